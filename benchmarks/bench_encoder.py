"""Vision-tower latency: stock transformers vs encoder-graphs, on real-size configs with random weights.

Columns: stock transformers (its default attention), stock transformers through our varlen
attention (InternVL: our dense FA2), ours with graphs and with graphs off (our eager path) with the
blocks compiled (`torch.compile`, what the caption command runs on a GPU) and uncompiled, the FLOP
floor at the measured matmul rate, and the padding waste of the graphed run. The graphed columns
choose graph or eager per sub-batch by the costs measured at capture (the manager's default).
Graphs and graphs off are timed interleaved (`timing.time_interleaved`). Each row repeats one
batch, so from its second call the adapter's metadata comes from its cache; "graphs, new sizes"
(Qwen rows) empties that cache before every call: a batch of sizes never seen before. The "ours"
columns run with the adapter's exact weight changes (Qwen2.5-VL's MLP padded from 3420 to 3424,
the patch embedding as a GEMM); both "stock" columns on the original weights. InternVL rows time the whole `get_image_features` (InternViT, pixel
shuffle, projector) over tiles. Run on a CUDA machine:
    python3 benchmarks/bench_encoder.py [--preset qwen2.5-vl-7b] [--internvl internvl3-1b] [--quick] [--json out.json]
"""

import argparse
import random
from functools import partial

import torch
from timing import environment, markdown_table, matmul_tflops, time_calls, time_interleaved, write_json

from encoder_graphs import EncoderCudaGraphManager
from encoder_graphs.engine.compile import compile_blocks
from encoder_graphs.models import VisionBatch, adapter_for
from encoder_graphs.presets import build_model, build_vision_tower
from encoder_graphs.rewrites import Rewrites
from encoder_graphs.seam.attention import (
    attention_implementation,
    register_dense_attention,
    register_varlen_attention,
)

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


def internvl_workloads() -> dict[str, list[int]]:
    """Tiles per item: an image is 1..12 tiles plus a thumbnail, a video frame one tile."""
    rng = random.Random(0)
    return {
        "1 image, 1 tile": [1],
        "1 image, 13 tiles": [13],
        "8 images, mixed tiles": [rng.choice([1, 3, 5, 7, 9, 13]) for _ in range(8)],
        "1 video, 16 frames": [1] * 16,
    }


def internvl_flops(model: torch.nn.Module, tiles: int) -> float:
    """Matmul FLOPs of get_image_features: every InternViT linear on every token (CLS + patches),
    attention within each tile, the projector on the shuffled tokens."""
    vision = model.config.vision_config
    tokens = (vision.image_size[0] // vision.patch_size[0]) ** 2 + 1
    tower = model.model.vision_tower
    layer_params = sum(m.weight.numel() for m in tower.encoder.modules() if isinstance(m, torch.nn.Linear))
    embed = tower.embeddings.patch_embeddings.projection.weight.numel()
    projector = sum(m.weight.numel() for m in model.model.multi_modal_projector.modules() if isinstance(m, torch.nn.Linear))
    attention = 4 * tokens**2 * vision.hidden_size * vision.num_hidden_layers
    return tiles * (2 * tokens * (layer_params + embed) + attention + 2 * model.config.image_seq_length * projector)


def run_internvl(preset: str, rate: float, warmup: int, iters: int) -> tuple[list[list[str]], dict]:
    model = build_model(preset, dtype=torch.bfloat16, device="cuda")
    inner = model.model
    side = model.config.vision_config.image_size[0]
    stock = lambda pixels: type(inner).get_image_features(inner, pixels, return_dict=True)  # noqa: E731
    dense = register_dense_attention("torch")
    cases = {name: torch.randn(sum(items), 3, side, side, device="cuda", dtype=torch.bfloat16)
             for name, items in internvl_workloads().items()}
    timed: dict[str, dict] = {name: {} for name in cases}
    with torch.inference_mode():
        for name, pixels in cases.items():
            timed[name]["stock"] = time_calls(lambda: stock(pixels), warmup, iters)
            with attention_implementation(model.config.vision_config, dense):
                timed[name]["stock_varlen"] = time_calls(lambda: stock(pixels), warmup, iters)
    adapter = adapter_for(model)
    uncompiled = {"graphs_uncompiled": EncoderCudaGraphManager(adapter),
                  "graphs_fa2": EncoderCudaGraphManager(adapter_for(model, attn_backend="torch")),
                  "graphs_off_uncompiled": EncoderCudaGraphManager(adapter, enabled=False)}
    time_managers(uncompiled, cases, timed, warmup, iters)
    for manager in uncompiled.values():
        manager.close()
    torch.cuda.empty_cache()
    managers = {"graphs": EncoderCudaGraphManager(adapter), "graphs_off": EncoderCudaGraphManager(adapter, enabled=False)}
    compiling = Rewrites()
    compiled = compile_blocks(adapter.repeated_blocks(), managers["graphs"].warm_up, compiling)
    time_managers(managers, cases, timed, warmup, iters)
    compiling.undo()
    rows, results = [], []
    for name, items in internvl_workloads().items():
        ms = timed[name]
        with torch.inference_mode():
            managers["graphs"].reset_stats()
            managers["graphs"].execute(cases[name])
        stats = managers["graphs"].stats()
        floor_ms = internvl_flops(model, sum(items)) / (rate * 1e12) * 1000
        waste = stats["paths"]["tiles"]["waste_pct"]
        results.append({"workload": name, "tiles": sum(items), "ms": ms, "floor_ms": floor_ms, "waste_pct": waste,
                        "graph_items": stats["graph_items"], "items": stats["items"]})
        rows.append([name, *(f"{ms[k]['mean']:.1f}" for k in INTERNVL_COLUMNS),
                     f"{floor_ms:.1f}", f"{waste:.0f}%", f"{ms['stock']['mean'] / ms['graphs']['mean']:.1f}x"])
    summary = {"preset": preset, "results": results, "capture": capture_summary(managers["graphs"], compiled)}
    return rows, summary


QWEN_COLUMNS = ("stock", "stock_varlen", "graphs", "graphs_new_sizes", "graphs_off", "graphs_uncompiled",
                "graphs_off_uncompiled")
INTERNVL_COLUMNS = ("stock", "stock_varlen", "graphs", "graphs_off", "graphs_uncompiled", "graphs_fa2",
                    "graphs_off_uncompiled")


def time_managers(managers: dict, cases: dict, timed: dict, warmup: int, iters: int) -> None:
    """Capture the managers, then time them on every case (its inputs are the case's value),
    interleaved: graphs against graphs off is the comparison the never-slower target reads."""
    for manager in managers.values():
        manager.capture()
    with torch.inference_mode():
        for name, inputs in cases.items():
            calls = {key: partial(manager.execute, inputs) for key, manager in managers.items()}
            timed[name].update(time_interleaved(calls, warmup, iters))


def capture_summary(manager: EncoderCudaGraphManager, compiled) -> dict:
    stats = manager.stats()
    return {**{k: stats[k] for k in ("capture_seconds", "graph_memory_bytes", "captured_budgets", "budget_costs_ms")},
            "compile_seconds": compiled.seconds, "compile_error": compiled.error}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="qwen2.5-vl-7b", help="Qwen-VL preset for the patch rows ('' for none)")
    parser.add_argument("--internvl", default="internvl3-1b", help="InternVL preset for the tile rows ('' for none)")
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args()
    warmup, iters = (5, 20) if args.quick else (10, 100)
    rate = matmul_tflops()
    payload = run_qwen(args.preset, rate, warmup, iters) if args.preset else {"matmul_tflops": rate}
    torch.cuda.empty_cache()
    if args.internvl:
        internvl_rows, payload["internvl"] = run_internvl(args.internvl, rate, warmup, iters)
        capture = payload["internvl"]["capture"]
        print(f"\n{args.internvl} get_image_features, bf16, random weights | compile {capture['compile_seconds']:.1f} s, "
              f"capture {capture['capture_seconds']:.1f} s, {capture['graph_memory_bytes'] / 2**30:.2f} GiB, "
              f"budgets (tiles) {capture['captured_budgets']['tiles']}")
        print(markdown_table(
            ["workload", "stock HF ms (mean)", "stock HF + dense FA2", "ours, graphs", "ours, graphs off",
             "graphs, uncompiled", "graphs (dense FA2), uncompiled", "graphs off, uncompiled", "FLOP floor ms",
             "padding waste", "graphs vs stock"],
            internvl_rows))
    write_json(args.json, payload)


def run_qwen(preset: str, rate: float, warmup: int, iters: int) -> dict:
    """The Qwen-VL rows: prints their table, returns the JSON payload."""
    tower = build_vision_tower(preset, dtype=torch.bfloat16, device="cuda")
    config = tower.config
    unit = config.patch_size * config.spatial_merge_size
    patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size**2
    varlen = register_varlen_attention("torch")
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
    rewrites = Rewrites()
    adapter.align_weights(rewrites)
    batches = {name: VisionBatch(pixel_values=pixels, image_grid_thw=grid_thw) for name, (_, pixels, grid_thw) in cases.items()}
    uncompiled = {"graphs_uncompiled": EncoderCudaGraphManager(adapter),
                  "graphs_off_uncompiled": EncoderCudaGraphManager(adapter, enabled=False)}
    time_managers(uncompiled, batches, timed, warmup, iters)
    for manager in uncompiled.values():
        manager.close()
    torch.cuda.empty_cache()
    graphs = EncoderCudaGraphManager(adapter)
    compiling = Rewrites()
    compiled = compile_blocks(adapter.repeated_blocks(), graphs.warm_up, compiling)
    time_managers({"graphs": graphs, "graphs_off": EncoderCudaGraphManager(adapter, enabled=False)}, batches, timed,
                  warmup, iters)
    with torch.inference_mode():  # sizes never seen before: the adapter's metadata built and copied anew
        for name, batch in batches.items():
            timed[name]["graphs_new_sizes"] = time_calls(
                lambda: (adapter._metadata.clear(), graphs.execute(batch)), warmup, iters  # noqa: B023
            )
    compiling.undo()
    rows, results = [], []
    for name, (grids, pixels, grid_thw) in cases.items():
        batch = batches[name]
        with torch.inference_mode():
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
        rows.append([name, *(f"{ms[k]['mean']:.1f}" for k in QWEN_COLUMNS), f"{floor_ms:.1f}",
                     f"{ms['graphs']['mean'] / floor_ms:.1f}x", f"{waste:.0f}%", f"{speedup:.1f}x"])
    env = environment()
    capture = capture_summary(graphs, compiled)
    print(f"\n{preset} vision tower, bf16, random weights | {env} | matmul {rate:.0f} TFLOP/s | "
          f"compile {capture['compile_seconds']:.1f} s, capture {capture['capture_seconds']:.1f} s, "
          f"{capture['graph_memory_bytes'] / 2**30:.2f} GiB, budgets {capture['captured_budgets']['default']}")
    print(markdown_table(
        ["workload", "stock HF ms (mean)", "stock HF + varlen", "ours, graphs", "graphs, new sizes",
         "ours, graphs off", "graphs, uncompiled", "graphs off, uncompiled", "FLOP floor ms", "graphs / floor", "padding waste",
         "graphs vs stock"], rows))
    return {"preset": preset, "environment": env, "matmul_tflops": rate, "capture": capture, "results": results}


if __name__ == "__main__":
    main()
