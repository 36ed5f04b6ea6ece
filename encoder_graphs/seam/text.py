"""The language models' decoder layers, rotary embeddings and caches as this package uses them,
and the cache layers of its static decode cache (subclasses of transformers' cache API)."""

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from transformers import DynamicCache, PretrainedConfig

# 5.17.0, 5.23.0: the cache layer API the decoder's static cache implements (update, lazy init,
# mask sizes, sequence length; is_compileable / is_sliding / is_initialized), and a Cache built
# from a list of layers. A linear-attention layer's (Qwen3.5's Gated DeltaNet) cache layer keeps
# `conv_states[0]` [batch, conv_dim, kernel] and `recurrent_states[0]` [batch, heads, k_dim,
# v_dim]; with `has_previous_state[0]` a one-token step updates the conv state in place
# (`causal_conv1d_update`) and hands the new recurrent state to `update_recurrent_state`.
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionCacheLayerMixin

LINEAR_ATTENTION = "linear_attention"  # 5.17.0, 5.23.0: its name in a text config's `layer_types`

# 5.17.0, 5.23.0: decoder layers, by class name, that `decoder/layers/decode.py`'s `DecodeLayer` computes
# over their own modules: pre-norm, q/k/v/o projections (Qwen3: RMSNorm on q and k per head),
# rotate-half rotary embedding, a gated MLP. Qwen3.5's: its full-attention layers as Qwen3's with
# an output gate (`q_proj` twice as wide: each head's query, then its gate) and rotary over a part
# of each head; its Gated DeltaNet layers (`delta_net`) through `DeltaNetDecodeLayer`.
FUSED_LAYERS = frozenset(
    {
        "Qwen2DecoderLayer",
        "Qwen2VLDecoderLayer",
        "Qwen2_5_VLDecoderLayer",
        "Qwen3DecoderLayer",
        "Qwen3VLTextDecoderLayer",
        "Qwen3_5DecoderLayer",
    }
)


# 5.17.0, 5.23.0: a Qwen3.5 decoder layer of linear attention holds its Gated DeltaNet as
# `linear_attn` (in_proj_qkv / _z / _b / _a, conv1d, A_log, dt_bias, a gated RMSNorm `norm`,
# out_proj; num_k_heads / num_v_heads, head_k_dim / head_v_dim, key_dim / value_dim); a layer of
# full attention holds `self_attn`.
def delta_net(layer: torch.nn.Module) -> bool:
    return hasattr(layer, "linear_attn")


# 5.17.0, 5.23.0: its conv's activation, by name ("silu" in every Qwen3.5 config).
def delta_net_activation(net: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    from transformers.activations import ACT2FN

    return ACT2FN[net.activation]


# 5.17.0, 5.23.0: DynamicCache(config=...) builds one layer per decoder layer; each layer holds
# `keys` and `values` [batch, kv_heads, length, head_dim].
def dynamic_cache(config: PretrainedConfig) -> Cache:
    return DynamicCache(config=config)


def layer_states(cache: Cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (keys, values) of a prefill's dynamic cache; a linear-attention layer's
    (conv state, recurrent state)."""
    return [
        (layer.conv_states[0], layer.recurrent_states[0])
        if isinstance(layer, LinearAttentionCacheLayerMixin)
        else (layer.keys, layer.values)
        for layer in cache.layers
    ]


# 5.17.0: a dynamic layer appends a forward's keys to `keys` / `values` once `is_initialized`; a
# linear-attention layer with `has_previous_state[0]` prepends `conv_states[0]` to the new tokens'
# conv inputs and starts the chunked recurrence from `recurrent_states[0]` (updating both in
# place), so a multi-token forward continues a prefill.
def continued_cache(cache: Cache, states: list[tuple[torch.Tensor, torch.Tensor]]) -> Cache:
    """`cache` (a fresh dynamic cache) holding `states` as `layer_states` gives them: a forward
    over it continues the sequences they end. The tensors are taken, not copied: the forward
    updates linear states in place."""
    for layer, (first, second) in zip(cache.layers, states, strict=True):
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            layer.conv_states[0], layer.recurrent_states[0] = first, second
            layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = True
            layer.has_previous_state[0] = True
            layer.conv_kernel_size[0] = first.shape[-1]
            layer.dtype, layer.device = first.dtype, first.device
        else:
            layer.dtype, layer.device = first.dtype, first.device
            layer.keys, layer.values = first, second
            layer.is_initialized = True
    return cache


# 5.17.0, 5.23.0: Qwen3.5's Gated DeltaNet convolves q, k and v together (conv_dim channels
# of `linear_conv_kernel_dim` taps) and keeps an fp32 state per value head (the torch fallback's
# dtype, and fla's).
def linear_state_shapes(text_config: PretrainedConfig) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """The conv state's [conv_dim, kernel] and the recurrent state's [heads, k_dim, v_dim] per
    sequence of a linear-attention layer."""
    key_dim = text_config.linear_num_key_heads * text_config.linear_key_head_dim
    value_dim = text_config.linear_num_value_heads * text_config.linear_value_head_dim
    conv = (2 * key_dim + value_dim, text_config.linear_conv_kernel_dim)
    recurrent = (text_config.linear_num_value_heads, text_config.linear_key_head_dim, text_config.linear_value_head_dim)
    return conv, recurrent


def text_head_dim(text_config: PretrainedConfig) -> int:
    """The attention heads' width: `head_dim` where the config sets it (Qwen3, Qwen3.5), else
    hidden_size / heads."""
    return getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads


# 5.17.0, 5.23.0: Qwen3.5's attention projects each head's query and its output gate together.
def mixer_width(text_config: PretrainedConfig) -> int:
    """The widest token mixer's projection outputs a token: attention's q (with Qwen3.5's gate),
    k and v; a Gated DeltaNet's convolved q, k, v and its z, b and a."""
    heads, kv_heads = text_config.num_attention_heads, text_config.num_key_value_heads
    head_dim = text_head_dim(text_config)
    gate = 2 if text_config.model_type == "qwen3_5_text" else 1
    width = (gate * heads + 2 * kv_heads) * head_dim
    if linear_attention_layers(text_config):
        (channels, _), (value_heads, _, value_dim) = linear_state_shapes(text_config)
        width = max(width, channels + value_heads * value_dim + 2 * value_heads)
    return width


def linear_attention_layers(text_config: PretrainedConfig) -> tuple[int, ...]:
    """The indices of the linear-attention layers (none for a model of full attention only)."""
    kinds = getattr(text_config, "layer_types", None) or []
    return tuple(index for index, kind in enumerate(kinds) if kind == LINEAR_ATTENTION)


# 5.17.0, 5.23.0: a decoder's `rotary_emb(hidden, position_ids)` gives the (cos, sin) that every
# layer applies, [batch, length, head_dim]. Qwen-VL's generation positions lead with a row of
# text positions (for packed masks) before the three M-RoPE rows; its text model drops that row.
def decode_rotary(
    text_model: torch.nn.Module, hidden: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if positions.ndim == 3 and positions.shape[0] == 4:
        positions = positions[1:]
    return text_model.rotary_emb(hidden, positions)


# 5.17.0, 5.23.0: a "dynamic" rotary embedding (InternVL3's language models) syncs with the host
# on every call to compare the largest position with its cached length, which a graph capture
# forbids. Below `original_max_seq_len` it never changes the frequencies, so while no position
# reaches that, reading its rope type as plain gives the same result without the sync.
@contextmanager
def static_rope(model: torch.nn.Module, max_positions: int) -> Iterator[None]:
    """Within the block, dynamic rotary embeddings that `max_positions` cannot grow skip their
    host-side length check."""
    modules = [
        module
        for module in model.modules()
        if isinstance(getattr(module, "rope_type", None), str)
        and "dynamic" in module.rope_type
        and max_positions <= getattr(module, "original_max_seq_len", 0)
    ]
    saved = [module.rope_type for module in modules]
    for module in modules:
        module.rope_type = "default"
    try:
        yield
    finally:
        for module, rope_type in zip(modules, saved):
            module.rope_type = rope_type


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


class StateLayer(LinearAttentionCacheLayerMixin):
    """One linear-attention layer's conv and recurrent states for a decode step, allocated up
    front (views of the static store): the step updates both in place."""

    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        super().__init__()
        self.conv_states[0], self.recurrent_states[0] = conv, recurrent
        self.is_conv_states_initialized[0] = self.is_recurrent_states_initialized[0] = True
        self.has_previous_state[0] = True
        self.conv_kernel_size[0] = conv.shape[-1]
        self.device, self.dtype = conv.device, conv.dtype

    def lazy_initialization(self, *args, **kwargs) -> None:
        raise RuntimeError("StateLayer is allocated up front")

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        raise RuntimeError("StateLayer takes one token per step: its conv state is updated in place")

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        self.recurrent_states[0].copy_(recurrent_states)
        return self.recurrent_states[0]


class SlotCache(Cache):
    """A `Cache` of `SlotLayer`s (and `StateLayer`s): `SlotCache(layers)`."""
