"""The command line's exit statuses, the error that means "the request is wrong", and how names
are shown on a terminal."""

EXIT_OK, EXIT_FAILURES, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(Exception):
    """A request the command cannot carry out as given: reported in one line, exit 2."""


def printable(text: object) -> str:
    """`text` with control characters and undecodable bytes escaped (`\\x1b`, `\\udcff`): a file
    name can hold terminal escapes, which printed raw would drive the user's terminal."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode("ascii")
                   for c in str(text))
