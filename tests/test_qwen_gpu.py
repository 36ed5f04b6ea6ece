"""Real-size Qwen-VL vision towers on CUDA (bf16, random weights): graph replays vs stock eager.

For each preset a pool of items (odd-sized images up to ~1000 px, videos of 2-16 frames) is
encoded once, item by item, by the stock transformers tower (its default attention) in bf16 and
by the same tower cast to fp32: the reference, and the stock bf16 tower's own error against it.
Then random calls, each a random handful of pool items, go through the manager with graphs
captured into a NaN-poisoned pool, and with every input buffer filled with NaN / huge integers
after capture, so stale or uncovered rows would show. Every item of every call must be finite
and within 1.5x the stock bf16 tower's error against fp32 on that item (the tolerance bf16
itself sets: tests/fidelity.py).

Runtime: CALLS random calls per preset and backend (fewer for qwen2-vl-2b, whose 32 full-attention
layers make its large budgets the slowest), one reference pass per pool item.
"""

import copy
import importlib.util
import random

import pytest
import torch
from fidelity import assert_encoder_within_stock_error, relative_error
from synthetic_prompts import left_pad, mm_token_type_ids, random_pixels, vision_span

from encoder_graphs import EncoderCudaGraphManager, enable_cuda_graphs
from encoder_graphs.engine.compile import compile_blocks
from encoder_graphs.models import VisionBatch, adapter_for
from encoder_graphs.packing import BudgetCosts
from encoder_graphs.presets import build_model, build_vision_tower
from encoder_graphs.rewrites import Rewrites

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PRESETS = ["qwen2-vl-2b", "qwen2.5-vl-3b", "qwen2.5-vl-7b", "qwen3-vl-2b", "qwen3.5-vision"]
BACKENDS = [
    "torch",
    pytest.param(
        "flashinfer",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("flashinfer") is None, reason="flashinfer is not installed"
        ),
    ),
]
CALLS = {"qwen2-vl-2b": 120, "qwen2.5-vl-3b": 200, "qwen2.5-vl-7b": 200, "qwen3-vl-2b": 200, "qwen3.5-vision": 200}
BUDGETS = [128, 512, 2048, 8192]
MAX_ITEMS, MAX_FRAMES = 8, 32
POOL_IMAGES, POOL_VIDEOS = 28, 8
MAX_PIXELS = 1024 * 1024


def smart_grid(height: int, width: int, frames: int, config) -> tuple[int, int, int]:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    factor = config.patch_size * config.spatial_merge_size
    h, w = smart_resize(
        height, width, factor=factor, min_pixels=factor * factor, max_pixels=MAX_PIXELS
    )
    return -(-frames // config.temporal_patch_size), h // config.patch_size, w // config.patch_size


def stock_item(tower, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
    """The stock tower on one item, as get_image_features runs it (Qwen3: main | deepstack)."""
    output = tower(pixels, grid_thw=torch.tensor([grid], device=pixels.device), return_dict=True)
    deepstack = getattr(output, "deepstack_features", None) or []
    return torch.cat([output.pooler_output, *deepstack], dim=-1)


@pytest.fixture(scope="module", params=PRESETS)
def pool(request):
    """(tower, items): items are (is_video, grid, pixels, (fp32 reference, the stock bf16
    tower's error against it)) built once per preset."""
    name = request.param
    tower = build_vision_tower(name, dtype=torch.bfloat16, device="cuda", seed=0)
    fp32_tower = copy.deepcopy(tower).float()
    config = tower.config
    rng = random.Random(0)
    shapes = [(False, 1, rng.randint(28, 1000), rng.randint(28, 1000)) for _ in range(POOL_IMAGES)]
    shapes += [(False, 1, 1000, 1000), (False, 1, 30, 1000)]  # the largest and the thinnest
    shapes += [
        (True, rng.randint(2, 16), rng.randint(56, 448), rng.randint(56, 448))
        for _ in range(POOL_VIDEOS)
    ]
    items = []
    generator = torch.Generator(device="cuda").manual_seed(0)
    with torch.inference_mode():
        for is_video, frames, height, width in shapes:
            grid = smart_grid(height, width, frames, config)
            pixels = random_pixels(config, [grid], generator).to(torch.bfloat16)
            fp32 = stock_item(fp32_tower, pixels.float(), grid)
            items.append((is_video, grid, pixels, (fp32, relative_error(stock_item(tower, pixels, grid), fp32))))
    del fp32_tower
    yield name, tower, items
    del tower, items
    torch.cuda.empty_cache()


def make_call(items: list, chosen: list[int]) -> VisionBatch:
    images = [items[i] for i in chosen if not items[i][0]]
    videos = [items[i] for i in chosen if items[i][0]]

    def part(group):
        if not group:
            return None, None
        pixels = torch.cat([p for _, _, p, _ in group])
        return pixels, torch.tensor([g for _, g, _, _ in group], device="cuda")

    return VisionBatch(*part(images), *part(videos)), images + videos


@pytest.mark.parametrize("backend", BACKENDS)
def test_graphs_match_stock_tower_over_random_calls(pool, backend):
    name, tower, items = pool
    adapter = adapter_for(tower, attn_backend=backend)
    attention, mlp = tower.blocks[0].attn, tower.blocks[0].mlp  # a window block in Qwen2.5-VL
    weights = {key: value.clone() for key, value in tower.blocks[0].state_dict().items()}
    rewrites = Rewrites()
    adapter.align_weights(rewrites)  # as enable_cuda_graphs does
    fused = name.startswith("qwen2.5") and backend == "torch"
    assert getattr(adapter, "fuses_windows", False) == fused
    assert ("forward" in attention.__dict__) == fused
    assert ("forward" in mlp.__dict__) == name.startswith("qwen2.5")  # gated MLPs, any backend
    assert (getattr(adapter, "_chained_forwards", None) is not None) == name.startswith("qwen2.5")  # chained blocks
    manager = EncoderCudaGraphManager(
        adapter,
        budgets=BUDGETS,
        max_items=MAX_ITEMS,
        max_frames=MAX_FRAMES,
        poison_pool_bytes=256 << 20,
        choose_by_cost=False,  # every sub-batch through its graph: this test is of the graphs
    )
    try:
        manager.capture()
        assert sorted(manager.graphs["default"]) == BUDGETS, manager.failed_budgets
        manager.poison_buffers()
        worst, stats = run_random_calls(manager, name, backend, items, CALLS[name])
    finally:
        manager.close()
        rewrites.undo()
    assert "forward" not in attention.__dict__ and "forward" not in mlp.__dict__
    assert getattr(adapter, "_chained_forwards", None) is None
    assert not any("forward" in block.__dict__ for block in tower.blocks)
    assert all(torch.equal(weights[key], value) for key, value in tower.blocks[0].state_dict().items())
    assert stats["graph_items"] == stats["items"], stats["paths"]
    assert stats["paths"]["default"]["hits"] > 0
    print(f"{name} {backend}: {stats['items']} items, worst error against fp32 {worst:.2f}x stock bf16's")


# Compiling a real-size tower costs tens of seconds: two towers of different blocks are checked.
COMPILED_PRESETS = ("qwen2.5-vl-7b", "qwen3-vl-2b")


def test_compiled_blocks_in_graphs_and_cost_choice_match_stock_tower(pool):
    """The blocks compiled (dynamic shapes) before capture, and sub-batches run the measured
    cheaper way: the same random calls stay within tolerance of the stock tower."""
    name, tower, items = pool
    if name not in COMPILED_PRESETS:
        pytest.skip(f"compiled towers are checked on {COMPILED_PRESETS}")
    adapter = adapter_for(tower, attn_backend="torch")
    rewrites = Rewrites()
    adapter.align_weights(rewrites)  # as enable_cuda_graphs does
    manager = EncoderCudaGraphManager(
        adapter, budgets=BUDGETS, max_items=MAX_ITEMS, max_frames=MAX_FRAMES, poison_pool_bytes=256 << 20
    )
    # A guard on each block's own modules (the chained forwards hold the next block's norm) would
    # compile block by block up to dynamo's limit and leave the blocks past it eager: fail instead.
    torch._dynamo.utils.counters.clear()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        compiled = compile_blocks(adapter.repeated_blocks(), manager.warm_up, rewrites)
        try:
            assert compiled.error is None and compiled.blocks == len(tower.blocks), compiled.error
            manager.capture()
            assert sorted(manager.graphs["default"]) == BUDGETS, manager.failed_budgets
            assert sorted(manager.costs["default"].replay_ms) == BUDGETS
            manager.poison_buffers()
            worst, by_cost = run_random_calls(manager, name, "compiled, by cost", items, CALLS[name] // 2)
            manager.costs["default"] = BudgetCosts()  # unmeasured: every fitting sub-batch replays
            manager.reset_stats()
            worst_graphs, graphs = run_random_calls(manager, name, "compiled, graphs", items, CALLS[name] // 2)
        finally:
            manager.close()
            rewrites.undo()
    graphs_compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs["graph_items"] == graphs["items"], graphs["paths"]
    print(f"{name} compiled in {compiled.seconds:.1f} s ({graphs_compiled} graphs): {by_cost['items']} items by cost, "
          f"worst error against fp32 {worst:.2f}x stock bf16's, misses {by_cost['paths']['default']['miss_reasons']}, "
          f"costs {by_cost['budget_costs_ms']['default']}; all graphed: {worst_graphs:.2f}x")


def run_random_calls(manager, name: str, label: str, items: list, count: int) -> tuple[float, dict]:
    """`count` random calls of pool items (small, large, small first: stale rows must not leak);
    every output checked against its fp32 reference, within 1.5x the stock bf16 tower's error.
    The worst ratio of ours' error to stock's, the stats."""
    rng = random.Random(1)
    small = min(range(len(items)), key=lambda i: items[i][1][1] * items[i][1][2])
    large = [i for i in range(len(items)) if not items[i][0]][-2]  # the 1000x1000 image
    calls = [[small], [large] + [small] * 3, [small]]  # small, large, small: stale rows must not leak
    calls += [rng.sample(range(len(items)), rng.randint(1, 6)) for _ in range(count - len(calls))]
    worst = 0.0
    with torch.inference_mode():
        for chosen in calls:
            batch, ordered = make_call(items, chosen)
            outputs = manager.execute(batch)
            assert len(outputs) == len(ordered)
            for got, (_, grid, _, (fp32, stock_error)) in zip(outputs, ordered):
                ratio = assert_encoder_within_stock_error(got, fp32, stock_error, f"{name} {label} {grid}")
                worst = max(worst, ratio)
    return worst, manager.stats()


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-qwen3.5"])
def test_enable_cuda_graphs_on_cuda_keeps_generation(name, monkeypatch):
    """The plugin entry on CUDA: graphs captured, forward and generate go through them."""
    model = build_model(name, dtype=torch.bfloat16, device="cuda", seed=0)
    config = model.config
    grids = [(1, 8, 12), (1, 22, 14)]
    generator = torch.Generator(device="cuda").manual_seed(0)
    pixels = random_pixels(config.vision_config, grids, generator).to(torch.bfloat16)
    ids = [5]
    for grid in grids:
        ids += vision_span(config, grid)
    inputs = left_pad([ids])
    inputs["mm_token_type_ids"] = mm_token_type_ids(inputs["input_ids"], config)
    inputs = {key: value.cuda() for key, value in inputs.items()}
    inputs.update(pixel_values=pixels, image_grid_thw=torch.tensor(grids, device="cuda"))
    fp32_model = copy.deepcopy(model).float()
    with torch.inference_mode():
        fp32 = fp32_model.get_image_features(pixels.float(), inputs["image_grid_thw"]).pooler_output
        stock = model.get_image_features(pixels, inputs["image_grid_thw"]).pooler_output
        monkeypatch.setattr("encoder_graphs.engine.manager._POISON_POOL_BYTES", 16 << 20)  # the manager enable makes
        handle = enable_cuda_graphs(model, budgets=[64, 256], choose_by_cost=False)
        ours = model.get_image_features(pixels, inputs["image_grid_thw"]).pooler_output
        generated = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        stats = handle.stats()["encoder"]
        handle.disable()
    for got, want, reference in zip(ours, stock, fp32, strict=True):
        assert_encoder_within_stock_error(got, reference, relative_error(want, reference), name)
    assert stats["graph_items"] == stats["items"] == 2 * len(grids)
    assert generated.shape[1] == inputs["input_ids"].shape[1] + 4
    assert "get_image_features" not in model.model.__dict__
