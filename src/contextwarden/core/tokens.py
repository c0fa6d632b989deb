"""Counting tokens: per-model encoding, message overhead, images, a bounded cache.

tiktoken downloads its encodings on first use, which fails (or hangs) offline. A counter
therefore loads encodings in a background thread, never through tiktoken's own download (see
`encoding_files`), and, until one is there, counts with a conservative estimator; `mode()` says
which it used so the caller can tell the user.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal

from ..backoff import Backoff
from ..caches import DEFAULT_COUNT_CACHE_SIZE, ENCODING_MEMO_SIZE, lru_hit, register
from ..encoding_files import EncodingUnavailable, encoding_cached, load_encoding
from .conversation import REASONING_KEYS, Message, image_count, message_text, reasoning_text

__all__ = [
    "encode_pieces",
    "ENCODE_CHUNK_CHARS",
    "CountMode",
    "TokenCounter",
    "encoding_for",
    "estimate_tokens",
    "preload_encodings",
    "ESTIMATE_HIGH_BY",
    "DEFAULT_IMAGE_TOKENS",
    "TOKENS_PER_MESSAGE",
    "TOKENS_PER_REPLY",
    "TOKENS_PER_ROLE",
]

tokens_log = logging.getLogger("contextwarden")

CountMode = Literal["exact", "substitute", "estimate"]
"""`exact`: the model's encoding; `substitute`: another BPE encoding; `estimate`: no encoding."""

TOKENS_PER_MESSAGE = 3  # OpenAI cookbook: <|start|>{role}<|message|> ... <|end|>
TOKENS_PER_NAME = 1
TOKENS_PER_ROLE = 1  # every message's role (a one-token word)
TOKENS_PER_REPLY = 3  # every reply is primed with <|start|>assistant<|message|>
DEFAULT_IMAGE_TOKENS = 765  # one 1024x1024 image at high detail (OpenAI's tile formula)
# After a failed load a counter estimates 60 s before it tries again, doubling while loads fail, up to an hour.
LOAD_RETRY_SECONDS = (60.0, 3600.0)
# The longest text one encode call gets. tiktoken panics (a BaseException) on a whitespace run of
# ~1M characters, and one call holds the GIL for its whole text, superlinearly in a run of spaces
# or a long word: 4k characters take under 1 ms, 16k up to 17 ms (AMD EPYC).
ENCODE_CHUNK_CHARS = 4_096
PRELOADED_ENCODINGS = ("o200k_base", "cl100k_base")  # what `encoding_for` picks: every model's
# `estimate_tokens` over the encodings, at most: 1.1x on numbers, 1.4x on prose, code and JSON,
# 1.9x on runs of 7-11 letter words (o200k). Estimated savings are divided by it (a lower bound).
ESTIMATE_HIGH_BY = 2.0

_O200K_MODEL = re.compile(r"(?:^|[/.:])(?:chatgpt-4o|gpt-4o|gpt-4\.1|gpt-4\.5|gpt-5|gpt-oss|o[1345])(?:$|[-:.])")
_CL100K_MODEL = re.compile(r"(?:^|[/.:])(?:gpt-4|gpt-3\.5|gpt-35|text-embedding)(?:$|[-:.])")
# Pieces as a BPE pre-tokenizer sees them: letter runs, digit runs, space runs, single others.
_ESTIMATE_PIECES = re.compile(r" ?[A-Za-z]+|\d+| ?[^\sA-Za-z\d]|\s+")
# The last single space between two non-spaces: BPE pre-tokenizers always start a piece there,
# so cutting before it changes no token (greedy `.*` finds it from the end, in linear time).
_LAST_WORD_GAP = re.compile(r".*\S( )\S", re.DOTALL)
# The encodings whose pre-split `_splits_between` describes (checked by tests/test_tokens.py).
_SPLITS_AFTER_LINE_BREAKS = frozenset({"o200k_base", "cl100k_base"})
# A message holding none of these keys, with text content, is counted by its text alone.
_NOT_PLAIN = frozenset({"tool_calls", "name", "tool_call_id", *REASONING_KEYS})


def encoding_for(model: str | None) -> str:
    """The tiktoken encoding that counts best for a model id (o200k_base unless GPT-4/3.5).

    Families without a public tiktoken encoding (Claude, Llama, Qwen, Gemini, ...) get
    o200k_base, the closest general-purpose one; calibration corrects the rest.

    Example:
        >>> encoding_for("openai/gpt-4-turbo"), encoding_for("gpt-4.1-mini")
        ('cl100k_base', 'o200k_base')
    """
    return _encoding_for_model_id(model or "")


@lru_cache(maxsize=ENCODING_MEMO_SIZE)
def _encoding_for_model_id(model: str) -> str:
    """`encoding_for` without the cache: counting asks once per text, so the answer is memoised."""
    name = model.lower()
    if _O200K_MODEL.search(name):
        return "o200k_base"
    if _CL100K_MODEL.search(name):
        return "cl100k_base"
    return "o200k_base"


register("tokens._encoding_for_model_id", _encoding_for_model_id.cache_clear)


def estimate_tokens(text: str) -> int:
    """Count tokens without an encoding, erring high (1.1-1.6x o200k and cl100k on prose, code, numbers, CJK).

    Example:
        >>> estimate_tokens("Hello, world!")
        4
    """
    total = 0
    for piece in _ESTIMATE_PIECES.findall(text):
        last = piece[-1]
        if last.isascii() and last.isalpha():
            total += 1 + len(piece.lstrip(" ")) // 6
        elif last.isdigit():
            total += (len(piece) + 2) // 3
        elif piece.isspace():
            total += 1
        else:  # punctuation or one non-ASCII character, maybe after a space
            total += 1 if ord(last) <= 0xFFFF else 3
    return total + total // 10


def encode_pieces(text: str, limit: int = ENCODE_CHUNK_CHARS) -> list[str]:
    """`text` cut into pieces of at most `limit` characters whose tokens, joined, are the text's.

    Cuts go before a single space between words (no token changes: the counts of ordinary text
    are exact); a stretch with no such space in its second half (a long run of spaces, a huge
    word) is cut at the limit, which may change a token or two at each cut.

    Example:
        >>> encode_pieces("aaa bbb ccc", limit=8)
        ['aaa bbb', ' ccc']
    """
    return [text[start:end] for start, end, _ in _cuts(text, limit)]


def _cuts(text: str, limit: int) -> Iterator[tuple[int, int, bool]]:
    """`encode_pieces`' pieces as (start, end, clean): clean unless the piece ends at the limit
    (a cut that may change a token)."""
    start = 0
    while len(text) - start > limit:
        end = start + limit
        gap = _LAST_WORD_GAP.match(text, start + limit // 2 - 1, end + 1)
        cut = gap.start(1) if gap is not None else end
        yield start, cut, gap is not None
        start = cut
    yield start, len(text), True


def _cut_cleanly(text: str) -> bool:
    """`_encode` gives `text` the tokens one encode call of it would (no cut at the limit)."""
    return len(text) <= ENCODE_CHUNK_CHARS or all(clean for _, _, clean in _cuts(text, ENCODE_CHUNK_CHARS))


def _splits_between(parts: Sequence[str]) -> bool:
    """tiktoken's pre-split (o200k_base, cl100k_base) starts a piece where each part begins: its
    regex ends a run of line breaks before a letter, whatever came before. So each part then
    counts alone, and the parts' counts add up to the joined text's."""
    return all(a.endswith("\n") for a in parts[:-1]) and all(b[:1].isascii() and b[:1].isalpha() for b in parts[1:])


def _encode(encoding: Any, text: str) -> list[int]:
    """The token ids of `text`, encoded piece by piece (see `encode_pieces`)."""
    if len(text) <= ENCODE_CHUNK_CHARS:
        return encoding.encode_ordinary(text)
    ids: list[int] = []
    for piece in encode_pieces(text):
        ids += encoding.encode_ordinary(piece)
    return ids


def _mode_of(name: str, encoding: Any | None, model: str | None) -> CountMode:
    """The count mode of counts made with `encoding` (named `name`) for `model`."""
    if encoding is None:
        return "estimate"
    return "exact" if name == encoding_for(model) else "substitute"


def preload_encodings(names: Iterable[str] = PRELOADED_ENCODINGS) -> threading.Thread:
    """Start loading tiktoken's encodings in a background thread, e.g. when the filter module is
    loaded: tiktoken keeps them for every counter (a counter's own load then returns at once or
    waits on tiktoken's lock), so a fresh worker's first request finds them sooner. Cached ones
    first, so a download that hangs holds back none of them. A failed download logs itself (see
    `encoding_files`); any other failure is left to the counters, which log it and estimate."""

    def load() -> None:
        ordered = sorted(names, key=lambda name: not encoding_cached(name))
        for name in ordered:
            try:
                load_encoding(name)
            except Exception:  # offline, blocked, corrupt cache: the counter says so when it tries
                pass

    thread = threading.Thread(target=load, name="contextwarden-preload", daemon=True)
    thread.start()
    return thread


def _longest_within(limit: int, fits: Callable[[int], bool]) -> int:
    """The largest k in 0..limit with fits(k), by bisection (fits is monotone: longer never fits better)."""
    low, high = 0, limit
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


@dataclass(slots=True)
class _Loading:
    backoff: Backoff = field(default_factory=Backoff)  # on time.monotonic()
    thread: threading.Thread | None = None


class TokenCounter:
    """Counts message tokens for a model, caching text counts by content hash.

    One counter serves every request of a worker: it holds only encodings and counts of
    text it has seen (bounded by `cache_size` entries), never per-request data.

    Args:
        image_tokens: tokens counted for each image part (default 765).
        cache_size: how many text counts to remember (LRU; default 50,000, about 16 MB when full, dict slack included).
        block: load encodings in the calling thread (scripts, tests) instead of in the
            background (servers: never block the event loop).

    Example:
        >>> counter = TokenCounter(block=True)
        >>> counter.count_messages([{"role": "user", "content": "hi"}], "gpt-4o")
        8
    """

    def __init__(
        self,
        *,
        image_tokens: int = DEFAULT_IMAGE_TOKENS,
        cache_size: int = DEFAULT_COUNT_CACHE_SIZE,
        block: bool = False,
    ) -> None:
        self.image_tokens = image_tokens
        self.cache_size = cache_size
        self.block = block
        self._encodings: dict[str, Any] = {}
        self._loading: dict[str, _Loading] = {}
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, int, int], int] = OrderedDict()

    def clear(self) -> None:
        """Forget every count (the encodings stay loaded)."""
        self._cache.clear()

    # -- encodings --------------------------------------------------------------------------

    def _load(self, name: str) -> None:
        """Load one encoding (see `load_encoding`); a failure rests it (LOAD_RETRY_SECONDS), and
        the first of a run is one warning, unless the failed download already said so."""
        try:
            encoding = load_encoding(name)
        except Exception as exc:  # offline, blocked, corrupt cache: all mean "not now"
            with self._lock:
                state = self._loading[name]
                first = state.backoff.failures == 0
                pause = state.backoff.failed(time.monotonic(), *LOAD_RETRY_SECONDS)
                state.thread = None
            loud = first and not isinstance(exc, EncodingUnavailable)
            tokens_log.log(
                logging.WARNING if loud else logging.DEBUG,
                "contextwarden: tiktoken encoding %s unavailable (%s); estimating, next try in %d s",
                name,
                type(exc).__name__,
                pause,
            )
            return
        with self._lock:
            self._encodings[name] = encoding
            self._loading[name].backoff.succeeded()
            self._loading[name].thread = None

    def _encoding(self, name: str) -> Any | None:
        """The encoding if loaded; otherwise start loading it (at most one thread per name)."""
        encoding = self._encodings.get(name)
        if encoding is not None:
            return encoding
        with self._lock:
            state = self._loading.setdefault(name, _Loading())
            if state.thread is not None or state.backoff.resting(time.monotonic()):
                return None
            if not self.block:
                state.thread = threading.Thread(
                    target=self._load, args=(name,), name=f"contextwarden-{name}", daemon=True
                )
                state.thread.start()
                return None
            state.thread = threading.current_thread()
        self._load(name)
        return self._encodings.get(name)

    def wait_ready(self, model: str | None = None, timeout: float = 30.0) -> bool:
        """Block until the model's encoding is loaded or failed; True when it is loaded."""
        name = encoding_for(model)
        self._encoding(name)
        state = self._loading.get(name)
        thread = state.thread if state else None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        return name in self._encodings

    def _pick(self, model: str | None) -> tuple[str, Any | None]:
        name = encoding_for(model)
        encoding = self._encodings.get(name)
        if encoding is None:
            encoding = self._encoding(name)
        if encoding is not None:
            return name, encoding
        for other, loaded in self._encodings.items():
            return other, loaded
        return "estimate", None

    def scheme(self, model: str | None) -> str:
        """What counts for this model are made with right now: an encoding's name, or "estimate"."""
        return self._pick(model)[0]

    def mode(self, model: str | None) -> CountMode:
        """How counts for this model are made right now."""
        return _mode_of(*self._pick(model), model)

    # -- counting ---------------------------------------------------------------------------

    def count_text(self, text: str, model: str | None = None) -> int:
        """Tokens in `text` for `model` (special-token text counts as ordinary text)."""
        if not text:
            return 0
        name, encoding = self._pick(model)
        return self._count(text, name, encoding)

    def _count(self, text: str, name: str, encoding: Any | None) -> int:
        """Count non-empty `text`, from the cache when this text was counted before.

        The key is the text's length and Python's own string hash (SipHash, keyed per
        process): a 64-bit content hash CPython may already hold for the string, about 5x
        cheaper than UTF-8 encoding and hashing it with BLAKE2 on every request. Two different
        texts share a key with odds of about 1e-10 even with the cache full.
        """
        key = (name, len(text), hash(text))
        cached = lru_hit(self._cache, key)
        if cached is not None:
            return cached
        count = len(_encode(encoding, text)) if encoding is not None else estimate_tokens(text)
        self._keep(key, count)
        return count

    def _keep(self, key: tuple[str, int, int], count: int) -> None:
        cache = self._cache
        cache[key] = count
        if len(cache) > self.cache_size:
            try:
                cache.popitem(last=False)
            except KeyError:  # emptied by other threads meanwhile
                pass

    def count_joined(self, parts: Sequence[str], model: str | None = None) -> int:
        """`count_text("".join(parts))`, from each part's own (cached) count where that is the
        same: each part but the last ends in a line break and each but the first starts with
        an ASCII letter (see `_splits_between`). A text made of the same parts turn after turn
        (a recall block of quoted messages) then encodes only its new parts.

        Example:
            >>> counter = TokenCounter(block=True)
            >>> parts = ["Earlier:\\n\\n", "user: my cat is Miso.\\n\\n", "assistant: Lovely!"]
            >>> counter.count_joined(parts, "gpt-4o") == counter.count_text("".join(parts), "gpt-4o")
            True
        """
        name, encoding = self._pick(model)
        joined = "".join(parts)
        if not (
            name in _SPLITS_AFTER_LINE_BREAKS and _splits_between(parts) and all(map(_cut_cleanly, [joined, *parts]))
        ):
            return self.count_text(joined, model)
        key = (name, len(joined), hash(joined))
        count = lru_hit(self._cache, key)
        if count is None:
            count = sum(self._count(part, name, encoding) for part in parts if part)
            self._keep(key, count)  # the joined text counts from the cache too (when it is sent)
        return count

    def count_message(self, message: Message, model: str | None = None) -> int:
        """Tokens one message costs in a prompt: overhead, role, name, text, tool calls, images, and
        the reasoning replayed beside its content (`conversation.reasoning_text`)."""
        return self._count_message(message, *self._pick(model))

    def count_each(self, messages: Iterable[Message], model: str | None = None) -> list[int]:
        """`count_message` of every message, choosing the encoding once (a turn counts them all).

        Example:
            >>> TokenCounter(block=True).count_each([{"role": "user", "content": "hi"}] * 2, "gpt-4o")
            [5, 5]
        """
        encoding_name, encoding = self._pick(model)
        count = self._count_message
        return [count(message, encoding_name, encoding) for message in messages]

    def count_each_as(self, messages: Iterable[Message], model: str | None = None) -> tuple[list[int], CountMode, str]:
        """`count_each` with how those very counts were made, `(counts, mode, scheme)`, taken
        together: an encoding that finishes loading meanwhile cannot relabel estimated counts.

        Example:
            >>> TokenCounter(block=True).count_each_as([{"role": "user", "content": "hi"}], "gpt-4o")
            ([5], 'exact', 'o200k_base')
        """
        encoding_name, encoding = self._pick(model)
        count = self._count_message
        return (
            [count(message, encoding_name, encoding) for message in messages],
            _mode_of(encoding_name, encoding, model),
            encoding_name,
        )

    def _count_message(self, message: Message, encoding_name: str, encoding: Any | None) -> int:
        content = message.get("content")
        if type(content) is str and content and _NOT_PLAIN.isdisjoint(message):
            # the common message
            return TOKENS_PER_MESSAGE + TOKENS_PER_ROLE + self._count(content, encoding_name, encoding)
        total = TOKENS_PER_MESSAGE + TOKENS_PER_ROLE
        name = message.get("name")
        if isinstance(name, str) and name:
            total += TOKENS_PER_NAME + self._count(name, encoding_name, encoding)
        call_id = message.get("tool_call_id")
        if isinstance(call_id, str) and call_id:
            total += self._count(call_id, encoding_name, encoding)
        if isinstance(content, str) and message.get("tool_calls") is None:
            text, images = content, 0  # no parts or calls to walk
        else:
            text, images = message_text(message), image_count(message)
        if text:
            total += self._count(text, encoding_name, encoding)
        reasoning = reasoning_text(message)
        if reasoning:
            total += self._count(reasoning, encoding_name, encoding)
        return total + images * self.image_tokens

    def count_messages(self, messages: Iterable[Message], model: str | None = None) -> int:
        """Tokens a whole prompt costs, reply priming included."""
        return TOKENS_PER_REPLY + sum(self.count_each(messages, model))

    def keep_ends(self, text: str, head: int, tail: int, model: str | None = None) -> tuple[str, str]:
        """The first `head` and last `tail` tokens of `text` as text (by characters when estimating),
        each of whole characters: a character whose bytes a cut token splits is left out, not
        sent as U+FFFD (an emoji or a CJK character is often two or three tokens)."""
        _, encoding = self._pick(model)
        if encoding is not None:
            ids = _encode(encoding, text)
            if head + tail >= len(ids):
                return text, ""
            # The tokens' bytes are the text's UTF-8, so the only bytes that do not decode are
            # the part of a split character at the cut edge: "ignore" leaves that part out.
            kept_head = encoding.decode_bytes(ids[:head]).decode("utf-8", "ignore")
            kept_tail = encoding.decode_bytes(ids[len(ids) - tail :]).decode("utf-8", "ignore") if tail else ""
            return kept_head, kept_tail
        # The estimate is far from uniform per character (a math letter costs 3, a space run 1):
        # take the longest ends whose own estimate fits, not a proportional share of characters.
        h = _longest_within(len(text), lambda k: estimate_tokens(text[:k]) <= head)
        t = _longest_within(len(text), lambda k: estimate_tokens(text[len(text) - k :]) <= tail) if tail else 0
        if h + t >= len(text):
            return text, ""
        return text[:h], text[len(text) - t :] if t else ""
