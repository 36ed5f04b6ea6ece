"""An exclusive lock on a file by its identity, for one process at a time.

`flock` on the guarded file itself (created empty when missing), so every name of it, a hard link
or a symlink, meets the same lock; the kernel drops it when the holder dies, so a killed holder
is taken over, not obeyed. `<file>.lock` beside it names the holder (pid and host) for the
message of a run that finds the file taken: only the holder writes it, never through a symlink
or into a file with other names. A guarded file the holder created and left empty is removed
before it lets go, so a taker checks that the file it locked is still the one at the path.

Any user who can read a file can hold a `flock` on it: a lock that `/proc/locks` shows held only by
other users' processes, none of whom can write the file (not its owner, not root; no group or
other write bit, no ACL), keeps no run out: it is reported and passed over. Our own runs then meet
on the holder's file, which only its owner can open (mode 0600), and which each holder also locks.
Where the holders cannot be told (another machine's, a /proc mounted with hidepid), the lock holds.
"""

import errno
import fcntl
import json
import os
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path

# No symlink at the last step (the lock and the writes meet one inode); no wait on a FIFO.
OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


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
    """`acquire()` once, `release()` when done (also when the process dies, by the kernel).
    While held, `fd` is the guarded file open for reading and writing."""

    def __init__(self, guarded: str | Path) -> None:
        self.guarded = Path(guarded)
        self.path = Path(os.path.realpath(self.guarded.parent)) / f"{self.guarded.name}.lock"  # the holder's name
        self.fd: int | None = None
        self._holder_fd: int | None = None
        # Why the holder's name could not be written (its lock file is a link, a folder, a FIFO or
        # another user's: left alone); the lock holds all the same, only a taker cannot name us.
        self.note: str | None = None
        self._created = False
        self.unguarded = False

    @property
    def held(self) -> bool:
        return self.fd is not None

    def acquire(self) -> None:
        """Take the lock; HeldElsewhere (naming the holder) when another run holds it, OSError when
        the guarded file cannot be opened for writing or is not a regular file. A lock file that is
        not one we wrote is left alone (`note` says so), and so is another user's lock on the
        guarded file (`note` names the process)."""
        notes = []
        while True:
            fd, self._created = _open_regular(self.guarded)
            try:
                foreign = _lock_unless_foreign(fd, self.path)
            except BaseException:
                os.close(fd)
                raise
            # A holder before us removes an empty file it created before it lets go: if we locked
            # that unlinked file, the file at the path is another one (or none): try again on it.
            if same_file(fd, self.guarded):
                break
            os.close(fd)
        self.fd = fd
        if foreign:
            notes.append(f"{self.guarded} is locked by {foreign}, another user's: passed over")
        try:
            self._holder_fd, odd = _write_holder(self.path)
        except BaseException:
            self.release()
            raise
        notes += [odd] if odd else []
        self.note = "; ".join(notes) or None
        self.unguarded = bool(foreign and odd)  # neither lock is ours: another run of ours is not kept out

    def release(self) -> None:
        """Let go of the lock (removing the lock file, and the guarded file if we created it and
        it is still empty). Idempotent."""
        fd, holder_fd, self.fd, self._holder_fd = self.fd, self._holder_fd, None, None
        if fd is None:
            return
        try:  # unlink before unlocking: see `acquire`
            if holder_fd is not None:
                unlink_held(holder_fd, self.path)
            if self._created and os.fstat(fd).st_size == 0:
                unlink_held(fd, self.guarded)
        except OSError:
            pass  # a lock file we cannot remove is harmless: the next holder rewrites it
        finally:
            if holder_fd is not None:
                os.close(holder_fd)
            os.close(fd)


def _open_regular(path: Path) -> tuple[int, bool]:
    """`path` opened for reading and writing, created when missing (and whether we created it);
    OSError for a symlink or anything but a regular file."""
    while True:
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | OPEN_FLAGS, 0o666), True
        except FileExistsError:
            pass
        try:
            fd = os.open(path, os.O_RDWR | OPEN_FLAGS)
            break
        except FileNotFoundError:
            continue  # removed since: create it
        except OSError as error:
            raise _no_symlink(error, path) from error
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{path} is not a regular file")
    return fd, False


# Opening a lock file fails so where it is a link, a folder or another user's file.
ODD_LOCK_FILE = frozenset({errno.ELOOP, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENXIO})


def _lock_unless_foreign(fd: int, holder_path: Path) -> str | None:
    """`flock` `fd`'s file: None once locked; where other users' processes alone hold it (they
    can read it), which of them (unlocked: passed over); else HeldElsewhere, naming the holder
    as `holder_path` says."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        pass
    holders = flock_holders(fd)
    info = os.fstat(fd)
    writers = {os.geteuid(), 0, info.st_uid}  # who may write it whatever its mode: none of them is passed over
    if holders and _only_owner_writes(fd, info) and all(uid is not None and uid not in writers for uid in holders.values()):
        return ", ".join(f"process {pid} (uid {uid})" for pid, uid in sorted(holders.items()))
    raise HeldElsewhere(_read_holder(holder_path))


def _only_owner_writes(fd: int, info: os.stat_result) -> bool:
    """No group or other write bit and no ACL: only the owner (and root) may write the file."""
    if info.st_mode & 0o022:
        return False
    try:
        return "system.posix_acl_access" not in os.listxattr(fd)
    except OSError:  # no extended attributes here: no ACL either
        return True


def flock_holders(fd: int) -> dict[int, int | None]:
    """The processes `/proc/locks` shows holding a flock on `fd`'s file, with their users (None
    where unknown). Empty where none is seen (another machine's, another pid namespace's)."""
    info = os.fstat(fd)
    device = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    holders: dict[int, int | None] = {}
    try:
        with open("/proc/locks") as locks:
            for line in locks:
                fields = line.split()
                if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == device:  # waiters: "->" first
                    pid = int(fields[4])
                    try:
                        holders[pid] = os.stat(f"/proc/{pid}").st_uid
                    except OSError:
                        holders[pid] = None
    except (OSError, ValueError):
        return {}
    return holders


def _write_holder(path: Path) -> tuple[int | None, str | None]:
    """Our pid and host in the lock file `path` (a stale one of ours is overwritten), locked
    (HeldElsewhere where another run of ours holds it) and closed to other users: its
    descriptor; or None and why, where `path` is not ours to write (a link, a special file,
    another file's name, another user's): left alone. OSError where it cannot be written."""
    odd = f"{path} is not a lock file this command wrote (a link, a special file or another user's): left alone"
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | OPEN_FLAGS, 0o600)
        except OSError as error:
            if error.errno in ODD_LOCK_FILE:
                return None, odd
            raise
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1 or info.st_uid != os.geteuid():
                os.close(fd)
                return None, odd
            os.fchmod(fd, 0o600)  # one an earlier version left readable: no other user opens it to lock it
            foreign = _lock_unless_foreign(fd, path)
        except BaseException:
            os.close(fd)
            raise
        current = same_file(fd, path)  # not one a holder removed as we opened it
        if current and not foreign:
            break
        if current:  # another user kept a descriptor of an old one: a new file
            os.unlink(path)
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps({"pid": os.getpid(), "host": socket.gethostname()}) + "\n").encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd, None


def lock_own_file(path: Path) -> int | None:
    """`path` opened for appending (created 0600 when missing: a user who cannot open it cannot
    hold its lock either) and `flock`ed: its descriptor, or None where another process holds it.
    Never through a link, a symlink or a hard link: only this user's own regular file of one name
    (else PermissionError). A file removed or replaced while it was being locked (its holder's
    tidying) gives way to the one there now."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | OPEN_FLAGS, 0o600)
        info = os.fstat(fd)
        if info.st_nlink == 0:  # its holder removed it as we opened it: the one at the path now
            os.close(fd)
            continue
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_nlink > 1:
            os.close(fd)
            raise PermissionError(errno.EPERM, "not this user's own regular file of one name", str(path))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError:  # no locks on this filesystem (ENOLCK)
            os.close(fd)
            raise
        if same_file(fd, path):
            return fd
        os.close(fd)


def _no_symlink(error: OSError, path: Path) -> OSError:
    """ELOOP of O_NOFOLLOW said as what it means here."""
    if error.errno == errno.ELOOP:
        return OSError(error.errno, f"{path} is a symbolic link, not a file this command wrote")
    return error


def same_file(fd: int, path: Path) -> bool:
    """Whether `path` names `fd`'s file still (not removed, nor replaced by another, since it was opened)."""
    try:
        here, there = os.fstat(fd), os.lstat(path)
    except FileNotFoundError:
        return False
    return os.path.samestat(here, there)


def unlink_held(fd: int, path: Path) -> bool:
    """Remove `path` where it still names `fd`'s file, the one this process locked (another's
    tidying may have put a new file there meanwhile, which is left): whether it was removed."""
    if not same_file(fd, path):
        return False
    os.unlink(path)
    return True


def _read_holder(path: Path) -> LockHolder:
    try:
        fd = os.open(path, os.O_RDONLY | OPEN_FLAGS)
    except OSError:  # a hard link or symlink to the guarded file: its own lock file does not exist
        return LockHolder(None, None)
    try:
        # The holder writes its pid just after locking: give it a moment if the file is still empty.
        for _ in range(20):
            data = os.pread(fd, 4096, 0)
            if data.endswith(b"\n"):
                try:
                    info = json.loads(data)
                    return LockHolder(int(info["pid"]), str(info["host"]))
                except (ValueError, KeyError, TypeError):
                    break
            time.sleep(0.005)
    except OSError:
        pass
    finally:
        os.close(fd)
    return LockHolder(None, None)
