"""`generate` inputs for Qwen-VL checkpoints, built from the tokenizer and the PIL image processor.

Why not `AutoProcessor`: in transformers 5.17 `Qwen2VLProcessor` cannot be built without
torchvision (its video processor imports it), and CPU machines often lack torchvision. The image
processor's PIL backend has no such need, and a video is the same patch layout with `temporal`
frames stacked instead of one frame repeated, so both kinds are built here, one way everywhere.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase, Qwen2VLImageProcessorPil

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_START = "<|vision_start|>"
MM_TOKEN_TYPE = {"image": 1, "video": 2}


@dataclass
class EncodedItem:
    """One image or video as patches, ready to join a batch."""

    kind: str  # "image" | "video"
    pixel_values: np.ndarray  # (patches, channels * temporal * patch * patch)
    grid_thw: tuple[int, int, int]
    vision_tokens: int  # placeholder tokens in the prompt = encoder output tokens


class QwenVLInputs:
    """CaptionInputs for the Qwen-VL families."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        image_processor: Qwen2VLImageProcessorPil,
        video_max_pixels: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.tokenizer.padding_side = "left"
        self.image_processor = image_processor
        self.video_max_pixels = video_max_pixels
        self.merge_size = image_processor.merge_size
        self.temporal_patch_size = image_processor.temporal_patch_size
        self.min_pixels = image_processor.size["shortest_edge"]
        self.factor = image_processor.patch_size * self.merge_size
        self.token_ids = {
            t: tokenizer.convert_tokens_to_ids(t) for t in (IMAGE_PAD, VIDEO_PAD, VISION_START)
        }
        if tokenizer.chat_template is None:
            raise ValueError("the tokenizer has no chat template")

    @classmethod
    def from_pretrained(cls, directory: str | Path, *, max_tiles: int | None = None) -> "QwenVLInputs":
        """`max_tiles` is ignored: Qwen-VL sizes its grid to the image, it does not tile."""
        directory = Path(directory)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(directory)
        video_max_pixels = image_processor.size["longest_edge"]
        video_config = directory / "video_preprocessor_config.json"
        if video_config.is_file():
            video_max_pixels = (
                json.loads(video_config.read_text()).get("size", {}).get("longest_edge", video_max_pixels)
            )
        return cls(tokenizer, image_processor, video_max_pixels)

    @property
    def eos_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id

    @property
    def min_side(self) -> int:
        return self.factor

    @property
    def max_image_pixels(self) -> int:
        return max(self.image_processor.size["longest_edge"], self.factor**2)

    @property
    def max_frame_pixels(self) -> int:
        return max(self.video_max_pixels, self.factor**2)

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True).strip()

    def longest_prompt(self, prompt: str, max_frames: int) -> int:
        unit = self.factor**2
        vision_tokens = {
            "image": self.image_processor.size["longest_edge"] // unit,
            "video": max_frames // self.temporal_patch_size * (self.video_max_pixels // unit),
        }
        # The template's single pad token is replaced by the vision tokens: hence the -1.
        return max(
            len(self.tokenizer(self.prompt_text(kind, prompt, 1)).input_ids) - 1 + tokens
            for kind, tokens in vision_tokens.items()
        )

    def check_model(self, config: PretrainedConfig) -> None:
        """Raise ValueError when this tokenizer's ids do not fit the model."""
        vocab_size = config.get_text_config().vocab_size
        if len(self.tokenizer) > vocab_size:
            raise ValueError(f"tokenizer has {len(self.tokenizer)} tokens, the model's vocabulary only {vocab_size}")
        expected = {
            IMAGE_PAD: config.image_token_id,
            VIDEO_PAD: config.video_token_id,
            VISION_START: config.vision_start_token_id,
        }
        for token, model_id in expected.items():
            if self.token_ids[token] != model_id:
                raise ValueError(f"tokenizer maps {token} to {self.token_ids[token]}, the model expects {model_id}")
        patch_size = config.vision_config.patch_size
        if patch_size != self.image_processor.patch_size:
            raise ValueError(f"processor patch size {self.image_processor.patch_size}, model {patch_size}")

    def encode_image(self, image: Image.Image) -> EncodedItem:
        out = self.image_processor(images=[image], return_tensors="np")
        grid = tuple(int(v) for v in out["image_grid_thw"][0])
        return EncodedItem("image", out["pixel_values"], grid, int(np.prod(grid)) // self.merge_size**2)

    def encode_video(self, frames: list[Image.Image]) -> EncodedItem:
        temporal = self.temporal_patch_size
        if len(frames) % temporal:
            raise ValueError(f"{len(frames)} frames is not a multiple of the temporal patch {temporal}")
        out = self.image_processor(
            images=frames,
            size={"shortest_edge": self.min_pixels, "longest_edge": self.video_max_pixels},
            return_tensors="np",
        )
        _, grid_h, grid_w = (int(v) for v in out["image_grid_thw"][0])
        # Per frame the processor repeats the frame over the temporal axis:
        # (frames, patches, C, temporal, p, p). Keep one copy and stack `temporal` frames instead.
        patch = self.image_processor.patch_size
        per_frame = out["pixel_values"].reshape(len(frames), grid_h * grid_w, 3, temporal, patch, patch)[:, :, :, 0]
        grouped = per_frame.reshape(len(frames) // temporal, temporal, grid_h * grid_w, 3, patch, patch)
        pixel_values = grouped.transpose(0, 2, 3, 1, 4, 5).reshape(-1, 3 * temporal * patch * patch)
        grid = (len(frames) // temporal, grid_h, grid_w)
        return EncodedItem("video", np.ascontiguousarray(pixel_values), grid, int(np.prod(grid)) // self.merge_size**2)

    def prompt_text(self, kind: str, prompt: str, vision_tokens: int) -> str:
        message = [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": prompt}]}]
        text = self.tokenizer.apply_chat_template(message, add_generation_prompt=True, tokenize=False)
        pad = IMAGE_PAD if kind == "image" else VIDEO_PAD
        if text.count(pad) != 1:
            raise ValueError(f"chat template produced {text.count(pad)} {pad} tokens, expected 1")
        return text.replace(pad, pad * vision_tokens)

    def batch(self, items: list[EncodedItem], prompt: str) -> dict[str, torch.Tensor]:
        """Left-padded inputs for `model.generate(**batch)`; items keep their order."""
        texts = [self.prompt_text(item.kind, prompt, item.vision_tokens) for item in items]
        encoded = self.tokenizer(texts, padding=True, return_tensors="pt")
        batch = {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}
        mm_types = torch.zeros_like(batch["input_ids"])
        mm_types[batch["input_ids"] == self.token_ids[IMAGE_PAD]] = MM_TOKEN_TYPE["image"]
        mm_types[batch["input_ids"] == self.token_ids[VIDEO_PAD]] = MM_TOKEN_TYPE["video"]
        batch["mm_token_type_ids"] = mm_types
        for kind, pixels_key, grid_key in (
            ("image", "pixel_values", "image_grid_thw"),
            ("video", "pixel_values_videos", "video_grid_thw"),
        ):
            chosen = [item for item in items if item.kind == kind]
            if chosen:
                batch[pixels_key] = torch.from_numpy(np.concatenate([item.pixel_values for item in chosen]))
                batch[grid_key] = torch.tensor([item.grid_thw for item in chosen], dtype=torch.long)
        return batch
