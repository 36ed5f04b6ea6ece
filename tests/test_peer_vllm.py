"""The parts of the vLLM peer (`benchmarks/peer_vllm.py`) that run without vLLM: the checkpoint it
hands vLLM is a whole one that transformers loads, with the chat template the prompt is written
by; photos reach it upright and within the resolution cap. vLLM itself runs on the GPU machine
only (`bench_cli.py --runs vllm`)."""

import torch
from peer_vllm import chat_prompt, open_image, write_checkpoint
from PIL import Image
from transformers import AutoModelForImageTextToText

from encoder_graphs.presets import build_model


def test_the_checkpoint_is_the_presets_model(tmp_path):
    write_checkpoint("tiny-qwen2.5-vl", tmp_path)
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path, dtype=torch.bfloat16)
    expected = build_model("tiny-qwen2.5-vl", dtype=torch.bfloat16)
    assert loaded.state_dict().keys() == expected.state_dict().keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in expected.state_dict().items())
    prompt = chat_prompt(tmp_path, "Describe this image.")
    assert "<|vision_start|><|image_pad|><|vision_end|>Describe this image." in prompt


def test_photos_are_upright_and_within_the_cap(tmp_path):
    path = tmp_path / "phone.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # stored landscape, shown portrait
    Image.new("RGB", (4000, 3000), (200, 30, 30)).save(path, exif=exif)
    image = open_image(path, max_pixels=1280 * 28 * 28)
    assert image.mode == "RGB" and image.height > image.width
    assert image.width * image.height <= 1280 * 28 * 28
    assert abs(image.height / image.width - 4000 / 3000) < 0.01
    small = tmp_path / "small.png"
    Image.new("RGB", (64, 48)).save(small)
    assert open_image(small, max_pixels=1280 * 28 * 28).size == (64, 48)
