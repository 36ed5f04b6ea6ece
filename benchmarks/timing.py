"""Shared timing helpers for the benchmarks: per-call CUDA-event latency, the matmul and copy ceilings."""

import json
import os
import platform
import sys
from collections.abc import Callable
from datetime import date
from pathlib import Path

import torch

from encoder_graphs.engine.stats import elapsed_ms, latency_summary


def time_calls(fn: Callable[[], object], warmup: int, iters: int) -> dict[str, float]:
    """Latency of each call in ms (CUDA events around each call, synchronised after each)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return latency_summary([elapsed_ms(fn) for _ in range(iters)])


def time_interleaved(
    fns: dict[str, Callable[[], object]], warmup: int, iters: int, rounds: int = 6
) -> dict[str, dict[str, float]]:
    """`time_calls` of several ways to do the same work, in alternating rounds (the order reversed
    every round, an even number of rounds): clock and thermal drift then weighs on each alike.
    Timed one after the other, two ways of doing the same work differed by more than the
    differences measured; interleaved, they agreed (benchmarks/HISTORY.md)."""
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in names}
    per_round = -(-iters // rounds)
    for index in range(rounds):
        for name in names if index % 2 == 0 else reversed(names):
            samples[name] += [elapsed_ms(fns[name]) for _ in range(per_round)]
    return {name: latency_summary(values) for name, values in samples.items()}


def matmul_tflops(size: int = 8192) -> float:
    """Measured dense bf16 matmul rate: the ceiling the FLOP floors use."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    ms = time_calls(lambda: a @ b, warmup=5, iters=20)["p50"]
    return 2 * size**3 / (ms / 1000) / 1e12


def copy_bandwidth_gbps(nbytes: int = 2**30) -> float:
    """Measured device-to-device copy rate in GB/s, counting the read and the write: the ceiling
    the weight-bytes floors use."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_calls(lambda: dst.copy_(src), warmup=3, iters=20)["p50"]
    return 2 * nbytes / (ms / 1000) / 1e9


def source(root: Path = Path(__file__).resolve().parent.parent) -> dict[str, object]:
    """The code measured: the git commit, whether the tree differed from it, and the tree's own
    id (`tree_id`), from ENCODER_GRAPHS_COMMIT / ENCODER_GRAPHS_DIRTY where the caller sets them
    (a GPU machine gets a copy of the working tree whose .git may be older than it), else from
    git. Where the commit is old, `git log --format='%H %T' | grep TREE` finds the code's."""
    import subprocess

    if "ENCODER_GRAPHS_COMMIT" in os.environ:
        return {"commit": os.environ["ENCODER_GRAPHS_COMMIT"], "dirty": os.environ.get("ENCODER_GRAPHS_DIRTY") == "1"}
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, check=True)
        return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip()), "tree": tree_id(root)}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}


def tree_id(root: Path) -> str:
    """The git tree id of the files in `root` as they are (tracked, and untracked ones git does
    not ignore): a commit of exactly these files has it as its tree. Built in a temporary index
    and object folder, so the repository is not written to."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        objects = subprocess.run(["git", "rev-parse", "--path-format=absolute", "--git-path", "objects"], cwd=root,
                                 capture_output=True, text=True, check=True).stdout.strip()
        os.mkdir(f"{scratch}/objects")
        env = {**os.environ, "GIT_INDEX_FILE": f"{scratch}/index", "GIT_OBJECT_DIRECTORY": f"{scratch}/objects",
               "GIT_ALTERNATE_OBJECT_DIRECTORIES": objects}
        subprocess.run(["git", "add", "-A", "."], cwd=root, env=env, capture_output=True, check=True)
        return subprocess.run(["git", "write-tree"], cwd=root, env=env, capture_output=True, text=True,
                              check=True).stdout.strip()


def _installed(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def environment() -> dict[str, object]:
    """What a JSON needs to describe its numbers: the device, date, versions, code and command."""
    import transformers

    try:
        import av

        pyav = av.__version__
    except ImportError:
        pyav = None
    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu {platform.machine()}",
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "date": date.today().isoformat(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "pyav": pyav,
        "pynvvideocodec": _installed("pynvvideocodec"),
        "python": platform.python_version(),
        **source(),
        "command": " ".join(["python3", *sys.argv]),
    }


def write_json(path: str | None, payload: dict) -> None:
    if path:
        with open(path, "w") as handle:
            json.dump(payload, handle, indent=2)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def speedup(ours: dict, stock: dict) -> dict[str, float]:
    """Ours over the stock script, end to end and in the loop: the one way README and RESULTS
    state a ratio. Both runs must have captioned the same number of files, so each start (and
    the stock script's slow first batch) counts once; runs of different counts have no ratio."""
    if ours["images"] != stock["images"]:
        raise ValueError(f"no ratio between runs of {ours['images']} and {stock['images']} files")
    # "images_per_s_*": the key every run of bench_cli.py has written, whatever the files' kind.
    return {"end_to_end": ours["images_per_s_end_to_end"] / stock["images_per_s_end_to_end"],
            "in_loop": ours["images_per_s_in_loop"] / stock["images_per_s_in_loop"]}


def in_parts(parts: list[dict]) -> dict:
    """One run of all the files from runs of disjoint parts of them (a run too long for one call
    of the GPU machine, split): the files summed over the summed wall and loop times, so the
    ratio against it is `speedup`'s. Each part pays its own start, so the whole is slower than
    one run of all the files by a start for each part but the first."""
    images = sum(part["images"] for part in parts)
    return {"images": images, "images_per_s_end_to_end": images / sum(part["wall_s"] for part in parts),
            "images_per_s_in_loop": images / sum(part["images"] / part["images_per_s_in_loop"] for part in parts)}


def over_stock(runs: dict[str, dict]) -> dict:
    """bench_cli.py's ratio: the stock script at its best batch (end to end; a batch that ran out of
    memory is none) against our defaults on as many files (the defaults, or `--sizes`' run of that
    count); None, and why, where ours ran no such count."""
    ran = [name for name in runs if (name == "stock" or name.startswith("stock_batch_")) and not runs[name].get("out_of_memory")]
    if not ran:
        return {"stock_baseline": None, "speedup_of": None, "speedup_over_stock": None,
                "no_speedup": "the stock script ran out of memory at every batch"}
    best = max(ran, key=lambda name: runs[name]["images_per_s_end_to_end"])
    count = runs[best]["images"]
    ours = next((name for name in ("defaults", f"defaults_{count}") if runs.get(name, {}).get("images") == count),
                "defaults")
    try:
        return {"stock_baseline": best, "speedup_of": ours, "speedup_over_stock": speedup(runs[ours], runs[best])}
    except ValueError as error:
        return {"stock_baseline": best, "speedup_of": ours, "speedup_over_stock": None, "no_speedup": str(error)}
