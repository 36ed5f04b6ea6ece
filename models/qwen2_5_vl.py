"""Qwen2.5-VL: window attention on most blocks, full attention on `fullatt_block_indexes`.

The tower permutes merged tokens into window order with `window_index` and undoes it after the
merger; `cu_window_seqlens` cuts the permuted rows into windows of at most `window_rows`.
"""

import torch

from encoder_graphs.models.aligned_mlp import align_gated_mlps, set_gated_mlp_width
from encoder_graphs.models.qwen_vision import Layout, QwenVisionAdapter, pad_offsets
from encoder_graphs.models.transformers_seam import get_vision_window_index


class Qwen2_5_VLAdapter(QwenVisionAdapter):
    tensor_keys = (*QwenVisionAdapter.tensor_keys, "window_index", "cu_window_seqlens")
    static_keys = (*QwenVisionAdapter.static_keys, "max_window_seqlen")

    _original_mlp_width: int | None = None

    def align_weights(self) -> None:
        """Pad the blocks' MLP width (3420 in the real models) to a multiple of 8: exact, and
        cuBLAS then picks its fast kernels; and the patch embedding as a GEMM."""
        super().align_weights()
        if self._original_mlp_width is None:
            self._original_mlp_width = align_gated_mlps([block.mlp for block in self.visual.blocks])

    def restore_weights(self) -> None:
        super().restore_weights()
        if self._original_mlp_width is not None:
            for block in self.visual.blocks:
                set_gated_mlp_width(block.mlp, self._original_mlp_width)
            self._original_mlp_width = None

    @property
    def window_side(self) -> int:
        """A window's side in merged tokens."""
        config = self.visual.config
        return config.window_size // self.merge // config.patch_size

    @property
    def window_rows(self) -> int:
        """The largest window in patch rows: the bound baked in as max_window_seqlen."""
        return self.window_side**2 * self.unit

    def layout(self, budget: int, max_frames: int) -> Layout:
        base = super().layout(budget, max_frames)
        tail = -(-base.rows // self.window_rows)
        # A frame of a x b merged tokens has ceil(a/s) * ceil(b/s) <= a*b/s + 1 windows of side s,
        # so a sub-batch has at most budget/s + frames. Every window slot launches attention
        # blocks, used or not: a tight bound keeps large budgets fast.
        windows = min(budget, budget // self.window_side + base.segments)
        return Layout(base.rows, base.segments, windows=windows + tail)

    def _add_metadata(
        self,
        grid_thw: torch.Tensor,
        layout: Layout | None,
        tensors: dict[str, torch.Tensor],
        static: dict[str, int],
    ) -> None:
        config = self.visual.config
        if grid_thw.numel():
            window_index, cu_window_seqlens = get_vision_window_index(
                grid_thw, self.merge, config.window_size, config.patch_size
            )
        else:
            window_index = torch.zeros(0, dtype=torch.long)
            cu_window_seqlens = torch.zeros(1, dtype=torch.int32)
        if layout is None:
            static["max_window_seqlen"] = int(cu_window_seqlens.diff().max())
        else:
            # Padded tokens keep their places: a continued permutation, so its inverse holds.
            units = layout.rows // self.unit
            window_index = torch.cat([window_index, torch.arange(window_index.numel(), units)])
            cu_window_seqlens = pad_offsets(
                cu_window_seqlens, layout.windows + 1, layout.rows, self.window_rows
            )
            static["max_window_seqlen"] = self.window_rows
        tensors["window_index"] = window_index
        tensors["cu_window_seqlens"] = cu_window_seqlens
