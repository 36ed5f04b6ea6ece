"""`generate` inputs for Qwen-VL checkpoints (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), equal to what the
checkpoint's own `AutoProcessor` returns, built without torchvision.

Why not `AutoProcessor`: in transformers 5.17 the Qwen video processors (and so the processors)
cannot be built without torchvision, and CPU machines often lack it. This module reads the same
config files and takes the same steps with torch alone; tests/test_processors.py compares the two
wherever torchvision is installed. What the processors do, and so what is done here:

- pixels: their torchvision backend resizes uint8 pixels with antialiased bicubic `interpolate`
  (PIL's bicubic, the PIL backend's, differs by up to a few levels wherever a side grows), then
  rescales and normalizes in float32 with the fused mean and std;
- video sizes: Qwen2VLVideoProcessor (Qwen2-VL, Qwen2.5-VL) bounds each frame's pixels,
  Qwen3VLVideoProcessor the whole clip's (frames x height x width); a clip of an odd frame count
  is padded with its last frame;
- video timing: Qwen2_5_VLProcessor adds `second_per_grid_ts` (temporal patch / sampled fps),
  which M-RoPE spaces the video's temporal positions by; Qwen3VLProcessor writes each temporal
  patch's mean time ("<1.5 seconds>") and its own vision start and end tokens before its tokens.
  Both come from the video's metadata (fps, frame indices), 24 fps and consecutive frames without;
- the prompt is rendered with the processor's chat template (chat_template.json, else
  chat_template.jinja), which need not be the tokenizer's.
"""

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase, Qwen2VLImageProcessorPil

from encoder_graphs.models.common.batching import CollatingInputs, per_item, to_device
from encoder_graphs.models.qwen.geometry import (
    QWEN3_PROCESSOR_MODELS,
    VIDEO_DEFAULTS,
    VIDEO_PROCESSOR_OF_MODEL,
    PixelSettings,
    QwenFrameSize,
    smart_resize,
    video_size,
    video_timing,
)
from encoder_graphs.models.qwen.pixels import patchify, pixel_values, resize, uint8_pixels

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
MM_TOKEN_TYPE = {"image": 1, "video": 2}
# Qwen3-VL writes a time before each temporal patch; `longest_prompt` assumes none is longer than this.
LONGEST_TIMESTAMP = 99999.9


PIXEL_KEYS = {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}


@dataclass
class EncodedItem:
    """One image or video as uint8 patches, ready to join a batch: `pixel_values` normalises them
    where the batch goes (a GPU), so a photo travels as 3 MB rather than 25."""

    kind: str  # "image" | "video"
    patches: torch.Tensor  # uint8 (patches, channels, frames: 1 for an image, patch * patch)
    grid_thw: tuple[int, int, int]
    vision_tokens: int  # placeholder tokens in the prompt = encoder output tokens
    size: tuple[int, int]  # (width, height) in pixels the model sees (a video: each frame)
    # Videos: seconds per temporal patch (Qwen2.5-VL's second_per_grid_ts) and each temporal
    # patch's mean time in seconds (Qwen3-VL's prompt).
    second_per_grid_t: float | None = None
    timestamps: tuple[float, ...] = field(default_factory=tuple)


class QwenVLInputs(CollatingInputs):
    """CaptionInputs for the Qwen-VL families."""

    default_prompt: str | None = None  # a caption's
    reads_videos = True
    resolution_arguments = ("max_image_tokens", "max_frame_tokens")

    @property
    def generation_overrides(self) -> dict[str, Any]:
        """Qwen-VL checkpoints ship `repetition_penalty` 1.05, which no caption flag asks for and
        which would send every call to the stock `generate` (the decoder graphs apply no penalty)."""
        return {**super().generation_overrides, "repetition_penalty": 1.0}

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        image_processor: Qwen2VLImageProcessorPil,
        video: PixelSettings | None = None,
        *,
        model_type: str = "qwen2_vl",
        chat_template: str | None = None,
        max_image_tokens: int | None = None,
        max_frame_tokens: int | None = None,
    ) -> None:
        """`video`: the video processor's settings (default: the image processor's, per frame);
        `model_type`: the checkpoint's config.model_type (qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_5);
        `chat_template`: the processor's (default: the tokenizer's); the resolution policy:
        `max_image_tokens` vision tokens an image may become, `max_frame_tokens` a pair of video
        frames (a temporal patch; each frame then holds at most that many (patch x merge)**2
        pixels); larger ones are shrunk, as the processors do when given that `max_pixels`
        (None: the processors' own limit)."""
        self.tokenizer = tokenizer
        self.tokenizer.padding_side = "left"
        self.image_processor = image_processor
        image = PixelSettings.of_image_processor(image_processor)
        video = video if video is not None else image
        for name, tokens, pixels in (("max_image_tokens", max_image_tokens, image), ("max_frame_tokens", max_frame_tokens, video)):
            least = -(-max(pixels.min_pixels, pixels.factor**2) // pixels.factor**2)
            if tokens is not None and tokens < least:
                raise ValueError(f"{name} {tokens} is below the {least} tokens ({pixels.min_pixels} pixels) the "
                                 "processor makes of the smallest image")
        self.image = image.capped(None if max_image_tokens is None else max_image_tokens * image.factor**2)
        self.video = video.capped(None if max_frame_tokens is None else max_frame_tokens * video.factor**2)
        self.model_type = model_type
        self.chat_template = chat_template if chat_template is not None else tokenizer.chat_template
        if self.chat_template is None:
            raise ValueError("neither the processor nor the tokenizer has a chat template")
        self.factor = self.image.factor
        self.token_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (IMAGE_PAD, VIDEO_PAD, VISION_START)}

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        *,
        max_tiles: int | None = None,
        max_image_tokens: int | None = None,
        max_frame_tokens: int | None = None,
    ) -> "QwenVLInputs":
        """`max_tiles` is ignored: Qwen-VL sizes its grid to the image, it does not tile.

        Reads what `AutoProcessor.from_pretrained(directory)` reads: the image processor config,
        the video processor config (processor_config.json's `video_processor`, else
        video_preprocessor_config.json, else preprocessor_config.json, over the video processor
        class's defaults), the chat template, and config.json's model type."""
        directory = Path(directory)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(directory)
        model_type = _read_json(directory / "config.json").get("model_type", "qwen2_vl")
        video_config = (
            _read_json(directory / "processor_config.json").get("video_processor")
            or _read_json(directory / "video_preprocessor_config.json")
            or _read_json(directory / "preprocessor_config.json")
        )
        video_class = video_config.get("video_processor_type")
        if video_class not in VIDEO_DEFAULTS:
            video_class = VIDEO_PROCESSOR_OF_MODEL.get(model_type, "Qwen2VLVideoProcessor")
        video = PixelSettings.from_config(
            video_config, VIDEO_DEFAULTS[video_class], clip_budget=video_class == "Qwen3VLVideoProcessor"
        )
        return cls(
            tokenizer,
            image_processor,
            video,
            model_type=model_type,
            chat_template=_processor_chat_template(directory),
            max_image_tokens=max_image_tokens,
            max_frame_tokens=max_frame_tokens,
        )

    @property
    def timestamped_video(self) -> bool:
        """Qwen3-VL and Qwen3.5 prompts (Qwen3VLProcessor) write each temporal patch's time
        before its tokens."""
        return self.model_type in QWEN3_PROCESSOR_MODELS

    @property
    def min_side(self) -> int:
        return self.factor

    @property
    def max_image_pixels(self) -> int:
        return max(self.image.max_pixels, self.factor**2)

    @property
    def frame_size(self) -> QwenFrameSize:
        return QwenFrameSize(self.video)

    @property
    def max_frame_pixels(self) -> int:
        # With a whole-clip budget a frame is largest in the shortest clip, one temporal patch.
        temporal = self.video.temporal_patch_size
        per_frame = self.video.clip_pixels(temporal) // temporal if self.video.clip_budget else self.video.max_pixels
        return max(per_frame, self.video.factor**2)

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True).strip()

    def longest_prompt(self, prompt: str, max_frames: int) -> int:
        def length(kind: str, groups: int, tokens_per_group: int) -> int:
            # One pad token per group in the text, the rest counted: no need to tokenize thousands.
            timestamps = (LONGEST_TIMESTAMP,) * groups if kind == "video" else ()
            text = self.prompt_text(kind, prompt, groups, timestamps)
            return len(self.tokenizer(text).input_ids) + groups * (tokens_per_group - 1)

        lengths = [length("image", 1, self.image.max_pixels // self.factor**2)]
        temporal, unit = self.video.temporal_patch_size, self.video.factor**2
        for frames in range(temporal, max_frames + 1, temporal):
            frame_pixels = self.max_frame_pixels
            if self.video.clip_budget:
                frame_pixels = min(frame_pixels, self.video.clip_pixels(frames) // frames)
            groups = frames // temporal
            if self.timestamped_video:
                lengths.append(length("video", groups, frame_pixels // unit))
            else:
                lengths.append(length("video", 1, groups * (frame_pixels // unit)))
        return max(lengths)

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
        for kind, settings in (("image", self.image), ("video", self.video)):
            if settings.patch_size != patch_size:
                raise ValueError(f"{kind} processor patch size {settings.patch_size}, model {patch_size}")

    def encode_image(self, image: Image.Image) -> EncodedItem:
        settings = self.image
        pixels = uint8_pixels([image])
        if settings.do_resize:
            pixels = resize(pixels, *smart_resize(*pixels.shape[-2:], settings, settings.max_pixels))
        patches, grid = patchify(pixels, settings, temporal=1)
        size = (pixels.shape[-1], pixels.shape[-2])
        return EncodedItem("image", patches, grid, math.prod(grid) // settings.merge_size**2, size)

    def encode_video(self, frames: "Sequence[Image.Image] | np.ndarray", metadata: Any = None) -> EncodedItem:
        """`frames`: equally sized images, or a uint8 array (frames, height, width, 3) as the video
        decoder gives them (already at `frame_size`, so not resized again), any count (an odd one
        gets its last frame repeated, as the processors do). `metadata`: where they come from, as
        transformers' `VideoMetadata` (or a mapping with its keys): `fps` of the source,
        `frames_indices` of these frames in it, `total_num_frames` it has; without it, the
        processors' default for frames given without metadata: 24 fps, frames consecutive from 0.
        It sets Qwen2.5-VL's second_per_grid_ts and Qwen3-VL's timestamps; Qwen2-VL ignores it."""
        settings = self.video
        pixels = uint8_pixels(frames)
        if settings.do_resize:
            pixels = resize(pixels, *video_size(pixels.shape, settings))
        patches, grid = patchify(pixels, settings, temporal=settings.temporal_patch_size)
        second_per_grid_t, timestamps = video_timing(metadata, len(frames), settings.temporal_patch_size)
        return EncodedItem(
            "video",
            patches,
            grid,
            math.prod(grid) // settings.merge_size**2,
            (pixels.shape[-1], pixels.shape[-2]),
            second_per_grid_t=second_per_grid_t,
            timestamps=timestamps,
        )

    def prompt_text(self, kind: str, prompt: str, vision_tokens: int, timestamps: Sequence[float] = ()) -> str:
        """The chat-templated prompt with its pad token expanded to `vision_tokens`; for a Qwen3-VL
        video, split over its temporal patches, each after its time (`timestamps`, one per patch)."""
        message = [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": prompt}]}]
        text = self.tokenizer.apply_chat_template(
            message, chat_template=self.chat_template, add_generation_prompt=True, tokenize=False
        )
        pad = IMAGE_PAD if kind == "image" else VIDEO_PAD
        if text.count(pad) != 1:
            raise ValueError(f"chat template produced {text.count(pad)} {pad} tokens, expected 1")
        if kind == "video" and self.timestamped_video:
            # Qwen3VLProcessor.replace_video_token: the template's own start and end tokens stay.
            if not timestamps or vision_tokens % len(timestamps):
                raise ValueError(f"{vision_tokens} video tokens cannot be split over {len(timestamps)} timestamps")
            per_patch = pad * (vision_tokens // len(timestamps))
            return text.replace(
                pad, "".join(f"<{t:.1f} seconds>{VISION_START}{per_patch}{VISION_END}" for t in timestamps)
            )
        return text.replace(pad, pad * vision_tokens)

    def collate(self, items: Sequence[EncodedItem], prompts: str | Sequence[str]) -> dict[str, torch.Tensor]:
        """The batch on the CPU with its pixels still uint8 patches (`to_model` finishes it);
        touches no GPU, so it can run on a worker thread while the model works."""
        prompts = per_item(prompts, items)
        texts = [
            self.prompt_text(item.kind, prompt, item.vision_tokens, item.timestamps)
            for item, prompt in zip(items, prompts, strict=True)
        ]
        batch = self.tokenized(texts)
        mm_types = torch.zeros_like(batch["input_ids"])
        mm_types[batch["input_ids"] == self.token_ids[IMAGE_PAD]] = MM_TOKEN_TYPE["image"]
        mm_types[batch["input_ids"] == self.token_ids[VIDEO_PAD]] = MM_TOKEN_TYPE["video"]
        batch["mm_token_type_ids"] = mm_types
        for kind, (pixels_key, grid_key) in PIXEL_KEYS.items():
            chosen = [item for item in items if item.kind == kind]
            if chosen:
                batch[pixels_key] = torch.cat([item.patches for item in chosen])
                batch[grid_key] = torch.tensor([item.grid_thw for item in chosen], dtype=torch.long)
        videos = [item for item in items if item.kind == "video"]
        if videos and self.model_type == "qwen2_5_vl":
            # Float32, as the processor's; Qwen2.5-VL's M-RoPE spaces temporal positions by it.
            batch["second_per_grid_ts"] = torch.tensor([item.second_per_grid_t for item in videos])
        return batch

    def to_model(
        self, collated: dict[str, torch.Tensor], device: torch.device | str, dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        """`collate`'s batch on `device`: uint8 patches copied there and normalised into `dtype`
        pixels (float32 first, as the processors, so the result is theirs cast to `dtype`)."""
        moved = to_device(collated, device)
        for kind, (pixels_key, _) in PIXEL_KEYS.items():
            if pixels_key in moved:
                moved[pixels_key] = pixel_values(moved[pixels_key], self.image if kind == "image" else self.video, dtype)
        return moved


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _processor_chat_template(directory: Path) -> str | None:
    """The processor's chat template, found as ProcessorMixin.from_pretrained finds it."""
    legacy = _read_json(directory / "chat_template.json").get("chat_template")
    if legacy is not None:
        return legacy
    raw = directory / "chat_template.jinja"
    return raw.read_text() if raw.is_file() else None
