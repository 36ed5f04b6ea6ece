"""Attention implementations registered with transformers under our names (each with the
prefix `encoder_graphs_`: another library's registration is never overwritten), and switching a
config to one of them."""

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface, PretrainedConfig

from encoder_graphs.attention import (
    VarlenAttention,
    causal_varlen_attention,
    decode_attention,
    get_attention_backend,
)

_VARLEN_PREFIX = "encoder_graphs_flash_"


# 5.17.0, 5.23.0: the implementation name lives in the private `config._attn_implementation`, and
# attention modules read it at every forward, so setting it switches kernels without a rebuild.
@contextmanager
def attention_implementation(config: PretrainedConfig, name: str) -> Iterator[None]:
    """Run modules configured by `config` with attention implementation `name`, then restore it."""
    original = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = original


def _varlen_forward(attention: VarlenAttention) -> Callable[..., tuple[torch.Tensor, None]]:
    """`attention` as transformers calls an attention implementation, over the packed rows of a
    varlen call: q, k, v [1, heads, tokens, head_dim] in, [1, tokens, heads, head_dim] out."""

    def forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        max_length_q: int | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
        return attention(q, k, v, cu_seq_lens_q, max_length_q, scale=scaling).unsqueeze(0), None

    return forward


# 5.17.0, 5.23.0: Qwen vision attention takes its cu_seqlens (varlen) branch only when the
# implementation's name contains "flash", and there passes a host-int `max_length_q`: what graph
# capture needs. (No "flash" in a name: transformers then treats it as an ordinary kernel.)
def register_varlen_attention(backend: str) -> str:
    """Register varlen backend `backend` with transformers (once); the implementation name to use."""
    name = _VARLEN_PREFIX + backend
    # Out of torch.compile'd blocks: its host-int max length differs per budget (engine/compile.py).
    AttentionInterface.register(name, torch.compiler.disable(_varlen_forward(get_attention_backend(backend))))
    return name


# 5.17.0, 5.23.0: an implementation name that transformers has no mask function for gets no mask
# (masking_utils: early exit). The segments reach the attention through `packed_sequences`, not as
# keyword arguments of the model's forward: Qwen-VL hands those on to its vision tower too.
PACKED_PREFILL_ATTENTION = "encoder_graphs_packed_causal"
# Model inputs with one value per prompt token, which a packed prefill packs like input_ids.
TOKEN_INPUTS = ("mm_token_type_ids", "token_type_ids")
_packed: list[tuple[torch.Tensor, int]] = []  # the segments of the packed forward running now


@contextmanager
def packed_sequences(config: PretrainedConfig, cu_seqlens: torch.Tensor, longest: int) -> Iterator[None]:
    """Within the block, the decoder that `config` configures attends causally within each
    segment of `cu_seqlens` (its forward gets one row of packed tokens and no attention mask)."""
    _packed.append((cu_seqlens, longest))
    try:
        with attention_implementation(config, PACKED_PREFILL_ATTENTION):
            yield
    finally:
        _packed.pop()


def _packed_causal_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if attention_mask is not None or not _packed:
        raise RuntimeError(f"{PACKED_PREFILL_ATTENTION} runs within packed_sequences(), without an attention mask")
    cu_seqlens, longest = _packed[-1]
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [1, heads, tokens, dim] -> [tokens, heads, dim]
    return causal_varlen_attention(q, k, v, cu_seqlens, longest, scale=scaling).unsqueeze(0), None


AttentionInterface.register(PACKED_PREFILL_ATTENTION, _packed_causal_attention_forward)


# 5.17.0, 5.23.0: attention modules that batch whole sequences (InternViT: one tile per row, no
# mask) call the implementation named in their config with q, k, v [batch, heads, tokens, dim].
def register_dense_attention(backend: str) -> str:
    """Register varlen backend `backend` for dense, unmasked, non-causal attention over a batch of
    equal-length sequences (each row of the batch one segment); the implementation name to use."""
    attention = get_attention_backend(backend)
    name = f"encoder_graphs_dense_{backend}"

    def dense_attention_forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        if attention_mask is not None:
            raise ValueError(f"{name} takes no attention mask")
        batch, heads, tokens, dim = query.shape
        q, k, v = (x.transpose(1, 2).reshape(batch * tokens, heads, dim) for x in (query, key, value))
        cu_seqlens = torch.arange(0, (batch + 1) * tokens, tokens, dtype=torch.int32, device=query.device)
        out = attention(q, k, v, cu_seqlens, tokens, scale=scaling)
        return out.view(batch, tokens, heads, dim), None

    AttentionInterface.register(name, torch.compiler.disable(dense_attention_forward))  # as the varlen one
    return name


# 5.17.0, 5.23.0: a decoder layer's attention through the model's own forward calls the
# implementation named in its config with query [batch, heads, 1, dim] and the cache layer's keys
# and values as `update` returned them. No "flash" in the name: transformers treats those specially.
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
