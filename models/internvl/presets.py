"""InternVL presets (transformers' InternVLForConditionalGeneration): real sizes, values from the
public config.json files and OpenGVLab's HF conversion script, and a tiny CPU one."""

from typing import Any

from transformers import InternVLConfig, InternVLForConditionalGeneration, InternVLVisionModel

from encoder_graphs.presets.preset import TINY_TEXT, Preset

# InternViT-300M (InternVL3-1B/2B/8B, InternVL3.5-1B..8B) and InternViT-6B (InternVL3-38B/78B,
# InternVL3.5-38B/241B), as OpenGVLab's HF conversion (internvl_chat/tools/internvl_custom2hf.py)
# writes them: 448² tiles, patch 14, CLS, absolute position embeddings, layer scale 0.1.
_INTERNVIT_300M = dict(
    hidden_size=1024,
    num_hidden_layers=24,
    num_attention_heads=16,
    intermediate_size=4096,
    norm_type="layer_norm",
    use_qk_norm=False,
    attention_bias=True,
    layer_scale_init_value=0.1,
    layer_norm_eps=1e-6,
    image_size=448,
    patch_size=14,
    hidden_act="gelu",
    use_mean_pooling=True,
)
_INTERNVIT_6B = dict(
    _INTERNVIT_300M,
    hidden_size=3200,
    num_hidden_layers=45,
    num_attention_heads=25,
    intermediate_size=12800,
    norm_type="rms_norm",
    use_qk_norm=True,
    attention_bias=False,
)
_QWEN_TEXT_IDS = dict(bos_token_id=151643, eos_token_id=151645)


def _internvl(text: dict[str, Any], vision: dict[str, Any], image_token_id: int, tie: bool, **extra: Any) -> Preset:
    return Preset(
        InternVLConfig,
        InternVLForConditionalGeneration,
        InternVLVisionModel,
        text=text,
        vision=vision,
        extra=dict(
            image_token_id=image_token_id,
            downsample_ratio=0.5,
            projector_hidden_act="gelu",
            vision_feature_layer=-1,
            vision_feature_select_strategy="default",
            tie_word_embeddings=tie,
            **{"image_seq_length": 256, **extra},
        ),
    )


# InternVL3 language models (Qwen2.5) use dynamic rotary scaling x2 over 32768 positions.
_DYNAMIC_ROPE = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1_000_000.0}

INTERNVL_PRESETS: dict[str, Preset] = {
    # OpenGVLab/InternVL3-1B-hf: InternViT-300M + Qwen2.5-0.5B; image token 151667
    "internvl3-1b": _internvl(
        dict(
            model_type="qwen2",
            vocab_size=151674,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_parameters=_DYNAMIC_ROPE,
            **_QWEN_TEXT_IDS,
        ),
        _INTERNVIT_300M,
        image_token_id=151667,
        tie=True,
    ),
    # OpenGVLab/InternVL3_5-2B-HF: InternViT-300M + Qwen3-1.7B; image token 151671
    "internvl3.5-2b": _internvl(
        dict(
            model_type="qwen3",
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            **_QWEN_TEXT_IDS,
        ),
        _INTERNVIT_300M,
        image_token_id=151671,
        tie=True,
    ),
    # InternViT-6B as in OpenGVLab/InternVL3-38B-hf, with the projector to its 5120-wide language
    # model; the language model cut to one layer: the vision side at real size, in little memory.
    "internvl3-38b-vision": _internvl(
        dict(
            model_type="qwen2",
            vocab_size=151674,
            hidden_size=5120,
            intermediate_size=27648,
            num_hidden_layers=1,
            num_attention_heads=40,
            num_key_value_heads=8,
            max_position_embeddings=32768,
            rms_norm_eps=1e-5,
            rope_parameters=_DYNAMIC_ROPE,
            **_QWEN_TEXT_IDS,
        ),
        _INTERNVIT_6B,
        image_token_id=151667,
        tie=False,
    ),
    # Tiny: 56² tiles of 4x4 patches -> 4 tokens per tile after the pixel shuffle; both norms'
    # code paths are real-size ones (layer norm here, RMS + qk-norm in the 6B preset).
    "tiny-internvl": _internvl(
        dict(TINY_TEXT, model_type="qwen2", rope_parameters=dict(_DYNAMIC_ROPE, rope_theta=10000.0)),
        dict(
            _INTERNVIT_300M,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            image_size=56,
        ),
        image_token_id=250,
        tie=False,
        image_seq_length=4,
    ),
}
