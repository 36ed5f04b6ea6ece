"""The presets of every family by name, and building their models with random weights."""

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from encoder_graphs.models.deepseek_ocr.presets import DEEPSEEK_OCR_PRESETS
from encoder_graphs.models.internvl.presets import INTERNVL_PRESETS
from encoder_graphs.models.qwen.presets import QWEN_PRESETS
from encoder_graphs.presets.preset import Preset
from encoder_graphs.seam import from_config

PRESETS: dict[str, Preset] = {**QWEN_PRESETS, **INTERNVL_PRESETS, **DEEPSEEK_OCR_PRESETS}


def _preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]


def get_config(name: str) -> PretrainedConfig:
    """A fresh config of the whole *ForConditionalGeneration model."""
    return _preset(name).config()


def _build(
    factory: Callable[[], PreTrainedModel],
    dtype: torch.dtype,
    device: str | torch.device,
    seed: int,
    drawn: tuple[str, ...],
) -> PreTrainedModel:
    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in the target dtype: no fp32 copy of a large model
    try:
        with torch.device(device):
            model = factory()
    finally:
        torch.set_default_dtype(default_dtype)
    with buffers_kept(model):
        model.to(dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(fragment in name for fragment in drawn):
                param.normal_(0, 0.02)
    return model.eval()


@contextmanager
def buffers_kept(model: nn.Module) -> Iterator[None]:
    """Cast the model's parameters inside (not move them); on leaving, every buffer is again the
    tensor it was. `from_pretrained(dtype=torch.bfloat16)` leaves transformers' rotary `inv_freq`
    in fp32; `model.to(torch.bfloat16)` rounds it, and a model so cast rotates positions far from
    0 otherwise than the checkpoint does."""
    buffers = [(module, name, buffer) for module in model.modules() for name, buffer in module._buffers.items()]
    try:
        yield
    finally:
        for module, name, buffer in buffers:
            module._buffers[name] = buffer


def build_model(
    name: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0
) -> PreTrainedModel:
    """The whole model with random weights, in eval mode, built directly on `device` in `dtype`."""
    preset = _preset(name)
    config = preset.config()
    return _build(lambda: from_config(preset.model_class, config, dtype), dtype, device, seed, preset.drawn)


def build_vision_tower(
    name: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0
) -> PreTrainedModel:
    """Only the vision tower (the module a model holds as `model.visual`), random weights."""
    preset = _preset(name)
    config = preset.config().vision_config
    return _build(lambda: from_config(preset.vision_class, config, dtype), dtype, device, seed, preset.drawn)
