"""Where captions go: the JSONL results (the run's record, resumable) and caption sidecars beside
the files (`metadata.jsonl`: `metadata.py`). Files are written whole through a temporary renamed
into place, never through a symlink; a sidecar that cannot be written is a `sidecar_error` line
after its file's caption, which stands. Also the checks that every output can be written, made
before any model loads."""

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import stat
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from encoder_graphs.app.lock import OPEN_FLAGS, unlink_held
from encoder_graphs.app.names import as_text
from encoder_graphs.app.results import PathKeys, ResultsFile, iter_records, record_path
from encoder_graphs.app.walk import media_kind

METADATA_FILE = "metadata.jsonl"
NAME_MAX = 255  # bytes in a file name (ext4, xfs, btrfs, tmpfs, NFS)
TEMP_TAIL = re.compile(r"[a-z0-9_]{8}")  # the random part of tempfile.mkstemp's names


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
        """A file whose sidecar exists (a file: not a folder of that name) is done, unless `overwrite`."""
        return self.enabled and not self.overwrite and os.path.isfile(self.path(media))

    def write(self, media: Path, text: str) -> bool:
        """The sidecar of `media`; without `overwrite` one that exists already (another run's)
        is kept: False then. OSError when it cannot be written."""
        return write_atomically(self.path(media), text + "\n", replace=self.overwrite)

    def collisions(self, files: Sequence[Path]) -> list[tuple[Path, Path]]:
        """Pairs of files that would write the same sidecar (a.jpg and a.png)."""
        owner: dict[Path, Path] = {}
        clashes = []
        for file in files:
            first = owner.setdefault(self.path(file), file)
            if first != file:
                clashes.append((first, file))
        return clashes

    def backfill(
        self, results_path: Path, files: Sequence[Path], text: Callable[[str], str]
    ) -> tuple[int, list[dict]]:
        """Write the sidecars of files the results already caption (an earlier run without
        `--sidecar`, or one killed between its record and its sidecars), each caption with this
        run's prefix and suffix (`text`); with `overwrite` also those whose sidecar exists. How
        many, and the error records of those that could not be written."""
        lacking = [file for file in files if self.overwrite or not os.path.isfile(self.path(file))]
        key_of = PathKeys()
        keys = {file: key_of(file) for file in lacking}
        latest = latest_records(results_path, set(keys.values()))
        written, errors = 0, []
        for file in lacking:
            record = latest.get(keys[file])
            if record is None or "caption" not in record:
                continue
            try:
                written += self.write(file, text(record["caption"]))
            except OSError as error:
                errors.append(sidecar_error(record, error))
        return written, errors


def sidecar_error(record: dict, error: OSError) -> dict:
    """The line saying that the sidecar of `record`'s file could not be written, appended after
    its caption: a `sidecar_error`, not an error record, so the caption stands (the file is
    captioned, `ResultsFile` and `latest_records` pass over this line); the sidecar is written by
    the next run with --sidecar (`backfill`), and until it is, the run's exit status says so."""
    identity = {key: record[key] for key in ("path", "path_bytes", "relative_path", "kind", "model") if key in record}
    return {**identity, "sidecar_error": f"cannot write the sidecar {error.filename}: {error.strerror}"}


def relative_path(path: Path, roots: Sequence[Path]) -> str:
    """`path` relative to the first root folder holding it (its name for a file given directly)."""
    for root in roots:
        if root.is_dir() and str(path).startswith(str(root).rstrip(os.sep) + os.sep):
            return os.path.relpath(path, root)
    return path.name


class Outputs:
    """Writes a batch's records: JSONL first (durable), then the sidecars of its captions, one for
    each name of the file: its record's path and its `aliases` (`MediaFile.aliases`, keyed by
    that path)."""

    def __init__(
        self,
        results: ResultsFile,
        sidecars: SidecarPolicy,
        on_written: Callable[[int], None] | None = None,
        aliases: Mapping[str, Sequence[Path]] | None = None,
    ) -> None:
        self.results = results
        self.sidecars = sidecars
        self.on_written = on_written
        self.aliases = aliases or {}
        self.sidecars_written = 0
        self.sidecar_errors: list[str] = []  # the error of each sidecar that could not be written

    def write(self, records: list[dict]) -> None:
        """`OutputError` when the results cannot be written; a sidecar that cannot be is its
        file's error record."""
        self.results.append(records)
        if self.sidecars.enabled:
            errors = []
            for record in records:
                if "text" in record:
                    for name in (Path(record["path"]), *self.aliases.get(record["path"], ())):
                        try:
                            self.sidecars_written += self.sidecars.write(name, record["text"])
                        except OSError as error:
                            errors.append(sidecar_error(record, error))
            self.results.append(errors)
            self.sidecar_errors += [error["sidecar_error"] for error in errors]
        if self.on_written is not None:
            self.on_written(len(records))


def carry_moved(results: ResultsFile, files: Sequence[Path], roots: Sequence[Path], identity: dict) -> int:
    """A moved dataset resumes: each of `files` without a record whose path relative to its root
    and `fingerprint` are those of the latest caption (or error) of a path not among `files` (the
    same file where the dataset was), made with this run's settings (`identity`), gets a copy of
    that record under its own path (`moved_from` the old), so it is not captioned again. How
    many; only files whose relative path matches are read."""
    key_of = PathKeys()
    keys = {file: key_of(file) for file in files}
    missing = [file for file, key in keys.items() if key not in results.done]
    if not missing or not results.done - set(keys.values()):  # nothing to do, or no record of elsewhere
        return 0
    from encoder_graphs.app.media import fingerprint  # PIL: only where a dataset may have moved
    ours = set(keys.values())
    elsewhere: dict[str, list[dict]] = defaultdict(list)
    for key, record in latest_records(results.path).items():
        if (key not in ours and "fingerprint" in record and isinstance(record.get("relative_path"), str)
                and record.get("settings", identity) == identity):
            elsewhere[record["relative_path"]].append(record)
    carried = []
    for file in missing:
        candidates = elsewhere.get(as_text(relative_path(file, roots)))
        mark = fingerprint(file) if candidates else None
        for record in candidates or ():
            if record["fingerprint"] == mark:
                moved = {key: value for key, value in record.items() if key not in ("path_bytes", "moved_from")}
                carried.append({**moved, "path": str(file), "moved_from": record["path"]})
                break
    results.append(carried)
    return len(carried)


def latest_records(results_path: Path, wanted: "set[str] | None" = None) -> dict[str, dict]:
    """The latest record of every path in a results file, by path identity (`wanted`: of those
    paths only, so a run over millions of records holds the few it needs). A sidecar that could
    not be written leaves the caption before it standing: its line is not counted here (nor an
    earlier version's error record for it)."""
    latest: dict[str, dict] = {}
    keys = PathKeys()
    if results_path.exists() and wanted != set():
        for record in iter_records(results_path):
            if is_sidecar_line(record):
                continue
            key = keys(record_path(record))
            if wanted is None or key in wanted:
                latest[key] = record
    return latest


def is_sidecar_line(record: dict) -> bool:
    """A line about a sidecar that could not be written (`sidecar_error`; before, an error record
    of kind "sidecar"), not a file's outcome."""
    return "sidecar_error" in record or record.get("error_kind") == "sidecar"


def write_atomically(path: Path, text: "str | bytes | Callable[[BinaryIO], None]", *, replace: bool = True) -> bool:
    """Write `text` (or what the callable writes to the file it is given: a stream too large to
    hold) to a temporary beside `path`, then rename it to `path`: a kill never leaves half a
    file, and a symlink (or another name of a file) at `path` is replaced, never written through.
    `replace=False` keeps whatever regular file is at `path` already: False then. An OSError
    names `path` (its `filename`)."""
    try:
        fd, temp = tempfile.mkstemp(prefix=temp_prefix(path.name), dir=path.parent)
    except OSError as error:
        raise OSError(error.errno, error.strerror, str(path)) from error
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held while it exists: a run tidying up leaves it alone
        try:
            info = os.lstat(path)
            mode = info.st_mode & 0o7777 if stat.S_ISREG(info.st_mode) else 0o666 & ~_umask()
        except FileNotFoundError:  # mkstemp makes 0600 files: a new one gets what the umask gives
            mode = 0o666 & ~_umask()
        os.fchmod(fd, mode)
        if callable(text):
            with os.fdopen(os.dup(fd), "wb") as sink:
                text(sink)
        else:
            data = memoryview(text if isinstance(text, bytes) else text.encode("utf-8"))
            while data:
                data = data[os.write(fd, data) :]
        os.fsync(fd)  # the data reaches the disk before the name does: a crash leaves the old file or the new
        if not replace:
            return _link_new(temp, path)
        os.replace(temp, path)
        return True
    except OSError as error:
        raise OSError(error.errno, error.strerror, str(path)) from error
    finally:
        with contextlib.suppress(OSError):
            os.unlink(temp)  # gone already once renamed
        os.close(fd)


def _link_new(temp: str, path: Path) -> bool:
    """`temp` also named `path` unless `path` exists (False then): two runs never replace each
    other's file. EEXIST when what is there is not a regular file."""
    try:
        os.link(temp, path)  # fails on any existing name, a dangling symlink included
        return True
    except FileExistsError:
        pass
    except OSError as error:
        if error.errno not in (errno.EPERM, errno.EOPNOTSUPP):
            raise
        if not os.path.lexists(path):  # a filesystem without hard links (FAT): look, then rename
            os.replace(temp, path)
            return True
    if not os.path.isfile(path):
        raise OSError(errno.EEXIST, "it exists and is not a file")
    return False


TEMP_MARK = "encoder-graphs-tmp-"  # in every temporary's name: what a user's own file is not named


def temp_prefix(name: str) -> str:
    """How the temporaries beside `name` begin: `.<name>.encoder-graphs-tmp-`, or a digest of the
    name where that and mkstemp's 8 random characters would not fit in NAME_MAX."""
    prefix = f".{name}.{TEMP_MARK}"
    if len(os.fsencode(prefix)) + 8 <= NAME_MAX:
        return prefix
    return f".{hashlib.sha256(os.fsencode(name)).hexdigest()[:32]}.{TEMP_MARK}"


def remove_stale_temporaries(targets: Iterable[Path]) -> int:
    """Remove the temporaries that killed runs left beside `targets` (the files this run may
    write): only names of exactly the form `temp_prefix(target's name)` + 8 random characters,
    regular files of this user that no live writer holds (a writer holds its temporary's flock).
    How many."""
    prefixes: dict[Path, set[str]] = defaultdict(set)
    for target in targets:
        prefixes[target.parent].add(temp_prefix(target.name))
    removed = 0
    for folder, wanted in prefixes.items():
        try:
            names = os.listdir(folder)
        except OSError:
            continue  # a folder that cannot be listed gets no sidecar either
        for name in names:
            if name[:-8] in wanted and TEMP_TAIL.fullmatch(name[-8:]) and remove_unheld(folder / name):
                removed += 1
    return removed


def remove_unheld(path: Path) -> bool:
    """Remove `path` where it is this user's regular file that no process holds (a writer holds
    its file's flock), and still the file locked (not swapped by another's tidying meanwhile)."""
    try:
        fd = os.open(path, os.O_RDONLY | OPEN_FLAGS)
    except OSError:  # a symlink, or gone
        return False
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():  # another user's is not ours
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return unlink_held(fd, path)
    except OSError:  # held: a live run is writing it
        return False
    finally:
        os.close(fd)


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
