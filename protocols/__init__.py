"""The contracts between the engine and the model adapters: `SupportsEncoderCudaGraph` (what the
manager needs to graph an encoder) and `ModelFamily` / `CaptionInputs` (what `enable_cuda_graphs`,
the decoder and the caption command need from a model family). torch only: no transformers."""

from encoder_graphs.protocols.encoder import (
    PROTOCOL_METHODS,
    CaptureInputs,
    EncoderCudaGraphConfig,
    EncoderItemSpec,
    EncoderPathConfig,
    ReplayBuffers,
    SupportsEncoderCudaGraph,
    check_supports_encoder_cuda_graph,
)
from encoder_graphs.protocols.family import CaptionInputs, EncodedMedia, FamilyDefaults, ModelFamily

__all__ = [
    "PROTOCOL_METHODS",
    "CaptionInputs",
    "CaptureInputs",
    "EncodedMedia",
    "EncoderCudaGraphConfig",
    "EncoderItemSpec",
    "EncoderPathConfig",
    "FamilyDefaults",
    "ModelFamily",
    "ReplayBuffers",
    "SupportsEncoderCudaGraph",
    "check_supports_encoder_cuda_graph",
]
