"""The residual add and RMSNorm kernel (`encoder_graphs/kernels/add_norm.py`) against plain torch, in
compiled code and graphs, and the chained blocks of a real Qwen2.5-VL tower module on a GPU."""

import pytest
import torch
from test_attention_gpu import relative_error
from test_chained_blocks import add_norm_reference
from test_swiglu_gpu import poisoned_empty_cache

from encoder_graphs.models.qwen.chained_blocks import chained, chained_forwards, chains_blocks
from encoder_graphs.presets import build_vision_tower

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("pair_input", [False, True])
@pytest.mark.parametrize(("rows", "dim"), [(1, 1280), (7, 1280), (4099, 1280), (11584, 1280), (333, 96)])
def test_add_rms_norm_matches_the_stock_ops(rows, dim, pair_input):
    """The sum bit for bit; its norm within two bf16 roundings (the kernel's fp32 sum of squares
    adds in another order: a few elements in millions round the other way); every output written (the allocator poisoned with NaN). `pair_input`:
    x is the left half of a previous pair, a strided view, as the chained blocks hand it on."""
    from encoder_graphs.kernels.add_norm import add_rms_norm

    generator = torch.Generator(device="cuda").manual_seed(rows + dim)
    x = torch.randn(rows, 2 * dim if pair_input else dim, generator=generator, device="cuda").to(torch.bfloat16)[:, :dim]
    update = torch.randn(rows, dim, generator=generator, device="cuda").to(torch.bfloat16)
    weight = (1 + torch.randn(dim, generator=generator, device="cuda") / 4).to(torch.bfloat16)
    want = add_norm_reference(x, update, weight, 1e-6)
    poisoned_empty_cache()
    with torch.inference_mode():
        out = add_rms_norm(x, update, weight, 1e-6)
    assert out.shape == (rows, 2 * dim) and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert torch.equal(out[:, :dim], want[:, :dim])
    torch.testing.assert_close(out[:, dim:], want[:, dim:], rtol=2**-6, atol=1e-5)


@pytest.mark.parametrize(("rows", "dim"), [(1, 2048), (77, 2048), (5003, 2048), (333, 96), (4099, 128)])
def test_rms_norm_equals_the_stock_norm_but_for_rare_roundings(rows, dim):
    """Against transformers' RMSNorm module on the same bf16 input: most elements bit for bit (the
    kernel rounds where the module rounds; only its fp32 sum of squares adds in another order),
    all within two bf16 roundings; every output written (the allocator poisoned with NaN); rows
    given as a strided view are read in place."""
    from encoder_graphs.kernels.add_norm import rms_norm

    generator = torch.Generator(device="cuda").manual_seed(rows * dim)
    x = torch.randn(rows, 3 * dim, generator=generator, device="cuda").to(torch.bfloat16)[:, dim : 2 * dim]
    weight = (1 + torch.randn(dim, generator=generator, device="cuda") / 4).to(torch.bfloat16)
    want = add_norm_reference(x, torch.zeros_like(x), weight, 1e-6)[:, dim:]
    poisoned_empty_cache()
    with torch.inference_mode():
        out = rms_norm(x, weight, 1e-6)
    assert out.shape == (rows, dim) and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert torch.isfinite(out).all()
    assert (out == want).float().mean() >= 0.99
    torch.testing.assert_close(out, want, rtol=2**-6, atol=1e-5)
    with pytest.raises(ValueError, match="contiguous weight"):
        rms_norm(x, weight.float(), 1e-6)


def test_add_rms_norm_in_compiled_code_and_graphs_without_a_break():
    from encoder_graphs.kernels.add_norm import add_rms_norm

    weight = torch.randn(1280, device="cuda", dtype=torch.bfloat16)

    @torch.compile(dynamic=True, fullgraph=True)  # fullgraph: a graph break would raise
    def chained(x, update):
        return add_rms_norm(x * 2, update, weight, 1e-6)  # x * 2: exact, as in eager

    with torch.inference_mode():
        for rows in (300, 4096, 2000):
            x, update = torch.randn(2, rows, 1280, device="cuda", dtype=torch.bfloat16)
            torch.testing.assert_close(chained(x, update), add_rms_norm(x * 2, update, weight, 1e-6), rtol=0, atol=0)
        static = torch.randn(2, 4096, 1280, device="cuda", dtype=torch.bfloat16)
        chained(*static)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chained(*static)
        static.copy_(torch.randn_like(static))
        graph.replay()
        torch.testing.assert_close(out, add_rms_norm(static[0] * 2, static[1], weight, 1e-6), rtol=0, atol=0)


def test_chained_stock_blocks_match_and_refuse_gradients():
    """Three real-size Qwen2.5-VL-7B blocks (window attention through sdpa; each norm weight its
    own), chained through the kernel, against the same blocks stock: nearer fp32 than the stock
    bf16 blocks are, or about as near; and refusing gradients."""
    from encoder_graphs.kernels.add_norm import add_rms_norm

    tower = build_vision_tower("qwen2.5-vl-7b", device="cuda")
    blocks = list(tower.blocks[:3])
    del tower
    generator = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for norm in (module for block in blocks for module in (block.norm1, block.norm2)):
            norm.weight.copy_(1 + torch.randn(norm.weight.shape, generator=generator, device="cuda") / 2)
    rows, dim = 1000, blocks[0].norm1.weight.shape[0]
    head_dim = blocks[0].attn.head_dim
    angles = torch.rand(rows, head_dim // 2, device="cuda") * 10
    angles = torch.cat([angles, angles], -1)
    args = {"cu_seqlens": torch.tensor([0, 64, 400, rows], dtype=torch.int32, device="cuda"),
            "position_embeddings": (angles.cos(), angles.sin())}
    x = torch.randn(rows, dim, device="cuda")

    def run(blocks, inputs):
        for block in blocks:
            inputs = block(inputs, **args)
        return inputs

    with torch.inference_mode():
        exact = run(blocks, x)
    for block in blocks:
        block.bfloat16()
    with torch.inference_mode():
        stock = run(blocks, x.bfloat16())
    assert chains_blocks(blocks, torch.bfloat16)
    with chained(blocks, chained_forwards(blocks, add_rms_norm)):
        with torch.inference_mode():
            got = run(blocks, x.bfloat16())
        with pytest.raises(RuntimeError, match="no backward"):
            run(blocks, x.bfloat16())  # ordinary weights, gradients wanted
    assert got.shape == (rows, dim)
    assert relative_error(got, exact) <= relative_error(stock, exact) * 1.1
