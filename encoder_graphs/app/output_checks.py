"""Whether the files the user names as outputs (`--out`, `--stats-json`) may be written, checked
before any model loads: a regular file or none yet, when it exists in the format this command
writes there, and not a file of the run's inputs or of another output. Files are compared by
identity (device and inode, or the real path of one not made yet), so a symlink or a hard link to
an input or to another output is caught."""

import json
import os
import stat
from collections.abc import Sequence
from pathlib import Path

from encoder_graphs.app.errors import UsageError, file_kind
from encoder_graphs.app.outputs import SidecarPolicy
from encoder_graphs.app.walk import media_kind

STATS_READ_MAX = 64 << 20  # bytes: statistics we wrote are far smaller; a larger file is not ours


def foreign_link(path: Path) -> str | None:
    """Why `path`, a symbolic link another user owns, is not followed as an output (in a shared
    folder it would send the results wherever that user chose), or None. Root's links, and the
    user's own, are followed as before."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISLNK(info.st_mode) or info.st_uid in (os.geteuid(), 0):
        return None
    return f"{path} is a symbolic link owned by another user (uid {info.st_uid}); give the file it names, or another name"


def special_file(path: Path) -> str | None:
    """Why `path` is neither a regular file nor a folder (`unwritable` speaks of folders), or None."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return f"{path} is {file_kind(mode)}, not a regular file"


def not_our_stats(path: Path) -> str | None:
    """Why an existing `--stats-json` (a regular file) is not statistics this command wrote, or None."""
    try:
        size = os.stat(path).st_size
    except OSError:
        return None  # none yet
    if size == 0:
        return None
    try:
        data = json.loads(Path(path).read_bytes()) if size <= STATS_READ_MAX else None
    except (OSError, ValueError):
        data = None
    if isinstance(data, dict) and "pipeline" in data:
        return None
    return f"{path} is not statistics this command wrote"


class Identities:
    """What names a file: (device, inode) when it exists, else its real path (each folder's
    real path worked out once: a run may have a sidecar to check per file)."""

    def __init__(self) -> None:
        self._folders: dict[Path, str] = {}

    def __call__(self, path: Path) -> tuple:
        try:
            info = os.stat(path)
            return (info.st_dev, info.st_ino)
        except OSError:
            pass
        if os.path.islink(path):  # dangling: the file it would create
            return (os.path.realpath(path),)
        if path.parent not in self._folders:
            self._folders[path.parent] = os.path.realpath(path.parent)
        return (os.path.join(self._folders[path.parent], path.name),)


def check_targets(
    named: Sequence[tuple[str, Path]], roots: Sequence[Path], media: Sequence[Path], sidecars: SidecarPolicy
) -> None:
    """UsageError unless each output in `named` ((what writes it, path), the user's flags last)
    is a file of its own: not another output, not an input in `media`, not a file a sidecar
    would be written to, not an image or video the walk of `roots` would caption."""
    identity = Identities()
    owners: dict[tuple, str] = {}
    for flag, path in named:
        key = identity(path)
        # A flag twice is one root given twice (`--hf-metadata` writes its metadata.jsonl once).
        if (owner := owners.get(key)) is not None and not owner.startswith(f"{flag} "):
            raise UsageError(f"cannot use {flag} {path}: the same file as {owner}")
        owners.setdefault(key, f"{flag} {path}")
    folders = [os.path.realpath(root) + os.sep for root in roots if root.is_dir()]
    for flag, path in named:
        if media_kind(path) is not None and any(os.path.realpath(path).startswith(f) for f in folders):
            raise UsageError(f"cannot use {flag} {path}: an image or video file in a folder being captioned")
    for file in media:
        if (owner := owners.get(identity(file))) is not None:
            raise UsageError(f"cannot use {owner}: that is {file}, a file this run captions")
        if sidecars.enabled and (owner := owners.get(identity(sidecars.path(file)))) is not None:
            raise UsageError(f"cannot use {owner}: the sidecar of {file} would be written there")
