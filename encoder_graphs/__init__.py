"""encoder-graphs: CUDA graphs for the vision encoders and decoders of Hugging Face VLMs.

The root exports its names lazily (PEP 562): `import encoder_graphs.packing` loads no torch, and
the command line starts without transformers.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "EncoderCudaGraphManager": "encoder_graphs.engine.manager",
    "DecoderGraphRunner": "encoder_graphs.decoder.runner",
    "EncoderGraphsHandle": "encoder_graphs.enable",
    "enable_cuda_graphs": "encoder_graphs.enable",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from encoder_graphs.decoder.runner import DecoderGraphRunner
    from encoder_graphs.enable import EncoderGraphsHandle, enable_cuda_graphs
    from encoder_graphs.engine.manager import EncoderCudaGraphManager


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'encoder_graphs' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
