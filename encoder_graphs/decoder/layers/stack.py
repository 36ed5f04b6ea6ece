"""The language model's MLPs and norms: the prefill's pointwise work, through Triton kernels where
they run, and for torch.compile.

Uncompiled, a Qwen2.5-VL-3B prefill of a caption batch spent about as long in elementwise kernels
as in its GEMMs, most of it the norms' six kernels and the MLPs' SiLU and product (benchmarks/COMPONENTS.md).
`fuse_text_kernels` runs each stock RMSNorm as one kernel (`kernels/add_norm.py`'s `rms_norm`) and each
gated MLP's gate, up and SiLU as one GEMM (`kernels/swiglu.py`), for the prefill and decode steps alike.

Whole decoder layers do not compile well: dynamo specializes on each layer's `layer_idx`, on the
cache's type and fill state, and reached its recompile limit on the second `generate` call (CPU,
tiny Qwen2.5-VL). Their MLPs and RMSNorms take only hidden states: compiled with
dynamic shapes they fuse the activation, the gating and the norms' six kernels, for prompts of
any batch and length (one compilation, and one more for a batch of one). Decode steps run
`decoder/layers/decode.py`'s `DecodeLayer`s, which call these modules inside their own compiled code.
"""

from contextlib import nullcontext

import torch
from torch import nn

from encoder_graphs.kernels import HALF_DTYPES, triton_runs
from encoder_graphs.rewrites import Rewrites
from encoder_graphs.rewrites.fused_mlp import InterleavedGateUp, fuse_gated_mlp, fuses_gated_mlp
from encoder_graphs.seam.modules import is_stock_rms_norm, rms_norm_forward

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


def warm_up_language_model(model: nn.Module) -> None:
    """One forward of the language model over a few tokens, so that what its first call pays once
    (Triton's compiler imported, our kernels' binaries loaded, cuBLAS's handles made) is paid
    before the first batch, while its files still load. Callable from any thread: the current
    device is the model's there."""
    weight = model.get_input_embeddings().weight
    ids = torch.zeros(1, _WARM_UP_LENGTH, dtype=torch.long, device=weight.device)
    on_device = torch.cuda.device(weight.device) if weight.is_cuda else nullcontext()
    with torch.inference_mode(), on_device:
        model.get_decoder()(input_ids=ids, use_cache=False)


def fuse_text_kernels(model: nn.Module, rewrites: Rewrites) -> dict[nn.Module, InterleavedGateUp]:
    """The language model's stock RMSNorms through `rms_norm` and its gated MLPs through the
    swiglu GEMM, until `rewrites` is undone, where the kernels run (half precision, a tested GPU);
    each fused MLP's gate and up for the decode steps (`decoder/layers/decode.py`'s `DecodeLayer`)."""
    weight = model.get_input_embeddings().weight
    if weight.dtype not in HALF_DTYPES or not triton_runs(weight.device):
        return {}
    from encoder_graphs.kernels.add_norm import rms_norm
    from encoder_graphs.kernels.swiglu import swiglu_linear

    decoder = model.get_decoder()
    for module in decoder.modules():
        if is_stock_rms_norm(module) and (module.weight.dtype, module.weight.device) == (weight.dtype, weight.device):
            rewrites.patch(module, "forward", rms_norm_forward(module, rms_norm))
    mlps = [layer.mlp for layer in decoder.layers if fuses_gated_mlp(layer.mlp)]
    return {mlp: fuse_gated_mlp(mlp, swiglu_linear, rewrites) for mlp in mlps}
