"""InternVL: the stock `get_image_features` (InternViT tower, feature layer and CLS selection, pixel
shuffle, projector) graphed per number of tiles.

transformers' InternVL encodes tiles: a processor cuts each image into 1..N tiles of the tower's
image size (plus a thumbnail) and each video frame is one tile; `get_image_features` receives all
tiles of a prompt batch as one `[tiles, 3, H, W]` tensor, with no item boundaries. Each tile attends
only to itself (dense attention over CLS + patches), so a tile is an item, budgets count tiles,
and a padded tile is zero pixels whose output rows are dropped: nothing data-dependent is left to
compute outside the graph.
"""

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPooling

from encoder_graphs.protocols import (
    CaptureInputs,
    EncoderCudaGraphConfig,
    EncoderItemSpec,
    EncoderPathConfig,
    FamilyDefaults,
    ReplayBuffers,
)
from encoder_graphs.rewrites import Rewrites
from encoder_graphs.seam.attention import attention_implementation, register_dense_attention

PATH = "tiles"
# Budgets 1, 2, ..., 13, 15, 16, 17, 19, ..., 59, 64 (31 graphs): every tile count of one image has
# its own graph and at most ~8% of tiles are padding. With doubling-ish budgets (1, 2, 3, 4, 6,
# 8, 11, 16, ...) an InternVL3-1B 13-tile image padded to 16 ran slower than eager (measured:
# benchmarks/HISTORY.md); large calls are GPU-bound, so there padding is the whole cost of a graph.
BUDGET_STEPS_PER_DOUBLING = 8
# Calls that ask for per-layer outputs, which only the stock method returns.
_STOCK_ONLY_KWARGS = ("output_hidden_states", "output_attentions")


class InternVLAdapter(FamilyDefaults):
    """SupportsEncoderCudaGraph and ModelFamily over a stock `InternVLModel` (the module that owns
    the vision tower and the projector). Budgets count tiles; the graph input is the tile pixels."""

    feature_methods = ("get_image_features",)
    # The tiles, and how get_image_features reads them (consumed by the prefill with them).
    generate_inputs = ("pixel_values", "vision_feature_layer", "vision_feature_select_strategy")

    def __init__(
        self,
        model: nn.Module,
        *,
        attn_backend: str | None = None,
        budget_range: tuple[int, int] = (1, 64),
    ) -> None:
        self.model = model
        vision = model.config.vision_config
        self.tile_size = tuple(vision.image_size)
        self.tokens_per_tile = model.config.image_seq_length
        weight = next(model.vision_tower.parameters())
        self.dtype, self.device = weight.dtype, weight.device
        # None: the tower's own attention (sdpa by default); a name: one of our dense backends.
        self.attn_implementation = None if attn_backend in (None, "sdpa") else register_dense_attention(attn_backend)
        self.attn_backend = attn_backend or "sdpa"
        self.budget_range = budget_range

    # ----- ModelFamily -----------------------------------------------------------------------
    def feature_inputs(self, method: str, arguments: dict) -> torch.Tensor | None:
        """The tiles of one `get_image_features` call; None (stock) for per-layer outputs or a
        feature layer / selection other than the config's, which the graphs were captured with."""
        config = self.model.config
        layer = arguments.get("vision_feature_layer")
        strategy = arguments.get("vision_feature_select_strategy")
        if any(arguments.get(key) for key in _STOCK_ONLY_KWARGS):
            return None
        if layer not in (None, config.vision_feature_layer) or strategy not in (None, config.vision_feature_select_strategy):
            return None
        return arguments["pixel_values"]

    def feature_output(self, method: str, items: list[torch.Tensor], arguments: dict) -> Any:
        """What the stock method returns: `pooler_output` [tiles, tokens per tile, hidden]; the
        tower's hidden states are not kept by the graphs (None)."""
        return BaseModelOutputWithPooling(pooler_output=torch.stack(items) if items else None)

    def align_weights(self, rewrites: Rewrites) -> None:
        """InternViT's widths (1024/4096, 3200/12800) are multiples of 8: nothing to align."""

    def repeated_blocks(self) -> list[nn.Module]:
        return list(self.model.vision_tower.encoder.layer)

    @classmethod
    def check_decoder_inputs(cls, inputs: dict) -> None:
        """InternVL's language model takes plain 1-D positions and no token types: nothing to check."""

    @classmethod
    def pixel_values_per_vision_token(cls, config: Any) -> int:
        """A tile (the tower's image size, 3 channels) gives `image_seq_length` tokens."""
        height, width = config.vision_config.image_size
        return -(-3 * height * width // config.image_seq_length)

    # ----- the encoder -----------------------------------------------------------------------
    def _features(self, pixels: torch.Tensor) -> torch.Tensor:
        """The stock computation (the class's method, never a patched instance attribute)."""
        config = self.model.config
        run = type(self.model).get_image_features
        kwargs = dict(
            vision_feature_layer=config.vision_feature_layer,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
            return_dict=True,
        )
        if self.attn_implementation is None:
            return run(self.model, pixels, **kwargs).pooler_output
        with attention_implementation(self.model.config.vision_config, self.attn_implementation):
            return run(self.model, pixels, **kwargs).pooler_output

    # ----- SupportsEncoderCudaGraph ----------------------------------------------------------
    def get_encoder_cudagraph_config(self) -> EncoderCudaGraphConfig:
        # A sub-batch may hold as many tiles as the largest budget: dense attention has no
        # per-segment launch cost.
        return EncoderCudaGraphConfig(
            paths=(EncoderPathConfig(PATH, steps_per_doubling=BUDGET_STEPS_PER_DOUBLING),),
            dtype=self.dtype,
            device=self.device,
            max_items=self.budget_range[1],
        )

    def get_budget_range(self) -> dict[str, tuple[int, int]]:
        return {PATH: self.budget_range}

    def get_item_specs(self, inputs: torch.Tensor) -> list[EncoderItemSpec]:
        height, width = inputs.shape[-2:]
        if (height, width) != self.tile_size:
            raise ValueError(f"tiles of {height}x{width} pixels; the tower takes {self.tile_size}")
        spec = EncoderItemSpec(1, self.tokens_per_tile, path_tokens={PATH: 1})
        return [spec] * inputs.shape[0]

    def select_items(self, inputs: torch.Tensor, indices: Sequence[int]) -> torch.Tensor:
        first = indices[0] if indices else 0
        if list(indices) == list(range(first, first + len(indices))):
            return inputs[first : first + len(indices)]  # the packer keeps runs of tiles: no copy
        return inputs[torch.tensor(list(indices), device=inputs.device)]

    def prepare_capture_inputs(self, budget: int, max_items: int, max_frames: int, path: str) -> CaptureInputs:
        pixels = torch.zeros(budget, 3, *self.tile_size, dtype=self.dtype, device=self.device)
        return CaptureInputs({"pixel_values": pixels})

    def prepare_replay_buffers(
        self, inputs: torch.Tensor, max_items: int, max_frames: int, path: str, *, budget: int
    ) -> ReplayBuffers:
        # The manager zeroes the rows past these tiles: padded tiles are zero pixels.
        return ReplayBuffers({"pixel_values": inputs.to(self.device, self.dtype)})

    def graph_forward(self, buffers: dict, path: str) -> dict[str, torch.Tensor]:
        return {"features": self._features(buffers["pixel_values"])}

    def eager_forward(self, inputs: torch.Tensor, path: str) -> dict[str, torch.Tensor]:
        return {"features": self._features(inputs.to(self.device, self.dtype))}

    def postprocess(
        self, outputs_by_path: dict[str, dict[str, torch.Tensor] | None], specs: Sequence[EncoderItemSpec]
    ) -> list[torch.Tensor]:
        return list(outputs_by_path[PATH]["features"][: len(specs)].unbind(0))
