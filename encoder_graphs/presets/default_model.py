"""The embedded default model: a tiny random-weight Qwen2-VL built once and cached on disk.

Its captions are noise. It exists so that the command runs on a fresh CPU machine with no
download; point `--model` at a real checkpoint directory for real captions.

The cache directory holds what a Hub checkpoint holds (config, safetensors weights, tokenizer,
chat template, image and video processor configs), so it loads through the real
`from_pretrained` paths.
"""

import shutil
from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen2VLForConditionalGeneration

from encoder_graphs.presets.files import build_atomically, cache_root, write_preset_files
from encoder_graphs.seam import from_config

VERSION = 1
PRESET = "tiny-qwen2-vl"
# The ids the tiny presets' config and tokenizer share (vocab 256, bos 0, eos 1, vision tokens 250-253).
SPECIAL_TOKENS = {
    "<|endoftext|>": 0,
    "<|im_end|>": 1,
    "<|im_start|>": 2,
    "<|image_pad|>": 250,
    "<|video_pad|>": 251,
    "<|vision_start|>": 252,
    "<|vision_end|>": 253,
}


def default_model_dir() -> Path:
    """The cached default model directory, built on first use, and built again where it is
    damaged (a file missing, weights whose header does not read): it is this package's cache,
    not the user's files. Raises OSError where the cache folder cannot be written."""
    target = cache_root() / f"{PRESET}-v{VERSION}"
    if not _complete(target):
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        build_atomically(target, write_default_model)
    return target


def _complete(directory: Path) -> bool:
    """Whether a built default model is all there: its config, and weights whose header reads."""
    from safetensors import SafetensorError, safe_open

    weights = directory / "model.safetensors"
    if not ((directory / "config.json").is_file() and weights.is_file()):
        return False
    try:
        with safe_open(str(weights), framework="pt") as handle:
            return bool(list(handle.keys()))
    except (OSError, SafetensorError):
        return False


def write_default_model(directory: Path) -> None:
    config = write_preset_files(PRESET, directory)
    torch.manual_seed(0)
    model = from_config(Qwen2VLForConditionalGeneration, config, torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=SPECIAL_TOKENS["<|endoftext|>"],
        eos_token_id=SPECIAL_TOKENS["<|im_end|>"],
        pad_token_id=SPECIAL_TOKENS["<|endoftext|>"],
    )
    model.save_pretrained(directory, safe_serialization=True)
