"""Finding images and videos under the given paths: folders walked recursively, links followed
only where safe, each real file once under all its names. Nothing is opened here but folders."""

import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from encoder_graphs.app.results import path_key

# What Pillow reads (AVIF where its build has libavif: else such a file is an error record).
IMAGE_EXTENSIONS = frozenset({
    ".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".webp", ".bmp", ".gif", ".tiff", ".tif", ".avif", ".ppm", ".pgm",
    ".pbm", ".pnm", ".ico",
})
VIDEO_EXTENSIONS = frozenset({".mp4", ".m4v", ".mov", ".webm", ".mkv", ".avi"})  # .mov, .m4v: what phones record
# Decided by the real path (links resolved): whatever is mounted there is the kernel's view of
# processes, devices and drivers, not a dataset (`ds/me -> /proc/self` reaches the whole disk).
PSEUDO_FILESYSTEMS = ("/proc", "/sys", "/dev")
# Names one real folder is walked under (through links): a lattice of links would otherwise name
# each file 2**depth times.
MAX_FOLDER_NAMES = 32


@dataclass(frozen=True)
class MediaFile:
    path: Path
    # "image" | "video" | "folder" (one the walk could not list or would not enter) | "other" (a
    # file named on the command line that is not media): `load` raises for the last two.
    kind: str
    # Set by the walk for an entry it will not read (`load` raises it): why, and the MediaError kind.
    reason: str = field(default="", compare=False)
    error_kind: str = field(default="unreadable", compare=False)
    # The same file's other names under the roots (links), sorted: `discover`'s docstring.
    aliases: tuple[Path, ...] = field(default=(), compare=False)

    @property
    def names(self) -> tuple[Path, ...]:
        """Every name of the file, `path` first."""
        return (self.path, *self.aliases)

    @property
    def label(self) -> str:
        """How an error message names the file."""
        return str(self.path)


def media_kind(path: Path) -> str | None:
    suffix = path.suffix.lower()
    if suffix in IMAGE_EXTENSIONS:
        return "image"
    if suffix in VIDEO_EXTENSIONS:
        return "video"
    return None


def discover(
    paths: list[str | Path], *, include_hidden: bool = False, follow_links: bool = True,
    skipped: Counter | None = None,
) -> list[MediaFile]:
    """Media files under `paths` (files or folders, walked recursively), sorted, each file once.

    Paths are made absolute (symlinks kept): a results file written from one working directory
    resumes from any other. Raises FileNotFoundError for a path that does not exist; files of other
    types are skipped. Hidden files and folders (name starting with ".") are skipped unless
    `include_hidden`; a path given in `paths` is always used, links included.

    Links met in the walk are followed (datasets spread over disks rely on it) unless
    `follow_links` is False, which skips them so the walk stays inside the roots. Never followed:
    a link back to a folder above it on its way (a loop); a link whose target's real path lies in
    /proc, /sys or /dev, nor a folder there (unless the root given is in that one too, e.g.
    /dev/shm/data); a folder's names past MAX_FOLDER_NAMES. The refused ones, and a folder that
    cannot be listed, are not dropped silently: each is an entry with a `reason` (kind "folder",
    or its media kind for a file link), which `load` raises as a `MediaError`.

    A file reached under several names (a file link and its target, folders linked twice, two
    linked roots) is one entry, whose identity is its real path (`results.path_key`). Its `path`
    is the name without links when there is one, else the first name in order; `aliases` holds the
    others (`names`: all of them), so that each name can get its own sidecar and metadata row while
    the file is captioned once.

    `skipped` (given) counts the entries of the walked folders not taken, by reason: "hidden",
    "link (--no-follow-links)", "not media (.txt)". A file named in `paths` that is not media
    is not skipped: it is an entry (kind "other") whose reason `load` raises.
    """
    walk = _Walk(include_hidden, follow_links, skipped if skipped is not None else Counter())
    names: dict[str, set[Path]] = {}  # real path -> names
    refused: dict[Path, MediaFile] = {}
    for root in map(Path, paths):
        if not root.exists() and not root.is_symlink():
            raise FileNotFoundError(f"no such file or directory: {root}")
        absolute = Path(os.path.abspath(root))
        if not root.is_dir() and (refusal := _named_refusal(absolute)) is not None:
            refused[absolute] = MediaFile(absolute, "other", *refusal)
            continue
        found = walk.folder(absolute) if root.is_dir() else [(absolute, path_key(absolute), None)]
        for path, real, refusal in found:
            if refusal is not None:
                refused[path] = MediaFile(path, media_kind(path) or "folder", *refusal)
            elif media_kind(path) is not None:
                names.setdefault(real, set()).add(path)
    files = [_named(real, sorted(same)) for real, same in names.items()] + list(refused.values())
    return sorted(files, key=lambda f: str(f.path))


def _named_refusal(path: Path) -> tuple[str, str] | None:
    """Why a file named on the command line is not read: not an image or video by its extension."""
    if media_kind(path) is not None:
        return None
    extension = path.suffix.lower() or "no extension"
    return f"not an image or video this command reads ({extension})", "unsupported"


def _named(real: str, names: list[Path]) -> MediaFile:
    """The entry of one file: the name that is its real path when there is one."""
    path = next((name for name in names if str(name) == real), names[0])
    return MediaFile(path, media_kind(path) or "image", aliases=tuple(n for n in names if n != path))


class _Walk:
    """The walk of `discover` over any number of roots: how many names each real folder has been
    walked under so far."""

    def __init__(self, include_hidden: bool, follow_links: bool, skipped: Counter) -> None:
        self.include_hidden = include_hidden
        self.follow_links = follow_links
        self.skipped = skipped
        self.folder_names: dict[tuple[int, int], set[Path]] = {}  # (st_dev, st_ino) -> names walked

    def folder(self, root: Path) -> Iterator[tuple[Path, str, tuple[str, str] | None]]:
        """(name, real path, None) for every file under `root`; (name, real path, (why, kind)) for
        every entry not read."""
        home = _pseudo_filesystem(os.path.realpath(root))  # a root given there may be walked
        # Depth first, without recursion (deep trees do not hit the recursion limit). Each entry
        # carries its real path (links resolved only where there is one: a realpath per file would
        # cost a system call per path component) and the folders above it on this name.
        stack: list[tuple[Path, str, tuple[tuple[int, int], ...]]] = [(root, os.path.realpath(root), ())]
        while stack:
            folder, real, above = stack.pop()
            try:
                info = os.stat(folder)
                identity = (info.st_dev, info.st_ino)
                if identity in above:
                    continue  # a link back up: following it would loop
                walked = self.folder_names.setdefault(identity, set())
                if folder not in walked and len(walked) >= MAX_FOLDER_NAMES:
                    if len(walked) == MAX_FOLDER_NAMES:  # reported once, under its first name past the limit
                        walked.add(folder)
                        why = f"this folder is reached under more than {MAX_FOLDER_NAMES} names (links): not walked again"
                        yield folder, real, (why, "unreadable")
                    continue
                walked.add(folder)
                entries = list_folder(folder)
            except OSError as error:
                yield folder, real, (f"cannot list this folder: {os_reason(error)}", "unreadable")
                continue
            subfolders = []
            for name, is_dir, is_link in entries:
                if not self.include_hidden and name.startswith("."):
                    self.skipped["hidden"] += 1
                    continue
                if is_link and not self.follow_links:
                    self.skipped["link (--no-follow-links)"] += 1
                    continue
                path = folder / name
                if not is_dir and media_kind(path) is None:
                    self.skipped[f"not media ({path.suffix.lower() or 'no extension'})"] += 1
                    continue  # never resolved or read
                target = os.path.realpath(path) if is_link else os.path.join(real, name)
                # /proc/self/root resolves to "/": a link is judged by every step it takes too.
                pseudo = _pseudo_filesystem(target) or (_steps_through_pseudo(path) if is_link else None)
                if pseudo is not None and pseudo != home:
                    yield path, target, (f"not followed: it is in {pseudo}, a pseudo-filesystem", "special")
                elif is_dir:
                    subfolders.append((path, target, (*above, identity)))
                else:
                    yield path, target, None
            stack.extend(reversed(subfolders))


def _steps_through_pseudo(path: Path) -> str | None:
    """The pseudo-filesystem that resolving `path` passes through on its way (a link to
    /proc/self/root, or to a link that goes there), or None; resolved a component at a time."""
    from collections import deque

    current, pending, hops = os.sep, deque(Path(os.path.abspath(path)).parts[1:]), 0
    while pending:
        part = pending.popleft()
        if part in ("", "."):
            continue
        if part == "..":
            current = os.path.dirname(current)
            continue
        candidate = os.path.join(current, part)
        if (pseudo := _pseudo_filesystem(candidate)) is not None:
            return pseudo
        if not os.path.islink(candidate):
            current = candidate
            continue
        hops += 1
        if hops > 40:  # a loop: realpath and the walk's own checks deal with it
            return None
        try:
            target = Path(os.readlink(candidate))
        except OSError:
            return None
        if target.is_absolute():
            current = os.sep
        pending.extendleft(reversed(target.parts[1:] if target.is_absolute() else target.parts))
    return None


def _pseudo_filesystem(real: str) -> str | None:
    """The pseudo-filesystem (/proc, /sys or /dev) that the real path `real` lies in, or None."""
    return next((top for top in PSEUDO_FILESYSTEMS if real == top or real.startswith(top + os.sep)), None)


def list_folder(folder: Path) -> list[tuple[str, bool, bool]]:
    """(name, is a folder (links followed), is a link) for each entry, by name. Raises OSError."""
    with os.scandir(folder) as entries:
        listed = []
        for entry in entries:
            try:
                is_dir = entry.is_dir()  # follows symlinks; False for a dangling one
            except OSError:
                is_dir = False
            listed.append((entry.name, is_dir, entry.is_symlink()))
    return sorted(listed)


def os_reason(error: OSError) -> str:
    """An OSError in a few words, as a record gives it."""
    if isinstance(error, PermissionError):
        return "permission denied"
    return error.strerror or str(error)


def folder_reason(path: Path) -> str:
    """Why a folder entry made without a `reason` cannot be listed (now)."""
    try:
        list_folder(path)
    except OSError as error:
        return os_reason(error)
    return "it could not be listed when the files were gathered"
