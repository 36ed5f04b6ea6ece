"""A folder of photo-like files at the sizes people have (fixed seed): phone and camera photos
both ways, screenshots (PNG), panoramas and small web images. The content is smooth colour with
shapes and sensor-like noise, so a 12 MP JPEG is ~3-4 MB and decodes as slowly as a real one.
    python3 benchmarks/photos.py FOLDER [--count 1024] [--seed 0]
"""

import argparse
import random
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

# (width, height, format, weight in %)
SIZES = [
    (4032, 3024, "jpg", 15),  # 12 MP phone, landscape
    (3024, 4032, "jpg", 10),  # and portrait
    (3000, 2000, "jpg", 10),  # 6 MP camera
    (2048, 1536, "jpg", 10),
    (1920, 1080, "jpg", 8),
    (1080, 1920, "jpg", 5),
    (1600, 1200, "jpg", 8),
    (1280, 960, "jpg", 8),
    (800, 600, "jpg", 6),
    (640, 480, "jpg", 5),
    (1080, 1350, "jpg", 3),  # portrait post
    (2560, 1440, "png", 4),  # desktop screenshot
    (1170, 2532, "png", 3),  # phone screenshot
    (8000, 2000, "jpg", 3),  # panoramas
    (6000, 1500, "jpg", 2),
]


def photo(width: int, height: int, seed: int) -> Image.Image:
    """Gradients, a few shapes, and noise of a phone sensor (up to 14 levels)."""
    rng = np.random.default_rng(seed)
    x = np.linspace(0, 1, width, dtype=np.float32)[None, :, None]
    y = np.linspace(0, 1, height, dtype=np.float32)[:, None, None]
    colors = rng.random((3, 3), dtype=np.float32)
    pixels = 255 * (colors[0] * x + colors[1] * y + colors[2] * (1 - x) * (1 - y)).clip(0, 1)
    image = Image.fromarray(pixels.astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        left, top = int(rng.integers(width)), int(rng.integers(height))
        box = (left, top, left + int(rng.integers(width // 3 + 1)), top + int(rng.integers(height // 3 + 1)))
        fill = tuple(int(v) for v in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=fill)
    noisy = np.asarray(image, dtype=np.int16) + rng.integers(-14, 15, (height, width, 3), dtype=np.int16)
    return Image.fromarray(noisy.clip(0, 255).astype(np.uint8))


def screenshot(width: int, height: int, seed: int) -> Image.Image:
    """Flat panels and lines of 'text' (runs of dark boxes): compresses as screenshots do."""
    rng = random.Random(seed)
    image = Image.new("RGB", (width, height), (245, 245, 247))
    draw = ImageDraw.Draw(image)
    for _ in range(6):
        left, top = rng.randrange(width), rng.randrange(height)
        draw.rectangle((left, top, left + rng.randrange(width // 2), top + rng.randrange(height // 4)),
                       fill=tuple(rng.randrange(180, 256) for _ in range(3)))
    for line in range(0, height, 28):
        x = 20
        while x < width - 40 and rng.random() < 0.97:
            word = rng.randrange(12, 70)
            draw.rectangle((x, line + 8, x + word, line + 20), fill=(40, 40, 48))
            x += word + 8
    return image


def write_one(job: tuple[Path, int, int, str, int]) -> None:
    path, width, height, kind, seed = job
    if kind == "png":
        screenshot(width, height, seed).save(path, optimize=False)
    else:
        photo(width, height, seed).save(path, quality=90)


def write_photo_folder(folder: Path, count: int, seed: int = 0, workers: int = 16) -> list[Path]:
    """`count` files drawn from SIZES by weight (seeded), written in parallel; their paths."""
    return write_drawn_folder(folder, "photo", SIZES, write_one, count, seed, workers)


def write_drawn_folder(
    folder: Path, stem: str, sizes: list[tuple], write: Callable[[tuple], None], count: int, seed: int, workers: int
) -> list[Path]:
    """`count` files drawn from `sizes` (rows of width, height, format, ..., weight in %) by weight
    (seeded), each `write((path, *row without its weight, seed))` in parallel; their paths."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    picks = rng.choices(sizes, weights=[row[-1] for row in sizes], k=count)
    jobs = [(folder / f"{stem}_{i:05d}.{row[2]}", *row[:-1], seed * 100_000 + i) for i, row in enumerate(picks)]
    with ProcessPoolExecutor(workers) as pool:
        list(pool.map(write, jobs, chunksize=2))
    return [job[0] for job in jobs]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--count", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write_photo_folder(args.folder, args.count, args.seed)
