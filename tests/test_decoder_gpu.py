"""Decoder graphs on real-size presets (random weights), through `enable_cuda_graphs`, so the
patched `model.generate` is what runs.

(a) fp32: greedy tokens identical to the stock `generate(do_sample=False)` of the same model,
    encoder and decoder graphs on, each case crossing a length-tier boundary mid-generation;
    with `compile=True` as well (inductor's fp32 kernels round differently, by ~1e-6).
    fp32 rounding (~1e-6) practically never flips a greedy choice, so any logic fault (positions,
    cache slots, masks, padded lanes, tier views) shows as a divergence.
(b) bf16: graph replay bit-identical to the runner's own eager steps over the same bucket and
    length tiers; compiled, one replayed step within CLOSE_LOGIT_GAP of the same step run eagerly; against the stock decode loop (same encoder graphs), identical up to the first
    bf16 near-tie of the stock logits. The static-cache decode attention sums in another order
    than transformers' dynamic-cache sdpa, and two bf16 logits within a couple of units in the
    last place can swap.
"""

import gc

import pytest
import torch
from synthetic_prompts import image_prompt, left_pad, mm_token_type_ids, random_pixels

from encoder_graphs import DecoderGraphRunner, enable_cuda_graphs
from encoder_graphs.decoder.step import decode_step
from encoder_graphs.presets import build_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# qwen3.5-0.8b: a hybrid language model (18 Gated DeltaNet layers beside 6 of gated full
# attention), whose linear layers' conv and recurrent states the static cache holds.
PRESETS = ["qwen2-vl-2b", "qwen2.5-vl-3b", "qwen3-vl-2b", "qwen3.5-0.8b"]
CASES = {
    "batch of 3, left padded": [(1, 16, 16), (1, 24, 20), (1, 12, 28)],
    "batch of 1": [(1, 20, 20)],
}
BUDGETS = [256, 1024]  # merged tokens; fp32 vision attention is the dense masked "sdpa" backend
CACHE_LEN = 256
# Prompts are 109 (batch of 1) and 133 (batch of 3) tokens: both cases switch tier mid-generation
# (120 -> 144 and 144 -> 256), and 120 is not a multiple of 16 (attention kernels pad the mask).
LENGTH_TIERS = [120, 144]
ALL_TIERS = {*LENGTH_TIERS, CACHE_LEN}
FP32_NEW_TOKENS = 24
BF16_NEW_TOKENS = 32
# bf16 decode through 28-36 random-weight layers, in other kernels than generate's (a bucket of 4
# rows vs 3, a static masked cache vs a growing one), moves logits by up to ~0.1-0.2 (seen on an
# H200); a wrong token would sit about 5 logits below the top.
CLOSE_LOGIT_GAP = 0.3


@pytest.fixture(autouse=True)
def free_cuda_memory():
    yield
    gc.collect()
    torch.cuda.empty_cache()


def enable_graphs(model, compile=False):
    return enable_cuda_graphs(
        model,
        compile=compile,
        budgets=BUDGETS,
        decoder_max_batch_size=4,
        decoder_max_cache_len=CACHE_LEN,
        decoder_length_tiers=LENGTH_TIERS,
        choose_by_cost=False,  # these tests are of the graphs: every fitting sub-batch replays
    )


def make_batch(config, grids, dtype, seed=0):
    """Left-padded prompts: text, <vision_start>, image pads, <vision_end>, text."""
    rng = torch.Generator().manual_seed(seed)
    inputs = left_pad([image_prompt(config, grid, 3 + i, 4 + 3 * i, rng) for i, grid in enumerate(grids)])
    inputs["mm_token_type_ids"] = mm_token_type_ids(inputs["input_ids"], config)
    inputs["pixel_values"] = random_pixels(config.vision_config, grids, rng).to(dtype)
    inputs["image_grid_thw"] = torch.tensor(grids)
    return {key: value.cuda() for key, value in inputs.items()}


def make_cases(config, dtype):
    return {case: make_batch(config, grids, dtype, seed) for seed, (case, grids) in enumerate(CASES.items())}


def greedy(generate, inputs, new_tokens, **kwargs):
    with torch.inference_mode():
        return generate(**inputs, do_sample=False, max_new_tokens=new_tokens, **kwargs)


def replay_and_eager_step(runner, bucket, tier):
    """Logits of one decode step from the runner's current buffers, replayed, then run eagerly
    from the same state."""
    buffers = runner.static_buffers()
    store = buffers.store
    state = [store.kv, store.conv, store.recurrent, store.slot, buffers.positions, buffers.mask]
    saved = [tensor.clone() for tensor in state]
    runner.graphs[bucket, tier].replay()
    replayed = buffers.logits[:bucket].clone()
    for tensor, value in zip(state, saved, strict=True):
        tensor.copy_(value)
    with torch.inference_mode():
        decode_step(runner.model, runner.stack, buffers, bucket, tier, buffers.store.cache(bucket, tier))
    return replayed, buffers.logits[:bucket].clone()


def first_differences(got, expected, prompt_len):
    """Per row, the first new-token index where the two differ (the common width if none)."""
    width = min(got.shape[1], expected.shape[1])
    differ = got[:, prompt_len:width] != expected[:, prompt_len:width]
    none = torch.full((got.shape[0],), width - prompt_len, device=got.device)
    return torch.where(differ.any(1), differ.int().argmax(1), none).tolist()


def top2_margins(scores):
    """Top-2 logit margins [batch, steps] of `generate`'s scores."""
    top2 = torch.stack([step.float().topk(2, dim=-1).values for step in scores], dim=1)
    return top2[..., 0] - top2[..., 1]


def divergence_report(generate, inputs, got, expected, new_tokens):
    with torch.inference_mode():
        scores = generate(
            **inputs, do_sample=False, max_new_tokens=new_tokens, output_scores=True, return_dict_in_generate=True
        ).scores
    margin = top2_margins(scores)
    lines = []
    for row, step in enumerate(first_differences(got, expected, inputs["input_ids"].shape[1])):
        if step < min(got.shape[1], expected.shape[1]) - inputs["input_ids"].shape[1]:
            lines.append(f"row {row}: first differs at new token {step}, top-2 margin {margin[row, step]:.3g}")
    return "\n".join(lines)


def assert_parts_only_at_close_logits(what: str, got: torch.Tensor, stock, prompt_len: int) -> None:
    """Our tokens equal the stock generate's (`stock`: with scores) up to where, per row, they
    part, and there ours is one of generate's own near-top choices."""
    sequences, scores = stock.sequences, stock.scores
    matched = first_differences(got, sequences, prompt_len)
    compared = min(got.shape[1], sequences.shape[1]) - prompt_len
    print(f"{what}: new tokens matching generate per row {matched} of {compared}")
    for row, step in enumerate(matched):
        # Step 0 too: ours prefills the packed prompts (FA2 varlen), generate the padded ones (sdpa).
        if step < compared:
            # A logic bug picks an arbitrary token, about 5 logits below the top here.
            ours = int(got[row, prompt_len + step])
            gap = float(scores[step][row].max() - scores[step][row, ours])
            print(f"  row {row} parts at {step}: ours is {gap:.3f} below generate's top logit")
            assert gap <= CLOSE_LOGIT_GAP, f"{what} row {row}: ours is {gap:.3f} below the top"


@pytest.mark.parametrize("compile", [False, True], ids=["uncompiled", "compiled"])
@pytest.mark.parametrize("name", PRESETS)
def test_fp32_greedy_tokens_identical_to_generate(name, compile):
    model = build_model(name, dtype=torch.float32, device="cuda")
    cases = make_cases(model.config, torch.float32)
    stock_generate = model.generate
    expected = {case: greedy(stock_generate, inputs, FP32_NEW_TOKENS) for case, inputs in cases.items()}

    handle = enable_graphs(model, compile)
    try:
        assert handle.adapter.attn_backend == "sdpa"  # FA2 takes half precision only
        assert handle.decoder.stack is not None  # the fused decode layers run (Qwen3.5's hybrid ones too)
        if compile:
            assert handle.stats()["encoder"]["compile"]["error"] is None
        got = {case: greedy(model.generate, inputs, FP32_NEW_TOKENS) for case, inputs in cases.items()}
        stats = handle.stats()
        print(f"\n{name} fp32\n{handle.format_stats()}")
    finally:
        handle.disable()

    for case, inputs in cases.items():
        assert torch.equal(got[case], expected[case]), f"{name} {case}:\n" + divergence_report(
            model.generate, inputs, got[case], expected[case], FP32_NEW_TOKENS
        )
    new_tokens = torch.cat([expected[case][:, cases[case]["input_ids"].shape[1] :].flatten() for case in cases])
    assert len(set(new_tokens.tolist())) > 2  # the model is not stuck on one token: the check means something
    decoder, encoder = stats["decoder"], stats["encoder"]
    assert stats["generate_fallbacks"] == {}
    assert decoder["calls"] == 2 and decoder["sequences"] == 4
    assert decoder["steps"] > 0 and decoder["graph_steps"] == decoder["steps"], decoder
    assert set(decoder["replays_per_bucket"]) == {1, 4}, decoder
    assert set(decoder["replays_per_tier"]) == ALL_TIERS, decoder
    assert encoder["graph_items"] == encoder["items"] == 4, encoder


@pytest.mark.parametrize("compile", [False, True], ids=["uncompiled", "compiled"])
@pytest.mark.parametrize("name", PRESETS)
def test_bf16_replay_equals_eager_steps_and_parts_from_generate_only_at_close_logits(name, compile):
    model = build_model(name, dtype=torch.bfloat16, device="cuda")
    cases = make_cases(model.config, torch.bfloat16)
    stock_generate = model.generate
    handle = enable_graphs(model, compile)
    try:
        if compile:
            assert handle.stats()["encoder"]["compile"]["error"] is None
        captured = handle.decoder.stats()["captured_graphs"]
        assert captured == [[b, t] for b in (1, 2, 4) for t in sorted(ALL_TIERS)]
        got = {case: greedy(model.generate, inputs, BF16_NEW_TOKENS) for case, inputs in cases.items()}
        stats = handle.stats()
        # The same step function run eagerly over the same bucket (batch 3 in bucket 4), after the
        # same prefill (encoder graphs on): bit-identical tokens.
        eager = DecoderGraphRunner(
            model, max_batch_size=4, max_cache_len=CACHE_LEN, length_tiers=LENGTH_TIERS, enabled=False
        )
        replayed, stepped = replay_and_eager_step(handle.decoder, bucket=4, tier=CACHE_LEN)
        batch = dict(cases["batch of 3, left padded"])
        eager_tokens = eager.generate(
            batch.pop("input_ids"), batch.pop("attention_mask"), max_new_tokens=BF16_NEW_TOKENS, **batch
        )
        # The stock decode loop, with the same encoder graphs: only the decode differs.
        stock = {
            case: greedy(stock_generate, inputs, BF16_NEW_TOKENS, output_scores=True, return_dict_in_generate=True)
            for case, inputs in cases.items()
        }
        print(f"\n{name} bf16\n{handle.format_stats()}")
    finally:
        handle.disable()

    if compile:
        # Inductor's kernels round differently captured (on the capture stream's cuBLAS
        # workspace) than run eagerly, so they are held to the logits, not to the same bits.
        assert (replayed - stepped).abs().max() <= CLOSE_LOGIT_GAP
    else:
        assert torch.equal(got["batch of 3, left padded"], eager_tokens)
        assert torch.equal(replayed, stepped)
    assert eager.stats()["graph_steps"] == 0 and set(eager.stats()["steps_per_tier"]) == {144, CACHE_LEN}
    decoder = stats["decoder"]
    assert stats["generate_fallbacks"] == {}
    assert decoder["graph_steps"] == decoder["steps"] > 0, decoder
    assert set(decoder["replays_per_bucket"]) == {1, 4}, decoder
    assert set(decoder["replays_per_tier"]) == ALL_TIERS, decoder
    assert decoder["decode_ms_per_step"]["mean"] > 0

    for case, inputs in cases.items():
        assert_parts_only_at_close_logits(f"{name} {case}", got[case], stock[case], inputs["input_ids"].shape[1])


def test_lazy_capture_takes_only_the_graphs_used_and_keeps_fp32_tokens():
    """`lazy=True` (the caption command's): no graph at enable; each call captures its bucket's
    graphs for the tiers its steps read, before its prefill fills the cache; tokens as stock."""
    model = build_model("qwen2.5-vl-3b", dtype=torch.float32, device="cuda")
    cases = make_cases(model.config, torch.float32)
    expected = {case: greedy(model.generate, inputs, FP32_NEW_TOKENS) for case, inputs in cases.items()}
    handle = enable_cuda_graphs(
        model, budgets=BUDGETS, decoder_max_batch_size=4, decoder_max_cache_len=CACHE_LEN,
        decoder_length_tiers=LENGTH_TIERS, choose_by_cost=False, lazy=True,
    )
    try:
        assert handle.stats()["decoder"]["captured_graphs"] == []
        assert handle.stats()["encoder"]["captured_budgets"] == {"default": []}
        got = {case: greedy(model.generate, inputs, FP32_NEW_TOKENS) for case, inputs in cases.items()}
        stats = handle.stats()
    finally:
        handle.disable()
    for case in cases:
        assert torch.equal(got[case], expected[case]), case
    decoder = stats["decoder"]
    # Batch of 1: prompt 109, steps read 110-132 slots (tiers 120, 144); batch of 3 (bucket 4):
    # prompt 133, 134-156 slots (tiers 144, 256).
    assert sorted(map(tuple, decoder["captured_graphs"])) == [(1, 120), (1, 144), (4, 144), (4, CACHE_LEN)]
    assert decoder["graph_steps"] == decoder["steps"] > 0, decoder
    assert stats["encoder"]["graph_items"] == stats["encoder"]["items"] == 4
