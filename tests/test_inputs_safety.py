"""What a dataset folder can hold that must neither hang, exhaust nor mislead a run (issue 25's
input side): links into /proc, /sys and /dev, link cycles, `--no-follow-links`, one file under
several names, FIFOs, sockets and devices, images whose header promises an absurd bitmap, prompt
templates and prompt files that would grow without bound, a video's recorded size. CPU, the
embedded tiny model."""

import os
import shutil
import threading
import time
from pathlib import Path

import pytest
from test_cli import good_images, lines_of, model_cache  # noqa: F401 (autouse: a private model cache)

from encoder_graphs.app.cli import main
from encoder_graphs.app.media import MAX_FOLDER_NAMES, LoadLimits, MediaError, MediaFile, discover, load

FAST = ["--max-new-tokens", "3", "--quiet"]
LIMITS = LoadLimits(max_pixels=224 * 224, frame_max_pixels=112 * 112, max_frames=8)


def load_in_time(file: MediaFile, seconds: float = 10.0) -> MediaError:
    """The MediaError `load` raises, on a thread: a load that blocks fails the test, not the run."""
    outcome: list[BaseException | object] = []

    def target() -> None:
        try:
            outcome.append(load(file, LIMITS))
        except BaseException as error:  # noqa: BLE001 (reported below)
            outcome.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"loading {file.path} blocked"
    assert isinstance(outcome[0], MediaError), outcome[0]
    return outcome[0]


# -- 9: symlinks ---------------------------------------------------------------------------------


def test_links_into_proc_sys_and_dev_are_refused_not_walked(tmp_path):
    data = tmp_path / "data"
    good_images(data, 1)
    (data / "fds").symlink_to("/proc/self/fdinfo")
    (data / "zero.jpg").symlink_to("/dev/zero")
    expected = {"img00.png": "image", "fds": "folder", "zero.jpg": "image"}
    if Path("/sys/kernel").is_dir():
        (data / "kernel").symlink_to("/sys/kernel")
        expected["kernel"] = "folder"
    files = discover([data])
    assert {f.path.name: f.kind for f in files} == expected
    for file in (f for f in files if f.path.name != "img00.png"):
        error = load_in_time(file)
        assert error.kind == "special" and "pseudo-filesystem" in str(error) and str(file.path) in str(error)


def test_a_root_given_inside_dev_is_walked(tmp_path):
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        pytest.skip("no writable /dev/shm")
    root = Path(os.path.realpath(shm)) / f"encoder-graphs-test-{os.getpid()}"
    try:
        good_images(root / "sub", 1)
        (root / "out").symlink_to("/proc/self/fdinfo")
        files = discover([root])
        assert [(f.path.relative_to(root).as_posix(), f.reason == "") for f in files] == [
            ("out", False),
            ("sub/img00.png", True),
        ]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_link_to_proc_self_is_an_error_record_not_a_walk_of_the_disk(tmp_path):
    good_images(tmp_path / "data", 2)
    (tmp_path / "data" / "me").symlink_to("/proc/self")  # /proc/self/root is /
    out = tmp_path / "r.jsonl"
    assert main(["caption", str(tmp_path / "data"), "--out", str(out)] + FAST) == 1
    by_name = {Path(r["path"]).name: r for r in lines_of(out)}
    assert sorted(by_name) == ["img00.png", "img01.png", "me"]
    assert by_name["me"]["error_kind"] == "special" and "/proc" in by_name["me"]["error"]


def test_no_follow_links_keeps_the_run_inside_the_roots(tmp_path):
    data, outside = tmp_path / "data", tmp_path / "outside"
    good_images(data, 1)
    good_images(outside / "sub", 2)
    (data / "linked").symlink_to(outside)
    (data / "borrowed.png").symlink_to(outside / "sub" / "img00.png")
    (data / "again.png").symlink_to(data / "img00.png")
    (tmp_path / "root").symlink_to(data)
    assert [f.path for f in discover([data], follow_links=False)] == [data / "img00.png"]
    assert [f.path for f in discover([tmp_path / "root"], follow_links=False)] == [tmp_path / "root" / "img00.png"]
    assert len(discover([data])) == 3, "followed by default"
    out = tmp_path / "r.jsonl"
    assert main(["caption", str(data), "--out", str(out), "--no-follow-links", "--sidecar"] + FAST) == 0
    assert [r["path"] for r in lines_of(out)] == [str(data / "img00.png")]
    assert not (outside / "sub" / "img00.txt").exists() and not (data / "again.txt").exists()


def test_a_file_under_several_names_is_captioned_once_and_every_name_gets_its_sidecar(tmp_path):
    data = tmp_path / "data"
    good_images(data, 1)
    (data / "link.png").symlink_to(data / "img00.png")  # sorts after: the real file is the record's path
    (data / "a_link.png").symlink_to("img00.png")  # sorts before: still the real file
    (file,) = discover([data])
    assert file.path == data / "img00.png"
    assert file.aliases == (data / "a_link.png", data / "link.png") and file.names[0] == file.path
    # Two linked roots to one folder: one file, a name under each root.
    (tmp_path / "one").symlink_to(data)
    (tmp_path / "two").symlink_to(data)
    (file,) = discover([tmp_path / "two", tmp_path / "one"])
    assert file.path == tmp_path / "one" / "a_link.png"
    assert set(file.names) == {tmp_path / root / name for root in ("one", "two")
                               for name in ("a_link.png", "img00.png", "link.png")}
    out = tmp_path / "r.jsonl"
    assert main(["caption", str(data), "--out", str(out), "--sidecar"] + FAST) == 0
    (record,) = lines_of(out)
    assert record["path"] == str(data / "img00.png")
    for name in ("img00", "link", "a_link"):
        assert (data / f"{name}.txt").read_text() == record["text"] + "\n", name
    assert not (data / f"{name}.txt").is_symlink()
    # A name added later gets its sidecar from the record; nothing is captioned again.
    (data / "late.png").symlink_to(data / "img00.png")
    assert main(["caption", str(data), "--out", str(out), "--sidecar"] + FAST) == 0
    assert len(lines_of(out)) == 1 and (data / "late.txt").read_text() == record["text"] + "\n"


def test_link_cycles_and_link_lattices_end_quickly(tmp_path):
    data = tmp_path / "data"
    good_images(data / "A", 1)
    good_images(data / "B", 1)
    (data / "A" / "toB").symlink_to(data / "B")
    (data / "B" / "toA").symlink_to(data / "A")  # A -> B -> A
    (data / "B" / "self").symlink_to(".")
    files = discover([data])
    assert [f.path.relative_to(data).as_posix() for f in files] == ["A/img00.png", "B/img00.png"]
    assert files[0].aliases == (data / "B" / "toA" / "img00.png",)
    # Each level links to the next twice: 2**24 names for the last folder's file.
    levels = tmp_path / "levels"
    for level in range(24):
        (levels / str(level)).mkdir(parents=True)
        if level:
            for name in ("x", "y"):
                (levels / str(level - 1) / name).symlink_to(levels / str(level))
    good_images(levels / "23", 1)
    started = time.monotonic()
    files = discover([levels / "0"])
    assert time.monotonic() - started < 10
    deep = [f for f in files if f.kind == "image"]
    assert len(deep) == 1 and len(deep[0].names) <= MAX_FOLDER_NAMES
    refused = [f for f in files if f.kind == "folder"]
    assert refused and all(f"more than {MAX_FOLDER_NAMES} names" in f.reason for f in refused)
