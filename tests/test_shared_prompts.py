"""Several prompts per item over one prefill of their shared prefix (`decoder/shared.py`), on the
CPU (the eager path runs the same step the graphs hold): each row's tokens equal those of the
runner over that prompt alone, greedy, fp32. Tiny models, saved and reloaded for real."""

import pytest
import torch
from synthetic_prompts import mm_token_type_ids, random_pixels, random_text, tile_prompt, vision_span

from encoder_graphs.decoder.runner import DecoderGraphRunner
from encoder_graphs.decoder.shared import SharedPrompts
from encoder_graphs.presets import PRESETS, build_model

NEW_TOKENS = 10
NO_EOS = 10**6  # outside every vocabulary: sequences run to max_new_tokens
FAMILIES = ["tiny-qwen2.5-vl", "tiny-qwen3.5", "tiny-internvl"]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    build_model(request.param).save_pretrained(path)
    return PRESETS[request.param].model_class.from_pretrained(path).eval()


def prompts_of(config, items, suffix_lengths, rng):
    """Per item a prefix (text, its image) and per prompt a suffix of random text; the images'
    pixel inputs."""
    if getattr(config, "model_type", "") == "internvl":
        prefixes = [tile_prompt(config, tiles, 2 + i, 0, rng) for i, tiles in enumerate(items)]
        size = config.vision_config.image_size  # a list once saved, a tuple as the preset builds it
        side = size[0] if isinstance(size, (list, tuple)) else size
        pixels = {"pixel_values": torch.randn(sum(items), 3, side, side, generator=rng)}
        text = lambda n: torch.randint(2, config.image_token_id, (n,), generator=rng).tolist()  # noqa: E731
    else:
        prefixes = [random_text(config, 2 + i, rng) + vision_span(config, grid) for i, grid in enumerate(items)]
        pixels = {"pixel_values": random_pixels(config.vision_config, items, rng), "image_grid_thw": torch.tensor(items)}
        text = lambda n: random_text(config, n, rng)  # noqa: E731
    suffixes = [text(n) for n in suffix_lengths]
    return prefixes, suffixes, pixels


def left_padded(config, rows, pixels):
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(rows):
        ids[row, width - len(tokens):] = torch.tensor(tokens)
        mask[row, width - len(tokens):] = 1
    inputs = dict(pixels)
    if "image_grid_thw" in pixels:
        inputs["mm_token_type_ids"] = mm_token_type_ids(ids, config)
    return ids, mask, inputs


ITEMS = {"internvl": [1, 2], "qwen": [(1, 4, 4), (1, 8, 6)]}


@pytest.mark.parametrize("fused", [True, False], ids=["fused step", "model forward"])
def test_each_prompts_tokens_equal_its_run_alone(model, fused):
    config = model.config
    rng = torch.Generator().manual_seed(1)
    items = ITEMS["internvl" if config.model_type == "internvl" else "qwen"]
    prefixes, suffixes, pixels = prompts_of(config, items, (3, 6, 6), rng)
    runner = DecoderGraphRunner(model, max_batch_size=6, max_cache_len=160, fused_step=fused, packed_prefill=fused)
    alone = []
    for suffix in suffixes:
        ids, mask, inputs = left_padded(config, [prefix + suffix for prefix in prefixes], pixels)
        out = runner.generate(ids, mask, max_new_tokens=NEW_TOKENS, eos_token_id=NO_EOS, **inputs)
        alone.append(out[:, ids.shape[1]:])
    ids, mask, inputs = left_padded(config, prefixes, pixels)
    shared = SharedPrompts(items=(0, 0, 0, 1, 1, 1), suffixes=tuple(tuple(s) for _ in items for s in suffixes))
    got = runner.generate_shared(ids, mask, shared, max_new_tokens=NEW_TOKENS, eos_token_id=NO_EOS, **inputs)
    assert got.shape == (6, NEW_TOKENS)
    for row, (item, prompt) in enumerate((i, p) for i in range(2) for p in range(3)):
        assert torch.equal(got[row], alone[prompt][item]), f"item {item}, prompt {prompt}"
    assert len({tuple(t.tolist()) for t in got}) > 2  # the prompts lead somewhere apart
