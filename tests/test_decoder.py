"""Decoder runner on CPU (eager path, same step function the graphs hold): tokens identical to
`generate`, length tiers, EOS handling, sampling, statistics. Tiny models, fp32, saved and
reloaded for real."""

import copy
import warnings
from dataclasses import replace

import pytest
import torch
from synthetic_prompts import (
    image_prompt,
    left_pad,
    mm_token_type_ids,
    random_pixels,
    random_text,
)

from encoder_graphs.decoder.buffers import DecoderGraphConfig, default_buckets, default_length_tiers
from encoder_graphs.decoder.runner import DecoderGraphRunner
from encoder_graphs.decoder.step import packed_prefill, prefill, prompt_positions
from encoder_graphs.models.qwen import vision as qwen_vision
from encoder_graphs.presets import PRESETS, build_model
from encoder_graphs.report import format_decoder_stats
from encoder_graphs.seam.attention import (
    attention_implementation,
    register_varlen_attention,
    static_decode_attention,
)

FAMILIES = ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl"]
NEW_TOKENS = 12
NO_EOS = 10**6  # outside every vocabulary: sequences run to max_new_tokens


@pytest.fixture(scope="module", params=FAMILIES)
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    build_model(request.param).save_pretrained(path)
    return PRESETS[request.param].model_class.from_pretrained(path).eval()


def make_batch(config, grids, seed=0, text_only_lengths=()):
    """Left-padded prompts: text, <vision_start>, image pads, <vision_end>, text; or text only."""
    rng = torch.Generator().manual_seed(seed)
    prompts = [image_prompt(config, grid, 2 + i, 1 + 2 * i, rng) for i, grid in enumerate(grids)]
    prompts += [random_text(config, length, rng) for length in text_only_lengths]
    inputs = left_pad(prompts)
    if grids:
        inputs["pixel_values"] = random_pixels(config.vision_config, grids, rng)
        inputs["image_grid_thw"] = torch.tensor(grids)
        inputs["mm_token_type_ids"] = mm_token_type_ids(inputs["input_ids"], config)
    return inputs


def hf_generate(model, inputs, **kwargs):
    kwargs.setdefault("max_new_tokens", NEW_TOKENS)
    with torch.inference_mode():
        return model.generate(**inputs, do_sample=False, **kwargs)


def runner_generate(runner, inputs, **kwargs):
    inputs = dict(inputs)
    kwargs.setdefault("max_new_tokens", NEW_TOKENS)
    return runner.generate(inputs.pop("input_ids"), inputs.pop("attention_mask"), **inputs, **kwargs)


CASES = {
    "one image": dict(grids=[(1, 4, 4)]),
    "three images, left padded": dict(grids=[(1, 4, 4), (1, 8, 6), (1, 4, 8)]),
    "text only, left padded": dict(grids=[], text_only_lengths=(5, 9)),
}


@pytest.mark.parametrize("ours", [True, False], ids=["fused layers, packed prefill", "model forward, padded prefill"])
def test_greedy_matches_generate(model, ours):
    # One runner for every case, larger batch first: rows and slots left by an earlier call
    # must not leak into a later one.
    runner = DecoderGraphRunner(model, max_batch_size=4, max_cache_len=96, fused_step=ours, packed_prefill=ours)
    assert (runner.stack is not None) == runner.packed_prefill == ours  # every Qwen family's decoder is known
    for name in ["three images, left padded", "one image", "text only, left padded"]:
        inputs = make_batch(model.config, **CASES[name])
        expected = hf_generate(model, inputs)
        got = runner_generate(runner, inputs)
        assert torch.equal(got, expected), f"{name}:\n{got}\n!=\n{expected}"
    assert len(set(expected[0, -NEW_TOKENS:].tolist())) > 2  # the test means something


@pytest.mark.parametrize("packed", [True, False], ids=["packed prefill", "padded prefill"])
def test_position_ids_computed_ahead_give_generates_tokens(model, packed):
    """The caption command computes the prompts' positions on its collate thread and passes them
    as `position_ids`, which stock `generate` honours: the same tokens as without them. Positions
    of another shape are refused."""
    inputs = make_batch(model.config, **CASES["three images, left padded"])
    expected = hf_generate(model, inputs)
    others = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    positions = prompt_positions(model, inputs["input_ids"], inputs["attention_mask"], others)
    assert positions.shape[-2:] == inputs["input_ids"].shape
    runner = DecoderGraphRunner(model, max_batch_size=4, max_cache_len=96, packed_prefill=packed)
    assert torch.equal(runner_generate(runner, dict(inputs, position_ids=positions)), expected)
    assert torch.equal(hf_generate(model, dict(inputs, position_ids=positions)), expected)
    with pytest.raises(ValueError, match="position_ids"):
        runner_generate(runner, dict(inputs, position_ids=positions[..., 1:]))


def right_padded(inputs):
    """The same prompts padded on the right instead."""
    inputs = dict(inputs)
    order = torch.argsort(1 - inputs["attention_mask"], dim=1, stable=True)  # real tokens first
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        if key in inputs:
            inputs[key] = torch.gather(inputs[key], 1, order)
    return inputs


def test_packed_prefill_equals_padded_prefill(model):
    """Logits and every prompt slot of the static cache, packed vs padded (fp32)."""
    inputs = make_batch(model.config, **CASES["three images, left padded"])
    assert not inputs["attention_mask"].all()
    stores = []
    for packed in (False, True):
        runner = DecoderGraphRunner(model, max_batch_size=4, max_cache_len=96, packed_prefill=packed)
        batch = dict(inputs)
        ids, mask = batch.pop("input_ids"), batch.pop("attention_mask")
        with torch.inference_mode():
            prefilled = (packed_prefill if packed else prefill)(model, ids, mask, runner._model_inputs(batch))
            store = runner.static_buffers().store
            store.load_prefill(prefilled.key_values, prefilled.slots)
        stores.append((prefilled, store))
    (padded, padded_store), (packed, packed_store) = stores
    torch.testing.assert_close(packed.logits, padded.logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(packed.next_positions, padded.next_positions)
    real = inputs["attention_mask"].bool()
    rows, slots = real.nonzero(as_tuple=True)
    for side in (0, 1):  # keys, values of every layer at each real token's slot
        torch.testing.assert_close(
            packed_store.kv[side][:, rows, :, slots], padded_store.kv[side][:, rows, :, slots], rtol=1e-4, atol=1e-4
        )


def test_right_padded_prompts_match_generate(model):
    """`generate` reads the logits of the last column, a pad token's on a right-padded row: such a
    batch takes the padded prefill, whose logits are the same."""
    inputs = right_padded(make_batch(model.config, **CASES["three images, left padded"]))
    expected = hf_generate(model, inputs)
    got = runner_generate(DecoderGraphRunner(model, max_batch_size=4, max_cache_len=96), inputs)
    assert torch.equal(got, expected)


def test_packed_prefill_leaves_a_flash_named_vision_attention_alone(model):
    """Qwen-VL hands its forward's keyword arguments on to the vision tower, whose varlen branch
    (an implementation named "flash") passes cu_seq_lens itself: the packed prefill adds none."""
    inputs = make_batch(model.config, **CASES["three images, left padded"])
    expected = hf_generate(model, inputs)
    runner = DecoderGraphRunner(model, max_batch_size=4, max_cache_len=96)
    with attention_implementation(model.config.vision_config, register_varlen_attention("sdpa")):
        got = runner_generate(runner, inputs)
    assert torch.equal(got, expected)


def test_generation_crossing_length_tiers_matches_generate(model):
    inputs = make_batch(model.config, grids=[(1, 4, 4), (1, 8, 6)], seed=9)
    assert inputs["input_ids"].shape[1] == 20
    expected = hf_generate(model, inputs, eos_token_id=NO_EOS, max_new_tokens=30)
    runner = DecoderGraphRunner(model, max_batch_size=2, max_cache_len=64, length_tiers=[16, 32])
    got = runner_generate(runner, inputs, eos_token_id=NO_EOS, max_new_tokens=30)
    assert torch.equal(got, expected)
    # Step s attends over 20 + s slots: steps 1-12 fit tier 32, steps 13-29 need tier 64.
    stats = runner.stats()
    assert stats["length_tiers"] == [16, 32, 64]
    assert stats["steps_per_tier"] == {32: 12, 64: 17}
    assert stats["eager_reasons"] == {"no CUDA device": 29} and stats["replays_per_tier"] == {}
    assert runner.format_stats() == "decoder graphs: off (no CUDA device); sequences 2, decode steps 29, all eager"
    # The full table (what a GPU run prints) from the same counters.
    assert "steps per tier: 32 x12, 64 x17" in format_decoder_stats(replace(runner.typed_stats(), enabled=True))


def test_decode_steps_read_only_their_length_tier(model):
    inputs = make_batch(model.config, grids=[(1, 4, 4), (1, 8, 6)], seed=9)
    expected = hf_generate(model, inputs, eos_token_id=NO_EOS, max_new_tokens=30)  # up to 49 slots

    def poisoned_generate(runner):
        # NaN in the slots past tier 64: a step reading them, even masked, turns its logits to
        # NaN (a masked slot still meets a 0 weight, and 0 * NaN is NaN).
        runner.static_buffers().store.kv[..., 64:, :] = float("nan")
        return runner_generate(runner, inputs, eos_token_id=NO_EOS, max_new_tokens=30)

    tiered = DecoderGraphRunner(model, max_batch_size=2, max_cache_len=96, length_tiers=[32, 64])
    assert torch.equal(poisoned_generate(tiered), expected)
    assert tiered.stats()["steps_per_tier"] == {32: 12, 64: 17}
    whole_cache = DecoderGraphRunner(model, max_batch_size=2, max_cache_len=96, length_tiers=[96])
    assert not torch.equal(poisoned_generate(whole_cache), expected)  # the poison is seen when read


def test_without_mm_token_type_ids_tokens_are_stocks_and_a_warning_says_so(model, monkeypatch):
    """Stock transformers gives vision tokens text positions when a call lacks the token types:
    so does the runner (it adds none), and it says so once."""
    monkeypatch.setattr(qwen_vision, "_warned", [])
    model = copy.deepcopy(model)
    with torch.no_grad():  # sharper attention: positions decide the tiny model's tokens
        for layer in model.get_decoder().layers:
            layer.self_attn.q_proj.weight.mul_(10)
            layer.self_attn.k_proj.weight.mul_(10)
    typed = make_batch(model.config, grids=[(1, 4, 4), (1, 8, 6)], seed=3)
    untyped = {key: value for key, value in typed.items() if key != "mm_token_type_ids"}
    expected = {"typed": hf_generate(model, typed), "untyped": hf_generate(model, untyped)}
    assert not torch.equal(expected["typed"], expected["untyped"])  # the types change stock's tokens
    runner = DecoderGraphRunner(model, max_batch_size=2, max_cache_len=96)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(runner_generate(runner, typed), expected["typed"])
        for _ in range(2):
            assert torch.equal(runner_generate(runner, untyped), expected["untyped"])
    said = [str(w.message) for w in caught if "mm_token_type_ids" in str(w.message)]
    assert len(said) == 1 and "text positions" in said[0]


def test_eager_attention_matches_generate(tmp_path):
    build_model("tiny-qwen2.5-vl", seed=1).save_pretrained(tmp_path)
    model = PRESETS["tiny-qwen2.5-vl"].model_class.from_pretrained(tmp_path, attn_implementation="eager")
    inputs = make_batch(model.config, grids=[(1, 4, 4), (1, 8, 6), (1, 4, 8)], seed=1)
    got = runner_generate(DecoderGraphRunner(model, max_batch_size=4, max_cache_len=96), inputs)
    assert torch.equal(got, hf_generate(model, inputs))


def test_eos_stops_each_sequence_and_pads_after_it(model):
    inputs = make_batch(model.config, grids=[(1, 4, 4), (1, 8, 6), (1, 4, 8)], seed=2)
    prompt_len = inputs["input_ids"].shape[1]
    free_run = runner_generate(DecoderGraphRunner(model, max_cache_len=96), inputs, eos_token_id=NO_EOS)
    # Each sequence's third new token is an EOS: a list of ids, and rows stop at different steps.
    eos = sorted({int(free_run[row, prompt_len + row]) for row in range(3)})
    pad = 7
    runner = DecoderGraphRunner(model, max_cache_len=96)
    got = runner_generate(runner, inputs, eos_token_id=eos, pad_token_id=pad, stop_check_interval=2)
    assert torch.equal(got, hf_generate(model, inputs, eos_token_id=eos, pad_token_id=pad))

    new = got[:, prompt_len:]
    lengths = []
    for row in range(3):
        end = next(i for i, token in enumerate(new[row].tolist()) if token in eos) + 1
        assert end <= row + 1
        assert (new[row, end:] == pad).all()
        lengths.append(end)
    assert new.shape[1] == max(lengths)  # trimmed where the last sequence stopped
    assert runner.stats()["steps"] <= max(lengths) + 2  # the host check every 2 steps stopped the loop


def test_sampling_reproducible_and_top_p_tiny_is_greedy(model):
    inputs = make_batch(model.config, grids=[(1, 4, 4), (1, 8, 6)], seed=4)
    runner = DecoderGraphRunner(model, max_batch_size=2, max_cache_len=96)

    def sample(seed, **kwargs):
        generator = torch.Generator().manual_seed(seed)
        return runner_generate(
            runner, inputs, do_sample=True, generator=generator, eos_token_id=NO_EOS, **kwargs
        )

    first, again, other = sample(0, temperature=1.5), sample(0, temperature=1.5), sample(1, temperature=1.5)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    greedy = runner_generate(runner, inputs, eos_token_id=NO_EOS)
    assert not torch.equal(first, greedy)
    assert torch.equal(sample(5, top_p=1e-6), greedy)
    assert torch.equal(sample(6, temperature=1e-6), greedy)  # 1e-4 flips near-ties of 2e-4, seen


def test_stats_and_eager_reasons(model):
    runner = DecoderGraphRunner(model, max_batch_size=3, batch_sizes=[2], max_cache_len=40, enabled=False)
    three = make_batch(model.config, grids=[(1, 4, 4), (1, 4, 4), (1, 4, 4)], seed=5)
    one = make_batch(model.config, grids=[(1, 4, 4)], seed=6)
    long_one = make_batch(model.config, grids=[(1, 8, 8)], seed=7)  # 16 image tokens + 6
    assert torch.equal(
        runner_generate(runner, three, eos_token_id=NO_EOS), hf_generate(model, three, eos_token_id=NO_EOS)
    )
    assert torch.equal(
        runner_generate(runner, one, eos_token_id=NO_EOS), hf_generate(model, one, eos_token_id=NO_EOS)
    )
    # What the static cache cannot hold is refused before any work (enable_cuda_graphs sends it
    # to the stock generate), not given a cache of its own.
    slots = long_one["input_ids"].shape[1] + 29
    with pytest.raises(ValueError, match=f"sequence of {slots} cache slots, longer than decoder max_cache_len 40"):
        runner_generate(runner, long_one, eos_token_id=NO_EOS, max_new_tokens=30)
    four = make_batch(model.config, grids=[(1, 4, 4)] * 4, seed=8)
    with pytest.raises(ValueError, match="batch of 4, larger than decoder max_batch_size 3"):
        runner_generate(runner, four, eos_token_id=NO_EOS)

    stats = runner.stats()
    assert stats["calls"] == 2 and stats["sequences"] == 4
    assert stats["steps"] == 2 * (NEW_TOKENS - 1)
    assert stats["graph_steps"] == 0 and stats["eager_steps"] == stats["steps"]
    assert stats["eager_reasons"] == {
        "batch larger than the largest bucket": NEW_TOKENS - 1,
        "enabled=False": NEW_TOKENS - 1,
    }
    assert stats["replays_per_bucket"] == {} and stats["replays_per_tier"] == {}
    assert stats["length_tiers"] == [40] and set(stats["steps_per_tier"]) == {40}
    assert sum(stats["steps_per_tier"].values()) == stats["steps"]
    assert stats["decode_ms_per_step"]["mean"] > 0
    assert "decoder graphs: off (enabled=False)" in runner.format_stats()
    runner.reset_stats()
    assert runner.stats()["steps"] == 0


def test_batch_between_largest_bucket_and_max_batch_size(model):
    runner = DecoderGraphRunner(model, max_batch_size=4, batch_sizes=[2], max_cache_len=96)
    inputs = make_batch(model.config, grids=[(1, 4, 4), (1, 8, 6), (1, 4, 8)], seed=8)
    got = runner_generate(runner, inputs, eos_token_id=NO_EOS)
    assert torch.equal(got, hf_generate(model, inputs, eos_token_id=NO_EOS))
    assert runner.stats()["eager_reasons"] == {"batch larger than the largest bucket": NEW_TOKENS - 1}


def test_no_cuda_reason_and_capture_is_a_no_op(model):
    runner = DecoderGraphRunner(model, max_batch_size=2, max_cache_len=64)
    runner.capture()
    assert runner.graphs == {}
    runner_generate(runner, make_batch(model.config, grids=[(1, 4, 4)]), eos_token_id=NO_EOS)
    assert runner.stats()["eager_reasons"] == {"no CUDA device": NEW_TOKENS - 1}


def test_decode_attention_equals_repeated_kv_attention():
    batch, kv_heads, group, slots, dim = 3, 2, 4, 40, 16
    rng = torch.Generator().manual_seed(0)
    query = torch.randn(batch, kv_heads * group, 1, dim, generator=rng)
    key = torch.randn(batch, kv_heads, slots, dim, generator=rng)
    value = torch.randn(batch, kv_heads, slots, dim, generator=rng)
    mask = torch.rand(batch, 1, 1, slots, generator=rng) > 0.5
    mask[:, ..., 0] = True
    got, _ = static_decode_attention(None, query, key, value, mask, scaling=0.3)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(group, 1), value.repeat_interleave(group, 1), attn_mask=mask, scale=0.3
    )
    assert got.shape == (batch, 1, kv_heads * group, dim)
    torch.testing.assert_close(got, expected.transpose(1, 2))


def test_decode_swaps_attention_only_inside_the_step(model):
    text_config = model.config.get_text_config(decoder=True)
    attention = [m for m in model.modules() if hasattr(m, "k_proj") and hasattr(m, "layer_idx")]
    assert attention and all(m.config is text_config for m in attention)  # the swap reaches them
    before = text_config._attn_implementation
    runner_generate(
        DecoderGraphRunner(model, max_batch_size=1, max_cache_len=64),
        make_batch(model.config, grids=[(1, 4, 4)]),
        max_new_tokens=3,
    )
    assert text_config._attn_implementation == before


def test_default_buckets_and_config():
    assert default_buckets(32) == [1, 2, 4, 8, 16, 32]
    assert default_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert default_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert default_buckets(5) == [1, 2, 4, 5]
    assert DecoderGraphConfig(8, 64, [4, 2, 4]).buckets == [2, 4]
    with pytest.raises(ValueError):
        DecoderGraphConfig(4, 64, [8])
    with pytest.raises(ValueError):
        DecoderGraphConfig(0, 64)


def test_length_tiers():
    assert default_length_tiers(4096) == [256, 512, 1024, 2048, 4096]
    assert default_length_tiers(16500) == [256, 512, 1024, 2048, 4096, 8192, 16384, 16500]
    assert default_length_tiers(96) == [96]
    assert DecoderGraphConfig(8, 100, length_tiers=[64, 16, 64]).length_tiers == [16, 64, 100]
    assert DecoderGraphConfig(8, 64, length_tiers=[16, 64]).length_tiers == [16, 64]
    for tiers in ([1, 16], [16, 128]):
        with pytest.raises(ValueError):
            DecoderGraphConfig(8, 64, length_tiers=tiers)


def test_rejects_bad_arguments(model):
    runner = DecoderGraphRunner(model, max_batch_size=1, max_cache_len=64)
    inputs = make_batch(model.config, grids=[(1, 4, 4)])
    with pytest.raises(ValueError):
        runner_generate(runner, inputs, max_new_tokens=0)
    with pytest.raises(ValueError):
        runner_generate(runner, inputs, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError):
        runner_generate(runner, inputs, do_sample=True, top_p=0.0)


def test_static_buffer_bytes_counts_every_buffer(model):
    runner = DecoderGraphRunner(model, max_batch_size=2, max_cache_len=40)
    runner_generate(runner, make_batch(model.config, grids=[(1, 4, 4)]), max_new_tokens=3)
    text = model.config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv = 2 * text.num_hidden_layers * 2 * text.num_key_value_heads * 40 * head_dim * 4  # fp32
    position_rows = runner.static_buffers().positions.shape[:-1].numel()
    rest = 2 * 8 + position_rows * 8 + 2 * 40 + 2 * text.vocab_size * 4  # ids, positions, mask, logits
    assert runner.stats()["static_buffer_bytes"] == kv + rest


def test_stacked_projections_are_views_until_close(model):
    """The fused step's q/k/v and gate/up GEMMs read the stock weights themselves (views of one
    stacked tensor each, no copy); the stock forward still gives `generate`'s tokens; `close`
    gives every projection its own tensor back, values unchanged."""
    before = {name: weight.clone() for name, weight in model.state_dict().items()}
    runner = DecoderGraphRunner(model, max_batch_size=2, max_cache_len=64)
    layer, stacked = model.get_decoder().layers[-1], runner.stack.layers[-1]
    storage = stacked.qkv.weight.untyped_storage().data_ptr()
    projections = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]
    assert all(p.weight.untyped_storage().data_ptr() == storage for p in projections)
    mlp_storage = stacked.gate_up.weight.untyped_storage().data_ptr()
    assert all(p.weight.untyped_storage().data_ptr() == mlp_storage for p in (layer.mlp.gate_proj, layer.mlp.up_proj))
    inputs = make_batch(model.config, grids=[(1, 4, 4)])
    assert torch.equal(runner_generate(runner, inputs), hf_generate(model, inputs))
    runner.close()
    assert runner.stack is None
    storages = {p.weight.untyped_storage().data_ptr() for p in projections}
    assert len(storages) == 3 and storage not in storages
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())


def test_projections_that_are_not_plain_linears_run_one_by_one():
    """A subclass (as LoRA or quantized layers are) is never stacked: its own forward runs."""
    from torch import nn

    from encoder_graphs.rewrites.stacked_linear import StackedLinear

    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    from encoder_graphs.rewrites import Rewrites

    linears = [Scaled(8, 4), nn.Linear(8, 2)]
    storages = [linear.weight.data_ptr() for linear in linears]
    stacked = StackedLinear(linears, Rewrites())
    x = torch.randn(3, 8)
    assert stacked.weight is None and [linear.weight.data_ptr() for linear in linears] == storages
    for got, linear in zip(stacked(x), linears, strict=True):
        assert torch.equal(got, linear(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_fused_step_hands_the_decode_kernel_what_it_takes(model, dtype, monkeypatch):
    """Every decode attention of the fused step has the dtypes, strides and mask the Triton kernel
    takes, so on a GPU it runs the kernel and not the sdpa fallback."""
    import encoder_graphs.decoder.layers.decode as text_decode
    from encoder_graphs.attention import fits_decode_kernel, write_and_decode

    calls = []

    def observed(query, key, value, keys, values, slot, mask, scale):
        calls.append(fits_decode_kernel(query, keys, values, mask) and key.dtype == keys.dtype)
        return write_and_decode(query, key, value, keys, values, slot, mask, scale)

    monkeypatch.setattr(text_decode, "_write_and_decode", observed)
    model = copy.deepcopy(model).to(dtype)
    runner = DecoderGraphRunner(model, max_batch_size=2, max_cache_len=64)
    runner_generate(runner, make_batch(model.config, grids=[(1, 4, 4)]), max_new_tokens=3)
    assert calls and all(calls)
