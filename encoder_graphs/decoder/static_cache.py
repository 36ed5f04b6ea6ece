"""A static KV cache whose write slot is a device tensor, for decode steps replayed as CUDA graphs
(its cache layers and the decode attention over them are the seam's: `seam/text.py`'s `SlotCache`,
`seam/attention.py`'s `DECODE_ATTENTION`).

One allocation of `rows` sequences x `max_cache_len` slots holds every layer; a cache object for a
batch-size bucket and a length tier is a set of prefix views [:bucket, :, :tier] of it, so all
buckets and tiers share the memory, and attention over a tier reads only its first `tier` slots.
"""

import torch

from encoder_graphs.models.seam.text import SlotCache, SlotLayer


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
