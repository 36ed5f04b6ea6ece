"""The language model's decode step captured as CUDA graphs, one per (batch-size bucket, length tier).

Prefill is the model's own forward (eager, dynamic cache, exactly what `generate` runs); its keys
and values are copied into a static cache, and each decode step then replays the graph of the
smallest bucket that holds the batch and the smallest length tier that holds its sequences: that
graph's attention reads only the tier's first slots of the one cache allocation. The tier of each
step is known on the host (prompt length + step index), so switching tiers needs no sync. Without
CUDA, with `enabled=False`, or when no graph fits, the same step function runs eagerly over the
same tiers, so the CPU path exercises the same logic.
"""

import logging
import time
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import product

import torch
from transformers import DynamicCache

from encoder_graphs.generation import token_id_list
from encoder_graphs.packing import generate_budgets, smallest_fitting_budget
from encoder_graphs.sampling import SamplingParams, select_next_tokens
from encoder_graphs.static_cache import DECODE_ATTENTION, SlotCache, StaticKVStore
from encoder_graphs.stats import LatencyRecorder

logger = logging.getLogger(__name__)

_POWER_BUCKETS = (1, 2, 4, 8, 16, 32)
_BUCKET_STEP = 16
_MIN_LENGTH_TIER = 256


def default_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, then steps of 16; `max_batch_size` is always the largest."""
    buckets = {b for b in _POWER_BUCKETS if b < max_batch_size}
    buckets.update(range(_POWER_BUCKETS[-1] + _BUCKET_STEP, max_batch_size, _BUCKET_STEP))
    buckets.add(max_batch_size)
    return sorted(buckets)


def default_length_tiers(max_cache_len: int) -> list[int]:
    """256, 512, 1024, ... below `max_cache_len`, which is always the last tier."""
    return generate_budgets(min(_MIN_LENGTH_TIER, max_cache_len), max_cache_len)


@dataclass
class DecoderGraphConfig:
    max_batch_size: int = 32
    max_cache_len: int = 4096
    buckets: list[int] = field(default_factory=list)
    length_tiers: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_cache_len < 2:
            raise ValueError(f"max_cache_len must be >= 2, got {self.max_cache_len}")
        self.buckets = sorted(set(self.buckets)) or default_buckets(self.max_batch_size)
        if self.buckets[0] < 1 or self.buckets[-1] > self.max_batch_size:
            raise ValueError(f"buckets must lie in [1, {self.max_batch_size}], got {self.buckets}")
        tiers = sorted(set(self.length_tiers)) or default_length_tiers(self.max_cache_len)
        if tiers[0] < 2 or tiers[-1] > self.max_cache_len:
            raise ValueError(f"length_tiers must lie in [2, {self.max_cache_len}], got {self.length_tiers}")
        self.length_tiers = tiers if tiers[-1] == self.max_cache_len else [*tiers, self.max_cache_len]


@dataclass(frozen=True)
class TextDims:
    """The sizes of the language model that the decode buffers are allocated for."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype: torch.dtype


class DecodeBuffers:
    """Everything a decode step reads or writes, for `rows` sequences; a bucket uses the first
    `bucket` rows. Addresses never change, so captured graphs stay valid."""

    def __init__(
        self,
        *,
        rows: int,
        max_cache_len: int,
        position_dims: tuple[int, ...],
        dims: TextDims,
        device: torch.device,
    ) -> None:
        self.store = StaticKVStore(
            num_layers=dims.num_layers,
            rows=rows,
            num_kv_heads=dims.num_kv_heads,
            head_dim=dims.head_dim,
            max_cache_len=max_cache_len,
            dtype=dims.dtype,
            device=device,
        )
        self.input_ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        # Same leading dims as the prefill's position ids ([4] for Qwen-VL: text + 3 M-RoPE axes).
        self.positions = torch.zeros(*position_dims, rows, 1, dtype=torch.long, device=device)
        self.mask = torch.zeros(rows, max_cache_len, dtype=torch.bool, device=device)
        self.logits = torch.zeros(rows, dims.vocab_size, dtype=torch.float32, device=device)

    @property
    def max_cache_len(self) -> int:
        return self.store.max_cache_len

    @property
    def nbytes(self) -> int:
        return self.store.nbytes + sum(t.nbytes for t in (self.input_ids, self.positions, self.mask, self.logits))

    def start(
        self, *, batch: int, rows: int, prompt_mask: torch.Tensor, next_positions: torch.Tensor
    ) -> None:
        """Set up rows [0, rows) for a decode that continues a prefill of `batch` sequences.
        Rows past `batch` are padded lanes: token 0, position 0, attending only their own new slots
        (never an empty row, whose softmax would be NaN)."""
        prompt_len = prompt_mask.shape[1]
        self.mask[:rows].zero_()
        self.mask[:batch, :prompt_len].copy_(prompt_mask.bool())
        self.store.slot.fill_(prompt_len)
        positions = self.positions.narrow(-2, 0, rows)
        positions.zero_()
        positions.narrow(-2, 0, batch).copy_(next_positions)
        self.input_ids[:rows].zero_()


@dataclass
class _Route:
    """Where a generate call's decode steps run: `rows` rows of `buffers`; `eager_reason` when no
    graph can serve any of its steps."""

    buffers: DecodeBuffers
    rows: int
    eager_reason: str | None


@dataclass
class _Tier:
    """How the decode steps whose sequences fit `tier` slots run: a graph, or eagerly over `cache`."""

    tier: int
    graph: torch.cuda.CUDAGraph | None
    cache: SlotCache | None
    eager_reason: str | None


class DecoderGraphRunner:
    """`generate` for a Hugging Face vision-language model: the model's own prefill, then decode
    steps replayed from CUDA graphs per (batch bucket, length tier), or run eagerly over the same
    buffers."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_batch_size: int = 32,
        batch_sizes: Sequence[int] | None = None,
        max_cache_len: int = 4096,
        length_tiers: Sequence[int] | None = None,
        enabled: bool = True,
    ) -> None:
        self.model = model
        self.config = DecoderGraphConfig(
            max_batch_size, max_cache_len, list(batch_sizes or []), list(length_tiers or [])
        )
        text_config = model.config.get_text_config(decoder=True)
        self._text_config = text_config
        if any(kind != "full_attention" for kind in getattr(text_config, "layer_types", None) or []):
            raise ValueError("decoder graphs support full-attention layers only (no sliding window)")
        lm_head = model.get_output_embeddings().weight
        self.device = lm_head.device
        self._dims = TextDims(
            num_layers=text_config.num_hidden_layers,
            num_kv_heads=text_config.num_key_value_heads,
            head_dim=getattr(text_config, "head_dim", None)
            or text_config.hidden_size // text_config.num_attention_heads,
            vocab_size=lm_head.shape[0],
            dtype=model.dtype,
        )
        if not enabled:
            self.disabled_reason: str | None = "disabled (enabled=False)"
        elif not torch.cuda.is_available() or self.device.type != "cuda":
            self.disabled_reason = "no CUDA device"
        else:
            self.disabled_reason = None

        self._position_dims: tuple[int, ...] | None = None
        self._shared: DecodeBuffers | None = None
        self._caches: dict[tuple[int, int], SlotCache] = {}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (bucket, tier) -> graph
        self.failed_graphs: dict[tuple[int, int], str] = {}
        self._pool = None
        self.captured = False
        self.capture_seconds = 0.0
        self.graph_memory_bytes = 0
        self.reset_stats()

    # ----- buffers -------------------------------------------------------------------------
    def _buffers(self, rows: int, max_cache_len: int) -> DecodeBuffers:
        return DecodeBuffers(
            rows=rows,
            max_cache_len=max_cache_len,
            position_dims=self._positions_layout(),
            dims=self._dims,
            device=self.device,
        )

    def _shared_buffers(self) -> DecodeBuffers:
        if self._shared is None:
            self._shared = self._buffers(self.config.max_batch_size, self.config.max_cache_len)
        return self._shared

    def _positions_layout(self) -> tuple[int, ...]:
        """Leading dims of the model's own generation position ids (probed on one token)."""
        if self._position_dims is None:
            probe = torch.zeros(1, 1, dtype=torch.long, device=self.device)
            positions = self.model._prepare_position_ids_for_generation(probe, {"attention_mask": probe + 1})
            self._position_dims = tuple(positions.shape[:-2])
        return self._position_dims

    # ----- the step ------------------------------------------------------------------------
    def _step(self, buffers: DecodeBuffers, rows: int, tier: int, cache: SlotCache) -> None:
        """One decode step for rows [0, rows) over slots [0, tier) (`cache` views exactly those):
        reads input ids, positions, mask and slot; writes logits; advances slot and positions.
        Only fixed-shape device work: it is what graphs hold."""
        slot = buffers.store.slot
        mask = buffers.mask[:rows, :tier]
        mask.index_fill_(1, slot, True)
        # Prefill keeps the model's own attention; decode steps use the static-cache one. Only
        # the Python dispatch changes, so a captured graph holds the decode kernels for good.
        own_attention = self._text_config._attn_implementation
        self._text_config._attn_implementation = DECODE_ATTENTION
        try:
            output = self.model(
                input_ids=buffers.input_ids[:rows],
                position_ids=buffers.positions.narrow(-2, 0, rows),
                attention_mask=mask[:, None, None, :],
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        finally:
            self._text_config._attn_implementation = own_attention
        buffers.logits[:rows].copy_(output.logits[:, -1])
        slot.add_(1)
        buffers.positions.add_(1)

    # ----- capture -------------------------------------------------------------------------
    def capture(self) -> None:
        """Capture every (bucket, length tier), largest first, into this runner's own graph memory pool."""
        if self.disabled_reason is not None or self.captured:
            self.captured = True
            return
        buffers = self._shared_buffers()
        torch.cuda.synchronize(self.device)
        reserved_before = torch.cuda.memory_reserved(self.device)
        started = time.perf_counter()
        self._pool = torch.cuda.graph_pool_handle()
        for bucket, tier in sorted(product(self.config.buckets, self.config.length_tiers), reverse=True):
            try:
                self._capture_graph(buffers, bucket, tier)
            except (torch.cuda.OutOfMemoryError, RuntimeError) as error:
                self.failed_graphs[bucket, tier] = f"{type(error).__name__}: {error}"[:200]
                warnings.warn(
                    f"decoder graph capture failed for batch {bucket}, tier {tier}; it runs eagerly: {error}",
                    stacklevel=2,
                )
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - started
        self.graph_memory_bytes = torch.cuda.memory_reserved(self.device) - reserved_before
        self.captured = True
        logger.info(
            "captured decoder graphs (bucket, tier) %s in %.2f s, %.1f MiB",
            sorted(self.graphs),
            self.capture_seconds,
            self.graph_memory_bytes / 2**20,
        )

    def _capture_graph(self, buffers: DecodeBuffers, bucket: int, tier: int) -> None:
        cache = buffers.store.cache(bucket, tier)
        with torch.inference_mode():
            buffers.start(
                batch=0,
                rows=bucket,
                prompt_mask=buffers.mask[:0, :0],
                next_positions=buffers.positions.narrow(-2, 0, 0),
            )
            # Warm up off the capture stream: lazy inits and workspaces must not land in the graph.
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._step(buffers, bucket, tier, cache)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._step(buffers, bucket, tier, cache)
        self._caches[bucket, tier] = cache  # the graph reads these views: keep them alive
        self.graphs[bucket, tier] = graph

    # ----- generate ------------------------------------------------------------------------
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_p: float = 1.0,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        generator: torch.Generator | None = None,
        stop_check_interval: int = 8,
        **model_inputs: torch.Tensor,
    ) -> torch.Tensor:
        """Prompt ids followed by new ids, [batch, prompt_len + new], as `generate` returns them:
        left-padded prompts in, finished sequences padded with `pad_token_id` after their EOS."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if stop_check_interval < 1:
            raise ValueError(f"stop_check_interval must be >= 1, got {stop_check_interval}")
        params = SamplingParams(do_sample, temperature, top_p)
        eos_ids = self._eos_ids(eos_token_id)
        pad_id = self._pad_id(pad_token_id, eos_ids)
        input_ids = input_ids.to(self.device)
        attention_mask = (
            torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(self.device)
        )
        model_inputs = self._model_inputs(input_ids, model_inputs)
        batch, prompt_len = input_ids.shape
        on_cuda = self.device.type == "cuda"

        with torch.inference_mode():
            logits, prefill_kv, next_positions = self._prefill(input_ids, attention_mask, model_inputs)
            eos = torch.tensor(eos_ids, dtype=torch.long, device=self.device)
            tokens = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long, device=self.device)
            unfinished = torch.ones(batch, dtype=torch.bool, device=self.device)
            lengths = torch.zeros(batch, dtype=torch.long, device=self.device)

            def emit(step: int, chosen: torch.Tensor) -> torch.Tensor:
                chosen = torch.where(unfinished, chosen, pad_id)
                tokens[:, step] = chosen
                lengths.add_(unfinished)
                unfinished.logical_and_(torch.isin(chosen, eos, invert=True))
                return chosen

            chosen = emit(0, select_next_tokens(logits, params, generator))
            steps = 0
            if max_new_tokens > 1:
                route = self._route(batch, prompt_len + max_new_tokens - 1)
                buffers = route.buffers
                buffers.store.load_prefill(prefill_kv)
                del prefill_kv
                buffers.start(
                    batch=batch, rows=route.rows, prompt_mask=attention_mask, next_positions=next_positions
                )
                tier = None
                started = self._timer.start(on_cuda)
                for step in range(1, max_new_tokens):
                    if eos_ids and step % stop_check_interval == 0 and not bool(unfinished.any()):
                        break
                    # This step writes slot prompt_len + step - 1 and attends over every slot up to it.
                    if tier is None or prompt_len + step > tier.tier:
                        tier = self._tier(route, prompt_len + step)
                    buffers.input_ids[:batch, 0].copy_(chosen)
                    if tier.graph is not None:
                        tier.graph.replay()
                    else:
                        self._step(buffers, route.rows, tier.tier, tier.cache)
                    chosen = emit(step, select_next_tokens(buffers.logits[:batch], params, generator))
                    self._count(route, tier, batch)
                    steps += 1
                self._timer.stop(started, steps)
            new_tokens = int(lengths.max())
        self.sequences += batch
        self.calls += 1
        return torch.cat([input_ids, tokens[:, :new_tokens]], dim=1)

    def _prefill(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, model_inputs: dict
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """The model's own first forward, as `generate` runs it. Returns the last logits (float32),
        the per-layer keys and values, and the position ids of the first decode step."""
        positions = self.model._prepare_position_ids_for_generation(
            input_ids, {"attention_mask": attention_mask, **model_inputs}
        )
        cache = DynamicCache(config=self._text_config)
        output = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            **model_inputs,
        )
        prefill_kv = [(layer.keys, layer.values) for layer in cache.layers]
        return output.logits[:, -1].float(), prefill_kv, positions[..., -1:] + 1

    def _route(self, batch: int, needed_slots: int) -> _Route:
        if needed_slots > self.config.max_cache_len:
            reason = f"sequence longer than max_cache_len {self.config.max_cache_len}"
            return _Route(self._buffers(batch, needed_slots), batch, reason)
        bucket = next((b for b in self.config.buckets if b >= batch), None)
        if bucket is None:
            reason = f"batch larger than largest bucket {self.config.buckets[-1]}"
            if batch > self.config.max_batch_size:
                return _Route(self._buffers(batch, self.config.max_cache_len), batch, reason)
            return _Route(self._shared_buffers(), batch, reason)
        # Eager steps take the same padded bucket as a replay would: one code path everywhere.
        return _Route(self._shared_buffers(), bucket, None)

    def _tier(self, route: _Route, needed_slots: int) -> _Tier:
        """The smallest length tier holding `needed_slots`; past the last one (a route's own longer
        buffers), all of the route's slots."""
        tier = smallest_fitting_budget(self.config.length_tiers, needed_slots) or route.buffers.max_cache_len
        graph = self.graphs.get((route.rows, tier)) if route.eager_reason is None else None
        if graph is not None:
            return _Tier(tier, graph, None, None)
        reason = route.eager_reason or self._eager_reason(route.rows, tier)
        return _Tier(tier, None, route.buffers.store.cache(route.rows, tier), reason)

    def _eager_reason(self, bucket: int, tier: int) -> str:
        if self.disabled_reason is not None:
            return self.disabled_reason
        if not self.captured:
            return "capture() not called"
        return f"capture of batch {bucket}, tier {tier} failed"

    def _model_inputs(self, input_ids: torch.Tensor, model_inputs: dict) -> dict:
        inputs = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in model_inputs.items()}
        multimodal = inputs.get("image_grid_thw") is not None or inputs.get("video_grid_thw") is not None
        if multimodal and inputs.get("mm_token_type_ids") is None:
            # What the Qwen-VL processors return: 0 text, 1 image, 2 video.
            config = self.model.config
            types = torch.zeros_like(input_ids)
            types[input_ids == config.image_token_id] = 1
            types[input_ids == config.video_token_id] = 2
            inputs["mm_token_type_ids"] = types
        return inputs

    def _eos_ids(self, eos_token_id: int | Sequence[int] | None) -> list[int]:
        if eos_token_id is None:
            eos_token_id = self.model.generation_config.eos_token_id
        return token_id_list(eos_token_id)

    def _pad_id(self, pad_token_id: int | None, eos_ids: list[int]) -> int:
        if pad_token_id is None:
            pad_token_id = self.model.generation_config.pad_token_id
        if pad_token_id is None:
            pad_token_id = eos_ids[0] if eos_ids else 0  # what generate falls back to
        return int(pad_token_id)

    # ----- statistics ----------------------------------------------------------------------
    def _count(self, route: _Route, tier: _Tier, batch: int) -> None:
        """Count one decode step."""
        self.steps += 1
        self.real_lanes += batch
        self.padded_lanes += route.rows
        self.steps_per_tier[tier.tier] += 1
        if tier.graph is not None:
            self.graph_steps += 1
            self.replays[route.rows] += 1
            self.tier_replays[tier.tier] += 1
        else:
            self.eager_reasons[tier.eager_reason] += 1

    def reset_stats(self) -> None:
        self.calls = 0
        self.sequences = 0
        self.steps = 0
        self.graph_steps = 0
        self.eager_reasons: Counter = Counter()
        self.replays: Counter = Counter()  # bucket -> graph replays
        self.tier_replays: Counter = Counter()  # length tier -> graph replays
        self.steps_per_tier: Counter = Counter()  # length tier -> decode steps, replayed or eager
        self.real_lanes = 0
        self.padded_lanes = 0
        self._timer = LatencyRecorder()

    def stats(self) -> dict:
        shared = self._shared
        return {
            "enabled": self.disabled_reason is None,
            "disabled_reason": self.disabled_reason,
            "calls": self.calls,
            "sequences": self.sequences,
            "steps": self.steps,
            "graph_steps": self.graph_steps,
            "eager_steps": self.steps - self.graph_steps,
            "eager_reasons": dict(self.eager_reasons),
            "replays_per_bucket": dict(sorted(self.replays.items())),
            "replays_per_tier": dict(sorted(self.tier_replays.items())),
            "steps_per_tier": dict(sorted(self.steps_per_tier.items())),
            "lane_waste_pct": 100.0 * (1 - self.real_lanes / self.padded_lanes) if self.padded_lanes else 0.0,
            "buckets": list(self.config.buckets),
            "length_tiers": list(self.config.length_tiers),
            "captured_graphs": [list(key) for key in sorted(self.graphs)],
            "failed_graphs": {
                f"batch {b}, tier {t}": reason for (b, t), reason in sorted(self.failed_graphs.items())
            },
            "max_cache_len": self.config.max_cache_len,
            "capture_seconds": self.capture_seconds,
            "graph_memory_bytes": self.graph_memory_bytes,
            "static_buffer_bytes": shared.nbytes if shared is not None else 0,
            "decode_ms_per_step": self._timer.summary(),
        }

    def format_stats(self) -> str:
        return format_decoder_stats(self.stats())

    def close(self) -> None:
        """Free the graphs, their pool and the static buffers."""
        self.graphs.clear()
        self._caches.clear()
        self._shared = None
        self._pool = None
        self.captured = False


def format_decoder_stats(stats: dict) -> str:
    """A readable table of `DecoderGraphRunner.stats()`."""
    state = "on" if stats["enabled"] else f"off ({stats['disabled_reason']})"
    timing = stats["decode_ms_per_step"]
    memory_mib = stats["graph_memory_bytes"] / 2**20
    lines = [
        f"decoder graphs: {state}",
        f"  sequences {stats['sequences']}, decode steps {stats['steps']}, graph steps "
        f"{stats['graph_steps']}, eager steps {stats['eager_steps']}, "
        f"lane waste {stats['lane_waste_pct']:.1f}%",
        f"  capture {stats['capture_seconds']:.2f} s, graph memory {memory_mib:.1f} MiB, "
        f"static buffers {stats['static_buffer_bytes'] / 2**20:.1f} MiB",
        f"  decode ms/step: mean {timing['mean']:.2f}  p50 {timing['p50']:.2f}",
        "  replays per bucket: "
        + (", ".join(f"{b} x{n}" for b, n in stats["replays_per_bucket"].items()) or "-"),
        f"  length tiers {stats['length_tiers']}; steps per tier: "
        + (", ".join(f"{t} x{n}" for t, n in stats["steps_per_tier"].items()) or "-"),
    ]
    lines += [f"  eager: {reason} x{count}" for reason, count in stats["eager_reasons"].items()]
    lines += [f"  capture of {graph} failed: {reason}" for graph, reason in stats["failed_graphs"].items()]
    return "\n".join(lines)
