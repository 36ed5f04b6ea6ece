import logging
import random
from dataclasses import replace

import pytest
import torch
from toy_items import random_call
from toy_vit import GLOBAL, LOCAL, ToyItem, ToyViT, ToyViTConfig

from encoder_graphs import EncoderCudaGraphManager
from encoder_graphs.engine.buffers import fill_buffers
from encoder_graphs.report import format_encoder_stats


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return ToyViT(ToyViTConfig(depth=1)).eval()


def eager_per_item(model, items):
    """Each item alone through the model's own eager forward: the reference."""
    outputs = []
    for item in items:
        parts = [model.eager_forward([item], GLOBAL)["hidden"]]
        if item.tiles is not None:
            parts.append(model.eager_forward([item], LOCAL)["hidden"])
        outputs.append(torch.cat(parts))
    return outputs


@pytest.mark.parametrize("enabled", [True, False])
def test_eager_path_matches_per_item_eager(model, enabled):
    manager = EncoderCudaGraphManager(model, enabled=enabled, max_items=4)
    manager.capture()
    rng = random.Random(1)
    with torch.inference_mode():
        for _ in range(5):
            items = random_call(rng, model.config.in_dim)
            outputs = manager.execute(items)
            expected = eager_per_item(model, items)
            assert len(outputs) == len(items)
            for out, ref in zip(outputs, expected):
                torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_stats_say_why_everything_ran_eagerly(model):
    manager = EncoderCudaGraphManager(model, enabled=False)
    items = [
        ToyItem(torch.randn(10, 48)),
        ToyItem(torch.randn(20, 48), tiles=torch.randn(32, 48)),
        ToyItem(torch.randn(4000, 48), frames=2),
    ]
    manager.execute(items)
    manager.execute(items[:1])
    stats = manager.stats()
    assert stats["enabled"] is False
    assert stats["disabled_reason"] == "enabled=False"
    assert (stats["calls"], stats["items"], stats["graph_items"], stats["eager_items"]) == (2, 4, 0, 4)
    assert stats["paths"][GLOBAL]["misses"] == 4
    assert stats["paths"][GLOBAL]["miss_reasons"] == {"enabled=False": 4}
    assert stats["paths"][LOCAL]["misses"] == 1  # only one item has tiles
    assert stats["latency_ms"]["calls"] == 2 and stats["latency_ms"]["p99"] > 0
    table = manager.format_stats()
    assert table == "encoder graphs: off (enabled=False); calls 2, encoder items 4, all eager"
    assert "miss: enabled=False x4" in format_encoder_stats(replace(manager.typed_stats(), enabled=True))
    manager.reset_stats()
    assert manager.stats()["items"] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA reason")
def test_no_cuda_is_a_reason(model):
    manager = EncoderCudaGraphManager(model)
    manager.capture()
    manager.execute([ToyItem(torch.randn(8, 48))])
    assert manager.stats()["paths"][GLOBAL]["miss_reasons"] == {"no CUDA device": 1}


def test_budgets_and_caps(model):
    manager = EncoderCudaGraphManager(model, enabled=False)
    assert manager.budgets == {GLOBAL: [64, 128, 256, 512, 1024], LOCAL: [64, 128, 256, 512, 1024]}
    assert manager.max_items == 1024 // 64
    assert manager.max_frames == manager.max_items
    manager = EncoderCudaGraphManager(model, budgets=[300, 100], max_items=3, enabled=False)
    assert manager.budgets[GLOBAL] == [100, 300]
    assert manager.max_frames == model.config.max_frames_per_item  # a whole item always fits
    assert EncoderCudaGraphManager(model, budgets=[1, 1000], enabled=False).max_items == 32
    manager = EncoderCudaGraphManager(model, budgets={GLOBAL: [128], LOCAL: [16]}, enabled=False)
    assert manager.budgets == {GLOBAL: [128], LOCAL: [16]}
    with pytest.raises(ValueError, match="unknown paths"):
        EncoderCudaGraphManager(model, budgets={"nope": [1]}, enabled=False)
    with pytest.raises(ValueError, match="max_items and max_frames"):
        EncoderCudaGraphManager(model, max_items=0, enabled=False)
    with pytest.raises(ValueError, match="positive budgets"):
        EncoderCudaGraphManager(model, budgets=[0, 5], enabled=False)


def test_padded_buffers_are_nan_safe_and_exact(model):
    """The replay path run eagerly: NaN-poisoned buffers refilled as the manager does give the
    same rows as the unpadded eager forward."""
    items = [ToyItem(torch.randn(30, 48), frames=2), ToyItem(torch.randn(7, 48))]
    budget = 64
    for path in (GLOBAL,):
        capture = model.prepare_capture_inputs(budget, 4, 8, path)
        buffers = {key: value.clone() for key, value in capture.values.items()}
        buffers["patches"].fill_(float("nan"))
        buffers["cu_seqlens"].fill_(-7)
        replay = model.prepare_replay_buffers(items, 4, 8, path, budget=budget)
        fill_buffers(buffers, replay, where="test")
        cu = buffers["cu_seqlens"].tolist()
        assert cu == sorted(cu) and cu[-1] == budget  # monotonic, padded with capacity
        with torch.inference_mode():
            padded = model.graph_forward({**buffers, **capture.static}, path)["hidden"]
            eager = model.eager_forward(items, path)["hidden"]
        assert torch.isfinite(padded).all()
        torch.testing.assert_close(padded[:37], eager, rtol=1e-5, atol=1e-5)


def test_fill_buffers_names_bad_keys(model):
    capture = model.prepare_capture_inputs(64, 2, 2, GLOBAL)
    replay = model.prepare_replay_buffers([ToyItem(torch.randn(8, 48))], 2, 2, GLOBAL, budget=64)
    replay.values["extra"] = torch.zeros(1)
    with pytest.raises(KeyError, match="extra"):
        fill_buffers(capture.values, replay, where="path 'global' budget 64")
    del replay.values["extra"], replay.values["cu_seqlens"]
    with pytest.raises(KeyError, match="cu_seqlens"):
        fill_buffers(capture.values, replay, where="path 'global' budget 64")
    replay.values["cu_seqlens"] = torch.zeros(100, dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens"):
        fill_buffers(capture.values, replay, where="path 'global' budget 64")


def test_summary_is_logged(model, caplog):
    manager = EncoderCudaGraphManager(model, enabled=False, log_interval_s=0.0)
    with caplog.at_level(logging.INFO, logger="encoder_graphs.engine.manager"):
        manager.execute([ToyItem(torch.randn(8, 48))])
        manager.close()
    assert sum("hit rate" in record.message for record in caplog.records) == 2


def test_shared_output_buffers_refuse_what_is_not_a_prefix():
    """An output larger than the buffer the first forward sized (or of another width or dtype)
    is refused by name, not written into a truncated view."""
    from encoder_graphs.engine.buffers import SharedBuffers

    buffers = SharedBuffers()
    views = buffers.output_views("global", {"hidden": torch.zeros(64, 8)})
    assert views["hidden"].shape == (64, 8) and buffers.output_views("global", {"hidden": torch.zeros(16, 8)})["hidden"].shape == (16, 8)
    for wrong in (torch.zeros(65, 8), torch.zeros(16, 4), torch.zeros(16, 8, dtype=torch.float16)):
        with pytest.raises(ValueError, match="output 'hidden' of path 'global'.*not a prefix"):
            buffers.output_views("global", {"hidden": wrong})
    assert not buffers.sized("global")  # no inputs yet: a whole forward sizes both
    buffers.drop("global")
    assert buffers.outputs == {}


def test_options_are_one_frozen_object_and_keywords_change_some(model):
    """The manager's settings: an `EncoderOptions`, keyword arguments of the same names over it
    (design.md's `EncoderCudaGraphManager(model, budgets=..., max_items=...)`), no other name."""
    from encoder_graphs import EncoderOptions

    manager = EncoderCudaGraphManager(model, EncoderOptions(budgets=[64, 128], max_items=3), max_frames=5)
    assert manager.options == EncoderOptions(budgets=(64, 128), max_items=3, max_frames=5)
    assert (manager.max_items, manager.max_frames, manager.budgets[GLOBAL]) == (3, 5, [64, 128])
    keywords = EncoderCudaGraphManager(model, budgets=[64], max_items=2)
    assert keywords.options == EncoderOptions(budgets=(64,), max_items=2)
    with pytest.raises(TypeError, match="max_item"):
        EncoderCudaGraphManager(model, max_item=2)
    with pytest.raises(ValueError, match="capture_from_call"):
        EncoderCudaGraphManager(model, capture_from_call=0)


def test_graphs_is_one_live_view_a_later_capture_shows_in(model, monkeypatch):
    """`graphs` is made once, not per `execute`, and never stale: a budget captured after it was
    read is in it, in budget order, and `close()` empties it (the capture session is a stand-in
    here: the bookkeeping, not CUDA)."""
    from contextlib import nullcontext

    manager = EncoderCudaGraphManager(model, budgets=[16, 64, 256], enabled=False)
    view = manager.graphs
    manager.execute([ToyItem(torch.randn(10, 48))])
    assert manager.graphs is view and dict(view[GLOBAL]) == {} and len(view[LOCAL]) == 0
    monkeypatch.setattr(manager._graphs, "session", nullcontext)
    manager._graphs.capture([(GLOBAL, 256), (LOCAL, 16), (GLOBAL, 16)], lambda key: f"graph {key}", str)
    assert list(view[GLOBAL]) == [16, 256] and view[GLOBAL][256] == "graph ('global', 256)"
    assert dict(view[LOCAL]) == {16: "graph ('local', 16)"} and 64 not in view[GLOBAL]
    assert manager.typed_stats().captured_budgets == {GLOBAL: [16, 256], LOCAL: [16]}
    with pytest.raises(TypeError):
        view[GLOBAL][64] = "written"  # read-only
    manager.close()
    assert manager.graphs is view and len(view[GLOBAL]) == len(view[LOCAL]) == 0
