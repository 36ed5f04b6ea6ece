"""One file made ready for a batch: decoded, preprocessed into uint8 patches or tiles and its
prompt filled in, or its error record. Runs in the loader processes (`app.loader`), so a
`Preparer` holds only what pickles: the inputs builder, the limits and the settings."""

import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from encoder_graphs.app.config import CaptionConfig
from encoder_graphs.app.media import LoadLimits, MediaError, MediaFile, load
from encoder_graphs.app.outputs import relative_path
from encoder_graphs.protocols import CaptionInputs, EncodedMedia

ORIENTATION_TAG = 0x0112  # EXIF; values 5-8 turn the image by 90 degrees


@dataclass
class Pending:
    file: MediaFile
    item: EncodedMedia
    load_ms: float
    prompt: str
    size: tuple[int, int]  # the image's (a video frame's) width and height in pixels


@dataclass(frozen=True)
class Preparer:
    inputs: CaptionInputs
    limits: LoadLimits
    config: CaptionConfig
    roots: tuple[Path, ...] = ()
    model_name: str = "default"

    def __call__(self, file: MediaFile) -> Pending | dict:
        """Load and encode one file; a failure becomes its error record."""
        started = time.perf_counter()
        try:
            media = load(file, self.limits)
            if file.kind == "image":
                item = self.inputs.encode_image(media)
                size = original_size(file.path)
            else:
                item = self.inputs.encode_video(media)
                size = media.size
        except MediaError as error:
            return self.error_record(file, error.kind, str(error))
        # A processor rejecting one input (or a decoder failing in a way `load` does not foresee)
        # must not stop the run: an exception escaping here would end it from `future.result()`.
        except Exception as error:  # noqa: BLE001
            return self.error_record(file, "preprocess", f"{file.path}: {type(error).__name__}: {error}")
        prompt = self.config.prompt_for(file.path.stem, file.path.parent.name, *size)
        return Pending(file, item, 1000.0 * (time.perf_counter() - started), prompt, size)

    def identity(self, file: MediaFile) -> dict:
        return {"path": str(file.path), "relative_path": relative_path(file.path, self.roots), "kind": file.kind}

    def error_record(self, file: MediaFile, kind: str, message: str) -> dict:
        return {**self.identity(file), "model": self.model_name, "error_kind": kind, "error": message}


def original_size(path: Path) -> tuple[int, int]:
    """An image's width and height as seen (EXIF rotation applied), from its header only."""
    with warnings.catch_warnings():  # `load` has already judged the size
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with Image.open(path) as image:
            width, height = image.size
            rotated = image.getexif().get(ORIENTATION_TAG) in (5, 6, 7, 8)
    return (height, width) if rotated else (width, height)
