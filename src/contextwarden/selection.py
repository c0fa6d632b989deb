"""Choosing which turns to keep under a budget.

Pure functions over costs: they know nothing of messages, only how much each candidate
costs, and return which candidates to keep.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["select_recent"]


def select_recent(costs: Sequence[int], budget: int) -> list[int]:
    """Indices of the newest candidates that fit in `budget`, in ascending order.

    Candidates are taken newest first and the walk stops at the first that does not fit, so
    what is kept is one unbroken stretch ending at the newest candidate.

    Example:
        >>> select_recent([50, 10, 20, 30], budget=55)
        [2, 3]
    """
    kept: list[int] = []
    left = budget
    for index in range(len(costs) - 1, -1, -1):
        if costs[index] > left:
            break
        left -= costs[index]
        kept.append(index)
    kept.reverse()
    return kept
