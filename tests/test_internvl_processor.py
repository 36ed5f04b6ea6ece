"""Our InternVL inputs (built without torchvision) against the official `AutoProcessor`
(InternVLProcessor with its torchvision image and video processors), on the tiny checkpoint:
identical ids and masks, the same tiles in the same order, pixels equal up to resampling.
Runs where torchvision imports (the GPU machine has it); skipped elsewhere."""

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_internvl import write_tiny_internvl

from encoder_graphs.models.internvl.inputs import InternVLInputs

pytest.importorskip("torchvision")
pytestmark = pytest.mark.torchvision
from transformers import AutoProcessor  # noqa: E402

# PIL's and torchvision's bicubic resampling (antialiased when shrinking) differ by a few levels of
# 255, up to ~7 at sharp edges of a shrunk noise image: in normalised units (ImageNet std ~0.22) at
# most ~0.12, ~0.004 on average. A wrong tile, crop or normalisation differs by ~1 on average.
PIXEL_ATOL, PIXEL_MEAN_ATOL = 0.2, 0.006


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_internvl(tmp_path_factory.mktemp("tiny-internvl"))


def random_image(rng, width, height):
    return Image.fromarray(rng.integers(0, 255, (height, width, 3), np.uint8))


def official(processor, kinds, images, videos):
    texts = [
        processor.apply_chat_template(
            [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": "Describe."}]}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for kind in kinds
    ]
    arrays = [np.stack([np.asarray(frame) for frame in video]) for video in videos]
    return processor(text=texts, images=images or None, videos=arrays or None, padding=True, return_tensors="pt")


@pytest.mark.parametrize(
    "sizes, video_frames",
    [
        ([(56, 56)], []),
        ([(200, 90)], []),
        ([(90, 300)], []),
        ([(1000, 600)], []),
        ([(40, 40), (200, 90), (120, 500)], [3]),
        ([], [2]),
        ([], [4, 4]),  # the official processor batches videos of equal frame counts only
    ],
)
def test_inputs_equal_the_official_processor(checkpoint, sizes, video_frames):
    rng = np.random.default_rng(len(sizes) * 10 + len(video_frames))
    images = [random_image(rng, w, h) for w, h in sizes]
    videos = [[random_image(rng, 64, 48) for _ in range(n)] for n in video_frames]
    ours = InternVLInputs.from_pretrained(checkpoint)
    items = [ours.encode_image(image) for image in images] + [ours.encode_video(video) for video in videos]
    mine = ours.batch(items, "Describe.")
    theirs = official(AutoProcessor.from_pretrained(checkpoint), ["image"] * len(images) + ["video"] * len(videos),
                      images, videos)
    assert torch.equal(mine["input_ids"], theirs["input_ids"])
    assert torch.equal(mine["attention_mask"], theirs["attention_mask"])
    assert mine["pixel_values"].shape == theirs["pixel_values"].shape
    difference = (mine["pixel_values"] - theirs["pixel_values"].float()).abs()
    assert difference.max() < PIXEL_ATOL and difference.mean() < PIXEL_MEAN_ATOL, (difference.max(), difference.mean())
