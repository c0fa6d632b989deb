"""Every cache contextwarden keeps in memory, in one place: what each holds and its bound.

A cache lives beside what it computes (the module named on its line below) and takes its
bound from here, the one definition. The process-wide ones (module level: one each per
worker, shared by every chat) register how to empty them, so `clear_all()` empties them all
(tests, benchmarks: a cold process without starting one) and `registered()` names them; the
per-instance ones start empty with their Filter or TokenCounter. What a full one weighs is
listed in bench/README.md. Open WebUI re-executes this module when the filter's source
changes: the caches then start empty, which costs time, never correctness. Not caches, so
not here: the in-process store (`store.DEFAULT_MEMORY_KEYS`, chat state) and the summary
endpoints' back-off (`summarize`), which change what a turn does when emptied.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["lru_hit", "WeighedLRU", "TextCache", "register", "registered", "clear_all"]

# Process-wide, least recently used out first unless said otherwise.
ENCODING_MEMO_SIZE = 1_024  # tokens._encoding_for_model_id: a model id's encoding name
UNIT_MEMO_SIZE = 4_096  # conversation._unit: the Unit value for (start, stop, kind)
CODE_MEMO_SIZE = 4_096  # flags._outside_code_memo: a text's flag positions outside code (emptied whole when full)
DEFAULT_VECTOR_CACHE_SIZE = 8_192  # semantic.VECTORS: a text's unit vector (float32), by embedder, at most this many
# semantic.VECTORS: and this many bytes in all, as `semantic._vector_bytes` weighs them: 8,192 vectors at
# 384 dimensions (MiniLM, ~1.8 KiB each) fit, as before; at 1,536 dimensions ~2,600 do, at 3,072 ~1,300.
DEFAULT_VECTOR_CACHE_BYTES = 16 * 2**20
MAX_EMBEDDERS = 8  # semantic.VECTORS key spaces and embedder._adapters: one per embedding function
DEFAULT_TERM_CACHE_SIZE = 20_000  # relevance._term_cache: a text's term statistics, at most this many texts
DEFAULT_TERM_CACHE_TERMS = 1_000_000  # relevance._term_cache: and this many (text, term) entries in all
TERM_MEMO_SIZE = 16_384  # relevance._word_memos: a word's term, per memo (folded, plain; replaced whole when full)
TERM_MEMO_CHARS = 40  # relevance._word_memos: longer words are not kept (nor numbers of more than three digits)
DEFAULT_INDEX_TERMS = 250_000  # recall_index._indexes: per chat, each term's postings; (message, term) entries
FREQUENCY_CACHE_SIZE = (
    8  # relevance._frequency_cache: per chat, how many messages hold each term (a new selection's BM25)
)
FREQUENCY_CACHE_TERMS = 50_000  # relevance._frequency_cache: and this many (chat, term) counts in all (~5 MiB)
DEFAULT_FINGERPRINT_CACHE_SIZE = 20_000  # decision._fingerprint_cache: a message's fingerprint, by its stand-in key
QUESTION_MEMO_SIZE = 16  # excerpt._question_words: a question's words and their search terms
CHUNK_CACHE_SIZE = 16  # excerpt._passage_pieces: a long text's embedder pieces
# excerpt._cached_chunk_index: a long text's chunks indexed, for at most this many texts and ...
CHUNK_INDEX_TEXTS = 256
CHUNK_INDEX_CHARS = 1_600_000  # ... this many characters in all (~10 bytes a character with their terms: 16 MiB)
POINTED_MEMO_SIZE = 8  # excerpt._cached_scored: a long message's chunk scores for one question (a float a chunk)
CHUNK_CACHE_MAX_CHARS = 100_000  # excerpt._cached_chunk_index: longer texts are cut anew each time
VALVE_RANGE_MEMO_SIZE = 64  # valves.valve_range: a numeric valve's Field bounds, by valve name
GLOB_MEMO_SIZE = 16  # pricing._glob_matchers: a model-name valve's globs compiled once, by its patterns

# Per instance (the Filter's own, so one per loaded function; `clear_all` leaves them).
DEFAULT_COUNT_CACHE_SIZE = 50_000  # tokens.TokenCounter: a text's token count, by encoding (trim's default registers)
SETTINGS_MEMO_SIZE = 1_024  # filter.Filter: the Settings parsed from (admin valves, user valves) (emptied when full)
MAX_REMEMBERED_USERS = 10_000  # usergroups.GroupReader: a user's groups, expiring (emptied when full)

_K = TypeVar("_K")
_V = TypeVar("_V")
_clears: dict[str, Callable[[], object]] = {}


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


class WeighedLRU(Generic[_K, _V]):
    """Values by key, least recently used out first, at most `max_entries` of them and
    `max_weight` in all as `weigh(key, value)` counts: a bound by size, so many small entries
    fit where a few large ones would (a count alone must allow for the largest). Read with
    `lru_hit(cache._entries, key)`; `put` under a lock, as threads share it.

    Example:
        >>> sizes = WeighedLRU(max_entries=8, max_weight=5, weigh=lambda key, value: value)
        >>> sizes.put("a", 3), sizes.put("b", 2), sizes.put("c", 3)
        (3, 2, 3)
        >>> list(sizes._entries), sizes.weight
        (['b', 'c'], 5)
    """

    def __init__(self, *, max_entries: int, max_weight: int, weigh: Callable[[_K, _V], int]) -> None:
        self.max_entries, self.max_weight, self.weigh = max_entries, max_weight, weigh
        self._entries: OrderedDict[_K, _V] = OrderedDict()
        self.weight = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: _K, value: _V) -> _V:
        """Keep `value` under `key` (unless another thread kept one first) and return it."""
        with self._lock:
            entries = self._entries
            if key not in entries:
                entries[key] = value
                self.weight += self.weigh(key, value)
                while entries and (len(entries) > self.max_entries or self.weight > self.max_weight):
                    self.weight -= self.weigh(*entries.popitem(last=False))
        return value

    def clear(self) -> None:
        """Forget every entry."""
        with self._lock:
            self._entries.clear()
            self.weight = 0


def _text_length(text: str, value: object) -> int:
    return len(text)


class TextCache(WeighedLRU[str, _V]):
    """`function(text)` for the texts most recently asked, at most `max_texts` of them and
    `max_chars` characters in all (`WeighedLRU`). The function must be pure: a value is the
    same whenever it is made.

    Example:
        >>> lengths = TextCache(len, max_texts=8, max_chars=5)
        >>> lengths("abc"), lengths("de"), len(lengths), lengths("fgh"), len(lengths), lengths.chars
        (3, 2, 2, 3, 2, 5)
    """

    def __init__(self, function: Callable[[str], _V], *, max_texts: int, max_chars: int) -> None:
        super().__init__(max_entries=max_texts, max_weight=max_chars, weigh=_text_length)
        self.function = function

    @property
    def chars(self) -> int:
        """The characters of the texts kept."""
        return self.weight

    def __call__(self, text: str) -> _V:
        value = lru_hit(self._entries, text)
        return self.put(text, self.function(text)) if value is None else value

    def cache_clear(self) -> None:
        """Forget every text."""
        self.clear()


def register(name: str, clear: Callable[[], object]) -> None:
    """Let `clear_all` empty the process-wide cache `name` ("module.attribute") by calling `clear`;
    each module registers its caches where it makes them."""
    _clears[name] = clear


def registered() -> tuple[str, ...]:
    """The names of the process-wide caches `clear_all` empties, sorted."""
    return tuple(sorted(_clears))


def clear_all() -> None:
    """Empty every registered process-wide cache, as in a worker that has just started.

    Example:
        >>> memo = {"a": 1}
        >>> register("example.memo", memo.clear)
        >>> clear_all(), memo, "example.memo" in registered()
        (None, {}, True)
        >>> del _clears["example.memo"]
    """
    for clear in list(_clears.values()):
        clear()
