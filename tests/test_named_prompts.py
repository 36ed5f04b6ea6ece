"""Several named prompts per file in one pass, end to end on the CPU with tiny random models:
`--prompt NAME=TEXT` (repeatable) and a JSON `--prompt-file`, their usage errors, the records
(`captions` by name; `caption`, sidecar and metadata the first prompt's), and each prompt's
captions equal to a run with that prompt alone (greedy, fp32)."""

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from test_cli import lines_of
from transformers import Qwen2VLForConditionalGeneration

from encoder_graphs.app.cli import main
from encoder_graphs.app.config import CaptionConfig
from encoder_graphs.app.errors import UsageError
from encoder_graphs.app.media import LoadLimits
from encoder_graphs.app.outputs import Outputs, SidecarPolicy
from encoder_graphs.app.pipeline import Captioner
from encoder_graphs.app.prompt_batches import common_prefix
from encoder_graphs.app.prompts import read_prompts
from encoder_graphs.app.results import ResultsFile
from encoder_graphs.app.walk import discover
from encoder_graphs.models.qwen.inputs import QwenVLInputs
from encoder_graphs.presets.default_model import default_model_dir

PROMPTS = {"short": "Describe this in one sentence.", "tags": "List tags.", "long": "Describe every detail of it."}
RUN = ["--max-new-tokens", "8", "--quiet", "--batch-size", "2"]


@pytest.fixture(autouse=True)
def model_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ENCODER_GRAPHS_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def photos(folder: Path, count: int = 5) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        Image.new("RGB", (48 + 16 * index, 64), (40 * index, 90, 200 - 30 * index)).save(folder / f"p{index}.png")
    return folder


def test_prompt_flags_parse_to_one_unnamed_or_named_prompts(tmp_path):
    assert read_prompts(None, None) == (None, ())
    assert read_prompts("Describe it.", None) == ("Describe it.", ())
    assert read_prompts("Describe: style=photo", None) == ("Describe: style=photo", ())  # not a name before "="
    assert read_prompts(("a=One.", "b.2=Two = 2"), None) == (None, (("a", "One."), ("b.2", "Two = 2")))
    assert read_prompts("only=One.", None) == (None, (("only", "One."),))
    mapping = tmp_path / "prompts.json"
    mapping.write_text(json.dumps(PROMPTS))
    assert read_prompts(None, mapping) == (None, tuple(PROMPTS.items()))
    plain = tmp_path / "prompt.txt"
    plain.write_text('{"a": "b"}\n')  # not .json: a template as today
    assert read_prompts(None, plain) == ('{"a": "b"}', ())


@pytest.mark.parametrize(
    ("prompt", "file_text", "message"),
    [
        ("=x", None, "--prompt '=x': no name"),
        (("a=x", "a=y"), None, "--prompt: the prompt name 'a' is given twice"),
        (("a=x", "plain text"), None, "name each one"),
        (("a=x", "b= "), None, "the prompt 'b' is empty"),
        (None, '["x", "y"]', "object mapping names to prompts"),
        (None, '{"a": "x", "a": "y"}', "'a' is given twice"),
        (None, '{"a b": "x"}', "'a b' is not 1-64"),
        (None, '{"a": 3}', "object mapping names to prompts"),
        (None, "{not json", "not JSON"),
    ],
)
def test_bad_prompt_flags_are_usage_errors_naming_the_flag(tmp_path, prompt, file_text, message):
    path = None
    if file_text is not None:
        path = tmp_path / "prompts.json"
        path.write_text(file_text)
    with pytest.raises(UsageError, match=message.replace("(", r"\(")) as error:
        read_prompts(prompt, path)
    assert ("--prompt-file" if path else "--prompt") in str(error.value)


def test_a_bad_prompt_exits_2_before_any_model(tmp_path, capsys):
    photos(tmp_path / "in", 1)
    assert main(["caption", str(tmp_path / "in"), "--prompt", "=x", "--out", str(tmp_path / "o.jsonl")]) == 2
    assert "--prompt '=x'" in capsys.readouterr().err
    bad = ["--prompt", "short=One.", "--prompt", "tags=List \udcff tags."]  # a shell's bytes that are not UTF-8
    assert main(["caption", str(tmp_path / "in"), *bad, "--out", str(tmp_path / "o.jsonl")]) == 2
    assert "--prompt tags is not valid UTF-8" in capsys.readouterr().err


def test_common_prefix_leaves_each_row_a_token():
    assert common_prefix([[1, 2, 3, 4], [1, 2, 5]]) == 2
    assert common_prefix([[1, 2, 3], [1, 2, 3]]) == 2


@pytest.mark.parametrize("model", ["tiny-qwen2.5-vl", "tiny-internvl"])
def test_each_prompts_captions_equal_its_run_alone(tmp_path, model):
    """Three prompts in one pass (the image prefilled once per file: "shared prefix"), against
    three runs of one prompt each: the same captions, token counts and truncations."""
    folder = photos(tmp_path / "in")
    named, stats = tmp_path / "named.jsonl", tmp_path / "stats.json"
    argv = ["caption", str(folder), "--model", model, *RUN]
    flags = [f for name, text in PROMPTS.items() for f in ("--prompt", f"{name}={text}")]
    assert main([*argv, *flags, "--out", str(named), "--stats-json", str(stats), "--sidecar"]) == 0
    assert json.loads(stats.read_text())["pipeline"]["prompt_batches"] == {"shared prefix": 3}
    records = {r["relative_path"]: r for r in lines_of(named)}
    assert len(records) == 5
    for name, text in PROMPTS.items():
        alone = tmp_path / f"{name}.jsonl"
        assert main([*argv, "--prompt", text, "--out", str(alone)]) == 0
        for record in lines_of(alone):
            got = records[record["relative_path"]]
            assert got["captions"][name] == record["caption"], (name, record["relative_path"])
            assert (got["tokens"][name], got["truncated"][name]) == (record["tokens"], record["truncated"])
            assert got["prompt"][name] == text
    for record in records.values():  # the first prompt's caption is the record's, its sidecar's
        assert set(record["captions"]) == set(PROMPTS) and record["caption"] == record["captions"]["short"]
        assert (folder / record["relative_path"]).with_suffix(".txt").read_text() == record["texts"]["short"] + "\n"
    assert len({c for r in records.values() for c in r["captions"].values()}) > 5  # prompts lead apart


def test_a_prompt_file_mapping_and_a_rerun_with_other_prompts(tmp_path, capsys):
    """A JSON mapping is repeated `--prompt NAME=TEXT`; the named prompts are the run's identity:
    a rerun with other prompts is refused (the settings clash), with the same ones a no-op."""
    folder = photos(tmp_path / "in", 2)
    mapping, out = tmp_path / "prompts.json", tmp_path / "out.jsonl"
    mapping.write_text(json.dumps(PROMPTS))
    argv = ["caption", str(folder), "--model", "tiny-qwen2.5-vl", *RUN, "--out", str(out)]
    assert main([*argv, "--prompt-file", str(mapping)]) == 0
    first = lines_of(out)
    assert [list(r["captions"]) for r in first] == [list(PROMPTS)] * 2
    assert main([*argv, "--prompt-file", str(mapping)]) == 0 and lines_of(out) == first
    assert main([*argv, "--prompt", "a=Other.", "--prompt", "b=Else."]) == 2
    assert "--redo" in capsys.readouterr().err
    # The same prompts in another order: the first names `caption` and the sidecars, so it clashes too.
    flipped = [f for name, text in reversed(PROMPTS.items()) for f in ("--prompt", f"{name}={text}")]
    assert main([*argv, *flipped]) == 2


def test_a_checkpoint_setting_the_runner_lacks_runs_every_prompt_whole(tmp_path):
    """A checkpoint's `no_repeat_ngram_size` sends `generate` to its stock path, which applies it:
    named prompts then do not share (the runner would decode without it), each prompt runs whole,
    and its captions stay those of a run with that prompt alone."""
    from encoder_graphs.presets import build_model
    from encoder_graphs.presets.files import write_preset_files

    checkpoint = tmp_path / "model"
    model = build_model("tiny-qwen2.5-vl")
    model.generation_config.no_repeat_ngram_size = 2
    model.save_pretrained(checkpoint)
    write_preset_files("tiny-qwen2.5-vl", checkpoint)
    (checkpoint / "generation_config.json").write_text(model.generation_config.to_json_string())
    folder = photos(tmp_path / "in", 3)
    argv = ["caption", str(folder), "--model", str(checkpoint), *RUN]
    two = {name: PROMPTS[name] for name in ("short", "tags")}
    flags = [f for name, text in two.items() for f in ("--prompt", f"{name}={text}")]
    named, stats = tmp_path / "named.jsonl", tmp_path / "stats.json"
    assert main([*argv, *flags, "--out", str(named), "--stats-json", str(stats)]) == 0
    assert json.loads(stats.read_text())["pipeline"]["prompt_batches"] == {"whole prompts": 2}
    records = {r["relative_path"]: r for r in lines_of(named)}
    for name, text in two.items():
        alone = tmp_path / f"{name}.jsonl"
        assert main([*argv, "--prompt", text, "--out", str(alone)]) == 0
        assert all(records[r["relative_path"]]["captions"][name] == r["caption"] for r in lines_of(alone))


OUT_OF_MEMORY = "CUDA out of memory. Tried to allocate 20.00 GiB"


class RowBoundInputs(QwenVLInputs):
    """The real inputs, whose move to the device runs out of memory past `rows` rows, as a small
    device would (test_cli_usage's seam of a CUDA OOM, without a stand-in for torch or the model)."""

    rows = 1

    def to_model(self, collated, device, dtype):
        if collated["input_ids"].shape[0] > self.rows:
            raise torch.OutOfMemoryError(OUT_OF_MEMORY)
        return super().to_model(collated, device, dtype)


def bound_shared_rows(decoder, rows: int) -> None:
    """The runner's shared-prefix generation out of memory past `rows` rows: its inputs hold a row
    a file, its rows are the files' prompts (the same seam, one step on)."""
    real = decoder.generate_shared

    def generate_shared(ids, mask, shared, **settings):
        if shared.rows > rows:
            raise torch.OutOfMemoryError(OUT_OF_MEMORY)
        return real(ids, mask, shared, **settings)

    decoder.generate_shared = generate_shared


@pytest.mark.parametrize(
    ("rows", "graphs", "sampling"),
    [(1, False, {}), (1, True, {}), (1, True, {"temperature": 1.0, "seed": 7}), (0, False, {})],
    ids=["whole prompts", "shared prefix", "shared prefix, sampled", "no prompt fits"],
)
def test_a_file_whose_prompts_run_out_of_memory_together_is_captioned_a_prompt_at_a_time(
    tmp_path, rows, graphs, sampling
):
    """A batch of one file is three rows with three prompts: out of memory, its prompts are tried
    apart, and its record holds the captions of an undisturbed run (sampled: each row drawing
    from the file's seed); an error record only where a prompt alone does not fit (before, any
    OOM of the file's rows was its error record)."""
    from encoder_graphs import enable_cuda_graphs

    folder = photos(tmp_path / "in", 1)
    model = Qwen2VLForConditionalGeneration.from_pretrained(default_model_dir()).eval()
    handle = enable_cuda_graphs(model) if graphs else None  # on the CPU: the runner's eager step
    config = CaptionConfig(named=tuple(PROMPTS.items()), max_new_tokens=8, batch_size=1, **sampling)
    RowBoundInputs.rows = rows

    def run(inputs: QwenVLInputs, out: Path) -> tuple[dict, object]:
        with ResultsFile(out) as results:
            stats = Captioner(model, inputs, config, LoadLimits()).run(discover([folder]), Outputs(results, SidecarPolicy()))
        (record,) = lines_of(out)
        return record, stats

    undisturbed, whole = run(QwenVLInputs.from_pretrained(default_model_dir()), tmp_path / "whole.jsonl")
    if handle is not None:
        bound_shared_rows(handle.decoder, rows)
    record, stats = run(RowBoundInputs.from_pretrained(default_model_dir()), tmp_path / "apart.jsonl")
    if handle is not None:
        handle.disable()
    if rows == 0:
        assert record["error_kind"] == "out_of_memory" and stats.failed == 1
        return
    assert whole.failed == stats.failed == 0 and stats.retried_batches >= 1
    assert set(stats.prompt_batches) == {"shared prefix" if graphs else "whole prompts"}
    for field in ("caption", "captions", "texts", "tokens", "truncated", "prompt"):
        assert record[field] == undisturbed[field], field


@pytest.mark.parametrize("max_batch", [8, 1], ids=["the runner's", "over its batch: generate's"])
def test_the_captioner_calls_the_decoder_runner_itself_and_generate_only_for_what_it_cannot_hold(
    tmp_path, monkeypatch, max_batch
):
    """With graphs enabled the command's batches go to the decoder runner directly (the patched
    `generate` is for library users): here it is made to raise, so any batch routed through it
    fails. A batch over the runner's static cache goes to `generate`, which counts why. Either way
    fp32 greedy captions equal a run without graphs."""
    from encoder_graphs import enable_cuda_graphs
    from encoder_graphs.options import GraphOptions

    folder = photos(tmp_path / "in", 4)
    model = Qwen2VLForConditionalGeneration.from_pretrained(default_model_dir()).eval()
    inputs = QwenVLInputs.from_pretrained(default_model_dir())
    config = CaptionConfig(max_new_tokens=8, batch_size=2)

    def run(out: Path) -> list[dict]:
        with ResultsFile(out) as results:
            stats = Captioner(model, inputs, config, LoadLimits()).run(discover([folder]), Outputs(results, SidecarPolicy()))
        assert stats.failed == 0
        return sorted(lines_of(out), key=lambda r: r["path"])

    stock = run(tmp_path / "stock.jsonl")
    handle = enable_cuda_graphs(model, GraphOptions(decoder_max_batch_size=max_batch))  # on the CPU: the eager step
    patched = model.generate

    def not_through_generate(*args, **kwargs):
        if max_batch > 1:
            raise AssertionError("a batch the runner holds went through model.generate")
        return patched(*args, **kwargs)

    monkeypatch.setattr(model, "generate", not_through_generate)
    try:
        graphed = run(tmp_path / "graphed.jsonl")
        stats = handle.stats()
    finally:
        monkeypatch.undo()
        handle.disable()
    assert [r["tokens"] for r in graphed] == [r["tokens"] for r in stock]
    if max_batch > 1:
        assert stats["decoder"]["calls"] == 2 and not stats["generate_fallbacks"]
    else:
        assert stats["decoder"]["calls"] == 0 and sum(stats["generate_fallbacks"].values()) == 2
        assert "max_batch_size" in next(iter(stats["generate_fallbacks"]))
