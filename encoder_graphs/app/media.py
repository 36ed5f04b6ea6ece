"""Finding images and videos under the given paths, and loading them safely.

Every way a file can be bad ends in a `MediaError` naming the file and a short `kind`, so the
pipeline can record it and go on.
"""

import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from encoder_graphs.app.results import path_key

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tiff", ".tif"})
VIDEO_EXTENSIONS = frozenset({".mp4", ".webm", ".mkv", ".avi"})
SAMPLES_DIR = Path(__file__).parent / "samples"


class MediaError(Exception):
    """A file that cannot be captioned.

    `kind`: unreadable, empty, corrupt, too_large, no_frames, unsupported (no video decoder).
    """

    def __init__(self, path: Path | str, kind: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.kind = kind


@dataclass(frozen=True)
class MediaFile:
    path: Path
    kind: str  # "image" | "video" | "folder" (one that could not be listed: `load` raises)
    reason: str = field(default="", compare=False)  # why a "folder" could not be listed
    aliases: tuple[Path, ...] = field(default=(), compare=False)  # its other names the walk found (symlinks to it)


class VideoFrames(list):
    """A video's frames (RGB images) and `metadata` on where they come from, with the keys of
    transformers' `VideoMetadata`: `fps` of the stream (None when unknown), `frames_indices` of
    these frames in it, `total_num_frames` decoded. Qwen2.5-VL and Qwen3-VL inputs time the
    video by it (`QwenVLInputs.encode_video`). `size`: the stream's (width, height) before the
    frames were shrunk."""

    def __init__(self, frames: list[Image.Image], metadata: dict, size: tuple[int, int] | None = None) -> None:
        super().__init__(frames)
        self.metadata = metadata
        self.size = size if size is not None else (frames[0].size if frames else (0, 0))


@dataclass(frozen=True)
class LoadLimits:
    # An image larger than this is reduced by a whole factor that still leaves it this many pixels
    # (a JPEG inside its decoder: 1/2, 1/4, 1/8; other formats after decoding, by box averages);
    # the processor then resizes it once, to its own grid, which the reduction leaves unchanged.
    max_pixels: int = 1280 * 28 * 28
    min_side: int = 28  # tiny images are grown to this (the model's patch * merge size)
    max_decode_pixels: int = 2 * Image.MAX_IMAGE_PIXELS  # refuse to decode larger (bombs)
    max_frames: int = 16
    frame_max_pixels: int = 256 * 28 * 28

    def __post_init__(self) -> None:
        if self.max_frames < 2 or self.max_frames % 2:
            raise ValueError(f"max_frames must be an even number >= 2, got {self.max_frames}")
        if self.min_side < 1 or self.min_side**2 > min(self.max_pixels, self.frame_max_pixels):
            raise ValueError(f"min_side {self.min_side} does not fit the pixel limits")
        if self.max_pixels > self.max_decode_pixels:
            raise ValueError("max_pixels must not exceed max_decode_pixels")


def media_kind(path: Path) -> str | None:
    suffix = path.suffix.lower()
    if suffix in IMAGE_EXTENSIONS:
        return "image"
    if suffix in VIDEO_EXTENSIONS:
        return "video"
    return None


def discover(paths: list[str | Path], *, include_hidden: bool = False) -> list[MediaFile]:
    """Media files under `paths` (files or folders, walked recursively), sorted, each once.

    Paths are made absolute (symlinks kept): a results file written from one working directory
    resumes from any other. Raises FileNotFoundError for a path that does not exist; files of other
    types are skipped. Symlinked folders are followed, each real folder walked once (so a link to
    an ancestor cannot loop) and each real file listed once (`path_key`), its other names as
    `aliases` (each gets its row in metadata.jsonl). Hidden files and folders
    (name starting with ".") are skipped unless `include_hidden`; a path given in `paths` is always
    used. A folder that cannot be listed is not dropped silently: it is listed as a
    `MediaFile(kind="folder")`, which `load` reports as an "unreadable" `MediaError`.
    """
    found: dict[str, dict[Path, tuple[str, str]]] = {}  # path_key -> {name: (kind, reason)}, first name first
    visited: set[tuple[int, int]] = set()  # (st_dev, st_ino) of every folder walked
    for root in map(Path, paths):
        if not root.exists() and not root.is_symlink():
            raise FileNotFoundError(f"no such file or directory: {root}")
        candidates = _walk(root, visited, include_hidden) if root.is_dir() else [(root, None)]
        for path, reason in candidates:
            kind = "folder" if reason is not None else media_kind(path)
            if kind is not None:
                found.setdefault(path_key(path), {}).setdefault(Path(os.path.abspath(path)), (kind, reason or ""))
    files = []
    for names in found.values():
        first, *others = names
        files.append(MediaFile(first, *names[first], aliases=tuple(others)))
    return sorted(files, key=lambda f: str(f.path))


def _walk(root: Path, visited: set[tuple[int, int]], include_hidden: bool) -> list[tuple[Path, str | None]]:
    """(path, None) for every file under `root`, following symlinked folders but never into a
    folder already in `visited`; (folder, why) for every folder that cannot be listed."""
    found: list[tuple[Path, str | None]] = []
    stack = [root]  # depth first, without recursion: deep trees do not hit the recursion limit
    while stack:
        folder = stack.pop()
        try:
            info = os.stat(folder)
            identity = (info.st_dev, info.st_ino)
            if identity in visited:
                continue
            visited.add(identity)
            entries = _list_folder(folder)
        except OSError as error:
            found.append((folder, _reason(error)))
            continue
        subfolders = []
        for name, is_dir in entries:
            if not include_hidden and name.startswith("."):
                continue
            if is_dir:
                subfolders.append(folder / name)
            else:
                found.append((folder / name, None))
        stack.extend(reversed(subfolders))
    return found


def _list_folder(folder: Path) -> list[tuple[str, bool]]:
    """(name, is a folder (symlinks followed)) for each entry, by name. Raises OSError."""
    with os.scandir(folder) as entries:
        listed = []
        for entry in entries:
            try:
                is_dir = entry.is_dir()  # follows symlinks; False for a dangling one
            except OSError:
                is_dir = False
            listed.append((entry.name, is_dir))
    return sorted(listed)


def _reason(error: OSError) -> str:
    if isinstance(error, PermissionError):
        return f"permission denied ({error.strerror})" if error.strerror else "permission denied"
    return error.strerror or str(error)


def load(file: MediaFile, limits: LoadLimits) -> Image.Image | VideoFrames:
    """An RGB image, or an even number of equally sized RGB video frames."""
    if file.kind == "folder":
        reason = file.reason or _folder_reason(file.path)
        raise MediaError(file.path, "unreadable", f"cannot list this folder: {reason}")
    if file.kind == "image":
        return load_image(file.path, limits)
    return load_video(file.path, limits)


def _folder_reason(path: Path) -> str:
    """Why a folder entry made without a `reason` cannot be listed (now)."""
    try:
        _list_folder(path)
    except OSError as error:
        return _reason(error)
    return "it could not be listed when the files were gathered"


def load_image(path: Path, limits: LoadLimits) -> Image.Image:
    _check_readable(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                width, height = image.size
                if width * height > limits.max_decode_pixels:
                    raise MediaError(path, "too_large", f"{width}x{height} pixels exceeds the decode limit")
                # JPEG can decode at 1/2, 1/4, 1/8 scale: a huge photo never becomes a huge bitmap.
                scale = math.sqrt(limits.max_pixels / (width * height))
                if scale < 1:
                    image.draft("RGB", (max(1, int(width * scale)), max(1, int(height * scale))))
                image.load()
                rgb = _to_rgb(ImageOps.exif_transpose(image))  # phone photos: upright as seen
    except MediaError:
        raise
    except Image.DecompressionBombError as error:
        raise MediaError(path, "too_large", str(error)) from error
    except PermissionError as error:
        raise MediaError(path, "unreadable", f"permission denied ({error.strerror})") from error
    except UnidentifiedImageError as error:
        raise MediaError(path, "corrupt", "not a recognised image") from error
    except (OSError, ValueError, SyntaxError, EOFError) as error:
        # PIL reports truncated and malformed data as any of these.
        raise MediaError(path, "corrupt", f"cannot decode image ({error})") from error
    return fit(reduce(rgb, limits.max_pixels), None, limits.min_side)


def reduce(image: Image.Image, max_pixels: int) -> Image.Image:
    """`image` box-reduced by the largest whole factor that keeps at least `max_pixels` of it:
    what JPEG's draft decode does, for every format. Not resized to `max_pixels` itself: the
    processor's resize to its grid follows, and a resize before it would blur the picture twice."""
    factor = math.isqrt(image.width * image.height // max_pixels)
    return image.reduce(factor) if factor >= 2 else image


def load_video(path: Path, limits: LoadLimits) -> VideoFrames:
    """Up to `limits.max_frames` frames, evenly spaced, an even count (the temporal patch is 2),
    with their stream indices and the stream's frame rate (`VideoFrames.metadata`).

    The whole stream is decoded once while a bounded set of candidates is kept (every `stride`-th
    frame, the stride doubling when the set fills), because many containers do not say how many
    frames they hold.
    """
    _check_readable(path)
    try:
        import av
    except ImportError as error:
        raise MediaError(path, "unsupported", "video needs PyAV: pip install 'encoder-graphs[video]'") from error
    keep = 4 * limits.max_frames
    candidates: list[Image.Image] = []  # candidates[i] is the stream's frame i * stride
    size = None  # the stream's frame size, before shrinking
    stride = 1
    decoded = 0
    fps = None
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise MediaError(path, "no_frames", "no video stream")
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            fps = float(stream.average_rate) if stream.average_rate else None
            for index, frame in enumerate(container.decode(stream)):
                decoded = index + 1
                if index % stride:
                    continue
                size = size or (frame.width, frame.height)
                candidates.append(fit(frame.to_image().convert("RGB"), limits.frame_max_pixels, limits.min_side))
                if len(candidates) == keep:
                    candidates = candidates[::2]
                    stride *= 2
    except MediaError:
        raise
    except PermissionError as error:
        raise MediaError(path, "unreadable", f"permission denied ({error.strerror})") from error
    except (av.FFmpegError, OSError, ValueError) as error:
        raise MediaError(path, "corrupt", f"cannot decode video ({error})") from error
    if not candidates:
        raise MediaError(path, "no_frames", "the video has no decodable frames")
    count = min(limits.max_frames, len(candidates))
    count = max(2, count - count % 2)
    picks = np.linspace(0, len(candidates) - 1, count).round().astype(int)
    shape = candidates[0].size
    frames = [candidates[i] if candidates[i].size == shape else candidates[i].resize(shape) for i in picks]
    indices = [int(i) * stride for i in picks]
    return VideoFrames(frames, {"fps": fps, "frames_indices": indices, "total_num_frames": decoded}, size)


def fit(image: Image.Image, max_pixels: int | None, min_side: int) -> Image.Image:
    """Shrink to at most `max_pixels` (None: never), then grow so the short side is at least
    `min_side`."""
    width, height = image.size
    scale = 1.0 if max_pixels is None else min(1.0, math.sqrt(max_pixels / (width * height)))
    scale = max(scale, min_side / min(width, height))
    if scale == 1.0:
        return image
    size = (max(min_side, round(width * scale)), max(min_side, round(height * scale)))
    return image.resize(size, Image.Resampling.BICUBIC, reducing_gap=None if scale > 1 else 3.0)


def _check_readable(path: Path) -> None:
    try:
        size = os.stat(path).st_size
        with open(path, "rb"):
            pass
    except PermissionError as error:
        raise MediaError(path, "unreadable", f"permission denied ({error.strerror})") from error
    except OSError as error:
        raise MediaError(path, "unreadable", error.strerror or str(error)) from error
    if size == 0:
        raise MediaError(path, "empty", "zero-byte file")


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB for any PIL mode: 16-bit and float scaled to 8 bits (not clipped), alpha over white."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        values = np.asarray(image, dtype=np.float64)
        peak = 65535.0 if image.mode.startswith("I;16") or values.max() > 255 else 255.0
        gray = np.clip(values * (255.0 / peak), 0, 255).astype(np.uint8)
        return Image.fromarray(gray, "L").convert("RGB")
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")
