"""The decode step alone: one graph replay per batch bucket, three ways, against the floor.

For each preset (real-size config, random weights, bf16), a `DecoderGraphRunner` captures its
decode step at batch buckets 1, 8 and 64 over one length tier, and each graph is replayed on its
own (CUDA events, p50):
- `model forward`: the step through the model's own forward (transformers' layers);
- `fused layers`: the step through `DecodeLayer`s (encoder_graphs/decoder/layers/decode.py), uncompiled;
- `fused layers, compiled`: the same layers after `torch.compile` (what `compile=True` runs).
Beside each: the kernels one step launches, their summed time and the costliest by name
(torch.profiler over one eager step: the graph holds the same kernels), and the floors: the text
stack's and lm_head's weight bytes, plus the keys and values of the slots the timed steps attend
(each lane starts with a prompt that fills the tier but for the steps' own slots) and, for a
hybrid model (Qwen3.5), each lane's linear-attention states read and written, at the measured
copy rate. A model whose decoder layers the fused step does not know runs the first way only.
    python3 benchmarks/bench_decode.py [--quick] [--presets qwen2.5-vl-3b,qwen3-vl-2b] [--json out.json]
"""

import argparse
import math
import time

import torch
from bench_caption import weight_bytes_per_step
from timing import copy_bandwidth_gbps, environment, markdown_table, time_calls, write_json
from torch.profiler import ProfilerActivity, profile

from encoder_graphs import DecoderGraphRunner
from encoder_graphs.decoder.layers.decode import DecodeStack
from encoder_graphs.decoder.step import decode_step
from encoder_graphs.engine.compile import compile_blocks
from encoder_graphs.presets import build_model
from encoder_graphs.rewrites import Rewrites
from encoder_graphs.seam.text import linear_attention_layers, linear_state_shapes

BUCKETS = (1, 8, 64)
TOP_KERNELS = 12
VARIANTS = {"model forward": (False, False), "fused layers": (True, False), "fused layers, compiled": (True, True)}


WARMUP, ITERS = 3, 30
STEPS_ROOM = 64  # slots past the prompt: every replay (warm-up and timed) writes the next one


def restart(runner: DecoderGraphRunner, bucket: int, prompt: int) -> None:
    """Every lane continues a prompt of `prompt` slots: each replay writes the next slot and
    attends all before it, so timing starts afresh at the same length."""
    buffers = runner.static_buffers()
    positions = torch.full_like(buffers.positions.narrow(-2, 0, bucket), prompt)
    mask = torch.ones(bucket, prompt, dtype=torch.bool, device=positions.device)
    buffers.start(batch=bucket, rows=bucket, prompt_mask=mask, next_positions=positions)


def slots_attended(prompt: int) -> float:
    """The slots a timed step attends, on average: the prompt, the steps before it, its own."""
    return prompt + WARMUP + (ITERS - 1) / 2 + 1


def kernels_per_step(runner: DecoderGraphRunner, bucket: int, tier: int) -> dict:
    """Kernels of one eager step: how many, their summed device time (ms), the costliest names."""
    buffers = runner.static_buffers()
    cache = buffers.store.cache(bucket, tier)
    restart(runner, bucket, tier - STEPS_ROOM)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        decode_step(runner.model, runner.stack, buffers, bucket, tier, cache)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for kernel in kernels:
        by_name.setdefault(kernel.name[:80], []).append(kernel.device_time / 1000)
    top = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:TOP_KERNELS]
    return {
        "kernels": len(kernels),
        "kernel_ms": sum(sum(times) for times in by_name.values()),
        "top": [{"name": name, "count": len(times), "ms": sum(times)} for name, times in top],
    }


def measure(model, tier: int, fused: bool, compiled: bool) -> dict:
    runner = DecoderGraphRunner(
        model, max_batch_size=BUCKETS[-1], batch_sizes=BUCKETS, max_cache_len=tier, fused_step=fused
    )
    started = time.perf_counter()
    rewrites = Rewrites()
    compiled_layers = compile_blocks(runner.stack.layers, runner.warm_up, rewrites) if compiled else None
    runner.capture()
    setup_s = time.perf_counter() - started
    rows = {}
    for bucket in BUCKETS:
        graph = runner.graphs[bucket, tier]
        restart(runner, bucket, tier - STEPS_ROOM)
        replay = time_calls(graph.replay, warmup=WARMUP, iters=ITERS)["p50"]
        rows[bucket] = {"replay_ms": replay, **kernels_per_step(runner, bucket, tier)}
    result = {"setup_s": setup_s, "graph_memory_bytes": runner.stats()["graph_memory_bytes"], "buckets": rows}
    if compiled_layers is not None:
        result["compile"] = compiled_layers.stats()
    rewrites.undo()
    runner.close()
    return result


def kv_bytes_per_slot(model) -> int:
    """Keys and values of one slot over the full-attention layers."""
    text = model.config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    full_layers = text.num_hidden_layers - len(linear_attention_layers(text))
    return 2 * full_layers * text.num_key_value_heads * head_dim * model.dtype.itemsize


def state_bytes_per_row(model) -> int:
    """The linear-attention layers' conv and recurrent states of one sequence, each read and
    written once a step (none for a model of full attention only)."""
    text = model.config.get_text_config(decoder=True)
    layers = linear_attention_layers(text)
    if not layers:
        return 0
    conv, recurrent = linear_state_shapes(text)
    per_layer = math.prod(conv) * model.dtype.itemsize + math.prod(recurrent) * 4  # the recurrence in fp32
    return 2 * len(layers) * per_layer


def table(results: list[dict]) -> str:
    floor_column = "floor ms (weights + KV attended + linear states)"
    header = ["preset", "batch", "step", "replay ms", "kernels", "kernel ms", floor_column, "vs floor"]
    rows = []
    for result in results:
        for bucket in BUCKETS:
            floor = result["floor_ms"][str(bucket)]
            for name, variant in result["variants"].items():
                row = variant["buckets"][bucket]
                rows.append(
                    [
                        result["preset"],
                        str(bucket),
                        name,
                        f"{row['replay_ms']:.2f}",
                        str(row["kernels"]),
                        f"{row['kernel_ms']:.2f}",
                        f"{floor:.2f}",
                        f"{row['replay_ms'] / floor:.1f}x",
                    ]
                )
    return markdown_table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", help="comma-separated (default: qwen2.5-vl-3b,qwen3-vl-2b; --quick: the first)")
    parser.add_argument("--quick", action="store_true", help="qwen2.5-vl-3b only")
    parser.add_argument("--tier", type=int, default=512, help="KV slots each step attends over")
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args()
    bandwidth = copy_bandwidth_gbps() * 1e9
    results = []
    presets = args.presets or ("qwen2.5-vl-3b" if args.quick else "qwen2.5-vl-3b,qwen3-vl-2b")
    for preset in presets.split(","):
        model = build_model(preset, dtype=torch.bfloat16, device="cuda")
        weights = weight_bytes_per_step(model)
        kv = kv_bytes_per_slot(model) * slots_attended(args.tier - STEPS_ROOM) + state_bytes_per_row(model)
        fusable = DecodeStack.supports(model)  # else only the model's own forward (Qwen3.5's hybrid layers)
        variants = {name: measure(model, args.tier, *how) for name, how in VARIANTS.items() if fusable or not how[0]}
        results.append(
            {
                "preset": preset,
                "tier": args.tier,
                "slots_attended": slots_attended(args.tier - STEPS_ROOM),
                "weight_bytes_per_step": weights,
                "weights_floor_ms": 1000 * weights / bandwidth,
                "floor_ms": {str(b): 1000 * (weights + b * kv) / bandwidth for b in BUCKETS},
                "variants": variants,
            }
        )
        del model
        torch.cuda.empty_cache()
    env = environment()
    print(f"\ndecode step, one replay, tier {args.tier} | {env} | copy {bandwidth / 1e9:.0f} GB/s")
    print(table(results))
    for result in results:
        for name, variant in result["variants"].items():
            print(
                f"{result['preset']} {name}: setup {variant['setup_s']:.1f} s"
                + (f", compile {variant['compile']}" if "compile" in variant else "")
            )
            top = variant["buckets"][1]["top"]
            print(
                "  batch 1, costliest kernels: " + "; ".join(f"{k['name']} x{k['count']} {k['ms']:.2f} ms" for k in top)
            )
    write_json(args.json, {"environment": env, "copy_gbps": bandwidth / 1e9, "results": results})


if __name__ == "__main__":
    main()
