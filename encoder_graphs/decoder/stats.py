"""Counters of the decode steps: replayed or eager (and why), per batch bucket and length tier."""

from collections import Counter
from dataclasses import dataclass, field

from encoder_graphs.engine.statistics import Latency
from encoder_graphs.engine.stats import LatencyRecorder
from encoder_graphs.packing.reasons import EagerReason, counts_by_text


@dataclass
class DecodeCounters:
    calls: int = 0
    sequences: int = 0
    steps: int = 0
    graph_steps: int = 0
    real_lanes: int = 0
    padded_lanes: int = 0
    eager_reasons: Counter = field(default_factory=Counter)
    replays: Counter = field(default_factory=Counter)  # bucket -> graph replays
    tier_replays: Counter = field(default_factory=Counter)  # length tier -> graph replays
    steps_per_tier: Counter = field(default_factory=Counter)  # length tier -> steps, replayed or eager
    timer: LatencyRecorder = field(default_factory=LatencyRecorder)

    def count_step(self, rows: int, batch: int, tier: int, eager_reason: EagerReason | None) -> None:
        """One decode step of `batch` sequences in `rows` lanes, replayed unless `eager_reason`."""
        self.steps += 1
        self.real_lanes += batch
        self.padded_lanes += rows
        self.steps_per_tier[tier] += 1
        if eager_reason is None:
            self.graph_steps += 1
            self.replays[rows] += 1
            self.tier_replays[tier] += 1
        else:
            self.eager_reasons[eager_reason] += 1

    def counts(self) -> dict:
        """The fields of `DecoderStats` that these counters fill (its rates it computes itself)."""
        return {
            "calls": self.calls,
            "sequences": self.sequences,
            "steps": self.steps,
            "graph_steps": self.graph_steps,
            "eager_steps": self.steps - self.graph_steps,
            "eager_reasons": counts_by_text(self.eager_reasons),
            "replays_per_bucket": dict(sorted(self.replays.items())),
            "replays_per_tier": dict(sorted(self.tier_replays.items())),
            "steps_per_tier": dict(sorted(self.steps_per_tier.items())),
            "real_lanes": self.real_lanes,
            "padded_lanes": self.padded_lanes,
            "decode_ms_per_step": Latency.from_json(self.timer.summary()),
        }
