"""DeepSeek-OCR 2 presets (transformers' DeepseekOcr2ForConditionalGeneration): the real size,
values from the public config.json of deepseek-community/DeepSeek-OCR-2, and a tiny CPU one."""

from transformers import DeepseekOcr2Config, DeepseekOcr2ForConditionalGeneration, DeepseekOcr2VisionModel

from encoder_graphs.presets.preset import Preset

# SAM ViT-B at 1024 px (global attention in blocks 2, 5, 8, 11; its neck to 256 channels, then two
# strided convs to 896, the encoder's width), then a Qwen2-0.5B-shaped encoder that reads SAM's
# patches and returns its learned queries. transformers' SAM defaults are these values, but for its
# init: SAM's weights drawn with std 1e-10 would make a random model's SAM a no-op; drawn as the
# encoder's are (0.02), it computes as a checkpoint's does. Its relative-position tables, which
# stock init zeroes, are drawn too (`Preset.drawn`).
_SAM = dict(
    initializer_range=0.02,
    hidden_size=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    mlp_dim=3072,
    output_channels=256,
    downsample_channels=[512, 896],
    window_size=14,
    global_attn_indexes=[2, 5, 8, 11],
)
_ENCODER = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
)
# DeepSeek-3B-MoE (A570M): 12 layers of multi-head attention (no MLA), the first a dense MLP, the
# others 64 routed experts (6 a token, softmax greedy routing) and 2 shared ones.
_TEXT = dict(
    vocab_size=129280,
    hidden_size=1280,
    intermediate_size=6848,
    moe_intermediate_size=896,
    num_hidden_layers=12,
    num_attention_heads=10,
    num_key_value_heads=10,
    head_dim=128,
    n_routed_experts=64,
    n_shared_experts=2,
    num_experts_per_tok=6,
    topk_method="greedy",
    n_group=1,
    topk_group=1,
    mlp_layer_types=["dense"] + ["sparse"] * 11,
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)


def _deepseek_ocr(text: dict, sam: dict, encoder: dict, image_token_id: int) -> Preset:
    return Preset(
        DeepseekOcr2Config,
        DeepseekOcr2ForConditionalGeneration,
        DeepseekOcr2VisionModel,
        text=text,
        vision=dict(sam_config=sam, encoder_config=encoder),
        extra=dict(image_token_id=image_token_id, tie_word_embeddings=False),
        drawn=("rel_pos",),
    )


DEEPSEEK_OCR_PRESETS: dict[str, Preset] = {
    "deepseek-ocr-2": _deepseek_ocr(_TEXT, _SAM, _ENCODER, image_token_id=128815),
    # Tiny: the real image sides (1024 px views, 768 px tiles: the encoder's query banks are sized
    # for them, 256 and 144 features) through two narrow SAM and encoder layers; a vocabulary
    # that holds the byte tokenizer's 256 bytes and the specials.
    "tiny-deepseek-ocr-2": _deepseek_ocr(
        dict(
            _TEXT,
            vocab_size=320,
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            mlp_layer_types=["dense", "sparse"],
            max_position_embeddings=4096,
        ),
        dict(_SAM, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_dim=64, output_channels=16,
             downsample_channels=[32, 64], global_attn_indexes=[1]),
        dict(_ENCODER, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2),
        image_token_id=300,
    ),
}
