"""Which family adapter serves a transformers model: a registry keyed on transformers classes.

Each entry names the family's config class, its model classes (the *ForConditionalGeneration and
the inner *Model), the class of the module its adapter wraps (the vision tower, or for InternVL
the inner model) and the attribute that holds it, the adapter
(`SupportsEncoderCudaGraph` + `ModelFamily`) and the caption inputs builder (`CaptionInputs`).
The table is built at the first lookup, so importing this module loads no adapter, nor torch:
`option_help` serves the command line's `--help`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

# Each family's folder, whose `help.py` says what the command line's help tells of it.
FAMILY_FOLDERS = ("qwen", "internvl", "deepseek_ocr")


@dataclass(frozen=True)
class Family:
    config_class: type
    model_classes: tuple[type, ...]
    tower_class: type
    tower_attribute: str
    adapter: type
    inputs: type

    @property
    def architecture(self) -> str:
        return self.model_classes[0].__name__


@cache
def families() -> tuple[Family, ...]:
    from transformers import (
        DeepseekOcr2Config,
        DeepseekOcr2ForConditionalGeneration,
        DeepseekOcr2Model,
        InternVLConfig,
        InternVLForConditionalGeneration,
        InternVLModel,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLModel,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLModel,
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5Model,
        Qwen3_5VisionModel,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLModel,
        Qwen3VLVisionModel,
    )

    from encoder_graphs.models.deepseek_ocr.adapter import DeepseekOcrAdapter
    from encoder_graphs.models.deepseek_ocr.inputs import DeepseekOcrInputs
    from encoder_graphs.models.internvl.adapter import InternVLAdapter
    from encoder_graphs.models.internvl.inputs import InternVLInputs
    from encoder_graphs.models.qwen.inputs import QwenVLInputs
    from encoder_graphs.models.qwen.qwen2_5_vl import Qwen2_5_VLAdapter
    from encoder_graphs.models.qwen.qwen2_vl import Qwen2VLAdapter
    from encoder_graphs.models.qwen.qwen3_5 import Qwen3_5Adapter
    from encoder_graphs.models.qwen.qwen3_vl import Qwen3VLAdapter
    from encoder_graphs.seam.vision import qwen_vision_towers

    Qwen2VisionTransformerPretrainedModel, Qwen2_5_VisionTransformerPretrainedModel = qwen_vision_towers()

    return (
        Family(
            Qwen2VLConfig,
            (Qwen2VLForConditionalGeneration, Qwen2VLModel),
            Qwen2VisionTransformerPretrainedModel,
            "visual",
            Qwen2VLAdapter,
            QwenVLInputs,
        ),
        Family(
            Qwen2_5_VLConfig,
            (Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLModel),
            Qwen2_5_VisionTransformerPretrainedModel,
            "visual",
            Qwen2_5_VLAdapter,
            QwenVLInputs,
        ),
        Family(
            Qwen3VLConfig,
            (Qwen3VLForConditionalGeneration, Qwen3VLModel),
            Qwen3VLVisionModel,
            "visual",
            Qwen3VLAdapter,
            QwenVLInputs,
        ),
        Family(
            Qwen3_5Config,
            (Qwen3_5ForConditionalGeneration, Qwen3_5Model),
            Qwen3_5VisionModel,
            "visual",
            Qwen3_5Adapter,
            QwenVLInputs,
        ),
        # The InternVL adapter graphs InternVLModel's whole get_image_features (tower, pixel
        # shuffle, projector), so the module it wraps is the inner model.
        Family(InternVLConfig, (InternVLForConditionalGeneration,), InternVLModel, "model", InternVLAdapter, InternVLInputs),
        # DeepSeek-OCR 2 (5.17.0, 5.23.0): the same, over both of its vision paths.
        Family(
            DeepseekOcr2Config,
            (DeepseekOcr2ForConditionalGeneration,),
            DeepseekOcr2Model,
            "model",
            DeepseekOcrAdapter,
            DeepseekOcrInputs,
        ),
    )


def option_help(option: str) -> list[str]:
    """What the families say of a command-line option (`option` as its destination, e.g.
    "max_tiles"), one phrase a family that says anything, in the registry's order."""
    phrases = (import_module(f"encoder_graphs.models.{folder}.help").HELP.get(option) for folder in FAMILY_FOLDERS)
    return [phrase for phrase in phrases if phrase]


def supported_architectures() -> list[str]:
    return [family.architecture for family in families()]


def _find(model: nn.Module) -> tuple[Family, nn.Module] | None:
    """The family of a *ForConditionalGeneration, its inner *Model, or a bare vision tower; and
    the tower."""
    for family in families():
        if isinstance(model, family.tower_class):
            return family, model
        if isinstance(model, family.model_classes):
            inner = getattr(model, "model", None)
            for owner in (model, inner):
                tower = getattr(owner, family.tower_attribute, None)
                if isinstance(tower, family.tower_class):
                    return family, tower
    return None


def family_class(model: nn.Module) -> type | None:
    """The adapter class of `model`'s family (its `generate_inputs` and `check_decoder_inputs`), or None when unregistered."""
    found = _find(model)
    return found[0].adapter if found is not None else None


def family_for_config(config: Any) -> Family:
    """The family of a checkpoint's config; ValueError naming the supported ones otherwise."""
    for family in families():
        if isinstance(config, family.config_class):
            return family
    raise ValueError(_unsupported(type(config).__name__))


def adapter_for(model: nn.Module, *, attn_backend: str | None = None, **options: Any) -> Any:
    """The family adapter over `model`'s own vision tower (or, for InternVL, its inner model).
    `options` go to the adapter's constructor (e.g. `budget_range`)."""
    found = _find(model)
    if found is None:
        raise ValueError(_unsupported(type(model).__name__))
    family, tower = found
    return family.adapter(tower, attn_backend=attn_backend, **options)


def _unsupported(name: str) -> str:
    return f"{name} is not supported by encoder_graphs; supported architectures: {', '.join(supported_architectures())}"
