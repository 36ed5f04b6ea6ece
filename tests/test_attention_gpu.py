import importlib.util
import random

import pytest
import torch
from test_attention import random_layout

from encoder_graphs.attention import fits_decode_kernel, get_attention_backend, sdpa_varlen_attention
from encoder_graphs.models.qwen.qwen2_5_vl import interleave_pairs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CAPACITY, SLOTS, HEADS = 1024, 12, 16  # heads as in Qwen2.5-VL's vision tower
WINDOWS = 48  # segment slots of the window-kernel cases


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


def decode_case(batch, heads, kv_heads, dim, slots, dtype, seed):
    """A decode step's inputs: the cache's masked slots and the write slot poisoned with NaN."""
    generator = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=generator, device="cuda").to(dtype)

    store = randn(2, batch, kv_heads, slots + 16, dim)  # a prefix view, as the static cache gives
    keys, values = store[0, :, :, :slots], store[1, :, :, :slots]
    mask = torch.rand(batch, slots + 16, generator=generator, device="cuda")[:, :slots] > 0.4
    slot = torch.tensor([slots - 3], device="cuda")
    hidden = ~mask[:, None, :, None].expand_as(keys)
    keys[hidden], values[hidden] = float("nan"), float("nan")
    keys[:, :, slots - 3], values[:, :, slots - 3] = float("nan"), float("nan")
    return randn(batch, heads, 1, dim), randn(batch, kv_heads, 1, dim), randn(batch, kv_heads, 1, dim), keys, values, slot, mask


def reference_decode(query, key, value, keys, values, slot, mask, scale):
    """Write, then float64 attention over the allowed slots with the KV heads repeated."""
    keys, values, mask = keys.clone(), values.clone(), mask.clone()
    keys.index_copy_(2, slot, key)
    values.index_copy_(2, slot, value)
    mask.index_fill_(1, slot, True)
    group = query.shape[1] // keys.shape[1]
    k, v = (x.double().nan_to_num(0).repeat_interleave(group, 1) for x in (keys, values))
    scores = (query.double() @ k.transpose(-1, -2) * scale).masked_fill(~mask[:, None, None, :], float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2), keys, values


@pytest.mark.parametrize(
    "batch, heads, kv_heads, dim, slots",
    [(1, 16, 2, 128, 512), (8, 16, 2, 128, 512), (3, 28, 4, 128, 1000), (64, 16, 8, 128, 300), (2, 14, 2, 64, 70),
     (4, 8, 2, 256, 300)],  # Qwen3.5's full-attention heads: 256 wide (fp32 tiles halved)
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_kernel_writes_and_attends_like_sdpa(batch, heads, kv_heads, dim, slots, dtype):
    """Each head sizes of the served models (Qwen2.5-VL-3B, -7B, Qwen3-VL, Qwen3.5), odd slot counts, NaN in
    every slot the mask hides and in the write slot: the kernel matches float64 attention and
    writes exactly the new key and value."""
    from encoder_graphs.kernels import decode as decode_kernel

    case = decode_case(batch, heads, kv_heads, dim, slots, dtype, seed=batch + slots)
    query, keys, values = case[0], case[3], case[4]
    expected, expected_keys, expected_values = reference_decode(*case, scale=dim**-0.5)
    assert fits_decode_kernel(query, keys, values, case[6])
    out = decode_kernel.write_and_attend(*case, scale=dim**-0.5)
    assert out.shape == expected.shape and out.dtype == dtype
    atol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=atol)
    assert torch.equal(keys.nan_to_num(7), expected_keys.nan_to_num(7))
    assert torch.equal(values.nan_to_num(7), expected_values.nan_to_num(7))


def test_decode_kernel_replays_at_each_new_slot():
    """Captured once, replayed as the step advances the slot: each replay writes its own slot and
    attends over it."""
    from encoder_graphs.kernels import decode as decode_kernel

    query, key, value, keys, values, slot, mask = decode_case(4, 16, 2, 128, 256, torch.bfloat16, seed=5)
    keys.nan_to_num_(0), values.nan_to_num_(0)
    slot.fill_(100)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # Triton compiles on the first call
        decode_kernel.write_and_attend(query, key, value, keys, values, slot, mask, 0.1)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_kernel.write_and_attend(query, key, value, keys, values, slot, mask, 0.1)
    for step in range(3):
        before = (keys.clone(), values.clone(), mask.clone())
        key.normal_(), value.normal_(), query.normal_()
        slot.fill_(101 + step)
        expected, _, _ = reference_decode(query, key, value, *before[:2], slot, before[2], 0.1)
        graph.replay()
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-2)
        assert torch.equal(keys[:, :, 101 + step], key[:, :, 0])


def window_case(heads: int, head_dim: int, seed: int):
    """q, k, v as views of one qkv projection [CAPACITY, 3 * heads * head_dim], as Qwen2.5-VL's
    tower hands them over; cos and sin [CAPACITY, head_dim] of equal halves, as its rotary builds
    them; up to WINDOWS segments of 0-64 rows (a window of Qwen2.5-VL-7B holds 64), the offsets
    padded with the last one; the rows after the last segment (at least 40) poisoned with NaN."""
    rng = random.Random(seed)
    offsets = [0]
    while len(offsets) <= WINDOWS and offsets[-1] + 64 <= CAPACITY - 40:
        offsets.append(offsets[-1] + rng.choice([0, 1, 7, 33, 48, 63, 64, 64, 64]))
    offsets += [offsets[-1]] * (WINDOWS + 1 - len(offsets))
    generator = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(CAPACITY, 3 * heads * head_dim, generator=generator, device="cuda").to(torch.bfloat16)
    qkv[offsets[-1]:] = float("nan")
    angles = torch.rand(CAPACITY, head_dim // 2, generator=generator, device="cuda") * 30
    angles = torch.cat([angles, angles], dim=-1)
    q, k, v = qkv.unflatten(1, (3, heads, head_dim)).unbind(1)
    return q, k, v, angles.cos(), angles.sin(), torch.tensor(offsets, dtype=torch.int32, device="cuda")


def reference_window(q, k, v, cos, sin, cu_seqlens, scale):
    """transformers' rotary (fp32, rounded to bf16) in the dims' own order, then fp32 attention."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision

    covered = int(cu_seqlens[-1])
    q, k = apply_rotary_pos_emb_vision(q[:covered], k[:covered], cos[:covered], sin[:covered])
    return sdpa_varlen_attention(q.float(), k.float(), v[:covered].float(), cu_seqlens, 64, scale)


def window_kernel_call(q, k, v, cos, sin, cu_seqlens, scale):
    """The kernel on q and k with their dims interleaved by rotary pairs, as the fused blocks hold them."""
    from encoder_graphs.kernels.window import rotary_window_attention

    order = interleave_pairs(q.shape[-1]).cuda()
    return rotary_window_attention(q[..., order], k[..., order], v, cos, sin, cu_seqlens, 64, scale)


@pytest.mark.parametrize("sms", [None, 1])
@pytest.mark.parametrize("programs", [None, 3])
@pytest.mark.parametrize("heads, head_dim", [(16, 80), (2, 16), (12, 64), (4, 96), (6, 80), (5, 32)])
def test_rotary_window_kernel_matches_rotary_then_fp32_sdpa(heads, head_dim, programs, sms, monkeypatch):
    """Head dims of one power-of-two part and of two (80 = 64 + 16, 96 = 64 + 32); empty,
    one-row and full windows; the rows past the last window (NaN in q, k, v) come out zero.
    These few windows take a head a program; counted as for a GPU of one SM, they take as many
    as divide the heads, up to 4 (16 and 12 heads: 4, 6: 2, 5: 1). With 3 programs a head group,
    each loops over several windows, past empty ones, to the end."""
    from encoder_graphs.kernels import window as window_kernel

    if programs is not None:
        monkeypatch.setattr(window_kernel, "_programs_per_group", lambda device, groups: programs)
    if sms is not None:
        monkeypatch.setattr(window_kernel, "_sm_count", lambda device: sms)
        expected = {16: 4, 12: 4, 4: 4, 6: 2, 2: 2, 5: 1}[heads]
    else:
        expected = 1
    assert window_kernel._heads_per_program(heads, CAPACITY, torch.device("cuda")) == expected
    for seed in range(3):
        q, k, v, cos, sin, cu_seqlens = window_case(heads, head_dim, seed)
        covered = int(cu_seqlens[-1])
        out = window_kernel_call(q, k, v, cos, sin, cu_seqlens, 0.1)
        assert out.shape == q.shape and out.dtype == q.dtype
        ref = reference_window(q, k, v, cos, sin, cu_seqlens, 0.1)
        assert relative_error(out[:covered], ref) < 1e-2, seed
        assert torch.equal(out[covered:], torch.zeros_like(out[covered:]))


def test_rotary_window_kernel_replays_new_windows():
    """Captured once; a replay over new windows and new rows matches an eager call on them and
    zeroes the rows the new windows leave uncovered."""
    from encoder_graphs.kernels.window import rotary_window_attention

    q, k, v, cos, sin, cu_seqlens = window_case(16, 80, seed=0)
    order = interleave_pairs(80).cuda()
    q_pairs, k_pairs = q[..., order], k[..., order]
    args = (q_pairs, k_pairs, v, cos, sin, cu_seqlens, 64, 0.1)
    rotary_window_attention(*args)  # Triton compiles here
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rotary_window_attention(*args)
    new = window_case(16, 80, seed=1)
    assert not torch.equal(new[-1], cu_seqlens)
    for buffer, value in zip((q, k, v, cos, sin, cu_seqlens), new):
        buffer.copy_(value)
    q_pairs.copy_(q[..., order]), k_pairs.copy_(k[..., order])
    graph.replay()
    torch.testing.assert_close(out, rotary_window_attention(*args), rtol=0, atol=0)
    covered = int(cu_seqlens[-1])
    assert relative_error(out[:covered], reference_window(q, k, v, cos, sin, cu_seqlens, 0.1)) < 1e-2
    assert torch.equal(out[covered:], torch.zeros_like(out[covered:]))


def test_fused_window_forward_matches_stock_attention():
    """A real-size Qwen2.5-VL window attention module, its qkv reordered and the fused forward
    on, against its stock forward (sdpa) on the original weights: the same output, also with
    cu_seqlens on the CPU (the stock tower builds them on grid_thw's device); with gradients
    wanted, a clear error rather than none."""
    from functools import partial

    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLVisionAttention

    from encoder_graphs.kernels.window import rotary_window_attention
    from encoder_graphs.presets import get_config
    from encoder_graphs.rewrites import Rewrites
    from encoder_graphs.seam.vision import permute_qk, window_attention_forward

    config = get_config("qwen2.5-vl-7b").vision_config
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    attention = Qwen2_5_VLVisionAttention(config).to("cuda", torch.bfloat16)
    _, _, _, cos, sin, cu_seqlens = window_case(config.num_heads, attention.head_dim, seed=3)
    covered = int(cu_seqlens[-1])
    hidden = torch.randn(covered, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    cos, sin, cu_seqlens = cos[:covered], sin[:covered], torch.unique_consecutive(cu_seqlens)
    with torch.no_grad():
        stock = attention(hidden, cu_seqlens=cu_seqlens, position_embeddings=(cos, sin))
        permute_qk(attention, interleave_pairs(attention.head_dim), Rewrites())
        fused = window_attention_forward(attention, partial(rotary_window_attention, max_seqlen=64))
        for offsets in (cu_seqlens, cu_seqlens.cpu()):
            out = fused(hidden, cu_seqlens=offsets, position_embeddings=(cos, sin))
            assert relative_error(out, stock.float()) < 1e-2
    with pytest.raises(RuntimeError, match="no backward"):
        fused(hidden, cu_seqlens=cu_seqlens, position_embeddings=(cos, sin))
