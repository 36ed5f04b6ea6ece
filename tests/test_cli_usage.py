"""The caption command's flags as a careful user meets them (issue 25, items 6 and 18-22): usage
errors before the model loads, naming the flag; no flag ignored silently; seeds per file; out of
memory split off from a file's own failure; --samples outputs; readable messages. CPU, the
embedded tiny model."""

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from PIL import Image
from test_cli import model_cache  # noqa: F401 (autouse: a private model cache for this module)
from test_dataset_tool import FAST, images, records
from test_media import write_video
from transformers import Qwen2VLForConditionalGeneration

from encoder_graphs.app import loading
from encoder_graphs.app.cli import build_parser, main
from encoder_graphs.app.config import CaptionConfig
from encoder_graphs.app.media import SAMPLES_DIR, LoadLimits, MediaError
from encoder_graphs.app.outputs import Outputs, SidecarPolicy
from encoder_graphs.app.pipeline import Captioner, load
from encoder_graphs.app.results import ResultsFile
from encoder_graphs.app.sizing import RESERVE_BYTES, batch_size_for, model_sizes, sequence_memory
from encoder_graphs.app.walk import MediaFile, discover
from encoder_graphs.models.qwen.inputs import QwenVLInputs
from encoder_graphs.presets import PRESETS, get_config
from encoder_graphs.presets.default_model import default_model_dir


@pytest.fixture
def no_model(monkeypatch):
    """The model's weights must not load: every case is a usage error found before."""
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("the model loaded"))


# ----- 18: usage errors found before the model loads, naming the right flag ---------------------
def test_lengths_and_backends_are_usage_errors_before_the_model_loads(tmp_path, no_model, capsys):
    images(tmp_path / "data", 1)
    write_video(tmp_path / "data" / "clip.mp4", frames=4)
    (tmp_path / "long.txt").write_text("Describe the picture in great detail please. " * 300)
    base = ["caption", str(tmp_path / "data"), "--out", str(tmp_path / "r.jsonl"), "--quiet"]
    cases = {
        "--max-new-tokens 1000": ["--max-new-tokens", "1000"],
        "--attn-backend bogus": ["--attn-backend", "bogus"],
        "--max-frames 1000": ["--max-frames", "1000"],
        f"--prompt-file {tmp_path / 'long.txt'}": ["--prompt-file", str(tmp_path / "long.txt")],
    }
    for flag, extra in cases.items():
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err
        assert f"error: {flag}" in err, err
        if "--max-new-tokens" not in flag:
            assert "--max-new-tokens" not in err, err
    assert main(base + ["--max-new-tokens", "1000"]) == 2
    assert "at most" in capsys.readouterr().err  # says what is allowed
    assert not (tmp_path / "r.jsonl").exists()


# ----- 20: flags that would be ignored silently ----------------------------------------------------
def test_flags_that_would_be_ignored_are_usage_errors(tmp_path, no_model, capsys):
    images(tmp_path / "data", 1)
    (tmp_path / "p.txt").write_text("Describe.")
    base = ["caption", str(tmp_path / "data"), "--out", str(tmp_path / "r.jsonl")] + FAST
    cases = [
        ("--overwrite", ["--overwrite"]),
        ("--sidecar-ext", ["--sidecar-ext", ".cap"]),
        ("--top-p", ["--top-p", "0.9"]),
        ("--seed", ["--seed", "3"]),
        ("--seed", ["--temperature", "0", "--seed", "3"]),
        ("--temperature", ["--temperature", "inf"]),
        ("--temperature", ["--temperature", "nan"]),
        ("--prompt-file", ["--prompt", "Hi.", "--prompt-file", str(tmp_path / "p.txt")]),
        ("--top-p", ["--temperature", "1", "--top-p", "0"]),  # named as the flag, not top_p
    ]
    for flag, extra in cases:
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err
        assert flag in err and "top_p" not in err, (extra, err)
    assert not (tmp_path / "r.jsonl").exists()


def test_the_flags_of_sampling_and_sidecars_parse_when_given_together():
    args = build_parser().parse_args(
        ["caption", "x", "--temperature", "0.7", "--top-p", "0.9", "--seed", "1", "--sidecar", "--sidecar-ext", ".cap"]
    )
    assert (args.temperature, args.top_p, args.seed, args.sidecar_ext) == (0.7, 0.9, 1, ".cap")


# ----- 19: a sampled caption depends on the seed and the file only -------------------------------
def test_seeded_captions_do_not_depend_on_the_batch_or_the_other_files(tmp_path):
    images(tmp_path / "data", 3)
    sample = ["--temperature", "1.5", "--seed", "11", "--max-new-tokens", "8", "--quiet"]

    def captions(root: Path, out: str, *extra: str) -> dict[str, str]:
        assert main(["caption", str(root), "--out", str(tmp_path / out), *sample, *extra]) == 0
        return {r["relative_path"]: r["caption"] for r in records(tmp_path / out)}

    together = captions(tmp_path / "data", "together.jsonl", "--batch-size", "3")
    # A resumed run: two files done before the "kill", the third captioned alone.
    (tmp_path / "resumed.jsonl").write_text("".join(
        line for line in (tmp_path / "together.jsonl").read_text().splitlines(keepends=True)
        if '"img02.png"' not in line
    ))
    resumed = captions(tmp_path / "data", "resumed.jsonl", "--batch-size", "1")
    assert resumed == together
    shutil.copytree(tmp_path / "data", tmp_path / "more")
    images(tmp_path / "more", 2, prefix="extra")
    more = captions(tmp_path / "more", "more.jsonl", "--batch-size", "3")
    assert {name: more[name] for name in together} == together
    other_seed = captions(tmp_path / "data", "other.jsonl", "--batch-size", "3", "--seed", "12")
    assert other_seed != together


# ----- 6: out of memory is not the file's fault --------------------------------------------------
class MemoryBoundInputs(QwenVLInputs):
    """The real inputs, whose move to the device runs out of memory as a small device would: past
    2 prompts, or for an image of more than 100 patches even alone. The seam a CUDA OOM comes
    through (the pixels' copy to the device), without a stand-in for torch or the model."""

    def to_model(self, collated, device, dtype):
        if collated["input_ids"].shape[0] > 2 or int(collated["image_grid_thw"].prod(1).max()) > 100:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return super().to_model(collated, device, dtype)


def test_out_of_memory_splits_the_batch_and_fails_only_a_file_that_fails_alone(tmp_path):
    paths = images(tmp_path / "data", 5)
    Image.new("RGB", (224, 224), (9, 9, 9)).save(paths[3])  # 256 patches: too large even alone
    inputs = MemoryBoundInputs.from_pretrained(default_model_dir())
    model = Qwen2VLForConditionalGeneration.from_pretrained(default_model_dir()).eval()
    captioner = Captioner(model, inputs, CaptionConfig(max_new_tokens=2, batch_size=5), LoadLimits())
    with ResultsFile(tmp_path / "r.jsonl") as results:
        stats = captioner.run(discover([tmp_path / "data"]), Outputs(results, SidecarPolicy()))
    by_path = {r["path"]: r for r in records(tmp_path / "r.jsonl")}
    assert len(by_path) == 5 and set(by_path) == {str(p) for p in paths}
    assert [p.name for p in paths if "error" in by_path[str(p)]] == ["img03.png"]
    failed = by_path[str(paths[3])]
    assert failed["error_kind"] == "out_of_memory" and "out of memory" in failed["error"]
    assert stats.succeeded == 4 and stats.failed == 1 and stats.retried_batches >= 2
    assert all(r["timings"]["batch_size"] <= 2 for r in by_path.values() if "caption" in r)


def test_a_huge_batch_size_is_capped_by_what_the_cache_can_hold():
    """The cap `--batch-size N` gets on a GPU (sizing.fitting_batch_sizes; the GPU test below runs
    it): the most sequences whose memory fits, not rounded to the auto size's multiples of 8."""
    sizes = model_sizes(get_config("qwen2.5-vl-7b"), 2)
    per_sequence = sequence_memory(sizes, 2048, 2000)
    usable = 60 * 2**30
    capped = batch_size_for(RESERVE_BYTES + usable, per_sequence, most=1_000_000, multiple=1)
    assert capped * per_sequence.peak <= usable < (capped + 1) * per_sequence.peak
    assert capped % 8 and batch_size_for(RESERVE_BYTES + usable, per_sequence, most=1_000_000) == capped - capped % 8
    assert batch_size_for(RESERVE_BYTES + usable, per_sequence, most=3, multiple=1) == 3  # a small request stands


def test_photos_and_videos_get_their_own_batches_beside_one_cache():
    """`batch_sizes_for`: photos are not batched by a clip's prompt; each kind's prefill fits
    beside the one cache whose rows the largest batch takes, at the longest sequence; a kind is
    batched by no more files than it has, and a job of clips alone holds no rows for photos."""
    from encoder_graphs.app.sizing import batch_sizes_for

    sizes = model_sizes(get_config("qwen2.5-vl-3b"), 2)
    free, longest, prompts = RESERVE_BYTES + 20 * 2**30, 6200, {"image": 1300, "video": 6168}
    unbounded = {"image": 10**6, "video": 10**6}
    batches = batch_sizes_for(free, sizes, longest, prompts, unbounded, multiple=1)
    alone = {kind: batch_size_for(free, sequence_memory(sizes, longest, p), 10**6, 1) for kind, p in prompts.items()}
    assert batches["image"] == alone["image"] > 2 * batches["video"]
    resident = sequence_memory(sizes, longest, 1).resident
    for kind, prompt in prompts.items():  # what a batch of each kind holds at its peak fits
        peak = batches["image"] * resident + batches[kind] * sequence_memory(sizes, longest, prompt).prefill
        assert peak <= free - RESERVE_BYTES
    assert batches["video"] < alone["video"]  # the photos' rows of the cache stay allocated
    few_photos = batch_sizes_for(free, sizes, longest, prompts, {"image": 3, "video": 10**6}, multiple=1)
    assert few_photos == {"image": 3, "video": alone["video"]}  # 3 photo rows take nothing from the clips
    assert batch_sizes_for(free, sizes, longest, {"video": 6168}, {"video": 10**6}, 1) == {"video": alone["video"]}
    assert batch_sizes_for(free, sizes, 1400, {"image": 1300}, {"image": 64}) == {"image": 64}


def test_video_flags_parse_into_the_settings():
    from encoder_graphs.app.settings import Settings

    flags = ["caption", "x", "--video-fps", "2", "--max-frame-tokens", "model", "--video-timeout", "30"]
    settings = Settings.from_arguments(build_parser().parse_args(flags))
    assert (settings.video_fps, settings.max_frame_tokens, settings.video_timeout) == (2.0, None, 30.0)
    assert Settings.from_arguments(build_parser().parse_args(["caption", "x"])).max_frame_tokens == 256
    for bad in (["--video-fps", "0"], ["--video-timeout", "-1"], ["--max-frame-tokens", "0"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["caption", "x", *bad])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_seeded_sampling_on_cuda_replays_the_decoder_graphs_and_repeats(tmp_path):
    """Per-file generators on the device, sampling outside the graphs: the decode steps replay
    graphs, nothing goes to stock generate, the same command gives the same captions."""
    images(tmp_path / "data", 3)
    runs = []
    for name in ("a", "b"):
        out, stats = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.json"
        argv = ["caption", str(tmp_path / "data"), "--out", str(out), "--stats-json", str(stats), "--device", "cuda"]
        assert main(argv + ["--temperature", "1.5", "--seed", "5", "--max-new-tokens", "8", "--quiet"]) == 0
        runs.append(({r["path"]: r["caption"] for r in records(out)}, json.loads(stats.read_text())))
    assert runs[0][0] == runs[1][0]
    graph_stats = runs[0][1]
    assert graph_stats["decoder"]["graph_steps"] > 0 and graph_stats["generate_fallbacks"] == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_huge_batch_size_on_cuda_is_capped_and_every_file_captioned(tmp_path, capsys):
    """Issue 25 item 6 as reported: `--batch-size 1000000` failed every file out of memory. A
    Qwen2.5-VL-3B-size model at its own resolution (16,384 tokens an image) holds ~20 such
    sequences in an 80 GB card: the batch is capped before anything runs, and no file fails."""
    images(tmp_path / "data", 64)
    out = tmp_path / "r.jsonl"
    argv = ["caption", str(tmp_path / "data"), "--out", str(out), "--model", "qwen2.5-vl-3b", "--device", "cuda"]
    argv += ["--max-image-tokens", "model", "--batch-size", "1000000", "--max-new-tokens", "2", "--quiet"]
    assert main(argv) == 0
    assert "--batch-size 1000000 capped to" in capsys.readouterr().err
    assert all("caption" in r for r in records(out)) and len(records(out)) == 64


# ----- 21: --samples, --stats-json with nothing to do, presets in --help ---------------------------
def test_samples_alone_print_their_captions_and_leave_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    package = sorted(SAMPLES_DIR.iterdir())
    for _ in range(2):  # a second run captions them again
        assert main(["caption", "--samples"] + FAST) == 0
        captured = capsys.readouterr()
        shown = [line for line in captured.out.splitlines() if line.split(":")[0] in {p.name for p in package}]
        assert len(shown) == len(package) and all(len(line.split(": ", 1)) == 2 for line in shown)
        assert "not kept; give --out FILE" in captured.err
    assert list(tmp_path.iterdir()) == [tmp_path / "tmp"] and not list((tmp_path / "tmp").iterdir()), "nothing left"
    for flag in ("--sidecar", "--hf-metadata"):
        assert main(["caption", "--samples", flag] + FAST) == 2
        assert flag in capsys.readouterr().err
    assert sorted(SAMPLES_DIR.iterdir()) == package and not list((tmp_path / "tmp").iterdir())


def test_a_demo_dry_run_reads_no_captions_jsonl_here_and_odd_hub_ids_are_usage_errors(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    Path("captions.jsonl").write_text("my notes\n")
    assert main(["caption", "--samples", "--dry-run"]) == 0
    assert "0 in --out already" in capsys.readouterr().out and Path("captions.jsonl").read_text() == "my notes\n"
    for name in ("my--org/model", "a/b..c"):
        assert main(["caption", "--samples", "--model", name, "--out", str(tmp_path / "r.jsonl")] + FAST) == 2
        err = capsys.readouterr().err
        assert f"--model {name}: neither a checkpoint directory" in err and "Traceback" not in err


def test_stats_json_is_written_when_there_is_nothing_to_do(tmp_path, no_model):
    (path,) = images(tmp_path / "data", 1)
    out, stats = tmp_path / "r.jsonl", tmp_path / "stats.json"
    with ResultsFile(out) as results:
        results.append([{"path": str(path), "caption": "x", "text": "x"}])
    assert main(["caption", str(tmp_path / "data"), "--out", str(out), "--stats-json", str(stats)] + FAST) == 0
    pipeline = json.loads(stats.read_text())["pipeline"]
    assert (pipeline["files"], pipeline["skipped"], pipeline["succeeded"]) == (1, 1, 0)


def test_help_lists_the_presets_and_reads_well(capsys):
    assert main(["--help"]) == 0
    top = capsys.readouterr().out
    assert not any(line.rstrip().endswith(",") for line in top.splitlines()), top
    assert main(["caption", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert all(name in text for name in PRESETS), text
    compile_help = text[text.index("--compile, --no-compile") :]  # the last flag: its help to the end
    assert "decode step" in compile_help  # what --compile compiles now, the decoder included


@pytest.mark.torchvision
def test_the_readme_api_example_builds_inputs_with_the_processor_and_runs(tmp_path, capsys):
    """The README's example as written (the default tiny checkpoint, two images; the CPU without
    CUDA): the official processor's inputs reach the graphs, no call goes to stock generate."""
    pytest.importorskip("torchvision")
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    (code,) = [block for block in re.findall(r"```python\n(.*?)```", readme, re.S) if "AutoProcessor" in block]
    names = []
    for index in range(2):
        names.append(str(tmp_path / f"{index}.jpg"))
        Image.new("RGB", (64 + 32 * index, 64), (90 * index, 40, 200)).save(names[-1])
    code = code.replace('"/models/Qwen2.5-VL-3B-Instruct"', repr(str(default_model_dir())))
    code = code.replace('("a.jpg", "b.jpg")', repr(tuple(names)))
    if not torch.cuda.is_available():
        code = code.replace('"cuda"', '"cpu"')
    namespace = {}
    exec(code, namespace)  # noqa: S102
    assert len(namespace["captions"]) == 2
    assert "generate calls sent to stock generate: none" in capsys.readouterr().out


# ----- 22: messages ------------------------------------------------------------------------------
def test_a_single_sidecar_clash_has_no_zero_more(tmp_path, no_model, capsys):
    images(tmp_path / "data", 1, prefix="a")
    Image.new("RGB", (40, 40)).save(tmp_path / "data" / "a00.jpg")
    argv = ["caption", str(tmp_path / "data"), "--out", str(tmp_path / "r.jsonl"), "--sidecar"] + FAST
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "a00.jpg and a00.png" in err and "more pair" not in err
    Image.new("RGB", (40, 40)).save(tmp_path / "data" / "a00.bmp")
    assert main(argv) == 2
    assert "(and 1 more pair)" in capsys.readouterr().err


def test_permission_denied_is_said_once(tmp_path):
    (path,) = images(tmp_path, 1)
    path.chmod(0)
    Image.init()  # every PIL plugin imported before the effective user changes
    as_root = os.geteuid() == 0
    if as_root:  # root reads anything: read as nobody (the real user stays root, to switch back)
        os.seteuid(65534)
    try:
        with pytest.raises(MediaError) as error:
            load(MediaFile(path, "image"), LoadLimits())
    finally:
        if as_root:
            os.seteuid(0)
    assert error.value.kind == "unreadable"
    assert str(error.value).lower().count("permission denied") == 1, str(error.value)


def test_graphs_turned_off_are_reported_plainly(tmp_path, capsys):
    images(tmp_path / "data", 1)
    assert main(["caption", str(tmp_path / "data"), "--out", str(tmp_path / "r.jsonl"), "--no-graphs"] + FAST) == 0
    out = capsys.readouterr().out
    assert "encoder graphs: off (--no-graphs); calls" in out and "enabled=False" not in out
    assert "disabled (enabled=False)" not in out


def test_names_with_terminal_escapes_are_printed_escaped(tmp_path, no_model, capsys):
    hostile = tmp_path / "x\x1b]0;owned\x07\x1b[2J"
    hostile.mkdir()
    assert main(["caption", str(hostile), "--out", str(tmp_path / "r.jsonl")] + FAST) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err
    assert "x\\x1b]0;owned\\x07\\x1b[2J" in err


def test_the_settings_are_the_parsed_flags_frozen_with_the_same_defaults():
    """One settings object from the arguments: its defaults are the parser's (a flag added to one
    and not the other fails here), it cannot change after the start, it refuses ignored flags."""
    from dataclasses import FrozenInstanceError, fields

    from encoder_graphs.app.errors import UsageError
    from encoder_graphs.app.settings import Settings

    arguments = build_parser().parse_args(["caption", "x"])
    assert set(vars(arguments)) - {"command"} == {field.name for field in fields(Settings)}
    parsed = Settings.from_arguments(arguments)
    assert parsed == Settings(paths=("x",))
    flags = ["caption", "a", "b", "--budgets", "64,16", "--max-image-tokens", "model", "--no-graphs", "--batch-size", "4"]
    settings = Settings.from_arguments(build_parser().parse_args(flags))
    assert (settings.paths, settings.budgets, settings.max_image_tokens) == (("a", "b"), (16, 64), None)
    assert settings.no_graphs and settings.batch_size == 4
    with pytest.raises(FrozenInstanceError):
        settings.out = Path("elsewhere.jsonl")
    with pytest.raises(UsageError, match="--seed applies to sampling"):
        Settings(seed=3)


def test_flags_of_another_family_and_other_formats_are_usage_errors(tmp_path, no_model, capsys):
    """A resolution flag the model's family does not read, and an --out named for a format the
    results are not written in, are refused by name before the model loads (issue 41: ignored)."""
    images(tmp_path / "data", 1)
    base = ["caption", str(tmp_path / "data"), "--out", str(tmp_path / "r.jsonl")] + FAST
    cases = [
        (["--max-tiles", "4"], "--max-tiles does not apply to the embedded tiny default"),
        (["--model", "tiny-internvl", "--max-image-tokens", "256"], "--max-image-tokens does not apply to tiny-internvl"),
        (["--model", "tiny-internvl", "--max-frame-tokens", "model"], "--max-frame-tokens does not apply"),
        (["--model", "tiny-deepseek-ocr-2", "--max-image-tokens", "model"], "its resolution flags: --max-tiles"),
        (["--out", str(tmp_path / "captions.parquet")], "written as JSON lines, not parquet; name it .jsonl"),
    ]
    for extra, message in cases:
        assert main(base + extra) == 2, extra
        assert message in capsys.readouterr().err, extra
    assert not (tmp_path / "r.jsonl").exists() and not (tmp_path / "captions.parquet").exists()


def test_messages_say_what_to_do(tmp_path, no_model, capsys):
    """--hf-metadata over files alone, a token cap below the smallest image, and a prompt with
    literal braces: each refused with what to do (issue 41, case 10)."""
    images(tmp_path / "data", 1)
    photo = next((tmp_path / "data").iterdir())
    base = ["caption", "--out", str(tmp_path / "r.jsonl")] + FAST
    cases = [
        ([str(photo), "--hf-metadata"], "only files were named: name their folder instead"),
        ([str(photo), "--max-image-tokens", "3"], "--max-image-tokens 3 is below the 4 tokens"),
        ([str(photo), "--max-frame-tokens", "1"], "--max-frame-tokens 1 is below the 4 tokens"),
        ([str(photo), "--prompt", "Describe {this}."], "write {{ and }} for literal braces"),
    ]
    for extra, message in cases:
        assert main(base + extra) == 2, extra
        assert message in capsys.readouterr().err, extra
    assert not (tmp_path / "r.jsonl").exists()


def test_the_report_reads_as_english():
    """No "0 retried in parts", no "1 batches", no sidecar count where none were asked for (issue
    41, case 14; "stock generate: none", not "-": the CPU runs' tests)."""
    from encoder_graphs.app.runstats import RunStats
    from encoder_graphs.report import format_run_stats, plural

    stats = RunStats(files=1, succeeded=1, batches=1, wall_s=1.0).as_dict()
    text = format_run_stats(stats)
    assert "1 batch)" in text and "retried" not in text and "sidecars" not in text
    assert format_run_stats({**stats, "batches": 3, "retried_batches": 1}).count("3 batches, 1 retried in parts") == 1
    assert "sidecars written: 1" in format_run_stats({**stats, "sidecars": 1})
    assert [plural(n, "batch") for n in (0, 1, 2)] == ["0 batches", "1 batch", "2 batches"]
