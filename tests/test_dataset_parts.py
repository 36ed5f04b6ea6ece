"""The dataset tool's outputs across runs, on the embedded tiny model (CPU, gloo for torchrun):
part files a killed torchrun job left are merged by any later run, each record once (issue 25.1);
metadata.jsonl from every caption of the folder's images (25.3); names that are not UTF-8 (25.4);
backfilled sidecars with this run's prefix (25.5); a torchrun job's exit status, Ctrl-C and
statistics (25.17)."""

import json
import os
import signal
import time
from pathlib import Path
from urllib.parse import unquote_to_bytes

import pytest
from PIL import Image
from test_cli import model_cache  # noqa: F401 (autouse: a private model cache for this module)
from test_dataset_tool import FAST, images, records
from test_distributed import torchrun
from test_media import write_video
from torch.distributed import HashStore

from encoder_graphs.app.cli import main
from encoder_graphs.app.distributed import Job, gather_stats, part_path
from encoder_graphs.engine.statistics import GraphStats


def split_into_stale_parts(out: Path) -> None:
    """What a torchrun job killed while rank 0 merged leaves: part0 copied into --out but not yet
    removed, part1 one record in, the next one cut half-way."""
    lines = out.read_bytes().splitlines(keepends=True)
    part0, part1 = lines[: len(lines) // 2], lines[len(lines) // 2 :]
    part_path(out, 0).write_bytes(b"".join(part0))
    part_path(out, 1).write_bytes(b"".join(part1))
    out.write_bytes(b"".join(part0 + part1[:1]) + part1[1][:25])
    # A killed rank's lock file, naming a process long gone.
    out.with_name(out.name + ".encoder-graphs-part1.lock").write_text('{"pid": 999999999, "host": "gone"}\n')


def assert_each_once(out: Path, count: int) -> None:
    paths = [record["path"] for record in records(out)]
    assert len(paths) == len(set(paths)) == count, sorted(paths)
    assert not list(out.parent.glob(out.name + ".encoder-graphs-part*")), "the parts are merged and removed"


# -- 25.1: parts ----------------------------------------------------------------------------------


def test_a_single_process_rerun_merges_the_parts_of_a_killed_merge(tmp_path, capsys):
    images(tmp_path / "data", 6)
    out = tmp_path / "r.jsonl"
    argv = ["caption", str(tmp_path / "data"), "--out", str(out)] + FAST
    assert main(argv) == 0
    captioned = set(out.read_text().splitlines())
    split_into_stale_parts(out)
    assert main(argv) == 0
    assert "merged 2 records from the 2 part files" in capsys.readouterr().err
    assert_each_once(out, 6)
    assert set(out.read_text().splitlines()) == captioned, "nothing captioned again: the parts held it all"
    assert not list(tmp_path.glob("*.lock")), "the killed rank's lock file went with its part"


@pytest.mark.slow
def test_torchrun_merges_stale_parts_when_there_is_nothing_to_do(tmp_path):
    images(tmp_path / "data", 6)
    out = tmp_path / "r.jsonl"
    assert main(["caption", str(tmp_path / "data"), "--out", str(out)] + FAST) == 0
    split_into_stale_parts(out)
    job = torchrun(tmp_path / "data", out, "--max-new-tokens", "3")
    log, _ = job.communicate(timeout=240)
    assert job.returncode == 0 and "nothing to do: all 6 files" in log, log
    assert_each_once(out, 6)


@pytest.mark.slow
def test_a_torchrun_rerun_with_work_merges_stale_parts_once_and_reports_the_whole_job(tmp_path):
    """25.1, and 25.17: a finished job with a failed file exits 0 without torchrun's "FAILED"
    traceback; its statistics, graphs' included, are of every rank."""
    images(tmp_path / "data", 6)
    out, stats = tmp_path / "r.jsonl", tmp_path / "stats.json"
    assert main(["caption", str(tmp_path / "data"), "--out", str(out)] + FAST) == 0
    split_into_stale_parts(out)
    images(tmp_path / "data", 8, prefix="new")
    (tmp_path / "data" / "broken.png").write_bytes(b"not a png")
    job = torchrun(tmp_path / "data", out, "--max-new-tokens", "3", "--stats-json", str(stats))
    log, _ = job.communicate(timeout=240)
    assert job.returncode == 0, log
    assert "FAILED" not in log and "Traceback" not in log, log
    assert "files 15: captioned 8, failed 1, skipped (already done) 6" in log
    assert_each_once(out, 15)
    payload = json.loads(stats.read_text())
    assert payload["pipeline"]["failed"] == 1 and payload["pipeline"]["world_size"] == 2
    assert payload["encoder"]["items"] == payload["decoder"]["sequences"] == 8, "every rank's, not rank 0's"
    assert f"calls {payload['encoder']['calls']}, encoder items 8" in log


# -- 25.3: metadata -------------------------------------------------------------------------------


def metadata(root: Path) -> dict[str, str]:
    rows = records(root / "metadata.jsonl")
    assert len(rows) == len({row["file_name"] for row in rows}), "a row twice"
    return {row["file_name"]: row["text"] for row in rows}


def test_metadata_from_every_caption_of_the_folder(tmp_path):
    data = tmp_path / "data"
    images(data, 3)
    (data / "img02.txt").write_text("a hand-written caption\n")  # its sidecar existed before
    base = ["caption", str(data), "--sidecar", "--hf-metadata"] + FAST
    assert main(base + ["--out", str(tmp_path / "a.jsonl")]) == 0
    images(data, 5)  # the folder grows; another --out captions the new files only
    assert main(base + ["--out", str(tmp_path / "b.jsonl")]) == 0
    rows = metadata(data)
    assert sorted(rows) == [f"img{i:02d}.png" for i in range(5)]
    assert rows["img02.png"] == "a hand-written caption"
    assert all(rows[f"img{i:02d}.png"] == (data / f"img{i:02d}.txt").read_text()[:-1] for i in range(5))
    # Through a symlinked root, with the first --out (its records name the real paths), and
    # without --sidecar: every caption is found by the file's identity.
    link = tmp_path / "link"
    link.symlink_to(data, target_is_directory=True)
    (data / "metadata.jsonl").unlink()
    assert main(["caption", str(link), "--out", str(tmp_path / "a.jsonl"), "--hf-metadata"] + FAST) == 0
    assert sorted(metadata(link)) == [f"img{i:02d}.png" for i in range(5)]


def test_metadata_images_only_one_file_per_root_every_name_and_loads_in_datasets(tmp_path):
    data = tmp_path / "data"
    images(data, 2)
    images(data / "sub", 2, prefix="deep")
    (data / "alias.png").symlink_to("img00.png")  # a file under two names
    pytest.importorskip("av")  # the video is captioned: its record has a text, and still no row
    write_video(data / "clip.mp4", frames=4)
    out = tmp_path / "r.jsonl"
    assert main(["caption", str(data), str(data / "sub"), "--out", str(out), "--hf-metadata"] + FAST) == 0
    by_name = {Path(record["path"]).name: record for record in records(out)}
    assert by_name["clip.mp4"]["kind"] == "video" and "text" in by_name["clip.mp4"]
    assert not (data / "sub" / "metadata.jsonl").exists(), "data/sub is inside the dataset root data"
    rows = metadata(data)
    assert sorted(rows) == ["alias.png", "img00.png", "img01.png", "sub/deep00.png", "sub/deep01.png"]
    assert rows["alias.png"] == rows["img00.png"]
    datasets = pytest.importorskip("datasets")
    loaded = datasets.load_dataset("imagefolder", data_dir=str(data), split="train")
    assert sorted(loaded["text"]) == sorted(rows.values())
    assert all(image.size[0] >= 40 for image in loaded["image"])


# -- 25.4: names that are not UTF-8 ---------------------------------------------------------------


def test_names_that_are_not_utf8_give_valid_json_and_resume(tmp_path, capsys):
    data = tmp_path / "data"
    images(data, 1)
    odd = os.fsencode(data) + b"/caf\xe9 \xff.png"
    Image.new("RGB", (48, 40), (200, 10, 10)).save(odd)
    out = tmp_path / "r.jsonl"
    argv = ["caption", str(data), "--out", str(out), "--hf-metadata", "--prompt", "Describe {name} in {folder}."]
    assert main(argv + FAST) == 0
    text = out.read_bytes().decode("utf-8")  # strict: no surrogates, no bad bytes
    rows = [json.loads(line) for line in text.splitlines()]
    (record,) = [row for row in rows if "path_bytes" in row]
    assert "caption" in record and record["prompt"] == "Describe caf\ufffd \ufffd in data."
    assert unquote_to_bytes(record["path_bytes"]) == odd and record["path"] == f"{data}/caf\ufffd \ufffd.png"
    assert "no row for 1 images whose names are not UTF-8" in capsys.readouterr().err
    assert list(metadata(data)) == ["img00.png"]
    pyarrow_json = pytest.importorskip("pyarrow.json")
    assert pyarrow_json.read_json(out).num_rows == 2
    assert pyarrow_json.read_json(data / "metadata.jsonl").num_rows == 1
    assert main(argv + FAST) == 0  # the exact path is found again: nothing to do
    assert "nothing to do: all 2 files" in capsys.readouterr().out and len(records(out)) == 2


# -- 25.5: backfilled sidecars ----------------------------------------------------------------------


def test_backfilled_sidecars_take_this_runs_prefix_and_overwrite(tmp_path):
    files = images(tmp_path / "data", 2)
    base = ["caption", str(tmp_path / "data"), "--out", str(tmp_path / "r.jsonl")] + FAST
    assert main(base + ["--prefix", "OLD, "]) == 0
    captions = {record["path"]: record["caption"] for record in records(tmp_path / "r.jsonl")}
    assert main(base + ["--sidecar", "--prefix", "NEW, "]) == 0
    assert all(f.with_suffix(".txt").read_text() == f"NEW, {captions[str(f)]}\n" for f in files)
    assert main(base + ["--sidecar", "--prefix", "NEWER, "]) == 0, "without --overwrite, sidecars stay"
    assert all(f.with_suffix(".txt").read_text().startswith("NEW, ") for f in files)
    assert main(base + ["--sidecar", "--overwrite", "--prefix", "NEWER, ", "--suffix", "."]) == 0
    assert all(f.with_suffix(".txt").read_text() == f"NEWER, {captions[str(f)]}.\n" for f in files)
    assert len(records(tmp_path / "r.jsonl")) == 2, "nothing captioned again"


# -- 25.17: torchrun's exit status, Ctrl-C and statistics -----------------------------------------


def test_graph_statistics_of_a_job_whose_rank_0_got_no_file():
    def rank(calls: int, items: int, sequences: int, steps: int) -> GraphStats:
        latency = {"calls": calls, "mean": 2.0 * calls, "p50": 1.0, "p99": 3.0}
        once = {"capture_seconds": 0.5, "graph_memory_bytes": 10}  # each rank's own
        return GraphStats.from_json({  # as the ranks send them: JSON
            "encoder": {"enabled": False, "disabled_reason": "no CUDA device", "calls": calls, "items": items,
                        "graph_items": 0, "eager_items": items, "hit_rate_pct": 0.0, **once, "max_items": 4, "max_frames": None,
                        "latency_ms": latency, "budgets": {"default": [64, 128]}, "budget_costs_ms": {"default": {}},
                        "captured_budgets": {"default": [64] if calls else []}, "failed_budgets": {}, "compile": None,
                        "paths": {"default": {"hits": 0, "misses": items, "miss_reasons": {"no CUDA device": items},
                                              "replays_per_budget": {}, "real_tokens": 8 * items,
                                              "padded_tokens": 10 * items, "waste_pct": 20.0}}},
            "decoder": {"enabled": False, "disabled_reason": "no CUDA device", "step": "model forward",
                        "prefill": "left-padded", "calls": calls, "sequences": sequences, "steps": steps,
                        "graph_steps": 0, "eager_steps": steps, "real_lanes": sequences, "padded_lanes": 2 * sequences,
                        "lane_waste_pct": 50.0, "decode_ms_per_step": latency, "captured_graphs": [[1, 64]],
                        "eager_reasons": {"no CUDA device": steps}, "replays_per_bucket": {}, "replays_per_tier": {},
                        "steps_per_tier": {"64": steps}, "buckets": [1], "length_tiers": [64], "failed_graphs": {},
                        "max_cache_len": 64, **once, "static_buffer_bytes": 10},
            "decoder_off": None,
            "generate_fallbacks": {},
        })

    job = GraphStats.merge([rank(0, 0, 0, 0), rank(3, 7, 7, 9), rank(1, 2, 2, 4)])
    encoder, decoder = job["encoder"], job["decoder"]
    assert (encoder["calls"], encoder["items"], encoder["eager_items"]) == (4, 9, 9)
    assert encoder["paths"]["default"]["miss_reasons"] == {"no CUDA device": 9}
    assert encoder["paths"]["default"]["waste_pct"] == pytest.approx(20.0)
    assert encoder["latency_ms"]["calls"] == 4 and encoder["latency_ms"]["mean"] == pytest.approx(5.0)
    assert encoder["capture_seconds"] == 0.5 and encoder["captured_budgets"] == {"default": [64]}
    assert (decoder["sequences"], decoder["steps"], decoder["lane_waste_pct"]) == (9, 13, 50.0)
    assert decoder["steps_per_tier"] == {"64": 13} and decoder["max_cache_len"] == 64
    assert decoder["eager_reasons"] == {"no CUDA device": 13} and decoder["captured_graphs"] == [[1, 64]]


def test_an_interrupted_rank_0_waits_a_while_only_for_the_other_ranks():
    """A rank that a Ctrl-C stopped before its first file never reports: rank 0 must not wait for
    it until torchrun kills the job (and its merge) 30 s after the Ctrl-C."""
    store = HashStore()
    jobs = [Job(rank, 3, rank, store) for rank in range(3)]
    assert gather_stats(jobs[2], {"files": 2}) is None
    started = time.monotonic()
    assert gather_stats(jobs[0], {"files": 0}, patience_s=0.5) == {0: {"files": 0}, 2: {"files": 2}}
    assert 0.5 <= time.monotonic() - started < 10


@pytest.mark.slow
def test_ctrl_c_stops_a_torchrun_job_cleanly(tmp_path):
    images(tmp_path / "data", 60)
    out = tmp_path / "r.jsonl"
    job = torchrun(tmp_path / "data", out, "--max-new-tokens", "24", "--batch-size", "2")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any(p.stat().st_size for p in tmp_path.glob("r.jsonl.encoder-graphs-part[0-9]")):
        time.sleep(0.05)
    assert job.poll() is None, "the job finished before Ctrl-C: make it slower"
    os.killpg(job.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches torchrun; it passes SIGINT to the ranks
    log, _ = job.communicate(timeout=120)
    assert job.returncode != 0 and "rerun the same command to resume" in log, log
    assert "forcefully exiting" not in log, "every rank ended within torchrun's 30 s"
    tracebacks = log.split("Traceback (most recent call last)")[1:]
    assert len(tracebacks) <= 1 and all("SignalException: Process" in t for t in tracebacks), "only torchrun's own"
    # Rank 0 merged the parts of the ranks that reported; a part left (a rank stopped before it
    # reported) waits for the next run: no record is in two places.
    done = [r["path"] for r in records(out)] if out.exists() else []
    done += [json.loads(line)["path"] for part in tmp_path.glob("r.jsonl.encoder-graphs-part[0-9]") for line in part.read_text().splitlines()]
    assert 0 < len(done) < 60 and len(set(done)) == len(done)


def test_every_graph_statistic_has_a_merge_rule():
    """A torchrun job merges its ranks' statistics field by field: a statistic added without a
    rule must fail here, not be summed by accident."""
    from encoder_graphs import enable_cuda_graphs
    from encoder_graphs.presets import build_model

    handle = enable_cuda_graphs(build_model("tiny-qwen2.5-vl"), budgets=[64])
    try:
        stats = json.loads(json.dumps(handle.stats().to_json()))  # as the ranks send them
    finally:
        handle.disable()
    job = GraphStats.merge([GraphStats.from_json(stats), GraphStats.from_json(stats)]).to_json()
    assert job.keys() == stats.keys() and job["encoder"].keys() == stats["encoder"].keys()
    assert job["decoder"].keys() == stats["decoder"].keys()
    stats["encoder"]["new_counter"] = 1
    with pytest.raises(KeyError, match="no merge rule for the statistics \\['new_counter'\\]"):
        GraphStats.from_json(stats)
