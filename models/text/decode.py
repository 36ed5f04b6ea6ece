"""The language model's decode step over Qwen-style decoder layers, in a form torch.compile fuses.

Through the stock layers a decode step launches ~46 kernels per layer (RMSNorm alone is six, the
rotary ten), so the graphed step took several times as long as its weights take to read
(benchmarks/HISTORY.md). `DecodeLayer` runs the stock layer's own modules (projections, norms,
activation; q/k/v and gate/up each stacked into one GEMM over views of the same weights) for one
new token against the static cache, and writes that cache itself: no cache object and no layer
index reach the code, only tensors, so one compilation serves every layer (the cache write and
the attention, one Triton kernel pair on CUDA, stay eager between the compiled parts).
Each layer returns its MLP output beside the residual, and the next layer adds them, so the add
fuses into that layer's first norm. Layers this module does not list decode through the model's
own forward (`DecodeStack.supports` is False).
"""

from collections.abc import Sequence

import torch
from torch import nn

from encoder_graphs.models.attention import write_and_decode
from encoder_graphs.models.rewrites import Rewrites
from encoder_graphs.models.rewrites.fused_mlp import InterleavedGateUp
from encoder_graphs.models.rewrites.stacked_linear import StackedLinear
from encoder_graphs.models.seam.text import FUSED_LAYERS, decode_rotary


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# Outside the compiled code: inductor would functionalize the in-place cache write, at worst
# into a copy of the whole cache view per layer. Compiled, a layer is three graphs: two around
# this, and the down projection's (below).
_write_and_decode = torch.compiler.disable(write_and_decode)


class DecodeLayer(nn.Module):
    """One stock decoder layer's decode math over its own modules (no weights copied; q/k/v and
    gate/up stacked until `rewrites` is undone). `gate_up`: the MLP's, where it is fused already
    (`text/stack.py`'s `fuse_text_kernels`), over its interleaved weight."""

    def __init__(self, layer: nn.Module, rewrites: Rewrites, gate_up: InterleavedGateUp | None = None) -> None:
        super().__init__()
        self.attn = layer.self_attn
        self.mlp = layer.mlp
        self.qkv = StackedLinear([self.attn.q_proj, self.attn.k_proj, self.attn.v_proj], rewrites)
        self.gate_up = gate_up or StackedLinear([self.mlp.gate_proj, self.mlp.up_proj], rewrites)
        self.input_layernorm = layer.input_layernorm
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.qk_norm = hasattr(self.attn, "q_norm")

    def forward(
        self,
        hidden: torch.Tensor,
        delta: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        slot: torch.Tensor,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on `hidden + delta` [rows, 1, width]: writes the token's key and value at
        `slot` of `keys` / `values` [rows, kv_heads, slots, head_dim] and attends over the slots
        `mask` [rows, slots] allows. Returns (residual after attention, MLP output)."""
        attn, mlp = self.attn, self.mlp
        hidden = hidden + delta
        x = self.input_layernorm(hidden)
        heads = (x.shape[0], 1, -1, attn.head_dim)
        query, key, value = (y.view(heads) for y in self.qkv(x))
        if self.qk_norm:
            query, key = attn.q_norm(query), attn.k_norm(key)
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        query = query * cos + rotate_half(query) * sin
        key = key * cos + rotate_half(key) * sin
        out = _write_and_decode(query, key, value, keys, values, slot, mask, attn.scaling)
        hidden = hidden + attn.o_proj(out.reshape(x.shape[0], 1, -1))
        x = self.post_attention_layernorm(hidden)
        gate, up = self.gate_up(x)
        activation = mlp.act_fn(gate) * up
        # Compiled with its producer, the one-row down projection recomputed silu(gate) * up in
        # each program of its GEMV, a large share of the step. The graph break makes inductor
        # write the activation once, and the projection runs faster (benchmarks/HISTORY.md).
        torch._dynamo.graph_break()
        return hidden, mlp.down_proj(activation)


class DecodeStack:
    """Embedding, rotary tables, `DecodeLayer`s, final norm and LM head: one decode step, over
    projections stacked until `rewrites` is undone (`gate_ups`: the fused MLPs', by module)."""

    def __init__(
        self, model: nn.Module, rewrites: Rewrites, gate_ups: dict[nn.Module, InterleavedGateUp] | None = None
    ) -> None:
        self.text_model = model.get_decoder()
        self.embed = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        gate_ups = gate_ups or {}
        self.layers = [DecodeLayer(layer, rewrites, gate_ups.get(layer.mlp)) for layer in self.text_model.layers]

    @staticmethod
    def supports(model: nn.Module) -> bool:
        """Whether every decoder layer of `model` is in `FUSED_LAYERS`."""
        layers = getattr(model.get_decoder(), "layers", [])
        return bool(layers) and all(type(layer).__name__ in FUSED_LAYERS for layer in layers)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        key_values: Sequence[tuple[torch.Tensor, torch.Tensor]],
        slot: torch.Tensor,
    ) -> torch.Tensor:
        """Last-token logits [rows, vocab] for `input_ids` [rows, 1] at `positions` (the model's
        generation layout), attending over `mask` [rows, slots] of each layer's (keys, values)
        [rows, kv_heads, slots, head_dim] after writing the token at `slot`."""
        hidden = self.embed(input_ids)
        cos, sin = decode_rotary(self.text_model, hidden, positions)
        delta = torch.zeros_like(hidden)
        for layer, (keys, values) in zip(self.layers, key_values, strict=True):
            hidden, delta = layer(hidden, delta, cos, sin, keys, values, slot, mask)
        return self.lm_head(self.text_model.norm(hidden + delta)[:, -1])
