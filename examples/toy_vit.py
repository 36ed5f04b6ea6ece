"""A small two-tower ViT that implements SupportsEncoderCudaGraph.

It exists to test and demonstrate the manager without a real checkpoint: a "global" tower encodes
each item's frames (one attention segment per frame) and a "local" tower its optional tiles (one
segment per tile), like tiled two-tower encoders. Output rows equal input rows.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from encoder_graphs.attention import default_attention_backend, get_attention_backend
from encoder_graphs.protocols import (
    CaptureInputs,
    EncoderCudaGraphConfig,
    EncoderItemSpec,
    EncoderPathConfig,
    ReplayBuffers,
)

GLOBAL, LOCAL = "global", "local"


@dataclass(frozen=True)
class ToyViTConfig:
    in_dim: int = 48
    dim: int = 64
    heads: int = 4
    depth: int = 2
    out_dim: int = 32
    max_tiles_per_item: int = 4
    max_frames_per_item: int = 8
    two_paths: bool = True
    min_budget: int = 64
    max_budget: int = 1024

    def __post_init__(self) -> None:
        if self.dim % self.heads:
            raise ValueError(f"dim {self.dim} is not a multiple of heads {self.heads}")
        if not 0 < self.min_budget <= self.max_budget:
            raise ValueError(f"bad budget range {self.min_budget}..{self.max_budget}")


@dataclass
class ToyItem:
    """`frames` equal frames of rows in `patches`; `tiles` holds whole tiles of `tile_rows` rows."""

    patches: torch.Tensor
    frames: int = 1
    tiles: torch.Tensor | None = None
    tile_rows: int = 16

    def __post_init__(self) -> None:
        if self.frames < 1 or self.patches.shape[0] % self.frames:
            raise ValueError(f"{self.patches.shape[0]} rows do not split into {self.frames} frames")
        if self.tiles is not None and self.tiles.shape[0] % self.tile_rows:
            raise ValueError(f"{self.tiles.shape[0]} tile rows are not whole tiles of {self.tile_rows}")

    def segments(self, path: str) -> list[int]:
        if path == GLOBAL:
            return [self.patches.shape[0] // self.frames] * self.frames
        if self.tiles is None:
            return []
        return [self.tile_rows] * (self.tiles.shape[0] // self.tile_rows)

    def rows(self, path: str) -> torch.Tensor | None:
        return self.patches if path == GLOBAL else self.tiles


def segment_offsets(
    lengths: Sequence[int], capacity: int, slots: int, device: torch.device
) -> torch.Tensor:
    """cu_seqlens for `lengths` in a buffer of `capacity` rows, with `slots` segments.

    Shared by eager (capacity = real rows, slots = segments), capture and replay. The padded tail
    becomes one dummy segment ending at `capacity`, and unused slots repeat `capacity`: every row is
    covered, and the offsets stay monotonic (never padded with zeros).
    """
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    if offsets[-1] < capacity:
        offsets.append(capacity)
    if len(offsets) > slots + 1:
        raise ValueError(f"{len(offsets) - 1} segments do not fit in {slots} slots")
    offsets += [capacity] * (slots + 1 - len(offsets))
    return torch.tensor(offsets, dtype=torch.int32, device=device)


class ToyBlock(nn.Module):
    def __init__(self, config: ToyViTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.norm1 = nn.LayerNorm(config.dim)
        self.qkv = nn.Linear(config.dim, 3 * config.dim)
        self.proj = nn.Linear(config.dim, config.dim)
        self.norm2 = nn.LayerNorm(config.dim)
        self.mlp = nn.Sequential(
            nn.Linear(config.dim, 4 * config.dim), nn.GELU(), nn.Linear(4 * config.dim, config.dim)
        )

    def forward(self, x, cu_seqlens, max_seqlen: int, attention) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).view(x.shape[0], 3, self.heads, -1).unbind(1)
        x = x + self.proj(attention(q, k, v, cu_seqlens, max_seqlen).reshape(x.shape[0], -1))
        return x + self.mlp(self.norm2(x))


class ToyTower(nn.Module):
    def __init__(self, config: ToyViTConfig) -> None:
        super().__init__()
        self.embed = nn.Linear(config.in_dim, config.dim)
        self.blocks = nn.ModuleList(ToyBlock(config) for _ in range(config.depth))
        self.head = nn.Linear(config.dim, config.out_dim)

    def forward(self, x, cu_seqlens, max_seqlen: int, attention) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x, cu_seqlens, max_seqlen, attention)
        return self.head(x)


class ToyViT(nn.Module):
    """Inputs are a list of ToyItem; each output is the item's global rows then its tile rows."""

    def __init__(self, config: ToyViTConfig | None = None, attn_backend: str | None = None) -> None:
        super().__init__()
        self.config = config or ToyViTConfig()
        self.towers = nn.ModuleDict({GLOBAL: ToyTower(self.config)})
        if self.config.two_paths:
            self.towers[LOCAL] = ToyTower(self.config)
        self.attn_backend = attn_backend

    @property
    def device(self) -> torch.device:
        return self.towers[GLOBAL].embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.towers[GLOBAL].embed.weight.dtype

    def _attention(self):
        return get_attention_backend(self.attn_backend or default_attention_backend(self.device))

    def _slots(self, path: str, max_items: int, max_frames: int) -> int:
        segments = max_frames if path == GLOBAL else max_items * self.config.max_tiles_per_item
        return segments + 1  # + the dummy segment over padding

    # ----- SupportsEncoderCudaGraph --------------------------------------------------------
    def get_encoder_cudagraph_config(self) -> EncoderCudaGraphConfig:
        return EncoderCudaGraphConfig(
            paths=tuple(EncoderPathConfig(name) for name in self.towers),
            max_frames_per_item=self.config.max_frames_per_item,
            dtype=self.dtype,
            device=self.device,
        )

    def get_budget_range(self) -> dict[str, tuple[int, int]]:
        return {path: (self.config.min_budget, self.config.max_budget) for path in self.towers}

    def get_item_specs(self, inputs: list[ToyItem]) -> list[EncoderItemSpec]:
        specs = []
        for item in inputs:
            tokens = {path: sum(item.segments(path)) for path in self.towers}
            total = sum(tokens.values())
            specs.append(EncoderItemSpec(total, total, item.frames, tokens))
        return specs

    def select_items(self, inputs: list[ToyItem], indices: Sequence[int]) -> list[ToyItem]:
        return [inputs[i] for i in indices]

    def prepare_capture_inputs(
        self, budget: int, max_items: int, max_frames: int, path: str
    ) -> CaptureInputs:
        slots = self._slots(path, max_items, max_frames)
        patches = torch.randn(budget, self.config.in_dim, device=self.device, dtype=self.dtype)
        cu_seqlens = segment_offsets([budget], budget, slots, self.device)
        return CaptureInputs({"patches": patches, "cu_seqlens": cu_seqlens}, {"max_seqlen": budget})

    def prepare_replay_buffers(
        self, inputs: list[ToyItem], max_items: int, max_frames: int, path: str, *, budget: int
    ) -> ReplayBuffers:
        lengths = [length for item in inputs for length in item.segments(path)]
        slots = self._slots(path, max_items, max_frames)
        return ReplayBuffers(
            {
                "patches": self._rows(inputs, path),
                "cu_seqlens": segment_offsets(lengths, budget, slots, self.device),
            }
        )

    def graph_forward(self, buffers: dict, path: str) -> dict[str, torch.Tensor]:
        hidden = self.towers[path](
            buffers["patches"], buffers["cu_seqlens"], buffers["max_seqlen"], self._attention()
        )
        return {"hidden": hidden}

    def eager_forward(self, inputs: list[ToyItem], path: str) -> dict[str, torch.Tensor]:
        lengths = [length for item in inputs for length in item.segments(path)]
        rows = self._rows(inputs, path)
        cu_seqlens = segment_offsets(lengths, rows.shape[0], len(lengths), self.device)
        hidden = self.towers[path](rows, cu_seqlens, max(lengths), self._attention())
        return {"hidden": hidden}

    def postprocess(
        self,
        outputs_by_path: dict[str, dict[str, torch.Tensor] | None],
        specs: Sequence[EncoderItemSpec],
    ) -> list[torch.Tensor]:
        per_path = []
        for path, outputs in outputs_by_path.items():
            sizes = [spec.path_tokens.get(path, 0) for spec in specs]
            if outputs is None:
                per_path.append([None] * len(specs))
            else:
                per_path.append(list(outputs["hidden"].split(sizes)))
        return [torch.cat([part for part in parts if part is not None]) for parts in zip(*per_path)]

    def _rows(self, inputs: list[ToyItem], path: str) -> torch.Tensor:
        rows = [item.rows(path) for item in inputs if item.rows(path) is not None]
        return torch.cat(rows).to(self.device, self.dtype)
