"""`enable_cuda_graphs` routes `model.generate` through the decoder runner (CPU: its eager path,
the same step function the graphs hold): tokens equal to the stock `generate`, unsupported
settings sent back to the stock `generate` and counted, `disable()` restores it. Tiny models, fp32,
saved and reloaded for real."""

from dataclasses import replace

import pytest
import torch
from test_decoder import make_batch
from transformers import GenerationConfig

from encoder_graphs import DecoderGraphRunner, GraphOptions, enable_cuda_graphs
from encoder_graphs.presets import PRESETS, build_model

FAMILIES = ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-qwen3.5"]
NEW_TOKENS = 10
GRIDS = [(1, 4, 4), (1, 8, 6), (1, 4, 8)]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    build_model(request.param, seed=2).save_pretrained(path)
    return PRESETS[request.param].model_class.from_pretrained(path).eval()


def generate(model, inputs, **kwargs):
    kwargs.setdefault("max_new_tokens", NEW_TOKENS)
    with torch.inference_mode():
        return model.generate(**inputs, **kwargs)


def test_generate_equals_stock_and_disable_restores(model):
    batch = make_batch(model.config, GRIDS, seed=1)  # left padded, three image sizes
    single = make_batch(model.config, GRIDS[1:2], seed=2)
    single_no_mask = {k: v for k, v in single.items() if k != "attention_mask"}
    expected = {
        "batch": generate(model, batch, do_sample=False),
        "single": generate(model, single, do_sample=False),
        "beams": generate(model, single, num_beams=2),
    }
    handle = enable_cuda_graphs(model, budgets=[64, 256], decoder_max_batch_size=4, decoder_max_cache_len=128)
    try:
        assert isinstance(handle.decoder, DecoderGraphRunner)
        assert "generate" in model.__dict__
        assert torch.equal(generate(model, batch, do_sample=False), expected["batch"])
        assert torch.equal(generate(model, single), expected["single"])
        assert torch.equal(generate(model, single_no_mask), expected["single"])
        # Settings from a generation_config argument, not keyword arguments.
        config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False)
        assert torch.equal(generate(model, single, generation_config=config), expected["single"])
        decoder = handle.stats()["decoder"]
        assert (decoder["calls"], decoder["sequences"]) == (4, 6)
        assert decoder["steps"] > 0 and decoder["eager_reasons"] == {"no CUDA device": decoder["steps"]}
        assert handle.stats()["generate_fallbacks"] == {}

        assert torch.equal(generate(model, single, num_beams=2), expected["beams"])
        assert handle.stats()["generate_fallbacks"] == {"generation mode beam_search": 1}
        assert handle.stats()["decoder"]["calls"] == 4
        assert "generation mode beam_search x1" in handle.format_stats()
        assert "decoder graphs: off (no CUDA device)" in handle.format_stats()
    finally:
        handle.disable()
    assert "generate" not in model.__dict__
    assert handle.decoder.graphs == {} and not handle.decoder.captured
    assert torch.equal(generate(model, batch, do_sample=False), expected["batch"])


def test_calls_past_the_static_cache_go_to_stock(model):
    """A batch or a sequence larger than the decoder's static cache goes to the stock generate,
    counted with its reason (no second cache is allocated for it); tokens as stock's."""
    batch = make_batch(model.config, GRIDS, seed=4)
    single = make_batch(model.config, GRIDS[1:2], seed=5)
    expected = {"batch": generate(model, batch, do_sample=False), "long": generate(model, single, max_new_tokens=40)}
    handle = enable_cuda_graphs(model, budgets=[64], decoder_max_batch_size=2, decoder_max_cache_len=48)
    try:
        assert torch.equal(generate(model, batch, do_sample=False), expected["batch"])
        assert torch.equal(generate(model, single, max_new_tokens=40), expected["long"])
        slots = single["input_ids"].shape[1] + 39
        assert handle.stats()["generate_fallbacks"] == {
            "batch of 3, larger than decoder max_batch_size 2": 1,
            f"sequence of {slots} cache slots, longer than decoder max_cache_len 48": 1,
        }
        assert handle.stats()["decoder"]["calls"] == 0
    finally:
        handle.disable()


def test_settings_resolve_like_generate_and_unsupported_ones_fall_back(model):
    inputs = make_batch(model.config, GRIDS[:2], seed=3)
    handle = enable_cuda_graphs(model, budgets=[64], decoder_max_batch_size=2, decoder_max_cache_len=96)
    default_config = model.generation_config
    try:
        # A checkpoint's generation config (Qwen ships repetition_penalty 1.05) is read as generate
        # reads it; an explicit argument overrides it.
        model.generation_config = GenerationConfig(**default_config.to_dict())
        model.generation_config.repetition_penalty = 1.05
        generate(model, inputs)
        generate(model, inputs, repetition_penalty=1.0)
        model.generation_config = default_config
        # Sampling: transformers' default top_k=50 is a warper the runner lacks; top_k=0 removes it.
        generate(model, inputs, do_sample=True)
        torch.manual_seed(0)
        sampled = generate(model, inputs, do_sample=True, top_k=0, temperature=0.7, top_p=0.9)
        generate(model, inputs, output_scores=True, return_dict_in_generate=True)
        generate(model, inputs, max_new_tokens=None, max_length=inputs["input_ids"].shape[1] + 3)
        with pytest.raises(ValueError, match="not used by the model"):
            generate(model, inputs, not_an_argument=1)  # a typo raises as in the stock generate
        stats = handle.stats()
    finally:
        model.generation_config = default_config
        handle.disable()
    assert stats["generate_fallbacks"] == {
        "repetition_penalty=1.05": 1,
        "top_k=50": 1,
        "output_scores=True": 1,
        "max_new_tokens not set": 1,
    }
    assert stats["decoder"]["calls"] == 2  # repetition_penalty=1.0 and top_k=0
    assert sampled.shape[0] == 2 and sampled.shape[1] > inputs["input_ids"].shape[1]


def test_decoder_false_leaves_generate_alone_and_options_are_one_object(model):
    """The settings as one `GraphOptions` (the contract), keyword settings changing some of them."""
    options = GraphOptions(budgets=[64], decoder=True, lazy=True)
    with pytest.raises(TypeError, match="decoder_cache_len"):
        enable_cuda_graphs(model, options, decoder_cache_len=64)  # no such setting: nothing enabled
    with pytest.raises(TypeError, match="options must be a GraphOptions, got dict"):
        enable_cuda_graphs(model, {"budgets": [64]})
    # Sequences become tuples: one setting compares and hashes the same however it was written.
    assert GraphOptions(budgets=(64,)) == GraphOptions(budgets=[64]) and len({options, replace(options)}) == 1
    per_path = GraphOptions(budgets={"global": [64, 128]})
    assert per_path == GraphOptions(budgets={"global": (64, 128)}) and hash(per_path) == hash(replace(per_path))
    handle = enable_cuda_graphs(model, options, decoder=False)
    try:
        assert handle.options == GraphOptions(budgets=[64], decoder=False, lazy=True)
        assert handle.manager.budgets == {"default": [64]} and handle.manager.lazy
        assert handle.decoder is None and "generate" not in model.__dict__
        assert handle.stats()["decoder"] is None
        assert "decoder graphs: off (decoder=False)" in handle.format_stats()
    finally:
        handle.disable()


def test_the_manager_and_the_runner_get_their_part_of_the_options_whole(model, monkeypatch):
    """Each setting of `GraphOptions` reaches the manager's or the runner's options object (or is
    enable's own: the backend, the decoder switch, compile), none dropped on the way; the test
    hook that poisons the encoder's pool is no setting but a module-level one of the manager."""
    from dataclasses import fields

    from encoder_graphs import DecoderOptions, EncoderOptions

    assert "poison_pool_bytes" not in {f.name for f in fields(GraphOptions)}
    with pytest.raises(TypeError, match="poison_pool_bytes"):
        enable_cuda_graphs(model, poison_pool_bytes=1 << 20)
    options = GraphOptions(budgets=[64, 128], max_items=3, max_frames=5, max_frames_per_item=4, choose_by_cost=False,
                           decoder_max_batch_size=2, decoder_max_cache_len=96, decoder_batch_sizes=[1, 2],
                           decoder_length_tiers=[32], enabled=False, lazy=True, encoder_capture_from_call=3,
                           log_interval_s=5.0)
    encoder = EncoderOptions(budgets=(64, 128), max_items=3, max_frames=5, max_frames_per_item=4, enabled=False,
                             choose_by_cost=False, lazy=True, capture_from_call=3, log_interval_s=5.0)
    decoder = DecoderOptions(max_batch_size=2, batch_sizes=(1, 2), max_cache_len=96, length_tiers=(32,),
                             enabled=False, lazy=True)
    assert (options.encoder_options, options.decoder_options) == (encoder, decoder)
    own = {"attn_backend", "decoder", "compile"}
    to_encoder = {f.name for f in fields(EncoderOptions)} - {"capture_from_call"} | {"encoder_capture_from_call"}
    to_decoder = {f"decoder_{f.name}" for f in fields(DecoderOptions)} - {"decoder_enabled", "decoder_lazy"}
    assert {f.name for f in fields(GraphOptions)} == own | to_encoder | to_decoder
    monkeypatch.setattr("encoder_graphs.engine.manager._POISON_POOL_BYTES", 1 << 20)
    handle = enable_cuda_graphs(model, options)
    try:
        assert handle.manager.options == encoder and handle.decoder.options == decoder
        assert (handle.manager.max_items, handle.manager.max_frames) == (3, 5)
        assert handle.decoder.config.buckets == [1, 2] and handle.decoder.config.length_tiers == [32, 96]
        assert handle.manager._graphs.poison_bytes == 1 << 20
    finally:
        handle.disable()


def test_a_tuple_asked_of_the_features_is_stocks(model):
    """`return_dict=False` gives stock's tuple (its first entry the tower's last hidden state, which
    the graphs do not keep), from the stock method: the manager is not called."""
    from synthetic_prompts import random_pixels

    pixels = random_pixels(model.config.vision_config, GRIDS, torch.Generator().manual_seed(1))
    grid = torch.tensor(GRIDS)
    with torch.inference_mode():
        stock = model.get_image_features(pixels, grid, return_dict=False)
    handle = enable_cuda_graphs(model, budgets=[64], decoder=False)
    try:
        with torch.inference_mode():
            got = model.get_image_features(pixels, grid, return_dict=False)
            graphed = model.get_image_features(pixels, grid).pooler_output
        assert handle.stats()["encoder"]["calls"] == 1
    finally:
        handle.disable()
    assert isinstance(got, tuple) and len(got) == len(stock)
    torch.testing.assert_close(got, stock, rtol=1e-4, atol=1e-4)  # stock over the aligned weights
    torch.testing.assert_close(tuple(graphed), tuple(stock[1]), rtol=1e-4, atol=1e-4)


def test_token_id_list_accepts_what_generation_configs_hold():
    from encoder_graphs.decoder.generation import token_id_list

    assert token_id_list(None) == []
    assert token_id_list(7) == [7]
    assert token_id_list([3, 4]) == [3, 4]
    assert token_id_list(torch.tensor([5, 6])) == [5, 6]
