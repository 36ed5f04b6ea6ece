"""The graphs' typed statistics (`engine/statistics.py`): frozen records that read like the dicts
they were, write the same JSON, come back from it, and merge a torchrun job's ranks by the rule on
each field. Real statistics of a tiny model on CPU (every graph path eager, all counted)."""

import json
from dataclasses import FrozenInstanceError, dataclass, field, fields

import pytest
import torch
from test_decoder import make_batch

from encoder_graphs import enable_cuda_graphs
from encoder_graphs.app.summary import said_by_flag
from encoder_graphs.engine.statistics import (
    CompileStats,
    DecoderStats,
    EncoderStats,
    GraphStats,
    Latency,
    Merge,
    PathStats,
    Record,
    checked,
    rule,
)
from encoder_graphs.packing.reasons import EagerReason
from encoder_graphs.presets import build_model

RECORDS = [Latency, CompileStats, PathStats, EncoderStats, DecoderStats, GraphStats]
# The JSON's keys, in order, before the statistics were typed (a reader of --stats-json keeps them).
ENCODER_KEYS = ["enabled", "disabled_reason", "calls", "items", "graph_items", "eager_items", "hit_rate_pct", "paths",
                "budgets", "captured_budgets", "failed_budgets", "max_items", "max_frames", "capture_seconds",
                "graph_memory_bytes", "budget_costs_ms", "latency_ms", "compile"]
DECODER_KEYS = ["enabled", "disabled_reason", "step", "prefill", "calls", "sequences", "steps", "graph_steps",
                "eager_steps", "eager_reasons", "replays_per_bucket", "replays_per_tier", "steps_per_tier", "real_lanes",
                "padded_lanes", "lane_waste_pct", "decode_ms_per_step", "buckets", "length_tiers", "captured_graphs",
                "failed_graphs", "max_cache_len", "capture_seconds", "graph_memory_bytes", "static_buffer_bytes"]
PATH_KEYS = ["hits", "misses", "miss_reasons", "replays_per_budget", "real_tokens", "padded_tokens", "waste_pct"]


@pytest.fixture(scope="module")
def ranks() -> list[GraphStats]:
    """Two ranks' statistics: one generated for two images in one call, the other for one image
    and sent a beam search to stock generate."""
    model = build_model("tiny-qwen2.5-vl", seed=2).eval()
    stats = []
    for grids, beams in (([(1, 4, 4), (1, 8, 6)], False), ([(1, 4, 8)], True)):
        handle = enable_cuda_graphs(model, budgets=[64, 256], decoder_max_batch_size=4, decoder_max_cache_len=128)
        try:
            batch = make_batch(model.config, grids, seed=1)
            with torch.inference_mode():
                model.generate(**batch, max_new_tokens=6, do_sample=False)
                if beams:
                    model.generate(**batch, max_new_tokens=6, num_beams=2)
            stats.append(handle.stats())
        finally:
            handle.disable()
    return stats


def test_every_field_of_every_record_has_a_merge_rule():
    for record in RECORDS:
        for f in fields(record):
            assert isinstance(f.metadata.get("merge"), Merge), f"{record.__name__}.{f.name}"
            assert (f.metadata["merge"] is Merge.RATE) == (not f.init), "a rate is computed, never passed"
    with pytest.raises(TypeError, match="Unruled.forgotten has no merge rule"):

        @checked
        @dataclass(frozen=True)
        class Unruled(Record):
            counted: int = field(metadata=rule(Merge.SUM))
            forgotten: int = 0


def test_json_keeps_the_keys_and_comes_back(ranks):
    for stats in ranks:
        data = stats.to_json()
        assert list(data) == ["encoder", "decoder", "decoder_off", "generate_fallbacks"]
        assert list(data["encoder"]) == ENCODER_KEYS and list(data["decoder"]) == DECODER_KEYS
        assert list(data["encoder"]["paths"]["default"]) == PATH_KEYS
        assert list(data["encoder"]["latency_ms"]) == ["calls", "mean", "p50", "p99"]
        assert data["encoder"]["disabled_reason"] == "no CUDA device" and type(data["encoder"]["disabled_reason"]) is str
        assert GraphStats.from_json(data) == stats
        sent = json.loads(json.dumps(data))  # plain data: no default= needed; as a rank sends it
        assert GraphStats.from_json(sent).to_json() == sent
        assert GraphStats.from_json(sent).encoder.disabled_reason is EagerReason.NO_CUDA


def test_reads_like_the_dict_it_was(ranks):
    stats = ranks[0]
    assert stats["encoder"]["paths"]["default"]["hits"] == stats.encoder.paths["default"].hits == 0
    assert stats["encoder"]["paths"]["default"]["misses"] == stats.encoder.items == 2
    assert stats["decoder"]["eager_reasons"] == {"no CUDA device": stats.decoder.steps}
    assert stats.get("decoder_off") is None and stats["encoder"].get("compile", "absent") is None
    assert stats.get("no such statistic", 0) == 0 and "encoder" in stats and "pipeline" not in stats
    assert {**stats}.keys() == stats.to_json().keys() == set(stats.keys())
    with pytest.raises(KeyError):
        stats["no such statistic"]


def test_frozen(ranks):
    stats = ranks[0]
    with pytest.raises(FrozenInstanceError):
        stats.encoder.calls = 0
    with pytest.raises(TypeError):
        stats["encoder"]["calls"] = 0
    stats.to_json()["encoder"]["paths"]["default"]["miss_reasons"]["no CUDA device"] = 0
    assert stats.encoder.paths["default"].miss_reasons == {"no CUDA device": 2}, "to_json() is a copy"


def test_a_job_merges_two_real_ranks_by_the_rules(ranks):
    one, two = (GraphStats.from_json(json.loads(json.dumps(stats.to_json()))) for stats in ranks)
    job = GraphStats.merge([one, two])
    encoder, decoder = job.encoder, job.decoder
    items = one.encoder.items + two.encoder.items
    assert (encoder.calls, encoder.items) == (one.encoder.calls + two.encoder.calls, items) and encoder.eager_items == items
    path = encoder.paths["default"]
    assert path.misses == items and path.miss_reasons == {"no CUDA device": items} and path.waste_pct == 0.0
    busiest = max((one, two), key=GraphStats.work)
    assert busiest.work() == busiest.encoder.items + busiest.decoder.sequences
    assert encoder.hit_rate_pct == 0.0 and encoder.budget_costs_ms == busiest.encoder.budget_costs_ms
    latency = encoder.latency_ms
    assert latency.calls == one.encoder.latency_ms.calls + two.encoder.latency_ms.calls
    weighted = sum(s.encoder.latency_ms.mean * s.encoder.latency_ms.calls for s in (one, two)) / latency.calls
    assert latency.mean == pytest.approx(weighted) and latency.p99 == busiest.encoder.latency_ms.p99
    assert (decoder.calls, decoder.sequences, decoder.steps) == (2, 3, one.decoder.steps + two.decoder.steps)
    assert decoder.decode_ms_per_step.p50 == busiest.decoder.decode_ms_per_step.p50
    assert decoder.eager_reasons == {"no CUDA device": decoder.steps} and decoder.eager_steps == decoder.steps
    lanes = one.decoder.padded_lanes + two.decoder.padded_lanes
    assert decoder.padded_lanes == lanes and decoder.lane_waste_pct == pytest.approx(100 * (1 - decoder.real_lanes / lanes))
    assert decoder.max_cache_len == 128 and decoder.captured_graphs == []
    assert job.generate_fallbacks == {"generation mode beam_search": 1}
    assert GraphStats.merge([one]) == one, "one rank is its own job"


def test_an_unknown_statistic_fails_the_merge(ranks):
    sent = ranks[0].to_json()
    sent["encoder"]["new_counter"] = 1
    with pytest.raises(KeyError, match="no merge rule for the statistics \\['new_counter'\\]"):
        GraphStats.from_json(sent)


def test_turned_off_is_said_by_the_flag(ranks):
    off = GraphStats.from_json({**ranks[0].to_json(), "encoder": {
        **ranks[0].encoder.to_json(), "enabled": False, "disabled_reason": "enabled=False",
        "paths": {"default": {**ranks[0].encoder.paths["default"].to_json(), "miss_reasons": {"enabled=False": 2}}}}})
    assert off.encoder.disabled_reason is EagerReason.TURNED_OFF
    said = said_by_flag(off)
    assert said.encoder.disabled_reason == "--no-graphs" and said.encoder.paths["default"].miss_reasons == {"--no-graphs": 2}
    assert said.decoder == off.decoder
