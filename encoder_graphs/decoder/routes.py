"""Where a generate call of `DecoderGraphRunner` runs its decode steps: the route (its rows of
the static buffers) and, per length tier, a graph or the eager cache."""

from dataclasses import dataclass

import torch

from encoder_graphs.decoder.buffers import DecodeBuffers
from encoder_graphs.packing.reasons import EagerReason
from encoder_graphs.seam.text import SlotCache


@dataclass
class Route:
    """Where a generate call's decode steps run: `rows` rows of `buffers`; `eager_reason` when no
    graph can serve any of its steps."""

    buffers: DecodeBuffers
    rows: int
    eager_reason: EagerReason | None


@dataclass
class Tier:
    """How the decode steps whose sequences fit `tier` slots run: a graph, or eagerly over `cache`."""

    tier: int
    graph: torch.cuda.CUDAGraph | None
    cache: SlotCache | None
    eager_reason: EagerReason | None
