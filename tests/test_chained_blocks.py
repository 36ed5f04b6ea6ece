"""Qwen2.5-VL's vision blocks chained (`models/qwen/chained_blocks.py`) on the CPU, with a plain-torch
add and the stock norm module in place of the Triton kernel: the tower gives its stock output, each
block but the last hands on the sum and its norm side by side, only inside the adapter's own calls;
a stock call that records per-layer outputs sees the stock blocks. (On a GPU,
tests/test_add_norm_gpu.py checks the kernel, tests/test_qwen_gpu.py the chained tower.)"""

import torch
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRMSNorm

from encoder_graphs.models import Qwen2_5_VLAdapter, VisionBatch
from encoder_graphs.models.qwen.chained_blocks import chained, chained_forwards, chains_blocks
from encoder_graphs.presets import build_vision_tower
from encoder_graphs.rewrites import Rewrites
from encoder_graphs.seam.vision import is_qwen2_5_vision_block


def add_norm_reference(x: torch.Tensor, update: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """What `kernels/add_norm.py`'s `add_rms_norm` computes, by the stock modules: the sum, and the stock
    RMSNorm of it with `weight`, side by side."""
    norm = Qwen2_5_VLRMSNorm(weight.shape[0], eps=eps).to(weight.device, weight.dtype)
    norm.weight.data.copy_(weight)
    h = x + update
    return torch.cat([h, norm(h)], dim=-1)


def tower_with_distinct_norms(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The tiny tower, every norm weight its own (random init leaves them all ones, where a wrong
    norm would go unseen)."""
    tower = build_vision_tower("tiny-qwen2.5-vl", dtype=dtype)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for block in tower.blocks:
            for norm in (block.norm1, block.norm2):
                norm.weight.copy_(1 + torch.randn(norm.weight.shape, generator=generator) / 2)
    return tower


def test_chained_blocks_hand_on_the_pair_and_give_the_stock_output():
    tower = tower_with_distinct_norms()
    blocks = list(tower.blocks)
    assert len(blocks) >= 3 and all(is_qwen2_5_vision_block(block) for block in blocks)
    assert not chains_blocks(blocks, torch.float32), "the kernel needs half precision on a GPU"
    dim = tower.config.hidden_size
    rows, head_dim = 40, dim // tower.config.num_heads
    block_args = {"cu_seqlens": torch.tensor([0, 16, rows], dtype=torch.int32),
                  "position_embeddings": (torch.ones(rows, head_dim), torch.zeros(rows, head_dim))}
    forwards = chained_forwards(blocks, add_norm_reference)
    with torch.inference_mode():
        x = torch.randn(rows, dim)
        first = blocks[0](x, **block_args)
        second = blocks[1](first, **block_args)
        with chained(blocks, forwards):
            assert all("forward" in block.__dict__ for block in blocks)
            pair = blocks[0](x, **block_args)  # the sum and the next block's norm1 of it
            torch.testing.assert_close(pair, torch.cat([first, blocks[1].norm1(first)], -1), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(blocks[1](pair, **block_args)[:, :dim], second, rtol=1e-6, atol=1e-6)
            assert blocks[-1](pair, **block_args).shape == (rows, dim)  # the last one hands on the sum
    assert not any("forward" in block.__dict__ for block in blocks)


def test_adapter_chains_only_its_own_calls():
    """The adapter's calls run the chained blocks and give the stock output; a stock call with
    per-layer outputs, as `get_image_features(output_hidden_states=True)` falls back to, records
    the stock blocks' outputs."""
    tower = tower_with_distinct_norms()
    adapter = Qwen2_5_VLAdapter(tower)
    rewrites = Rewrites()
    adapter.align_weights(rewrites)
    assert adapter._chained_forwards is None, "no GPU here"
    # As align_weights does on a GPU, with the plain-torch kernel.
    rewrites.patch(adapter, "_chained_forwards", chained_forwards(list(tower.blocks), add_norm_reference))
    pixels = torch.randn(96 + 64, 3 * 2 * 14 * 14)
    grid = torch.tensor([[1, 8, 12], [1, 8, 8]])
    widths = []
    hooks = [block.register_forward_hook(lambda module, args, out: widths.append(out.shape[-1])) for block in tower.blocks]
    with torch.inference_mode():
        chained_out = adapter.eager_forward(VisionBatch(pixel_values=pixels, image_grid_thw=grid), "default")["embeds"]
        dim = tower.config.hidden_size
        assert widths == [2 * dim] * (len(tower.blocks) - 1) + [dim]
        stock = tower(pixels, grid_thw=grid, output_hidden_states=True)
    for hook in hooks:
        hook.remove()
    assert not any("forward" in block.__dict__ for block in tower.blocks)
    assert [state.shape for state in stock.hidden_states] == [(160, dim)] * (len(tower.blocks) + 1)
    torch.testing.assert_close(chained_out, stock.pooler_output, rtol=1e-5, atol=1e-5)
    rewrites.undo()
    assert adapter._chained_forwards is None


def test_blocks_are_chained_only_where_triton_runs():
    tower = build_vision_tower("tiny-qwen2.5-vl", dtype=torch.bfloat16)
    assert not chains_blocks(list(tower.blocks), torch.bfloat16), "no GPU here"
    adapter = Qwen2_5_VLAdapter(tower)
    rewrites = Rewrites()
    adapter.align_weights(rewrites)
    assert adapter._chained_forwards is None
    rewrites.undo()
