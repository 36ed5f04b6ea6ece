"""Qwen2.5-VL's vision blocks chained (`models/chained_blocks.py`) on the CPU, with a plain-torch
add and norm in place of the Triton kernel: the tower gives its stock output, each block but the
last hands on the sum and its norm side by side, and the undo gives the stock blocks back. (On a
GPU, tests/test_add_norm_gpu.py checks the kernel, tests/test_qwen_gpu.py the chained tower.)"""

import torch

from encoder_graphs.models import Qwen2_5_VLAdapter, VisionBatch
from encoder_graphs.models.chained_blocks import chain_blocks, chains_blocks
from encoder_graphs.models.presets import build_vision_tower
from encoder_graphs.models.transformers_seam import is_qwen2_5_vision_block


def add_norm_reference(x: torch.Tensor, update: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """What `add_norm_kernel.add_rms_norm` computes, in plain torch as the stock modules do: the
    sum, and RMSNorm of it times `weight`, side by side."""
    h = x + update
    hf = h.float()
    normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return torch.cat([h, weight * normed], dim=-1)


def test_chained_blocks_give_the_stock_output_and_are_undone():
    tower = build_vision_tower("tiny-qwen2.5-vl")
    blocks = list(tower.blocks)
    assert len(blocks) >= 3 and all(is_qwen2_5_vision_block(block) for block in blocks)
    assert not chains_blocks(blocks, torch.float32), "the kernel needs half precision on a GPU"
    adapter = Qwen2_5_VLAdapter(tower)
    batch = VisionBatch(pixel_values=torch.randn(96 + 64, 3 * 2 * 14 * 14), image_grid_thw=torch.tensor([[1, 8, 12], [1, 8, 8]]))
    dim = tower.config.hidden_size
    rows, head_dim = 40, dim // tower.config.num_heads
    block_args = {"cu_seqlens": torch.tensor([0, 16, rows], dtype=torch.int32),
                  "position_embeddings": (torch.ones(rows, head_dim), torch.zeros(rows, head_dim))}
    with torch.inference_mode():
        stock = adapter.eager_forward(batch, "default")["embeds"]
        x = torch.randn(rows, dim)
        first = blocks[0](x, **block_args)
        second = blocks[1](first, **block_args)
        undos = chain_blocks(blocks, add_norm_reference)
        assert all("forward" in block.__dict__ for block in blocks)
        pair = blocks[0](x, **block_args)  # the sum and the next block's norm1 of it
        torch.testing.assert_close(pair, torch.cat([first, blocks[1].norm1(first)], -1), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(blocks[1](pair, **block_args)[:, :dim], second, rtol=1e-6, atol=1e-6)
        chained = adapter.eager_forward(batch, "default")["embeds"]
        for undo in reversed(undos):
            undo()
        restored = adapter.eager_forward(batch, "default")["embeds"]
    assert chained.shape == stock.shape
    torch.testing.assert_close(chained, stock, rtol=1e-6, atol=1e-6)
    assert torch.equal(restored, stock)
    assert not any("forward" in block.__dict__ for block in blocks)


def test_blocks_are_chained_only_where_triton_runs():
    tower = build_vision_tower("tiny-qwen2.5-vl", dtype=torch.bfloat16)
    assert not chains_blocks(list(tower.blocks), torch.bfloat16), "no GPU here"
    adapter = Qwen2_5_VLAdapter(tower)
    adapter.align_weights()
    assert not any("forward" in block.__dict__ for block in tower.blocks)
    adapter.restore_weights()
