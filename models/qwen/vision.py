"""What the Qwen-VL vision towers share: inputs, padded metadata, and the adapter over the stock tower.

The tower is the transformers module itself (its weights, its forward). Every data-dependent
tensor its forward would derive from `grid_thw` (rotary position ids, cu_seqlens, window index,
position-embedding interpolation) is computed here, on the host, by `metadata`, and passed to that
forward as the precomputed kwargs transformers accepts. `metadata` serves eager calls (exact
sizes), capture and replay (padded to a budget's layout), so all three see the same values.
"""

import warnings
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, partial
from typing import Any

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import BaseModelOutputWithPooling

from encoder_graphs.attention import default_attention_backend
from encoder_graphs.kernels import HALF_DTYPES
from encoder_graphs.protocols import (
    CaptureInputs,
    EncoderCudaGraphConfig,
    EncoderItemSpec,
    EncoderPathConfig,
    FamilyDefaults,
    ReplayBuffers,
)
from encoder_graphs.rewrites import Rewrites
from encoder_graphs.seam.attention import attention_implementation, register_varlen_attention
from encoder_graphs.seam.vision import get_vision_cu_seqlens, get_vision_position_ids

PATH = "default"
# Budgets grow by 2**(1/4): at most ~16% padding instead of doubling's 50%. At large budgets the
# padded rows cost more than the launches a graph saves, so waste matters more than graph count.
BUDGET_STEPS_PER_DOUBLING = 4
Grid = tuple[int, int, int]
METADATA_CACHE = 64  # (grids, layout) entries: a dataset's common image sizes and batches
# Requests for per-layer vision outputs that only the stock forward can answer.
_STOCK_ONLY_KWARGS = ("output_hidden_states", "output_attentions")
# The stock feature methods' names for their inputs, which are VisionBatch's field names too.
_FEATURE_ARGUMENTS = {
    "get_image_features": ("pixel_values", "image_grid_thw"),
    "get_video_features": ("pixel_values_videos", "video_grid_thw"),
}
_warned: list[str] = []  # warnings given once a process


@dataclass(eq=False)
class VisionBatch:
    """Images then videos, as a Qwen-VL processor returns them: patch rows and (t, h, w) per item."""

    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for pixels, grid in (
            (self.pixel_values, self.image_grid_thw),
            (self.pixel_values_videos, self.video_grid_thw),
        ):
            if (pixels is None) != (grid is None):
                raise ValueError("pixel values and their grid_thw come together")

    @cached_property
    def grids(self) -> list[Grid]:
        """(t, h, w) of every item in patches: one host read per batch."""
        grids = []
        for grid in (self.image_grid_thw, self.video_grid_thw):
            if grid is not None:
                grids += [tuple(int(x) for x in row) for row in grid.tolist()]
        return grids

    def rows(self) -> torch.Tensor:
        """Every item's patch rows, in item order (no copy unless both kinds are present)."""
        pixels = [p for p in (self.pixel_values, self.pixel_values_videos) if p is not None]
        rows = torch.cat(pixels) if len(pixels) > 1 else pixels[0]
        expected = sum(t * h * w for t, h, w in self.grids)
        if rows.shape[0] != expected:
            raise ValueError(f"pixel rows {rows.shape[0]} do not match grid_thw ({expected} patches)")
        return rows

    def item_pixels(self) -> list[torch.Tensor]:
        """One [t*h*w, patch_dim] view per item."""
        return list(torch.split(self.rows(), [t * h * w for t, h, w in self.grids]))


@dataclass(frozen=True)
class Layout:
    """Sizes of a budget's padded buffers. `rows`: patch rows; `segments`, `windows`: attention
    segments that cu_seqlens / cu_window_seqlens can describe (the padded tail included)."""

    rows: int
    segments: int
    windows: int


def pad_offsets(offsets: torch.Tensor, length: int, capacity: int, chunk: int) -> torch.Tensor:
    """Cumulative offsets of the real segments, then the padded tail [real, capacity) cut into
    self-attending segments of at most `chunk` rows, then `capacity` repeated up to `length`
    entries: monotonic, and every row of the buffer belongs to a segment."""
    real = int(offsets[-1])
    tail = torch.arange(real, capacity, chunk, dtype=offsets.dtype)[1:]
    offsets = torch.cat([offsets, tail, torch.tensor([capacity], dtype=offsets.dtype)])
    offsets = torch.unique_consecutive(offsets)
    if offsets.numel() > length:
        raise ValueError(f"{offsets.numel() - 1} attention segments do not fit in {length - 1}")
    return torch.cat([offsets, offsets.new_full((length - offsets.numel(),), capacity)])


def pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.shape[0] > rows:
        raise ValueError(f"{tensor.shape[0]} rows do not fit in {rows}")
    return torch.cat([tensor, tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))])


def linear_patch_embed(embed: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """The stock patch embedding of every Qwen-VL tower, a Conv3d whose kernel is its stride over
    rows that each hold one patch (channels, frames, height, width), as the GEMM it equals.
    cuDNN ran the conv as an implicit-GEMM sgemm, many times as long as the equal GEMM's FLOPs
    take (measured: benchmarks/HISTORY.md)."""
    proj = embed.proj
    return F.linear(pixels.to(proj.weight.dtype), proj.weight.flatten(1), proj.bias)


class QwenVisionAdapter(FamilyDefaults):
    """SupportsEncoderCudaGraph over a stock Qwen2-VL vision tower (base of the other families).

    Budgets count output rows (merged tokens); a budget of B holds B * merge**2 patch rows.
    Each frame of an item is its own attention segment, as in transformers. The default budgets
    stop at 4096: above it the tower is GPU-bound, so replay barely beat the eager path, while
    those budgets took most of the capture's time. Capped, the caption command ran as fast
    (measured: benchmarks/HISTORY.md); larger sub-batches split into budgets of 4096 and a larger
    single item (over ~3.2 MP) runs eagerly.
    """

    # Keys of the tower forward's precomputed kwargs that `metadata` returns as tensors.
    tensor_keys: tuple[str, ...] = ("position_ids", "cu_seqlens")
    # Host ints baked into a graph at capture.
    static_keys: tuple[str, ...] = ("max_seqlen",)

    def __init__(
        self,
        vision_tower: torch.nn.Module,
        *,
        attn_backend: str | None = None,
        max_frames_per_item: int = 16,
        budget_range: tuple[int, int] = (64, 4096),
    ) -> None:
        self.visual = vision_tower
        config = vision_tower.config
        self.merge = config.spatial_merge_size
        self.unit = self.merge**2
        weight = next(vision_tower.parameters())
        self.dtype, self.device = weight.dtype, weight.device
        if attn_backend is None:
            # PyTorch's FA2 needs half precision; fp32 on CUDA falls back to the masked reference.
            half = self.dtype in HALF_DTYPES
            attn_backend = default_attention_backend(self.device) if half else "sdpa"
        self.attn_backend = attn_backend
        self.attn_implementation = register_varlen_attention(attn_backend)
        self.max_frames_per_item = max_frames_per_item
        self.budget_range = budget_range
        self._metadata: OrderedDict[tuple, tuple[dict[str, torch.Tensor], dict[str, int]]] = OrderedDict()

    # ----- ModelFamily: transformers' get_image_features / get_video_features, decoder inputs ---
    feature_methods = tuple(_FEATURE_ARGUMENTS)
    # The images, the videos, and their token types, which M-RoPE reads.
    generate_inputs = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "mm_token_type_ids")
    # `generate`'s position ids are 4 rows: plain text positions, then M-RoPE's temporal, height
    # and width rows (`seam/generation.py`); the text model builds its mask from the first.
    text_position_row = 0

    @classmethod
    def pixel_values_per_vision_token(cls, config: Any) -> int:
        """A merged token is merge x merge patches, each of `temporal_patch_size` frames."""
        vision = config.vision_config
        return vision.spatial_merge_size**2 * vision.temporal_patch_size * vision.in_channels * vision.patch_size**2

    def feature_inputs(self, method: str, arguments: dict) -> VisionBatch | None:
        """A VisionBatch for `get_*_features`; None when the call asks for per-layer outputs,
        which only the stock forward has."""
        if any(arguments.get(key) for key in _STOCK_ONLY_KWARGS):
            return None
        pixels, grid = _FEATURE_ARGUMENTS[method]
        return VisionBatch(**{pixels: arguments[pixels], grid: arguments.get(grid)})

    def feature_output(self, method: str, items: list[torch.Tensor], arguments: dict) -> Any:
        """The object transformers' get_*_features returns, `pooler_output` one tensor per item.
        `last_hidden_state` (the unmerged patch states) is not kept by the graphs: None."""
        return self._feature_output(items)

    def _feature_output(self, items: list[torch.Tensor]) -> Any:
        return BaseModelOutputWithPooling(pooler_output=tuple(items))

    @classmethod
    def check_decoder_inputs(cls, inputs: dict) -> None:
        """Without `mm_token_type_ids` (0 text, 1 image, 2 video: the Qwen-VL processors return
        them) stock transformers gives vision tokens text positions, and so does the runner;
        say so once."""
        multimodal = inputs.get("image_grid_thw") is not None or inputs.get("video_grid_thw") is not None
        if multimodal and inputs.get("mm_token_type_ids") is None and not _warned:
            _warned.append("mm_token_type_ids")
            warnings.warn(
                "generate() got images or videos without mm_token_type_ids: as in stock transformers, their "
                "tokens get text positions instead of M-RoPE's; pass the processor's mm_token_type_ids",
                stacklevel=5,  # the caller of the graphed model.generate
            )

    # ----- weights ----------------------------------------------------------------------------
    def align_weights(self, rewrites: Rewrites) -> None:
        """The patch embedding as the GEMM it is (`linear_patch_embed`), on the same weights; a
        family may change more (Qwen2.5-VL pads its MLP, fuses its window attention). The undo
        also drops the cached metadata."""
        rewrites.push(self._metadata.clear)
        embed = self.visual.patch_embed
        rewrites.patch(embed, "forward", partial(linear_patch_embed, embed))

    def repeated_blocks(self) -> list[torch.nn.Module]:
        return list(self.visual.blocks)

    # ----- metadata (the one function eager, capture and replay share) ----------------------
    def layout(self, budget: int, max_frames: int) -> Layout:
        # A frame or a window holds at least one merged token, so a budget bounds their number.
        rows = budget * self.unit
        return Layout(rows=rows, segments=min(max_frames, budget) + 1, windows=budget + 1)

    def metadata(
        self, grids: Sequence[Grid], layout: Layout | None
    ) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """Tensors for the tower's forward and its host ints. `layout=None`: exact sizes (eager);
        otherwise padded to `layout` (the host ints are then the capture's worst case)."""
        grid_thw = torch.tensor(list(grids), dtype=torch.long).reshape(-1, 3)
        if grids:
            position_ids = get_vision_position_ids(grid_thw, self.merge)
        else:
            position_ids = torch.zeros(0, 2, dtype=torch.long)
        cu_seqlens = get_vision_cu_seqlens(grid_thw)
        if layout is None:
            tensors = {"position_ids": position_ids, "cu_seqlens": cu_seqlens}
            static = {"max_seqlen": max(h * w for _, h, w in grids)}
        else:
            tensors = {
                "position_ids": pad_rows(position_ids, layout.rows),
                "cu_seqlens": pad_offsets(cu_seqlens, layout.segments + 1, layout.rows, layout.rows),
            }
            static = {"max_seqlen": layout.rows}
        self._add_metadata(grid_thw, layout, tensors, static)
        return tensors, static

    def _add_metadata(
        self,
        grid_thw: torch.Tensor,
        layout: Layout | None,
        tensors: dict[str, torch.Tensor],
        static: dict[str, int],
    ) -> None:
        """A family's own metadata, added in place (none for Qwen2-VL)."""

    # ----- the tower ----------------------------------------------------------------------
    def _run_tower(self, pixels: torch.Tensor, kwargs: dict) -> torch.Tensor:
        with attention_implementation(self.visual.config, self.attn_implementation):
            output = self.visual(pixels, grid_thw=None, return_dict=True, **kwargs)
        return self._embeds(output)

    def _embeds(self, output) -> torch.Tensor:
        return output.pooler_output

    def device_metadata(
        self, grids: Sequence[Grid], layout: Layout | None
    ) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """`metadata` on the device, kept for the last `METADATA_CACHE` (grids, layout) asked: a
        sub-batch of sizes seen before costs no host work and no copy. Building and copying it
        took host time comparable to a small image's replay (measured: benchmarks/HISTORY.md).
        The cached tensors are only ever read."""
        key = (tuple(grids), layout)
        if key in self._metadata:
            self._metadata.move_to_end(key)
            return self._metadata[key]
        tensors, static = self.metadata(grids, layout)
        entry = {name: value.to(self.device) for name, value in tensors.items()}, static
        if not grids:  # a capture's inputs: the manager keeps its own copy
            return entry
        self._metadata[key] = entry
        if len(self._metadata) > METADATA_CACHE:
            self._metadata.popitem(last=False)
        return entry

    # ----- SupportsEncoderCudaGraph -------------------------------------------------------
    def get_encoder_cudagraph_config(self) -> EncoderCudaGraphConfig:
        return EncoderCudaGraphConfig(
            paths=(EncoderPathConfig(PATH, steps_per_doubling=BUDGET_STEPS_PER_DOUBLING),),
            max_frames_per_item=self.max_frames_per_item,
            dtype=self.dtype,
            device=self.device,
        )

    def get_budget_range(self) -> dict[str, tuple[int, int]]:
        return {PATH: self.budget_range}

    def get_item_specs(self, inputs: VisionBatch) -> list[EncoderItemSpec]:
        specs = []
        for t, h, w in inputs.grids:
            tokens = t * h * w // self.unit
            specs.append(EncoderItemSpec(t * h * w, tokens, frames=t, path_tokens={PATH: tokens}))
        return specs

    def select_items(self, inputs: VisionBatch, indices: Sequence[int]) -> VisionBatch:
        """The chosen items in the order asked. The tower treats images and videos alike, so
        the selection holds them all in the image fields."""
        pixels = inputs.item_pixels()
        grids = inputs.grids
        chosen = VisionBatch(
            pixel_values=torch.cat([pixels[i] for i in indices]),
            image_grid_thw=torch.tensor([grids[i] for i in indices], dtype=torch.long),
        )
        chosen.grids = [grids[i] for i in indices]  # seeds the cached property: no device read
        return chosen

    def prepare_capture_inputs(
        self, budget: int, max_items: int, max_frames: int, path: str
    ) -> CaptureInputs:
        layout = self.layout(budget, max_frames)
        tensors, static = self.device_metadata([], layout)
        pixels = torch.zeros(layout.rows, self._patch_dim, dtype=self.dtype, device=self.device)
        return CaptureInputs({"pixel_values": pixels, **tensors}, static)

    def prepare_replay_buffers(
        self, inputs: VisionBatch, max_items: int, max_frames: int, path: str, *, budget: int
    ) -> ReplayBuffers:
        tensors, _ = self.device_metadata(inputs.grids, self.layout(budget, max_frames))
        pixels = inputs.rows().to(self.device, self.dtype)
        return ReplayBuffers({"pixel_values": pixels, **tensors})

    def graph_forward(self, buffers: dict, path: str) -> dict[str, torch.Tensor]:
        kwargs = {key: buffers[key] for key in (*self.tensor_keys, *self.static_keys)}
        return {"embeds": self._run_tower(buffers["pixel_values"], kwargs)}

    def eager_forward(self, inputs: VisionBatch, path: str) -> dict[str, torch.Tensor]:
        tensors, static = self.device_metadata(inputs.grids, None)
        pixels = inputs.rows().to(self.device, self.dtype)
        return {"embeds": self._run_tower(pixels, {**tensors, **static})}

    def postprocess(
        self,
        outputs_by_path: dict[str, dict[str, torch.Tensor] | None],
        specs: Sequence[EncoderItemSpec],
    ) -> list[torch.Tensor]:
        embeds = outputs_by_path[PATH]["embeds"]
        return list(torch.split(embeds, [spec.output_tokens for spec in specs]))

    @property
    def _patch_dim(self) -> int:
        config = self.visual.config
        return config.in_channels * config.temporal_patch_size * config.patch_size**2
