"""The buffers a path's graphs share: per path and key, the largest budget's buffer, of which
every graph reads or writes a prefix (the largest budget is captured, or run, first and sizes
it). Replay refills every input row a graph reads, so no stale or NaN row reaches a real token."""

from dataclasses import dataclass

import torch

from encoder_graphs.protocols import CaptureInputs, ReplayBuffers


@dataclass
class BudgetGraph:
    """One captured graph and prefix views of the shared buffers it reads and writes."""

    budget: int
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]


def fill_buffers(buffers: dict[str, torch.Tensor], replay: ReplayBuffers, where: str) -> None:
    """Refill every captured input buffer: copy the replay value into its head, zero its tail."""
    extra = set(replay.values) - set(buffers)
    if extra:
        raise KeyError(f"replay buffers for {where} name keys the graph lacks: {sorted(extra)}")
    for key, buffer in buffers.items():
        if key not in replay.values:
            raise KeyError(f"replay buffers for {where} lack key {key!r}")
        value = replay.values[key]
        rows = value.shape[0]
        if rows > buffer.shape[0] or value.shape[1:] != buffer.shape[1:]:
            raise ValueError(
                f"replay value {key!r} for {where} has shape {tuple(value.shape)}; "
                f"the captured buffer holds {tuple(buffer.shape)}"
            )
        buffer[:rows].copy_(value, non_blocking=True)
        buffer[rows:].zero_()


class SharedBuffers:
    """Every path's shared input and output buffers."""

    def __init__(self) -> None:
        self.inputs: dict[str, dict[str, torch.Tensor]] = {}
        self.outputs: dict[str, dict[str, torch.Tensor]] = {}

    def sized(self, path: str) -> bool:
        """Whether a whole forward has sized `path`'s input and output buffers."""
        return bool(self.inputs.get(path)) and bool(self.outputs.get(path))

    def drop(self, path: str) -> None:
        """Forget `path`'s buffers (a forward that sized them in part failed)."""
        self.inputs.pop(path, None)
        self.outputs.pop(path, None)

    def input_views(self, path: str, capture: CaptureInputs) -> dict[str, torch.Tensor]:
        """Prefix views holding the capture's values (the first capture of a path sizes them)."""
        largest = self.inputs.setdefault(path, {})
        views = {}
        for key, value in capture.values.items():
            if key not in largest:
                largest[key] = value.contiguous().clone()
            base = largest[key]
            if value.shape[1:] != base.shape[1:] or value.shape[0] > base.shape[0]:
                raise ValueError(
                    f"capture input {key!r} of path {path!r} has shape {tuple(value.shape)}, "
                    f"not a prefix of the largest budget's {tuple(base.shape)}"
                )
            views[key] = base[: value.shape[0]]
            views[key].copy_(value)
        return views

    def output_views(self, path: str, produced: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Prefix views of the shapes of `produced` (the first of a path sizes them)."""
        largest = self.outputs.setdefault(path, {})
        views = {}
        for key, value in produced.items():
            if key not in largest:
                largest[key] = torch.empty_like(value, memory_format=torch.contiguous_format)
            base = largest[key]
            if value.shape[1:] != base.shape[1:] or value.shape[0] > base.shape[0] or value.dtype != base.dtype:
                raise ValueError(
                    f"output {key!r} of path {path!r} has shape {tuple(value.shape)} ({value.dtype}), "
                    f"not a prefix of the buffer the largest budget sized, {tuple(base.shape)} ({base.dtype})"
                )
            views[key] = base[: value.shape[0]]
        return views

    def poison(self) -> None:
        """Fill every buffer with NaN (integers with 2**30): a test hook."""
        with torch.inference_mode():  # the buffers are inference tensors
            for buffers in (*self.inputs.values(), *self.outputs.values()):
                for tensor in buffers.values():
                    tensor.fill_(float("nan") if tensor.is_floating_point() else 2**30)

    def clear(self) -> None:
        self.inputs.clear()
        self.outputs.clear()
