import importlib.util
import random

import pytest
import torch
from test_attention import random_layout

from encoder_graphs.models.attention import get_attention_backend, sdpa_varlen_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CAPACITY, SLOTS, HEADS = 1024, 12, 16  # heads as in Qwen2.5-VL's vision tower


def backend_or_skip(name: str):
    if name != "torch" and importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed")
    return get_attention_backend(name)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def layout(seed: int) -> torch.Tensor:
    offsets = random_layout(random.Random(seed), CAPACITY, SLOTS)
    return torch.tensor(offsets, dtype=torch.int32, device="cuda")


def random_qkv(head_dim: int, seed: int):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    shape = (CAPACITY, HEADS, head_dim)
    return [
        torch.randn(shape, generator=generator, device="cuda", dtype=torch.bfloat16)
        for _ in range(3)
    ]


@pytest.mark.parametrize("head_dim", [80, 64])
@pytest.mark.parametrize("name", ["torch", "flash_attn", "flashinfer"])
def test_bf16_matches_fp32_sdpa(name, head_dim):
    attention = backend_or_skip(name)
    for seed in range(3):
        cu_seqlens = layout(seed)
        q, k, v = random_qkv(head_dim, seed)
        ref = sdpa_varlen_attention(q.float(), k.float(), v.float(), cu_seqlens, CAPACITY)
        out = attention(q, k, v, cu_seqlens, CAPACITY)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert relative_error(out, ref) < 1e-2, seed


@pytest.mark.parametrize("head_dim", [80, 64])
@pytest.mark.parametrize("name", ["torch", "flash_attn", "flashinfer"])
def test_graph_replay_follows_new_boundaries(name, head_dim):
    attention = backend_or_skip(name)
    q, k, v = random_qkv(head_dim, seed=0)
    cu_seqlens = layout(seed=0)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: workspaces, cuDNN graphs, kernel selection
        attention(q, k, v, cu_seqlens, CAPACITY)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention(q, k, v, cu_seqlens, CAPACITY)

    new_cu_seqlens = layout(seed=1)
    assert not torch.equal(new_cu_seqlens, cu_seqlens)
    new_q, new_k, new_v = random_qkv(head_dim, seed=1)
    for buffer, value in ((q, new_q), (k, new_k), (v, new_v), (cu_seqlens, new_cu_seqlens)):
        buffer.copy_(value)
    graph.replay()
    torch.cuda.synchronize()

    eager = attention(q, k, v, cu_seqlens, CAPACITY)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    ref = sdpa_varlen_attention(q.float(), k.float(), v.float(), cu_seqlens, CAPACITY)
    assert relative_error(out, ref) < 1e-2


def test_flashinfer_zeroes_uncovered_rows_and_honours_scale():
    attention = backend_or_skip("flashinfer")
    q, k, v = random_qkv(80, seed=2)
    cu_seqlens = torch.tensor([0, 1, 1, 300, 700], dtype=torch.int32, device="cuda")
    for scale in (0.05, 80**-0.5, 0.2):  # flashinfer's cuDNN graph cache ignores the scale
        ref = sdpa_varlen_attention(q.float(), k.float(), v.float(), cu_seqlens, 400, scale)
        out = attention(q, k, v, cu_seqlens, 400, scale)
        assert relative_error(out[:700], ref[:700]) < 1e-2, scale
        assert torch.equal(out[700:], torch.zeros_like(out[700:]))
