"""Routes a transformers vision tower's varlen attention to one of our backends.

Qwen vision attention takes its cu_seqlens branch only when the implementation's name contains
"flash"; there it calls the registered function with a host-int `max_length_q`, which is what
graph capture needs. The name is set on the tower's config only while our code runs, so the
model's own forward keeps its attention implementation.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface

from encoder_graphs.attention import get_attention_backend

_PREFIX = "encoder_graphs_flash_"


def register_varlen_attention(backend: str) -> str:
    """Register `backend` with transformers (once) and return the implementation name to use."""
    attention = get_attention_backend(backend)
    name = _PREFIX + backend

    def varlen_attention_forward(
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
        # transformers passes [1, heads, tokens, head_dim] and expects [1, tokens, heads, head_dim].
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
        out = attention(q, k, v, cu_seq_lens_q, max_length_q, scale=scaling)
        return out.unsqueeze(0), None

    AttentionInterface.register(name, varlen_attention_forward)
    return name


@contextmanager
def attention_implementation(vision_tower: torch.nn.Module, name: str) -> Iterator[None]:
    """Run the tower's attention through implementation `name` inside the block, then restore it."""
    config = vision_tower.config
    original = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = original
