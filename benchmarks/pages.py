"""A folder of document-like pages at the sizes people OCR (fixed seed): A4 scans at 150-300 dpi,
letter pages rendered from PDF to PNG, slides, phone photos of a page, receipts and small
snippets (under one 768 px tile: no local tiles). Each is a white page of lines of real glyphs
(PIL's font, random words) in paragraphs under a title; scans and photos get paper tone and
sensor noise, so their JPEGs are as large and slow to decode as real ones.
    python3 benchmarks/pages.py FOLDER [--count 256] [--seed 0]
"""

import argparse
import random
from pathlib import Path

import numpy as np
from photos import write_drawn_folder
from PIL import Image, ImageDraw, ImageFont

# (width, height, format, noisy, weight in %)
SIZES = [
    (2480, 3508, "jpg", True, 20),  # A4 scan, 300 dpi
    (1240, 1754, "jpg", True, 15),  # A4 scan, 150 dpi
    (1700, 2200, "png", False, 15),  # letter, PDF rendered at 200 dpi
    (1224, 1584, "png", False, 15),  # letter, PDF rendered at 2x
    (1920, 1080, "png", False, 10),  # slide or screenshot
    (3024, 4032, "jpg", True, 10),  # phone photo of a page
    (576, 1800, "png", False, 5),  # receipt
    (700, 300, "png", False, 10),  # snippet: under one tile
]
WORDS = (
    "the of and to in is for on that with as by this are from at be an or it which model data page table "
    "figure results method section value total invoice date amount number shown using based each these"
).split()


def font(size: int) -> ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, OSError, ImportError):  # Pillow without FreeType: the fixed bitmap font
        return ImageFont.load_default()


def page(width: int, height: int, noisy: bool, seed: int) -> Image.Image:
    rng = random.Random(seed)
    image = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    size = max(10, height // 70)
    margin, y = width // 12, height // 14
    draw.text((margin, y), " ".join(rng.choices(WORDS, k=5)).title(), fill=(10, 10, 10), font=font(2 * size))
    y += 3 * size
    body = font(size)
    chars = max(8, int((width - 2 * margin) / (0.45 * size)))
    while y < height - height // 14:
        for _ in range(rng.randint(3, 9)):  # a paragraph
            words = []
            while len(" ".join(words)) < chars - 8:
                words.append(rng.choice(WORDS))
            draw.text((margin, y), " ".join(words), fill=(20, 20, 25), font=body)
            y += int(1.5 * size)
            if y >= height - height // 14:
                break
        y += size
    if not noisy:
        return image
    generator = np.random.default_rng(seed)
    tone = np.asarray(image, dtype=np.int16) - generator.integers(0, 18)  # paper, not pure white
    noise = generator.integers(-10, 11, (height, width, 1), dtype=np.int16)
    return Image.fromarray((tone + noise).clip(0, 255).astype(np.uint8))


def write_one(job: tuple[Path, int, int, str, bool, int]) -> None:
    path, width, height, kind, noisy, seed = job
    image = page(width, height, noisy, seed)
    image.save(path, quality=90) if kind == "jpg" else image.save(path, optimize=False)


def write_page_folder(folder: Path, count: int, seed: int = 0, workers: int = 16) -> list[Path]:
    """`count` pages drawn from SIZES by weight (seeded), written in parallel; their paths."""
    return write_drawn_folder(folder, "page", SIZES, write_one, count, seed, workers)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--count", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write_page_folder(args.folder, args.count, args.seed)
