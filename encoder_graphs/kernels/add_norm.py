"""RMSNorm, alone or after a residual add, in one Triton kernel.

A Qwen2.5-VL vision block ends with `h + mlp(...)` and the next one begins with `norm1(h)`.
Compiled block by block, these are two kernels: the add reads two tensors and writes one, the
norm reads that back and writes another. Here one kernel reads both once and writes the sum and its
norm side by side, [rows, 2 x dim]: the next block takes the halves as views (`chained_blocks`).
Uncompiled, transformers' RMSNorm is six kernels (a float32 copy, its square, the mean, the
rsqrt, two products) that move about eight times the bytes of one read and one write: the
language model's norms of a caption batch's prefill (benchmarks/COMPONENTS.md). `rms_norm` is the kernel
without the add. Both round where the stock modules round, so most outputs equal the stock ones.
"""

import torch
import triton
import triton.language as tl

from encoder_graphs.kernels import refuse_gradients


# The row count is not specialized on (divisible by 16 or not): one compilation serves every batch.
@triton.jit(do_not_specialize=["rows"])
def _add_rms_norm_kernel(
    X, Y, W, Out, rows, s_x, s_y, s_out, eps,
    DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, HAS_UPDATE: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    row = r.to(tl.int64)[:, None]
    mask = (r < rows)[:, None] & (d < DIM)[None, :]
    x = tl.load(X + row * s_x + d[None, :], mask=mask, other=0.0)
    # Rounded where the stock modules round: the sum to the input dtype, the normalised rows to
    # it again before the weight, the product once more.
    if HAS_UPDATE:
        y = tl.load(Y + row * s_y + d[None, :], mask=mask, other=0.0)
        h = (x.to(tl.float32) + y.to(tl.float32)).to(x.dtype)
        tl.store(Out + row * s_out + d[None, :], h, mask=mask)
        normed_at = Out + row * s_out + DIM + d[None, :]
    else:
        h = x
        normed_at = Out + row * s_out + d[None, :]
    hf = h.to(tl.float32)
    normed = (hf * tl.rsqrt(tl.sum(hf * hf, 1) / DIM + eps)[:, None]).to(x.dtype)
    w = tl.load(W + d, mask=d < DIM, other=0.0)
    tl.store(normed_at, (w[None, :].to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=mask)


def _launch(x: torch.Tensor, update: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor, eps: float) -> None:
    rows, dim = x.shape
    if rows == 0:
        return
    block = triton.next_power_of_2(dim)
    per_program = max(4, 4096 // block)  # rows a program: a few thousand elements each
    x = x if x.stride(1) == 1 else x.contiguous()
    y = x if update is None else (update if update.stride(1) == 1 else update.contiguous())
    _add_rms_norm_kernel[(triton.cdiv(rows, per_program),)](
        x, y, weight, out, rows, x.stride(0), y.stride(0), out.stride(0), eps,
        DIM=dim, BLOCK_D=block, ROWS=per_program, HAS_UPDATE=update is not None, num_warps=8 if block >= 1024 else 4,
    )  # fmt: skip


@torch.library.custom_op("encoder_graphs::add_rms_norm", mutates_args=())
def _add_rms_norm(x: torch.Tensor, update: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = x.new_empty(x.shape[0], 2 * x.shape[1])
    _launch(x, update, weight, out, eps)
    return out


@_add_rms_norm.register_fake
def _(x: torch.Tensor, update: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x.new_empty(x.shape[0], 2 * x.shape[1])


@torch.library.custom_op("encoder_graphs::rms_norm", mutates_args=())
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(x, None, weight, out, eps)
    return out


@_rms_norm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _check(what: str, x: torch.Tensor, update: torch.Tensor | None, weight: torch.Tensor) -> None:
    refuse_gradients(what, (x, weight) if update is None else (x, update, weight))
    dim = x.shape[-1]
    shapes_ok = update is None or (update.shape == x.shape and update.dtype == x.dtype)
    if not shapes_ok or weight.shape != (dim,) or weight.stride(0) != 1 or x.dtype != weight.dtype:
        got = [tuple(t.shape) for t in (x, update, weight) if t is not None]
        raise ValueError(f"{what} takes x{' and update of one shape' if update is not None else ''} and a contiguous "
                         f"weight [{dim}], all of one dtype (got {got}; {x.dtype}, {weight.dtype})")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) (statistics in fp32, as transformers' RMSNorms) times `weight`: x and weight of
    one half-precision dtype on a GPU where Triton runs. A custom op, capturable, no backward."""
    _check("the fused norm", x, None, weight)
    dim = x.shape[-1]
    return torch.ops.encoder_graphs.rms_norm(x.reshape(-1, dim), weight, eps).view(x.shape)


def add_rms_norm(x: torch.Tensor, update: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h = x + update and RMSNorm(h) (statistics in fp32, as transformers' RMSNorms) times
    `weight`, side by side: [..., 2 x dim]. x, update and weight of one half-precision dtype on a
    GPU where Triton runs. A custom op: compiled code calls it without a graph break. No host
    sync: capturable. No backward: refuses calls that want one."""
    _check("the fused add and norm", x, update, weight)
    dim = x.shape[-1]
    out = torch.ops.encoder_graphs.add_rms_norm(x.reshape(-1, dim), update.reshape(-1, dim), weight, eps)
    return out.reshape(*x.shape[:-1], 2 * dim)
