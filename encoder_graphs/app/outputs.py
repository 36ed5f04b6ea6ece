"""Where captions go: the JSONL results (the run's record, resumable) and caption sidecars beside
the files (`metadata.jsonl`: `metadata.py`). Also the checks that every output can be written,
made before any model loads."""

import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from encoder_graphs.app.media import media_kind
from encoder_graphs.app.results import ResultsFile, path_key, read_records, record_path

METADATA_FILE = "metadata.jsonl"


@dataclass(frozen=True)
class SidecarPolicy:
    """`--sidecar`: `<file without its extension><ext>` beside each captioned file."""

    enabled: bool = False
    ext: str = ".txt"
    overwrite: bool = False

    def __post_init__(self) -> None:
        if not self.ext.startswith(".") or len(self.ext) < 2 or os.sep in self.ext:
            raise ValueError(f"the sidecar extension must look like .txt, got {self.ext!r}")
        if media_kind(Path("x" + self.ext)) is not None:
            raise ValueError(f"the sidecar extension {self.ext} is a media extension: sidecars would replace images")

    def path(self, media: Path) -> Path:
        return media.with_suffix(self.ext)

    def skips(self, media: Path) -> bool:
        """A file whose sidecar exists is done, unless `overwrite`."""
        return self.enabled and not self.overwrite and self.path(media).exists()

    def collisions(self, files: Sequence[Path]) -> list[tuple[Path, Path]]:
        """Pairs of files that would write the same sidecar (a.jpg and a.png)."""
        owner: dict[Path, Path] = {}
        clashes = []
        for file in files:
            first = owner.setdefault(self.path(file), file)
            if first != file:
                clashes.append((first, file))
        return clashes

    def backfill(self, results_path: Path, files: Sequence[Path], text: Callable[[str], str]) -> int:
        """Write the sidecars of files the results already caption (an earlier run without
        `--sidecar`, or one killed between its record and its sidecars), each caption with this
        run's prefix and suffix (`text`); with `overwrite` also those whose sidecar exists. How many."""
        captions = {key: record["caption"] for key, record in latest_records(results_path).items() if "caption" in record}
        written = 0
        for file in files:
            caption = captions.get(path_key(file))
            if caption is not None and (self.overwrite or not self.path(file).exists()):
                write_atomically(self.path(file), text(caption) + "\n")
                written += 1
        return written


def relative_path(path: Path, roots: Sequence[Path]) -> str:
    """`path` relative to the first root folder holding it (its name for a file given directly)."""
    for root in roots:
        if root.is_dir() and str(path).startswith(str(root).rstrip(os.sep) + os.sep):
            return os.path.relpath(path, root)
    return path.name


class Outputs:
    """Writes a batch's records: JSONL first (durable), then the sidecars of its captions."""

    def __init__(
        self, results: ResultsFile, sidecars: SidecarPolicy, on_written: Callable[[int], None] | None = None
    ) -> None:
        self.results = results
        self.sidecars = sidecars
        self.on_written = on_written
        self.sidecars_written = 0

    def write(self, records: list[dict]) -> None:
        self.results.append(records)
        if self.sidecars.enabled:
            for record in records:
                if "text" in record:
                    write_atomically(self.sidecars.path(Path(record["path"])), record["text"] + "\n")
                    self.sidecars_written += 1
        if self.on_written is not None:
            self.on_written(len(records))


def latest_records(results_path: Path) -> dict[str, dict]:
    """The latest record of every path in a results file, by path identity."""
    latest: dict[str, dict] = {}
    if results_path.exists():
        for record in read_records(results_path):
            latest[path_key(record_path(record))] = record
    return latest


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to a temp file beside `path`, then rename: a kill never leaves half a file."""
    handle, temp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        # mkstemp makes 0600 files: take the file's old mode, or what the umask gives a new one.
        os.fchmod(handle, path.stat().st_mode & 0o7777 if path.exists() else 0o666 & ~_umask())
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def unwritable(path: Path, *, folder: bool = False) -> str | None:
    """Why `path` (a file to create or append to, or with `folder` a folder to write into) cannot
    be written, or None. Creates nothing."""
    target = path if folder else path.parent
    probe = target
    while not probe.exists():  # the first existing ancestor decides whether folders can be made
        if probe.parent == probe:
            return f"{target} cannot be created"
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"no permission to write in {probe}"
    if not folder and path.exists() and (path.is_dir() or not os.access(path, os.W_OK)):
        return f"{path} is a folder" if path.is_dir() else f"no permission to write {path}"
    return None
