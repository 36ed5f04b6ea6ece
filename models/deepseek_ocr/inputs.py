"""`generate` inputs for transformers' DeepSeek-OCR 2 checkpoints, built from the tokenizer and the
PIL image processor, as `DeepseekOcr2Processor` builds them over `DeepseekOcr2ImageProcessorPil`.

Why not `AutoProcessor`: the checkpoint names `DeepseekOcr2ImageProcessor`, the torchvision one;
the PIL one is its torchvision-free twin (their bicubic resamplings differ by a few levels of 255).
What the processor does (5.17.0, 5.23.0), and so what is done here:

- each page gives a global view: the page resized (bicubic) so its long side is 1024, then padded
  to a 1024 square with `background_color` (127, 127, 127), centred. The padding is written into
  the uint8 pixels before the rescale, so the image processor called with do_rescale=False and
  do_normalize=False returns exactly the uint8 pixels its float path starts from;
- a page whose longer side exceeds one tile (> 768 px, not >=) also gives 2 to 6 local tiles of
  768 px: the page resized to the grid of tiles closest to its aspect ratio (GotOcr2's tiling,
  `tiled_canvas`), cut row-major. All tiles of a batch are one tensor, `pixel_values_local`,
  absent when no page has any; `num_local_patches` (an int64 tensor, one count per page) is
  always there;
- the tiling settings are the processor's own (crop_to_patches, 2 to 6 tiles), which override
  the image processor's saved `min_patches` and `max_patches`; `max_tiles` replaces the 6. With
  crop_to_patches=False the processor makes a 768 px view yet still writes the 1024 px view's
  257 tokens (the tower gives 145 features, and generate fails): that path is never taken;
- each `<image>` becomes 256 + 144 * tiles + 1 (the view separator) image tokens, from
  processor_config.json's `patch_size` and `downsample_ratio`;
- the prompt is plain text, `<image>\\n` then the instruction, as the model card, transformers'
  docs and its integration tests write it ("<image>\\nFree OCR."), with no roles: the conversion
  script saves DeepSeek's own tokenizer and a processor without a chat template (DeepSeek's
  `infer` formats prompts "plain" too). The BOS is whatever the tokenizer adds (DeepSeek's puts
  its own first), as in the processor, which calls the same tokenizer the same way.
"""

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import AutoTokenizer, DeepseekOcr2ImageProcessorPil, PreTrainedTokenizerBase

from encoder_graphs.models.common.batching import CollatingInputs, per_item, to_device
from encoder_graphs.models.common.pil_pixels import affine, normalized
from encoder_graphs.models.deepseek_ocr.adapter import MOST_TILES, TILE_FEATURES, TILE_SIDE, VIEW_FEATURES, VIEW_SIDE
from encoder_graphs.seam.vision import tiled_canvas

# What `DeepseekOcr2Processor` hands its image processor unless told otherwise (crop_to_patches=True,
# min_patches=2, max_patches=MOST_TILES), over the image processor's own settings: 5.17.0's
# `DeepseekOcr2ProcessorKwargs._defaults`, 5.23.0's `DeepseekOcr2Processor.images_kwargs`.
FEWEST_TILES = 2
IMAGE_TOKEN = "<image>"


@dataclass
class EncodedPage:
    """One image as uint8 pixels, ready to join a batch (`to_model` normalises them where the
    batch goes)."""

    kind: str  # always "image"
    view_u8: torch.Tensor  # uint8 (1, 3, 1024, 1024): the page padded to a square
    tiles_u8: torch.Tensor  # uint8 (tiles, 3, 768, 768), no rows for a page of one tile or less
    vision_tokens: int  # image tokens in the prompt = features of the view, the tiles and the separator
    size: tuple[int, int]  # (width, height) the model sees at most: the tiles' canvas, else the page in the view

    @property
    def tiles(self) -> int:
        return self.tiles_u8.shape[0]


class DeepseekOcrInputs(CollatingInputs):
    """CaptionInputs for DeepSeek-OCR 2 checkpoints (`DeepseekOcr2ForConditionalGeneration`)."""

    default_prompt: str | None = "Free OCR."  # the model card's plain reading (its other: markdown with boxes)
    reads_videos = False
    resolution_arguments = ("max_tiles",)

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        image_processor: DeepseekOcr2ImageProcessorPil,
        patch_size: int = 16,
        downsample_ratio: int = 4,
        max_tiles: int | None = None,
    ) -> None:
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token to left-pad a batch with")
        self.tokenizer = tokenizer
        self.tokenizer.padding_side = "left"
        self.image_processor = image_processor
        self.patch_size = patch_size
        self.downsample_ratio = downsample_ratio
        self.min_tiles = FEWEST_TILES
        self.max_tiles = max_tiles if max_tiles is not None else MOST_TILES
        if self.max_tiles < self.min_tiles:
            # Below its smallest grid the processor's tiling falls back to one tile, a grid it never chooses.
            raise ValueError(f"max_tiles must be >= {self.min_tiles} for DeepSeek-OCR, got {self.max_tiles}")
        self.image_token = getattr(tokenizer, "image_token", IMAGE_TOKEN)  # as the processor picks it
        self.view_side = image_processor.size["height"]
        self.tile_side = image_processor.tile_size
        self.view_tokens, self.tile_tokens = self._queries(self.view_side), self._queries(self.tile_side)

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        *,
        max_tiles: int | None = None,
        max_image_tokens: int | None = None,
        max_frame_tokens: int | None = None,
    ) -> "DeepseekOcrInputs":
        """`max_image_tokens` and `max_frame_tokens` are ignored: DeepSeek-OCR 2's resolution is
        its tiles (`max_tiles`, 144 tokens each, besides the view's 257), and it reads no videos."""
        directory = Path(directory)
        processor_config = directory / "processor_config.json"
        settings = json.loads(processor_config.read_text()) if processor_config.is_file() else {}
        return cls(
            AutoTokenizer.from_pretrained(directory),
            DeepseekOcr2ImageProcessorPil.from_pretrained(directory),
            settings.get("patch_size", 16),
            settings.get("downsample_ratio", 4),
            max_tiles,
        )

    def _queries(self, side: int) -> int:
        """Features of one view or tile, by the processor's arithmetic."""
        return math.ceil(side / self.patch_size / self.downsample_ratio) ** 2

    def _vision_tokens(self, tiles: int) -> int:
        return self.view_tokens + self.tile_tokens * tiles + 1

    @property
    def min_side(self) -> int:
        return 1  # every page is resized to the view (and the tiles' canvas)

    @property
    def max_image_pixels(self) -> int:
        """Enough pixels that an image reduced to this many (by a whole factor, keeping at least
        this many) gets the tiles the whole image gets: its long side still over 768, the same grid
        (the tiling's area tie-break included; up to the reduction's rounding of the aspect ratio,
        which may pick the neighbouring grid, also covered) and, for the aspect ratios the grids
        span (1:max_tiles to max_tiles:1), no side shorter than the grid's canvas, so the resize to
        the canvas enlarges neither side. Between two grids' ratios a page is longer than its
        canvas along one side: 7.5 tiles' pixels for 2 to 6 tiles, not 6. A page more elongated
        than the widest grid may still be enlarged across."""
        canvas = _tiles_needed(self.min_tiles, self.max_tiles) * self.tile_side**2
        return math.ceil(max(canvas, self.view_side**2))

    @property
    def max_frame_pixels(self) -> int:
        return self.view_side**2  # no videos: a frame is never read

    @property
    def frame_size(self) -> tuple[int, int]:
        return self.view_side, self.view_side  # no videos: never used

    def check_model(self, config: Any) -> None:
        """Raise ValueError when the tokenizer or the views and tiles do not fit the model."""
        vocab_size = config.get_text_config().vocab_size
        if len(self.tokenizer) > vocab_size:
            raise ValueError(f"tokenizer has {len(self.tokenizer)} tokens, the model's vocabulary only {vocab_size}")
        image_id = self.tokenizer.convert_tokens_to_ids(self.image_token)
        if image_id != config.image_token_id:
            expected = config.image_token_id
            raise ValueError(f"tokenizer maps {self.image_token} to {image_id}, the model expects {expected}")
        sam_patch = config.vision_config.sam_config.patch_size
        if sam_patch != self.patch_size:
            raise ValueError(f"processor counts {self.patch_size} px patches, the model's SAM takes {sam_patch} px")
        # The tower's query banks are fixed: 256 features for a 1024 px view, 144 for a 768 px tile.
        sides, features = (self.view_side, self.tile_side), (self.view_tokens, self.tile_tokens)
        if sides != (VIEW_SIDE, TILE_SIDE) or features != (VIEW_FEATURES, TILE_FEATURES):
            raise ValueError(
                f"processor makes {sides} px views and tiles of {features} tokens; the model takes "
                f"{(VIEW_SIDE, TILE_SIDE)} px, {(VIEW_FEATURES, TILE_FEATURES)} features"
            )

    def encode_image(self, image: Image.Image) -> EncodedPage:
        out = self.image_processor(
            images=[image],
            crop_to_patches=True,
            min_patches=self.min_tiles,
            max_patches=self.max_tiles,
            do_rescale=False,
            do_normalize=False,
            return_tensors="np",
        )
        view = _uint8(out["pixel_values"])
        if "pixel_values_local" in out:
            tiles = _uint8(out["pixel_values_local"])
        else:
            tiles = view.new_empty(0, 3, self.tile_side, self.tile_side)
        count = tiles.shape[0]
        return EncodedPage("image", view, tiles, self._vision_tokens(count), self._seen_size(image, count))

    def _seen_size(self, image: Image.Image, tiles: int) -> tuple[int, int]:
        """The tiles' canvas, or (no tiles) the page as resized into the view. DeepSeek's tiling is
        GotOcr2's (`tiled_canvas`), function for function (tests compare them)."""
        if tiles:
            tile = (self.tile_side, self.tile_side)
            columns, rows = tiled_canvas((image.height, image.width), tile, self.min_tiles, self.max_tiles)
            return columns * self.tile_side, rows * self.tile_side
        scale = self.view_side / max(image.width, image.height)
        return round(image.width * scale), round(image.height * scale)

    def encode_video(self, frames: Sequence[Image.Image], metadata: Any = None) -> EncodedPage:
        raise ValueError("DeepSeek-OCR 2 reads images, not videos")

    def prompt_text(self, item: EncodedPage, prompt: str) -> str:
        return self._text(prompt, item.vision_tokens)

    def _text(self, prompt: str, vision_tokens: int) -> str:
        """`<image>\\n` + `prompt`, the placeholder expanded to the page's tokens."""
        if self.image_token in prompt:
            raise ValueError(f"the prompt may not contain {self.image_token}: the page's tokens go before it")
        return self.image_token * vision_tokens + "\n" + prompt

    def collate(self, items: Sequence[EncodedPage], prompts: str | Sequence[str]) -> dict[str, torch.Tensor]:
        """The batch on the CPU with uint8 views and tiles (`to_model` finishes it); touches no GPU."""
        prompts = per_item(prompts, items)
        texts = [self.prompt_text(item, prompt) for item, prompt in zip(items, prompts, strict=True)]
        batch = self.tokenized(texts)
        if items:
            batch["pixel_values"] = torch.cat([item.view_u8 for item in items])
            batch["num_local_patches"] = torch.tensor([item.tiles for item in items], dtype=torch.int64)
            if any(item.tiles for item in items):  # the processor leaves it out, the model takes None
                batch["pixel_values_local"] = torch.cat([item.tiles_u8 for item in items])
        return batch

    def to_model(
        self, collated: dict[str, torch.Tensor], device: torch.device | str, dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        """`collate`'s batch on `device`, the views and tiles rescaled and normalised there as the
        PIL processor does it (`pil_pixels.normalized`), then cast to `dtype`."""
        moved = to_device(collated, device)
        if "pixel_values" in moved:
            mean_std = affine(self.image_processor, moved["pixel_values"].device)  # once for views and tiles
            for key in ("pixel_values", "pixel_values_local"):
                if key in moved:
                    moved[key] = normalized(moved[key], self.image_processor, mean_std, dtype)
        return moved

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True).strip()

    def longest_prompt(self, prompt: str, max_frames: int) -> int:
        """Tokens of the prompt around the most tiles a page can have (`max_tiles`: a 1 x N grid
        is always among the choices); `max_frames` is ignored (no videos)."""
        return len(self.tokenizer(self._text(prompt, self._vision_tokens(self.max_tiles))).input_ids)


def _uint8(pixels: np.ndarray) -> torch.Tensor:
    """The image processor's pixels before its rescale: uint8, a quarter of the bytes."""
    return torch.from_numpy(np.ascontiguousarray(pixels, dtype=np.uint8))


def _tiles_needed(min_tiles: int, max_tiles: int) -> float:
    """Tile areas of pixels a page needs so that no side of its grid's canvas is longer than the
    page's, for every aspect ratio between the narrowest and widest grid. A grid (c, r) is chosen
    from its own ratio c/r to the midpoints with its neighbours' ratios; past its ratio the page
    is wider than the canvas and needs r^2 * ratio tile areas, before it taller, c^2 / ratio, so
    the most is needed at those midpoints. Of grids of one ratio the processor takes the one of
    most tiles (for a page this large)."""
    grids: dict[Fraction, tuple[int, int]] = {}
    for columns in range(1, max_tiles + 1):
        for rows in range(1, max_tiles // columns + 1):
            ratio = Fraction(columns, rows)
            if columns * rows >= min_tiles and columns * rows > math.prod(grids.get(ratio, (0, 0))):
                grids[ratio] = (columns, rows)
    ratios = sorted(grids)
    needed = float(max(columns * rows for columns, rows in grids.values()))
    for narrower, wider in itertools.pairwise(ratios):
        middle = (narrower + wider) / 2
        needed = max(needed, float(grids[narrower][1] ** 2 * middle), float(grids[wider][0] ** 2 / middle))
    return needed
