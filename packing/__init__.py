"""Token budgets and greedy bin-packing of encoder items. Pure Python: no torch here."""

from encoder_graphs.packing.budgets import generate_budgets, smallest_fitting_budget
from encoder_graphs.packing.cost import BudgetCosts
from encoder_graphs.packing.greedy import PackItem, SubBatch, greedy_pack, merge_eager
from encoder_graphs.packing.reasons import EagerReason

__all__ = [
    "BudgetCosts",
    "EagerReason",
    "PackItem",
    "SubBatch",
    "generate_budgets",
    "greedy_pack",
    "merge_eager",
    "smallest_fitting_budget",
]
