"""Captioning throughput: stock `generate` vs encoder + decoder graphs, on a real-size preset with
random weights.

A folder of synthetic images (fixed seed, 224-1024 px sides, mixed aspect ratios, PNG and JPEG)
is captioned in folder order at a fixed batch size, exactly `--new-tokens` tokens per image (an
EOS id outside the vocabulary), first by the stock `model.generate`, then by the same call after
`enable_cuda_graphs(model)` on the same model. Inputs are built before timing (presets have no
tokenizer: random text ids around the image placeholders, pixels from the Qwen2-VL image
processor, or for InternVL the tiles of its own tiling processor), so the timed part is `generate`
alone. Then decode ms/token at batch 1 and 8, derived
the same way on both sides as (generate of 1 + N tokens - generate of 1 token) / N, against the
weight-bytes floor (text-stack and lm_head weights read once per step at the measured copy rate).
Last, ours alone at growing batch sizes (`--sweep`), over the folder in its order and in the
caption command's order (windows of 4 batches, largest images first): where throughput stops
growing, where each batch's time goes (encoder, decode loop, the rest: prefill), against a floor
per image of (vision FLOPs + language-model prefill FLOPs) / measured matmul rate + new tokens x
weight bytes / batch size / measured copy rate; the best is `best`.
    python3 benchmarks/bench_caption.py [--preset qwen2.5-vl-3b | internvl3.5-2b] [--quick] [--json out.json]
    python3 benchmarks/bench_caption.py --preset tiny-qwen2-vl --images 8 --device cpu   # smoke run
"""

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from itertools import product
from pathlib import Path

import numpy as np
import torch
from bench_encoder import flops, internvl_flops
from PIL import Image
from synthetic_prompts import Grid, image_prompt, left_pad, mm_token_type_ids, tile_prompt
from timing import copy_bandwidth_gbps, environment, markdown_table, matmul_tflops, write_json
from transformers import GotOcr2ImageProcessorPil, PretrainedConfig, PreTrainedModel, Qwen2VLImageProcessorPil

from encoder_graphs import enable_cuda_graphs
from encoder_graphs.engine.stats import latency_summary
from encoder_graphs.presets import build_model

Batch = dict[str, torch.Tensor]
DECODE_BATCHES = (1, 8)
DECODE_SIDE = 448  # px, the image of each decode-benchmark prompt


def write_images(folder: Path, count: int, seed: int = 0) -> list[Path]:
    """Smooth synthetic images (gradients and boxes), alternately PNG and JPEG."""
    rng = random.Random(seed)
    paths = []
    for index in range(count):
        width, height = rng.randint(224, 1024), rng.randint(224, 1024)
        paths.append(folder / f"image_{index:04d}.{'png' if index % 2 else 'jpg'}")
        synthetic_image(width, height, rng).save(paths[-1])
    return paths


def synthetic_image(width: int, height: int, rng: random.Random) -> Image.Image:
    x = np.linspace(0, 1, width, dtype=np.float32)[None, :, None]
    y = np.linspace(0, 1, height, dtype=np.float32)[:, None, None]
    colors = np.array([[rng.random() for _ in range(3)] for _ in range(3)], dtype=np.float32)
    pixels = colors[0] * x + colors[1] * y + colors[2] * (1 - x) * (1 - y)
    image = Image.fromarray((255 * pixels.clip(0, 1)).astype(np.uint8))
    for _ in range(4):
        left, top = rng.randrange(width), rng.randrange(height)
        box = (left, top, rng.randint(left, width), rng.randint(top, height))
        image.paste(tuple(rng.randrange(256) for _ in range(3)), box)
    return image


class PromptBuilder:
    """`generate` inputs by hand: random text ids, <vision_start>, image pads, <vision_end>, text."""

    def __init__(self, config: PretrainedConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        vision = config.vision_config
        self.processor = Qwen2VLImageProcessorPil(
            patch_size=vision.patch_size,
            merge_size=vision.spatial_merge_size,
            temporal_patch_size=vision.temporal_patch_size,
        )
        self.rng = torch.Generator().manual_seed(seed)

    def prompt(self, image: Image.Image) -> tuple[list[int], torch.Tensor, Grid]:
        out = self.processor(images=[image.convert("RGB")], return_tensors="np")
        t, h, w = (int(v) for v in out["image_grid_thw"][0])
        ids = image_prompt(self.config, (t, h, w), 8, 12, self.rng)
        return ids, torch.from_numpy(out["pixel_values"]), (t, h, w)

    def batch(self, images: list[Image.Image]) -> Batch:
        """Left-padded (token 0, mask 0), on the device."""
        ids, pixels, grids = zip(*(self.prompt(image) for image in images), strict=True)
        batch = left_pad(list(ids))
        batch["mm_token_type_ids"] = mm_token_type_ids(batch["input_ids"], self.config)
        batch["pixel_values"] = torch.cat(pixels).to(self.dtype)
        batch["image_grid_thw"] = torch.tensor(grids)
        return {key: value.to(self.device) for key, value in batch.items()}


class TilePromptBuilder:
    """InternVL inputs by hand: random text ids around `image_seq_length` image tokens per tile;
    tiles from the processor's own tiling (up to 12 and a thumbnail, ImageNet normalisation)."""

    def __init__(self, config: PretrainedConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        side = config.vision_config.image_size[0]
        self.processor = GotOcr2ImageProcessorPil(
            size={"height": side, "width": side},
            crop_to_patches=True,
            max_patches=12,
            image_mean=[0.485, 0.456, 0.406],
            image_std=[0.229, 0.224, 0.225],
        )
        self.rng = torch.Generator().manual_seed(seed)

    def batch(self, images: list[Image.Image]) -> Batch:
        """Left-padded (token 0, mask 0), on the device; every tile of the batch in prompt order."""
        tiles = [self.processor(images=[image.convert("RGB")], return_tensors="pt")["pixel_values"] for image in images]
        batch = left_pad([tile_prompt(self.config, len(t), 8, 12, self.rng) for t in tiles])
        batch["pixel_values"] = torch.cat(tiles).to(self.dtype)
        return {key: value.to(self.device) for key, value in batch.items()}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate(model: PreTrainedModel, batch: Batch, new_tokens: int, **settings: object) -> torch.Tensor:
    """Exactly `new_tokens` greedy tokens per row: the EOS id lies outside the vocabulary."""
    vocab_size = model.get_output_embeddings().weight.shape[0]
    out = model.generate(
        **batch, do_sample=False, max_new_tokens=new_tokens, eos_token_id=vocab_size, pad_token_id=0, **settings
    )
    generated = out[:, batch["input_ids"].shape[1] :]
    if generated.shape[1] != new_tokens:
        raise RuntimeError(f"generate returned {generated.shape[1]} new tokens, expected {new_tokens}")
    return generated


def caption_run(
    model: PreTrainedModel, batches: list[Batch], new_tokens: int, device: torch.device, **settings: object
) -> tuple[dict, torch.Tensor]:
    """One warm-up batch, then every batch timed on the host clock, synchronised after each.
    `settings`: more `generate` settings (transformers' static cache, which it compiles)."""
    generate(model, batches[0], new_tokens, **settings)
    batch_ms, outputs = [], []
    synchronize(device)
    started = time.perf_counter()
    for batch in batches:
        begun = time.perf_counter()
        outputs.append(generate(model, batch, new_tokens, **settings))
        synchronize(device)
        batch_ms.append(1000 * (time.perf_counter() - begun))
    wall_s = time.perf_counter() - started
    sizes = [len(batch["input_ids"]) for batch in batches]
    result = {
        "wall_s": wall_s,
        "images_per_s": sum(sizes) / wall_s,
        "tokens_per_s": sum(sizes) * new_tokens / wall_s,
        "batch_ms": latency_summary(batch_ms),
        "image_ms_mean": statistics.fmean(ms / size for ms, size in zip(batch_ms, sizes, strict=True)),
    }
    return result, torch.cat(outputs)


def wall_ms(fn: Callable[[], object], device: torch.device) -> float:
    synchronize(device)
    begun = time.perf_counter()
    fn()
    synchronize(device)
    return 1000 * (time.perf_counter() - begun)


def decode_ms_per_token(
    model: PreTrainedModel, batch: Batch, new_tokens: int, reps: int, device: torch.device
) -> float:
    """Decode cost alone: the prefill and the first token cancel out of the difference of the two
    calls' medians. The calls alternate (after one of each to warm up), so that drift in clocks
    or temperature weighs on both alike: the difference is a few percent of either call."""
    calls = {"full": lambda: generate(model, batch, 1 + new_tokens), "prefill": lambda: generate(model, batch, 1)}
    times: dict[str, list[float]] = {name: [] for name in calls}
    for rep in range(reps + 1):
        for name, call in calls.items():
            ms = wall_ms(call, device)
            if rep:
                times[name].append(ms)
    return (statistics.median(times["full"]) - statistics.median(times["prefill"])) / new_tokens


def weight_bytes_per_step(model: PreTrainedModel) -> int:
    """Bytes every decode step must read: the text stack without its embedding table (one row
    per token) plus the lm_head, counted once when tied."""
    embedding = model.get_input_embeddings().weight
    tensors = {id(p): p for p in model.get_decoder().parameters() if p is not embedding}
    lm_head = model.get_output_embeddings().weight
    tensors[id(lm_head)] = lm_head
    return sum(p.numel() * p.element_size() for p in tensors.values())


def prefill_flops(model: PreTrainedModel, batch: Batch) -> float:
    """Matmul FLOPs of the language model's prefill over the real (unpadded) prompt tokens:
    every text-stack linear on every token, causal attention scores, the lm_head on the last."""
    text = model.config.get_text_config()
    linear = sum(m.weight.numel() for m in model.get_decoder().modules() if isinstance(m, torch.nn.Linear))
    lm_head = model.get_output_embeddings().weight.numel()
    width = text.num_attention_heads * getattr(text, "head_dim", text.hidden_size // text.num_attention_heads)
    return sum(2 * n * linear + 2 * text.num_hidden_layers * n * n * width + 2 * lm_head
               for n in batch["attention_mask"].sum(1).tolist())


def vision_flops(model: PreTrainedModel, batch: Batch) -> float:
    if model.config.model_type == "internvl":
        return internvl_flops(model, batch["pixel_values"].shape[0])
    return flops(model.model.visual, [tuple(g) for g in batch["image_grid_thw"].tolist()])


def window_order(images: list, size: int, windows: int = 4) -> list:
    """The caption command's order: the folder cut into windows of `windows` batches, each
    window largest image first (area for cost: the processor keeps the aspect ratio)."""
    span = size * windows
    return [image for start in range(0, len(images), span)
            for image in sorted(images[start : start + span], key=lambda im: im.width * im.height, reverse=True)]


def sweep(handle, builder, images: list, sizes: list[int], new_tokens: int, device: torch.device,
          weight_bytes: int) -> tuple[list[dict], dict]:
    """Ours at each batch size over `images`, in folder order and in the caption command's
    windows: throughput, peak memory, the floor and where each batch's time went; the best."""
    model = handle.model
    rate, bandwidth = matmul_tflops() * 1e12, copy_bandwidth_gbps() * 1e9
    rows = []
    for size, order in product(sizes, ("folder", "windows")):
        ordered = images if order == "folder" else window_order(images, size)
        batches = [builder.batch(ordered[i : i + size]) for i in range(0, len(ordered), size)]
        compute_s = sum(vision_flops(model, b) + prefill_flops(model, b) for b in batches) / rate / len(images)
        floor_s = compute_s + new_tokens * weight_bytes / size / bandwidth
        torch.cuda.reset_peak_memory_stats(device)
        handle.manager.reset_stats()
        handle.decoder.reset_stats()
        run, _ = caption_run(model, batches, new_tokens, device)
        masks = [b["attention_mask"] for b in batches]
        padding = 100 * (1 - sum(int(m.sum()) for m in masks) / sum(m.numel() for m in masks))
        rows.append({"batch_size": size, "order": order, "images_per_s": run["images_per_s"],
                     "floor_images_per_s": 1 / floor_s, "prompt_padding_pct": padding,
                     "compute_floor_ms_per_image": 1000 * compute_s,
                     "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30, "batch_ms": run["batch_ms"],
                     "stage_ms_per_batch": stage_ms(handle, run["batch_ms"]["mean"], len(batches) + 1)})
    best = max(rows, key=lambda row: row["images_per_s"])
    return rows, {key: best[key] for key in ("batch_size", "images_per_s", "floor_images_per_s", "order")}


def stage_ms(handle, batch_ms: float, calls: int) -> dict:
    """A batch's mean time split by the statistics of `calls` generate calls: the encoder's
    execute calls, the decode loop, and the rest (the language model's prefill, sampling, host)."""
    encoder, decoder = handle.manager.stats(), handle.decoder.stats()
    encoder_ms = encoder["latency_ms"]["mean"] * encoder["calls"] / calls
    decode_ms = decoder["decode_ms_per_step"]["mean"] * decoder["steps"] / calls
    return {"encoder": encoder_ms, "decode": decode_ms, "prefill_and_rest": batch_ms - encoder_ms - decode_ms}


def sweep_table(rows: list[dict]) -> str:
    header = ["batch", "order", "images/s", "floor images/s", "of floor", "compute floor ms/image", "prompt padding",
              "peak GiB", "batch ms p50", "encoder / decode / prefill+rest ms"]
    return markdown_table(header, [
        [str(r["batch_size"]), r["order"], f"{r['images_per_s']:.2f}", f"{r['floor_images_per_s']:.1f}",
         f"{100 * r['images_per_s'] / r['floor_images_per_s']:.0f}%", f"{r['compute_floor_ms_per_image']:.2f}",
         f"{r['prompt_padding_pct']:.0f}%", f"{r['peak_memory_gib']:.1f}", f"{r['batch_ms']['p50']:.0f}",
         " / ".join(f"{ms:.0f}" for ms in r["stage_ms_per_batch"].values())] for r in rows])


def throughput_table(workload: str, stock: dict, ours: dict) -> str:
    header = [
        "workload",
        "side",
        "wall s",
        "images/s",
        "tokens/s",
        "batch ms (mean/p50/p99)",
        "ms per image",
        "vs stock",
    ]
    rows = []
    for side, run in (("stock generate", stock), ("ours, graphs", ours)):
        batch_ms = run["batch_ms"]
        rows.append(
            [
                workload,
                side,
                f"{run['wall_s']:.2f}",
                f"{run['images_per_s']:.2f}",
                f"{run['tokens_per_s']:.0f}",
                f"{batch_ms['mean']:.0f} / {batch_ms['p50']:.0f} / {batch_ms['p99']:.0f}",
                f"{run['image_ms_mean']:.1f}",
                f"{run['images_per_s'] / stock['images_per_s']:.2f}x",
            ]
        )
    return markdown_table(header, rows)


def decode_table(decode: list[dict]) -> str:
    header = ["workload", "stock ms/token", "ours ms/token", "weight-bytes floor ms", "ours vs floor", "ours vs stock"]
    rows = []
    for row in decode:
        floor = row["floor_ms"]
        rows.append(
            [
                f"decode batch {row['batch']} ({row['prompt_tokens']}-token prompt)",
                f"{row['stock']:.2f}",
                f"{row['ours']:.2f}",
                f"{floor:.2f}" if floor else "-",
                f"{row['ours'] / floor:.1f}x" if floor else "-",
                f"{row['stock'] / row['ours']:.1f}x",
            ]
        )
    return markdown_table(header, rows)


def graphs_line(stats: dict, same_tokens_pct: float) -> str:
    encoder, decoder = stats["encoder"], stats["decoder"]
    replayed = 100.0 * decoder["graph_steps"] / decoder["steps"] if decoder["steps"] else 0.0
    return (
        f"encoder graphs: hit rate {encoder['hit_rate_pct']:.1f}% ({encoder['graph_items']}/{encoder['items']} "
        f"items), capture {encoder['capture_seconds']:.1f} s | decoder graphs: {replayed:.1f}% of "
        f"{decoder['steps']} decode steps replayed, {decoder['decode_ms_per_step']['mean']:.2f} ms/step, lane "
        f"waste {decoder['lane_waste_pct']:.1f}%, capture {decoder['capture_seconds']:.1f} s | tokens identical "
        f"to stock for {same_tokens_pct:.0f}% of images | generate calls sent to stock: "
        f"{stats['generate_fallbacks'] or 'none'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen2.5-vl-3b")
    parser.add_argument("--images", type=int, help="folder size (default 256, 64 with --quick)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="64 images, fewer decode repetitions")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sweep", default="8,16,32,64,128", help="batch sizes for ours alone ('' for none; CUDA only)")
    parser.add_argument("--sweep-images", type=int, help="folder size of the sweep (default 256, 128 with --quick)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile the encoder blocks and decode layers (default: on CUDA)")
    parser.add_argument("--json", help="write results here")
    parser.add_argument("--stock-static", action="store_true",
                        help="also stock generate over transformers' static cache, which it compiles")
    parser.add_argument(
        "--cache-len", type=int, help="decoder KV slots (default: longest prompt + new tokens + 1; "
        "the caption command sizes it for the largest image the processor allows)"
    )
    args = parser.parse_args()
    count = args.images or (64 if args.quick else 256)
    sweep_count = args.sweep_images or (128 if args.quick else 256)
    reps = 3 if args.quick else 5
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    dtype = torch.bfloat16 if on_cuda else torch.float32

    started = time.perf_counter()
    model = build_model(args.preset, dtype=dtype, device=device)
    build_s = time.perf_counter() - started
    tiled = model.config.model_type == "internvl"
    builder = (TilePromptBuilder if tiled else PromptBuilder)(model.config, device, dtype)
    sizes = [int(size) for size in args.sweep.split(",") if size.strip()] if on_cuda else []
    with tempfile.TemporaryDirectory() as folder:
        images = [Image.open(path) for path in write_images(Path(folder), max(count, sweep_count))]
        sweep_images, images = images, images[:count]
        batches = [builder.batch(images[i : i + args.batch_size]) for i in range(0, count, args.batch_size)]
    square = [synthetic_image(DECODE_SIDE, DECODE_SIDE, random.Random(100 + i)) for i in range(max(DECODE_BATCHES))]
    decode_inputs = {b: builder.batch(square[:b]) for b in DECODE_BATCHES}
    prompt_len = max(batch["input_ids"].shape[1] for batch in [*batches, *decode_inputs.values()])
    if sizes:  # the sweep's prompts must fit the decoder's cache too
        prompt_len = max([prompt_len, *(builder.batch(sweep_images[i : i + 64])["input_ids"].shape[1]
                                        for i in range(count, len(sweep_images), 64))])

    stock, stock_tokens = caption_run(model, batches, args.new_tokens, device)
    static = None
    if args.stock_static:
        static = caption_run(model, batches, args.new_tokens, device, cache_implementation="static")[0]
    stock_decode = {
        b: decode_ms_per_token(model, decode_inputs[b], args.new_tokens, reps, device) for b in DECODE_BATCHES
    }
    handle = enable_cuda_graphs(
        model,
        decoder_max_batch_size=max(args.batch_size, *DECODE_BATCHES, *sizes),
        decoder_max_cache_len=args.cache_len or prompt_len + args.new_tokens + 1,
        compile=on_cuda if args.compile is None else args.compile,
    )
    if handle.decoder is None:
        handle.disable()
        raise SystemExit(f"{args.preset}: the decoder is not graphed ({handle.decoder_off}); bench_caption times it")
    weight_bytes = weight_bytes_per_step(model)
    try:
        ours, our_tokens = caption_run(model, batches, args.new_tokens, device)
        graph_stats = handle.stats().to_json()  # plain data: the results JSON takes it as is
        ours_decode = {  # ours takes seconds where stock takes minutes: three times the repetitions
            b: decode_ms_per_token(model, decode_inputs[b], args.new_tokens, 3 * reps, device) for b in DECODE_BATCHES
        }
        sweep_rows, best = sweep(handle, builder, sweep_images, sizes, args.new_tokens, device, weight_bytes) if sizes else ([], None)
    finally:
        handle.disable()

    bandwidth = copy_bandwidth_gbps() if on_cuda else None
    floor_ms = 1000 * weight_bytes / (bandwidth * 1e9) if bandwidth else None
    decode = [
        {
            "batch": b,
            "prompt_tokens": decode_inputs[b]["input_ids"].shape[1],
            "stock": stock_decode[b],
            "ours": ours_decode[b],
            "floor_ms": floor_ms,
        }
        for b in DECODE_BATCHES
    ]
    same_tokens_pct = 100.0 * (our_tokens == stock_tokens).all(dim=1).float().mean().item()
    workload = f"{count} images, batch {args.batch_size}, {args.new_tokens} new tokens"
    env = environment()
    print(
        f"\n{args.preset}, {dtype}, random weights | {env} | model build {build_s:.1f} s | longest prompt "
        f"{prompt_len} tokens | weights read per decode step {weight_bytes / 2**30:.2f} GiB"
        + (f" | copy {bandwidth:.0f} GB/s" if bandwidth else "")
    )
    print(throughput_table(workload, stock, ours))
    if static is not None:
        print(f"stock generate, static cache (compiled by transformers): {static['images_per_s']:.2f} images/s; "
              f"ours {ours['images_per_s'] / static['images_per_s']:.2f}x that")
    print(decode_table(decode))
    print(graphs_line(graph_stats, same_tokens_pct))
    if sweep_rows:
        print(f"\nours alone, {len(sweep_images)} images, {args.new_tokens} new tokens, by batch size:")
        print(sweep_table(sweep_rows))
    write_json(
        args.json,
        {
            "preset": args.preset,
            "environment": env,
            "dtype": str(dtype),
            "images": count,
            "batch_size": args.batch_size,
            "new_tokens": args.new_tokens,
            "longest_prompt": prompt_len,
            "model_build_s": build_s,
            "throughput": {"stock": stock, "ours": ours, **({"stock_static_cache": static} if static else {})},
            "speedup": ours["images_per_s"] / stock["images_per_s"],
            "identical_tokens_pct": same_tokens_pct,
            "decode_ms_per_token": decode,
            "weight_bytes_per_step": weight_bytes,
            "copy_gbps": bandwidth,
            "graphs": graph_stats,
            "sweep": sweep_rows,
            "best": best,
        },
    )


if __name__ == "__main__":
    main()
