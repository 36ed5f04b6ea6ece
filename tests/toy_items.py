"""Random items for the toy ViT, shared by the CPU and GPU manager tests."""

import random

import torch
from toy_vit import ToyItem


def random_item(rng: random.Random, in_dim: int, *, large: bool = False, tiles: bool = True) -> ToyItem:
    frames = rng.choice([1, 1, 1, 2, 4, 8])
    rows_per_frame = rng.randint(200, 700) if large else rng.randint(1, 96)
    tile_count = rng.choice([0, 0, 1, 2, 4]) if tiles else 0
    return ToyItem(
        patches=torch.randn(frames * rows_per_frame, in_dim),
        frames=frames,
        tiles=torch.randn(tile_count * 16, in_dim) if tile_count else None,
    )


def random_call(rng: random.Random, in_dim: int, *, tiles: bool = True) -> list[ToyItem]:
    large = rng.random() < 0.3
    return [random_item(rng, in_dim, large=large, tiles=tiles) for _ in range(rng.randint(1, 6))]
