"""How faithful generation through the graphs is to the stock model, measured as a user meets it.

A family's model (real-size presets with random weights on a GPU, bf16; tiny ones on the CPU,
fp32) gets processor-style inputs from its own caption-inputs builder (the caption command's,
equal to the official processor's: chat template, left padding, Qwen-VL's mm_token_type_ids):
one prompt per image of a few sizes and one with a video. Each way of generating (the stock
`generate`; ours, `enable_cuda_graphs`; ours with `compile=True`) makes `new_tokens` greedy tokens
per prompt (an EOS outside the vocabulary: every prompt runs to the end), and each token is then
checked against a forward of the model over the prompt and the tokens before it (teacher forcing,
one forward per way), twice: the stock model's own bf16 forward, and the same model cast to fp32
(the truth, whose rounding neither way shares):
- agreement: the steps whose token has the top logit of that forward (a tie counts: an argmax
  among equal logits is arbitrary);
- worst margin: the most any token lies below that forward's top logit (0 when all agree).
bf16 sequences part early even when every token is an argmax, so steps are compared, not
sequences. Beside it, each image's and video's encoder output against an fp32 reference (the
same stock model cast to fp32 and back, exactly, on the same pixels), for the stock bf16 encoder
and for ours.

Targets (`missed_targets`): against the fp32 forward, ours agrees at no fewer steps than the stock
`generate` less 2% of the steps, with a worst margin at most 1.5x stock's (or one bf16 step of the
top logit, the finest margin bf16 logits show), compiled or not; each item's encoder error against
fp32 at most 1.5x stock bf16's. On a GPU the stock generate runs twice (`STOCK_AGAIN`): stock's own bf16 tokens differ run to
run, so each measure's bar is the looser value of its two runs (a bar one stock run misses
against the other would be tighter than bf16 itself). Against the stock bf16 forward the same two are reported
(`stock_forward_gaps`), not asserted: that forward runs the stock encoder, so it shares the stock
generate's encoder rounding exactly, and any encoder rounded otherwise (ours: packed items, other
attention and GEMM kernels, as accurate against fp32) parts from it at the first steps of a
prompt. Measured (RESULTS.md): ours with graphs off, or with the decoder's graphs off, drifts
from that forward as far as ours does; the drift is the encoder's rounding, not the decoder's.

Shared by tests/test_fidelity_gpu.py (a family a test), tests/test_fidelity.py (the logic on the
CPU, fp32: everything agrees) and benchmarks/bench_fidelity.py (the table, JSON).
"""

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import numpy as np
import torch
from PIL import Image

from encoder_graphs import enable_cuda_graphs
from encoder_graphs.presets.catalog import buffers_kept
from encoder_graphs.seam.generation import generation_position_ids

# The families and the presets measured on a GPU: real-size language models, random weights.
FAMILIES = {
    "qwen2-vl": "qwen2-vl-2b",
    "qwen2.5-vl": "qwen2.5-vl-3b",
    "qwen3-vl": "qwen3-vl-2b",
    "internvl": "internvl3.5-2b",
    "qwen3.5": "qwen3.5-2b",
    "deepseek-ocr-2": "deepseek-ocr-2",
}
TINY_FAMILIES = {family: f"tiny-{family}" for family in FAMILIES}
SEEDS = (0, 1, 2)  # the workloads a family's targets are judged over, pooled
AGREEMENT_SLACK = 0.02  # of the steps: ours may agree at this many fewer than the stock generate
MARGIN_RATIO = 1.5  # ours' worst margin at most this times stock's
ENCODER_RATIO = 1.5  # ours' encoder error against fp32 at most this times stock bf16's
# Ways of generating besides the stock `generate`: enable_cuda_graphs' options for each.
OURS = {"ours": {"compile": False}, "ours, compile=True": {"compile": True}}
STOCK = "stock"
# The stock generate run again on the same inputs, judged by the same targets as ours: on a GPU
# its bf16 tokens differ from the first run's (measured: 40-50% of an H100's, though one forward
# is bit for bit the same twice), so this is the spread the targets must leave room for.
STOCK_AGAIN = "stock, again"
FP32 = "fp32"  # each way's tokens teacher-forced through the same model in fp32
TOKEN_TYPES = "mm_token_type_ids"  # a per-token input: generated tokens are text (type 0)


@dataclass(frozen=True)
class Workload:
    """One prompt per image (width, height), one with a video (frames, width, height) unless None."""

    images: tuple[tuple[int, int], ...]
    video: tuple[int, int, int] | None
    new_tokens: int = 48
    prompt: str = "Describe this in detail."
    seed: int = 0


WORKLOADS = {
    "full": Workload(images=((448, 448), (812, 476), (336, 1008)), video=(8, 448, 336)),
    # Twelve images: how many steps agree turns on a few rows that part early from the truth
    # into regions of near ties, so the workloads are many short rows (stock's own count moved
    # by 2% between two runs of four rows).
    "quick": Workload(
        images=(
            (224, 224), (364, 196), (168, 420), (280, 280), (448, 252), (196, 364),
            (336, 336), (420, 168), (252, 448), (308, 224), (224, 308), (392, 392),
        ),
        video=(4, 224, 168),
    ),
    "tiny": Workload(images=((64, 64), (96, 48)), video=(4, 56, 56), new_tokens=8),  # CPU tests
}
# DeepSeek-OCR reads pages, not videos: pages under one tile (its global view only) and larger
# ones of 2 to 6 tiles, wide and tall (grids 2x1, 3x1, 1x3, 3x2, 2x3).
PAGE_WORKLOADS = {
    "full": Workload(images=((700, 300), (1240, 1754), (1920, 1080), (2480, 3508)), video=None, prompt="Free OCR."),
    "quick": Workload(
        images=(
            (700, 300), (850, 1100), (1600, 900), (760, 760), (1240, 1754), (500, 700),
            (1920, 1080), (576, 1800), (1100, 850), (900, 1200), (2400, 800), (400, 600),
        ),
        video=None,
        prompt="Free OCR.",
    ),
    "tiny": Workload(images=((600, 400), (900, 1200)), video=None, new_tokens=8, prompt="Free OCR."),
}


def workload_for(family: str, size: str) -> Workload:
    """The `size` workload ("full", "quick", "tiny") that `family` reads."""
    return (PAGE_WORKLOADS if family.startswith("deepseek-ocr") else WORKLOADS)[size]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||, in fp32."""
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def assert_encoder_within_stock_error(got: torch.Tensor, fp32: torch.Tensor, stock_error: float, what: str) -> float:
    """Our encoder output `got` against the fp32 reference: at most ENCODER_RATIO x the stock bf16
    encoder's own error against it (the tolerance bf16 itself sets). Returns the ratio."""
    assert got.shape == fp32.shape, what
    assert torch.isfinite(got).all(), what
    error = relative_error(got, fp32)
    assert error <= ENCODER_RATIO * stock_error, f"{what}: error {error:.3e} against fp32, stock's {stock_error:.3e}"
    return error / stock_error if stock_error else 0.0


# ----- inputs ---------------------------------------------------------------------------------
def noise_image(width: int, height: int, rng: np.random.Generator) -> Image.Image:
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), np.uint8))


def prompt_batch(inputs, workload: Workload, device: torch.device, dtype: torch.dtype) -> tuple[dict, list[dict]]:
    """`generate` inputs of the workload as the family's caption inputs build them (left
    padded), and what each item is: kind, size the model sees, vision tokens, tiles (InternVL)."""
    rng = np.random.default_rng(workload.seed)
    items = [inputs.encode_image(noise_image(width, height, rng)) for width, height in workload.images]
    if workload.video is not None:
        frames, width, height = workload.video
        items.append(inputs.encode_video([noise_image(width, height, rng) for _ in range(frames)]))
    batch = inputs.batch(items, workload.prompt, device, dtype)
    described = [
        {"kind": it.kind, "size": list(it.size), "vision_tokens": it.vision_tokens, "tiles": getattr(it, "tiles", None)}
        for it in items
    ]
    return batch, described


# ----- the encoder ----------------------------------------------------------------------------
def item_features(model: torch.nn.Module, batch: dict, items: list[dict]) -> list[torch.Tensor]:
    """Each image's and video's encoder output [tokens, hidden] through the model's own
    `get_image_features` / `get_video_features` (the graphed ones while enabled): Qwen3-VL's
    deepstack levels beside the main features; InternVL's tiles of an item together; a
    DeepSeek-OCR page's tiles, view and separator."""
    inner = model.model
    with torch.inference_mode():
        if model.config.model_type == "deepseek_ocr2":
            pages = inner.get_image_features(
                batch["pixel_values"], batch.get("pixel_values_local"), batch["num_local_patches"], return_dict=True
            )
            return list(pages.pooler_output)
        if model.config.model_type == "internvl":
            tiles = inner.get_image_features(batch["pixel_values"], return_dict=True).pooler_output
            return [part.flatten(0, 1) for part in torch.split(tiles, [item["tiles"] for item in items])]
        features = []
        for method, pixels, grid in (
            (inner.get_image_features, "pixel_values", "image_grid_thw"),
            (inner.get_video_features, "pixel_values_videos", "video_grid_thw"),
        ):
            if pixels in batch:
                features += _qwen_items(method(batch[pixels], batch[grid], return_dict=True))
    return features


def _qwen_items(output) -> list[torch.Tensor]:
    main = list(output.pooler_output)
    sizes = [item.shape[0] for item in main]
    levels = [
        list(torch.split(level, sizes)) if isinstance(level, torch.Tensor) else list(level)  # transformers 5.17 / 5.18+
        for level in getattr(output, "deepstack_features", None) or []
    ]
    return [torch.cat([item, *(level[index] for level in levels)], dim=-1) for index, item in enumerate(main)]


@contextmanager
def in_fp32(model: torch.nn.Module) -> Iterator[None]:
    """The model cast to fp32 inside, back outside: exact both ways (the buffers, such as the fp32
    rotary frequencies, the very tensors they were), and outside inference mode (its weights stay
    ordinary tensors)."""
    dtype = model.dtype
    with buffers_kept(model):
        with torch.no_grad():
            model.float()
        try:
            yield
        finally:
            with torch.no_grad():
                model.to(dtype)


def fp32_inputs(batch: dict) -> dict:
    return {key: value.float() if value.is_floating_point() else value for key, value in batch.items()}


def fp32_features(model: torch.nn.Module, batch: dict, items: list[dict]) -> list[torch.Tensor]:
    """`item_features` of the same model in fp32 on the same pixels."""
    with in_fp32(model):
        return item_features(model, fp32_inputs(batch), items)


# ----- generation -----------------------------------------------------------------------------
def generate_tokens(model: torch.nn.Module, batch: dict, new_tokens: int) -> torch.Tensor:
    """Exactly `new_tokens` greedy tokens per prompt [batch, new_tokens]: the EOS id lies outside
    the vocabulary."""
    vocab_size = model.get_output_embeddings().weight.shape[0]
    pad = model.generation_config.pad_token_id or 0
    with torch.inference_mode():
        out = model.generate(
            **batch, do_sample=False, max_new_tokens=new_tokens, eos_token_id=vocab_size, pad_token_id=pad
        )
    tokens = out[:, batch["input_ids"].shape[1] :]
    if tokens.shape[1] != new_tokens:
        raise RuntimeError(f"generate returned {tokens.shape[1]} new tokens, expected {new_tokens}")
    return tokens


def teacher_forced(model: torch.nn.Module, batch: dict, tokens: torch.Tensor) -> dict:
    """Each token of `tokens` [batch, steps] against the model's own forward over the prompt and
    the tokens before it (run as generate's first forward runs a prompt: its positions, left
    padding and M-RoPE included): agreeing steps, the worst margin below the top logit, where
    each row first disagrees, and the finest margin the logits' dtype shows at their top (one
    unit in the last place)."""
    rows, steps = tokens.shape
    before = tokens[:, :-1]
    inputs = dict(batch, attention_mask=torch.cat([batch["attention_mask"], torch.ones_like(before)], dim=1))
    if TOKEN_TYPES in batch:
        inputs[TOKEN_TYPES] = torch.cat([batch[TOKEN_TYPES], torch.zeros_like(before)], dim=1)
    ids = torch.cat([inputs.pop("input_ids"), before], dim=1)
    with torch.inference_mode():
        positions = generation_position_ids(model, ids, dict(inputs))
        logits = model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=steps, **inputs).logits
    top = logits.float().max(dim=-1).values
    margins = top - logits.float().gather(-1, tokens[..., None])[..., 0]  # [rows, steps], 0: a top token
    differ = margins > 0
    first = torch.where(differ.any(1), differ.int().argmax(1), torch.full_like(differ[:, 0], steps, dtype=torch.long))
    exponent = torch.floor(torch.log2(top.abs().clamp_min(torch.finfo(torch.float32).tiny)))
    return {
        "steps": rows * steps,
        "agree": int((~differ).sum()),
        "worst_margin": float(margins.max()),
        "first_disagreement": first.tolist(),
        "logit_step": float((torch.finfo(logits.dtype).eps * torch.exp2(exponent)).max()),
    }


# ----- the measure ----------------------------------------------------------------------------
def measure(model: torch.nn.Module, inputs, workload: Workload, ours: dict[str, dict] = OURS) -> dict:
    """The workload's fidelity for the stock `generate` and each of `ours` (name -> options of
    `enable_cuda_graphs`), on `model` in its own dtype and device; `inputs` its caption inputs."""
    device, dtype = model.get_output_embeddings().weight.device, model.dtype
    batch, items = prompt_batch(inputs, workload, device, dtype)
    started = time.perf_counter()
    reference = fp32_features(model, batch, items)
    features = {STOCK: item_features(model, batch, items)}
    tokens = {STOCK: generate_tokens(model, batch, workload.new_tokens)}
    seconds = {STOCK: time.perf_counter() - started}
    if device.type == "cuda":  # stock's own generate twice: a GPU's bf16 tokens differ run to run
        features[STOCK_AGAIN] = features[STOCK]
        tokens[STOCK_AGAIN] = generate_tokens(model, batch, workload.new_tokens)
    graphs = {}
    for name, options in ours.items():
        started = time.perf_counter()
        handle = enable_cuda_graphs(
            model,
            decoder_max_batch_size=batch["input_ids"].shape[0],
            decoder_max_cache_len=batch["input_ids"].shape[1] + workload.new_tokens,
            choose_by_cost=False,  # every sub-batch a budget fits replays: the path never depends on timings
            **options,
        )
        try:
            features[name] = item_features(model, batch, items)
            tokens[name] = generate_tokens(model, batch, workload.new_tokens)
            graphs[name] = _graph_summary(handle.stats().to_json())
        finally:
            handle.disable()
        seconds[name] = time.perf_counter() - started
    variants = {}
    for name in tokens:
        errors = [relative_error(got, want) for got, want in zip(features[name], reference, strict=True)]
        variants[name] = {**teacher_forced(model, batch, tokens[name]), "encoder_errors": errors}
        if name in graphs:
            variants[name]["graphs"] = graphs[name]
    with in_fp32(model):  # the truth neither way's rounding is privileged against
        truth = fp32_inputs(batch)
        for name in tokens:
            variants[name][FP32] = teacher_forced(model, truth, tokens[name])
    result = {
        "dtype": str(dtype),
        "device": str(device),
        "workload": asdict(workload),
        "prompt_tokens": batch["attention_mask"].sum(1).tolist(),
        "items": items,
        "variants": variants,
        "seconds": seconds,
    }
    # The targets are bf16's: in fp32 the reference is the stock output itself (stock's error nil).
    result["missed_targets"] = missed_targets(result) if dtype != torch.float32 else None
    result["stock_forward_gaps"] = stock_forward_gaps(result) if dtype != torch.float32 else None
    return result


def _pooled_forward(parts: list[dict]) -> dict:
    return {
        "steps": sum(p["steps"] for p in parts),
        "agree": sum(p["agree"] for p in parts),
        "worst_margin": max(p["worst_margin"] for p in parts),
        "first_disagreement": [row for p in parts for row in p["first_disagreement"]],
        "logit_step": max(p["logit_step"] for p in parts),
    }


def pooled(results: list[dict]) -> dict:
    """Several workloads' `measure` results as one (steps and agreements summed, the worst margin
    the worst, items side by side), its targets judged anew: a few disagreements of one workload's
    steps are too few to compare two ways by: stock's own count moves by several percent between seeds."""
    ways = results[0]["variants"]
    variants = {}
    for way in ways:
        parts = [result["variants"][way] for result in results]
        variants[way] = {
            **_pooled_forward(parts),
            FP32: _pooled_forward([part[FP32] for part in parts]),
            "encoder_errors": [error for part in parts for error in part["encoder_errors"]],
        }
    result = {**results[0], "items": [item for r in results for item in r["items"]], "variants": variants}
    result["workload"] = [r["workload"] for r in results]
    bf16 = result["dtype"] != str(torch.float32)
    result["missed_targets"] = missed_targets(result) if bf16 else None
    result["stock_forward_gaps"] = stock_forward_gaps(result) if bf16 else None
    return result


def _graph_summary(stats: dict) -> dict:
    encoder, decoder = stats["encoder"], stats["decoder"] or {}  # None: a way without the decoder's graphs
    return {
        "encoder_graph_items": encoder["graph_items"],
        "encoder_items": encoder["items"],
        "decode_graph_steps": decoder.get("graph_steps", 0),
        "decode_steps": decoder.get("steps", 0),
        "generate_fallbacks": stats["generate_fallbacks"],
        "compile_error": (encoder.get("compile") or {}).get("error"),
    }


def _agreement_gaps(result: dict, reference: str | None) -> list[str]:
    """Where ours agrees with a reference forward (None: the stock bf16 forward, else
    `variants[way][reference]`) at fewer steps than the stock generate less the slack, or lies
    further below its top logit than the margin allowed."""
    stock = result["variants"][STOCK]
    runs = [v if reference is None else v[reference] for n, v in result["variants"].items() if n in (STOCK, STOCK_AGAIN)]
    # Each stock run is stock bf16 alike, and on a GPU they differ (worst margins 0.071 and 0.094
    # of the same inputs): each measure's bar is the loosest value of the two runs (the fewest
    # agreeing steps, the worst margin), not whichever run came first.
    of_stock = {"agree": min(r["agree"] for r in runs), "steps": runs[0]["steps"],
                "worst_margin": max(r["worst_margin"] for r in runs)}
    against = "the stock bf16 forward" if reference is None else f"the {reference} forward"
    gaps = []
    for name, variant in result["variants"].items():
        if name in (STOCK, STOCK_AGAIN):
            continue
        ours = variant if reference is None else variant[reference]
        least = of_stock["agree"] - AGREEMENT_SLACK * of_stock["steps"]
        if ours["agree"] < least:
            gaps.append(f"{name}: agrees with {against} at {ours['agree']} of {ours['steps']} steps, stock's generate "
                        f"at {of_stock['agree']} (at least {least:.1f} wanted)")
        allowed = max(MARGIN_RATIO * of_stock["worst_margin"], stock["logit_step"])
        if ours["worst_margin"] > allowed:
            gaps.append(f"{name}: worst margin below {against} {ours['worst_margin']:.3g}, stock's "
                        f"{of_stock['worst_margin']:.3g} (at most {allowed:.3g} wanted)")
    return gaps


def missed_targets(result: dict) -> list[str]:
    """The targets (module docstring) that `result`'s ways of ours miss, each said with its numbers:
    agreement and margin against the fp32 forward, encoder error against fp32."""
    stock = result["variants"][STOCK]
    missed = _agreement_gaps(result, FP32)
    for name, ours in result["variants"].items():
        if name == STOCK:
            continue
        for index, (error, stock_error) in enumerate(zip(ours["encoder_errors"], stock["encoder_errors"], strict=True)):
            if error > ENCODER_RATIO * stock_error:
                item = result["items"][index]
                missed.append(f"{name}: {item['kind']} {index} ({item['vision_tokens']} tokens): encoder error "
                              f"{error:.3g} against fp32, stock's {stock_error:.3g}")
    return missed


def stock_forward_gaps(result: dict) -> list[str]:
    """The same agreement and margin targets against the stock bf16 forward (issue 24's first
    measure), reported, not asserted: that forward shares the stock encoder's bf16 rounding, so an
    encoder as accurate as stock's but rounded otherwise parts from it at the first steps."""
    return _agreement_gaps(result, None)
