"""What `generate` resolves and computes before its first forward, as the decoder's runner
needs it: settings, the arguments only stock `generate` implements, the first position ids."""

import inspect
from functools import cache
from typing import Any

import torch
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel

# 5.17.0, 5.23.0: the generation modes `GenerationConfig.get_generation_mode()` returns.
from transformers.generation.configuration_utils import GenerationMode

__all__ = [
    "GenerationMode",
    "generate_arguments",
    "generation_position_ids",
    "generation_settings",
    "prepare_generation_config",
]


# 5.17.0, 5.23.0: `generate` resolves its settings (arguments > generation_config argument >
# model.generation_config > defaults) and checks model kwargs in these private methods.
def prepare_generation_config(
    model: PreTrainedModel, generation_config: GenerationConfig | None, kwargs: dict[str, Any]
) -> tuple[GenerationConfig, dict[str, Any]]:
    """The settings and model inputs `model.generate(generation_config=..., **kwargs)` would use;
    unknown model kwargs raise as they do in `generate`."""
    config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    model._validate_model_kwargs(dict(model_kwargs))
    return config, model_kwargs


# 5.17.0, 5.23.0: `generate` pops these from its **kwargs itself (assisted generation's tokenizers).
_GENERATE_POPPED_KWARGS = ("tokenizer", "assistant_tokenizer")


@cache
def generate_arguments() -> tuple[str, ...]:
    """The arguments of `generate` besides `inputs`, `generation_config`, settings and model
    inputs (logits processors, stopping criteria, streamers, assistants ...): every one of them
    is only the stock `generate`'s to implement."""
    parameters = inspect.signature(GenerationMixin.generate).parameters.values()
    named = [p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD or p.kind is p.KEYWORD_ONLY]
    return (*(name for name in named if name not in ("self", "inputs", "generation_config")), *_GENERATE_POPPED_KWARGS)


@cache
def generation_settings() -> tuple[str, ...]:
    """The settings the running transformers defines: a `GenerationConfig`'s public attributes."""
    names = vars(GenerationConfig())
    return tuple(name for name in names if not name.startswith("_") and name != "transformers_version")


# 5.17.0, 5.23.0: the position ids `generate` gives the first forward (M-RoPE for Qwen-VL),
# computed on the host. Qwen-VL's `get_rope_index` walks each image and video with device reads
# (nonzero, item): on the GPU each stalls it while the batch's work waits to start (RESULTS.md).
# Integer arithmetic (and Qwen2.5-VL's float32 products of video times),
# so either device gives the same ids. It reads ids, masks and grids, never pixels; it leaves
# `rope_deltas` on the model (stock decode steps read them), which go back to the ids' device.
_PIXEL_INPUTS = ("pixel_values", "pixel_values_videos")


def generation_position_ids(
    model: PreTrainedModel, input_ids: torch.Tensor, model_kwargs: dict[str, Any]
) -> torch.Tensor:
    host = {
        key: value.cpu() if isinstance(value, torch.Tensor) else value
        for key, value in model_kwargs.items()
        if key not in _PIXEL_INPUTS
    }
    positions = model._prepare_position_ids_for_generation(input_ids.cpu(), host)
    inner = getattr(model, "model", None)
    if isinstance(getattr(inner, "rope_deltas", None), torch.Tensor):
        inner.rope_deltas = inner.rope_deltas.to(input_ids.device)
    return positions.to(input_ids.device)
