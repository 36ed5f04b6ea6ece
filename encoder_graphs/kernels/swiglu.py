"""A gated MLP's gate and up projections and its SiLU gate as one GEMM (Triton, Hopper TMA).

cuBLAS offers no gated epilogue, so the stock MLP writes gate and up (2 x rows x width) and reads
them back for SiLU(gate) * up: in Qwen2.5-VL-7B's tower that kernel took a sizable share of the two
GEMMs' time (benchmarks/HISTORY.md). Here the weight rows interleave gate and up (row 2j gate j,
row 2j + 1 up j), so each output tile holds matching pairs of columns and the epilogue writes only
the product, rounded at the stock MLP's three points (gate and up, the SiLU, the product): the bf16
result then equals the stock one wherever the two GEMMs' fp32 accumulators round alike, which keeps
generation near the stock model's tokens. A persistent grid, TMA loads, the tile picked per row
count: from a few thousand rows up, as fast as cuBLAS's GEMM alone (benchmarks/COMPONENTS.md).
"""

from functools import cache

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from encoder_graphs.kernels import HALF_DTYPES
from encoder_graphs.kernels.checks import check_swiglu_inputs


@triton.jit(do_not_specialize=["rows"])
def _swiglu_kernel(
    x_desc, w_desc, Bias, Out, rows, cols, width, s_out,
    HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
    PROGRAMS: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    tiles_m, tiles_n = tl.cdiv(rows, BM), tl.cdiv(cols, BN)
    in_group = GROUP * tiles_n  # tiles of GROUP row blocks run together: their weight tiles stay in L2
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS, flatten=True, num_stages=STAGES):
        first_m = tile // in_group * GROUP
        size_m = min(tiles_m - first_m, GROUP)
        om = (first_m + tile % in_group % size_m) * BM
        on = tile % in_group // size_m * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, width, BK):  # TMA fills past the edges with zeros
            acc = tl.dot(x_desc.load([om, k]), w_desc.load([on, k]).T, acc)
        if HAS_BIAS:
            n = on + tl.arange(0, BN)
            acc += tl.load(Bias + n, mask=n < cols, other=0.0).to(tl.float32)[None, :]
        # Rounded where the stock MLP rounds (each projection, the SiLU, the product), so that
        # where the accumulators agree with cuBLAS's the output is the stock one, bit for bit.
        acc = acc.to(Out.dtype.element_ty).to(tl.float32)
        gate, up = tl.split(tl.reshape(acc, [BM, BN // 2, 2]))
        silu = (gate / (1.0 + tl.exp(-gate))).to(Out.dtype.element_ty).to(tl.float32)
        y = silu * up
        m = (om + tl.arange(0, BM)).to(tl.int64)[:, None]
        c = (on // 2 + tl.arange(0, BN // 2))[None, :]
        tl.store(Out + m * s_out + c, y.to(Out.dtype.element_ty), mask=(m < rows) & (c < cols // 2))


# Tiles (rows, columns, warps) and each one's time relative to 64 x 256's: a 128 x 256 tile runs
# somewhat more FLOPs a second, a 64 x 128 one somewhat fewer (measured: benchmarks/HISTORY.md).
TILES = ((64, 128, 4, 0.55), (64, 256, 4, 1.0), (128, 256, 8, 1.82))


@cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _tile(rows: int, cols: int, sms: int) -> tuple[int, int, int]:
    """The tile of the least time over whole waves of `sms` tiles: with few rows the largest tile
    leaves SMs idle and runs slower; with many rows it runs faster (benchmarks/HISTORY.md)."""
    bm, bn, warps, _ = min(TILES, key=lambda t: -(-triton.cdiv(rows, t[0]) * triton.cdiv(cols, t[1]) // sms) * t[3])
    return bm, bn, warps


def fits_swiglu_kernel(weight: torch.Tensor) -> bool:
    """Whether `swiglu_linear` takes this interleaved weight: half precision on a Hopper or newer
    GPU (TMA), an input width TMA can stride (rows of a multiple of 16 bytes)."""
    return (
        weight.device.type == "cuda"
        and torch.cuda.get_device_capability(weight.device)[0] >= 9
        and weight.dtype in HALF_DTYPES
        and weight.shape[0] % 2 == 0
        and weight.shape[1] % 8 == 0
    )


@torch.library.custom_op("encoder_graphs::swiglu_linear", mutates_args=())
def _swiglu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows, width = x.shape
    out = x.new_empty(rows, weight.shape[0] // 2)
    if rows == 0:
        return out
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:  # TMA's alignment
        x = x.clone(memory_format=torch.contiguous_format)
    cols, sms = weight.shape[0], _sm_count(x.device)
    bm, bn, warps = _tile(rows, cols, sms)
    programs = min(triton.cdiv(rows, bm) * triton.cdiv(cols, bn), sms)
    _swiglu_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [bm, 64]), TensorDescriptor.from_tensor(weight, [bn, 64]),
        bias if bias is not None else weight, out, rows, cols, width, out.stride(0),
        HAS_BIAS=bias is not None, BM=bm, BN=bn, BK=64, GROUP=8, PROGRAMS=programs, STAGES=4,
        num_warps=warps,
    )  # fmt: skip
    return out


@_swiglu_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0] // 2)


def swiglu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """SiLU(x W_gate^T + b_gate) * (x W_up^T + b_up) for `weight` [2 x width, in] (and `bias`)
    with gate and up rows interleaved (`fits_swiglu_kernel`); x [..., in] of the same dtype.
    A custom op: compiled code calls it without a graph break. No host sync: capturable. No
    backward (`fused_mlp` refuses calls that want one). Raises ValueError for shapes, dtypes or
    layouts the kernel does not take (`check_swiglu_inputs`)."""
    check_swiglu_inputs(x, weight, bias)
    out = torch.ops.encoder_graphs.swiglu_linear(x.reshape(-1, x.shape[-1]), weight, bias)
    return out.reshape(*x.shape[:-1], out.shape[-1])
