"""Next-token selection on the device, with no host sync: greedy, temperature, top-p.

Temperature and top-p follow transformers' TemperatureLogitsWarper and TopPLogitsWarper, so that
greedy picks the same token as `generate(do_sample=False)` and top-p keeps the same set.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

Generators = torch.Generator | Sequence[torch.Generator] | None


@dataclass(frozen=True)
class SamplingParams:
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class Sampling:
    """How a generate call picks its tokens: the params, the generators (one, or one a row), the
    EOS and pad ids (None: the model's)."""

    params: SamplingParams
    generator: Generators = None
    eos_token_id: int | Sequence[int] | None = None
    pad_token_id: int | None = None

    @classmethod
    def split(cls, settings: dict) -> tuple["Sampling", dict]:
        """`DecoderGraphRunner.generate`'s keyword arguments as (the sampling, the model inputs)."""
        rest = dict(settings)
        params = SamplingParams(rest.pop("do_sample", False), rest.pop("temperature", 1.0), rest.pop("top_p", 1.0))
        sampling = cls(params, rest.pop("generator", None), rest.pop("eos_token_id", None), rest.pop("pad_token_id", None))
        return sampling, rest


def select_next_tokens(logits: torch.Tensor, params: SamplingParams, generator: Generators = None) -> torch.Tensor:
    """Token ids [batch] from float logits [batch, vocab]. `generator`: one for the batch, or one
    per row, so that a row's draws depend on neither its batch nor the other rows."""
    if not params.do_sample:
        return logits.argmax(dim=-1)
    scores = logits / params.temperature
    if params.top_p < 1.0:
        scores = _top_p_filter(scores, params.top_p)
    probs = scores.softmax(dim=-1)
    # Exponential race (argmax of p / E, E ~ Exp(1)) draws from `probs` like multinomial,
    # but never synchronises with the host.
    if generator is None or isinstance(generator, torch.Generator):
        race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    else:
        rows = zip(probs, generator, strict=True)
        race = torch.stack([torch.empty_like(row).exponential_(1.0, generator=g) for row, g in rows])
    return probs.div_(race).argmax(dim=-1)


def _top_p_filter(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_scores, sorted_indices = torch.sort(scores, descending=False)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - top_p)
    remove_sorted[..., -1:] = False  # always keep the most likely token
    remove = remove_sorted.scatter(1, sorted_indices, remove_sorted)
    return scores.masked_fill(remove, float("-inf"))
