"""DeepSeek-OCR 2 on its two vision paths (CPU: the manager's eager path, the same packing and
per-path outputs the graphs replay): each page's global view on the "global" path, its local
tiles on the "local" one; features equal the stock `get_image_features` for pages of 0 to 6
tiles, a call with no tiles at all, and per-path statistics. A tiny model, saved and reloaded for
real; the caption command over a folder of pages."""

import json
from pathlib import Path

import pytest
import torch
from fidelity import relative_error
from PIL import Image
from transformers import DeepseekOcr2Config, DeepseekOcr2ForConditionalGeneration
from transformers.models.deepseek_ocr2.modeling_deepseek_ocr2 import (
    DeepseekOcr2SamVisionAttention,
    DeepseekOcr2SamVisionSdpaAttention,
)

from encoder_graphs import enable_cuda_graphs
from encoder_graphs.app.cli import main
from encoder_graphs.attention.rel_pos import decomposed_rel_pos_attention
from encoder_graphs.models.deepseek_ocr.adapter import GLOBAL, LOCAL, Pages
from encoder_graphs.models.registry import adapter_for
from encoder_graphs.seam.vision import rel_pos_on_device, sam_attention_forward

# The tower keeps its real image sides (1024 px views, 768 px tiles: its query banks are sized for
# them) and shrinks everything else.
TINY = dict(
    image_token_id=60,
    vision_config=dict(
        sam_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_dim=64, output_channels=16,
                        downsample_channels=[32, 64], window_size=14, global_attn_indexes=[1],
                        initializer_range=0.02),  # stock's 1e-10 would make SAM a no-op
        encoder_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=1),
    ),
    text_config=dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2,
                     moe_intermediate_size=32, topk_method="greedy", n_group=1, topk_group=1,
                     mlp_layer_types=["dense", "sparse"], max_position_embeddings=4096, bos_token_id=1,
                     eos_token_id=2, pad_token_id=3),
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-deepseek-ocr2")
    torch.manual_seed(0)
    model = DeepseekOcr2ForConditionalGeneration(DeepseekOcr2Config(**TINY))
    with torch.no_grad():  # stock init zeroes SAM's relative-position tables; a checkpoint's are not zero
        for name, table in model.named_parameters():
            if "rel_pos" in name:
                table.normal_(0, 0.5)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model(checkpoint):
    return DeepseekOcr2ForConditionalGeneration.from_pretrained(checkpoint).eval()


def pages(tiles_per_page: list[int], seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    views = torch.randn(len(tiles_per_page), 3, 1024, 1024, generator=generator)
    local = torch.randn(sum(tiles_per_page), 3, 768, 768, generator=generator)
    return dict(pixel_values=views, pixel_values_local=local if sum(tiles_per_page) else None,
                num_local_patches=torch.tensor(tiles_per_page))


CALLS = [[0, 3, 6, 2], [6], [0, 0], [2, 0, 4]]  # small, large, none, small: buffers reused across sizes


def test_both_paths_give_the_stock_features(model):
    calls = [pages(tiles, seed) for seed, tiles in enumerate(CALLS)]
    with torch.inference_mode():
        expected = [model.get_image_features(**call).pooler_output for call in calls]
    attentions = [layer.attn for layer in model.model.vision_tower.sam_encoder.layers]
    handle = enable_cuda_graphs(model, decoder=False)
    try:
        # SAM's attentions fold their relative positions into q and k (capturable), until disable().
        assert all("forward" in vars(attention) and "get_rel_pos" in vars(attention) for attention in attentions)
        with torch.inference_mode():
            got = [model.get_image_features(**call).pooler_output for call in calls]
        paths = handle.stats()["encoder"]["paths"]
    finally:
        handle.disable()
    assert not any("forward" in vars(attention) or "get_rel_pos" in vars(attention) for attention in attentions)
    for tiles, ours, theirs in zip(CALLS, got, expected, strict=True):
        assert [page.shape[0] for page in ours] == [256 + 144 * count + 1 for count in tiles]
        for page, stock in zip(ours, theirs, strict=True):
            torch.testing.assert_close(page, stock, rtol=1e-5, atol=1e-5)
    pages_seen = sum(len(tiles) for tiles in CALLS)
    with_tiles = sum(1 for tiles in CALLS for count in tiles if count)
    assert paths[GLOBAL]["hits"] + paths[GLOBAL]["misses"] == pages_seen  # every page's view
    assert paths[LOCAL]["hits"] + paths[LOCAL]["misses"] == with_tiles  # the local path skipped where no tiles


def test_generate_through_the_paths_and_the_static_cache_gives_stock_tokens(model):
    """Its MoE language model decodes through the runner's static cache (the model's own forward:
    its layers are not the fused step's), left-padded prompts of a page without tiles and one
    with two: greedy tokens equal the stock `generate`'s, fp32."""
    prompts = [[1] + [TINY["image_token_id"]] * (257 + 144 * tiles) + [10, 11, 12] for tiles in (0, 2)]
    longest = max(map(len, prompts))
    ids = torch.tensor([[3] * (longest - len(prompt)) + prompt for prompt in prompts])
    inputs = dict(input_ids=ids, attention_mask=(ids != 3).long(), **pages([0, 2], seed=1))
    with torch.inference_mode():
        expected = model.generate(**inputs, max_new_tokens=8, do_sample=False, eos_token_id=None)
    handle = enable_cuda_graphs(model)
    try:
        with torch.inference_mode():
            got = model.generate(**inputs, max_new_tokens=8, do_sample=False, eos_token_id=None)
        stats = handle.stats()
    finally:
        handle.disable()
    assert torch.equal(got, expected)
    assert len(set(expected[:, -8:].flatten().tolist())) > 2  # the check means something
    assert stats["generate_fallbacks"] == {} and stats["decoder"]["steps"] == 7


@pytest.mark.parametrize("q_size, k_size", [(14, 14), (64, 64), (48, 48), (8, 16), (16, 8)])
def test_relative_positions_on_the_device_equal_stocks(model, q_size, k_size):
    attention = model.model.vision_tower.sam_encoder.layers[0].attn
    table = torch.randn(2 * max(q_size, k_size) + 5, 8, generator=torch.Generator().manual_seed(q_size))
    assert torch.equal(rel_pos_on_device(q_size, k_size, table), attention.get_rel_pos(q_size, k_size, table))


@pytest.mark.parametrize("attention", [DeepseekOcr2SamVisionAttention, DeepseekOcr2SamVisionSdpaAttention])
@pytest.mark.parametrize("shape", [(3, 14, 14), (1, 64, 64), (2, 6, 10)])  # windows, the 1024 px grid, a rectangle
def test_folded_relative_positions_equal_stock_attention(model, attention, shape):
    """Scores with the relative positions folded into q and k (one attention, no [tokens, tokens]
    bias) against both stock SAM attentions: equal in fp32; in bf16 as near the fp32 output as
    stock's bf16 is. The head width plus the grid's sides is padded to a multiple of 8 (16 + 14 +
    14 here)."""
    sam = model.model.vision_tower.sam_encoder
    layer = sam.layers[sam.config.global_attn_indexes[0]]
    stock = attention(sam.config, window_size=0).eval()
    stock.load_state_dict(layer.attn.state_dict())
    assert stock.use_rel_pos and stock.rel_pos_h.abs().sum() > 0
    hidden = torch.randn(*shape, sam.config.hidden_size, generator=torch.Generator().manual_seed(sum(shape)))
    folded = sam_attention_forward(stock, decomposed_rel_pos_attention)
    with torch.inference_mode():
        want, got = stock(hidden)[0], folded(hidden)[0]
        plain = sam_attention_forward(stock, lambda q, k, v, rel_h, rel_w, scale: decomposed_rel_pos_attention(
            q, k, v, torch.zeros_like(rel_h), torch.zeros_like(rel_w), scale))(hidden)[0]
        stock.to(torch.bfloat16)
        stock_bf16, folded_bf16 = stock(hidden.bfloat16())[0], folded(hidden.bfloat16())[0]
    assert relative_error(got, want) < 1e-5
    assert relative_error(plain, want) > 0.05  # the positions matter: the check means something
    assert relative_error(folded_bf16, want) < 1.5 * relative_error(stock_bf16, want)


def test_eager_attention_keeps_its_weights(checkpoint):
    """A model loaded with eager attention: SAM's attentions keep their stock forward (it returns
    the weights, which `output_attentions` records), with their tables indexed on the device."""
    model = DeepseekOcr2ForConditionalGeneration.from_pretrained(checkpoint, attn_implementation="eager").eval()
    sam = model.model.vision_tower.sam_encoder
    views = pages([0], seed=3)["pixel_values"]
    with torch.inference_mode():
        expected = sam(views, output_attentions=True).attentions
    handle = enable_cuda_graphs(model, decoder=False)
    try:
        assert all("forward" not in vars(layer.attn) for layer in sam.layers)
        assert all(vars(layer.attn)["get_rel_pos"] is rel_pos_on_device for layer in sam.layers)
        with torch.inference_mode():
            got = sam(views, output_attentions=True).attentions
    finally:
        handle.disable()
    assert len(got) == len(expected) == len(sam.layers)
    for ours, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, theirs)


def test_pages_select_each_pages_own_tiles():
    views = torch.arange(3, dtype=torch.float32)[:, None, None, None].expand(3, 3, 1024, 1024)
    tiles = torch.arange(5, dtype=torch.float32)[:, None, None, None].expand(5, 3, 768, 768)
    picked = Pages(views, tiles, [2, 0, 3]).select([2, 0])
    assert picked.tiles_per_page == [3, 2]
    assert picked.views[:, 0, 0, 0].tolist() == [2, 0] and picked.tiles[:, 0, 0, 0].tolist() == [2, 3, 4, 0, 1]
    with pytest.raises(ValueError, match="tile counts"):
        Pages(views, tiles, [2, 0, 2])
    with pytest.raises(ValueError, match="the tower takes"):
        Pages(views[:, :, :768, :768], tiles, [2, 0, 3])


def test_the_adapter_specs_count_views_and_tiles(model):
    adapter = adapter_for(model)
    specs = adapter.get_item_specs(adapter.feature_inputs("get_image_features", pages([0, 4], seed=9)))
    assert [spec.path_tokens for spec in specs] == [{GLOBAL: 1, LOCAL: 0}, {GLOBAL: 1, LOCAL: 4}]
    assert [spec.output_tokens for spec in specs] == [257, 257 + 4 * 144]


def test_the_caption_command_reads_a_folder_of_pages(tmp_path, monkeypatch):
    """The tiny preset through the command: a page under one tile (no local rows), a tall and a
    wide one (tiles), a video refused unread; each page's record carries the OCR prompt (the
    model's default), its statistics per path."""
    monkeypatch.setenv("ENCODER_GRAPHS_CACHE", str(tmp_path / "cache"))
    pages = tmp_path / "pages"
    pages.mkdir()
    for name, size in {"note": (600, 400), "letter": (850, 1100), "slide": (1600, 900)}.items():
        Image.new("RGB", size, (250, 250, 245)).save(pages / f"{name}.png")
    (pages / "talk.mp4").write_bytes(b"not decoded: a video is refused by its kind")
    out, stats = tmp_path / "pages.jsonl", tmp_path / "stats.json"
    argv = ["caption", str(pages), "--model", "tiny-deepseek-ocr-2", "--out", str(out), "--stats-json", str(stats),
            "--max-new-tokens", "3", "--quiet"]
    assert main(argv) == 1  # the video failed
    records = {Path(r["path"]).stem: r for r in map(json.loads, out.read_text().splitlines())}
    assert records["talk"]["error_kind"] == "unsupported" and "reads images, not videos" in records["talk"]["error"]
    for name in ("note", "letter", "slide"):
        assert "error" not in records[name], records[name]
        assert records[name]["prompt"] == "Free OCR." and 0 <= records[name]["tokens"] <= 3
    encoder = json.loads(stats.read_text())["encoder"]
    assert encoder["items"] == 3
    views, tiles = (encoder["paths"][path] for path in (GLOBAL, LOCAL))
    assert views["hits"] + views["misses"] == 3  # every page has a view
    assert tiles["hits"] + tiles["misses"] == 2  # the note, under one tile, has no tiles
    # A prompt given overrides the model's; one the page's tokens would collide with is refused.
    (tmp_path / "prompt.txt").write_text("Convert the document to markdown.")
    assert main([*argv, "--prompt-file", str(tmp_path / "prompt.txt"), "--out", str(tmp_path / "md.jsonl")]) == 1
    markdown = [json.loads(line) for line in (tmp_path / "md.jsonl").read_text().splitlines()]
    assert {r["prompt"] for r in markdown if "caption" in r} == {"Convert the document to markdown."}
    assert main([*argv, "--prompt", "<image> read", "--out", str(tmp_path / "bad.jsonl")]) == 2
