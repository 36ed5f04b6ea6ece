"""Pixels travel as uint8 and are normalised where the batch goes: on a GPU the result must be
the CPU's (the processors') bit for bit, for every family, in float32 and cast to bf16."""

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_internvl import write_tiny_internvl

from encoder_graphs.models.internvl.inputs import InternVLInputs
from encoder_graphs.models.qwen.inputs import QwenVLInputs
from encoder_graphs.presets.default_model import default_model_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def noise(width: int, height: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), np.uint8))


@pytest.fixture(scope="module", params=["qwen", "internvl"])
def inputs(request, tmp_path_factory):
    if request.param == "qwen":
        return QwenVLInputs.from_pretrained(default_model_dir())
    return InternVLInputs.from_pretrained(write_tiny_internvl(tmp_path_factory.mktemp("tiny-internvl")))


def test_pixels_normalised_on_the_gpu_equal_the_cpu_bit_for_bit(inputs):
    frames = [noise(96, 72, seed=10 + i) for i in range(4)]
    items = [inputs.encode_image(noise(w, h, seed=w)) for w, h in [(300, 200), (57, 91), (640, 480)]]
    items.append(inputs.encode_video(frames))
    collated = inputs.collate(items, "Describe.")
    cpu = inputs.to_model(collated, "cpu", torch.float32)
    gpu = inputs.to_model(collated, "cuda", torch.float32)
    half = inputs.to_model(collated, "cuda", torch.bfloat16)
    pixel_keys = [key for key in cpu if key.startswith("pixel_values")]
    assert pixel_keys and all(collated[key].dtype == torch.uint8 for key in pixel_keys)
    for key, value in cpu.items():
        assert gpu[key].device.type == "cuda"
        assert torch.equal(gpu[key].cpu(), value), key
    for key in pixel_keys:
        assert half[key].dtype == torch.bfloat16 and torch.equal(half[key].cpu(), cpu[key].to(torch.bfloat16)), key
