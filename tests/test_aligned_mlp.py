import torch

from encoder_graphs import enable_cuda_graphs
from encoder_graphs.models import Qwen2_5_VLAdapter, VisionBatch
from encoder_graphs.presets import build_model, build_vision_tower, get_config
from encoder_graphs.rewrites import Rewrites
from encoder_graphs.rewrites.fused_mlp import fuse_gated_mlp, fuses_gated_mlp
from encoder_graphs.seam.modules import is_gated_silu_mlp


def test_aligned_mlp_is_exact_and_restorable():
    tower = build_vision_tower("tiny-qwen2.5-vl")
    width = tower.blocks[0].mlp.down_proj.in_features
    assert width % 8, "the tiny preset keeps Qwen2.5-VL's misaligned MLP width"
    assert get_config("qwen2.5-vl-7b").vision_config.intermediate_size == 3420
    before = {k: v.clone() for k, v in tower.state_dict().items()}
    adapter = Qwen2_5_VLAdapter(tower)
    grid = torch.tensor([[1, 8, 12]])
    batch = VisionBatch(pixel_values=torch.randn(96, 3 * 2 * 14 * 14), image_grid_thw=grid)
    rewrites = Rewrites()
    with torch.inference_mode():
        reference = adapter.eager_forward(batch, "default")["embeds"]
        adapter.align_weights(rewrites)
        mlp = tower.blocks[0].mlp
        assert mlp.gate_proj.weight.shape[0] % 8 == 0 == mlp.down_proj.weight.shape[1] % 8
        assert mlp.up_proj.out_features == mlp.down_proj.in_features == mlp.gate_proj.weight.shape[0]
        aligned = adapter.eager_forward(batch, "default")["embeds"]
        rewrites.undo()
    torch.testing.assert_close(aligned, reference, rtol=1e-5, atol=1e-6)
    after = tower.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert mlp.up_proj.out_features == mlp.down_proj.in_features == width


def test_enable_aligns_and_disable_restores_the_weights():
    model = build_model("tiny-qwen2.5-vl")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    handle = enable_cuda_graphs(model, decoder=False)
    assert model.model.visual.blocks[0].mlp.down_proj.in_features % 8 == 0
    handle.disable()
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_rotary_pairs_interleave_exactly_and_undo():
    """The fused window blocks' weight change: q and k dims reordered so rotary pair (i, i + d/2)
    sits at (2i, 2i + 1), v untouched; q.k is unchanged and the inverse order restores every bit."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision

    from encoder_graphs.models.qwen.qwen2_5_vl import interleave_pairs, permute_qk

    assert interleave_pairs(6).tolist() == [0, 3, 1, 4, 2, 5]
    attention = build_vision_tower("tiny-qwen2.5-vl").blocks[0].attn
    heads, dim = attention.num_heads, attention.head_dim
    hidden = torch.randn(10, heads * dim)
    angles = torch.rand(10, dim // 2) * 6
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    before = {k: v.clone() for k, v in attention.state_dict().items()}
    rewrites = Rewrites()
    with torch.inference_mode():
        q, k, v = attention.qkv(hidden).view(10, 3, heads, dim).unbind(1)
        order = interleave_pairs(dim)
        permute_qk(attention, order, rewrites)
        assert all(torch.equal(before[key], value) for key, value in attention.state_dict().items())  # stock
        q2, k2, v2 = attention.qkv(hidden).view(10, 3, heads, dim).unbind(1)
        torch.testing.assert_close(q2, q[..., order], rtol=0, atol=1e-6)
        torch.testing.assert_close(k2, k[..., order], rtol=0, atol=1e-6)
        torch.testing.assert_close(v2, v, rtol=0, atol=1e-6)
        q, k = apply_rotary_pos_emb_vision(q, k, cos, sin)  # rotated in the stock order...
        a, b = q2.unflatten(-1, (dim // 2, 2)).unbind(-1)  # ...and pair by pair, as the kernel does
        c, s = cos[:, None, : dim // 2], sin[:, None, : dim // 2]
        q2 = torch.stack([a * c - b * s, b * c + a * s], -1).flatten(-2)
        a, b = k2.unflatten(-1, (dim // 2, 2)).unbind(-1)
        k2 = torch.stack([a * c - b * s, b * c + a * s], -1).flatten(-2)
        torch.testing.assert_close(q2 @ k2.transpose(-1, -2), q @ k.transpose(-1, -2), rtol=1e-5, atol=1e-5)
        rewrites.undo()
    assert all(torch.equal(before[key], value) for key, value in attention.state_dict().items())


def test_window_blocks_are_fused_only_where_triton_runs():
    """On the CPU the window blocks keep their stock forward and weights."""
    tower = build_vision_tower("tiny-qwen2.5-vl")
    adapter = Qwen2_5_VLAdapter(tower)
    assert not adapter.fuses_windows
    rewrites = Rewrites()
    adapter.align_weights(rewrites)
    assert not any("forward" in block.attn.__dict__ or "forward" in block.mlp.__dict__ for block in tower.blocks)
    rewrites.undo()


def interleaved_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What `kernels/swiglu.py`'s `swiglu_linear` computes, in plain torch: gate rows even, up rows odd."""
    y = torch.nn.functional.linear(x, weight, bias)
    return torch.nn.functional.silu(y[..., 0::2]) * y[..., 1::2]


def test_fused_mlp_runs_on_interleaved_views_and_is_undone_bit_for_bit():
    tower = build_vision_tower("tiny-qwen2.5-vl")
    mlp = tower.blocks[0].mlp
    assert is_gated_silu_mlp(mlp)
    assert not fuses_gated_mlp(mlp), "the kernel needs a CUDA GPU"
    before = {k: v.clone() for k, v in mlp.state_dict().items()}
    x = torch.randn(7, mlp.gate_proj.in_features)
    params = list(mlp.parameters())
    rewrites = Rewrites()
    with torch.inference_mode():
        reference = mlp(x)
        fuse_gated_mlp(mlp, interleaved_reference, rewrites)
        assert "forward" in mlp.__dict__
        assert mlp.gate_proj.weight.stride(0) == 2 * mlp.gate_proj.in_features  # a view, no copy
        assert mlp.gate_proj.weight.untyped_storage().data_ptr() == mlp.up_proj.weight.untyped_storage().data_ptr()
        assert all(torch.equal(before[k], v) for k, v in mlp.state_dict().items())
        torch.testing.assert_close(mlp(x), reference, rtol=1e-5, atol=1e-6)
        rewrites.undo()
        torch.testing.assert_close(mlp(x), reference, rtol=0, atol=0)
    assert "forward" not in mlp.__dict__
    assert all(p is q for p, q in zip(mlp.parameters(), params, strict=True))  # the same objects
    assert all(p.is_contiguous() and not p.is_inference() for p in mlp.parameters())
    assert all(torch.equal(before[k], v) for k, v in mlp.state_dict().items())
