"""Graph or eager, per sub-batch, by cost measured at capture.

A graph replays its whole budget, padding included; the eager path runs only the real tokens but
pays every kernel launch. Small sub-batches are launch-bound (the graph wins by far); large ones
are GPU-bound, and there a sub-batch well below its budget runs faster eagerly (measured on mixed
images: benchmarks/HISTORY.md). So the manager times each budget both ways at capture, and a
sub-batch replays only where the replay is the cheaper.

Both timings run on the capture's inputs: an empty layout whose padding is one attention segment
of the whole budget. Real sub-batches attend within their images, so both ways cost them less
than timed; the comparison, same layout against same layout, is what the choice uses. It is
timed on another layout than the real one, so a replay is chosen only where it is estimated
`replay_margin` (5%) cheaper: mixed images estimated slightly cheaper as a replay ran faster
eagerly (measured: benchmarks/HISTORY.md). In a close call eager costs at most about that
margin, and a replay that is not clearly cheaper may be slower.

Each way is timed once; where eager comes within `retime_within` (50%) of the replay, the choice
could go either way, so both are timed once more and the faster of each kept (a stalled host
only ever adds). A single timing once put a large budget's eager forward above a smaller
budget's, so mixed images replayed there where eager ran them faster (benchmarks/HISTORY.md).
"""

from bisect import bisect_left
from dataclasses import dataclass, field


@dataclass
class BudgetCosts:
    """Milliseconds per budget of one path: its graph's replay, and the eager forward at its size;
    how much cheaper a replay must be estimated to be chosen; how close the two ways must come
    for a budget to be timed again."""

    replay_ms: dict[int, float] = field(default_factory=dict)
    eager_ms: dict[int, float] = field(default_factory=dict)
    replay_margin: float = 0.05
    retime_within: float = 0.5
    gpu_bound_growth: float = 0.8

    def __post_init__(self) -> None:
        for name in ("replay_margin", "retime_within", "gpu_bound_growth"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)}: a fraction in [0, 1)")

    def close_call(self, replay_ms: float, eager_ms: float) -> bool:
        """Whether one budget's two timings are close enough to be taken again."""
        return eager_ms < replay_ms * (1 + self.retime_within)

    def record(self, budget: int, replay_ms: float, eager_ms: float) -> None:
        if budget <= 0 or replay_ms < 0 or eager_ms < 0:
            raise ValueError(f"budget {budget}: replay {replay_ms} ms, eager {eager_ms} ms")
        self.replay_ms[budget] = replay_ms
        self.eager_ms[budget] = eager_ms

    def record_eager(self, budget: int, eager_ms: float) -> None:
        """An eager timing alone, at a budget not captured (yet): a point for `eager_estimate`."""
        if budget <= 0 or eager_ms < 0:
            raise ValueError(f"budget {budget}: eager {eager_ms} ms")
        self.eager_ms[budget] = eager_ms

    def eager_estimate(self, tokens: int) -> float:
        """The eager forward over `tokens`: linear between the measured budgets; below the smallest
        the smallest's (launch-bound there); above the largest, in proportion to it."""
        budgets = sorted(self.eager_ms)
        if not budgets:
            raise ValueError("no budget has been timed")
        if tokens <= budgets[0]:
            return self.eager_ms[budgets[0]]
        if tokens >= budgets[-1]:
            return self.eager_ms[budgets[-1]] * tokens / budgets[-1]
        high = bisect_left(budgets, tokens)
        low_budget, high_budget = budgets[high - 1], budgets[high]
        low_ms, high_ms = self.eager_ms[low_budget], self.eager_ms[high_budget]
        return low_ms + (high_ms - low_ms) * (tokens - low_budget) / (high_budget - low_budget)

    def gpu_bound(self, budget: int) -> bool:
        """Whether the eager forward is GPU-bound at `budget`: from the largest timed budget at
        most half of it, its time grew by at least `gpu_bound_growth` of the tokens' growth.
        Launch-bound, the time stays flat as tokens grow and a graph's replay saves the launches;
        GPU-bound, the kernels set the pace and a replay saves little. A doubling apart, noise of
        tens of percent (a stalled timing) cannot pass for the growth. Unknown: False."""
        below = [b for b in self.eager_ms if 2 * b <= budget]
        if budget not in self.eager_ms or not below:
            return False
        low = max(below)
        return self.eager_ms[budget] / self.eager_ms[low] - 1 >= self.gpu_bound_growth * (budget / low - 1)

    @staticmethod
    def gpu_bound_pair(budgets: list[int], budget: int) -> list[int]:
        """The budgets whose eager timings `gpu_bound(budget)` compares: `budget` and the largest
        of `budgets` at most half of it (if any)."""
        below = [b for b in budgets if 2 * b <= budget]
        return [budget] + below[-1:]

    def prefer_eager(self, tokens: int, budget: int) -> bool:
        """Whether `tokens` run eagerly rather than through the graph of `budget`: unless the
        replay is estimated `replay_margin` cheaper (unmeasured: always replay)."""
        if budget not in self.replay_ms:
            return False
        return self.eager_estimate(tokens) < self.replay_ms[budget] * (1 + self.replay_margin)
