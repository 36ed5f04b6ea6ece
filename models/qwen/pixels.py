"""Pixels as the Qwen-VL processors' torchvision backend makes them, with torch alone: resizing,
normalisation and patch order (the sizes and timing they follow are `geometry.py`'s). `inputs.py`
says why."""

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from encoder_graphs.models.qwen.geometry import PixelSettings


def uint8_pixels(images: "Sequence[Image.Image] | np.ndarray") -> torch.Tensor:
    """(images, 3, height, width) uint8 from RGB images (others converted as transformers does)
    or from an array of frames (frames, height, width, 3), as the video decoder gives them."""
    if isinstance(images, np.ndarray):
        if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8:
            raise ValueError(f"frames must be a uint8 array (frames, height, width, 3), got {images.dtype} {images.shape}")
        return torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()
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
