"""Our DeepSeek-OCR 2 inputs (`DeepseekOcrInputs`, over the PIL image processor, equal to it:
tests/test_deepseek_ocr_inputs.py) against `AutoProcessor` of the same checkpoint files, which
names the torchvision image processor (as the converted checkpoint does): ids, masks and tile
counts identical; pixels as close as the two bicubic resamplings are (each view and tile within
0.45 levels of 255 on average, where the same page moved by one pixel is further).

Needs torchvision: skipped where it is missing; CI's processor-parity stage and the GPU machine
have it.
"""

import numpy as np
import pytest
import torch
from PIL import Image, ImageChops

from encoder_graphs.models.deepseek_ocr.inputs import DeepseekOcrInputs
from encoder_graphs.presets.files import write_preset_files

pytest.importorskip("torchvision")
pytestmark = pytest.mark.torchvision

from transformers import AutoProcessor  # noqa: E402

PAGES = {"snippet": (700, 300), "letter": (850, 1100), "slide": (1600, 900), "scan": (2480, 3508)}
LEVEL = 2 / 255  # one level of 255 after the processor's normalisation to [-1, 1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-deepseek-ocr-2")
    write_preset_files("tiny-deepseek-ocr-2", directory)
    return directory


def page(width: int, height: int, seed: int) -> Image.Image:
    """Paper with sensor noise and sharp dark strokes: text-like edges where resamplings differ most."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(225, 256, (height, width, 3), dtype=np.uint8)
    for _ in range(200):
        top, left = rng.integers(0, height - 8), rng.integers(0, width - 60)
        pixels[top : top + 6, left : left + rng.integers(10, 60)] = rng.integers(0, 80)
    return Image.fromarray(pixels)


def test_ids_and_tiles_equal_the_processors_and_pixels_its_resampling(checkpoint):
    processor = AutoProcessor.from_pretrained(checkpoint)
    processor.tokenizer.padding_side = "left"
    ours = DeepseekOcrInputs.from_pretrained(checkpoint)
    images = [page(*size, seed) for seed, size in enumerate(PAGES.values())]
    prompt = ours.default_prompt
    theirs = processor(images=images, text=[f"<image>\n{prompt}"] * len(images), padding=True, return_tensors="pt")
    got = ours.batch([ours.encode_image(image) for image in images], prompt)
    for key in ("input_ids", "attention_mask", "num_local_patches"):
        assert torch.equal(got[key], theirs[key]), key
    shifted = ours.batch([ours.encode_image(ImageChops.offset(image, 1, 0)) for image in images], prompt)
    for key in ("pixel_values", "pixel_values_local"):
        difference = (got[key] - theirs[key].float()).abs().flatten(1)  # a row a view or tile
        moved = (shifted[key] - theirs[key].float()).abs().flatten(1)  # our pages moved by one pixel
        worst, apart = difference.mean(1).max() / LEVEL, moved.mean(1).min() / LEVEL
        print(f"{key}: worst row {worst:.3f} levels on average, moved pages' best {apart:.3f}")
        # The two bicubic resizes round otherwise, most on the noise a tile is cut from (measured:
        # a view's rows 0.007 levels on average at worst, a tile's 0.275, single values up to 13);
        # a page moved by one pixel is 0.63 (a view) and 3.6 (a tile) at best.
        assert (difference.mean(1) < 0.45 * LEVEL).all(), key
        assert (moved.mean(1) > 0.45 * LEVEL).all(), key  # the bound tells a misplaced page
