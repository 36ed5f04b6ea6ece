from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from encoder_graphs.packing.budgets import smallest_fitting_budget
from encoder_graphs.packing.reasons import EagerReason


class PackItem(Protocol):
    """What the packer reads from an item (`EncoderItemSpec` has these)."""

    frames: int
    path_tokens: Mapping[str, int]


@dataclass
class SubBatch:
    """Items that run together. `budget[path]`: the graph to replay, None = eager, 0 = path absent."""

    indices: list[int]
    tokens: dict[str, int]
    budget: dict[str, int | None]
    frames: int = 0
    eager_reasons: dict[str, EagerReason] = field(default_factory=dict)

    def padded_tokens(self, path: str) -> int:
        return self.budget[path] or self.tokens[path]


def greedy_pack(
    specs: Sequence[PackItem],
    budgets: Mapping[str, Sequence[int]],
    max_items: int,
    max_frames: int | None = None,
) -> list[SubBatch]:
    """Pack items, smallest first, into sub-batches that each fit one budget per path.

    A sub-batch closes when the next item would overflow the largest budget of some path, the
    item cap or the frame cap. An item larger than the largest budget of a path runs eagerly on
    that path, in a sub-batch of items that overflow the same paths, packed as the others on the
    paths where they fit: a page too large for the local tiles' graphs still replays its global
    view. An item of more frames than `max_frames` runs eagerly on every path (the frame cap is a
    sub-batch's), grouped up to `max_items`. A path with no budgets never constrains packing and
    always runs eagerly.
    """
    if max_items <= 0:
        raise ValueError(f"max_items must be positive, got {max_items}")
    paths = list(budgets)
    budgets = {path: sorted(budgets[path]) for path in paths}
    limits = {path: budgets[path][-1] for path in paths if budgets[path]}
    frame_limit = max_frames if max_frames is not None else float("inf")

    def overflows(index: int) -> tuple[bool, frozenset[str]]:
        """Whether `index`'s frames overflow the cap, and the paths its tokens overflow alone."""
        spec = specs[index]
        paths_over = frozenset(path for path, limit in limits.items() if spec.path_tokens.get(path, 0) > limit)
        return spec.frames > frame_limit, paths_over

    order = sorted(range(len(specs)), key=lambda i: (sum(specs[i].path_tokens.values()), i))
    by_overflow: dict[tuple[bool, frozenset[str]], list[int]] = {}
    for index in order:
        by_overflow.setdefault(overflows(index), []).append(index)
    groups = []
    for (frames_over, paths_over), indices in sorted(by_overflow.items(), key=lambda e: (e[0][0], len(e[0][1]))):
        if frames_over:  # eager on every path: only the item cap groups them
            groups += _fill(indices, specs, {}, max_items, float("inf"))
            continue
        fitting = {path: limit for path, limit in limits.items() if path not in paths_over}
        groups += _fill(indices, specs, fitting, max_items, frame_limit)
    return [_sub_batch(group, specs, budgets, frame_limit) for group in groups]


def _fill(
    order: Sequence[int], specs: Sequence[PackItem], limits: Mapping[str, int], max_items: int, frame_limit: float
) -> list[list[int]]:
    """`order`'s items, in order, into groups that stay within `limits` tokens per path, the item
    cap and the frame cap (each item fits them alone)."""
    groups: list[list[int]] = []
    current: list[int] = []
    totals = dict.fromkeys(limits, 0)
    frames = 0
    for index in order:
        spec = specs[index]
        if current and (
            len(current) == max_items
            or frames + spec.frames > frame_limit
            or any(totals[path] + spec.path_tokens.get(path, 0) > limit for path, limit in limits.items())
        ):
            groups.append(current)
            current, totals, frames = [], dict.fromkeys(limits, 0), 0
        current.append(index)
        frames += spec.frames
        for path in limits:
            totals[path] += spec.path_tokens.get(path, 0)
    if current:
        groups.append(current)
    return groups


def _sub_batch(
    indices: list[int],
    specs: Sequence[PackItem],
    budgets: Mapping[str, Sequence[int]],
    frame_limit: float,
) -> SubBatch:
    frames = sum(specs[i].frames for i in indices)
    tokens = {path: sum(specs[i].path_tokens.get(path, 0) for i in indices) for path in budgets}
    chosen: dict[str, int | None] = {}
    reasons: dict[str, EagerReason] = {}
    for path, path_budgets in budgets.items():
        if tokens[path] == 0:
            chosen[path] = 0
        elif not path_budgets:
            chosen[path], reasons[path] = None, EagerReason.NONE_CAPTURED
        elif frames > frame_limit:
            chosen[path], reasons[path] = None, EagerReason.FRAMES_OVER_CAP
        else:
            chosen[path] = smallest_fitting_budget(path_budgets, tokens[path])
            if chosen[path] is None:
                reasons[path] = EagerReason.TOKENS_OVER_BUDGETS
    return SubBatch(indices, tokens, chosen, frames, reasons)


def merge_eager(batches: Sequence[SubBatch], max_items: int, max_tokens: Mapping[str, int]) -> list[SubBatch]:
    """`batches` with the ones that replay no graph (each path eager or absent) merged, in order,
    into as few sub-batches as `max_items` items and `max_tokens` tokens per path allow: one eager
    forward over many items costs less than several over few (fewer launches, fuller kernels, the
    host-side metadata once). Only sub-batches that run the same paths merge; the ones that replay
    come first, unchanged."""
    graphed = [batch for batch in batches if any(batch.budget.values())]
    merged: list[SubBatch] = []
    for batch in (batch for batch in batches if not any(batch.budget.values())):
        last = merged[-1] if merged else None
        if (
            last is not None
            and last.budget == batch.budget
            and len(last.indices) + len(batch.indices) <= max_items
            and all(last.tokens[path] + batch.tokens[path] <= max_tokens[path] for path in batch.tokens)
        ):
            merged[-1] = SubBatch(
                last.indices + batch.indices,
                {path: last.tokens[path] + batch.tokens[path] for path in batch.tokens},
                dict(batch.budget),
                last.frames + batch.frames,
                {**last.eager_reasons, **batch.eager_reasons},
            )
        else:
            merged.append(batch)
    return graphed + merged
