"""A gated SiLU MLP run as `kernels/swiglu.py`'s GEMM (gate, up and SiLU in one GEMM) and its down projection.

The kernel takes gate and up rows interleaved in one weight. The stock modules keep working on
strided views of it (the same values, no second copy), until the `Rewrites` undo gives each its
own contiguous weight back, bit for bit as before.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from encoder_graphs.kernels import refuse_gradients, triton_runs
from encoder_graphs.rewrites import Rewrites, made_like
from encoder_graphs.rewrites.stacked_linear import plain_linears
from encoder_graphs.seam.modules import gated_silu_mlp_forward, is_gated_silu_mlp


def fuses_gated_mlp(mlp: nn.Module) -> bool:
    """Whether `fuse_gated_mlp` takes `mlp`: a stock gated SiLU MLP whose gate and up are plain
    dense linears (not LoRA, quantized or offloaded ones) of one device and dtype, that the
    kernel runs."""
    if not (is_gated_silu_mlp(mlp) and plain_linears([mlp.gate_proj, mlp.up_proj])):
        return False
    weight, other = mlp.gate_proj.weight, mlp.up_proj.weight
    if (other.device, other.dtype) != (weight.device, weight.dtype) or not triton_runs(weight.device):
        return False
    from encoder_graphs.kernels.swiglu import fits_swiglu_kernel

    return fits_swiglu_kernel(weight)


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Rows (or entries) of gate and up alternating: gate 0, up 0, gate 1, up 1, ..."""
    return torch.stack([gate, up], dim=1).flatten(0, 1)


GatedLinear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


class InterleavedGateUp:
    """A fused MLP's gate and up projections from its interleaved weight, as one GEMM (cuBLAS):
    for decode steps, whose few rows read the weight once either way."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        both = F.linear(x, self.weight, self.bias)
        return both[..., 0::2], both[..., 1::2]


def fuse_gated_mlp(mlp: nn.Module, gated_linear: GatedLinear, rewrites: Rewrites) -> InterleavedGateUp:
    """Run `mlp` (`fuses_gated_mlp`) through `gated_linear(x, weight, bias)` over its gate and up
    weights interleaved (`kernels/swiglu.py`'s `swiglu_linear`), until `rewrites` is undone; returns its
    gate and up over the same weight."""
    gate, up = mlp.gate_proj, mlp.up_proj
    with made_like(gate.weight):
        weight = _interleave(gate.weight, up.weight)
        bias = _interleave(gate.bias, up.bias) if gate.bias is not None else None
    for index, linear in enumerate((gate, up)):
        rewrites.replace_data(linear, "weight", weight[index::2])
        if bias is not None:
            rewrites.replace_data(linear, "bias", bias[index::2])

    stock = [param for linear in (gate, up) for param in linear.parameters()]

    def gated(x: torch.Tensor) -> torch.Tensor:
        refuse_gradients("the fused gated MLP", (x, *stock))
        return gated_linear(x, weight, bias)

    rewrites.patch(mlp, "forward", gated_silu_mlp_forward(mlp, gated))
    return InterleavedGateUp(weight, bias)
