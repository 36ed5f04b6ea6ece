"""encoder-graphs: CUDA graphs for the vision encoders and decoders of Hugging Face VLMs."""

from encoder_graphs.manager import EncoderCudaGraphManager

__all__ = ["EncoderCudaGraphManager"]
