import importlib.util
import random

import pytest
import torch

from encoder_graphs.attention import get_attention_backend, sdpa_varlen_attention


def reference_attention(q, k, v, cu_seqlens, scale=None) -> torch.Tensor:
    """Plain softmax attention in float64, one segment at a time; uncovered rows stay NaN."""
    q, k, v = q.double(), k.double(), v.double()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.full_like(q, float("nan"))
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        scores = torch.einsum("qhd,khd->hqk", q[start:end], k[start:end]) * scale
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[start:end])
    return out


def random_layout(rng: random.Random, capacity: int, slots: int) -> list[int]:
    """Offsets with a zero-length and a 1-token segment among random ones, the padded tail as
    one dummy segment, and unused slots repeating the capacity (never zeros)."""
    lengths = [0, 1]
    while len(lengths) < slots - 2:
        length = rng.randint(0, capacity // 3)
        if sum(lengths) + length >= capacity:
            break
        lengths.append(length)
    rng.shuffle(lengths)
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    offsets.append(capacity)
    return offsets + [capacity] * (slots + 1 - len(offsets))


def random_qkv(tokens: int, heads: int, head_dim: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(tokens, heads, head_dim, generator=generator) for _ in range(3)]


@pytest.mark.parametrize("seed", range(6))
def test_sdpa_matches_per_segment_reference(seed):
    rng = random.Random(seed)
    capacity, slots = rng.randint(24, 96), rng.randint(4, 10)
    offsets = random_layout(rng, capacity, slots)
    cu_seqlens = torch.tensor(offsets, dtype=torch.int32)
    q, k, v = random_qkv(capacity, 3, 16, seed)
    max_seqlen = max(b - a for a, b in zip(offsets[:-1], offsets[1:]))

    out = sdpa_varlen_attention(q, k, v, cu_seqlens, max_seqlen)

    assert out.shape == q.shape
    torch.testing.assert_close(out, reference_attention(q, k, v, cu_seqlens).float())


def test_sdpa_honours_scale():
    cu_seqlens = torch.tensor([0, 5, 5, 12, 16], dtype=torch.int32)
    q, k, v = random_qkv(16, 2, 8, seed=7)
    out = sdpa_varlen_attention(q, k, v, cu_seqlens, 7, scale=0.05)
    torch.testing.assert_close(out, reference_attention(q, k, v, cu_seqlens, 0.05).float())
    assert not torch.allclose(out, sdpa_varlen_attention(q, k, v, cu_seqlens, 7))


def test_sdpa_rows_outside_all_segments_stay_finite():
    cu_seqlens = torch.tensor([0, 3, 3, 10], dtype=torch.int32)  # rows 10..15 uncovered
    q, k, v = random_qkv(16, 2, 8, seed=3)
    out = sdpa_varlen_attention(q, k, v, cu_seqlens, 7)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:10], reference_attention(q, k, v, cu_seqlens)[:10].float())


def test_segments_do_not_see_each_other():
    cu_seqlens = torch.tensor([0, 4, 9], dtype=torch.int32)
    q, k, v = random_qkv(9, 2, 8, seed=1)
    before = sdpa_varlen_attention(q, k, v, cu_seqlens, 5)
    k2, v2 = k.clone(), v.clone()
    k2[4:], v2[4:] = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    after = sdpa_varlen_attention(q, k2, v2, cu_seqlens, 5)
    torch.testing.assert_close(after[:4], before[:4])
    assert not torch.allclose(after[4:], before[4:])


def test_unknown_backend_lists_the_choices():
    with pytest.raises(ValueError, match="unknown attention backend 'xformers'") as error:
        get_attention_backend("xformers")
    for name in ("flash_attn", "flashinfer", "sdpa", "torch"):
        assert name in str(error.value)


@pytest.mark.parametrize(
    ("name", "extra"),
    [("flash_attn", "encoder-graphs[flash-attn]"), ("flashinfer", "encoder-graphs[flashinfer]")],
)
def test_missing_package_names_the_pip_extra(name, extra):
    if importlib.util.find_spec(name) is not None:
        pytest.skip(f"{name} is installed")
    with pytest.raises(ImportError, match=extra.replace("[", r"\[").replace("]", r"\]")):
        get_attention_backend(name)


def test_builtin_backends_need_no_extra_package():
    assert get_attention_backend("sdpa") is sdpa_varlen_attention
    assert callable(get_attention_backend("torch"))


def test_flashinfer_metadata_pads_with_the_last_offset():
    from encoder_graphs.attention.flashinfer import ragged_metadata

    cu_seqlens = torch.tensor([0, 3, 3, 4, 10], dtype=torch.int32)  # 4 segments -> 8 slots
    seq_lens, offsets, bound = ragged_metadata(cu_seqlens, 6, row_elements=5)

    assert seq_lens.shape == (8, 1, 1, 1) and offsets.shape == (9, 1, 1, 1)
    assert seq_lens.dtype == offsets.dtype == torch.int32
    assert seq_lens.flatten().tolist() == [3, 0, 1, 6, 0, 0, 0, 0]
    assert offsets.flatten().tolist() == [0, 15, 15, 20, 50, 50, 50, 50, 50]
    assert bound == 16
    assert ragged_metadata(cu_seqlens, 300, row_elements=5)[2] == 512
    assert ragged_metadata(torch.arange(10, dtype=torch.int32), 1, 1)[0].shape[0] == 16


def test_refuse_gradients_only_where_autograd_wants_a_backward():
    from encoder_graphs.kernels import refuse_gradients

    weight = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(RuntimeError, match="the kernel has no backward"):
        refuse_gradients("the kernel", (torch.zeros(3), weight))
    refuse_gradients("the kernel", (torch.zeros(3),))  # nothing wants a gradient
    with torch.no_grad():
        refuse_gradients("the kernel", (weight,))
