"""Counters for graph hits, eager misses, padding waste and latency."""

import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from encoder_graphs.engine.statistics import Latency, PathStats, pct
from encoder_graphs.packing import SubBatch
from encoder_graphs.packing.reasons import EagerReason, counts_by_text
from encoder_graphs.protocols import EncoderItemSpec

LATENCY_WINDOW = 10_000


@dataclass
class PathCounters:
    """One path's counts while the manager runs; `typed()` is what its statistics report."""

    hits: int = 0
    misses: int = 0
    miss_reasons: Counter = field(default_factory=Counter)
    replays: Counter = field(default_factory=Counter)
    real_tokens: int = 0
    padded_tokens: int = 0

    def typed(self) -> PathStats:
        return PathStats(
            hits=self.hits,
            misses=self.misses,
            miss_reasons=counts_by_text(self.miss_reasons),
            replays_per_budget=dict(sorted(self.replays.items())),
            real_tokens=self.real_tokens,
            padded_tokens=self.padded_tokens,
        )


class EncoderCounters:
    """A manager's calls and items (those whose every path replayed are graph items), and per
    path the items that replayed or ran eagerly (with the reason), the replays per budget and the
    padding they carried."""

    def __init__(self, paths: Sequence[str]) -> None:
        self.paths = list(paths)
        self.path_stats = {path: PathCounters() for path in self.paths}
        self.calls = 0
        self.items = 0
        self.graph_items = 0
        self.latency = LatencyRecorder()

    def count(self, batch: SubBatch, specs: list[EncoderItemSpec], miss_reason: Callable[[SubBatch, str], EagerReason]) -> None:
        """Count one sub-batch; `miss_reason` says why a path of it runs eagerly."""
        self.items += len(batch.indices)
        if all(batch.budget[path] is not None for path in self.paths):
            self.graph_items += len(batch.indices)
        for path in self.paths:
            stats, budget = self.path_stats[path], batch.budget[path]
            if budget == 0:  # no item of the sub-batch has tokens on this path
                continue
            users = sum(1 for i in batch.indices if specs[i].path_tokens.get(path, 0) > 0)
            if budget is None:
                stats.misses += users
                stats.miss_reasons[miss_reason(batch, path)] += users
            else:
                stats.hits += users
                stats.replays[budget] += 1
                stats.real_tokens += batch.tokens[path]
                stats.padded_tokens += budget

    def hit_rate_pct(self) -> float:
        return pct(self.graph_items, self.items)

    def counts(self) -> dict:
        """The fields of `EncoderStats` that these counters fill (its rates it computes itself)."""
        return {
            "calls": self.calls,
            "items": self.items,
            "graph_items": self.graph_items,
            "eager_items": self.items - self.graph_items,
            "paths": {path: stats.typed() for path, stats in self.path_stats.items()},
            "latency_ms": Latency.from_json(self.latency.summary()),
        }

    def miss_reasons(self) -> dict[str, int]:
        return counts_by_text(sum((Counter(stats.miss_reasons) for stats in self.path_stats.values()), Counter()))


class LatencyRecorder:
    """Latency per call, or per unit of work (e.g. decode steps) when `stop` is given `units`.

    On CUDA it records events and resolves them only when read, so the hot path never waits for
    the device. `mean` weighs calls by their units; `p50` / `p99` are over calls.
    """

    def __init__(self) -> None:
        self._done: deque[tuple[float, int]] = deque(maxlen=LATENCY_WINDOW)
        self._pending: deque[tuple[torch.cuda.Event, torch.cuda.Event, int]] = deque()

    def start(self, on_cuda: bool) -> torch.cuda.Event | float:
        if not on_cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, started: torch.cuda.Event | float, units: int = 1) -> None:
        if units <= 0:
            return
        if isinstance(started, float):
            self._done.append((1000.0 * (time.perf_counter() - started), units))
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((started, end, units))
        if len(self._pending) > LATENCY_WINDOW:
            self._resolve()

    def _resolve(self) -> None:
        while self._pending:
            start, end, units = self._pending.popleft()
            end.synchronize()
            self._done.append((start.elapsed_time(end), units))

    def summary(self) -> dict:
        self._resolve()
        if not self._done:
            return latency_summary([])
        mean = sum(ms for ms, _ in self._done) / sum(units for _, units in self._done)
        return latency_summary([ms / units for ms, units in self._done], mean=mean)


def latency_summary(values_ms: Sequence[float], mean: float | None = None) -> dict:
    """calls, mean (or the given one), p50 and p99 of latencies in ms."""
    ordered = sorted(values_ms)
    if not ordered:
        return {"calls": 0, "mean": 0.0, "p50": 0.0, "p99": 0.0}
    return {
        "calls": len(ordered),
        "mean": sum(ordered) / len(ordered) if mean is None else mean,
        "p50": _percentile(ordered, 50),
        "p99": _percentile(ordered, 99),
    }


def _percentile(sorted_values: list[float], pct: float) -> float:
    rank = pct / 100 * (len(sorted_values) - 1)
    low = int(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


def elapsed_ms(run: Callable[[], object]) -> float:
    """One call of `run` on the current CUDA stream, timed by CUDA events, in milliseconds."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)
