"""Shards out: a dataset run writes, for each input shard, one output shard `<name>.jsonl` or
`<name>.parquet` in the `--out` folder, and only once every sample of the shard has its record,
so a complete output shard is all that ever shows under that name.

Until then the shard's records are appended, a batch at a time and synced, to its partial file
`.<name>.encoder-graphs-partial.jsonl` beside it: a killed run loses at most the batch under way,
and a rerun skips the shard's finished keys. The partial file is created without following
links, must be the user's own, and is held with an exclusive lock while a process writes it: a
second process given the same shard (an overlapping array task) leaves it alone and says so.
Sealing keeps the last record of each key (a retried failure replaces its error), writes the
output shard to a temporary name and renames it, then removes the partial file. A WebDataset
copy of a shard sealed before is written on a rerun under the same lock (the partial file made
for it and removed after), so two processes never both write it.
"""

import errno
import io
import json
import os
import stat
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

from encoder_graphs.app.datasets import InputShard, unreadable
from encoder_graphs.app.errors import UsageError, printable
from encoder_graphs.app.lock import lock_own_file, unlink_held
from encoder_graphs.app.outputs import remove_unheld, write_atomically
from encoder_graphs.app.webdataset_copy import copy_path, copy_writer

PARTIAL_SUFFIX = ".encoder-graphs-partial.jsonl"
FORMATS = ("jsonl", "parquet")
JSON_COLUMNS = b"encoder_graphs.json_columns"  # a Parquet output shard's metadata: its JSON text columns


def partial_path(folder: Path, name: str) -> Path:
    return folder / f".{name}{PARTIAL_SUFFIX}"


class ShardOutputs:
    """The output shards of one dataset run; `write` takes the caption run's records (each names
    its shard), as the folder run's `Outputs` does."""

    def __init__(self, folder: Path, out_format: str, identity: dict, on_sealed: Callable[[str, int, int], None],
                 webdataset_copy: bool = False, retry_failed: bool = False) -> None:
        self.folder, self.format, self.identity = folder, out_format, identity
        self.webdataset_copy = webdataset_copy  # also each tar shard's copy with the captions (`webdataset_copy`)
        self._shards: dict[str, InputShard] = {}
        prompt = identity.get("prompt")  # named prompts: [[name, text], ...]
        self.names = tuple(name for name, _ in prompt) if isinstance(prompt, list) else ()
        self.named = bool(self.names)
        self.retry_failed = retry_failed  # sealed shards with error records are opened again for those keys
        self._retrying: set[str] = set()  # sealed shards opened again for their errors (read under the lock)
        self.on_sealed = on_sealed  # (shard, records, errors): said as each shard completes
        self._partials: dict[str, int] = {}  # shard -> its partial file's descriptor (locked)
        self._written: Counter = Counter()  # new records a shard has had in this run
        self._expected: dict[str, int] = {}  # samples a shard gave, once its reading ended
        self.failed: dict[str, str] = {}  # shard -> why it could not be read to its end (twice)
        self.duplicates: Counter = Counter()  # shard -> samples whose key an earlier one had (skipped)
        self.skipped: dict[str, str] = {}  # shard -> why this process left it to another
        self.sealed: list[str] = []
        self.progress: Callable[[int], object] | None = None  # told the records of each write

    def final_path(self, name: str) -> Path:
        return self.folder / f"{name}.{self.format}"

    def is_complete(self, shard: InputShard) -> bool:
        """Whether the shard's output exists (checked to be of these settings: else a usage error)."""
        path = self.final_path(shard.name)
        if not os.path.lexists(path):
            return False
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise UsageError(f"--out {printable(path)}: not a regular file where the output shard goes")
        self._check_settings(path, first_settings(path))
        remove_unheld(partial_path(self.folder, shard.name))  # a kill between the seal's rename and unlink
        if self.retry_failed and has_errors(path):
            self._retrying.add(shard.name)  # whole under its name until its new seal replaces it
            return False
        if self.webdataset_copy:
            self._copy_sealed(shard, path)  # asked for after the shard was sealed
        return True

    def _copy_sealed(self, shard: InputShard, final: Path) -> None:
        """The copy of a shard sealed without one, written under the shard's lock: a process
        holding it is left to it (said in `skipped`: a holder run without the flag writes none, and
        a rerun with it does), and a copy written meanwhile is not written again."""
        path, copy = partial_path(self.folder, shard.name), copy_path(self.folder, shard)
        if is_regular(copy):
            return
        if (descriptor := self._locked_partial(path)) is None:
            self.skipped[shard.name] = "its WebDataset copy is left to the process holding the shard"
            print(f"encoder-graphs: shard {shard.name}: {self.skipped[shard.name]}", file=sys.stderr)
            return
        try:
            if not is_regular(copy):
                self._write_copy(shard, sealed_records(final, self.named))
            unlink_held(descriptor, path)  # before the lock goes, as a seal does
        finally:
            os.close(descriptor)

    @staticmethod
    def _locked_partial(path: Path) -> int | None:
        """The shard's partial file `path` locked (`lock.lock_own_file`): its descriptor, or None
        where another process holds it."""
        try:
            return lock_own_file(path)
        except OSError as error:
            if error.errno == errno.ENOLCK:  # said by the caller's error
                raise
            why = "a link" if error.errno == errno.ELOOP else error.strerror
            raise UsageError(f"--out: cannot open {printable(path)} ({why})") from error

    def begin(self, shard: InputShard) -> dict[str, bool] | None:
        """Open the shard's partial file: the keys it holds records of already (True: a caption,
        False: an error), or None where another process holds it."""
        path, final = partial_path(self.folder, shard.name), self.final_path(shard.name)
        descriptor = self._locked_partial(path)
        if descriptor is None:
            self.skipped[shard.name] = "another process is captioning it: left to it"
            return None
        # Retried: read under the lock, still with errors (another process may have retried it meanwhile).
        kept = sealed_records(final, self.named) if shard.name in self._retrying and os.path.lexists(final) else {}
        if os.path.lexists(final) and not any("error" in record for record in kept.values()):
            unlink_held(descriptor, path)  # left by a seal cut short, or made just now
            os.close(descriptor)
            self.skipped[shard.name] = "another process completed it meanwhile"
            return None
        cut_torn_line(descriptor)
        if kept and not os.fstat(descriptor).st_size:  # the sealed records, carried into the new seal
            append_synced(descriptor, b"".join(map(json_line, kept.values())))
        records = list(partial_records(path))
        if records:
            try:
                self._check_settings(path, records[0].get("settings"))
            except UsageError:
                os.close(descriptor)
                raise
        self._partials[shard.name] = descriptor
        self._shards[shard.name] = shard
        return {record["key"]: "error" not in record for record in records}

    def write(self, records: Iterable[dict]) -> None:
        by_shard: dict[str, list[bytes]] = {}
        for record in records:
            record = {**record, "status": "error" if "error" in record else "ok"}
            line = json_line(record)
            by_shard.setdefault(record["shard"], []).append(line)
        for name, lines in by_shard.items():
            append_synced(self._partials[name], b"".join(lines))
            self._written[name] += len(lines)
            if self.progress is not None:
                self.progress(len(lines))
            self._seal_if_done(name)

    def ended(self, name: str, samples: int) -> None:
        """The shard's reading ended: `samples` new ones were handed to the run."""
        self._expected[name] = samples
        self._seal_if_done(name)

    def close(self) -> None:
        for name in list(self._partials):
            self._release(name)

    def _seal_if_done(self, name: str) -> None:
        if name in self._partials and self._expected.get(name) == self._written[name]:
            self._seal(name)

    def _seal(self, name: str) -> None:
        latest = {record["key"]: record for record in partial_records(partial_path(self.folder, name))}
        records = list(latest.values())
        shard = self._shards[name]
        # First: the output shard marks the shard complete. A copy written before is kept current.
        if shard.format == "webdataset" and (self.webdataset_copy or is_regular(copy_path(self.folder, shard))):
            self._write_copy(shard, latest)
        write_atomically(self.final_path(name), encoded(records, self.format))
        unlink_held(self._partials[name], partial_path(self.folder, name))
        self._release(name)
        self.sealed.append(name)
        self.on_sealed(name, len(records), sum("error" in record for record in records))

    def _write_copy(self, shard: InputShard, records: dict[str, dict]) -> None:
        """The shard's WebDataset copy; one that cannot be written (the input gone or cut since) is
        the shard's failure, said at the end, and a rerun writes it again."""
        try:
            write_atomically(copy_path(self.folder, shard), copy_writer(shard, records, self.names))
        except unreadable() as error:
            self.failed[shard.name] = f"its WebDataset copy was not written: {type(error).__name__}: {error}"

    def _release(self, name: str) -> None:
        os.close(self._partials.pop(name))  # closing drops the lock

    def _check_settings(self, path: Path, settings: object) -> None:
        if isinstance(settings, str):
            settings = json.loads(settings)
        if settings is not None and settings != self.identity:
            raise UsageError(f"{printable(path)} holds captions of other settings ({settings}): caption into another "
                             "--out folder, or remove it")


def append_synced(descriptor: int, data: bytes) -> None:
    """`data` appended whole and synced: a kill after this loses none of it."""
    view = memoryview(data)
    while view:
        view = view[os.write(descriptor, view) :]
    os.fsync(descriptor)


def cut_torn_line(descriptor: int) -> None:
    """Drop a last line a kill left without its newline: the next append would join it."""
    size = os.fstat(descriptor).st_size
    block = 1 << 16
    end = size
    while end > 0:
        start = max(0, end - block)
        chunk = os.pread(descriptor, end - start, start)
        if (newline := chunk.rfind(b"\n")) >= 0:
            if start + newline + 1 < size:
                os.ftruncate(descriptor, start + newline + 1)
            return
        end = start
    if size:
        os.ftruncate(descriptor, 0)


def partial_records(path: Path) -> Iterable[dict]:
    """The records of a partial file; a last line a kill cut short is left out (it is redone)."""
    with open(path, "rb") as handle:
        for line in handle:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and "key" in record:
                yield record


def sealed_records(path: Path, named: bool) -> dict[str, dict]:
    """An output shard's records by key, as they were written: Parquet's JSON text columns
    (`encoded`) read back, so that sealing them again encodes each value once, as at first."""
    if path.suffix != ".parquet":
        return {record["key"]: record for record in partial_records(path)}
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    texts = json_columns(table.schema.metadata or {}, named)
    records = {}
    for row in table.to_pylist():
        record = {name: value for name, value in row.items() if value is not None}
        for name in texts:
            if isinstance(record.get(name), str):
                record[name] = json.loads(record[name])
        records[record["key"]] = record
    return records


def json_columns(metadata: dict, named: bool) -> list[str]:
    """The columns of a Parquet output shard stored as JSON text, as its schema's metadata names
    them; a shard sealed before it named them holds so only the mappings (with named prompts also
    each one's tokens, truncation, prompt)."""
    if JSON_COLUMNS in metadata:
        return json.loads(metadata[JSON_COLUMNS])
    return ["captions", "texts", "settings", "timings", "video", *(("tokens", "truncated", "prompt") if named else ())]


def is_regular(path: Path) -> bool:
    """A regular file at `path` (not a link to one): what a copy written before is."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def has_errors(path: Path) -> bool:
    """Whether an output shard holds error records (reading its error column, or its lines, only)."""
    if path.suffix != ".parquet":
        return any("error" in record for record in partial_records(path))
    import pyarrow.parquet as pq

    errors = pq.read_table(path, columns=["error"]).column(0)
    return errors.null_count < len(errors)


def first_settings(path: Path) -> object:
    """The settings an output shard was written with (its first record's)."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        source = pq.ParquetFile(path)
        if "settings" not in source.schema_arrow.names or source.metadata.num_rows == 0:
            return None
        return source.read_row_group(0, columns=["settings"]).column(0)[0].as_py()
    with open(path, "rb") as handle:
        first = handle.readline()
    return json.loads(first).get("settings") if first.strip() else None


def parquet_types() -> dict:
    import pyarrow as pa

    text, number = pa.string(), pa.int64()
    return {"key": text, "shard": text, "kind": text, "status": text, "caption": text, "text": text, "captions": text,
            "texts": text, "tokens": number, "truncated": pa.bool_(), "model": text, "prompt": text, "width": number,
            "height": number, "model_width": number, "model_height": number, "vision_tokens": number,
            "video": text, "settings": text, "timings": text, "error_kind": text, "error": text}


def json_line(record: dict) -> bytes:
    return json.dumps(record, ensure_ascii=False, default=str).encode("utf-8") + b"\n"


def encoded(records: list[dict], out_format: str) -> bytes:
    if out_format == "jsonl":
        return b"".join(map(json_line, records))
    import pyarrow as pa
    import pyarrow.parquet as pq

    types = parquet_types()
    # The record's own fields always, in one type whatever a shard holds (a shard of no errors
    # has an all-null error column: typed so, every shard loads as one dataset); a mapping (named
    # prompts' captions, the settings, timings), or a carried column of mixed kinds, as JSON text:
    # the schema's metadata names those columns, read back by a retry (`sealed_records`).
    names = list(dict.fromkeys([*types, *(name for record in records for name in record)]))
    columns, texts = {}, []
    for name in names:
        values = [record.get(name) for record in records]
        if any(isinstance(v, (dict, list)) for v in values) and name in types:
            columns[name] = pa.array(json_texts(values, sort_keys=True), pa.string())
            texts.append(name)
            continue
        try:
            columns[name] = pa.array(values, types.get(name) or (pa.string() if all(
                v is None for v in values) else None))
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):  # mixed kinds of values
            columns[name] = pa.array(json_texts(values), pa.string())
            texts.append(name)
    table = pa.table(columns).replace_schema_metadata({JSON_COLUMNS: json.dumps(texts)})
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def json_texts(values: list, **how: bool) -> list[str | None]:
    """Each value as JSON text (None stays null)."""
    return [json.dumps(v, default=str, **how) if v is not None else None for v in values]


def say_sealed(name: str, records: int, errors: int, folder: Path, out_format: str) -> None:
    from tqdm import tqdm

    failed = f", {errors} of them errors" if errors else ""
    # Above the progress bar, where one is drawn.
    tqdm.write(f"encoder-graphs: shard {name}: {records} records{failed} -> "
               f"{printable(folder / f'{name}.{out_format}')}", file=sys.stderr)
