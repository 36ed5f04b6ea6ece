"""Counters for graph hits, eager misses, padding waste and latency."""

import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

LATENCY_WINDOW = 10_000


@dataclass
class PathStats:
    hits: int = 0
    misses: int = 0
    miss_reasons: Counter = field(default_factory=Counter)
    replays: Counter = field(default_factory=Counter)
    real_tokens: int = 0
    padded_tokens: int = 0

    def as_dict(self) -> dict:
        waste = self.padded_tokens - self.real_tokens
        return {
            "hits": self.hits,
            "misses": self.misses,
            "miss_reasons": dict(self.miss_reasons),
            "replays_per_budget": dict(sorted(self.replays.items())),
            "real_tokens": self.real_tokens,
            "padded_tokens": self.padded_tokens,
            "waste_pct": 100.0 * waste / self.padded_tokens if self.padded_tokens else 0.0,
        }


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
