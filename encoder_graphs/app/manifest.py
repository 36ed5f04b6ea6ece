"""`--manifest FILE`: the files to caption as a list (a dataset's index, a selection, another
tool's output) rather than a folder walk: CSV with a header naming the path column, JSON lines,
or plain text of a path a line. Relative paths are from the manifest's folder, which is also
the root the records' `relative_path` and the metadata files are relative to. A listed file that
is missing is its error record, not a failed run: nothing listed is dropped in silence."""

import csv
import io
import json
from pathlib import Path

from encoder_graphs.app.errors import UsageError, printable

PATH_COLUMNS = ("path", "file_name", "filename", "file")  # the first a CSV header or JSON object has
MAX_MANIFEST_BYTES = 4 << 30


def read_manifest(manifest: Path) -> list[Path]:
    """The paths `manifest` lists, absolute, in its order; `UsageError` naming the manifest (and
    the line) where it cannot be read as one."""
    try:
        size = manifest.stat().st_size
        if size > MAX_MANIFEST_BYTES:
            raise UsageError(f"--manifest {printable(manifest)}: {size} bytes, more than a manifest may have")
        text = manifest.read_bytes().decode("utf-8-sig")
    except OSError as error:
        raise UsageError(f"cannot read --manifest {printable(manifest)}: {error.strerror or error}") from error
    except UnicodeDecodeError as error:
        raise UsageError(f"--manifest {printable(manifest)} is not UTF-8 text ({error.reason} at byte "
                         f"{error.start})") from error
    suffix = manifest.suffix.lower()
    names = _csv(manifest, text) if suffix in (".csv", ".tsv") else _jsonl(manifest, text) if suffix in (
        ".jsonl", ".ndjson") else _lines(text)
    folder = manifest.resolve().parent
    return [folder / name for name in names]  # an absolute name stays as it is


def _csv(manifest: Path, text: str) -> list[str]:
    reader = csv.DictReader(io.StringIO(text), dialect="excel-tab" if manifest.suffix.lower() == ".tsv" else "excel")
    column = next((name for name in PATH_COLUMNS if name in (reader.fieldnames or ())), None)
    if column is None:
        raise UsageError(f"--manifest {printable(manifest)}: its header ({', '.join(reader.fieldnames or ['none'])}) "
                         f"names no path column; name one {' or '.join(PATH_COLUMNS)}")
    return [row[column] for row in reader if row.get(column)]


def _jsonl(manifest: Path, text: str) -> list[str]:
    names = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as error:
            raise UsageError(f"--manifest {printable(manifest)}, line {number}: not JSON ({error.msg})") from error
        name = entry if isinstance(entry, str) else next(
            (entry[key] for key in PATH_COLUMNS if isinstance(entry, dict) and isinstance(entry.get(key), str)), None)
        if name is None:
            raise UsageError(f"--manifest {printable(manifest)}, line {number}: no path (a string, or an object "
                             f"with {' or '.join(PATH_COLUMNS)})")
        names.append(name)
    return names


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
