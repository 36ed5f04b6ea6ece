import pytest
import torch
import torch.nn.functional as F
from test_aligned_mlp import interleaved_reference
from test_attention_gpu import relative_error

from encoder_graphs.presets import build_vision_tower
from encoder_graphs.rewrites import Rewrites
from encoder_graphs.rewrites.fused_mlp import fuse_gated_mlp, fuses_gated_mlp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="needs a Hopper GPU"
    ),
]


def poisoned_empty_cache() -> None:
    """Fill the allocator's free blocks with NaN: an output element the kernel fails to write
    comes out NaN."""
    torch.cuda.empty_cache()
    torch.full((1 << 28,), float("nan"), device="cuda", dtype=torch.bfloat16)  # freed at once, cached


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("rows", "width", "inputs"), [
    (1, 3424, 1280), (63, 3424, 1280), (1000, 3424, 1280), (1025, 3424, 1280), (4099, 3424, 1280),
    (11520, 3424, 1280), (300, 40, 64), (2048, 200, 72),
])  # fmt: skip
def test_swiglu_linear_is_the_stock_mlps_bf16_but_for_rare_roundings(rows, width, inputs, bias):
    """Rounded at the stock MLP's points: nearly every element equals the stock bf16 one (the
    GEMMs accumulate in another order), and the error against fp32 is stock's own."""
    from encoder_graphs.kernels.swiglu import swiglu_linear

    generator = torch.Generator(device="cuda").manual_seed(rows + width)

    def randn(*shape, scale=1.0):
        return (torch.randn(shape, generator=generator, device="cuda") * scale).to(torch.bfloat16)

    x, gate, up = randn(rows, inputs), randn(width, inputs, scale=inputs**-0.5), randn(width, inputs, scale=inputs**-0.5)
    b_gate, b_up = (randn(width, scale=0.1), randn(width, scale=0.1)) if bias else (None, None)
    weight = torch.stack([gate, up], 1).flatten(0, 1)
    b = torch.stack([b_gate, b_up], 1).flatten(0, 1) if bias else None
    exact = interleaved_reference(x.float(), weight.float(), b.float() if bias else None)
    stock = F.silu(F.linear(x, gate, b_gate)) * F.linear(x, up, b_up)  # what the stock MLP rounds
    poisoned_empty_cache()
    with torch.inference_mode():
        out = swiglu_linear(x, weight, b)
    assert out.shape == (rows, width) and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    assert (out == stock).float().mean() >= 0.98
    assert relative_error(out, exact) <= 1.05 * relative_error(stock, exact) + 1e-5


def test_swiglu_linear_in_compiled_code_and_graphs_without_a_break():
    from encoder_graphs.kernels.swiglu import swiglu_linear

    weight = torch.randn(2 * 3424, 1280, device="cuda", dtype=torch.bfloat16) / 36
    bias = torch.randn(2 * 3424, device="cuda", dtype=torch.bfloat16) / 10

    @torch.compile(dynamic=True, fullgraph=True)  # fullgraph: a graph break would raise
    def mlp(x):
        return swiglu_linear(x * 2, weight, bias)  # x * 2: exact, as in eager

    with torch.inference_mode():
        for rows in (300, 4096, 2000):
            x = torch.randn(rows, 1280, device="cuda", dtype=torch.bfloat16)
            want = swiglu_linear(x * 2, weight, bias)
            torch.testing.assert_close(mlp(x), want, rtol=0, atol=0)
        static = torch.randn(4096, 1280, device="cuda", dtype=torch.bfloat16)
        mlp(static)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = mlp(static)
        static.copy_(torch.randn_like(static))
        graph.replay()
        torch.testing.assert_close(out, swiglu_linear(static * 2, weight, bias), rtol=0, atol=0)


def test_fused_stock_mlp_matches_and_refuses_gradients():
    from encoder_graphs.kernels.swiglu import swiglu_linear

    mlp = build_vision_tower("tiny-qwen2.5-vl", device="cuda").blocks[0].mlp  # 44 wide: a multiple of 4 only
    x = torch.randn(999, mlp.gate_proj.in_features, device="cuda")
    with torch.inference_mode():
        exact = mlp(x)
    mlp.bfloat16()
    with torch.inference_mode():
        stock = mlp(x.bfloat16())
    assert fuses_gated_mlp(mlp)
    rewrites = Rewrites()
    fuse_gated_mlp(mlp, swiglu_linear, rewrites)
    with torch.inference_mode():
        fused = mlp(x.bfloat16())
    assert relative_error(fused, exact) <= relative_error(stock, exact) * 1.1
    with pytest.raises(RuntimeError, match="no backward"):
        mlp(x.bfloat16())  # grad mode on, weights that want gradients
    rewrites.undo()
