from bisect import bisect_left
from collections.abc import Sequence


def generate_budgets(min_budget: int, max_budget: int) -> list[int]:
    """Budgets doubling from `min_budget`; `max_budget` is always the last one."""
    if min_budget <= 0:
        raise ValueError(f"min_budget must be positive, got {min_budget}")
    if max_budget < min_budget:
        raise ValueError(f"max_budget {max_budget} is below min_budget {min_budget}")
    budgets = []
    budget = min_budget
    while budget < max_budget:
        budgets.append(budget)
        budget *= 2
    budgets.append(max_budget)
    return budgets


def smallest_fitting_budget(budgets: Sequence[int], tokens: int) -> int | None:
    """The smallest budget >= tokens, or None when every budget is too small.

    `budgets` must be sorted ascending (as `generate_budgets` returns them).
    """
    position = bisect_left(budgets, tokens)
    return budgets[position] if position < len(budgets) else None
