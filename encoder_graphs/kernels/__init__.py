"""This package's Triton kernels (RMSNorm with the residual add, the SwiGLU GEMM, Qwen2.5-VL's
window attention, the decode step's cache write and attention) and the guards every kernel entry
shares: which dtypes and GPUs they run on, and refusing autograd, which none of them supports."""

import importlib.util
from collections.abc import Iterable

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)  # what FA2, cuDNN and our Triton kernels take
_TRITON = importlib.util.find_spec("triton") is not None


def refuse_gradients(what: str, tensors: Iterable[torch.Tensor]) -> None:
    """Raise where autograd would want a backward of `what` (one of this package's kernels, which
    have none): grad mode on and any of `tensors` requiring gradients."""
    if torch.is_grad_enabled() and any(tensor.requires_grad for tensor in tensors):
        raise RuntimeError(f"{what} has no backward: run under torch.no_grad or torch.inference_mode, "
                           "or restore the stock modules first")


# The GPUs (compute capabilities) this package's Triton kernels passed their tests on: Hopper,
# H100 and H200 (sm90). Ampere, Ada and Blackwell never ran them (nor the swiglu GEMM's TMA path,
# which needs Hopper): there the torch paths run, until the GPU tests pass on one and it joins.
TESTED_CAPABILITIES = frozenset({(9, 0)})


def kernels_tested_on(capability: tuple[int, int]) -> bool:
    return tuple(capability) in TESTED_CAPABILITIES


def triton_runs(device: torch.device) -> bool:
    """Whether this package's Triton kernels run on `device`: Triton present, a CUDA GPU of a
    capability they were tested on (`TESTED_CAPABILITIES`)."""
    return _TRITON and device.type == "cuda" and kernels_tested_on(torch.cuda.get_device_capability(device))
