"""encoder-graphs: CUDA graphs for the vision encoders and decoders of Hugging Face VLMs."""

from encoder_graphs.decoder import DecoderGraphRunner
from encoder_graphs.enable import enable_cuda_graphs
from encoder_graphs.manager import EncoderCudaGraphManager

__all__ = ["DecoderGraphRunner", "EncoderCudaGraphManager", "enable_cuda_graphs"]
