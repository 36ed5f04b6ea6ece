"""The package's Triton kernels against the torch ops they stand in for, at the shapes the models
give them: Qwen2.5-VL's window attention (rotary and attention within 64-row windows), the SwiGLU
GEMM of the vision tower and of the 3B language model, the residual add with RMSNorm, and the
decode step's cache write and attention over a batch of 64 photos' prompts.

Each row: ms per call (CUDA events, p50, the two ways interleaved), the speed-up, the kernel's
rate against the measured ceiling (FLOPs at the matmul rate, or bytes at the copy rate), and the
kernel's largest error against an fp32 reference beside the torch way's (bf16 inputs alike).

    python3 benchmarks/bench_kernels.py [--quick] [--json bench_kernels_h100.json]
"""

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from timing import copy_bandwidth_gbps, environment, markdown_table, matmul_tflops, time_interleaved, write_json

from encoder_graphs.attention import decode_attention
from encoder_graphs.kernels.add_norm import add_rms_norm
from encoder_graphs.kernels.decode import write_and_attend
from encoder_graphs.kernels.swiglu import swiglu_linear
from encoder_graphs.kernels.window import rotary_window_attention
from encoder_graphs.models.qwen.qwen2_5_vl import interleave_pairs

BF16 = {"dtype": torch.bfloat16, "device": "cuda"}
Case = tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor], Callable[[], torch.Tensor], float, str]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def window_case(rows: int = 16384, heads: int = 16, dim: int = 80) -> Case:
    """Full 64-row windows of the 7B tower's attention; the torch way: transformers' fp32 rotary,
    then PyTorch's bundled FA2 over the windows."""
    from torch.nn.attention.varlen import varlen_attn

    q, k, v = (torch.randn(rows, heads, dim, **BF16) for _ in range(3))
    angles = torch.rand(rows, dim // 2, device="cuda") * 30
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    cu = torch.arange(0, rows + 1, 64, dtype=torch.int32, device="cuda")
    order = interleave_pairs(dim).cuda()
    qi, ki = q[..., order].contiguous(), k[..., order].contiguous()
    scale = dim**-0.5

    def rotated(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        c, s = cos[:, None].float(), sin[:, None].float()
        return tuple((x.float() * c + rotate_half(x.float()) * s).to(dtype) for x in (q, k))

    def torch_way() -> torch.Tensor:
        rq, rk = rotated(torch.bfloat16)
        return varlen_attn(rq, rk, v, cu, cu, 64, 64, scale=scale)

    def reference() -> torch.Tensor:
        rq, rk = rotated(torch.float32)
        out = torch.empty(rows, heads, dim, device="cuda")
        for start in range(0, rows, 64):
            window = [x[start:start + 64].transpose(0, 1) for x in (rq, rk, v.float())]
            out[start:start + 64] = F.scaled_dot_product_attention(*window, scale=scale).transpose(0, 1)
        return out

    flops = 4 * rows * 64 * heads * dim
    return lambda: rotary_window_attention(qi, ki, v, cos, sin, cu, 64, scale), torch_way, reference, flops, "flops"


def swiglu_case(rows: int, width: int, hidden: int) -> Case:
    """SiLU(x W_gate) * (x W_up); the torch way: one cuBLAS GEMM over both, then the elementwise."""
    x = torch.randn(rows, width, **BF16)
    gate_up = torch.randn(2 * hidden, width, **BF16) / width**0.5
    interleaved = gate_up.view(2, hidden, width).transpose(0, 1).reshape(2 * hidden, width).contiguous()

    def torch_way() -> torch.Tensor:
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        return F.silu(gate) * up

    def reference() -> torch.Tensor:
        gate, up = F.linear(x.float(), gate_up.float()).chunk(2, dim=-1)
        return F.silu(gate) * up

    return lambda: swiglu_linear(x, interleaved, None), torch_way, reference, 2 * rows * width * 2 * hidden, "flops"


def add_norm_case(rows: int, width: int) -> Case:
    """h = x + update and RMSNorm(h) side by side; the torch way: transformers' RMSNorm ops."""
    x, update = torch.randn(rows, width, **BF16), torch.randn(rows, width, **BF16)
    weight = torch.rand(width, **BF16) + 0.5

    def norm(h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        h32 = h.float()
        normed = (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
        return torch.cat([h.to(dtype), weight.to(dtype) * normed], dim=-1)

    moved = 2 * rows * width * 2 * 2  # x and update in, h and the norm out, bf16
    return (lambda: add_rms_norm(x, update, weight, 1e-6), lambda: norm(x + update, torch.bfloat16),
            lambda: norm(x.float() + update.float(), torch.float32), moved, "bytes")


def decode_case(batch: int = 64, heads: int = 16, kv_heads: int = 2, dim: int = 128, slots: int = 1363) -> Case:
    """One new token against the static cache; the torch way: index_copy, then grouped sdpa."""
    query = torch.randn(batch, heads, 1, dim, **BF16)
    key, value = torch.randn(batch, kv_heads, 1, dim, **BF16), torch.randn(batch, kv_heads, 1, dim, **BF16)
    keys, values = torch.randn(batch, kv_heads, slots, dim, **BF16), torch.randn(batch, kv_heads, slots, dim, **BF16)
    slot = torch.tensor([slots - 40], device="cuda")
    mask = torch.zeros(batch, slots, dtype=torch.bool, device="cuda")
    mask[:, : slots - 39] = True
    scale = dim**-0.5

    def torch_way() -> torch.Tensor:
        keys.index_copy_(2, slot, key)
        values.index_copy_(2, slot, value)
        return decode_attention(query, keys, values, mask[:, None, None, :], scale)

    def reference() -> torch.Tensor:
        torch_way()
        return decode_attention(query.float(), keys.float(), values.float(), mask[:, None, None, :], scale)

    read = 2 * keys.nbytes
    return lambda: write_and_attend(query, key, value, keys, values, slot, mask, scale), torch_way, reference, read, "bytes"


CASES = {
    "window attention, 7B tower, 16k rows": window_case,
    "swiglu GEMM, vision MLP 1280 -> 3456, 16k rows": lambda: swiglu_case(16384, 1280, 3456),
    "swiglu GEMM, 3B language model 2048 -> 11008, 16k rows": lambda: swiglu_case(16384, 2048, 11008),
    "add + RMSNorm, 1280 wide, 16k rows": lambda: add_norm_case(16384, 1280),
    "decode write + attention, batch 64, 1363 slots": decode_case,
}


def max_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return ((out.float() - reference.float()).abs().max() / reference.float().abs().max()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--quick", action="store_true", help="fewer timed calls (run_gpu.sh)")
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args()
    iters = 20 if args.quick else args.iters
    ceilings = {"flops": matmul_tflops() * 1e12, "bytes": copy_bandwidth_gbps() * 1e9}
    rows, results = [], {}
    with torch.inference_mode():
        for name, make in CASES.items():
            kernel, torch_way, reference, work, unit = make()
            truth = reference()
            errors = {"kernel": max_error(kernel(), truth), "torch": max_error(torch_way(), truth)}
            timed = time_interleaved({"kernel": kernel, "torch": torch_way}, warmup=5, iters=iters)
            ms = {way: timed[way]["p50"] for way in timed}
            of_ceiling = work / (ms["kernel"] / 1000) / ceilings[unit]
            results[name] = {"ms": ms, "work": work, "unit": unit, "kernel_of_ceiling": of_ceiling, "max_error": errors}
            rows.append([name, f"{ms['torch']:.3f}", f"{ms['kernel']:.3f}", f"{ms['torch'] / ms['kernel']:.2f}x",
                         f"{of_ceiling:.0%} of {unit}", f"{errors['kernel']:.1e} / {errors['torch']:.1e}"])
    env = environment()
    print(f"kernels | {env} | matmul {ceilings['flops'] / 1e12:.0f} TFLOP/s, copy {ceilings['bytes'] / 1e9:.0f} GB/s")
    print(markdown_table(["kernel", "torch ms", "kernel ms", "speed-up", "kernel rate", "max error kernel / torch"], rows))
    write_json(args.json, {"environment": env, "matmul_tflops": ceilings["flops"] / 1e12,
                           "copy_gbps": ceilings["bytes"] / 1e9, "results": results})


if __name__ == "__main__":
    main()
