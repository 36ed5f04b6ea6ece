"""A static KV cache whose write slot is a device tensor, and the decode attention over it, for
decode steps replayed as CUDA graphs.

One allocation of `rows` sequences x `max_cache_len` slots holds every layer; a cache object for a
batch-size bucket and a length tier is a set of prefix views [:bucket, :, :tier] of it, so all
buckets and tiers share the memory, and attention over a tier reads only its first `tier` slots.
"""

import torch
from transformers import AttentionInterface

from encoder_graphs.models.attention import decode_attention
from encoder_graphs.models.transformers_seam import Cache, CacheLayerMixin

# Our prefix, as every name we register: another library's registration is never overwritten.
# No "flash" in the name: transformers treats those specially.
DECODE_ATTENTION = "encoder_graphs_static_kv_decode"


def static_decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """`decode_attention` as transformers calls an attention implementation (the decode step
    through the model's own forward)."""
    return decode_attention(query, key, value, attention_mask, scaling), None


AttentionInterface.register(DECODE_ATTENTION, static_decode_attention)


class SlotLayer(CacheLayerMixin):
    """One layer's keys and values; `update` writes the new token at `slot` (a shared 1-element
    device tensor that the caller advances), never at a position read on the host."""

    is_compileable = True
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slot: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values, self.slot = keys, values, slot
        self.max_cache_len = keys.shape[2]
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("SlotLayer is allocated up front")

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if key_states.shape[2] != 1:
            raise ValueError(f"SlotLayer takes one token per step, got {key_states.shape[2]}")
        self.keys.index_copy_(2, self.slot, key_states)
        self.values.index_copy_(2, self.slot, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_seq_length(self) -> int:
        # Masks and positions are passed in precomputed; nothing should need the fill level.
        raise RuntimeError("SlotLayer does not track its fill level on the host")

    def get_max_length(self) -> int:
        return self.max_cache_len


class SlotCache(Cache):
    """A `Cache` of `SlotLayer`s: `SlotCache(layers)`."""


class StaticKVStore:
    """Keys and values of `num_layers` layers for `rows` sequences, plus the shared write slot."""

    def __init__(
        self,
        *,
        num_layers: int,
        rows: int,
        num_kv_heads: int,
        head_dim: int,
        max_cache_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (2, num_layers, rows, num_kv_heads, max_cache_len, head_dim)
        # Zeros, not empty: masked slots still meet a 0 weight in attention, and 0 * NaN is NaN.
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.rows = rows
        self.max_cache_len = max_cache_len

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes

    def cache(self, rows: int, length: int) -> SlotCache:
        """A cache over slots [0, length) of the first `rows` sequences (prefix views: no copy)."""
        if rows > self.rows or length > self.max_cache_len:
            raise ValueError(
                f"cache of {rows} rows x {length} slots asked of a store of {self.rows} x {self.max_cache_len}"
            )
        layers = [
            SlotLayer(self.kv[0, layer, :rows, :, :length], self.kv[1, layer, :rows, :, :length], self.slot)
            for layer in range(self.kv.shape[1])
        ]
        return SlotCache(layers)

    def load_prefill(
        self, layer_kv: list[tuple[torch.Tensor, torch.Tensor]], slots: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> None:
        """Copy a prefill's per-layer (keys, values) of shape [batch, heads, length, dim] into
        slots [0, length) of the first `batch` rows; or, packed [1, heads, tokens, dim], each token
        to its (row, slot) in `slots`."""
        for layer, (keys, values) in enumerate(layer_kv):
            if slots is not None:
                rows, columns = slots
                self.kv[0, layer][rows, :, columns] = keys[0].transpose(0, 1)
                self.kv[1, layer][rows, :, columns] = values[0].transpose(0, 1)
                continue
            batch, _, length, _ = keys.shape
            self.kv[0, layer, :batch, :, :length].copy_(keys)
            self.kv[1, layer, :batch, :, :length].copy_(values)
