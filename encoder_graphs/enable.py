"""Plugin entry: route a stock transformers VLM's image and video encoding through encoder graphs.

The model instance's own `get_image_features` / `get_video_features` are replaced by versions that
call `EncoderCudaGraphManager.execute` and rebuild exactly the output transformers returns, so its
`forward` and `generate` use the graphs unchanged. `disable()` puts the originals back.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPooling

from encoder_graphs.manager import EncoderCudaGraphManager
from encoder_graphs.models import QwenVisionAdapter, Qwen3VLAdapter, VisionBatch, adapter_for

_FEATURE_METHODS = ("get_image_features", "get_video_features")
# Requests for per-layer vision outputs that only the stock forward can answer.
_STOCK_ONLY_KWARGS = ("output_hidden_states", "output_attentions")
_MISSING = object()
# Sub-batch caps when the caller gives none. FlashAttention-2's varlen grid is (segments x
# max_seqlen / 128 x heads) and a graph bakes the worst case of both, so a segment cap of
# hundreds (the manager's own default, largest // smallest budget) would launch millions of
# empty blocks per layer at large budgets.
DEFAULT_MAX_ITEMS = 32
DEFAULT_MAX_FRAMES = 64


class EncoderGraphsHandle:
    """What `enable_cuda_graphs` returns: the manager, the adapter, statistics and `disable()`."""

    def __init__(self, model: nn.Module, adapter: QwenVisionAdapter, manager: EncoderCudaGraphManager):
        self.model = model
        self.adapter = adapter
        self.manager = manager
        self._patched: list[tuple[nn.Module, str, Any]] = []

    def patch(self, owner: nn.Module, name: str, replacement: Callable) -> None:
        """Set `owner.name` on the instance, remembering what `disable()` must restore."""
        self._patched.append((owner, name, owner.__dict__.get(name, _MISSING)))
        setattr(owner, name, replacement)

    def stats(self) -> dict:
        return {"encoder": self.manager.stats()}

    def format_stats(self) -> str:
        return "encoder graphs\n" + self.manager.format_stats()

    @property
    def enabled(self) -> bool:
        return bool(self._patched)

    def disable(self) -> None:
        """Restore every patched attribute and free the graphs."""
        for owner, name, original in reversed(self._patched):
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._patched.clear()
        self.manager.close()
        if getattr(self.model, "_encoder_graphs", None) is self:
            del self.model._encoder_graphs


def enable_cuda_graphs(
    model: nn.Module,
    *,
    budgets: Sequence[int] | Mapping[str, Sequence[int]] | None = None,
    max_items: int | None = None,
    max_frames: int | None = None,
    attn_backend: str | None = None,
    enabled: bool = True,
    poison_pool_bytes: int = 0,
    log_interval_s: float = 60.0,
) -> EncoderGraphsHandle:
    """Capture `model`'s vision encoder at token budgets and route its image/video features
    through the graphs. Raises ValueError for an unsupported architecture."""
    if getattr(model, "_encoder_graphs", None) is not None:
        raise RuntimeError("encoder graphs are already enabled on this model; disable() them first")
    adapter = adapter_for(model, attn_backend=attn_backend)
    manager = EncoderCudaGraphManager(
        adapter,
        budgets=budgets,
        max_items=max_items or DEFAULT_MAX_ITEMS,
        max_frames=max_frames or DEFAULT_MAX_FRAMES,
        enabled=enabled,
        log_interval_s=log_interval_s,
        poison_pool_bytes=poison_pool_bytes,
    )
    manager.capture()
    handle = EncoderGraphsHandle(model, adapter, manager)
    for owner in (model, getattr(model, "model", None)):
        if owner is None:
            continue
        for name in _FEATURE_METHODS:
            original = getattr(owner, name, None)
            if callable(original):
                handle.patch(owner, name, _graphed_features(handle, name, original))
    model._encoder_graphs = handle
    return handle


def _graphed_features(handle: EncoderGraphsHandle, name: str, original: Callable) -> Callable:
    video = name == "get_video_features"

    def features(pixel_values: torch.Tensor, grid_thw: torch.Tensor | None = None, **kwargs):
        if any(kwargs.get(key) for key in _STOCK_ONLY_KWARGS):
            return original(pixel_values, grid_thw, **kwargs)
        if video:
            batch = VisionBatch(pixel_values_videos=pixel_values, video_grid_thw=grid_thw)
        else:
            batch = VisionBatch(pixel_values=pixel_values, image_grid_thw=grid_thw)
        output = _stock_output(handle.adapter, handle.manager.execute(batch))
        return output if kwargs.get("return_dict", True) else output.to_tuple()

    features.__name__ = name
    features.__doc__ = f"{name} through encoder CUDA graphs (encoder_graphs.enable_cuda_graphs)."
    return features


def _stock_output(adapter: QwenVisionAdapter, items: list[torch.Tensor]) -> BaseModelOutputWithPooling:
    """The output object transformers' get_*_features returns, with `pooler_output` one tensor per
    item. `last_hidden_state` (the unmerged patch states) is not kept by the graphs: None."""
    if not isinstance(adapter, Qwen3VLAdapter):
        return BaseModelOutputWithPooling(pooler_output=tuple(items))
    from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

    main, *deepstack = adapter.split_deepstack(torch.cat(items))
    sizes = [item.shape[0] for item in items]
    return BaseModelOutputWithDeepstackFeatures(
        pooler_output=tuple(torch.split(main, sizes)),
        deepstack_features=[level.contiguous() for level in deepstack],
    )
