"""torch.compile of an encoder's repeated blocks, run inside the graphs the manager captures.

Inductor fuses each block's norms, rotary, activation and residual adds around the GEMMs; the
manager then captures those kernels as it captures eager ones (inductor's own CUDA graphs stay
off: the manager owns capture and the pool). Shapes are dynamic from the first compilation, so
one compilation serves every budget and every eager call. Varlen attention stays out of the
compiled code (the seam registers its backends `torch.compiler.disable`d): its host-int
`max_seqlen` differs per budget, and a probe that compiled through it recompiled per budget until
dynamo's limit of 8 left later blocks uncompiled. Dense attention of one shape
per tile (InternViT's stock sdpa) is compiled in. While compiled, every call of the blocks runs
the compiled code, stock-only calls (per-layer outputs) included; the `Rewrites` undo ends that.
"""

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

from encoder_graphs.engine.statistics import CompileStats
from encoder_graphs.rewrites import Rewrites


@dataclass
class CompiledBlocks:
    """How many blocks were compiled in place (0 after a failure), `seconds` spent compiling
    (the warm-up), `error` if it failed (the blocks then run uncompiled)."""

    blocks: int = 0
    seconds: float = 0.0
    error: str | None = None

    def stats(self) -> dict:
        return self.typed_stats().to_json()

    def typed_stats(self) -> CompileStats:
        return CompileStats(blocks=self.blocks, seconds=self.seconds, error=self.error)


def compile_blocks(blocks: Sequence[nn.Module], warm_up: Callable[[], None], rewrites: Rewrites) -> CompiledBlocks:
    """Compile `blocks` in place, until `rewrites` is undone, and run `warm_up` (which must call
    them) to compile now, before any capture. A compiler failure is reported in the result and
    the blocks stay uncompiled. No blocks: nothing to compile, no warm-up."""
    compiled = CompiledBlocks(len(blocks))
    if not blocks:
        return compiled
    own = Rewrites()
    rewrites.push(own.undo)
    for block in blocks:
        own.keep(block, "_compiled_call_impl")  # what nn.Module.compile() sets; torch 2.11, 2.13
        block.compile(dynamic=True)
    started = time.perf_counter()
    try:
        warm_up()
    except Exception as error:  # noqa: BLE001 (inductor or a missing compiler: run uncompiled)
        own.undo()
        compiled.blocks = 0
        compiled.error = f"{type(error).__name__}: {error}"[:300]
        warnings.warn(f"torch.compile of the encoder blocks failed; they run uncompiled: {compiled.error}", stacklevel=2)
    compiled.seconds = time.perf_counter() - started
    return compiled
