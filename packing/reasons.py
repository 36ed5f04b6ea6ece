"""Why a call ran eagerly instead of replaying a graph, for the encoder and the decoder alike:
the packer's (no budget fits, too many frames), the graph owners' (no CUDA, a failed capture,
cheaper eagerly).

The statistics count by member and show the member's text: `stats()`'s JSON keys are the texts,
so a reader of the JSON (and a torchrun job's merge of its ranks) sees plain strings. The
parameters of one case (which budget, which batch and tier) are in the statistics beside the
counts (`failed_budgets`, `failed_graphs`), not in the reason, so the same cause is one key."""

from enum import Enum, unique


@unique  # one text, one cause
class EagerReason(str, Enum):
    TURNED_OFF = "enabled=False"  # the owner's enabled=False (the caption command says --no-graphs)
    NO_CUDA = "no CUDA device"
    NOT_CAPTURED = "capture() not called"
    EVERY_BUDGET_FAILED = "every budget failed to capture"
    CAPTURE_FAILED = "capture failed"
    GPU_BOUND = "GPU-bound size, not captured"
    EAGER_CHEAPER = "eager measured faster"
    BEFORE_CAPTURE = "budget's first call, run eagerly"
    NO_GRAPH_FITS = "no graph fits"
    OVER_LARGEST_BUCKET = "batch larger than the largest bucket"
    NONE_CAPTURED = "no graph captured"
    FRAMES_OVER_CAP = "frames over max_frames"
    TOKENS_OVER_BUDGETS = "tokens over largest budget"

    def __str__(self) -> str:  # the text, on every Python (3.12 formats a str mixin by its name)
        return self.value

    __format__ = str.__format__
    __hash__ = str.__hash__  # a member and its text are one key of a dict (Enum hashes the name)


def counts_by_text(counts: dict) -> dict[str, int]:
    """A counter keyed by reasons as the statistics' JSON has it: keyed by each reason's text."""
    return {str(reason): count for reason, count in counts.items()}
