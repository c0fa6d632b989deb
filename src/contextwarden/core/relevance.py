"""Scoring messages against the current question: how much each one is worth keeping.

BM25 over the chat's own messages (lower case, punctuation and stop words out, a light English
suffix folding, CJK as character bigrams), queried with the latest user message plus, when
it is short, the messages just before it at a lower weight (they carry the topic of a follow-up). On
top of that, signals measured in `bench/quality.py`: a reply inherits part of its question's
score, neighbours of a strong match share in it, short date-carrying messages (session
headers) share in what follows them, and newer messages get a small recency bonus.

Term statistics per message are cached by the text's length and string hash (as token counts
are), so a warm turn only tokenizes what is new; a turn then costs one pass over the cached
terms of its messages (document frequencies, then BM25 of the query terms each holds).

Memory limits (per process): the term cache holds at most `DEFAULT_TERM_CACHE_SIZE` (20,000)
messages and `DEFAULT_TERM_CACHE_TERMS` (1,000,000) (message, term) entries in all, least
recently used out first: about 9 bytes an entry plus ~400 bytes a message, so at most ~17 MiB
(measured: 15.5k short messages holding 1M entries retain 15 MiB). Terms are interned: a word
met in many messages is stored once. Two word -> term memos (folded, plain) hold at most
`TERM_MEMO_SIZE` (16,384) words of up to `TERM_MEMO_CHARS` (40) bytes each (numbers of more
than three digits are not kept; under 3 MiB each).
"""

from __future__ import annotations

import math
import re
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain, compress, repeat
from operator import add, attrgetter, is_, mul

from ..caches import (
    DEFAULT_TERM_CACHE_SIZE,
    DEFAULT_TERM_CACHE_TERMS,
    FREQUENCY_CACHE_SIZE,
    FREQUENCY_CACHE_TERMS,
    TERM_MEMO_CHARS,
    TERM_MEMO_SIZE,
    WeighedLRU,
    lru_hit,
    register,
)
from .conversation import Message, message_text
from .semantic import SEMANTIC_SHARE

__all__ = [
    "RelevanceWeights",
    "DEFAULT_RELEVANCE_WEIGHTS",
    "relevance_terms",
    "held_terms",
    "words_terms",
    "read_ahead",
    "score_messages",
    "wants_whole",
    "leans_on_latest",
    "DEFAULT_TERM_CACHE_SIZE",
    "DEFAULT_TERM_CACHE_TERMS",
]

RECALL_CONTEXT_TERMS = 4  # a question of at most this many terms also draws on the turns before it (both scorers)

# A question about a document as a whole (a summary, an overview, a comparison): no passage is
# more relevant than another, and it needs as much of the text as fits (`wants_whole`). Such a
# request is short: a longer message that says "summary" is about something else (bench/speed.py's
# made-up questions of ~1,700 characters said it in 96 of 200).
WHOLE_QUESTION_MAX_CHARS = 400
_WHOLE_QUESTION = re.compile(
    r"\b(?:summar(?:y|ies|i[sz]\w*)|overview|overall|gist|tl;?dr|outline|recap|"
    r"main (?:points?|ideas?|themes?|arguments?|findings?)|key (?:points?|takeaways?|ideas?|findings?)|"
    r"(?:whole|entire|full|complete) (?:document|text|article|paper|file|report|page|thing|piece)|"
    r"what(?:'s| is| was) (?:this|the|that) (?:document|text|article|paper|file|report|page) about|"
    r"compar(?:e|es|ing|ison)|contrast)\b",
    re.IGNORECASE,
)

# A follow-up leans on the exchange just before it ("and in French?", "shorten that", "why?"):
# a question of at most FOLLOW_UP_MAX_TERMS terms of its own, or one with a word pointing back,
# opening as a continuation or a thanks ("thanks, now add tests"), or asking to go on. Any other
# question stands on its own (`leans_on_latest`).
FOLLOW_UP_MAX_TERMS = 2
_POINTS_BACK = re.compile(
    r"\b(?:it|its|that|this|these|those|them|they|again|above|previous|same|more)\b"
    r"|^\W*(?:and|but|so|also|then|what about|how about|thanks|thank you|ok|okay|great|cool|nice|perfect)\b"
    r"|\b(?:go on|keep going|carry on|continue)\W*$",
    re.IGNORECASE,
)

# Han, Hiragana, Katakana, Hangul: scripts written without spaces between words.
_CJK_CHARS = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uac00-\ud7af"
_TERM_PIECES = re.compile(rf"[{_CJK_CHARS}]+|[^\W_{_CJK_CHARS}]+")
_DATE_LIKE = re.compile(
    r"\b(?:19|20)\d\d\b|\b\d{1,2}[/.-]\d{1,2}(?:[/.-]\d{2,4})?\b|\b(?:jan|feb|mar|apr|may|jun|jul|aug|sep|"
    r"sept|oct|nov|dec)[a-z]*\.?\s+\d{1,2}\b|\b\d{1,2}\s+(?:jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)[a-z]*\b|"
    r"\b(?:mon|tues|wednes|thurs|fri|satur|sun)day\b",
    re.IGNORECASE,
)
_STOP_WORDS = frozenset(
    """a about above after again all am an and any are as at be been before being below between both but by
    can could did do does doing down during each few for from further had has have having he her here hers
    herself him himself his how i if in into is it its itself just me more most my myself no nor not now of
    off on once only or other our ours out over own same she should so some such than that the their theirs
    them then there these they this those through to too under until up very was we were what when where
    which while who whom why will with would you your yours yourself yourselves s t d ll m re ve don didn
    doesn isn wasn weren hasn haven also get got ok okay yes yeah oh like really just""".split()
)
_SHORT_MESSAGE_CHARS = 160
# UTF-8 bytes to words in one pass: ASCII letters lower-cased, ASCII digits and every
# non-ASCII byte kept, every other ASCII byte a space.
_WORD_BYTES = bytes(
    b + 32 if 65 <= b <= 90 else b if 48 <= b <= 57 or 97 <= b <= 122 or b >= 128 else 32 for b in range(256)
)
_ASCII_SEPARATORS = re.compile(r"[\x00-\x2f\x3a-\x40\x5b-\x60\x7b-\x7f]+")
WORD_SLICE_CHARS = 4_096  # a longer word is lower-cased and cut into terms this many characters at a time


@dataclass(frozen=True, slots=True)
class RelevanceWeights:
    """How the signals are mixed; the defaults are what `bench/quality.py` measured best.

    `context_weight` weighs the `context_messages` messages before the question against the
    question itself (1.0), in full while they hold at most `context_span` distinct terms and in
    proportion beyond (a long message's many terms would outweigh a short question's own).
    `pair_share` is the share of a user message's score its reply inherits (and `pair_back`
    the share a question gets from its reply); `neighbour_share` the
    share of the best adjacent message's score; `header_share` the share of the best score in
    the `header_reach` messages after a short date-carrying message; `recency` a bonus rising
    linearly to this share of the top score for the newest message. `semantic_share` is the
    embedder's share of the base signal when similarities are given. `turn_share` is used
    by the selection (`selection.choose_indices`): each message of a turn also gets this share of
    the best message score in an adjacent turn, in full while the two turns average at most
    `turn_reach` tokens and in proportion beyond (a long turn carries its own context).
    """

    k1: float = 1.2
    b: float = 0.75
    context_messages: int = 2
    context_weight: float = 0.25
    context_span: int = 12
    pair_share: float = 0.3
    pair_back: float = 0.15
    neighbour_share: float = 0.25
    header_share: float = 0.3
    header_reach: int = 12
    recency: float = 0.01
    fold_suffixes: bool = True
    semantic_share: float = SEMANTIC_SHARE
    turn_share: float = 0.5
    turn_reach: int = 64


DEFAULT_RELEVANCE_WEIGHTS = RelevanceWeights()


def _fold_suffix(word: str) -> str:
    """A light English suffix folding, so that 'painted', 'paints' and 'painting' meet."""
    if len(word) <= 3 or not word.isascii() or not word.isalpha():
        return word
    if word.endswith("ies") and len(word) > 4:
        return word[:-3] + "y"
    if word.endswith("ing") and len(word) > 5:
        word = word[:-3]
    elif word.endswith("ed") and len(word) > 4:
        word = word[:-2]
    elif word.endswith("es") and (word[-3] in "sxz" or word.endswith(("ches", "shes"))):
        return word[:-2]
    elif word.endswith("s") and not word.endswith(("ss", "us", "is")):
        word = word[:-1]
    if len(word) > 3 and word[-1] == word[-2] and word[-1] not in "lsz":
        word = word[:-1]  # running -> run, stopped -> stop
    if len(word) > 3 and word.endswith("e"):
        word = word[:-1]  # bake / baking, sunrise / sunrises
    return word


def _word_term(piece: str, fold: bool) -> str:
    """The interned term of one lower-cased word (suffix folded when `fold`); "" when it is none."""
    if piece in _STOP_WORDS or (len(piece) == 1 and not piece.isdigit()):
        return ""
    return sys.intern(_fold_suffix(piece) if fold else piece)


def relevance_terms(text: str, *, fold: bool = True) -> list[str]:
    """The search terms of a text: lower-cased words and numbers without stop words; runs
    of CJK characters as overlapping character pairs. Each word (a run between ASCII
    punctuation, spaces and controls) is lower-cased on its own.

    Example:
        >>> relevance_terms("Caroline painted 2 sunrises in 2022! 日本語")
        ['carolin', 'paint', '2', 'sunris', '2022', '日本', '本語']
    """
    terms: list[str] = []
    for word in _ASCII_SEPARATORS.split(text):
        if word:
            terms += _word_pieces_terms(word, fold)
    return terms


def _word_pieces_terms(word: str, fold: bool) -> list[str]:
    """The terms of one word (no ASCII separator in it), lower-cased and cut `WORD_SLICE_CHARS`
    characters at a time: a megabyte of emoji or lone surrogates with no space in it is then
    many short C calls rather than one that holds the GIL (and the event loop) for 50-500 ms.
    A term across a cut counts as two; no real word is that long. (An ASCII word is one term,
    found in a fast scan.)"""
    if len(word) <= WORD_SLICE_CHARS or word.isascii():
        return _lowered_terms(word.lower(), fold)
    terms: list[str] = []
    for start in range(0, len(word), WORD_SLICE_CHARS):
        terms += _lowered_terms(word[start : start + WORD_SLICE_CHARS].lower(), fold)
    return terms


def _lowered_terms(lowered: str, fold: bool) -> list[str]:
    """`relevance_terms` of a word already lower-cased."""
    terms: list[str] = []
    for piece in _TERM_PIECES.findall(lowered):
        first = piece[0]
        if not first.isascii() and _is_cjk(first):
            if len(piece) == 1:
                terms.append(piece)
            else:
                terms.extend(piece[k : k + 2] for k in range(len(piece) - 1))
            continue
        term = _word_term(piece, fold)
        if term:
            terms.append(term)
    return terms


class _WordTerms(dict):
    """A word as `_term_counts` cuts it (UTF-8, ASCII letters lower-cased) -> its term ("" for a
    stop word), computed on first use.

    A word that yields several terms (CJK pairs, words joined by non-ASCII punctuation) maps
    to their tuple, also listed in `several`. Numbers of more than three digits are not kept
    (there is no end to them); when full, a fresh memo takes this one's place, so a call
    under way never sees its memo emptied.
    """

    def __init__(self, fold: bool) -> None:
        super().__init__()
        self.fold = fold
        self.several: set[tuple[str, ...]] = set()
        self.spaced: dict[str, tuple[str, ...]] = {}  # `words_terms`: a word as split() cuts it -> its terms

    def __missing__(self, word: bytes) -> str | tuple[str, ...]:
        terms = _word_terms(word, self.fold)
        value: str | tuple[str, ...] = (terms[0] if terms else "") if len(terms) <= 1 else tuple(terms)
        if type(value) is tuple:
            self.several.add(value)  # before anything else: the caller looks for it there
        if len(self) + len(self.several) >= TERM_MEMO_SIZE:
            _word_memos[self.fold] = _WordTerms(self.fold)
        elif len(word) <= TERM_MEMO_CHARS and not (len(word) > 3 and word.isdigit()):
            self[word] = value
        return value


_word_memos = {True: _WordTerms(True), False: _WordTerms(False)}


def _fresh_word_memos() -> None:
    """Both word memos replaced by empty ones, as when full (a call under way keeps its own)."""
    _word_memos.update({True: _WordTerms(True), False: _WordTerms(False)})


register("relevance._word_memos", _fresh_word_memos)


def _term_counts(text: str, fold: bool) -> tuple[dict[str, int], int]:
    """How often each (interned) term of `relevance_terms(text)` occurs, and their total,
    without a Python step per word: one byte translation of the UTF-8 text lower-cases ASCII
    letters and blanks every other ASCII byte that is not a digit; the words between are
    mapped to their terms and counted in C through the word memo (a word holding non-ASCII
    characters is lower-cased and cut into pieces by `_lowered_terms` on first use)."""
    memo = _word_memos[fold]
    words = text.encode("utf-8", "surrogatepass").translate(_WORD_BYTES).split()
    counts: dict = Counter(map(memo.__getitem__, words))
    if memo.several:
        for several in counts.keys() & memo.several:
            times = counts.pop(several)
            for term in several:
                counts[term] = counts.get(term, 0) + times
    counts.pop("", None)  # stop words and single letters
    return counts, sum(counts.values())


def words_terms(words: Iterable[str], *, fold: bool = True) -> dict[str, tuple[str, ...]]:
    """Each distinct word with its search terms (those of `relevance_terms(word)`, perhaps in
    another order), cut as `_term_counts` cuts a text: through the word memo, several times
    cheaper than a `relevance_terms` call a word; a word met before (up to `TERM_MEMO_SIZE` of
    them, kept with the word memo) is one lookup.

    Example:
        >>> words_terms(["Caroline's", "the", "sunrises"])
        {"Caroline's": ('carolin',), 'the': (), 'sunrises': ('sunris',)}
    """
    memo = _word_memos[fold]
    spaced = memo.spaced
    out: dict[str, tuple[str, ...]] = {}
    for word in words:
        if word in out:
            continue
        known = spaced.get(word)
        if known is None:
            terms: list[str] = []
            for piece in word.encode("utf-8", "surrogatepass").translate(_WORD_BYTES).split():
                term = memo[piece]
                if type(term) is tuple:
                    terms += term
                elif term:
                    terms.append(term)
            known = tuple(terms)
            if len(word) <= TERM_MEMO_CHARS and len(spaced) < TERM_MEMO_SIZE:
                spaced[word] = known
        out[word] = known
    return out


def _word_terms(word: bytes, fold: bool) -> list[str]:
    """The (interned) terms of one word cut from UTF-8 bytes (ASCII letters already lower-cased):
    at most one for an ASCII word, CJK pairs or several pieces for a word holding non-ASCII characters."""
    if word.isascii():
        term = _word_term(word.decode("ascii"), fold)
        return [term] if term else []
    return [sys.intern(term) for term in _word_pieces_terms(_decoded(word), fold)]


def _decoded(word: bytes) -> str:
    """UTF-8 bytes (lone surrogates allowed) as text, decoded a slice at a time: surrogatepass
    decodes ~6 MB/s, so one call over a megabyte would hold the GIL for half a second."""
    if len(word) <= 4 * WORD_SLICE_CHARS:
        return word.decode("utf-8", "surrogatepass")
    pieces: list[str] = []
    start = 0
    while start < len(word):
        end = min(start + 4 * WORD_SLICE_CHARS, len(word))
        while end < len(word) and word[end] & 0xC0 == 0x80:  # a character's first byte
            end += 1
        pieces.append(word[start:end].decode("utf-8", "surrogatepass"))
        start = end
    return "".join(pieces)


def _is_cjk(char: str) -> bool:
    code = ord(char)
    return (
        0x3040 <= code <= 0x30FF
        or 0x3400 <= code <= 0x4DBF
        or 0x4E00 <= code <= 0x9FFF
        or 0xF900 <= code <= 0xFAFF
        or 0xAC00 <= code <= 0xD7AF
    )


@dataclass(frozen=True, slots=True)
class _TermStats:
    """One text's distinct terms (interned): those it holds once, and the others with their
    counts; the total count; whether it is a short date-carrying message."""

    once: tuple[str, ...]
    more: tuple[str, ...]
    more_tfs: bytes | tuple[int, ...]  # bytes while every count is under 256 (9x smaller than a tuple)
    length: int
    short_date: bool

    @property
    def distinct(self) -> int:
        return len(self.once) + len(self.more)


def _term_stats(text: str, fold: bool) -> _TermStats:
    counts, length = _term_counts(text, fold)
    once = tuple([term for term, tf in counts.items() if tf == 1])
    more = {term: tf for term, tf in counts.items() if tf > 1}
    try:
        more_tfs: bytes | tuple[int, ...] = bytes(more.values())
    except ValueError:  # a count of 256 or more
        more_tfs = tuple(more.values())
    short_date = len(text) <= _SHORT_MESSAGE_CHARS and _DATE_LIKE.search(text) is not None
    return _TermStats(once, tuple(more), more_tfs, length, short_date)


def _distinct_terms(key: tuple[int, int, bool], stats: _TermStats) -> int:
    return stats.distinct


class _TermStatsCache(WeighedLRU[tuple[int, int, bool], _TermStats]):
    """Per-text term statistics, least recently used out first, bounded by messages and by terms.

    The key is the text's length and Python's string hash (see `TokenCounter._count`): about 5x
    cheaper than hashing the UTF-8 bytes with BLAKE2 on every turn.
    """

    def __init__(self, size: int, max_terms: int) -> None:
        super().__init__(max_entries=size, max_weight=max_terms, weigh=_distinct_terms)

    @property
    def _terms(self) -> int:
        """The (text, term) entries kept."""
        return self.weight

    def get(self, text: str, fold: bool) -> _TermStats:
        key = (len(text), hash(text), fold)
        stats = lru_hit(self._entries, key)
        return self.put(key, _term_stats(text, fold)) if stats is None else stats


_term_cache = _TermStatsCache(DEFAULT_TERM_CACHE_SIZE, DEFAULT_TERM_CACHE_TERMS)
register("relevance._term_cache", _term_cache.clear)


def read_ahead(text: str) -> None:
    """Cut `text` into its search terms now (the per-text cache keeps them), so that a later
    trim that meets it does not: Open WebUI's outlet reads a reply the next turn sends back."""
    _term_cache.get(text, DEFAULT_RELEVANCE_WEIGHTS.fold_suffixes)


def held_terms(text: str) -> frozenset[str]:
    """The distinct search terms of `text` (`relevance_terms`, folded), read from the per-text
    cache, so a text seen on an earlier turn is not cut into words again."""
    stats = _term_cache.get(text, True)
    return frozenset(stats.once).union(stats.more)


class _FrequencyCache:
    """Per chat, how many of its messages hold each term (BM25's document frequency), kept for
    the chat's next turn: its statistics list begins with the very same objects (the per-text
    cache hands out one per text) and only the messages after them are read. At most `size`
    chats and `max_terms` terms over them all, least recently used out first; a list whose
    start differs (an edited chat, statistics the term cache let go) is counted anew."""

    def __init__(self, size: int, max_terms: int) -> None:
        self.size = size
        self.max_terms = max_terms
        self._entries: list[tuple[list[_TermStats], Counter[str]]] = []
        self._lock = threading.Lock()

    def of(self, stats: Sequence[_TermStats]) -> Counter[str]:
        """How many of `stats` hold each term (shared: the caller must not change it)."""
        with self._lock:
            found = next((e for e in reversed(self._entries) if _begins(stats, e[0])), None)
            if found is not None:
                self._drop(found)
        held, counts = found if found is not None else ([], Counter[str]())
        if len(held) < len(stats):
            counts = counts.copy()  # a published count never changes (another thread may read it)
            counts.update(chain.from_iterable(chain(s.once, s.more) for s in stats[len(held) :]))
            held = list(stats)
        if len(counts) <= self.max_terms:
            with self._lock:
                self._entries.append((held, counts))
                total = sum(len(c) for _, c in self._entries)
                while len(self._entries) > self.size or total > self.max_terms:
                    total -= len(self._entries.pop(0)[1])
        return counts

    def _drop(self, entry: tuple[list[_TermStats], Counter[str]]) -> None:
        self._entries[:] = [e for e in self._entries if e is not entry]

    def clear(self) -> None:
        """Forget every chat's counts."""
        with self._lock:
            self._entries.clear()


def _begins(stats: Sequence[_TermStats], held: list[_TermStats]) -> bool:
    """`stats` begins with the objects `held`."""
    return len(held) <= len(stats) and all(map(is_, held, stats))


_frequency_cache = _FrequencyCache(FREQUENCY_CACHE_SIZE, FREQUENCY_CACHE_TERMS)
register("relevance._frequency_cache", _frequency_cache.clear)


def _query_weights(stats: Sequence[_TermStats], question: int, weights: RelevanceWeights) -> dict[str, float]:
    """Query terms with their weights: the question's at 1, for a short question the context's
    at `context_weight` (shared by its term count)."""
    query: dict[str, float] = {}
    # A short follow-up ("and tomorrow?") leans on the turns before it; a question with more
    # than RECALL_CONTEXT_TERMS terms of its own does not (their terms would only add noise),
    # and below that the context weight shrinks with the question's term count.
    distinct = stats[question].distinct
    context_weight = weights.context_weight / max(1, distinct) if distinct <= RECALL_CONTEXT_TERMS else 0.0
    start = max(0, question - weights.context_messages) if context_weight else question
    # A long message before the question (a person's several messages in one, an LLM's answer)
    # holds many terms: shared in full, they would outweigh the question's own few. REALTALK
    # (bench/knobs.py): the two messages before it, 24-130 terms, cost -0.03 to -0.045 of all
    # evidence kept at every budget; LoCoMo's (6-21 terms) about nothing either way.
    span = sum(stats[i].distinct for i in range(start, question))
    if span > weights.context_span:
        context_weight *= weights.context_span / span
    for index in range(start, question):
        query.update(dict.fromkeys(stats[index].once, context_weight))
        query.update(dict.fromkeys(stats[index].more, context_weight))
    query.update(dict.fromkeys(stats[question].once, 1.0))
    query.update(dict.fromkeys(stats[question].more, 1.0))
    return query


def _bm25(
    stats: Sequence[_TermStats], skip: set[int], query: dict[str, float], weights: RelevanceWeights
) -> list[float]:
    """Okapi BM25 of every message against the weighted query, over the chat (less `skip`) as corpus.

    Only query terms are weighed. Sums are `math.fsum`: exact whatever the order of the terms
    (which follows the text and the word memo), so every process computes the same scores.
    """
    n = len(stats)
    corpus = [(i, s) for i, s in enumerate(stats) if i not in skip]
    total = 0
    for _, s in corpus:
        total += s.length
    average = total / n if n and total else 1.0
    # The chat's counts (kept from its last turn), less those of the messages left out.
    held = _frequency_cache.of(stats).get
    skipped = Counter(chain.from_iterable(chain(s.once, s.more) for s in _left(stats, skip)))
    idf: dict[str, float] = {}
    for term, weight in query.items():
        found = held(term, 0) - skipped[term]
        if found:
            idf[term] = _bm25_idf(n, found, weight)
    idf_of = idf.get
    scores = [0.0] * n
    for index, s in corpus:
        scores[index] = _message_bm25(s, idf_of, average, weights)
    return scores


def _bm25_idf(n: int, found: int, weight: float = 1.0) -> float:
    """A query term's BM25 idf in a corpus of `n` texts, `found` of which hold it, times `weight`."""
    return weight * math.log(1.0 + (n - found + 0.5) / (found + 0.5))


def _message_bm25(
    s: _TermStats, idf_of: Callable[[str, float], float], average: float, weights: RelevanceWeights
) -> float:
    """One text's BM25 (statistics `s`) given each query term's idf (`idf_of(term, 0.0)`) and
    the corpus's average length. The sums are `math.fsum`: exact whatever the terms' order."""
    k1, b = weights.k1, weights.b
    k1_plus = k1 + 1.0
    zeros = repeat(0.0)
    norm = k1 * (1.0 - b + b * s.length / average)
    # Each term held once adds idf * (k1 + 1) / (1 + norm): one product for all of them.
    score = math.fsum(map(idf_of, s.once, zeros)) * k1_plus / (1.0 + norm)
    if s.more:
        # A term held tf times adds idf * tf (k1 + 1) / (tf + norm): the factor once per
        # distinct count, the products and their sum in C.
        factor = {tf: tf * k1_plus / (tf + norm) for tf in set(s.more_tfs)}
        score += math.fsum(map(mul, map(idf_of, s.more, zeros), map(factor.__getitem__, s.more_tfs)))
    return score


def _left(stats: Sequence[_TermStats], skip: set[int]) -> Iterator[_TermStats]:
    """The statistics at the `skip` indices (those within the list)."""
    return (stats[i] for i in skip if 0 <= i < len(stats))


def _fuse(lexical: Sequence[float], similarity: Sequence[float], skip: set[int], share: float) -> list[float]:
    """`1 - share` of BM25 relative to its best, plus `share` of the cosine relative to the
    chat's own: 0 at the median message, 1 at the best (below the median, 0). Embedders differ
    in their cosine of unrelated texts (about 0.1 for MiniLM, 0.7 for some API models), so
    only where a message stands within its chat says something. On BM25's scale, so that the
    later steps weigh as they do without an embedder."""
    scored = sorted(s for i, s in enumerate(similarity) if i not in skip)
    if not scored:
        return list(lexical)
    median, best = scored[len(scored) // 2], scored[-1]
    span = best - median
    top = max(lexical, default=0.0) or 1.0
    keep, lift = (1.0 - share) / top, share / span if span > 0 else 0.0
    return [
        top * (keep * bm25 + (lift * max(0.0, cosine - median) if i not in skip else 0.0))
        for i, (bm25, cosine) in enumerate(zip(lexical, similarity, strict=True))
    ]


def wants_whole(question: str) -> bool:
    """True for a question about a document as a whole (a summary, an overview, "the whole
    document", a comparison), which needs as much of it as fits rather than its best passages.

    Example:
        >>> wants_whole("Give me a one-line summary of the whole document"), wants_whole("What was the cat's name?")
        (True, False)
    """
    return len(question) <= WHOLE_QUESTION_MAX_CHARS and _WHOLE_QUESTION.search(question) is not None


def leans_on_latest(question: str, *, fold: bool = True) -> bool:
    """True for a follow-up, which needs the exchange right before it (see `FOLLOW_UP_MAX_TERMS`
    and `_POINTS_BACK`); False for a question that stands on its own.

    Example:
        >>> leans_on_latest("Shorten that"), leans_on_latest("And in French?"), leans_on_latest("Why?")
        (True, True, True)
        >>> leans_on_latest("Thanks, now add the unit tests"), leans_on_latest("Please go on.")
        (True, True)
        >>> leans_on_latest("When did Emi go to the jazz concert in Boston?")
        False
    """
    return _term_cache.get(question, fold).distinct <= FOLLOW_UP_MAX_TERMS or _POINTS_BACK.search(question) is not None


def score_messages(
    messages: Sequence[Message],
    *,
    question: int,
    exclude: Sequence[int] = (),
    weights: RelevanceWeights = DEFAULT_RELEVANCE_WEIGHTS,
    similarity: Sequence[float] | None = None,
    texts: Sequence[str] | None = None,
    roles: Sequence[object] | None = None,
) -> list[float]:
    """How relevant each message is to `messages[question]`, higher is better (all >= 0).

    Args:
        messages: the chat, OpenAI format.
        question: index of the message to score against (the latest user message).
        exclude: indices left out of the corpus and scored 0 (e.g. system prompts).
        weights: how the signals are mixed (see `RelevanceWeights`).
        similarity: one cosine per message to the question (see `semantic.similarities`);
            when given, the base signal is `1 - semantic_share` BM25 (as a share of its
            best score) plus `semantic_share` cosine (from the chat's median to its best),
            before pairing, neighbours and recency.
        texts, roles: each message's `message_text` and `role`, when the caller read them
            (`ChatView`); read from `messages` otherwise.

    Example:
        >>> chat = [{"role": "user", "content": "I adopted a cat named Miso."},
        ...         {"role": "assistant", "content": "Lovely!"},
        ...         {"role": "user", "content": "The weather is bad."},
        ...         {"role": "user", "content": "What is my cat called?"}]
        >>> scores = score_messages(chat, question=3)
        >>> max(range(3), key=scores.__getitem__)
        0
    """
    n = len(messages)
    fold = weights.fold_suffixes
    get = _term_cache.get
    stats = [get(text, fold) for text in (map(message_text, messages) if texts is None else texts)]
    skip = set(exclude)
    skip.add(question)
    query = _query_weights(stats, question, weights)
    base = _bm25(stats, skip, query, weights) if query else [0.0] * n
    if similarity is not None and len(similarity) == n:
        base = _fuse(base, similarity, skip, weights.semantic_share)
    return _mixed(base, stats, [m.get("role") for m in messages] if roles is None else roles, skip, weights)


_short_date = attrgetter("short_date")


def _mixed(
    base: list[float], stats: Sequence[_TermStats], roles: Sequence[object], skip: set[int], weights: RelevanceWeights
) -> list[float]:
    """BM25 scores `base` with the other signals mixed in: Q&A pairing, neighbours, date
    headers, recency; the `skip` indices scored 0."""
    n = len(base)
    top = max(base, default=0.0)
    scores = list(base)
    # Each step adds to every score in C where it can, in the same order per message as one
    # loop a step would (the sums are then the same, bit for bit).
    if weights.pair_share or weights.pair_back:
        for i in range(1, n):
            if roles[i] == "assistant" and roles[i - 1] == "user":
                scores[i] += weights.pair_share * base[i - 1]
                scores[i - 1] += weights.pair_back * base[i]
    if weights.neighbour_share and n:
        best = map(max, [0.0, *base[:-1]], [*base[1:], 0.0])
        scores = list(map(add, scores, map(mul, repeat(weights.neighbour_share), best)))
    if weights.header_share:
        for i in compress(range(n), map(_short_date, stats)):
            if i not in skip:
                following = base[i + 1 : i + 1 + weights.header_reach]
                scores[i] += weights.header_share * max(following, default=0.0)
    if weights.recency and n > 1:
        bonus = weights.recency * (top or 1.0) / (n - 1)
        scores = list(map(add, scores, map(mul, repeat(bonus), range(n))))
    for i in skip:
        if 0 <= i < n:
            scores[i] = 0.0
    return scores
