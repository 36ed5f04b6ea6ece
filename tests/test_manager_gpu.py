"""The toy ViT graphed vs eager on the same items, on a real GPU."""

import random
import warnings

import pytest
import torch
from toy_items import random_call
from toy_vit import GLOBAL, LOCAL, ToyItem, ToyViT, ToyViTConfig

from encoder_graphs import EncoderCudaGraphManager
from encoder_graphs.engine.buffers import fill_buffers
from encoder_graphs.packing.reasons import EagerReason

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
POISON_BYTES = 256 << 20


def build(seed: int = 0, **config) -> ToyViT:
    torch.manual_seed(seed)
    return ToyViT(ToyViTConfig(**config)).to("cuda", torch.bfloat16).eval()


def assert_close_bf16(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()
    error = (out.float() - ref.float()).norm() / ref.float().norm()
    assert error < 2e-2, f"relative error {error:.3e}"


def test_500_random_calls_match_eager_with_poisoned_pool():
    model = build()
    manager = EncoderCudaGraphManager(model, max_items=4, poison_pool_bytes=POISON_BYTES, choose_by_cost=False)
    manager.capture()
    manager.poison_buffers()
    eager = EncoderCudaGraphManager(model, max_items=4, enabled=False)
    rng = random.Random(0)
    with torch.inference_mode():
        for call in range(500):
            items = random_call(rng, model.config.in_dim)
            if call % 50 == 0:  # small-large-small
                items = [ToyItem(torch.randn(9, 48))] + items + [ToyItem(torch.randn(3, 48))]
            items = [ToyItem(i.patches.cuda(), i.frames, None if i.tiles is None else i.tiles.cuda()) for i in items]
            outputs = manager.execute(items)
            expected = eager.execute(items)
            for out, ref in zip(outputs, expected):
                assert_close_bf16(out, ref)
    stats = manager.stats()
    assert stats["graph_items"] > 0.8 * stats["items"]
    assert stats["paths"][LOCAL]["hits"] > 0
    assert stats["capture_seconds"] > 0 and stats["graph_memory_bytes"] > 0
    print(
        f"\ntoy ViT: budgets {stats['captured_budgets']}, capture {stats['capture_seconds']:.2f} s, "
        f"graph memory {stats['graph_memory_bytes'] / 2**20:.1f} MiB, hit rate "
        f"{stats['hit_rate_pct']:.1f}%, waste {stats['paths'][GLOBAL]['waste_pct']:.1f}%"
    )
    print(manager.format_stats())


def test_replay_is_bit_identical_to_eager_on_the_same_padded_shapes():
    model = build(seed=1)
    manager = EncoderCudaGraphManager(
        model, budgets=[256], max_items=4, poison_pool_bytes=POISON_BYTES, choose_by_cost=False
    )
    manager.capture()
    manager.poison_buffers()
    items = [ToyItem(torch.randn(40, 48, device="cuda"), frames=2), ToyItem(torch.randn(17, 48, device="cuda"))]
    with torch.inference_mode():
        graphed = manager.execute(items)
        capture = model.prepare_capture_inputs(256, 4, manager.max_frames, GLOBAL)
        buffers = {key: torch.full_like(value, 3) for key, value in capture.values.items()}
        fill_buffers(buffers, model.prepare_replay_buffers(items, 4, manager.max_frames, GLOBAL, budget=256), "test")
        padded = model.graph_forward({**buffers, **capture.static}, GLOBAL)["hidden"]
    assert torch.equal(torch.cat(graphed), padded[:57])


def test_one_path_hits_while_the_other_falls_back():
    model = build(seed=2)
    manager = EncoderCudaGraphManager(
        model, budgets={GLOBAL: [64, 256, 1024], LOCAL: [16]}, max_items=4,
        poison_pool_bytes=POISON_BYTES, choose_by_cost=False,
    )
    manager.capture()
    manager.poison_buffers()
    eager = EncoderCudaGraphManager(model, enabled=False)
    items = [ToyItem(torch.randn(50, 48, device="cuda"), tiles=torch.randn(64, 48, device="cuda")),
             ToyItem(torch.randn(30, 48, device="cuda"))]
    with torch.inference_mode():
        for out, ref in zip(manager.execute(items), eager.execute(items)):
            assert_close_bf16(out, ref)
    stats = manager.stats()
    assert stats["paths"][GLOBAL]["hits"] == 2 and stats["paths"][GLOBAL]["misses"] == 0
    assert stats["paths"][LOCAL]["misses"] == 1
    assert stats["paths"][LOCAL]["miss_reasons"] == {"tokens over largest budget": 1}
    assert stats["eager_items"] == 1  # the tiled item, alone in its sub-batch, ran local eagerly


def test_sub_batches_run_eagerly_where_eager_measured_faster():
    model = build(seed=3)
    manager = EncoderCudaGraphManager(model, budgets=[64, 256, 1024], max_items=4, poison_pool_bytes=POISON_BYTES)
    manager.capture()
    manager.poison_buffers()
    costs = manager.costs[GLOBAL]
    assert sorted(costs.replay_ms) == [64, 256, 1024]
    # Launch-bound toy: every replay beats the eager forward of its own size.
    assert all(costs.replay_ms[b] < costs.eager_ms[b] for b in costs.replay_ms), costs
    eager = EncoderCudaGraphManager(model, enabled=False)
    items = [ToyItem(torch.randn(50, 48, device="cuda")), ToyItem(torch.randn(30, 48, device="cuda"))]
    with torch.inference_mode():
        assert manager.execute(items) and manager.stats()["graph_items"] == 2
        costs.record(256, replay_ms=1e9, eager_ms=costs.eager_ms[256])  # as if padding made 256 slow
        manager.reset_stats()
        for out, ref in zip(manager.execute(items), eager.execute(items)):
            assert_close_bf16(out, ref)
    stats = manager.stats()
    assert stats["eager_items"] == 2 and stats["paths"][GLOBAL]["miss_reasons"] == {"eager measured faster": 2}
    assert "eager measured faster x2" in manager.format_stats()


class FailingViT(ToyViT):
    """Capture of one budget fails, as an out-of-memory capture would."""

    def prepare_capture_inputs(self, budget, max_items, max_frames, path):
        if budget == 512:
            raise torch.cuda.OutOfMemoryError("simulated: no memory for budget 512")
        return super().prepare_capture_inputs(budget, max_items, max_frames, path)


class BuggyViT(ToyViT):
    """An adapter bug (not a capture failure) in one budget's forward."""

    def graph_forward(self, buffers, path):
        if buffers["patches"].shape[0] == 512:
            raise ValueError("adapter bug at budget 512")
        return super().graph_forward(buffers, path)


def test_an_adapter_bug_during_capture_propagates():
    torch.manual_seed(4)
    model = BuggyViT(ToyViTConfig(two_paths=False)).to("cuda", torch.bfloat16).eval()
    manager = EncoderCudaGraphManager(model, budgets=[128, 512, 1024], max_items=4)
    with pytest.raises(ValueError, match="adapter bug at budget 512"):
        manager.capture()


def test_failed_capture_drops_that_budget_and_carries_on():
    torch.manual_seed(3)
    model = FailingViT(ToyViTConfig(two_paths=False)).to("cuda", torch.bfloat16).eval()
    # Not chosen by cost: 300 tokens padded to 1,024 may time faster eagerly (on a GPU shared by
    # several test processes it did), which is not what this test is about.
    manager = EncoderCudaGraphManager(model, budgets=[128, 512, 1024], max_items=4, choose_by_cost=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager.capture()
    assert any("budget 512" in str(w.message) for w in caught)
    assert manager.stats()["captured_budgets"] == {GLOBAL: [128, 1024]}
    assert 512 in manager.stats()["failed_budgets"][GLOBAL]
    items = [ToyItem(torch.randn(300, 48, device="cuda"))]
    with torch.inference_mode():
        assert_close_bf16(manager.execute(items)[0], model.eager_forward(items, GLOBAL)["hidden"])
    assert manager.stats()["paths"][GLOBAL]["replays_per_budget"] == {1024: 1}


def test_lazy_capture_takes_the_budgets_used_and_matches_eager():
    """`lazy`: nothing at capture(); a path's first use runs its largest budget eagerly (which
    sizes the shared buffers), then each budget is captured at its first use and timed; outputs
    as eager under random calls with a poisoned pool and buffers; a failed lazy capture runs that
    sub-batch eagerly and is not tried again."""
    model = build(seed=5, two_paths=False)
    budgets = [64, 256, 1024, 4096]
    manager = EncoderCudaGraphManager(model, budgets=budgets, max_items=4, poison_pool_bytes=POISON_BYTES, lazy=True)
    manager.capture()
    assert manager.stats()["captured_budgets"] == {GLOBAL: []}
    eager = EncoderCudaGraphManager(model, max_items=4, enabled=False)
    with torch.inference_mode():
        first = [ToyItem(torch.randn(50, 48, device="cuda"))]
        for out, ref in zip(manager.execute(first), eager.execute(first)):
            assert_close_bf16(out, ref)
        assert manager.stats()["captured_budgets"] == {GLOBAL: [64]}
        costs = manager.costs[GLOBAL]
        assert sorted(costs.replay_ms) == [64] and sorted(costs.eager_ms) == [64, 4096]
        manager.poison_buffers()
        rng = random.Random(1)
        for _ in range(100):
            items = [ToyItem(i.patches.cuda(), i.frames) for i in random_call(rng, model.config.in_dim, tiles=False)]
            for out, ref in zip(manager.execute(items), eager.execute(items)):
                assert_close_bf16(out, ref)
    stats = manager.stats()
    used = {b for b, n in stats["paths"][GLOBAL]["replays_per_budget"].items() if n}
    assert used <= set(stats["captured_budgets"][GLOBAL]) and stats["graph_items"] > 0

    failing = FailingViT(ToyViTConfig(two_paths=False)).to("cuda", torch.bfloat16).eval()
    lazy = EncoderCudaGraphManager(failing, budgets=[128, 512, 1024], max_items=4, lazy=True, choose_by_cost=False)
    lazy.capture()
    items = [ToyItem(torch.randn(300, 48, device="cuda"))]  # budget 512: its capture fails
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.inference_mode():
            for _ in range(2):
                assert_close_bf16(lazy.execute(items)[0], failing.eager_forward(items, GLOBAL)["hidden"])
    stats = lazy.stats()
    assert stats["captured_budgets"] == {GLOBAL: [1024]} and 512 in stats["failed_budgets"][GLOBAL]
    # The call that met the failure ran eagerly; the next packed the item into 1024.
    assert stats["paths"][GLOBAL]["miss_reasons"] == {"capture failed": 1}
    assert stats["paths"][GLOBAL]["replays_per_budget"] == {1024: 1}


def test_lazy_capture_from_the_second_call_times_nothing_in_the_first():
    """`capture_from_call=2` (the caption command's): the first call that wants a budget runs it
    eagerly, timing and capturing nothing (a job of one batch pays nothing); the second captures
    it and replays. Outputs as eager throughout."""
    model = build(seed=6, two_paths=False)
    manager = EncoderCudaGraphManager(
        model, budgets=[64, 256], max_items=4, lazy=True, capture_from_call=2, choose_by_cost=False
    )
    manager.capture()
    eager = EncoderCudaGraphManager(model, max_items=4, enabled=False)
    items = [ToyItem(torch.randn(50, 48, device="cuda"))]
    with torch.inference_mode():
        for out, ref in zip(manager.execute(items), eager.execute(items)):
            assert_close_bf16(out, ref)
        first = manager.stats()
        assert first["captured_budgets"] == {GLOBAL: []} and not manager.costs[GLOBAL].eager_ms
        assert first["graph_items"] == 0 and first["paths"][GLOBAL]["miss_reasons"] == {EagerReason.BEFORE_CAPTURE: 1}
        for out, ref in zip(manager.execute(items), eager.execute(items)):
            assert_close_bf16(out, ref)
    second = manager.stats()
    assert second["captured_budgets"] == {GLOBAL: [64]} and second["graph_items"] == 1
    with pytest.raises(ValueError, match="capture_from_call"):
        EncoderCudaGraphManager(model, lazy=True, capture_from_call=0)


def test_lazy_capture_skips_a_budget_measured_gpu_bound():
    """Eager time that grew with tokens from a budget half the size (here as recorded, as a
    large tower's would): that budget is never captured, and its sub-batches run eagerly."""
    model = build(seed=6, two_paths=False)
    manager = EncoderCudaGraphManager(model, budgets=[256, 1024, 4096], max_items=4, lazy=True)
    manager.capture()
    manager.costs[GLOBAL].record_eager(256, 10.0)
    manager.costs[GLOBAL].record_eager(1024, 40.0)
    items = [ToyItem(torch.randn(300, 48, device="cuda"))]
    with torch.inference_mode():
        for out, ref in zip(manager.execute(items), model.eager_forward(items, GLOBAL)["hidden"].split([300])):
            assert_close_bf16(out, ref)
    stats = manager.stats()
    assert stats["captured_budgets"] == {GLOBAL: []} and stats["graph_memory_bytes"] == 0
    assert stats["paths"][GLOBAL]["miss_reasons"] == {"GPU-bound size, not captured": 1}


def test_lazy_captures_succeed_while_another_thread_pins_memory():
    """The caption command's collator thread pins memory (and runs transformers' host code)
    while the model's thread captures lazily: no capture may fail for it (under CUDA's "global"
    capture mode nearly all did), and the graphs match eager."""
    import threading

    model = build(seed=7, two_paths=False)
    budgets = [64, 128, 256, 512, 1024, 2048]
    manager = EncoderCudaGraphManager(model, budgets=budgets, max_items=4, lazy=True, choose_by_cost=False)
    manager.capture()
    eager = EncoderCudaGraphManager(model, max_items=4, enabled=False)
    stop = threading.Event()

    def pin() -> None:
        while not stop.is_set():
            torch.empty(1 << 16, dtype=torch.uint8).pin_memory()

    pinning = threading.Thread(target=pin, daemon=True)
    pinning.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a failed capture warns
            with torch.inference_mode():
                for tokens in (40, 100, 200, 400, 900, 1800, 60, 1000):
                    items = [ToyItem(torch.randn(tokens, model.config.in_dim, device="cuda"))]
                    assert_close_bf16(manager.execute(items)[0], eager.execute(items)[0])
    finally:
        stop.set()
        pinning.join()
    stats = manager.stats()
    assert not stats["failed_budgets"].get(GLOBAL), stats["failed_budgets"]
    assert stats["captured_budgets"][GLOBAL] == budgets


class SizingOomViT(ToyViT):
    """Runs out of memory at the largest budget's forward (after its inputs are in the buffers),
    as a large budget of a real tower can on a full card."""

    def graph_forward(self, buffers, path):
        if buffers["patches"].shape[0] == 4096:
            raise torch.cuda.OutOfMemoryError("simulated: no memory for the forward of budget 4096")
        return super().graph_forward(buffers, path)


def test_buffers_sized_by_the_largest_budget_that_runs():
    """The shared buffers are sized by a whole forward: where the largest budget's runs out of
    memory, that budget is dropped (loudly) and the next sizes them; budgets captured later in
    any order fit their prefix, and every output matches eager (once, a smaller budget sized the
    outputs and a larger capture then failed on a truncated view)."""
    torch.manual_seed(6)
    model = SizingOomViT(ToyViTConfig(two_paths=False)).to("cuda", torch.bfloat16).eval()
    manager = EncoderCudaGraphManager(model, budgets=[64, 256, 1024, 4096], max_items=4, lazy=True,
                                      choose_by_cost=False)
    manager.capture()
    with pytest.warns(UserWarning, match="budget 4096 is dropped"):
        with torch.inference_mode():
            small = [ToyItem(torch.randn(50, model.config.in_dim, device="cuda"))]
            assert_close_bf16(manager.execute(small)[0], model.eager_forward(small, GLOBAL)["hidden"])
    with torch.inference_mode():
        for tokens in (900, 200, 3000, 60):
            items = [ToyItem(torch.randn(tokens, model.config.in_dim, device="cuda"))]
            assert_close_bf16(manager.execute(items)[0], model.eager_forward(items, GLOBAL)["hidden"])
    stats = manager.stats()
    assert stats["captured_budgets"] == {GLOBAL: [64, 256, 1024]}
    assert "sizing the shared buffers" in stats["failed_budgets"][GLOBAL][4096]
    assert all(b.shape[0] == 1024 for b in manager.buffers.outputs[GLOBAL].values())
