import gc
import os
import sys
from pathlib import Path

import pytest

# run_gpu.sh on a host of several GPUs lists them all in CUDA_VISIBLE_DEVICES: each pytest-xdist
# worker takes one, in turn, before torch starts CUDA (no test needs two).
_visible, _worker = os.environ.get("CUDA_VISIBLE_DEVICES", ""), os.environ.get("PYTEST_XDIST_WORKER", "")
if "," in _visible and _worker.startswith("gw"):
    _devices = _visible.split(",")
    os.environ["CUDA_VISIBLE_DEVICES"] = _devices[int(_worker[2:]) % len(_devices)]

import torch  # noqa: E402 (after the device is chosen)

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
