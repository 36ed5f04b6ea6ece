"""The decode step's attention as one Triton kernel pair: each sequence's new token against its
static KV cache, grouped-query, split over the cache (split-KV), with the token's own key and
value written into the cache by the same kernel.

cuDNN's sdpa, for one token over a cache of a few hundred slots, took many times as long per
layer as reading those slots takes (measured: benchmarks/HISTORY.md). Here the query heads that
share a KV head are one tile's rows, each program reads one slice of the slots, and a second
kernel merges the slices' softmax statistics. Masked slots are never loaded, so NaNs there cannot
leak into the output.
"""

import torch
import triton
import triton.language as tl

from encoder_graphs.kernels.checks import check_decode_inputs

BLOCK_N = 64  # slots per tile
# Rows of a key or value tile wider than this many bytes halve the tile: an fp32 head of 256
# (Qwen3.5's) in tiles of 64 slots asked for 276 KiB of shared memory, over an H100's 227.
TILE_ROW_BYTES = 512


@triton.jit
def _split_kernel(
    Q, KNew, VNew, K, V, Mask, Slot, Acc, Stats,
    sq_b, sq_h, sn_b, sn_h, sk_b, sk_h, sk_n, sm_b,
    scale, slots, split_size,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    b, h, s = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)  # int64: offsets past 2**31
    rows, dims = tl.arange(0, G_PAD), tl.arange(0, D)
    q = tl.load(Q + b * sq_b + (h * G + rows)[:, None] * sq_h + dims[None, :], mask=(rows < G)[:, None], other=0.0)
    slot = tl.load(Slot)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    if s == 0:  # the new token: always attended, and written to the cache here
        k_new = tl.load(KNew + b * sn_b + h * sn_h + dims)
        v_new = tl.load(VNew + b * sn_b + h * sn_h + dims)
        tl.store(K + b * sk_b + h * sk_h + slot * sk_n + dims, k_new)
        tl.store(V + b * sk_b + h * sk_h + slot * sk_n + dims, v_new)
        m_i = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * scale
        l_i = tl.full([G_PAD], 1.0, tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32) + v_new.to(tl.float32)[None, :]
    start = s * split_size
    end = tl.minimum(start + split_size, slots)
    for n in range(start, end, BLOCK_N):
        cols = n + tl.arange(0, BLOCK_N)
        inside = cols < end
        allowed = inside & (cols != slot) & (tl.load(Mask + b * sm_b + cols, mask=inside, other=0) != 0)
        offsets = b * sk_b + h * sk_h + cols[:, None] * sk_n + dims[None, :]
        k = tl.load(K + offsets, mask=allowed[:, None], other=0.0)
        v = tl.load(V + offsets, mask=allowed[:, None], other=0.0)
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = tl.where(allowed[None, :], qk * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    part = ((b * tl.num_programs(1) + h) * tl.num_programs(2) + s) * G_PAD + rows
    tl.store(Acc + part[:, None] * D + dims[None, :], acc)
    tl.store(Stats + part * 2, m_i)
    tl.store(Stats + part * 2 + 1, l_i)


@triton.jit
def _merge_kernel(
    Acc, Stats, Out, so_b, so_h, splits,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    b, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    rows, dims = tl.arange(0, G_PAD), tl.arange(0, D)
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    total = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for s in range(splits):
        part = ((b * tl.num_programs(1) + h) * splits + s) * G_PAD + rows
        m_s = tl.load(Stats + part * 2)
        l_s = tl.load(Stats + part * 2 + 1)
        m_new = tl.maximum(m, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha, beta = tl.exp(m - m_safe), tl.exp(m_s - m_safe)
        total = total * alpha + l_s * beta
        acc = acc * alpha[:, None] + tl.load(Acc + part[:, None] * D + dims[None, :]) * beta[:, None]
        m = m_new
    out = acc / total[:, None]
    heads = h * G + rows
    tl.store(Out + b * so_b + heads[:, None] * so_h + dims[None, :], out.to(Out.dtype.element_ty), mask=(rows < G)[:, None])


def _split_size(programs: int, slots: int, block_n: int, device: torch.device) -> int:
    # About two programs per SM: a slice per program no shorter than one tile.
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    tiles = triton.cdiv(slots, block_n)
    splits = max(1, min(tiles, triton.cdiv(2 * sms, programs)))
    return triton.cdiv(tiles, splits) * block_n


def write_and_attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slot: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """query [batch, heads, 1, dim]; key, value [batch, kv_heads, 1, dim], written at `slot` of
    keys, values [batch, kv_heads, slots, dim] (same strides); mask bool [batch, slots], True =
    attend (the slot itself is attended whatever the mask says there). Returns [batch, 1, heads, dim].
    Raises ValueError for arguments the kernels do not take (`check_decode_inputs`); `slot` below
    `slots` is the caller's to keep (the runner checks each step's on the host)."""
    check_decode_inputs(query, key, value, keys, values, slot, mask)
    batch, heads, _, dim = query.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    group_pad = max(16, triton.next_power_of_2(group))
    block_n = BLOCK_N if dim * query.element_size() <= TILE_ROW_BYTES else BLOCK_N // 2
    split_size = _split_size(batch * kv_heads, slots, block_n, query.device)
    splits = triton.cdiv(slots, split_size)
    acc = torch.empty(batch, kv_heads, splits, group_pad, dim, dtype=torch.float32, device=query.device)
    stats = torch.empty(batch, kv_heads, splits, group_pad, 2, dtype=torch.float32, device=query.device)
    out = torch.empty(batch, 1, heads, dim, dtype=query.dtype, device=query.device)
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    mask = mask.view(torch.uint8)
    with torch.cuda.device(query.device):  # Triton launches on the current device, not the inputs'
        _split_kernel[(batch, kv_heads, splits)](
            query, key, value, keys, values, mask, slot, acc, stats,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1),
            keys.stride(0), keys.stride(1), keys.stride(2), mask.stride(0),
            scale, slots, split_size,
            G=group, G_PAD=group_pad, D=dim, BLOCK_N=block_n, IEEE=query.dtype == torch.float32,
        )  # fmt: skip
        _merge_kernel[(batch, kv_heads)](
            acc, stats, out, out.stride(0), out.stride(2), splits, G=group, G_PAD=group_pad, D=dim
        )
    return out
