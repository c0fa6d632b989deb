"""Semantic relevance: an embedder's cosine fused into the base signal, lexical when it fails."""

from __future__ import annotations

import pytest

from contextwarden import TrimDecision, trim_messages
from contextwarden.core.semantic import (
    CONTEXT_SHARE,
    DEFAULT_VECTOR_CACHE_BYTES,
    DEFAULT_VECTOR_CACHE_SIZE,
    EMBED_CHARS,
    MAX_DIMENSIONS,
    PIECE_CHARS,
    VectorCache,
    context_window,
    embed_pieces,
    embed_texts,
    similarities,
)

from embedders import chat_about_a_cat, topic_embed


def test_similarities_are_cosines_to_the_question():
    chat = chat_about_a_cat()
    found = similarities(chat, len(chat) - 1, VectorCache(), topic_embed)
    assert found is not None and found[-1] == 0.0
    assert found[1] == pytest.approx(1.0) and found[3] == pytest.approx(0.01 / 1.01, rel=1e-3)


def test_without_filling_only_cached_vectors_count():
    cache = VectorCache()
    chat = chat_about_a_cat()
    assert similarities(chat, len(chat) - 1, cache, topic_embed, fill=False) is None  # nothing cached: lexical
    similarities(chat, len(chat) - 1, cache, topic_embed)
    assert similarities(chat, len(chat) - 1, cache, topic_embed, fill=False) is not None


def test_vectors_of_different_embedders_never_mix():
    cache = VectorCache()
    cache.fill(["a"], topic_embed)
    other = lambda texts: [[0.0, 0.0, 1.0] for _ in texts]  # noqa: E731
    assert cache.get("a", topic_embed) is not None and cache.get("a", other) is None


def test_cache_is_bounded_and_embeds_each_text_once():
    calls: list[int] = []

    def counting(texts: list[str]) -> list[list[float]]:
        calls.append(len(texts))
        return topic_embed(texts)

    cache = VectorCache(size=3)
    cache.fill(["a", "b", "a"], counting)
    cache.fill(["a", "b", "c", "d"], counting)
    assert calls == [2, 2] and len(cache) == 3 and cache.get("a", counting) is None


def test_embedder_shape_errors_are_refused():
    with pytest.raises(ValueError):
        VectorCache().put(["a", "b"], [[1.0]], topic_embed)
    with pytest.raises(ValueError):
        VectorCache().put(["a"], [[float("nan")]], topic_embed)


def test_the_embedder_finds_what_words_do_not():
    chat = chat_about_a_cat()
    lexical = trim_messages(chat, max_tokens=150, model="gpt-4o", low_watermark=1.0)
    semantic = trim_messages(chat, max_tokens=150, model="gpt-4o", low_watermark=1.0, embed=topic_embed)
    assert 1 not in lexical.kept and 1 in lexical.dropped  # no word of the question is in it
    assert 1 in semantic.kept + semantic.recalled and semantic.tokens_after <= 150
    again = trim_messages(chat, max_tokens=150, model="gpt-4o", low_watermark=1.0, embed=topic_embed)
    assert again.kept == semantic.kept  # deterministic


def test_a_failing_embedder_leaves_relevance_lexical():
    def broken(texts: list[str]) -> list[list[float]]:
        raise RuntimeError("model not loaded")

    chat = chat_about_a_cat()
    lexical = trim_messages(chat, max_tokens=150, model="gpt-4o", low_watermark=1.0)
    result = trim_messages(chat, max_tokens=150, model="gpt-4o", low_watermark=1.0, embed=broken)
    assert result.kept == lexical.kept
    assert result.notes == ("embedder failed (RuntimeError): relevance is lexical",)


def test_a_long_message_is_embedded_in_pieces_of_whole_lines():
    lines = [f"line {k}: " + "word " * 30 for k in range(20)]  # ~160 characters each
    pieces = embed_pieces({"role": "user", "content": "\n".join(lines)})
    assert len(pieces) > 1 and all(len(p) <= PIECE_CHARS for p in pieces)
    assert pieces[0].startswith("line 0:") and all(p.split("\n")[0] in lines for p in pieces[:-1])
    assert sum(map(len, pieces)) <= EMBED_CHARS  # no more text than one message embedded whole
    assert embed_pieces({"role": "user", "content": "a short one"}) == ["a short one"]


def test_a_long_line_is_cut_at_sentence_ends():
    text = " ".join(f"Sentence {k} has a few words in it." for k in range(20))
    pieces = embed_pieces({"role": "user", "content": text})
    assert len(pieces) > 1 and all(len(p) <= PIECE_CHARS for p in pieces)
    assert all(p.startswith("Sentence") and p.endswith(".") for p in pieces)


def test_a_long_message_is_as_close_as_its_closest_piece():
    # One line of a long message is about the cat: a vector of the whole text blurs it.
    weather = [(f"Day {k}: the storm and the rain kept us in. " * 9)[: PIECE_CHARS - 10] for k in range(6)]
    long = {"role": "assistant", "content": "\n".join([*weather, "I adopted a cat named Miso."])}
    chat = [long, {"role": "user", "content": "What was my feline called?"}]
    found = similarities(chat, 1, VectorCache(), topic_embed)
    assert found is not None and found[0] == pytest.approx(1.0)


# -- one-liners embedded with the one-liner before them ---------------------------------------


def dialogue(*texts: str) -> list[dict]:
    return [{"role": "user" if k % 2 == 0 else "assistant", "content": t} for k, t in enumerate(texts)]


def test_a_one_liner_after_a_one_liner_has_a_context_window():
    chat = dialogue("Did you adopt the kitten?", "Yes, last week!", "x" * (PIECE_CHARS + 1), "Nice.")
    assert context_window(chat, 1) == "Did you adopt the kitten?\nYes, last week!"
    assert context_window(chat, 0) is None  # nothing before it
    assert context_window(chat, 2) is None  # a long message carries its own context
    assert context_window(chat, 3) is None  # and gives none: it is not a one-liner
    system = [{"role": "system", "content": "Be brief."}, *dialogue("Hi")]
    assert context_window(system, 1) is None  # only user and assistant messages pair up
    assert context_window(dialogue("  ", "Yes"), 1) is None
    assert context_window(chat, 9) is None


def test_a_reply_takes_its_share_of_similarity_from_what_it_answers():
    chat = dialogue("Did you adopt the kitten?", "Yes, last week!", "It rained all day.", "What was my feline called?")
    alone = similarities(chat, 3, VectorCache(), topic_embed, context=False)
    found = similarities(chat, 3, VectorCache(), topic_embed)
    assert alone is not None and found is not None
    no_topic = 0.1 / 1.01**0.5  # "Yes, last week!" alone shares only the constant with the question
    assert alone[1] == pytest.approx(no_topic, rel=1e-3)
    assert found[1] == pytest.approx(no_topic + CONTEXT_SHARE * (1.0 - no_topic), rel=1e-3)  # its window is the cat
    assert found[2] == pytest.approx(alone[2])  # its window ("Yes, last week!" and the rain) is no closer
    assert found[0] == alone[0] and found[3] == 0.0  # the first message has no window; the question none


def test_a_window_not_fetched_yet_leaves_its_message_scored_alone():
    chat = dialogue("Did you adopt the kitten?", "Yes, last week!", "What was my feline called?")
    cache = VectorCache()
    own = [t for t in embed_texts(chat) if "\n" not in t]
    cache.fill(own, topic_embed)
    assert similarities(chat, 2, cache, topic_embed, fill=False) == similarities(
        chat, 2, VectorCache(), topic_embed, context=False
    )
    cache.fill(embed_texts(chat), topic_embed)
    assert similarities(chat, 2, cache, topic_embed, fill=False) == similarities(chat, 2, VectorCache(), topic_embed)


def test_texts_are_fetched_messages_first_then_windows_newest_first():
    chat = [{"role": "system", "content": "Be brief."}, *dialogue("Did you adopt the kitten?", "Yes!", "Cute.")]
    assert embed_texts(chat) == [
        "Cute.",
        "Yes!",
        "Did you adopt the kitten?",
        "Yes!\nCute.",
        "Did you adopt the kitten?\nYes!",
    ]


def test_a_selection_s_own_block_stays_without_a_recall_room(counter):
    """With `recall_share` 0 a selection by message may still quote what it picked rather than
    send it in place; passing its decision back (a retry, the next turn) sends that block again
    where it was (it was once dropped: the retry sent another prompt, the prefix broke at 1)."""
    chat = chat_about_a_cat()
    options = dict(max_tokens=200, model="gpt-4o", token_counter=counter, embed=topic_embed, recall_share=0.0)
    first = trim_messages(chat, **options)
    assert first.recalled == (1,)  # quoted: the cat's name
    retry = trim_messages(chat, previous=TrimDecision.from_json(first.decision.to_json()), **options)
    assert retry.messages == first.messages
    later = chat + [{"role": "assistant", "content": "Miso."}, {"role": "user", "content": "Thanks!"}]
    following = trim_messages(later, previous=TrimDecision.from_json(first.decision.to_json()), **options)
    assert following.reused and following.messages[: first.stable_prefix] == first.messages[: first.stable_prefix]


def test_the_cache_is_bounded_in_bytes_and_keeps_minilms_8192():
    """A count alone let 8,192 vectors of 3,072 dimensions hold 99 MiB; 384 (MiniLM) fit as before."""
    embed = lambda texts: None  # noqa: E731 (a key space only)
    minilm = (384, DEFAULT_VECTOR_CACHE_SIZE + 512, DEFAULT_VECTOR_CACHE_SIZE)
    for dimensions, puts, fit in (minilm, (3_072, 2_048, 1_328)):
        cache = VectorCache()
        vectors = [[1.0 + k % 7] * dimensions for k in range(512)]
        for start in range(0, puts, 512):
            cache.put([f"{dimensions} {k}" for k in range(start, start + 512)], vectors, embed)
        assert len(cache) == fit and cache.bytes <= DEFAULT_VECTOR_CACHE_BYTES
        assert cache.get(f"{dimensions} {puts - 1}", embed) is not None and cache.get(f"{dimensions} 0", embed) is None


def test_a_vector_over_the_largest_dimension_is_refused():
    cache = VectorCache()
    cache.put(["a"], [[1.0] * MAX_DIMENSIONS], topic_embed)
    with pytest.raises(ValueError, match="dimensions"):
        cache.put(["b"], [[1.0] * (MAX_DIMENSIONS + 1)], topic_embed)
    assert cache.get("b", topic_embed) is None


def test_vectors_of_other_dimensions_are_refused_and_a_new_length_starts_afresh():
    """An answer whose lengths differ from each other or from the embedder's earlier vectors is
    refused (the filter warns, as on any bad answer); `similarities` no longer goes lexical
    silently. The refused length's next answer is kept: a new model behind the same function."""
    cache = VectorCache()
    with pytest.raises(ValueError, match="in one answer"):
        cache.put(["a", "b"], [[1.0, 0.0], [1.0, 0.0, 0.0]], topic_embed)
    cache.put(["a"], [[1.0, 0.0]], topic_embed)
    with pytest.raises(ValueError, match="from 2 to 3 dimensions"):
        cache.put(["b"], [[1.0, 0.0, 0.0]], topic_embed)
    assert cache.get("a", topic_embed) is None and cache.get("b", topic_embed) is None  # the old ones forgotten
    cache.put(["b"], [[1.0, 0.0, 0.0]], topic_embed)
    assert cache.get("b", topic_embed) is not None
