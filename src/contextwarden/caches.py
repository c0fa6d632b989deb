"""Helpers for the process-wide caches (bounded LRUs shared by every chat of a worker).

The caches themselves live beside what they remember (counts in `tokens.py`, fingerprints in
`selection.py`, terms in `relevance.py`, vectors in `semantic.py`); each is bounded, and what
one holds is listed in bench/README.md. Open WebUI re-executes this module when the filter's
source changes: the caches then start empty, which costs time, never correctness.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

__all__ = ["lru_hit"]

_K = TypeVar("_K")
_V = TypeVar("_V")


def lru_hit(cache: OrderedDict[_K, _V], key: _K) -> _V | None:
    """`cache[key]` marked as just used, or None; safe while other threads evict (no lock).

    Example:
        >>> cache = OrderedDict(a=1, b=2)
        >>> lru_hit(cache, "a"), list(cache), lru_hit(cache, "c")
        (1, ['b', 'a'], None)
    """
    value = cache.get(key)
    if value is not None:
        try:
            cache.move_to_end(key)
        except KeyError:  # evicted by another thread in between
            pass
    return value
