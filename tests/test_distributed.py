"""Data-parallel captioning under torchrun on CPU (gloo): 2 ranks share one folder through the
store's counter, every file once in the merged --out; a rank killed mid-run stops the job, and a
rerun finishes the rest with nothing lost or doubled."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image
from test_cli import model_cache  # noqa: F401 (autouse: a private model cache for this module)

pytestmark = pytest.mark.slow  # inductor compiles / torchrun jobs: the quick command skips them


def images(folder: Path, count: int) -> None:
    folder.mkdir(parents=True)
    for index in range(count):
        Image.new("RGB", (40 + 3 * (index % 20), 56 + index % 7), (6 * (index % 40), 80, 160)).save(folder / f"{index:03d}.png")


def torchrun(folder: Path, out: Path, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "encoder_graphs", "caption", str(folder), "--out", str(out), "--quiet", "--batch-size", "4", *extra]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def paths_in(out: Path) -> list[str]:
    return [json.loads(line)["path"] for line in out.read_text().splitlines()]


def test_two_ranks_caption_every_file_once(tmp_path):
    images(tmp_path / "data", 40)
    out, stats = tmp_path / "captions.jsonl", tmp_path / "stats.json"
    job = torchrun(tmp_path / "data", out, "--max-new-tokens", "3", "--stats-json", str(stats), "--sidecar")
    log, _ = job.communicate(timeout=240)
    assert job.returncode == 0, log
    paths = paths_in(out)
    assert len(paths) == len(set(paths)) == 40
    assert not list(tmp_path.glob("captions.jsonl.encoder-graphs-part*")), "the parts are merged and removed"
    assert len(list((tmp_path / "data").glob("*.txt"))) == 40
    pipeline = json.loads(stats.read_text())["pipeline"]
    assert pipeline["world_size"] == 2 and pipeline["succeeded"] == 40
    assert sum(rank["files"] for rank in pipeline["ranks"]) == 40 and len(pipeline["ranks"]) == 2
    assert log.count("files 40: captioned 40") == 1, "rank 0 alone reports"


def test_a_killed_rank_then_a_rerun_loses_and_doubles_nothing(tmp_path):
    images(tmp_path / "data", 240)
    out = tmp_path / "captions.jsonl"
    job = torchrun(tmp_path / "data", out, "--max-new-tokens", "24")
    deadline = time.monotonic() + 120
    parts = []
    while time.monotonic() < deadline and not any(p.stat().st_size for p in parts):
        time.sleep(0.05)
        parts = list(tmp_path.glob("captions.jsonl.encoder-graphs-part[0-9]*"))
    assert job.poll() is None, "the job finished before a rank could be killed: make it slower"
    workers = subprocess.run(["pgrep", "-P", str(job.pid)], capture_output=True, text=True).stdout.split()
    assert workers, "no worker processes found"
    os.kill(int(workers[-1]), signal.SIGKILL)
    job.communicate(timeout=120)
    assert job.returncode != 0, "torchrun stops the job when a rank dies"
    done_before = sum(len(p.read_text().splitlines()) for p in tmp_path.glob("captions.jsonl.encoder-graphs-part[0-9]*"))
    assert 0 < done_before < 240
    rerun = torchrun(tmp_path / "data", out, "--max-new-tokens", "24")
    log, _ = rerun.communicate(timeout=240)
    assert rerun.returncode == 0, log
    paths = paths_in(out)
    assert len(paths) == len(set(paths)) == 240
    assert not list(tmp_path.glob("captions.jsonl.encoder-graphs-part[0-9]*"))


@pytest.fixture(autouse=True)
def _no_stray_lock(tmp_path):
    yield
    assert not list(tmp_path.glob("*.lock")), "every lock file is removed"


def test_a_rank_whose_launcher_dies_while_it_connects_stops_at_once(tmp_path):
    """A launcher (here a stand-in parent) dies while its rank waits for the job's store, which no
    one will serve: the rank gets the parent-death signal and ends within seconds, not at the
    store's timeout (issue 42, case 7)."""
    import socket

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    rank = ("import time; from encoder_graphs.app.distributed import job_from_env; "
            "print('connecting', flush=True); job_from_env(); time.sleep(600)")
    parent = ("import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', sys.argv[1]]); "
              "print(child.pid, flush=True); time.sleep(600)")
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    launcher = subprocess.Popen([sys.executable, "-c", parent, rank], env=env, stdout=subprocess.PIPE, text=True)
    child = int(launcher.stdout.readline())
    assert launcher.stdout.readline() == "connecting\n"  # the rank imported the module (seconds on a busy machine)
    time.sleep(3)  # the rank is connecting by now
    os.kill(child, 0)  # alive, waiting
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{child}/stat") as stat:  # a zombie (reaped by init later) has ended
            if stat.read().split(")")[-1].split()[0] == "Z":
                return
        time.sleep(0.2)
    os.kill(child, signal.SIGKILL)
    raise AssertionError("the rank outlived its launcher by 15 s")
