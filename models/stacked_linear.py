"""Linear layers over one input run as one GEMM: their weights become row blocks of one tensor.

A decode step's GEMMs read each weight once for a few tokens, so each costs its bytes plus a fixed
time per kernel: Qwen2.5-VL-3B's k and v projections (1 MB each) took 5.5 us apiece, q's (8 MB)
6 us (H200, 2026-11-22). Stacked, q, k and v are one read of 10 MB. The stock modules keep
working unchanged, on views of the stacked weight (the same values, no second copy), until
`unstack` gives each its own tensor back, as the model was.
"""

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class StackedLinear(nn.Module):
    """`linears` (same input width; all with a bias or none) as one GEMM; `forward` returns each
    one's output, in order."""

    def __init__(self, linears: Sequence[nn.Linear]) -> None:
        super().__init__()
        has_bias = {linear.bias is not None for linear in linears}
        if len(has_bias) != 1:
            raise ValueError("stacked linear layers need a bias on all of them or on none")
        self.linears = list(linears)  # a plain list: the stock modules are not this module's children
        self.sizes = [linear.out_features for linear in linears]
        self.weight = nn.Parameter(torch.cat([linear.weight.detach() for linear in linears]), requires_grad=False)
        self.bias = None
        if has_bias == {True}:
            self.bias = nn.Parameter(torch.cat([linear.bias.detach() for linear in linears]), requires_grad=False)
        biases = self.bias.split(self.sizes) if self.bias is not None else [None] * len(self.sizes)
        for linear, weight, bias in zip(self.linears, self.weight.split(self.sizes), biases, strict=True):
            grad = linear.weight.requires_grad
            linear.weight = nn.Parameter(weight, requires_grad=grad)
            if bias is not None:
                linear.bias = nn.Parameter(bias, requires_grad=grad)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)

    def unstack(self) -> None:
        """Each stock module gets its own copy of its weight (and bias) back; this module is
        spent (its stacked tensors are freed with the last view)."""
        for linear in self.linears:
            linear.weight = nn.Parameter(linear.weight.detach().clone(), requires_grad=linear.weight.requires_grad)
            if linear.bias is not None:
                linear.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
        self.weight = self.bias = None
