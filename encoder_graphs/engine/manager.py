"""Captures a model's encoder as CUDA graphs at several token budgets and replays them.

The manager knows no model: everything model-specific comes through SupportsEncoderCudaGraph.
"""

import logging
import time
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType
from typing import Any

import torch

from encoder_graphs.engine.buffers import BudgetGraph, SharedBuffers, fill_buffers
from encoder_graphs.engine.capture import GraphCache, KeyedGraphs, unavailable_reason
from encoder_graphs.engine.statistics import EncoderStats
from encoder_graphs.engine.stats import EncoderCounters, elapsed_ms
from encoder_graphs.options import EncoderOptions
from encoder_graphs.packing import BudgetCosts, SubBatch, generate_budgets, greedy_pack, merge_eager
from encoder_graphs.packing.reasons import EagerReason
from encoder_graphs.protocols import SupportsEncoderCudaGraph, check_supports_encoder_cuda_graph
from encoder_graphs.report import format_encoder_stats

logger = logging.getLogger(__name__)

DEFAULT_MAX_ITEMS = 32
# Sub-batches that run eagerly merge into one forward of up to this many largest budgets (and
# `max_items` items): fewer launches, fuller kernels, the host-side metadata once a forward. A
# call of photos that ran as many small eager sub-batches took less time merged (measured:
# benchmarks/HISTORY.md).
EAGER_GROUP_BUDGETS = 8
# A test hook, no setting: the bytes of NaN every manager made while it is set fills its graph
# pool with before the first capture (tests/test_qwen_gpu.py sets it around enable_cuda_graphs).
_POISON_POOL_BYTES = 0


class EncoderCudaGraphManager:
    def __init__(
        self,
        model: SupportsEncoderCudaGraph,
        options: EncoderOptions | None = None,
        *,
        poison_pool_bytes: int | None = None,
        **settings: Any,
    ) -> None:
        """`options`: the settings, frozen (`EncoderOptions`, as `GraphOptions.encoder_options`
        gives them; default: its defaults); keyword `settings` of the same names change some of
        them (`budgets`, `max_items`, `max_frames`, `max_frames_per_item`, `enabled`,
        `choose_by_cost`, `lazy`, `capture_from_call`, `log_interval_s`; another name raises
        TypeError).

        `choose_by_cost`: time every budget's replay and eager forward at capture, and run a
        sub-batch eagerly where that measured faster (counted as a miss, "eager measured faster").
        `lazy`: `capture()` captures nothing; each budget is captured (and timed) at its first
        use unless its eager forward measured GPU-bound, so a job pays only for the budgets it uses
        (a path's first use runs its largest budget eagerly once, to size the shared buffers).
        `capture_from_call`: with `lazy`, a budget is timed and captured only in the Nth `execute`
        call that wants it; calls before run it eagerly, so a job of fewer calls measures nothing
        (the caption command's 2: a job of one batch spent time timing budgets, none of which
        then replayed; measured: benchmarks/HISTORY.md). `max_frames_per_item`: the most frames
        (attention segments) one item of the job can hold, e.g. a video's sampled frames, where the
        model's own bound (`EncoderCudaGraphConfig.max_frames_per_item`) is lower: the frames a
        sub-batch holds (`max_frames`, unless given) then cover one such item, which would
        otherwise run eagerly every time.

        `poison_pool_bytes`, a test hook (None: `_POISON_POOL_BYTES`): the graph pool is filled
        with NaN before the first capture, so that a graph reading memory it never wrote shows it."""
        check_supports_encoder_cuda_graph(model)
        self.options = options = replace(options or EncoderOptions(), **settings)
        self.model = model
        self.config = model.get_encoder_cudagraph_config()
        self.paths = self.config.path_names
        self.budgets = self._resolve_budgets(options.budgets)
        smallest = min(b[0] for b in self.budgets.values())
        largest = max(b[-1] for b in self.budgets.values())
        # Attention kernels launch (segment slots x max_seqlen blocks) whether or not a slot is
        # used, so the caps are kept small rather than sized for the worst case of every budget.
        max_items, max_frames = options.max_items, options.max_frames
        if max_items is None:
            max_items = self.config.max_items or min(DEFAULT_MAX_ITEMS, max(1, largest // smallest))
        if max_frames is None:
            max_frames = max(max_items, self.config.max_frames_per_item, options.max_frames_per_item or 0)
        self.max_items, self.max_frames = max_items, max_frames
        if self.max_items < 1 or self.max_frames < 1:
            raise ValueError(f"max_items and max_frames must be >= 1: {max_items}, {max_frames}")
        self.lazy = options.lazy
        self._calls_wanting: Counter[tuple[str, int]] = Counter()  # execute calls that wanted each budget
        self.costs = {path: BudgetCosts() for path in self.paths}

        self.disabled_reason = unavailable_reason(options.enabled, self.config.device)

        self.buffers = SharedBuffers()
        poison = _POISON_POOL_BYTES if poison_pool_bytes is None else poison_pool_bytes
        self._graphs: GraphCache[tuple[str, int], BudgetGraph] = GraphCache(self.config.device, "encoder", poison)
        # Read-only and live: a budget captured later shows up in it, without a copy per call.
        self._graph_view = MappingProxyType({path: KeyedGraphs(self._graphs.graphs, path) for path in self.paths})
        self.captured = False
        self._reset_counters()

    def _resolve_budgets(self, budgets) -> dict[str, list[int]]:
        if budgets is None:
            ranges = self.model.get_budget_range()
            resolved = {}
            for path in self.config.paths:
                low, high = ranges[path.name]
                multiple = path.budget_multiple
                budgets = generate_budgets(low, high, steps_per_doubling=path.steps_per_doubling)
                resolved[path.name] = sorted({-(-b // multiple) * multiple for b in budgets})
        elif isinstance(budgets, Mapping):
            unknown = set(budgets) - set(self.paths)
            if unknown:
                raise ValueError(f"budgets name unknown paths {sorted(unknown)}; paths: {self.paths}")
            resolved = {path: sorted(set(budgets[path])) for path in self.paths}
        else:
            resolved = {path: sorted(set(budgets)) for path in self.paths}
        for path, values in resolved.items():
            if not values or values[0] <= 0:
                raise ValueError(f"path {path!r} needs positive budgets, got {values}")
        return resolved

    def _reset_counters(self) -> None:
        self.counters = EncoderCounters(self.paths)
        self._last_log = time.monotonic()

    # ----- capture -------------------------------------------------------------------------
    def capture(self) -> None:
        """Capture every budget of every path, largest first, into one shared memory pool (with
        `lazy`, none now: `execute` captures each budget at its first use)."""
        if self.disabled_reason is not None or self.captured:
            self.captured = True
            return
        if not self.lazy:
            for path in self.paths:
                self._capture_budgets(path, self.budgets[path])
        self.captured = True

    @property
    def graphs(self) -> Mapping[str, Mapping[int, BudgetGraph]]:
        """The captured graphs by path and budget (ascending): a read-only view of the graph cache's."""
        return self._graph_view

    def _capture_budgets(self, path: str, budgets: Sequence[int]) -> None:
        """Capture `budgets` of `path` in one session, largest first (without `lazy`, the first is
        the path's largest budget, which sizes the shared buffers every graph takes a prefix of)."""
        keys = [(path, budget) for budget in sorted(budgets, reverse=True)]
        self._graphs.capture(keys, lambda key: self._capture_budget(*key), lambda key: f"path {key[0]!r} budget {key[1]}")
        logger.info(
            "captured encoder graphs %s in %.2f s, %.1f MiB",
            {path: sorted(graphs) for path, graphs in self.graphs.items()},
            self._graphs.seconds,
            self._graphs.memory_bytes / 2**20,
        )

    def _capture_budget(self, path: str, budget: int) -> BudgetGraph:
        """Capture one budget's graph (and time it against the same forward run eagerly)."""
        # Inference tensors throughout, as in `execute`: compiled blocks see one set of guards.
        with torch.inference_mode():
            inputs, forward = self._forward(path, budget)
            graph, outputs = self._graphs.graph(forward)
        if self.options.choose_by_cost:
            self._measure(path, budget, graph, forward)
        return BudgetGraph(budget, graph, inputs, outputs)

    def _forward(self, path: str, budget: int) -> tuple[dict[str, torch.Tensor], Callable[[], dict[str, torch.Tensor]]]:
        """The capture inputs of `budget` in the shared buffers, and the forward over them that
        writes the shared outputs."""
        capture = self.model.prepare_capture_inputs(budget, self.max_items, self.max_frames, path)
        inputs = self.buffers.input_views(path, capture)
        buffers = {**inputs, **capture.static}

        def forward() -> dict[str, torch.Tensor]:
            produced = self.model.graph_forward(buffers, path)
            outputs = self.buffers.output_views(path, produced)
            for key, view in outputs.items():
                view.copy_(produced[key])
            return outputs

        return inputs, forward

    def _size_buffers(self, path: str) -> None:
        """Size `path`'s shared buffers by a whole eager forward at its largest budget (timed);
        where that runs out of memory, at the next largest, and so on: the budgets above the one
        that sized them are dropped (a graph of one could not fit its buffers), each with its
        reason, so no later capture meets buffers too small for it."""
        for budget in reversed(self.budgets[path]):
            if (path, budget) in self._graphs.failed:
                continue
            self._time_eager(path, budget)
            if self.buffers.sized(path):
                return
            self.buffers.drop(path)
            self._graphs.failed[path, budget] = "OutOfMemoryError: sizing the shared buffers by an eager forward"
            warnings.warn(f"encoder graphs of path {path!r}: budget {budget} is dropped, it ran out of memory "
                          "sizing the shared buffers; its items run eagerly", stacklevel=3)

    def _time_eager(self, path: str, budget: int) -> None:
        """Time the eager forward over `budget`'s capture inputs (uncaptured; after one untimed
        call: lazy inits, kernel choice), the faster of two. Out of memory leaves it untimed."""
        try:
            with torch.inference_mode():
                _, forward = self._forward(path, budget)
                forward()
                self.costs[path].record_eager(budget, min(elapsed_ms(forward), elapsed_ms(forward)))
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()

    def _measure(self, path: str, budget: int, graph: torch.cuda.CUDAGraph, forward: Callable[[], object]) -> None:
        """Time the budget's replay (after an untimed one: the first uploads the graph) and its
        eager forward (the capture's warm-up ran the forward already); a close call twice, keeping
        each way's faster (see `packing.cost`). Out of memory leaves the budget unmeasured: it
        then always replays."""
        costs = self.costs[path]
        try:
            with torch.inference_mode():
                graph.replay()
                replay, eager = elapsed_ms(graph.replay), elapsed_ms(forward)
                if costs.close_call(replay, eager):
                    replay, eager = min(replay, elapsed_ms(graph.replay)), min(eager, elapsed_ms(forward))
                costs.record(budget, replay, eager)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()

    def warm_up(self) -> None:
        """Run the smallest budget of every path once, uncaptured: compiles what torch.compile
        wrapped in the model before any capture."""
        with torch.inference_mode():  # as capture and execute run it: the same guards
            for path in self.paths:
                capture = self.model.prepare_capture_inputs(self.budgets[path][0], self.max_items, self.max_frames, path)
                self.model.graph_forward({**capture.values, **capture.static}, path)

    def poison_buffers(self) -> None:
        """Fill every captured input and output buffer with NaN (integers with 2**30): a test hook.
        Replay refills every input, so graphed outputs must stay exactly as they were."""
        self.buffers.poison()

    # ----- execute -------------------------------------------------------------------------
    def execute(self, inputs: Any) -> list[torch.Tensor]:
        """Encode every item of `inputs`; one tensor per item, in input order."""
        started = self.counters.latency.start(self.config.device.type == "cuda")
        specs = self.model.get_item_specs(inputs)
        results: list[torch.Tensor | None] = [None] * len(specs)
        with torch.inference_mode():
            batches = greedy_pack(specs, self._packing_budgets(), self.max_items, self.max_frames)
            self._calls_wanting.update({(path, b) for batch in batches for path, b in batch.budget.items() if b})
            for batch in batches:
                self._capture_first_use(batch)
                self._eager_where_cheaper(batch)
                self.counters.count(batch, specs, self._miss_reason)
            eager_tokens = {path: EAGER_GROUP_BUDGETS * budgets[-1] for path, budgets in self.budgets.items()}
            for batch in merge_eager(batches, self.max_items, eager_tokens):
                subset = self.model.select_items(inputs, batch.indices)
                outputs = {path: self._run_path(batch, path, subset) for path in self.paths}
                batch_specs = [specs[i] for i in batch.indices]
                for index, output in zip(batch.indices, self.model.postprocess(outputs, batch_specs)):
                    results[index] = output
        self.counters.latency.stop(started)
        self.counters.calls += 1
        self._maybe_log()
        return results

    def _packing_budgets(self) -> dict[str, list[int]]:
        """The budgets sub-batches may take: the captured ones, and with `lazy` also those not
        tried yet (a failed capture is out)."""
        if not (self.lazy and self.captured and self.disabled_reason is None):
            return {path: sorted(graphs) for path, graphs in self.graphs.items()}
        failed = set(self._graphs.failed)
        return {path: [b for b in self.budgets[path] if (path, b) not in failed] for path in self.paths}

    def _capture_first_use(self, batch: SubBatch) -> None:
        """With `lazy`, the budgets `batch` takes that have no graph yet: captured (and timed),
        unless the eager forward measured GPU-bound there (a graph would save little: no capture
        time, no pool memory). A budget left uncaptured or whose capture failed runs eagerly."""
        if not self.lazy:
            return
        for path, budget in batch.budget.items():
            if not budget or (path, budget) in self._graphs.graphs:
                continue
            if self._calls_wanting[path, budget] < self.options.capture_from_call:
                batch.budget[path], batch.eager_reasons[path] = None, EagerReason.BEFORE_CAPTURE
                continue
            if (path, budget) not in self._graphs.failed and not self._measured_gpu_bound(path, budget):
                self._capture_budgets(path, [budget])
            if (path, budget) not in self._graphs.graphs:
                failed = (path, budget) in self._graphs.failed
                batch.budget[path], batch.eager_reasons[path] = None, (
                    EagerReason.CAPTURE_FAILED if failed else EagerReason.GPU_BOUND)

    def _measured_gpu_bound(self, path: str, budget: int) -> bool:
        """Whether `budget` is GPU-bound by eager timings at it and at a budget half its size
        (`BudgetCosts.gpu_bound`), timing them where not yet timed. A path's first use also runs
        its largest budget eagerly, which sizes the shared buffers every graph takes a prefix of
        (`_size_buffers`)."""
        costs, budgets = self.costs[path], self.budgets[path]
        if not self.buffers.sized(path):
            self._size_buffers(path)
            if (path, budget) in self._graphs.failed:
                return True  # dropped: it runs eagerly
        if not self.options.choose_by_cost:
            return False
        for timed in costs.gpu_bound_pair(budgets, budget):
            if timed not in costs.eager_ms:
                self._time_eager(path, timed)
        return costs.gpu_bound(budget)

    def _eager_where_cheaper(self, batch: SubBatch) -> None:
        if not self.options.choose_by_cost:
            return
        for path, budget in batch.budget.items():
            if budget and self.costs[path].prefer_eager(batch.tokens[path], budget):
                batch.budget[path] = None
                batch.eager_reasons[path] = EagerReason.EAGER_CHEAPER

    def _run_path(self, batch: SubBatch, path: str, subset: Any) -> dict[str, torch.Tensor] | None:
        budget = batch.budget[path]
        if budget == 0:
            return None
        if budget is None:
            return self.model.eager_forward(subset, path)
        graph = self._graphs.graphs[path, budget]
        replay = self.model.prepare_replay_buffers(
            subset, self.max_items, self.max_frames, path, budget=budget
        )
        fill_buffers(graph.inputs, replay, where=f"path {path!r} budget {budget}")
        graph.graph.replay()
        rows = batch.tokens[path]
        return {key: out[:rows].clone() for key, out in graph.outputs.items()}

    def _miss_reason(self, batch: SubBatch, path: str) -> EagerReason:
        if self.disabled_reason is not None:
            return self.disabled_reason
        if not self.captured:
            return EagerReason.NOT_CAPTURED
        if not self.lazy and not any(key[0] == path for key in self._graphs.graphs):  # lazy: none captured yet is no failure
            return EagerReason.EVERY_BUDGET_FAILED
        return batch.eager_reasons.get(path, EagerReason.NO_GRAPH_FITS)

    # ----- statistics ----------------------------------------------------------------------
    def stats(self) -> dict:
        """`typed_stats()` as plain data (the JSON's keys, `engine/statistics.py`)."""
        return self.typed_stats().to_json()

    def typed_stats(self) -> EncoderStats:
        return EncoderStats(
            enabled=self.disabled_reason is None,
            disabled_reason=self.disabled_reason,
            **self.counters.counts(),
            budgets={path: list(values) for path, values in self.budgets.items()},
            captured_budgets={path: sorted(graphs) for path, graphs in self.graphs.items()},
            failed_budgets=self._failed_budgets(),
            max_items=self.max_items,
            max_frames=self.max_frames,
            capture_seconds=self._graphs.seconds,
            graph_memory_bytes=self._graphs.memory_bytes,
            budget_costs_ms={
                path: {budget: {"replay": costs.replay_ms.get(budget), "eager": costs.eager_ms[budget]}
                       for budget in sorted(costs.eager_ms)}
                for path, costs in self.costs.items()
            },
        )

    def _failed_budgets(self) -> dict[str, dict[int, str]]:
        failed: dict[str, dict[int, str]] = {}
        for (path, budget), reason in self._graphs.failed.items():
            failed.setdefault(path, {})[budget] = reason
        return failed

    def format_stats(self) -> str:
        return format_encoder_stats(self.typed_stats())

    def reset_stats(self) -> None:
        self._reset_counters()

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log >= self.options.log_interval_s:
            self._last_log = now
            self._log_summary()

    def _log_summary(self) -> None:
        counters = self.counters
        if counters.calls:
            logger.info(
                "encoder graphs: %d calls, %d items, hit rate %.1f%%, misses %s",
                counters.calls, counters.items, counters.hit_rate_pct(), counters.miss_reasons(),
            )

    def close(self) -> None:
        """Log a last summary and free the graphs and their pool."""
        self._log_summary()
        self._graphs.clear()
        self.costs = {path: BudgetCosts() for path in self.paths}
        self._calls_wanting.clear()
        self.buffers.clear()
