"""Qwen2.5-VL's vision blocks chained: each block's last residual add and the next block's first
norm in one kernel (`add_norm_kernel`), the pair handed on as one tensor of both halves.

Blocks are compiled one by one, so inductor cannot fuse across them; the stock tower hands each
block's output to the next one alone, so that output carries the sum and its norm side by side.
"""

from collections.abc import Callable, Sequence

import torch
from torch import nn

from encoder_graphs.models.attention import triton_runs
from encoder_graphs.models.patching import patch_attribute
from encoder_graphs.models.transformers_seam import AddNorm, chained_block_forward, is_qwen2_5_vision_block


def chains_blocks(blocks: Sequence[nn.Module], dtype: torch.dtype) -> bool:
    """Whether `chain_blocks` takes `blocks`: two or more stock Qwen2.5-VL vision blocks running
    in half-precision `dtype`, their norm weights of it too (the kernel rounds as those norms do),
    on one GPU where Triton runs."""
    if len(blocks) < 2 or not all(is_qwen2_5_vision_block(block) for block in blocks):
        return False
    weights = [norm.weight for block in blocks for norm in (block.norm1, block.norm2)]
    device = weights[0].device
    same = all((weight.device, weight.dtype) == (device, dtype) for weight in weights)
    return same and dtype in (torch.float16, torch.bfloat16) and triton_runs(device)


def chain_blocks(blocks: Sequence[nn.Module], add_norm: AddNorm) -> list[Callable[[], None]]:
    """Each of `blocks` (`chains_blocks`, in the tower's order) ends with the next one's first
    norm through `add_norm` (`add_norm_kernel.add_rms_norm`); returns the undos."""
    undos = []
    for index, block in enumerate(blocks):
        following = blocks[index + 1].norm1 if index + 1 < len(blocks) else None
        forward = chained_block_forward(block, add_norm, following, takes_pair=index > 0)
        undos.append(patch_attribute(block, "forward", forward))
    return undos
