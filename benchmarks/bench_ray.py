"""Ray Data against torchrun on one host's GPUs (issue 43): the same photos as Parquet shards
(columns `key`, `image` bytes), captioned once by the caption command under torchrun (one rank a
GPU, Parquet output shards) and once by `ray.data.read_parquet(...).map_batches(RayCaptioner,
num_gpus=1, concurrency=GPUS).write_parquet(...)`, each a fresh process, start included
(Ray's cluster start, each actor's model load and graphs). Reported per run: wall time,
images/s end to end, rows written, errors, peak host memory of the process tree. Random weights
(presets): captions are noise, speed is real.
    python3 benchmarks/bench_ray.py [--images 1024] [--gpus 4] [--shards 16] [--json out.json]
"""

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from photos import write_photo_folder
from processes import run_measured
from timing import environment, markdown_table, write_json

RAY_SCRIPT = """
import sys, ray
from encoder_graphs.app.ray_data import RayCaptioner
source, out, preset, gpus, batch, tokens, actor_gpus = sys.argv[1:8]
ray.init(num_gpus=int(gpus) * int(actor_gpus), num_cpus=None if int(actor_gpus) else 8, include_dashboard=False,
         log_to_driver=False)
ds = ray.data.read_parquet(source)
ds = ds.map_batches(RayCaptioner, fn_constructor_kwargs={"model": preset or None, "batch_size": int(batch),
                    "max_new_tokens": int(tokens)}, batch_size=int(batch), num_gpus=int(actor_gpus),
                    concurrency=int(gpus))
ds.write_parquet(out)
"""


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


def run(name: str, command: list[str], out: Path, images: int) -> dict:
    print(f"run {name} ...", file=sys.stderr)
    _, wall_s, peak = run_measured(command)
    rows, errors = counted(out)
    return {"wall_s": wall_s, "images": images, "rows": rows, "errors": errors,
            "images_per_s_end_to_end": images / wall_s, "peak_host_gib": peak / 2**30, "command": command}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen2.5-vl-3b")
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=64, help="Ray's batch and RayCaptioner's")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--runs", default="torchrun,ray")
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
            if name == "torchrun":
                command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={args.gpus}", "-m", "encoder_graphs", "caption", str(work / "pq" / "*.parquet"),
                           *(["--model", args.preset] if args.preset else []), "--out", str(out), "--out-format", "parquet", "--quiet",
                           "--max-new-tokens", str(args.new_tokens)]
            else:
                command = [sys.executable, "-c", RAY_SCRIPT, str(work / "pq"), str(out), args.preset, str(args.gpus),
                           str(args.batch_size), str(args.new_tokens), str(args.actor_gpus)]
            try:
                runs[name] = run(name, command, out, args.images)
            except Exception as error:  # noqa: BLE001 (its row says why; the other stands)
                runs[name] = {"error": f"{type(error).__name__}: {error}"[-3000:]}
            write_json(args.json, {"preset": args.preset, "gpus": args.gpus, "partial": True,
                                   "environment": environment(), "runs": runs})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [[name, str(run.get("images", "")), f"{run['wall_s']:.1f}", f"{run['images_per_s_end_to_end']:.2f}",
             str(run["rows"]), str(run["errors"]), f"{run['peak_host_gib']:.1f}"] if "error" not in run
            else [name, "", "", "", "", "", run["error"][:200]] for name, run in runs.items()]
    print(markdown_table(["run", "images", "wall s", "images/s end to end", "rows", "errors", "peak host GiB"], rows))
    write_json(args.json, {"preset": args.preset, "gpus": args.gpus, "partial": False,
                           "environment": environment(), "runs": runs})


if __name__ == "__main__":
    main()
