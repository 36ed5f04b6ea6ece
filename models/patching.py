"""Instance attributes set over a module's own, and given back."""

from collections.abc import Callable
from typing import Any

_MISSING = object()  # no instance attribute of that name before


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
