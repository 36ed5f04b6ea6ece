"""Qwen2.5-VL's vision blocks chained: each block's last residual add and the next block's first
norm in one kernel (`kernels/add_norm.py`), the pair handed on as one tensor of both halves.

Blocks are compiled one by one, so inductor cannot fuse across them; the stock tower hands each
block's output to the next one alone, so that output carries the sum and its norm side by side.
The chained forwards are on only for the adapter's own calls of the tower (`chained`): a stock
call that records per-layer outputs must see each block's output as the stock one.
"""

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from encoder_graphs.kernels import HALF_DTYPES, triton_runs
from encoder_graphs.rewrites import Rewrites
from encoder_graphs.seam.vision import AddNorm, chained_block_forward, is_qwen2_5_vision_block

Forward = Callable[..., torch.Tensor]


def chains_blocks(blocks: Sequence[nn.Module], dtype: torch.dtype) -> bool:
    """Whether `chained_forwards` takes `blocks`: two or more stock Qwen2.5-VL vision blocks
    running in half-precision `dtype`, their norm weights of it too (the kernel rounds as those
    norms do), on one GPU where Triton runs."""
    if len(blocks) < 2 or not all(is_qwen2_5_vision_block(block) for block in blocks):
        return False
    weights = [norm.weight for block in blocks for norm in (block.norm1, block.norm2)]
    device = weights[0].device
    same = all((weight.device, weight.dtype) == (device, dtype) for weight in weights)
    return same and dtype in HALF_DTYPES and triton_runs(device)


def chained_forwards(blocks: Sequence[nn.Module], add_norm: AddNorm) -> list[Forward]:
    """A forward for each of `blocks` (`chains_blocks`, in the tower's order) that ends with the
    next block's first norm through `add_norm` (`kernels/add_norm.py`'s `add_rms_norm`)."""
    return [
        chained_block_forward(
            block, add_norm, blocks[index + 1].norm1 if index + 1 < len(blocks) else None, takes_pair=index > 0
        )
        for index, block in enumerate(blocks)
    ]


@contextmanager
def chained(blocks: Sequence[nn.Module], forwards: Sequence[Forward]) -> Iterator[None]:
    """`blocks` run `forwards` (`chained_forwards`) inside the context, their own after it. The
    same function objects each time: compiled blocks keep one set of guards."""
    rewrites = Rewrites()
    try:
        for block, forward in zip(blocks, forwards, strict=True):
            rewrites.patch(block, "forward", forward)
        yield
    finally:
        rewrites.undo()
