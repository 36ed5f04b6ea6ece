"""Reading the files `walk.discover` found, safely: the images here, and what videos share with
them (`LoadLimits`, `MediaError`, opening and size checks; their frames: `app/video.py`).

Every way a file can be bad ends in a `MediaError` naming the file and a short `kind`, so the
pipeline can record it and go on. Nothing is read that could hang the run or exhaust its memory:
special files are never opened, and an image's size and shape are judged from its header before
any pixel is decoded.
"""

import hashlib
import math
import os
import stat
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from PIL import ExifTags, Image, UnidentifiedImageError

from encoder_graphs.app.errors import file_kind

SAMPLES_DIR = Path(__file__).parent / "samples"
ORIENTATION_TAG = ExifTags.Base.Orientation
# How EXIF orientations 2-8 turn a stored image upright (PIL's ImageOps.exif_transpose table).
UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
QUARTER_TURNS = frozenset({Image.Transpose.TRANSPOSE, Image.Transpose.ROTATE_270, Image.Transpose.TRANSVERSE,
                           Image.Transpose.ROTATE_90})  # orientations 5-8: width and height swap
WIDE_MODES = frozenset({"I;16", "I;16B", "I;16L", "I;16N", "I", "F"})  # more than 8 bits a channel
# Bytes a decoded pixel may take while an image is converted: its bitmap (at most 4) and one
# converted copy.
DECODE_BYTES_PER_PIXEL = 8


class MediaError(Exception):
    """A file that cannot be captioned.

    `kind`: unreadable, empty, special (a FIFO, device or socket, or a link into /proc, /sys or
    /dev: never opened), corrupt, too_large (pixels), aspect_ratio (past the models' 200:1),
    no_frames, unsupported (no video decoder), timeout (a video past `--video-timeout`), crashed
    (a video decoder's process died), cancelled (the run ended while its frames were decoded).
    """

    def __init__(self, path: Path | str, kind: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.kind, self.reason = path, kind, reason

    def __reduce__(self) -> tuple:  # from a video decoder's worker process, whole
        return type(self), (self.path, self.kind, self.reason)


@dataclass(frozen=True)
class LoadLimits:
    # An image larger than this is reduced by a whole factor that still leaves it this many pixels
    # (a JPEG inside its decoder: 1/2, 1/4, 1/8; other formats after decoding, by box averages);
    # the processor then resizes it once, to its own grid, which the reduction leaves unchanged.
    max_pixels: int = 1280 * 28 * 28
    min_side: int = 28  # tiny images are grown to this (the model's patch * merge size)
    max_decode_pixels: int = 2 * Image.MAX_IMAGE_PIXELS  # refuse to decode larger (bombs)
    # Longest side over shortest: Qwen-VL's processors refuse past 200, and a 1,000,000 x 1 strip
    # grown to `min_side` would be 28 million pixels wide.
    max_aspect: float = 200.0
    # Videos (`app/video.py`): `max_frames` sampled evenly, or with `video_fps` that many a second
    # up to `max_frames`; each scaled as decoded to `frame_size` (the model's: a fixed (width,
    # height), or a picklable callable of the clip's (width, height, frames); None: at most
    # `frame_max_pixels`, the short side at least `min_side`).
    max_frames: int = 16
    video_fps: float | None = None
    # "exact": the frame shown at each sampled time (what the processors take); "keyframes": the
    # keyframe nearest each where one lies within half the sampling interval (no decode before it).
    video_sampling: str = "exact"
    frame_size: Any = None
    frame_max_pixels: int = 256 * 28 * 28
    # A stream whose frames are larger (than DCI 8K: 8K UHD and 8192 x 4096 pass) is refused by its
    # header: a decoder holds up to 16 reference frames, which at 8192 x 8192 took its process to
    # 2.8 GB, at 8K UHD to 1.45 GB (a hostile file's bound is 2 GB).
    max_video_pixels: int = 8192 * 4320
    video_timeout_s: float = 120.0  # a video's decode, in its worker process (`VideoDecoders`)
    video_threads: int = 1  # FFmpeg threads of one video's decoder
    video_hwaccel: str | None = None  # "nvdec": the GPU decodes H.264 / HEVC where it can (app/nvdec.py)
    video_device: int = 0  # its GPU

    def __post_init__(self) -> None:
        if self.max_frames < 2 or self.max_frames % 2:
            raise ValueError(f"max_frames must be an even number >= 2, got {self.max_frames}")
        if self.video_fps is not None and not 0 < self.video_fps < math.inf:
            raise ValueError(f"video_fps must be a positive number, got {self.video_fps}")
        if self.video_hwaccel not in (None, "nvdec"):
            raise ValueError(f"video_hwaccel must be None or 'nvdec', got {self.video_hwaccel!r}")
        if self.video_sampling not in ("exact", "keyframes"):
            raise ValueError(f"video_sampling must be 'exact' or 'keyframes', got {self.video_sampling!r}")
        if not self.video_timeout_s > 0 or self.video_threads < 1:
            raise ValueError("video_timeout_s must be positive and video_threads at least 1")
        if self.min_side < 1 or self.min_side**2 > min(self.max_pixels, self.frame_max_pixels):
            raise ValueError(f"min_side {self.min_side} does not fit the pixel limits")
        if self.max_pixels > self.max_decode_pixels:
            raise ValueError("max_pixels must not exceed max_decode_pixels")
        if not self.max_aspect >= 1:
            raise ValueError(f"max_aspect must be >= 1, got {self.max_aspect}")


class DecodeBudget:
    """Bytes of decoded bitmaps that the loader threads may hold at once. Sixteen threads each
    decoding a 13000 x 13000 16-bit PNG would hold 16 x 340 MB plus their conversions: within the
    budget the largest images decode one at a time (one larger than the whole budget alone), while
    photos (JPEGs decode reduced, a few MB) never wait."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.free = total
        self._changed = threading.Condition()

    @contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        nbytes = min(nbytes, self.total)
        with self._changed:
            self._changed.wait_for(lambda: self.free >= nbytes)
            self.free -= nbytes
        try:
            yield
        finally:
            with self._changed:
                self.free += nbytes
                self._changed.notify_all()


DECODE_BUDGET = DecodeBudget(2 << 30)

# Pillow's warning for an image past its pixel count is for code that does not judge sizes: these
# loaders refuse by the header first (`check_size`), so it is off, once, for the process. Turned off
# per call, in `warnings.catch_warnings`, it leaked: that context is not thread-safe, and the loader
# threads entered and left it at once.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


def load_image(path: Path, limits: LoadLimits) -> Image.Image:
    """Decoded as small as the limits allow (`decode_image`), from a regular file only."""
    with open_regular(path) as handle:
        return decode_image(handle, path, limits)


def decode_image(handle: BinaryIO, name: Path | str, limits: LoadLimits) -> Image.Image:
    """The image `handle` holds (a file, or bytes of a dataset's row; `name` says which in an
    error), decoded as small as the limits allow: a JPEG reduced inside its decoder, other
    formats box reduced right after decoding, before any conversion (a float copy of a 16-bit
    bitmap is four times its size); turned upright by its EXIF orientation."""
    try:
        with Image.open(handle) as image:  # no DecompressionBombWarning: the filter above
            check_size(name, *image.size, limits)
            # JPEG can decode at 1/2, 1/4, 1/8 scale: a huge photo never becomes a huge bitmap.
            scale = math.sqrt(limits.max_pixels / (image.width * image.height))
            if scale < 1:
                image.draft("RGB", (max(1, int(image.width * scale)), max(1, int(image.height * scale))))
            with DECODE_BUDGET.hold(image.width * image.height * DECODE_BYTES_PER_PIXEL):
                image.load()
                orientation = image.getexif().get(ORIENTATION_TAG, 1)  # a PNG's may follow its pixels
                rgb = _to_rgb(reduce(_narrow(image), limits.max_pixels))
    except MediaError:
        raise
    except Image.DecompressionBombError as error:
        raise MediaError(name, "too_large", str(error)) from error
    except UnidentifiedImageError as error:
        raise MediaError(name, "corrupt", "not a recognised image") from error
    except (OSError, ValueError, SyntaxError, EOFError) as error:
        # PIL reports truncated and malformed data as any of these.
        raise MediaError(name, "corrupt", f"cannot decode image ({error})") from error
    if orientation in UPRIGHT:  # phone photos: upright as seen
        rgb = rgb.transpose(UPRIGHT[orientation])
    return fit(rgb, None, limits.min_side)


def upright_size(path: Path | BinaryIO) -> tuple[int, int]:
    """An image's width and height as seen (its EXIF orientation applied), from its header only
    (`path`: a file, or a handle on an image's bytes)."""
    with Image.open(path) as image:  # sizes judged by `load` (the warnings filter above)
        width, height = image.size
        turned = UPRIGHT.get(image.getexif().get(ORIENTATION_TAG, 1)) in QUARTER_TURNS
    return (height, width) if turned else (width, height)


def check_size(path: Path | str, width: int, height: int, limits: LoadLimits, max_pixels: int | None = None) -> None:
    """From the header, before any pixel is decoded: too many pixels (`max_pixels`, default
    `limits.max_decode_pixels`), or too elongated a shape."""
    if width < 1 or height < 1:
        raise MediaError(path, "corrupt", f"the header gives {width}x{height} pixels")
    if width * height > (max_pixels or limits.max_decode_pixels):
        raise MediaError(path, "too_large", f"{width}x{height} pixels exceeds the decode limit")
    if max(width, height) > limits.max_aspect * min(width, height):
        raise MediaError(
            path, "aspect_ratio", f"{width}x{height} pixels: longer than {limits.max_aspect:g} times its width"
        )


def reduce(image: Image.Image, max_pixels: int) -> Image.Image:
    """`image` box-reduced by the largest whole factor that keeps at least `max_pixels` of it:
    what JPEG's draft decode does, for every format. Not resized to `max_pixels` itself: the
    processor's resize to its grid follows, and a resize before it would blur the picture twice."""
    factor = math.isqrt(image.width * image.height // max_pixels)
    return image.reduce(factor) if factor >= 2 else image


def fit(image: Image.Image, max_pixels: int | None, min_side: int) -> Image.Image:
    """Shrink to at most `max_pixels` (None: never), then grow so the short side is at least
    `min_side`."""
    size = fitted_size(*image.size, max_pixels, min_side)
    if size == image.size:
        return image
    grows = size[0] > image.width
    return image.resize(size, Image.Resampling.BICUBIC, reducing_gap=None if grows else 3.0)


def fitted_size(width: int, height: int, max_pixels: int | None, min_side: int) -> tuple[int, int]:
    """(width, height) shrunk to at most `max_pixels` (None: never), then grown so the short side
    is at least `min_side`."""
    scale = 1.0 if max_pixels is None else min(1.0, math.sqrt(max_pixels / (width * height)))
    scale = max(scale, min_side / min(width, height))
    if scale == 1.0:
        return width, height
    return max(min_side, round(width * scale)), max(min_side, round(height * scale))


def open_regular(path: Path) -> BinaryIO:
    """`path` opened for reading, once it is known to be a regular file. A FIFO, device or socket
    is never opened: opening a FIFO waits for a writer (a run would hang, Ctrl-C too), and opening
    a device can act on it. O_NONBLOCK keeps a FIFO swapped in after the check from blocking the
    open (regular files ignore it), and the opened file must be the one checked."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise MediaError(path, "special", f"{file_kind(info.st_mode)}, not a regular file: not read")
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except PermissionError as error:
        raise MediaError(path, "unreadable", "permission denied") from error
    except OSError as error:
        raise MediaError(path, "unreadable", error.strerror or str(error)) from error
    handle = os.fdopen(descriptor, "rb")
    opened = os.fstat(descriptor)
    if not os.path.samestat(opened, info):
        handle.close()
        raise MediaError(path, "unreadable", "the file was replaced while it was opened")
    if opened.st_size == 0:
        handle.close()
        raise MediaError(path, "empty", "zero-byte file")
    return handle


FINGERPRINT_BYTES = 64 << 10  # read from each end of a file for its fingerprint


def fingerprint(path: Path) -> str | None:
    """What a file holds, told cheaply: BLAKE2b of its size and its first and last 64 KiB (None
    where it is not a regular file that can be read: `open_regular`). With its path relative to
    its root, it is a file's identity when its dataset moves (`outputs.carry_moved`)."""
    try:
        with open_regular(Path(path)) as handle:
            size = os.fstat(handle.fileno()).st_size
            digest = hashlib.blake2b(size.to_bytes(8, "little"), digest_size=16)
            digest.update(handle.read(FINGERPRINT_BYTES))
            if size > FINGERPRINT_BYTES:
                handle.seek(max(FINGERPRINT_BYTES, size - FINGERPRINT_BYTES))
                digest.update(handle.read(FINGERPRINT_BYTES))
            return digest.hexdigest()
    except (MediaError, OSError):
        return None


def _narrow(image: Image.Image) -> Image.Image:
    """One byte a channel, in a mode `Image.reduce` takes: 16- and 32-bit grey scaled to 8 bits
    (not clipped: 65535 is white), band by band (a float copy of a 13000 x 13000 bitmap would be
    1.4 GB); palettes, bilevel and other modes converted, with their alpha."""
    if image.mode in WIDE_MODES:
        peak = 65535.0 if image.mode.startswith("I;16") or image.getextrema()[1] > 255 else 255.0
        gray = Image.new("L", image.size)
        for top in range(0, image.height, 256):
            band = np.asarray(image.crop((0, top, image.width, min(top + 256, image.height))), dtype=np.float32)
            gray.paste(Image.fromarray(np.clip(band * (255.0 / peak), 0, 255).astype(np.uint8), "L"), (0, top))
        return gray
    if image.mode in ("L", "LA", "RGB", "RGBA", "CMYK"):
        return image
    alpha = image.mode == "PA" or (image.mode == "P" and "transparency" in image.info)
    return image.convert("RGBA" if alpha else "RGB")


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB from `_narrow`'s modes: alpha over white."""
    if image.mode in ("RGBA", "LA"):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")
