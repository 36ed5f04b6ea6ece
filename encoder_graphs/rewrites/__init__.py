"""Every change made to a stock model, each with its inverse, on one stack: `undo` unwinds them
last first, so each inverse sees the model as its own change left it.

Two kinds of change: an attribute set on an instance over its class's (a forward, a width), and a
parameter given other data (padded, permuted, or a view of a fused or stacked weight). A
parameter stays the same `nn.Parameter` object throughout (its data is swapped, for data of the
same kind: an inference tensor only if it was one), so its `requires_grad`, its ties and an
optimizer made before all keep holding it; the undo gives it back its stock values in a tensor of
its own. While changed, the parameter's `state_dict()` entry is its stock value (a copy), so saving
writes a stock checkpoint, and `load_state_dict` into it refuses: the data it would load into is
not laid out as the stock weight.
"""

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any
from weakref import WeakKeyDictionary

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

StockView = Callable[[torch.Tensor], torch.Tensor]  # a changed parameter's data -> its value before
_MISSING = object()  # no instance attribute of that name before


def _unchanged(data: torch.Tensor) -> torch.Tensor:
    return data


@contextmanager
def _made_as(inference: bool) -> Iterator[None]:
    """Tensors made inside are inference tensors or ordinary ones (outside autograd either way),
    whatever mode the caller is in."""
    with torch.inference_mode(inference), torch.no_grad():
        yield


def made_like(tensor: torch.Tensor) -> AbstractContextManager[None]:
    """Tensors made inside are of `tensor`'s kind, as `replace_data` takes them: a parameter's
    data cannot change kind (an inference tensor's `Parameter` keeps no version counter)."""
    return _made_as(tensor.is_inference())


def _stock_copy(data: torch.Tensor, views: list[StockView], inference: bool) -> torch.Tensor:
    """`data` through `views` (last first), as a tensor of its own of that kind."""
    with _made_as(inference):
        for view in reversed(views):
            data = view(data)
        return data.clone(memory_format=torch.contiguous_format)


@dataclass
class _Changed:
    """A module's changed parameters, each with its stock views (first change first), and the
    hooks that show their stock values to `state_dict` and refuse `load_state_dict`."""

    views: dict[str, list[StockView]] = field(default_factory=dict)
    hooks: list[RemovableHandle] = field(default_factory=list)

    def stock(self, module: nn.Module, name: str) -> torch.Tensor:
        param = getattr(module, name)
        return _stock_copy(param.detach(), self.views[name], param.is_inference())


# Per module, not per stack: two stacks changing one parameter still compose in order.
_changed: "WeakKeyDictionary[nn.Module, _Changed]" = WeakKeyDictionary()


def _changes(module: nn.Module, prefix: str) -> _Changed:
    changed = _changed.get(module)
    if changed is None:  # a deep copy keeps the hooks (and the changed data), not this entry
        raise RuntimeError(
            f"{prefix or 'the module'}: copied while enable_cuda_graphs had changed its weights (padded, permuted, "
            "fused or stacked), so they may not be the stock ones; copy the model before enable or after disable()"
        )
    return changed


def _show_stock(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    changed = _changes(module, prefix)
    for name in changed.views:
        if prefix + name in state_dict:
            state_dict[prefix + name] = changed.stock(module, name)


def _refuse_loading(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    names = [prefix + name for name in _changes(module, prefix).views if prefix + name in state_dict]
    if names:
        raise RuntimeError(
            f"{', '.join(names)}: changed by enable_cuda_graphs (padded, permuted, fused or stacked); "
            "call disable() on its handle before loading weights"
        )


def patch_attribute(owner: Any, name: str, value: Any) -> Callable[[], None]:
    """Set `owner.name` to `value` on the instance; returns what undoes it, giving back an
    instance attribute set before (a hook's forward, such as accelerate's) or none."""
    before = owner.__dict__.get(name, _MISSING)
    setattr(owner, name, value)

    def undo() -> None:
        if before is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, before)

    return undo


class Rewrites:
    """An undo stack of changes to a model's modules."""

    def __init__(self) -> None:
        self._undos: list[Callable[[], None]] = []

    def push(self, undo: Callable[[], None]) -> None:
        """Run `undo` when the stack unwinds to here (a nested stack's `undo`, a resource's `close`)."""
        self._undos.append(undo)

    def patch(self, owner: Any, name: str, value: Any) -> None:
        """`owner.name = value` on the instance, until undone."""
        self.push(patch_attribute(owner, name, value))

    def keep(self, owner: Any, name: str) -> None:
        """`owner.name` given back as it is now when undone (what a call about to set it sets)."""
        self.patch(owner, name, getattr(owner, name))

    def replace_data(
        self, module: nn.Module, name: str, data: torch.Tensor, stock: StockView = _unchanged
    ) -> None:
        """Parameter `name` of `module` holds `data` (made `made_like` it) until undone;
        `stock(data)` is its value before, which `state_dict` returns meanwhile and the undo
        copies back (default: the same values, in another layout, such as a view of a fused
        weight)."""
        param = module._parameters[name]
        inference = param.is_inference()
        if data.is_inference() != inference:
            raise ValueError(f"{name}: new data must be of the parameter's kind (inference tensor: {inference})")
        changed = _changed.get(module)
        if changed is None:
            changed = _changed[module] = _Changed()
            changed.hooks = [
                module.register_state_dict_post_hook(_show_stock),
                module.register_load_state_dict_pre_hook(_refuse_loading),
            ]
        changed.views.setdefault(name, []).append(stock)
        param.data = data

        def undo() -> None:
            param.data = _stock_copy(param.detach(), [changed.views[name].pop()], inference)
            if not changed.views[name]:
                del changed.views[name]
            if not changed.views:
                for hook in changed.hooks:
                    hook.remove()
                del _changed[module]

        self.push(undo)

    def undo(self) -> None:
        """Undo every change, last first; each undo runs once. The first error raised is raised
        again after the rest ran."""
        error = None
        while self._undos:
            try:
                self._undos.pop()()
            except BaseException as raised:  # noqa: BLE001 (the rest must still run)
                error = error or raised
        if error is not None:
            raise error

    @contextmanager
    def undone_on_error(self) -> Iterator["Rewrites"]:
        """The block's changes, undone if it raises (the error goes on)."""
        try:
            yield self
        except BaseException:
            self.undo()
            raise
