import heapq
from collections.abc import Sequence


def load_balance(sizes: Sequence[int], num_ranks: int) -> list[list[int]]:
    """Longest-processing-time assignment: largest item first onto the least-loaded rank.

    Returns, per rank, the indices into `sizes` it takes, ascending. Ties go to the lower rank.
    """
    if num_ranks <= 0:
        raise ValueError(f"num_ranks must be positive, got {num_ranks}")
    loads = [(0, rank) for rank in range(num_ranks)]
    assignment: list[list[int]] = [[] for _ in range(num_ranks)]
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, rank = heapq.heappop(loads)
        assignment[rank].append(index)
        heapq.heappush(loads, (load + sizes[index], rank))
    return [sorted(indices) for indices in assignment]
