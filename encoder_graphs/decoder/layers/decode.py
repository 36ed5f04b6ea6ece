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

Qwen3.5's layers: its full-attention ones gate their output (a sigmoid gate per head, projected
with the query) and rotate a part of each head; its Gated DeltaNet ones (`DeltaNetDecodeLayer`)
take the conv and recurrent states in place of keys and values, and run transformers' one-token
math (its torch fallback's: conv window, l2-normed q and k, decayed delta-rule update) over them,
stacked projections and no cache object, so that they compile as the others do.
"""

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from encoder_graphs.attention import write_and_decode
from encoder_graphs.rewrites import Rewrites
from encoder_graphs.rewrites.fused_mlp import InterleavedGateUp
from encoder_graphs.rewrites.stacked_linear import StackedLinear
from encoder_graphs.seam.text import FUSED_LAYERS, decode_rotary, delta_net, delta_net_activation


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding over the first `cos.shape[-1]` channels of each head (all, or Qwen3.5's
    partial share), the rest passed through."""
    width = cos.shape[-1]
    if width == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    turned, kept = x[..., :width], x[..., width:]
    return torch.cat((turned * cos + rotate_half(turned) * sin, kept), dim=-1)


# Outside the compiled code: inductor would functionalize the in-place cache write, at worst
# into a copy of the whole cache view per layer. Compiled, a layer is three graphs: two around
# this, and the down projection's (below).
_write_and_decode = torch.compiler.disable(write_and_decode)


class _DecodeBlock(nn.Module):
    """A decoder layer's norms and MLP (gate/up stacked until `rewrites` is undone; `gate_up`: the
    MLP's, where it is fused already by `decoder/layers/stack.py`'s `fuse_text_kernels`)."""

    def __init__(self, layer: nn.Module, rewrites: Rewrites, gate_up: InterleavedGateUp | None) -> None:
        super().__init__()
        self.mlp = layer.mlp
        self.gate_up = gate_up or StackedLinear([self.mlp.gate_proj, self.mlp.up_proj], rewrites)
        self.input_layernorm = layer.input_layernorm
        self.post_attention_layernorm = layer.post_attention_layernorm

    def _mlp(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(`hidden`, the MLP's output on its norm): the residual and what the next layer adds."""
        x = self.post_attention_layernorm(hidden)
        gate, up = self.gate_up(x)
        activation = self.mlp.act_fn(gate) * up
        # Compiled with its producer, the one-row down projection recomputed silu(gate) * up in
        # each program of its GEMV, a large share of the step. The graph break makes inductor
        # write the activation once, and the projection runs faster (benchmarks/HISTORY.md).
        torch._dynamo.graph_break()
        return hidden, self.mlp.down_proj(activation)


class DecodeLayer(_DecodeBlock):
    """One stock decoder layer's decode math over its own modules (no weights copied; q/k/v
    stacked until `rewrites` is undone)."""

    def __init__(self, layer: nn.Module, rewrites: Rewrites, gate_up: InterleavedGateUp | None = None) -> None:
        super().__init__(layer, rewrites, gate_up)
        self.attn = layer.self_attn
        self.qkv = StackedLinear([self.attn.q_proj, self.attn.k_proj, self.attn.v_proj], rewrites)
        self.qk_norm = hasattr(self.attn, "q_norm")
        # Qwen3.5: the query projection gives each head's query and then its output gate.
        self.gated = self.attn.q_proj.out_features == 2 * self.attn.o_proj.in_features

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
        attn = self.attn
        hidden = hidden + delta
        x = self.input_layernorm(hidden)
        rows = x.shape[0]
        heads = (rows, 1, -1, attn.head_dim)
        query, key, value = self.qkv(x)
        if self.gated:
            query, gate = query.view(rows, 1, -1, 2 * attn.head_dim).chunk(2, dim=-1)
        query, key, value = query.reshape(heads), key.view(heads), value.view(heads)
        if self.qk_norm:
            query, key = attn.q_norm(query), attn.k_norm(key)
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        query, key = rotate(query, cos, sin), rotate(key, cos, sin)
        out = _write_and_decode(query, key, value, keys, values, slot, mask, attn.scaling).reshape(rows, 1, -1)
        if self.gated:
            out = out * torch.sigmoid(gate.reshape(rows, 1, -1))
        return self._mlp(hidden + attn.o_proj(out))


class DeltaNetDecodeLayer(_DecodeBlock):
    """A Gated DeltaNet layer's one-token step (Qwen3.5), over its own modules (the four input
    projections stacked until `rewrites` is undone): the same math as transformers' torch
    fallback, on the conv state [rows, conv_dim, kernel] and the fp32 recurrent state [rows,
    heads, k_dim, v_dim], both updated in place."""

    def __init__(self, layer: nn.Module, rewrites: Rewrites, gate_up: InterleavedGateUp | None = None) -> None:
        super().__init__(layer, rewrites, gate_up)
        self.net = net = layer.linear_attn
        self.proj = StackedLinear([net.in_proj_qkv, net.in_proj_z, net.in_proj_b, net.in_proj_a], rewrites)
        self.activation = delta_net_activation(net)

    def forward(
        self,
        hidden: torch.Tensor,
        delta: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        conv: torch.Tensor,
        recurrent: torch.Tensor,
        slot: torch.Tensor,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on `hidden + delta` [rows, 1, width]; (cos, sin, slot, mask: unused, the
        attention layers' arguments). Returns (residual after the mixer, MLP output)."""
        net = self.net
        hidden = hidden + delta
        x = self.input_layernorm(hidden)
        rows = x.shape[0]
        mixed, z, b, a = self.proj(x[:, 0])
        # The conv window slides one token: the state's last taps and the new input, in place.
        window = torch.cat((conv[..., 1:], mixed.to(conv.dtype).unsqueeze(-1)), dim=-1)
        conv.copy_(window)
        weight = net.conv1d.weight
        mixed = self.activation(F.conv1d(window.to(weight.dtype), weight, net.conv1d.bias, groups=weight.shape[0]))
        query, key, value = mixed[..., 0].to(x.dtype).split([net.key_dim, net.key_dim, net.value_dim], dim=-1)
        decay = -net.A_log.float().exp() * F.softplus(a.float() + net.dt_bias)
        out = delta_rule_step(
            query.view(rows, -1, net.head_k_dim),
            key.view(rows, -1, net.head_k_dim),
            value.view(rows, -1, net.head_v_dim),
            decay,
            b.sigmoid(),
            recurrent,
        )
        out = net.norm(out.reshape(-1, net.head_v_dim), z.reshape(-1, net.head_v_dim))
        return self._mlp(hidden + net.out_proj(out.reshape(rows, 1, -1)))


def delta_rule_step(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """One token of the gated delta rule, as transformers' `torch_recurrent_gated_delta_rule`
    computes it (fp32, q and k l2-normed, q scaled by 1/sqrt(k_dim), key heads repeated over the
    value heads they serve): query, key [rows, k_heads, k_dim], value [rows, v_heads, v_dim],
    decay (log) and beta [rows, v_heads]; `state` [rows, v_heads, k_dim, v_dim] fp32, updated in
    place. Returns the output [rows, v_heads, v_dim] in value's dtype."""
    dtype = value.dtype
    query, key, value, decay, beta = (t.float() for t in (query, key, value, decay, beta))
    query = query * torch.rsqrt((query * query).sum(-1, keepdim=True) + 1e-6)
    key = key * torch.rsqrt((key * key).sum(-1, keepdim=True) + 1e-6)
    query = query / query.shape[-1] ** 0.5
    repeats = value.shape[1] // key.shape[1]
    if repeats > 1:
        query, key = query.repeat_interleave(repeats, dim=1), key.repeat_interleave(repeats, dim=1)
    decayed = state * decay.exp()[..., None, None]
    remembered = (decayed * key.unsqueeze(-1)).sum(dim=-2)
    change = (value - remembered) * beta.unsqueeze(-1)
    updated = decayed + key.unsqueeze(-1) * change.unsqueeze(-2)
    state.copy_(updated)
    return (updated * query.unsqueeze(-1)).sum(dim=-2).to(dtype)


class DecodeStack:
    """Embedding, rotary tables, `DecodeLayer`s (and `DeltaNetDecodeLayer`s), final norm and LM
    head: one decode step, over projections stacked until `rewrites` is undone (`gate_ups`: the
    fused MLPs', by module)."""

    def __init__(
        self, model: nn.Module, rewrites: Rewrites, gate_ups: dict[nn.Module, InterleavedGateUp] | None = None
    ) -> None:
        self.text_model = model.get_decoder()
        self.embed = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        gate_ups = gate_ups or {}
        self.layers = [
            (DeltaNetDecodeLayer if delta_net(layer) else DecodeLayer)(layer, rewrites, gate_ups.get(layer.mlp))
            for layer in self.text_model.layers
        ]

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
        [rows, kv_heads, slots, head_dim] after writing the token at `slot` (a linear-attention
        layer's: its conv and recurrent states, updated)."""
        hidden = self.embed(input_ids)
        cos, sin = decode_rotary(self.text_model, hidden, positions)
        delta = torch.zeros_like(hidden)
        for layer, (keys, values) in zip(self.layers, key_values, strict=True):
            hidden, delta = layer(hidden, delta, cos, sin, keys, values, slot, mask)
        return self.lm_head(self.text_model.norm(hidden + delta)[:, -1])
