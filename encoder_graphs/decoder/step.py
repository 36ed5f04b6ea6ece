"""The two model calls of a generation: the prefill (the model's own forward, exactly what
`generate` runs) and one decode step over the static cache (fixed-shape device work only: what a
decode graph holds), through the fusable `DecodeStack` where the model's layers have one."""

import torch

from encoder_graphs.decoder.buffers import DecodeBuffers
from encoder_graphs.decoder.static_cache import DECODE_ATTENTION, SlotCache
from encoder_graphs.models.text_decode import DecodeStack
from encoder_graphs.models.transformers_seam import (
    attention_implementation,
    dynamic_cache,
    generation_position_ids,
    layer_key_values,
)

KeyValues = list[tuple[torch.Tensor, torch.Tensor]]


def prefill(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, model_inputs: dict
) -> tuple[torch.Tensor, KeyValues, torch.Tensor]:
    """The model's first forward over the prompts. Returns the last logits (float32), the per-layer
    keys and values, and the position ids of the first decode step."""
    positions = generation_position_ids(model, input_ids, {"attention_mask": attention_mask, **model_inputs})
    cache = dynamic_cache(model.config.get_text_config(decoder=True))
    output = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
        **model_inputs,
    )
    return output.logits[:, -1].float(), layer_key_values(cache), positions[..., -1:] + 1


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
        logits = stack(buffers.input_ids[:rows], positions, mask, cache)
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
