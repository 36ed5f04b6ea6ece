"""A static decode cache whose write slot is a device tensor, for decode steps replayed as CUDA
graphs (its cache layers and the decode attention over them are the seam's: `seam/text.py`'s
`SlotCache`, `seam/attention.py`'s `DECODE_ATTENTION`).

One allocation of `rows` sequences x `max_cache_len` slots holds every full-attention layer's keys
and values; a cache object for a batch-size bucket and a length tier is a set of prefix views
[:bucket, :, :tier] of it, so all buckets and tiers share the memory, and attention over a tier
reads only its first `tier` slots. A linear-attention layer (Qwen3.5's Gated DeltaNet) holds a conv
and a recurrent state per sequence instead, whatever the length: views [:bucket] of two more
allocations.
"""

from dataclasses import dataclass

import torch

from encoder_graphs.seam.text import SlotCache, SlotLayer, StateLayer


@dataclass(frozen=True)
class LinearStates:
    """The linear-attention layers (their indices among all layers) and each one's conv state
    [conv_dim, kernel] and recurrent state [heads, k_dim, v_dim] per sequence."""

    layers: tuple[int, ...]
    conv: tuple[int, int]
    recurrent: tuple[int, int, int]


class StaticKVStore:
    """The decode state of `num_layers` layers for `rows` sequences, plus the shared write slot."""

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
        linear: LinearStates | None = None,
    ) -> None:
        linear_layers = linear.layers if linear is not None else ()
        # Each layer's kind and its index among the layers of that kind (into `kv` or the states).
        self.layers = [
            ("linear", linear_layers.index(layer)) if layer in linear_layers
            else ("full", layer - sum(1 for other in linear_layers if other < layer))
            for layer in range(num_layers)
        ]
        shape = (2, num_layers - len(linear_layers), rows, num_kv_heads, max_cache_len, head_dim)
        # Zeros, not empty: masked slots still meet a 0 weight in attention, and 0 * NaN is NaN.
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        states = len(linear_layers)
        self.conv = torch.zeros(states, rows, *(linear.conv if linear else ()), dtype=dtype, device=device)
        # fp32: the dtype the recurrence computes in (transformers' torch fallback and fla's kernels).
        self.recurrent = torch.zeros(states, rows, *(linear.recurrent if linear else ()), dtype=torch.float32, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.rows = rows
        self.max_cache_len = max_cache_len

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + self.conv.nbytes + self.recurrent.nbytes

    def cache(self, rows: int, length: int) -> SlotCache:
        """A cache over slots [0, length) of the first `rows` sequences (prefix views: no copy)."""
        if rows > self.rows or length > self.max_cache_len:
            raise ValueError(
                f"cache of {rows} rows x {length} slots asked of a store of {self.rows} x {self.max_cache_len}"
            )
        layers = [
            StateLayer(self.conv[index, :rows], self.recurrent[index, :rows])
            if kind == "linear"
            else SlotLayer(self.kv[0, index, :rows, :, :length], self.kv[1, index, :rows, :, :length], self.slot)
            for kind, index in self.layers
        ]
        return SlotCache(layers)

    def clear_states(self, start: int) -> None:
        """Zero the linear-attention states of rows [start, rows): padded lanes start afresh."""
        self.conv[:, start:].zero_()
        self.recurrent[:, start:].zero_()

    def load_rows(self, layer_states: list[tuple[torch.Tensor, torch.Tensor]], rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Copy the per-layer (keys, values) [len(rows), heads, len(slots), dim] of some sequences
        into `rows`, token t of each at slot `slots[t]`; linear layers' states into `rows`."""
        for (kind, index), (first, second) in zip(self.layers, layer_states, strict=True):
            if kind == "linear":
                self.conv[index, rows] = first
                self.recurrent[index, rows] = second
            else:  # [rows, 1] and [1, slots] index the rows and slots around the heads: [rows, slots, heads, dim]
                self.kv[0, index][rows[:, None], :, slots[None, :]] = first.transpose(1, 2)
                self.kv[1, index][rows[:, None], :, slots[None, :]] = second.transpose(1, 2)

    def load_prefill(
        self, layer_states: list[tuple[torch.Tensor, torch.Tensor]], slots: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> None:
        """Copy a prefill's per-layer (keys, values) of shape [batch, heads, length, dim] into
        slots [0, length) of the first `batch` rows; or, packed [1, heads, tokens, dim], each token
        to its (row, slot) in `slots`. A linear-attention layer's (conv, recurrent) states go to
        its first `batch` rows."""
        for (kind, index), (first, second) in zip(self.layers, layer_states, strict=True):
            if kind == "linear":
                self.conv[index, : first.shape[0]].copy_(first)
                self.recurrent[index, : second.shape[0]].copy_(second)
            elif slots is not None:
                rows, columns = slots
                self.kv[0, index][rows, :, columns] = first[0].transpose(0, 1)
                self.kv[1, index][rows, :, columns] = second[0].transpose(0, 1)
            else:
                batch, _, length, _ = first.shape
                self.kv[0, index, :batch, :, :length].copy_(first)
                self.kv[1, index, :batch, :, :length].copy_(second)
