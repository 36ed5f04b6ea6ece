"""What a checkpoint has besides weights, for a preset (random weights have nothing else): config,
a tokenizer whose special tokens sit at the model's ids, the chat template, and processor configs
that fit the model's patch or tile size. With these files every preset runs through the caption
command, and the tiny checkpoints for tests are these files plus saved weights.

The tokenizer is byte-level (one token per byte, no merges): captions of random weights are noise
anyway, and it spans any vocabulary, from the tiny presets' 256 ids to Qwen's 151936.
"""

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from transformers import DeepseekOcr2ImageProcessorPil, DeepseekOcr2Processor, PretrainedConfig

from encoder_graphs.presets import get_config
from encoder_graphs.presets.tokenizer import build_tokenizer, write_json

VERSION = 2  # 2: Qwen2.5-VL presets name Qwen2_5_VLProcessor
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# InternVL3.5's chat template puts "<IMG_CONTEXT>\n" for an image and "<video>\n" for a video.
INTERNVL_CHAT_TEMPLATE = QWEN_CHAT_TEMPLATE.replace(
    "<|vision_start|><|image_pad|><|vision_end|>", "<IMG_CONTEXT>\n"
).replace("<|vision_start|><|video_pad|><|vision_end|>", "<video>\n")
CLIP_NORM = dict(image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711])
IMAGENET_NORM = dict(image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
PIXELS = dict(do_rescale=True, rescale_factor=1 / 255, do_normalize=True, do_convert_rgb=True, do_resize=True)
# Pixel bounds: tiny presets keep CPU tests fast; real-size ones take what the public checkpoints take.
TINY_IMAGE = {"shortest_edge": 56 * 56, "longest_edge": 224 * 224}
TINY_VIDEO = {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}
QWEN_IMAGE = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 16384}
QWEN_VIDEO = {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28}


def cache_root() -> Path:
    override = os.environ.get("ENCODER_GRAPHS_CACHE")
    return Path(override) if override else Path.home() / ".cache" / "encoder-graphs"


def preset_files_dir(name: str) -> Path:
    """The cached files of preset `name` (no weights), written on first use."""
    target = cache_root() / f"preset-{name}-v{VERSION}"
    if not (target / "config.json").is_file():
        build_atomically(target, lambda staging: write_preset_files(name, staging))
    return target


def build_atomically(target: Path, write: Any) -> None:
    """`write` into a temp dir beside `target`, then rename: a killed build leaves no half
    directory, and two concurrent builds both end with a complete one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_preset_files(name: str, directory: Path) -> PretrainedConfig:
    """Config, tokenizer, chat template and processor configs of preset `name`; its config."""
    config = get_config(name)
    config.save_pretrained(directory)
    tiny = name.startswith("tiny-")
    if config.model_type == "internvl":
        _write_internvl_files(config, directory, max_tiles=6 if tiny else 12)
    elif config.model_type == "deepseek_ocr2":
        _write_deepseek_ocr_files(config, directory)
    else:
        _write_qwen_files(config, directory, tiny)
    return config


def _write_qwen_files(config: PretrainedConfig, directory: Path, tiny: bool) -> None:
    text = config.get_text_config()
    specials = {
        "<|endoftext|>": text.bos_token_id,
        "<|im_end|>": text.eos_token_id,
        "<|vision_start|>": config.vision_start_token_id,
        "<|vision_end|>": config.vision_end_token_id,
        "<|image_pad|>": config.image_token_id,
        "<|video_pad|>": config.video_token_id,
    }
    specials["<|im_start|>"] = _free_id(text.bos_token_id, specials)
    tokenizer = build_tokenizer(specials, vocab_size=text.vocab_size)
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    qwen3 = config.model_type.startswith("qwen3")
    patch = dict(patch_size=config.vision_config.patch_size, temporal_patch_size=2, merge_size=2)
    norm = dict(image_mean=[0.5] * 3, image_std=[0.5] * 3) if qwen3 else CLIP_NORM
    # The processor the Hub checkpoints name: Qwen2.5-VL's adds second_per_grid_ts for videos.
    processor = "Qwen3VLProcessor" if qwen3 else {"qwen2_5_vl": "Qwen2_5_VLProcessor"}.get(config.model_type, "Qwen2VLProcessor")
    image, video = (TINY_IMAGE, TINY_VIDEO) if tiny else (QWEN_IMAGE, QWEN_VIDEO)
    # Written as JSON rather than through the processor classes: the video processors (and so
    # the processors) cannot be built without torchvision, but must load where it exists.
    common = dict(processor_class=processor, **patch, **norm, **PIXELS)
    write_json(directory / "preprocessor_config.json", dict(image_processor_type="Qwen2VLImageProcessor", size=image, **common))
    video_type = "Qwen3VLVideoProcessor" if qwen3 else "Qwen2VLVideoProcessor"
    write_json(
        directory / "video_preprocessor_config.json",
        dict(video_processor_type=video_type, size=video, do_sample_frames=False, **common),
    )
    write_json(directory / "processor_config.json", dict(processor_class=processor))
    (directory / "chat_template.jinja").write_text(QWEN_CHAT_TEMPLATE)


def _write_internvl_files(config: PretrainedConfig, directory: Path, max_tiles: int) -> None:
    text = config.get_text_config()
    image = config.image_token_id
    specials = {
        "<|endoftext|>": text.bos_token_id,
        "<|im_end|>": text.eos_token_id,
        "<IMG_CONTEXT>": image,
        "<img>": image + 1,
        "</img>": image + 2,
        "<video>": image + 3,
    }
    named = {
        "im_start_token": "<|im_start|>",
        "context_image_token": "<IMG_CONTEXT>",
        "start_image_token": "<img>",
        "end_image_token": "</img>",
        "video_token": "<video>",
    }
    specials["<|im_start|>"] = _free_id(text.bos_token_id, specials)
    tokenizer = build_tokenizer(specials, named, vocab_size=text.vocab_size)
    tokenizer.chat_template = INTERNVL_CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    side = config.vision_config.image_size[0]
    pixels = dict(processor_class="InternVLProcessor", size={"height": side, "width": side}, resample=3, **IMAGENET_NORM, **PIXELS)
    tiling = dict(crop_to_patches=False, min_patches=1, max_patches=max_tiles)  # the processor crops images
    write_json(directory / "preprocessor_config.json", dict(image_processor_type="GotOcr2ImageProcessor", **pixels, **tiling))
    write_json(directory / "video_preprocessor_config.json", dict(video_processor_type="InternVLVideoProcessor", **pixels))
    write_json(
        directory / "processor_config.json",
        dict(processor_class="InternVLProcessor", image_seq_length=config.image_seq_length),
    )
    (directory / "chat_template.jinja").write_text(INTERNVL_CHAT_TEMPLATE)


def _write_deepseek_ocr_files(config: PretrainedConfig, directory: Path) -> None:
    """DeepSeek's tokenizer puts `<｜begin▁of▁sentence｜>` at 0, `<｜end▁of▁sentence｜>` at 1 and pads
    with 2; the processor (no chat template: prompts are plain text after `<image>`) nests its
    image processor in processor_config.json, as the converted checkpoint does, named as there
    (`DeepseekOcr2ImageProcessor`, the torchvision one; the caption command reads its PIL twin)."""
    text = config.get_text_config()
    specials = {
        "<｜begin▁of▁sentence｜>": text.bos_token_id,
        "<|im_end|>": text.eos_token_id,
        "<|endoftext|>": text.pad_token_id,
        "<image>": config.image_token_id,
    }
    tokenizer = build_tokenizer(specials, {"image_token": "<image>"}, vocab_size=text.vocab_size)
    processor = DeepseekOcr2Processor(image_processor=DeepseekOcr2ImageProcessorPil(), tokenizer=tokenizer)
    processor.save_pretrained(directory)


def _free_id(after: int, specials: dict[str, int]) -> int:
    """The first id past `after` no special token has: `<|im_start|>` sits after `<|endoftext|>`
    (151644 in Qwen's vocabulary, 2 in the tiny presets', whose 1 is `<|im_end|>`)."""
    taken = set(specials.values())
    return next(i for i in range(after + 1, after + 2 + len(taken)) if i not in taken)
