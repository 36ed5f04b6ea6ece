"""DeepSeek-OCR 2's encoder over pages (`get_image_features`: each page's 1024 px view and its 0 to
6 tiles of 768 px, through SAM ViT-B, the Qwen2-shaped encoder and the projector), real-size
config with random weights, bf16.

Columns: stock transformers (SAM's relative positions as a materialised [tokens, tokens] bias
handed to sdpa); ours with graphs off (the relative positions folded into q and k:
`encoder_graphs/attention/rel_pos.py`); ours with graphs, each sub-batch replayed or run eagerly by the
costs measured at capture (the manager's default); ours replaying wherever a budget fits; the
FLOP floor at the measured matmul rate. The three "ours" columns are timed interleaved
(`timing.time_interleaved`). Run on a CUDA machine:
    python3 benchmarks/bench_encoder_pages.py [--preset deepseek-ocr-2] [--quick] [--json out.json]
"""

import argparse
import random
from functools import partial

import torch
from bench_encoder import time_managers
from timing import environment, markdown_table, matmul_tflops, time_calls, write_json

from encoder_graphs import EncoderCudaGraphManager
from encoder_graphs.models import adapter_for
from encoder_graphs.models.deepseek_ocr.adapter import TILE_SIDE, VIEW_SIDE, Pages
from encoder_graphs.presets import build_model
from encoder_graphs.rewrites import Rewrites

COLUMNS = ("stock", "graphs_off", "graphs", "graphs_always")


def workloads() -> dict[str, list[int]]:
    """Tiles per page: 0 for a page under one tile, else 2 to 6."""
    rng = random.Random(0)
    return {
        "1 page, no tiles": [0],
        "1 page, 6 tiles": [6],
        "4 pages, 0-6 tiles": [0, 2, 4, 6],
        "16 pages, mixed": [rng.choice([0, 2, 3, 4, 6]) for _ in range(16)],
    }


def linear_params(module: torch.nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)))


def image_flops(model: torch.nn.Module, side: int) -> float:
    """Matmul FLOPs of one view or tile of `side` px: SAM's linears on every patch (windows'
    padding left out), its attention (global layers over the whole grid, the others within
    14 x 14 windows), the neck's and the downsampling convs at their grids, the encoder's linears
    and attention over its patches and as many queries, the projector on the queries."""
    tower = model.model.vision_tower
    sam, encoder = tower.sam_encoder, tower.vision_encoder
    config, width = sam.config, sam.config.hidden_size
    tokens = (side // config.patch_size) ** 2
    globals_ = len(config.global_attn_indexes)
    windows = config.num_hidden_layers - globals_
    attention = 4 * width * (globals_ * tokens**2 + windows * tokens * config.window_size**2)
    sam_flops = 2 * tokens * (linear_params(sam.layers) + linear_params(sam.patch_embed)) + attention
    necks = 2 * tokens * linear_params(sam.neck) + 2 * (tokens // 4) * linear_params(sam.proj.conv1)
    queries = tokens // 16
    necks += 2 * queries * linear_params(sam.proj.conv2)
    sequence = 2 * queries
    hidden = encoder.config.hidden_size
    encoder_flops = 2 * sequence * linear_params(encoder.layers) + 4 * hidden * sequence**2 * len(encoder.layers)
    projector = 2 * queries * linear_params(model.model.multi_modal_projector)
    return sam_flops + necks + encoder_flops + projector


def pages(tiles: list[int]) -> Pages:
    views = torch.randn(len(tiles), 3, VIEW_SIDE, VIEW_SIDE, device="cuda", dtype=torch.bfloat16)
    local = torch.randn(sum(tiles), 3, TILE_SIDE, TILE_SIDE, device="cuda", dtype=torch.bfloat16)
    return Pages(views, local, tiles)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="deepseek-ocr-2")
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args()
    warmup, iters = (3, 10) if args.quick else (10, 50)
    rate = matmul_tflops()
    model = build_model(args.preset, dtype=torch.bfloat16, device="cuda")
    inner = model.model
    cases = {name: pages(tiles) for name, tiles in workloads().items()}
    timed: dict[str, dict] = {name: {} for name in cases}
    with torch.inference_mode():  # stock first, before our rewrites
        for name, call in cases.items():
            local = call.tiles if call.tiles.shape[0] else None
            counts = torch.tensor(call.tiles_per_page)
            stock = partial(inner.get_image_features, call.views, local, counts)
            timed[name]["stock"] = time_calls(stock, warmup, iters)
    adapter = adapter_for(model)
    adapter.align_weights(Rewrites())  # for the rest of the process
    managers = {"graphs_off": EncoderCudaGraphManager(adapter, enabled=False),
                "graphs": EncoderCudaGraphManager(adapter),
                "graphs_always": EncoderCudaGraphManager(adapter, choose_by_cost=False)}
    time_managers(managers, cases, timed, warmup, iters)
    rows, results = [], []
    for name, tiles in workloads().items():
        ms = timed[name]
        flops = len(tiles) * image_flops(model, VIEW_SIDE) + sum(tiles) * image_flops(model, TILE_SIDE)
        floor_ms = flops / rate / 1e9  # rate in TFLOP/s
        with torch.inference_mode():
            managers["graphs"].reset_stats()
            managers["graphs"].execute(cases[name])
        paths = managers["graphs"].stats()["paths"]
        replayed = {path: f"{stats['hits']}/{stats['hits'] + stats['misses']}" for path, stats in paths.items()}
        results.append({"workload": name, "tiles_per_page": tiles, "ms": ms, "floor_ms": floor_ms,
                        "replayed": replayed})
        rows.append([name, *(f"{ms[k]['mean']:.1f}" for k in COLUMNS), f"{floor_ms:.1f}",
                     f"{ms['graphs']['mean'] / floor_ms:.1f}x", " ".join(f"{p} {r}" for p, r in replayed.items()),
                     f"{ms['stock']['mean'] / ms['graphs']['mean']:.1f}x"])
    env = environment()
    costs = managers["graphs"].stats()["budget_costs_ms"]
    print(f"\n{args.preset} get_image_features over pages, bf16, random weights | {env} | matmul {rate:.0f} TFLOP/s")
    print(markdown_table(["workload", "stock HF ms (mean)", "ours, graphs off", "ours, graphs (by cost)",
                          "ours, always replay", "FLOP floor ms", "graphs / floor", "replayed (by cost)",
                          "graphs vs stock"], rows))
    write_json(args.json, {"preset": args.preset, "environment": env, "matmul_tflops": rate, "results": results,
                           "budget_costs_ms": costs})


if __name__ == "__main__":
    main()
