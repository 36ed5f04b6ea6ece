"""How every family's caption inputs make a batch: `collate` on the CPU (ids, masks, uint8 pixels;
no GPU, so a worker thread can run it while the model works), then `to_model` on the device
(pixels normalised there). The steps every family takes alike live here once."""

from collections.abc import Sequence
from typing import Any

import torch


class CollatingInputs:
    """`batch` as the family's `collate(items, prompts)` then its `to_model(collated, device,
    dtype)`; the tokenizing every family's `collate` opens with; the tokenizer's special ids."""

    tokenizer: Any  # the family's tokenizer, padding on the left

    @property
    def eos_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id

    @property
    def generation_overrides(self) -> dict[str, Any]:
        """The tokenizer's end and padding ids (a family adds what its checkpoints ship that the
        caption command must not take: `CaptionInputs.generation_overrides`)."""
        return {"eos_token_id": self.eos_token_id, "pad_token_id": self.pad_token_id}

    def batch(
        self, items: Sequence[Any], prompts: str | Sequence[str], device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> dict[str, torch.Tensor]:
        """Left-padded inputs for `model.generate(**batch)`, as the processor returns them (on the
        CPU, in float32 by default), items in order. `prompts`: one for every item, or one per item."""
        return self.to_model(self.collate(items, prompts), device, dtype)

    def tokenized(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        """`input_ids` and `attention_mask` of `texts`, padded (on the left) to the longest."""
        encoded = self.tokenizer(list(texts), padding=True, return_tensors="pt")
        return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}


def per_item(prompts: str | Sequence[str], items: Sequence[Any]) -> Sequence[str]:
    """One prompt for each of `items`: `prompts` itself, or the one prompt repeated."""
    return [prompts] * len(items) if isinstance(prompts, str) else prompts


def to_device(collated: dict[str, torch.Tensor], device: torch.device | str) -> dict[str, torch.Tensor]:
    """`collate`'s batch copied to `device`, not waiting where the host memory is pinned."""
    return {key: value.to(device, non_blocking=True) for key, value in collated.items()}
