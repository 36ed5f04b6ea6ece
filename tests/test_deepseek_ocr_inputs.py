"""Our DeepSeek-OCR 2 inputs (tokenizer and PIL image processor, uint8 until `to_model`) against the
official `DeepseekOcr2Processor` over `DeepseekOcr2ImageProcessorPil` with the same tokenizer, on
the CPU in float32: identical ids, masks, views, tiles and tile counts for pages of no tiles to
six, of every shape and colour mode, alone and mixed; the processor's tiling defaults over the
checkpoint's; a tiny model's greedy tokens equal on both batches."""

import math

import numpy as np
import pytest
import torch
from PIL import Image
from test_deepseek_ocr import TINY
from transformers import AutoTokenizer, DeepseekOcr2Config, DeepseekOcr2ForConditionalGeneration, DeepseekOcr2Processor
from transformers.models.deepseek_ocr2.image_processing_pil_deepseek_ocr2 import (
    DeepseekOcr2ImageProcessorPil,
    get_optimal_tiled_canvas,
)

from encoder_graphs.models.common import pil_pixels
from encoder_graphs.models.deepseek_ocr.inputs import DeepseekOcrInputs
from encoder_graphs.presets.tokenizer import build_tokenizer
from encoder_graphs.seam.vision import tiled_canvas

IMAGE_ID = TINY["image_token_id"]
EOS_ID, PAD_ID = TINY["text_config"]["eos_token_id"], TINY["text_config"]["pad_token_id"]
# TINY's 64 ids would leave the byte tokenizer no letters; 320 hold all 256 bytes and the specials.
CONFIG = dict(TINY, text_config=dict(TINY["text_config"], vocab_size=320))
PROMPT = "Free OCR."


def tokenizer():
    return build_tokenizer({"<image>": IMAGE_ID, "<|im_end|>": EOS_ID, "<|endoftext|>": PAD_ID}, vocab_size=320)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The files the converter writes (tokenizer, processor_config.json with the image processor
    nested), whose image processor saves tiling settings the processor's call defaults override."""
    path = tmp_path_factory.mktemp("deepseek-ocr2-processor")
    image_processor = DeepseekOcr2ImageProcessorPil(min_patches=1, max_patches=3)
    DeepseekOcr2Processor(image_processor=image_processor, tokenizer=tokenizer()).save_pretrained(path)
    return path


def official(directory, images, prompts, **images_kwargs):
    processor = DeepseekOcr2Processor(
        image_processor=DeepseekOcr2ImageProcessorPil.from_pretrained(directory),
        tokenizer=AutoTokenizer.from_pretrained(directory),
    )
    texts = ["<image>\n" + prompt for prompt in prompts]
    return processor(images=images, text=texts, padding=True, padding_side="left", return_tensors="pt", **images_kwargs)


def page(rng, width, height, mode="RGB"):
    channels = 4 if mode == "RGBA" else 3  # a varying alpha: the processor composites it on white
    image = Image.fromarray(rng.integers(0, 256, (height, width, channels), np.uint8))
    return image if image.mode == mode else image.convert(mode)


def assert_equal_batches(mine, theirs):
    assert mine.keys() == theirs.keys()
    for key in theirs:
        assert mine[key].dtype == theirs[key].dtype, key
        assert torch.equal(mine[key], theirs[key]), key


@pytest.mark.parametrize(
    "pages, tiles, sizes",
    [
        ([(200, 300)], [0], [(683, 1024)]),  # small: the view only, the page grown into it
        ([(768, 768)], [0], [(1024, 1024)]),  # one tile's size is not larger than a tile
        ([(769, 400)], [2], [(1536, 768)]),
        ([(1400, 500)], [3], [(2304, 768)]),  # wide
        ([(500, 1400)], [3], [(768, 2304)]),  # tall
        ([(2448, 3264)], [6], [(1536, 2304)]),  # a photographed page
        ([(900, 700, "L"), (300, 1000, "RGBA"), (640, 480, "P")], [6, 3, 0], [(2304, 1536), (768, 2304), (1024, 768)]),
        ([(120, 80), (1000, 1000), (50, 50)], [0, 4, 0], [(1024, 683), (1536, 1536), (1024, 1024)]),
        ([(100, 60), (300, 40)], [0, 0], [(1024, 614), (1024, 137)]),  # no tiles in the batch
    ],
)
def test_inputs_equal_the_official_processor(checkpoint, pages, tiles, sizes):
    rng = np.random.default_rng(len(pages) * 1000 + pages[0][0])
    images = [page(rng, *shape) for shape in pages]
    prompts = [PROMPT + " " * i for i in range(len(images))]  # prompts of unequal lengths: left padding shows
    ours = DeepseekOcrInputs.from_pretrained(checkpoint)
    items = [ours.encode_image(image) for image in images]
    mine = ours.batch(items, prompts)
    theirs = official(checkpoint, images, prompts)
    assert_equal_batches(mine, theirs)
    assert mine["num_local_patches"].tolist() == tiles
    assert ("pixel_values_local" in mine) == any(tiles)
    assert [item.size for item in items] == sizes
    assert [item.vision_tokens for item in items] == (mine["input_ids"] == IMAGE_ID).sum(1).tolist()
    assert [item.vision_tokens for item in items] == [256 + 144 * count + 1 for count in tiles]
    assert (mine["attention_mask"][:, 0] == 0).any() == (len(images) > 1)  # padded on the left


def test_collate_keeps_uint8_pixels_and_to_model_casts_as_the_processor(checkpoint):
    rng = np.random.default_rng(7)
    images = [page(rng, 900, 500), page(rng, 300, 300)]
    ours = DeepseekOcrInputs.from_pretrained(checkpoint)
    collated = ours.collate([ours.encode_image(image) for image in images], PROMPT)
    assert collated["pixel_values"].dtype == collated["pixel_values_local"].dtype == torch.uint8
    assert collated["pixel_values"][0, :, 0, 0].tolist() == [127] * 3  # the padding colour, before the rescale
    theirs = official(checkpoint, images, [PROMPT] * 2)
    mine = ours.to_model(collated, "cpu", torch.bfloat16)
    for key in ("pixel_values", "pixel_values_local"):
        assert torch.equal(mine[key], theirs[key].to(torch.bfloat16)), key


def test_normalising_in_chunks_equals_one_pass(checkpoint, monkeypatch):
    """The views and tiles are normalised a chunk of rows at a time (`pil_pixels.CHUNK_VALUES`):
    chunks that do not divide the rows give the very values of one pass over them all."""
    ours = DeepseekOcrInputs.from_pretrained(checkpoint)
    rng = np.random.default_rng(11)
    collated = ours.collate([ours.encode_image(page(rng, 1800, 700)) for _ in range(3)], PROMPT)
    whole = ours.to_model(collated, "cpu", torch.float32)
    row = collated["pixel_values_local"][0].numel()
    monkeypatch.setattr(pil_pixels, "CHUNK_VALUES", 2 * row)  # tiles two at a time, views one
    chunked = ours.to_model(collated, "cpu", torch.float32)
    assert collated["pixel_values_local"].shape[0] % 2 == 1  # a last chunk of one tile
    for key in ("pixel_values", "pixel_values_local"):
        assert torch.equal(chunked[key], whole[key]), key


def test_max_tiles_is_the_processors_max_patches(checkpoint):
    rng = np.random.default_rng(3)
    images = [page(rng, 2448, 3264), page(rng, 1400, 500)]
    ours = DeepseekOcrInputs.from_pretrained(checkpoint, max_tiles=3)
    mine = ours.batch([ours.encode_image(image) for image in images], PROMPT)
    assert_equal_batches(mine, official(checkpoint, images, [PROMPT] * 2, max_patches=3))
    assert mine["num_local_patches"].tolist() == [2, 3]
    assert ours.longest_prompt(PROMPT, max_frames=8) == mine["input_ids"].shape[1]
    with pytest.raises(ValueError, match="max_tiles must be >= 2"):
        DeepseekOcrInputs.from_pretrained(checkpoint, max_tiles=1)


def test_the_longest_prompt_is_a_page_of_six_tiles(checkpoint):
    ours = DeepseekOcrInputs.from_pretrained(checkpoint)
    theirs = official(checkpoint, [page(np.random.default_rng(0), 2448, 3264)], [PROMPT])
    assert theirs["num_local_patches"].tolist() == [6]
    assert ours.longest_prompt(PROMPT, max_frames=0) == theirs["input_ids"].shape[1]


def test_generate_takes_our_batch_as_the_processors(checkpoint):
    torch.manual_seed(0)
    model = DeepseekOcr2ForConditionalGeneration(DeepseekOcr2Config(**CONFIG)).eval()
    rng = np.random.default_rng(11)
    images = [page(rng, 200, 300), page(rng, 1000, 500)]
    ours = DeepseekOcrInputs.from_pretrained(checkpoint)
    ours.check_model(model.config)
    mine = ours.batch([ours.encode_image(image) for image in images], [PROMPT, "Convert the document."])
    theirs = official(checkpoint, images, [PROMPT, "Convert the document."])
    assert mine["num_local_patches"].tolist() == [0, 2]
    with torch.inference_mode():
        expected = model.generate(**theirs, max_new_tokens=4, do_sample=False, eos_token_id=None)
        got = model.generate(**mine, max_new_tokens=4, do_sample=False, eos_token_id=None)
    assert torch.equal(got, expected)
    assert got.shape[1] == mine["input_ids"].shape[1] + 4


def test_check_model_refuses_what_does_not_fit(checkpoint):
    ours = DeepseekOcrInputs.from_pretrained(checkpoint)
    ours.check_model(DeepseekOcr2Config(**CONFIG))
    wrong_image = DeepseekOcr2Config(**dict(CONFIG, image_token_id=61))
    small_vocab = DeepseekOcr2Config(**TINY)
    sam = dict(CONFIG["vision_config"]["sam_config"], patch_size=8)
    wrong_patch = DeepseekOcr2Config(**dict(CONFIG, vision_config=dict(CONFIG["vision_config"], sam_config=sam)))
    for config, message in [(wrong_image, "maps <image> to 60"), (small_vocab, "259 tokens"), (wrong_patch, "8 px")]:
        with pytest.raises(ValueError, match=message):
            ours.check_model(config)
    for settings in ({"tile_size": 512}, {"size": {"height": 768, "width": 768}}):
        other = DeepseekOcrInputs(tokenizer(), DeepseekOcr2ImageProcessorPil(**settings))
        with pytest.raises(ValueError, match="views and tiles"):
            other.check_model(DeepseekOcr2Config(**CONFIG))


def test_max_image_pixels_keep_the_grid_and_its_canvas(checkpoint):
    """A page of `max_image_pixels` at any aspect ratio the grids span has tiles, and its grid's
    canvas is no wider nor taller than the page (up to rounding); at some ratio 3% fewer pixels
    would fall short."""
    for max_tiles in (2, 3, 6):
        ours = DeepseekOcrInputs.from_pretrained(checkpoint, max_tiles=max_tiles)
        shortfalls = []
        for ratio in np.exp(np.linspace(-math.log(max_tiles), math.log(max_tiles), 2001)):
            width, height = math.sqrt(ours.max_image_pixels * ratio), math.sqrt(ours.max_image_pixels / ratio)
            columns, rows = tiled_canvas((round(height), round(width)), (768, 768), 2, max_tiles)
            assert max(width, height) > 768
            shortfalls.append(max(columns * 768 / width, rows * 768 / height))
        assert math.sqrt(0.97) < max(shortfalls) <= 1.001


def test_the_repos_tiling_is_deepseeks():
    for height in range(100, 4000, 37):
        for width in (height // 7, height // 2, height - 13, height, height * 3 // 2 + 1, height * 5):
            for most in (2, 5, 6, 9):
                shape = (height, max(width, 1))
                assert tiled_canvas(shape, (768, 768), 2, most) == get_optimal_tiled_canvas(shape, (768, 768), 2, most)


def test_text_only_ways(checkpoint):
    ours = DeepseekOcrInputs.from_pretrained(checkpoint)
    assert ours.eos_token_id == EOS_ID and ours.pad_token_id == PAD_ID and ours.min_side == 1
    tokens = ours.tokenizer(" Some text. ").input_ids + [EOS_ID, PAD_ID]
    assert ours.decode(tokens) == "Some text."
    with pytest.raises(ValueError, match="not videos"):
        ours.encode_video([page(np.random.default_rng(0), 64, 64)] * 2)
    item = ours.encode_image(page(np.random.default_rng(0), 64, 64))
    with pytest.raises(ValueError, match="may not contain <image>"):
        ours.collate([item], "<image>\nFree OCR.")
    unpadded = tokenizer()
    unpadded.pad_token = None
    with pytest.raises(ValueError, match="no pad token"):
        DeepseekOcrInputs(unpadded, DeepseekOcr2ImageProcessorPil())
