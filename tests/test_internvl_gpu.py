"""InternVL on a real GPU, real-size presets with random weights.

Encoder: graphs over NaN-poisoned pools and buffers against the stock model's own
`get_image_features`, over random calls of images (1-13 tiles) and videos (up to 32 frames).
Decoder (1-D positions, Qwen2 and Qwen3 layers, InternVL3's dynamic rotary scaling): fp32 greedy
tokens identical to the stock `generate`; bf16 replay identical to the runner's eager steps and
parting from `generate` only at near-ties, as for Qwen (tests/test_decoder_gpu.py says why).
"""

import random

import pytest
import torch
from synthetic_prompts import left_pad, tile_prompt
from test_decoder_gpu import assert_parts_only_at_close_logits, free_cuda_memory  # noqa: F401 (autouse)

from encoder_graphs import DecoderGraphRunner, EncoderCudaGraphManager, enable_cuda_graphs
from encoder_graphs.models import adapter_for
from encoder_graphs.presets import build_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# (preset, random calls, budgets in tiles: None = the adapter's 1..64)
ENCODER_CASES = [("internvl3-1b", 200, None), ("internvl3.5-2b", 100, None), ("internvl3-38b-vision", 20, [1, 4, 16, 32])]
DECODER_PRESETS = ["internvl3-1b", "internvl3.5-2b"]
# Tiles per prompt: prompts of 1039 (batch of 3) and 775 (batch of 1) tokens cross a tier mid-generation.
CASES = {"batch of 3, left padded": [2, 1, 4], "batch of 1": [3]}
CACHE_LEN = 1088
LENGTH_TIERS = [784, 1048]
ALL_TIERS = {*LENGTH_TIERS, CACHE_LEN}
NEW_TOKENS = 24


def random_call(rng: random.Random, call: int) -> list[int]:
    """Tiles per item: images of 1-13 tiles, sometimes a video of 2-32 frames; every 25th call
    small-large-small."""
    items = [rng.randint(1, 13) for _ in range(rng.randint(1, 4))]
    if rng.random() < 0.3:
        items.append(rng.randint(2, 32))
    if call % 25 == 0:
        items = [1, 13, 32, 1]
    return items


def assert_close_bf16(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert out.shape == ref.shape, what
    assert torch.isfinite(out).all(), what
    error = (out.float() - ref.float()).norm() / ref.float().norm()
    assert error < 2e-2, f"{what}: relative error {error:.3e}"


@pytest.mark.parametrize("name, calls, budgets", ENCODER_CASES)
def test_graphs_match_stock_features_with_poisoned_pool(name, calls, budgets):
    model = build_model(name, dtype=torch.bfloat16, device="cuda")
    inner = model.model
    manager = EncoderCudaGraphManager(adapter_for(model), budgets=budgets, poison_pool_bytes=256 << 20,
                                      choose_by_cost=False)
    manager.capture()
    assert not manager.stats()["failed_budgets"], manager.stats()["failed_budgets"]
    manager.poison_buffers()
    rng = random.Random(0)
    side = model.config.vision_config.image_size[0]
    largest = manager.budgets["tiles"][-1]
    with torch.inference_mode():
        for call in range(calls):
            tiles = sum(random_call(rng, call))
            pixels = torch.randn(tiles, 3, side, side, device="cuda", dtype=torch.bfloat16)
            ours = torch.stack(manager.execute(pixels))
            stock = type(inner).get_image_features(inner, pixels, return_dict=True).pooler_output
            assert_close_bf16(ours, stock, f"{name} call {call} ({tiles} tiles)")
    stats = manager.stats()
    assert stats["graph_items"] == stats["items"], stats["paths"]  # every tile fits a budget
    assert stats["paths"]["tiles"]["misses"] == 0 and max(stats["paths"]["tiles"]["replays_per_budget"]) == largest
    print(f"\n{name}: {manager.format_stats()}")


@pytest.mark.parametrize("backend", ["torch", "flashinfer"])
def test_dense_attention_backends_match_sdpa(backend):
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    model = build_model("internvl3-1b", dtype=torch.bfloat16, device="cuda")
    pixels = torch.randn(5, 3, 448, 448, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        sdpa = adapter_for(model).eager_forward(pixels, "tiles")["features"]
        ours = EncoderCudaGraphManager(adapter_for(model, attn_backend=backend), budgets=[4, 8], choose_by_cost=False)
        ours.capture()
        got = torch.stack(ours.execute(pixels))
    assert_close_bf16(got, sdpa, backend)
    assert ours.stats()["graph_items"] == 5


def make_cases(config, dtype):
    cases = {}
    for seed, (case, tiles) in enumerate(CASES.items()):
        rng = torch.Generator().manual_seed(seed)
        inputs = left_pad([tile_prompt(config, t, 3 + i, 4 + 3 * i, rng) for i, t in enumerate(tiles)])
        side = config.vision_config.image_size[0]
        inputs["pixel_values"] = torch.randn(sum(tiles), 3, side, side, generator=rng).to(dtype)
        cases[case] = {key: value.cuda() for key, value in inputs.items()}
    assert {case: inputs["input_ids"].shape[1] for case, inputs in cases.items()} == {
        "batch of 3, left padded": 1039,
        "batch of 1": 775,
    }
    return cases


def enable_graphs(model):
    return enable_cuda_graphs(
        model,
        budgets=[1, 8],
        decoder_max_batch_size=4,
        decoder_max_cache_len=CACHE_LEN,
        decoder_length_tiers=LENGTH_TIERS,
        choose_by_cost=False,  # these tests are of the graphs: every fitting sub-batch replays
    )


def greedy(generate, inputs, **kwargs):
    with torch.inference_mode():
        return generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS, **kwargs)


def assert_all_replayed(stats):
    decoder, encoder = stats["decoder"], stats["encoder"]
    assert stats["generate_fallbacks"] == {}
    assert decoder["steps"] > 0 and decoder["graph_steps"] == decoder["steps"], decoder
    assert set(decoder["replays_per_bucket"]) == {1, 4}, decoder
    assert set(decoder["replays_per_tier"]) == ALL_TIERS, decoder
    assert encoder["graph_items"] == encoder["items"] == sum(map(sum, CASES.values())), encoder


@pytest.mark.parametrize("name", DECODER_PRESETS)
def test_fp32_greedy_tokens_identical_to_generate(name):
    model = build_model(name, dtype=torch.float32, device="cuda")
    cases = make_cases(model.config, torch.float32)
    expected = {case: greedy(model.generate, inputs) for case, inputs in cases.items()}
    handle = enable_graphs(model)
    try:
        got = {case: greedy(model.generate, inputs) for case, inputs in cases.items()}
        stats = handle.stats()
        print(f"\n{name} fp32\n{handle.format_stats()}")
    finally:
        handle.disable()
    for case in cases:
        assert torch.equal(got[case], expected[case]), f"{name} {case}"
    new_tokens = torch.cat([expected[case][:, cases[case]["input_ids"].shape[1] :].flatten() for case in cases])
    assert len(set(new_tokens.tolist())) > 2
    assert_all_replayed(stats)


@pytest.mark.parametrize("name", DECODER_PRESETS)
def test_bf16_replay_equals_eager_steps_and_parts_from_generate_only_at_close_logits(name):
    model = build_model(name, dtype=torch.bfloat16, device="cuda")
    cases = make_cases(model.config, torch.bfloat16)
    stock_generate = model.generate
    handle = enable_graphs(model)
    try:
        got = {case: greedy(model.generate, inputs) for case, inputs in cases.items()}
        stats = handle.stats()
        eager = DecoderGraphRunner(
            model, max_batch_size=4, max_cache_len=CACHE_LEN, length_tiers=LENGTH_TIERS, enabled=False
        )
        batch = dict(cases["batch of 3, left padded"])
        eager_tokens = eager.generate(batch.pop("input_ids"), batch.pop("attention_mask"), max_new_tokens=NEW_TOKENS, **batch)
        stock = {
            case: greedy(stock_generate, inputs, output_scores=True, return_dict_in_generate=True)
            for case, inputs in cases.items()
        }
    finally:
        handle.disable()
    assert torch.equal(got["batch of 3, left padded"], eager_tokens)
    assert_all_replayed(stats)
    for case, inputs in cases.items():
        assert_parts_only_at_close_logits(f"{name} {case}", got[case], stock[case], inputs["input_ids"].shape[1])
