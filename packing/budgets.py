from bisect import bisect_left
from collections.abc import Sequence


def generate_budgets(min_budget: int, max_budget: int, *, steps_per_doubling: int = 1) -> list[int]:
    """Budgets growing geometrically from `min_budget`, doubling every `steps_per_doubling`
    budgets (1: plain doubling); `max_budget` is always the last one.

    More steps cost more graphs (captured into one shared pool) and cut the worst padding waste
    from 50% (doubling) to 1 - 2**(-1/steps).
    """
    if min_budget <= 0:
        raise ValueError(f"min_budget must be positive, got {min_budget}")
    if max_budget < min_budget:
        raise ValueError(f"max_budget {max_budget} is below min_budget {min_budget}")
    if steps_per_doubling < 1:
        raise ValueError(f"steps_per_doubling must be >= 1, got {steps_per_doubling}")
    budgets = []
    step = 0
    while (budget := round(min_budget * 2 ** (step / steps_per_doubling))) < max_budget:
        if not budgets or budget > budgets[-1]:
            budgets.append(budget)
        step += 1
    budgets.append(max_budget)
    return budgets


def smallest_fitting_budget(budgets: Sequence[int], tokens: int) -> int | None:
    """The smallest budget >= tokens, or None when every budget is too small.

    `budgets` must be sorted ascending (as `generate_budgets` returns them).
    """
    position = bisect_left(budgets, tokens)
    return budgets[position] if position < len(budgets) else None
