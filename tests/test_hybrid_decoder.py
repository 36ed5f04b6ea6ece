"""The decoder runner over a hybrid language model (Qwen3.5: Gated DeltaNet linear-attention layers
beside full attention), on the CPU (eager path, the same step function the graphs hold): its
static cache holds the full-attention layers' keys and values and the linear-attention layers'
conv and recurrent states; prefill writes them, each step updates them in place, through the
fused step's layers (`DecodeLayer` with its output gate and partial rotary, `DeltaNetDecodeLayer`)
or the model's own forward. Tokens identical to `generate`, fp32. A tiny Qwen3.5, saved and
reloaded for real."""

import pytest
import torch
from test_decoder import CASES, NO_EOS, hf_generate, make_batch, runner_generate
from transformers import AutoConfig

from encoder_graphs.decoder.runner import DecoderGraphRunner
from encoder_graphs.presets import PRESETS, build_model
from encoder_graphs.seam.text import SlotLayer, StateLayer, linear_attention_layers


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3.5")
    build_model("tiny-qwen3.5", seed=3).save_pretrained(path)
    return PRESETS["tiny-qwen3.5"].model_class.from_pretrained(path).eval()


@pytest.mark.parametrize("fused", [True, False], ids=["fused step", "model forward"])
def test_greedy_matches_generate_and_no_state_leaks_between_calls(model, fused):
    """One runner for every case, the largest batch first: the rows and states an earlier call
    left behind must not reach a later one."""
    runner = DecoderGraphRunner(model, max_batch_size=4, max_cache_len=96, fused_step=fused)
    assert not runner.packed_prefill  # the recurrence would cross packed prompts' bounds
    if fused:
        kinds = [type(layer).__name__ for layer in runner.stack.layers]
        assert kinds == ["DeltaNetDecodeLayer"] * 3 + ["DecodeLayer"] and runner.stack.layers[-1].gated
    else:
        assert runner.stack is None
    for name in ["three images, left padded", "one image", "text only, left padded"]:
        inputs = make_batch(model.config, **CASES[name])
        expected = hf_generate(model, inputs, eos_token_id=NO_EOS)
        assert torch.equal(runner_generate(runner, inputs, eos_token_id=NO_EOS), expected), name
    assert len(set(expected[0, -12:].tolist())) > 2  # the test means something


def test_the_static_cache_holds_states_for_linear_layers_and_slots_for_full_ones(model):
    text = model.config.get_text_config(decoder=True)
    linear = linear_attention_layers(text)
    assert 0 < len(linear) < text.num_hidden_layers  # hybrid: both kinds
    runner = DecoderGraphRunner(model, max_batch_size=2, max_cache_len=40)
    store = runner.static_buffers().store
    cache = store.cache(2, 32)
    for index, layer in enumerate(cache.layers):
        assert isinstance(layer, StateLayer if index in linear else SlotLayer), index
    assert store.kv.shape[1] == text.num_hidden_layers - len(linear)
    assert store.recurrent.dtype == torch.float32 and store.conv.shape[:2] == (len(linear), 2)
    stats = runner.stats()
    assert stats["static_buffer_bytes"] >= store.kv.nbytes + store.conv.nbytes + store.recurrent.nbytes


def test_padded_lanes_start_from_zero_states(model):
    """Rows past a call's batch (a bucket's padded lanes) get zeroed states, so that NaN left in
    them never grows into a row that a later call reads."""
    runner = DecoderGraphRunner(model, max_batch_size=4, max_cache_len=96)
    store = runner.static_buffers().store
    store.conv.fill_(float("nan"))
    store.recurrent.fill_(float("nan"))
    inputs = make_batch(model.config, **CASES["one image"])
    assert torch.equal(runner_generate(runner, inputs, eos_token_id=NO_EOS), hf_generate(model, inputs, eos_token_id=NO_EOS))
    assert not store.conv[:, 1:].isnan().any() and not store.recurrent[:, 1:].isnan().any()


def test_generation_crossing_length_tiers_and_eos_match_generate(model):
    inputs = make_batch(model.config, grids=[(1, 4, 4), (1, 8, 6)], seed=7)
    expected = hf_generate(model, inputs, eos_token_id=NO_EOS, max_new_tokens=30)
    runner = DecoderGraphRunner(model, max_batch_size=2, max_cache_len=96, length_tiers=[32, 64])
    assert torch.equal(runner_generate(runner, inputs, eos_token_id=NO_EOS, max_new_tokens=30), expected)
    assert len(runner.stats()["steps_per_tier"]) == 2
    prompt_len = inputs["input_ids"].shape[1]
    eos = sorted({int(expected[row, prompt_len + 2]) for row in range(2)})
    got = runner_generate(runner, inputs, eos_token_id=eos, pad_token_id=7)
    assert torch.equal(got, hf_generate(model, inputs, eos_token_id=eos, pad_token_id=7))


def test_sliding_window_layers_are_still_declined(tmp_path):
    """Sliding-window layers would need a ring of slots: the runner declines them, by name."""
    build_model("tiny-qwen2.5-vl").save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    config.text_config.layer_types = ["sliding_attention"] * config.text_config.num_hidden_layers
    assert DecoderGraphRunner.unsupported(config).startswith("sliding_attention layers")
    assert DecoderGraphRunner.unsupported(model_config := AutoConfig.from_pretrained(tmp_path)) is None
    assert model_config.model_type == "qwen2_5_vl"
