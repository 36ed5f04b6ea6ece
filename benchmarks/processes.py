"""Run a command to its end and measure it as a user would: wall time, and the peak memory of its
whole process tree (the caption command decodes videos in worker processes)."""

import os
import subprocess
import threading
import time
from pathlib import Path

SAMPLE_S = 0.2  # how often the process tree's memory is read


def children_of() -> dict[int, list[int]]:
    """Every process's children, from /proc (no psutil here)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])  # after "pid (name)": state, then the parent's pid
        children.setdefault(parent, []).append(int(entry.name))
    return children


def tree_rss_bytes(root: int) -> int:
    """Resident memory of `root` and all its descendants, summed: pages that processes share
    (libraries, memory a fork inherited) count in each, so this bounds the tree's use from above."""
    children, total, pending = children_of(), 0, [root]
    while pending:
        pid = pending.pop()
        pending += children.get(pid, [])
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError):
            continue
    return total


def watch_memory(pid: int, done: threading.Event, peak: list[int]) -> None:
    """Keep in `peak[0]` the largest process-tree memory seen, every SAMPLE_S s until `done`."""
    while True:
        peak[0] = max(peak[0], tree_rss_bytes(pid))
        if done.wait(SAMPLE_S):
            return


def run_measured(command: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, float, int]:
    """Run `command` to its end (`env` added to the environment): its result, wall time and peak
    memory of its process tree. The tree's, not the process's: the caption command decodes
    videos in worker processes."""
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, **(env or {})})
    done, peak = threading.Event(), [0]
    watcher = threading.Thread(target=watch_memory, args=(process.pid, done, peak), daemon=True)
    watcher.start()
    try:
        stdout, stderr = process.communicate()
    finally:
        done.set()
        watcher.join()
    wall_s = time.perf_counter() - started
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {process.returncode}:\n{stderr[-4000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr), wall_s, peak[0]
