"""The whole caption command, timed as a user runs it: `python -m encoder_graphs caption DIR` as a
process over a folder of generated JPEGs of varied sizes, with graphs and with `--no-graphs`.
End-to-end images/s counts everything (interpreter start, model build, capture, loading files,
writing records); the in-loop figure is the pipeline's own (its `items_per_s`). Random weights
(presets): captions are noise, speed is real.
    python3 benchmarks/bench_cli.py [--preset qwen2.5-vl-3b] [--images 512] [--batch-size auto] [--json out.json]
"""

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_caption import synthetic_image
from timing import environment, markdown_table, write_json


def write_jpegs(folder: Path, count: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        synthetic_image(rng.randint(224, 1024), rng.randint(224, 1024), rng).save(folder / f"{index:05d}.jpg", quality=90)


def run_command(folder: Path, work: Path, args: argparse.Namespace, graphs: bool) -> dict:
    name = "graphs" if graphs else "no_graphs"
    out, stats_path = work / f"{name}.jsonl", work / f"{name}.stats.json"
    command = [sys.executable, "-m", "encoder_graphs", "caption", str(folder), "--model", args.preset,
               "--out", str(out), "--stats-json", str(stats_path), "--max-new-tokens", str(args.new_tokens),
               "--batch-size", args.batch_size, "--quiet"] + ([] if graphs else ["--no-graphs"])
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    wall_s = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {result.returncode}:\n{result.stderr[-4000:]}")
    stats = json.loads(stats_path.read_text())
    pipeline = stats["pipeline"]
    return {
        "wall_s": wall_s,
        "images_per_s_end_to_end": pipeline["succeeded"] / wall_s,
        "images_per_s_in_loop": pipeline["items_per_s"],
        "loop_s": pipeline["wall_s"],
        "startup_s": wall_s - pipeline["wall_s"],
        "input_wait_s": pipeline["input_wait_s"],
        "batch_size": pipeline["batch_size"],
        "succeeded": pipeline["succeeded"],
        "encoder_capture_s": stats["encoder"]["capture_seconds"],
        "decoder_capture_s": stats["decoder"]["capture_seconds"] if stats["decoder"] else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen2.5-vl-3b")
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch-size", default="auto")
    parser.add_argument("--skip-no-graphs", action="store_true", help="time the graphed command only")
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work_dir:
        work = Path(work_dir)
        write_jpegs(work / "images", args.images)
        runs = {"graphs": run_command(work / "images", work, args, graphs=True)}
        if not args.skip_no_graphs:
            runs["no_graphs"] = run_command(work / "images", work, args, graphs=False)
    env = environment()
    print(f"\n{args.preset}, {args.images} JPEGs 224-1024 px, {args.new_tokens} new tokens | {env}")
    rows = [[side, f"{r['batch_size']}", f"{r['wall_s']:.1f}", f"{r['startup_s']:.1f}", f"{r['images_per_s_end_to_end']:.2f}",
             f"{r['images_per_s_in_loop']:.2f}", f"{r['input_wait_s']:.2f}"] for side, r in runs.items()]
    print(markdown_table(["side", "batch", "process wall s", "start + load + capture s", "images/s end to end",
                          "images/s in loop", "model waited for files s"], rows))
    write_json(args.json, {"preset": args.preset, "images": args.images, "new_tokens": args.new_tokens,
                           "environment": env, "runs": runs})


if __name__ == "__main__":
    main()
