"""The Qwen3 towers (Qwen3-VL's, Qwen3.5's): learned position embeddings resampled to each grid;
Qwen3-VL's adds deepstack features.

The interpolation taps and weights are computed outside the graph; the tower gathers them inside.
A Qwen3-VL item's output row is [main features | deepstack level 0 | level 1 | ...] on the last dim.
"""

from typing import Any

import torch

from encoder_graphs.models.qwen.vision import Layout, QwenVisionAdapter, pad_rows
from encoder_graphs.seam.vision import deepstack_output, get_vision_interpolation_indices_and_weights


class Qwen3TowerAdapter(QwenVisionAdapter):
    """A tower whose position embeddings are a learned grid resampled to each image's (Qwen3.5's
    as it is; Qwen3-VL's adds deepstack levels)."""

    tensor_keys = (*QwenVisionAdapter.tensor_keys, "interp_indices", "interp_weights")

    def _add_metadata(
        self,
        grid_thw: torch.Tensor,
        layout: Layout | None,
        tensors: dict[str, torch.Tensor],
        static: dict[str, int],
    ) -> None:
        visual = self.visual
        if grid_thw.numel():
            indices, weights = get_vision_interpolation_indices_and_weights(
                grid_thw,
                num_grid_per_side=visual.num_grid_per_side,
                mode=visual.interpolation_mode,
                align_corners=visual.interpolation_align_corners,
                spatial_merge_size=self.merge,
            )
        else:
            taps = 4 if visual.interpolation_mode == "bilinear" else 16
            indices = torch.zeros(0, taps, dtype=torch.long)
            weights = torch.zeros(0, taps, dtype=torch.float32)
        if layout is not None:
            # Padded rows gather entry 0 with weight 0: a finite zero embedding.
            indices, weights = pad_rows(indices, layout.rows), pad_rows(weights, layout.rows)
        tensors["interp_indices"] = indices
        tensors["interp_weights"] = weights


class Qwen3VLAdapter(Qwen3TowerAdapter):
    @property
    def deepstack_levels(self) -> int:
        return len(self.visual.deepstack_visual_indexes)

    def _embeds(self, output) -> torch.Tensor:
        return torch.cat([output.pooler_output, *output.deepstack_features], dim=-1)

    def _feature_output(self, items: list[torch.Tensor]) -> Any:
        main, *deepstack = self.split_deepstack(torch.cat(items))
        return deepstack_output(main, deepstack, [item.shape[0] for item in items])

    def split_deepstack(self, embeds: torch.Tensor) -> list[torch.Tensor]:
        """[tokens, hidden * (1 + levels)] -> main features, then one tensor per deepstack level."""
        return list(embeds.chunk(1 + self.deepstack_levels, dim=-1))
