"""The headline: the caption command end to end, as a user runs it, on a folder of photo-sized
files (`photos.py`: phone and camera photos, screenshots, panoramas; fixed seed; `--pages`: document
pages from `pages.py`, scans to snippets, for an OCR model such as deepseek-ocr-2; `--clips N`:
video clips from `clips.py`, 360p to 1080p60, 10 s to 5 minutes, a VP9 WebM, a rotated phone
clip; `--mixed P,C`: P photos and C clips interleaved in one folder). Runs in one call, each a
fresh process over the same files at the same resolution policy:
- `defaults`: `python -m encoder_graphs caption FOLDER --model PRESET` (graphs, auto batch);
- `no_graphs`: the same with `--no-graphs`;
- `frames_model` (asked for by name): the defaults with `--max-frame-tokens model`, video frames
  at the checkpoint's own resolution;
- `cold` (asked for by name): the defaults as a fresh machine's first run, as near as a process
  can make it: empty Triton, inductor and preset caches, the page cache dropped where allowed
  (`page_cache_dropped` says); the untimed warm-up run warms only the other runs;
- `vllm`, `vllm_warm` (asked for by name): vLLM's offline `LLM.generate` (`peer_vllm.py`), its
  first start on the machine and a second one;
- `stock`: `stock_caption.py`, the official processor and `model.generate`, at each batch of
  `--stock-batches` (default 8 to 128; its best is the baseline of the ratio),
  what a user writes without this project (videos: 16 frames each, as the command's default).
Reported per run: process wall time, items/s end to end (start included) and in the loop (the
`images_*` keys say the same, kept for older readers), the start (process start until the loop),
time to the first caption after the weights are on the GPU, the model's wait for files, peak
GPU memory, peak host memory of the whole process tree (the command's video decoders are
processes of their own), and each kind's count where the stats report it. `--card-gib 24` adds
a run of the defaults with only that much GPU memory free (a second process holds the rest):
`--batch-size auto` must fit it with no batch retried. `--sizes 32,256` adds the defaults and
`--no-graphs` on the first N files. Before the timed runs, one untimed run of the defaults on 16
files reads the libraries into the page cache and fills Triton's kernel cache, so the first timed
run does not pay what a user pays once per machine; still, a call's first timed run can differ by
seconds: `--rounds R` runs our `--runs` (and `--sizes`) R times, each round in the reverse order of
the one before, and reports their medians (and the defaults over `--no-graphs` by them). `--gpus 2,4` runs the defaults as one torchrun job of 2 GPUs, then of 4. `--runs defaults,prompts_3`
times three named prompts a file (one pass, the image prefilled once) against one. Random weights (presets):
captions are noise, speed is real.
    python3 benchmarks/bench_cli.py [--preset qwen2.5-vl-3b] [--images 1024] [--runs defaults,no_graphs,stock]
        [--sizes 32,256] [--card-gib 24] [--cli-args=--compile] [--pages | --clips 512 | --mixed 768,256]
        [--json out.json]
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from baselines import PEER_RUNS, STOCK_BATCHES, run_peer, stock_sweep, subset
from pages import write_page_folder
from photos import write_photo_folder
from processes import run_measured
from timing import environment, markdown_table, over_stock, speedup, write_json

from encoder_graphs.app.walk import media_kind

HOLDER = """
import sys, time, torch
free, total = torch.cuda.mem_get_info()
keep = int(float(sys.argv[1]) * 2**30)
held = torch.empty(max(0, free - keep), dtype=torch.uint8, device="cuda")
print("held", held.numel(), flush=True)
time.sleep(3600)
"""
# The caption command's arguments of each run of ours that `--runs` may name.
OUR_RUNS = {"defaults": [], "no_graphs": ["--no-graphs"], "frames_model": ["--max-frame-tokens", "model"],
            "keyframes": ["--video-sampling", "keyframes"], "nvdec": ["--video-decoder", "nvdec"],
            "cpu_decoder": ["--video-decoder", "cpu"], "no_prefetch": [], "cold": [], "no_compile": ["--no-compile"], "shards": [],
            # Three captions a file in one pass (issue 43: at most 1.5x the loop time of `defaults`).
            "prompts_3": ["--prompt", "short=Describe this in one sentence.", "--prompt", "tags=List tags for this image.",
                          "--prompt", "long=Describe this image in detail."]}
# Runs that differ by the environment: no clips decoded while the model loads (`app/decoders.py`).
OUR_RUN_ENV = {"no_prefetch": {"ENCODER_GRAPHS_VIDEO_PREFETCH_BYTES": "0"}}
def caption_command(folder: Path, out: Path, stats: Path, args: argparse.Namespace, extra: list[str], gpus: int) -> list[str]:
    launcher = [sys.executable] if gpus == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}"]
    return launcher + ["-m", "encoder_graphs", "caption", str(folder), "--model", args.preset, "--out", str(out),
                       "--stats-json", str(stats), "--max-new-tokens", str(args.new_tokens), "--quiet",
                       *args.cli_args.split(), *extra]


def cold_start(work: Path) -> tuple[dict[str, str], bool]:
    """A first run on a fresh machine, as near as one process can make it: Triton's, inductor's
    and this project's caches empty (fresh folders), and, where this process may (root, a /proc/sys
    that is not read-only), the page cache dropped, so libraries are read from disk again. Its
    environment, and whether the page cache was dropped."""
    fresh = Path(tempfile.mkdtemp(prefix="cold-", dir=work))
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        dropped = True
    except OSError:
        dropped = False
    env = {"TRITON_CACHE_DIR": fresh / "triton", "TORCHINDUCTOR_CACHE_DIR": fresh / "inductor",
           "ENCODER_GRAPHS_CACHE": fresh / "encoder-graphs"}
    return {key: str(path) for key, path in env.items()}, dropped


def as_shards(folder: Path, work: Path, count: int = 16) -> str:
    """The folder's files packed into `count` WebDataset tar shards (a file a sample, keyed by its
    number), untimed: the brace list naming them."""
    import tarfile

    shards = work / "shards"
    shards.mkdir(exist_ok=True)
    files = sorted(path for path in folder.rglob("*") if media_kind(path) is not None)
    for index in range(count):
        with tarfile.open(shards / f"{index:05d}.tar", "w") as tar:
            for number, path in enumerate(files[index::count]):
                tar.add(path, arcname=f"{index:05d}{number:06d}{path.suffix.lower()}")
    return str(shards / f"{{00000..{count - 1:05d}}}.tar")


def run_ours(folder: Path, work: Path, name: str, args: argparse.Namespace, extra: list[str], gpus: int = 1,
             label: str | None = None) -> dict:
    """Our run `name` (a key of OUR_RUNS, or a label of its own), its outputs named by `label`
    (a later round's: `NAME_rK`), so that no run resumes another's."""
    label = label or name
    out, stats_path = work / f"{label}.jsonl", work / f"{label}.stats.json"
    if name == "shards":  # the same files as WebDataset shards, captioned into output shards
        folder, out = Path(as_shards(folder, work)), work / f"{label}-shard-captions"
    command = caption_command(folder, out, stats_path, args, extra, gpus)
    env, dropped = (cold_start(work) if name == "cold" else (OUR_RUN_ENV.get(name), None))
    _, wall_s, peak_host = run_measured(command, env)
    stats = json.loads(stats_path.read_text())
    pipeline, encoder, decoder = stats["pipeline"], stats["encoder"], stats["decoder"] or {}
    return {
        "command": " ".join(command[command.index("caption"):]),
        "env": env,
        "page_cache_dropped": dropped,  # a cold run's: whether the files were read from disk again
        "wall_s": wall_s,
        "images": pipeline["succeeded"],  # items captioned, whatever their kind (the key older reports read)
        "images_per_s_end_to_end": pipeline["succeeded"] / wall_s,
        "images_per_s_in_loop": pipeline["items_per_s"],
        "items_per_s_end_to_end": pipeline["succeeded"] / wall_s,
        "items_per_s_in_loop": pipeline["items_per_s"],
        "by_kind": pipeline.get("by_kind"),
        # Files a second of each kind's generate calls: a mixed folder's photos against a photo-only folder's.
        "items_per_batch_s_by_kind": pipeline.get("items_per_batch_s_by_kind"),
        "failed": pipeline.get("failed"), "failures": pipeline.get("failures"),
        "loop_s": pipeline["wall_s"],
        "start_s": wall_s - pipeline["wall_s"],
        "load_s": pipeline.get("load_s"),
        "setup_s": pipeline.get("setup_s"),
        "first_caption_after_load_s": pipeline.get("first_caption_after_load_s"),
        "input_wait_s": pipeline["input_wait_s"],
        "input_wait_pct": 100 * pipeline["input_wait_s"] / pipeline["wall_s"],
        "peak_gpu_memory_gib": pipeline.get("peak_gpu_memory_bytes", 0) / 2**30,
        "peak_host_memory_gib": peak_host / 2**30,
        "batch_size": pipeline["batch_size"],
        # videos batch apart, by limits of their own; `--video-decoder auto` decides by the job's size
        "video_batch_size": pipeline.get("video_batch_size"), "video_decoder": pipeline.get("video_decoder"),
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
        # Graphs whose capture failed (their shapes ran eagerly): a run with any fails the benchmark.
        "capture_failures": {**{f"encoder {path}, budget {budget}": reason
                                for path, failed in (encoder.get("failed_budgets") or {}).items()
                                for budget, reason in failed.items()},
                             **{f"decoder {key}": reason for key, reason in (decoder.get("failed_graphs") or {}).items()}},
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


def mixed_counts(text: str) -> tuple[int, int]:
    """`--mixed P,C`: photos and clips."""
    photos, clips = (int(n) for n in text.split(","))
    if photos < 0 or clips < 0:
        raise ValueError(text)
    return photos, clips


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen2.5-vl-3b")
    parser.add_argument("--images", type=int, default=1024, help="photos (or --pages) generated")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--runs", default="defaults,no_graphs,stock",
                        help=f"of {', '.join(OUR_RUNS)}, stock, {', '.join(PEER_RUNS)} (vLLM's LLM.generate: peer_vllm.py)")
    parser.add_argument("--sizes", type=lambda t: [int(n) for n in t.split(",") if n], default=[],
                        help="also defaults and --no-graphs on the first N files, e.g. 32,256 (as many --rounds)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run our --runs (and --sizes) this many times, each round in the reverse order of the one "
                        "before (the first run of a call can differ by seconds); the report gives their medians")
    parser.add_argument("--card-gib", type=float, default=0, help="also the defaults with only this much GPU memory free")
    parser.add_argument("--stock-images", type=int, default=0, help="run the stock script on the first N files only")
    parser.add_argument("--stock-batches", type=lambda t: [int(b) for b in t.split(",")], default=STOCK_BATCHES,
                        help="the stock script's batch sizes, each a run: its best is the baseline (default: "
                        f"{','.join(map(str, STOCK_BATCHES))}; a batch out of memory ends the sweep)")
    parser.add_argument("--gpus", type=lambda t: [int(n) for n in t.split(",")], default=[1],
                        help="also the defaults under torchrun on each of these many GPUs, as 2,4")
    parser.add_argument("--cli-args", default="", help="more arguments for every caption command, as --cli-args=--compile")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--folder", type=Path, help="a folder of files to use instead of the generated photos")
    source.add_argument("--pages", action="store_true", help="generated document pages (pages.py) instead of photos")
    source.add_argument("--clips", type=int, default=0, metavar="N", help="N generated video clips (clips.py) instead")
    source.add_argument("--mixed", type=mixed_counts, metavar="P,C", help="P photos and C clips in one folder instead")
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args()
    unknown = [name for name in args.runs.split(",") if name and name not in {*OUR_RUNS, "stock", *PEER_RUNS}]
    if unknown:
        parser.error(f"--runs: unknown {', '.join(unknown)} (of {', '.join([*OUR_RUNS, 'stock', *PEER_RUNS])})")
    peers = [name for name in args.runs.split(",") if name in PEER_RUNS]
    if peers and (args.clips or args.mixed or (args.folder is not None and unit(args) != "images")):
        parser.error(f"--runs {','.join(peers)}: peer_vllm.py reads photos only; drop it, or caption photos or pages")
    return args


def folder_kind(args: argparse.Namespace) -> str:
    if args.folder is not None:
        return "folder"
    return "pages" if args.pages else "clips" if args.clips else "mixed" if args.mixed else "photos"


def unit(args: argparse.Namespace) -> str:
    """What the table counts: clips, items (a mixed folder's photos and clips) or images; for a
    given folder, by what the command would read in it."""
    kind = folder_kind(args)
    if kind == "folder":
        kinds = {media_kind(path) for path in args.folder.rglob("*")} - {None}
        kind = "clips" if kinds == {"video"} else "mixed" if len(kinds) > 1 else "photos"
    return {"clips": "clips", "mixed": "items"}.get(kind, "images")


def write_folder(args: argparse.Namespace, folder: Path) -> dict:
    """The generated folder every run reads: its kind, files, bytes and the time it took."""
    kind, started = folder_kind(args), time.perf_counter()
    if kind in ("clips", "mixed"):
        from clips import write_clip_folder, write_mixed_folder  # PyAV, only where clips are written

        paths = write_clip_folder(folder, args.clips) if kind == "clips" else write_mixed_folder(folder, *args.mixed)
    else:
        paths = (write_page_folder if kind == "pages" else write_photo_folder)(folder, args.images)
    written = {"kind": kind, "files": len(paths), "bytes": sum(path.stat().st_size for path in paths),
               "generate_s": time.perf_counter() - started}
    print(f"wrote {written['files']} {kind} ({written['bytes'] / 2**30:.2f} GiB) in {written['generate_s']:.1f} s",
          file=sys.stderr)
    return written


def given_folder(folder: Path) -> dict:
    """A `--folder`'s files the command reads (images and videos), and their bytes."""
    paths = [path for path in folder.rglob("*") if media_kind(path) is not None]
    return {"kind": "folder", "files": len(paths), "bytes": sum(path.stat().st_size for path in paths),
            "generate_s": None}


def main() -> None:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-cli-"))
    try:
        folder = args.folder or work / folder_kind(args)
        written = write_folder(args, folder) if args.folder is None else given_folder(folder)
        runs: dict[str, dict] = {}
        print("untimed warm-up run ...", file=sys.stderr)
        run_ours(subset(folder, work, 16), work, "warm_up", args, [])
        chosen = args.runs.split(",") if args.runs else []
        for name in chosen:
            print(f"run {name} ...", file=sys.stderr)
            if name == "stock":
                runs.update(stock_sweep(folder, work, args))
            elif name in PEER_RUNS:
                try:  # a peer that cannot start (not installed, an engine error) costs its row only
                    runs[name] = run_peer(folder, work, args)
                except Exception as error:  # noqa: BLE001 (its row says why; the others stand)
                    runs[name] = {"error": f"{type(error).__name__}: {error}"[-2000:]}
                    print(f"{name}: did not run; its error is in the JSON", file=sys.stderr)
                if name == "vllm_warm" and "error" in runs.get("vllm", {}):
                    runs[name]["first_start"] = True  # the run before it failed: nothing was warm
            else:
                runs[name] = run_ours(folder, work, name, args, OUR_RUNS[name])
            save_partial(args, runs)
        ours = [name for name in chosen if name in OUR_RUNS]
        for round_ in range(2, args.rounds + 1):  # round 2 in reverse, round 3 as the first, ...
            for name in ours if round_ % 2 else ours[::-1]:
                runs[f"{name}_r{round_}"] = run_ours(folder, work, name, args, OUR_RUNS[name], label=f"{name}_r{round_}")
                save_partial(args, runs)
        for count in args.sizes:
            small, pair = subset(folder, work, count), (("defaults", []), ("no_graphs", ["--no-graphs"]))
            for round_ in range(1, args.rounds + 1):
                for name, extra in pair if round_ % 2 else pair[::-1]:
                    key = f"{name}_{count}" + (f"_r{round_}" if round_ > 1 else "")
                    runs[key] = run_ours(small, work, key, args, extra)
        if args.card_gib:
            runs[f"defaults_{args.card_gib:g}_gib_free"] = on_a_smaller_card(folder, work, args)
        for gpus in [n for n in args.gpus if n > 1]:
            runs[f"defaults_{gpus}_gpus"] = run_ours(folder, work, f"gpus_{gpus}", args, [], gpus)
            save_partial(args, runs)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(args, runs, written)


def save_partial(args: argparse.Namespace, runs: dict[str, dict]) -> None:
    """The runs so far, marked partial: a call cut off by its time limit keeps what it measured."""
    if args.json:
        Path(args.json).write_text(json.dumps({"preset": args.preset, "partial": True, "new_tokens": args.new_tokens,
                                               "environment": environment(), "runs": runs}, indent=1))


def round_medians(args: argparse.Namespace, runs: dict[str, dict]) -> dict[str, dict]:
    """Each of our runs' (and `--sizes`') medians over its `--rounds` (wall s, items/s end to end and
    in the loop), printed; with the defaults and `--no-graphs` both run, the ratio of their medians."""
    result: dict[str, dict] = {}
    names = [name for name in args.runs.split(",") if name in OUR_RUNS]
    for name in names + [f"{name}_{count}" for count in args.sizes for name in ("defaults", "no_graphs")]:
        rounds = [runs[name], *(runs[f"{name}_r{k}"] for k in range(2, args.rounds + 1))]
        result[name] = {key: statistics.median(r[key] for r in rounds)
                        for key in ("wall_s", "items_per_s_end_to_end", "items_per_s_in_loop")}
        print(f"{name}: medians of {len(rounds)} rounds: {result[name]}")
    if "defaults" in result and "no_graphs" in result:
        ours, theirs = result["defaults"], result["no_graphs"]
        result["defaults_over_no_graphs"] = {"end_to_end": ours["items_per_s_end_to_end"] / theirs["items_per_s_end_to_end"],
                                             "in_loop": ours["items_per_s_in_loop"] / theirs["items_per_s_in_loop"]}
        print(f"defaults over no_graphs, medians: {result['defaults_over_no_graphs']}")
    return result


def describe_source(args: argparse.Namespace) -> str:
    kind = folder_kind(args)
    if kind == "folder":
        return str(args.folder)
    if kind == "clips":
        return f"{args.clips} generated clips (clips.py, seed 0, with its specials)"
    if kind == "mixed":
        return f"{args.mixed[0]} generated photos and {args.mixed[1]} clips interleaved (clips.py, seed 0)"
    generated = "pages (pages.py" if kind == "pages" else "photos (photos.py"
    return f"{args.images} generated {generated}, seed 0)"


def report(args: argparse.Namespace, runs: dict[str, dict], written: dict) -> None:
    env = environment()
    source, what = describe_source(args), unit(args)
    print(f"\n{args.preset}, {source}, {args.new_tokens} new tokens | {env}")
    rows = [[name, str(r["images"]), str(r["batch_size"] or r.get("video_batch_size")), f"{r['wall_s']:.1f}", f"{r['items_per_s_end_to_end']:.2f}",
             f"{r['items_per_s_in_loop']:.2f}", f"{r['start_s']:.1f}", f"{r['first_caption_after_load_s']:.1f}",
             f"{r['input_wait_pct']:.1f}", f"{r['peak_gpu_memory_gib']:.1f}" + ("*" if r.get("gpu_memory_is_card_use") else ""),
             f"{r['peak_host_memory_gib']:.1f}"]
            for name, r in runs.items() if not r.get("out_of_memory") and "error" not in r]
    print(markdown_table(["run", what, "batch", "wall s", f"{what}/s end to end", f"{what}/s in loop", "start s",
                          "first caption s after load", "input wait % of loop", "peak GPU GiB",
                          "peak host GiB (process tree)"], rows))
    if any(r.get("gpu_memory_is_card_use") for r in runs.values()):
        print("* the card's use at the end, not the run's peak: vLLM reserves --gpu-memory-utilization of it")
    for name, r in runs.items():
        if "error" in r:
            print(f"{name}: did not run: {(r['error'].strip().splitlines() or ['?'])[-1]}")
            continue
        if r.get("first_start"):
            print(f"{name}: the vLLM run before it failed, so this was vLLM's first start on the machine")
        if r.get("out_of_memory"):
            print(f"{name}: out of GPU memory at batch {r['batch_size']} ({r['out_of_memory']})")
            continue
        paths = (r.get("encoder") or {}).get("paths") or {}
        replays = ", ".join(f"{path} {p['hits']} replayed / {p['misses']} eager" for path, p in paths.items())
        decoder = r.get("decoder") or {}
        if replays or decoder.get("steps"):
            steps = f"{decoder.get('graph_steps')} of {decoder.get('steps')}"
            print(f"{name}: encoder {replays or '-'}; decode steps {steps} replayed")
        if r.get("by_kind") and (folder_kind(args) in ("mixed", "folder") or r.get("failed")):
            kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(r["by_kind"].items()))
            failed = f"; failed {r['failed']} ({r.get('failures')})" if r.get("failed") else ""
            print(f"{name}: {kinds}{failed}")
    result = {"preset": args.preset, "images": written["files"], "items": written["files"], "unit": what,
              "source": source, "folder": written, "new_tokens": args.new_tokens, "cli_args": args.cli_args,
              "environment": env, "runs": runs}
    if args.rounds > 1:
        result["rounds"] = round_medians(args, runs)
    if any(name == "stock" or name.startswith("stock_batch_") for name in runs) and "defaults" in runs:
        result.update(over_stock(runs))
        print(f"{result['speedup_of']} over {result['stock_baseline']}: {result['speedup_over_stock'] or result['no_speedup']}")
    peers = [name for name in PEER_RUNS if name in runs and "error" not in runs[name]]
    if peers and "defaults" in runs:
        result["speedup_over_peer"] = {name: speedup(runs["defaults"], runs[name]) for name in peers}
        print(f"defaults over {', '.join(peers)}: {result['speedup_over_peer']}")
    write_json(args.json, result)
    failures = {name: r["capture_failures"] for name, r in runs.items() if r.get("capture_failures")}
    if failures:
        sys.exit(f"missed: graph captures failed (those shapes ran eagerly): {failures}")


if __name__ == "__main__":
    main()
