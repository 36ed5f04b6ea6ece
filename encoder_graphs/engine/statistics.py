"""Typed statistics of the graphs: frozen records that the graph owners fill from their counters,
the caption command writes as JSON, and a torchrun job merges from its ranks'.

Who returns what: `EncoderGraphsHandle.stats()` returns a `GraphStats`. `EncoderCudaGraphManager`
and `DecoderGraphRunner` keep `stats() -> dict` (the design card's contract, and what a benchmark
writes to its JSON as is): their `typed_stats()` is the record and `stats()` its `to_json()`.

A record reads like a dict too (`stats["encoder"]["paths"]`, `get`, `keys`, `in`, `{**stats}`, as
transformers' `ModelOutput` does), so code written against the dicts keeps working; but it is
frozen: no field can be set, by attribute or by item. Field names are the JSON keys: `to_json()`
gives the dict the statistics were before they were typed (same keys, order and values; a
manager's dict gains "compile": None, which only the handle fills). Counters keyed by data
(reasons, budgets, buckets, tiers) stay plain dicts, keyed by the reasons' texts.

How a job's statistics come from its ranks' is said on each field (`metadata=rule(...)`), so a
statistic cannot be added without saying how it merges: `checked` refuses such a record when its
module loads. Rates are never passed: each one is computed from its record's counts on creation,
so a merged record's rates come from the job's sums.
"""

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import TYPE_CHECKING, Any

from encoder_graphs.packing.reasons import EagerReason

if TYPE_CHECKING:
    from typing_extensions import Self


class Merge(str, Enum):
    """How a job's value of a field comes from its ranks' values."""

    SUM = "summed"  # a count, or a counter keyed by data (reasons, budgets, buckets, tiers), key by key
    LARGEST = "largest rank's"  # set or spent per GPU (None where no rank set it)
    BUSIEST = "busiest rank's"  # measured or chosen per rank: the busiest rank's stands for the job's
    UNION = "union"  # the graphs captured, or failed, on any rank
    RECORD = "field by field"  # a record (or a dict of them, by path), each field by its own rule
    MEAN = "mean weighted by calls"  # a latency's mean: the ranks' calls weigh it
    RATE = "computed again"  # a rate or a share: from the record's counts, never merged


def rule(merge: Merge, *, record: type | None = None, keyed: bool = False,
         load: Callable[[Any], Any] | None = None) -> dict:
    """A field's metadata: its `merge` rule; `record`: the class of a RECORD field (`keyed`: a dict
    of them); `load`: what a JSON value becomes (a reason's text its `EagerReason`)."""
    if record is not None:
        load = _loader(record, keyed)
    return {"merge": merge, "record": record, "keyed": keyed, "rate": None, "load": load}


def rate(compute: Callable[[Any], float]) -> dict:
    """A RATE field's metadata: how it is computed from its record's counts (the field must be
    `init=False`: no one passes a rate)."""
    return {**rule(Merge.RATE), "rate": compute}


def checked(cls: type) -> type:
    """`cls` itself, after checking that each field says how it merges (TypeError if not): a
    statistic merged by accident would be summed, or lost, silently."""
    for f in fields(cls):
        merge = f.metadata.get("merge")
        if not isinstance(merge, Merge):
            raise TypeError(f"{cls.__name__}.{f.name} has no merge rule: give it metadata=rule(Merge...)")
        if (merge is Merge.RECORD) != (f.metadata["record"] is not None) or (merge is Merge.RATE) == f.init:
            raise TypeError(f"{cls.__name__}.{f.name}: a RECORD field needs its record, a RATE field rate() and init=False")
    return cls


class Record:
    """What every statistics record shares: dict-like reading, JSON, rates, merging."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.metadata.get("rate") is not None:
                object.__setattr__(self, f.name, f.metadata["rate"](self))  # frozen: only here

    def keys(self) -> list[str]:
        return [f.name for f in fields(self)]

    def __getitem__(self, name: str) -> Any:
        if name not in self.keys():
            raise KeyError(name)
        return getattr(self, name)

    def __contains__(self, name: object) -> bool:
        return name in self.keys()

    def __iter__(self):  # as a dict: its keys (`dict(record)`, `for name in record`)
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self, name) if name in self.keys() else default

    def to_json(self) -> dict:
        """The record as plain data (a copy: changing it changes no record)."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_json(cls, data: Mapping) -> "Self":
        """The record of `to_json()`'s dict, or of one that came through JSON (its keys then
        strings). KeyError for a key that is no field: a rank's statistic this one lacks."""
        names = {f.name: f for f in fields(cls) if f.init}
        unknown = [name for name in data if name not in names and name not in _rates(cls)]
        if unknown:
            raise KeyError(f"no merge rule for the statistics {unknown}")
        return cls(**{name: _load(f, data[name]) for name, f in names.items() if name in data})

    @classmethod
    def merged(cls, ranks: "list[Self | None]", busiest: "Self | None") -> "Self | None":
        """The job's record from the ranks' (those that have one), each field by its rule;
        `busiest`: the busiest rank's record, None when it has none (then so has the job)."""
        if busiest is None:
            return None
        ranks = [rank for rank in ranks if rank is not None]
        return cls(**{f.name: _merge_field(f, ranks, busiest) for f in fields(cls) if f.init})


def _rates(cls: type) -> set[str]:
    return {f.name for f in fields(cls) if not f.init}


def _loader(record: type, keyed: bool) -> Callable[[Any], Any]:
    """A RECORD field's value from JSON: the record (by key where `keyed`), a record as is."""

    def one(value: Any) -> Any:
        return value if isinstance(value, record) else record.from_json(value)

    if keyed:
        return lambda values: {key: one(value) for key, value in values.items()}
    return one


def _load(f: Any, value: Any) -> Any:
    load = f.metadata["load"]
    return value if load is None or value is None else load(value)


def as_reason(text: str) -> EagerReason | str:
    """A reason's text as its `EagerReason`, or the text where it is none (a flag's words)."""
    try:
        return EagerReason(text)
    except ValueError:
        return text


def _plain(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_json()
    if isinstance(value, Enum):
        return str(value)
    if isinstance(value, dict):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


# ----- merging -------------------------------------------------------------------------------
def _merge_field(f: Any, ranks: list, busiest: Any) -> Any:
    merge, values, mine = f.metadata["merge"], [getattr(rank, f.name) for rank in ranks], getattr(busiest, f.name)
    if merge is Merge.RECORD and f.metadata["keyed"]:
        return {key: f.metadata["record"].merged(have := _having(values, key), mine.get(key, have[0]))
                for key in _keys(values)}
    if merge is Merge.RECORD:
        return f.metadata["record"].merged(values, mine)
    if merge is Merge.MEAN:
        calls = sum(rank.calls for rank in ranks)
        return sum(value * rank.calls for value, rank in zip(values, ranks)) / calls if calls else 0.0
    if merge is Merge.SUM:
        return dict(sum((Counter(value) for value in values), Counter())) if isinstance(mine, dict) else sum(values)
    if merge is Merge.LARGEST:  # None: not set on that rank (no video frames on an image-only model)
        return max((value for value in values if value is not None), default=None)
    if merge is Merge.UNION:
        return _union(values, mine)
    return mine  # BUSIEST


def _union(values: list, first: Any) -> Any:
    """Keys and list items of every rank's value; a key's scalar (a failure's reason) the first
    rank's that has it."""
    if isinstance(first, dict):
        return {key: _union(have := _having(values, key), have[0]) for key in _keys(values)}
    if isinstance(first, list):
        union = {tuple(item) if isinstance(item, list) else item for value in values for item in value}
        return [list(item) if isinstance(item, tuple) else item for item in sorted(union)]
    return first


def _keys(dicts: list[dict]) -> list:
    return list(dict.fromkeys(key for value in dicts for key in value))


def _having(dicts: list[dict], key: Any) -> list:
    return [value[key] for value in dicts if key in value]


def pct(part: float, whole: float) -> float:
    """`part` as a percentage of `whole` (0 of nothing): every rate of the statistics."""
    return 100.0 * part / whole if whole else 0.0


# ----- the records ---------------------------------------------------------------------------
@checked
@dataclass(frozen=True)
class Latency(Record):
    """Latency in ms: calls, their mean (weighted by units of work where there are any), p50, p99."""

    calls: int = field(metadata=rule(Merge.SUM))
    mean: float = field(metadata=rule(Merge.MEAN))
    p50: float = field(metadata=rule(Merge.BUSIEST))
    p99: float = field(metadata=rule(Merge.BUSIEST))


@checked
@dataclass(frozen=True)
class CompileStats(Record):
    """torch.compile of the encoder blocks: blocks compiled (0 after a failure), seconds, error."""

    blocks: int = field(metadata=rule(Merge.BUSIEST))
    seconds: float = field(metadata=rule(Merge.BUSIEST))
    error: str | None = field(metadata=rule(Merge.BUSIEST))


@checked
@dataclass(frozen=True)
class PathStats(Record):
    """One encoder path's items that replayed (hits) or ran eagerly (misses, by reason), its
    replays per budget and the padding they carried."""

    hits: int = field(metadata=rule(Merge.SUM))
    misses: int = field(metadata=rule(Merge.SUM))
    miss_reasons: dict[str, int] = field(metadata=rule(Merge.SUM))
    replays_per_budget: dict[int, int] = field(metadata=rule(Merge.SUM))
    real_tokens: int = field(metadata=rule(Merge.SUM))
    padded_tokens: int = field(metadata=rule(Merge.SUM))
    waste_pct: float = field(init=False, metadata=rate(lambda s: pct(s.padded_tokens - s.real_tokens, s.padded_tokens)))


@checked
@dataclass(frozen=True)
class EncoderStats(Record):
    """`EncoderCudaGraphManager`'s statistics; `compile` is the handle's (None: not asked)."""

    enabled: bool = field(metadata=rule(Merge.BUSIEST))
    disabled_reason: EagerReason | str | None = field(metadata=rule(Merge.BUSIEST, load=as_reason))
    calls: int = field(metadata=rule(Merge.SUM))
    items: int = field(metadata=rule(Merge.SUM))
    graph_items: int = field(metadata=rule(Merge.SUM))
    eager_items: int = field(metadata=rule(Merge.SUM))
    hit_rate_pct: float = field(init=False, metadata=rate(lambda s: pct(s.graph_items, s.items)))
    paths: dict[str, PathStats] = field(metadata=rule(Merge.RECORD, record=PathStats, keyed=True))
    budgets: dict[str, list[int]] = field(metadata=rule(Merge.BUSIEST))
    captured_budgets: dict[str, list[int]] = field(metadata=rule(Merge.UNION))
    failed_budgets: dict[str, dict[int, str]] = field(metadata=rule(Merge.UNION))
    max_items: int = field(metadata=rule(Merge.LARGEST))
    max_frames: int | None = field(metadata=rule(Merge.LARGEST))
    capture_seconds: float = field(metadata=rule(Merge.LARGEST))
    graph_memory_bytes: int = field(metadata=rule(Merge.LARGEST))
    budget_costs_ms: dict[str, dict[int, dict[str, float | None]]] = field(metadata=rule(Merge.BUSIEST))
    latency_ms: Latency = field(metadata=rule(Merge.RECORD, record=Latency))
    compile: CompileStats | None = field(default=None, metadata=rule(Merge.RECORD, record=CompileStats))


@checked
@dataclass(frozen=True)
class DecoderStats(Record):
    """`DecoderGraphRunner`'s statistics: decode steps replayed or eager (and why), per batch
    bucket and length tier, the lanes they padded, the graphs and their memory."""

    enabled: bool = field(metadata=rule(Merge.BUSIEST))
    disabled_reason: EagerReason | str | None = field(metadata=rule(Merge.BUSIEST, load=as_reason))
    step: str = field(metadata=rule(Merge.BUSIEST))
    prefill: str = field(metadata=rule(Merge.BUSIEST))
    calls: int = field(metadata=rule(Merge.SUM))
    sequences: int = field(metadata=rule(Merge.SUM))
    steps: int = field(metadata=rule(Merge.SUM))
    graph_steps: int = field(metadata=rule(Merge.SUM))
    eager_steps: int = field(metadata=rule(Merge.SUM))
    eager_reasons: dict[str, int] = field(metadata=rule(Merge.SUM))
    replays_per_bucket: dict[int, int] = field(metadata=rule(Merge.SUM))
    replays_per_tier: dict[int, int] = field(metadata=rule(Merge.SUM))
    steps_per_tier: dict[int, int] = field(metadata=rule(Merge.SUM))
    real_lanes: int = field(metadata=rule(Merge.SUM))
    padded_lanes: int = field(metadata=rule(Merge.SUM))
    lane_waste_pct: float = field(init=False, metadata=rate(lambda s: pct(s.padded_lanes - s.real_lanes, s.padded_lanes)))
    decode_ms_per_step: Latency = field(metadata=rule(Merge.RECORD, record=Latency))
    buckets: list[int] = field(metadata=rule(Merge.BUSIEST))
    length_tiers: list[int] = field(metadata=rule(Merge.BUSIEST))
    captured_graphs: list[list[int]] = field(metadata=rule(Merge.UNION))
    failed_graphs: dict[str, str] = field(metadata=rule(Merge.UNION))
    max_cache_len: int = field(metadata=rule(Merge.LARGEST))
    capture_seconds: float = field(metadata=rule(Merge.LARGEST))
    graph_memory_bytes: int = field(metadata=rule(Merge.LARGEST))
    static_buffer_bytes: int = field(metadata=rule(Merge.LARGEST))


@checked
@dataclass(frozen=True)
class GraphStats(Record):
    """`EncoderGraphsHandle.stats()`: the encoder's, the decoder's (None when it is not graphed,
    `decoder_off` says why) and the generate calls sent to stock, by reason."""

    encoder: EncoderStats = field(metadata=rule(Merge.RECORD, record=EncoderStats))
    decoder: DecoderStats | None = field(metadata=rule(Merge.RECORD, record=DecoderStats))
    decoder_off: str | None = field(metadata=rule(Merge.BUSIEST))
    generate_fallbacks: dict[str, int] = field(metadata=rule(Merge.SUM))

    def work(self) -> int:
        """What the busiest rank did most of: encoder items and decoded sequences."""
        return self.encoder.items + (self.decoder.sequences if self.decoder is not None else 0)

    @classmethod
    def merge(cls, ranks: list["GraphStats"]) -> "GraphStats":
        """A torchrun job's statistics from its ranks', each field by its rule: counts summed,
        capture time and memory the largest rank's, captured graphs the union, rates from the
        sums, latency means weighted by calls and the rest the busiest rank's."""
        return cls.merged(ranks, max(ranks, key=cls.work))
