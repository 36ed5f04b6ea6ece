"""Which `generate` calls the graphed `generate` takes: an allow-list of settings, arguments and
model inputs; anything else set goes to the stock `generate` (same tokens) and is counted by
reason. A tiny Qwen2-VL, fp32, saved and reloaded for real."""

import pytest
import torch
from test_decoder import make_batch

from encoder_graphs import enable_cuda_graphs
from encoder_graphs.decoder import generation
from encoder_graphs.decoder.generation import StockOnly, runner_arguments
from encoder_graphs.presets import PRESETS, build_model
from encoder_graphs.seam.generation import generation_settings

NEW_TOKENS = 8
GRIDS = [(1, 4, 4), (1, 8, 6)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen2-vl")
    build_model("tiny-qwen2-vl", seed=3).save_pretrained(path)
    return PRESETS["tiny-qwen2-vl"].model_class.from_pretrained(path).eval()


def generate(model, inputs, **kwargs):
    with torch.inference_mode():
        return model.generate(**inputs, max_new_tokens=NEW_TOKENS, **kwargs)


def test_settings_outside_the_allow_list_go_to_stock_and_are_counted(model, monkeypatch):
    inputs = make_batch(model.config, GRIDS, seed=1)
    calls = {  # settings that change tokens and that the runner does not implement
        "repetition_penalty=1.3": dict(do_sample=False, repetition_penalty=1.3),
        "no_repeat_ngram_size=2": dict(do_sample=False, no_repeat_ngram_size=2),
        "min_p=0.2": dict(do_sample=True, top_k=0, min_p=0.2),
    }
    expected = {}
    for reason, kwargs in calls.items():
        torch.manual_seed(0)
        expected[reason] = generate(model, inputs, **kwargs)
    # A setting a later transformers adds (here: one the running transformers is told it defines,
    # set in the checkpoint's generation config, which the stock generate then ignores).
    monkeypatch.setattr(generation, "generation_settings", lambda: (*generation_settings(), "new_setting"))
    default_config = model.generation_config
    handle = enable_cuda_graphs(model, budgets=[64], decoder_max_batch_size=2, decoder_max_cache_len=64)
    try:
        for reason, kwargs in calls.items():
            torch.manual_seed(0)
            assert torch.equal(generate(model, inputs, **kwargs), expected[reason]), reason
        greedy = generate(model, inputs, do_sample=False)
        model.generation_config = default_config.__class__(**default_config.to_dict())
        model.generation_config.new_setting = 3
        assert torch.equal(generate(model, inputs, do_sample=False), greedy)
        stats = handle.stats()
    finally:
        model.generation_config = default_config
        handle.disable()
    assert stats["generate_fallbacks"] == {**dict.fromkeys(calls, 1), "new_setting=3": 1}
    assert stats["decoder"]["calls"] == 1  # the plain greedy call alone reached the graphs


def test_handled_settings_reach_the_graphs_and_keep_stocks_tokens(model):
    inputs = make_batch(model.config, GRIDS, seed=2)
    calls = [
        dict(do_sample=False, repetition_penalty=1.0, no_repeat_ngram_size=0),  # inactive values
        dict(do_sample=False, top_k=5, min_p=0.3, typical_p=0.5),  # sampling warpers: greedy ignores them
        dict(do_sample=False, num_beams=1, length_penalty=2.0, renormalize_logits=True),  # no effect here
    ]
    expected = [generate(model, inputs, **kwargs) for kwargs in calls]
    default_config = model.generation_config
    handle = enable_cuda_graphs(model, budgets=[64], decoder_max_batch_size=2, decoder_max_cache_len=64)
    try:
        got = [generate(model, inputs, **kwargs) for kwargs in calls]
        # A checkpoint's own extra key, which transformers does not define, is ignored as there.
        model.generation_config = default_config.__class__(**default_config.to_dict())
        model.generation_config.chat_format = "chatml"
        got.append(generate(model, inputs, do_sample=False))
        stats = handle.stats()
    finally:
        model.generation_config = default_config
        handle.disable()
    assert all(torch.equal(g, e) for g, e in zip(got, [*expected, expected[0]]))
    assert stats["generate_fallbacks"] == {}
    assert stats["decoder"]["calls"] == len(calls) + 1


def test_model_inputs_outside_the_familys_list_go_to_stock(model):
    inputs = make_batch(model.config, GRIDS, seed=3)
    arguments = runner_arguments(model, None, None, dict(inputs, max_new_tokens=2))
    assert set(arguments) >= set(inputs) and arguments["max_new_tokens"] == 2
    embeds = torch.zeros(*inputs["input_ids"].shape, model.config.get_text_config().hidden_size)
    with pytest.raises(StockOnly, match="input inputs_embeds"):
        runner_arguments(model, None, None, dict(inputs, max_new_tokens=2, inputs_embeds=embeds))
    with pytest.raises(StockOnly, match="argument streamer"):
        runner_arguments(model, None, None, dict(inputs, max_new_tokens=2, streamer=object()))


def test_every_listed_setting_is_one_transformers_defines():
    """A misspelt or removed setting in the lists would never match: the lists are checked."""
    listed = set(generation._HANDLED) | set(generation._SAMPLING)
    assert listed <= set(generation_settings()), listed - set(generation_settings())
