"""Scoring a chat's messages for the per-turn recall block, incrementally (issue 14).

A chat that goes on asks for a recall every turn, so that scoring must cost little more than
reading the new messages. Per chat this keeps what the previous turn already read: each
message's text key (length and string hash, as the term cache keys it) and term statistics,
and for every term the messages that hold it and how often (its postings: a turn reads only
the messages that hold a query term, not every message). The next turn checks
that its messages begin with exactly those (by key) and reads only the rest. It is a cache: a
worker that never saw the chat builds the same index from scratch, with the same scores.

Memory limits (per process): at most `DEFAULT_INDEX_TERMS` (250,000) (message, term) entries
over all indexes (a posting and its count each, ~31 bytes, so ~7.5 MiB at most), least
recently used chat out first; a chat over that alone is scored without being kept.
"""

from __future__ import annotations

import math
import threading
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain, repeat
from operator import add, mul, neg, sub, truediv

from ..caches import DEFAULT_INDEX_TERMS, register
from .conversation import Message, message_text
from .relevance import (
    DEFAULT_RELEVANCE_WEIGHTS,
    RECALL_CONTEXT_TERMS,
    RelevanceWeights,
    _bm25_idf,
    _fuse,
    _mixed,
    _query_weights,
    _term_cache,
    _TermStats,
)

__all__ = ["recall_scores", "indexed", "RECALL_CONTEXT_TERMS", "RECALL_QUERY_TERMS", "DEFAULT_INDEX_TERMS"]

RECALL_QUERY_TERMS = 16  # the recall reads at most this many query terms, those that weigh most


_consume: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend  # runs an iterator to its end, in C


@dataclass(slots=True)
class _ChatIndex:
    """What the recall read of one chat's messages, in order: text keys, term statistics, their
    total length, and for each term the messages that hold it (its postings, ascending) with
    how often each holds it."""

    fold: bool
    keys: list[tuple[int, int]] = field(default_factory=list)
    stats: list[_TermStats] = field(default_factory=list)
    postings: defaultdict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    counts: defaultdict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    length: int = 0
    entries: int = 0

    def extend(self, texts: Sequence[str], keys: Sequence[tuple[int, int]]) -> None:
        """Read the messages after those already indexed."""
        get = _term_cache.get
        fold = self.fold
        at, tf = self.postings.__getitem__, self.counts.__getitem__
        for k in range(len(self.keys), len(texts)):
            stats = get(texts[k], fold)
            _consume(map(list.append, map(at, stats.once), repeat(k)))
            _consume(map(list.append, map(tf, stats.once), repeat(1)))
            _consume(map(list.append, map(at, stats.more), repeat(k)))
            _consume(map(list.append, map(tf, stats.more), stats.more_tfs))
            self.stats.append(stats)
            self.length += stats.length
            self.entries += stats.distinct
        self.keys.extend(keys[len(self.keys) :])


class _IndexCache:
    """Chat indexes by the text keys of the messages they hold, least recently used out first."""

    def __init__(self, max_terms: int) -> None:
        self.max_terms = max_terms
        self._entries: OrderedDict[tuple[bool, int, int], _ChatIndex] = OrderedDict()
        self._terms = 0
        self._lock = threading.Lock()

    def take(self, keys: list[tuple[int, int]], fold: bool, seen: int) -> _ChatIndex:
        """The index of the chat whose first `seen` messages have these `keys` (taken out: the
        caller owns it until `give`), or a new, empty one."""
        for m, name in _names(keys, fold, seen):
            with self._lock:
                index = self._entries.pop(name, None)
                if index is not None:
                    self._terms -= index.entries
            if index is not None and index.keys == keys[:m]:
                return index
        return _ChatIndex(fold)

    def holds(self, keys: list[tuple[int, int]], fold: bool, seen: int) -> bool:
        """`take` would find an index (and leave it)."""
        for m, name in _names(keys, fold, seen):
            with self._lock:
                index = self._entries.get(name)
            if index is not None and index.keys == keys[:m]:
                return True
        return False

    def give(self, index: _ChatIndex) -> None:
        """Keep `index` for the chat's next turn, under the keys it holds now."""
        if index.entries > self.max_terms:
            return
        name = (index.fold, len(index.keys), hash(tuple(index.keys)))
        with self._lock:
            old = self._entries.pop(name, None)
            if old is not None:
                self._terms -= old.entries
            self._entries[name] = index
            self._terms += index.entries
            while self._terms > self.max_terms:
                self._terms -= self._entries.popitem(last=False)[1].entries

    def clear(self) -> None:
        """Forget every chat's index."""
        with self._lock:
            self._entries.clear()
            self._terms = 0


def _names(keys: list[tuple[int, int]], fold: bool, seen: int) -> Iterator[tuple[int, tuple[bool, int, int]]]:
    """Where an index of these messages may be kept: of them all (this list again, a second
    pass), or of the first `seen` (the last turn's)."""
    for m in dict.fromkeys((len(keys), seen)):
        if 0 < m <= len(keys):
            yield m, (fold, m, hash(tuple(keys[:m])))


_indexes = _IndexCache(DEFAULT_INDEX_TERMS)
register("recall_index._indexes", _indexes.clear)


def indexed(messages: Sequence[Message], *, seen: int, weights: RelevanceWeights = DEFAULT_RELEVANCE_WEIGHTS) -> bool:
    """This process keeps the index of these messages, or of their first `seen` (the chat's last
    turn here): `recall_scores` then reads only the messages after those.

    Example:
        >>> chat = [{"role": "user", "content": "I adopted a cat."}, {"role": "user", "content": "Its name?"}]
        >>> _ = recall_scores(chat, question=1)
        >>> indexed(chat + [{"role": "user", "content": "And its age?"}], seen=2), indexed(chat[:1], seen=1)
        (True, False)
    """
    return _indexes.holds(_text_keys(map(message_text, messages)), weights.fold_suffixes, seen)


def _text_keys(texts: Iterable[str]) -> list[tuple[int, int]]:
    """Each text's key: its length and string hash, as the term cache keys it."""
    texts = list(texts)
    return list(zip(map(len, texts), map(hash, texts), strict=True))


def recall_scores(
    messages: Sequence[Message],
    *,
    question: int,
    exclude: Sequence[int] = (),
    weights: RelevanceWeights = DEFAULT_RELEVANCE_WEIGHTS,
    seen: int = 0,
    texts: Sequence[str] | None = None,
    similarity: Sequence[float] | None = None,
    roles: Sequence[object] | None = None,
) -> list[float]:
    """`score_messages`, cheaply enough for every turn of a chat that goes on: a question of more
    than `RECALL_CONTEXT_TERMS` terms is its own query (as with `context_weight` 0), and only its
    `RECALL_QUERY_TERMS` weightiest (rarest) terms are read. Up to that, the same scores (sums
    may differ in the last bit). `seen`: how many leading messages the previous turn of this
    chat read (its decision's `seen`): those are not read again when this process kept them.
    `texts`, `roles`: each message's `message_text` and `role`, when the caller has them
    (`ChatView`). `similarity`: one cosine
    per message to the question (see `semantic.similarities`), fused into the base signal as
    `score_messages` fuses it.

    Example:
        >>> chat = [{"role": "user", "content": "I adopted a cat named Miso."},
        ...         {"role": "assistant", "content": "Lovely!"},
        ...         {"role": "user", "content": "The weather is bad."},
        ...         {"role": "user", "content": "What is my cat called?"}]
        >>> scores = recall_scores(chat, question=3)
        >>> max(range(3), key=scores.__getitem__)
        0
    """
    texts = list(map(message_text, messages)) if texts is None else texts
    keys = _text_keys(texts)
    index = _indexes.take(keys, weights.fold_suffixes, seen)
    index.extend(texts, keys)
    try:
        roles = [m.get("role") for m in messages] if roles is None else roles
        return _scores(index, roles, question, exclude, weights, similarity)
    finally:
        _indexes.give(index)


def _scores(
    index: _ChatIndex,
    roles: Sequence[object],
    question: int,
    exclude: Sequence[int],
    weights: RelevanceWeights,
    similarity: Sequence[float] | None = None,
) -> list[float]:
    """BM25 of the query's weightiest terms over the chat less `exclude` and the question, fused
    with `similarity` when given, mixed."""
    n = len(index.keys)
    stats, postings = index.stats, index.postings
    skip = set(exclude)
    skip.add(question)
    skip = {i for i in skip if 0 <= i < n}
    query = _recall_query(stats, question, weights)
    total = index.length - sum(stats[i].length for i in skip)
    average = total / n if n and total else 1.0
    k1, b = weights.k1, weights.b
    skipped = Counter(chain.from_iterable(chain(stats[i].once, stats[i].more) for i in skip))
    # How many messages hold each query term, and its idf: once per distinct (weight, count),
    # since a long question's hundreds of terms share a few (the counts made in C).
    asked = list(query)
    found = map(sub, map(len, map(postings.get, asked, repeat(()))), map(skipped.__getitem__, asked))
    pairs = list(zip(query.values(), found, strict=True))
    weighs = {(w, f): _bm25_idf(n, f, w) for w, f in set(pairs) if f}
    idf = {term: weighs[pair] for term, pair in zip(asked, pairs, strict=True) if pair[1]}
    # The RECALL_QUERY_TERMS terms that weigh most (the rarest): a long question's common words
    # add little to what is recalled, and each term read costs a pass over its postings.
    terms = [term for _, term in sorted(zip(map(neg, idf.values()), idf, strict=True))[:RECALL_QUERY_TERMS]]
    # Term by term over the messages that hold it, each message's parts then summed, all in C:
    # `math.fsum` is exact, so a message's sum is the same whichever terms it lacks.
    k1_plus = k1 + 1.0
    # Each message's length norm, for the messages that hold a term read (most hold none).
    norms = {i: k1 * (1.0 - b + b * stats[i].length / average) for i in set().union(*map(postings.__getitem__, terms))}
    parts: defaultdict[int, list[float]] = defaultdict(list)
    for term in terms:
        at, tfs = postings[term], index.counts[term]
        scaled = map(mul, tfs, repeat(idf[term] * k1_plus))
        _consume(
            map(
                list.append, map(parts.__getitem__, at), map(truediv, scaled, map(add, tfs, map(norms.__getitem__, at)))
            )
        )
    base = [0.0] * n
    for i, total_part in zip(parts, map(math.fsum, parts.values()), strict=True):
        base[i] = total_part
    for i in skip:
        base[i] = 0.0
    if similarity is not None and len(similarity) == n:
        base = _fuse(base, similarity, skip, weights.semantic_share)
    return _mixed(base, stats, roles, skip, weights)


def _recall_query(stats: Sequence[_TermStats], question: int, weights: RelevanceWeights) -> dict[str, float]:
    """`_query_weights` for a short follow-up (at most `RECALL_CONTEXT_TERMS` terms); else the
    question's own terms only (the turns before it would weigh at most 1/20 of them)."""
    if stats[question].distinct <= RECALL_CONTEXT_TERMS:
        return _query_weights(stats, question, weights)
    return dict.fromkeys(stats[question].once + stats[question].more, 1.0)
