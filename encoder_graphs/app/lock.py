"""An exclusive lock on `<file>.lock` beside the file it guards, for one process at a time.

`flock` on the lock file, which names the holder (pid and host). The kernel drops the lock when
the holder dies, so a lock file left by a killed process is taken over, not obeyed; the holder
unlinks the file before it lets go, and a taker checks it locked the file still at the path.
"""

import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LockHolder:
    """Who holds a lock, as its lock file says (None where it could not be read)."""

    pid: int | None
    host: str | None

    def __str__(self) -> str:
        if self.pid is None:
            return "another process"
        return f"process {self.pid} on {self.host or 'an unknown host'}"


class HeldElsewhere(Exception):
    """The lock is held by another process, or by another FileLock of this one."""

    def __init__(self, holder: LockHolder) -> None:
        self.holder = holder
        super().__init__(f"held by {holder}")


class FileLock:
    """`acquire()` once, `release()` when done (also when the process dies, by the kernel)."""

    def __init__(self, guarded: str | Path) -> None:
        self.path = Path(os.path.realpath(guarded) + ".lock")
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock; HeldElsewhere (naming the holder) when another holds it."""
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as error:
                raise OSError(error.errno, f"cannot create the lock file {self.path}: {error.strerror}") from error
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise HeldElsewhere(holder) from None
            except BaseException:
                os.close(fd)
                raise
            # The holder before us unlinks the lock file before it lets go: if we locked that
            # unlinked file, the lock file at the path is another one (or none): try again on it.
            if _same_file(fd, self.path):
                break
            os.close(fd)
        try:  # a stale pid left by a killed run is overwritten
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps({"pid": os.getpid(), "host": socket.gethostname()}) + "\n").encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        """Let go of the lock (and remove the lock file while it is still ours). Idempotent."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if _same_file(fd, self.path):  # unlink before unlocking: see `acquire`
                os.unlink(self.path)
        except OSError:
            pass  # a lock file we cannot remove is harmless: the next run takes it over
        finally:
            os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _read_holder(fd: int) -> LockHolder:
    # The holder writes its pid just after locking: give it a moment if the file is still empty.
    for _ in range(20):
        try:
            data = os.pread(fd, 4096, 0)
        except OSError:
            break
        if data.endswith(b"\n"):
            try:
                info = json.loads(data)
                return LockHolder(int(info["pid"]), str(info["host"]))
            except (ValueError, KeyError, TypeError):
                break
        time.sleep(0.005)
    return LockHolder(None, None)
