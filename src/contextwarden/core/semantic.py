"""Semantic similarity from an embedder: each message's cosine to the question.

Relevance fuses it into its base signal (see `relevance.score_messages`); without an embedder,
or when one is missing, slow or failing, scores stay lexical. Vectors are kept per process
by the text's hash, so a chat that goes on embeds only its new messages.

An embedder is any `fn(texts: list[str]) -> list[list[float]]` (one vector per text, any
length, same length for all). The filter adapts Open WebUI's async `EMBEDDING_FUNCTION` to
this by embedding ahead of the trim and handing the trim a lookup into the cache.

A message longer than `PIECE_CHARS` is embedded in pieces (whole lines, a long line cut at
sentence ends) and is as close to the question as its closest piece: a mean-pooling embedder
(MiniLM) blurs the one line that matters into the rest of a long message. The pieces cover
the same `EMBED_CHARS` a message embedded whole would (bench/quality.py, reshaped chats).

A one-liner that follows a one-liner ("Yes, with the kids last week!") says little alone: it
is also embedded together with the message before it (`context_window`), and `CONTEXT_SHARE`
of its similarity comes from that window. bench/quality.py with MiniLM, all evidence kept at
2k / 8k: LoCoMo 0.797 / 0.911 -> 0.800 / 0.921 (both halves gain at 8k), reshaped chats
0.734 / 0.909 -> 0.734 / 0.912; windows over long messages too lost on the reshaped chats.

Memory limits (per process): at most `DEFAULT_VECTOR_CACHE_SIZE` (8,192) vectors and
`DEFAULT_VECTOR_CACHE_BYTES` (16 MiB) in all, least recently used out, stored as float32: 8,192
at 384 dimensions (MiniLM: 1.8 KiB each with its key, 14.5 MiB measured), ~2,600 at 1,536, ~1,300
at 3,072. A vector over `MAX_DIMENSIONS` (8,192), or of another length than the embedder's
others, fails the embedder's answer (a new length is kept from the next answer on).
"""

from __future__ import annotations

import hashlib
import math
import re
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Sequence
from itertools import chain
from operator import mul

from ..caches import DEFAULT_VECTOR_CACHE_BYTES, DEFAULT_VECTOR_CACHE_SIZE, MAX_EMBEDDERS, WeighedLRU, lru_hit, register
from .conversation import SYSTEM_ROLES, Message, message_text

__all__ = [
    "Embed",
    "VectorCache",
    "VECTORS",
    "similarities",
    "embed_pieces",
    "embed_texts",
    "context_window",
    "PIECE_CHARS",
    "CONTEXT_SHARE",
    "SEMANTIC_SHARE",
    "DEFAULT_VECTOR_CACHE_SIZE",
    "DEFAULT_VECTOR_CACHE_BYTES",
    "MAX_DIMENSIONS",
]

Embed = Callable[[list[str]], Sequence[Sequence[float]]]

SEMANTIC_SHARE = 0.35  # of the base relevance signal; the rest is lexical (BM25). bench/quality.py
EMBED_CHARS = 2_000  # text embedded per message: MiniLM reads 256 word pieces (~1,000 chars) anyway
PIECE_CHARS = 250  # a longer message is embedded in pieces of about this (a line or two)
CONTEXT_SHARE = 0.65  # of a one-liner's similarity, from it embedded with the one-liner before it
MAX_DIMENSIONS = 8_192  # a longer vector is refused (the embedder's answer fails): 3,072 is the largest in use
VECTOR_ENTRY_BYTES = 256  # a cached vector's key and its place in the cache, beside its array (tracemalloc)
_DIALOGUE_ROLES = ("user", "assistant")
_SENTENCE_ENDS = re.compile(r"(?<=[.!?;])\s+")


def embed_pieces(message: Message) -> list[str]:
    """The texts a message is embedded as: its plain text when it holds at most `PIECE_CHARS`;
    else its lines packed into pieces of at most `PIECE_CHARS` (a longer line cut at sentence
    ends, a longer sentence into `PIECE_CHARS` stretches), together at most `EMBED_CHARS`.

    Example:
        >>> embed_pieces({"role": "user", "content": "short"})
        ['short']
        >>> [len(p) for p in embed_pieces({"role": "user", "content": "\\n".join(["x" * 100] * 5)})]
        [201, 201, 100]
    """
    return _pieces_of(message_text(message))


def _pieces_of(text: str) -> list[str]:
    """`embed_pieces` of a message whose text is `text`."""
    if len(text) <= PIECE_CHARS:
        return [text]
    pieces: list[str] = []
    current, left = "", EMBED_CHARS
    for part, joint in _parts(text):
        if current and len(current) + len(joint) + len(part) > PIECE_CHARS:
            pieces.append(current[:left])
            left -= len(current)
            current = ""
            if left <= 0:
                return pieces
        current = current + joint + part if current else part
    return [*pieces, current[:left]] if current else pieces


def context_window(messages: Sequence[Message], index: int) -> str | None:
    """The text `messages[index]` is also embedded as when it and the message before it are
    both user or assistant messages of at most `PIECE_CHARS` (neither blank): the one before,
    a line break, then it. None otherwise: a longer message carries its own context.

    Example:
        >>> chat = [{"role": "user", "content": "Did you go camping?"},
        ...         {"role": "assistant", "content": "Yes, with the kids!"}]
        >>> print(context_window(chat, 1))
        Did you go camping?
        Yes, with the kids!
        >>> context_window(chat, 0) is None
        True
    """
    if index < 1 or index >= len(messages):
        return None
    before, message = messages[index - 1], messages[index]
    if before.get("role") not in _DIALOGUE_ROLES or message.get("role") not in _DIALOGUE_ROLES:
        return None
    return _joined(message_text(before), message_text(message))


def _joined(first: str, text: str) -> str | None:
    """`context_window` of two dialogue messages whose texts are `first` and `text`."""
    if len(first) > PIECE_CHARS or len(text) > PIECE_CHARS or not first.strip() or not text.strip():
        return None
    return f"{first}\n{text}"


def embed_texts(messages: Sequence[Message]) -> list[str]:
    """Every text a chat is embedded as, in the order to fetch them: each message's pieces
    (`embed_pieces`), newest first, which a turn needs to score by meaning at all; then the
    context windows (`context_window`), newest first. System and developer messages are not
    embedded (relevance never scores them)."""
    dialogue = [i for i in range(len(messages) - 1, -1, -1) if messages[i].get("role") not in SYSTEM_ROLES]
    texts = [text for i in dialogue for text in embed_pieces(messages[i])]
    windows = (context_window(messages, i) for i in dialogue)
    return texts + [window for window in windows if window is not None]


def _parts(text: str) -> Iterator[tuple[str, str]]:
    """The non-blank lines of `text`, a line over `PIECE_CHARS` cut at sentence ends and a
    sentence over it into `PIECE_CHARS` stretches; each with what joins it to the part before."""
    for line in text.splitlines():
        if not line.strip():
            continue
        sentences = _SENTENCE_ENDS.split(line) if len(line) > PIECE_CHARS else [line]
        for k, sentence in enumerate(sentences):
            for start in range(0, len(sentence), PIECE_CHARS):
                yield sentence[start : start + PIECE_CHARS], " " if k or start else "\n"


def _key(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _vector_bytes(key: tuple[int, bytes], vector: array) -> int:
    """What a cached vector weighs: its array and `VECTOR_ENTRY_BYTES` for its key and place."""
    return sys.getsizeof(vector) + VECTOR_ENTRY_BYTES


def _unit_vector(vector: Sequence[float]) -> array:
    """`vector` as float32 of unit length (an array the exact size: one grown from a generator
    took 2.3 KiB at 384 dimensions, against 1.6); ValueError when it cannot be one."""
    if len(vector) > MAX_DIMENSIONS:
        raise ValueError(f"the embedder gave a vector of {len(vector)} dimensions (at most {MAX_DIMENSIONS})")
    values = array("f", [float(x) for x in vector])
    if not values or not all(map(math.isfinite, values)):
        raise ValueError("the embedder gave an empty or non-finite vector")
    norm = math.sqrt(math.fsum(x * x for x in values))
    return array("f", [x / norm for x in values]) if norm else values


class VectorCache:
    """Unit-length vectors by embedder and the hash of the text; bounded in count and bytes
    (`WeighedLRU`), least recently used out.

    Vectors of different embedders never mix: each embedder (the function object, or a bound
    method's object and function) gets its own key space, and the cache holds a reference to
    the last `MAX_EMBEDDERS` it saw so that a new function cannot take an old one's place.
    """

    def __init__(self, size: int = DEFAULT_VECTOR_CACHE_SIZE, max_bytes: int = DEFAULT_VECTOR_CACHE_BYTES) -> None:
        self._vectors: WeighedLRU[tuple[int, bytes], array] = WeighedLRU(
            max_entries=size, max_weight=max_bytes, weigh=_vector_bytes
        )
        self._spaces: OrderedDict[object, int] = OrderedDict()
        self._dimensions: dict[int, int] = {}  # each key space's vector length, once it holds one
        self._next_space = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._vectors)

    @property
    def bytes(self) -> int:
        """What the vectors kept weigh, as `_vector_bytes` counts."""
        return self._vectors.weight

    def clear(self) -> None:
        """Forget every vector (the embedders keep their key spaces: a number is never reused)."""
        self._vectors.clear()

    def _space(self, embed: object, dimensions: int = 0) -> tuple[int, int]:
        """`embed`'s key space and the length of the vectors it held (`dimensions` when none).
        Vectors of another length than `dimensions` (when given) leave their space behind:
        the embedder gets a new one (its old vectors are never read again, and age out)."""
        with self._lock:
            space = self._spaces.get(embed)
            before = self._dimensions.get(space, dimensions) if space is not None and dimensions else dimensions
            if space is None or before != dimensions:
                self._next_space += 1
                space = self._spaces[embed] = self._next_space
                while len(self._spaces) > MAX_EMBEDDERS:
                    self._dimensions.pop(self._spaces.popitem(last=False)[1], None)
            if dimensions:
                self._dimensions[space] = dimensions
            self._spaces.move_to_end(embed)
            return space, before

    def get(self, text: str, embed: object) -> array | None:
        """The cached vector `embed` gave for `text`, or None."""
        return self.lookup([text], embed)[0]

    def lookup(self, texts: Sequence[str], embed: object) -> list[array | None]:
        """The cached vector of each text (None where there is none); the embedder's key space
        is found once for all of them."""
        space, _ = self._space(embed)
        found = [lru_hit(self._vectors._entries, (space, _key(text))) for text in texts]
        return [v if isinstance(v, array) else None for v in found]

    def missing(self, texts: Sequence[str], embed: object) -> list[str]:
        """The distinct texts `embed` has no cached vector for, in their first order."""
        distinct = list(dict.fromkeys(texts))
        return [t for t, v in zip(distinct, self.lookup(distinct, embed), strict=True) if v is None]

    def put(self, texts: Sequence[str], vectors: Sequence[Sequence[float]], embed: object) -> None:
        """Store one vector per text (normalised). Raises ValueError on a shape that does not fit:
        another count than the texts', a vector empty, not finite or over `MAX_DIMENSIONS`, or
        lengths that differ (in the answer, or from the embedder's earlier vectors: these are
        then forgotten, so a new model behind the same function is used from its next answer)."""
        if len(vectors) != len(texts):
            raise ValueError(f"the embedder gave {len(vectors)} vectors for {len(texts)} texts")
        if not texts:
            return
        unit = [_unit_vector(v) for v in vectors]
        lengths = {len(v) for v in unit}
        if len(lengths) > 1:
            raise ValueError(f"the embedder gave vectors of {min(lengths)} to {max(lengths)} dimensions in one answer")
        space, before = self._space(embed, len(unit[0]))
        if before != len(unit[0]):
            raise ValueError(f"the embedder's vectors went from {before} to {len(unit[0])} dimensions")
        for text, vector in zip(texts, unit, strict=True):
            self._vectors.put((space, _key(text)), vector)

    def fill(self, texts: Sequence[str], embed: Embed) -> None:
        """Embed (in one call) the texts not cached yet."""
        todo = self.missing(texts, embed)
        if todo:
            self.put(todo, embed(todo), embed)


VECTORS = VectorCache()  # the process's vectors, shared by every chat (keyed by text)
register("semantic.VECTORS", VECTORS.clear)


def similarities(
    messages: Sequence[Message],
    question: int,
    cache: VectorCache,
    embed: Embed,
    *,
    fill: bool = True,
    skip: Collection[int] = (),
    context: bool = True,
    texts: Sequence[str] | None = None,
    roles: Sequence[object] | None = None,
) -> list[float] | None:
    """Cosine of each message to `messages[question]` (0 for the question and `skip`), or None.

    A message in pieces (see `embed_pieces`) counts its closest piece; a question in pieces is
    the mean of its pieces' vectors. With `context`, a one-liner after a one-liner takes
    `CONTEXT_SHARE` of its similarity from its `context_window`. Texts `embed` has no cached
    vector for are embedded first (one call); with `fill=False` only cached vectors are used
    and None says a message's are missing, so the caller scores lexically (the filter embeds
    ahead, off the trim, within its time and count limits; see `embed_texts`); a missing
    window only leaves its message scored alone. `texts`, `roles`: each message's `message_text`
    and `role`, when the caller read them (`ChatView`).

    Example:
        >>> cache = VectorCache()
        >>> fake = lambda texts: [[1.0, 0.0] if "cat" in t else [0.0, 1.0] for t in texts]
        >>> chat = [{"role": "user", "content": "my cat"}, {"role": "user", "content": "rain"},
        ...         {"role": "user", "content": "what about the cat?"}]
        >>> similarities(chat, 2, cache, fake, context=False)
        [1.0, 0.0, 0.0]
        >>> [round(s, 2) for s in similarities(chat, 2, cache, fake)]  # "rain" follows "my cat"
        [1.0, 0.65, 0.0]
    """
    text = (lambda i: message_text(messages[i])) if texts is None else texts.__getitem__
    role = (lambda i: messages[i].get("role")) if roles is None else roles.__getitem__
    pieces = {i: _pieces_of(text(i)) for i in range(len(messages)) if i not in skip}
    windows: dict[int, str] = {}
    if context:
        for i in pieces:
            if i == question or i - 1 in skip or i < 1:
                continue
            if role(i - 1) in _DIALOGUE_ROLES and role(i) in _DIALOGUE_ROLES:
                window = _joined(text(i - 1), text(i))
                if window is not None:
                    windows[i] = window
    texts = list(chain.from_iterable(pieces.values()))
    if fill:
        try:
            cache.fill([*texts, *windows.values()], embed)
        except LookupError:  # an embedder that only looks up (the filter's): windows come later
            cache.fill(texts, embed)
    found = dict(zip(texts, cache.lookup(texts, embed), strict=True))
    if question not in pieces or any(v is None for v in found.values()):
        return None
    query = _mean([found[t] for t in pieces[question]])  # type: ignore[misc]
    if any(len(v) != len(query) for v in found.values()):  # type: ignore[arg-type]
        return None
    out = [0.0] * len(messages)
    plain = query.tolist()
    for i, own in pieces.items():
        out[i] = max(_dot(found[t], plain) for t in own)  # type: ignore[arg-type]
    # A window not fetched yet (the filter fetches them after every message's own pieces)
    # leaves its message scored alone this turn.
    for i, vector in zip(windows, cache.lookup(list(windows.values()), embed), strict=True):
        if vector is not None and len(vector) == len(query):
            out[i] += CONTEXT_SHARE * (_dot(vector, plain) - out[i])
    out[question] = 0.0
    return out


def _dot(vector: array, query: list[float]) -> float:
    """The dot product, summed in order: the same on every machine (IEEE doubles), and twice
    as fast as `math.fsum` (7.6 against 15 µs at 384 dimensions; a turn of a 1,000-message
    chat of one-liners takes some 2,000)."""
    return sum(map(mul, vector, query))


def _mean(vectors: Sequence[array]) -> array:
    """The unit-length mean of unit vectors (the vector itself when there is one)."""
    if len(vectors) == 1:
        return vectors[0]
    return _unit_vector([math.fsum(column) for column in zip(*vectors, strict=True)])
