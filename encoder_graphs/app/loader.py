"""Loader processes: files are decoded and preprocessed in worker processes, not threads.

Threads shared the interpreter with the one that drives the GPU: PyTorch releases the GIL around
its ops and must take it back after each, and each loader thread's resize also ran on every core.
With 15 loader threads, the main thread's small ops took 1.5 ms apiece in the caption loop
(2,273 `torch.arange` calls, 3.3 s: Qwen2.5-VL-3B, H100, 2026-11-25). Processes leave the GPU's
thread alone with its interpreter, and each runs single-threaded, so they never oversubscribe.

Workers fork from a forkserver that imported the preprocessing code once
(`start_loader_server`: call it early, it imports while the model loads); each worker gets the
`Preparer` once, ignores Ctrl-C (the command stops between batches), and returns pickled
results (uint8 patches: ~3 MB a photo).
"""

import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import ProcessPoolExecutor

import torch

from encoder_graphs.app.media import MediaFile
from encoder_graphs.app.prepare import Pending, Preparer

_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
_CONTEXT = multiprocessing.get_context(_METHOD)
# What unpickling a Preparer imports (the inputs builders import transformers' tokenizers and image
# processors: ~4 s), imported once by the server rather than by every worker.
_PRELOAD = ["encoder_graphs.app.prepare", "encoder_graphs.models.qwen_inputs", "encoder_graphs.models.internvl_inputs"]
_preparer: Preparer | None = None  # in a worker: its Preparer


def start_loader_server() -> None:
    """Start the forkserver now, importing what workers need, so the first pool forks at once."""
    if _METHOD == "forkserver":
        _CONTEXT.set_forkserver_preload(_PRELOAD)
        from multiprocessing import forkserver

        forkserver.ensure_running()


def loader_pool(preparer: Preparer, workers: int) -> ProcessPoolExecutor:
    """`workers` processes that run `prepare` with `preparer`."""
    start_loader_server()
    return ProcessPoolExecutor(workers, mp_context=_CONTEXT, initializer=_install, initargs=(preparer, os.getpid()))


def prepare(file: MediaFile) -> Pending | dict:
    """In a worker: the file's Pending, or its error record."""
    assert _preparer is not None, "prepare runs in a loader_pool worker"
    return _preparer(file)


def _install(preparer: Preparer, owner: int) -> None:
    global _preparer
    _preparer = preparer
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    threading.Thread(target=_exit_with, args=(owner,), daemon=True).start()


def _exit_with(owner: int) -> None:
    """End this worker once the process that owns the pool is gone: killed (SIGKILL), it never
    closes the queues, and a worker holds both ends of their pipes, so it would wait forever (and
    keep the forkserver, and the owner's stdout, open)."""
    while _alive(owner):
        time.sleep(1.0)
    os._exit(0)


def _alive(pid: int) -> bool:
    """Whether process `pid` runs: a killed one that its parent has not reaped yet (a zombie)
    counts as gone where /proc tells (Linux)."""
    if os.path.isdir("/proc/self"):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except FileNotFoundError:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
