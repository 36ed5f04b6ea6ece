"""Attention within short segments (Qwen2.5-VL's windows of at most 64 rows), with the rotary
embedding applied to q and k as they load: one Triton kernel where there were two.

FA2's varlen kernel tiles queries by 128 rows, so a 64-row window fills half a tile, and it
launches a CTA per segment slot, used or not (a budget's layout holds far more slots than
windows); rotary ran as a kernel of its own that wrote q and k back. Here one program holds a
whole segment of a few heads, one head at a time: one softmax, no running maximum. It loads the
window's rotary angles once for its heads, and its loop over them is pipelined (the next head's
q, k, v load while this one computes). Programs are persistent and stop at the first slot past
the last segment, so the empty slots of a budget's layout cost nothing. Several heads a program
ran faster than one, for images and video alike, though still above the memory floor (measured:
benchmarks/HISTORY.md). Small budgets take fewer heads a program, so that their few windows still
fill the GPU.

Rotary pairs dim i with dim i + head_dim/2 (transformers' `rotate_half`). q and k come with each
head's dims interleaved by those pairs, i and i + head_dim/2 at 2i and 2i + 1
(`models.qwen2_5_vl.interleave_pairs` reorders the qkv weights so, exactly: q.k is the same in
any common order of dims). So a pair sits in one tile, and the head dim splits into power-of-two
parts (80 = 64 + 16) instead of padding to 128.
"""

from functools import cache

import torch
import triton
import triton.language as tl

from encoder_graphs.kernels import refuse_gradients
from encoder_graphs.kernels.checks import check_window_inputs

MAX_ROWS = 64  # longer segments need more registers than a program holds
PROGRAMS_PER_SM = 4  # with 4 heads a program; 2 to 16 measured the same
HEADS_PER_PROGRAM = 4  # at most; 1, 2, 4, 8 and 16 measured at 8k-12k rows: 4 was best, or within 10% of best
STAGES = 3  # of the loop over heads; 1 and 2 were slower


@triton.jit
def _rotate(x, c, s, PAIRS: tl.constexpr):
    """x [rows, 2 * PAIRS] of interleaved pairs (a, b) -> (a c - b s, b c + a s), in fp32 and
    rounded back to x's dtype, as transformers' rotary in fp32."""
    a, b = tl.split(tl.reshape(x.to(tl.float32), [x.shape[0], PAIRS, 2]))
    y = tl.join(a * c - b * s, b * c + a * s)
    return tl.reshape(y, [x.shape[0], 2 * PAIRS]).to(x.dtype)


@triton.jit(do_not_specialize=["rows", "segments"])  # one compilation for every batch
def _window_kernel(
    Q, K, V, Cos, Sin, Cu, Out,
    sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, s_cos, so_n, so_h, rows, segments, scale,
    D: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr,
    HEADS: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    group, first, programs = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    r, da, dp, pa = tl.arange(0, BLOCK), tl.arange(0, DA), tl.arange(0, D_PAD), tl.arange(0, DA // 2)
    total = tl.load(Cu + segments)
    seg, start = first, tl.load(Cu + first)
    while start < total:  # offsets are monotonic: past the last segment every slot is empty
        n = tl.load(Cu + seg + 1) - start
        if n > 0:
            row = (start + r).to(tl.int64)[:, None]
            live = (r < n)[:, None]
            full = live & (dp < D)[None, :]
            # The window's rotary angles, loaded once for its heads.
            cos_a = tl.load(Cos + row * s_cos + pa[None, :], mask=live, other=0.0)
            sin_a = tl.load(Sin + row * s_cos + pa[None, :], mask=live, other=0.0)
            if DB > 0:  # the head dim's second part (16 of Qwen2.5-VL's 80), its pairs after DA's
                db, pb = DA + tl.arange(0, DB), DA // 2 + tl.arange(0, DB // 2)
                cos_b = tl.load(Cos + row * s_cos + pb[None, :], mask=live, other=0.0)
                sin_b = tl.load(Sin + row * s_cos + pb[None, :], mask=live, other=0.0)
            # Pipelined over heads: the next heads' q, k, v load while this one computes.
            for i in tl.range(0, HEADS, num_stages=STAGES):
                h = group * HEADS + i
                q = tl.load(Q + row * sq_n + h * sq_h + da[None, :], mask=live, other=0.0)
                k = tl.load(K + row * sk_n + h * sk_h + da[None, :], mask=live, other=0.0)
                if DB > 0:
                    q_b = tl.load(Q + row * sq_n + h * sq_h + db[None, :], mask=live, other=0.0)
                    k_b = tl.load(K + row * sk_n + h * sk_h + db[None, :], mask=live, other=0.0)
                # One padded tile for v: a second dot of 16 columns gave wrong results (Triton 3.6/3.7).
                v = tl.load(V + row * sv_n + h * sv_h + dp[None, :], mask=full, other=0.0)
                scores = tl.dot(_rotate(q, cos_a, sin_a, DA // 2), tl.trans(_rotate(k, cos_a, sin_a, DA // 2)))
                if DB > 0:
                    scores += tl.dot(_rotate(q_b, cos_b, sin_b, DB // 2), tl.trans(_rotate(k_b, cos_b, sin_b, DB // 2)))
                scores = tl.where((r < n)[None, :], scores * scale, float("-inf"))
                p = tl.exp(scores - tl.max(scores, 1)[:, None])
                denom = tl.sum(p, 1)[:, None]  # as FA2: the weights rounded unnormalised, the sum fp32
                out = (tl.dot(p.to(v.dtype), v) / denom).to(v.dtype)
                tl.store(Out + row * so_n + h * so_h + dp[None, :], out, mask=full)
        seg += programs
        start = tl.load(Cu + seg, mask=seg < segments, other=total)
    if first == programs - 1:  # rows past the last segment come out zero, never stale
        for row0 in range(total, rows, BLOCK):
            row = (row0 + r).to(tl.int64)[:, None]
            full = (row < rows) & (dp < D)[None, :]
            zeros = tl.zeros([BLOCK, D_PAD], Out.dtype.element_ty)
            for i in range(HEADS):
                tl.store(Out + row * so_n + (group * HEADS + i) * so_h + dp[None, :], zeros, mask=full)


@cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _programs_per_group(device: torch.device, groups: int) -> int:
    """Programs along the segment slots for each group of heads."""
    return max(1, PROGRAMS_PER_SM * _sm_count(device) // groups)


def _heads_per_program(heads: int, rows: int, device: torch.device) -> int:
    """HEADS_PER_PROGRAM, halved until it divides `heads` and `rows` of full windows give every
    SM a program: few windows run faster spread over more programs, many windows faster with more
    heads a program (measured: benchmarks/HISTORY.md)."""
    work = rows // MAX_ROWS * heads  # (window, head) pairs
    per_program = HEADS_PER_PROGRAM
    while per_program > 1 and (heads % per_program or work < per_program * _sm_count(device)):
        per_program //= 2
    return per_program


def _head_parts(head_dim: int) -> tuple[int, int]:
    """head_dim as the largest power of two in it plus the rest, which must be a power of two
    of at least 16 (or none): 80 = 64 + 16, 64 = 64 + 0."""
    first = 1 << (head_dim.bit_length() - 1)
    rest = head_dim - first
    return first, rest


def fits_window_kernel(head_dim: int, max_seqlen: int) -> bool:
    """Whether `rotary_window_attention` takes heads of `head_dim` and segments of `max_seqlen`."""
    first, rest = _head_parts(head_dim)
    return max_seqlen <= MAX_ROWS and first >= 16 and (rest == 0 or (rest >= 16 and rest & (rest - 1) == 0))


def rotary_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
) -> torch.Tensor:
    """Non-causal attention within each segment of `cu_seqlens` (int32; segments of at most
    `max_seqlen` rows, see `fits_window_kernel`). q, k [rows, heads, head_dim] with each
    head's dims interleaved by rotary pairs, rotated here by `cos`, `sin` [rows, head_dim] (the
    halves alike, as transformers builds them; pair i takes column i); v in its own order.
    Half precision, any row and head strides, head dims contiguous (`check_window_inputs`).
    Offsets on the device are trusted to keep within `max_seqlen` (their builder checks them on
    the host, as `Qwen2_5_VLAdapter` does). Returns [rows, heads, head_dim]; rows that no segment
    covers are zero. No host sync: capturable."""
    refuse_gradients("rotary window attention", (q, k, v))
    check_window_inputs(q, k, v, cos, sin, cu_seqlens, max_seqlen)  # CPU offsets: their segments too
    rows, heads, head_dim = q.shape
    if not fits_window_kernel(head_dim, max_seqlen):
        raise ValueError(f"window attention takes segments of at most {MAX_ROWS} rows (got {max_seqlen}) "
                         f"and a head dim of two power-of-two parts of at least 16 (got {head_dim})")
    cu_seqlens = cu_seqlens.to(q.device)  # the stock tower builds it on grid_thw's, maybe the CPU
    out = torch.empty_like(v, memory_format=torch.contiguous_format)
    first, rest = _head_parts(head_dim)
    segments = cu_seqlens.shape[0] - 1
    per_program = _heads_per_program(heads, rows, q.device)
    groups = heads // per_program
    grid = (groups, max(1, min(segments, _programs_per_group(q.device, groups))))
    _window_kernel[grid](
        q, k, v, cos, sin, cu_seqlens, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        out.stride(0), out.stride(1), rows, segments, scale,
        D=head_dim, DA=first, DB=rest, D_PAD=triton.next_power_of_2(head_dim),
        BLOCK=max(16, triton.next_power_of_2(max_seqlen)), HEADS=per_program, STAGES=STAGES, num_warps=4,
    )  # fmt: skip
    return out
