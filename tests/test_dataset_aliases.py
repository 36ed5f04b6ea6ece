"""Where the dataset tool's parts meet (a review of the issue-25 merges): a file under several
names is checked and written under every name, a sidecar that failed is retried from the caption
it followed, part files that are not ours are refused, and no output or header read opens a FIFO.
The embedded tiny model on the CPU."""

import json
import os
from pathlib import Path

import pytest
from test_cli import model_cache  # noqa: F401 (autouse: a private model cache for this module)
from test_dataset_tool import FAST, images, records

from encoder_graphs.app.cli import main
from encoder_graphs.app.distributed import by_cost
from encoder_graphs.app.walk import MediaFile


def linked_dataset(tmp_path: Path) -> tuple[Path, Path, Path]:
    """ds/a.png, ds/c.png and ds/sub/b.png, a link to a.png: (the folder, a.png, the link)."""
    data = tmp_path / "ds"
    first, _ = images(data, 2)
    (data / "sub").mkdir()
    link = data / "sub" / "b.png"
    link.symlink_to(Path("..") / first.name)
    return data, first, link


def test_an_other_names_sidecar_is_checked_against_out(tmp_path, capsys):
    data, _, link = linked_dataset(tmp_path)
    out = link.with_suffix(".txt")  # where the link's sidecar goes
    assert main(["caption", str(data), "--out", str(out), "--sidecar", "--overwrite", *FAST]) == 2
    assert "sidecar" in capsys.readouterr().err and not out.exists()


def test_a_failed_sidecar_of_an_other_name_fails_the_run_and_a_rerun_writes_it(tmp_path):
    data, first, link = linked_dataset(tmp_path)
    blocker = link.with_suffix(".txt")
    blocker.mkdir()  # a folder where the link's sidecar goes
    out = tmp_path / "run.jsonl"
    argv = ["caption", str(data), "--out", str(out), "--sidecar", *FAST]
    assert main(argv) == 1
    assert first.with_suffix(".txt").is_file() and any("sidecar_error" in r for r in records(out))
    blocker.rmdir()
    assert main(argv) == 0  # written from the caption already in --out, nothing captioned again
    assert blocker.read_text() == first.with_suffix(".txt").read_text()


def test_a_failed_sidecar_leaves_the_caption_its_metadata_row(tmp_path):
    data = tmp_path / "ds"
    first, second = images(data, 2)
    first.with_suffix(".txt").mkdir()
    out = tmp_path / "run.jsonl"
    assert main(["caption", str(data), "--out", str(out), "--sidecar", *FAST]) == 1
    # Without --sidecar nothing is missing: both files have captions (a sidecar's failure is no file's error).
    assert main(["caption", str(data), "--out", str(out), "--hf-metadata", *FAST]) == 0
    rows = (data / "metadata.jsonl").read_text()
    assert first.name in rows and second.name in rows


def test_files_named_like_parts_of_another_user_or_program_are_left_alone(tmp_path, capsys):
    """`run.jsonl.part1` (the user's own earlier --out) is no part of ours; another user's planted
    `<out>.encoder-graphs-part7` is not merged: no injected caption, no lockout (issue 42, case 2)."""
    images(tmp_path / "ds", 1)
    out = tmp_path / "run.jsonl"
    notes = Path(f"{out}.part1")
    notes.write_text("my notes\n")
    planted = Path(f"{out}.encoder-graphs-part7")
    planted.write_text(json.dumps({"path": str(tmp_path / "ds" / "img00.png"), "caption": "INJECTED"}) + "\n")
    if os.geteuid() == 0:
        os.chown(planted, 4242, 4242)
    else:
        planted.unlink()
    assert main(["caption", str(tmp_path / "ds"), "--out", str(out), *FAST]) == 0
    assert notes.read_text() == "my notes\n" and "INJECTED" not in out.read_text()
    if os.geteuid() == 0:
        assert planted.exists() and "left alone 1 files named as part files" in capsys.readouterr().err


def test_a_fifo_as_metadata_jsonl_is_refused_before_the_model_loads(tmp_path, capsys):
    images(tmp_path / "ds", 1)
    os.mkfifo(tmp_path / "ds" / "metadata.jsonl")
    argv = ["caption", str(tmp_path / "ds"), "--out", str(tmp_path / "run.jsonl"), "--hf-metadata", *FAST]
    assert main(argv) == 2
    assert "FIFO" in capsys.readouterr().err


def test_ordering_by_cost_never_opens_a_fifo(tmp_path):
    (image,) = images(tmp_path, 1)
    fifo = tmp_path / "x.jpg"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer: the test would hang
    ordered = by_cost([MediaFile(fifo, "image"), MediaFile(image, "image")])
    assert [f.path for f in ordered] == [image, fifo]


@pytest.mark.parametrize("flag", ["--prefix", "--suffix"])
def test_text_that_is_not_utf8_is_a_usage_error(tmp_path, flag, capsys):
    images(tmp_path / "ds", 1)
    odd = os.fsdecode(b"\xff ")  # what a shell passes for bytes that are not UTF-8
    argv = ["caption", str(tmp_path / "ds"), "--out", str(tmp_path / "run.jsonl"), "--sidecar", flag, odd, *FAST]
    assert main(argv) == 2
    assert f"{flag} is not valid UTF-8" in capsys.readouterr().err


def test_a_foreign_part_file_where_a_rank_would_write_refuses_the_job(tmp_path):
    """Under torchrun a rank opens `<out>.encoder-graphs-part<rank>`: another user's file there
    would take its records and be merged, so the job is refused before any model loads."""
    from torch.distributed import HashStore

    from encoder_graphs.app.distributed import Job, part_path
    from encoder_graphs.app.errors import UsageError
    from encoder_graphs.app.plan import make_plan
    from encoder_graphs.app.settings import Settings

    if os.geteuid() != 0:
        pytest.skip("planting another user's file needs root")
    images(tmp_path / "ds", 1)
    out = tmp_path / "run.jsonl"
    planted = part_path(out, 1)
    planted.write_text("")
    os.chown(planted, 4242, 4242)
    with pytest.raises(UsageError, match="not this user's regular file"):
        make_plan(Settings(paths=(str(tmp_path / "ds"),), out=out), Job(0, 2, 0, HashStore()))
    assert planted.exists() and not out.exists()
