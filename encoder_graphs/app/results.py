"""The JSONL results file: one line per input file, appended and fsynced batch by batch.

A kill can leave at most one half-written last line; opening the file cuts it off (that file is
then redone), so every line before it stays byte-for-byte as it was.
"""

import json
import os
from pathlib import Path


def path_key(path: str | Path) -> str:
    """The identity of an input file across runs, whatever the working directory."""
    return os.path.realpath(path)


class ResultsFile:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.done: set[str] = set()
        self.failed: set[str] = set()  # the subset of `done` recorded as errors
        self.repaired_bytes = 0
        self._read_existing()
        # Here, not at the first append: a bad --out fails before any model loads or batch runs.
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def _read_existing(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        lines = data.splitlines(keepends=True)
        if lines and _parse(lines[-1]) is None:  # only the last line can be the victim of a kill
            self.repaired_bytes = len(lines.pop())
            with open(self.path, "r+b") as handle:
                handle.truncate(len(data) - self.repaired_bytes)
                os.fsync(handle.fileno())
        # A damaged line elsewhere is not ours to delete: it is kept and marks nothing done.
        for record in filter(None, map(_parse, lines)):
            self._mark(record)

    def is_done(self, path: str | Path) -> bool:
        return path_key(path) in self.done

    def is_failed(self, path: str | Path) -> bool:
        return path_key(path) in self.failed

    def append(self, records: list[dict]) -> None:
        """Write `records` and make them durable before returning."""
        if not records:
            return
        # ASCII escapes keep undecodable file names (surrogates) writable and the file valid UTF-8.
        payload = "".join(json.dumps(record) + "\n" for record in records)
        with open(self.path, "a", encoding="ascii") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        for record in records:
            self._mark(record)

    def _mark(self, record: dict) -> None:
        key = path_key(record["path"])
        self.done.add(key)
        if "error" in record:
            self.failed.add(key)
        else:
            self.failed.discard(key)


def read_records(path: str | Path) -> list[dict]:
    """Every complete, well-formed record in a results file."""
    with open(path, "rb") as handle:
        return [record for line in handle if (record := _parse(line)) is not None]


def _parse(line: bytes) -> dict | None:
    if not line.endswith(b"\n"):
        return None
    try:
        record = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("path"), str):
        return None
    return record
