"""Dataset inputs of the caption command: WebDataset tar shards, Parquet files and Hugging Face
datasets saved with `save_to_disk`, each read as a stream of samples, never whole (a 10 GB
shard holds one sample's bytes at a time, or one record batch of a Parquet row group).

A shard is the unit of output and of splitting across machines: each input shard gets one output
shard (`app/shard_outputs.py`), named after it. A sample's identity is its key: the WebDataset
sample key (a member's path up to the first dot of its name), the `--key-column` value, or the
shard name and row number. Its media is its first image or video member (by extension) or the
`--image-column` value (bytes, an HF image struct, or a path relative to the Parquet file); a
sample without one, or whose member is not a regular file or too large, is a `Sample` with its
reason, which the caption run records as an error: nothing read is dropped in silence.
"""

import glob
import re
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from encoder_graphs.app.errors import UsageError, printable
from encoder_graphs.app.media import open_regular
from encoder_graphs.app.walk import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS, MediaFile

# A member or cell larger than this is not read (a clip of a video dataset is far smaller).
MAX_SAMPLE_BYTES = 1 << 30
# Members carried into the record as text (a sample's .json, .txt, .cls), when at most this large.
CARRIED_MEMBERS = ("json", "txt", "cls")
MAX_CARRIED_BYTES = 1 << 20
IMAGE_COLUMNS = ("image", "jpg", "jpeg", "png", "webp", "img")  # tried in order without --image-column
VIDEO_COLUMNS = ("video", "mp4", "webm")
KEY_COLUMNS = ("key", "__key__", "id")
ROWS_PER_READ = 64
# The fields of a dataset run's records (`pipeline.Captioner._record`, `shard_outputs`).
RECORD_FIELDS = frozenset({"key", "shard", "kind", "caption", "text", "captions", "texts", "tokens", "truncated",
                           "model", "prompt", "width", "height", "model_width", "model_height", "vision_tokens",
                           "video", "settings", "timings", "status", "error_kind", "error"})


@dataclass(frozen=True)
class InputShard:
    name: str  # the output shard's name: the input's file name without its extension
    path: Path
    format: str  # "webdataset" | "parquet" | "arrow" (one file of a saved HF dataset)


@dataclass(frozen=True)
class Sample(MediaFile):
    """One sample of a shard, as the caption run takes a file: `path` is `<shard>/<key>` (a
    prompt's `{name}` is the key's last part, `{folder}` the shard's name)."""

    key: str = ""
    shard: str = ""
    data: bytes | None = field(default=None, repr=False, compare=False)
    carried: dict = field(default_factory=dict, compare=False)


def is_dataset_input(text: str) -> bool:
    """Whether a PATH argument names dataset shards rather than files or folders to walk."""
    path = Path(text)
    if path.suffix.lower() in (".tar", ".parquet") or (path.name.endswith(".tar.gz")):
        return True
    return path.is_dir() and (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def expand_braces(pattern: str) -> list[str]:
    """WebDataset's shard lists: `{00000..00127}` (zero-padded as written) and `{a,b}`."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    head, tail, body = pattern[: match.start()], pattern[match.end() :], match.group(1)
    if (span := re.fullmatch(r"(\d+)\.\.(\d+)", body)) is not None:
        first, last = span.groups()
        width = len(first) if first.startswith("0") else 0
        parts = [str(n).zfill(width) for n in range(int(first), int(last) + 1)]
    else:
        parts = body.split(",")
    return [expanded for part in parts for expanded in expand_braces(head + part + tail)]


def find_shards(paths: Sequence[str]) -> list[InputShard]:
    """The input shards the PATH arguments name (brace lists and globs expanded), in order; a
    usage error names a path that matches nothing, or two shards that would write one output."""
    shards: list[InputShard] = []
    for text in paths:
        names = [name for part in expand_braces(text) for name in (sorted(glob.glob(part)) if glob.has_magic(part) else [part])]
        if not names:
            raise UsageError(f"{printable(text)}: no shard matches")
        for name in names:
            shards.extend(_shards_at(Path(name)))
    by_name: dict[str, Path] = {}
    for shard in shards:
        if shard.name in by_name and by_name[shard.name] != shard.path:
            raise UsageError(f"{printable(by_name[shard.name])} and {printable(shard.path)} would both write the "
                             f"output shard {printable(shard.name)}: caption them to different --out folders")
        by_name[shard.name] = shard.path
    return list({shard.path: shard for shard in shards}.values())


def _shards_at(path: Path) -> list[InputShard]:
    if path.is_dir():
        return _saved_dataset(path)
    if not path.is_file():
        raise UsageError(f"{printable(path)}: no such shard")
    lowered = path.name.lower()
    if lowered.endswith(".parquet"):
        return [InputShard(path.name[: -len(".parquet")], path, "parquet")]
    if lowered.endswith((".tar", ".tar.gz", ".tgz")):
        return [InputShard(re.sub(r"\.(tar(\.gz)?|tgz)$", "", path.name, flags=re.IGNORECASE), path, "webdataset")]
    raise UsageError(f"{printable(path)}: not a .tar, .parquet or saved dataset")


def _saved_dataset(folder: Path) -> list[InputShard]:
    """The Arrow files of a dataset saved with `datasets`' `save_to_disk`, one shard each."""
    try:
        import datasets
    except ImportError as error:
        raise UsageError(f"{printable(folder)}: reading a saved dataset needs datasets: pip install "
                         "'encoder-graphs[datasets]'") from error
    try:
        loaded = datasets.load_from_disk(str(folder))
    except Exception as error:
        raise UsageError(f"{printable(folder)}: not a dataset saved with save_to_disk ({error})") from error
    if isinstance(loaded, datasets.DatasetDict):
        splits = ", ".join(printable(folder / split) for split in loaded)
        raise UsageError(f"{printable(folder)} holds splits: give one of {splits}")
    return [InputShard(Path(f["filename"]).stem, Path(f["filename"]), "arrow") for f in loaded.cache_files]


def media_of(name: str) -> str | None:
    """"image" or "video" by a member's or file's extension."""
    extension = "." + name.rsplit(".", 1)[-1].lower()
    return "image" if extension in IMAGE_EXTENSIONS else "video" if extension in VIDEO_EXTENSIONS else None


def samples(shard: InputShard, image_column: str | None = None, key_column: str | None = None) -> Iterator[Sample]:
    """The shard's samples, streamed; an OSError, `tarfile.TarError` or pyarrow error where the
    shard itself cannot be read on (the run retries the shard once, then reports it)."""
    if shard.format == "webdataset":
        return _tar_samples(shard)
    return _table_samples(shard, image_column, key_column)


def _tar_samples(shard: InputShard) -> Iterator[Sample]:
    with open_regular(shard.path) as handle, tarfile.open(fileobj=handle, mode="r|*") as tar:
        key, members, refused = None, {}, []
        for member in tar:
            folder, _, base = member.name.rpartition("/")
            stem, _, extension = base.partition(".")
            if not stem or not extension:
                continue  # a folder entry or a name without an extension: no sample's
            this = f"{folder}/{stem}" if folder else stem
            if this != key:
                if key is not None:
                    yield _tar_sample(shard, key, members, refused)
                key, members, refused = this, {}, []
            if not member.isfile():
                refused.append(f"{extension}: {'a link' if member.issym() or member.islnk() else 'not a regular file'}")
            elif member.size > MAX_SAMPLE_BYTES:
                refused.append(f"{extension}: {member.size} bytes, more than a sample may have")
            elif media_of(base) or (extension in CARRIED_MEMBERS and member.size <= MAX_CARRIED_BYTES):
                members[extension] = tar.extractfile(member).read()
        if key is not None:
            yield _tar_sample(shard, key, members, refused)


def _tar_sample(shard: InputShard, key: str, members: dict[str, bytes], refused: list[str]) -> Sample:
    carried = {extension: data.decode("utf-8", "replace") for extension, data in members.items()
               if extension in CARRIED_MEMBERS}
    for extension, data in members.items():
        if (kind := media_of(extension)) is not None:
            return _sample(shard, key, kind, data, carried)
    why = "; ".join(refused) or f"no image or video member (members: {', '.join(sorted(members)) or 'none'})"
    return _sample(shard, key, "other", None, carried, reason=why, error_kind="unreadable")


def _sample(shard: InputShard, key: str, kind: str, data: bytes | None, carried: dict, **why: str) -> Sample:
    return Sample(Path(shard.name) / key, kind, key=key, shard=shard.name, data=data, carried=carried, **why)


def _table(shard: InputShard) -> tuple[Any, Iterator[Any]]:
    """A table shard's schema and its record batches, streamed."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as error:
        raise UsageError(f"{printable(shard.path)}: reading it needs pyarrow: pip install "
                         "'encoder-graphs[datasets]'") from error

    if shard.format == "parquet":
        source = pq.ParquetFile(shard.path)
        return source.schema_arrow, source.iter_batches(batch_size=ROWS_PER_READ)
    reader = pa.ipc.open_stream(pa.memory_map(str(shard.path)))  # an HF dataset's Arrow file
    return reader.schema, reader


def check_columns(shard: InputShard, image_column: str | None, key_column: str | None) -> None:
    """A usage error, before any model loads, where a table shard lacks the columns to read."""
    if shard.format != "webdataset":
        pick_columns(shard, _table(shard)[0].names, image_column, key_column)


def _table_samples(shard: InputShard, image_column: str | None, key_column: str | None) -> Iterator[Sample]:
    schema, batches = _table(shard)
    media, key = pick_columns(shard, schema.names, image_column, key_column)
    row = 0
    for batch in batches:
        for values in batch.to_pylist():
            name = str(values[key]) if key is not None else f"{row:08d}"
            carried = carried_columns(values, media, key)
            yield _cell_sample(shard, name, media, values[media], carried)
            row += 1


def carried_columns(values: dict, media: str, key: str | None) -> dict:
    """A row's other columns for its record: binary ones left out (bytes are no caption's), a
    name the record has already given the prefix `input_` (a re-captioned dataset's `caption`)."""
    carried = {}
    for column, value in values.items():
        if column == media or (column == "key" and key == "key") or isinstance(value, (bytes, bytearray)):
            continue
        carried[f"input_{column}" if column in RECORD_FIELDS else column] = value
    return carried


def pick_columns(shard: InputShard, names: Sequence[str], image: str | None, key: str | None) -> tuple[str, str | None]:
    """The media column and the key column (None: rows are keyed by number) of a table shard."""
    for flag, given in (("--image-column", image), ("--key-column", key)):
        if given is not None and given not in names:
            raise UsageError(f"{printable(shard.path)} has no column {given!r} for {flag} (columns: {', '.join(names)})")
    media = image or next((n for n in (*IMAGE_COLUMNS, *VIDEO_COLUMNS) if n in names), None)
    if media is None:
        raise UsageError(f"{printable(shard.path)}: no image column among {', '.join(names)}: name it with --image-column")
    return media, key or next((n for n in KEY_COLUMNS if n in names), None)


def _cell_sample(shard: InputShard, key: str, column: str, value: Any, carried: dict) -> Sample:
    """A table row's sample: its cell's bytes, or the file its path names (beside the shard)."""
    if isinstance(value, dict):  # an HF Image / Video struct
        value = value.get("bytes") or value.get("path")
    if isinstance(value, str):
        path = shard.path.parent / value
        kind = media_of(value) or "other"
        reason = {} if kind != "other" else {"reason": f"{value}: not an image or video by its extension"}
        return Sample(path, kind, key=key, shard=shard.name, carried=carried, **reason)
    if not isinstance(value, (bytes, bytearray)) or not value:
        why = "no media in the row" if not value else f"the media column holds {type(value).__name__}"
        return _sample(shard, key, "other", None, carried, reason=why, error_kind="missing")
    kind = "video" if column in VIDEO_COLUMNS or sniff_video(value) else "image"
    return _sample(shard, key, kind, bytes(value), carried)


def sniff_video(data: bytes) -> bool:
    """Whether bytes open as a video container (MP4/MOV, Matroska/WebM, AVI) rather than an image."""
    return data[4:8] == b"ftyp" or data[:4] == b"\x1a\x45\xdf\xa3" or (data[:4] == b"RIFF" and data[8:11] == b"AVI")


def shard_selection(shards: Sequence[InputShard], num_shards: int, index: int) -> list[InputShard]:
    """This process's shards: every `num_shards`th of the list from `index` (each shard exactly
    once over the processes, as every process lists the same shards in the same order)."""
    return [shard for position, shard in enumerate(shards) if position % num_shards == index]

