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
import math
import os
import re
import tarfile
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from encoder_graphs.app.errors import UsageError, printable
from encoder_graphs.app.media import MediaError, open_regular
from encoder_graphs.app.walk import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS, MediaFile

if TYPE_CHECKING:
    from encoder_graphs.app.settings import Settings

# A member or cell larger than this is not read (a clip of a video dataset is far smaller).
MAX_SAMPLE_BYTES = 256 << 20
# A Parquet row group is read whole (its columns decompressed): a larger one fails its shard.
MAX_ROW_GROUP_BYTES = 2 << 30


class ShardError(Exception):
    """Why a shard cannot be read on (the run reads it once more, then reports it)."""
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

    @property
    def label(self) -> str:
        """`<shard>/<key>` with the key as the dataset spells it (`path` made it a Path: `./a` is `a`)."""
        return f"{self.shard}/{self.key}"


def is_dataset_input(text: str) -> bool:
    """Whether a PATH argument names dataset shards rather than files or folders to walk."""
    path = Path(text)
    if path.name.lower().endswith((".tar", ".parquet", ".tar.gz", ".tgz")):
        return True
    saved = (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    return path.is_dir() and (saved or (path / "dataset_dict.json").is_file())


def is_dataset_run(settings: "Settings") -> bool:
    """Whether the PATHs name dataset shards (all of them: a usage error for a mix with files)."""
    shards = [is_dataset_input(path) for path in settings.paths]
    if any(shards) and not all(shards):
        raise UsageError("give dataset shards or files and folders, not both in one run")
    return any(shards)


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


def arrow_errors() -> tuple[type[Exception], ...]:
    """pyarrow's read errors, where it is installed (tar shards need none of it)."""
    try:
        import pyarrow as pa
    except ImportError:
        return ()
    return (pa.ArrowException,)


def unreadable() -> tuple[type[Exception], ...]:
    """What reading a shard raises where the shard itself cannot be read on."""
    return (OSError, EOFError, tarfile.TarError, zlib.error, MediaError, ShardError, *arrow_errors())


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
            tar.members = []  # a stream keeps every header otherwise: 10^6 tiny members took GBs
            this, extension = sample_key(member.name)
            base = member.name.rpartition("/")[2]
            if this is None:
                continue  # a folder entry or a name without an extension: no sample's
            if this != key:
                if key is not None:
                    yield _tar_sample(shard, key, members, refused)
                key, members, refused = this, {}, []
            if not member.isfile():
                refused.append(f"{extension}: {'a link' if member.issym() or member.islnk() else 'not a regular file'}")
            elif member.size > MAX_SAMPLE_BYTES:
                refused.append(f"{extension}: {member.size} bytes, more than a sample may have")
            elif media_of(base):
                if not any(map(media_of, members)):  # the first media member is the sample's; others unread
                    members[extension] = tar.extractfile(member).read()
            elif extension in CARRIED_MEMBERS and member.size <= MAX_CARRIED_BYTES:
                members[extension] = tar.extractfile(member).read()
        if key is not None:
            yield _tar_sample(shard, key, members, refused)


def sample_key(name: str) -> tuple[str | None, str]:
    """A tar member's WebDataset sample key (its path up to the first dot of its name) and its
    extension; (None, "") for a name with no extension."""
    folder, _, base = name.rpartition("/")
    stem, _, extension = base.partition(".")
    if not stem or not extension:
        return None, ""
    return (f"{folder}/{stem}" if folder else stem), extension


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
        for index in range(source.metadata.num_row_groups):
            if (size := source.metadata.row_group(index).total_byte_size) > MAX_ROW_GROUP_BYTES:
                raise ShardError(f"row group {index} holds {size} bytes, more than {MAX_ROW_GROUP_BYTES} read at once")
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
    names = carried_names(schema, media, key)
    row = 0
    for batch in batches:
        sizes = cell_sizes(batch.column(media))
        others = batch.select(list(names)).to_pylist()
        for index, values in enumerate(others):
            number = f"{row:08d}"  # a row without a key is named by its number, never "None"
            name = number if key is None or batch.column(key)[index].as_py() is None else str(batch.column(key)[index])
            carried = {names[column]: clean(value) for column, value in values.items()}
            if sizes[index] > MAX_SAMPLE_BYTES:
                why = f"{sizes[index]} bytes of media, more than a sample may have"
                yield _sample(shard, name, "other", None, carried, reason=why, error_kind="too_large")
            else:
                yield _cell_sample(shard, name, media, batch.column(media)[index].as_py(), carried)
            row += 1


def carried_names(schema: Any, media: str, key: str | None) -> dict[str, str]:
    """The columns a row's record carries, by their names there: binary ones (anywhere in their
    type) left out, bytes being no caption's; a name the record has already prefixed `input_`
    until unique (a re-captioned dataset's `caption`)."""
    names: dict[str, str] = {}
    for column in schema:
        if column.name == media or (column.name == "key" and key == "key") or holds_binary(column.type):
            continue
        name = column.name
        while name in RECORD_FIELDS or name in names.values() or (name != column.name and name in schema.names):
            name = f"input_{name}"
        names[column.name] = name
    return names


def holds_binary(kind: Any) -> bool:
    import pyarrow as pa

    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_fixed_size_binary(kind):
        return True
    return any(holds_binary(kind.field(i).type) for i in range(kind.num_fields)) if kind.num_fields else (
        holds_binary(kind.value_type) if hasattr(kind, "value_type") else False)


def cell_sizes(column: Any) -> list[int]:
    """Each row's media bytes (a struct's `bytes` field), counted before any is converted."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_struct(column.type):
        column = column.field("bytes") if column.type.get_field_index("bytes") >= 0 else pa.nulls(len(column))
    if not (pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)):
        return [0] * len(column)
    return [n or 0 for n in pc.binary_length(column).to_pylist()]


def clean(value: Any) -> Any:
    """A carried value as JSON takes it: NaN (no JSON number) as null."""
    return None if isinstance(value, float) and math.isnan(value) else value


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
        why = outside(shard.path.parent, value) or (None if kind != "other" else "not an image or video by its extension")
        reason = {} if why is None else {"reason": f"{value}: {why}", "error_kind": "refused"}
        return Sample(path, kind if why is None else "other", key=key, shard=shard.name, carried=carried, **reason)
    if not isinstance(value, (bytes, bytearray)) or not value:
        why = "no media in the row" if not value else f"the media column holds {type(value).__name__}"
        return _sample(shard, key, "other", None, carried, reason=why, error_kind="missing")
    kind = "video" if column in VIDEO_COLUMNS or sniff_video(value) else "image"
    return _sample(shard, key, kind, bytes(value), carried)


def outside(folder: Path, name: str) -> str | None:
    """Why a path a table names is not read: absolute, or leading (by `..` or a link) out of the
    folder the table is in. A dataset another user made must not read this user's other files;
    checked before the path is opened, so an error says nothing of what exists outside."""
    if Path(name).is_absolute() or ".." in Path(name).parts:
        return "a path out of the dataset's folder: not read"
    base = os.path.realpath(folder)
    if not os.path.realpath(folder / name).startswith(base.rstrip(os.sep) + os.sep):
        return "a link out of the dataset's folder: not read"
    return None


def sniff_video(data: bytes) -> bool:
    """Whether bytes open as a video container (MP4/MOV, Matroska/WebM, AVI) rather than an image."""
    return data[4:8] == b"ftyp" or data[:4] == b"\x1a\x45\xdf\xa3" or (data[:4] == b"RIFF" and data[8:11] == b"AVI")


def shard_selection(shards: Sequence[InputShard], num_shards: int, index: int) -> list[InputShard]:
    """This process's shards: every `num_shards`th of the list from `index` (each shard exactly
    once over the processes, as every process lists the same shards in the same order)."""
    return [shard for position, shard in enumerate(shards) if position % num_shards == index]

