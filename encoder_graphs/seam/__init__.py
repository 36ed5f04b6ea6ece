"""Every private or version-sensitive use of transformers, in one place: this package.

The rest of the package reaches transformers' internals only through these modules, so a new
transformers release is checked (and, where needed, mended) here. Each entry says which versions
it was checked on; `TESTED_RANGE` is the range CI runs (both ends) and `pyproject.toml` allows.
- `attention`: attention implementations registered under our names, and switching to them;
- `modules`: the stock MLPs and norms the kernels stand in for;
- `vision`: the Qwen vision towers' blocks, helpers and outputs, InternVL's tiling, DeepSeek-OCR's
  SAM attention;
- `text`: the language models' layers, rotary embeddings and caches (our static cache's layers);
- `generation`: what `generate` resolves and computes before its first forward.
"""

import warnings

import torch
import transformers
from packaging.version import Version
from transformers import PretrainedConfig, PreTrainedModel

TESTED_RANGE = ("5.17.0", "5.23.0")
_warned: list[str] = []


def check_version(version: str = transformers.__version__) -> bool:
    """Warn once when transformers is outside the tested range; True when inside it."""
    low, high = (Version(v) for v in TESTED_RANGE)
    tested = low <= Version(version) and Version(version).release[:2] <= high.release[:2]
    if not tested and version not in _warned:
        _warned.append(version)
        warnings.warn(
            f"encoder-graphs was tested with transformers {TESTED_RANGE[0]} to {TESTED_RANGE[1][:-2]}.x; "
            f"{version} is untested: graphs may fail or differ from stock outputs",
            stacklevel=2,
        )
    return tested


# 5.17.0, 5.23.0: `_from_config` builds a model from a config without loading weights.
def from_config(model_class: type[PreTrainedModel], config: PretrainedConfig, dtype: torch.dtype) -> PreTrainedModel:
    return model_class._from_config(config, dtype=dtype)
