from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from encoder_graphs.packing import (
    BudgetCosts,
    generate_budgets,
    greedy_pack,
    smallest_fitting_budget,
)


@dataclass
class Item:
    frames: int
    path_tokens: dict[str, int] = field(default_factory=dict)


def test_generate_budgets_doubles_and_keeps_max():
    assert generate_budgets(64, 1000) == [64, 128, 256, 512, 1000]
    assert generate_budgets(64, 512) == [64, 128, 256, 512]
    assert generate_budgets(7, 7) == [7]
    assert generate_budgets(64, 256, steps_per_doubling=2) == [64, 91, 128, 181, 256]
    assert generate_budgets(1, 4, steps_per_doubling=4) == [1, 2, 3, 4]  # no repeats
    with pytest.raises(ValueError):
        generate_budgets(1, 4, steps_per_doubling=0)
    with pytest.raises(ValueError):
        generate_budgets(0, 10)
    with pytest.raises(ValueError):
        generate_budgets(10, 5)


def test_smallest_fitting_budget():
    budgets = [64, 128, 256]
    assert smallest_fitting_budget(budgets, 1) == 64
    assert smallest_fitting_budget(budgets, 64) == 64
    assert smallest_fitting_budget(budgets, 65) == 128
    assert smallest_fitting_budget(budgets, 257) is None


def test_zero_tokens_mean_path_absent_and_oversize_means_eager():
    items = [Item(1, {"a": 10, "b": 0}), Item(1, {"a": 5000, "b": 0})]
    batches = greedy_pack(items, {"a": [64, 128], "b": [64]}, max_items=4)
    assert [b.indices for b in batches] == [[0], [1]]
    assert batches[0].budget == {"a": 64, "b": 0}
    assert batches[1].budget == {"a": None, "b": 0}
    assert batches[1].eager_reasons == {"a": "tokens over largest budget"}


def test_an_item_too_large_for_one_path_still_replays_on_the_other():
    """Pages of many local tiles: too many for the local graphs, yet each global view replays,
    packed with the other such pages up to the global budget; a page that fits both goes apart."""
    items = [Item(1, {"global": 300, "local": 5000}) for _ in range(3)] + [Item(1, {"global": 300, "local": 800})]
    batches = greedy_pack(items, {"global": [256, 512, 1024], "local": [1024, 4096]}, max_items=8)
    assert sorted(sorted(b.indices) for b in batches) == [[0, 1, 2], [3]]
    oversized = next(b for b in batches if 0 in b.indices)
    assert oversized.budget == {"global": 1024, "local": None}
    assert oversized.eager_reasons == {"local": "tokens over largest budget"}
    assert next(b for b in batches if 3 in b.indices).budget == {"global": 512, "local": 1024}


def test_path_without_budgets_runs_eager_and_does_not_constrain():
    items = [Item(1, {"a": 10, "b": 10_000}) for _ in range(3)]
    (batch,) = greedy_pack(items, {"a": [64], "b": []}, max_items=8)
    assert batch.budget == {"a": 64, "b": None}


def test_frame_cap_closes_sub_batches():
    items = [Item(4, {"a": 8}) for _ in range(5)]
    batches = greedy_pack(items, {"a": [1024]}, max_items=10, max_frames=8)
    assert [len(b.indices) for b in batches] == [2, 2, 1]
    too_many = greedy_pack([Item(9, {"a": 8})], {"a": [1024]}, max_items=10, max_frames=8)
    assert too_many[0].budget == {"a": None}
    assert too_many[0].eager_reasons == {"a": "frames over max_frames"}


budget_lists = st.lists(st.integers(1, 2000), min_size=0, max_size=5).map(sorted)
items_strategy = st.lists(
    st.builds(
        Item,
        frames=st.integers(1, 6),
        path_tokens=st.fixed_dictionaries({"a": st.integers(0, 2500), "b": st.integers(0, 900)}),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(
    items=items_strategy,
    budgets_a=budget_lists,
    budgets_b=budget_lists,
    max_items=st.integers(1, 9),
    max_frames=st.one_of(st.none(), st.integers(1, 12)),
)
def test_greedy_pack_properties(items, budgets_a, budgets_b, max_items, max_frames):
    budgets = {"a": budgets_a, "b": budgets_b}
    batches = greedy_pack(items, budgets, max_items, max_frames)
    seen = [i for batch in batches for i in batch.indices]
    assert sorted(seen) == list(range(len(items)))  # none lost, none duplicated: order restorable
    for batch in batches:
        assert 1 <= len(batch.indices) <= max_items
        for path, path_budgets in budgets.items():
            tokens = sum(items[i].path_tokens[path] for i in batch.indices)
            assert batch.tokens[path] == tokens
            chosen = batch.budget[path]
            if tokens == 0:
                assert chosen == 0
            elif chosen is None:
                frames_over = max_frames is not None and batch.frames > max_frames
                assert frames_over or not any(b >= tokens for b in path_budgets)
            else:
                assert chosen == min(b for b in path_budgets if b >= tokens)
        graphed = any(batch.budget[p] not in (None, 0) for p in budgets)
        if graphed and max_frames is not None:
            assert batch.frames <= max_frames
        frames_fit = max_frames is None or all(items[i].frames <= max_frames for i in batch.indices)
        for path, path_budgets in budgets.items():
            # A path that every item of the sub-batch fits alone replays: an item that overflows
            # another path does not send this one eager.
            fits_alone = path_budgets and all(items[i].path_tokens[path] <= path_budgets[-1] for i in batch.indices)
            if fits_alone and frames_fit and batch.tokens[path]:
                assert batch.budget[path] is not None, (path, batch)
        # Items that overflow different paths never share a sub-batch.
        limits = {path: path_budgets[-1] for path, path_budgets in budgets.items() if path_budgets}
        over = {frozenset(p for p, limit in limits.items() if items[i].path_tokens[p] > limit) for i in batch.indices}
        assert len(over) == 1 or not frames_fit


def test_budget_costs_interpolate_eager_and_prefer_the_cheaper_way():
    costs = BudgetCosts()
    costs.record(64, replay_ms=0.5, eager_ms=4.0)  # launch-bound: the graph wins by far
    costs.record(1024, replay_ms=20.0, eager_ms=21.0)
    costs.record(2048, replay_ms=37.0, eager_ms=41.0)
    assert costs.eager_estimate(10) == 4.0  # below the smallest budget: its launch-bound time
    assert costs.eager_estimate(1536) == pytest.approx(31.0)
    assert costs.eager_estimate(4096) == pytest.approx(82.0)
    assert not costs.prefer_eager(60, 64)
    assert not costs.prefer_eager(2000, 2048)  # nearly full: the replay is cheaper (40.1 vs 37 ms)
    assert costs.prefer_eager(1900, 2048)  # eager estimated 38.1 ms: replay less than 5% cheaper
    assert costs.prefer_eager(1100, 2048)  # half padding: eager at ~22 ms beats the 37 ms replay
    assert not costs.prefer_eager(100, 128)  # an unmeasured budget always replays
    exact = BudgetCosts(replay_margin=0.0)
    exact.record(1024, replay_ms=20.0, eager_ms=21.0)
    exact.record(2048, replay_ms=37.0, eager_ms=41.0)
    assert not exact.prefer_eager(1900, 2048)  # no margin: the 37 ms replay beats 38.1 eager
    with pytest.raises(ValueError, match="replay_margin"):
        BudgetCosts(replay_margin=1.5)
    with pytest.raises(ValueError, match="retime_within"):
        BudgetCosts(retime_within=-0.1)


def test_close_calls_are_those_within_retime_within():
    costs = BudgetCosts()
    assert not costs.close_call(replay_ms=2.0, eager_ms=28.0)  # launch-bound: no doubt which wins
    assert costs.close_call(replay_ms=53.6, eager_ms=67.8)  # GPU-bound, 26% apart: timed again
    assert costs.close_call(replay_ms=40.0, eager_ms=35.0)  # eager faster: timed again too
    assert not BudgetCosts(retime_within=0.2).close_call(replay_ms=53.6, eager_ms=67.8)
    with pytest.raises(ValueError):
        costs.record(0, 1.0, 1.0)
    with pytest.raises(ValueError, match="no budget"):
        BudgetCosts().eager_estimate(10)


def test_gpu_bound_needs_growth_across_a_doubling():
    from encoder_graphs.packing import BudgetCosts

    costs = BudgetCosts()
    assert not costs.gpu_bound(1024)  # nothing timed
    costs.record_eager(512, 20.0)
    costs.record_eager(1024, 21.0)  # flat: launch-bound
    assert not costs.gpu_bound(1024)
    costs.record_eager(2048, 39.0)  # +86% for twice the tokens
    assert costs.gpu_bound(2048)
    costs.record_eager(1448, 30.0)
    assert not costs.gpu_bound(1448)  # against 512, the largest timed at most half: +50% for +183% tokens
    assert BudgetCosts.gpu_bound_pair([64, 512, 724, 1024, 2048], 2048) == [2048, 1024]
    assert BudgetCosts.gpu_bound_pair([64, 512], 64) == [64]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)), min_size=1, max_size=30),
    st.integers(1, 6),
    st.integers(30, 120),
)
def test_merge_eager_keeps_every_item_once_and_only_merges_eager_alike(sizes, max_items, max_tokens):
    from encoder_graphs.packing import merge_eager

    specs = [Item(1, {"a": a, "b": b}) for a, b in sizes]
    batches = greedy_pack(specs, {"a": [16, 32], "b": []}, max_items=4)
    merged = merge_eager(batches, max_items, {"a": max_tokens, "b": max_tokens})
    assert sorted(i for batch in merged for i in batch.indices) == list(range(len(specs)))
    graphed = [batch for batch in batches if any(batch.budget.values())]
    assert merged[: len(graphed)] == graphed  # replaying sub-batches untouched, first
    originals = {tuple(batch.indices) for batch in batches}
    for batch in merged[len(graphed):]:
        assert not any(batch.budget.values())
        for path in ("a", "b"):
            assert batch.tokens[path] == sum(specs[i].path_tokens[path] for i in batch.indices)
        if tuple(batch.indices) not in originals:  # a merge: within the limits
            assert len(batch.indices) <= max_items and all(t <= max_tokens for t in batch.tokens.values())
