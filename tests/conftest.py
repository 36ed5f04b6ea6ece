import gc
import os
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(2)
# Fixtures the wheel does not ship: the toy ViT lives with the example that shows it (examples/),
# the synthetic prompts with the benchmarks that build them (benchmarks/).
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "benchmarks")]


@pytest.fixture(autouse=True)
def _gpu_memory_given_back():
    """Under pytest-xdist (run_gpu.sh) several test processes share one GPU: each gives its cached
    blocks back after a test, so what one holds idle does not run another out of memory."""
    yield
    if os.environ.get("PYTEST_XDIST_WORKER") and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()
