"""The recall's incremental index (recall_index.py): a cache, so its scores must be exactly those
of reading the whole chat anew, whatever the chat did since (grew, was edited, branched)."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from itertools import repeat
from operator import add, contains, mul, truediv

import pytest

from contextwarden.core import recall_index
from contextwarden.core.conversation import message_text
from contextwarden.core.recall_index import RECALL_CONTEXT_TERMS, RECALL_QUERY_TERMS, _IndexCache, recall_scores
from contextwarden.core.relevance import DEFAULT_RELEVANCE_WEIGHTS, _mixed, _query_weights, _term_cache

WEIGHTS = replace(DEFAULT_RELEVANCE_WEIGHTS, recency=0.0)


def reference_scores(messages, *, question, exclude=(), weights=WEIGHTS):
    """recall_scores as it was before the index: every message's term dict read every turn."""
    n = len(messages)
    fold = weights.fold_suffixes
    stats = [_term_cache.get(message_text(m), fold) for m in messages]
    skip = set(exclude) | {question}
    if stats[question].distinct <= RECALL_CONTEXT_TERMS:
        query = _query_weights(stats, question, weights)
    else:
        query = dict.fromkeys(stats[question].once + stats[question].more, 1.0)
    corpus = [i for i in range(n) if i not in skip]
    held = []
    for i in corpus:
        h = dict.fromkeys(stats[i].once, 1)
        h.update(zip(stats[i].more, stats[i].more_tfs, strict=True))
        held.append(h)
    total = sum(stats[i].length for i in corpus)
    average = total / n if n and total else 1.0
    k1, b = weights.k1, weights.b
    norms = [k1 * (1.0 - b + b * stats[i].length / average) for i in corpus]
    found = {term: sum(map(contains, held, repeat(term))) for term in query}
    idf = {term: query[term] * math.log(1.0 + (n - f + 0.5) / (f + 0.5)) for term, f in found.items() if f}
    terms = sorted(idf, key=lambda t: (-idf[t], t))[:RECALL_QUERY_TERMS]
    columns = []
    for term in terms:
        counts = list(map(dict.get, held, repeat(term), repeat(0)))
        weight = idf[term] * (k1 + 1.0)
        columns.append(list(map(truediv, map(mul, counts, repeat(weight)), map(add, counts, norms))))
    base = [0.0] * n
    if columns:
        for i, score in zip(corpus, map(math.fsum, zip(*columns, strict=True)), strict=False):
            base[i] = score
    return _mixed(base, stats, [m.get("role") for m in messages], skip, weights)


def words(rng: random.Random, count: int) -> str:
    """Zipf-ish words, so that terms have every document frequency; some repeated, some dates."""
    pool = [f"w{int(rng.paretovariate(1.1))}" for _ in range(count)]
    if rng.random() < 0.1:
        pool.append("May 7")
    return " ".join(pool)


def growing_chat(rng: random.Random, turns: int):
    """A chat and, turn after turn, the list as each turn sees it (a reply and a question more)."""
    chat = [{"role": "system", "content": words(rng, 20)}]
    for _ in range(turns):
        chat = chat + [{"role": "user", "content": words(rng, rng.choice((2, 3, 12, 40)))}]
        yield chat
        chat = chat + [{"role": "assistant", "content": words(rng, rng.randint(1, 80))}]


@pytest.mark.parametrize("seed", range(12))
def test_scores_turn_after_turn_are_those_of_a_fresh_read(seed):
    rng = random.Random(seed)
    seen = 0
    for chat in growing_chat(rng, 30):
        q = len(chat) - 1
        assert recall_scores(chat, question=q, exclude=[0], weights=WEIGHTS, seen=seen) == reference_scores(
            chat, question=q, exclude=[0]
        )
        seen = len(chat)


def test_an_edited_branched_or_shorter_chat_is_read_anew():
    rng = random.Random(7)
    chats = list(growing_chat(rng, 20))
    chat = chats[-1]
    q = len(chat) - 1
    recall_scores(chat, question=q, exclude=[0], weights=WEIGHTS)
    edited = [dict(m) for m in chat]
    text = edited[5]["content"]
    edited[5]["content"] = text[::-1]  # same length, other terms
    for variant in (edited, chats[10], chats[10][:-1] + [{"role": "user", "content": "w1 w2 w3 w4 w5 w9 w17"}]):
        v = len(variant) - 1
        got = recall_scores(variant, question=v, exclude=[0], weights=WEIGHTS, seen=len(chat))
        assert got == reference_scores(variant, question=v, exclude=[0])


def test_the_next_turn_reads_only_its_new_messages(monkeypatch):
    rng = random.Random(3)
    chats = list(growing_chat(rng, 12))
    before, after = chats[-2], chats[-1]
    recall_scores(before, question=len(before) - 1, exclude=[0], weights=WEIGHTS)
    read = []
    get = _term_cache.get
    monkeypatch.setattr(_term_cache, "get", lambda text, fold: read.append(text) or get(text, fold))
    recall_scores(after, question=len(after) - 1, exclude=[0], weights=WEIGHTS, seen=len(before))
    assert read == [after[-2]["content"], after[-1]["content"]]
    read.clear()  # the same list again (a second pass of the same turn): nothing to read
    recall_scores(after, question=len(after) - 1, exclude=[0], weights=WEIGHTS, seen=len(before))
    assert read == []


def test_indexes_stay_within_their_bound(monkeypatch):
    cache = _IndexCache(max_terms=500)
    monkeypatch.setattr(recall_index, "_indexes", cache)
    rng = random.Random(11)
    for _ in range(40):
        chat = [{"role": "user", "content": words(rng, 60)} for _ in range(4)]
        recall_scores(chat, question=3, weights=WEIGHTS)
        assert cache._terms <= 500
        assert cache._terms == sum(index.entries for index in cache._entries.values())
    huge = [{"role": "user", "content": " ".join(f"t{k}" for k in range(600))}, {"role": "user", "content": "t1"}]
    assert recall_scores(huge, question=1, weights=WEIGHTS) == reference_scores(huge, question=1)
    assert all(len(index.keys) != 2 for index in cache._entries.values())  # over the bound alone: not kept


def test_a_reply_read_ahead_leaves_the_next_turn_only_its_question(monkeypatch):
    """Open WebUI's outlet sees the reply before the next turn sends it back: `read_reply` counts
    it and cuts its terms then, so the next turn's trim cuts only the new question's."""
    from contextwarden.core.relevance import _term_stats
    from contextwarden.core.tokens import TokenCounter
    from contextwarden.core.trim import read_reply

    rng = random.Random(5)
    chats = list(growing_chat(rng, 12))
    before, after = chats[-2], chats[-1]
    fresh = f" unique{rng.random()}"  # texts no other test had the term cache read
    after = [*after[:-2], *({**m, "content": m["content"] + fresh} for m in after[-2:])]
    counter = TokenCounter()
    recall_scores(before, question=len(before) - 1, exclude=[0], weights=WEIGHTS)
    reply = after[-2]
    read_reply(reply, counter, "gpt-4o")
    cut: list[str] = []
    monkeypatch.setattr(
        "contextwarden.core.relevance._term_stats", lambda text, fold: cut.append(text) or _term_stats(text, fold)
    )
    recall_scores(after, question=len(after) - 1, exclude=[0], weights=WEIGHTS, seen=len(before))
    assert cut == [after[-1]["content"]]
