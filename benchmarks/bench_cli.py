"""The headline: the caption command end to end, as a user runs it, on a folder of photo-sized
files (`photos.py`: phone and camera photos, screenshots, panoramas; fixed seed; `--pages`: document
pages from `pages.py`, scans to snippets, for an OCR model such as deepseek-ocr-2). Three runs in
one call, each a fresh process over the same files at the same resolution policy:
- `defaults`: `python -m encoder_graphs caption FOLDER --model PRESET` (graphs, auto batch);
- `no_graphs`: the same with `--no-graphs`;
- `stock`: `stock_caption.py`, the official processor and `model.generate` in batches of 8,
  what a user writes without this project.
Reported per run: process wall time, images/s end to end (start included) and in the loop, the
start (process start until the loop), time to the first caption after the weights are on the
GPU, the model's wait for files, peak GPU memory. `--card-gib 24` adds a run of the defaults
with only that much GPU memory free (a second process holds the rest): `--batch-size auto` must
fit it with no batch retried. `--sizes 32,256` adds the defaults and `--no-graphs` on the first N
files, `--repeats R` times each (their order alternating; the report gives each one's median wall
time: a start varies by a second or more between processes). Before the timed runs, one untimed
run of the defaults on 16 files reads the libraries into the page cache and fills Triton's kernel
cache, so the first timed run does not pay what a user pays once per machine. `--gpus N` runs the defaults as one torchrun job of N GPUs. Random weights (presets):
captions are noise, speed is real.
    python3 benchmarks/bench_cli.py [--preset qwen2.5-vl-3b] [--images 1024] [--runs defaults,no_graphs,stock]
        [--sizes 32,256] [--card-gib 24] [--cli-args=--compile] [--pages] [--json out.json]
"""

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pages import write_page_folder
from photos import write_photo_folder
from timing import environment, markdown_table, write_json

HOLDER = """
import sys, time, torch
free, total = torch.cuda.mem_get_info()
keep = int(float(sys.argv[1]) * 2**30)
held = torch.empty(max(0, free - keep), dtype=torch.uint8, device="cuda")
print("held", held.numel(), flush=True)
time.sleep(3600)
"""


def caption_command(folder: Path, out: Path, stats: Path, args: argparse.Namespace, extra: list[str], gpus: int) -> list[str]:
    launcher = [sys.executable] if gpus == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}"]
    return launcher + ["-m", "encoder_graphs", "caption", str(folder), "--model", args.preset, "--out", str(out),
                       "--stats-json", str(stats), "--max-new-tokens", str(args.new_tokens), "--quiet",
                       *args.cli_args.split(), *extra]


def run_ours(folder: Path, work: Path, name: str, args: argparse.Namespace, extra: list[str], gpus: int = 1) -> dict:
    out, stats_path = work / f"{name}.jsonl", work / f"{name}.stats.json"
    command = caption_command(folder, out, stats_path, args, extra, gpus)
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    wall_s = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {result.returncode}:\n{result.stderr[-4000:]}")
    stats = json.loads(stats_path.read_text())
    pipeline, encoder, decoder = stats["pipeline"], stats["encoder"], stats["decoder"] or {}
    return {
        "command": " ".join(command[command.index("caption"):]),
        "wall_s": wall_s,
        "images": pipeline["succeeded"],
        "images_per_s_end_to_end": pipeline["succeeded"] / wall_s,
        "images_per_s_in_loop": pipeline["items_per_s"],
        "loop_s": pipeline["wall_s"],
        "start_s": wall_s - pipeline["wall_s"],
        "load_s": pipeline.get("load_s"),
        "setup_s": pipeline.get("setup_s"),
        "first_caption_after_load_s": pipeline.get("first_caption_after_load_s"),
        "input_wait_s": pipeline["input_wait_s"],
        "input_wait_pct": 100 * pipeline["input_wait_s"] / pipeline["wall_s"],
        "peak_gpu_memory_gib": pipeline.get("peak_gpu_memory_bytes", 0) / 2**30,
        "batch_size": pipeline["batch_size"],
        "retried_batches": pipeline["retried_batches"],
        "generated_tokens": pipeline["generated_tokens"],
        "prompt_tokens_mean": pipeline["prompt_tokens"] / max(1, pipeline["succeeded"]),
        "longest_sequence": pipeline.get("longest_sequence"),
        "world_size": pipeline.get("world_size", 1),
        "encoder": {k: encoder.get(k) for k in ("items", "graph_items", "calls", "capture_seconds", "captured_budgets",
                                                "budget_costs_ms", "paths", "graph_memory_bytes", "latency_ms")},
        "decoder": {k: decoder.get(k) for k in ("steps", "graph_steps", "capture_seconds", "captured_graphs",
                                                "static_buffer_bytes", "decode_ms_per_step")},
        "compile_s": (encoder.get("compile") or {}).get("seconds", 0.0),
    }


def run_stock(folder: Path, work: Path, args: argparse.Namespace) -> dict:
    if args.stock_images:
        folder = subset(folder, work, args.stock_images)
    command = [sys.executable, str(Path(__file__).with_name("stock_caption.py")), str(folder), "--preset", args.preset,
               "--new-tokens", str(args.new_tokens), "--out", str(work / "stock.jsonl")]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    wall_s = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {result.returncode}:\n{result.stderr[-4000:]}")
    stats = json.loads(result.stdout.strip().splitlines()[-1])
    return {
        **stats,
        "command": "stock_caption.py " + " ".join(command[2:]),
        "wall_s": wall_s,
        "images_per_s_end_to_end": stats["images"] / wall_s,
        "images_per_s_in_loop": stats["images"] / stats["loop_s"],
        "start_s": wall_s - stats["loop_s"],
        "input_wait_pct": 100 * stats["input_wait_s"] / stats["loop_s"],
        "peak_gpu_memory_gib": stats["peak_gpu_memory_bytes"] / 2**30,
        "batch_size": 8,
    }


def on_a_smaller_card(folder: Path, work: Path, args: argparse.Namespace) -> dict:
    """The defaults with only `args.card_gib` GiB of GPU memory free: a second process holds the rest."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(args.card_gib)], stdout=subprocess.PIPE, text=True)
    try:
        holder.stdout.readline()  # "held ...": the memory is taken
        return run_ours(folder, work, f"card_{args.card_gib}_gib", args, [])
    finally:
        holder.kill()
        holder.wait()


def subset(folder: Path, work: Path, count: int) -> Path:
    """A folder of links to the first `count` files."""
    target = work / f"first_{count}"
    if target.exists():
        return target
    target.mkdir()
    for path in sorted(folder.iterdir())[:count]:
        (target / path.name).symlink_to(path)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen2.5-vl-3b")
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--runs", default="defaults,no_graphs,stock", help="of defaults, no_graphs, stock")
    parser.add_argument("--sizes", default="", help="also defaults and --no-graphs on the first N files, e.g. 32,256")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each --sizes configuration")
    parser.add_argument("--card-gib", type=float, default=0, help="also the defaults with only this much GPU memory free")
    parser.add_argument("--stock-images", type=int, default=0, help="run the stock script on the first N files only")
    parser.add_argument("--gpus", type=int, default=1, help="also the defaults under torchrun on this many GPUs")
    parser.add_argument("--cli-args", default="", help="more arguments for every caption command, as --cli-args=--compile")
    parser.add_argument("--folder", type=Path, help="a folder of files to use instead of the generated photos")
    parser.add_argument("--pages", action="store_true", help="generated document pages (pages.py) instead of photos")
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-cli-"))
    try:
        folder = args.folder or work / ("pages" if args.pages else "photos")
        if args.folder is None:
            started = time.perf_counter()
            (write_page_folder if args.pages else write_photo_folder)(folder, args.images)
            print(f"wrote {args.images} {folder.name} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
        runs: dict[str, dict] = {}
        print("untimed warm-up run ...", file=sys.stderr)
        run_ours(subset(folder, work, 16), work, "warm_up", args, [])
        chosen = args.runs.split(",") if args.runs else []
        for name in chosen:
            print(f"run {name} ...", file=sys.stderr)
            if name == "stock":
                runs[name] = run_stock(folder, work, args)
            else:
                runs[name] = run_ours(folder, work, name, args, [] if name == "defaults" else ["--no-graphs"])
        for count in [int(n) for n in args.sizes.split(",") if n]:
            small = subset(folder, work, count)
            for repeat in range(args.repeats):
                pair = (("defaults", []), ("no_graphs", ["--no-graphs"]))
                for name, extra in pair if repeat % 2 == 0 else pair[::-1]:
                    key = f"{name}_{count}" + (f"_{repeat + 1}" if repeat else "")
                    runs[key] = run_ours(small, work, key, args, extra)
        if args.card_gib:
            runs[f"defaults_{args.card_gib:g}_gib_free"] = on_a_smaller_card(folder, work, args)
        if args.gpus > 1:
            runs[f"defaults_{args.gpus}_gpus"] = run_ours(folder, work, f"gpus_{args.gpus}", args, [], args.gpus)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(args, runs)


def medians(args: argparse.Namespace, runs: dict[str, dict]) -> dict[str, float]:
    """Each repeated configuration's median wall time, printed."""
    result = {}
    for count in [int(n) for n in args.sizes.split(",") if n]:
        for name in ("defaults", "no_graphs"):
            walls = [r["wall_s"] for key, r in runs.items() if key == f"{name}_{count}" or key.startswith(f"{name}_{count}_")]
            result[f"{name}_{count}"] = statistics.median(walls)
            print(f"{name}_{count}: median wall {result[f'{name}_{count}']:.2f} s of {len(walls)} runs "
                  f"({', '.join(f'{w:.2f}' for w in walls)})")
    return result


def report(args: argparse.Namespace, runs: dict[str, dict]) -> None:
    env = environment()
    generated = "pages (pages.py" if args.pages else "photos (photos.py"
    source = str(args.folder) if args.folder else f"{args.images} generated {generated}, seed 0)"
    print(f"\n{args.preset}, {source}, {args.new_tokens} new tokens | {env}")
    rows = [[name, str(r["images"]), str(r["batch_size"]), f"{r['wall_s']:.1f}", f"{r['images_per_s_end_to_end']:.2f}",
             f"{r['images_per_s_in_loop']:.2f}", f"{r['start_s']:.1f}", f"{r['first_caption_after_load_s']:.1f}",
             f"{r['input_wait_pct']:.1f}", f"{r['peak_gpu_memory_gib']:.1f}"] for name, r in runs.items()]
    print(markdown_table(["run", "images", "batch", "wall s", "images/s end to end", "images/s in loop", "start s",
                          "first caption s after load", "input wait % of loop", "peak GPU GiB"], rows))
    for name, r in runs.items():
        paths = (r.get("encoder") or {}).get("paths") or {}
        replays = ", ".join(f"{path} {p['hits']} replayed / {p['misses']} eager" for path, p in paths.items())
        decoder = r.get("decoder") or {}
        if replays or decoder.get("steps"):
            steps = f"{decoder.get('graph_steps')} of {decoder.get('steps')}"
            print(f"{name}: encoder {replays or '-'}; decode steps {steps} replayed")
    result = {"preset": args.preset, "images": args.images, "source": source, "new_tokens": args.new_tokens,
              "cli_args": args.cli_args, "environment": env, "runs": runs}
    if args.repeats > 1:
        result["median_wall_s"] = medians(args, runs)
    if "stock" in runs and "defaults" in runs:
        result["speedup_over_stock"] = {
            key: runs["defaults"][key] / runs["stock"][key] for key in ("images_per_s_end_to_end", "images_per_s_in_loop")
        }
        print("defaults over stock: end to end {images_per_s_end_to_end:.2f}x, in loop {images_per_s_in_loop:.2f}x".format(
            **result["speedup_over_stock"]))
    write_json(args.json, result)


if __name__ == "__main__":
    main()
