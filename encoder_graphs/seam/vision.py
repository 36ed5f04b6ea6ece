"""The Qwen vision towers' blocks, helpers and outputs, InternVL's tiling, and DeepSeek-OCR 2's
SAM attention, as this package uses them."""

from collections.abc import Callable
from typing import Any

import torch
import transformers
from packaging.version import Version
from transformers import PreTrainedModel

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

from encoder_graphs.rewrites import Rewrites, made_like

__all__ = [
    "get_vision_cu_seqlens",
    "get_vision_interpolation_indices_and_weights",
    "get_vision_position_ids",
    "get_vision_window_index",
    "tiled_canvas",
]


# 5.17.0, 5.23.0: Qwen2-VL's and Qwen2.5-VL's vision towers are not exported at transformers' top
# level (Qwen3-VL's and InternVL's are); their modeling modules hold them.
def qwen_vision_towers() -> tuple[type[PreTrainedModel], type[PreTrainedModel]]:
    """Qwen2-VL's and Qwen2.5-VL's vision tower classes."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    return Qwen2VisionTransformerPretrainedModel, Qwen2_5_VisionTransformerPretrainedModel


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


# 5.17.0, 5.23.0: DeepSeek-OCR 2's SAM attention reads its relative-position tables through
# `self.get_rel_pos(q_size, k_size, rel_pos)`, which builds the coordinates with `torch.arange` on
# the CPU and indexes the device table with them: a copy from the host every call, which a CUDA
# graph capture forbids. The same computation with the coordinates made on the table's device.
def rel_pos_on_device(q_size: int, k_size: int, rel_pos: torch.Tensor) -> torch.Tensor:
    distances = int(2 * max(q_size, k_size) - 1)
    resized = torch.nn.functional.interpolate(
        rel_pos.reshape(1, rel_pos.shape[0], -1).transpose(1, 2), size=distances, mode="linear"
    )
    resized = resized.reshape(-1, distances).permute(1, 0)
    q_coords = torch.arange(q_size, device=rel_pos.device)[:, None] * max(k_size / q_size, 1.0)
    k_coords = torch.arange(k_size, device=rel_pos.device)[None, :] * max(q_size / k_size, 1.0)
    relative = (q_coords - k_coords) + (k_size - 1) * max(q_size / k_size, 1.0)
    return resized[relative.long()]


RelPosAttention = Callable[..., torch.Tensor]


# 5.17.0, 5.23.0: SAM's attention comes in two classes, `DeepseekOcr2SamVisionAttention` (eager:
# it returns its attention weights, which `output_attentions` records by a hook) and its subclass
# `DeepseekOcr2SamVisionSdpaAttention` (sdpa, the default: no weights, no dropout). Both take
# hidden states [batch, height, width, channels] (one window's, or the whole grid's), project them
# with `qkv` (per token q, k, v, each `num_attention_heads` heads), add to the scores (q·k·`scale`)
# the decomposed relative positions (q's dot products with `rel_pos_h` and `rel_pos_w`, resized and
# indexed by `get_rel_pos`; with `use_rel_pos`), project with `proj` and return (output, weights).
def sam_rel_pos_attentions(tower: torch.nn.Module) -> list[torch.nn.Module]:
    """The SAM attentions of `tower` that add relative positions (either class)."""
    from transformers.models.deepseek_ocr2.modeling_deepseek_ocr2 import DeepseekOcr2SamVisionAttention

    return [m for m in tower.modules() if isinstance(m, DeepseekOcr2SamVisionAttention) and m.use_rel_pos]


def returns_no_weights(attention: torch.nn.Module) -> bool:
    """Whether SAM attention `attention` is the sdpa class, which returns no attention weights."""
    from transformers.models.deepseek_ocr2.modeling_deepseek_ocr2 import DeepseekOcr2SamVisionSdpaAttention

    return isinstance(attention, DeepseekOcr2SamVisionSdpaAttention)


def sam_attention_forward(attention: torch.nn.Module, attend: RelPosAttention) -> Callable[..., tuple]:
    """A forward for SAM attention `attention` (the sdpa class: no weights to return) that hands
    q, k, v [batch, heads, tokens, head_dim] and the decomposed relative positions (rel_h [...,
    height], rel_w [..., width], per query, as stock computes them through its `get_rel_pos`) to
    `attend` (`attention/rel_pos.py`'s `decomposed_rel_pos_attention`)."""

    def forward(hidden_states: torch.Tensor, output_attentions: bool | None = None) -> tuple:
        batch, height, width, _ = hidden_states.shape
        heads = attention.num_attention_heads
        qkv = attention.qkv(hidden_states).reshape(batch, height * width, 3, heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        grid = q.reshape(batch, heads, height, width, -1)
        rel_h = torch.einsum("bnhwc,hkc->bnhwk", grid, attention.get_rel_pos(height, height, attention.rel_pos_h))
        rel_w = torch.einsum("bnhwc,wkc->bnhwk", grid, attention.get_rel_pos(width, width, attention.rel_pos_w))
        out = attend(q, k, v, rel_h.flatten(2, 3), rel_w.flatten(2, 3), attention.scale)
        out = out.view(batch, heads, height, width, -1).permute(0, 2, 3, 1, 4).reshape(batch, height, width, -1)
        return attention.proj(out), None

    return forward
