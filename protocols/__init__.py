"""The contract between the model-agnostic manager and a model adapter."""

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

__all__ = [
    "PROTOCOL_METHODS",
    "CaptureInputs",
    "EncoderCudaGraphConfig",
    "EncoderItemSpec",
    "EncoderPathConfig",
    "ReplayBuffers",
    "SupportsEncoderCudaGraph",
    "check_supports_encoder_cuda_graph",
]
