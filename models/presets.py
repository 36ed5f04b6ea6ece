"""Named model configs: real sizes (values from the public config.json files) and tiny CPU ones.

Weights are random: presets exist to measure speed and to test equivalence, not to caption.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from encoder_graphs.models.transformers_seam import from_config
from transformers import (
    PretrainedConfig,
    PreTrainedModel,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel


@dataclass(frozen=True)
class Preset:
    config_class: type[PretrainedConfig]
    model_class: type[PreTrainedModel]
    vision_class: type[PreTrainedModel]
    text: dict[str, Any]
    vision: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)

    def config(self) -> PretrainedConfig:
        return self.config_class(
            text_config=dict(self.text), vision_config=dict(self.vision), **self.extra
        )


_QWEN_TOKENS = dict(
    image_token_id=151655,
    video_token_id=151656,
    vision_start_token_id=151652,
    vision_end_token_id=151653,
)
# Tiny models keep every special token inside their small vocabulary.
_TINY_TOKENS = dict(
    image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253
)
_TINY_TEXT = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=1024,
    bos_token_id=0,
    eos_token_id=1,
)


# The vision tower both Qwen2.5-VL sizes share (only out_hidden_size differs).
_QWEN2_5_VISION = dict(
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    hidden_act="silu",
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31],
    tokens_per_second=2,
)


def _mrope(sections: list[int], theta: float, **extra: Any) -> dict[str, Any]:
    return {"rope_type": "default", "mrope_section": sections, "rope_theta": theta, **extra}


PRESETS: dict[str, Preset] = {
    # Qwen/Qwen2-VL-2B-Instruct
    "qwen2-vl-2b": Preset(
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VisionTransformerPretrainedModel,
        text=dict(
            vocab_size=151936,
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_parameters=_mrope([16, 24, 24], 1_000_000.0),
            bos_token_id=151643,
            eos_token_id=151645,
        ),
        vision=dict(
            depth=32,
            embed_dim=1280,
            hidden_size=1536,
            hidden_act="quick_gelu",
            mlp_ratio=4,
            num_heads=16,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        extra=dict(tie_word_embeddings=True, **_QWEN_TOKENS),
    ),
    # Qwen/Qwen2.5-VL-3B-Instruct
    "qwen2.5-vl-3b": Preset(
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VisionTransformerPretrainedModel,
        text=dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=11008,
            num_hidden_layers=36,
            num_attention_heads=16,
            num_key_value_heads=2,
            max_position_embeddings=128000,
            rms_norm_eps=1e-6,
            rope_parameters=_mrope([16, 24, 24], 1_000_000.0),
            bos_token_id=151643,
            eos_token_id=151645,
        ),
        vision=dict(_QWEN2_5_VISION, out_hidden_size=2048),
        extra=dict(tie_word_embeddings=True, **_QWEN_TOKENS),
    ),
    # Qwen/Qwen2.5-VL-7B-Instruct
    "qwen2.5-vl-7b": Preset(
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VisionTransformerPretrainedModel,
        text=dict(
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            max_position_embeddings=128000,
            rms_norm_eps=1e-6,
            rope_parameters=_mrope([16, 24, 24], 1_000_000.0),
            bos_token_id=151643,
            eos_token_id=151645,
        ),
        vision=dict(_QWEN2_5_VISION, out_hidden_size=3584),
        extra=dict(tie_word_embeddings=False, **_QWEN_TOKENS),
    ),
    # Qwen/Qwen3-VL-2B-Instruct
    "qwen3-vl-2b": Preset(
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLVisionModel,
        text=dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=262144,
            rms_norm_eps=1e-6,
            rope_parameters=_mrope([24, 20, 20], 5_000_000.0, mrope_interleaved=True),
            bos_token_id=151643,
            eos_token_id=151645,
        ),
        vision=dict(
            depth=24,
            hidden_size=1024,
            intermediate_size=4096,
            num_heads=16,
            out_hidden_size=2048,
            hidden_act="gelu_pytorch_tanh",
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            num_position_embeddings=2304,
            deepstack_visual_indexes=[5, 11, 17],
        ),
        extra=dict(tie_word_embeddings=True, **_QWEN_TOKENS),
    ),
    # Tiny: same structure (merge 2, temporal patch 2, windows, deepstack), a few narrow layers.
    "tiny-qwen2-vl": Preset(
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VisionTransformerPretrainedModel,
        text=dict(_TINY_TEXT, rope_parameters=_mrope([2, 3, 3], 10000.0)),
        vision=dict(
            depth=2,
            embed_dim=32,
            hidden_size=32,
            hidden_act="quick_gelu",
            mlp_ratio=2,
            num_heads=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        extra=dict(tie_word_embeddings=False, **_TINY_TOKENS),
    ),
    "tiny-qwen2.5-vl": Preset(
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VisionTransformerPretrainedModel,
        text=dict(_TINY_TEXT, rope_parameters=_mrope([2, 3, 3], 10000.0)),
        vision=dict(
            depth=4,
            hidden_size=32,
            intermediate_size=44,
            num_heads=2,
            out_hidden_size=32,
            hidden_act="silu",
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
            fullatt_block_indexes=[1, 3],
            tokens_per_second=2,
        ),
        extra=dict(tie_word_embeddings=False, **_TINY_TOKENS),
    ),
    "tiny-qwen3-vl": Preset(
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLVisionModel,
        text=dict(
            _TINY_TEXT, head_dim=16, rope_parameters=_mrope([2, 3, 3], 10000.0, mrope_interleaved=True)
        ),
        vision=dict(
            depth=4,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=32,
            hidden_act="gelu_pytorch_tanh",
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            num_position_embeddings=144,
            deepstack_visual_indexes=[1, 2],
        ),
        extra=dict(tie_word_embeddings=False, **_TINY_TOKENS),
    ),
}


def _preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]


def get_config(name: str) -> PretrainedConfig:
    """A fresh config of the whole *ForConditionalGeneration model."""
    return _preset(name).config()


def _build(
    factory: Callable[[], PreTrainedModel], dtype: torch.dtype, device: str | torch.device, seed: int
) -> PreTrainedModel:
    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in the target dtype: no fp32 copy of a large model
    try:
        with torch.device(device):
            model = factory()
    finally:
        torch.set_default_dtype(default_dtype)
    return model.to(dtype).eval()


def build_model(
    name: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0
) -> PreTrainedModel:
    """The whole model with random weights, in eval mode, built directly on `device` in `dtype`."""
    preset = _preset(name)
    config = preset.config()
    return _build(lambda: from_config(preset.model_class, config, dtype), dtype, device, seed)


def build_vision_tower(
    name: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0
) -> PreTrainedModel:
    """Only the vision tower (the module a model holds as `model.visual`), random weights."""
    preset = _preset(name)
    config = preset.config().vision_config
    return _build(lambda: from_config(preset.vision_class, config, dtype), dtype, device, seed)
