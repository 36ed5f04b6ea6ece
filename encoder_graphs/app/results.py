"""The JSONL results file: one line per input file, appended and fsynced batch by batch.

A kill can leave at most one half-written last line; opening the file cuts it off (that file is
then redone), so every line before it stays byte-for-byte as it was.

A path may have several records (an error, then a caption from a later run, or the reverse): the
LATEST record of a path wins. `is_done` is true once a path has any record (with `retry_failed`,
only when its latest record is not an error); `is_failed` is true when its latest record is an
error.

One run at a time per results file: `ResultsFile` holds the exclusive lock of `lock.py` on the
file itself (any name of it) from construction to `close()` (or the end of a `with` block), and
writes through that lock's descriptor. A file that does not begin with a record is not a results
file: it is refused, never cut or appended to.

Every line is valid UTF-8 JSON: a path that is not UTF-8 is written with U+FFFD for its bad bytes,
and `path_bytes` holds it exactly (`names.escaped`); `record_path` gives it back.
"""

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from encoder_graphs.app.errors import OutputError
from encoder_graphs.app.lock import FileLock, HeldElsewhere, LockHolder
from encoder_graphs.app.names import as_text, escaped, is_text, unescaped

RECORD_START = b'{"path": '  # how every record we write begins (the path is its first key)


def path_key(path: str | Path) -> str:
    """The identity of an input file across runs, whatever the working directory."""
    return os.path.realpath(path)


class PathKeys:
    """`path_key` of many paths, each folder resolved once: a results file of a million records
    costs a `lstat` a record (is the name a link?), not one for every step of every path. For
    one pass or one run: a folder link retargeted meanwhile keeps its first target here."""

    def __init__(self) -> None:
        self._folders: dict[str, str] = {}

    def __call__(self, path: str | Path) -> str:
        text = os.fspath(path)
        folder, name = os.path.split(text)
        if name in ("", ".", "..") or os.path.islink(text):
            return os.path.realpath(text)
        real = self._folders.get(folder)
        if real is None:
            real = self._folders[folder] = os.path.realpath(folder)
        return os.path.join(real, name)


def record_path(record: dict) -> str:
    """The exact path of the file a record describes."""
    return unescaped(record["path_bytes"]) if "path_bytes" in record else record["path"]


class ResultsLocked(Exception):
    """Another live `ResultsFile` (this process or another) holds the results file."""

    def __init__(self, path: str | Path, holder: LockHolder) -> None:
        self.path = Path(path)
        self.holder = holder
        super().__init__(f"{self.path} is in use by {holder}; wait for it or use another --out")


class NotResultsFile(Exception):
    """The file exists and is not JSONL records this command wrote (notes, an image...)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        super().__init__(f"{self.path} is not a results file this command wrote (its first line is not a record)")


class ResultsFile:
    """The results of a caption run; take it with `with ResultsFile(out) as results:`.

    Construction creates the parent folder, takes the lock (`ResultsLocked` if another run holds
    it; `OSError` if the file cannot be opened for writing, is not a regular file or is a
    symlink), refuses a file that is not ours (`NotResultsFile`), repairs a half-written last
    line and reads what earlier runs recorded. It creates the folder, `<out>.lock` and an empty
    file, removed again at `close()` while it stays empty.
    """

    def __init__(self, path: str | Path, *, retry_failed: bool = False, lock: bool = True) -> None:
        """`lock=False`: read only (a torchrun rank beside the one that holds the job's lock)."""
        self.path = Path(path)
        self.retry_failed = retry_failed
        self._lock = FileLock(self.path)
        self.lock_path = self._lock.path
        self._keys = PathKeys()  # path identities, each folder resolved once
        self.done: set[str] = set()  # every path with a record
        self.failed: set[str] = set()  # the subset of `done` whose latest record is an error
        # The "settings" of each path's latest caption (`settings.IDENTITY`), as canonical JSON
        # (one string for every record of a run); absent for records written before they had any.
        self.settings: dict[str, str] = {}
        self._seen_settings: dict[str, str] = {}
        self.repaired_bytes = 0
        if lock:
            # Here, not at the first append: a bad --out fails before any model loads or batch runs.
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                self._lock.acquire()
            except HeldElsewhere as error:
                raise ResultsLocked(self.path, error.holder) from None
            except OSError as error:
                message = f"cannot append to the results file {self.path}: {error.strerror}"
                raise OSError(error.errno, message) from error
        try:
            self._read_existing()  # under the lock: the tail we cut cannot be another run's batch
        except BaseException:
            self.close()
            raise

    # -- the lock ---------------------------------------------------------------------------------

    @property
    def lock_note(self) -> str | None:
        """What the lock passed over: another user's lock on the results, a lock file not ours
        (`FileLock.note`)."""
        return self._lock.note

    @property
    def lock_unguarded(self) -> bool:
        """Whether both were passed over: no lock keeps another run of ours out."""
        return self._lock.unguarded

    @property
    def closed(self) -> bool:
        return not self._lock.held

    def close(self) -> None:
        """Let go of the lock (removing the lock file, and the results file if this one created
        it and it is still empty). Idempotent."""
        self._lock.release()

    def __enter__(self) -> "ResultsFile":  # noqa: PYI034 (typing.Self needs 3.11)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:  # a safety net only: the lock is released with the object
        with contextlib.suppress(OSError, AttributeError):  # AttributeError: __init__ failed early
            self.close()

    # -- the records ------------------------------------------------------------------------------

    def _read_existing(self) -> None:
        """Read line by line (a results file of millions of records is never held whole): every
        record marked, the file refused if it is not ours, its last line repaired."""
        if not self.path.exists():
            return
        with open(self.path, "rb") as handle:
            first = handle.readline()
            if first and not _ours(first, more=bool(handle.peek(1))):
                raise NotResultsFile(self.path)
            offset, line = 0, first
            while line:
                following = handle.readline()
                if not following and not line.endswith(b"\n"):
                    self._repair(line, offset)
                    break
                # A damaged line elsewhere is not ours to delete: it is kept and marks nothing done.
                if (record := _parse(line)) is not None:  # in file order: the latest record wins
                    self._mark(record)
                offset, line = offset + len(line), following

    def _repair(self, last: bytes, offset: int) -> None:
        """The unterminated last line: a kill's half line is cut, a whole record that lost only its
        newline (a script rewrote the file) gets it back; only by the lock holder."""
        if self.closed:
            return
        if (record := _parse(last + b"\n")) is not None:
            self._write(b"\n")
            self._mark(record)
            return
        self.repaired_bytes = len(last)
        os.ftruncate(self._lock.fd, offset)
        os.fsync(self._lock.fd)

    def is_done(self, path: str | Path) -> bool:
        """Recorded already, so not to be captioned again (with `retry_failed`: and not an error)."""
        key = self._keys(path)
        return key in self.done and not (self.retry_failed and key in self.failed)

    def is_failed(self, path: str | Path) -> bool:
        """The latest record of `path` is an error."""
        return self._keys(path) in self.failed

    def append(self, records: list[dict]) -> None:
        """Write `records` and make them durable before returning; `OutputError` when they cannot
        be (the file is left as it was)."""
        self._write(b"".join(json.dumps(_json_ready(record)).encode() + b"\n" for record in records))
        for record in records:
            self._mark(record)

    def merge(self, parts: Sequence[Path]) -> int:
        """Append the records of `parts` (torchrun ranks' files) that this file does not hold yet,
        then remove the parts; how many were appended. A merge that a kill cut short is finished by
        the next one: the lines it copied already are found here byte for byte, so no record is
        written twice. Each part's lock is taken first, so a rank still writing it is not robbed."""
        locks = [FileLock(part) for part in parts]
        try:
            for lock, part in zip(locks, parts):
                try:
                    lock.acquire()
                except HeldElsewhere as error:
                    raise ResultsLocked(part, error.holder) from None
            missing = dict.fromkeys(line for part in parts for line in _record_lines(part))  # NotResultsFile
            if missing and self.path.exists():
                with open(self.path, "rb") as handle:
                    for line in handle:
                        missing.pop(line, None)
            self._write(b"".join(missing))
            for line in missing:
                self._mark(_parse(line))
            for part in parts:
                part.unlink()
        finally:
            for lock in locks:
                lock.release()
        return len(missing)

    def _write(self, payload: bytes) -> None:
        """`payload` appended through the lock's descriptor and made durable; `OutputError` when
        it cannot be (disk full, file too large), the file cut back as it was: no half line."""
        if not payload:
            return
        if self.closed:
            raise ValueError(f"{self.path} is closed: its lock is no longer held")
        fd = self._lock.fd
        end = os.lseek(fd, 0, os.SEEK_END)
        remaining = memoryview(payload)
        try:
            while remaining:
                remaining = remaining[os.write(fd, remaining) :]
            os.fsync(fd)
        except OSError as error:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, end)
            raise OutputError(self.path, error) from error

    def _mark(self, record: dict) -> None:
        """Record `record` as the latest of its path: a caption clears an earlier error and vice
        versa; a line about a sidecar that could not be written changes neither."""
        if "sidecar_error" in record:
            return
        key = self._keys(record_path(record))
        self.done.add(key)
        if "error" in record:
            self.failed.add(key)
        else:
            self.failed.discard(key)
            if isinstance(record.get("settings"), dict):
                text = json.dumps(record["settings"], sort_keys=True)
                self.settings[key] = self._seen_settings.setdefault(text, text)
            else:
                self.settings.pop(key, None)

    def made_otherwise(self, paths: Sequence[str | Path], identity: dict) -> dict[str, int]:
        """Of `paths`, how many have a latest caption made with other settings than `identity`,
        by those settings (canonical JSON)."""
        ours = json.dumps(identity, sort_keys=True)
        if set(self._seen_settings) <= {ours}:  # the common case, a resume: no path to resolve
            return {}
        counts: dict[str, int] = {}
        for path in paths:
            theirs = self.settings.get(self._keys(path))
            if theirs is not None and theirs != ours:
                counts[theirs] = counts.get(theirs, 0) + 1
        return counts


def read_records(path: str | Path) -> list[dict]:
    """Every complete, well-formed record in a results file."""
    return list(iter_records(path))


def iter_records(path: str | Path) -> Iterator[dict]:
    """The complete, well-formed records of a results file, one at a time."""
    with open(path, "rb") as handle:
        for line in handle:
            if (record := _parse(line)) is not None:
                yield record


def _record_lines(path: Path) -> list[bytes]:
    """The lines of the complete, well-formed records in a results file, as written;
    `NotResultsFile` for a file that is not one (a part is removed once merged: never another's)."""
    with open(path, "rb") as handle:
        lines = handle.readlines()
    if lines and not _ours(lines[0], more=len(lines) > 1):
        raise NotResultsFile(path)
    return [line for line in lines if _parse(line) is not None]


def _ours(first: bytes, more: bool) -> bool:
    """A results file of ours begins with a record (its `first` line), or (killed in its first
    append: no line `more`) with the start of one."""
    return _parse(first) is not None or (not more and RECORD_START.startswith(first[:9]))


def _json_ready(record: dict) -> dict:
    """`record` as valid UTF-8 JSON holds it: bad bytes of names as U+FFFD (in the path, the
    prompt, an error message), the exact path in `path_bytes` where it differs."""
    ready = _as_text(record)
    if not is_text(record["path"]):
        ready["path_bytes"] = escaped(record["path"])
    return ready


def _as_text(value: object) -> object:
    if isinstance(value, str):
        return as_text(value)
    if isinstance(value, dict):
        return {key: _as_text(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_as_text(item) for item in value]
    return value


def _parse(line: bytes) -> dict | None:
    if not line.endswith(b"\n"):
        return None
    try:
        record = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("path"), str):
        return None
    if not isinstance(record.get("path_bytes", ""), str):
        return None
    return record
