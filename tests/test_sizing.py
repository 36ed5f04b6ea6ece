"""`--batch-size auto` on a 24 GiB card: the arithmetic of `app.sizing` for the real-size presets
at the default resolution policy and at the checkpoint's own (GPU: benchmarks/bench_cli.py
--card-gib 24 runs the command with only that much memory free)."""

import pytest
import torch

from encoder_graphs.app.config import DEFAULT_IMAGE_TOKENS, CaptionConfig
from encoder_graphs.app.media import LoadLimits
from encoder_graphs.app.model_checks import longest_sequence
from encoder_graphs.app.sizing import (
    GIB,
    RESERVE_BYTES,
    SequenceMemory,
    TextSizes,
    batch_size_for,
    model_sizes,
    sequence_memory,
)
from encoder_graphs.models.registry import family_for_config
from encoder_graphs.presets import build_model, get_config
from encoder_graphs.presets.files import preset_files_dir

CARD = 24 * GIB
CUDA_CONTEXT = GIB // 2  # what the CUDA context and torch take before any tensor


@pytest.fixture(autouse=True)
def preset_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ENCODER_GRAPHS_CACHE", str(tmp_path_factory.getbasetemp() / "preset-cache"))


def plan(
    name: str, max_image_tokens: int | None, max_tiles: int | None = None, videos: bool = False
) -> tuple[int, SequenceMemory, int]:
    """(weight bytes, one sequence's memory, the batch auto picks) for `name` on the card, for a
    job of images (`videos`: and 16-frame videos)."""
    config = get_config(name)
    inputs = family_for_config(config).inputs.from_pretrained(
        preset_files_dir(name), max_image_tokens=max_image_tokens, max_tiles=max_tiles
    )
    caption = CaptionConfig()
    limits = LoadLimits(max_frames=16, min_side=inputs.min_side, max_pixels=inputs.max_image_pixels,
                        frame_max_pixels=inputs.max_frame_pixels)
    longest = longest_sequence(inputs, caption, limits, videos)
    weights = sum(p.numel() for p in build_model(name, dtype=torch.bfloat16, device="meta").parameters()) * 2
    memory = sequence_memory(model_sizes(config, 2), longest, longest - caption.max_new_tokens)
    return weights, memory, batch_size_for(CARD - CUDA_CONTEXT - weights, memory)


@pytest.mark.parametrize(
    "name, tokens, tiles, videos, least",
    [
        ("qwen2.5-vl-3b", DEFAULT_IMAGE_TOKENS, None, False, 32),
        ("qwen2.5-vl-3b", DEFAULT_IMAGE_TOKENS, None, True, 1),  # 16 frames of up to 768 tokens a pair
        ("qwen2.5-vl-3b", None, None, False, 1),  # the checkpoint's 16384 tokens an image
        ("qwen2-vl-2b", DEFAULT_IMAGE_TOKENS, None, False, 32),
        ("qwen3-vl-2b", DEFAULT_IMAGE_TOKENS, None, False, 16),
        ("qwen3.5-2b", DEFAULT_IMAGE_TOKENS, None, False, 32),  # 6 of 24 layers hold keys and values
        ("internvl3.5-2b", None, None, False, 16),  # 12 tiles and a thumbnail: 3,328 tokens
    ],
)
def test_auto_batch_fits_a_24_gib_card(name, tokens, tiles, videos, least):
    weights, memory, batch = plan(name, tokens, tiles, videos)
    used = CUDA_CONTEXT + weights + RESERVE_BYTES + batch * memory.peak
    print(f"{name} tokens {tokens}: weights {weights / GIB:.1f} GiB, a sequence {memory.peak / 2**20:.0f} MiB "
          f"({memory.resident / 2**20:.0f} resident), batch {batch}, {used / GIB:.1f} GiB of 24")
    assert used <= CARD
    assert least <= batch <= 64
    assert batch == 64 or CUDA_CONTEXT + weights + RESERVE_BYTES + (batch + 8) * memory.peak > CARD


def test_the_policy_not_the_checkpoint_sizes_the_batch():
    _, default, at_default = plan("qwen2.5-vl-3b", DEFAULT_IMAGE_TOKENS)
    _, full, at_full = plan("qwen2.5-vl-3b", None)
    assert full.peak > 8 * default.peak and at_full < at_default


def test_sequence_memory_counts_cache_and_prefill():
    sizes = TextSizes(num_layers=2, hidden_size=8, intermediate_size=16, mixer_width=16, num_kv_heads=1, head_dim=4,
                      vocab_size=10, dtype_bytes=2, pixel_bytes_per_vision_token=1000)
    assert sizes.kv_bytes_per_token == 2 * 2 * 1 * 4 * 2
    memory = sequence_memory(sizes, longest=100, longest_prompt=60)
    assert memory.resident == 32 * 100 + 10 * 8
    widest = 2 * 8 + 3 * 16 + 16
    assert memory.prefill == 60 * (32 + widest * 2 + 2 * 8 * 2 + 1000)
    with pytest.raises(ValueError):
        sequence_memory(sizes, longest=10, longest_prompt=11)


def test_batch_size_for_steps_of_8_and_bounds():
    one = SequenceMemory(resident=GIB // 4, prefill=GIB // 4)  # 0.5 GiB a sequence
    assert batch_size_for(RESERVE_BYTES + 3 * GIB, one) == 6
    assert batch_size_for(RESERVE_BYTES + 9 * GIB, one) == 16  # 18 fit: a multiple of 8
    assert batch_size_for(RESERVE_BYTES + 100 * GIB, one) == 64
    assert batch_size_for(RESERVE_BYTES, one) == batch_size_for(0, one) == 1


@pytest.mark.parametrize("name", ["tiny-qwen3.5", "qwen3.5-2b", "qwen2.5-vl-3b"])
def test_cache_arithmetic_equals_the_static_store(name):
    """The sizes count what the decoder's static store allocates: keys and values for attention
    layers only, a hybrid model's linear layers their conv and fp32 recurrent states."""
    from encoder_graphs.decoder.buffers import TextDims
    from encoder_graphs.decoder.static_cache import StaticKVStore

    model = build_model(name, dtype=torch.bfloat16, device="meta")
    sizes = TextSizes.of(model.config.get_text_config(decoder=True), 2)
    dims = TextDims.of(model)
    store = StaticKVStore(num_layers=dims.num_layers, rows=3, num_kv_heads=dims.num_kv_heads, head_dim=dims.head_dim,
                          max_cache_len=100, dtype=torch.bfloat16, device=torch.device("meta"), linear=dims.linear)
    assert sizes.linear_layers == (len(dims.linear.layers) if dims.linear else 0)
    assert store.nbytes == 3 * (100 * sizes.kv_bytes_per_token + sizes.state_bytes // 2)
    assert (sizes.linear_layers > 0) == name.startswith(("tiny-qwen3.5", "qwen3.5"))


def test_the_widest_mixer_counts_qwen3_5s_gate_and_its_delta_net_projections():
    """Qwen3.5-2B: attention's q with its gate, k, v: (2 x 8 + 2 x 2) x 256 = 5,120 a token; its
    Gated DeltaNet's convolved q, k, v (2 x 2,048 + 2,048) plus z (2,048), b and a (16 each): 8,224."""
    model = build_model("qwen3.5-2b", dtype=torch.bfloat16, device="meta")
    assert TextSizes.of(model.config.get_text_config(decoder=True), 2).mixer_width == 8224
    layer = model.get_decoder().layers[0].linear_attn
    projections = (layer.in_proj_qkv, layer.in_proj_z, layer.in_proj_b, layer.in_proj_a)
    assert sum(linear.out_features for linear in projections) == 8224
    attention = model.get_decoder().layers[3].self_attn
    assert sum(p.out_features for p in (attention.q_proj, attention.k_proj, attention.v_proj)) == 5120
    qwen2_5 = get_config("qwen2.5-vl-3b").get_text_config(decoder=True)
    assert TextSizes.of(qwen2_5, 2).mixer_width == (16 + 2 * 2) * 128


# Pixel values one vision token is encoded from: Qwen's merged 2 x 2 patches of 2 frames x 3
# channels (14 px patches for Qwen2/2.5-VL, 16 px for Qwen3-VL and Qwen3.5), an InternVL tile
# (448² x 3) over its 256 tokens, a DeepSeek-OCR view (1024² x 3) over 256 or a tile (768² x 3) over 144.
PIXELS_PER_TOKEN = {
    "qwen2-vl-2b": 4 * 2 * 3 * 14 * 14,
    "qwen2.5-vl-7b": 4 * 2 * 3 * 14 * 14,
    "qwen3-vl-2b": 4 * 2 * 3 * 16 * 16,
    "qwen3.5-2b": 4 * 2 * 3 * 16 * 16,
    "internvl3-1b": 448 * 448 * 3 // 256,
    "deepseek-ocr-2": 1024 * 1024 * 3 // 256,
}


@pytest.mark.parametrize("name", sorted(PIXELS_PER_TOKEN))
def test_each_family_says_its_pixels_per_vision_token_and_auto_batch_counts_them(name):
    """`--batch-size auto` counts the model's own pixels per vision token (its family's hook), in
    its dtype: a family of larger patches per token leaves room for fewer sequences."""
    config = get_config(name)
    assert family_for_config(config).adapter.pixel_values_per_vision_token(config) == PIXELS_PER_TOKEN[name]
    sizes = model_sizes(config, 2)
    assert sizes.pixel_bytes_per_vision_token == 2 * PIXELS_PER_TOKEN[name]
    text_only = sequence_memory(TextSizes.of(config.get_text_config(decoder=True), 2), 4096, 4000)
    assert sequence_memory(sizes, 4096, 4000).prefill == text_only.prefill + 4000 * 2 * PIXELS_PER_TOKEN[name]


@pytest.mark.parametrize("name, size", [("tiny-qwen2-vl", (300, 200)), ("tiny-qwen3-vl", (300, 200)),
                                        ("tiny-internvl", (900, 500)), ("tiny-deepseek-ocr-2", (1600, 900))])
def test_the_hook_bounds_what_the_familys_inputs_give_a_vision_token(name, size):
    """The pixel values a family's own caption inputs give the model for an image, over its vision tokens, are
    what the family's hook says (DeepSeek-OCR: at most, its view separator is a token of no pixels)."""
    from PIL import Image

    config = get_config(name)
    family = family_for_config(config)
    inputs = family.inputs.from_pretrained(preset_files_dir(name))
    item = inputs.encode_image(Image.new("RGB", size, (90, 120, 200)))
    batch = inputs.batch([item], "Describe.")  # what the model is given
    pixels = sum(value.numel() for key, value in batch.items() if key.startswith("pixel_values"))
    hook = family.adapter.pixel_values_per_vision_token(config)
    if name.startswith("tiny-deepseek"):
        assert hook * (item.vision_tokens - 1) >= pixels > hook * (item.vision_tokens - 2)
    else:
        assert pixels == hook * item.vision_tokens
