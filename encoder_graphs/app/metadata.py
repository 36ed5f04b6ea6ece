"""`--hf-metadata`: `metadata.jsonl` (file_name, text; or the root's `metadata.csv`) in each
dataset root, the layout the `datasets` imagefolder loader reads. The loader makes one example of every row of every
metadata.jsonl under the folder it is given and opens each row's file as an image: so one file per
dataset root (a root folder given that no other holds), rows of existing images only, each name
once, by a name a JSON string can spell."""

import csv
import errno
import io
import json
import os
import stat
from collections.abc import Sequence
from pathlib import Path

from encoder_graphs.app.lock import OPEN_FLAGS
from encoder_graphs.app.names import is_text
from encoder_graphs.app.outputs import METADATA_FILE, SidecarPolicy, latest_records, write_atomically
from encoder_graphs.app.results import path_key
from encoder_graphs.app.walk import MediaFile, list_folder, media_kind

# Folder names the `datasets` loader reads as splits, each with its own metadata file.
SPLIT_NAMES = frozenset({"train", "training", "test", "testing", "validation", "valid", "val", "dev", "eval",
                         "evaluation"})
CSV_FILE = "metadata.csv"  # the loader's other format: a root that has one (and no JSON lines) keeps it


def metadata_path(root: Path) -> Path:
    """The root's metadata file: its metadata.csv where it has one and no metadata.jsonl, else
    metadata.jsonl (the loader refuses a folder with two formats: `plan` refuses that first)."""
    csv_path = root / CSV_FILE
    return csv_path if csv_path.is_file() and not os.path.lexists(root / METADATA_FILE) else root / METADATA_FILE


def write_hf_metadata(
    results_path: Path, roots: Sequence[Path], files: Sequence[MediaFile], sidecars: SidecarPolicy
) -> tuple[list[Path], list[Path], dict[Path, int], list[Path]]:
    """Write `metadata.jsonl` in every dataset root: a row for every name of every image under it
    that has a caption, from its sidecar (with `--sidecar`), else from its latest record in
    `results_path`, else the row it had already (captioned through another --out). A row the
    file had keeps its other columns (the user's: scores, tags), its `text` replaced; a root with
    a metadata.csv keeps it (`metadata_path`); the file replaced is kept as `<its name>.bak`
    (which the loader does not read). Returns the
    files written, the names left out because they are not UTF-8, per file written the rows it no
    longer has (their image is gone, or the row could not be read), and the sidecars not read as
    captions (`caption_of`)."""
    homes = dataset_homes(roots)
    found: dict[Path, tuple[dict[str, dict], int]] = {}

    def rows_of(folder: Path) -> dict[str, dict]:
        if folder not in found:
            found[folder] = existing_rows(folder)
        return found[folder][0]

    emptied = set()  # dataset roots whose rows an earlier run wrote there now belong to a split's file
    for root in {root for root, _ in homes.values()}:
        for name in list(rows_of(root)):
            split, inside = split_of(root, name)
            if split != root:
                rows_of(split).setdefault(inside, rows_of(root).pop(name))
                emptied.add(root)
    records = latest_records(results_path)
    left_out: list[Path] = []
    refused: list[Path] = []  # sidecars not read as captions (links, other files, too large)
    for file in files:
        text = caption_of(file, records, sidecars, refused)
        for name in (file.path, *file.aliases) if text is not None else ():
            placed = place(name, homes)
            if placed is None or media_kind(name) != "image":
                continue
            root, file_name = placed
            if is_text(file_name):
                rows_of(root)[file_name] = {**rows_of(root).get(file_name, {}), "text": text}
            else:
                left_out.append(name)
    written, dropped = [], {}
    for root, (kept, _) in found.items():
        target = metadata_path(root)
        if not kept:
            if root in emptied and (previous := _read(target)) is not None:  # its rows moved to the splits'
                write_atomically(target.with_name(target.name + ".bak"), previous)
                os.unlink(target)
            continue
        lines = _as_csv(kept) if target.name == CSV_FILE else "".join(
            json.dumps({"file_name": name, **row}) + "\n" for name, row in sorted(kept.items()))
        previous = _read(target)
        if previous is not None and previous != lines.encode():
            write_atomically(target.with_name(target.name + ".bak"), previous)
        write_atomically(target, lines)
        written.append(target)
        if found[root][1]:
            dropped[target] = found[root][1]
    return written, left_out, dropped, refused


def _as_csv(rows: dict[str, dict]) -> str:
    """Rows as metadata.csv: file_name, the columns in the order first met, text last if new."""
    columns = list(dict.fromkeys(column for row in rows.values() for column in row if column != "text"))
    out = io.StringIO()
    writer = csv.DictWriter(out, ["file_name", *columns, "text"], restval="", lineterminator="\n")
    writer.writeheader()
    writer.writerows({"file_name": name, **row} for name, row in sorted(rows.items()))
    return out.getvalue()


def _read(path: Path) -> bytes | None:
    """A regular file's bytes (None: none there, or not a regular file)."""
    try:
        return path.read_bytes() if path.is_file() else None
    except OSError:
        return None


def dataset_homes(roots: Sequence[Path]) -> dict[Path, tuple[Path, str]]:
    """Each root folder given -> the dataset root holding it (the outermost given folder whose real
    path holds its real path; the first of equals) and its place inside that root."""
    folders = [root for root in roots if root.is_dir()]
    real = {folder: os.path.realpath(folder) for folder in folders}
    homes = {}
    for folder in folders:
        holders = [other for other in folders if Path(real[folder]).is_relative_to(real[other])]
        home = min(holders, key=lambda other: len(real[other]))
        homes[folder] = (home, os.path.relpath(real[folder], real[home]))
    return homes


def place(name: Path, homes: dict[Path, tuple[Path, str]]) -> tuple[Path, str] | None:
    """The folder whose metadata file holds a file's name (its dataset root, or the root's split
    folder it lies in) and its file_name there; None outside every root folder."""
    for folder, (root, inside) in homes.items():
        if name.is_relative_to(folder):
            return split_of(root, os.path.normpath(os.path.join(inside, os.path.relpath(name, folder))))
    return None


def split_of(root: Path, file_name: str) -> tuple[Path, str]:
    """(the split folder, the name inside it) for a name in a split folder of `root` (train/,
    test/, validation/ ...: the loader reads a metadata file per split), else (root, file_name)."""
    first, _, rest = file_name.partition(os.sep)
    if rest and first.lower() in SPLIT_NAMES and (root / first).is_dir():
        return root / first, rest
    return root, file_name


def metadata_folders(roots: Sequence[Path]) -> list[Path]:
    """Every folder whose metadata file a run over `roots` may write: each root folder and its
    split folders."""
    folders = [root for root in roots if root.is_dir()]
    return folders + [root / name for root in folders for name, is_dir, _ in _listing(root)
                      if is_dir and name.lower() in SPLIT_NAMES]


def _listing(folder: Path) -> list:
    try:
        return list_folder(folder)
    except OSError:
        return []


def existing_rows(root: Path) -> tuple[dict[str, dict], int]:
    """The rows of the root's metadata.jsonl whose file is still an image inside the root, by
    file_name, each with its other columns (`text` among them where it has one); and how many
    rows are not kept (their file gone, outside the root, not an image, or the row unreadable)."""
    rows: dict[str, dict] = {}
    path = metadata_path(root)
    previous = _read(path)
    if previous is None:  # none yet (or none readable: it is rebuilt from what this run knows)
        return rows, 0
    dropped = 0
    for line in _rows_of(previous, path.name == CSV_FILE):
        try:
            row = json.loads(line) if isinstance(line, bytes) else {k: v for k, v in line.items() if k is not None}
            name = os.path.normpath(row.pop("file_name"))
        except (ValueError, TypeError, KeyError, AttributeError):
            dropped += 1
            continue
        text = row.get("text")
        inside = not os.path.isabs(name) and name.split(os.sep)[0] != ".."
        valid = (text is None or isinstance(text, str) and is_text(text)) and is_text(name)  # not an old run's surrogates
        if valid and inside and media_kind(Path(name)) == "image" and (root / name).is_file():
            rows[name] = row
        else:
            dropped += 1
    return rows, dropped


def _rows_of(data: bytes, is_csv: bool) -> list:
    """A metadata file's rows: JSON lines (bytes each), or a CSV's rows as dicts."""
    if not is_csv:
        return [line for line in data.splitlines() if line.strip()]
    try:
        return list(csv.DictReader(io.StringIO(data.decode("utf-8-sig"))))
    except (UnicodeDecodeError, csv.Error):
        return []


MAX_SIDECAR_BYTES = 1 << 20  # larger than any caption: such a file is not read as one


def caption_of(
    file: MediaFile, records: dict[str, dict], sidecars: SidecarPolicy, refused: list | None = None
) -> str | None:
    """The file's caption as the dataset has it: its sidecar's (with `--sidecar`), else its latest
    record's text; None when it has none. A sidecar that is a link, not a regular file or larger
    than a caption can be is not read (a link planted in a shared folder would copy what it names,
    a secret, into the metadata file): its path goes to `refused`, and the record's text stands."""
    if sidecars.enabled:
        sidecar = sidecars.path(file.path)
        text = read_sidecar(sidecar)
        if isinstance(text, str):
            return text
        if text is False and refused is not None:
            refused.append(sidecar)
    return records.get(path_key(file.path), {}).get("text")


def read_sidecar(path: Path) -> str | bool | None:
    """The caption in the sidecar at `path`; None where there is none or it cannot be read; False
    where it is not one: a link (symbolic, or hard: a file of more names), not a regular file, or
    larger than `MAX_SIDECAR_BYTES`."""
    try:
        fd = os.open(path, os.O_RDONLY | OPEN_FLAGS)
    except OSError as error:
        return False if error.errno == errno.ELOOP else None  # ELOOP: a symlink (O_NOFOLLOW)
    try:
        info = os.fstat(fd)
        # A hard link's other name may be a file the sidecar's writer could not read themselves.
        if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1 or info.st_size > MAX_SIDECAR_BYTES:
            return False
        return os.read(fd, MAX_SIDECAR_BYTES + 1).decode("utf-8").removesuffix("\n")
    except (OSError, UnicodeDecodeError):
        return None
    finally:
        os.close(fd)
