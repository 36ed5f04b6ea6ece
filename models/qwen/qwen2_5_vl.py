"""Qwen2.5-VL: window attention on most blocks, full attention on `fullatt_block_indexes`.

The tower permutes merged tokens into window order with `window_index` and undoes it after the
merger; `cu_window_seqlens` cuts the permuted rows into windows of at most `window_rows`.
"""

from collections.abc import Callable
from functools import partial

import torch

from encoder_graphs.kernels import HALF_DTYPES, triton_runs
from encoder_graphs.kernels.checks import check_segments
from encoder_graphs.models.qwen.aligned_mlp import align_gated_mlps
from encoder_graphs.models.qwen.chained_blocks import Forward, chained, chained_forwards, chains_blocks
from encoder_graphs.models.qwen.vision import Layout, QwenVisionAdapter, pad_offsets
from encoder_graphs.rewrites import Rewrites
from encoder_graphs.rewrites.fused_mlp import fuse_gated_mlp, fuses_gated_mlp
from encoder_graphs.seam.vision import get_vision_window_index, permute_qk, window_attention_forward


def interleave_pairs(head_dim: int) -> torch.Tensor:
    """The order of one head's dims that puts rotary pair (i, i + head_dim/2) at (2i, 2i + 1),
    as `kernels/window.py` takes q and k."""
    half = head_dim // 2
    return torch.stack([torch.arange(half), torch.arange(half, head_dim)], dim=1).flatten()


class Qwen2_5_VLAdapter(QwenVisionAdapter):
    tensor_keys = (*QwenVisionAdapter.tensor_keys, "window_index", "cu_window_seqlens")
    static_keys = (*QwenVisionAdapter.static_keys, "max_window_seqlen")
    # Seconds per temporal patch of each video: M-RoPE spaces its temporal positions by them.
    generate_inputs = (*QwenVisionAdapter.generate_inputs, "second_per_grid_ts")

    _chained_forwards: list[Forward] | None = None  # on during the adapter's own tower calls

    def align_weights(self, rewrites: Rewrites) -> None:
        """Pad the blocks' MLP width (3420 in the real models) to a multiple of 8: exact, and
        cuBLAS then picks its fast kernels; the patch embedding as a GEMM; and, where Triton runs,
        the window blocks' rotary and attention in one kernel (`kernels/window.py`), each MLP's gate,
        up and SiLU in one GEMM (`kernels/swiglu.py`), and each block's last residual add with the
        next block's first norm (`chained_blocks`)."""
        super().align_weights(rewrites)
        align_gated_mlps([block.mlp for block in self.visual.blocks], rewrites)
        if self.fuses_windows:
            from encoder_graphs.kernels.window import rotary_window_attention

            # One wrapper for every window block, out of torch.compile'd code as the varlen backends.
            attend = torch.compiler.disable(partial(rotary_window_attention, max_seqlen=self.window_rows))
            for attention in self._window_attentions():
                self._fuse_window(attention, attend, rewrites)
        mlps = [block.mlp for block in self.visual.blocks if fuses_gated_mlp(block.mlp)]
        if mlps:
            from encoder_graphs.kernels.swiglu import swiglu_linear

            for mlp in mlps:
                fuse_gated_mlp(mlp, swiglu_linear, rewrites)
        blocks = list(self.visual.blocks)
        if chains_blocks(blocks, self.dtype):
            from encoder_graphs.kernels.add_norm import add_rms_norm

            rewrites.patch(self, "_chained_forwards", chained_forwards(blocks, add_rms_norm))

    def _run_tower(self, pixels: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """The blocks chained for this call only (`chained_blocks`), where they chain."""
        if self._chained_forwards is None:
            return super()._run_tower(pixels, kwargs)
        with chained(self.visual.blocks, self._chained_forwards):
            return super()._run_tower(pixels, kwargs)

    @property
    def fuses_windows(self) -> bool:
        """Whether the window blocks run `kernels/window.py`'s kernel: PyTorch's FA2 as the backend (the CUDA
        default; another backend asked for is kept everywhere), half precision, Triton, weights
        on the device (offloaded ones would not take the reordering), and windows and heads the
        kernel takes."""
        half = self.dtype in HALF_DTYPES
        if not (self.attn_backend == "torch" and half and triton_runs(self.device)):
            return False
        if any(param.device != self.device for param in self.visual.parameters()):
            return False
        from encoder_graphs.kernels.window import fits_window_kernel

        return fits_window_kernel(self.head_dim, self.window_rows)

    @property
    def head_dim(self) -> int:
        return self.visual.config.hidden_size // self.visual.config.num_heads

    def _window_attentions(self) -> list[torch.nn.Module]:
        full = set(self.visual.config.fullatt_block_indexes)
        return [block.attn for index, block in enumerate(self.visual.blocks) if index not in full]

    def _fuse_window(
        self, attention: torch.nn.Module, attend: Callable[..., torch.Tensor], rewrites: Rewrites
    ) -> None:
        """q and k dims interleaved by rotary pairs, the fused forward (through `attend`) on."""
        permute_qk(attention, interleave_pairs(self.head_dim), rewrites)
        rewrites.patch(attention, "forward", window_attention_forward(attention, attend))

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
        # The windows' bound, which the fused kernel and a captured graph take as given, checked
        # on the host where the offsets are built (cached with them: once per sizes and layout).
        rows = layout.rows if layout is not None else int(cu_window_seqlens[-1])
        check_segments(cu_window_seqlens, self.window_rows, rows)
        tensors["window_index"] = window_index
        tensors["cu_window_seqlens"] = cu_window_seqlens
