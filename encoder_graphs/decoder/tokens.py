"""The new tokens of a generate call, as `generate` returns them."""

import torch


class NewTokens:
    """The new tokens of a batch: finished sequences get `pad_id` after their EOS."""

    def __init__(self, batch: int, max_new_tokens: int, eos_ids: list[int], pad_id: int, device: torch.device):
        self.eos = torch.tensor(eos_ids, dtype=torch.long, device=device)
        self.pad_id = pad_id
        self.ids = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long, device=device)
        self.unfinished = torch.ones(batch, dtype=torch.bool, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)

    def emit(self, step: int, chosen: torch.Tensor) -> torch.Tensor:
        chosen = torch.where(self.unfinished, chosen, self.pad_id)
        self.ids[:, step] = chosen
        self.lengths.add_(self.unfinished)
        self.unfinished.logical_and_(torch.isin(chosen, self.eos, invert=True))
        return chosen

    def finished(self) -> bool:
        return not bool(self.unfinished.any())  # a host sync: called every few steps only

    def generated(self) -> torch.Tensor:
        return self.ids[:, : int(self.lengths.max())]
