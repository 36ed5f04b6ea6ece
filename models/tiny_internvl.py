"""A tiny random-weight InternVL checkpoint directory, as a Hub checkpoint holds it (config,
safetensors weights, tokenizer with InternVL's named image tokens, chat template, image and
processor configs), so that tests load it through the real `from_pretrained` paths."""

from pathlib import Path

import torch
from transformers import GenerationConfig, InternVLForConditionalGeneration

from encoder_graphs.models.default_model import build_tokenizer, write_json
from encoder_graphs.models.presets import get_config
from encoder_graphs.models.transformers_seam import from_config

PRESET = "tiny-internvl"
SPECIAL_TOKENS = {
    "<|endoftext|>": 0,
    "<|im_end|>": 1,
    "<|im_start|>": 2,
    "<IMG_CONTEXT>": 250,
    "<img>": 251,
    "</img>": 252,
    "<video>": 253,
}
NAMED_TOKENS = {
    "im_start_token": "<|im_start|>",
    "context_image_token": "<IMG_CONTEXT>",
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "video_token": "<video>",
}
# InternVL3.5's chat template puts "<IMG_CONTEXT>\n" for an image and "<video>\n" for a video.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<IMG_CONTEXT>\n"
    "{% elif content['type'] == 'video' %}<video>\n"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_internvl(directory: str | Path, *, seed: int = 0, max_tiles: int = 6) -> Path:
    """Write the tiny InternVL checkpoint into `directory`; returns it."""
    directory = Path(directory)
    config = get_config(PRESET)
    if config.image_token_id != SPECIAL_TOKENS["<IMG_CONTEXT>"]:
        raise RuntimeError(f"preset {PRESET} has image_token_id {config.image_token_id}")
    torch.manual_seed(seed)
    model = from_config(InternVLForConditionalGeneration, config, torch.float32).eval()
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=0)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer = build_tokenizer(SPECIAL_TOKENS, NAMED_TOKENS)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    side = config.vision_config.image_size[0]
    pixels = dict(
        processor_class="InternVLProcessor",
        size={"height": side, "width": side},
        do_resize=True,
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=[0.485, 0.456, 0.406],
        image_std=[0.229, 0.224, 0.225],
        do_convert_rgb=True,
        resample=3,  # bicubic
    )
    tiling = dict(crop_to_patches=False, min_patches=1, max_patches=max_tiles)  # the processor crops images
    write_json(directory / "preprocessor_config.json", dict(image_processor_type="GotOcr2ImageProcessor", **pixels, **tiling))
    write_json(directory / "video_preprocessor_config.json", dict(video_processor_type="InternVLVideoProcessor", **pixels))
    write_json(
        directory / "processor_config.json",
        dict(processor_class="InternVLProcessor", image_seq_length=config.image_seq_length),
    )
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return directory
