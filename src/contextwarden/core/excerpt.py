"""Excerpts: an old message too large for what is left of the budget, cut to what the question needs.

A pasted document or a long tool result in an earlier turn would be dropped whole. Instead its
text is split into line-aligned chunks (`split_chunks`), the chunks are scored against the
latest question with the chat's own scorer (`relevance.score_messages`, the chunks as its
corpus), and the best that fit are sent in their order, each stretch left out replaced by a
`CUT_MARK` line. An excerpt is named by its chunk numbers, so the next turn can rebuild the very
same bytes (`rebuild`) while the question's needs do not change (prompt cache).
"""

from __future__ import annotations

import functools
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, replace
from itertools import chain

from ..caches import (
    CHUNK_CACHE_MAX_CHARS,
    CHUNK_CACHE_SIZE,
    CHUNK_INDEX_CHARS,
    CHUNK_INDEX_TEXTS,
    POINTED_MEMO_SIZE,
    QUESTION_MEMO_SIZE,
    TextCache,
    register,
)
from .alternation import fits_bridged
from .chatview import ChatView
from .conversation import Message
from .relevance import (
    DEFAULT_RELEVANCE_WEIGHTS,
    FOLLOW_UP_MAX_TERMS,
    _bm25_idf,
    _fuse,
    _message_bm25,
    _mixed,
    _term_cache,
    _TermStats,
    held_terms,
    leans_on_latest,
    words_terms,
)
from .semantic import VECTORS, Embed, embed_pieces, similarities
from .tokens import TokenCounter

__all__ = [
    "CUT_MARK",
    "CHUNK_CHARS",
    "MIN_EXCERPT_TOKENS",
    "EXCERPT_KEEP_SHARE",
    "Excerpt",
    "split_chunks",
    "passage_count",
    "chunk_scores",
    "excerpt_message",
    "rebuild",
    "excerpt_text",
    "with_text",
    "excerpt_turns",
    "fresh_share",
    "pointed_words",
    "spread_scores",
    "filled_scores",
    "marked_text",
    "passage_texts",
    "passage_quote",
    "recall_passages",
    "cuttable",
]

CUT_MARK = "[… {n} tokens cut by contextwarden …]"
CHUNK_CHARS = 600  # a chunk is lines (paragraphs first) joined up to about this; longer lines are split
MIN_EXCERPT_TOKENS = 200  # a message costing less is never excerpted: kept whole or dropped
MIN_EXCERPT_ROOM = 64  # tokens left below which no further turn is excerpted
MAX_EXCERPT_TRIES = 8  # candidate turns tried per trim, most relevant first (each chunks and scores its text)
PASSAGE_MESSAGES = 2  # the newest long messages whose passages the filter embeds ahead (`passage_texts`)
PASSAGE_MAX_CHARS = 40_000  # ... each at most this long (~10k tokens): the first cut of one runs on the loop
# A carried excerpt is sent again while its chunks hold at least this share of the relevance a
# fresh excerpt of the same size would hold for the new question (as the recall block's rule).
EXCERPT_KEEP_SHARE = 0.5
# ... and while one of its chunks scores at least this share of the best chunk's (a passage that
# clearly matches best is never left out; near-ties, common in chats of made-up words, carry).
BEST_PASSAGE_SHARE = 0.75
# A recall block quotes the passages of a long message that score at least this share of its best.
RECALL_PASSAGE_SHARE = 0.5
POINTED_SHARE = 0.25  # a question word held by more of the chunks than this says nothing of what it needs
_CHUNK_WEIGHTS = replace(DEFAULT_RELEVANCE_WEIGHTS, context_messages=0, recency=0.0, pair_share=0.0, pair_back=0.0)
_SPLIT_AT = (". ", "? ", "! ", "; ", ", ", " ")


@dataclass(frozen=True, slots=True)
class Excerpt:
    """An excerpted copy of one message: the copy, what it costs, the chunk numbers it keeps and
    how many chunks (passages) the whole text has."""

    message: Message
    tokens: int
    chunks: tuple[int, ...]
    total: int = 0


def split_chunks(text: str) -> list[str]:
    """`text` cut into chunks of about `CHUNK_CHARS` that join back to it exactly: whole lines,
    a chunk ending at a blank line when it is a third full; a longer line is cut at a sentence
    end, else a comma or a space, else anywhere. Every chunk is a passage, with words: blank
    lines go with the chunk before (`_ended`), unless the text is blank alone.

    Example:
        >>> chunks = split_chunks("a\\n\\nb\\n" + "word " * 200)
        >>> "".join(chunks) == "a\\n\\nb\\n" + "word " * 200, len(chunks)
        (True, 3)
    """
    chunks: list[str] = []
    current = ""
    for line in _pieces(text):
        if current and len(current) + len(line) > CHUNK_CHARS:
            current = _ended(chunks, current)
        current += line
        if not line.strip() and len(current) >= CHUNK_CHARS // 3:
            current = _ended(chunks, current)
    if current and _ended(chunks, current):
        chunks.append(current)  # a blank text: its one chunk
    return chunks


def _ended(chunks: list[str], current: str) -> str:
    """Ends the chunk `current`: added to `chunks`, or, blank lines alone, to the chunk before (a
    chunk of them was a passage: sent, and told as one, "12 of 42" for 11); what is left to go
    on with (blank lines with no chunk before them)."""
    if current.strip():
        chunks.append(current)
    elif chunks:
        chunks[-1] += current
    else:
        return current
    return ""


@dataclass(frozen=True, slots=True)
class _ChunkIndex:
    """A text's chunks (`split_chunks`), each one's term statistics (from the per-text cache, folded
    as `held_terms` and `chunk_scores` read them), their total length, and for each term the
    chunks that hold it, ascending: a question then reads only the chunks holding one of its
    terms, and a term's holders are counted without reading every chunk."""

    chunks: tuple[str, ...]
    stats: tuple[_TermStats, ...]
    holders: dict[str, tuple[int, ...]]
    length: int


def _index(chunks: tuple[str, ...]) -> _ChunkIndex:
    get, fold = _term_cache.get, _CHUNK_WEIGHTS.fold_suffixes
    stats = tuple([get(c, fold) for c in chunks])
    holders: defaultdict[str, list[int]] = defaultdict(list)
    for k, s in enumerate(stats):
        for term in chain(s.once, s.more):
            holders[term].append(k)
    return _ChunkIndex(chunks, stats, {t: tuple(ks) for t, ks in holders.items()}, sum(s.length for s in stats))


def _chunked(text: str) -> _ChunkIndex:
    """`split_chunks(text)` with its `_ChunkIndex`. A carried excerpt's message is cut, checked
    and rebuilt again every turn: the texts of up to `CHUNK_CACHE_MAX_CHARS` used last are kept,
    `CHUNK_INDEX_TEXTS` at most and `CHUNK_INDEX_CHARS` in all (~10 bytes a character with their
    terms: 16 MiB at most; by size, so that other chats' documents do not push out a chat's few)."""
    if len(text) > CHUNK_CACHE_MAX_CHARS:
        return _index(tuple(split_chunks(text)))
    return _cached_chunk_index(text)


def _chunks_only(text: str) -> tuple[str, ...]:
    """`split_chunks(text)`, from `_chunked`'s cache when it keeps the text; a longer one is cut
    without its search terms (a quote or a rebuilt excerpt needs none, and they cost 2x the cut)."""
    if len(text) > CHUNK_CACHE_MAX_CHARS:
        return tuple(split_chunks(text))
    return _cached_chunk_index(text).chunks


def passage_count(text: str) -> int:
    """How many passages (chunks) `text` is cut into: what a user is told a document has.

    Example:
        >>> passage_count("short"), passage_count("word " * 2_000) > 1
        (1, True)
    """
    return len(_chunks_only(text))


def _chunk_index(text: str) -> _ChunkIndex:
    return _index(tuple(split_chunks(text)))


_cached_chunk_index = TextCache(_chunk_index, max_texts=CHUNK_INDEX_TEXTS, max_chars=CHUNK_INDEX_CHARS)
register("excerpt._cached_chunk_index", _cached_chunk_index.cache_clear)


def _pieces(text: str) -> list[str]:
    """The lines of `text` (with their ends), lines over `CHUNK_CHARS` cut into pieces."""
    out: list[str] = []
    for line in text.splitlines(keepends=True):
        while len(line) > CHUNK_CHARS:
            window = line[:CHUNK_CHARS]
            cut = CHUNK_CHARS
            for mark in _SPLIT_AT:
                at = window.rfind(mark)
                if at >= CHUNK_CHARS // 3:
                    cut = at + len(mark)
                    break
            out.append(line[:cut])
            line = line[cut:]
        out.append(line)
    return out


def passage_texts(messages: Sequence[Message]) -> list[str]:
    """The texts an embedder scores the passages of the chat's long messages by (what
    `chunk_scores` asks it for): the filter embeds them ahead, with the messages, so an excerpt
    weighs meaning too. The `PASSAGE_MESSAGES` newest messages that an excerpt could cut, newest
    first; none longer than `PASSAGE_MAX_CHARS` (a longer one's excerpts stay lexical). Each text's
    list is cached: this runs on the event loop every turn (two texts of 40,000 characters: 6 ms
    the first time on a loaded 2-core machine, 0.01 ms after; two of 100,000 took 51 ms).

    Example:
        >>> doc = {"role": "user", "content": "\\n\\n".join(["Alpha beta gamma. " * 20] * 3)}
        >>> len(passage_texts([doc, {"role": "user", "content": "short"}])) > 1
        True
    """
    texts: list[str] = []
    found = 0
    for message in reversed(messages):
        slot = _text_slot(message) if message.get("role") in ("user", "assistant", "tool") else None
        if slot is None or not CHUNK_CHARS <= len(slot[0]) <= PASSAGE_MAX_CHARS:
            continue
        texts += _passage_pieces(slot[0])
        found += 1
        if found == PASSAGE_MESSAGES:
            break
    return texts


@functools.lru_cache(maxsize=CHUNK_CACHE_SIZE)
def _passage_pieces(text: str) -> tuple[str, ...]:
    """The embedder's texts for the chunks of `text` (`passage_texts`)."""
    chunks = _chunked(text).chunks
    return tuple(chain.from_iterable(embed_pieces({"role": "user", "content": c}) for c in chunks))


register("excerpt._passage_pieces", _passage_pieces.cache_clear)


def chunk_scores(chunks: Sequence[str], question: str, embed: Embed | None = None) -> list[float]:
    """How relevant each chunk is to `question`: BM25 and friends over the chunks as the corpus
    (`score_messages` without recency, pairing or the turns before the question), with the
    embedder's cosines fused in when `embed` gives them (else, or when it fails, lexical)."""
    return _index_scores(_index(tuple(chunks)), question, embed)


def _index_scores(index: _ChunkIndex, question: str, embed: Embed | None = None) -> list[float]:
    """`chunk_scores` of the indexed chunks: the question's terms (its query) read only the
    chunks that hold them (the others score 0 in BM25), so it costs what the question's terms
    hold, not the text; the same scores as `score_messages`' over the chunks, bit for bit."""
    chunks = index.chunks
    similarity = None
    if embed is not None and chunks:
        pseudo = [{"role": "user", "content": c} for c in chunks]
        pseudo.append({"role": "user", "content": question})
        try:
            similarity = similarities(pseudo, len(chunks), VECTORS, embed, context=False)
        except Exception:  # any embedder (the filter's looks vectors up and raises for chunks): lexical
            similarity = None
    asked = _term_cache.get(question, _CHUNK_WEIGHTS.fold_suffixes)
    return _terms_scores(index, chain(asked.once, asked.more), asked, similarity)


def _terms_scores(
    index: _ChunkIndex,
    query: Iterable[str],
    asked: _TermStats,
    similarity: Sequence[float] | None = None,
) -> list[float]:
    """`score_messages` of the chunks and a question (`asked`: its statistics) whose query terms
    are `query` (each at weight 1, as `_CHUNK_WEIGHTS` reads a question alone), under
    `_CHUNK_WEIGHTS`, less the question's own score: `relevance._bm25`'s sums over the chunks
    holding a query term, in the same order of operations, then fused and mixed alike."""
    weights, stats, holders = _CHUNK_WEIGHTS, index.stats, index.holders
    n = len(stats) + 1  # the question is a message of the corpus's count, left out of its sums
    average = index.length / n if index.length else 1.0
    idf: dict[str, float] = {}
    reading: set[int] = set()
    for term in query:
        held = holders.get(term)
        if held:
            idf[term] = _bm25_idf(n, len(held))
            reading.update(held)
    base = [0.0] * n
    for k in reading:
        base[k] = _message_bm25(stats[k], idf.get, average, weights)
    skip = {n - 1}
    if similarity is not None and len(similarity) == n:
        base = _fuse(base, similarity, skip, weights.semantic_share)
    return _mixed(base, [*stats, asked], ["user"] * n, skip, weights)[:-1]


def spread_scores(count: int) -> list[float]:
    """Scores under which the best chunks that fit are spread evenly over a text: the first and
    the last, the middle, the quarters, the eighths... (what a question about the whole text
    needs when not all of it fits: every part of it, in order, rather than its best passages).

    Example:
        >>> spread_scores(5)  # chunks 0 and 4 first, then 2 (the middle), then 1 and 3
        [5.0, 2.0, 3.0, 1.0, 4.0]
    """
    ranked: dict[int, int] = {}
    parts = 1
    while len(ranked) < count:
        for i in range(parts + 1):
            ranked.setdefault(i * (count - 1) // parts, len(ranked))
        parts *= 2
    return [float(count - ranked[k]) for k in range(count)]


def excerpt_text(
    chunks: Sequence[str], kept: Sequence[int], counter: TokenCounter, model: str | None
) -> tuple[str, int]:
    """The kept chunks in their order, each stretch left out as one `CUT_MARK` line naming its
    tokens (its chunks' counts added: each chunk is counted once a chat, where counting the
    stretch joined would encode most of a long text again for every new cut); and the tokens
    cut in all."""
    return marked_text(chunks, set(kept), lambda k: counter.count_text(chunks[k], model))


def marked_text(pieces: Sequence[str | int], kept: Collection[int], cost: Callable[[int], int]) -> tuple[str, int]:
    """`pieces` (chunks, and an earlier cut's markers as the tokens each names) with the chunks
    `kept` (numbered among the chunks) in their order, each stretch of other chunks and markers
    one `CUT_MARK` line naming all the tokens they stand for (a chunk's: `cost(k)`); and the
    tokens cut in all.

    Example:
        >>> marked_text(["a\\n", 40, "b\\n", "c"], {0, 2}, lambda k: 7)
        ('a\\n[… 47 tokens cut by contextwarden …]\\nc', 47)
    """
    out: list[str] = []
    cut = total = k = 0
    for piece in pieces:
        if isinstance(piece, int):
            cut += piece
            continue
        if k in kept:
            if cut:
                out.append(_mark_line(out, cut) + "\n")
                total, cut = total + cut, 0
            out.append(piece)
        else:
            cut += cost(k)
        k += 1
    if cut:
        out.append(_mark_line(out, cut))
    return "".join(out), total + cut


def _mark_line(out: Sequence[str], cut: int) -> str:
    """The `CUT_MARK` line naming `cut` tokens after what `out` holds (on a line of its own)."""
    lead = "\n" if out and not out[-1].endswith("\n") else ""
    return f"{lead}{CUT_MARK.format(n=f'{cut:,}')}"


def filled_scores(scores: Sequence[float]) -> list[float]:
    """Scores under which the relevant chunks (score above 0) come first, the best first, then
    the rest spread evenly over the text (`spread_scores`): what fills a room the relevant
    chunks leave.

    Example:
        >>> filled_scores([0.0, 2.5, 0.0, 0.0, 0.0])
        [5.0, 8.5, 3.0, 1.0, 4.0]
    """
    top = float(len(scores) + 1)
    return [top + s if s > 0 else spread for s, spread in zip(scores, spread_scores(len(scores)), strict=True)]


def _text_slot(message: Message) -> tuple[str, int | None] | None:
    """The text an excerpt cuts: the string content, or the largest text part (and its index)."""
    content = message.get("content")
    if isinstance(content, str):
        return content, None
    if isinstance(content, list):
        parts = [
            (len(p["text"]), k) for k, p in enumerate(content) if isinstance(p, dict) and isinstance(p.get("text"), str)
        ]
        if parts:
            k = max(parts)[1]
            return content[k]["text"], k
    return None


def with_text(message: Message, text: str, part: int | None) -> Message:
    """A copy of `message` with `text` as its string content, or as the text of its part `part`."""
    if part is None:
        return {**message, "content": text}
    parts = list(message["content"])
    parts[part] = {**parts[part], "text": text}
    return {**message, "content": parts}


def rebuild(message: Message, kept: Sequence[int], counter: TokenCounter, model: str | None) -> Excerpt | None:
    """The excerpt of `message` that keeps chunks `kept` (as an earlier turn chose them): the
    same bytes for the same message and counter. None when the message has no text to cut."""
    slot = _text_slot(message)
    if slot is None:
        return None
    chunks = _chunks_only(slot[0])
    if any(not 0 <= k < len(chunks) for k in kept):
        return None
    text, _ = excerpt_text(chunks, kept, counter, model)  # none kept: a placeholder, the one mark
    copy = with_text(message, text, slot[1])
    return Excerpt(copy, counter.count_message(copy, model), tuple(sorted(kept)), len(chunks))


def excerpt_message(
    message: Message,
    question: str,
    room: int,
    counter: TokenCounter,
    model: str | None,
    embed: Embed | None = None,
    *,
    whole: bool = False,
    fill: bool = False,
) -> Excerpt | None:
    """The copy of `message` within `room` tokens (overhead included) that keeps its chunks
    most relevant to `question` (score above 0), in order, the rest marked as cut; with no
    relevant chunk, or none that fits, a placeholder (only the mark). None when even that
    does not fit or the message has no text to cut. `whole`: the question is about the text
    as a whole (`relevance.wants_whole`): chunks spread evenly over it (`spread_scores`).
    `fill`: after the relevant chunks, the room left takes chunks spread evenly over the rest.

    Example:
        >>> from contextwarden.core.tokens import TokenCounter
        >>> doc = "\\n\\n".join(f"Section {n}. " + "Filler text about nothing. " * 20 for n in range(10))
        >>> doc += "\\n\\nThe vault code is 7731.\\n\\n" + "More filler. " * 40
        >>> message = {"role": "user", "content": doc}
        >>> cut = excerpt_message(message, "What is the vault code?", 300, TokenCounter(), None)
        >>> "vault code is 7731" in cut.message["content"], "tokens cut by contextwarden" in cut.message["content"]
        (True, True)
    """
    slot = _text_slot(message)
    if slot is None:
        return None
    if whole:
        chunks = _chunks_only(slot[0])
        scores = spread_scores(len(chunks))
    else:
        index = _chunked(slot[0])
        chunks, scores = index.chunks, _index_scores(index, question, embed)
        if fill:  # the relevant chunks first, then the rest spread
            scores = filled_scores(scores)
    chosen, _ = _choose(
        chunks, scores, room - counter.count_message(with_text(message, "", slot[1]), model), counter, model
    )
    while True:
        text, _ = excerpt_text(chunks, chosen, counter, model)
        copy = with_text(message, text, slot[1])
        tokens = counter.count_message(copy, model)
        if tokens <= room:
            return Excerpt(copy, tokens, tuple(chosen), len(chunks))
        if not chosen:
            return None
        # Joined pieces and marks counted more than apart: let the least relevant chunk go.
        chosen.remove(min(chosen, key=lambda k: (scores[k], -k)))


def _choose(
    chunks: Sequence[str], scores: Sequence[float], room: int, counter: TokenCounter, model: str | None
) -> tuple[list[int], int]:
    """The relevant chunks (score above 0) that fit `room` best first, ascending, and what they
    cost: each counted with a mark for the stretch it may leave before it (and one mark more
    for the end)."""
    mark = counter.count_text(CUT_MARK.format(n="99,999"), model) + 1
    left = room - mark
    chosen: list[int] = []
    for k in sorted((k for k, s in enumerate(scores) if s > 0), key=lambda k: (-scores[k], k)):
        cost = counter.count_text(chunks[k], model) + mark
        if cost <= left:
            chosen.append(k)
            left -= cost
    return sorted(chosen), room - left


def pointed_words(chunks: Sequence[str], question: str) -> str:
    """The words of `question` that point somewhere in `chunks`: each with a search term held by at
    most `POINTED_SHARE` of them ("thanks" in a chat transcript points nowhere; "aisle" does).

    Example:
        >>> pointed_words(["thanks a lot", "thanks, see you", "thanks", "the aisle is 42"], "Thanks! Which aisle?")
        'aisle?'
    """
    return _pointed([held_terms(c) for c in chunks], question)


def _pointed(held: Sequence[frozenset[str]], question: str) -> str:
    """`pointed_words` of chunks whose terms are `held`."""
    words, wanted, _ = _question_words(question)
    holders = Counter(chain.from_iterable(map(wanted.intersection, held)))
    limit = max(1, int(len(held) * POINTED_SHARE))
    pointed = {term for term in wanted if holders[term] <= limit}
    return " ".join(word for word, terms in words if not pointed.isdisjoint(terms))


@functools.lru_cache(maxsize=QUESTION_MEMO_SIZE)
def _question_words(
    question: str,
) -> tuple[tuple[tuple[str, tuple[str, ...]], ...], frozenset[str], tuple[tuple[str, ...], ...]]:
    """Each word of `question` with its search terms, all those terms, and the distinct terms of
    its words of more than one term (one question is read for every excerpt of a turn)."""
    words = question.split()
    terms = words_terms(words)
    several = tuple({t for t in terms.values() if len(t) > 1})
    return tuple((word, terms[word]) for word in words), frozenset().union(*terms.values()), several


register("excerpt._question_words", _question_words.cache_clear)


def _pointed_query(index: _ChunkIndex, question: str) -> set[str]:
    """The search terms of the question's `pointed_words` in the indexed chunks that some chunk
    holds (the others weigh nothing), without joining the words and cutting them again: a
    word's terms go when one of them is held by at most `POINTED_SHARE` of the chunks (or by
    none), so those of a one-term word go when it is held by some but not too many."""
    _, wanted, several = _question_words(question)
    holders = index.holders
    limit = max(1, int(len(index.chunks) * POINTED_SHARE))
    query = {term for term in holders.keys() & wanted if len(holders[term]) <= limit}
    for terms in several:
        if any(len(holders.get(term, ())) <= limit for term in terms):
            query.update(term for term in terms if term in holders)
    return query


def _pointed_scores(text: str, question: str) -> tuple[tuple[str, ...], list[float]]:
    """The chunks of `text` and their `chunk_scores` for the question's `pointed_words`: what
    a carried excerpt is judged by and a recall block quotes passages by (one turn asks both,
    and its second pass again: the last few are kept, texts of `CHUNK_CACHE_MAX_CHARS` at most)."""
    if len(text) > CHUNK_CACHE_MAX_CHARS:
        return _scored(text, question)
    return _cached_scored(text, question)


# The question's statistics where `_terms_scores` needs some: it is left out of every sum.
_ASKED = _TermStats((), (), b"", 0, False)


def _scored(text: str, question: str) -> tuple[tuple[str, ...], list[float]]:
    index = _chunked(text)
    return index.chunks, _terms_scores(index, _pointed_query(index, question), _ASKED)


_cached_scored = functools.lru_cache(maxsize=POINTED_MEMO_SIZE)(_scored)
register("excerpt._cached_scored", _cached_scored.cache_clear)


def fresh_share(
    message: Message, kept: Sequence[int], question: str, tokens: int, counter: TokenCounter, model: str | None
) -> float:
    """The relevance to `question` (its `pointed_words`) that chunks `kept` hold, as a share of what
    a fresh excerpt of `tokens` would hold (1.0 when nothing is relevant: the needs have not
    changed); 0.0 when none of them comes near the passage that matches best (`BEST_PASSAGE_SHARE`;
    found in the browser: a summary's excerpt of 49 of 93 passages held 0.58 of the relevance,
    all but the one passage the next question needed, scored 11.5 against 6.2 for the next).

    Example:
        >>> from contextwarden.core.tokens import TokenCounter
        >>> doc = {"role": "user", "content": "\\n\\n".join(f"Part {n}. " + "Filler text. " * 40 for n in range(6))}
        >>> fresh_share(doc, [0, 1, 2], "What does part 4 say?", 400, TokenCounter(), None)
        0.0
    """
    slot = _text_slot(message)
    if slot is None:
        return 1.0
    chunks, scores = _pointed_scores(slot[0], question)
    fresh, _ = _choose(chunks, scores, tokens, counter, model)
    best = sum(scores[k] for k in fresh)
    if best <= 0:
        return 1.0
    kept = [k for k in kept if 0 <= k < len(scores)]
    if max((scores[k] for k in kept), default=0.0) < BEST_PASSAGE_SHARE * max(scores):
        return 0.0
    return sum(scores[k] for k in kept) / best


def passage_quote(message: Message, chunks: Sequence[int], counter: TokenCounter, model: str | None) -> str | None:
    """What a recall block quotes of `message`'s passages `chunks`: those chunks in their order,
    each stretch between them marked as cut (as in an excerpt), the same bytes every turn; None
    when the message has no text to cut or a chunk number is not one of its chunks.

    Example:
        >>> from contextwarden.core.tokens import TokenCounter
        >>> doc = {"role": "user", "content": "\\n\\n".join(f"Part {n}. " + "Filler text. " * 40 for n in range(3))}
        >>> quote = passage_quote(doc, [1], TokenCounter(), None)
        >>> quote.startswith("[… ") and "Part 1." in quote and "Part 2." not in quote
        True
    """
    slot = _text_slot(message)
    if slot is None:
        return None
    pieces = _chunks_only(slot[0])
    if not chunks or any(not 0 <= k < len(pieces) for k in chunks):
        return None
    return excerpt_text(pieces, sorted(chunks), counter, model)[0]


def recall_passages(
    message: Message,
    question: str,
    room: int,
    sent: Collection[int],
    counter: TokenCounter,
    model: str | None,
) -> tuple[tuple[int, ...], int]:
    """The passages of `message` a recall block quotes for `question`: chunks not `sent` already
    (in its excerpt or an earlier block) scoring at least `RECALL_PASSAGE_SHARE` of its best for
    the question's `pointed_words` (the scores `fresh_share` judges a carried excerpt by), best
    first while they fit `room` tokens with their marks; ascending, and what they cost so.

    Example:
        >>> from contextwarden.core.tokens import TokenCounter
        >>> doc = {"role": "user", "content": "\\n\\n".join(f"Part {n}. " + "Filler text. " * 40 for n in range(6))}
        >>> recall_passages(doc, "What does part 4 say?", 400, (), TokenCounter(), None)[0]
        (4,)
    """
    slot = _text_slot(message)
    if slot is None:
        return (), 0
    chunks, scores = _pointed_scores(slot[0], question)
    floor = RECALL_PASSAGE_SHARE * max(scores, default=0.0)
    wanted = [s if s >= floor and k not in sent else 0.0 for k, s in enumerate(scores)]
    chosen, cost = _choose(chunks, wanted, room, counter, model)
    return tuple(chosen), cost


def excerpt_turns(
    view: ChatView,
    keep: Collection[int],
    costs: Sequence[int],
    room: int,
    counter: TokenCounter,
    model: str | None,
    *,
    scores: Sequence[float] | None = None,
    embed: Embed | None = None,
    whole: bool = False,
    keep_free: int | None = None,
) -> tuple[set[int], dict[int, Excerpt]]:
    """Earlier turns the selection left out (`keep` holds none of them) that hold a message of
    `MIN_EXCERPT_TOKENS` or more, sent with those messages excerpted for the latest question,
    the most relevant turn first, while they fit `room`; the indices to add and the excerpts.
    A turn goes whole or not at all (a question with its answer, a tool call with its result),
    and only where roles still alternate beside it, with a bridging message if need be
    (`alternation.fits_bridged`);
    a turn whose excerpts keep no relevant chunk goes only to collapse a tool result. `scores`
    (one per message, as the selection used them) rank the turns; by default `score_messages`.
    `embed` (optional) scores the chunks semantically as well. `whole` (a question about the
    documents as a whole): every such turn, the newest first, gets a share of `room` by its
    size and its chunks spread evenly. `keep_free` (not with `whole`): for a follow-up on the
    exchange that holds a long text (`relevance.leans_on_latest`, "what else does it say?": it
    matches a few chunks and left most of the room unused), what `room` still holds past the
    excerpts, but `keep_free`, fills that exchange's excerpts with chunks spread evenly over
    the rest of their text (`_filled`; not a placeholder for a question with words of its own:
    "thanks! and which dessert goes with a pear tart?" needs nothing of a maintenance log)."""
    question = view.question
    if question is None or room <= 0 or not view.current:
        return set(), {}
    messages = view.messages
    candidates: list[tuple[list[int], list[int]]] = []
    for turn in view.turns[: view.current]:
        indices = turn.indices
        if turn.units[0].kind != "user" or not _disjoint(keep, indices):
            continue
        large = [i for i in indices if costs[i] >= MIN_EXCERPT_TOKENS and cuttable(messages[i])]
        if large and sum(costs[i] for i in indices if i not in large) < room:
            candidates.append((indices, large))
    if not candidates:
        return set(), {}
    if scores is None:
        scores = view.relevance()
    text = view.text(question)
    added: set[int] = set()
    excerpts: dict[int, Excerpt] = {}
    sent = sorted(keep)  # (kept in order: a turn goes only where it clashes with neither neighbour)
    if whole:
        ranked = sorted(candidates, key=lambda c: -c[0][0])[:MAX_EXCERPT_TRIES]
    else:
        ranked = sorted(candidates, key=lambda c: (-sum(scores[i] for i in c[0]), -c[0][0]))[:MAX_EXCERPT_TRIES]
    for n, (indices, large) in enumerate(ranked):
        if (not whole and sum(scores[i] for i in indices) <= 0) or room < MIN_EXCERPT_ROOM:
            break
        placed = fits_bridged(view, sent, indices, costs, MIN_EXCERPT_TOKENS)
        if placed is None:
            continue
        share = room * sum(costs[i] for i in indices) // sum(costs[i] for c in ranked[n:] for i in c[0])
        got = _excerpt_turn(
            view, placed, large, scores, text, share if whole else room, costs, counter, model, embed, whole
        )
        if got is None:
            continue
        added.update(placed)
        sent = sorted([*sent, *placed])
        excerpts.update(got)
        room -= sum(got[i].tokens if i in got else costs[i] for i in placed)
    if keep_free is not None and not whole and view.latest is not None and leans_on_latest(text):
        latest = set(view.turns[view.latest].indices)
        vague = _term_cache.get(text, _CHUNK_WEIGHTS.fold_suffixes).distinct <= FOLLOW_UP_MAX_TERMS
        which = [i for i, e in excerpts.items() if i in latest and (e.chunks or vague)]
        _filled(messages, which, excerpts, text, room - keep_free, counter, model, embed)
    return added, excerpts


def _filled(
    messages: Sequence[Message],
    which: Sequence[int],
    excerpts: dict[int, Excerpt],
    question: str,
    spare: int,
    counter: TokenCounter,
    model: str | None,
    embed: Embed | None,
) -> None:
    """The `excerpts` of messages `which` made again, in their order, in their tokens and what is
    left of `spare`, with chunks spread evenly over the rest of their texts after the relevant
    ones (`excerpt_message`'s `fill`), while `MIN_EXCERPT_ROOM` is left."""
    for i in which:
        made = excerpts[i]
        if spare < MIN_EXCERPT_ROOM:
            return
        more = excerpt_message(messages[i], question, made.tokens + spare, counter, model, embed, fill=True)
        if more is not None and more.tokens > made.tokens:
            excerpts[i] = more
            spare -= more.tokens - made.tokens


def cuttable(message: Message) -> bool:
    """The message has a text of at least one chunk to cut."""
    slot = _text_slot(message)
    return slot is not None and len(slot[0]) >= CHUNK_CHARS


def _disjoint(keep: Collection[int], indices: Sequence[int]) -> bool:
    """None of `indices` is in `keep`."""
    return not any(i in keep for i in indices)


def _excerpt_turn(
    view: ChatView,
    indices: Sequence[int],
    large: Sequence[int],
    scores: Sequence[float],
    question: str,
    room: int,
    costs: Sequence[int],
    counter: TokenCounter,
    model: str | None,
    embed: Embed | None = None,
    whole: bool = False,
) -> dict[int, Excerpt] | None:
    """The excerpts of one turn's `large` messages within `room` less its other messages: the
    most relevant message first, each leaving the room for the others' placeholders. None when
    it does not fit, or keeps nothing relevant and collapses no tool result."""
    messages = view.messages
    left = room - sum(costs[i] for i in indices if i not in large)
    placeholders = {i: rebuild(messages[i], (), counter, model) for i in large}
    if any(p is None for p in placeholders.values()):
        return None
    reserve = sum(p.tokens for p in placeholders.values() if p is not None)
    if reserve > left:
        return None
    out: dict[int, Excerpt] = {}
    for i in sorted(large, key=lambda i: (-scores[i], i)):
        reserve -= placeholders[i].tokens  # type: ignore[union-attr]
        cut = excerpt_message(messages[i], question, left - reserve, counter, model, embed, whole=whole)
        if cut is None:
            return None
        out[i] = cut
        left -= cut.tokens
    if not any(e.chunks for e in out.values()) and not any(view.role(i) == "tool" for i in large):
        return None
    return out
