"""Several prompts per item over one shared prefill on a GPU, the decode steps replayed from
graphs: fp32, each row's tokens identical to the runner over that prompt alone (the CPU tests'
equality: `test_shared_prompts.py`), and the caption command's named prompts in bf16 equal to
its single-prompt runs."""

import json

import pytest
import torch
from test_named_prompts import PROMPTS, photos
from test_shared_prompts import ITEMS, NEW_TOKENS, NO_EOS, left_padded, prompts_of

from encoder_graphs.app.cli import main
from encoder_graphs.decoder.runner import DecoderGraphRunner
from encoder_graphs.decoder.shared import SharedPrompts
from encoder_graphs.presets import build_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def on_device(values):
    return [v.cuda() if isinstance(v, torch.Tensor) else v for v in values]


@pytest.mark.parametrize("preset", ["tiny-qwen2.5-vl", "tiny-qwen3.5", "tiny-internvl"])
def test_fp32_tokens_identical_to_each_prompt_alone_through_graphs(preset):
    model = build_model(preset).cuda().eval()
    config = model.config
    rng = torch.Generator().manual_seed(1)
    items = ITEMS["internvl" if config.model_type == "internvl" else "qwen"]
    prefixes, suffixes, pixels = prompts_of(config, items, (3, 6, 6), rng)
    runner = DecoderGraphRunner(model, max_batch_size=8, max_cache_len=256)
    runner.capture()
    alone = []
    for suffix in suffixes:
        ids, mask, inputs = left_padded(config, [prefix + suffix for prefix in prefixes], pixels)
        inputs = {k: v.cuda() for k, v in inputs.items()}
        out = runner.generate(ids.cuda(), mask.cuda(), max_new_tokens=NEW_TOKENS, eos_token_id=NO_EOS, **inputs)
        alone.append(out[:, ids.shape[1]:])
    ids, mask, inputs = left_padded(config, prefixes, pixels)
    shared = SharedPrompts(items=(0, 0, 0, 1, 1, 1), suffixes=tuple(tuple(s) for _ in items for s in suffixes))
    got = runner.generate_shared(ids.cuda(), mask.cuda(), shared, max_new_tokens=NEW_TOKENS, eos_token_id=NO_EOS,
                                 **{k: v.cuda() for k, v in inputs.items()})
    for row, (item, prompt) in enumerate((i, p) for i in range(2) for p in range(3)):
        assert torch.equal(got[row], alone[prompt][item]), f"item {item}, prompt {prompt}"
    assert runner.stats()["graph_steps"] > 0 and runner.stats()["eager_steps"] == 0
    runner.close()


def test_the_command_s_named_prompts_equal_its_single_prompt_runs_in_bf16(tmp_path, monkeypatch):
    monkeypatch.setenv("ENCODER_GRAPHS_CACHE", str(tmp_path / "cache"))
    folder = photos(tmp_path / "in", 8)
    argv = ["caption", str(folder), "--model", "tiny-qwen2.5-vl", "--device", "cuda", "--max-new-tokens", "16",
            "--quiet", "--batch-size", "4"]
    named, stats = tmp_path / "named.jsonl", tmp_path / "stats.json"
    flags = [f for name, text in PROMPTS.items() for f in ("--prompt", f"{name}={text}")]
    assert main([*argv, *flags, "--out", str(named), "--stats-json", str(stats)]) == 0
    assert json.loads(stats.read_text())["pipeline"]["prompt_batches"] == {"shared prefix": 2}
    records = {r["relative_path"]: r for r in map(json.loads, named.read_text().splitlines())}
    same = total = 0
    for name, text in PROMPTS.items():
        alone = tmp_path / f"{name}.jsonl"
        assert main([*argv, "--prompt", text, "--out", str(alone)]) == 0
        for record in map(json.loads, alone.read_text().splitlines()):
            same += records[record["relative_path"]]["captions"][name] == record["caption"]
            total += 1
    # bf16: a shared prefill is another sum order than a whole one, so a near tie can flip a token
    # and the caption drifts from there (design.md); the fp32 test above holds the tokens equal.
    assert total == 8 * len(PROMPTS) and same >= 0.75 * total, f"{same} of {total} captions equal"
