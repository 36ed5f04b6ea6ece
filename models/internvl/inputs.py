"""`generate` inputs for transformers' InternVL checkpoints, built from the tokenizer and the PIL
image processor, as `InternVLProcessor` builds them.

Why not `AutoProcessor`: InternVL's processor needs its video processor, which imports
torchvision. Images are tiled by `GotOcr2ImageProcessorPil` (the processor's own tiling: a grid
of tiles closest to the image's aspect ratio, then a thumbnail); a video frame is one tile (the
frame resized to the tile size). In the prompt an image is `<img>` + image_seq_length context
tokens per tile + `</img>`; a video is one line `FrameN: <img>...</img>` per frame.
"""

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import AutoTokenizer, GotOcr2ImageProcessorPil, PreTrainedTokenizerBase

from encoder_graphs.models.common.batching import CollatingInputs, per_item, to_device
from encoder_graphs.models.common.pil_pixels import affine, normalized
from encoder_graphs.seam.vision import tiled_canvas

# The tokenizer's named special tokens (`tokenizer.context_image_token` ...) and their usual text.
TOKENS = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}


@dataclass
class EncodedTiles:
    """One image or video as uint8 tiles, ready to join a batch (`to_model` normalises them where
    the batch goes)."""

    kind: str  # "image" | "video"
    tiles_u8: torch.Tensor  # uint8 (tiles, 3, height, width)
    vision_tokens: int  # context tokens in the prompt = encoder output rows
    size: tuple[int, int] = (0, 0)  # (width, height) the model sees: the tiles' canvas (a video: a frame)

    @property
    def tiles(self) -> int:
        return self.tiles_u8.shape[0]


class InternVLInputs(CollatingInputs):
    """CaptionInputs for InternVL checkpoints (`InternVLForConditionalGeneration`)."""

    default_prompt: str | None = None  # a caption's
    reads_videos = True
    resolution_arguments = ("max_tiles",)

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        image_processor: GotOcr2ImageProcessorPil,
        image_seq_length: int,
        max_tiles: int | None = None,
    ) -> None:
        if tokenizer.chat_template is None:
            raise ValueError("the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.tokenizer.padding_side = "left"
        self.image_processor = image_processor
        self.image_seq_length = image_seq_length
        self.max_tiles = max_tiles if max_tiles is not None else image_processor.max_patches
        if self.max_tiles < 1:
            raise ValueError(f"max_tiles must be >= 1, got {self.max_tiles}")
        self.tokens = {name: getattr(tokenizer, name, None) or text for name, text in TOKENS.items()}
        size = image_processor.size
        self.tile_size = (size["height"], size["width"])

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        *,
        max_tiles: int | None = None,
        max_image_tokens: int | None = None,
        max_frame_tokens: int | None = None,
    ) -> "InternVLInputs":
        """`max_image_tokens` and `max_frame_tokens` are ignored: InternVL's resolution is its
        tiles (`max_tiles`, 256 tokens each; a video frame is one tile)."""
        directory = Path(directory)
        processor_config = directory / "processor_config.json"
        settings = json.loads(processor_config.read_text()) if processor_config.is_file() else {}
        return cls(
            AutoTokenizer.from_pretrained(directory),
            GotOcr2ImageProcessorPil.from_pretrained(directory),
            settings.get("image_seq_length", 256),
            max_tiles,
        )

    @property
    def min_side(self) -> int:
        return 1  # every image is resized to whole tiles

    @property
    def max_image_pixels(self) -> int:
        """Beyond this many pixels the tiling resizes the image down anyway."""
        return (self.max_tiles + 1) * self.tile_size[0] * self.tile_size[1]

    @property
    def max_frame_pixels(self) -> int:
        return self.tile_size[0] * self.tile_size[1]

    @property
    def frame_size(self) -> tuple[int, int]:
        """Every video frame becomes one tile: (width, height), whatever the clip's size."""
        return self.tile_size[1], self.tile_size[0]

    def check_model(self, config: Any) -> None:
        """Raise ValueError when the tokenizer or the tiles do not fit the model."""
        vocab_size = config.get_text_config().vocab_size
        if len(self.tokenizer) > vocab_size:
            raise ValueError(f"tokenizer has {len(self.tokenizer)} tokens, the model's vocabulary only {vocab_size}")
        context_id = self.tokenizer.convert_tokens_to_ids(self.tokens["context_image_token"])
        if context_id != config.image_token_id:
            raise ValueError(f"tokenizer maps the image context token to {context_id}, the model expects {config.image_token_id}")
        if tuple(config.vision_config.image_size) != self.tile_size:
            raise ValueError(f"processor tiles are {self.tile_size}, the model's {tuple(config.vision_config.image_size)}")
        if config.image_seq_length != self.image_seq_length:
            raise ValueError(f"processor puts {self.image_seq_length} tokens per tile, the model {config.image_seq_length}")

    def encode_image(self, image: Image.Image) -> EncodedTiles:
        tiles = self._tiles([image], crop_to_patches=True)
        height, width = self.tile_size
        if tiles.shape[0] > 1:  # a grid of tiles and a thumbnail
            columns, rows = tiled_canvas((image.height, image.width), self.tile_size, self.image_processor.min_patches, self.max_tiles)
            width, height = columns * width, rows * height
        return EncodedTiles("image", tiles, tiles.shape[0] * self.image_seq_length, (width, height))

    def encode_video(self, frames: "list[Image.Image] | np.ndarray", metadata: Any = None) -> EncodedTiles:
        """`frames`: images, or a uint8 array (frames, height, width, 3) as the video decoder gives
        them (already one tile each: `frame_size`); `metadata` (the frames' timing) is not read:
        InternVL numbers its frames (`FrameN:`), it does not time them."""
        tiles = self._tiles(list(frames), crop_to_patches=False)
        height, width = self.tile_size
        return EncodedTiles("video", tiles, tiles.shape[0] * self.image_seq_length, (width, height))

    def _tiles(self, images: list[Image.Image], crop_to_patches: bool) -> torch.Tensor:
        """The processor's tiles before its rescale and normalisation: uint8, a quarter of the bytes."""
        out = self.image_processor(
            images=images,
            crop_to_patches=crop_to_patches,
            max_patches=self.max_tiles,
            do_rescale=False,
            do_normalize=False,
            return_tensors="np",
            input_data_format="channels_last",  # PIL images and decoded frames: else a 1x1 image is ambiguous
        )
        return torch.from_numpy(np.ascontiguousarray(out["pixel_values"], dtype=np.uint8))

    def prompt_text(self, item: EncodedTiles, prompt: str) -> str:
        message = [{"role": "user", "content": [{"type": item.kind}, {"type": "text", "text": prompt}]}]
        text = self.tokenizer.apply_chat_template(message, add_generation_prompt=True, tokenize=False)
        marker = self.tokens["context_image_token" if item.kind == "image" else "video_token"]
        if text.count(marker) != 1:
            raise ValueError(f"chat template produced {text.count(marker)} {marker} tokens, expected 1")
        return text.replace(marker, self._expansion(item.kind, item.tiles))

    def _expansion(self, kind: str, tiles: int) -> str:
        start, end, context = (self.tokens[n] for n in ("start_image_token", "end_image_token", "context_image_token"))
        if kind == "image":
            return f"{start}{context * self.image_seq_length * tiles}{end}"
        return "\n".join(f"Frame{i + 1}: {start}{context * self.image_seq_length}{end}" for i in range(tiles))

    def collate(self, items: Sequence[EncodedTiles], prompts: str | Sequence[str]) -> dict[str, torch.Tensor]:
        """The batch on the CPU with uint8 tiles (`to_model` finishes it); touches no GPU."""
        prompts = per_item(prompts, items)
        texts = [self.prompt_text(item, prompt) for item, prompt in zip(items, prompts, strict=True)]
        batch = self.tokenized(texts)
        if items:
            batch["pixel_values"] = torch.cat([item.tiles_u8 for item in items])
        return batch

    def to_model(
        self, collated: dict[str, torch.Tensor], device: torch.device | str, dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        """`collate`'s batch on `device`, the tiles rescaled and normalised there as the PIL
        processor does it (`pil_pixels.normalized`), then cast to `dtype`."""
        moved = to_device(collated, device)
        if "pixel_values" in moved:
            tiles, processor = moved["pixel_values"], self.image_processor
            moved["pixel_values"] = normalized(tiles, processor, affine(processor, tiles.device), dtype)
        return moved

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True).strip()

    def longest_prompt(self, prompt: str, max_frames: int) -> int:
        """Tokens of the prompt around the most tiles an image can have (`max_tiles` + thumbnail)
        or a video of `max_frames` frames (0: no video)."""
        shapes = [("image", self.max_tiles + 1)] + ([("video", max_frames)] if max_frames else [])
        return max(
            len(self.tokenizer(self.prompt_text(EncodedTiles(kind, torch.zeros(tiles, 0), 0), prompt)).input_ids)
            for kind, tiles in shapes
        )
