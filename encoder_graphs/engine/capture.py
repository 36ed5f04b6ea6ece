"""The capture core that the encoder manager and the decoder runner share.

One memory pool per owner; every graph is warmed up on a side stream first (lazy inits,
autotuning and workspace allocation must not land inside a graph), then captured into the pool.
A capture failure (out of memory, an operation that cannot be captured) drops that one graph with
its reason, and the owner runs that shape eagerly; any other exception is a bug and propagates.
"""

import time
import warnings
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch

from encoder_graphs.packing.reasons import EagerReason

T = TypeVar("T")
# Phrases of the RuntimeErrors torch raises when a stream capture itself fails (an op that syncs,
# allocates pinned memory or queries the device while capturing), as opposed to a wrong program.
_CAPTURE_PHRASES = ("captur", "out of memory")
# Only this thread's calls may break a capture: the caption command's collator thread pins memory
# and runs transformers' position code while the model's thread captures, and under the default
# ("global") CUDA fails a capture for calls such as those from any thread (a GPU probe: 1,816 of
# 1,820 captures failed beside a thread pinning in a loop; none "thread_local").
CAPTURE_ERROR_MODE = "thread_local"


def unavailable_reason(enabled: bool, device: torch.device) -> EagerReason | None:
    """Why graphs cannot run here, or None when they can."""
    if not enabled:
        return EagerReason.TURNED_OFF
    if device.type != "cuda" or not torch.cuda.is_available():
        return EagerReason.NO_CUDA
    return None


def is_capture_failure(error: BaseException) -> bool:
    """Out of memory, or a failure of the stream capture itself: drop the graph, run eagerly."""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return True
    message = str(error).lower()
    return isinstance(error, RuntimeError) and any(phrase in message for phrase in _CAPTURE_PHRASES)


class GraphCapture:
    """Captures graphs into one pool and accounts for their time and memory."""

    def __init__(self, device: torch.device, what: str) -> None:
        self.device = device
        self.what = what  # "encoder" or "decoder", for messages
        self.pool: tuple[int, int] | None = None
        self.failed: dict[Hashable, str] = {}
        self.seconds = 0.0
        self.memory_bytes = 0

    @contextmanager
    def session(self) -> Iterator[None]:
        """Open the pool; count the time and the memory reserved by what is captured inside
        (the cache emptied at both ends: warm-ups and timed eager runs leave free blocks behind)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved(self.device)
        started = time.perf_counter()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        try:
            yield
        finally:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            self.seconds += time.perf_counter() - started
            self.memory_bytes += torch.cuda.memory_reserved(self.device) - reserved

    @contextmanager
    def or_drop(self, key: Hashable, label: str) -> Iterator[None]:
        """Run one graph's capture; a capture failure is recorded under `key` and swallowed."""
        try:
            yield
        except Exception as error:
            if not is_capture_failure(error):
                raise
            self.failed[key] = f"{type(error).__name__}: {error}"[:200]
            warnings.warn(f"{self.what} graph capture failed for {label}; it runs eagerly: {error}", stacklevel=3)
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def graph(self, forward: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
        """`forward` warmed up once on a side stream, then captured into the pool; what it returned
        inside the graph (tensors the graph writes on every replay)."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            forward()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode=CAPTURE_ERROR_MODE):
            produced = forward()
        return graph, produced
