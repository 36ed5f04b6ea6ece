"""Permission tests that mean the same for root (CI runs as root): root reads and writes past file
modes only through its CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH capabilities, so a subprocess
started without them (util-linux `setpriv`) meets a chmod as any other user does."""

import os
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_DROPPED = "--bounding-set=-dac_override,-dac_read_search"


@cache
def _setpriv() -> str | None:
    """setpriv, where it can drop the capabilities here (a container may forbid it)."""
    setpriv = shutil.which("setpriv")
    if setpriv is None or subprocess.run([setpriv, _DROPPED, "true"], capture_output=True).returncode != 0:
        return None
    return setpriv


def unprivileged(command: list[str]) -> list[str]:
    """`command` as it runs for a user that file modes bind: as it is, or for root through setpriv."""
    if os.geteuid() != 0:
        return command
    setpriv = _setpriv()
    if setpriv is None:
        pytest.skip("root, and setpriv cannot drop the capabilities that pass file modes")
    return [setpriv, _DROPPED, *command]


def code_env() -> dict[str, str]:
    """The environment of a subprocess that imports this checkout's code."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def run_unprivileged(code: str) -> subprocess.CompletedProcess:
    """Python `code` in a fresh interpreter, `unprivileged`."""
    command = unprivileged([sys.executable, "-c", code])
    return subprocess.run(command, env=code_env(), capture_output=True, text=True, timeout=120, check=False)
