"""Every private or version-sensitive use of transformers, in one place.

The rest of the package reaches transformers' internals only through this module, so a new
transformers release is checked (and, where needed, mended) here. Each entry says which versions
it was checked on; `TESTED_RANGE` is the range CI runs (both ends) and `pyproject.toml` allows.
"""

import inspect
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

import torch
import transformers
from packaging.version import Version
from transformers import (
    AttentionInterface,
    DynamicCache,
    GenerationConfig,
    GenerationMixin,
    PretrainedConfig,
    PreTrainedModel,
)

# 5.17.0, 5.23.0: what `ACT2FN["silu"]` builds (not an nn.SiLU).
from transformers.activations import SiLUActivation

# 5.17.0, 5.23.0: the cache layer API the decoder's static cache implements (update, lazy init,
# mask sizes, sequence length; is_compileable / is_sliding / is_initialized), and a Cache built
# from a list of layers.
from transformers.cache_utils import Cache, CacheLayerMixin

# 5.17.0, 5.23.0: the generation modes `GenerationConfig.get_generation_mode()` returns.
from transformers.generation.configuration_utils import GenerationMode

# 5.17.0, 5.23.0: the grid of tiles GotOcr2's image processors (InternVL's) choose for an image:
# (columns, rows) from its (height, width), the tile size and the fewest and most tiles.
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas as tiled_canvas

# Checked on 5.17.0 and 5.23.0: the vision helpers Qwen-VL forwards call on their grids.
from transformers.vision_utils import (
    get_vision_cu_seqlens,
    get_vision_interpolation_indices_and_weights,
    get_vision_position_ids,
    get_vision_window_index,
)

from encoder_graphs.models.attention import VarlenAttention, causal_varlen_attention, get_attention_backend
from encoder_graphs.models.rewrites import Rewrites, made_like

TESTED_RANGE = ("5.17.0", "5.23.0")
_VARLEN_PREFIX = "encoder_graphs_flash_"
_warned: list[str] = []

__all__ = [
    "TESTED_RANGE",
    "TOKEN_INPUTS",
    "Cache",
    "CacheLayerMixin",
    "GenerationMode",
    "attention_implementation",
    "chained_block_forward",
    "check_version",
    "decode_rotary",
    "deepstack_output",
    "dynamic_cache",
    "from_config",
    "gated_silu_mlp_forward",
    "generate_arguments",
    "generation_position_ids",
    "generation_settings",
    "get_vision_cu_seqlens",
    "get_vision_interpolation_indices_and_weights",
    "get_vision_position_ids",
    "get_vision_window_index",
    "is_gated_silu_mlp",
    "is_qwen2_5_vision_block",
    "is_stock_rms_norm",
    "layer_key_values",
    "packed_sequences",
    "permute_qk",
    "prepare_generation_config",
    "register_dense_attention",
    "register_varlen_attention",
    "rms_norm_forward",
    "static_rope",
    "tiled_canvas",
    "window_attention_forward",
]


def check_version(version: str = transformers.__version__) -> bool:
    """Warn once when transformers is outside the tested range; True when inside it."""
    low, high = (Version(v) for v in TESTED_RANGE)
    tested = low <= Version(version) and Version(version).release[:2] <= high.release[:2]
    if not tested and version not in _warned:
        _warned.append(version)
        warnings.warn(
            f"encoder-graphs was tested with transformers {TESTED_RANGE[0]} to {TESTED_RANGE[1][:-2]}.x; "
            f"{version} is untested: graphs may fail or differ from stock outputs",
            stacklevel=2,
        )
    return tested


# 5.17.0, 5.23.0: the implementation name lives in the private `config._attn_implementation`, and
# attention modules read it at every forward, so setting it switches kernels without a rebuild.
@contextmanager
def attention_implementation(config: PretrainedConfig, name: str) -> Iterator[None]:
    """Run modules configured by `config` with attention implementation `name`, then restore it."""
    original = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = original


def _varlen_forward(attention: VarlenAttention) -> Callable[..., tuple[torch.Tensor, None]]:
    """`attention` as transformers calls an attention implementation, over the packed rows of a
    varlen call: q, k, v [1, heads, tokens, head_dim] in, [1, tokens, heads, head_dim] out."""

    def forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        max_length_q: int | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
        return attention(q, k, v, cu_seq_lens_q, max_length_q, scale=scaling).unsqueeze(0), None

    return forward


# 5.17.0, 5.23.0: Qwen vision attention takes its cu_seqlens (varlen) branch only when the
# implementation's name contains "flash", and there passes a host-int `max_length_q`: what graph
# capture needs. (No "flash" in a name: transformers then treats it as an ordinary kernel.)
def register_varlen_attention(backend: str) -> str:
    """Register varlen backend `backend` with transformers (once); the implementation name to use."""
    name = _VARLEN_PREFIX + backend
    # Out of torch.compile'd blocks: its host-int max length differs per budget (engine/compile.py).
    AttentionInterface.register(name, torch.compiler.disable(_varlen_forward(get_attention_backend(backend))))
    return name


# 5.17.0, 5.23.0: a Qwen2.5-VL vision block calls its attention as `attn(hidden, cu_seqlens=,
# max_seqlen=, position_embeddings=(cos, sin))`, cos and sin [rows, head_dim] with equal halves
# (the rotary's `recomposition_frequencies`). The module holds one fused `qkv` projection (its
# outputs q, k, v, each num_heads x head_dim, head-major), `proj`, `num_heads`, `head_dim` and
# `scaling`; it rotates q and k with `rotate_half` in fp32, attends within each segment, projects.
def window_attention_forward(
    attention: torch.nn.Module, attend: Callable[..., torch.Tensor]
) -> Callable[..., torch.Tensor]:
    """A forward for Qwen2.5-VL vision attention `attention` that hands q, k, v (views of its qkv
    output), cos, sin and cu_seqlens to `attend` (`rotary_window_attention`), which rotates and
    attends in one kernel."""

    def forward(
        hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        **kwargs,
    ) -> torch.Tensor:
        rows = hidden_states.shape[0]
        q, k, v = attention.qkv(hidden_states).view(rows, 3, attention.num_heads, attention.head_dim).unbind(1)
        cos, sin = position_embeddings
        return attention.proj(attend(q, k, v, cos, sin, cu_seqlens, scale=attention.scaling).flatten(1))

    return forward


def permute_qk(attention: torch.nn.Module, order: torch.Tensor, rewrites: Rewrites) -> None:
    """Reorder the dims of every q and k head of Qwen2.5-VL vision attention `attention` by
    `order` (one head's dims), in its qkv weights and bias; v keeps its order. Exact, and undone
    (by the inverse order) with `rewrites`."""
    heads, head_dim = attention.num_heads, attention.head_dim
    qk = (torch.arange(2 * heads)[:, None] * head_dim + order[None, :]).flatten()
    rows = torch.cat([qk, torch.arange(2 * heads * head_dim, 3 * heads * head_dim)])
    inverse = torch.argsort(rows)
    for name in ("weight", "bias"):
        param = getattr(attention.qkv, name)
        with made_like(param):
            permuted = param.detach()[rows.to(param.device)]
        rewrites.replace_data(attention.qkv, name, permuted, stock=lambda data: data[inverse.to(data.device)])


# 5.17.0, 5.23.0: a Qwen2.5-VL vision MLP computes `down_proj(act_fn(gate_proj(x)) * up_proj(x))`
# with `act_fn` from its config's hidden_act (SiLU in the released models).
def is_gated_silu_mlp(mlp: torch.nn.Module) -> bool:
    """Whether `mlp` is a stock gated MLP with a SiLU gate."""
    act = getattr(mlp, "act_fn", None)
    return isinstance(act, (SiLUActivation, torch.nn.SiLU)) and all(
        hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj")
    )


def gated_silu_mlp_forward(
    mlp: torch.nn.Module, gated: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A forward for the gated MLP `mlp` (`is_gated_silu_mlp`) whose SiLU(gate(x)) * up(x) is
    `gated(x)` (`kernels/swiglu.py`'s `swiglu_linear`)."""

    def forward(hidden_state: torch.Tensor) -> torch.Tensor:
        return mlp.down_proj(gated(hidden_state))

    return forward


# 5.17.0, 5.23.0: the RMSNorms of the Qwen-VL language models (and InternVL's Qwen2/Qwen3) compute
# `weight * (x.float() * rsqrt(mean(x.float()**2) + variance_epsilon)).to(x.dtype)` with `weight`
# [hidden] (a zero-centred norm, Gemma's `1 + weight`, is not among them).
_STOCK_RMS_NORMS = frozenset(
    {"Qwen2RMSNorm", "Qwen3RMSNorm", "Qwen2VLRMSNorm", "Qwen2_5_VLRMSNorm", "Qwen3VLTextRMSNorm"}
)


def is_stock_rms_norm(module: torch.nn.Module) -> bool:
    """Whether `module` is one of those RMSNorms running its class's own forward."""
    return (
        type(module).__name__ in _STOCK_RMS_NORMS
        and type(module).__module__.startswith("transformers.models.")
        and "forward" not in module.__dict__
        and isinstance(getattr(module, "weight", None), torch.nn.Parameter)
        and isinstance(getattr(module, "variance_epsilon", None), float)
    )


def rms_norm_forward(norm: torch.nn.Module, kernel: Callable[..., torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A forward for `norm` (`is_stock_rms_norm`) through `kernel(x, weight, eps)`
    (`kernels/add_norm.py`'s `rms_norm`)."""

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        return kernel(hidden_states, norm.weight, norm.variance_epsilon)

    return forward


# 5.17.0, 5.23.0: a Qwen2.5-VL vision block computes `h + attn(norm1(h), cu_seqlens=, max_seqlen=,
# position_embeddings=)`, then `h + mlp(norm2(h))`; its norms are RMSNorms (`weight`,
# `variance_epsilon`); the tower hands each block's output to the next block alone, the last one's
# to its merger.
def is_qwen2_5_vision_block(block: torch.nn.Module) -> bool:
    """Whether `block` is a stock Qwen2.5-VL vision block with its stock RMSNorms."""
    # Imported here: the modeling module takes seconds to import, and only this family needs it.
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRMSNorm, Qwen2_5_VLVisionBlock

    return type(block) is Qwen2_5_VLVisionBlock and all(
        type(norm) is Qwen2_5_VLRMSNorm for norm in (block.norm1, block.norm2)
    )


AddNorm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def chained_block_forward(
    block: torch.nn.Module, add_norm: AddNorm, following: torch.nn.Module | None, takes_pair: bool
) -> Callable[..., torch.Tensor]:
    """A forward for Qwen2.5-VL vision block `block` (`is_qwen2_5_vision_block`) whose residual
    adds come with the norms after them through `add_norm` (`kernels/add_norm.py`'s `add_rms_norm`, the sum
    and its norm side by side): the attention's with the block's own `norm2`, the MLP's with the
    next block's first norm, `following`, whose pair it returns; the next block (`takes_pair`)
    takes the halves instead of norming its input. With no `following` (the last block) it
    returns the sum alone."""

    def forward(
        hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        if takes_pair:
            hidden_states, normed = hidden_states.chunk(2, dim=-1)
        else:
            normed = block.norm1(hidden_states)
        attended = block.attn(normed, cu_seqlens=cu_seqlens, position_embeddings=position_embeddings, **kwargs)
        norm2 = block.norm2
        hidden_states, normed = add_norm(hidden_states, attended, norm2.weight, norm2.variance_epsilon).chunk(2, dim=-1)
        update = block.mlp(normed)
        if following is None:
            return hidden_states + update
        return add_norm(hidden_states, update, following.weight, following.variance_epsilon)

    return forward


# 5.17.0, 5.23.0: an implementation name that transformers has no mask function for gets no mask
# (masking_utils: early exit). The segments reach the attention through `packed_sequences`, not as
# keyword arguments of the model's forward: Qwen-VL hands those on to its vision tower too.
PACKED_PREFILL_ATTENTION = "encoder_graphs_packed_causal"
# Model inputs with one value per prompt token, which a packed prefill packs like input_ids.
TOKEN_INPUTS = ("mm_token_type_ids", "token_type_ids")
_packed: list[tuple[torch.Tensor, int]] = []  # the segments of the packed forward running now


@contextmanager
def packed_sequences(config: PretrainedConfig, cu_seqlens: torch.Tensor, longest: int) -> Iterator[None]:
    """Within the block, the decoder that `config` configures attends causally within each
    segment of `cu_seqlens` (its forward gets one row of packed tokens and no attention mask)."""
    _packed.append((cu_seqlens, longest))
    try:
        with attention_implementation(config, PACKED_PREFILL_ATTENTION):
            yield
    finally:
        _packed.pop()


def _packed_causal_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if attention_mask is not None or not _packed:
        raise RuntimeError(f"{PACKED_PREFILL_ATTENTION} runs within packed_sequences(), without an attention mask")
    cu_seqlens, longest = _packed[-1]
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [1, heads, tokens, dim] -> [tokens, heads, dim]
    return causal_varlen_attention(q, k, v, cu_seqlens, longest, scale=scaling).unsqueeze(0), None


AttentionInterface.register(PACKED_PREFILL_ATTENTION, _packed_causal_attention_forward)


# 5.17.0, 5.23.0: attention modules that batch whole sequences (InternViT: one tile per row, no
# mask) call the implementation named in their config with q, k, v [batch, heads, tokens, dim].
def register_dense_attention(backend: str) -> str:
    """Register varlen backend `backend` for dense, unmasked, non-causal attention over a batch of
    equal-length sequences (each row of the batch one segment); the implementation name to use."""
    attention = get_attention_backend(backend)
    name = f"encoder_graphs_dense_{backend}"

    def dense_attention_forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        if attention_mask is not None:
            raise ValueError(f"{name} takes no attention mask")
        batch, heads, tokens, dim = query.shape
        q, k, v = (x.transpose(1, 2).reshape(batch * tokens, heads, dim) for x in (query, key, value))
        cu_seqlens = torch.arange(0, (batch + 1) * tokens, tokens, dtype=torch.int32, device=query.device)
        out = attention(q, k, v, cu_seqlens, tokens, scale=scaling)
        return out.view(batch, tokens, heads, dim), None

    AttentionInterface.register(name, torch.compiler.disable(dense_attention_forward))  # as the varlen one
    return name


# 5.17.0, 5.23.0: `generate` resolves its settings (arguments > generation_config argument >
# model.generation_config > defaults) and checks model kwargs in these private methods.
def prepare_generation_config(
    model: PreTrainedModel, generation_config: GenerationConfig | None, kwargs: dict[str, Any]
) -> tuple[GenerationConfig, dict[str, Any]]:
    """The settings and model inputs `model.generate(generation_config=..., **kwargs)` would use;
    unknown model kwargs raise as they do in `generate`."""
    config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    model._validate_model_kwargs(dict(model_kwargs))
    return config, model_kwargs


# 5.17.0, 5.23.0: `generate` pops these from its **kwargs itself (assisted generation's tokenizers).
_GENERATE_POPPED_KWARGS = ("tokenizer", "assistant_tokenizer")


@cache
def generate_arguments() -> tuple[str, ...]:
    """The arguments of `generate` besides `inputs`, `generation_config`, settings and model
    inputs (logits processors, stopping criteria, streamers, assistants ...): every one of them
    is only the stock `generate`'s to implement."""
    parameters = inspect.signature(GenerationMixin.generate).parameters.values()
    named = [p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD or p.kind is p.KEYWORD_ONLY]
    return (*(name for name in named if name not in ("self", "inputs", "generation_config")), *_GENERATE_POPPED_KWARGS)


@cache
def generation_settings() -> tuple[str, ...]:
    """The settings the running transformers defines: a `GenerationConfig`'s public attributes."""
    names = vars(GenerationConfig())
    return tuple(name for name in names if not name.startswith("_") and name != "transformers_version")


# 5.17.0, 5.23.0: the position ids `generate` gives the first forward (M-RoPE for Qwen-VL),
# computed on the host. Qwen-VL's `get_rope_index` walks each image and video with device reads
# (nonzero, item): on the GPU each stalls it while the batch's work waits to start (RESULTS.md).
# Integer arithmetic (and Qwen2.5-VL's float32 products of video times),
# so either device gives the same ids. It reads ids, masks and grids, never pixels; it leaves
# `rope_deltas` on the model (stock decode steps read them), which go back to the ids' device.
_PIXEL_INPUTS = ("pixel_values", "pixel_values_videos")


def generation_position_ids(
    model: PreTrainedModel, input_ids: torch.Tensor, model_kwargs: dict[str, Any]
) -> torch.Tensor:
    host = {
        key: value.cpu() if isinstance(value, torch.Tensor) else value
        for key, value in model_kwargs.items()
        if key not in _PIXEL_INPUTS
    }
    positions = model._prepare_position_ids_for_generation(input_ids.cpu(), host)
    inner = getattr(model, "model", None)
    if isinstance(getattr(inner, "rope_deltas", None), torch.Tensor):
        inner.rope_deltas = inner.rope_deltas.to(input_ids.device)
    return positions.to(input_ids.device)


# 5.17.0, 5.23.0: DynamicCache(config=...) builds one layer per decoder layer; each layer holds
# `keys` and `values` [batch, kv_heads, length, head_dim].
def dynamic_cache(config: PretrainedConfig) -> Cache:
    return DynamicCache(config=config)


def layer_key_values(cache: Cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


# 5.17.0, 5.23.0: a decoder's `rotary_emb(hidden, position_ids)` gives the (cos, sin) that every
# layer applies, [batch, length, head_dim]. Qwen-VL's generation positions lead with a row of
# text positions (for packed masks) before the three M-RoPE rows; its text model drops that row.
def decode_rotary(
    text_model: torch.nn.Module, hidden: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if positions.ndim == 3 and positions.shape[0] == 4:
        positions = positions[1:]
    return text_model.rotary_emb(hidden, positions)


# 5.17.0, 5.23.0: a "dynamic" rotary embedding (InternVL3's language models) syncs with the host
# on every call to compare the largest position with its cached length, which a graph capture
# forbids. Below `original_max_seq_len` it never changes the frequencies, so while no position
# reaches that, reading its rope type as plain gives the same result without the sync.
@contextmanager
def static_rope(model: torch.nn.Module, max_positions: int) -> Iterator[None]:
    """Within the block, dynamic rotary embeddings that `max_positions` cannot grow skip their
    host-side length check."""
    modules = [
        module
        for module in model.modules()
        if isinstance(getattr(module, "rope_type", None), str)
        and "dynamic" in module.rope_type
        and max_positions <= getattr(module, "original_max_seq_len", 0)
    ]
    saved = [module.rope_type for module in modules]
    for module in modules:
        module.rope_type = "default"
    try:
        yield
    finally:
        for module, rope_type in zip(modules, saved):
            module.rope_type = rope_type


# 5.17.0, 5.23.0: `_from_config` builds a model from a config without loading weights.
def from_config(model_class: type[PreTrainedModel], config: PretrainedConfig, dtype: torch.dtype) -> PreTrainedModel:
    return model_class._from_config(config, dtype=dtype)


# Qwen3-VL's get_*_features output type lives in its modeling module (5.17.0, 5.23.0). Its
# deepstack levels: 5.17 returns one tensor per level; 5.18 to 5.23 split each level per item,
# as pooler_output, and the model's forward concatenates them again.
_DEEPSTACK_PER_ITEM = Version(transformers.__version__).release[:2] >= (5, 18)


def deepstack_output(main: torch.Tensor, levels: list[torch.Tensor], sizes: list[int]) -> Any:
    """Qwen3-VL's get_*_features output from all items' main features and deepstack levels
    (rows of every item in order; `sizes` rows each)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

    levels = [level.contiguous() for level in levels]
    return BaseModelOutputWithDeepstackFeatures(
        pooler_output=tuple(torch.split(main, sizes)),
        deepstack_features=[torch.split(level, sizes) for level in levels] if _DEEPSTACK_PER_ITEM else levels,
    )
