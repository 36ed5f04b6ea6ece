"""encoder-graphs: CUDA graphs for the vision encoders and decoders of Hugging Face VLMs.

The root exports its names lazily (PEP 562): `import encoder_graphs.packing` loads no torch, and
the command line starts without transformers.
"""

from typing import TYPE_CHECKING

from encoder_graphs.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "EncoderCudaGraphManager": "encoder_graphs.engine.manager",
    "DecoderGraphRunner": "encoder_graphs.decoder.runner",
    "EncoderGraphsHandle": "encoder_graphs.enable",
    "GraphOptions": "encoder_graphs.options",
    "EncoderOptions": "encoder_graphs.options",
    "DecoderOptions": "encoder_graphs.options",
    "enable_cuda_graphs": "encoder_graphs.enable",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from encoder_graphs.decoder.runner import DecoderGraphRunner
    from encoder_graphs.enable import EncoderGraphsHandle, enable_cuda_graphs
    from encoder_graphs.engine.manager import EncoderCudaGraphManager
    from encoder_graphs.options import DecoderOptions, EncoderOptions, GraphOptions


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
