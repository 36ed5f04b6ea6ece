"""What the caption command is measured against, each run as its own process over the same files:
the stock script (`stock_caption.py`) at each batch of a sweep, and the peer, vLLM's offline
`LLM.generate` (`peer_vllm.py`). Each prints one JSON line of timings, reported here in the keys
of ours."""

import argparse
import json
import sys
from pathlib import Path

from processes import run_measured

# The stock script's batches swept by default: its best is what a user would run (on an H200 at 256
# photos it ran fastest at 64, the largest tried then, and was still gaining).
STOCK_BATCHES = [8, 16, 32, 64, 128]
# vLLM, the peer (`peer_vllm.py`): its first run on a machine compiles and fills ~/.cache/vllm, a
# second (`vllm_warm`, named after `vllm`) reuses it.
PEER_RUNS = ("vllm", "vllm_warm")


def run_stock(folder: Path, work: Path, args: argparse.Namespace, batch_size: int = 8) -> dict:
    if args.stock_images:
        folder = subset(folder, work, args.stock_images)
    command = [sys.executable, str(Path(__file__).with_name("stock_caption.py")), str(folder), "--preset", args.preset,
               "--new-tokens", str(args.new_tokens), "--out", str(work / "stock.jsonl"), "--batch-size", str(batch_size)]
    return run_script(command)


def run_peer(folder: Path, work: Path, args: argparse.Namespace) -> dict:
    """vLLM's `LLM.generate` over the same files (`peer_vllm.py`); its checkpoint (the preset's
    random weights, which ours builds in its process) written first, untimed, once a call."""
    script = str(Path(__file__).with_name("peer_vllm.py"))
    checkpoint = work / "vllm-checkpoint"
    if not (checkpoint / "config.json").is_file():
        run_measured([sys.executable, script, "--write-checkpoint", "--checkpoint", str(checkpoint), "--preset", args.preset])
    return run_script([sys.executable, script, str(folder), "--checkpoint", str(checkpoint),
                       "--new-tokens", str(args.new_tokens), "--out", str(work / "vllm.jsonl")],
                      env={"VLLM_LOGGING_STREAM": "ext://sys.stderr"})  # stdout's last line is the JSON


def run_script(command: list[str], env: dict[str, str] | None = None) -> dict:
    """A baseline script's run (`stock_caption.py`, `peer_vllm.py`: one JSON line of timings), in
    the keys of ours."""
    result, wall_s, peak_host = run_measured(command, env)
    stats = json.loads(result.stdout.strip().splitlines()[-1])
    videos = stats.get("videos", 0)
    return {
        **stats,
        "command": " ".join([Path(command[1]).name, *command[2:]]),
        "wall_s": wall_s,
        "images_per_s_end_to_end": stats["images"] / wall_s,
        "images_per_s_in_loop": stats["images"] / stats["loop_s"],
        "items_per_s_end_to_end": stats["images"] / wall_s,
        "items_per_s_in_loop": stats["images"] / stats["loop_s"],
        "by_kind": {kind: n for kind, n in (("image", stats["images"] - videos), ("video", videos)) if n},
        "start_s": wall_s - stats["loop_s"],
        "input_wait_pct": 100 * stats["input_wait_s"] / stats["loop_s"],
        "peak_gpu_memory_gib": stats["peak_gpu_memory_bytes"] / 2**30,
        "peak_host_memory_gib": peak_host / 2**30,
        "batch_size": stats.get("batch_size", 8),
    }


def stock_sweep(folder: Path, work: Path, args: argparse.Namespace) -> dict[str, dict]:
    """The stock script at each of `--stock-batches`, smallest first: what a user would run at its
    best batch. A batch that runs out of GPU memory is recorded as such and ends the sweep (a
    larger one would too)."""
    runs = {}
    for batch in sorted(args.stock_batches):
        key = "stock" if len(args.stock_batches) == 1 else f"stock_batch_{batch}"
        try:
            runs[key] = run_stock(folder, work, args, batch)
        except RuntimeError as error:
            if "OutOfMemoryError" not in str(error) and "out of memory" not in str(error).lower():
                raise
            said = [line for line in str(error).splitlines() if "out of memory" in line.lower()]
            runs[key] = {"batch_size": batch, "out_of_memory": (said or str(error).splitlines())[-1][:300]}
            print(f"{key}: out of GPU memory; larger batches not run", file=sys.stderr)
            break
    return runs


def subset(folder: Path, work: Path, count: int) -> Path:
    """A folder of links to the first `count` files."""
    target = work / f"first_{count}"
    if target.exists():
        return target
    target.mkdir()
    for path in sorted(folder.iterdir())[:count]:
        (target / path.name).symlink_to(path)
    return target
