"""What the Triton kernels take, checked at their Python entries before a launch.

A kernel trusts its arguments: a segment longer than its bound leaves rows unwritten, a width that
does not match reads past a row, a slot past the cache writes past it. These checks read only
tensor metadata (shapes, dtypes, strides, devices), so they cost microseconds, never sync with
the device, and run at capture as well. A bound held in device memory is checked where the host
has it: segment offsets where they are built (or at the entry when they are on the CPU), the
decode slot by the decoder runner, which knows each step's slot. A violation raises ValueError
naming the argument. No Triton here: the checks run, and are tested, on any machine.
"""

import torch

from encoder_graphs.kernels import HALF_DTYPES


def check_segments(cu_seqlens: torch.Tensor, max_seqlen: int, rows: int) -> None:
    """Host offsets `cu_seqlens` of segments within `rows` rows: integers, from 0, monotonic,
    each segment at most `max_seqlen` rows (the bound a kernel was launched or captured with)."""
    if cu_seqlens.device.type != "cpu":
        raise ValueError("check_segments reads offsets on the host: a device tensor would cost a sync")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.is_floating_point():
        raise ValueError(f"cu_seqlens must be 1-D integer offsets, got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    lengths = cu_seqlens.diff()
    if int(cu_seqlens[0]) != 0 or bool((lengths < 0).any()) or int(cu_seqlens[-1]) > rows:
        raise ValueError(f"cu_seqlens must rise from 0 to at most {rows} rows, got {cu_seqlens.tolist()}")
    longest = int(lengths.max()) if lengths.numel() else 0
    if longest > max_seqlen:
        raise ValueError(f"a segment of {longest} rows is longer than max_seqlen {max_seqlen}: its rows past "
                         f"{max_seqlen} would never be written")


def check_window_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
) -> None:
    """The arguments of `window.rotary_window_attention`: q, k, v [rows, heads, head_dim] of one
    half-precision dtype, head dims contiguous; cos, sin [rows, head_dim] of one layout; int32
    offsets; all on q's device (offsets may be on the CPU, where their segments are checked
    against `max_seqlen` too)."""
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"window attention takes q, k, v of one shape [rows, heads, head_dim], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.dtype not in HALF_DTYPES or not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"window attention takes q, k, v of one half-precision dtype, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    rows, _, head_dim = q.shape
    if cos.shape != (rows, head_dim) or sin.shape != cos.shape or not cos.is_floating_point():
        raise ValueError(f"window attention takes cos and sin [{rows}, {head_dim}] of a float dtype, got "
                         f"{tuple(cos.shape)}, {tuple(sin.shape)}")
    if any(x.stride(-1) != 1 for x in (q, k, v, cos, sin)) or cos.stride() != sin.stride():
        raise ValueError("window attention takes head dims contiguous, and cos and sin of one layout")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32:
        raise ValueError(f"window attention takes int32 offsets [segments + 1], got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)}")
    _same_device("window attention", q, k, v, cos, sin)
    if cu_seqlens.device.type == "cpu":
        check_segments(cu_seqlens, max_seqlen, rows)
    elif cu_seqlens.device != q.device:
        raise ValueError(f"window attention takes offsets on the host or on q's device, got {cu_seqlens.device}")


def check_swiglu_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """The arguments of `swiglu.swiglu_linear`: weight [2 x width, in], row-major, `in` a
    multiple of 8 (TMA strides rows by multiples of 16 bytes), half precision; bias [2 x width]
    or None; x [..., in]; one dtype, one device."""
    if weight.dim() != 2 or weight.shape[0] % 2 or weight.shape[1] % 8 or weight.stride() != (weight.shape[1], 1):
        raise ValueError(f"the gated GEMM takes a contiguous weight [2 x width, in] with in a multiple of 8, got "
                         f"{tuple(weight.shape)} of strides {weight.stride()}")
    if weight.dtype not in HALF_DTYPES or x.dtype != weight.dtype:
        raise ValueError(f"the gated GEMM takes x and weight of one half-precision dtype, got {x.dtype}, "
                         f"{weight.dtype}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"the gated GEMM takes x [..., {weight.shape[1]}], got {tuple(x.shape)}")
    if bias is not None and (bias.shape != weight.shape[:1] or bias.dtype != weight.dtype or bias.stride(0) != 1):
        raise ValueError(f"the gated GEMM takes a contiguous bias [{weight.shape[0]}] of the weight's dtype, got "
                         f"{tuple(bias.shape)} {bias.dtype}")
    _same_device("the gated GEMM", x, weight, *([bias] if bias is not None else []))


def check_decode_inputs(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slot: torch.Tensor,
    mask: torch.Tensor,
) -> None:
    """The arguments of `decode.write_and_attend`: query [batch, heads, 1, dim]; key, value
    [batch, kv_heads, 1, dim]; keys, values [batch, kv_heads, slots, dim] of one layout, dims
    contiguous; heads a multiple of kv_heads; dim a power of two from 16 to 256; one dtype; mask
    bool [batch, slots], slots contiguous; `slot` one integer. All on one device. That `slot` is
    below `slots` is the caller's to keep (reading it here would sync; the runner checks each
    step's slot on the host)."""
    batch, heads, tokens, dim = query.shape if query.dim() == 4 else (None,) * 4
    if tokens != 1 or keys.dim() != 4 or keys.shape[0] != batch or keys.shape[3] != dim:
        raise ValueError(f"decode attention takes query [batch, heads, 1, dim] and keys [batch, kv_heads, slots, dim], "
                         f"got {tuple(query.shape)}, {tuple(keys.shape)}")
    kv_heads, slots = keys.shape[1], keys.shape[2]
    if key.shape != (batch, kv_heads, 1, dim) or value.shape != key.shape or values.shape != keys.shape:
        raise ValueError(f"decode attention takes key, value [{batch}, {kv_heads}, 1, {dim}] and values like keys, got "
                         f"{tuple(key.shape)}, {tuple(value.shape)}, {tuple(values.shape)}")
    if heads % kv_heads or not (16 <= dim <= 256 and dim & (dim - 1) == 0):
        raise ValueError(f"decode attention takes whole groups of query heads ({heads} over {kv_heads}) and a "
                         f"power-of-two head dim from 16 to 256 (got {dim})")
    if not query.dtype == key.dtype == value.dtype == keys.dtype == values.dtype:
        raise ValueError(f"decode attention takes one dtype, got {query.dtype}, {key.dtype}, {value.dtype}, "
                         f"{keys.dtype}, {values.dtype}")
    if keys.stride(-1) != 1 or keys.stride() != values.stride():
        raise ValueError("decode attention takes keys and values of one layout, head dims contiguous")
    if mask.dtype != torch.bool or mask.shape != (batch, slots) or mask.stride(-1) != 1:
        raise ValueError(f"decode attention takes a bool mask [{batch}, {slots}] contiguous along the slots, got "
                         f"{mask.dtype} {tuple(mask.shape)}")
    if slot.numel() != 1 or slot.is_floating_point():
        raise ValueError(f"decode attention takes one integer slot, got {slot.dtype} {tuple(slot.shape)}")
    _same_device("decode attention", query, key, value, keys, values, slot, mask)


def _same_device(what: str, *tensors: torch.Tensor) -> None:
    devices = {tensor.device for tensor in tensors}
    if len(devices) > 1:
        raise ValueError(f"{what} takes its tensors on one device, got {sorted(map(str, devices))}")
