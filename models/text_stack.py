"""The language model's MLPs and norms, for torch.compile: the prefill's pointwise work.

Whole decoder layers do not compile well: dynamo specializes on each layer's `layer_idx`, on the
cache's type and fill state, and reached its recompile limit on the second `generate` call (CPU,
tiny Qwen2.5-VL, 2026-11-22). Their MLPs and RMSNorms take only hidden states: compiled with
dynamic shapes they fuse the activation, the gating and the norms' six kernels, for prompts of
any batch and length (one compilation, and one more for a batch of one). Decode steps run
`text_decode.DecodeLayer`s, which call these modules inside their own compiled code.
"""

import torch
from torch import nn

# Every decoder this package supports (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, InternVL's Qwen2/Qwen3)
# names them so, as Llama does.
_LAYER_PARTS = ("mlp", "input_layernorm", "post_attention_layernorm")
_WARM_UP_LENGTH = 8  # tokens: any length above 1 compiles the dynamic-shape kernels


def pointwise_parts(model: nn.Module) -> list[nn.Module]:
    """Each decoder layer's MLP and norms, and the final norm."""
    decoder = model.get_decoder()
    parts = [getattr(layer, name) for layer in decoder.layers for name in _LAYER_PARTS]
    return [*parts, decoder.norm]


def warm_up_parts(model: nn.Module) -> None:
    """Run every part on zeros of a batch of two and of one, as a prefill would."""
    weight = model.get_input_embeddings().weight
    with torch.inference_mode():
        for batch in (2, 1):
            hidden = torch.zeros(batch, _WARM_UP_LENGTH, weight.shape[1], dtype=weight.dtype, device=weight.device)
            for part in pointwise_parts(model):
                part(hidden)
