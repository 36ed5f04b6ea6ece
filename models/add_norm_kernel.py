"""A residual add and the RMSNorm after it in one Triton kernel, across a block boundary.

A Qwen2.5-VL vision block ends with `h + mlp(...)` and the next one begins with `norm1(h)`.
Compiled block by block, these are two kernels: the add reads two tensors and writes one, the
norm reads that back and writes another (32 + 25 us at 11.6k rows of 1280, H200, 2026-11-22, where
the memory floor of the pair is 28 us). Here one kernel reads both once and writes the sum and its
norm side by side, [rows, 2 x dim]: the next block takes the halves as views (`chained_blocks`).
"""

import torch
import triton
import triton.language as tl

from encoder_graphs.models.attention import refuse_gradients

ROWS = 4  # a program's rows


@triton.jit
def _add_rms_norm_kernel(
    X, Y, W, Out, rows, s_x, s_y, s_out, eps,
    DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    row = r.to(tl.int64)[:, None]
    mask = (r < rows)[:, None] & (d < DIM)[None, :]
    x = tl.load(X + row * s_x + d[None, :], mask=mask, other=0.0)
    y = tl.load(Y + row * s_y + d[None, :], mask=mask, other=0.0)
    # Rounded where the stock modules round: the sum to the input dtype, the normalised rows to
    # it again before the weight, the product once more.
    h = (x.to(tl.float32) + y.to(tl.float32)).to(x.dtype)
    hf = h.to(tl.float32)
    normed = (hf * tl.rsqrt(tl.sum(hf * hf, 1) / DIM + eps)[:, None]).to(x.dtype)
    w = tl.load(W + d, mask=d < DIM, other=0.0)
    tl.store(Out + row * s_out + d[None, :], h, mask=mask)
    tl.store(Out + row * s_out + DIM + d[None, :], (w[None, :].to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=mask)


@torch.library.custom_op("encoder_graphs::add_rms_norm", mutates_args=())
def _add_rms_norm(x: torch.Tensor, update: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows, dim = x.shape
    out = x.new_empty(rows, 2 * dim)
    if rows == 0:
        return out
    x, update = (t if t.stride(1) == 1 else t.contiguous() for t in (x, update))
    _add_rms_norm_kernel[(triton.cdiv(rows, ROWS),)](
        x, update, weight, out, rows, x.stride(0), update.stride(0), out.stride(0), eps,
        DIM=dim, BLOCK_D=triton.next_power_of_2(dim), ROWS=ROWS, num_warps=8,
    )  # fmt: skip
    return out


@_add_rms_norm.register_fake
def _(x: torch.Tensor, update: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x.new_empty(x.shape[0], 2 * x.shape[1])


def add_rms_norm(x: torch.Tensor, update: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h = x + update and RMSNorm(h) (statistics in fp32, as transformers' RMSNorms) times
    `weight`, side by side: [..., 2 x dim]. x, update and weight of one half-precision dtype on a
    GPU where Triton runs. A custom op: compiled code calls it without a graph break. No host
    sync: capturable. No backward: refuses calls that want one."""
    refuse_gradients("the fused add and norm", (x, update, weight))
    dim = x.shape[-1]
    if update.shape != x.shape or weight.shape != (dim,) or weight.stride(0) != 1 or not x.dtype == update.dtype == weight.dtype:
        raise ValueError(f"add_rms_norm takes x and update of one shape and a contiguous weight [{dim}], all of one "
                         f"dtype (got {tuple(x.shape)}, {tuple(update.shape)}, {tuple(weight.shape)}; "
                         f"{x.dtype}, {update.dtype}, {weight.dtype})")
    out = torch.ops.encoder_graphs.add_rms_norm(x.reshape(-1, dim), update.reshape(-1, dim), weight, eps)
    return out.reshape(*x.shape[:-1], 2 * dim)
