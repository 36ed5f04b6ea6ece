"""torch.compile of the encoder blocks and decode layers (`enable_cuda_graphs(..., compile=True)`) on the CPU:
inductor's code gives the stock tower's features, the statistics name what was compiled, and
`disable()` leaves the blocks uncompiled. A compiler failure leaves the blocks as they were.
(On CUDA, tests/test_qwen_gpu.py checks compiled blocks inside the graphs.)"""

import pytest
import torch
from synthetic_prompts import random_pixels
from test_decoder import NO_EOS, hf_generate, make_batch
from torch import nn

from encoder_graphs import enable_cuda_graphs
from encoder_graphs.decoder.layers.stack import pointwise_parts
from encoder_graphs.engine.compile import compile_blocks
from encoder_graphs.presets import build_model
from encoder_graphs.rewrites import Rewrites

GRIDS = [(1, 8, 8), (1, 12, 20), (2, 8, 12)]

pytestmark = pytest.mark.slow  # inductor compiles / torchrun jobs: the quick command skips them


def test_compiled_blocks_give_the_stock_features_and_disable_undoes_them():
    model = build_model("tiny-qwen2.5-vl", seed=3)
    pixels = random_pixels(model.config.vision_config, GRIDS, torch.Generator().manual_seed(0))
    grid_thw = torch.tensor(GRIDS)
    with torch.inference_mode():
        stock = model.get_image_features(pixels, grid_thw).pooler_output
    torch._dynamo.utils.counters.clear()
    handle = enable_cuda_graphs(model, compile=True, decoder=False)  # the language model's parts: below
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0, "the warm-up compiled nothing"
    # Other sizes reuse the warm-up's one dynamic-shape compilation (eager calls on the CPU).
    with torch.inference_mode(), torch._dynamo.config.patch(error_on_recompile=True):
        ours = model.get_image_features(pixels, grid_thw).pooler_output
        single = model.get_image_features(pixels[:64], grid_thw[:1]).pooler_output
    compile_stats = handle.stats()["encoder"]["compile"]
    assert compile_stats["blocks"] == len(model.model.visual.blocks) and compile_stats["error"] is None
    assert "blocks compiled" in handle.format_stats()
    assert all(block._compiled_call_impl is not None for block in model.model.visual.blocks)
    for got, want in zip(ours, stock, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(single[0], stock[0], rtol=1e-4, atol=1e-4)
    handle.disable()
    assert all(block._compiled_call_impl is None for block in model.model.visual.blocks)


def test_a_compiler_failure_warns_and_leaves_the_blocks_uncompiled():
    blocks = [nn.Linear(4, 4), nn.Linear(4, 4)]

    def warm_up() -> None:
        raise RuntimeError("no C++ compiler")

    with pytest.warns(UserWarning, match="no C\\+\\+ compiler"):
        compiled = compile_blocks(blocks, warm_up, Rewrites())
    assert compiled.error == "RuntimeError: no C++ compiler"
    assert compiled.stats()["blocks"] == 0
    assert all(block._compiled_call_impl is None for block in blocks)


def test_no_blocks_run_no_warm_up():
    """A family whose compiled blocks measured slower gives none (DeepSeek-OCR): its warm-up would
    be an eager forward for nothing."""

    def warm_up() -> None:
        raise AssertionError("warmed up with nothing to compile")

    assert compile_blocks([], warm_up, Rewrites()).stats() == {"blocks": 0, "seconds": 0.0, "error": None}


def test_the_undo_gives_back_a_compilation_made_before():
    """A block the user compiled before keeps that compilation after the undo; the others none."""
    blocks = [nn.Linear(4, 4), nn.Linear(4, 4)]
    blocks[0].compile()
    users = blocks[0]._compiled_call_impl
    rewrites = Rewrites()
    compiled = compile_blocks(blocks, lambda: None, rewrites)
    assert compiled.blocks == 2 and blocks[0]._compiled_call_impl is not users
    rewrites.undo()
    assert blocks[0]._compiled_call_impl is users and "_compiled_call_impl" not in vars(blocks[1])


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-qwen3-vl", "tiny-qwen3.5"])
def test_compiled_decode_layers_generate_the_stock_tokens(name):
    """The decode step's layers and the prefill's MLPs and norms compiled with the encoder:
    `generate`'s tokens (fp32; the runner's eager path on the CPU); the warm-up compiled every
    batch and length, so calls of other sizes compile nothing new."""
    model = build_model(name, seed=4)
    calls = [
        make_batch(model.config, grids=[(1, 4, 4), (1, 8, 6)], seed=1),
        make_batch(model.config, grids=[(1, 4, 8)], seed=2),
        make_batch(model.config, grids=[(1, 8, 8), (1, 4, 4), (1, 4, 6)], seed=3),
    ]
    expected = [hf_generate(model, inputs, eos_token_id=NO_EOS) for inputs in calls]
    handle = enable_cuda_graphs(model, compile=True, decoder_max_batch_size=4, decoder_max_cache_len=96)
    try:
        layers = handle.decoder.stack.layers
        assert all(layer._compiled_call_impl is not None for layer in layers)
        parts = [*model.model.visual.blocks, *pointwise_parts(model), *layers]
        assert handle.stats()["encoder"]["compile"]["blocks"] == len(parts)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for inputs, want in zip(calls, expected, strict=True):
                assert torch.equal(hf_generate(model, inputs, eos_token_id=NO_EOS), want)
    finally:
        handle.disable()
    assert all(part._compiled_call_impl is None for part in parts)
