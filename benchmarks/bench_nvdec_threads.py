"""NVDEC on threads of one process, beside GPU work in that same process: can the model's own
process (one CUDA context) decode its clips on threads instead of worker processes (a context
each, which the GPU time-slices with the model's: `bench_video_decode.py --beside-gpu-work`)?
Two questions: do PyNvVideoCodec's decodes let threads run side by side (the GIL), and does the
GPU work keep its rate beside them (bf16 matmuls on a thread, launched as the model's loop does)?
    python3 benchmarks/bench_nvdec_threads.py FOLDER [--runs 16,16b,16bs,16bd,8bs] [--json out.json]
A run is THREADS[b][s|d]: b, with the GPU work beside; s, each decoder on its thread's own CUDA
stream (else the legacy default stream); d, the GPU work on a side stream (else the default one).
Each run gives clips a second over all, `steady` (from the quarter of the files done on), and the
matmul rate beside against alone. The frames are the command's (`decode_video`, NVDEC's sampler);
this process's decoder is kept per thread here (the command keeps one a worker process).
"""

import argparse
import re
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from timing import environment, write_json

from encoder_graphs.app import nvdec
from encoder_graphs.app.decoders import decode_video
from encoder_graphs.app.media import LoadLimits
from encoder_graphs.app.walk import VIDEO_EXTENSIONS
from encoder_graphs.models.qwen.geometry import VIDEO_DEFAULTS, PixelSettings, QwenFrameSize

_local = threading.local()
_own_stream = {"on": False}


class _ThreadDecoder(dict):
    """`nvdec._process_decoder`, one a thread."""

    def _held(self) -> dict:
        if not hasattr(_local, "decoder"):
            _local.decoder = {}
        return _local.decoder

    def get(self, key, default=None):
        return self._held().get(key, default)

    def __getitem__(self, key):
        return self._held()[key]

    def clear(self) -> None:
        self._held().clear()

    def update(self, **items) -> None:
        self._held().update(**items)


def _patch_nvdec() -> None:
    import PyNvVideoCodec as nvc

    nvdec._process_decoder = _ThreadDecoder()
    create = nvc.CreateDecoder

    def on_thread_stream(**kwargs):
        if _own_stream["on"]:
            kwargs["cudastream"] = _local.stream.cuda_stream
        return create(**kwargs)

    nvc.CreateDecoder = on_thread_stream


def _gpu_work(stop: threading.Event, log: list, side_stream: bool) -> None:
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream() if side_stream else torch.cuda.default_stream()
    with torch.cuda.stream(stream):
        while not stop.is_set():
            for _ in range(50):
                a @ a
            stream.synchronize()
            log.append(time.time())


def _tflops(log: list, start: float, end: float) -> float:
    return round(sum(start <= t <= end for t in log) * 50 * 2 * 4096**3 / (end - start) / 1e12, 1)


def _one(path: Path, limits: LoadLimits) -> str:
    if not hasattr(_local, "stream"):
        _local.stream = torch.cuda.Stream()
    if _own_stream["on"]:
        torch.cuda.set_stream(_local.stream)
    try:
        return decode_video(path, limits).decoder
    except Exception as error:  # noqa: BLE001
        return f"error: {str(error)[:80]}"


def run(spec: str, files: list[Path], limits: LoadLimits) -> dict:
    threads, flags = re.fullmatch(r"(\d+)([bsd]*)", spec).groups()
    _own_stream["on"] = "s" in flags
    stop, log = threading.Event(), []
    work = threading.Thread(target=_gpu_work, args=(stop, log, "d" in flags), daemon=True) if "b" in flags else None
    alone = None
    if work is not None:
        work.start()
        time.sleep(3)
        alone = _tflops(log, time.time() - 2, time.time())
    started, done, decoders = time.time(), [], Counter()
    with ThreadPoolExecutor(int(threads)) as pool:
        for decoder in pool.map(lambda path: _one(path, limits), files):
            decoders[decoder[:40]] += 1
            done.append(time.time())
    ended = time.time()
    stop.set()
    if work is not None:
        work.join()
    first = len(done) // 4
    return {"threads": int(threads), "gpu_work": work is not None, "own_streams": "s" in flags, "gpu_work_side_stream": "d" in flags,
            "clips_per_s": len(files) / (ended - started), "steady_clips_per_s": (len(done) - 1 - first) / (done[-1] - done[first]),
            "gpu_work_tflops": _tflops(log, started, ended) if work is not None else None, "gpu_work_alone_tflops": alone,
            "decoders": dict(decoders)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--runs", default="16,16b,16bs,16bd,8bs")
    parser.add_argument("--json")
    args = parser.parse_args()
    _patch_nvdec()
    files = sorted(p for p in args.folder.rglob("*") if p.suffix.lower() in VIDEO_EXTENSIONS)
    settings = PixelSettings.from_config({}, VIDEO_DEFAULTS["Qwen2VLVideoProcessor"], clip_budget=False).capped(256 * 28**2)
    limits = LoadLimits(max_frames=16, frame_size=QwenFrameSize(settings), min_side=28, video_threads=1, video_hwaccel="nvdec")
    torch.empty(1, device="cuda")
    torch.set_num_threads(1)
    run("1", files[:6], limits)  # imports and a decoder, untimed
    results = {}
    for spec in args.runs.split(","):
        results[spec] = result = run(spec, files, limits)
        print(f"{spec}: {result['clips_per_s']:.2f} clips/s, {result['steady_clips_per_s']:.2f} steady; GPU work "
              f"{result['gpu_work_tflops']} of {result['gpu_work_alone_tflops']} TFLOP/s alone; {result['decoders']}",
              file=sys.stderr, flush=True)
    write_json(args.json, {"folder": str(args.folder), "files": len(files), "runs": results, "environment": environment()})


if __name__ == "__main__":
    main()
