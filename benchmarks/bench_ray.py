"""Ray Data against torchrun on one host's GPUs (issue 43): the same photos as Parquet shards
(columns `key`, `image` bytes), captioned by the caption command on one GPU (`one_gpu`, the
baseline of the ratios), by the same under torchrun (one rank a GPU, Parquet output shards) and
by `ray.data.read_parquet(...).map_batches(RayCaptioner, batch_size=MAP_BATCH, num_gpus=1,
concurrency=GPUS).write_parquet(...)`, each a fresh process, start included (Ray's cluster
start, each actor's model load and graphs). Reported per run: wall time, images/s end to end,
the ratio to one GPU, rows written, errors, peak host memory of the process tree; for Ray a
timeline (the driver's imports, Ray up, actors ready, first and last call, each actor's time in
its calls). Random weights (presets): captions are noise, speed is real.
    python3 benchmarks/bench_ray.py [--images 1024] [--gpus 4] [--shards 16] [--runs one_gpu,torchrun,ray]
        [--json out.json]
"""

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from photos import write_photo_folder
from processes import run_measured
from timing import environment, markdown_table, write_json

RAY_SCRIPT = """
import json, os, sys, time
source, out, preset, gpus, batch, map_batch, tokens, actor_gpus, log = sys.argv[1:10]


def note(event, **fields):  # the run's timeline, one JSON line an event (the actors' too)
    with open(log, "a") as f:
        f.write(json.dumps({"t": time.time(), "pid": os.getpid(), "event": event, **fields}) + "\\n")


note("driver_start")
import ray
from encoder_graphs.app.ray_data import RayCaptioner

note("imported")


class Timed(RayCaptioner):
    def __init__(self, *args, **kwargs):
        note("actor_start")
        super().__init__(*args, **kwargs)
        note("actor_ready")

    def __call__(self, rows):
        note("call_start", rows=len(rows["key"]))
        out = super().__call__(rows)
        note("call_end")
        return out


ray.init(num_gpus=int(gpus) * int(actor_gpus), num_cpus=None if int(actor_gpus) else 8, include_dashboard=False,
         log_to_driver=False)
note("ray_ready")
ds = ray.data.read_parquet(source)
ds = ds.map_batches(Timed, fn_constructor_kwargs={"model": preset or None, "batch_size": int(batch),
                    "max_new_tokens": int(tokens)}, batch_size=int(map_batch), num_gpus=int(actor_gpus),
                    concurrency=int(gpus))
ds.write_parquet(out)
note("written")
"""


def timeline(log: Path, started: float) -> dict:
    """Where a Ray run's time went, in seconds from its process start: the driver's imports done,
    Ray up, the first actor's constructor entered, the actors ready (first, last), the first call,
    the last call's end, the output written; each actor's time in its calls (mean, max) and the
    calls' rows."""
    import json

    events = [json.loads(line) for line in log.read_text().splitlines()]

    def at(name: str) -> list[float]:
        return sorted(e["t"] - started for e in events if e["event"] == name)

    busy: dict[int, float] = {}
    begun: dict[int, float] = {}
    for e in events:
        if e["event"] == "call_start":
            begun[e["pid"]] = e["t"]
        elif e["event"] == "call_end":
            busy[e["pid"]] = busy.get(e["pid"], 0.0) + e["t"] - begun.pop(e["pid"])
    ready, calls = at("actor_ready"), at("call_start")
    return {"imported_s": at("imported")[0], "ray_ready_s": at("ray_ready")[0], "first_actor_start_s": at("actor_start")[0],
            "first_actor_ready_s": ready[0], "last_actor_ready_s": ready[-1],
            "first_call_s": calls[0], "last_call_end_s": at("call_end")[-1], "written_s": at("written")[-1],
            "calls": len(calls), "rows_per_call": sorted({e["rows"] for e in events if e["event"] == "call_start"}),
            "actor_busy_s_mean": sum(busy.values()) / len(busy), "actor_busy_s_max": max(busy.values())}


def as_parquet(folder: Path, target: Path, shards: int) -> list[Path]:
    """The folder's files as `shards` Parquet files of (key, image bytes), in sorted order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = sorted(path for path in folder.iterdir() if path.is_file())
    target.mkdir(parents=True)
    written = []
    for index in range(shards):
        part = files[index::shards]
        table = pa.table({"key": [path.stem for path in part], "image": [path.read_bytes() for path in part]})
        written.append(target / f"{index:05d}.parquet")
        pq.write_table(table, written[-1], row_group_size=64)
    return written


def counted(folder: Path) -> tuple[int, int]:
    """(rows, error rows) of the Parquet files under `folder`."""
    import pyarrow.parquet as pq

    table = pq.read_table(folder, columns=["key", "error"])
    return table.num_rows, table.num_rows - table.column("error").null_count


def run(name: str, command: list[str], out: Path, images: int, env: dict[str, str] | None = None,
        log: Path | None = None) -> dict:
    print(f"run {name} ...", file=sys.stderr)
    started = time.time()
    _, wall_s, peak = run_measured(command, env)
    rows, errors = counted(out)
    result = {"wall_s": wall_s, "images": images, "rows": rows, "errors": errors,
              "images_per_s_end_to_end": images / wall_s, "peak_host_gib": peak / 2**30, "command": command}
    return {**result, "timeline": timeline(log, started)} if log else result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen2.5-vl-3b")
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=64, help="RayCaptioner's generate batch")
    parser.add_argument("--map-batch", type=int, default=256, help="the rows of one map_batches call")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--runs", default="torchrun,ray", help="of one_gpu (the command alone on GPU 0), torchrun, ray")
    parser.add_argument("--actor-gpus", type=int, default=1, help="0: a CPU smoke run (with --preset '')")
    parser.add_argument("--json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-ray-"))
    runs: dict[str, dict] = {}
    try:
        write_photo_folder(work / "photos", args.images)
        as_parquet(work / "photos", work / "pq", args.shards)
        for name in args.runs.split(","):
            out = work / f"out_{name}"
            env, log = None, None
            command = [sys.executable, "-m", "encoder_graphs", "caption", str(work / "pq" / "*.parquet"),
                       *(["--model", args.preset] if args.preset else []), "--out", str(out), "--out-format", "parquet",
                       "--quiet", "--max-new-tokens", str(args.new_tokens)]
            if name == "one_gpu":
                env = {"CUDA_VISIBLE_DEVICES": "0"}
            elif name == "torchrun":
                command[1:3] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.gpus}",
                                "-m", "encoder_graphs"]
            else:
                log = work / "ray_timeline.jsonl"
                command = [sys.executable, "-c", RAY_SCRIPT, str(work / "pq"), str(out), args.preset, str(args.gpus),
                           str(args.batch_size), str(args.map_batch), str(args.new_tokens), str(args.actor_gpus),
                           str(log)]
            try:
                runs[name] = run(name, command, out, args.images, env, log)
            except Exception as error:  # noqa: BLE001 (its row says why; the other stands)
                runs[name] = {"error": f"{type(error).__name__}: {error}"[-3000:]}
            write_json(args.json, {"preset": args.preset, "gpus": args.gpus, "partial": True,
                                   "environment": environment(), "runs": runs})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    one = runs.get("one_gpu", {}).get("wall_s")
    rows = [[name, str(run.get("images", "")), f"{run['wall_s']:.1f}", f"{run['images_per_s_end_to_end']:.2f}",
             f"{one / run['wall_s']:.2f}x" if one else "", str(run["rows"]), str(run["errors"]),
             f"{run['peak_host_gib']:.1f}"] if "error" not in run
            else [name, "", "", "", "", "", "", run["error"][:200]] for name, run in runs.items()]
    print(markdown_table(["run", "images", "wall s", "images/s end to end", "against one GPU", "rows", "errors",
                          "peak host GiB"], rows))
    for name, result in runs.items():
        if "timeline" in result:
            print(f"{name} timeline (s from its start): {result['timeline']}")
    write_json(args.json, {"preset": args.preset, "gpus": args.gpus, "partial": False,
                           "environment": environment(), "runs": runs})


if __name__ == "__main__":
    main()
