"""Presets: real sizes match the public config.json files; tiny ones build and round-trip."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForImageTextToText

from encoder_graphs.models import adapter_for, supported_architectures
from encoder_graphs.models.registry import family_for_config
from encoder_graphs.presets import PRESETS, build_model, build_vision_tower, get_config
from encoder_graphs.presets.files import preset_files_dir

# Key fields of Qwen/Qwen2-VL-2B-Instruct, Qwen/Qwen2.5-VL-{3B,7B}-Instruct, Qwen/Qwen3-VL-2B-Instruct.
PUBLIC = {
    "qwen2-vl-2b": dict(
        text=dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                  intermediate_size=8960, vocab_size=151936),
        vision=dict(depth=32, embed_dim=1280, num_heads=16, mlp_ratio=4, hidden_size=1536, patch_size=14,
                    spatial_merge_size=2, temporal_patch_size=2),
        mrope=[16, 24, 24],
        tie=True,
    ),
    "qwen2.5-vl-3b": dict(
        text=dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                  intermediate_size=11008, vocab_size=151936),
        vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                    window_size=112, fullatt_block_indexes=[7, 15, 23, 31], patch_size=14,
                    tokens_per_second=2),
        mrope=[16, 24, 24],
        tie=True,
    ),
    "qwen2.5-vl-7b": dict(
        text=dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                  intermediate_size=18944, vocab_size=152064),
        vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                    window_size=112, fullatt_block_indexes=[7, 15, 23, 31], patch_size=14,
                    tokens_per_second=2),
        mrope=[16, 24, 24],
        tie=False,
    ),
    "qwen3-vl-2b": dict(
        text=dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, intermediate_size=6144, vocab_size=151936),
        vision=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
                    patch_size=16, num_position_embeddings=2304, deepstack_visual_indexes=[5, 11, 17],
                    hidden_act="gelu_pytorch_tanh"),
        mrope=[24, 20, 20],
        tie=True,
    ),
}
# OpenGVLab/InternVL3-1B-hf and InternVL3_5-2B-HF config.json, and the 6B tower of InternVL3-38B-hf
# (OpenGVLab's internvl_custom2hf.py writes the same tower values).
INTERNVIT_300M = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                      norm_type="layer_norm", use_qk_norm=False, image_size=[448, 448], patch_size=[14, 14])
PUBLIC_INTERNVL = {
    "internvl3-1b": dict(
        text=dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, intermediate_size=4864, vocab_size=151674, max_position_embeddings=32768),
        vision=INTERNVIT_300M, image_token_id=151667, rope="dynamic", tie=True,
    ),
    "internvl3.5-2b": dict(
        text=dict(model_type="qwen3", hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, intermediate_size=6144, vocab_size=151936),
        vision=INTERNVIT_300M, image_token_id=151671, rope="default", tie=True,
    ),
    "internvl3-38b-vision": dict(
        text=dict(model_type="qwen2", hidden_size=5120, num_hidden_layers=1, vocab_size=151674),
        vision=dict(hidden_size=3200, num_hidden_layers=45, num_attention_heads=25, intermediate_size=12800,
                    norm_type="rms_norm", use_qk_norm=True, image_size=[448, 448], patch_size=[14, 14]),
        image_token_id=151667, rope="dynamic", tie=False,
    ),
}
# Qwen/Qwen3.5-0.8B, -2B, -4B config.json: (text, tower) key fields.
QWEN3_5_SHARED = dict(head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                      linear_num_key_heads=16, vocab_size=248320)
PUBLIC_QWEN3_5 = {
    "qwen3.5-0.8b": (dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
                          num_key_value_heads=2, linear_num_value_heads=16),
                     dict(depth=12, hidden_size=768, intermediate_size=3072, num_heads=12, out_hidden_size=1024)),
    "qwen3.5-2b": (dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8,
                        num_key_value_heads=2, linear_num_value_heads=16),
                   dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048)),
    "qwen3.5-4b": (dict(hidden_size=2560, intermediate_size=9216, num_hidden_layers=32, num_attention_heads=16,
                        num_key_value_heads=4, linear_num_value_heads=32),
                   dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2560)),
}
TINY = [name for name in PRESETS if name.startswith("tiny-")]


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_real_preset_matches_public_config(name):
    config = get_config(name)
    expected = PUBLIC[name]
    for key, value in expected["text"].items():
        assert getattr(config.text_config, key) == value, key
    for key, value in expected["vision"].items():
        got = getattr(config.vision_config, key)
        assert (list(got) if isinstance(got, tuple) else got) == value, key
    assert config.text_config.rope_parameters["mrope_section"] == expected["mrope"]
    assert config.tie_word_embeddings is expected["tie"]
    assert (config.image_token_id, config.video_token_id) == (151655, 151656)


def test_qwen3_5_vision_preset_is_the_default_tower_of_transformers():
    """qwen3.5-vision: the tower at transformers' Qwen3_5VisionConfig defaults as of 5.17.0 (the
    9B's and larger sizes'), pinned here, feeding one block of the hybrid language model."""
    config = get_config("qwen3.5-vision")
    tower = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16, spatial_merge_size=2,
                 temporal_patch_size=2, num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh")
    for key, value in tower.items():
        assert getattr(config.vision_config, key) == value, key
    assert config.vision_config.out_hidden_size == config.text_config.hidden_size
    assert config.text_config.layer_types == ["linear_attention"] * 3 + ["full_attention"]


@pytest.mark.parametrize("name", sorted(PUBLIC_QWEN3_5))
def test_real_qwen3_5_preset_matches_public_config(name):
    config = get_config(name)
    text, tower = PUBLIC_QWEN3_5[name]
    for key, value in {**QWEN3_5_SHARED, **text}.items():
        assert getattr(config.text_config, key) == value, key
    for key, value in dict(tower, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                           num_position_embeddings=2304, deepstack_visual_indexes=[]).items():
        assert getattr(config.vision_config, key, []) == value, key
    layers = config.text_config.num_hidden_layers
    assert config.text_config.layer_types == ["linear_attention", "linear_attention", "linear_attention",
                                              "full_attention"] * (layers // 4)
    rope = config.text_config.rope_parameters
    assert (rope["mrope_section"], rope["rope_theta"], rope["partial_rotary_factor"]) == ([11, 11, 10], 1e7, 0.25)
    assert rope["mrope_interleaved"] and config.tie_word_embeddings
    assert (config.image_token_id, config.video_token_id, config.vision_start_token_id) == (248056, 248057, 248053)


@pytest.mark.parametrize("name", sorted(PUBLIC_INTERNVL))
def test_real_internvl_preset_matches_public_config(name):
    config = get_config(name)
    expected = PUBLIC_INTERNVL[name]
    for part in ("text", "vision"):
        for key, value in expected[part].items():
            got = getattr(getattr(config, f"{part}_config"), key)
            assert (list(got) if isinstance(got, tuple) else got) == value, key
    assert config.image_token_id == expected["image_token_id"]
    assert config.text_config.rope_parameters["rope_type"] == expected["rope"]
    assert config.tie_word_embeddings is expected["tie"]
    assert (config.image_seq_length, config.downsample_ratio, config.vision_feature_layer) == (256, 0.5, -1)
    assert config.vision_feature_select_strategy == "default"


# deepseek-community/DeepSeek-OCR-2's config.json (transformers' conversion of deepseek-ai/DeepSeek-OCR-2).
PUBLIC_DEEPSEEK_OCR = {
    "deepseek-ocr-2": dict(
        text=dict(vocab_size=129280, hidden_size=1280, intermediate_size=6848, moe_intermediate_size=896,
                  num_hidden_layers=12, num_attention_heads=10, num_key_value_heads=10, n_routed_experts=64,
                  n_shared_experts=2, num_experts_per_tok=6, topk_method="greedy", bos_token_id=0, eos_token_id=1,
                  max_position_embeddings=8192, mlp_layer_types=["dense"] + ["sparse"] * 11),
        sam=dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, global_attn_indexes=[2, 5, 8, 11],
                 output_channels=256, downsample_channels=[512, 896], image_size=1024, patch_size=16),
        encoder=dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                     num_key_value_heads=2),
        image_token_id=128815,
    )
}


@pytest.mark.parametrize("name", sorted(PUBLIC_DEEPSEEK_OCR))
def test_real_deepseek_ocr_preset_matches_public_config(name):
    config, expected = get_config(name), PUBLIC_DEEPSEEK_OCR[name]
    parts = {"text": config.text_config, "sam": config.vision_config.sam_config,
             "encoder": config.vision_config.encoder_config}
    for part, sub_config in parts.items():
        for key, value in expected[part].items():
            assert getattr(sub_config, key) == value, (part, key)
    assert config.image_token_id == expected["image_token_id"] and not config.tie_word_embeddings


def test_every_preset_is_a_supported_architecture():
    public = set(PUBLIC) | set(PUBLIC_QWEN3_5) | set(PUBLIC_INTERNVL) | set(PUBLIC_DEEPSEEK_OCR)
    assert public | set(TINY) | {"qwen3.5-vision"} == set(PRESETS)
    for name in PRESETS:
        assert PRESETS[name].model_class.__name__ in supported_architectures()


def test_get_config_returns_a_fresh_config():
    first = get_config("qwen2.5-vl-7b")
    first.vision_config.depth = 1
    assert get_config("qwen2.5-vl-7b").vision_config.depth == 32


def test_real_vision_tower_size_on_meta_device():
    # Qwen2.5-VL's ViT is the ~670M-parameter tower of design.md; meta: no memory, no time.
    tower = build_vision_tower("qwen2.5-vl-7b", dtype=torch.bfloat16, device="meta")
    params = sum(p.numel() for p in tower.parameters())
    assert 0.66e9 < params < 0.69e9
    assert next(tower.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize("name", TINY)
def test_tiny_preset_round_trips(name, tmp_path):
    model = build_model(name, seed=3)
    assert not model.training
    config = model.config.vision_config
    if "internvl" in name:
        assert model.config.image_seq_length == (config.image_size[0] // config.patch_size[0] // 2) ** 2
    elif "deepseek" in name:  # the real view side: its encoder's query banks are sized for it
        assert config.sam_config.image_size == 1024 and config.sam_config.patch_size == 16
        # SAM drawn as a checkpoint's weights are spread, its relative positions too (stock: 1e-10 and 0)
        attention = model.model.vision_tower.sam_encoder.layers[0].attn
        tables = (attention.qkv.weight, attention.rel_pos_h, attention.rel_pos_w)
        assert all(0.01 < table.std() < 0.04 for table in tables)
    else:
        assert config.spatial_merge_size == 2 and config.temporal_patch_size == 2
    model.save_pretrained(tmp_path)
    assert type(AutoConfig.from_pretrained(tmp_path)) is type(model.config)
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(loaded) is type(model)
    state, loaded_state = model.state_dict(), loaded.state_dict()
    assert state.keys() == loaded_state.keys()
    for key, value in state.items():
        assert torch.equal(value, loaded_state[key]), key
    adapter_for(loaded)  # the loaded model is one our adapters take


@pytest.mark.parametrize("name", ["tiny-qwen2.5-vl", "tiny-internvl"])
def test_a_bf16_preset_keeps_its_buffers_as_a_bf16_checkpoint_load_does(name, tmp_path):
    """The rotary frequencies stay fp32, as `from_pretrained(dtype=torch.bfloat16)` leaves them:
    rounded to bf16 they rotate positions far from 0 otherwise than the checkpoint does."""
    model = build_model(name, dtype=torch.bfloat16, seed=3)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path, dtype=torch.bfloat16)
    buffers, loaded_buffers = dict(model.named_buffers()), dict(loaded.named_buffers())
    assert buffers.keys() == loaded_buffers.keys() and any(key.endswith("inv_freq") for key in buffers)
    for key, buffer in buffers.items():
        assert buffer.dtype == loaded_buffers[key].dtype and torch.equal(buffer, loaded_buffers[key]), key
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_seed_makes_weights_reproducible():
    first = build_vision_tower("tiny-qwen2.5-vl", seed=4)
    second = build_vision_tower("tiny-qwen2.5-vl", seed=4)
    other = build_vision_tower("tiny-qwen2.5-vl", seed=5)
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(first.parameters(), other.parameters()))


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(ValueError, match="qwen2.5-vl-7b"):
        get_config("qwen9-vl")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_has_caption_inputs_that_fit_it(name, tmp_path, monkeypatch):
    """The generated tokenizer and processor files (no weights) let the caption command run any
    preset: token ids, vocabulary and patch or tile sizes match the model."""
    monkeypatch.setenv("ENCODER_GRAPHS_CACHE", str(tmp_path))
    config = get_config(name)
    inputs = family_for_config(config).inputs.from_pretrained(preset_files_dir(name))
    inputs.check_model(config)
    assert inputs.eos_token_id == config.get_text_config().eos_token_id
    assert inputs.longest_prompt("Describe.", 4) > 0
