"""Model adapters, presets and small models."""

import torch

from encoder_graphs.models.qwen2_5_vl import Qwen2_5_VLAdapter
from encoder_graphs.models.qwen2_vl import Qwen2VLAdapter
from encoder_graphs.models.qwen3_vl import Qwen3VLAdapter
from encoder_graphs.models.qwen_vision import QwenVisionAdapter, VisionBatch

# Vision tower class name -> (architecture, adapter).
_ADAPTERS: dict[str, tuple[str, type[QwenVisionAdapter]]] = {
    "Qwen2VisionTransformerPretrainedModel": ("Qwen2VLForConditionalGeneration", Qwen2VLAdapter),
    "Qwen2_5_VisionTransformerPretrainedModel": (
        "Qwen2_5_VLForConditionalGeneration",
        Qwen2_5_VLAdapter,
    ),
    "Qwen3VLVisionModel": ("Qwen3VLForConditionalGeneration", Qwen3VLAdapter),
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(arch for arch, _ in _ADAPTERS.values())


def find_vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """The vision tower of a *ForConditionalGeneration, its inner *Model, or the tower itself."""
    inner = getattr(model, "model", None)
    for candidate in (model, getattr(model, "visual", None), getattr(inner, "visual", None)):
        if candidate is not None and type(candidate).__name__ in _ADAPTERS:
            return candidate
    return None


def adapter_for(
    model: torch.nn.Module, *, attn_backend: str | None = None, **options
) -> QwenVisionAdapter:
    """The SupportsEncoderCudaGraph adapter over `model`'s own vision tower.

    `options` go to the adapter (`max_frames_per_item`, `budget_range`).
    """
    tower = find_vision_tower(model)
    if tower is None:
        raise ValueError(
            f"{type(model).__name__} is not supported by encoder_graphs; "
            f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    _, adapter_class = _ADAPTERS[type(tower).__name__]
    return adapter_class(tower, attn_backend=attn_backend, **options)


__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "Qwen2VLAdapter",
    "Qwen2_5_VLAdapter",
    "Qwen3VLAdapter",
    "VisionBatch",
    "adapter_for",
    "find_vision_tower",
]
