"""Qwen-VL and InternVL model inputs built without a tokenizer (random-weight presets have none)."""

import torch
from transformers import PretrainedConfig

Grid = tuple[int, int, int]  # (t, h, w) in patches


def vision_span(config: PretrainedConfig, grid: Grid, video: bool = False) -> list[int]:
    """<vision_start>, one image (or video) pad per merged patch of `grid`, <vision_end>."""
    t, h, w = grid
    pads = t * h * w // config.vision_config.spatial_merge_size**2
    pad = config.video_token_id if video else config.image_token_id
    return [config.vision_start_token_id, *[pad] * pads, config.vision_end_token_id]


def random_text(config: PretrainedConfig, length: int, generator: torch.Generator) -> list[int]:
    """`length` random ids from 2 (above the padding id 0) to below every vision special token."""
    vision_ids = (
        config.image_token_id,
        config.video_token_id,
        config.vision_start_token_id,
        config.vision_end_token_id,
    )
    return torch.randint(2, min(vision_ids), (length,), generator=generator).tolist()


def image_prompt(
    config: PretrainedConfig, grid: Grid, before: int, after: int, generator: torch.Generator
) -> list[int]:
    """`before` random text ids, the vision span of one image of `grid`, `after` random text ids."""
    return random_text(config, before, generator) + vision_span(config, grid) + random_text(config, after, generator)


def random_pixels(vision_config: PretrainedConfig, grids: list[Grid], generator: torch.Generator) -> torch.Tensor:
    """fp32 pixel rows [sum t*h*w, channels*temporal*patch*patch] on the generator's device."""
    rows = sum(t * h * w for t, h, w in grids)
    patch = vision_config.in_channels * vision_config.temporal_patch_size * vision_config.patch_size**2
    return torch.randn(rows, patch, generator=generator, device=generator.device)


def left_pad(prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """`input_ids` and `attention_mask` [batch, longest], padded on the left with token 0, mask 0."""
    width = max(len(prompt) for prompt in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def mm_token_type_ids(input_ids: torch.Tensor, config: PretrainedConfig) -> torch.Tensor:
    """1 on image pads, 2 on video pads, 0 elsewhere (what the Qwen-VL processors return)."""
    return (input_ids == config.image_token_id).long() + 2 * (input_ids == config.video_token_id).long()


def tile_prompt(config: PretrainedConfig, tiles: int, before: int, after: int, generator: torch.Generator) -> list[int]:
    """An InternVL prompt: `before` random text ids, `image_seq_length` image tokens per tile,
    `after` random text ids (ids from 2 to below the image token)."""
    before_ids, after_ids = (
        torch.randint(2, config.image_token_id, (length,), generator=generator).tolist() for length in (before, after)
    )
    return before_ids + [config.image_token_id] * (config.image_seq_length * tiles) + after_ids
