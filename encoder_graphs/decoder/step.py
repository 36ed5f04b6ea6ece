"""The two model calls of a generation: the prefill (the model's own forward, over left-padded
prompts as `generate` runs it, or over the packed prompts) and one decode step over the static cache (fixed-shape device work only: what a
decode graph holds), through the fusable `DecodeStack` where the model's layers have one."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from encoder_graphs.decoder.buffers import DecodeBuffers
from encoder_graphs.decoder.layers.decode import DecodeStack
from encoder_graphs.seam.attention import (
    DECODE_ATTENTION,
    TOKEN_INPUTS,
    attention_implementation,
    packed_sequences,
)
from encoder_graphs.seam.generation import generation_position_ids
from encoder_graphs.seam.text import Cache, SlotCache, dynamic_cache, layer_states

KeyValues = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Prefilled:
    """A prefill's last logits [batch, vocab] (float32), the position ids of the first decode step,
    and its per-layer keys and values: [batch, kv_heads, length, head_dim] in the prompts'
    left-padded layout, or packed [1, kv_heads, tokens, head_dim] with `slots`, each token's
    (row, slot) in that layout; a linear-attention layer's (conv, recurrent) states instead."""

    logits: torch.Tensor
    next_positions: torch.Tensor
    key_values: KeyValues
    slots: tuple[torch.Tensor, torch.Tensor] | None = None


def prompt_positions(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, model_inputs: dict
) -> torch.Tensor:
    """The position ids of the prompts' first forward: `model_inputs`' `position_ids` (taken out
    of them) where given, as `generate` takes them, else those `generate` computes."""
    given = model_inputs.pop("position_ids", None)
    if given is None:
        return generation_position_ids(model, input_ids, {"attention_mask": attention_mask, **model_inputs})
    if given.shape[-2:] != input_ids.shape:
        raise ValueError(f"position_ids {tuple(given.shape)} do not end with input_ids' shape {tuple(input_ids.shape)}")
    return given.to(input_ids.device)


def prefill(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, model_inputs: dict,
    cache: Cache | None = None,
) -> Prefilled:
    """The model's first forward over the left-padded prompts, as `generate` runs it; or, over
    `cache` (a prefill's states), their continuation (the mask then spans the cached slots too)."""
    positions = prompt_positions(model, input_ids, attention_mask, model_inputs)
    cache = cache if cache is not None else dynamic_cache(model.config.get_text_config(decoder=True))
    output = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
        **model_inputs,
    )
    return Prefilled(output.logits[:, -1].float(), positions[..., -1:] + 1, layer_states(cache))


def packed_prefill(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    model_inputs: dict,
    text_position_row: int | None = None,
) -> Prefilled:
    """The model's first forward over left-padded prompts without their padding: one row of every
    real token, causal attention within each prompt (cu_seqlens), each prompt's own position ids,
    each prompt's last logits. Left padding is a sizable share of a caption batch's prefill
    tokens (measured: benchmarks/HISTORY.md). `text_position_row`: the row of the position ids
    that holds plain text positions, where the model reads them beside its rotary rows
    (`ModelFamily.text_position_row`): it restarts at 0 in each prompt, so that the model sees
    where the packed prompts begin."""
    positions = prompt_positions(model, input_ids, attention_mask, model_inputs)
    real = attention_mask.bool()
    lengths = real.sum(1)
    cu_seqlens = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    packed = positions[..., real].unsqueeze(-2)  # [..., 1, tokens]: rows of the real tokens in order
    if text_position_row is not None:
        starts = cu_seqlens[:-1].repeat_interleave(lengths)
        packed[text_position_row, 0] = torch.arange(packed.shape[-1], device=packed.device) - starts
    inputs = {k: v[real][None] if k in TOKEN_INPUTS else v for k, v in model_inputs.items()}
    text_config = model.config.get_text_config(decoder=True)
    cache = dynamic_cache(text_config)
    with packed_sequences(text_config, cu_seqlens, int(lengths.max())):
        output = model(
            input_ids=input_ids[real][None],
            position_ids=packed,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=cu_seqlens[1:] - 1,
            **inputs,
        )
    # Each token's keys and values go to its own (row, column) of the padded prompts: the decode
    # steps attend over the prompts' attention mask.
    slots = real.nonzero(as_tuple=True)
    return Prefilled(output.logits[0].float(), positions[..., -1:] + 1, layer_states(cache), slots)


def decode_step(
    model: torch.nn.Module, stack: DecodeStack | None, buffers: DecodeBuffers, rows: int, tier: int, cache: SlotCache
) -> None:
    """One decode step for rows [0, rows) over slots [0, tier) (`cache` views exactly those):
    reads input ids, positions, mask and slot; writes logits; advances slot and positions."""
    slot = buffers.store.slot
    mask = buffers.mask[:rows, :tier]
    mask.index_fill_(1, slot, True)
    positions = buffers.positions.narrow(-2, 0, rows)
    if stack is not None:
        logits = stack(buffers.input_ids[:rows], positions, mask, layer_states(cache), slot)
    else:
        logits = _stock_step(model, buffers.input_ids[:rows], positions, mask, cache)
    buffers.logits[:rows].copy_(logits)
    slot.add_(1)
    buffers.positions.add_(1)


def _stock_step(
    model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: SlotCache
) -> torch.Tensor:
    # Prefill keeps the model's own attention; decode steps use the static-cache one. Only the
    # Python dispatch changes, so a captured graph holds the decode kernels for good.
    with attention_implementation(model.config.get_text_config(decoder=True), DECODE_ATTENTION):
        output = model(
            input_ids=input_ids,
            position_ids=positions,
            attention_mask=mask[:, None, None, :],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
    return output.logits[:, -1]
