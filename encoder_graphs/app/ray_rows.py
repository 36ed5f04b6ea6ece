"""What a Ray actor of `RayCaptioner` (`app/ray_data.py`) runs: rows captioned by the caption
command's `Captioner`, decoded on loader threads sized by the actor's share of its node's cores.
Imported by the actor only (it pulls in torch and transformers; the driver needs neither)."""

import io
import os
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from encoder_graphs.app.media import LoadLimits, MediaError, decode_image, load_image, upright_size
from encoder_graphs.app.pipeline import Captioner, Pending
from encoder_graphs.app.runstats import RunStats
from encoder_graphs.app.walk import MediaFile


class RowCaptioner(Captioner):
    """A Captioner of a dataset's rows: a row is named by its key, not by a file."""

    def __init__(self, *args: Any, read_paths: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._keys: dict[Path, str] = {}  # a row's stand-in path -> its key
        self.read_paths = read_paths
        self._decoders: ThreadPoolExecutor | None = None

    def caption_rows(self, keys: list[str], images: list[Any]) -> list[dict]:
        """One record per row, in order: its caption, or why it has none. The rows are decoded and
        preprocessed on loader threads, in order, while the GPU captions the rows before them:
        a call of several generate batches (map_batches' `batch_size` a multiple of the
        captioner's) waits only for its first batch's files, as the command's loop does. At most
        two batches are decoded ahead (a preprocessed photo is megabytes of pixels)."""
        if self._decoders is None:
            self._decoders = ThreadPoolExecutor(actor_load_workers(self.config.load_workers),
                                                thread_name_prefix="ray-rows")
        records: list[dict | None] = []
        waiting: list[tuple[int, Pending]] = []
        stats = RunStats()

        def caption_waiting() -> None:
            batch = [pending for _, pending in waiting]
            for (index, _), record in zip(waiting, self.caption_batch(batch, stats), strict=True):
                records[index] = record
            waiting.clear()

        for index, outcome in enumerate(self._prepared(keys, images, 2 * self.config.batch_size)):
            records.append(outcome if isinstance(outcome, dict) else None)
            if isinstance(outcome, Pending):
                waiting.append((index, outcome))
                if len(waiting) == self.config.batch_size:
                    caption_waiting()
        if waiting:
            caption_waiting()
        return records  # type: ignore[return-value] (every None was replaced)

    def _prepared(self, keys: list[str], images: list[Any], ahead: int) -> Iterator["Pending | dict"]:
        """Each row's outcome (`_prepare_row`) in order, at most `ahead` rows decoding or decoded
        beyond the one taken."""
        futures: deque[Future] = deque()
        for index, (key, image) in enumerate(zip(keys, images, strict=True)):
            futures.append(self._decoders.submit(self._prepare_row, index, key, image))
            if len(futures) > ahead:
                yield futures.popleft().result()
        while futures:
            yield futures.popleft().result()

    def _prepare_row(self, index: int, key: str, image: Any) -> "Pending | dict":
        file = MediaFile(Path(f"row-{index}"), "image")  # rows are named by their keys (`_identity`)
        self._keys[file.path] = key
        started = time.perf_counter()
        try:
            picture, size = decode_row_image(image, key, self.limits, self.read_paths)
            item = self.inputs.encode_image(picture)
        except MediaError as error:
            return self._error_record(file, error.kind, str(error))
        except Exception as error:  # noqa: BLE001 (a processor refusing one row costs that row only)
            return self._error_record(file, "preprocess", f"{key}: {type(error).__name__}: {error}")
        return self._pending(file, item, started, size, None, Path(key).stem, "")

    def _identity(self, file: MediaFile) -> dict:
        return {"key": self._keys[file.path], "kind": file.kind}

    def _failure_record(self, file: MediaFile, error: Exception) -> dict:
        record = super()._failure_record(file, error)
        return {**record, "error": record["error"].replace(str(file.path), self._keys[file.path], 1)}


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
