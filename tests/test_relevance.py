"""Relevance scoring: tokenization, BM25, and each signal on small chats."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from contextwarden.core import relevance
from contextwarden.core.relevance import DEFAULT_RELEVANCE_WEIGHTS, relevance_terms, score_messages

OFF = dataclasses.replace(
    DEFAULT_RELEVANCE_WEIGHTS,
    context_weight=0.0,
    pair_share=0.0,
    pair_back=0.0,
    neighbour_share=0.0,
    header_share=0.0,
    recency=0.0,
)


def msg(role: str, text: str) -> dict:
    return {"role": role, "content": text}


def best(scores: list[float], among: range) -> int:
    return max(among, key=lambda i: (scores[i], i))


def test_terms_lowercase_strip_punctuation_stop_words_and_fold_suffixes():
    assert relevance_terms("The PAINTING, painted; paints!") == ["paint", "paint", "paint"]
    assert relevance_terms("What is it?") == []
    assert relevance_terms("in 2022, 7 times") == ["2022", "7", *relevance_terms("time")]
    assert relevance_terms("Paintings", fold=False) == ["paintings"]


def test_terms_split_cjk_into_character_pairs_and_keep_other_scripts_as_words():
    assert relevance_terms("東京タワー") == ["東京", "京タ", "タワ", "ワー"]
    assert relevance_terms("привет мир") == ["привет", "мир"]
    assert relevance_terms("tokyo東京") == ["tokyo", "東京"]


def test_bm25_prefers_the_message_sharing_rare_terms():
    chat = [
        msg("user", "I bought a red bicycle yesterday."),
        msg("assistant", "Nice, a bicycle!"),
        msg("user", "The weather is fine."),
        msg("assistant", "Good."),
        msg("user", "Which colour was my bicycle? red or blue"),
    ]
    scores = score_messages(chat, question=4, weights=OFF)
    assert best(scores, range(4)) == 0
    assert scores[2] == scores[3] == 0.0 and scores[4] == 0.0


def test_cjk_question_finds_cjk_message():
    chat = [
        msg("user", "我在东京买了一台相机。"),
        msg("assistant", "太好了"),
        msg("user", "今天天气很好"),
        msg("assistant", "是的"),
        msg("user", "我在哪里买了相机？"),
    ]
    scores = score_messages(chat, question=4, weights=OFF)
    assert best(scores, range(4)) == 0


def test_reply_inherits_part_of_its_question_score():
    chat = [
        msg("user", "How do I configure nginx reverse proxy?"),
        msg("assistant", "Use proxy_pass in a location block."),
        msg("user", "unrelated chatter"),
        msg("assistant", "sure"),
        msg("user", "nginx reverse proxy again?"),
    ]
    without = score_messages(chat, question=4, weights=OFF)
    paired = score_messages(chat, question=4, weights=dataclasses.replace(OFF, pair_share=0.5))
    assert paired[1] > without[1] and paired[1] > paired[3]


def test_neighbours_of_a_strong_match_share_in_it():
    chat = [
        msg("user", "filler one"),
        msg("assistant", "my passport number ends in 4471"),
        msg("user", "it expires soon"),
        msg("assistant", "other words"),
        msg("user", "passport 4471?"),
    ]
    plain = score_messages(chat, question=4, weights=OFF)
    spread = score_messages(chat, question=4, weights=dataclasses.replace(OFF, neighbour_share=0.3))
    assert plain[2] == 0.0 < spread[2] and spread[3] == 0.0


def test_short_date_message_shares_in_what_follows_it():
    chat = [
        msg("user", "[Session 3 - 4 May 2023]"),
        msg("assistant", "We adopted a puppy named Rex."),
        msg("user", "cool"),
        msg("assistant", "ok"),
        msg("user", "When did we adopt Rex?"),
    ]
    plain = score_messages(chat, question=4, weights=OFF)
    headed = score_messages(chat, question=4, weights=dataclasses.replace(OFF, header_share=0.3))
    assert plain[0] == 0.0 < headed[0]
    assert headed[2] == 0.0


def test_context_turns_help_a_short_follow_up():
    chat = [
        msg("user", "Tell me about the Eiffel tower height."),
        msg("assistant", "It is 330 m tall."),
        msg("user", "Random note about cooking pasta."),
        msg("assistant", "Pasta needs salt."),
        msg("user", "What about the Eiffel tower lifts?"),
        msg("assistant", "There are several lifts."),
        msg("user", "and the price?"),
    ]
    no_context = score_messages(chat, question=6, weights=OFF)
    context = score_messages(chat, question=6, weights=dataclasses.replace(OFF, context_weight=0.5))
    assert max(no_context[:6]) == 0.0
    assert best(context, range(4)) == 0


def test_a_long_message_before_a_short_question_does_not_outweigh_it():
    """A person's several messages in one (REALTALK) before a short question: its many terms,
    each at the context's weight, outweighed the question's own (-0.03 to -0.045 of all
    evidence kept there); spread over `context_span` terms, the question's own match wins."""
    chatter = " ".join(
        f"{w}s" for w in "harbour lantern copper meadow orchard granite summit canvas pilgrim saddle".split()
    )
    filler = " ".join(f"word{k}" for k in range(50))
    chat = [
        msg("user", "My violin is in the attic."),
        msg("assistant", f"{chatter} all over town."),
        msg("user", "Sure."),
        msg("assistant", f"{chatter} {filler}"),
        msg("user", "Where is the violin?"),
    ]
    weights = dataclasses.replace(OFF, context_weight=0.25)
    assert best(score_messages(chat, question=4, weights=weights), range(3)) == 0
    unbounded = dataclasses.replace(weights, context_span=10**6)  # as before: every context term in full
    assert best(score_messages(chat, question=4, weights=unbounded), range(3)) == 1


def test_recency_breaks_ties_toward_newer_and_excluded_score_zero():
    chat = [
        msg("system", "be nice"),
        msg("user", "apple"),
        msg("assistant", "apple"),
        msg("user", "x y"),
        msg("user", "apple?"),
    ]
    scores = score_messages(chat, question=4, exclude=[0], weights=dataclasses.replace(OFF, recency=0.1))
    assert scores[0] == 0.0 and scores[2] > scores[1]


def test_scores_are_deterministic_and_non_negative():
    chat = [msg("user" if i % 2 == 0 else "assistant", f"topic {i % 7} words {i}") for i in range(60)]
    chat.append(msg("user", "topic 3 words"))
    first = score_messages(chat, question=60)
    assert first == score_messages([dict(m) for m in chat], question=60)
    assert all(s >= 0 for s in first)


# Characters where a byte-level word split could part from the Unicode one: case mappings that
# change length or depend on context (İ, final sigma), the Kelvin sign, non-word marks inside
# CJK ranges (・, ゛), combining marks, non-ASCII digits and spaces, ligatures, lone surrogates.
TRICKY = "aZ9_ -'.,!?\u00e9\u00dfİΣσς\u0307\u212aK東京タワー・゛가힯\ud800\u00a0\u2019—\t\n0١２ﬁǅ"


@given(st.text(alphabet=st.sampled_from(TRICKY) | st.characters(), max_size=60), st.booleans())
@example("Caroline painted 2 sunrises in 2022! 日本語 ΟΔΟΣ'Α İstanbul don’t", True)
def test_term_counts_match_relevance_terms(text, fold):
    """The cache's fast counting yields exactly the terms `relevance_terms` lists."""
    terms = relevance_terms(text, fold=fold)
    assert relevance._term_counts(text, fold) == (dict(Counter(terms)), len(terms))


@given(st.text(alphabet=st.sampled_from(TRICKY) | st.characters(), max_size=60), st.booleans())
@example("Caroline painted 2 sunrises in 2022! 日本語 ΟΔΟΣ'Α İstanbul don’t", True)
def test_words_terms_match_relevance_terms(text, fold):
    """Each word's terms through the memo are those `relevance_terms` gives that word."""
    words = text.split()
    got = relevance.words_terms(words, fold=fold)
    assert list(got) == list(dict.fromkeys(words))
    assert all(Counter(got[w]) == Counter(relevance_terms(w, fold=fold)) for w in words)


class _Recorded:
    """`_TERM_PIECES` that notes the longest text one findall call was given."""

    def __init__(self, pattern):
        self.pattern, self.longest = pattern, 0

    def findall(self, text, *args):
        self.longest = max(self.longest, len(text))
        return self.pattern.findall(text, *args)


@pytest.mark.parametrize("char", ["\ud800", "\U0001f600", "\u00e9", "\u65e5"])
def test_a_megabyte_word_is_cut_in_short_calls(monkeypatch, char):
    """A reply of one 'word' (lone surrogates, emoji, accents, CJK: no ASCII space) is read a
    slice at a time, so no single C call holds the GIL, and the event loop, for long."""
    recorded = _Recorded(relevance._TERM_PIECES)
    monkeypatch.setattr(relevance, "_TERM_PIECES", recorded)
    relevance._fresh_word_memos()
    text = char * 300_000
    relevance._term_counts(text, True)
    relevance_terms(text)
    assert 0 < recorded.longest <= relevance.WORD_SLICE_CHARS


@given(st.text(alphabet=st.sampled_from(TRICKY), min_size=20, max_size=80), st.booleans())
def test_long_words_are_cut_alike_by_both_paths(text, fold):
    """With words longer than a slice, the memo's byte path and `relevance_terms` still agree."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(relevance, "WORD_SLICE_CHARS", 3)
        relevance._fresh_word_memos()  # words met with the usual slice would answer from the memo
        terms = relevance_terms(text, fold=fold)
        got = relevance._term_counts(text, fold)
    relevance._fresh_word_memos()
    assert got == (dict(Counter(terms)), len(terms))


def test_term_cache_is_bounded_by_messages_and_terms():
    cache = relevance._TermStatsCache(size=3, max_terms=10)
    for k in range(6):
        cache.get(f"alpha{k} beta{k} gamma{k}", True)
    assert len(cache._entries) == 3 and cache._terms == 9
    cache.get(" ".join(f"word{k}" for k in range(8)), True)  # 8 terms: older entries go until 10 terms hold
    assert len(cache._entries) == 1 and cache._terms == 8


def test_word_memo_is_bounded_and_replaced_whole(monkeypatch):
    monkeypatch.setattr(relevance, "TERM_MEMO_SIZE", 8)
    monkeypatch.setitem(relevance._word_memos, True, relevance._WordTerms(True))
    texts = [
        "alpha beta gamma delta",
        "東京タワー epsilon zeta 123456 eta theta",
        "iota kappa 東京タワー lambda mu nu xi",
        "omicron pi rho sigma tau upsilon",
        "phi chi psi omega 2024 99999 東京",
    ]
    for text in texts * 3:
        terms = relevance_terms(text)
        assert relevance._term_counts(text, True) == (dict(Counter(terms)), len(terms))
        memo = relevance._word_memos[True]
        assert len(memo) + len(memo.several) <= 8
        assert b"123456" not in memo and b"99999" not in memo  # long numbers are not remembered


def test_a_question_with_many_terms_of_its_own_does_not_draw_on_the_turns_before_it():
    chat = [
        msg("user", "Tell me about the Eiffel tower height."),
        msg("assistant", "It is 330 m tall."),
        msg("user", "Random note about cooking pasta."),
        msg("assistant", "Pasta needs salt and the Eiffel tower is far."),
        msg("user", "Which museums in Madrid open late on Sundays?"),
    ]
    assert len(set(relevance_terms(chat[-1]["content"]))) > relevance.RECALL_CONTEXT_TERMS
    with_context = score_messages(chat, question=4, weights=dataclasses.replace(OFF, context_weight=0.5))
    assert with_context == score_messages(chat, question=4, weights=OFF)


def test_a_chat_that_goes_on_is_scored_as_if_read_anew():
    words = ["apple", "harbor", "violin", "maple", "copper", "lantern", "meadow", "quartz"]
    chat = [
        msg("user" if k % 2 == 0 else "assistant", f"{words[k % 8]} {words[(k * 3) % 8]} note {k}") for k in range(40)
    ]
    edited = [*chat[:10], msg("user", "harbor lantern quartz, rewritten"), *chat[11:]]
    turns = [chat[: k + 1] for k in range(20, 40, 2)] + [chat, edited, chat[:30]]
    kept = [score_messages(turn, question=len(turn) - 1, exclude=[0]) for turn in turns]
    assert len(relevance._frequency_cache._entries) > 1  # the chat's counts were kept between turns

    fresh = []
    for turn in turns:
        relevance._frequency_cache.clear()
        fresh.append(score_messages(turn, question=len(turn) - 1, exclude=[0]))
    assert kept == fresh


def test_frequency_cache_is_bounded_by_chats_and_terms():
    cache = relevance._FrequencyCache(size=2, max_terms=8)
    stats = [relevance._term_cache.get(f"alpha{k} beta{k}", True) for k in range(5)]
    for k in range(3):
        cache.of([stats[k]])
    assert len(cache._entries) == 2
    assert cache.of(stats[:4]) == Counter({f"{w}{k}": 1 for w in ("alpha", "beta") for k in range(4)})
    assert [len(c) for _, c in cache._entries] == [8]  # the older chats gave way, by terms
    cache.of(stats)  # 10 terms: more than it may keep
    assert all(len(c) <= 8 for _, c in cache._entries)
