"""`--hf-metadata`: `metadata.jsonl` (file_name, text) in each dataset root, the layout the
`datasets` imagefolder loader reads. The loader makes one example of every row of every
metadata.jsonl under the folder it is given and opens each row's file as an image: so one file per
dataset root (a root folder given that no other holds), rows of existing images only, each name
once, by a name a JSON string can spell."""

import json
import os
from collections.abc import Sequence
from pathlib import Path

from encoder_graphs.app.names import is_text
from encoder_graphs.app.outputs import METADATA_FILE, SidecarPolicy, latest_records, write_atomically
from encoder_graphs.app.results import path_key
from encoder_graphs.app.walk import MediaFile, media_kind


def write_hf_metadata(
    results_path: Path, roots: Sequence[Path], files: Sequence[MediaFile], sidecars: SidecarPolicy
) -> tuple[list[Path], list[Path]]:
    """Write `metadata.jsonl` in every dataset root: a row for every name of every image under it
    that has a caption, from its sidecar (with `--sidecar`), else from its latest record in
    `results_path`, else the row it had already (captioned through another --out). Returns the
    files written, and the names left out because they are not UTF-8."""
    homes = dataset_homes(roots)
    rows = {root: existing_rows(root) for root, _ in homes.values()}
    records = latest_records(results_path)
    left_out = []
    for file in files:
        text = caption_of(file, records, sidecars)
        for name in (file.path, *file.aliases) if text is not None else ():
            placed = place(name, homes)
            if placed is None or media_kind(name) != "image":
                continue
            root, file_name = placed
            if is_text(file_name):
                rows[root][file_name] = text
            else:
                left_out.append(name)
    written = []
    for root, found in rows.items():
        if found:
            lines = "".join(json.dumps({"file_name": name, "text": text}) + "\n" for name, text in sorted(found.items()))
            write_atomically(root / METADATA_FILE, lines)
            written.append(root / METADATA_FILE)
    return written, left_out


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
    """The dataset root of a file's name and its file_name there; None outside every root folder."""
    for folder, (root, inside) in homes.items():
        if name.is_relative_to(folder):
            return root, os.path.normpath(os.path.join(inside, os.path.relpath(name, folder)))
    return None


def existing_rows(root: Path) -> dict[str, str]:
    """The rows of the root's metadata.jsonl whose file is still an image inside the root."""
    rows: dict[str, str] = {}
    try:
        with open(root / METADATA_FILE, "rb") as handle:
            lines = handle.readlines()
    except OSError:  # none yet (or none readable: it is rebuilt from what this run knows)
        return rows
    for line in lines:
        try:
            row = json.loads(line)
            name, text = os.path.normpath(row["file_name"]), row["text"]
        except (ValueError, TypeError, KeyError):
            continue
        inside = not os.path.isabs(name) and name.split(os.sep)[0] != ".."
        valid = isinstance(text, str) and is_text(text) and is_text(name)  # not an old run's surrogates
        if valid and inside and media_kind(Path(name)) == "image" and (root / name).is_file():
            rows[name] = text
    return rows


def caption_of(file: MediaFile, records: dict[str, dict], sidecars: SidecarPolicy) -> str | None:
    """The file's caption as the dataset has it: its sidecar's (with `--sidecar`), else its latest
    record's text; None when it has none."""
    if sidecars.enabled:
        sidecar = sidecars.path(file.path)
        try:
            if sidecar.is_file():  # not a FIFO or a folder: reading those would hang or fail
                return sidecar.read_text(encoding="utf-8").removesuffix("\n")
        except (OSError, UnicodeDecodeError):
            pass  # unreadable: the record's text stands
    return records.get(path_key(file.path), {}).get("text")
