from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class EncoderItemSpec:
    """One image or video as the packer sees it.

    `input_size`: rows the encoder reads (patches). `output_tokens`: rows it returns.
    `path_tokens`: the rows each path must hold for this item, in that path's budget unit;
    a path the item does not use may be left out (0).
    """

    input_size: int
    output_tokens: int
    frames: int = 1
    path_tokens: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.input_size < 0 or self.output_tokens < 0:
            raise ValueError(f"negative size in {self}")
        if self.frames < 1:
            raise ValueError(f"an item has at least one frame, got {self.frames}")
        if any(tokens < 0 for tokens in self.path_tokens.values()):
            raise ValueError(f"negative path tokens in {self}")


@dataclass(frozen=True)
class EncoderPathConfig:
    """One independent set of graphs (e.g. "default", or "global" and "local" for two towers).

    Budgets count output rows of this path; `budget_multiple` rounds generated budgets up;
    `steps_per_doubling` sets how finely generated budgets grow (see `generate_budgets`).
    """

    name: str = "default"
    budget_multiple: int = 1
    steps_per_doubling: int = 1

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a path needs a name")
        if self.budget_multiple < 1:
            raise ValueError(f"budget_multiple must be >= 1, got {self.budget_multiple}")
        if self.steps_per_doubling < 1:
            raise ValueError(f"steps_per_doubling must be >= 1, got {self.steps_per_doubling}")


@dataclass(frozen=True)
class EncoderCudaGraphConfig:
    """Static facts about a model's encoder that the manager needs."""

    paths: tuple[EncoderPathConfig, ...] = (EncoderPathConfig(),)
    max_frames_per_item: int = 1
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # The most items one sub-batch may hold by default (None: the manager's own default, kept
    # small for varlen attention, whose kernels launch blocks for every segment slot).
    max_items: int | None = None

    def __post_init__(self) -> None:
        if not self.paths:
            raise ValueError("an encoder has at least one path")
        names = [path.name for path in self.paths]
        if len(set(names)) != len(names):
            raise ValueError(f"path names repeat: {names}")
        if self.max_frames_per_item < 1:
            raise ValueError(f"max_frames_per_item must be >= 1, got {self.max_frames_per_item}")
        if self.max_items is not None and self.max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {self.max_items}")

    @property
    def path_names(self) -> list[str]:
        return [path.name for path in self.paths]


@dataclass
class CaptureInputs:
    """Dummy inputs for capturing one budget, at the full size of that budget.

    `values`: every tensor the graph reads; dim 0 is the one that grows with the budget.
    `static`: host numbers baked into the graph (e.g. max_seqlen): worst case for the budget.
    """

    values: dict[str, torch.Tensor]
    static: dict[str, int | float] = field(default_factory=dict)


@dataclass
class ReplayBuffers:
    """Real values for one replay. Each tensor fits in dim 0 of the captured buffer of that key.

    The manager zeroes each captured buffer and copies these into its head, so a model must
    return values already padded where zero would be wrong (offsets padded to the budget's
    capacity, index permutations continued), as its shared metadata function does.
    """

    values: dict[str, torch.Tensor]


@runtime_checkable
class SupportsEncoderCudaGraph(Protocol):
    """What a model adapter supplies so that the manager can graph its encoder."""

    def get_encoder_cudagraph_config(self) -> EncoderCudaGraphConfig: ...

    def get_budget_range(self) -> dict[str, tuple[int, int]]:
        """Per path: (min_budget, max_budget) in output rows."""
        ...

    def get_item_specs(self, inputs: Any) -> list[EncoderItemSpec]: ...

    def select_items(self, inputs: Any, indices: Sequence[int]) -> Any: ...

    def prepare_capture_inputs(
        self, budget: int, max_items: int, max_frames: int, path: str
    ) -> CaptureInputs: ...

    def prepare_replay_buffers(
        self, inputs: Any, max_items: int, max_frames: int, path: str, *, budget: int
    ) -> ReplayBuffers: ...

    def graph_forward(self, buffers: dict[str, Any], path: str) -> dict[str, torch.Tensor]:
        """Fixed shapes only: no host sync, no data-dependent shapes or branches."""
        ...

    def eager_forward(self, inputs: Any, path: str) -> dict[str, torch.Tensor]: ...

    def postprocess(
        self,
        outputs_by_path: dict[str, dict[str, torch.Tensor] | None],
        specs: Sequence[EncoderItemSpec],
    ) -> list[torch.Tensor]:
        """Split one sub-batch's outputs (rows of its items, in order) into one tensor per item."""
        ...


PROTOCOL_METHODS = tuple(
    name
    for name, value in vars(SupportsEncoderCudaGraph).items()
    if callable(value) and not name.startswith("_")
)


def check_supports_encoder_cuda_graph(model: object) -> None:
    """Raise a TypeError that lists every protocol method the model lacks."""
    missing = [name for name in PROTOCOL_METHODS if not callable(getattr(model, name, None))]
    if missing:
        raise TypeError(
            f"{type(model).__name__} does not implement SupportsEncoderCudaGraph; "
            f"missing: {', '.join(missing)}"
        )
