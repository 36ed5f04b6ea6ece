"""Varlen attention through flashinfer's cuDNN batch prefill (vLLM's FLASHINFER ViT backend).

`flashinfer.prefill.cudnn_batch_prefill_with_kv_cache` runs a cuDNN SDPA graph over packed
(ragged) q/k/v. It needs, all on the device: per-segment lengths shaped [segments, 1, 1, 1] and
ragged offsets in ELEMENTS (token offset * heads * head_dim) shaped [segments + 1, 1, 1, 1]; plus
a host-int max length and a workspace buffer. Everything is derived from `cu_seqlens` on the
device, so a captured graph follows new boundaries on replay.

cuDNN builds one execution graph per (segments, max_seqlen, heads, head_dim, dtype), the first
time it meets that shape; building syncs with the host, so every shape must be met once before
capture (the manager's warm-up does it). Segments and max_seqlen are rounded up to powers of two
so that eager calls of varying shape reuse a few graphs: extra segments have length 0, and a
larger max_seqlen only adds CTAs that exit at once (vLLM buckets both for the same reason).
flashinfer keeps one cuDNN handle for the process: use one device per process.
"""

import math

import torch

from encoder_graphs.kernels import HALF_DTYPES

WORKSPACE_BYTES = 128 * 1024 * 1024  # what vLLM gives cuDNN for ViT attention
MIN_SEGMENTS = 8
MIN_SEQLEN = 16

_workspaces: dict[torch.device, torch.Tensor] = {}


def _workspace(device: torch.device) -> torch.Tensor:
    """One buffer per device, allocated at the first call and reused by every later one.

    Hazard: allocating it while a CUDA graph is being captured would put it in the graph's pool,
    so the first call on a device must be eager (the manager warms up before it captures).
    """
    workspace = _workspaces.get(device)
    if workspace is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "flashinfer attention: first call on this device happened during CUDA graph "
                "capture; run it once eagerly (warm-up) before capturing"
            )
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        _workspaces[device] = workspace
    return workspace


def _next_power_of_two(n: int, minimum: int) -> int:
    return max(minimum, 1 << (n - 1).bit_length())


def ragged_metadata(
    cu_seqlens: torch.Tensor, max_seqlen: int, row_elements: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """cuDNN's view of `cu_seqlens`, computed on its device with host-known shapes only.

    Returns segment lengths [padded, 1, 1, 1], element offsets [padded + 1, 1, 1, 1] (int32) and
    the max length bound, where the segment count is padded to a power of two with empty
    segments at the last offset (never at zero) and max_seqlen is rounded up to a power of two.
    """
    offsets = cu_seqlens.to(torch.int32)
    segments = offsets.shape[0] - 1
    padded = _next_power_of_two(segments, MIN_SEGMENTS)
    if padded > segments:
        offsets = torch.cat([offsets, offsets[-1:].expand(padded - segments)])
    seq_lens = (offsets[1:] - offsets[:-1]).view(-1, 1, 1, 1)
    element_offsets = (offsets * row_elements).view(-1, 1, 1, 1)
    return seq_lens, element_offsets, _next_power_of_two(max_seqlen, MIN_SEQLEN)


def cudnn_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Non-causal attention within each segment of `cu_seqlens`; fp16/bf16 on CUDA only.

    `max_seqlen` must bound every segment. Zero-length segments are allowed; rows that no
    segment covers come back as zeros (cuDNN never writes them, and the output starts zeroed).
    """
    from flashinfer.prefill import cudnn_batch_prefill_with_kv_cache

    if q.dtype not in HALF_DTYPES:
        raise TypeError(f"flashinfer (cuDNN) attention needs fp16 or bf16, got {q.dtype}")
    _, heads, head_dim = q.shape
    default_scale = 1.0 / math.sqrt(head_dim)
    if scale is not None and scale != default_scale:
        # flashinfer's cuDNN graph cache key omits the scale, so a graph built with one scale
        # would be replayed with another: keep the graph's scale fixed and fold ours into q.
        q = q * (scale / default_scale)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    seq_lens, offsets, bound = ragged_metadata(cu_seqlens, max_seqlen, heads * head_dim)

    out = torch.zeros_like(q)
    cudnn_batch_prefill_with_kv_cache(
        q,
        k,
        v,
        default_scale,
        _workspace(q.device),
        max_token_per_sequence=bound,
        max_sequence_kv=bound,
        actual_seq_lens_q=seq_lens,
        actual_seq_lens_kv=seq_lens,
        causal=False,
        return_lse=False,
        batch_offsets_q=offsets,
        batch_offsets_k=offsets,
        batch_offsets_v=offsets,
        batch_offsets_o=offsets,
        out=out,
    )
    return out
