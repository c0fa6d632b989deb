"""Token counting: encodings by model, exact counts, overhead, cache bound, offline fallback."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st

import contextwarden.core.tokens as tokens_module
from contextwarden.core.tokens import TokenCounter, encoding_for, estimate_tokens

from chatgen import WORDS


@pytest.mark.parametrize(
    ("model", "encoding"),
    [
        ("gpt-4o", "o200k_base"),
        ("gpt-4o-2024-08-06", "o200k_base"),
        ("openai/gpt-4.1-mini", "o200k_base"),
        ("gpt-5", "o200k_base"),
        ("o3-mini", "o200k_base"),
        ("openrouter.openai/o4-mini", "o200k_base"),
        ("gpt-4", "cl100k_base"),
        ("gpt-4-turbo", "cl100k_base"),
        ("gpt-3.5-turbo", "cl100k_base"),
        ("azure.gpt-35-turbo", "cl100k_base"),
        ("claude-sonnet-4.5", "o200k_base"),
        ("llama3.1:8b", "o200k_base"),
        (None, "o200k_base"),
        ("", "o200k_base"),
        ("gpt-4.1", "o200k_base"),
        ("solo3", "o200k_base"),
    ],
)
def test_encoding_by_model(model, encoding):
    assert encoding_for(model) == encoding


def test_exact_counts_match_tiktoken(counter):
    text = "Hello <|endoftext|> world, 12345 日本語 🙂"
    for model, name in (("gpt-4o", "o200k_base"), ("gpt-4", "cl100k_base")):
        assert counter.mode(model) == "exact"
        assert counter.count_text(text, model) == len(tiktoken.get_encoding(name).encode_ordinary(text))


def test_message_overhead_follows_the_cookbook(counter):
    enc = tiktoken.get_encoding("o200k_base")
    message = {"role": "user", "content": "What is the capital of France?", "name": "ann"}
    expected = 3 + len(enc.encode("user")) + len(enc.encode(message["content"])) + 1 + len(enc.encode("ann"))
    assert counter.count_message(message, "gpt-4o") == expected
    assert counter.count_messages([message], "gpt-4o") == expected + 3


def test_tool_calls_and_images_are_counted(counter):
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    }
    assert (
        counter.count_message(call, "gpt-4o")
        > counter.count_message({"role": "assistant", "content": None}, "gpt-4o") + 5
    )
    image = {
        "role": "user",
        "content": [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "data:,"}}],
    }
    assert (
        counter.count_message(image, "gpt-4o")
        == counter.count_message({"role": "user", "content": "see"}, "gpt-4o") + 765
    )


def test_cache_is_bounded():
    small = TokenCounter(block=True, cache_size=100)
    for i in range(1_000):
        small.count_text(f"text number {i}", "gpt-4o")
    assert len(small._cache) == 100


def _samples() -> list[str]:
    rng = random.Random(7)
    prose = open(tokens_module.__file__, encoding="utf-8").read()
    return [
        " ".join(rng.choice(WORDS) for _ in range(2_000)),
        prose,
        "The quick brown fox jumps over the lazy dog. " * 200,
        "東京は日本の首都です。今日は晴れです。" * 100,
        " ".join(str(rng.randint(0, 10**9)) for _ in range(500)),
        "a b c d e f g h " * 300,
    ]


def test_estimator_errs_high(counter):
    enc = tiktoken.get_encoding("o200k_base")
    for sample in _samples():
        exact = len(enc.encode_ordinary(sample))
        ratio = estimate_tokens(sample) / exact
        assert 1.0 <= ratio <= 2.2, (sample[:30], ratio)


def test_offline_counts_with_estimator_and_never_blocks(monkeypatch):
    gate = threading.Event()

    def slow_unavailable(name):
        gate.wait(5)
        raise ConnectionError("no network")

    monkeypatch.setattr(tiktoken, "get_encoding", slow_unavailable)
    offline = TokenCounter()  # background loading, as in the filter
    started = time.perf_counter()
    count = offline.count_text("hello world", "gpt-4o")
    assert time.perf_counter() - started < 1.0  # returned while the loader still hangs
    assert count == estimate_tokens("hello world") and offline.mode("gpt-4o") == "estimate"
    gate.set()
    assert offline.wait_ready("gpt-4o", timeout=5) is False
    assert offline.mode("gpt-4o") == "estimate"  # a failure is not retried at once


async def test_loading_happens_off_the_event_loop(monkeypatch):
    loaded = threading.Event()
    real = tiktoken.get_encoding

    def slow(name):
        time.sleep(0.3)
        loaded.set()
        return real(name)

    monkeypatch.setattr(tiktoken, "get_encoding", slow)
    fresh = TokenCounter()
    ticks = 0

    async def ticker():
        nonlocal ticks
        while not loaded.is_set():
            ticks += 1
            await asyncio.sleep(0.01)

    task = asyncio.create_task(ticker())
    assert fresh.mode("gpt-4o") == "estimate"
    await task
    assert ticks >= 10  # the loop kept running while the encoding loaded
    fresh.wait_ready("gpt-4o")
    assert fresh.mode("gpt-4o") == "exact"


def test_substitute_encoding_when_only_cl100k_loads(monkeypatch):
    real = tiktoken.get_encoding

    def only_cl100k(name):
        if name != "cl100k_base":
            raise ConnectionError("offline")
        return real(name)

    monkeypatch.setattr(tiktoken, "get_encoding", only_cl100k)
    c = TokenCounter(block=True)
    c.wait_ready("gpt-4")
    assert c.mode("gpt-4o") == "substitute"
    assert c.count_text("hello world", "gpt-4o") == 2


# -- hostile text (issue 13, item 3) -------------------------------------------------------------

HOSTILE_RUNS = [" " * 1_000_000, "\t" * 1_000_000, "\u00a0" * 1_000_000, "x " + " " * 1_000_000 + "y"]


@pytest.mark.parametrize("text", HOSTILE_RUNS, ids=["spaces", "tabs", "nbsp", "inside"])
def test_a_million_spaces_are_counted_and_cut_without_a_panic(counter, text):
    # tiktoken's own encode panics (pyo3 PanicException, a BaseException) on a run of ~1M
    # whitespace characters; the counter encodes bounded pieces instead.
    with pytest.raises(BaseException) as raised:
        tiktoken.get_encoding("o200k_base").encode_ordinary(text)
    assert not isinstance(raised.value, Exception)
    for model in ("gpt-4o", "gpt-4"):
        assert 0 < counter.count_text(text, model) <= len(text)
    head, tail = counter.keep_ends(text, 50, 20, "gpt-4o")
    assert text.startswith(head) and text.endswith(tail) and head and tail


def test_pieces_are_bounded_and_join_to_the_text():
    for text in HOSTILE_RUNS + [" ".join(WORDS) * 50, "a" * 100_000, "ab " * 40_000]:
        pieces = tokens_module.encode_pieces(text)
        assert "".join(pieces) == text
        assert all(0 < len(p) <= tokens_module.ENCODE_CHUNK_CHARS for p in pieces)


@pytest.mark.parametrize("name", ["o200k_base", "cl100k_base"])
def test_counting_in_pieces_changes_no_count_of_ordinary_text(counter, name):
    encoding = tiktoken.get_encoding(name)
    rng = random.Random(13)
    samples = [
        " ".join(rng.choice(WORDS) for _ in range(20_000)),  # prose, ~130k characters
        "\n".join(
            f"    def f{i}(x):  return x * {i}  # 日本語, don't" for i in range(3_000)
        ),  # code, CJK, contractions
        " ".join(str(rng.randrange(10**9)) for _ in range(15_000)) + " 🙂 <|endoftext|>",
    ]
    for text in samples:
        assert len(text) > 3 * tokens_module.ENCODE_CHUNK_CHARS
        assert len(tokens_module._encode(encoding, text)) == len(encoding.encode_ordinary(text))
        assert tokens_module._encode(encoding, text) == encoding.encode_ordinary(text)
    short = samples[0][: tokens_module.ENCODE_CHUNK_CHARS]
    assert tokens_module.encode_pieces(short) == [short]


@pytest.mark.parametrize("unit", [" ", "\t", "a", "\u00a0", " \n"])
def test_counting_hard_cuts_stays_within_a_token_per_cut(counter, unit):
    encoding = tiktoken.get_encoding("o200k_base")
    text = unit * 300_000  # below the panic, with no word gap to cut at
    cuts = len(tokens_module.encode_pieces(text)) - 1
    assert cuts > 10
    assert abs(len(tokens_module._encode(encoding, text)) - len(encoding.encode_ordinary(text))) <= cuts


# Text that stresses tiktoken's pre-split where two parts meet: line breaks, spaces, tabs,
# punctuation, contractions, digits, CJK and emoji, at both ends of a part.
_EDGES = st.text(alphabet=st.sampled_from(list("ab Z9.,'!?:/-_\n\r\t \u00a0日本🙂")), max_size=12)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.tuples(_EDGES, st.sampled_from(WORDS), _EDGES), min_size=1, max_size=5),
    st.sampled_from(["gpt-4o", "gpt-4"]),
)
def test_counting_joined_parts_is_counting_the_joined_text(counter, chunks, model):
    """`count_joined` equals one encode call of the joined text, also where it adds up parts."""
    encoding = tiktoken.get_encoding(encoding_for(model))
    texts = [head + word + tail for head, word, tail in chunks]
    quoted = [f"user: {t}\n\n" for t in texts[:-1]] + [f"assistant: {texts[-1]}"]
    for parts in (["Earlier:\n\n", *quoted], texts):  # a recall block's shape, and any parts at all
        joined = "".join(parts)
        assert counter.count_joined(parts, model) == len(encoding.encode_ordinary(joined))
        assert counter.count_joined(parts, model) == counter.count_text(joined, model)


def test_joined_parts_are_added_up_only_where_the_pre_split_cuts(monkeypatch):
    """A recall block's quotes are counted one by one (cached per quote); parts that a token
    could span are counted joined."""
    counter = TokenCounter(block=True)  # its own count cache
    encoded: list[str] = []
    real = tokens_module._encode
    monkeypatch.setattr(tokens_module, "_encode", lambda enc, text: encoded.append(text) or real(enc, text))
    quotes = ["Earlier:\n\n", "user: my cat is Miso.\n\n", "assistant: Lovely!"]
    counter.count_joined(quotes, "gpt-4o")
    assert encoded == quotes
    encoded.clear()
    counter.count_joined(["Earlier:\n\n", "user: my cat is Miso.\n\n", "assistant: Cute!"], "gpt-4o")
    assert encoded == ["assistant: Cute!"]  # the label and the first quote were counted before
    encoded.clear()
    counter.count_joined(["my cat", " is Miso"], "gpt-4o")  # a space before a word: joined
    assert encoded == ["my cat is Miso"]
