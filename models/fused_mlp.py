"""A gated SiLU MLP run as `swiglu_kernel` (gate, up and SiLU in one GEMM) and its down projection.

The kernel takes gate and up rows interleaved in one weight. The stock modules keep working on
strided views of it (the same values, no second copy), until the undo gives each its own
contiguous weight back, bit for bit as before.
"""

from collections.abc import Callable

import torch
from torch import nn

from encoder_graphs.models.attention import refuse_gradients, triton_runs
from encoder_graphs.models.patching import patch_attribute
from encoder_graphs.models.stacked_linear import own_copies, plain_linears, set_parameters
from encoder_graphs.models.transformers_seam import gated_silu_mlp_forward, is_gated_silu_mlp


def fuses_gated_mlp(mlp: nn.Module) -> bool:
    """Whether `fuse_gated_mlp` takes `mlp`: a stock gated SiLU MLP whose gate and up are plain
    dense linears (not LoRA, quantized or offloaded ones) of one device and dtype, that the
    kernel runs."""
    if not (is_gated_silu_mlp(mlp) and plain_linears([mlp.gate_proj, mlp.up_proj])):
        return False
    weight, other = mlp.gate_proj.weight, mlp.up_proj.weight
    if (other.device, other.dtype) != (weight.device, weight.dtype) or not triton_runs(weight.device):
        return False
    from encoder_graphs.models.swiglu_kernel import fits_swiglu_kernel

    return fits_swiglu_kernel(weight)


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Rows (or entries) of gate and up alternating: gate 0, up 0, gate 1, up 1, ..."""
    return torch.stack([gate, up], dim=1).flatten(0, 1)


GatedLinear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def fuse_gated_mlp(mlp: nn.Module, gated_linear: GatedLinear) -> Callable[[], None]:
    """Run `mlp` (`fuses_gated_mlp`) through `gated_linear(x, weight, bias)` over its gate and up
    weights interleaved (`swiglu_kernel.swiglu_linear`); returns the undo."""
    gate, up = mlp.gate_proj, mlp.up_proj
    # Ordinary tensors whatever mode the caller is in, as the stock weights were.
    with torch.inference_mode(False), torch.no_grad():
        weight = _interleave(gate.weight, up.weight)
        bias = _interleave(gate.bias, up.bias) if gate.bias is not None else None
        set_parameters(gate, weight[0::2], bias[0::2] if bias is not None else None)
        set_parameters(up, weight[1::2], bias[1::2] if bias is not None else None)

    stock = [param for linear in (gate, up) for param in linear.parameters()]

    def gated(x: torch.Tensor) -> torch.Tensor:
        refuse_gradients("the fused gated MLP", (x, *stock))
        return gated_linear(x, weight, bias)

    undo_forward = patch_attribute(mlp, "forward", gated_silu_mlp_forward(mlp, gated))

    def undo() -> None:
        undo_forward()
        own_copies([gate, up])

    return undo
