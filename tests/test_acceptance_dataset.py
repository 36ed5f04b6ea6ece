"""Issue 41's acceptance run as a test (slow tier, CPU): 1,000 mixed files in a train/test layout
with the user's metadata.csv, captioned through five SIGKILLs, another prompt refused then taken
with --redo, both splits loaded by `datasets` with their text and the user's columns
(`benchmarks/acceptance_dataset.py` holds the run and its checks)."""

import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import model_cache  # noqa: F401 (autouse: a private model cache for this module)

pytestmark = pytest.mark.slow


def test_a_thousand_files_survive_five_kills_a_redo_and_load_in_datasets(tmp_path):
    pytest.importorskip("av")
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "acceptance_dataset.py"
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "datasets: train 720 rows" in done.stdout and "datasets: test 180 rows" in done.stdout
