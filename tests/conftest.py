import sys
from pathlib import Path

import torch

torch.set_num_threads(2)
# Fixtures the wheel does not ship: the toy ViT lives with the example that shows it (examples/),
# the synthetic prompts with the benchmarks that build them (benchmarks/).
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "benchmarks")]
