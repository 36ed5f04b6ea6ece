"""Variable-length, non-causal attention over cu_seqlens, with a host-int max length; and the
language model's two: causal varlen for its packed prefill, one query token for its decode steps.

Every backend takes q, k, v as [tokens, heads, head_dim], `cu_seqlens` as int32 offsets on the
device, and `max_seqlen` as a host int (baked into a graph at capture), and returns [tokens, heads,
head_dim]. None of them syncs with the host, so all of them can be captured.
"""

import importlib.util
from collections.abc import Callable
from itertools import pairwise

import torch

from encoder_graphs.kernels import HALF_DTYPES, triton_runs

VarlenAttention = Callable[..., torch.Tensor]

_EXTRAS = {"flash_attn": "flash-attn", "flashinfer": "flashinfer"}


def sdpa_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Reference and CPU backend.

    On CUDA: one dense attention with a block-diagonal mask (capturable; rows that no segment
    covers form one extra block, so they stay finite). On the CPU, where nothing is captured, one
    attention per segment instead: a mask over a whole packed batch costs its square.
    """
    if q.device.type == "cpu":
        out = torch.zeros_like(q)
        bounds = cu_seqlens.tolist()
        for start, end in pairwise(bounds):
            if end > start:
                segment = [x[start:end].transpose(0, 1) for x in (q, k, v)]
                attended = torch.nn.functional.scaled_dot_product_attention(*segment, scale=scale)
                out[start:end] = attended.transpose(0, 1)
        return out
    positions = torch.arange(q.shape[0], device=q.device)
    segment = torch.searchsorted(cu_seqlens[1:].to(positions.dtype), positions, right=True)
    mask = segment[:, None] == segment[None, :]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


def torch_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float | None = None,
) -> torch.Tensor:
    """PyTorch's bundled FA2 (`torch.nn.attention.varlen`): no extra wheel, CUDA fp16/bf16 only."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale)


def flash_attn_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float | None = None,
) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale=scale
    )


def flashinfer_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float | None = None,
) -> torch.Tensor:
    from encoder_graphs.attention.flashinfer import cudnn_varlen_attention

    return cudnn_varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale)


def _flash_varlen_runs(q: torch.Tensor) -> bool:
    """Whether FA2 takes `q`: half precision on an Ampere or newer GPU, heads up to 256 wide."""
    return (
        q.device.type == "cuda"
        and q.dtype in HALF_DTYPES
        and q.shape[-1] <= 256
        and torch.cuda.get_device_capability(q.device)[0] >= 8
    )


def causal_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention within each segment, grouped-query (k, v may have fewer heads): a
    language model's prefill over packed prompts. CUDA half precision: FA2's varlen kernel, as
    bundled with PyTorch (the aten op; `torch.nn.attention.varlen`'s signature differs between
    torch 2.11 and 2.13). Otherwise (CPU, fp32, GPUs before Ampere, heads over 256 wide): one
    causal sdpa per segment."""
    if _flash_varlen_runs(q):
        return torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, True, False, scale=scale
        )[0]
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in pairwise(bounds):
        segment = [x[start:end].transpose(0, 1) for x in (q, k, v)]
        attended = torch.nn.functional.scaled_dot_product_attention(*segment, is_causal=True, scale=scale, enable_gqa=True)
        out[start:end] = attended.transpose(0, 1)
    return out


def decode_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """One new token per sequence against every slot of a static cache, for grouped-query
    attention. transformers' sdpa path repeats K/V to the query head count whenever a mask is
    given (a full copy of the cache per layer per step); here the query heads that share a KV
    head become that head's query rows instead, so the cache is read once and never copied.
    query [batch, heads, 1, dim]; keys, values [batch, kv_heads, slots, dim]; mask bool
    [batch, 1, 1, slots], True = attend. Returns [batch, 1, heads, dim]."""
    batch, heads, q_len, dim = query.shape
    kv_heads = keys.shape[1]
    if q_len != 1:
        raise ValueError(f"decode attention takes one query token, got {q_len}")
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    output = torch.nn.functional.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
    return output.reshape(batch, heads, 1, dim).transpose(1, 2)


def fits_decode_kernel(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether `kernels/decode.py` takes these (on a GPU where `triton_runs`): head_dim a power of
    two from 16 to 256, whole groups of query heads per KV head, one dtype, cache rows contiguous
    in head_dim (keys and values alike), a bool mask contiguous along the slots."""
    dim, heads, kv_heads = query.shape[-1], query.shape[1], keys.shape[1]
    return (
        16 <= dim <= 256
        and dim & (dim - 1) == 0
        and heads % kv_heads == 0
        and keys.dtype == values.dtype == query.dtype
        and keys.stride(-1) == 1
        and keys.stride() == values.stride()
        and mask.dtype == torch.bool
        and mask.stride(-1) == 1
    )


def write_and_decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slot: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Write the new token's key and value [batch, kv_heads, 1, dim] at `slot` of the cache's keys,
    values [batch, kv_heads, slots, dim], then `decode_attention` over the slots `mask` [batch,
    slots] allows (the caller allows `slot`, as `decode_step` does). On CUDA one split-KV Triton
    kernel pair does both (`kernels/decode.py`); elsewhere (the CPU, no Triton, odd head widths, GPUs
    the kernels were not tested on) index_copy and sdpa."""
    if triton_runs(query.device) and fits_decode_kernel(query, keys, values, mask):
        from encoder_graphs.kernels.decode import write_and_attend

        return write_and_attend(query, key, value, keys, values, slot, mask, scale)
    keys.index_copy_(2, slot, key)
    values.index_copy_(2, slot, value)
    return decode_attention(query, keys, values, mask[:, None, None, :], scale)


BACKENDS: dict[str, VarlenAttention] = {
    "torch": torch_varlen_attention,
    "flash_attn": flash_attn_varlen_attention,
    "flashinfer": flashinfer_varlen_attention,
    "sdpa": sdpa_varlen_attention,
}


def get_attention_backend(name: str) -> VarlenAttention:
    """The backend called `name`; a clear error when it is unknown or its package is missing."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(BACKENDS)}")
    if name in _EXTRAS and importlib.util.find_spec(name) is None:
        raise ImportError(
            f"attention backend {name!r} needs the {name} package: "
            f"pip install 'encoder-graphs[{_EXTRAS[name]}]'"
        )
    return BACKENDS[name]


def default_attention_backend(device: torch.device) -> str:
    return "torch" if device.type == "cuda" else "sdpa"
