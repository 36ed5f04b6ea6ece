"""Vision-tower latency: stock transformers vs encoder-graphs, on real-size configs with random weights.

Columns: stock transformers (its default attention), stock transformers through our varlen
attention, ours with graphs, ours with graphs off, the FLOP floor at the measured matmul rate, and
the padding waste of the graphed run. Both "ours" columns run with the adapter's exact weight
alignment (Qwen2.5-VL's MLP padded from 3420 to 3424); both "stock" columns on the original weights. Run on a CUDA machine:
    python3 benchmarks/bench_encoder.py [--preset qwen2.5-vl-7b] [--quick] [--json out.json]
"""

import argparse
import random

import torch
from timing import environment, markdown_table, matmul_tflops, time_calls, write_json

from encoder_graphs import EncoderCudaGraphManager
from encoder_graphs.models import VisionBatch, adapter_for
from encoder_graphs.models.presets import build_vision_tower
from encoder_graphs.models.transformers_seam import attention_implementation, register_varlen_attention

Grid = tuple[int, int, int]


def image_grid(height: int, width: int, unit: int) -> Grid:
    """(t, h, w) in patches of an image resized to multiples of `unit` pixels."""
    return (1, round(height / unit) * 2, round(width / unit) * 2)


def workloads(unit: int, patch: int) -> dict[str, list[Grid]]:
    rng = random.Random(0)
    mixed = [image_grid(rng.randint(224, 1024), rng.randint(224, 1024), unit) for _ in range(8)]
    video_side = 448 // patch
    return {
        "1 image 224²": [image_grid(224, 224, unit)],
        "1 image 448²": [image_grid(448, 448, unit)],
        "8 images mixed 224-1024": mixed,
        "20 images 336²": [image_grid(336, 336, unit)] * 20,
        "1 video 16x448²": [(8, video_side, video_side)],  # 16 frames, temporal patch 2
    }


def flops(tower: torch.nn.Module, grids: list[Grid]) -> float:
    """Matmul FLOPs of one forward: every block linear on every patch, the merger on merged
    tokens, and attention scores over each frame (windows where the tower uses them)."""
    config = tower.config
    patches = sum(t * h * w for t, h, w in grids)
    merged = patches // config.spatial_merge_size**2
    block_params = sum(m.weight.numel() for m in tower.blocks.modules() if isinstance(m, torch.nn.Linear))
    merger_params = sum(m.weight.numel() for m in tower.merger.modules() if isinstance(m, torch.nn.Linear))
    embed_params = tower.patch_embed.proj.weight.numel()
    total = 2 * patches * (block_params + embed_params) + 2 * merged * merger_params
    width = config.hidden_size
    window = getattr(config, "window_size", 0) // config.patch_size
    full_blocks = set(getattr(config, "fullatt_block_indexes", range(len(tower.blocks))))
    for index in range(len(tower.blocks)):
        for t, h, w in grids:
            if index in full_blocks or not window:
                total += 4 * t * (h * w) ** 2 * width
            else:
                total += 4 * t * h * w * window * window * width
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="qwen2.5-vl-7b")
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args()
    warmup, iters = (5, 20) if args.quick else (10, 100)

    tower = build_vision_tower(args.preset, dtype=torch.bfloat16, device="cuda")
    config = tower.config
    unit = config.patch_size * config.spatial_merge_size
    patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size**2
    varlen = register_varlen_attention("torch")
    rate = matmul_tflops()
    cases = {}
    for name, grids in workloads(unit, config.patch_size).items():
        patches = sum(t * h * w for t, h, w in grids)
        pixels = torch.randn(patches, patch_dim, device="cuda", dtype=torch.bfloat16)
        grid_thw = torch.tensor(grids, device="cuda")
        cases[name] = (grids, pixels, grid_thw)

    timed: dict[str, dict] = {name: {} for name in cases}
    with torch.inference_mode():  # stock transformers first, on the model's own weights
        for name, (_, pixels, grid_thw) in cases.items():
            timed[name]["stock"] = time_calls(lambda: tower(pixels, grid_thw=grid_thw), warmup, iters)
            with attention_implementation(tower.config, varlen):
                timed[name]["stock_varlen"] = time_calls(
                    lambda: tower(pixels, grid_thw=grid_thw), warmup, iters
                )
    adapter = adapter_for(tower, attn_backend="torch")
    adapter.align_weights()
    graphs = EncoderCudaGraphManager(adapter)
    graphs.capture()
    eager = EncoderCudaGraphManager(adapter, enabled=False)
    rows, results = [], []
    for name, (grids, pixels, grid_thw) in cases.items():
        batch = VisionBatch(pixel_values=pixels, image_grid_thw=grid_thw)
        with torch.inference_mode():
            timed[name]["graphs"] = time_calls(lambda: graphs.execute(batch), warmup, iters)
            timed[name]["graphs_off"] = time_calls(lambda: eager.execute(batch), warmup, iters)
            graphs.reset_stats()
            graphs.execute(batch)
        stats = graphs.stats()
        floor_ms = flops(tower, grids) / (rate * 1e12) * 1000
        waste = stats["paths"]["default"]["waste_pct"]
        ms = timed[name]
        results.append({"workload": name, "patches": sum(t * h * w for t, h, w in grids), "ms": ms,
                        "floor_ms": floor_ms, "waste_pct": waste, "graph_items": stats["graph_items"],
                        "items": stats["items"]})
        speedup = ms["stock"]["mean"] / ms["graphs"]["mean"]
        rows.append([name, *(f"{ms[k]['mean']:.1f} / {ms[k]['p50']:.1f} / {ms[k]['p99']:.1f}"
                             for k in ("stock", "stock_varlen", "graphs", "graphs_off")),
                     f"{floor_ms:.1f}", f"{waste:.0f}%", f"{speedup:.1f}x"])
    env = environment()
    capture = graphs.stats()
    print(f"\n{args.preset} vision tower, bf16, random weights | {env} | matmul {rate:.0f} TFLOP/s | "
          f"capture {capture['capture_seconds']:.1f} s, {capture['graph_memory_bytes'] / 2**30:.2f} GiB, "
          f"budgets {capture['captured_budgets']['default']}")
    print(markdown_table(
        ["workload", "stock HF ms (mean/p50/p99)", "stock HF + varlen", "ours, graphs", "ours, graphs off",
         "FLOP floor ms", "padding waste", "graphs vs stock"], rows))
    write_json(args.json, {"preset": args.preset, "environment": env, "matmul_tflops": rate,
                           "capture": {k: capture[k] for k in ("capture_seconds", "graph_memory_bytes", "captured_budgets")},
                           "results": results})


if __name__ == "__main__":
    main()
