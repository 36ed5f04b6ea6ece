"""Pad a gated MLP's hidden width to a multiple of 8 with zero weights, undone on a `Rewrites`.

Qwen2.5-VL's vision MLP is 3420 wide: not a multiple of 8, so cuBLAS falls back to slow
`align2` kernels for its three GEMMs (much of the tower's time; benchmarks/HISTORY.md). Zero rows
in gate/up and zero columns in down add exactly zero (act(0) * 0 = 0), so padding is exact.
"""

import torch
from torch import nn

from encoder_graphs.rewrites import Rewrites, made_like

ALIGNMENT = 8


def _pad(linear: nn.Linear, name: str, dim: int, size: int, rewrites: Rewrites) -> None:
    """`linear`'s parameter `name` grown with zeros to `size` along `dim`; its stock value is the
    first rows (or columns) again."""
    param = getattr(linear, name)
    width = param.shape[dim]
    shape = list(param.shape)
    shape[dim] = size - width
    with made_like(param):
        padded = torch.cat([param.detach(), param.new_zeros(shape)], dim=dim)
    rewrites.replace_data(linear, name, padded, stock=lambda data: data.narrow(dim, 0, width))


def _pad_gated_mlp(mlp: nn.Module, width: int, rewrites: Rewrites) -> None:
    """`gate_proj`/`up_proj` outputs and `down_proj` inputs grown to `width`."""
    for linear in (mlp.gate_proj, mlp.up_proj):
        _pad(linear, "weight", 0, width, rewrites)
        if linear.bias is not None:
            _pad(linear, "bias", 0, width, rewrites)
        rewrites.patch(linear, "out_features", width)
    _pad(mlp.down_proj, "weight", 1, width, rewrites)
    rewrites.patch(mlp.down_proj, "in_features", width)


def align_gated_mlps(mlps: list[nn.Module], rewrites: Rewrites) -> None:
    """Pad every MLP to the next multiple of ALIGNMENT (nothing where already aligned)."""
    width = mlps[0].down_proj.in_features
    aligned = -(-width // ALIGNMENT) * ALIGNMENT
    if aligned != width:
        for mlp in mlps:
            _pad_gated_mlp(mlp, aligned, rewrites)
