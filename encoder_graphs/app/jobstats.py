"""A torchrun job's statistics from its ranks': the captioning run's and the graphs', as one
process would report them. Ranks share the work unevenly (one may get no file), so counts are
summed; rates are computed again from the sums. The graphs' statistics merge by the rule on each
of their fields: `GraphStats.merge` (`engine/statistics.py`)."""

from collections import Counter


def combined_stats(ranks: dict[int, dict]) -> dict:
    """One run's statistics (`RunStats.as_dict()`) from every rank's: sums, the slowest rank's
    wall time, throughput."""
    from encoder_graphs.app.runstats import NVDEC_THEN_CPU, padding_pct  # torch: not at import (the CLI's fast paths)

    runs = list(ranks.values())
    wall_s = max(r["wall_s"] for r in runs)
    done = sum(r["succeeded"] + r["failed"] for r in runs)
    counts = ("succeeded", "failed", "generated_tokens", "batches", "retried_batches", "sidecars", "sidecar_errors",
              "input_wait_s", "prompt_tokens", "padded_prompt_tokens")
    combined = {key: sum(r[key] for r in runs) for key in counts}
    for key in ("by_kind", "failures", "video_decoders"):
        combined[key] = dict(sorted(sum((Counter(r.get(key, {})) for r in runs), Counter()).items()))
    busiest = max(runs, key=lambda r: r["succeeded"] + r["failed"])  # its latencies stand for the job's
    return {
        **busiest,
        **combined,
        "wall_s": wall_s,
        "items_per_s": done / wall_s if wall_s else 0.0,
        "tokens_per_s": combined["generated_tokens"] / wall_s if wall_s else 0.0,
        "prompt_padding_pct": padding_pct(combined["prompt_tokens"], combined["padded_prompt_tokens"]),
        "interrupted": any(r["interrupted"] for r in runs),
        # chosen alike on every rank (`nvdec.chosen`); a rank's pool may then end NVDEC's workers
        "video_decoder": NVDEC_THEN_CPU if any(r.get("video_decoder") == NVDEC_THEN_CPU for r in runs)
        else next((r["video_decoder"] for r in runs if r.get("video_decoder")), None),
        "world_size": len(runs),
        "ranks": [
            {"rank": rank, "files": r["succeeded"] + r["failed"], "items_per_s": r["items_per_s"],
             "idle_s": wall_s - r["wall_s"] + r["input_wait_s"]}
            for rank, r in sorted(ranks.items())
        ],
    }

