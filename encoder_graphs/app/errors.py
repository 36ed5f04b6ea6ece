"""The command line's exit statuses and the error that means "the request is wrong"."""

EXIT_OK, EXIT_FAILURES, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(Exception):
    """A request the command cannot carry out as given: reported in one line, exit 2."""
