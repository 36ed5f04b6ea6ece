"""What a Ray actor of `RayCaptioner` (`app/ray_data.py`) runs: rows captioned by the caption
command's `Captioner`, decoded on loader threads sized by the actor's share of its node's cores.
Imported by the actor only (it pulls in torch and transformers; the driver needs neither)."""

import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from encoder_graphs.app.media import LoadLimits, MediaError, decode_image, load_image, upright_size
from encoder_graphs.app.pipeline import Captioner
from encoder_graphs.app.walk import MediaFile

# A call's window of rows captioned together, in generate batches, and as many decoding ahead of
# it (a preprocessed photo is megabytes of pixels; map_batches' batch is several generate batches).
PREFETCH_BATCHES = 2


@dataclass(frozen=True)
class Row(MediaFile):
    """A dataset row as the caption run takes a file: `path` is its key (a prompt's `{name}` is
    the stem of the key's last part, `{folder}` empty), `index` its place in the call, `value`
    its image column's value."""

    key: str = ""
    index: int = 0
    value: Any = field(default=None, repr=False, compare=False)

    @property
    def label(self) -> str:
        """The key as the dataset spells it (`path` is the key made a Path: `a//b` is `a/b`)."""
        return self.key


class Records(list):
    """Where `Captioner.run` writes a call's records."""

    def write(self, records: list[dict]) -> None:
        self.extend(records)


class RowCaptioner(Captioner):
    """A Captioner of a dataset's rows: the command's loop (rows decoded on loader threads sized by
    the actor's share of its node's cores, batched by cost, collated beside the GPU), rows named by
    their keys."""

    def __init__(self, *args: Any, read_paths: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.load_workers = actor_load_workers(self.config.load_workers)
        self.read_paths = read_paths

    def windows(self) -> tuple[int, int, int]:
        """The command's windows, but the first a full batch (every map_batches call would start
        with a short one), and later ones of `PREFETCH_BATCHES` batches, as many loading ahead:
        at most twice that held decoded, a window being captioned (with the collated copies of
        the batch running and the next) and the one after it decoding."""
        batch = self.config.largest_batch
        return batch, batch * PREFETCH_BATCHES, batch * PREFETCH_BATCHES

    def caption_rows(self, keys: list[str], images: list[Any]) -> list[dict]:
        """One record per row, in the rows' order: its caption, or why it has none. A call of
        several generate batches (map_batches' `batch_size` a multiple of the captioner's) waits
        only for its first batch's rows; the later batches' rows decode while it is captioned."""
        rows = [Row(Path(key), "image", key=key, index=index, value=image)
                for index, (key, image) in enumerate(zip(keys, images, strict=True))]
        records = Records()
        self.run(rows, records)
        ordered: list[dict] = [{}] * len(rows)
        for record in records:
            ordered[record.pop(ROW)] = record
        return ordered

    def _encoded(self, file: Row) -> tuple:
        picture, size = decode_row_image(file.value, file.key, self.limits, self.read_paths)
        return self.inputs.encode_image(picture), size, None

    def _pending(self, file: Row, item: Any, started: float, size: tuple[int, int], video: dict | None,
                 name: str, folder: str) -> Any:
        return super()._pending(file, item, started, size, video, name, "")  # a row has no folder

    def _identity(self, file: Row) -> dict:
        return {"key": file.key, "kind": file.kind, ROW: file.index}


ROW = "_row"  # a record's place in its call, taken out before the records are returned


def actor_load_workers(default: int) -> int:
    """Loader threads for a Ray actor: its node's cores shared among the node's GPUs in proportion
    to the GPUs it holds (actors a GPU each share the node's cores, not oversubscribe them), at
    most `default` (the command's). Outside an actor, or on an actor without a GPU, `default`."""
    try:
        import ray

        if not ray.is_initialized():
            return default
        context = ray.get_runtime_context()
        held = context.get_assigned_resources().get("GPU", 0)
        node = next(node for node in ray.nodes() if node["NodeID"] == context.get_node_id())
    except Exception:  # noqa: BLE001 (not in an actor, or a Ray that answers otherwise: the default serves)
        return default
    return share_of_cores(node["Resources"].get("CPU", 0), node["Resources"].get("GPU", 0), held, default)


def share_of_cores(cores: float, gpus: float, held: float, default: int) -> int:
    """`cores` shared among `gpus` GPUs, the share of `held` of them; at most `default`, at least 1."""
    if not gpus or not held:
        return default
    return max(1, min(default, int(cores * held / gpus)))


def decode_row_image(value: Any, key: str, limits: LoadLimits, read_paths: bool) -> tuple[Any, tuple[int, int]]:
    """A row's image (bytes, an HF image struct {"bytes": ..., "path": ...}, or with `read_paths`
    a path) decoded within `limits`, and its width and height as seen (its header's, upright)."""
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if value is None:
        raise MediaError(key, "missing", "the row has no image")
    if isinstance(value, (bytes, bytearray, memoryview)):
        if not value:
            raise MediaError(key, "empty", "zero bytes")
        data = bytes(value)
        image = decode_image(io.BytesIO(data), key, limits)
        return image, upright_size(io.BytesIO(data))
    if isinstance(value, (str, os.PathLike)):
        if not read_paths:
            raise MediaError(key, "unreadable", "the image column holds a path: give read_paths=True to read files "
                             "the dataset names")
        return load_image(Path(value), limits), upright_size(Path(value))
    raise MediaError(key, "unreadable", f"the image column holds {type(value).__name__}, not bytes or a path")
