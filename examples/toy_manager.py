"""Encode random items with the toy two-tower ViT through EncoderCudaGraphManager.

Eager on a CPU; CUDA graphs on a GPU. Prints the manager's statistics table.
"""

import random

import torch
from toy_vit import ToyItem, ToyViT

from encoder_graphs import EncoderCudaGraphManager


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    model = ToyViT().to(device, dtype).eval()
    manager = EncoderCudaGraphManager(model, max_items=8)
    manager.capture()
    rng = random.Random(0)
    for _ in range(20):
        items = []
        for _ in range(rng.randint(1, 8)):
            frames = rng.choice([1, 1, 2, 4])
            tiles = rng.choice([0, 0, 2])
            items.append(
                ToyItem(
                    torch.randn(frames * rng.randint(16, 256), 48, device=device),
                    frames=frames,
                    tiles=torch.randn(tiles * 16, 48, device=device) if tiles else None,
                )
            )
        outputs = manager.execute(items)
        assert len(outputs) == len(items)
    print(manager.format_stats())


if __name__ == "__main__":
    main()
