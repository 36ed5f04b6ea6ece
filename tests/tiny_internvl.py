"""A tiny random-weight InternVL checkpoint directory, as a Hub checkpoint holds it (config,
safetensors weights, tokenizer with InternVL's named image tokens, chat template, image, video and
processor configs), so that tests load it through the real `from_pretrained` paths."""

from pathlib import Path

import torch
from transformers import GenerationConfig, InternVLForConditionalGeneration

from encoder_graphs.presets.files import write_preset_files
from encoder_graphs.seam import from_config

PRESET = "tiny-internvl"


def write_tiny_internvl(directory: str | Path, *, seed: int = 0) -> Path:
    """Write the tiny InternVL checkpoint into `directory`; returns it."""
    directory = Path(directory)
    config = write_preset_files(PRESET, directory)
    torch.manual_seed(seed)
    model = from_config(InternVLForConditionalGeneration, config, torch.float32).eval()
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=0)
    model.save_pretrained(directory, safe_serialization=True)
    return directory
