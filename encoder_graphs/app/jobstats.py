"""A torchrun job's statistics from its ranks': the captioning run's and the graphs', as one
process would report them. Ranks share the work unevenly (one may get no file), so counts are
summed; rates are computed again from the sums."""

from collections import Counter

# Set or spent per GPU: the job's is the largest rank's, not a sum.
LARGEST = frozenset({"capture_seconds", "graph_memory_bytes", "static_buffer_bytes", "max_items", "max_frames",
                     "max_cache_len"})
# Measured or chosen per rank: the busiest rank's stand for the job's.
BUSIEST = frozenset({"budgets", "budget_costs_ms", "compile"})
LATENCY = frozenset({"calls", "mean", "p50", "p99"})  # engine.stats.latency_summary


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


def combined_graph_stats(ranks: list[dict]) -> dict:
    """One job's `EncoderGraphsHandle.stats()` from every rank's: counts summed (calls, items,
    hits, misses and their reasons, replays, steps), capture time and memory the largest rank's,
    captured graphs the union, hit rate and waste from the sums, latency means weighted by calls
    and percentiles the busiest rank's."""

    def work(stats: dict) -> int:
        return stats["encoder"]["items"] + (stats["decoder"] or {}).get("sequences", 0)

    combined = _combine(None, ranks, max(ranks, key=work))
    encoder, decoder = combined["encoder"], combined["decoder"]
    encoder["hit_rate_pct"] = _pct(encoder["graph_items"], encoder["items"])
    for path in encoder["paths"].values():
        path["waste_pct"] = _pct(path["padded_tokens"] - path["real_tokens"], path["padded_tokens"])
    if decoder is not None:
        decoder["lane_waste_pct"] = _pct(decoder["padded_lanes"] - decoder["real_lanes"], decoder["padded_lanes"])
    return combined


def _combine(key: str | None, values: list, busiest: object) -> object:
    """The job's value of `key` from the ranks' `values` (those that have it); `busiest`: the
    busiest rank's value, or the first rank's where it has none."""
    if key in BUSIEST or busiest is None or isinstance(busiest, (str, bool)):
        return busiest
    if isinstance(busiest, dict):
        if busiest.keys() == LATENCY:
            calls = sum(value["calls"] for value in values)
            mean = sum(value["mean"] * value["calls"] for value in values) / calls if calls else 0.0
            return {**busiest, "calls": calls, "mean": mean}
        keys = dict.fromkeys(name for value in values for name in value)
        return {
            name: _combine(name, have := [value[name] for value in values if name in value], busiest.get(name, have[0]))
            for name in keys
        }
    if isinstance(busiest, list):  # captured budgets, buckets, tiers, graphs ([batch, tier])
        union = {tuple(item) if isinstance(item, list) else item for value in values for item in value}
        return [list(item) if isinstance(item, tuple) else item for item in sorted(union)]
    return max(values) if key in LARGEST else sum(values)


def _pct(part: float, whole: float) -> float:
    return 100.0 * part / whole if whole else 0.0
