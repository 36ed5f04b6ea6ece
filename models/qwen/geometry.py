"""The Qwen-VL processors' geometry and timing, with no torch: their pixel settings (from the image
and video processor configs), `smart_resize` (per frame or per clip), a video's timing, and the size
each frame of a clip is scaled to (`QwenFrameSize`), which the video decoder's worker processes
use to scale frames once, as they decode them (`app/video.py`). `inputs.py` says what the
processors do."""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from transformers import Qwen2VLImageProcessorPil

BICUBIC = 3  # PILImageResampling.BICUBIC, every Qwen processor's resample

# The video processor classes' defaults, for keys a checkpoint's video config leaves out.
_OPENAI_CLIP = dict(image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711])
VIDEO_DEFAULTS: dict[str, dict[str, Any]] = {
    "Qwen2VLVideoProcessor": dict(
        size={"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768},
        patch_size=14,
        max_video_tokens=128000,
        **_OPENAI_CLIP,
    ),
    "Qwen3VLVideoProcessor": dict(
        size={"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768},
        patch_size=16,
        max_video_tokens=768,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    ),
}
# The model types whose checkpoints take Qwen3VLProcessor (transformers' processing_auto, 5.17.0).
QWEN3_PROCESSOR_MODELS = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
VIDEO_PROCESSOR_OF_MODEL = dict.fromkeys(QWEN3_PROCESSOR_MODELS, "Qwen3VLVideoProcessor")
_COMMON_DEFAULTS: dict[str, Any] = dict(
    temporal_patch_size=2,
    merge_size=2,
    rescale_factor=1 / 255,
    do_rescale=True,
    do_normalize=True,
    do_resize=True,
    resample=BICUBIC,
    cap_pixels_per_frame=None,
)


@dataclass(frozen=True)
class PixelSettings:
    """What an image or video processor config says about pixels."""

    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float
    do_rescale: bool
    do_normalize: bool
    do_resize: bool
    # Videos only: Qwen3VLVideoProcessor's min and max pixels bound the whole clip, not each frame.
    clip_budget: bool = False
    cap_pixels_per_frame: bool = False  # the processors' opt-in qwen-vl-utils cap
    max_video_tokens: int = 0
    # A resolution policy's bound on each frame's pixels where `max_pixels` bounds the whole clip
    # (0: none): a clip of n frames then gets at most n times this.
    frame_cap: int = 0

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def capped(self, max_pixels: int | None) -> "PixelSettings":
        """These settings with an image, or each frame of a video, at most `max_pixels` (None:
        as they are): what the processors do when called with that `max_pixels`."""
        if max_pixels is None:
            return self
        if max_pixels < max(self.min_pixels, self.factor**2):
            raise ValueError(f"max_pixels {max_pixels} is below the processor's minimum {self.min_pixels}")
        if self.clip_budget:
            return replace(self, frame_cap=max_pixels)
        return replace(self, max_pixels=min(self.max_pixels, max_pixels))

    def clip_pixels(self, frames: int) -> int:
        """The most pixels a clip of `frames` frames may hold (the whole-clip budget)."""
        return min(self.max_pixels, self.frame_cap * frames) if self.frame_cap else self.max_pixels

    @classmethod
    def from_config(cls, config: Mapping[str, Any], defaults: Mapping[str, Any], clip_budget: bool) -> "PixelSettings":
        merged = {**_COMMON_DEFAULTS, **defaults, **config}
        size = dict(merged["size"])
        # Old configs give min_pixels / max_pixels; the processors let them override `size`.
        if merged.get("min_pixels") is not None:
            size["shortest_edge"] = merged["min_pixels"]
        if merged.get("max_pixels") is not None:
            size["longest_edge"] = merged["max_pixels"]
        if int(merged["resample"]) != BICUBIC:
            raise ValueError(f"only bicubic resampling is supported, the config asks for {merged['resample']}")
        return cls(
            min_pixels=int(size["shortest_edge"]),
            max_pixels=int(size["longest_edge"]),
            patch_size=int(merged["patch_size"]),
            temporal_patch_size=int(merged["temporal_patch_size"]),
            merge_size=int(merged["merge_size"]),
            image_mean=tuple(merged["image_mean"]),
            image_std=tuple(merged["image_std"]),
            rescale_factor=float(merged["rescale_factor"]),
            do_rescale=bool(merged["do_rescale"]),
            do_normalize=bool(merged["do_normalize"]),
            do_resize=bool(merged["do_resize"]),
            clip_budget=clip_budget,
            cap_pixels_per_frame=bool(merged["cap_pixels_per_frame"]),
            max_video_tokens=int(merged.get("max_video_tokens") or 0),
        )

    @classmethod
    def of_image_processor(cls, processor: "Qwen2VLImageProcessorPil") -> "PixelSettings":
        names = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std", "rescale_factor")
        config = {name: getattr(processor, name) for name in names}
        config.update(
            size={"shortest_edge": processor.size["shortest_edge"], "longest_edge": processor.size["longest_edge"]},
            do_rescale=processor.do_rescale,
            do_normalize=processor.do_normalize,
            do_resize=processor.do_resize,
            resample=processor.resample,
        )
        return cls.from_config(config, {}, clip_budget=False)



def smart_resize(height: int, width: int, settings: PixelSettings, max_pixels: int) -> tuple[int, int]:
    """Qwen2VLImageProcessor's smart_resize (images, and each frame for Qwen2VLVideoProcessor)."""
    factor, min_pixels = settings.factor, settings.min_pixels
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def video_size(shape: Sequence[int], settings: PixelSettings) -> tuple[int, int]:
    """The resized (height, width) of the frames of a clip of `shape` (frames, channels, height,
    width): Qwen2VLVideoProcessor.resize or Qwen3VLVideoProcessor.resize."""
    frames, _, height, width = shape
    factor, temporal = settings.factor, settings.temporal_patch_size
    if not settings.clip_budget:
        max_pixels = settings.max_pixels
        if settings.cap_pixels_per_frame:
            total_pixels = int(settings.max_video_tokens * factor * factor * 0.9)
            max_pixels = max(min(max_pixels, total_pixels * temporal // frames), int(settings.min_pixels * 1.05))
        return smart_resize(height, width, settings, max_pixels)
    max_pixels = settings.clip_pixels(frames)
    if settings.cap_pixels_per_frame:
        frame_cap = settings.max_video_tokens * factor * factor
        max_pixels = max(min(frame_cap, max_pixels // frames), int(settings.min_pixels * 1.05)) * frames
    # Qwen3-VL's smart_resize: the bounds hold for frames x height x width.
    if frames < temporal:
        raise ValueError(f"t:{frames} must be larger than temporal_factor:{temporal}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < settings.min_pixels:
        beta = math.sqrt(settings.min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def video_timing(metadata: Any, frame_count: int, temporal: int) -> tuple[float, tuple[float, ...]]:
    """(seconds per temporal patch, each temporal patch's mean time), computed as
    Qwen2_5_VLProcessor (from VideoMetadata.sampled_fps) and Qwen3VLProcessor
    (_calculate_timestamps) compute them."""

    def get(name: str) -> Any:
        if metadata is None:
            return None
        return metadata.get(name) if isinstance(metadata, Mapping) else getattr(metadata, name, None)

    fps, indices, total = get("fps"), get("frames_indices"), get("total_num_frames")
    fps = float(fps) if fps else None  # a Fraction (PyAV) formats like a float; 0 fps is unknown
    if metadata is None:  # what the processors assume for frames given without metadata
        indices, total = range(frame_count), frame_count
    if indices is None or total is None or fps is None:
        sampled_fps = fps or 24
    else:
        sampled_fps = len(indices) / total * fps
    indices = list(range(frame_count)) if indices is None else [int(i) for i in np.asarray(indices).tolist()]
    if len(indices) != frame_count:
        raise ValueError(f"metadata has {len(indices)} frame indices for {frame_count} frames")
    video_fps = 24 if fps is None else fps
    indices += [indices[-1]] * (-len(indices) % temporal)
    times = [index / video_fps for index in indices]
    timestamps = tuple((times[i] + times[i + temporal - 1]) / 2 for i in range(0, len(times), temporal))
    return temporal / sampled_fps, timestamps


@dataclass(frozen=True)
class QwenFrameSize:
    """The (width, height) each frame of a clip of `frames` frames of `width` x `height` pixels
    becomes in the model's video processor (`video_size`): picklable and torch-free, so a video
    decoder's worker process scales each frame to it once, in the decoder's converter. Frames
    already at this size pass `encode_video`'s resize unchanged (`smart_resize` keeps a size it made)."""

    settings: PixelSettings

    def __call__(self, width: int, height: int, frames: int) -> tuple[int, int]:
        if not self.settings.do_resize:
            return width, height
        count = max(frames, self.settings.temporal_patch_size)
        height, width = video_size((count, 3, height, width), self.settings)
        return width, height
