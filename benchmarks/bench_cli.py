"""The whole caption command, timed as a user runs it: `python -m encoder_graphs caption DIR` as a
process over a folder of generated JPEGs of varied sizes, with graphs and with `--no-graphs`.
End-to-end images/s counts everything (interpreter start, model build, capture, loading files,
writing records); the in-loop figure is the pipeline's own (its `items_per_s`; under torchrun the
job's: files of all ranks over the slowest rank's loop). `--gpus N` also runs the graphed command
as one torchrun job on N GPUs and reports its scaling over one GPU. Random weights (presets):
captions are noise, speed is real.
    python3 benchmarks/bench_cli.py [--preset qwen2.5-vl-3b] [--images 512] [--batch-size auto] [--gpus 2]
        [--cli-args=--compile] [--json out.json]
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


def run_command(folder: Path, work: Path, args: argparse.Namespace, graphs: bool, gpus: int = 1) -> dict:
    name = ("graphs" if graphs else "no_graphs") + (f"_{gpus}_gpus" if gpus > 1 else "")
    out, stats_path = work / f"{name}.jsonl", work / f"{name}.stats.json"
    launcher = [sys.executable] if gpus == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                   f"--nproc-per-node={gpus}"]
    command = launcher + ["-m", "encoder_graphs", "caption", str(folder), "--model", args.preset,
               "--out", str(out), "--stats-json", str(stats_path), "--max-new-tokens", str(args.new_tokens),
               "--batch-size", args.batch_size, "--quiet", *args.cli_args.split()] + ([] if graphs else ["--no-graphs"])
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
        "world_size": pipeline.get("world_size", 1),
        "prompt_padding_pct": pipeline.get("prompt_padding_pct"),
        "ranks": pipeline.get("ranks", []),
        "encoder_capture_s": stats["encoder"]["capture_seconds"],
        "compile_s": (stats["encoder"].get("compile") or {}).get("seconds", 0.0),
        "decoder_capture_s": stats["decoder"]["capture_seconds"] if stats["decoder"] else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen2.5-vl-3b")
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch-size", default="auto")
    parser.add_argument("--skip-no-graphs", action="store_true", help="time the graphed command only")
    parser.add_argument("--gpus", type=int, default=1, help="also run the graphed command under torchrun on this many GPUs")
    parser.add_argument("--cli-args", default="", help="more arguments for every caption command, as --cli-args=--compile")
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work_dir:
        work = Path(work_dir)
        write_jpegs(work / "images", args.images)
        runs = {"graphs": run_command(work / "images", work, args, graphs=True)}
        if not args.skip_no_graphs:
            runs["no_graphs"] = run_command(work / "images", work, args, graphs=False)
        if args.gpus > 1:
            runs[f"graphs_{args.gpus}_gpus"] = run_command(work / "images", work, args, graphs=True, gpus=args.gpus)
    env = environment()
    print(f"\n{args.preset}, {args.images} JPEGs 224-1024 px, {args.new_tokens} new tokens | {env}")
    rows = [[side, f"{r['batch_size']}", f"{r['wall_s']:.1f}", f"{r['startup_s']:.1f}", f"{r['images_per_s_end_to_end']:.2f}",
             f"{r['images_per_s_in_loop']:.2f}", f"{r['input_wait_s']:.2f}"] for side, r in runs.items()]
    print(markdown_table(["side", "batch", "process wall s", "start + load + capture s", "images/s end to end",
                          "images/s in loop", "model waited for files s"], rows))
    result = {"preset": args.preset, "images": args.images, "new_tokens": args.new_tokens, "cli_args": args.cli_args,
              "environment": env, "runs": runs}
    if args.gpus > 1:
        many, one = runs[f"graphs_{args.gpus}_gpus"], runs["graphs"]
        result["scaling"] = {key: many[key] / one[key] for key in ("images_per_s_in_loop", "images_per_s_end_to_end")}
        print(f"{args.gpus} GPUs over 1: in loop {result['scaling']['images_per_s_in_loop']:.2f}x, "
              f"end to end {result['scaling']['images_per_s_end_to_end']:.2f}x")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
