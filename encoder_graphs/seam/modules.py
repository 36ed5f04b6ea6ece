"""The stock modules that this package's kernels stand in for: gated SiLU MLPs and RMSNorms,
recognised by what they compute and given another forward."""

from collections.abc import Callable

import torch

# 5.17.0, 5.23.0: what `ACT2FN["silu"]` builds (not an nn.SiLU).
from transformers.activations import SiLUActivation


# 5.17.0, 5.23.0: a Qwen2.5-VL vision MLP computes `down_proj(act_fn(gate_proj(x)) * up_proj(x))`
# with `act_fn` from its config's hidden_act (SiLU in the released models).
def is_gated_silu_mlp(mlp: torch.nn.Module) -> bool:
    """Whether `mlp` is a stock gated MLP with a SiLU gate."""
    act = getattr(mlp, "act_fn", None)
    return isinstance(act, (SiLUActivation, torch.nn.SiLU)) and all(
        hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj")
    )


def gated_silu_mlp_forward(
    mlp: torch.nn.Module, gated: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A forward for the gated MLP `mlp` (`is_gated_silu_mlp`) whose SiLU(gate(x)) * up(x) is
    `gated(x)` (`kernels/swiglu.py`'s `swiglu_linear`)."""

    def forward(hidden_state: torch.Tensor) -> torch.Tensor:
        return mlp.down_proj(gated(hidden_state))

    return forward


# 5.17.0, 5.23.0: the RMSNorms of the Qwen-VL language models (and InternVL's Qwen2/Qwen3) compute
# `weight * (x.float() * rsqrt(mean(x.float()**2) + variance_epsilon)).to(x.dtype)` with `weight`
# [hidden] (a zero-centred norm, Gemma's `1 + weight`, is not among them).
_STOCK_RMS_NORMS = frozenset(
    {"Qwen2RMSNorm", "Qwen3RMSNorm", "Qwen2VLRMSNorm", "Qwen2_5_VLRMSNorm", "Qwen3VLTextRMSNorm"}
)


def is_stock_rms_norm(module: torch.nn.Module) -> bool:
    """Whether `module` is one of those RMSNorms running its class's own forward."""
    return (
        type(module).__name__ in _STOCK_RMS_NORMS
        and type(module).__module__.startswith("transformers.models.")
        and "forward" not in module.__dict__
        and isinstance(getattr(module, "weight", None), torch.nn.Parameter)
        and isinstance(getattr(module, "variance_epsilon", None), float)
    )


def rms_norm_forward(
    norm: torch.nn.Module, kernel: Callable[..., torch.Tensor]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A forward for `norm` (`is_stock_rms_norm`) through `kernel(x, weight, eps)`
    (`kernels/add_norm.py`'s `rms_norm`)."""

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        return kernel(hidden_states, norm.weight, norm.variance_epsilon)

    return forward
