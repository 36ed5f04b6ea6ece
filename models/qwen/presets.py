"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 presets: real sizes (values from the public
config.json files) and tiny CPU ones."""

from typing import Any

from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5VisionModel,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLVisionModel,
)

from encoder_graphs.presets.preset import TINY_TEXT, Preset
from encoder_graphs.seam.vision import qwen_vision_towers

Qwen2VisionTransformerPretrainedModel, Qwen2_5_VisionTransformerPretrainedModel = qwen_vision_towers()

# Tiny models keep every special token inside their small vocabulary.
_TINY_TOKENS = dict(
    image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253
)


_QWEN_TOKENS = dict(
    image_token_id=151655,
    video_token_id=151656,
    vision_start_token_id=151652,
    vision_end_token_id=151653,
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


# The Qwen3 tower in miniature (Qwen3-VL's adds deepstack levels, Qwen3.5's has none).
_TINY_QWEN3_VISION = dict(
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
)


# What the small Qwen3.5 checkpoints share (Qwen/Qwen3.5-0.8B, -2B, -4B, -9B config.json): every
# fourth layer full attention (head_dim 256, a quarter of it rotary, gated output), the others
# Gated DeltaNet with 16 key heads of 128; Qwen3's 16 px tower without deepstack. <|endoftext|> and
# <|im_end|> ids as in qwen3.5-vision.
_QWEN3_5_TEXT = dict(
    vocab_size=248320,
    head_dim=256,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
    rope_parameters=_mrope([11, 11, 10], 10_000_000.0, mrope_interleaved=True, partial_rotary_factor=0.25),
    bos_token_id=248044,
    eos_token_id=248046,
)
_QWEN3_5_VISION = dict(
    hidden_act="gelu_pytorch_tanh",
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=2304,
)


def _qwen3_5(
    layers: int, hidden: int, intermediate: int, heads: int, value_heads: int, tower: tuple[int, int, int, int]
) -> Preset:
    """Language model: layers, width, MLP width, query heads (a quarter as KV heads), Gated DeltaNet
    value heads. Tower: depth, width, MLP width, heads."""
    depth, width, mlp, tower_heads = tower
    return Preset(
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5VisionModel,
        text=dict(
            _QWEN3_5_TEXT,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads // 4,
            linear_num_value_heads=value_heads,
        ),
        vision=dict(
            _QWEN3_5_VISION,
            depth=depth,
            hidden_size=width,
            intermediate_size=mlp,
            num_heads=tower_heads,
            out_hidden_size=hidden,
        ),
        extra=dict(tie_word_embeddings=True),
    )


QWEN_PRESETS: dict[str, Preset] = {
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
        text=dict(TINY_TEXT, rope_parameters=_mrope([2, 3, 3], 10000.0)),
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
        text=dict(TINY_TEXT, rope_parameters=_mrope([2, 3, 3], 10000.0)),
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
            TINY_TEXT, head_dim=16, rope_parameters=_mrope([2, 3, 3], 10000.0, mrope_interleaved=True)
        ),
        vision=dict(_TINY_QWEN3_VISION, deepstack_visual_indexes=[1, 2]),
        extra=dict(tie_word_embeddings=False, **_TINY_TOKENS),
    ),
    # The Qwen3.5 tower at transformers' Qwen3_5VisionConfig defaults (5.17.0: Qwen3.5-9B's and the
    # larger sizes' tower), feeding a 4096-wide language model cut to one block of four layers
    # (three Gated DeltaNet, one full attention): the vision side at real size, in little memory.
    "qwen3.5-vision": Preset(
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5VisionModel,
        # <|endoftext|> and <|im_end|> where Qwen's earlier vocabularies put them (9 and 7 ids
        # below <|vision_start|>): the preset's byte-level tokenizer needs ids, not these exactly.
        text=dict(num_hidden_layers=4, bos_token_id=248044, eos_token_id=248046),
        vision=dict(out_hidden_size=4096),
        extra=dict(tie_word_embeddings=False),
    ),
    # Qwen/Qwen3.5-0.8B, -2B, -4B
    "qwen3.5-0.8b": _qwen3_5(24, 1024, 3584, 8, 16, tower=(12, 768, 3072, 12)),
    "qwen3.5-2b": _qwen3_5(24, 2048, 6144, 8, 16, tower=(24, 1024, 4096, 16)),
    "qwen3.5-4b": _qwen3_5(32, 2560, 9216, 16, 32, tower=(24, 1024, 4096, 16)),
    # Qwen3.5's shape in miniature: three Gated DeltaNet layers, then one of full attention with
    # partial rotary (a quarter of each head), and the Qwen3-VL tower without deepstack.
    "tiny-qwen3.5": Preset(
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5VisionModel,
        text=dict(
            TINY_TEXT,
            num_hidden_layers=4,
            head_dim=32,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            rope_parameters=_mrope([2, 1, 1], 10000.0, mrope_interleaved=True, partial_rotary_factor=0.25),
        ),
        vision=_TINY_QWEN3_VISION,
        extra=dict(tie_word_embeddings=False, **_TINY_TOKENS),
    ),
}
