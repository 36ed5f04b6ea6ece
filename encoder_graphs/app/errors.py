"""The command line's exit statuses, the error that means "the request is wrong", the one that
means "an output could not be written", and how names are shown on a terminal."""

from pathlib import Path

EXIT_OK, EXIT_FAILURES, EXIT_USAGE, EXIT_OUTPUT, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


class UsageError(Exception):
    """A request the command cannot carry out as given: reported in one line, exit 2."""


class OutputError(Exception):
    """An output (`--out`, `--stats-json`, `metadata.jsonl`) could not be written during the run
    (disk full, file too large, a folder made read-only): reported in one line, exit 3. What was
    written before it stays whole, so a rerun resumes."""

    def __init__(self, path: str | Path, error: OSError) -> None:
        self.path = Path(path)
        super().__init__(f"cannot write {printable(path)}: {error.strerror or error}")


def printable(text: object) -> str:
    """`text` with control characters and undecodable bytes escaped (`\\x1b`, `\\udcff`): a file
    name can hold terminal escapes, which printed raw would drive the user's terminal."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode("ascii")
                   for c in str(text))


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, for messages ("a FIFO", "a folder", ...)."""
    import stat

    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"))
    return next((name for test, name in kinds if test(mode)), "a special file")
