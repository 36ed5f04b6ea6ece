"""The language model's decode step captured as CUDA graphs, one per (batch-size bucket, length tier).

Prefill is the model's own forward (eager, dynamic cache; over the prompts packed without their
padding where `layers/decode.py` knows the decoder and it has no linear attention, else exactly
what `generate` runs); its keys and values (linear layers: their states) are copied into
a static cache, and each decode step then replays the graph of the smallest bucket that holds
the batch and the smallest length tier that holds its sequences: that graph's attention reads
only the tier's first slots of the one cache allocation. The tier of each step is known on the
host (prompt length + step index), so switching tiers needs no sync. Without CUDA, with
`enabled=False`, or when no graph fits, the same step function runs eagerly over the same tiers,
so the CPU path exercises the same logic.
"""

import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from itertools import product
from typing import Any

import torch
from transformers import PretrainedConfig

from encoder_graphs.decoder.buffers import DecodeBuffers, DecoderGraphConfig, TextDims
from encoder_graphs.decoder.calls import GenerateCalls
from encoder_graphs.decoder.layers.decode import DecodeStack
from encoder_graphs.decoder.layers.stack import fuse_text_kernels
from encoder_graphs.decoder.routes import Route, Tier
from encoder_graphs.decoder.stats import DecodeCounters
from encoder_graphs.decoder.step import decode_step
from encoder_graphs.engine.capture import GraphCache, unavailable_reason
from encoder_graphs.engine.statistics import DecoderStats
from encoder_graphs.models.registry import family_class
from encoder_graphs.options import DecoderOptions
from encoder_graphs.packing import smallest_fitting_budget
from encoder_graphs.packing.reasons import EagerReason
from encoder_graphs.protocols import ModelFamily
from encoder_graphs.report import format_decoder_stats
from encoder_graphs.rewrites import Rewrites
from encoder_graphs.seam.generation import generation_position_ids
from encoder_graphs.seam.text import LINEAR_ATTENTION, SlotCache, static_rope

logger = logging.getLogger(__name__)


class DecoderGraphRunner(GenerateCalls):
    """`generate` for a Hugging Face vision-language model: the model's own prefill, then decode
    steps replayed from CUDA graphs per (batch bucket, length tier), or run eagerly over the same
    buffers. `family` checks the model inputs of a call and lays out its positions (default: the
    registered family of `model`, if any)."""

    def __init__(
        self,
        model: torch.nn.Module,
        options: DecoderOptions | None = None,
        *,
        family: ModelFamily | type[ModelFamily] | None = None,
        fused_step: bool = True,
        packed_prefill: bool = True,
        **settings: Any,
    ) -> None:
        """`options` (`GraphOptions.decoder_options`), keyword `settings` of its names over it.
        `lazy`: `capture()` only allocates the static buffers; the graphs of a (bucket, tier) are
        captured when a `generate` call first needs them, so a job pays for those it uses."""
        self.options = options = replace(options or DecoderOptions(), **settings)
        self.model, self.lazy = model, options.lazy
        self.config = DecoderGraphConfig.of(options)
        if (reason := self.unsupported(model.config)) is not None:
            raise ValueError(reason)
        self.family = family if family is not None else family_class(model)
        self._text_position_row = self.family.text_position_row if self.family is not None else None
        known = DecodeStack.supports(model)  # whether encoder_graphs/decoder/layers/decode.py knows its decoder layers
        self._dims = TextDims.of(model)
        # Prefill over the packed prompts for the same decoders (False: left-padded, as generate),
        # but linear attention's: its conv and recurrence would run across the prompts' bounds.
        self.packed_prefill = packed_prefill and known and self._dims.linear is None
        self.device = model.get_output_embeddings().weight.device
        self.disabled_reason = unavailable_reason(options.enabled, self.device)
        self._position_dims: tuple[int, ...] | None = None
        self._static: DecodeBuffers | None = None
        self._caches: dict[tuple[int, int], SlotCache] = {}
        self._graphs: GraphCache[tuple[int, int], torch.cuda.CUDAGraph] = GraphCache(self.device, "decoder")
        self.captured = False
        self.reset_stats()
        # The language model's norms and MLPs through the Triton kernels where they run, and the
        # step through `DecodeLayer`s (None: the model's own forward), whose fused and stacked
        # weights `close()` gives back; last, so that nothing after it can fail and leave them so.
        self._rewrites = Rewrites()
        self.stack = None
        if known:
            with self._rewrites.undone_on_error():
                gate_ups = fuse_text_kernels(model, self._rewrites)  # the prefill's norms and MLPs
                if fused_step:
                    self.stack = DecodeStack(model, self._rewrites, gate_ups)

    @staticmethod
    def unsupported(config: PretrainedConfig) -> str | None:
        """Why the decode step of a model of `config` cannot be graphed here, or None. The static
        cache holds full-attention layers' keys and values and linear-attention layers' conv and
        recurrent states (Qwen3.5's Gated DeltaNet): no sliding window."""
        text_config = config.get_text_config(decoder=True)
        known = ("full_attention", LINEAR_ATTENTION)
        kinds = sorted({kind for kind in getattr(text_config, "layer_types", None) or [] if kind not in known})
        if kinds:
            return f"{' and '.join(kinds)} layers: the static cache holds full- and linear-attention layers only"
        return None

    # ----- buffers -------------------------------------------------------------------------
    def _buffers(self, rows: int, max_cache_len: int) -> DecodeBuffers:
        return DecodeBuffers(
            rows=rows,
            max_cache_len=max_cache_len,
            position_dims=self._positions_layout(),
            dims=self._dims,
            device=self.device,
        )

    def static_buffers(self) -> DecodeBuffers:
        """The buffers every graph reads and writes (allocated at the first use)."""
        if self._static is None:
            self._static = self._buffers(self.config.max_batch_size, self.config.max_cache_len)
        return self._static

    def _positions_layout(self) -> tuple[int, ...]:
        """Leading dims of the model's own generation position ids (probed on one token)."""
        if self._position_dims is None:
            probe = torch.zeros(1, 1, dtype=torch.long, device=self.device)
            positions = generation_position_ids(self.model, probe, {"attention_mask": probe + 1})
            self._position_dims = tuple(positions.shape[:-2])
        return self._position_dims

    # ----- capture -------------------------------------------------------------------------
    def capture(self) -> None:
        """Capture every (bucket, length tier), largest first, into this runner's own graph pool
        (with `lazy`, none yet: `generate` captures those it needs)."""
        if self.disabled_reason is not None or self.captured:
            self.captured = True
            return
        self.static_buffers()
        if not self.lazy:
            self._capture_graphs(product(self.config.buckets, self.config.length_tiers))
        self.captured = True

    def _capture_graphs(self, keys: Iterable[tuple[int, int]]) -> None:
        buffers = self.static_buffers()
        if self._graphs.capture(sorted(keys, reverse=True), lambda key: self._capture_graph(buffers, *key),
                                lambda key: f"batch {key[0]}, tier {key[1]}"):
            logger.info(
                "captured decoder graphs (bucket, tier) %s in %.2f s, %.1f MiB",
                sorted(self.graphs), self._graphs.seconds, self._graphs.memory_bytes / 2**20,
            )

    @property
    def graphs(self) -> dict[tuple[int, int], torch.cuda.CUDAGraph]:
        """The captured graphs by (bucket, length tier): the graph cache's."""
        return self._graphs.graphs

    def _capture_graph(self, buffers: DecodeBuffers, bucket: int, tier: int) -> torch.cuda.CUDAGraph:
        cache = buffers.store.cache(bucket, tier)
        with torch.inference_mode(), self._idle_lanes(buffers, bucket, tier):
            graph, _ = self._graphs.graph(lambda: self._step(buffers, bucket, tier, cache))
        self._caches[bucket, tier] = cache  # the graph reads these views: keep them alive
        return graph

    def warm_up(self) -> None:
        """One eager step at the largest bucket and one at a single row, over the shortest tier:
        what `torch.compile` of the step's layers compiles before any capture."""
        from torch._inductor import config as inductor  # slow to import: only where compiled

        buffers, tier = self.static_buffers(), self.config.length_tiers[0]
        # With coordinate-descent tuning inductor turns one-row GEMMs (a batch of one) into Triton
        # reductions tuned per shape and fused with their neighbours (gpt-fast's setting). Larger
        # batches keep cuBLAS, so their step compiles untuned. Tuned kernels skip the static
        # launcher (they run inside graphs): torch 2.11 reloads a cached static kernel at its
        # untuned config and tunes it again, seconds of every warm start.
        for bucket in sorted({self.config.buckets[-1], 1}):
            tuned = bucket == 1
            with inductor.patch(coordinate_descent_tuning=tuned, use_static_cuda_launcher=not tuned):
                with torch.inference_mode(), self._idle_lanes(buffers, bucket, tier):
                    self._step(buffers, bucket, tier, buffers.store.cache(bucket, tier))

    @contextmanager
    def _idle_lanes(self, buffers: DecodeBuffers, bucket: int, tier: int) -> Iterator[None]:
        """`bucket` padded lanes (no sequence) for a step that only warms up or captures."""
        buffers.start(
            batch=0, rows=bucket, prompt_mask=buffers.mask[:0, :0], next_positions=buffers.positions.narrow(-2, 0, 0)
        )
        with static_rope(self.model, tier):  # positions stay below `tier`: no host check needed
            yield

    def _step(self, buffers: DecodeBuffers, rows: int, tier: int, cache: SlotCache) -> None:
        decode_step(self.model, self.stack, buffers, rows, tier, cache)

    def unfit_reason(self, batch: int, needed_slots: int) -> str | None:
        """Why a call of `batch` sequences that need `needed_slots` cache slots each does not fit
        the static cache (None: it fits). Such a call is refused, not given a cache of its own
        (a whole second store, allocated per call): `enable_cuda_graphs` sends it to the stock
        `generate` with this reason."""
        if needed_slots > self.config.max_cache_len:
            return f"sequence of {needed_slots} cache slots, longer than decoder max_cache_len {self.config.max_cache_len}"
        if batch > self.config.max_batch_size:
            return f"batch of {batch}, larger than decoder max_batch_size {self.config.max_batch_size}"
        return None

    def call_unfit(self, rows: int, prompt_len: int, max_new_tokens: int) -> str | None:
        """`unfit_reason` of a generate call of `rows` prompts `prompt_len` slots long (one new
        token takes no decode step: any call of one fits)."""
        return self.unfit_reason(rows, prompt_len + max_new_tokens - 1) if max_new_tokens > 1 else None

    def _route(self, batch: int, needed_slots: int) -> Route:
        assert self.unfit_reason(batch, needed_slots) is None, "generate refuses what the static cache cannot hold"
        bucket = next((b for b in self.config.buckets if b >= batch), None)
        if bucket is None:
            return Route(self.static_buffers(), batch, EagerReason.OVER_LARGEST_BUCKET)
        # Eager steps take the same padded bucket as a replay would: one code path everywhere.
        return Route(self.static_buffers(), bucket, None)

    def _capture_first_use(self, route: Route, first_slots: int, last_slots: int) -> None:
        """With `lazy`, capture the graphs of `route`'s bucket for the length tiers its steps read
        (from `first_slots` to `last_slots` slots): before the prefill fills the static cache,
        since a capture runs idle steps over it."""
        if not self.lazy or not self.captured or self.disabled_reason is not None or route.eager_reason:
            return
        tiers = self.config.length_tiers
        low = smallest_fitting_budget(tiers, first_slots) or tiers[-1]
        high = smallest_fitting_budget(tiers, last_slots) or tiers[-1]
        self._capture_graphs((route.rows, tier) for tier in tiers if low <= tier <= high)  # those not tried

    def _tier(self, route: Route, needed_slots: int) -> Tier:
        """The smallest length tier holding `needed_slots`; past the last one (a route's own longer
        buffers), all of the route's slots."""
        tier = smallest_fitting_budget(self.config.length_tiers, needed_slots) or route.buffers.max_cache_len
        slots = min(tier, route.buffers.max_cache_len)
        if needed_slots > slots:  # the step writes slot needed_slots - 1: the decode kernel trusts it to fit
            raise RuntimeError(f"a decode step needs {needed_slots} cache slots, its tier holds {slots}")
        graph = self.graphs.get((route.rows, tier)) if route.eager_reason is None else None
        if graph is not None:
            return Tier(tier, graph, None, None)
        reason = route.eager_reason or self._eager_reason()
        return Tier(tier, None, route.buffers.store.cache(route.rows, tier), reason)

    def _eager_reason(self) -> EagerReason:
        """Why a route that fits a bucket has no graph (its capture's error: `failed_graphs`)."""
        if self.disabled_reason is not None:
            return self.disabled_reason
        if not self.captured:
            return EagerReason.NOT_CAPTURED
        return EagerReason.CAPTURE_FAILED

    # ----- statistics ----------------------------------------------------------------------
    def reset_stats(self) -> None:
        self.counters = DecodeCounters()

    def stats(self) -> dict:
        return self.typed_stats().to_json()  # the JSON's keys: engine/statistics.py

    def typed_stats(self) -> DecoderStats:
        return DecoderStats(
            enabled=self.disabled_reason is None,
            disabled_reason=self.disabled_reason,
            step="fused layers" if self.stack is not None else "model forward",
            prefill="packed" if self.packed_prefill else "left-padded",
            **self.counters.counts(),
            buckets=list(self.config.buckets),
            length_tiers=list(self.config.length_tiers),
            captured_graphs=[list(key) for key in sorted(self.graphs)],
            failed_graphs={f"batch {b}, tier {t}": reason for (b, t), reason in sorted(self._graphs.failed.items())},
            max_cache_len=self.config.max_cache_len,
            capture_seconds=self._graphs.seconds,
            graph_memory_bytes=self._graphs.memory_bytes,
            static_buffer_bytes=self._static.nbytes if self._static is not None else 0,
        )

    def format_stats(self) -> str:
        return format_decoder_stats(self.typed_stats())

    def close(self) -> None:
        """Free the graphs, their pool and the static buffers; give the stacked projections of the
        fused step their own weights back (later steps run through the model's forward)."""
        self._graphs.clear(forget_failures=True)  # a later capture's step is the model's, not the fused one
        self._caches.clear()
        self._static = None
        self.captured = False
        self.stack = None
        self._rewrites.undo()
