"""Per model: does the provider's prompt cache serve anything at all? Learned from what a turn's
stream reported (`OpenTurn.reported`), never from the outlet's usage: that is the client's to
write, and these stats price every user's savings.

Each turn whose first provider call's prompt reached the model's minimum cacheable size counts
as one prompt, and as one hit when the backend reported cached tokens. Savings price the
untrimmed chat as cached only for a model that caches. Bounded: both counts are halved past
`CACHE_STATS_WINDOW` prompts (so old evidence fades), and the store key expires after
`CACHE_STATS_TTL_SECONDS` without a reply.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from urllib.parse import quote

from ..state.store import Store

__all__ = ["CacheStats", "update_cache_stats", "load_cache_stats", "save_cache_stats"]

CACHE_STATS_KEY_PREFIX = "cachestats:"
CACHE_STATS_TTL_SECONDS = 30 * 86_400
CACHE_STATS_WINDOW = 200  # prompts remembered (then both counts are halved)
CACHE_EVIDENCE = 3  # prompts over the minimum, none served from cache: the model does not cache
CACHE_HIT_SHARE = 0.1  # below this share of hits the cache is taken as not working


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Replies with a prompt at least the minimum cacheable size (`prompts`) and, of those, how
    many reported cached tokens (`hits`)."""

    prompts: int = 0
    hits: int = 0

    def caches(self) -> bool | None:
        """True: the cache serves this model; False: it did not on enough prompts; None: not known yet.

        Example:
            >>> CacheStats(4, 3).caches(), CacheStats(3, 0).caches(), CacheStats(1, 0).caches()
            (True, False, None)
        """
        if self.hits and self.hits >= CACHE_HIT_SHARE * self.prompts:
            return True
        return False if self.prompts >= CACHE_EVIDENCE else None


def update_cache_stats(
    stats: CacheStats, prompt_tokens: int | None, cached_tokens: int | None, minimum: int
) -> CacheStats | None:
    """The stats after one reply, or None when it says nothing (prompt unknown or below the minimum).

    Unreported cached tokens count as none: a backend that never reports them is not caching
    for us (its savings are priced uncached).

    Example:
        >>> update_cache_stats(CacheStats(), 2_000, 1_536, 1_024)
        CacheStats(prompts=1, hits=1)
    """
    if not isinstance(prompt_tokens, int) or prompt_tokens < minimum:
        return None
    prompts, hits = stats.prompts + 1, stats.hits + int(bool(cached_tokens and cached_tokens > 0))
    if prompts > CACHE_STATS_WINDOW:
        prompts, hits = prompts // 2, hits // 2
    return CacheStats(prompts, min(hits, prompts))


def _cache_stats_key(model: str) -> str:
    return CACHE_STATS_KEY_PREFIX + quote(model or "-", safe="")


async def load_cache_stats(store: Store, model: str) -> CacheStats:
    """The stored stats of a model (empty when none or unreadable)."""
    raw = await store.get(_cache_stats_key(model))
    try:
        data = json.loads(raw) if raw else {}
        prompts, hits = int(data["prompts"]), int(data["hits"])
    except (ValueError, TypeError, KeyError):
        return CacheStats()
    if not 0 <= hits <= prompts <= CACHE_STATS_WINDOW:
        return CacheStats()
    return CacheStats(prompts, hits)


async def save_cache_stats(store: Store, model: str, stats: CacheStats) -> None:
    """Store a model's stats (last writer wins: racing workers lose a sample at most)."""
    payload = json.dumps({"prompts": stats.prompts, "hits": stats.hits})
    await store.set(_cache_stats_key(model), payload.encode(), ttl=CACHE_STATS_TTL_SECONDS)
