"""The Triton kernels' entry checks (models/kernel_inputs.py), which read only tensor metadata and
so run on the CPU: what each kernel takes passes, each kind of wrong argument raises, naming it.
And the GPUs the kernels run on: only those they were tested on."""

import pytest
import torch

from encoder_graphs.decoder.routes import Route
from encoder_graphs.decoder.runner import DecoderGraphRunner
from encoder_graphs.kernels import kernels_tested_on, triton_runs
from encoder_graphs.kernels.checks import (
    check_decode_inputs,
    check_segments,
    check_swiglu_inputs,
    check_window_inputs,
)
from encoder_graphs.models.qwen.qwen2_5_vl import Qwen2_5_VLAdapter
from encoder_graphs.presets import build_model, build_vision_tower


def offsets(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def test_segments_within_their_bound_pass_and_a_longer_one_raises():
    check_segments(offsets(0, 64, 100, 164, 164, 200), max_seqlen=64, rows=200)
    check_segments(offsets(0, 64, 128, 128, 128), max_seqlen=64, rows=192)  # a padded tail repeats
    with pytest.raises(ValueError, match="segment of 65 rows is longer than max_seqlen 64"):
        check_segments(offsets(0, 64, 129), max_seqlen=64, rows=200)
    with pytest.raises(ValueError, match="rise from 0"):
        check_segments(offsets(0, 64, 32), max_seqlen=64, rows=200)  # not monotonic
    with pytest.raises(ValueError, match="rise from 0"):
        check_segments(offsets(0, 64, 128), max_seqlen=64, rows=100)  # past the rows
    with pytest.raises(ValueError, match="integer offsets"):
        check_segments(torch.tensor([0.0, 64.0]), max_seqlen=64, rows=100)


def window_args(rows=100, heads=4, head_dim=80, dtype=torch.bfloat16):
    q, k, v = (torch.zeros(rows, heads, head_dim, dtype=dtype) for _ in range(3))
    cos = sin = torch.zeros(rows, head_dim)
    return dict(q=q, k=k, v=v, cos=cos, sin=sin, cu_seqlens=offsets(0, 64, rows), max_seqlen=64)


def test_window_inputs():
    check_window_inputs(**window_args())
    bad = {
        "segment of 70 rows is longer": dict(cu_seqlens=offsets(0, 30, 100)),  # rows 94..99 never written
        "one shape": dict(k=torch.zeros(100, 4, 64, dtype=torch.bfloat16)),
        "half-precision": dict(q=torch.zeros(100, 4, 80), k=torch.zeros(100, 4, 80), v=torch.zeros(100, 4, 80)),
        "cos and sin": dict(cos=torch.zeros(99, 80)),
        "int32 offsets": dict(cu_seqlens=torch.tensor([0, 64, 100])),
        "head dims contiguous": dict(q=torch.zeros(100, 80, 4, dtype=torch.bfloat16).transpose(1, 2)),
    }
    for message, change in bad.items():
        with pytest.raises(ValueError, match=message):
            check_window_inputs(**{**window_args(), **change})


def test_swiglu_inputs():
    x = torch.zeros(5, 64, dtype=torch.bfloat16)
    weight = torch.zeros(2 * 24, 64, dtype=torch.bfloat16)
    bias = torch.zeros(2 * 24, dtype=torch.bfloat16)
    check_swiglu_inputs(x, weight, bias)
    check_swiglu_inputs(x[None], weight, None)  # any leading dims
    bad = {
        "x \\[..., 64\\]": (torch.zeros(5, 48, dtype=torch.bfloat16), weight, bias),
        "one half-precision dtype": (x.float(), weight, bias),
        "2 x width, in": (x, weight[1:], bias[1:]),  # odd rows: gate and up do not pair
        "in a multiple of 8": (x[:, :60], weight[:, :60], bias),  # TMA cannot stride those rows
        "contiguous weight": (x, weight.t().contiguous().t(), bias),
        "bias": (x, weight, bias[:-2]),
    }
    for message, args in bad.items():
        with pytest.raises(ValueError, match=message):
            check_swiglu_inputs(*args)


def decode_args(batch=3, heads=8, kv_heads=2, slots=40, dim=64, dtype=torch.bfloat16):
    return dict(
        query=torch.zeros(batch, heads, 1, dim, dtype=dtype),
        key=torch.zeros(batch, kv_heads, 1, dim, dtype=dtype),
        value=torch.zeros(batch, kv_heads, 1, dim, dtype=dtype),
        keys=torch.zeros(batch, kv_heads, slots, dim, dtype=dtype),
        values=torch.zeros(batch, kv_heads, slots, dim, dtype=dtype),
        slot=torch.tensor([7]),
        mask=torch.ones(batch, slots, dtype=torch.bool),
    )


def test_decode_inputs():
    check_decode_inputs(**decode_args())
    bad = {
        "query \\[batch, heads, 1, dim\\]": dict(query=torch.zeros(3, 8, 2, 64, dtype=torch.bfloat16)),
        "key, value": dict(key=torch.zeros(3, 4, 1, 64, dtype=torch.bfloat16)),
        "whole groups": decode_args(heads=6, kv_heads=4),
        "power-of-two head dim": decode_args(dim=80),
        "one dtype": dict(query=torch.zeros(3, 8, 1, 64)),
        "one layout": dict(values=torch.zeros(3, 2, 64, 40, dtype=torch.bfloat16).transpose(2, 3)),
        "bool mask": dict(mask=torch.ones(3, 41, dtype=torch.bool)),
        "one integer slot": dict(slot=torch.tensor([7.0])),
    }
    for message, change in bad.items():
        with pytest.raises(ValueError, match=message):
            check_decode_inputs(**{**decode_args(), **change})


def test_kernels_run_only_on_the_gpus_they_were_tested_on():
    assert kernels_tested_on((9, 0))  # H100, H200
    for untested in [(8, 0), (8, 6), (8, 9), (10, 0), (12, 0)]:  # A100, A10, L4 / 4090, B200, RTX 50
        assert not kernels_tested_on(untested)
    assert not triton_runs(torch.device("cpu"))


def test_window_metadata_passes_its_check_for_real_layouts():
    """The check on the host where Qwen2.5-VL builds its window offsets: real sizes and padded
    layouts pass (a false alarm would stop every call)."""
    adapter = Qwen2_5_VLAdapter(build_vision_tower("tiny-qwen2.5-vl"))
    grids = [(1, 8, 12), (2, 4, 4), (1, 14, 6)]
    tensors, static = adapter.metadata(grids, None)
    assert static["max_window_seqlen"] <= adapter.window_rows
    for budget in (64, 128):
        tensors, _ = adapter.metadata(grids, adapter.layout(budget, max_frames=8))
        assert int(tensors["cu_window_seqlens"][-1]) == budget * adapter.unit


def test_a_decode_step_past_its_cache_raises_on_the_host():
    """The slot a step writes is known on the host: a step past the last slot of the cache its
    graph or kernel reads raises before any launch (the kernel would write past the cache)."""
    runner = DecoderGraphRunner(build_model("tiny-qwen2-vl"), max_batch_size=2, max_cache_len=32, length_tiers=[16])
    route = Route(runner.static_buffers(), rows=2, eager_reason=None)
    assert [runner._tier(route, needed).tier for needed in (16, 17, 32)] == [16, 32, 32]
    with pytest.raises(RuntimeError, match="needs 33 cache slots, its tier holds 32"):
        runner._tier(route, 33)
