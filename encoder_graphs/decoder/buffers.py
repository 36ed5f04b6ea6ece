"""What a decode step reads and writes: the graphs' configuration, the language model's sizes,
and the fixed-address buffers (static KV cache, ids, positions, mask, logits) every graph shares."""

from dataclasses import dataclass, field

import torch

from encoder_graphs.decoder.static_cache import LinearStates, StaticKVStore
from encoder_graphs.options import DecoderOptions
from encoder_graphs.packing import generate_budgets
from encoder_graphs.seam.text import linear_attention_layers, linear_state_shapes, text_head_dim

_POWER_BUCKETS = (1, 2, 4, 8, 16, 32)
_BUCKET_STEP = 16
_MIN_LENGTH_TIER = 256


def default_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, then steps of 16; `max_batch_size` is always the largest."""
    buckets = {b for b in _POWER_BUCKETS if b < max_batch_size}
    buckets.update(range(_POWER_BUCKETS[-1] + _BUCKET_STEP, max_batch_size, _BUCKET_STEP))
    buckets.add(max_batch_size)
    return sorted(buckets)


def default_length_tiers(max_cache_len: int) -> list[int]:
    """256, 512, 1024, ... below `max_cache_len`, which is always the last tier."""
    return generate_budgets(min(_MIN_LENGTH_TIER, max_cache_len), max_cache_len)


@dataclass
class DecoderGraphConfig:
    max_batch_size: int = 32
    max_cache_len: int = 4096
    buckets: list[int] = field(default_factory=list)
    length_tiers: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_cache_len < 2:
            raise ValueError(f"max_cache_len must be >= 2, got {self.max_cache_len}")
        self.buckets = sorted(set(self.buckets)) or default_buckets(self.max_batch_size)
        if self.buckets[0] < 1 or self.buckets[-1] > self.max_batch_size:
            raise ValueError(f"buckets must lie in [1, {self.max_batch_size}], got {self.buckets}")
        tiers = sorted(set(self.length_tiers)) or default_length_tiers(self.max_cache_len)
        if tiers[0] < 2 or tiers[-1] > self.max_cache_len:
            raise ValueError(f"length_tiers must lie in [2, {self.max_cache_len}], got {self.length_tiers}")
        self.length_tiers = tiers if tiers[-1] == self.max_cache_len else [*tiers, self.max_cache_len]

    @classmethod
    def of(cls, options: DecoderOptions) -> "DecoderGraphConfig":
        return cls(options.max_batch_size, options.max_cache_len, list(options.batch_sizes or []),
                   list(options.length_tiers or []))


@dataclass(frozen=True)
class TextDims:
    """The sizes of the language model that the decode buffers are allocated for."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype: torch.dtype
    linear: LinearStates | None = None  # a hybrid model's linear-attention layers

    @classmethod
    def of(cls, model: torch.nn.Module) -> "TextDims":
        text = model.config.get_text_config(decoder=True)
        layers = linear_attention_layers(text)
        return cls(
            num_layers=text.num_hidden_layers,
            num_kv_heads=text.num_key_value_heads,
            head_dim=text_head_dim(text),
            vocab_size=model.get_output_embeddings().weight.shape[0],
            dtype=model.dtype,
            linear=LinearStates(layers, *linear_state_shapes(text)) if layers else None,
        )


class DecodeBuffers:
    """Everything a decode step reads or writes, for `rows` sequences; a bucket uses the first
    `bucket` rows. Addresses never change, so captured graphs stay valid."""

    def __init__(
        self,
        *,
        rows: int,
        max_cache_len: int,
        position_dims: tuple[int, ...],
        dims: TextDims,
        device: torch.device,
    ) -> None:
        self.store = StaticKVStore(
            num_layers=dims.num_layers,
            rows=rows,
            num_kv_heads=dims.num_kv_heads,
            head_dim=dims.head_dim,
            max_cache_len=max_cache_len,
            dtype=dims.dtype,
            device=device,
            linear=dims.linear,
        )
        self.input_ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        # Same leading dims as the prefill's position ids ([4] for Qwen-VL: text + 3 M-RoPE axes).
        self.positions = torch.zeros(*position_dims, rows, 1, dtype=torch.long, device=device)
        self.mask = torch.zeros(rows, max_cache_len, dtype=torch.bool, device=device)
        self.logits = torch.zeros(rows, dims.vocab_size, dtype=torch.float32, device=device)

    @property
    def max_cache_len(self) -> int:
        return self.store.max_cache_len

    @property
    def nbytes(self) -> int:
        return self.store.nbytes + sum(t.nbytes for t in (self.input_ids, self.positions, self.mask, self.logits))

    def start(
        self, *, batch: int, rows: int, prompt_mask: torch.Tensor, next_positions: torch.Tensor
    ) -> None:
        """Set up rows [0, rows) for a decode that continues a prefill of `batch` sequences.
        Rows past `batch` are padded lanes: token 0, position 0, attending only their own new slots
        (never an empty row, whose softmax would be NaN), linear-attention states zeroed."""
        prompt_len = prompt_mask.shape[1]
        self.store.clear_states(batch)
        self.mask[:rows].zero_()
        self.mask[:batch, :prompt_len].copy_(prompt_mask.bool())
        self.store.slot.fill_(prompt_len)
        positions = self.positions.narrow(-2, 0, rows)
        positions.zero_()
        positions.narrow(-2, 0, batch).copy_(next_positions)
        self.input_ids[:rows].zero_()
