"""DeepSeek-OCR 2: the stock `get_image_features` (SAM ViT-B, then a Qwen2-shaped encoder that
reads the SAM patches and returns its learned queries, then the projector) graphed on two paths.

The processor gives each page a global view (the page padded to a 1024 px square: 256 features)
and, for a page larger than one 768 px tile, 2 to 6 local tiles (144 features each), all tiles of
a batch in one tensor with a per-page count. Both go through the same tower; a view or tile
attends only to itself, so each is an independent row of its path's batch: the "global" path's
budgets count views, the "local" path's tiles, and a padded view or tile is zero pixels whose
features are dropped. A page without tiles has no local rows (that path skipped for it); a page
too large for the local graphs still replays its global view. Per page the features are the
stock order: its tiles' (row-major), its view's, then the view separator.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPooling

from encoder_graphs.attention.rel_pos import decomposed_rel_pos_attention
from encoder_graphs.protocols import (
    CaptureInputs,
    EncoderCudaGraphConfig,
    EncoderItemSpec,
    EncoderPathConfig,
    FamilyDefaults,
    ReplayBuffers,
)
from encoder_graphs.rewrites import Rewrites
from encoder_graphs.seam.vision import (
    rel_pos_on_device,
    returns_no_weights,
    sam_attention_forward,
    sam_rel_pos_attentions,
)

GLOBAL, LOCAL = "global", "local"
# 5.17.0, 5.23.0: the processor's view and tile sides, and the tower's features for each (its
# learned query banks: 16 x 16 for a 1024 px view, 12 x 12 for a 768 px tile).
VIEW_SIDE, TILE_SIDE = 1024, 768
VIEW_FEATURES, TILE_FEATURES = 256, 144
MOST_TILES = 6  # the processor's largest grid
# Budgets grow by 2**(1/2) (1, 2, 3, 4, 6, 8, 11, ...): one page's 2, 3, 4 or 6 tiles each fill a
# budget. Doubling padded a page of 6 tiles to 8, whose replay measured no cheaper than the eager
# forward over the 6 (H100), so a page at a time ran its tiles eagerly; budget 6 replays them 10%
# faster than eager (benchmarks/RESULTS.md, DeepSeek-OCR 2).
STEPS_PER_DOUBLING = 2
_STOCK_ONLY_KWARGS = ("output_hidden_states", "output_attentions")


@dataclass
class Pages:
    """One `get_image_features` call: `views` [pages, 3, 1024, 1024], `tiles` [tiles, 3, 768, 768]
    (every page's, in page order; no rows where no page has any), `tiles_per_page`."""

    views: torch.Tensor
    tiles: torch.Tensor
    tiles_per_page: list[int]

    def __post_init__(self) -> None:
        if len(self.tiles_per_page) != self.views.shape[0]:
            raise ValueError(f"{len(self.tiles_per_page)} tile counts for {self.views.shape[0]} pages")
        if sum(self.tiles_per_page) != self.tiles.shape[0] or min(self.tiles_per_page, default=0) < 0:
            raise ValueError(f"tile counts {self.tiles_per_page} for {self.tiles.shape[0]} tiles")
        for name, pixels, side in (("views", self.views, VIEW_SIDE), ("tiles", self.tiles, TILE_SIDE)):
            if pixels.shape[1:] != (3, side, side) and pixels.shape[0]:
                raise ValueError(f"{name} of shape {tuple(pixels.shape)}; the tower takes [n, 3, {side}, {side}]")

    def select(self, indices: Sequence[int]) -> "Pages":
        if list(indices) == list(range(len(self.tiles_per_page))):
            return self  # the whole call: no copy
        starts = [0]
        for count in self.tiles_per_page:
            starts.append(starts[-1] + count)
        tile_rows = [row for i in indices for row in range(starts[i], starts[i + 1])]
        index = torch.tensor(list(indices), dtype=torch.long, device=self.views.device)
        tiles = self.tiles[torch.tensor(tile_rows, dtype=torch.long, device=self.tiles.device)]
        return Pages(self.views[index], tiles, [self.tiles_per_page[i] for i in indices])


class DeepseekOcrAdapter(FamilyDefaults):
    """SupportsEncoderCudaGraph and ModelFamily over a stock `DeepseekOcr2Model` (the module that
    owns the tower, the projector and the view separator)."""

    feature_methods = ("get_image_features",)
    generate_inputs = ("pixel_values", "pixel_values_local", "num_local_patches")

    def __init__(
        self,
        model: nn.Module,
        *,
        attn_backend: str | None = None,
        budget_ranges: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        if attn_backend not in (None, "sdpa"):
            raise ValueError(f"DeepSeek-OCR 2's tower runs its own attention (sdpa), not {attn_backend!r}")
        self.model = model
        self.attn_backend = "sdpa"
        weight = model.multi_modal_projector.weight
        self.dtype, self.device = weight.dtype, weight.device
        self.budget_ranges = budget_ranges or {GLOBAL: (1, 16), LOCAL: (1, 6 * MOST_TILES)}

    # ----- ModelFamily -----------------------------------------------------------------------
    def feature_inputs(self, method: str, arguments: dict) -> Pages | None:
        """The pages of one `get_image_features` call; None (stock) for per-layer outputs."""
        if any(arguments.get(key) for key in _STOCK_ONLY_KWARGS):
            return None
        views = arguments["pixel_values"]
        tiles, counts = arguments.get("pixel_values_local"), arguments.get("num_local_patches")
        counts = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts or [0] * views.shape[0])
        if tiles is None:
            tiles, counts = views.new_zeros(0, 3, TILE_SIDE, TILE_SIDE), [0] * views.shape[0]
        return Pages(views, tiles, counts)

    def feature_output(self, method: str, items: list[torch.Tensor], arguments: dict) -> Any:
        """What the stock method returns: `pooler_output` a list of each page's features; the
        tower's hidden states are not kept by the graphs (None)."""
        return BaseModelOutputWithPooling(pooler_output=items)

    def align_weights(self, rewrites: Rewrites) -> None:
        """SAM's and the encoder's widths (768, 3072; 896, 4864) are multiples of 8: nothing to
        align. SAM's attentions index their relative-position tables on the device, so that their
        forward can be captured; those of the sdpa class (the default) also fold the positions
        into q and k (one fused attention, no [tokens, tokens] bias in memory:
        `attention/rel_pos.py`). The eager class keeps its forward: it returns the attention
        weights, which a call asking for them records."""
        for attention in sam_rel_pos_attentions(self.model.vision_tower.sam_encoder):
            rewrites.patch(attention, "get_rel_pos", rel_pos_on_device)
            if returns_no_weights(attention):
                rewrites.patch(attention, "forward", sam_attention_forward(attention, decomposed_rel_pos_attention))

    def repeated_blocks(self) -> list[nn.Module]:
        """None: compiled, SAM's and the encoder's blocks ran slower than uncompiled (the folded
        attention, 16 views on an H100) after a minute of compiling, and recompiled at the next
        batch size for another minute (benchmarks/RESULTS.md, DeepSeek-OCR 2)."""
        return []

    @classmethod
    def check_decoder_inputs(cls, inputs: dict) -> None:
        """Plain 1-D positions, no token types: nothing to check."""

    @classmethod
    def pixel_values_per_vision_token(cls, config: Any) -> int:
        """The global view's or a local tile's pixels (3 channels) over its features, the larger."""
        return max(-(-3 * side * side // features) for side, features in ((VIEW_SIDE, VIEW_FEATURES),
                                                                           (TILE_SIDE, TILE_FEATURES)))

    # ----- the encoder -----------------------------------------------------------------------
    def _features(self, pixels: torch.Tensor) -> torch.Tensor:
        """The stock tower and projector: [n, features, hidden]."""
        return self.model.multi_modal_projector(self.model.vision_tower(pixels).last_hidden_state)

    # ----- SupportsEncoderCudaGraph ----------------------------------------------------------
    def get_encoder_cudagraph_config(self) -> EncoderCudaGraphConfig:
        return EncoderCudaGraphConfig(
            paths=tuple(EncoderPathConfig(name, steps_per_doubling=STEPS_PER_DOUBLING) for name in (GLOBAL, LOCAL)),
            dtype=self.dtype,
            device=self.device,
            max_items=max(high for _, high in self.budget_ranges.values()),
        )

    def get_budget_range(self) -> dict[str, tuple[int, int]]:
        return dict(self.budget_ranges)

    def get_item_specs(self, inputs: Pages) -> list[EncoderItemSpec]:
        return [
            EncoderItemSpec(1 + tiles, VIEW_FEATURES + TILE_FEATURES * tiles + 1, path_tokens={GLOBAL: 1, LOCAL: tiles})
            for tiles in inputs.tiles_per_page
        ]

    def select_items(self, inputs: Pages, indices: Sequence[int]) -> Pages:
        return inputs.select(indices)

    def prepare_capture_inputs(self, budget: int, max_items: int, max_frames: int, path: str) -> CaptureInputs:
        side = VIEW_SIDE if path == GLOBAL else TILE_SIDE
        return CaptureInputs({"pixel_values": torch.zeros(budget, 3, side, side, dtype=self.dtype, device=self.device)})

    def prepare_replay_buffers(
        self, inputs: Pages, max_items: int, max_frames: int, path: str, *, budget: int
    ) -> ReplayBuffers:
        # The manager zeroes the rows past these: padded views and tiles are zero pixels.
        return ReplayBuffers({"pixel_values": self._pixels(inputs, path)})

    def graph_forward(self, buffers: dict, path: str) -> dict[str, torch.Tensor]:
        return {"features": self._features(buffers["pixel_values"])}

    def eager_forward(self, inputs: Pages, path: str) -> dict[str, torch.Tensor]:
        return {"features": self._features(self._pixels(inputs, path))}

    def postprocess(
        self, outputs_by_path: dict[str, dict[str, torch.Tensor] | None], specs: Sequence[EncoderItemSpec]
    ) -> list[torch.Tensor]:
        views = outputs_by_path[GLOBAL]["features"]
        local = outputs_by_path[LOCAL]
        tiles = [spec.path_tokens[LOCAL] for spec in specs]
        per_page = local["features"].split(tiles) if local is not None else [views[:0]] * len(specs)
        separator = self.model.view_separator.to(views.dtype).unsqueeze(0)
        width = views.shape[-1]
        return [
            torch.cat([page_tiles.reshape(-1, width), view, separator])
            for page_tiles, view in zip(per_page, views, strict=True)
        ]

    def _pixels(self, inputs: Pages, path: str) -> torch.Tensor:
        pixels = inputs.views if path == GLOBAL else inputs.tiles
        return pixels.to(self.device, self.dtype)
