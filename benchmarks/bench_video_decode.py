"""The video loader alone, over a folder of clips: clips a second from file to the frames the model
takes (16 a clip at its frame size), by the caption command's decoder (`app/video.py`: seeking,
one resize, worker processes) and by the ways it replaced or could use instead, each over the same
files with the same number of workers:
- `processes` (the command's): `VideoDecoders`, a worker process per loader;
- `threads`: the same `decode_video` on threads (the GIL's cost);
- `processes_full_pass`: processes decoding every frame of each stream (the old loader's way);
- `processes_nvdec`: the command's, its packets decoded by the GPU (NVDEC, `app/nvdec.py`) where it can.
    python3 benchmarks/bench_video_decode.py FOLDER [--workers 16] [--frames 16] [--frame-tokens 256]
        [--beside-gpu-work] [--json out.json]
Each run gives clips a second over all (the workers' start included) and `steady` (from the
quarter of the files done on: the workers running); with `--beside-gpu-work`, also the matmul
rate the GPU work kept beside the decoders (`gpu_work_tflops`), against its rate alone: what the
decoders' CUDA contexts take from a model sharing the GPU.
"""

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from timing import environment

from encoder_graphs.app.decoders import VideoDecoders, decode_video, default_decoder_threads
from encoder_graphs.app.media import LoadLimits, MediaError
from encoder_graphs.app.walk import VIDEO_EXTENSIONS
from encoder_graphs.models.qwen.geometry import VIDEO_DEFAULTS, PixelSettings, QwenFrameSize

# The GPU kept busy beside the decoders: the model's loop runs kernels back to back in its own CUDA
# context, which NVDEC's workers (each their own context) share the GPU with. It writes the time of
# each round of 50 matmuls to the file it is given, so each run reports how much of the GPU the
# decoders left it (`gpu_work_tflops`, against `gpu_work_alone_tflops` before the first run).
GPU_WORK = (
    "import sys, time, torch\n"
    "a = torch.randn(4096, 4096, device='cuda', dtype=torch.bfloat16)\n"
    "log = open(sys.argv[1], 'w', buffering=1)\n"
    "while True:\n"
    "    for _ in range(50):\n"
    "        b = a @ a\n"
    "    torch.cuda.synchronize()\n"
    "    log.write(f'{time.time()}\\n')\n"
)
ROUND_FLOP = 50 * 2 * 4096**3


def gpu_work_tflops(log: Path, start: float, end: float) -> float | None:
    """The busy process's matmul rate between `start` and `end` (wall clock), from its log."""
    times = [float(line) for line in log.read_text().split()] if log.exists() else []
    inside = [t for t in times if start <= t <= end]
    return len(inside) * ROUND_FLOP / (end - start) / 1e12 if inside and end > start else None


def full_pass(path: Path, limits: LoadLimits):
    """The decoder's full pass (every frame decoded, candidates kept), as for a clip it cannot seek."""
    import av

    from encoder_graphs.app.video import Sampler

    with av.open(str(path)) as container:
        return Sampler.of(path, container, limits).full_pass("benchmark: every frame")


def run(name: str, files: list[Path], limits: LoadLimits, workers: int) -> dict:
    started = time.perf_counter()
    outcomes: list[object] = []
    done: list[float] = []  # when each file finished, from the start

    def _safely(function, *args):
        try:
            return function(*args)
        except (MediaError, Exception) as error:  # noqa: BLE001
            return error
        finally:
            done.append(time.perf_counter() - started)

    if name.startswith("hybrid"):  # hybrid:W+K: W CPU workers and K NVDEC workers, each file to one that is free
        cpu_workers, gpu_workers = (int(n) for n in name.split(":")[1].split("+"))
        pools = [VideoDecoders(cpu_workers, limits), VideoDecoders(gpu_workers, replace(limits, video_hwaccel="nvdec"))]
        free: queue.Queue = queue.Queue()
        for pool, count in zip(pools, (cpu_workers, gpu_workers)):
            for _ in range(count):
                free.put(pool)

        def one(path: Path) -> object:
            pool = free.get()
            try:
                return _safely(pool.decode, path)
            finally:
                free.put(pool)

        try:
            with ThreadPoolExecutor(cpu_workers + gpu_workers) as threads:
                outcomes = list(threads.map(one, files))
        finally:
            for pool in pools:
                pool.close()
    elif name == "threads":
        with ThreadPoolExecutor(workers) as pool:
            outcomes = list(pool.map(lambda path: _safely(decode_video, path, limits), files))
    else:
        if ":" in name:  # name:N runs N workers
            name, workers = name.split(":")[0], int(name.split(":")[1])
        decoders = VideoDecoders(workers, limits)
        try:
            if name == "processes_full_pass":
                schedule = [decoders._pool.schedule(full_pass, (path, limits)) for path in files]
                outcomes = [_safely(future.result) for future in schedule]
            else:
                with ThreadPoolExecutor(workers) as pool:
                    outcomes = list(pool.map(lambda path: _safely(decoders.decode, path), files))
        finally:
            decoders.close()
    seconds = time.perf_counter() - started
    errors = [str(o) for o in outcomes if isinstance(o, Exception)]
    decoded = [o for o in outcomes if not isinstance(o, Exception)]
    done.sort()
    first = min(len(done) - 1, max(1, len(done) // 4))  # the workers started and warm by then
    return {
        "clips": len(decoded), "errors": len(errors), "first_errors": errors[:3], "seconds": seconds,
        "clips_per_s": len(decoded) / seconds, "first_clip_s": done[0] if done else None,
        # the rate once the workers run: the last three quarters of the files, their start left out
        "steady_clips_per_s": (len(done) - 1 - first) / (done[-1] - done[first]) if len(done) > 2 else None,
        "sampling": dict(Counter(o.sampling.split(":")[0][:90] for o in decoded)),
        "first_samplings": sorted({o.sampling[:300] for o in decoded})[:4],
        "frame_sizes": sorted({f"{o.frames.shape[2]}x{o.frames.shape[1]}" for o in decoded})[:6],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--workers", type=int, default=min(16, max(2, (os.cpu_count() or 2) - 1)))
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--frame-tokens", type=int, default=256, help="Qwen2.5-VL frame cap (0: the processor's own)")
    parser.add_argument("--runs", default="processes,threads,processes_full_pass,processes_nvdec")
    parser.add_argument("--beside-gpu-work", action="store_true",
                        help="a process keeps the GPU's cores busy meanwhile (bf16 matmuls), as the model does in the caption loop")
    parser.add_argument("--json")
    args = parser.parse_args()
    busy_log = Path(tempfile.mkdtemp()) / "gpu_work.log"
    busy = subprocess.Popen([sys.executable, "-c", GPU_WORK, str(busy_log)]) if args.beside_gpu_work else None
    alone = None
    if busy is not None:  # its rate with no decoder beside it: 5 s once it runs
        while not busy_log.exists() or not busy_log.read_text().strip():
            if busy.poll() is not None:
                raise SystemExit("--beside-gpu-work: the GPU work's process ended (no CUDA device?)")
            time.sleep(0.2)
        time.sleep(5)
        alone = gpu_work_tflops(busy_log, time.time() - 5, time.time())
    files = sorted(p for p in args.folder.rglob("*") if p.suffix.lower() in VIDEO_EXTENSIONS)
    settings = PixelSettings.from_config({}, VIDEO_DEFAULTS["Qwen2VLVideoProcessor"], clip_budget=False)
    if args.frame_tokens:
        settings = settings.capped(args.frame_tokens * settings.factor**2)
    limits = LoadLimits(max_frames=args.frames, frame_size=QwenFrameSize(settings), min_side=28,
                        video_threads=default_decoder_threads(args.workers))
    results = {}
    for name in args.runs.split(","):
        chosen = replace(limits, video_hwaccel="nvdec") if name.startswith("processes_nvdec") else limits
        started = time.time()
        results[name] = run(name, files, chosen, args.workers)
        if busy is not None:
            results[name]["gpu_work_tflops"] = gpu_work_tflops(busy_log, started, time.time())
        print(f"{name}: {results[name]['clips_per_s']:.2f} clips/s, {results[name]['steady_clips_per_s']:.2f} "
              f"steady, first after {results[name]['first_clip_s']:.1f} s ({results[name]['clips']} clips, "
              f"{results[name]['errors']} errors, {results[name]['seconds']:.1f} s; GPU work beside "
              f"{results[name].get('gpu_work_tflops')} of {alone} TFLOP/s alone) {results[name]['sampling']} "
              f"{results[name]['first_errors'][:1]}", file=sys.stderr, flush=True)
    if busy is not None:
        busy.kill()
    payload = {"beside_gpu_work": args.beside_gpu_work, "gpu_work_alone_tflops": alone, "folder": str(args.folder), "files": len(files), "workers": args.workers, "frames": args.frames,
               "frame_tokens": args.frame_tokens, "cpus": os.cpu_count(), "runs": results,
               "environment": environment()}
    if args.json:
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    print(json.dumps(payload))


if __name__ == "__main__":
    main()
