"""The one graph cache that the encoder manager (keyed by path and budget) and the decoder runner
(keyed by bucket and length tier) each hold: graphs captured on first use, failures remembered
with their reasons, capture time and memory counted.

One memory pool per owner; every graph is warmed up on a side stream first (lazy inits,
autotuning and workspace allocation must not land inside a graph), then captured into the pool.
A capture failure (out of memory, an operation that cannot be captured) drops that one graph with
its reason, and the owner runs that shape eagerly; any other exception is a bug and propagates.
"""

import time
import warnings
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

import torch

from encoder_graphs.packing.reasons import EagerReason

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)
G = TypeVar("G")
# Phrases of the RuntimeErrors torch raises when a stream capture itself fails (an op that syncs,
# allocates pinned memory or queries the device while capturing), as opposed to a wrong program.
_CAPTURE_PHRASES = ("captur", "out of memory")
# Only this thread's calls may break a capture: the caption command's collator thread pins memory
# and runs transformers' position code while the model's thread captures, and under the default
# ("global") CUDA fails a capture for calls such as those from any thread (a GPU probe: 1,816 of
# 1,820 captures failed beside a thread pinning in a loop; none "thread_local").
CAPTURE_ERROR_MODE = "thread_local"
# Sizes of the blocks that `GraphCache.poison` fills with NaN: one large block for the large pool
# and 1 MiB blocks for the caching allocator's small-block pool.
_SMALL_BLOCK = 1 << 20


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


class GraphCache(Generic[K, G]):
    """An owner's graphs by key, captured into one pool; the keys whose capture failed, with the
    error (never tried again); the time and memory the captures took."""

    def __init__(self, device: torch.device, what: str, poison_bytes: int = 0) -> None:
        self.device = device
        self.what = what  # "encoder" or "decoder", for messages
        self.poison_bytes = poison_bytes  # a test hook: the first session's pool is NaN (`poison`)
        self.pool: tuple[int, int] | None = None
        self.graphs: dict[K, G] = {}
        self.failed: dict[K, str] = {}
        self.seconds = 0.0
        self.memory_bytes = 0

    def tried(self, key: K) -> bool:
        """Captured, or failed to capture: either way not to be captured again."""
        return key in self.graphs or key in self.failed

    def capture(self, keys: Iterable[K], make: Callable[[K], G], label: Callable[[K], str]) -> list[K]:
        """Capture each key not tried yet, in the order given, in one session: `make(key)` builds
        its graph; a capture failure is remembered and the rest go on. The keys captured."""
        done, todo = [], [key for key in keys if not self.tried(key)]
        if not todo:
            return done
        with self.session():
            poison, self.poison_bytes = (self.poison(self.poison_bytes) if self.poison_bytes else None), 0
            for key in todo:
                with self.or_drop(key, label(key)):
                    self.graphs[key] = make(key)
                    done.append(key)
            del poison  # the real graphs hold the pool now
        return done

    def poison(self, nbytes: int) -> torch.cuda.CUDAGraph:
        """Fill blocks of the pool with NaN bits and free them, so that graphs captured next
        reuse NaN memory: a test of rule 1 (no uninitialised rows reach real tokens). Keep the
        returned graph until the real graphs are captured: it holds the pool and its NaN blocks."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool_handle(), capture_error_mode=CAPTURE_ERROR_MODE):
            blocks = [torch.empty(nbytes, dtype=torch.uint8, device=self.device)]
            blocks += [torch.empty(_SMALL_BLOCK, dtype=torch.uint8, device=self.device) for _ in range(64)]
            for block in blocks:
                block.fill_(0xFF)
        graph.replay()
        torch.cuda.synchronize(self.device)
        del blocks
        return graph

    def clear(self, *, forget_failures: bool = False) -> None:
        """Free the graphs and their pool; with `forget_failures`, a capture after this tries
        every key again (for an owner that changed what it captures)."""
        self.graphs.clear()
        self.pool = None
        if forget_failures:
            self.failed.clear()

    def pool_handle(self) -> tuple[int, int]:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        return self.pool

    @contextmanager
    def session(self) -> Iterator[None]:
        """Open the pool; count the time and the memory reserved by what is captured inside
        (the cache emptied at both ends: warm-ups and timed eager runs leave free blocks behind)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved(self.device)
        started = time.perf_counter()
        self.pool_handle()
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
            if self.device.type == "cuda":
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


class KeyedGraphs(Mapping):
    """The graphs of one group of a cache keyed (group, key), by key in ascending order: a live
    read-only view of the cache's dict (which `GraphCache.clear` empties in place), so a graph
    captured after the view was made is in it."""

    def __init__(self, graphs: dict[tuple[Hashable, Any], G], group: Hashable) -> None:
        self._graphs, self._group = graphs, group

    def __getitem__(self, key: Any) -> G:
        return self._graphs[self._group, key]

    def __iter__(self) -> Iterator:
        return iter(sorted(key for group, key in self._graphs if group == self._group))

    def __len__(self) -> int:
        return sum(group == self._group for group, _ in self._graphs)

    def __repr__(self) -> str:
        return repr(dict(self))
