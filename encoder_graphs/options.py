"""What `enable_cuda_graphs` does to a model, as one frozen object: made once (by a library user,
or by the caption command from its resolved job) and read by everything downstream."""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any


class PathBudgets(Mapping):
    """Budgets per encoder path, read-only and hashable, as the options object holding them is."""

    def __init__(self, budgets: Mapping[str, tuple[int, ...]]) -> None:
        self._budgets = dict(budgets)

    def __getitem__(self, path: str) -> tuple[int, ...]:
        return self._budgets[path]

    def __iter__(self):
        return iter(self._budgets)

    def __len__(self) -> int:
        return len(self._budgets)

    def __hash__(self) -> int:
        return hash(frozenset(self._budgets.items()))

    def __repr__(self) -> str:
        return repr(self._budgets)


@dataclass(frozen=True)
class GraphOptions:
    """The encoder's and the decoder's graph settings.

    Encoder: `budgets` (token budgets, one list or one per path; default: the adapter's range),
    `max_items` / `max_frames` (the most items / frames of a sub-batch), `max_frames_per_item`
    (the most frames a video of the job holds, the caption command's `--max-frames`, so that one
    fits a sub-batch), `attn_backend` (the vision attention; default: the fastest installed).
    `choose_by_cost` (the default) times each budget's replay and eager forward at capture and
    runs a sub-batch eagerly where that measured faster (GPU-bound sizes well below their budget);
    False replays wherever a budget fits, so the path taken never depends on timings.

    Decoder (with `decoder`): a static cache of `decoder_max_cache_len` slots, one graph per
    batch bucket (`decoder_batch_sizes`, up to `decoder_max_batch_size`) and length tier
    (`decoder_length_tiers`; default 256, 512, ... up to the cache length, always the last); each
    step reads only the smallest tier holding its sequences.

    Both: `enabled=False` keeps both routes but runs them eagerly. `compile=True` compiles, with
    torch.compile (dynamic shapes, attention left out) before the capture, the encoder's repeated
    blocks and (with `decoder`) the language model's MLPs and norms and the decode step's layers,
    so graphs and eager calls run inductor's fused kernels (until `disable()`, any call of those
    modules does, stock-only ones too); a compiler failure warns and leaves them uncompiled
    (`stats()["encoder"]["compile"]`). `lazy=True` captures each encoder budget and each decode
    (bucket, tier) at its first use instead of all of them now: the first calls pay for the
    captures, and a job that uses few pays little (the caption command's choice); with
    `encoder_capture_from_call=N` an encoder budget is timed and captured only in the Nth call of
    the model's feature method that wants it, eager before (the command's 2: a job of one batch
    times nothing). `log_interval_s`: how often the encoder logs its hit rate.

    The encoder manager reads `encoder_options`, the decoder runner `decoder_options`: each its
    part of these settings, frozen, under the names its constructor takes.
    """

    budgets: Sequence[int] | Mapping[str, Sequence[int]] | None = None
    max_items: int | None = None
    max_frames: int | None = None
    max_frames_per_item: int | None = None
    attn_backend: str | None = None
    choose_by_cost: bool = True
    decoder: bool = True
    decoder_max_batch_size: int = 32
    decoder_max_cache_len: int = 4096
    decoder_batch_sizes: Sequence[int] | None = None
    decoder_length_tiers: Sequence[int] | None = None
    enabled: bool = True
    compile: bool = False
    lazy: bool = False
    encoder_capture_from_call: int = 1
    log_interval_s: float = 60.0

    def __post_init__(self) -> None:
        _as_tuples(self, "budgets", "decoder_batch_sizes", "decoder_length_tiers")

    @property
    def encoder_options(self) -> "EncoderOptions":
        return self._part(EncoderOptions, lambda name: "encoder_" + name if name == "capture_from_call" else name)

    @property
    def decoder_options(self) -> "DecoderOptions":
        return self._part(DecoderOptions, lambda name: name if name in _SHARED else "decoder_" + name)

    def _part(self, part: type, own_name: Callable[[str], str]) -> Any:
        """`part`'s options, each field the one of these named `own_name(field)`."""
        return part(**{field.name: getattr(self, own_name(field.name)) for field in fields(part)})


# The settings both the encoder and the decoder read, under one name.
_SHARED = ("enabled", "lazy")


@dataclass(frozen=True)
class EncoderOptions:
    """What `EncoderCudaGraphManager` is given (`GraphOptions.encoder_options`; the manager's
    keyword arguments of the same names change some of them): see the manager's docstring."""

    budgets: Sequence[int] | Mapping[str, Sequence[int]] | None = None
    max_items: int | None = None
    max_frames: int | None = None
    max_frames_per_item: int | None = None
    enabled: bool = True
    choose_by_cost: bool = True
    lazy: bool = False
    capture_from_call: int = 1
    log_interval_s: float = 60.0

    def __post_init__(self) -> None:
        if self.capture_from_call < 1:
            raise ValueError(f"capture_from_call must be >= 1, got {self.capture_from_call}")
        _as_tuples(self, "budgets")


@dataclass(frozen=True)
class DecoderOptions:
    """What `DecoderGraphRunner` is given (`GraphOptions.decoder_options`; the runner's keyword
    arguments of the same names change some of them): a static cache of `max_cache_len` slots,
    one graph per batch bucket (`batch_sizes`, up to `max_batch_size`) and length tier."""

    max_batch_size: int = 32
    batch_sizes: Sequence[int] | None = None
    max_cache_len: int = 4096
    length_tiers: Sequence[int] | None = None
    enabled: bool = True
    lazy: bool = False

    def __post_init__(self) -> None:
        _as_tuples(self, "batch_sizes", "length_tiers")


def _as_tuples(options: object, *names: str) -> None:
    """Sequences as tuples: an options object hashes, and [64] and (64,) are the same setting."""
    for name in names:
        value = getattr(options, name)
        if isinstance(value, Mapping):
            object.__setattr__(options, name, PathBudgets({path: tuple(v) for path, v in value.items()}))
        elif value is not None:
            object.__setattr__(options, name, tuple(value))
