"""The results file: the latest record wins, --retry-failed, one run at a time per file."""

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from privileges import code_env, run_unprivileged

from encoder_graphs.app.results import LockHolder, ResultsFile, ResultsLocked, read_records



def write_lines(path: Path, *records: dict) -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def try_in_another_process(out: Path) -> subprocess.CompletedProcess:
    code = textwrap.dedent(
        f"""
        from encoder_graphs.app.results import ResultsFile, ResultsLocked
        try:
            ResultsFile({str(out)!r}).close()
        except ResultsLocked as error:
            print(error)
            raise SystemExit(3)
        print("acquired")
        """
    )
    env = code_env()
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, check=False
    )


def test_latest_record_wins_error_then_caption(tmp_path):
    out = tmp_path / "captions.jsonl"
    write_lines(out, {"path": "/a.png", "error": "boom"}, {"path": "/a.png", "caption": "a cat"})
    with ResultsFile(out) as results:
        assert results.is_done("/a.png") and not results.is_failed("/a.png")
        assert results.failed == set()
    with ResultsFile(out, retry_failed=True) as results:
        assert results.is_done("/a.png")


def test_latest_record_wins_caption_then_error(tmp_path):
    out = tmp_path / "captions.jsonl"
    write_lines(out, {"path": "/a.png", "caption": "a cat"}, {"path": "/a.png", "error": "boom"})
    with ResultsFile(out) as results:
        assert results.is_done("/a.png") and results.is_failed("/a.png")


def test_latest_record_wins_across_appends(tmp_path):
    out = tmp_path / "captions.jsonl"
    with ResultsFile(out) as results:
        results.append([{"path": "/a.png", "error": "boom"}, {"path": "/b.png", "caption": "b"}])
        assert results.is_failed("/a.png") and not results.is_failed("/b.png")
        results.append([{"path": "/a.png", "caption": "a"}, {"path": "/b.png", "error": "boom"}])
        assert not results.is_failed("/a.png") and results.is_failed("/b.png")
    with ResultsFile(out) as reread:  # the same verdicts read back from the file
        assert reread.failed == {"/b.png"} and reread.done == {"/a.png", "/b.png"}
    assert [r["path"] for r in read_records(out)] == ["/a.png", "/b.png", "/a.png", "/b.png"]


def test_retry_failed_makes_failed_paths_not_done(tmp_path):
    out = tmp_path / "captions.jsonl"
    write_lines(out, {"path": "/ok.png", "caption": "x"}, {"path": "/bad.png", "error": "boom"})
    with ResultsFile(out) as results:
        assert results.is_done("/ok.png") and results.is_done("/bad.png")
    with ResultsFile(out, retry_failed=True) as results:
        assert results.is_done("/ok.png") and not results.is_done("/bad.png")
        assert results.is_failed("/bad.png") and not results.is_failed("/ok.png")
        assert not results.is_done("/never.png")
        results.append([{"path": "/bad.png", "caption": "fixed"}])
        assert results.is_done("/bad.png") and not results.is_failed("/bad.png")


def test_a_second_results_file_on_the_same_path_is_locked(tmp_path):
    out = tmp_path / "captions.jsonl"
    with ResultsFile(out) as results:
        assert results.lock_path == Path(os.path.realpath(out) + ".lock") and results.lock_path.exists()
        with pytest.raises(ResultsLocked) as caught:
            ResultsFile(out)
        assert not isinstance(caught.value, OSError)
        assert caught.value.holder == LockHolder(os.getpid(), socket.gethostname())
        assert str(caught.value) == (
            f"{out} is in use by process {os.getpid()} on {socket.gethostname()}; wait for it or use another --out"
        )
        results.append([{"path": "/a.png", "caption": "still ours"}])  # the refused one broke nothing
    assert [r["path"] for r in read_records(out)] == ["/a.png"]


def test_another_process_is_refused_while_we_hold_it(tmp_path):
    out = tmp_path / "captions.jsonl"
    with ResultsFile(out):
        refused = try_in_another_process(out)
        assert refused.returncode == 3, refused.stderr
        assert f"is in use by process {os.getpid()} on {socket.gethostname()}" in refused.stdout
    acquired = try_in_another_process(out)
    assert acquired.returncode == 0 and "acquired" in acquired.stdout, acquired.stderr


def test_after_close_a_new_one_succeeds(tmp_path):
    out = tmp_path / "captions.jsonl"
    first = ResultsFile(out)
    first.close()
    first.close()  # idempotent
    assert not first.lock_path.exists()
    with pytest.raises(ValueError):
        first.append([{"path": "/a.png", "caption": "x"}])
    ResultsFile(out).close()


def test_a_stale_lock_file_does_not_block(tmp_path):
    out = tmp_path / "captions.jsonl"
    lock = Path(str(out) + ".lock")
    lock.write_text(json.dumps({"pid": 999999999, "host": "ghost"}) + "\n")  # a killed run's, no flock held
    with ResultsFile(out) as results:
        assert json.loads(lock.read_text()) == {"pid": os.getpid(), "host": socket.gethostname()}
        results.append([{"path": "/a.png", "caption": "x"}])
    assert not lock.exists()


def test_the_context_manager_releases_the_lock_even_on_error(tmp_path):
    out = tmp_path / "captions.jsonl"
    with pytest.raises(RuntimeError), ResultsFile(out) as results:
        raise RuntimeError("a batch blew up")
    assert results.closed
    with ResultsFile(out):
        pass


def test_a_killed_holder_does_not_block(tmp_path):
    out = tmp_path / "captions.jsonl"
    code = f"from encoder_graphs.app.results import ResultsFile; import os; r = ResultsFile({str(out)!r}); os._exit(0)"
    env = code_env()
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=env)
    assert Path(str(out) + ".lock").exists()  # left behind, but no longer locked
    with ResultsFile(out):
        pass


def test_bad_out_paths_fail_at_construction(tmp_path):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(OSError):
        ResultsFile(tmp_path / "a_file" / "x.jsonl")  # the parent cannot be created
    (tmp_path / "a_dir.jsonl").mkdir()
    with pytest.raises(OSError, match="cannot append to the results file"):
        ResultsFile(tmp_path / "a_dir.jsonl")
    assert not Path(str(tmp_path / "a_dir.jsonl") + ".lock").exists()  # released on the way out
    out = tmp_path / "new" / "captions.jsonl"
    with ResultsFile(out):
        assert out.parent.is_dir() and out.read_bytes() == b""  # created to be locked, nothing written
    assert not out.exists(), "an empty results file the run created is removed with its lock"


def test_a_read_only_results_file_fails_at_construction(tmp_path):
    """In a process that the file's mode binds (root without its capabilities too)."""
    out = tmp_path / "captions.jsonl"
    write_lines(out, {"path": "/a.png", "caption": "x"})
    out.chmod(0o444)
    done = run_unprivileged(textwrap.dedent(f"""
        from encoder_graphs.app.results import ResultsFile
        try:
            ResultsFile({str(out)!r})
        except OSError as error:
            raise SystemExit(str(error))
        """))
    assert done.returncode == 1 and "cannot append to the results file" in done.stderr, done.stderr


def test_path_keys_resolve_as_realpath_does(tmp_path, monkeypatch):
    """`PathKeys` (each folder resolved once: a million records cost a lstat each) gives what
    `path_key` (realpath) gives: through a linked folder, a linked file, `..`, relative paths,
    a trailing slash, a file that does not exist."""
    from encoder_graphs.app.results import PathKeys, path_key

    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "real" / "sub" / "a.jpg").write_text("")
    (tmp_path / "real" / "b.jpg").write_text("")
    (tmp_path / "linked").symlink_to(tmp_path / "real", target_is_directory=True)
    (tmp_path / "real" / "sub" / "c.jpg").symlink_to(tmp_path / "real" / "b.jpg")
    monkeypatch.chdir(tmp_path / "real")
    keys = PathKeys()
    paths = [tmp_path / "linked" / "sub" / "a.jpg", tmp_path / "linked" / "sub" / "c.jpg", "sub/a.jpg", "sub/c.jpg",
             "b.jpg", "sub/../b.jpg", f"{tmp_path}/linked/sub/", f"{tmp_path}//linked/./sub/gone.jpg", "..", "."]
    for path in paths * 2:  # the second time from the cache
        assert keys(path) == path_key(path), path
    assert keys(tmp_path / "linked" / "sub" / "c.jpg") == str(tmp_path / "real" / "b.jpg")
