"""Data-parallel captioning under torchrun: one process per GPU (`LOCAL_RANK`), one job.

Ranks share work dynamically: the files still to do are ordered by estimated cost (largest
first, `by_cost`); each rank claims the next chunk (a quarter batch) from an
atomic counter on torchrun's own store, so a slow rank simply takes fewer. Each rank
appends its records to its own part file beside `--out` (`captions.jsonl.encoder-graphs-part1`,
a name no user file has, of this user; another user's is never merged); at the end rank
0 merges every part into `--out` and removes them. Rank 0 holds the lock on `--out` for the job.
Any later run (torchrun or not) first merges the parts a killed job left, so nothing is lost or
done twice.
"""

import json
import os
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from encoder_graphs.app.walk import MediaFile

# Reaching the job's store at the start: a rank whose launcher died before serving it stops then,
# not hours later. Later waits poll the store (`Job.wait_for`), so no store call blocks for long.
STORE_TIMEOUT = timedelta(minutes=5)
POLL_S = 0.2


@dataclass
class Job:
    """Where this process stands in a torchrun job (rank 0 of 1 outside torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    store: Any = None  # torch.distributed.Store, shared by the job's ranks

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def wait_for(self, key: str, count: int, patience_s: float | None = None) -> bool:
        """Until `count` ranks have added to `key` (a barrier that needs no collective backend), or
        at most `patience_s`; whether they have."""
        deadline = None if patience_s is None else time.monotonic() + patience_s
        while int(self.store.add(key, 0)) < count:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
        return True

    def barrier(self, key: str) -> None:
        """Until every rank has reached this point."""
        self.store.add(key, 1)
        self.wait_for(key, self.world_size)


def job_from_env() -> Job:
    """The job torchrun started this process in (its env:// variables), or a single process."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return Job()
    die_with_launcher()  # first: the import below takes seconds, in which the launcher may die
    import torch.distributed as dist

    if not dist.is_initialized():
        # gloo: only the store is used (no collectives), and it runs with or without GPUs.
        dist.init_process_group(backend="gloo", timeout=STORE_TIMEOUT)
    # torch 2.11, 2.13: the process group's store is torchrun's rendezvous store (private getter).
    run = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    store = dist.PrefixStore(f"encoder_graphs/{run}/", dist.distributed_c10d._get_default_store())
    return Job(int(os.environ["RANK"]), world_size, int(os.environ.get("LOCAL_RANK", "0")), store)


def die_with_launcher() -> None:
    """This rank gets SIGTERM when its parent, torchrun's launcher, dies (Linux's parent-death
    signal), and stops now if it died already: a rank left alone would wait on a store nobody
    serves."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    launcher = os.getppid()  # torchrun may itself be PID 1 (a container's entrypoint)
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != launcher:  # it died before the signal was asked for: reparented
        raise SystemExit("encoder-graphs: torchrun's launcher is gone; this rank stops")


PART_MARK = ".encoder-graphs-part"  # a rank's part file is `<out>.encoder-graphs-part<rank>`


def part_path(out: Path, rank: int) -> Path:
    return out.with_name(f"{out.name}{PART_MARK}{rank}")


def part_paths(out: Path, *, others: list[Path] | None = None) -> list[Path]:
    """The part files beside `out` that this user's jobs wrote (this job's, or a killed one's):
    regular files of this user named as `part_path` names them. Another user's (planted in a
    shared folder: merging it would inject its records) goes to `others`, left alone."""
    import glob
    import stat

    mine = []
    for path in out.parent.glob(f"{glob.escape(out.name)}{PART_MARK}*"):
        if not path.name[len(out.name) + len(PART_MARK) :].isdigit():
            continue
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
            mine.append(path)
        elif others is not None:
            others.append(path)
    return sorted(mine)


def by_cost(files: Sequence[MediaFile]) -> list[MediaFile]:
    """Largest first: videos, then images by pixels read from their headers."""
    from PIL import Image

    from encoder_graphs.app.media import open_regular

    def cost(file: MediaFile) -> int:
        if file.kind != "image":
            return 1 << 62
        if file.reason:  # refused by the walk: never opened
            return 0
        try:
            with warnings.catch_warnings():  # a header read; `load` judges sizes
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                with open_regular(file.path) as handle, Image.open(handle) as image:
                    return image.width * image.height
        except Exception:  # noqa: BLE001 (a bad file costs nothing here; loading will report it)
            return 0

    return sorted(files, key=cost, reverse=True)


def claim_chunk(batch_size: int) -> int:
    """Files per claim: a quarter batch, so that ranks interleave the costliest files (with
    whole-batch chunks, a rank that started first claimed most of the files; measured:
    benchmarks/HISTORY.md)."""
    return max(1, batch_size // 4)


def claimed(job: Job, files: Sequence[MediaFile], chunk: int) -> Iterator[MediaFile]:
    """The files of every chunk this rank claims, in order, claiming the next when asked. The
    counter counts files, so ranks whose chunks differ (`--batch-size auto` per GPU) still claim
    disjoint ranges."""
    while (start := int(job.store.add("next_file", chunk)) - chunk) < len(files):
        yield from files[start : start + chunk]


def gather_stats(job: Job, stats: dict, patience_s: float | None = None) -> dict[int, dict] | None:
    """Publish this rank's statistics; rank 0 gets those of every rank that published them within
    `patience_s` (None: all, however long), by rank."""
    job.store.set(f"stats/{job.rank}", json.dumps(stats, default=str))
    job.store.add("finished", 1)
    if job.rank != 0:
        return None
    job.wait_for("finished", job.world_size, patience_s)
    keys = {rank: f"stats/{rank}" for rank in range(job.world_size)}
    return {rank: json.loads(job.store.get(key)) for rank, key in keys.items() if job.store.check([key])}
