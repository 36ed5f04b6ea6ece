"""The caption command's outputs, tried as a careless user and as an attacker would (issue 25, CPU,
the embedded tiny model): an --out or --stats-json that is not ours, an input, a special file or
another output is refused before the model loads; the lock holds by the file's identity and
follows no symlink; sidecars are never forced over another run's and one that cannot be written is
an error record; temporaries fit NAME_MAX and a killed run's are removed; an output that cannot be
written mid-run exits 3 with nothing lost."""

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import model_cache  # noqa: F401 (autouse: a private model cache for this module)
from test_dataset_tool import FAST, images, records

from encoder_graphs.app import loading
from encoder_graphs.app.cli import main
from encoder_graphs.app.results import ResultsFile, ResultsLocked
from encoder_graphs.models.default_model import default_model_dir

REPO = Path(__file__).resolve().parents[1]


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
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    limit = None if fsize is None else lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    command = [sys.executable, "-m", "encoder_graphs", "caption", *argv, *FAST]
    return subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=timeout, preexec_fn=limit, check=False
    )


# -- 8, 10: the lock by the file's identity, never through a symlink --------------------------------


def test_a_symlinked_or_hard_linked_lock_file_is_not_written(tmp_path, capsys, no_model):
    images(tmp_path / "data", 1)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "r.jsonl"
    lock = Path(f"{out}.lock")
    lock.symlink_to(victim)
    refused(["caption", str(tmp_path / "data"), "--out", str(out)], capsys, str(lock), "symbolic link")
    lock.unlink()
    lock.hardlink_to(victim)
    with pytest.raises(OSError, match="not one this command wrote"):
        ResultsFile(out)
    assert victim.read_text() == "precious\n" and lock.read_text() == "precious\n"
    assert not out.exists(), "the results file made for the lock is removed again"


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
