"""Linear layers over one input run as one GEMM: their weights become row blocks of one tensor.

A decode step's GEMMs read each weight once for a few tokens, so each costs its bytes plus a fixed
time per kernel: Qwen2.5-VL-3B's k and v projections (1 MB each) took nearly as long apiece as
q's (8 MB; benchmarks/HISTORY.md). Stacked, q, k and v are one read of 10 MB. The stock modules keep
working unchanged, on views of the stacked weight (the same values, no second copy), until the
`Rewrites` undo gives each its own tensor back, as the model was. Layers that are not plain dense
`nn.Linear`s (LoRA, quantized, offloaded weights) are left alone and run one by one.
"""

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from encoder_graphs.rewrites import Rewrites, made_like


def plain_linears(linears: Sequence[nn.Module]) -> bool:
    """Plain `nn.Linear`s with dense weights in memory, all with a bias or none."""
    return (
        all(type(linear) is nn.Linear and type(linear.weight) is nn.Parameter for linear in linears)
        and not any(linear.weight.is_meta for linear in linears)
        and len({linear.bias is not None for linear in linears}) == 1
    )


class StackedLinear(nn.Module):
    """`linears` (same input width) as one GEMM where they can be stacked, until `rewrites` is
    undone; `forward` returns each one's output, in order."""

    def __init__(self, linears: Sequence[nn.Module], rewrites: Rewrites) -> None:
        super().__init__()
        self.linears = list(linears)  # a plain list: the stock modules are not this module's children
        self.sizes = [linear.out_features for linear in linears]
        self.weight = self.bias = None
        if not plain_linears(linears):
            return
        with made_like(linears[0].weight):
            self.weight = nn.Parameter(torch.cat([linear.weight for linear in linears]), requires_grad=False)
            if linears[0].bias is not None:
                self.bias = nn.Parameter(torch.cat([linear.bias for linear in linears]), requires_grad=False)
        rewrites.push(self._spend)  # undone after the views below: the stock modules own copies again
        biases = self.bias.split(self.sizes) if self.bias is not None else [None] * len(self.sizes)
        for linear, weight, bias in zip(self.linears, self.weight.split(self.sizes), biases, strict=True):
            rewrites.replace_data(linear, "weight", weight.detach())
            if bias is not None:
                rewrites.replace_data(linear, "bias", bias.detach())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.weight is None:
            return tuple(linear(x) for linear in self.linears)
        return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)

    def _spend(self) -> None:
        """Run the stock modules one by one (the stacked tensors are freed with the last view)."""
        self.weight = self.bias = None
