"""Dataset shards in, shards out (issue 43): WebDataset tars, Parquet files and a saved HF dataset
captioned by the command (the tiny default model, CPU) into one output shard each; resumes,
kills, splits across processes, unreadable shards and members, settings clashes."""

import io
import json
import os
import random
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_cli import model_cache  # noqa: F401 (autouse: a private model cache for this module)
from test_media import write_video

from encoder_graphs.app.cli import main
from encoder_graphs.app.datasets import InputShard, expand_braces, samples, shard_selection
from encoder_graphs.app.shard_outputs import PARTIAL_SUFFIX

FAST = ["--max-new-tokens", "3", "--quiet", "--batch-size", "4"]


def image_bytes(index: int, fmt: str) -> bytes:
    rng = np.random.default_rng(index)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (32 + 4 * (index % 5), 48, 3), dtype=np.uint8)).save(buffer, format=fmt)
    return buffer.getvalue()


def sample_members(shard: int, index: int, clip: bytes | None) -> tuple[str, dict[str, bytes]]:
    """A sample of a mixed shard: JPEG, PNG, a corrupt JPEG, now and then a clip; with its json."""
    key = f"s{shard:02d}/k{index:04d}"
    n = shard * 1000 + index
    if clip is not None and index == 1:
        media = {"mp4": clip}
    elif index % 7 == 3:
        media = {"jpg": b"\xff\xd8 not a jpeg"}
    else:
        media = {"jpg": image_bytes(n, "JPEG")} if index % 2 else {"png": image_bytes(n, "PNG")}
    return key, {**media, "json": json.dumps({"n": n}).encode()}


def write_shards(folder: Path, count: int, per_shard: int, clip: bytes | None = None) -> list[tuple[str, dict]]:
    """`count` tar shards; the samples, as (key, members) in order."""
    folder.mkdir(parents=True, exist_ok=True)
    everything = []
    for shard in range(count):
        with tarfile.open(folder / f"{shard:05d}.tar", "w") as tar:
            for index in range(per_shard):
                key, members = sample_members(shard, index, clip)
                everything.append((key, members))
                for extension, data in members.items():
                    info = tarfile.TarInfo(f"{key}.{extension}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return everything


def media_of(members: dict) -> bytes:
    return next(data for extension, data in members.items() if extension != "json")


def records(folder: Path) -> list[dict]:
    found = []
    for path in sorted(folder.iterdir()):
        if path.suffix == ".jsonl" and not path.name.startswith("."):
            found += [json.loads(line) for line in path.read_text().splitlines()]
        elif path.suffix == ".parquet":
            import pyarrow.parquet as pq

            found += pq.read_table(path).to_pylist()
    return found


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> bytes:
    pytest.importorskip("av")
    path = tmp_path_factory.mktemp("clip") / "c.mp4"
    write_video(path, 12)
    return path.read_bytes()


def test_brace_lists_expand_as_webdataset_writes_them():
    assert expand_braces("a/{00008..00011}.tar") == [f"a/{n:05d}.tar" for n in range(8, 12)]
    assert expand_braces("{x,y}-{1..2}") == ["x-1", "x-2", "y-1", "y-2"]
    shards = [InputShard(str(n), Path(f"{n}.tar"), "webdataset") for n in range(10)]
    parts = [shard_selection(shards, 4, index) for index in range(4)]
    assert sorted(s.name for part in parts for s in part) == sorted(s.name for s in shards)
    assert all(len(part) in (2, 3) for part in parts)


def test_tar_samples_stream_with_their_problems_said(tmp_path):
    with tarfile.open(tmp_path / "t.tar", "w") as tar:
        for name, data in (("a.jpg", image_bytes(1, "JPEG")), ("a.json", b"{}"), ("b.txt", b"only text")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("c.jpg")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    got = list(samples(InputShard("t", tmp_path / "t.tar", "webdataset")))
    assert [(s.key, s.kind) for s in got] == [("a", "image"), ("b", "other"), ("c", "other")]
    assert got[0].carried == {"json": "{}"} and got[0].path == Path("t/a")
    assert "no image or video member" in got[1].reason and "a link" in got[2].reason


def test_shards_out_with_the_same_captions_from_tar_parquet_and_a_saved_dataset(tmp_path, clip):
    pytest.importorskip("datasets")
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    everything = write_shards(tmp_path / "wds", 3, 5, clip)
    assert main(["caption", str(tmp_path / "wds" / "{00000..00002}.tar"), "--out", str(tmp_path / "a")] + FAST) == 1
    by_tar = {r["key"]: r for r in records(tmp_path / "a")}
    assert sorted(by_tar) == sorted(key for key, _ in everything)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["00000.jsonl", "00001.jsonl", "00002.jsonl"]
    assert by_tar["s00/k0001"]["kind"] == "video" and by_tar["s00/k0001"]["status"] == "ok"
    assert by_tar["s00/k0003"]["error_kind"] == "corrupt" and by_tar["s00/k0003"]["status"] == "error"
    assert json.loads(by_tar["s01/k0002"]["json"]) == {"n": 1002}

    (tmp_path / "pq").mkdir()
    rows = [{"key": key, "image": media_of(members), "caption": "old", "n": i} for i, (key, members) in enumerate(everything)]
    for shard in range(3):
        pq.write_table(pa.Table.from_pylist(rows[5 * shard : 5 * shard + 5]), tmp_path / "pq" / f"p{shard}.parquet")
    assert main(["caption", str(tmp_path / "pq" / "*.parquet"), "--out", str(tmp_path / "b"), "--out-format",
                 "parquet"] + FAST) == 1
    by_parquet = {r["key"]: r for r in records(tmp_path / "b")}
    saved = datasets.Dataset.from_list([{"key": r["key"], "image": {"bytes": r["image"], "path": None}} for r in rows])
    saved.save_to_disk(str(tmp_path / "hf"), num_shards=2)
    assert main(["caption", str(tmp_path / "hf"), "--out", str(tmp_path / "c")] + FAST) == 1
    by_saved = {r["key"]: r for r in records(tmp_path / "c")}
    for other in (by_parquet, by_saved):
        assert {k: r.get("caption") for k, r in other.items()} == {k: r.get("caption") for k, r in by_tar.items()}
    assert by_parquet["s00/k0000"]["input_caption"] == "old" and by_parquet["s00/k0000"]["n"] == 0
    loaded = datasets.load_dataset("parquet", data_files=str(tmp_path / "b" / "*.parquet"), split="train")
    assert loaded.num_rows == 15 and "caption" in loaded.column_names
    assert datasets.load_dataset("json", data_files=str(tmp_path / "a" / "*.jsonl"), split="train").num_rows == 15


def test_a_rerun_skips_complete_shards_and_refuses_other_settings(tmp_path, capsys):
    write_shards(tmp_path / "wds", 2, 3)
    shards = str(tmp_path / "wds" / "*.tar")
    assert main(["caption", shards, "--out", str(tmp_path / "o")] + FAST) == 0
    first = records(tmp_path / "o")
    assert main(["caption", shards, "--out", str(tmp_path / "o")] + FAST) == 0
    assert "2 complete" in capsys.readouterr().err and records(tmp_path / "o") == first
    assert main(["caption", shards, "--out", str(tmp_path / "o"), "--prompt", "Other."] + FAST) == 2
    assert "other settings" in capsys.readouterr().err
    assert main(["caption", shards, "--out", str(tmp_path / "o"), "--sidecar"] + FAST) == 2
    assert main(["caption", shards, str(tmp_path), "--out", str(tmp_path / "o")] + FAST) == 2
    assert main(["caption", str(tmp_path / "wds"), "--out", str(tmp_path / "x.jsonl"), "--out-format", "parquet"]) == 2


def test_a_partial_shard_resumes_from_its_finished_keys_and_a_torn_line(tmp_path):
    write_shards(tmp_path / "wds", 1, 6)
    out = tmp_path / "o"
    out.mkdir()
    assert main(["caption", str(tmp_path / "wds" / "00000.tar"), "--out", str(tmp_path / "full")] + FAST) == 1
    full = records(tmp_path / "full")
    partial = out / f".00000{PARTIAL_SUFFIX}"
    partial.write_text("".join(json.dumps(r) + "\n" for r in full[:2]) + json.dumps(full[2])[:30])
    assert main(["caption", str(tmp_path / "wds" / "00000.tar"), "--out", str(out)] + FAST) == 1
    assert not partial.exists() and sorted(p.name for p in out.iterdir()) == ["00000.jsonl"]
    again = records(out)
    assert sorted(r["key"] for r in again) == sorted(r["key"] for r in full)
    assert {r["key"]: r.get("caption") for r in again} == {r["key"]: r.get("caption") for r in full}


def test_a_truncated_shard_is_read_twice_then_reported_and_the_others_complete(tmp_path, capsys):
    write_shards(tmp_path / "wds", 2, 6)
    data = (tmp_path / "wds" / "00001.tar").read_bytes()
    (tmp_path / "wds" / "00001.tar").write_bytes(data[: len(data) // 2])
    assert main(["caption", str(tmp_path / "wds" / "*.tar"), "--out", str(tmp_path / "o")] + FAST) == 1
    said = capsys.readouterr()
    assert "shard 00001 failed twice" in said.err and "1 of 2 shards complete" in said.out
    names = sorted(p.name for p in (tmp_path / "o").iterdir())
    assert names == [f".00001{PARTIAL_SUFFIX}", "00000.jsonl"]
    kept = [json.loads(line) for line in (tmp_path / "o" / names[0]).read_text().splitlines()]
    assert kept and len({r["key"] for r in kept}) == len(kept)


def test_four_processes_split_the_shards_exactly(tmp_path):
    everything = write_shards(tmp_path / "wds", 6, 2)
    sealed = []
    for index in range(4):
        stats = tmp_path / f"stats{index}.json"
        code = main(["caption", str(tmp_path / "wds" / "*.tar"), "--out", str(tmp_path / "o"), "--num-shards", "4",
                     "--shard-index", str(index), "--stats-json", str(stats)] + FAST)
        assert code in (0, 1)
        sealed += json.loads(stats.read_text())["shards"]["sealed"]
    assert sorted(sealed) == [f"{n:05d}" for n in range(6)]  # each shard by one process
    keys = [r["key"] for r in records(tmp_path / "o")]
    assert sorted(keys) == sorted(key for key, _ in everything)


@pytest.mark.slow
def test_ten_kills_lose_nothing_and_show_no_partial_shard(tmp_path, clip):
    # 20 shards of 500 mixed samples (JPEG, PNG, a corrupt JPEG every 7th, a clip each), as issue 43 asks.
    everything = write_shards(tmp_path / "wds", 20, 500, clip)
    out = tmp_path / "o"
    command = [sys.executable, "-m", "encoder_graphs", "caption", str(tmp_path / "wds" / "{00000..00019}.tar"),
               "--out", str(out)] + FAST
    chance, interrupted = random.Random(0), 0
    for _ in range(10):
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        # Once this run has written records (a partial file grew), at a random moment soon after.
        sizes = partial_sizes(out)
        while time.monotonic() < deadline and process.poll() is None and not any(
                size > sizes.get(name, 0) for name, size in partial_sizes(out).items()):
            time.sleep(0.01)
        time.sleep(chance.uniform(0, 2.0))  # spread over the job: each run captions a part of it
        interrupted += process.poll() is None  # still captioning: killed mid-run
        process.send_signal(signal.SIGKILL)
        process.wait()
        for path in out.iterdir():  # a visible shard is always whole
            if not path.name.startswith("."):
                shard = int(path.stem)
                assert sorted(r["key"] for r in records_of(path)) == sorted(
                    key for key, _ in everything if key.startswith(f"s{shard:02d}/"))
    assert interrupted >= 2, f"only {interrupted} kills landed mid-run"
    assert subprocess.run(command, check=False, capture_output=True, timeout=600).returncode in (0, 1)  # 1: errors
    keys = [r["key"] for r in records(out)]
    assert sorted(keys) == sorted(key for key, _ in everything)  # each exactly once
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def partial_sizes(out: Path) -> dict[str, int]:
    if not out.exists():
        return {}
    sizes = {}
    for path in out.iterdir():
        if path.name.endswith(PARTIAL_SUFFIX):
            try:
                sizes[path.name] = path.stat().st_size
            except FileNotFoundError:  # sealed meanwhile
                pass
    return sizes


def records_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("link, why", [(os.symlink, "a link"), (os.link, "not this user's own regular file of one name")],
                         ids=["symlink", "hard link"])
def test_a_planted_partial_link_is_refused(tmp_path, capsys, link, why):
    """A partial file that is a link (a symlink, or a hard link: a file of two names) to a file of
    the user's elsewhere is neither appended to nor removed: the run stops naming why."""
    write_shards(tmp_path / "wds", 1, 2)
    out = tmp_path / "o"
    out.mkdir()
    secret = tmp_path / "secret"
    secret.write_text("keep")
    link(secret, out / f".00000{PARTIAL_SUFFIX}")
    assert main(["caption", str(tmp_path / "wds" / "00000.tar"), "--out", str(out)] + FAST) == 2
    assert why in capsys.readouterr().err
    assert secret.read_text() == "keep" and (out / f".00000{PARTIAL_SUFFIX}").exists()


def test_the_job_is_sized_for_the_samples_the_shards_hold(tmp_path):
    """Counted, not guessed: a guess of a thousand a shard turned compile on for a small job."""
    from encoder_graphs.app.dataset_run import stand_in_plan
    from encoder_graphs.app.datasets import find_shards
    from encoder_graphs.app.settings import Settings

    write_shards(tmp_path / "wds", 3, 5)
    shards = find_shards([str(tmp_path / "wds" / "*.tar")])
    plan = stand_in_plan(Settings(paths=(str(tmp_path / "wds"),)), shards, None, {})
    assert plan.todo_by_kind() == {"image": 15} and not plan.todo  # counted: no stand-in file a sample


def test_a_datasets_videos_are_foretold_by_its_first_samples(tmp_path, clip):
    """A batch of videos sizes the job (the rest of the samples, the photos' batches); the video
    decoder's choice (`--video-decoder auto`) reads the first samples' share of videos instead."""
    from encoder_graphs.app.dataset_run import stand_in_plan
    from encoder_graphs.app.datasets import find_shards
    from encoder_graphs.app.settings import Settings

    write_shards(tmp_path / "wds", 40, 5, clip)  # a clip in every shard: a fifth of the samples
    shards = find_shards([str(tmp_path / "wds" / "*.tar")])
    plan = stand_in_plan(Settings(paths=(str(tmp_path / "wds"),)), shards, None, {})
    assert plan.todo_by_kind() == {"image": 136, "video": 64} and plan.videos_to_do() == 40


def test_a_dry_run_of_shards_says_which_video_decoder_auto_takes(tmp_path, capsys, clip):
    write_shards(tmp_path / "wds", 2, 5, clip)
    assert main(["caption", str(tmp_path / "wds" / "*.tar"), "--out", str(tmp_path / "o"), "--device", "cpu",
                 "--dry-run"]) == 0
    assert "video decoder: cpu (--video-decoder auto: 2 videos, fewer than 128 a GPU)" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_an_unreadable_shard_is_reported_and_the_others_complete(tmp_path, capsys):
    write_shards(tmp_path / "wds", 2, 3)
    (tmp_path / "wds" / "00002.tar").write_bytes(b"")
    (tmp_path / "wds" / "00003.tar").write_bytes(b"not a tar at all" * 64)
    assert main(["caption", str(tmp_path / "wds" / "*.tar"), "--out", str(tmp_path / "o")] + FAST) == 1
    said = capsys.readouterr()
    assert "shard 00002" in said.err and "shard 00003" in said.err and "2 of 4 shards complete" in said.out
    assert sorted(p.name for p in (tmp_path / "o").iterdir() if not p.name.startswith(".")) == [
        "00000.jsonl", "00001.jsonl"]


def test_table_rows_keep_their_number_a_path_stays_in_the_dataset_and_columns_load(tmp_path):
    """A null key is the row's number, not "None"; a path column cannot name files out of the
    table's folder (absolute, `..`, a link); nested binary columns are left out, names the record
    has are prefixed until unique; every output shard has the record's columns in one type."""
    pytest.importorskip("datasets")
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "pq"
    data.mkdir()
    (data / "ok.png").write_bytes(image_bytes(1, "PNG"))
    secret = tmp_path / "secret.png"
    secret.write_bytes(image_bytes(2, "PNG"))
    os.symlink(secret, data / "link.png")
    rows = [{"key": None, "image": "ok.png", "caption": "a", "input_caption": "b", "thumb": {"bytes": b"x" * 99}},
            {"key": None, "image": str(secret), "caption": "c", "input_caption": "d", "thumb": {"bytes": b"y"}},
            {"key": "k2", "image": "../secret.png", "caption": "e", "input_caption": "f", "thumb": {"bytes": b"z"}},
            {"key": "k3", "image": "link.png", "caption": "g", "input_caption": "h", "thumb": {"bytes": b"w"}}]
    pq.write_table(pa.Table.from_pylist(rows), data / "a.parquet")
    pq.write_table(pa.Table.from_pylist([{**rows[0], "key": "only"}]), data / "b.parquet")
    assert main(["caption", str(data / "*.parquet"), "--out", str(tmp_path / "o"), "--out-format", "parquet"]
                + FAST) == 1
    got = {r["key"]: r for r in records(tmp_path / "o")}
    assert sorted(got) == ["00000000", "00000001", "k2", "k3", "only"]
    assert got["00000000"]["status"] == "ok" and got["only"]["status"] == "ok"
    for key in ("00000001", "k2", "k3"):
        assert got[key]["error_kind"] == "refused" and "out of the dataset's folder" in got[key]["error"]
    # `caption` would take `input_caption`, which the table has: it goes one prefix further.
    assert "thumb" not in got["k2"] and (got["k2"]["input_input_caption"], got["k2"]["input_caption"]) == ("e", "f")
    loaded = datasets.load_dataset("parquet", data_files=str(tmp_path / "o" / "*.parquet"), split="train")
    assert loaded.num_rows == 5


def test_a_shard_sealed_meanwhile_is_left_alone_and_a_seal_cut_short_is_tidied(tmp_path):
    from encoder_graphs.app.datasets import find_shards
    from encoder_graphs.app.shard_outputs import ShardOutputs, partial_path

    write_shards(tmp_path / "wds", 1, 2)
    out = tmp_path / "o"
    assert main(["caption", str(tmp_path / "wds" / "00000.tar"), "--out", str(out)] + FAST) == 0
    (shard,) = find_shards([str(tmp_path / "wds" / "00000.tar")])
    identity = json.loads((out / "00000.jsonl").read_text().splitlines()[0])["settings"]
    late = ShardOutputs(out, "jsonl", identity, lambda *said: None)
    assert late.begin(shard) is None and "completed it meanwhile" in late.skipped["00000"]
    partial_path(out, "00000").write_text("")  # as a kill between the seal's rename and unlink leaves it
    assert ShardOutputs(out, "jsonl", identity, lambda *said: None).is_complete(shard)
    assert sorted(p.name for p in out.iterdir()) == ["00000.jsonl"]


def test_a_retried_parquet_shard_keeps_its_json_text_columns_as_a_clean_run_writes_them(tmp_path):
    """A carried column of mixed kinds (a map's [key, value] pairs) is stored as JSON text; a
    retry reads the sealed rows back and seals them again: each value encoded once, as a run
    without failures writes it (it was encoded twice: a string holding the JSON text)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def table(broken: set[int]) -> pa.Table:
        media = [b"\xff\xd8 not a jpeg" if n in broken else image_bytes(n, "PNG") for n in range(4)]
        tags = pa.array([[("a", n), ("b", 2 * n)] for n in range(4)], pa.map_(pa.string(), pa.int64()))
        return pa.table({"key": [f"k{n}" for n in range(4)], "image": media, "tags": tags, "n": list(range(4))})

    (tmp_path / "in").mkdir()
    pq.write_table(table({1, 3}), tmp_path / "in" / "p.parquet")
    args = ["caption", str(tmp_path / "in" / "p.parquet"), "--out-format", "parquet"] + FAST
    assert main(args + ["--out", str(tmp_path / "o")]) == 1
    pq.write_table(table(set()), tmp_path / "in" / "p.parquet")  # the broken rows mended
    assert main(args + ["--out", str(tmp_path / "o"), "--retry-failed"]) == 0
    assert main(args + ["--out", str(tmp_path / "clean")]) == 0
    retried, clean = ({r["key"]: r for r in records(tmp_path / name)} for name in ("o", "clean"))
    assert json.loads(clean["k2"]["tags"]) == [["a", 2], ["b", 4]]
    assert {k: (r["tags"], r["n"]) for k, r in retried.items()} == {k: (r["tags"], r["n"]) for k, r in clean.items()}
    assert {k: r["caption"] for k, r in retried.items()} == {k: r["caption"] for k, r in clean.items()}


def test_a_retry_is_not_skipped_when_a_copier_removes_the_partial_it_locks(tmp_path, monkeypatch):
    """A --retry-failed process opens the partial file a --webdataset-copy process made to copy
    the sealed shard; the copier writes its copy, removes the file and lets go; the retry locks the
    removed file. The shard still has errors: the retry takes the file there now, not 'completed'."""
    import fcntl

    from encoder_graphs.app.shard_outputs import ShardOutputs, first_settings, partial_path, sealed_records

    write_shards(tmp_path / "wds", 1, 4)  # sample 3 is a corrupt JPEG: an error record
    out = tmp_path / "o"
    assert main(["caption", str(tmp_path / "wds" / "00000.tar"), "--out", str(out)] + FAST) == 1
    settings = first_settings(out / "00000.jsonl")
    shard = InputShard("00000", tmp_path / "wds" / "00000.tar", "webdataset")
    copier = ShardOutputs(out, "jsonl", settings, lambda *_: None, webdataset_copy=True)
    retry = ShardOutputs(out, "jsonl", settings, lambda *_: None, retry_failed=True)
    assert not retry.is_complete(shard)
    path = partial_path(out, "00000")
    held = copier._locked_partial(path)  # the copier holds the partial file it made
    real = fcntl.flock

    def flock(descriptor, operation):  # the retry opened the copier's file; the copier ends first
        monkeypatch.setattr(fcntl, "flock", real)
        if descriptor != held:
            copier._write_copy(shard, sealed_records(out / "00000.jsonl", False))
            os.unlink(path)
            os.close(held)
        return real(descriptor, operation)

    monkeypatch.setattr(fcntl, "flock", flock)
    began = retry.begin(shard)
    assert began is not None, retry.skipped
    assert sorted(began.values()) == [False, True, True, True]  # the sealed records seed it, one an error
    retry.close()


def test_a_samples_error_names_its_key_as_the_tar_spells_it(tmp_path):
    """A tar made with `tar cf x.tar .` keys its samples `./NAME`: a bad sample's error, an image's
    or a video's (decoded in a worker process), names it so (the key the output record holds), not
    as a path would spell it."""
    (tmp_path / "wds").mkdir()
    good = io.BytesIO()
    Image.new("RGB", (32, 32)).save(good, "PNG")
    with tarfile.open(tmp_path / "wds" / "00000.tar", "w") as tar:
        for name, data in (("./0001.png", b"not a png"), ("./0002.png", good.getvalue()), ("./0003.mp4", b"not a clip")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    out = tmp_path / "o"
    assert main(["caption", str(tmp_path / "wds" / "00000.tar"), "--out", str(out)] + FAST) == 1
    by_key = {record["key"]: record for record in records(out)}
    assert by_key["./0002"].get("caption") is not None
    assert by_key["./0001"]["error"].startswith("00000/./0001: "), by_key["./0001"]["error"]
    assert by_key["./0003"]["error"].startswith("00000/./0003: "), by_key["./0003"]["error"]
