"""InternVL on CPU: the adapter's features equal the stock `get_image_features`, `enable_cuda_graphs`
keeps `generate` token for token, the decoder runner serves its 1-D positions, the inputs are what
InternVLProcessor builds, and the caption command runs end to end. A tiny checkpoint, fp32, saved
and reloaded for real."""

import json
import random

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_internvl import write_tiny_internvl
from transformers import AutoModelForImageTextToText, GotOcr2ImageProcessorPil

from encoder_graphs import EncoderCudaGraphManager, enable_cuda_graphs
from encoder_graphs.app.cli import main
from encoder_graphs.decoder.runner import DecoderGraphRunner
from encoder_graphs.models import adapter_for
from encoder_graphs.models.internvl.inputs import InternVLInputs


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_internvl(tmp_path_factory.mktemp("tiny-internvl"))


@pytest.fixture(scope="module")
def model(checkpoint):
    return AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def inputs(checkpoint):
    return InternVLInputs.from_pretrained(checkpoint)


def stock_features(model, pixels, **kwargs):
    with torch.inference_mode():
        return type(model.model).get_image_features(model.model, pixels, return_dict=True, **kwargs).pooler_output


def images_batch(inputs, sizes, frames=0, seed=0):
    rng = np.random.default_rng(seed)
    items = [inputs.encode_image(Image.fromarray(rng.integers(0, 255, (h, w, 3), np.uint8))) for w, h in sizes]
    if frames:
        video = [Image.fromarray(rng.integers(0, 255, (40, 64, 3), np.uint8)) for _ in range(frames)]
        items.append(inputs.encode_video(video))
    return items, inputs.batch(items, "Describe.")


def test_manager_features_equal_stock_over_random_tile_counts(model):
    adapter = adapter_for(model)
    manager = EncoderCudaGraphManager(adapter, budgets=[1, 2, 4, 8])
    rng = random.Random(0)
    for _ in range(5):
        pixels = torch.randn(rng.randint(1, 20), 3, 56, 56)
        got = torch.stack(manager.execute(pixels))
        torch.testing.assert_close(got, stock_features(model, pixels), rtol=1e-5, atol=1e-5)
    assert manager.stats()["items"] > 0


def test_enable_keeps_generate_and_sends_other_feature_layers_to_stock(model, inputs):
    _, batch = images_batch(inputs, [(200, 90), (40, 40)], frames=4)
    with torch.inference_mode():
        stock = model.generate(**batch, max_new_tokens=6, do_sample=False)
        pixels = batch["pixel_values"]
        layer_2 = stock_features(model, pixels, vision_feature_layer=-2)
    handle = enable_cuda_graphs(model)
    try:
        with torch.inference_mode():
            assert torch.equal(model.generate(**batch, max_new_tokens=6, do_sample=False), stock)
            items = handle.stats()["encoder"]["items"]
            assert items == pixels.shape[0], "every tile went through the manager"
            graphed = model.get_image_features(pixels, return_dict=True).pooler_output
            torch.testing.assert_close(graphed, stock_features(model, pixels), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(model.get_image_features(pixels, vision_feature_layer=-2).pooler_output, layer_2)
        assert handle.stats()["encoder"]["items"] == 2 * items, "another feature layer ran stock"
        assert handle.stats()["decoder"]["sequences"] == 3
    finally:
        handle.disable()
    assert "get_image_features" not in vars(model) and "get_image_features" not in vars(model.model)


def test_decoder_runner_serves_plain_positions(model, inputs):
    _, batch = images_batch(inputs, [(120, 60), (56, 56)], frames=2, seed=1)
    with torch.inference_mode():
        stock = model.generate(**batch, max_new_tokens=8, do_sample=False)
    runner = DecoderGraphRunner(model, max_batch_size=4, max_cache_len=256, length_tiers=[64, 128])
    batch = dict(batch)
    got = runner.generate(batch.pop("input_ids"), batch.pop("attention_mask"), max_new_tokens=8, **batch)
    assert torch.equal(got, stock)
    assert runner.static_buffers().positions.shape == (4, 1), "1-D positions: no M-RoPE axes"


def test_inputs_tile_and_expand_as_the_processor_does(checkpoint, inputs):
    processor = GotOcr2ImageProcessorPil.from_pretrained(checkpoint)
    image = Image.new("RGB", (200, 90), (10, 200, 30))
    reference = processor(images=[image], crop_to_patches=True, return_tensors="np")
    item = inputs.encode_image(image)
    assert item.tiles == reference["num_patches"][0] == 3  # a 2x1 grid and the thumbnail
    assert item.size == (2 * inputs.tile_size[1], inputs.tile_size[0])  # the 2x1 canvas the tiles cut
    # uint8 tiles normalised by `to_model` with the processor's own arithmetic: bit for bit.
    np.testing.assert_array_equal(inputs.batch([item], "Describe.")["pixel_values"].numpy(), reference["pixel_values"])
    text = inputs.prompt_text(item, "Describe.")
    assert text.count("<IMG_CONTEXT>") == item.vision_tokens == 3 * 4
    assert "<img>" + "<IMG_CONTEXT>" * 12 + "</img>" in text
    video = inputs.encode_video([image] * 3)
    lines = [line for line in inputs.prompt_text(video, "Describe.").splitlines() if line.startswith("Frame")]
    assert lines == [f"Frame{i}: <img>{'<IMG_CONTEXT>' * 4}</img>" for i in (1, 2, 3)]
    assert InternVLInputs.from_pretrained(checkpoint, max_tiles=1).encode_image(image).tiles == 1


def test_longest_prompt_bounds_every_item(inputs):
    longest = inputs.longest_prompt("Describe.", max_frames=8)
    _, batch = images_batch(inputs, [(3000, 200)])
    assert batch["input_ids"].shape[1] <= longest
    _, batch = images_batch(inputs, [], frames=8)
    assert batch["input_ids"].shape[1] <= longest


def test_caption_command_end_to_end(checkpoint, tmp_path):
    folder = tmp_path / "media"
    folder.mkdir()
    for index, size in enumerate([(200, 90), (40, 40), (90, 300)]):
        Image.new("RGB", size, (40 * index, 90, 10)).save(folder / f"img{index}.png")
    out, stats = tmp_path / "captions.jsonl", tmp_path / "stats.json"
    argv = ["caption", str(folder), "--model", str(checkpoint), "--out", str(out), "--max-new-tokens", "3"]
    assert main(argv + ["--max-tiles", "2", "--quiet", "--stats-json", str(stats)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 3 and all("caption" in record for record in records)
    assert {record["vision_tokens"] for record in records} <= {4, 12}  # 1 tile, or 2 + thumbnail
    report = json.loads(stats.read_text())
    assert report["encoder"]["items"] == sum(record["vision_tokens"] // 4 for record in records)
    assert report["pipeline"]["succeeded"] == 3


def test_a_one_pixel_image_tiles_without_the_processors_ambiguity_warning(inputs, capfd):
    """A 1x1 image is (1, 1, 3): without being told, transformers cannot tell its channels and
    warns on every such file (issue 41, case 14); the inputs say channels come last."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_warning()
    tiles = inputs.encode_image(Image.new("RGB", (1, 1), (255, 0, 0)))
    assert tiles.tiles_u8.shape[0] >= 1 and tiles.tiles_u8[0, 0].float().mean() > 200  # red, channel 0
    assert "ambiguous" not in capfd.readouterr().err
