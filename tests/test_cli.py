"""The captioning command end to end on the embedded tiny model (CPU): bad inputs, resume after a
kill, exit codes, statistics; plus the default model cache and the input builder."""

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_media import write_video, write_zoo
from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

from encoder_graphs.app.cli import build_parser, main
from encoder_graphs.app.config import DEFAULT_IMAGE_TOKENS, CaptionConfig
from encoder_graphs.app.media import SAMPLES_DIR, LoadLimits
from encoder_graphs.app.model_checks import longest_sequence
from encoder_graphs.app.pipeline import Captioner, Pending, RunStats
from encoder_graphs.app.results import ResultsFile, read_records
from encoder_graphs.app.walk import discover
from encoder_graphs.models.qwen.inputs import QwenVLInputs
from encoder_graphs.presets import build_model
from encoder_graphs.presets.default_model import SPECIAL_TOKENS, default_model_dir
from encoder_graphs.presets.files import write_preset_files

FAST = ["--max-new-tokens", "3", "--quiet"]


@pytest.fixture(scope="module", autouse=True)
def model_cache(tmp_path_factory):
    """A private cache, so the tests build the default model themselves (and subprocesses inherit it)."""
    cache = tmp_path_factory.mktemp("cache")
    previous = os.environ.get("ENCODER_GRAPHS_CACHE")
    os.environ["ENCODER_GRAPHS_CACHE"] = str(cache)
    yield cache
    if previous is None:
        del os.environ["ENCODER_GRAPHS_CACHE"]
    else:
        os.environ["ENCODER_GRAPHS_CACHE"] = previous


def lines_of(path: Path) -> list[dict]:
    text = path.read_text()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def good_images(folder: Path, count: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        Image.new("RGB", (40 + 8 * index, 56), (30 * index, 80, 160)).save(folder / f"img{index:02d}.png")


def test_default_model_is_cached_atomically_and_loads_with_from_pretrained(model_cache):
    directory = default_model_dir()
    assert directory.parent == model_cache
    stamp = (directory / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir() == directory
    assert (directory / "model.safetensors").stat().st_mtime_ns == stamp, "second call must reuse the cache"
    assert [p.name for p in model_cache.iterdir()] == [directory.name], "no staging directory left behind"
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = Qwen2VLForConditionalGeneration.from_pretrained(directory, use_safetensors=True, trust_remote_code=False)
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == model.config.image_token_id
    assert tokenizer.convert_tokens_to_ids("<|video_pad|>") == model.config.video_token_id
    assert tokenizer.convert_tokens_to_ids("<|vision_start|>") == model.config.vision_start_token_id
    assert tokenizer.eos_token_id == model.generation_config.eos_token_id == SPECIAL_TOKENS["<|im_end|>"]
    assert len(tokenizer) <= model.config.text_config.vocab_size
    text = "A caption, with punctuation & digits 123."
    assert tokenizer.decode(tokenizer(text).input_ids) == text


def test_a_broken_model_cache_is_rebuilt_or_named(tmp_path, monkeypatch, capsys):
    """The default model's cache damaged (weights cut short, config gone) is built again; a
    checkpoint the user names with cut weights, and a cache folder that cannot be written, are
    one-line errors naming the folder and what to do, not tracebacks (issue 41, case 9)."""
    import shutil

    from encoder_graphs.presets.default_model import default_model_dir

    monkeypatch.setenv("ENCODER_GRAPHS_CACHE", str(tmp_path / "cache"))
    good_images(tmp_path / "media", 1)
    argv = ["caption", str(tmp_path / "media"), "--quiet", "--max-new-tokens", "2"]
    built = default_model_dir()
    os.truncate(built / "model.safetensors", 1000)
    assert main(argv + ["--out", str(tmp_path / "a.jsonl")]) == 0 and len(lines_of(tmp_path / "a.jsonl")) == 1
    (built / "config.json").unlink()
    assert main(argv + ["--out", str(tmp_path / "b.jsonl")]) == 0 and len(lines_of(tmp_path / "b.jsonl")) == 1
    mine = tmp_path / "checkpoint"
    shutil.copytree(built, mine)
    os.truncate(mine / "model.safetensors", 1000)
    assert main(argv + ["--out", str(tmp_path / "c.jsonl"), "--model", str(mine)]) == 2
    err = capsys.readouterr().err
    assert f"cannot load the weights of {mine}" in err and "fetch the checkpoint again" in err
    assert "Traceback" not in err
    monkeypatch.setenv("ENCODER_GRAPHS_CACHE", str(tmp_path / "media" / "img00.png" / "cache"))
    for extra in ([], ["--model", "tiny-internvl"]):
        assert main(argv + ["--out", str(tmp_path / "d.jsonl"), *extra]) == 2
        assert "cannot build the model's files in the cache folder" in capsys.readouterr().err


def test_a_hub_id_runs_from_the_hugging_face_cache_offline(tmp_path, monkeypatch, capsys):
    """`--model owner/name` takes the checkpoint from the Hugging Face cache (the Hub's layout:
    refs/main naming a snapshot), with no network (HF_HUB_OFFLINE); an id the cache lacks is a
    one-line error naming the cache (issue 41)."""
    import shutil

    from huggingface_hub import constants

    from encoder_graphs.presets.default_model import default_model_dir

    hub = tmp_path / "hub"
    repo = hub / "models--someone--tiny-vl"
    shutil.copytree(default_model_dir(), repo / "snapshots" / ("a" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    good_images(tmp_path / "media", 1)
    argv = ["caption", str(tmp_path / "media"), "--quiet", "--max-new-tokens", "2", "--out", str(tmp_path / "a.jsonl")]
    assert main(argv + ["--model", "someone/tiny-vl"]) == 0
    assert [r["model"] for r in lines_of(tmp_path / "a.jsonl")] == ["someone/tiny-vl"]
    assert main(argv[:-1] + [str(tmp_path / "b.jsonl"), "--model", "someone/absent"]) == 2
    err = capsys.readouterr().err
    assert f"--model someone/absent: not in the Hugging Face cache ({hub})" in err and "Traceback" not in err


def test_batched_left_padded_generate_matches_one_by_one():
    inputs = QwenVLInputs.from_pretrained(default_model_dir())
    model = Qwen2VLForConditionalGeneration.from_pretrained(default_model_dir()).eval()
    frames = [Image.new("RGB", (64, 48), (40 * i, 0, 0)) for i in range(4)]
    items = [
        inputs.encode_image(Image.new("RGB", (100, 60), (200, 10, 10))),
        inputs.encode_video(frames),
        inputs.encode_image(Image.new("RGB", (280, 280), (0, 100, 10))),
    ]
    # 4 frames of 64x48 -> 2 temporal patches of 56x56 = 4x4 patches, merged 2x2 -> 8 tokens
    assert items[1].grid_thw == (2, 4, 4) and items[1].vision_tokens == 8

    def greedy(batch_items):
        batch = inputs.batch(batch_items, "Describe.")
        out = model.generate(**batch, max_new_tokens=5, do_sample=False, pad_token_id=inputs.pad_token_id)
        return out[:, batch["input_ids"].shape[1] :]

    together = greedy(items)
    alone = torch.cat([greedy([item]) for item in items])
    assert torch.equal(together, alone)


def test_longest_sequence_bounds_the_largest_image_and_video():
    inputs = QwenVLInputs.from_pretrained(default_model_dir())
    config = CaptionConfig(max_new_tokens=5)
    limits = LoadLimits(max_frames=16)
    longest = longest_sequence(inputs, config, limits)
    video = inputs.encode_video([Image.new("RGB", (112, 112), (0, 0, 9 * i)) for i in range(16)])
    image = inputs.encode_image(Image.new("RGB", (3000, 2000)))
    lengths = {
        item.kind: inputs.batch([item], config.prompt)["input_ids"].shape[1] + config.max_new_tokens
        for item in (video, image)
    }
    assert lengths["video"] == longest  # the tiny model's largest video is its longest input
    assert lengths["image"] <= longest
    assert longest_sequence(inputs, CaptionConfig(max_new_tokens=5), LoadLimits(max_frames=4)) < longest


def test_video_patches_match_the_hf_video_processor():
    pytest.importorskip("torchvision")
    from transformers import Qwen2VLVideoProcessor

    inputs = QwenVLInputs.from_pretrained(default_model_dir())
    rng = np.random.default_rng(0)
    frames = [Image.fromarray(rng.integers(0, 255, (56, 84, 3), np.uint8)) for _ in range(4)]
    ours = inputs.encode_video(frames)
    hf = Qwen2VLVideoProcessor.from_pretrained(default_model_dir())
    theirs = hf(videos=[np.stack([np.asarray(f) for f in frames])], return_tensors="np")
    assert ours.grid_thw == tuple(int(v) for v in theirs["video_grid_thw"][0])
    np.testing.assert_allclose(inputs.batch([ours], "Describe.")["pixel_values_videos"], theirs["pixel_values_videos"], atol=1e-4)


def test_end_to_end_over_every_bad_input(tmp_path, capsys):
    expected = write_zoo(tmp_path / "media")
    good_images(tmp_path / "media" / "nested" / "deeper", 3)
    expected.update({f"img{i:02d}.png": "ok" for i in range(3)})
    out, stats_path = tmp_path / "captions.jsonl", tmp_path / "stats.json"
    code = main(
        ["caption", str(tmp_path / "media"), "--out", str(out), "--batch-size", "4", "--stats-json", str(stats_path)]
        + FAST
    )
    assert code == 1
    records = lines_of(out)
    by_name = {Path(r["path"]).name: r for r in records}
    assert len(records) == len(by_name) == len(expected), "one line per file"
    for name, outcome in expected.items():
        record = by_name[name]
        if outcome == "ok":
            assert "error" not in record, record
            assert isinstance(record["caption"], str) and 0 <= record["tokens"] <= 3
            assert record["timings"]["batch_size"] >= 1
        else:
            assert record["error_kind"] == outcome, record
            assert name in record["error"]
    assert by_name["clip.mp4"]["kind"] == "video" and "caption" in by_name["clip.mp4"]

    printed = capsys.readouterr().out
    assert "failed" in printed and "files/s" in printed and "encoder graphs" in printed
    stats = json.loads(stats_path.read_text())
    failures = Counter(kind for kind in expected.values() if kind != "ok")
    assert stats["pipeline"]["failures"] == dict(failures)
    assert stats["pipeline"]["succeeded"] == sum(kind == "ok" for kind in expected.values())
    assert stats["pipeline"]["failed"] == sum(failures.values())
    assert stats["pipeline"]["items_per_s"] > 0
    assert stats["pipeline"]["video_decoder"] == "cpu"  # auto, on a CPU
    videos = sum(r["kind"] == "video" and "caption" in r for r in records)
    assert videos and stats["pipeline"]["video_decoders"] == {"cpu": videos}
    assert f"(video decoder cpu: {videos} by cpu)" in printed
    assert stats["encoder"]["items"] == stats["pipeline"]["succeeded"]
    decoder = stats["decoder"]
    assert decoder["sequences"] == stats["pipeline"]["succeeded"] and decoder["calls"] == stats["pipeline"]["batches"]
    assert decoder["steps"] > 0 and decoder["eager_reasons"] == {"no CUDA device": decoder["steps"]}
    assert decoder["max_cache_len"] < 4096 and decoder["buckets"] == [1, 2, 4]  # sized by the pipeline
    assert {"graph_steps", "replays_per_bucket", "decode_ms_per_step"} <= decoder.keys()
    assert stats["generate_fallbacks"] == {}
    assert "decoder graphs" in printed and "generate calls sent to stock generate: none" in printed


def test_every_entry_is_captioned_failed_or_counted_as_not_read(tmp_path, capsys):
    """JPEG under .jfif/.jpe, PPM, ICO and (where Pillow reads it) AVIF are captioned; a file
    named on the command line that is not media is an error record, not skipped; what the walk
    leaves (hidden, not media) is counted by reason in the report and the stats (issue 41, case 5)."""
    from PIL import features

    folder = tmp_path / "media"
    folder.mkdir()
    photo = Image.new("RGB", (64, 48), (200, 40, 40))
    formats = {"a.jfif": "JPEG", "b.jpe": "JPEG", "c.ppm": "PPM", "d.ico": "ICO"}
    if features.check("avif"):
        formats["e.avif"] = "AVIF"
    for name, kind in formats.items():
        photo.save(folder / name, format=kind)
    photo.save(folder / ".hidden.png")
    (folder / "notes.txt").write_text("not media")
    (folder / "README").write_text("not media")
    (tmp_path / "phone.heic").write_bytes(b"\0" * 64)
    out, stats_path = tmp_path / "captions.jsonl", tmp_path / "stats.json"
    argv = ["caption", str(folder), str(tmp_path / "phone.heic"), "--out", str(out), "--stats-json", str(stats_path)]
    assert main(argv + ["--max-new-tokens", "2"]) == 1
    by_name = {Path(r["path"]).name: r for r in lines_of(out)}
    assert set(by_name) == {*formats, "phone.heic"}
    assert all("caption" in by_name[name] for name in formats)
    assert by_name["phone.heic"]["error_kind"] == "unsupported" and "(.heic)" in by_name["phone.heic"]["error"]
    not_read = {"hidden": 1, "not media (.txt)": 1, "not media (no extension)": 1}
    assert json.loads(stats_path.read_text())["pipeline"]["not_read"] == not_read
    said = capsys.readouterr()
    assert "not read under the folders: hidden 1, not media (.txt) 1, not media (no extension) 1" in said.out
    files = len(formats) + 1
    assert f"| {files}/{files} [" in said.err and "file/s]" in said.err  # the progress bar (tqdm), on stderr
    assert main(argv + ["--max-new-tokens", "2"]) == 1  # nothing to do: the same said
    assert "not read under the folders: hidden 1" in capsys.readouterr().out


def test_a_rerun_with_other_settings_is_refused_or_redone(tmp_path, capsys):
    """Each caption records the settings that made it; a rerun on the same --out with another
    prompt or length is refused, naming what changed, where it used to say "nothing to do" and
    keep the old captions; --redo captions every file again (the latest record wins); records
    from before settings were recorded resume as before (issue 41, case 4)."""
    good_images(tmp_path / "media", 3)
    out = tmp_path / "captions.jsonl"
    argv = ["caption", str(tmp_path / "media"), "--out", str(out), "--quiet", "--max-new-tokens", "2"]
    assert main(argv) == 0
    first = lines_of(out)
    assert all(r["settings"]["max_new_tokens"] == 2 and r["settings"]["prompt"] is None for r in first)
    other = argv[:-1] + ["3", "--prompt", "List the colours."]
    assert main(other) == 2
    err = capsys.readouterr().err
    assert "holds captions of 3 of these files made with other settings" in err
    assert "--prompt its default (now 'List the colours.')" in err and "--max-new-tokens 2 (now 3)" in err
    assert "--redo" in err and lines_of(out) == first
    assert main(other + ["--redo"]) == 0
    records = lines_of(out)
    assert len(records) == 6 and all(r["prompt"].startswith("List the colours.") for r in records[3:])
    assert main(other) == 0 and "nothing to do" in capsys.readouterr().out
    # Records without settings (an earlier version's) are taken as this run's.
    out.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "settings"}) + "\n" for r in first))
    assert main(argv[:-1] + ["7"]) == 0 and "nothing to do" in capsys.readouterr().out
    sidecars = argv + ["--sidecar", "--redo"]
    assert main(sidecars) == 2 and "add --overwrite" in capsys.readouterr().err


def test_resume_after_a_kill_redoes_only_the_missing_files(tmp_path):
    good_images(tmp_path / "media", 7)
    (tmp_path / "media" / "bad.jpg").write_text("nope")
    out = tmp_path / "captions.jsonl"
    argv = ["caption", str(tmp_path / "media"), "--out", str(out), "--batch-size", "2"] + FAST
    assert main(argv) == 1
    full = out.read_bytes().splitlines(keepends=True)
    assert len(full) == 8
    # Simulate a kill: 3 complete lines survive, the 4th is half written.
    out.write_bytes(b"".join(full[:3]) + full[3][: len(full[3]) // 2])
    assert main(argv + ["--stats-json", str(tmp_path / "stats.json")]) == 1
    again = out.read_bytes().splitlines(keepends=True)
    assert again[:3] == full[:3], "earlier lines stay byte for byte"
    paths = [json.loads(line)["path"] for line in again]
    assert sorted(paths) == sorted(str(f.path) for f in discover([tmp_path / "media"]))
    assert len(set(paths)) == len(paths) == 8, "every file exactly once"
    assert json.loads((tmp_path / "stats.json").read_text())["pipeline"]["skipped"] == 3
    # A finished file reruns as a no-op that still reports the earlier failure.
    assert main(argv) == 1
    assert out.read_bytes().splitlines(keepends=True) == again


def test_rerun_from_another_working_directory_is_a_no_op(tmp_path, monkeypatch, capsys):
    good_images(tmp_path / "work" / "media", 2)
    (tmp_path / "work" / "media" / "bad.jpg").write_text("nope")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    assert main(["caption", "media", "--out", "captions.jsonl"] + FAST) == 1
    written = (tmp_path / "work" / "captions.jsonl").read_bytes()
    assert all(Path(record["path"]).is_absolute() for record in read_records(tmp_path / "work" / "captions.jsonl"))
    capsys.readouterr()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["caption", "../work/media", "--out", "../work/captions.jsonl"] + FAST) == 1
    assert (tmp_path / "work" / "captions.jsonl").read_bytes() == written
    assert "nothing to do: all 3 files are already in ../work/captions.jsonl (1 of them as errors)" in capsys.readouterr().out


def test_results_file_keeps_foreign_lines_and_repairs_only_the_tail(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_bytes(b'{"path": "/a.png", "caption": "x"}\nnot json\n{"path": "/b.png", "error": "e"}\n{"path": "/c')
    results = ResultsFile(path)
    assert results.done == {"/a.png", "/b.png"} and results.failed == {"/b.png"}
    assert results.repaired_bytes == len(b'{"path": "/c')
    results.append([{"path": "/c.png", "caption": "y"}, {"path": "/b.png", "caption": "z"}])
    results.close()
    assert path.read_bytes().startswith(b'{"path": "/a.png", "caption": "x"}\nnot json\n')
    assert [r["path"] for r in read_records(path)] == ["/a.png", "/b.png", "/c.png", "/b.png"]
    assert ResultsFile(path).failed == set()


def test_a_whole_last_record_without_its_newline_is_kept(tmp_path):
    """A script that rewrites the JSONL may drop the final newline: that record is whole, not a
    kill's half line, and stays (issue 42, case 8)."""
    path = tmp_path / "r.jsonl"
    path.write_bytes(b'{"path": "/a.png", "caption": "x"}\n{"path": "/b.png", "caption": "y"}')
    with ResultsFile(path) as results:
        assert results.done == {"/a.png", "/b.png"} and results.repaired_bytes == 0
        results.append([{"path": "/c.png", "caption": "z"}])
    assert [r["path"] for r in read_records(path)] == ["/a.png", "/b.png", "/c.png"]


def test_a_batch_broken_by_one_item_is_retried_one_by_one(tmp_path):
    inputs = QwenVLInputs.from_pretrained(default_model_dir())
    model = Qwen2VLForConditionalGeneration.from_pretrained(default_model_dir()).eval()
    good_images(tmp_path, 3)
    files = discover([tmp_path])
    config = CaptionConfig(max_new_tokens=2, batch_size=4)
    captioner = Captioner(model, inputs, config, LoadLimits())
    batch = [captioner.prepare(file) for file in files]
    assert all(isinstance(p, Pending) for p in batch)
    # Patches that disagree with their grid make the vision tower raise for the whole batch.
    batch[1].item.patches = batch[1].item.patches[:3]
    stats = RunStats()
    records = captioner.caption_batch(batch, stats)
    assert [("error" in r) for r in records] == [False, True, False]
    assert records[1]["error_kind"] == "model" and records[1]["path"] == str(files[1].path)
    assert stats.retried_batches == 1 and stats.succeeded == 2 and stats.failures == Counter(model=1)


def test_usage_errors_exit_2(tmp_path, capsys):
    good_images(tmp_path / "media", 1)
    (tmp_path / "empty").mkdir()
    (tmp_path / "not_a_model").mkdir()
    media = str(tmp_path / "media")
    assert main(["caption", media, "--batch-size", "0"]) == 2
    assert main(["caption", media, "--bogus-flag"]) == 2
    assert main(["caption", media, "--max-frames", "3"]) == 2
    assert main(["caption", media, "--budgets", "a,b"]) == 2
    assert main(["caption", media, "--max-image-tokens", "0"]) == 2
    assert main(["caption", media, "--max-image-tokens", "big"]) == 2
    assert main(["caption"]) == 2
    assert main([]) == 2
    assert main(["caption", str(tmp_path / "missing")]) == 2
    assert main(["caption", str(tmp_path / "empty")]) == 2
    assert main(["caption", media, "--model", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o.jsonl")]) == 2
    assert main(["caption", media, "--model", str(tmp_path / "not_a_model"), "--out", str(tmp_path / "o.jsonl")]) == 2
    assert not (tmp_path / "o.jsonl").exists()
    assert "no images or videos" in capsys.readouterr().err


def test_an_unusable_out_path_is_a_usage_error_before_any_work(tmp_path, capsys):
    good_images(tmp_path / "media", 1)
    (tmp_path / "a_file").write_text("")
    assert main(["caption", str(tmp_path / "media"), "--out", str(tmp_path / "a_file" / "x.jsonl")] + FAST) == 2
    assert "cannot use --out" in capsys.readouterr().err


def test_resolution_policy_shrinks_images_and_records_what_the_model_saw(tmp_path):
    """`--max-image-tokens`: each record keeps the file's size and gives the size the model saw,
    at most that many tokens' pixels; `model` keeps the checkpoint's own limit (224 x 224 here)."""
    Image.new("RGB", (560, 420), (10, 120, 200)).save(tmp_path / "photo.png")
    for tokens, most in (("16", 16), ("model", 64)):
        out = tmp_path / f"{tokens}.jsonl"
        assert main(["caption", str(tmp_path / "photo.png"), "--out", str(out), "--max-image-tokens", tokens] + FAST) == 0
        (record,) = lines_of(out)
        assert (record["width"], record["height"]) == (560, 420)
        assert record["vision_tokens"] <= most and record["model_width"] * record["model_height"] <= most * 28 * 28
        assert record["vision_tokens"] == record["model_width"] * record["model_height"] // (28 * 28)
    assert build_parser().parse_args(["caption", "x"]).max_image_tokens == DEFAULT_IMAGE_TOKENS


def test_tiny_preset_and_video(tmp_path):
    write_video(tmp_path / "clip.mp4", frames=5)
    out = tmp_path / "out.jsonl"
    argv = ["caption", str(tmp_path), "--samples", "--model", "tiny-qwen2-vl", "--out", str(out), "--max-frames", "4"]
    assert main(argv + FAST) == 0
    records = lines_of(out)
    assert len(records) == 1 + len(list(SAMPLES_DIR.iterdir()))
    assert all("caption" in r for r in records)
    (video,) = [r for r in records if r["kind"] == "video"]
    assert video["vision_tokens"] == 8  # 4 frames of 56x56


def test_qwen3_5_captions_images_and_video_through_both_graphed_paths(tmp_path):
    """Qwen3.5: images and a video's frames through its tower's adapter; its language model (Gated
    DeltaNet layers beside full attention) through the decoder runner, whose static cache holds
    the linear layers' states; every generate call taken (eager here: no CUDA device)."""
    write_video(tmp_path / "clip.mp4", frames=5)
    out, stats = tmp_path / "out.jsonl", tmp_path / "stats.json"
    argv = ["caption", str(tmp_path), "--samples", "--model", "tiny-qwen3.5", "--out", str(out), "--max-frames", "4"]
    assert main(argv + ["--stats-json", str(stats)] + FAST) == 0
    records = lines_of(out)
    assert len(records) == 1 + len(list(SAMPLES_DIR.iterdir())) and all("caption" in r for r in records)
    graphs = json.loads(stats.read_text())
    assert graphs["encoder"]["items"] == len(records)
    assert graphs["decoder"]["sequences"] == len(records) and graphs["generate_fallbacks"] == {}


def test_a_seed_is_refused_before_loading_where_generate_stays_stock(tmp_path, capsys):
    """A checkpoint whose language model the decoder graphs decline (sliding-window layers)
    decodes through stock generate, which takes no generator a file: `--seed` with sampling is a
    usage error before the weights load, not a failed file each."""
    checkpoint = tmp_path / "sliding"
    write_preset_files("tiny-qwen2.5-vl", checkpoint)
    model = build_model("tiny-qwen2.5-vl")
    model.config.text_config.layer_types = ["sliding_attention"] * model.config.text_config.num_hidden_layers
    model.save_pretrained(checkpoint)
    seeded = ["caption", "--samples", "--model", str(checkpoint), "--out", str(tmp_path / "seeded.jsonl")]
    assert main(seeded + ["--temperature", "0.7", "--seed", "1"] + FAST) == 2
    assert "--seed: this model's language model decodes through stock generate" in capsys.readouterr().err
    assert not (tmp_path / "seeded.jsonl").exists()


def test_killed_python_dash_m_run_resumes_without_loss_or_repeats(tmp_path):
    """`python -m encoder_graphs` killed with SIGKILL mid-run, then rerun: every file exactly once."""
    good_images(tmp_path / "media", 14)
    out = tmp_path / "captions.jsonl"
    argv = ["caption", str(tmp_path / "media"), "--samples", "--out", str(out), "--batch-size", "1"]
    process = subprocess.Popen(
        [sys.executable, "-m", "encoder_graphs", *argv, "--max-new-tokens", "16"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= 3:
            process.kill()
            break
        time.sleep(0.02)
    stdout, stderr = process.communicate(timeout=60)
    assert out.exists(), stderr.decode()
    before = out.read_bytes()
    kept = before[: before.rfind(b"\n") + 1]
    assert main(argv + ["--max-new-tokens", "16", "--quiet"]) == 0  # the same settings: a resume
    after = out.read_bytes()
    assert after.startswith(kept), "lines written before the kill stay byte for byte"
    paths = [json.loads(line)["path"] for line in after.splitlines()]
    assert len(paths) == len(set(paths)) == 14 + len(list(SAMPLES_DIR.iterdir()))
    if process.returncode == 0:  # finished before the kill could land: still a valid run
        assert b"captioned" in stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_run_uses_encoder_graphs_and_matches_no_graphs(tmp_path):
    good_images(tmp_path / "media", 5)
    write_video(tmp_path / "media" / "clip.mp4", frames=6)
    runs = {}
    for name, extra in (("graphs", []), ("eager", ["--no-graphs"])):
        out, stats = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.json"
        argv = ["caption", str(tmp_path / "media"), "--samples", "--out", str(out), "--stats-json", str(stats)]
        assert main(argv + ["--device", "cuda", "--batch-size", "4", "--max-new-tokens", "4", "--quiet"] + extra) == 0
        runs[name] = (lines_of(out), json.loads(stats.read_text()))
    (graph_records, graph_stats), (eager_records, eager_stats) = runs["graphs"], runs["eager"]
    assert graph_stats["device"].startswith("cuda")
    assert graph_stats["encoder"]["enabled"] and graph_stats["encoder"]["graph_items"] > 0
    assert eager_stats["encoder"]["graph_items"] == 0
    assert len(graph_records) == len(eager_records) == 10 and all("caption" in r for r in graph_records)
    # bf16 graphs and eager may round differently; random weights make near-ties common, so only
    # most (not all) greedy captions must agree.
    same = sum(g["caption"] == e["caption"] for g, e in zip(graph_records, eager_records, strict=True))
    assert same >= 7, (graph_records, eager_records)


def test_compile_defaults_on_only_for_gpu_runs_that_pay_for_it():
    from encoder_graphs.app.cli import build_parser
    from encoder_graphs.app.job import wants_compile
    from encoder_graphs.app.config import COMPILE_FROM_FILES
    from encoder_graphs.app.distributed import Job
    from encoder_graphs.app.plan import Plan
    from encoder_graphs.app.settings import Settings

    def plan(files: int, world_size: int = 1, *flags: str) -> Plan:
        settings = Settings.from_arguments(build_parser().parse_args(["caption", "x", *flags]))
        return Plan(settings, [], [], [], CaptionConfig(), None, None, Job(world_size=world_size),
                    counted=Counter(image=files))

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert wants_compile(plan(COMPILE_FROM_FILES), cuda)
    assert not wants_compile(plan(COMPILE_FROM_FILES - 1), cuda)
    assert not wants_compile(plan(COMPILE_FROM_FILES), cpu)
    assert not wants_compile(plan(COMPILE_FROM_FILES * 2 - 1, 2), cuda)  # per GPU
    assert wants_compile(plan(1, 1, "--compile"), cpu)
    assert not wants_compile(plan(10**6, 1, "--no-compile"), cuda)


def test_windows_of_loaded_files_are_batched_costliest_first_with_less_padding(tmp_path):
    """Small and large images alternate on disk: batches in file order pad every small prompt to
    a large one; a window of four batches sorted by cost pairs like with like. The first window
    is one batch (the first captions do not wait for four batches of files)."""
    from encoder_graphs.app.outputs import Outputs, SidecarPolicy

    for index in range(8):
        side = 28 if index % 2 else 224
        Image.new("RGB", (side, side), (20 * index, 90, 160)).save(tmp_path / f"img{index}.png")
    files = discover([tmp_path])
    inputs = QwenVLInputs.from_pretrained(default_model_dir())
    model = Qwen2VLForConditionalGeneration.from_pretrained(default_model_dir()).eval()

    def run(prefetch_batches: int, out: Path) -> tuple[RunStats, list[dict]]:
        config = CaptionConfig(max_new_tokens=2, batch_size=2, prefetch_batches=prefetch_batches)
        results = ResultsFile(out)
        stats = Captioner(model, inputs, config, LoadLimits()).run(files, Outputs(results, SidecarPolicy()))
        results.close()
        return stats, read_records(out)

    in_order, records_in_order = run(1, tmp_path / "a.jsonl")
    sorted_, records_sorted = run(4, tmp_path / "b.jsonl")
    assert [r["path"] for r in records_in_order] == [str(f.path) for f in files]
    tokens = [r["vision_tokens"] for r in records_sorted]
    assert tokens[:2] == [64, 4]  # the first window: one batch, sorted within
    assert tokens[2:] == sorted(tokens[2:], reverse=True)
    assert sorted(r["path"] for r in records_sorted) == sorted(str(f.path) for f in files)
    assert in_order.prompt_tokens == sorted_.prompt_tokens > 0
    assert sorted_.padded_prompt_tokens < in_order.padded_prompt_tokens
    assert sorted_.as_dict()["prompt_padding_pct"] < in_order.as_dict()["prompt_padding_pct"]


def test_a_window_holds_the_collated_copies_of_two_batches_at_most(tmp_path):
    """Each batch is collated (on a GPU: a page-locked copy) while the one before runs; a batch's
    copy goes once it ran, so a window of four batches holds two copies at most, not four."""
    import weakref

    from encoder_graphs.app.outputs import Outputs, SidecarPolicy

    for index in range(10):
        Image.new("RGB", (28 + 4 * index, 28), (20 * index, 90, 160)).save(tmp_path / f"img{index}.png")
    files = discover([tmp_path])
    inputs = QwenVLInputs.from_pretrained(default_model_dir())
    model = Qwen2VLForConditionalGeneration.from_pretrained(default_model_dir()).eval()
    captioner = Captioner(model, inputs, CaptionConfig(max_new_tokens=2, batch_size=2, prefetch_batches=4), LoadLimits())

    class Collated(dict):  # a dict that a weak reference can follow
        pass

    copies, alive = [], []
    collate, caption_batch = captioner._collate, captioner.caption_batch

    def tracked(batch):
        copy = Collated(collate(batch))
        copies.append(weakref.ref(copy))
        return copy

    def counted(batch, stats, collated=None):
        alive.append(sum(ref() is not None for ref in copies))
        return caption_batch(batch, stats, collated)

    captioner._collate, captioner.caption_batch = tracked, counted
    results = ResultsFile(tmp_path / "r.jsonl")
    stats = captioner.run(files, Outputs(results, SidecarPolicy()))
    results.close()
    assert stats.succeeded == 10 and len(copies) == len(alive) == 5  # a window of 1 batch, then one of 4
    assert max(alive) <= 2, alive  # a batch's own copy, and the next one's where it is ready


def test_warm_up_runs_beside_the_first_files_and_its_error_loses_nothing(tmp_path):
    """The warm-up (the language model's first call, on CUDA) runs on its own thread once the run
    starts and ends before the first batch; one that raises leaves every file captioned."""
    from encoder_graphs.app.outputs import Outputs, SidecarPolicy

    for index in range(3):
        Image.new("RGB", (56, 56), (40 * index, 90, 160)).save(tmp_path / f"img{index}.png")
    files = discover([tmp_path])
    inputs = QwenVLInputs.from_pretrained(default_model_dir())
    model = Qwen2VLForConditionalGeneration.from_pretrained(default_model_dir()).eval()
    events: list[str] = []
    generate = model.generate

    def counted_generate(*args, **kwargs):
        events.append("batch")
        return generate(*args, **kwargs)

    model.generate = counted_generate

    def warm_up(fail: bool) -> None:
        time.sleep(0.2)  # slower than the files: the first batch must still wait for it
        events.append("warm-up")
        if fail:
            raise RuntimeError("warm-up failed")

    for fail in (False, True):
        events.clear()
        out = tmp_path / f"{fail}.jsonl"
        results = ResultsFile(out)
        config = CaptionConfig(max_new_tokens=2, batch_size=2)
        captioner = Captioner(model, inputs, config, LoadLimits(), warm_up=lambda fail=fail: warm_up(fail))
        stats = captioner.run(files, Outputs(results, SidecarPolicy()))
        results.close()
        assert events == ["warm-up", "batch", "batch"]
        assert stats.succeeded == 3 and stats.failed == 0 and stats.retried_batches == 0
        assert sorted(r["path"] for r in read_records(out)) == sorted(str(f.path) for f in files)


def test_hostile_clips_cost_their_time_limit_and_lose_nothing_else(tmp_path, capsys):
    """A folder of an image, an ordinary clip, a clip with no duration or index, and 10**6 tiny
    frames with neither: the ordinary clip is sampled by seeking, the unindexed one in one pass,
    the million frames stop at --video-timeout as a timeout record; the rest is captioned, and
    each record says how its frames were taken. All three clips start decoding while the model
    loads, the hostile one's time limit included."""
    from test_video import write_h264, write_tiny_avi, write_unindexed_mkv

    folder = tmp_path / "media"
    good_images(folder, 1)
    write_h264(folder / "clip.mp4", frames=60)
    write_unindexed_mkv(folder / "live.mkv", frames=40)
    write_tiny_avi(folder / "many.avi", 10**6)
    out, stats = tmp_path / "out.jsonl", tmp_path / "stats.json"
    started = time.perf_counter()
    code = main(["caption", str(folder), "--out", str(out), "--stats-json", str(stats), "--max-frames", "4",
                 "--video-timeout", "2"] + FAST)
    assert time.perf_counter() - started < 120
    assert code == 1
    by_name = {Path(r["path"]).name: r for r in lines_of(out)}
    assert "caption" in by_name["img00.png"] and "video" not in by_name["img00.png"]
    assert by_name["clip.mp4"]["video"]["sampling"] == "seek" and by_name["clip.mp4"]["video"]["frames"] == 4
    assert by_name["clip.mp4"]["video"]["frame_times_s"] == [0.0, 0.667, 1.3, 1.967]  # frames 0, 20, 39, 59 of 60 at 30 fps
    assert by_name["live.mkv"]["video"]["sampling"].startswith("full pass: the container gives no duration")
    assert by_name["many.avi"]["error_kind"] == "timeout" and "many.avi" in by_name["many.avi"]["error"]
    assert json.loads(stats.read_text())["pipeline"]["failures"] == {"timeout": 1}
    assert "(decoding the first 3 videos meanwhile)" in capsys.readouterr().err


def test_images_and_videos_batch_apart_by_their_own_limits(tmp_path):
    """A mixed window: every batch holds one kind, videos by the video batch size, images by theirs."""
    from test_video import write_h264

    from encoder_graphs.app.outputs import Outputs, SidecarPolicy

    good_images(tmp_path, 5)
    for index in range(3):
        write_h264(tmp_path / f"clip{index}.mp4", frames=20 + index)
    files = discover([tmp_path])
    inputs = QwenVLInputs.from_pretrained(default_model_dir())
    model = Qwen2VLForConditionalGeneration.from_pretrained(default_model_dir()).eval()
    config = CaptionConfig(max_new_tokens=2, batch_size=3, video_batch_size=2)
    results = ResultsFile(tmp_path / "out.jsonl")
    stats = Captioner(model, inputs, config, LoadLimits(max_frames=4)).run(files, Outputs(results, SidecarPolicy()))
    results.close()
    records = read_records(tmp_path / "out.jsonl")
    assert stats.succeeded == 8 and len(records) == 8
    batches: dict[float, list[dict]] = {}
    for record in records:
        batches.setdefault(record["timings"]["batch_ms"], []).append(record)
    for batch in batches.values():
        (kind,) = {r["kind"] for r in batch}
        assert len(batch) == batch[0]["timings"]["batch_size"] <= (2 if kind == "video" else 3)
    assert sorted(len(b) for b in batches.values() if b[0]["kind"] == "video") == [1, 2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_run_of_clips_decodes_in_processes_and_replays_their_frames(tmp_path):
    """Clips on a CUDA run: frames from the decoder's worker processes (a fork server, beside a
    process that holds CUDA), sampled by seeking; the encoder replays graphs for the frames of
    later batches; the captions are most of --no-graphs' (bf16 near-ties aside)."""
    from test_video import write_h264

    (tmp_path / "clips").mkdir()
    for index in range(6):
        write_h264(tmp_path / "clips" / f"clip{index}.mp4", frames=45 + 15 * index, size=(160 + 32 * index, 96))
    runs = {}
    for name, extra in (("graphs", []), ("eager", ["--no-graphs"])):
        out, stats = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.json"
        argv = ["caption", str(tmp_path / "clips"), "--out", str(out), "--stats-json", str(stats), "--max-frames", "8"]
        assert main(argv + ["--device", "cuda", "--batch-size", "2", "--max-new-tokens", "4", "--quiet"] + extra) == 0
        runs[name] = (lines_of(out), json.loads(stats.read_text()))
    (graph_records, graph_stats), (eager_records, _) = runs["graphs"], runs["eager"]
    assert len(graph_records) == 6 and all(r["video"]["sampling"] == "seek" for r in graph_records)
    assert all(r["video"]["frames"] == 8 for r in graph_records)
    assert graph_stats["encoder"]["graph_items"] > 0 and graph_stats["pipeline"]["video_batch_size"] == 2
    same = sum(g["caption"] == e["caption"] for g, e in zip(graph_records, eager_records, strict=True))
    assert same >= 4, (graph_records, eager_records)
