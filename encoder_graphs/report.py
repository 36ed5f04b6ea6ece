"""Readable tables of the statistics: encoder graphs, decoder graphs, and a captioning run.

The graphs' tables take the typed records (`engine/statistics.py`); a saved `--stats-json` gives
them back with `GraphStats.from_json` (less its "pipeline" and "device"). A run's table takes the
plain dict of `RunStats.as_dict()`. Graphs that are off get one line saying so and why.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from encoder_graphs.engine.statistics import CompileStats, DecoderStats, EncoderStats, GraphStats


def format_encoder_stats(stats: "EncoderStats") -> str:
    """`EncoderCudaGraphManager.typed_stats()` as a table."""
    # An encoder item is what it packs as one (Qwen: an image or a video; InternVL: a tile; DeepSeek-OCR: a page).
    calls = f"calls {stats.calls}, encoder items {stats.items}"
    if not stats.enabled:
        return _off("encoder", stats.disabled_reason, calls) + _compiled(stats.compile)
    latency = stats.latency_ms
    lines = [
        "encoder graphs: on",
        (f"  {calls}, graph items {stats.graph_items}, eager items {stats.eager_items}, "
        f"hit rate {stats.hit_rate_pct:.1f}%"),
        f"  capture {stats.capture_seconds:.2f} s, graph memory {stats.graph_memory_bytes / 2**20:.1f} MiB"
        + _compiled(stats.compile),
        f"  latency ms: mean {latency.mean:.2f}  p50 {latency.p50:.2f}  p99 {latency.p99:.2f}",
        f"  {'path':<10}{'hits':>8}{'misses':>8}{'waste %':>9}  budgets (replays)",
    ]
    for name, path in stats.paths.items():
        replays = ", ".join(f"{b} ({n})" for b, n in path.replays_per_budget.items()) or "-"
        lines.append(f"  {name:<10}{path.hits:>8}{path.misses:>8}{path.waste_pct:>9.1f}  {replays}")
        lines += [f"  {'':<10}miss: {reason} x{count}" for reason, count in path.miss_reasons.items()]
        failed = stats.failed_budgets.get(name, {})
        lines += [f"  {'':<10}capture of {budget} failed: {reason}" for budget, reason in failed.items()]
    return "\n".join(lines)


def _compiled(compile: "CompileStats | None") -> str:
    """The capture line's note on torch.compile of the encoder blocks (nothing when not asked)."""
    if compile is None:
        return ""
    if compile.error:
        return f", torch.compile failed (uncompiled): {compile.error}"
    return f", {compile.blocks} blocks compiled in {compile.seconds:.1f} s"


def format_decoder_stats(stats: "DecoderStats | None", off: str | None = None) -> str:
    """`DecoderGraphRunner.typed_stats()` as a table (None: the decoder was not graphed, for `off`)."""
    if stats is None:
        return f"decoder graphs: off ({off}); generate runs stock"
    steps = f"sequences {stats.sequences}, decode steps {stats.steps}"
    if not stats.enabled:
        return _off("decoder", stats.disabled_reason, steps)
    timing = stats.decode_ms_per_step
    lines = [
        f"decoder graphs: on (step: {stats.step}, prefill: {stats.prefill})",
        (f"  {steps}, graph steps {stats.graph_steps}, eager steps {stats.eager_steps}, "
        f"lane waste {stats.lane_waste_pct:.1f}%"),
        (f"  capture {stats.capture_seconds:.2f} s, graph memory {stats.graph_memory_bytes / 2**20:.1f} MiB, "
        f"static buffers {stats.static_buffer_bytes / 2**20:.1f} MiB"),
        f"  decode ms/step: mean {timing.mean:.2f}  p50 {timing.p50:.2f}",
        "  replays per bucket: " + (", ".join(f"{b} x{n}" for b, n in stats.replays_per_bucket.items()) or "-"),
        f"  length tiers {stats.length_tiers}; steps per tier: "
        + (", ".join(f"{t} x{n}" for t, n in stats.steps_per_tier.items()) or "-"),
    ]
    lines += [f"  eager: {reason} x{count}" for reason, count in stats.eager_reasons.items()]
    lines += [f"  capture of {graph} failed: {reason}" for graph, reason in stats.failed_graphs.items()]
    return "\n".join(lines)


def _off(what: str, reason: object, counts: str) -> str:
    """The one line for graphs that are off: why (a reason's text), and what ran eagerly instead."""
    return f"{what} graphs: off ({reason}); {counts}, all eager"


def format_graph_stats(stats: "GraphStats") -> str:
    """`EncoderGraphsHandle.stats()`: encoder, decoder, and the generate calls sent to stock."""
    fallbacks = sorted(stats.generate_fallbacks.items(), key=lambda item: -item[1])
    return "\n".join(
        [
            format_encoder_stats(stats.encoder),
            format_decoder_stats(stats.decoder, stats.decoder_off),
            "generate calls sent to stock generate: "
            + ("all (decoder graphs off)" if stats.decoder_off else
               ", ".join(f"{reason} x{n}" for reason, n in fallbacks) or "none"),
        ]
    )


def plural(count: int, noun: str) -> str:
    """`count` `noun`s, in English ("1 batch", "2 batches")."""
    if count == 1:
        return f"1 {noun}"
    return f"{count} {noun}{'es' if noun.endswith(('s', 'x', 'ch', 'sh')) else 's'}"


def format_not_read(skipped: dict) -> str:
    """The folders' entries a run did not take, by reason (`walk.discover`'s `skipped`)."""
    return "not read under the folders: " + ", ".join(f"{reason} {n}" for reason, n in sorted(skipped.items()))


def format_run_stats(stats: dict) -> str:
    """`RunStats.as_dict()` of a captioning run as a table."""
    lines = [
        f"files {stats['files']}: captioned {stats['succeeded']}, failed {stats['failed']}, "
        f"skipped (already done) {stats['skipped']}"
        + (f", left to a later run (--limit) {stats['later']}" if stats.get("later") else "")
        + (", interrupted" if stats.get("interrupted") else "")
        + (f"; {stats['world_size']} ranks" if stats.get("world_size", 1) > 1 else ""),
        "  kinds: " + (", ".join(f"{kind} {n}" for kind, n in sorted(stats["by_kind"].items())) or "-")
        + (f" (video decoder {stats['video_decoder']}: " + ", ".join(
            f"{n} by {decoder}" for decoder, n in stats["video_decoders"].items()) + ")" if stats.get("video_decoders") else ""),
        f"  throughput: {stats['items_per_s']:.2f} files/s, {stats['tokens_per_s']:.1f} tokens/s "
        f"({stats['generated_tokens']} tokens in {stats['wall_s']:.2f} s, {plural(stats['batches'], 'batch')}"
        + (f", {stats['retried_batches']} retried in parts" if stats["retried_batches"] else "") + ")",
        f"  batch size {stats.get('batch_size') or '-'}"
        + (f" (videos {stats['video_batch_size']})" if stats.get("video_batch_size") else "")
        + f", prompt padding {stats.get('prompt_padding_pct', 0.0):.0f}%; "
        f"the model waited {stats.get('input_wait_s', 0.0):.2f} s for files still loading "
        f"({stats.get('input_wait_pct', 0.0):.1f}% of the loop)"
        + (f"; sidecars written: {stats['sidecars']}" if stats.get("sidecars") or stats.get("sidecar_errors") else "")
        + (f", {stats['sidecar_errors']} could not be" if stats.get("sidecar_errors") else ""),
    ]
    if stats.get("prompt_batches"):  # named prompts: say where an item's prompts did not share its prefill
        lines.append("  named prompts: " + ", ".join(f"{way} {plural(n, 'batch')}" for way, n in stats["prompt_batches"].items()))
    if stats.get("first_caption_after_load_s") is not None:
        lines.append(
            f"  start: model loaded {stats['load_s']:.1f} s after the command started; graphs set up in "
            f"{stats['setup_s']:.1f} s; first captions {stats['first_caption_after_load_s']:.1f} s after the model loaded"
        )
    for name in ("batch_latency_ms", "item_latency_ms"):
        latency = stats[name]
        lines.append(
            f"  {name.removesuffix('_ms').replace('_', ' ')} ms: mean {latency['mean']:.1f}  "
            f"p50 {latency['p50']:.1f}  p99 {latency['p99']:.1f}"
        )
    if stats.get("not_read"):
        lines.append("  " + format_not_read(stats["not_read"]))
    if stats["failures"]:
        lines.append("  failures: " + ", ".join(f"{kind} {n}" for kind, n in stats["failures"].items()))
    for rank in stats.get("ranks", []):  # a torchrun job
        lines.append(
            f"  rank {rank['rank']}: {rank['files']} files, {rank['items_per_s']:.2f} files/s, idle {rank['idle_s']:.2f} s"
        )
    return "\n".join(lines)
