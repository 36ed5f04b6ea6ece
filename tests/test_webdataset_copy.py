"""`--webdataset-copy` (issue 43): each tar shard copied into --out with its captions added, every
input member kept byte for byte and in order; written for shards sealed earlier on a rerun;
refused where it cannot apply or would write over its input."""

import io
import json
import tarfile
from pathlib import Path

import pytest
from test_cli import model_cache  # noqa: F401 (autouse: a private model cache for this module)
from test_shards import FAST, records, write_shards

from encoder_graphs.app.cli import main
from encoder_graphs.app.datasets import sample_key


def members(path: Path) -> list[tuple[str, bytes]]:
    with tarfile.open(path) as tar:
        return [(member.name, tar.extractfile(member).read()) for member in tar if member.isfile()]


def assert_copy_of(copy: Path, source: Path, by_key: dict[str, dict], named: tuple[str, ...] = ()) -> None:
    """The copy is the source's members in order, each sample followed by its caption members."""
    got, expected = members(copy), []
    sample = None
    for name, data in [*members(source), ("", b"")]:
        key = sample_key(name)[0] if name else None
        if sample is not None and key != sample:
            record = by_key[sample]
            if record.get("error") is None:
                texts = ([(f"caption.{n}.txt", record["captions"][n]) for n in named]
                         or [("caption.txt", record["caption"])])
                expected += [(f"{sample}.{ext}", text.encode()) for ext, text in texts]
            expected.append((f"{sample}.caption.json", None))
        sample = key
        if name and ".caption." not in name:
            expected.append((name, data))
    assert [name for name, _ in got] == [name for name, _ in expected]
    for (name, data), (_, want) in zip(got, expected):
        if want is not None:
            assert data == want, name
        else:
            record = json.loads(data)
            assert record["key"] == name.removesuffix(".caption.json") and record["status"] in ("ok", "error")
            assert record.get("caption") == by_key[record["key"]].get("caption")


def test_each_tar_shard_is_copied_with_its_captions_and_errors(tmp_path):
    write_shards(tmp_path / "wds", 2, 5)
    with tarfile.open(tmp_path / "wds" / "00001.tar", "a") as tar:  # a member named as ours is replaced
        info = tarfile.TarInfo("s01/k0004.caption.txt")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"stale"))
    out = tmp_path / "o"
    assert main(["caption", str(tmp_path / "wds" / "*.tar"), "--out", str(out), "--webdataset-copy"] + FAST) == 1
    by_key = {record["key"]: record for record in records(out)}
    assert len(by_key) == 10 and sum("error" in r for r in by_key.values()) == 2  # the corrupt JPEGs
    for name in ("00000", "00001"):
        assert_copy_of(out / f"{name}.tar", tmp_path / "wds" / f"{name}.tar", by_key)
    assert sorted(p.name for p in out.iterdir()) == ["00000.jsonl", "00000.tar", "00001.jsonl", "00001.tar"]


@pytest.mark.parametrize("out_format", ["jsonl", "parquet"])
def test_a_rerun_with_the_flag_copies_shards_sealed_before(tmp_path, capsys, out_format):
    pytest.importorskip("pyarrow") if out_format == "parquet" else None
    write_shards(tmp_path / "wds", 1, 4)
    named = ("short", "tags")
    args = ["caption", str(tmp_path / "wds" / "00000.tar"), "--out", str(tmp_path / "o"), "--out-format", out_format,
            "--prompt", "short=One line.", "--prompt", "tags=Tags."] + FAST
    assert main(args) == 1
    assert not (tmp_path / "o" / "00000.tar").exists()
    assert main(args + ["--webdataset-copy"]) == 0  # nothing to caption: the copy only
    assert "1 complete" in capsys.readouterr().err
    by_key = {record["key"]: record for record in records(tmp_path / "o")}
    for record in by_key.values():
        if isinstance(record.get("captions"), str):  # Parquet keeps a mapping as JSON text
            record["captions"] = json.loads(record["captions"])
    assert_copy_of(tmp_path / "o" / "00000.tar", tmp_path / "wds" / "00000.tar", by_key, named)


def test_the_copy_is_refused_where_it_cannot_apply(tmp_path, capsys):
    write_shards(tmp_path / "wds", 1, 2)
    tar = str(tmp_path / "wds" / "00000.tar")
    assert main(["caption", tar, "--out", str(tmp_path / "wds"), "--webdataset-copy"] + FAST) == 2
    assert "over the input shard" in capsys.readouterr().err
    assert main(["caption", str(tmp_path / "wds"), "--out", str(tmp_path / "x.jsonl"), "--webdataset-copy"]) == 2
    assert "--webdataset-copy applies to dataset shards" in capsys.readouterr().err
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.table({"key": ["a"], "image": [b"x"]}), tmp_path / "t.parquet")
    assert main(["caption", str(tmp_path / "t.parquet"), "--out", str(tmp_path / "p"), "--webdataset-copy"] + FAST) == 2
    assert "copies .tar shards" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


def test_retry_failed_opens_sealed_shards_again_for_their_errors_only(tmp_path, capsys):
    samples = write_shards(tmp_path / "wds", 2, 4)
    args = ["caption", str(tmp_path / "wds" / "*.tar"), "--out", str(tmp_path / "o"), "--webdataset-copy"] + FAST
    assert main(args) == 1
    first = {record["key"]: record for record in records(tmp_path / "o")}
    assert [key for key, record in first.items() if "error" in record] == ["s00/k0003", "s01/k0003"]
    fixed = tmp_path / "wds" / "00001.tar"  # the bad member replaced: its retry now captions
    with tarfile.open(fixed, "w") as tar:
        for key, sample in samples[4:]:
            for extension, data in sample.items():
                if key == "s01/k0003" and extension == "jpg":
                    data = members_of(samples, "s00/k0001")["jpg"]
                info = tarfile.TarInfo(f"{key}.{extension}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    assert main(args) == 0 and "2 complete" in capsys.readouterr().err  # without the flag: done is done
    assert main(args + ["--retry-failed"]) == 1  # 00000's JPEG is still corrupt
    err = capsys.readouterr().err
    assert "0 complete" in err and "2 to caption" in err
    again = {record["key"]: record for record in records(tmp_path / "o")}
    assert sorted(again) == sorted(first)
    assert "error" in again["s00/k0003"] and "error" not in again["s01/k0003"]
    for key in set(first) - {"s00/k0003", "s01/k0003"}:
        assert again[key] == first[key]  # kept as sealed, not captioned again
    assert not [p for p in (tmp_path / "o").iterdir() if p.name.startswith(".")]
    assert_copy_of(tmp_path / "o" / "00001.tar", fixed, again)


def members_of(samples: list[tuple[str, dict]], key: str) -> dict:
    return next(members for name, members in samples if name == key)


def test_a_second_retry_of_a_shard_another_process_retried_meanwhile_leaves_it(tmp_path):
    from encoder_graphs.app.datasets import InputShard
    from encoder_graphs.app.shard_outputs import ShardOutputs, first_settings

    write_shards(tmp_path / "wds", 1, 4)
    out = tmp_path / "o"
    assert main(["caption", str(tmp_path / "wds" / "00000.tar"), "--out", str(out)] + FAST) == 1
    settings = first_settings(out / "00000.jsonl")
    shard = InputShard("00000", tmp_path / "wds" / "00000.tar", "webdataset")
    first, second = (ShardOutputs(out, "jsonl", settings, lambda *_: None, retry_failed=True) for _ in range(2))
    assert not first.is_complete(shard) and not second.is_complete(shard)  # both see the error
    assert first.begin(shard)["s00/k0003"] is False
    first.write([{"key": "s00/k0003", "shard": "00000", "kind": "image", "caption": "fixed", "settings": settings}])
    first.ended("00000", 1)
    assert second.begin(shard) is None and "completed it meanwhile" in second.skipped["00000"]
    assert {r["key"]: r.get("caption") for r in records(out)}["s00/k0003"] == "fixed"


def test_parquet_named_retries_keep_the_other_rows_as_written(tmp_path):
    pytest.importorskip("pyarrow")
    samples = write_shards(tmp_path / "wds", 1, 4)
    args = ["caption", str(tmp_path / "wds" / "00000.tar"), "--out", str(tmp_path / "o"), "--out-format", "parquet",
            "--prompt", "short=One line.", "--prompt", "tags=Tags."] + FAST
    assert main(args) == 1
    before = {r["key"]: r for r in records(tmp_path / "o")}
    with tarfile.open(tmp_path / "wds" / "00000.tar", "w") as tar:  # the corrupt JPEG replaced
        for key, sample in samples:
            for extension, data in sample.items():
                data = members_of(samples, "s00/k0001")["jpg"] if key == "s00/k0003" and extension == "jpg" else data
                info = tarfile.TarInfo(f"{key}.{extension}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    assert main(args + ["--retry-failed"]) == 0
    after = {r["key"]: r for r in records(tmp_path / "o")}
    for key in ("s00/k0000", "s00/k0001", "s00/k0002"):
        assert after[key] == before[key]
        assert isinstance(json.loads(after[key]["tokens"]), dict)  # encoded once, as first written
    assert after["s00/k0003"]["error"] is None


def test_copies_in_dry_runs_stale_temporaries_and_odd_members(tmp_path):
    write_shards(tmp_path / "wds", 1, 2)
    with tarfile.open(tmp_path / "wds" / "00000.tar", "a") as tar:  # a member of the sample's own, kept
        info = tarfile.TarInfo("s00/k0001.caption")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"mine"))
    out, tar = tmp_path / "o", str(tmp_path / "wds" / "00000.tar")
    assert main(["caption", tar, "--out", str(out)] + FAST) == 0
    assert main(["caption", tar, "--out", str(out), "--webdataset-copy", "--dry-run"] + FAST) == 0
    assert not (out / "00000.tar").exists()  # a dry run writes nothing
    stale = out / ".00000.tar.encoder-graphs-tmp-abcdefgh"
    stale.write_bytes(b"x" * 100)
    (out / "00000.tar").symlink_to(tmp_path / "nowhere")  # a dangling link where the copy goes: replaced
    assert main(["caption", tar, "--out", str(out), "--webdataset-copy"] + FAST) == 0
    assert not stale.exists() and not (out / "00000.tar").is_symlink()
    assert dict(members(out / "00000.tar"))["s00/k0001.caption"] == b"mine"
    assert_copy_of(out / "00000.tar", tmp_path / "wds" / "00000.tar", {r["key"]: r for r in records(out)})


def test_a_copy_at_start_is_written_under_its_shards_lock_and_once(tmp_path, capsys):
    """Sealed shards copied on a rerun: each copy under the shard's lock (its partial file's, which
    a process captioning or copying the shard holds): one held elsewhere is left to its holder,
    one written before is not written again, and each is what a run with the flag writes."""
    import fcntl
    import os
    import shutil

    from encoder_graphs.app.shard_outputs import partial_path

    write_shards(tmp_path / "wds", 2, 3)
    shards, out, single = str(tmp_path / "wds" / "*.tar"), tmp_path / "o", tmp_path / "single"
    assert main(["caption", shards, "--out", str(out)] + FAST) == 0
    shutil.copytree(out, single)  # the same records, copied by one run alone
    assert main(["caption", shards, "--out", str(single), "--webdataset-copy"] + FAST) == 0
    held = os.open(partial_path(out, "00000"), os.O_RDWR | os.O_CREAT, 0o600)  # as another process holds it
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        capsys.readouterr()
        assert main(["caption", shards, "--out", str(out), "--webdataset-copy"] + FAST) == 0
        assert not (out / "00000.tar").exists() and (out / "00001.tar").exists()
        assert "shard 00000: its WebDataset copy is left to the process holding the shard" in capsys.readouterr().err
    finally:
        os.unlink(partial_path(out, "00000"))  # its holder's, gone with it
        os.close(held)
    first = (out / "00001.tar").stat()
    assert main(["caption", shards, "--out", str(out), "--webdataset-copy"] + FAST) == 0
    again = (out / "00001.tar").stat()
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)  # written once
    for name in ("00000", "00001"):
        assert members(out / f"{name}.tar") == members(single / f"{name}.tar")
    assert sorted(p.name for p in out.iterdir()) == ["00000.jsonl", "00000.tar", "00001.jsonl", "00001.tar"]


def test_two_processes_copying_the_same_sealed_shards_at_once_leave_each_copy_whole(tmp_path):
    """Two ShardOutputs (as two processes: each its own descriptors, so their locks meet) copy
    the same sealed shards at once: every copy whole, each as a run alone writes it, no partial
    file left."""
    import shutil
    import threading

    from encoder_graphs.app.datasets import find_shards
    from encoder_graphs.app.shard_outputs import ShardOutputs, first_settings

    write_shards(tmp_path / "wds", 6, 2)
    shards, out, single = str(tmp_path / "wds" / "*.tar"), tmp_path / "o", tmp_path / "single"
    assert main(["caption", shards, "--out", str(out)] + FAST) == 0
    shutil.copytree(out, single)
    assert main(["caption", shards, "--out", str(single), "--webdataset-copy"] + FAST) == 0
    settings, found = first_settings(out / "00000.jsonl"), find_shards([shards])
    start, complete = threading.Barrier(2), []

    def copy_all() -> None:
        outputs = ShardOutputs(out, "jsonl", settings, lambda *_: None, webdataset_copy=True)
        start.wait()
        complete.append(all(outputs.is_complete(shard) for shard in found) and not outputs.failed)

    threads = [threading.Thread(target=copy_all) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert complete == [True, True]
    for shard in found:
        assert members(out / f"{shard.name}.tar") == members(single / f"{shard.name}.tar")
    assert not [p for p in out.iterdir() if p.name.startswith(".")]
