"""Decoder graphs on real-size presets (random weights, bf16): greedy tokens of graph replays
identical to `generate(do_sample=False)` and to the same runner's eager steps."""

import pytest
import torch

from encoder_graphs.decoder import DecoderGraphRunner
from encoder_graphs.models.presets import build_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NEW_TOKENS = 32
BATCH_GRIDS = [(1, 16, 16), (1, 24, 20), (1, 12, 28)]
SINGLE_GRID = [(1, 20, 20)]


@pytest.fixture(scope="module", params=["qwen2.5-vl-3b", "qwen2-vl-2b", "qwen3-vl-2b"])
def model(request):
    model = build_model(request.param, dtype=torch.bfloat16, device="cuda")
    yield model
    del model
    torch.cuda.empty_cache()


def make_batch(config, grids, seed=0):
    """Left-padded prompts: text, <vision_start>, image pads, <vision_end>, text."""
    rng = torch.Generator().manual_seed(seed)
    vision = config.vision_config
    prompts, pixels = [], []
    for i, (t, h, w) in enumerate(grids):
        before = torch.randint(1000, 100_000, (3 + i,), generator=rng).tolist()
        after = torch.randint(1000, 100_000, (4 + 3 * i,), generator=rng).tolist()
        image = [config.image_token_id] * (t * h * w // vision.spatial_merge_size**2)
        prompts.append(before + [config.vision_start_token_id, *image, config.vision_end_token_id] + after)
        patch = 3 * vision.temporal_patch_size * vision.patch_size**2
        pixels.append(torch.randn(t * h * w, patch, generator=rng))
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    return {
        "input_ids": input_ids.cuda(),
        "attention_mask": attention_mask.cuda(),
        "pixel_values": torch.cat(pixels).cuda().bfloat16(),
        "image_grid_thw": torch.tensor(grids).cuda(),
        "mm_token_type_ids": (input_ids == config.image_token_id).long().cuda(),
    }


def runner_generate(runner, inputs):
    inputs = dict(inputs)
    return runner.generate(
        inputs.pop("input_ids"), inputs.pop("attention_mask"), max_new_tokens=NEW_TOKENS, **inputs
    )


def divergence_report(model, inputs, got, expected) -> str:
    """Where graph tokens leave `generate`'s, the top-2 logit margin there, and whether they
    match `generate` over a static cache instead."""
    prompt_len = inputs["input_ids"].shape[1]
    with torch.inference_mode():
        hf = model.generate(
            **inputs,
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            output_scores=True,
            return_dict_in_generate=True,
        )
        static = model.generate(
            **inputs, do_sample=False, max_new_tokens=NEW_TOKENS, cache_implementation="static"
        )
    lines = [f"matches generate(cache_implementation='static'): {torch.equal(got, static)}"]
    width = min(got.shape[1], expected.shape[1])
    for row in range(got.shape[0]):
        differ = (got[row, :width] != expected[row, :width]).nonzero()
        if len(differ):
            step = int(differ[0]) - prompt_len
            top2 = hf.scores[step][row].float().topk(2).values
            lines.append(
                f"row {row}: first differs at new token {step}, generate's top-2 margin "
                f"{float(top2[0] - top2[1]):.4f}"
            )
    return "\n".join(lines)


def test_graph_greedy_matches_generate(model):
    runner = DecoderGraphRunner(model, max_batch_size=4, max_cache_len=1024)
    runner.capture()
    assert runner.stats()["captured_buckets"] == [1, 2, 4]
    for grids in (BATCH_GRIDS, SINGLE_GRID):
        inputs = make_batch(model.config, grids)
        with torch.inference_mode():
            expected = model.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS)
        got = runner_generate(runner, inputs)
        assert torch.equal(got, expected), divergence_report(model, inputs, got, expected)

    stats = runner.stats()
    assert stats["steps"] > 0 and stats["graph_steps"] == stats["steps"], stats
    assert set(stats["replays_per_bucket"]) == {1, 4}, stats
    assert stats["decode_ms_per_step"]["mean"] > 0
    print(runner.format_stats())


def test_graph_replay_matches_eager_steps(model):
    """Independent of bf16 near-ties with `generate`: the same step function, replayed or eager,
    over the same padded bucket (batch 3 in bucket 4) gives the same tokens."""
    inputs = make_batch(model.config, BATCH_GRIDS, seed=1)
    graphs = DecoderGraphRunner(model, max_batch_size=4, max_cache_len=1024)
    graphs.capture()
    eager = DecoderGraphRunner(model, max_batch_size=4, max_cache_len=1024, enabled=False)
    got = runner_generate(graphs, inputs)
    assert torch.equal(got, runner_generate(eager, inputs))
    assert graphs.stats()["graph_steps"] > 0
    assert eager.stats()["graph_steps"] == 0
