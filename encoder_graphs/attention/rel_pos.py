"""Attention with decomposed relative positions (SAM's, after MViTv2) as one fused attention.

SAM adds to each score a height term and a width term: bias[i, j] = rel_h[i, row(j)] +
rel_w[i, col(j)], where rel_h and rel_w are query i's dot products with the relative-position
tables (the caller's). The stock forward materialises the whole [batch, heads, tokens, tokens]
bias and hands it to sdpa as a mask: for a 1024 px page's 4096 tokens 400 MB a view in each global
layer, written, copied and read again, which took two thirds of SAM's time (profiled on an H100).

The bias is itself a dot product. Append to each query its rel_h and rel_w, and to each key a
one-hot of its row and one of its column: then q'·k' = scale·q·k + bias, summed in the kernel's
fp32 accumulator, and no bias ever lies in memory. v is zero-padded to the same width, because
sdpa's fused kernels take one head width; the output's first head_dim columns are the attention's.
"""

import torch
import torch.nn.functional as F

_WIDTH_MULTIPLE = 8  # fused attention kernels take head widths in multiples of 8


def decomposed_rel_pos_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rel_h: torch.Tensor,
    rel_w: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """softmax(scale·q·kᵀ + bias)·v with bias[i, j] = rel_h[i, j // width] + rel_w[i, j % width].
    q, k, v [batch, heads, height·width, head_dim], keys in row-major order; rel_h [batch, heads,
    height·width, height]; rel_w [..., width]. Returns [batch, heads, height·width, head_dim]. No
    host sync: capturable."""
    height, width = rel_h.shape[-1], rel_w.shape[-1]
    tokens, head_dim = q.shape[-2:]
    if tokens != height * width or rel_h.shape[:-1] != q.shape[:-1] or rel_w.shape[:-1] != q.shape[:-1]:
        raise ValueError(f"q {tuple(q.shape)} with rel_h {tuple(rel_h.shape)}, rel_w {tuple(rel_w.shape)}")
    positions = torch.arange(tokens, device=q.device)[:, None]
    rows = (positions // width == torch.arange(height, device=q.device)).to(k.dtype)
    columns = (positions % width == torch.arange(width, device=q.device)).to(k.dtype)
    pad = -(head_dim + height + width) % _WIDTH_MULTIPLE
    lead = q.shape[:-2]
    queries = torch.cat([q * scale, rel_h, rel_w, q.new_zeros(*lead, tokens, pad)], dim=-1)
    one_hots = rows.expand(*lead, -1, -1), columns.expand(*lead, -1, -1)
    keys = torch.cat([k, *one_hots, k.new_zeros(*lead, tokens, pad)], dim=-1)
    values = F.pad(v, (0, queries.shape[-1] - head_dim))
    return F.scaled_dot_product_attention(queries, keys, values, scale=1.0)[..., :head_dim]
