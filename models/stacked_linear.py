"""Linear layers over one input run as one GEMM: their weights become row blocks of one tensor.

A decode step's GEMMs read each weight once for a few tokens, so each costs its bytes plus a fixed
time per kernel: Qwen2.5-VL-3B's k and v projections (1 MB each) took 5.5 us apiece, q's (8 MB)
6 us (H200, 2026-11-22). Stacked, q, k and v are one read of 10 MB. The stock modules keep
working unchanged, on views of the stacked weight (the same values, no second copy), until
`unstack` gives each its own tensor back, as the model was. Layers that are not plain dense
`nn.Linear`s (LoRA, quantized, offloaded weights) are left alone and run one by one.
"""

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def plain_linears(linears: Sequence[nn.Module]) -> bool:
    """Plain `nn.Linear`s with dense weights in memory, all with a bias or none."""
    return (
        all(type(linear) is nn.Linear and type(linear.weight) is nn.Parameter for linear in linears)
        and not any(linear.weight.is_meta for linear in linears)
        and len({linear.bias is not None for linear in linears}) == 1
    )


def set_parameters(linear: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """`linear`'s weight (and bias, where given) as new parameters over these tensors, wanting
    gradients as the old ones did."""
    linear.weight = nn.Parameter(weight, requires_grad=linear.weight.requires_grad)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=linear.bias.requires_grad)


def own_copies(linears: Sequence[nn.Linear]) -> None:
    """Each of `linears`, holding views of a shared tensor, gets its own contiguous copy back:
    ordinary tensors whatever mode the caller is in, as the stock weights were."""
    with torch.inference_mode(False), torch.no_grad():
        for linear in linears:
            bias = linear.bias.clone(memory_format=torch.contiguous_format) if linear.bias is not None else None
            set_parameters(linear, linear.weight.clone(memory_format=torch.contiguous_format), bias)


class StackedLinear(nn.Module):
    """`linears` (same input width) as one GEMM where they can be stacked; `forward` returns each
    one's output, in order."""

    def __init__(self, linears: Sequence[nn.Module]) -> None:
        super().__init__()
        self.linears = list(linears)  # a plain list: the stock modules are not this module's children
        self.sizes = [linear.out_features for linear in linears]
        self.weight = self.bias = None
        if not plain_linears(linears):
            return
        # Ordinary tensors whatever mode the caller is in: inference tensors as stock weights
        # would refuse backward and load_state_dict later.
        with torch.inference_mode(False), torch.no_grad():
            self.weight = nn.Parameter(torch.cat([linear.weight for linear in linears]), requires_grad=False)
            if linears[0].bias is not None:
                self.bias = nn.Parameter(torch.cat([linear.bias for linear in linears]), requires_grad=False)
            biases = self.bias.split(self.sizes) if self.bias is not None else [None] * len(self.sizes)
            for linear, weight, bias in zip(self.linears, self.weight.split(self.sizes), biases, strict=True):
                set_parameters(linear, weight, bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.weight is None:
            return tuple(linear(x) for linear in self.linears)
        return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)

    def unstack(self) -> None:
        """Each stock module gets its own copy of its weight (and bias) back; this module is
        spent (its stacked tensors are freed with the last view)."""
        if self.weight is None:
            return
        own_copies(self.linears)
        self.weight = self.bias = None
