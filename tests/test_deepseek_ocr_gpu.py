"""DeepSeek-OCR 2 on a real GPU, the real-size preset with random weights.

Encoder, per path: graphs over NaN-poisoned pools and buffers against the stock model's own
`get_image_features`, over random calls of pages of 0 to 6 tiles (1 to 6 pages; every 10th call
small-large-small), each path with its own budgets (global in views, local in tiles). Both bf16,
each page judged against the same model in fp32 (tests/fidelity.py's encoder target: at most 1.5x
the stock bf16 error): through SAM's 12 and the encoder's 24 layers stock bf16 lies 1.5-1.7% from
fp32 (measured: bench_fidelity.py, H100), so two bf16 runs that round otherwise (a batch of the
budget's rows against the call's) lie as far apart. Decoder (a small MoE: routed experts, 6 a token of 64):
every decode step replayed, in bf16 at real size through transformers' default experts kernel
(grouped_mm); fp32 greedy tokens equal to the stock `generate`'s on the tiny preset through its
batched_mm. grouped_mm does not capture in fp32: transformers falls back there to a loop over the
experts' token counts read to the host (`offs.tolist()`), so such a step runs eagerly (counted:
the graph's capture fails and is dropped); batched_mm gathers every token's expert weights, which
at real size and a page's prompt is hundreds of GB.
"""

import copy
import random

import pytest
import torch
from fidelity import assert_encoder_within_stock_error, relative_error
from test_decoder_gpu import free_cuda_memory  # noqa: F401 (autouse)

from encoder_graphs import EncoderCudaGraphManager, enable_cuda_graphs
from encoder_graphs.models import adapter_for
from encoder_graphs.models.deepseek_ocr.adapter import GLOBAL, LOCAL, TILE_SIDE, VIEW_SIDE, Pages
from encoder_graphs.presets import build_model
from encoder_graphs.rewrites import Rewrites

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
PRESET = "deepseek-ocr-2"
BUDGETS = {GLOBAL: [1, 2, 4], LOCAL: [2, 6, 12]}  # a call's 7+ pages or 13+ tiles split or run eagerly


def random_call(rng: random.Random, call: int) -> list[int]:
    """Tiles per page: 1 to 6 pages of 0 (a page under one tile) or 2 to 6 tiles."""
    if call % 10 == 0:
        return [0, 6, 6, 6, 0]  # small-large-small: 18 tiles, over the largest local budget
    return [rng.choice([0, 2, 3, 4, 6]) for _ in range(rng.randint(1, 6))]


def pages(tiles_per_page: list[int], generator: torch.Generator) -> Pages:
    views = torch.randn(len(tiles_per_page), 3, VIEW_SIDE, VIEW_SIDE, generator=generator)
    tiles = torch.randn(sum(tiles_per_page), 3, TILE_SIDE, TILE_SIDE, generator=generator)
    return Pages(views.to("cuda", torch.bfloat16), tiles.to("cuda", torch.bfloat16), tiles_per_page)


def test_graphs_match_stock_features_per_path_with_poisoned_pool():
    model = build_model(PRESET, dtype=torch.bfloat16, device="cuda")
    inner = model.model
    adapter = adapter_for(model)
    stock_model = copy.deepcopy(inner)  # stock attention (the graphs' model is changed below)
    reference = copy.deepcopy(inner).float()  # the same weights in fp32
    adapter.align_weights(Rewrites())  # as enable_cuda_graphs does: SAM's relative positions folded into q and k
    manager = EncoderCudaGraphManager(adapter, budgets=BUDGETS, poison_pool_bytes=256 << 20, choose_by_cost=False)
    manager.capture()
    assert not manager.stats()["failed_budgets"], manager.stats()["failed_budgets"]
    manager.poison_buffers()
    rng, generator = random.Random(0), torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for call in range(20):
            tiles = random_call(rng, call)
            inputs = pages(tiles, generator)
            ours = manager.execute(inputs)
            views, local = inputs.views, inputs.tiles if sum(tiles) else None
            stock = stock_model.get_image_features(views, local, torch.tensor(tiles), return_dict=True).pooler_output
            truth = reference.get_image_features(
                views.float(), None if local is None else local.float(), torch.tensor(tiles), return_dict=True
            ).pooler_output
            for page, (got, want, exact) in enumerate(zip(ours, stock, truth, strict=True)):
                assert got.shape[0] == 256 + 144 * tiles[page] + 1
                what = f"call {call} page {page} ({tiles[page]} tiles)"
                assert_encoder_within_stock_error(got, exact, relative_error(want, exact), what)
    stats = manager.stats()
    views, local_tiles = stats["paths"][GLOBAL], stats["paths"][LOCAL]
    assert views["misses"] == 0 and max(views["replays_per_budget"]) == BUDGETS[GLOBAL][-1]
    assert local_tiles["hits"] > 0 and max(local_tiles["replays_per_budget"]) == BUDGETS[LOCAL][-1]
    print(f"\n{PRESET}: {manager.format_stats()}")


def prompts(config, tiles_per_page: list[int], generator: torch.Generator) -> dict:
    """Left-padded prompts of a page each: BOS, its image tokens, a few text tokens."""
    image = config.image_token_id
    rows = [[0] + [image] * (257 + 144 * tiles) + [5, 6, 7 + i] for i, tiles in enumerate(tiles_per_page)]
    longest = max(map(len, rows))
    ids = torch.tensor([[2] * (longest - len(row)) + row for row in rows])
    inputs = pages(tiles_per_page, generator)
    return dict(input_ids=ids.cuda(), attention_mask=(ids != 2).long().cuda(), pixel_values=inputs.views,
                pixel_values_local=inputs.tiles, num_local_patches=torch.tensor(tiles_per_page))


@pytest.mark.parametrize("preset, dtype", [("tiny-deepseek-ocr-2", torch.float32), (PRESET, torch.bfloat16)])
def test_generate_replays_every_step_and_fp32_tokens_equal_stock(preset, dtype):
    model = build_model(preset, dtype=dtype, device="cuda")
    if dtype == torch.float32:
        model.set_experts_implementation("batched_mm")  # stock and ours alike
    inputs = prompts(model.config, [0, 2, 6], torch.Generator().manual_seed(1))
    inputs = {key: value.to(dtype) if value.is_floating_point() else value for key, value in inputs.items()}
    settings = dict(max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=2)
    with torch.inference_mode():
        expected = model.generate(**inputs, **settings)
    handle = enable_cuda_graphs(model, budgets={GLOBAL: [1, 4], LOCAL: [8]}, decoder_max_batch_size=4,
                                decoder_max_cache_len=1536, choose_by_cost=False)
    try:
        with torch.inference_mode():
            got = model.generate(**inputs, **settings)
        stats = handle.stats()
    finally:
        handle.disable()
    decoder = stats["decoder"]
    print(f"\n{preset} {dtype}: decoder {decoder}")
    assert stats["generate_fallbacks"] == {}
    assert decoder["steps"] == 15 and decoder["graph_steps"] == decoder["steps"], decoder
    if dtype == torch.float32:
        assert torch.equal(got, expected)
    else:  # bf16: the same length; tokens judged by the fidelity measure (bench_fidelity.py)
        assert got.shape == expected.shape
