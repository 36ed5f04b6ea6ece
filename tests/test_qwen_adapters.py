"""Qwen-VL adapters on tiny models (CPU, fp32): our paths equal the model's own features.

Each model is written with save_pretrained and loaded with the real from_pretrained. Image grids
come from the processors' own resize rule (smart_resize) applied to odd sizes; pixel rows are
random (the tower does not care where they came from).
"""

import random

import pytest
import torch
from synthetic_prompts import left_pad, mm_token_type_ids, random_pixels, vision_span
from transformers import AutoModelForImageTextToText, LlamaConfig, LlamaForCausalLM
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from encoder_graphs import EncoderCudaGraphManager, enable_cuda_graphs
from encoder_graphs.models import VisionBatch, adapter_for, supported_architectures
from encoder_graphs.models.qwen.vision import pad_offsets
from encoder_graphs.presets import build_model
from encoder_graphs.protocols import SupportsEncoderCudaGraph
from encoder_graphs.rewrites import Rewrites

FAMILIES = ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-qwen3.5"]
ODD_SIZES = [(37, 211), (333, 97), (501, 499), (64, 64), (120, 450), (29, 29)]
MAX_PIXELS = 320 * 320


@pytest.fixture(scope="module", params=FAMILIES)
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    build_model(request.param, seed=1).save_pretrained(path)
    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


def image_grid(model, height: int, width: int, frames: int = 1) -> tuple[int, int, int]:
    config = model.config.vision_config
    factor = config.patch_size * config.spatial_merge_size
    h, w = smart_resize(height, width, factor=factor, min_pixels=factor * factor, max_pixels=MAX_PIXELS)
    t = -(-frames // config.temporal_patch_size)  # the processors repeat the last frame to fill
    return t, h // config.patch_size, w // config.patch_size


def make_batch(model, images: list, videos: list, seed: int = 0) -> VisionBatch:
    """`images`: (height, width); `videos`: (frames, height, width)."""
    generator = torch.Generator().manual_seed(seed)

    def part(grids):
        if not grids:
            return None, None
        return random_pixels(model.config.vision_config, grids, generator), torch.tensor(grids, dtype=torch.long)

    pixel_values, image_grid_thw = part([image_grid(model, h, w) for h, w in images])
    pixel_values_videos, video_grid_thw = part([image_grid(model, h, w, f) for f, h, w in videos])
    return VisionBatch(pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw)


def reference_items(model, batch: VisionBatch) -> list[torch.Tensor]:
    """The model's own features, one tensor per item (Qwen3: main | deepstack levels)."""
    items = []
    with torch.no_grad():
        for method, pixels, grid in (
            (model.model.get_image_features, batch.pixel_values, batch.image_grid_thw),
            (model.model.get_video_features, batch.pixel_values_videos, batch.video_grid_thw),
        ):
            if pixels is None:
                continue
            output = method(pixels, grid)
            main = list(output.pooler_output)
            deepstack = getattr(output, "deepstack_features", None)
            if deepstack:
                sizes = [m.shape[0] for m in main]
                # One tensor per level (transformers 5.17) or already one per item (>= 5.18).
                levels = [torch.split(level, sizes) if torch.is_tensor(level) else level for level in deepstack]
                main = [torch.cat([m, *(level[i] for level in levels)], -1) for i, m in enumerate(main)]
            items += main
    return items


def assert_items_close(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        assert got.shape == want.shape
        assert torch.isfinite(got).all()
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)


CASES = {
    "odd_images": (ODD_SIZES, []),
    "one_image": ([(501, 499)], []),
    "video_2_frames": ([], [(2, 90, 130)]),
    "video_3_frames": ([], [(3, 77, 61)]),
    "videos_8_and_32_frames": ([], [(8, 100, 60), (32, 64, 96)]),
    "mixed": ([(37, 211), (250, 250)], [(6, 90, 70), (16, 56, 84)]),
}


@pytest.mark.parametrize("case", CASES)
def test_eager_forward_equals_model_features(model, case):
    images, videos = CASES[case]
    batch = make_batch(model, images, videos)
    adapter = adapter_for(model)
    assert isinstance(adapter, SupportsEncoderCudaGraph)
    specs = adapter.get_item_specs(batch)
    with torch.no_grad():
        outputs = adapter.eager_forward(batch, "default")
    actual = adapter.postprocess({"default": outputs}, specs)
    assert_items_close(actual, reference_items(model, batch))
    assert [s.frames for s in specs] == [t for t, _, _ in batch.grids]


def test_manager_on_cpu_equals_model_features(model):
    """The manager runs eagerly on CPU: packing, select_items and postprocess keep item order."""
    batch = make_batch(model, ODD_SIZES[:4], [(8, 100, 60), (2, 64, 64)], seed=3)
    manager = EncoderCudaGraphManager(adapter_for(model), budgets=[64, 128], max_items=2)
    manager.capture()
    assert_items_close(manager.execute(batch), reference_items(model, batch))
    assert manager.stats()["items"] == len(batch.grids)


def fill_like_manager(capture_values: dict, replay_values: dict) -> dict:
    """Buffers as the manager leaves them: stale NaN / huge values, tail zeroed, head copied."""
    buffers = {}
    for key, template in capture_values.items():
        buffer = template.clone()
        buffer.fill_(float("nan") if buffer.is_floating_point() else 2**30)
        value = replay_values[key]
        buffer[: value.shape[0]].copy_(value)
        buffer[value.shape[0] :].zero_()
        buffers[key] = buffer
    return buffers


@pytest.mark.parametrize("budget", [128, 1024])
def test_padded_graph_forward_equals_model_features(model, budget):
    """graph_forward, run eagerly on a larger budget's padded buffers, equals the model and is
    finite: the padded tail is covered by dummy segments, whatever the buffers held before."""
    batch = make_batch(model, [(37, 211), (120, 450)], [(5, 64, 96)], seed=5)
    adapter = adapter_for(model)
    order = [2, 0, 1]  # a sub-batch in packing order, not input order
    subset = adapter.select_items(batch, order)
    specs = adapter.get_item_specs(subset)
    assert sum(s.output_tokens for s in specs) < budget
    max_items, max_frames = 4, 8
    capture = adapter.prepare_capture_inputs(budget, max_items, max_frames, "default")
    replay = adapter.prepare_replay_buffers(subset, max_items, max_frames, "default", budget=budget)
    buffers = fill_like_manager(capture.values, replay.values)
    with torch.no_grad():
        outputs = adapter.graph_forward({**buffers, **capture.static}, "default")
    embeds = outputs["embeds"]
    assert embeds.shape[0] == budget
    assert torch.isfinite(embeds).all()
    rows = sum(s.output_tokens for s in specs)
    actual = adapter.postprocess({"default": {"embeds": embeds[:rows]}}, specs)
    expected = reference_items(model, batch)
    assert_items_close(actual, [expected[i] for i in order])


def test_capture_sizes_are_prefixes_of_the_largest_budget(model):
    """The manager keeps one buffer per key, sized by the largest budget: every other budget's
    capture input must be a prefix of it (same trailing shape, fewer or equal rows)."""
    adapter = adapter_for(model)
    largest = adapter.prepare_capture_inputs(1024, 8, 16, "default")
    for budget in (64, 256):
        capture = adapter.prepare_capture_inputs(budget, 8, 16, "default")
        assert capture.values.keys() == largest.values.keys()
        for key, value in capture.values.items():
            assert value.shape[1:] == largest.values[key].shape[1:]
            assert value.shape[0] <= largest.values[key].shape[0]
        assert capture.static["max_seqlen"] == budget * 4


def test_pad_offsets_covers_the_tail_with_bounded_segments():
    offsets = torch.tensor([0, 16, 40], dtype=torch.int32)
    padded = pad_offsets(offsets, length=12, capacity=256, chunk=64)
    assert padded.tolist() == [0, 16, 40, 104, 168, 232, 256, 256, 256, 256, 256, 256]
    assert pad_offsets(offsets, length=4, capacity=256, chunk=256).tolist() == [0, 16, 40, 256]
    assert pad_offsets(torch.tensor([0, 64], dtype=torch.int32), 3, 64, 64).tolist() == [0, 64, 64]
    with pytest.raises(ValueError, match="segments"):
        pad_offsets(offsets, length=3, capacity=256, chunk=256)


def model_inputs(model, batch: VisionBatch) -> dict:
    """input_ids with one placeholder run per image and per video (Qwen3: per video frame)."""
    config = model.config
    per_frame = config.model_type in ("qwen3_vl", "qwen3_5")
    ids = [5, 6]
    for index, (t, h, w) in enumerate(batch.grids):
        is_video = batch.image_grid_thw is None or index >= len(batch.image_grid_thw)
        runs = [(1, h, w)] * t if per_frame and is_video else [(t, h, w)]
        for run in runs:
            ids += vision_span(config, run, video=is_video) + [7]
    inputs = left_pad([ids])
    inputs["mm_token_type_ids"] = mm_token_type_ids(inputs["input_ids"], config)
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        if getattr(batch, key) is not None:
            inputs[key] = getattr(batch, key)
    return inputs


def test_enable_cuda_graphs_keeps_logits_and_disable_restores(model):
    batch = make_batch(model, [(37, 211), (120, 90)], [(4, 64, 96)], seed=7)
    inputs = model_inputs(model, batch)
    with torch.no_grad():
        before = model(**inputs).logits
        handle = enable_cuda_graphs(model, budgets=[64, 256])
        assert "get_image_features" in model.model.__dict__
        with pytest.raises(RuntimeError, match="already enabled"):
            enable_cuda_graphs(model)
        during = model(**inputs).logits
        generated = model.generate(**inputs, max_new_tokens=2, do_sample=False)
        items = handle.stats()["encoder"]["items"]
        handle.disable()
        after = model(**inputs).logits
    torch.testing.assert_close(during, before, rtol=1e-5, atol=1e-5 * before.abs().max().item())
    assert torch.equal(after, before)
    assert items == 2 * len(batch.grids)  # forward, then generate's prefill
    assert generated.shape[1] == inputs["input_ids"].shape[1] + 2
    for owner in (model, model.model):
        assert "get_image_features" not in owner.__dict__
        assert "get_video_features" not in owner.__dict__
    assert model.config.vision_config._attn_implementation == "sdpa"


def test_features_through_graphs_match_stock_structure(model):
    batch = make_batch(model, [(64, 64), (90, 200)], [], seed=9)
    with torch.no_grad():
        stock = model.get_image_features(batch.pixel_values, batch.image_grid_thw)
        handle = enable_cuda_graphs(model, budgets=[64])
        try:
            ours = model.get_image_features(batch.pixel_values, batch.image_grid_thw)
        finally:
            handle.disable()
    assert type(ours) is type(stock)
    assert isinstance(ours.pooler_output, tuple) and len(ours.pooler_output) == 2
    for got, want in zip(ours.pooler_output, stock.pooler_output):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if getattr(stock, "deepstack_features", None) is not None:
        assert len(ours.deepstack_features) == len(stock.deepstack_features)
        for got, want in zip(ours.deepstack_features, stock.deepstack_features):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_unsupported_architecture_lists_supported_ones():
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    llama = LlamaForCausalLM(config)
    for call in (lambda: adapter_for(llama), lambda: enable_cuda_graphs(llama)):
        with pytest.raises(ValueError) as error:
            call()
        for architecture in supported_architectures():
            assert architecture in str(error.value)


def test_random_mixes_equal_model_features(model):
    rng = random.Random(11)
    adapter = adapter_for(model)
    manager = EncoderCudaGraphManager(adapter, budgets=[64, 256, 512], max_items=3)
    for call in range(3):
        images = [(rng.randint(20, 500), rng.randint(20, 500)) for _ in range(rng.randint(0, 3))]
        videos = [(rng.randint(2, 20), rng.randint(40, 150), rng.randint(40, 150))]
        batch = make_batch(model, images, videos[: rng.randint(0 if images else 1, 1)], seed=call)
        assert_items_close(manager.execute(batch), reference_items(model, batch))



def test_patch_embedding_runs_as_a_gemm_until_restored(model):
    """`align_weights` runs the stock Conv3d patch embedding as the GEMM it equals (same weights);
    the undo gives the module its own forward back."""
    embed = model.model.visual.patch_embed
    adapter = adapter_for(model)
    config = model.config.vision_config
    pixels = torch.randn(40, config.in_channels * config.temporal_patch_size * config.patch_size**2)
    rewrites = Rewrites()
    with torch.inference_mode():
        stock = embed(pixels)
        adapter.align_weights(rewrites)
        assert "forward" in embed.__dict__
        gemm = embed(pixels)
        rewrites.undo()
    assert "forward" not in embed.__dict__
    torch.testing.assert_close(gemm, stock, rtol=1e-5, atol=1e-5)
    assert stock.abs().max() > 0.1  # the test means something
    hook = embed.forward  # an instance forward set before (as accelerate's hooks are) comes back
    embed.forward = hook
    adapter.align_weights(rewrites)
    rewrites.undo()
    rewrites.undo()  # each change is undone once
    assert embed.__dict__.pop("forward") is hook


def test_device_metadata_is_kept_per_grids_and_layout(model):
    """Sizes seen before reuse their metadata tensors (no host work, no copy); the cache stays
    bounded, and what it returns equals a fresh `metadata`."""
    from encoder_graphs.models.qwen.vision import METADATA_CACHE

    adapter = adapter_for(model)
    layout = adapter.layout(64, 4)
    first, static = adapter.device_metadata([(1, 4, 6), (1, 8, 8)], layout)
    again, _ = adapter.device_metadata([(1, 4, 6), (1, 8, 8)], layout)
    assert all(again[key] is first[key] for key in first)
    fresh, fresh_static = adapter.metadata([(1, 4, 6), (1, 8, 8)], layout)
    assert static == fresh_static and all(torch.equal(first[key], fresh[key]) for key in fresh)
    adapter.device_metadata([], layout)  # a capture's inputs: not kept
    assert len(adapter._metadata) == 1
    other, _ = adapter.device_metadata([(1, 4, 6), (1, 8, 8)], None)  # eager sizes: another entry
    assert other["position_ids"].shape[0] < first["position_ids"].shape[0]
    for side in range(METADATA_CACHE + 1):
        adapter.device_metadata([(1, 2, 2 * (side + 1))], None)
    assert len(adapter._metadata) == METADATA_CACHE
    assert adapter.device_metadata([(1, 4, 6), (1, 8, 8)], layout)[0]["position_ids"] is not first["position_ids"]
