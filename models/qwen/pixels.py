"""Pixels as the Qwen-VL processors' torchvision backend makes them, with torch alone: their
settings (from the image and video processor configs), resizing (`smart_resize`, per frame or per
clip), normalisation, patch order, and a video's timing. `inputs.py` says why."""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
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
    def of_image_processor(cls, processor: Qwen2VLImageProcessorPil) -> "PixelSettings":
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


def uint8_pixels(images: Sequence[Image.Image]) -> torch.Tensor:
    """(images, 3, height, width) uint8; images not in RGB are converted as transformers does."""
    arrays = [np.array(image if image.mode == "RGB" else image.convert("RGB")) for image in images]
    if len({a.shape for a in arrays}) != 1:
        raise ValueError(f"video frames differ in size: {sorted({a.shape[:2] for a in arrays})}")
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()


def resize(pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """torchvision's `resize` of uint8 pixels as the processors call it on CPU (bicubic,
    antialias): torchvision hands uint8 bicubic straight to this `interpolate`."""
    if tuple(pixels.shape[-2:]) == (height, width):
        return pixels
    return F.interpolate(pixels, size=(height, width), mode="bicubic", align_corners=False, antialias=True)


def normalize(pixels: torch.Tensor, settings: PixelSettings, affine: "Affine | None" = None) -> torch.Tensor:
    """TorchvisionBackend.rescale_and_normalize: rescale folded into mean and std, float32, over
    dim 1 (channels) of a tensor of any device; the same correctly rounded float32 operations
    on a GPU as on the CPU, so the result is the same bit for bit. `affine`: `fused_affine`'s
    result for this device, made once for many calls."""
    shape = (-1,) + (1,) * (pixels.dim() - 2)
    if settings.do_normalize:
        mean, std = affine or fused_affine(settings, pixels.device)
        return pixels.to(torch.float32).sub(mean.view(shape)).div_(std.view(shape))
    if settings.do_rescale:
        return pixels * settings.rescale_factor
    return pixels.to(torch.float32)


Affine = tuple[torch.Tensor, torch.Tensor]


def fused_affine(settings: PixelSettings, device: torch.device | str) -> Affine:
    """The processors' mean and std with the rescale folded in, float32 on `device`. Made once a
    batch, not once a chunk: each is a copy from pageable host memory, which waits for the
    device's queue, so made per chunk they held the model's thread for most of `to_model`."""
    mean = torch.tensor(settings.image_mean, device=device)
    std = torch.tensor(settings.image_std, device=device)
    if settings.do_rescale:
        mean, std = mean * (1.0 / settings.rescale_factor), std * (1.0 / settings.rescale_factor)
    return mean, std


def patchify(frames: torch.Tensor, settings: PixelSettings, temporal: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """(frames, C, H, W) -> (grid_t * grid_h * grid_w, C, temporal, patch * patch) in the
    processors' patch order (merge windows together), the last frame repeated to fill a temporal
    patch. An image is one frame with `temporal` 1: `pixel_values` repeats it over the temporal
    patch, as the processors do, so it travels once."""
    patch, merge = settings.patch_size, settings.merge_size
    if pad := -frames.shape[0] % temporal:
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
    count, channels, height, width = frames.shape
    grid = (count // temporal, height // patch, width // patch)
    patches = frames.reshape(
        grid[0], temporal, channels, grid[1] // merge, merge, patch, grid[2] // merge, merge, patch
    ).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(math.prod(grid), channels, temporal, patch * patch).contiguous(), grid


def pixel_values(patches: torch.Tensor, settings: PixelSettings, dtype: torch.dtype, chunk: int = 4096) -> torch.Tensor:
    """The processors' `pixel_values` (patches, C * temporal_patch_size * patch * patch) from
    `patchify`'s uint8 patches, on their device: normalised in float32 as the processors do, then
    cast to `dtype`. In chunks of patches, so the float32 copy stays small beside the output."""
    count, channels, temporal, area = patches.shape
    full = settings.temporal_patch_size
    if temporal not in (1, full):
        raise ValueError(f"patches hold {temporal} frames a temporal patch; expected 1 or {full}")
    out = torch.empty(count, channels * full * area, dtype=dtype, device=patches.device)
    affine = fused_affine(settings, patches.device) if settings.do_normalize else None
    for start in range(0, count, chunk):
        part = normalize(patches[start : start + chunk], settings, affine).expand(-1, -1, full, -1)
        out[start : start + chunk] = part.reshape(part.shape[0], -1)
    return out


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


def video_size(shape: torch.Size, settings: PixelSettings) -> tuple[int, int]:
    """The resized frame size: Qwen2VLVideoProcessor.resize or Qwen3VLVideoProcessor.resize."""
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
