"""A torchrun job's statistics from its ranks': the captioning run's and the graphs', as one
process would report them. Ranks share the work unevenly (one may get no file), so counts are
summed; rates are computed again from the sums."""

from collections import Counter


def combined_stats(ranks: dict[int, dict]) -> dict:
    """One run's statistics (`RunStats.as_dict()`) from every rank's: sums, the slowest rank's
    wall time, throughput."""
    from encoder_graphs.app.runstats import padding_pct  # torch: not at import (the CLI's fast paths)

    runs = list(ranks.values())
    wall_s = max(r["wall_s"] for r in runs)
    done = sum(r["succeeded"] + r["failed"] for r in runs)
    counts = ("succeeded", "failed", "generated_tokens", "batches", "retried_batches", "sidecars", "sidecar_errors",
              "input_wait_s", "prompt_tokens", "padded_prompt_tokens")
    combined = {key: sum(r[key] for r in runs) for key in counts}
    for key in ("by_kind", "failures"):
        combined[key] = dict(sum((Counter(r[key]) for r in runs), Counter()))
    busiest = max(runs, key=lambda r: r["succeeded"] + r["failed"])  # its latencies stand for the job's
    return {
        **busiest,
        **combined,
        "wall_s": wall_s,
        "items_per_s": done / wall_s if wall_s else 0.0,
        "tokens_per_s": combined["generated_tokens"] / wall_s if wall_s else 0.0,
        "prompt_padding_pct": padding_pct(combined["prompt_tokens"], combined["padded_prompt_tokens"]),
        "interrupted": any(r["interrupted"] for r in runs),
        "world_size": len(runs),
        "ranks": [
            {"rank": rank, "files": r["succeeded"] + r["failed"], "items_per_s": r["items_per_s"],
             "idle_s": wall_s - r["wall_s"] + r["input_wait_s"]}
            for rank, r in sorted(ranks.items())
        ],
    }


# How a torchrun job's graph statistics come from its ranks', field by field (every field has a
# rule: a statistic added without one fails the merge, and a test merges real statistics).
SUM = "summed"  # a count, or a counter keyed by data (reasons, budgets, buckets, tiers), key by key
LARGEST = "largest rank's"  # set or spent per GPU
BUSIEST = "busiest rank's"  # measured or chosen per rank: the busiest rank's stands for the job's
UNION = "union"  # the graphs captured, or failed, on any rank
LATENCY = "latency"  # calls summed, mean weighted by calls, percentiles the busiest rank's
RATE = "computed again"  # a rate or a share: from the job's sums, after the merge
PATH_RULES = {"hits": SUM, "misses": SUM, "miss_reasons": SUM, "replays_per_budget": SUM, "real_tokens": SUM,
              "padded_tokens": SUM, "waste_pct": RATE}
ENCODER_RULES = {
    "enabled": BUSIEST, "disabled_reason": BUSIEST, "calls": SUM, "items": SUM, "graph_items": SUM,
    "eager_items": SUM, "hit_rate_pct": RATE, "paths": {"*": PATH_RULES}, "budgets": BUSIEST,
    "captured_budgets": UNION, "failed_budgets": UNION, "max_items": LARGEST, "max_frames": LARGEST,
    "capture_seconds": LARGEST, "graph_memory_bytes": LARGEST, "budget_costs_ms": BUSIEST, "latency_ms": LATENCY,
    "compile": BUSIEST,
}
DECODER_RULES = {
    "enabled": BUSIEST, "disabled_reason": BUSIEST, "step": BUSIEST, "prefill": BUSIEST, "calls": SUM,
    "sequences": SUM, "steps": SUM, "graph_steps": SUM, "eager_steps": SUM, "eager_reasons": SUM,
    "replays_per_bucket": SUM, "replays_per_tier": SUM, "steps_per_tier": SUM, "real_lanes": SUM,
    "padded_lanes": SUM, "lane_waste_pct": RATE, "decode_ms_per_step": LATENCY, "buckets": BUSIEST,
    "length_tiers": BUSIEST, "captured_graphs": UNION, "failed_graphs": UNION, "max_cache_len": LARGEST,
    "capture_seconds": LARGEST, "graph_memory_bytes": LARGEST, "static_buffer_bytes": LARGEST,
}
GRAPH_RULES = {"encoder": ENCODER_RULES, "decoder": DECODER_RULES, "decoder_off": BUSIEST, "generate_fallbacks": SUM}


def combined_graph_stats(ranks: list[dict]) -> dict:
    """One job's `EncoderGraphsHandle.stats()` from every rank's, each field by its rule
    (`GRAPH_RULES`): counts summed, capture time and memory the largest rank's, captured graphs
    the union, hit rate and waste from the sums, latency means weighted by calls and percentiles
    the busiest rank's. KeyError for a field without a rule."""

    def work(stats: dict) -> int:
        return stats["encoder"]["items"] + (stats["decoder"] or {}).get("sequences", 0)

    combined = _merge(GRAPH_RULES, ranks, max(ranks, key=work))
    encoder, decoder = combined["encoder"], combined["decoder"]
    encoder["hit_rate_pct"] = _pct(encoder["graph_items"], encoder["items"])
    for path in encoder["paths"].values():
        path["waste_pct"] = _pct(path["padded_tokens"] - path["real_tokens"], path["padded_tokens"])
    if decoder is not None:
        decoder["lane_waste_pct"] = _pct(decoder["padded_lanes"] - decoder["real_lanes"], decoder["padded_lanes"])
    return combined


def _merge(rule: object, values: list, busiest: object) -> object:
    """The job's value from the ranks' `values` (those that have it) by `rule`; `busiest`: the
    busiest rank's value, or the first rank's where it has none."""
    if isinstance(rule, dict):  # a record: each field by its own rule ("*": every key alike)
        if busiest is None:
            return None
        names = dict.fromkeys(name for value in values if value is not None for name in value)
        unknown = [name for name in names if name not in rule and "*" not in rule]
        if unknown:
            raise KeyError(f"no merge rule for the statistics {unknown}")
        return {name: _merge(rule.get(name, rule.get("*")), have := [v[name] for v in values if v and name in v],
                             busiest.get(name, have[0]))
                for name in names}
    if rule == SUM:
        if isinstance(busiest, dict):
            return dict(sum((Counter(value) for value in values), Counter()))
        return sum(values)
    if rule == LARGEST:
        return max(values)
    if rule == LATENCY:
        calls = sum(value["calls"] for value in values)
        mean = sum(value["mean"] * value["calls"] for value in values) / calls if calls else 0.0
        return {**busiest, "calls": calls, "mean": mean}
    if rule == UNION:
        if isinstance(busiest, dict):  # per path, or per graph: the first rank's reason
            keys = dict.fromkeys(key for value in values for key in value)
            return {key: _merge(UNION, [v[key] for v in values if key in v], next(v[key] for v in values if key in v))
                    for key in keys}
        if isinstance(busiest, list):
            union = {tuple(item) if isinstance(item, list) else item for value in values for item in value}
            return [list(item) if isinstance(item, tuple) else item for item in sorted(union)]
        return busiest
    return busiest  # BUSIEST, RATE (computed again by the caller)


def _pct(part: float, whole: float) -> float:
    return 100.0 * part / whole if whole else 0.0
