"""The caption command's outputs, tried as a careless user and as an attacker would (issue 25, CPU,
the embedded tiny model): an --out or --stats-json that is not ours, an input, a special file or
another output is refused before the model loads; the lock holds by the file's identity and
follows no symlink; sidecars are never forced over another run's and one that cannot be written is
an error record; temporaries fit NAME_MAX and a killed run's are removed; an output that cannot be
written mid-run exits 3 with nothing lost."""

import fcntl
import json
import os
import resource
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from privileges import code_env, unprivileged
from test_cli import model_cache  # noqa: F401 (autouse: a private model cache for this module)
from test_dataset_tool import FAST, images, records

from encoder_graphs.app import loading
from encoder_graphs.app.cli import main
from encoder_graphs.app.outputs import NAME_MAX, Outputs, SidecarPolicy, temp_prefix
from encoder_graphs.app.results import ResultsFile, ResultsLocked
from encoder_graphs.presets.default_model import default_model_dir


@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if a run gets as far as loading the model."""
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("the model loaded"))


def refused(argv: list[str], capsys, *expected: str) -> None:
    assert main(argv + FAST) == 2, argv
    err = capsys.readouterr().err
    for text in expected:
        assert text in err, (text, err)


def cli(argv: list[str], *, fsize: int | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """The command in a subprocess (this worktree's code), optionally with files capped at `fsize` bytes."""
    limit = None if fsize is None else lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    command = [sys.executable, "-m", "encoder_graphs", "caption", *argv, *FAST]
    return subprocess.run(
        command, env=code_env(), capture_output=True, text=True, timeout=timeout, preexec_fn=limit, check=False
    )


# -- 2: --out / --stats-json that are not ours, inputs, sidecars, or another output --------------------


def test_out_and_stats_json_that_are_not_ours_are_refused_untouched(tmp_path, capsys, no_model):
    images(tmp_path / "data", 2)
    data = str(tmp_path / "data")
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"buy milk\ncall Bob")  # no newline at the end: not a half-written record
    refused(["caption", data, "--out", str(notes)], capsys, f"cannot use --out {notes}: {notes} is not a results file")
    tiny = tmp_path / "tiny.json"
    tiny.write_bytes(b'{"a": 1}')  # one unterminated line: not the start of a record either
    refused(["caption", data, "--out", str(tiny)], capsys, str(tiny))
    config = tmp_path / "config.json"
    config.write_text('{"model": "mine"}\n')
    refused(["caption", data, "--out", str(tmp_path / "r.jsonl"), "--stats-json", str(config)], capsys,
            f"cannot use --stats-json {config}", "not statistics")
    assert notes.read_bytes() == b"buy milk\ncall Bob" and tiny.read_bytes() == b'{"a": 1}'
    assert config.read_text() == '{"model": "mine"}\n'
    assert not (tmp_path / "r.jsonl").exists()


def test_inputs_and_sidecar_targets_are_refused_as_outputs(tmp_path, capsys, no_model):
    files = images(tmp_path / "data", 3)
    data = str(tmp_path / "data")
    before = {file: file.read_bytes() for file in files}
    out = str(tmp_path / "r.jsonl")
    refused(["caption", data, "--out", str(files[2])], capsys, f"cannot use --out {files[2]}")
    refused(["caption", data, "--out", out, "--stats-json", str(files[1])], capsys, f"--stats-json {files[1]}")
    # Not there yet, but the next walk would caption it.
    refused(["caption", data, "--out", str(tmp_path / "data" / "new.png")], capsys, "image or video")
    # An input under another name: a hard link named like a results file.
    (tmp_path / "linked.jsonl").hardlink_to(files[0])
    refused(["caption", data, "--out", str(tmp_path / "linked.jsonl")], capsys, f"that is {files[0]}")
    # The sidecar of img01.png would replace the results file mid-run.
    sidecar = files[1].with_suffix(".txt")
    refused(["caption", data, "--out", str(sidecar), "--sidecar"], capsys, f"the sidecar of {files[1]}")
    assert {file: file.read_bytes() for file in files} == before
    assert not sidecar.exists() and not (tmp_path / "data" / "new.png").exists()


def test_two_outputs_naming_one_file_are_refused(tmp_path, capsys, no_model):
    images(tmp_path / "data", 1)
    data = str(tmp_path / "data")
    out = tmp_path / "r.jsonl"
    out.write_text(json.dumps({"path": "/x.png", "caption": "kept"}) + "\n")
    before = out.read_bytes()
    (tmp_path / "stats-link.json").symlink_to(out)
    (tmp_path / "stats-hard.json").hardlink_to(out)
    for stats in ("stats-link.json", "stats-hard.json", "r.jsonl"):
        refused(["caption", data, "--out", str(out), "--stats-json", str(tmp_path / stats)], capsys,
                f"cannot use --stats-json {tmp_path / stats}: the same file as --out {out}")
    (tmp_path / "meta.jsonl").symlink_to(tmp_path / "data" / "metadata.jsonl")  # dangling: made by the run
    refused(["caption", data, "--out", str(tmp_path / "meta.jsonl"), "--hf-metadata"], capsys, "the same file as")
    assert out.read_bytes() == before


def test_our_own_outputs_are_accepted_on_a_rerun(tmp_path):
    images(tmp_path / "data", 2)
    argv = ["caption", str(tmp_path / "data"), "--out", str(tmp_path / "r.jsonl"), "--stats-json",
            str(tmp_path / "s.json"), "--hf-metadata", "--batch-size", "1"]
    assert main(argv + FAST) == 0
    (tmp_path / "data" / "img99.png").write_bytes((tmp_path / "data" / "img00.png").read_bytes())
    assert main(argv + FAST) == 0, "--out, --stats-json and metadata.jsonl written by the first run"
    assert len(records(tmp_path / "r.jsonl")) == 3
    assert json.loads((tmp_path / "s.json").read_text())["pipeline"]["skipped"] == 2


# -- 8, 10: the lock by the file's identity, never through a symlink --------------------------------


def test_an_odd_lock_file_is_left_alone_and_blocks_no_run(tmp_path, capsys):
    """`<out>.lock` only names the holder: a symlink, a hard link, a FIFO or a folder planted
    there is neither written nor a lockout; the flock on --out holds all the same (issue 42, case 6)."""
    images(tmp_path / "data", 1)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "r.jsonl"
    lock = Path(f"{out}.lock")
    plants = {"symlink": lambda: lock.symlink_to(victim), "hard link": lambda: lock.hardlink_to(victim),
              "FIFO": lambda: os.mkfifo(lock), "folder": lambda: lock.mkdir()}
    for what, plant in plants.items():
        plant()
        with ResultsFile(out) as results:
            assert results.lock_note is not None and "left alone" in results.lock_note, what
            with pytest.raises(ResultsLocked):
                ResultsFile(out)
        capsys.readouterr()
        assert main(["caption", str(tmp_path / "data"), "--out", str(out)] + FAST) == 0, what
        assert "left alone; --out is locked all the same" in capsys.readouterr().err, what
        assert victim.read_text() == "precious\n" and len(records(out)) == 1, what
        lock.rmdir() if what == "folder" else lock.unlink()
    with ResultsFile(out) as results:
        assert results.lock_note is None and json.loads(lock.read_text())["pid"] == os.getpid()


def _flock_held_by(path: Path, uid: int) -> int:
    """A child process of `uid` that holds a flock on `path` (opened for reading, as any user who
    can read it can) until killed: its pid."""
    ready_read, ready_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no return
        try:
            fd = os.open(path, os.O_RDONLY)
            if uid != os.geteuid():
                os.setgid(uid)
                os.setuid(uid)
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(ready_write, b"x")
            time.sleep(600)
        finally:
            os._exit(0)
    os.close(ready_write)
    assert os.read(ready_read, 1) == b"x"
    os.close(ready_read)
    return pid


def _stop(pid: int) -> None:
    os.kill(pid, 9)
    os.waitpid(pid, 0)


def test_another_users_flock_on_out_is_passed_over_and_ours_still_meet(tmp_path, capsys):
    """Any user who can read --out can hold a flock on it: one held by another user's process
    alone keeps no run out, and is named; two runs of ours still meet on the holder's file, which
    is ours alone (0600). With that file planted too, the run goes on and says it is unlocked.
    A process of our own holding the flock still refuses the run (issue 42, case 6)."""
    if os.geteuid() != 0:
        pytest.skip("a lock held by another user's process needs root to start one")
    images(tmp_path / "data", 1)
    out = tmp_path / "r.jsonl"
    out.write_text("")
    out.chmod(0o644)
    holder = _flock_held_by(out, 4242)
    try:
        with ResultsFile(out) as results:
            assert f"is locked by process {holder} (uid 4242), another user's: passed over" in results.lock_note
            assert not results.lock_unguarded
            lock = Path(f"{out}.lock")
            assert lock.stat().st_mode & 0o777 == 0o600 and json.loads(lock.read_text())["pid"] == os.getpid()
            with pytest.raises(ResultsLocked):
                ResultsFile(out)  # a second run of ours is kept out all the same
        capsys.readouterr()
        assert main(["caption", str(tmp_path / "data"), "--out", str(out)] + FAST) == 0
        assert "another user's: passed over; --out is locked all the same" in capsys.readouterr().err
        Path(f"{out}.lock").mkdir()  # and the holder's file planted: nothing is ours to lock
        with ResultsFile(out) as results:
            assert results.lock_unguarded and "left alone" in results.lock_note
        assert main(["caption", str(tmp_path / "data"), "--out", str(out), "--redo"] + FAST) == 0
        assert "--out is not locked: start no other run on it" in capsys.readouterr().err
        Path(f"{out}.lock").rmdir()
    finally:
        _stop(holder)
    ours = _flock_held_by(out, os.geteuid())
    try:
        with pytest.raises(ResultsLocked):
            ResultsFile(out)
    finally:
        _stop(ours)
    assert len(records(out)) == 2


def test_a_lock_held_by_a_user_who_may_write_out_keeps_the_run_out(tmp_path):
    """Passed over only where the holder cannot write --out: with a group write bit (a shared
    0664 file), the other user's lock is another writer's and is obeyed."""
    if os.geteuid() != 0:
        pytest.skip("a lock held by another user's process needs root to start one")
    out = tmp_path / "r.jsonl"
    out.write_text("")
    out.chmod(0o664)
    holder = _flock_held_by(out, 4242)
    try:
        with pytest.raises(ResultsLocked):
            ResultsFile(out)
        out.chmod(0o644)
        with ResultsFile(out) as results:
            assert "passed over" in results.lock_note
    finally:
        _stop(holder)


def test_another_users_hold_on_an_old_lock_file_does_not_let_two_runs_in(tmp_path):
    """Another user who kept a descriptor of an old `<out>.lock` (left readable by an earlier
    version) and locks it and --out: the run makes a new lock file, and a second run of ours is
    still kept out."""
    if os.geteuid() != 0:
        pytest.skip("a lock held by another user's process needs root to start one")
    out, lock = tmp_path / "r.jsonl", tmp_path / "r.jsonl.lock"
    out.write_text("")
    out.chmod(0o644)
    lock.write_text(json.dumps({"pid": 1, "host": "old"}) + "\n")
    lock.chmod(0o644)
    holders = [_flock_held_by(out, 4242), _flock_held_by(lock, 4242)]
    try:
        with ResultsFile(out) as results:
            assert "passed over" in results.lock_note and not results.lock_unguarded
            assert json.loads(lock.read_text())["pid"] == os.getpid() and lock.stat().st_mode & 0o777 == 0o600
            with pytest.raises(ResultsLocked):
                ResultsFile(out)
    finally:
        for pid in holders:
            _stop(pid)


def test_a_hard_link_or_symlink_to_out_meets_its_lock(tmp_path, capsys, no_model):
    images(tmp_path / "data", 1)
    out = tmp_path / "r.jsonl"
    with ResultsFile(out):
        (tmp_path / "hard.jsonl").hardlink_to(out)
        (tmp_path / "soft.jsonl").symlink_to(out)
        with pytest.raises(ResultsLocked):
            ResultsFile(tmp_path / "hard.jsonl")
        for name in ("hard.jsonl", "soft.jsonl"):
            refused(["caption", str(tmp_path / "data"), "--out", str(tmp_path / name)], capsys, "is in use by")


def test_a_sidecar_another_run_wrote_meanwhile_is_kept_without_overwrite(tmp_path):
    media = images(tmp_path / "data", 2)
    theirs = media[0].with_suffix(".txt")
    theirs.write_text("the other run's caption\n")  # written after this run planned its files
    record = {"path": str(media[0]), "relative_path": media[0].name, "kind": "image", "text": "ours"}
    with ResultsFile(tmp_path / "r.jsonl") as results:
        outputs = Outputs(results, SidecarPolicy(enabled=True))
        outputs.write([record, {**record, "path": str(media[1]), "text": "ours too"}])
        assert theirs.read_text() == "the other run's caption\n" and outputs.sidecars_written == 1
        assert media[1].with_suffix(".txt").read_text() == "ours too\n"
        Outputs(results, SidecarPolicy(enabled=True, overwrite=True)).write([record])
    assert theirs.read_text() == "ours\n", "--overwrite replaces it"
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    theirs.unlink()
    theirs.symlink_to(victim)
    with ResultsFile(tmp_path / "r.jsonl") as results:
        Outputs(results, SidecarPolicy(enabled=True, overwrite=True)).write([record])
    assert victim.read_text() == "precious\n" and not theirs.is_symlink() and theirs.read_text() == "ours\n"


# -- 11: special files as --out / --stats-json -------------------------------------------------------


def test_special_files_as_outputs_are_refused_at_once(tmp_path):
    images(tmp_path / "data", 1)
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    cases = [(["--out", str(fifo)], "is a FIFO"), (["--out", "/dev/full"], "is a character device"),
             (["--out", "/dev/null"], "is a character device"),
             (["--out", str(tmp_path / "r.jsonl"), "--stats-json", "/dev/null"], "is a character device")]
    for extra, reason in cases:  # the old hang (FIFO) and endless read (/dev/full) end at the timeout
        done = cli([str(tmp_path / "data"), *extra], timeout=60)
        assert done.returncode == 2, (extra, done.stderr)
        assert f"cannot use {extra[-2]} {extra[-1]}: {extra[-1]} {reason}" in done.stderr
        assert "loading model" not in done.stderr


# -- 12: long names, a folder where the sidecar goes, a sidecar that cannot be written --------------


def test_long_names_and_unwritable_sidecars_are_error_records_and_reruns_go_on(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    long_name, too_long = "a" * 246 + ".png", "b" * 248 + ".png"  # a 254- and a 256-byte .caption
    for name in (long_name, too_long, "c.png"):
        images(data, 1)[0].rename(data / name)
    (data / "c.caption").mkdir()  # a folder where c.png's sidecar goes
    out = tmp_path / "r.jsonl"
    argv = ["caption", str(data), "--out", str(out), "--sidecar", "--sidecar-ext", ".caption"] + FAST
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "2 sidecars could not be written" in err and "their captions stand" in err
    lines = records(out)
    assert len(lines) == 5, "three captions, then a line for each sidecar that could not be written"
    captions = {Path(line["path"]).name: line for line in lines if "caption" in line}
    errors = {Path(line["path"]).name: line["sidecar_error"] for line in lines if "sidecar_error" in line}
    assert len(captions) == 3 and not any("error" in line for line in lines)
    assert "File name too long" in errors[too_long] and "exists and is not a file" in errors["c.png"]
    assert (data / long_name).with_suffix(".caption").read_text() == captions[long_name]["text"] + "\n"
    # The captions stand: the summary counts three captioned, none failed (issue 41, cases 7 and 8).
    rerun = argv + ["--stats-json", str(tmp_path / "s.json")]
    assert main(rerun) == 1, "a rerun does not crash: the sidecars still fail"
    summary = json.loads((tmp_path / "s.json").read_text())["pipeline"]
    assert summary["failed"] == 0 and summary["files"] == 3
    again = tmp_path / "again.jsonl"  # a new --out captions all three again; --overwrite meets the folder
    assert main(argv + ["--out", str(again), "--overwrite"]) == 1
    assert "Is a directory" in {Path(r["path"]).name: r for r in records(again)}["c.png"]["sidecar_error"]
    # Sidecars written from the records of a run without --sidecar fail the same way, before any model.
    plain = tmp_path / "plain.jsonl"
    assert main(["caption", str(data), "--out", str(plain)] + FAST) == 0
    assert main(["caption", str(data), "--out", str(plain), "--sidecar", "--sidecar-ext", ".caption"] + FAST) == 1
    assert ["sidecar_error" in r for r in records(plain)[3:]] == [True, True]
    assert not [p for p in data.iterdir() if p.name.startswith(".")], "no temporary left"


def test_temporary_names_fit_name_max():
    assert temp_prefix("img.txt") == ".img.txt.encoder-graphs-tmp-"
    for name in ("a" * 246 + ".txt", "é" * 125 + ".txt"):
        assert len(os.fsencode(temp_prefix(name))) + 8 <= NAME_MAX
    assert temp_prefix("a" * 246 + ".txt") != temp_prefix("a" * 247 + ".txt")


def test_a_sidecar_on_a_full_disk_is_an_error_not_a_crash(tmp_path):
    """RLIMIT_FSIZE stands for a full disk: the same OSError path, without a disk to fill."""
    sidecar = tmp_path / "img.txt"
    code = textwrap.dedent(
        f"""
        import resource
        from pathlib import Path
        from encoder_graphs.app.outputs import SidecarPolicy
        resource.setrlimit(resource.RLIMIT_FSIZE, (8, 8))
        try:
            SidecarPolicy(enabled=True).write(Path({str(tmp_path / "img.png")!r}), "a caption longer than 8 bytes")
        except OSError as error:
            print(error.filename, error.strerror)
        """
    )
    env = code_env()
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    assert done.stdout.strip() == f"{sidecar} File too large", done.stderr
    assert list(tmp_path.iterdir()) == [], "neither the sidecar nor its temporary is left"


# -- 15: an output that cannot be written mid-run: exit 3, nothing lost ------------------------------


def test_out_too_large_mid_run_exits_3_and_a_rerun_finishes(tmp_path):
    default_model_dir()  # built here: the capped subprocess only reads it
    images(tmp_path / "data", 4)
    out = tmp_path / "r.jsonl"
    argv = [str(tmp_path / "data"), "--out", str(out), "--batch-size", "2"]
    done = cli(argv, fsize=1200)  # one batch of two records fits, not two
    assert done.returncode == 3, done.stderr
    assert f"cannot write {out}: File too large" in done.stderr and "Traceback" not in done.stderr
    assert not out.exists() or out.read_bytes().endswith(b"\n"), "no half-written line"
    kept = records(out) if out.exists() else []
    assert len(kept) < 4
    assert main(["caption", *argv, *FAST]) == 0
    assert sorted(r["path"] for r in records(out)) == sorted(str(p) for p in (tmp_path / "data").iterdir())
    assert records(out)[: len(kept)] == kept


def test_a_full_disk_at_the_start_or_the_merge_exits_3_not_2(tmp_path):
    """Lock files and a merge of part files are outputs too: a disk that cannot take them is exit 3
    (an output could not be written), not 2 (a wrong request) (issue 42, case 8)."""
    from encoder_graphs.app.distributed import part_path

    default_model_dir()
    images(tmp_path / "data", 2)
    out = tmp_path / "r.jsonl"
    done = cli([str(tmp_path / "data"), "--out", str(out)], fsize=10)  # not even the lock's few bytes
    assert done.returncode == 3, done.stderr
    assert "File too large" in done.stderr and "Traceback" not in done.stderr
    assert main(["caption", str(tmp_path / "data"), "--out", str(out), *FAST]) == 0
    lines = out.read_bytes().splitlines(keepends=True)
    part_path(out, 1).write_bytes(b"".join(lines) * 20)  # a killed job's part: more than the limit allows
    out.write_bytes(b"")
    done = cli([str(tmp_path / "data"), "--out", str(out)], fsize=400)
    assert done.returncode == 3, done.stderr
    assert "File too large" in done.stderr and "Traceback" not in done.stderr


def test_stats_json_too_large_exits_3_after_the_captions(tmp_path):
    default_model_dir()
    images(tmp_path / "data", 1)
    out, stats = tmp_path / "r.jsonl", tmp_path / "s.json"
    done = cli([str(tmp_path / "data"), "--out", str(out), "--stats-json", str(stats)], fsize=2000)
    assert done.returncode == 3, done.stderr
    assert f"cannot write {stats}: File too large" in done.stderr and "Traceback" not in done.stderr
    assert len(records(out)) == 1 and not stats.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], "no temporary left"


def test_a_folder_made_read_only_mid_run_exits_3(tmp_path):
    """The run in a process that the folder's mode binds (root without its capabilities too)."""
    (tmp_path / "stats").mkdir()
    default_model_dir()
    images(tmp_path / "data", 12)
    out, stats = tmp_path / "r.jsonl", tmp_path / "stats" / "s.json"
    command = unprivileged([sys.executable, "-m", "encoder_graphs", "caption", str(tmp_path / "data"), "--out",
                            str(out), "--stats-json", str(stats), "--batch-size", "2", *FAST])
    process = subprocess.Popen(command, env=code_env(), stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out.exists() and out.read_bytes().count(b"\n") >= 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    (tmp_path / "stats").chmod(0o555)
    try:
        _, err = process.communicate(timeout=120)
    finally:
        (tmp_path / "stats").chmod(0o755)
    assert process.returncode == 3, err
    assert f"cannot write {stats}: Permission denied" in err and "Traceback" not in err
    assert len(records(out)) == 12


# -- 16: temporaries of killed runs ------------------------------------------------------------------


def test_temporaries_of_killed_runs_are_removed_and_nothing_else(tmp_path, capsys):
    files = images(tmp_path / "data", 2)
    data = tmp_path / "data"
    stale = [data / f"{temp_prefix('img00.txt')}k1ll3d_x", data / f"{temp_prefix('metadata.jsonl')}abcdefgh",
             data / f"{temp_prefix('a' * 250 + '.txt')}zzzzzzzz"]
    (data / ("a" * 250 + ".png")).write_bytes(files[0].read_bytes())
    others = [data / ".img00.txt.short", data / ".img00.txt.ABCDEFGH", data / ".notes.txt.abcdefgh",
              data / ".img00.txt.abcdefgh.bak", data / "img00.txt.abcdefgh",
              # a user's own files that look like another program's temporaries (issue 42, case 3)
              data / ".metadata.jsonl.original", data / ".img00.txt.20240101", data / ".img01.txt.k1ll3d_x"]
    for path in stale + others:
        path.write_text("x")
    linked = data / f"{temp_prefix('img01.txt')}linkedxx"
    linked.symlink_to(tmp_path / "elsewhere")
    foreign = data / f"{temp_prefix('img00.txt')}foreign1"  # another user's, in a shared folder (as root)
    if os.geteuid() == 0:
        foreign.write_text("x")
        os.chown(foreign, 4242, 4242)
    live = data / f"{temp_prefix('img01.txt')}writing1"
    live.write_text("a live run's")
    with open(live) as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a run over this folder writing that sidecar right now
        argv = ["caption", str(data), "--out", str(tmp_path / "r.jsonl"), "--sidecar", "--hf-metadata"]
        assert main(argv + FAST) == 0
    assert "removed 3 temporary files" in capsys.readouterr().err
    assert not any(path.exists() for path in stale)
    assert all(path.exists() for path in others) and live.exists() and linked.is_symlink()
    assert foreign.exists() or os.geteuid() != 0


def test_a_temporary_swapped_while_it_was_locked_is_not_removed(tmp_path, monkeypatch):
    """`remove_unheld` locks the file, then unlinks the name: where another process's tidying
    put a new file at the name meanwhile (one it writes now), that file stays."""
    from encoder_graphs.app import outputs

    stale, new = tmp_path / "stale", tmp_path / "new"
    stale.write_text("a killed run's")
    new.write_text("a live run's")
    flock = fcntl.flock

    def swapping(fd, operation):
        flock(fd, operation)
        os.replace(new, stale)  # between the lock and the unlink

    monkeypatch.setattr(outputs.fcntl, "flock", swapping)
    assert outputs.remove_unheld(stale) is False
    assert stale.read_text() == "a live run's"


def test_a_partial_its_holder_removes_as_it_is_opened_gives_way_to_the_next(tmp_path, monkeypatch):
    """`lock_own_file` opening a partial file its holder unlinks at that moment (a seal) sees a
    file of no name: it takes the file at the path now, not refuse it as a file of other names."""
    from encoder_graphs.app import lock

    path = tmp_path / ".s.partial"
    path.write_text("sealed meanwhile")
    real_open, opened = os.open, []

    def open_as_the_holder_unlinks(name, flags, mode=0o777):
        fd = real_open(name, flags, mode)
        if not opened:
            os.unlink(name)  # the holder's seal, between our open and our checks
        opened.append(fd)
        return fd

    monkeypatch.setattr(lock.os, "open", open_as_the_holder_unlinks)
    fd = lock.lock_own_file(path)
    monkeypatch.undo()
    try:
        assert fd is not None and len(opened) == 2 and os.fstat(fd).st_nlink == 1
        assert os.path.samestat(os.fstat(fd), os.stat(path)) and path.read_text() == ""
    finally:
        os.close(fd)


# -- issue 42: shared folders --------------------------------------------------------------------------


def test_planted_sidecar_links_disclose_nothing_into_the_metadata(tmp_path, capsys):
    """Another user plants sidecars that are links to a secret and to /proc/self/environ, and one
    of 2 MiB: none is read as a caption into the world-readable metadata.jsonl (issue 42, case 1)."""
    images(tmp_path / "ds", 4)
    out = tmp_path / "caps.jsonl"
    assert main(["caption", str(tmp_path / "ds"), "--out", str(out)] + FAST) == 0
    secret = tmp_path / "secret"
    secret.write_text("TOKEN=hf_secret\n")
    secret.chmod(0o600)
    (tmp_path / "ds" / "img01.txt").symlink_to(secret)
    (tmp_path / "ds" / "img02.txt").symlink_to("/proc/self/environ")
    (tmp_path / "ds" / "img03.txt").write_bytes(b"x" * (2 << 20))
    other = tmp_path / "other-secret"
    other.write_text("PASSWORD=hunter2\n")
    os.link(other, tmp_path / "ds" / "img00.txt")  # a hard link: a regular file of two names
    capsys.readouterr()
    assert main(["caption", str(tmp_path / "ds"), "--out", str(out), "--sidecar", "--hf-metadata"] + FAST) == 0
    metadata = (tmp_path / "ds" / "metadata.jsonl").read_text()
    assert "hf_secret" not in metadata and "PATH=" not in metadata and "xxxx" not in metadata
    assert "hunter2" not in metadata
    captions = {r["relative_path"]: r["text"] for r in records(out)}
    assert {row["file_name"]: row["text"] for row in map(json.loads, metadata.splitlines())} == captions
    assert "4 sidecars were not read as captions" in capsys.readouterr().err


def test_an_output_link_another_user_planted_is_refused(tmp_path, capsys, no_model):
    """In a shared folder, `--out` or `--stats-json` that is another user's symlink would send the
    results where they chose: refused, naming it; the user's own links are followed (issue 42, case 6)."""
    if os.geteuid() != 0:
        pytest.skip("planting another user's link needs root")
    images(tmp_path / "data", 1)
    target = tmp_path / "theirs.jsonl"
    for flag in ("--out", "--stats-json"):
        link = tmp_path / f"planted{flag}"
        link.symlink_to(target)
        os.lchown(link, 4242, 4242)
        argv = ["caption", str(tmp_path / "data"), "--out", str(tmp_path / "r.jsonl"), flag, str(link)]
        assert main(argv + FAST) == 2
        assert "a symbolic link owned by another user (uid 4242)" in capsys.readouterr().err
        assert not target.exists()
