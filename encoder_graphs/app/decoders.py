"""A video's frames, decoded (`decode_video`: by `video.Sampler` on the CPU, or `nvdec`'s on the
GPU's video decoder) in worker processes, each a file at a time within a time limit.

Why processes: decoding and converting frames on threads held the GIL (benchmarks/RESULTS.md);
worker processes run side by side, and one that hangs or takes too long on a hostile file is killed
at its time limit and replaced (pebble), its file an error record, the other files unharmed.
Workers fork from a server that imported the decoder (and torch and PyAV) once, so a new one
starts at once, and inherit no CUDA state or threads of the caption process. `load` reads one
file's media for the Captioner's loader threads: an image there, a video's frames here.
"""

import contextlib
import io
import math
import multiprocessing
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from PIL import Image

from encoder_graphs.app import nvdec
from encoder_graphs.app.media import LoadLimits, MediaError, load_image, open_regular
from encoder_graphs.app.video import CannotSeek, DecodedVideo, Sampler
from encoder_graphs.app.walk import MediaFile, folder_reason

# Memory a worker may allocate (a backstop: frames are refused by their header's size first). A
# decoder holds up to 17 of its stream's frames (up to DCI 8K by `LoadLimits.max_video_pixels`,
# 53 MB each) and its working copies; a worker past it fails its file, not the machine.
WORKER_DATA_BYTES = 6 << 30
# Frames decoded ahead while the model loads (`VideoDecoders.prefetch`), at most this many bytes:
# the load takes tens of seconds that the decoders would otherwise spend idle. The environment's
# ENCODER_GRAPHS_VIDEO_PREFETCH_BYTES overrides it (0: none; benchmarks compare the two).
PREFETCH_BYTES = int(os.environ.get("ENCODER_GRAPHS_VIDEO_PREFETCH_BYTES", str(2 << 30)))
# NVDEC's workers take a share of the GPU from the model whether NVDEC takes the clips or not (each
# worker is a CUDA context, which the GPU time-slices with the model's: benchmarks/RESULTS.md). Where
# NVDEC took fewer than NVDEC_MIN_SHARE of the first NVDEC_TRIAL clips (another codec, 10-bit,
# interlaced, failing), the rest go to CPU workers, and NVDEC's workers end with their contexts
# once the decodes given them are done (prefetched clips among them). Decided once.
NVDEC_TRIAL = 32
NVDEC_MIN_SHARE = 0.25


def decode_video(path: Path | str, limits: LoadLimits, data: bytes | None = None) -> DecodedVideo:
    """`limits`' frames of the video at `path`, or of `data` (a sample's bytes `path` names), by
    seeking (`video.Sampler`; on NVDEC with `video_hwaccel="nvdec"`: `nvdec.sampled`); every way
    the file can be bad raises `MediaError` naming it. What the worker processes run. Where seeking
    cannot give the frames, the file is opened again for one full pass."""
    try:
        import av
    except ImportError as error:
        raise MediaError(path, "unsupported", "video needs PyAV: pip install 'encoder-graphs[video]'") from error
    path = Path(path)
    why: CannotSeek | None = None  # why seeking could not serve, once it was tried
    while True:
        with open_regular(path) if data is None else io.BytesIO(data) as handle:
            try:
                with av.open(handle, metadata_errors="ignore") as container:
                    sampler = Sampler.of(path, container, limits)
                    if why is not None:
                        return _full_pass(sampler, why)
                    try:
                        return nvdec.sampled(sampler) if limits.video_hwaccel == "nvdec" else sampler.by_seeking()
                    except CannotSeek as cannot:
                        why = cannot
            except (MediaError, MemoryError):
                raise
            except (av.FFmpegError, OSError, ValueError, EOFError) as error:
                raise MediaError(path, "corrupt", f"cannot decode video ({error})") from error


def _full_pass(sampler: Sampler, why: CannotSeek) -> DecodedVideo:
    """One pass over the whole stream, always the CPU's: with NVDEC asked for, the record says so
    (and why NVDEC had left the file to the CPU's seeking first, where it had)."""
    decoded = sampler.full_pass(str(why))
    if sampler.limits.video_hwaccel == "nvdec":
        because, reason = (f"{why.cpu_because}; ", f"{nvdec.reason(why.cpu_because)}; ") if why.cpu_because else ("", "")
        decoded.sampling, decoded.decoder = decoded.sampling + f", cpu ({because}a full pass)", f"cpu: {reason}a full pass"
    return decoded


def _decode_in_worker(path: Path, limits: LoadLimits, data: bytes | None = None) -> DecodedVideo:
    """`decode_video` in a worker, whose kernel stops it once this file took twice its time limit
    of CPU time (all its threads): a backstop for a worker whose parent died (and with it the time
    limit's timer)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    seconds = math.ceil(usage.ru_utime + usage.ru_stime + 2 * limits.video_timeout_s * limits.video_threads + 5)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if hard == resource.RLIM_INFINITY or seconds <= hard:
        resource.setrlimit(resource.RLIMIT_CPU, (seconds, hard))
    return decode_video(path, limits, data)


def _worker_setup(data_bytes: int, threads: int, gpu: int | None = None, contexts: Any = None) -> None:
    """A worker ignores Ctrl-C (the parent decides when the run stops and stops its workers),
    resizes on `threads` threads and allocates at most `data_bytes` (libraries mapped not counted).
    An NVDEC worker makes its CUDA context on GPU `gpu` now (about a second): while the model
    loads, not at its first clip, and before the batches are sized by the memory left. Where it
    cannot (a GPU out of memory), its first clip tries again and the CPU decodes what NVDEC does
    not: a failed initializer would break the whole pool. `contexts` counts the workers that
    tried [0] and that hold one [1] (`VideoDecoders.wait_started`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    torch.set_num_threads(threads)
    if data_bytes:
        try:
            resource.setrlimit(resource.RLIMIT_DATA, (data_bytes, data_bytes))
        except (ValueError, OSError):
            pass  # a hard limit below it stays
    if gpu is not None:
        held = False
        with contextlib.suppress(Exception):  # CUDA's, of any type: the first clip meets it, counted in its record
            torch.empty(1, device=torch.device("cuda", gpu))  # the primary context, which NVDEC's decoder shares
            held = True
        with contexts.get_lock():
            contexts[0] += 1
            contexts[1] += held


def _cores_of_this_process() -> int:
    """The cores this process may use, shared with the other processes torchrun started here."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def video_workers(load_workers: int) -> int:
    """Decoder processes: one a loader thread, no more than this process's share of the cores."""
    return max(1, min(load_workers, _cores_of_this_process()))


def default_decoder_threads(workers: int) -> int:
    """FFmpeg threads a worker's decoder takes: this process's cores shared among its workers."""
    return max(1, _cores_of_this_process() // max(1, workers))


class VideoDecoders:
    """Worker processes that decode videos (`decode_video`), a file each at a time; a file that
    takes longer than `limits.video_timeout_s` has its worker killed and replaced, and so has one
    whose worker dies (a decoder crash, the address-space limit): either becomes the file's
    `MediaError`, and the other files go on. Workers start from a fork server, so they inherit no
    CUDA state or threads of the parent. A pool asked for NVDEC hands its clips to CPU workers
    where NVDEC takes too few of the first (`NVDEC_TRIAL`)."""

    def __init__(self, workers: int, limits: LoadLimits, data_bytes: int = WORKER_DATA_BYTES) -> None:
        methods = multiprocessing.get_all_start_methods()
        self._context = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
        if self._context.get_start_method() == "forkserver":
            self._context.set_forkserver_preload([__name__, "encoder_graphs.app.video", "torch", "av"])
        self.limits, self.workers, self._data_bytes = limits, workers, data_bytes
        self._ahead: dict[Path, object] = {}  # path -> the future of its decode, started by `prefetch`
        self._pending: set = set()  # every decode not ended: `close` ends them (pebble's stop may not)
        self._closed = False
        self.prefetched = 0
        self._gpu = limits.video_device if limits.video_hwaccel == "nvdec" else None
        self._contexts = self._context.Array("i", 2)  # NVDEC's workers that tried to make their context, that hold one
        self._lock = threading.Lock()  # the pool a decode is scheduled on, NVDEC's count of the clips
        self._nvdec_asked = self._nvdec_took = 0
        self.nvdec_off: str | None = None  # why NVDEC's workers were ended, where they were
        self._retired: list = []  # NVDEC's pool once ended: its decodes under way finish
        self._reapers: list[threading.Thread] = []  # each joins a retired pool once its decodes are done
        self._pool = self._new_pool()

    def _new_pool(self) -> Any:
        import pebble

        return pebble.ProcessPool(
            max_workers=self.workers, initializer=_worker_setup, context=self._context,
            initargs=(self._data_bytes, self.limits.video_threads, self._gpu, self._contexts),
        )

    def start(self) -> "VideoDecoders":
        """Start the fork server and the workers now (a no-op task each), not at the first video:
        the caption command does it before the model loads, so the two overlap."""
        for _ in range(self.workers):
            self._pool.schedule(os.getpid)
        return self

    def wait_started(self, timeout_s: float = 60.0) -> int:
        """How many workers hold their CUDA context (NVDEC's; the CPU's: 0, at once), once each
        has made it or failed to, or `timeout_s` passed: GPU memory the batch sizing then reads
        as taken (`job.nvdec_bytes_later` reserves the rest). Counted by the workers themselves:
        one worker may run every start task while the others still make theirs."""
        if self._gpu is None:
            return 0
        deadline = time.monotonic() + timeout_s
        while self._contexts[0] < self.workers and time.monotonic() < deadline:
            time.sleep(0.05)
        return min(self._contexts[1], self.workers)

    def prefetch(self, paths: Iterable[Path]) -> int:
        """Start decoding the first of `paths` now, in their order, as many as `PREFETCH_BYTES` of
        frames at the model's size hold: the caption command passes the videos its run will ask
        for first, while the model loads. `decode` of one of them takes its result. How many."""
        limits = self.limits
        clip_bytes = limits.max_frames * max(limits.frame_max_pixels, limits.min_side**2) * 3
        count = 0
        for path in paths:
            if count * clip_bytes >= PREFETCH_BYTES:
                break
            if path not in self._ahead:
                self._ahead[path] = self._schedule(path)
                count += 1
        self.prefetched += count
        return count

    def _schedule(self, path: Path, data: bytes | None = None) -> object:
        """The decode of `path`, scheduled on the pool of the moment and in `_pending` before
        `close` can read it (else a decode queued as the run ends would never end)."""
        with self._lock:  # not onto NVDEC's pool as `_to_cpu` ends it, nor past `close`
            try:
                if self._closed:
                    raise RuntimeError("closed")
                future = self._pool.schedule(_decode_in_worker, (path, self.limits, data), timeout=self.limits.video_timeout_s)
            except RuntimeError as error:  # the pool was stopped: the run is ending
                raise MediaError(path, "cancelled", "the run ended before its frames were decoded") from error
            self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        return future

    def decode(self, path: Path, data: bytes | None = None) -> DecodedVideo:
        """The file's frames (the decode `prefetch` started, else a new one), waiting for a worker;
        `MediaError` for a bad file, a timeout, a crash or a run that ended first. `data`: a
        dataset sample's bytes, which `path` names."""
        from concurrent.futures import CancelledError
        from concurrent.futures import TimeoutError as FutureTimeout  # the builtin only from Python 3.11
        from concurrent.futures.process import BrokenProcessPool

        from pebble import ProcessExpired

        future = self._schedule(path, data) if data is not None else self._ahead.pop(path, None) or self._schedule(path)
        try:
            return self._judged(future.result())
        except FutureTimeout as error:
            raise MediaError(path, "timeout", f"decoding took longer than {self.limits.video_timeout_s:g} s "
                             "(--video-timeout); its worker was stopped") from error
        except (ProcessExpired, BrokenProcessPool) as error:
            if self._closed:  # its worker was stopped with the run
                raise MediaError(path, "cancelled", "the run ended before its frames were decoded") from error
            death = _death(error.exitcode) if isinstance(error, ProcessExpired) else str(error)
            raise MediaError(path, "crashed", f"the video decoder's process died ({death})") from error
        except MemoryError as error:
            raise MediaError(path, "too_large", "decoding it needed more memory than a video worker may take") from error
        except CancelledError as error:  # the pool stopped mid-decode: the run is ending
            raise MediaError(path, "cancelled", "the run ended before its frames were decoded") from error

    def _judged(self, decoded: DecodedVideo) -> DecodedVideo:
        """`decoded`, counted in NVDEC's take of the first `NVDEC_TRIAL` clips asked of it (not a
        full pass of a clip NVDEC had not refused: that is the CPU's anyway), which decides, once
        they are in, whether NVDEC's pool stays; the CPU pool's, once NVDEC's ended, saying why
        the CPU decoded it."""
        if self.nvdec_off is not None and decoded.decoder == "cpu":  # the CPU pool's: NVDEC's say "nvdec" or "cpu: why"
            decoded.sampling += f", cpu ({self.nvdec_off})"
            decoded.decoder = "cpu: nvdec off"
            return decoded
        if self._gpu is None or self._closed or decoded.decoder == "cpu: a full pass":
            return decoded
        with self._lock:
            if self._gpu is None or self._closed or self._nvdec_asked >= NVDEC_TRIAL:  # switched, ended or decided meanwhile
                return decoded
            self._nvdec_asked += 1
            self._nvdec_took += decoded.decoder == "nvdec"
            if self._nvdec_asked == NVDEC_TRIAL and self._nvdec_took < NVDEC_MIN_SHARE * NVDEC_TRIAL:
                self._to_cpu()
        return decoded

    def _to_cpu(self) -> None:
        """The rest of the run's clips to a pool of CPU workers; NVDEC's pool ends once the decodes
        it holds are done (prefetched clips among them), and its workers' CUDA contexts with them."""
        self.nvdec_off = f"NVDEC turned off: it took {self._nvdec_took} of the first {self._nvdec_asked} clips"
        print(f"encoder-graphs: video decoder: {self.nvdec_off}; the CPU decodes the rest", file=sys.stderr)
        self.limits, self._gpu = replace(self.limits, video_hwaccel=None), None
        retired = self._pool
        retired.close()  # pebble's close alone leaves the workers alive: its join ends them
        reaper = threading.Thread(target=retired.join, name="nvdec-pool-end", daemon=True)
        reaper.start()
        self._retired.append(retired)
        self._reapers.append(reaper)
        self._pool = self._new_pool()
        self.start()

    def close(self) -> None:
        """Stop the workers now (files still queued are dropped: their run is ending). A decode
        under way when pebble's loops stop would never end, and a loader thread waiting on it
        would hold the process at exit (a second Ctrl-C hung): each one still pending is ended
        here, cancelled."""
        from concurrent.futures import CancelledError, InvalidStateError

        with self._lock:  # no swap between reading the pools and stopping them
            self._closed = True
            pools = (self._pool, *self._retired)
        for pool in pools:
            pool.stop()
        for reaper in self._reapers:  # a retired pool, stopped, is joined by its reaper
            reaper.join(timeout=10)
        self._pool.join(timeout=10)
        self._ahead.clear()
        for future in list(self._pending):
            if not future.done():
                try:
                    future.set_exception(CancelledError())
                except InvalidStateError:  # it ended meanwhile
                    pass


def _death(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit status {exitcode}"


def load(file: MediaFile, limits: LoadLimits, videos: VideoDecoders | None = None) -> "Image.Image | DecodedVideo":
    """An RGB image (`app/media.py`), or a video's frames (`app/video.py`) decoded by `videos`'
    worker processes (None: in this process); a file that cannot be read raises `MediaError`."""
    if file.reason:
        raise MediaError(file.path, file.error_kind, file.reason)
    if file.kind == "folder":
        raise MediaError(file.path, "unreadable", f"cannot list this folder: {folder_reason(file.path)}")
    if file.kind == "image":
        return load_image(file.path, limits)
    return videos.decode(file.path) if videos is not None else decode_video(file.path, limits)
