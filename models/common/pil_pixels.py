"""The PIL image processors' rescale and normalisation (InternVL's GotOcr2ImageProcessorPil,
DeepSeek-OCR's DeepseekOcr2ImageProcessorPil), done on the device a batch goes to, from the uint8
pixels the processor returns with do_rescale=False and do_normalize=False: a float64 product
rounded to float32, then float32 (x - mean) / std, the same correctly rounded operations on a GPU
as on the CPU, so the result equals the processor's.
"""

from typing import Any

import torch

# Values normalised at a time: the float64 step of the rescale is 8 bytes a value (128 MiB here:
# 27 of InternVL's 448 px tiles, 5 of DeepSeek-OCR's 1024 px views, 9 of its 768 px tiles).
CHUNK_VALUES = 1 << 24
Affine = tuple[torch.Tensor, torch.Tensor] | None  # mean and std, [3, 1, 1]; None: no normalisation


def affine(processor: Any, device: torch.device) -> Affine:
    """The processor's mean and std on `device`; make them once a batch: each is a copy from
    pageable host memory, which waits for the device's queue."""
    if not processor.do_normalize:
        return None
    mean = torch.tensor(processor.image_mean, dtype=torch.float32, device=device).view(-1, 1, 1)
    std = torch.tensor(processor.image_std, dtype=torch.float32, device=device).view(-1, 1, 1)
    return mean, std


def normalized(pixels: torch.Tensor, processor: Any, mean_std: Affine, dtype: torch.dtype) -> torch.Tensor:
    """uint8 `pixels` [n, 3, h, w] as `processor` rescales and normalises them (`mean_std`:
    `affine(processor, pixels.device)`), cast to `dtype`."""
    out = torch.empty(pixels.shape, dtype=dtype, device=pixels.device)
    rows = max(1, CHUNK_VALUES // max(1, pixels[0].numel())) if pixels.shape[0] else 1
    for start in range(0, pixels.shape[0], rows):
        values = pixels[start : start + rows].to(torch.float64)
        if processor.do_rescale:
            values = values * processor.rescale_factor
        values = values.to(torch.float32)
        if mean_std is not None:
            mean, std = mean_std
            values = (values - mean) / std
        out[start : start + rows] = values
    return out
