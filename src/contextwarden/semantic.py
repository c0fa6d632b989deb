"""Semantic similarity from an embedder: each message's cosine to the question.

Relevance fuses it into its base signal (see `relevance.score_messages`); without an embedder,
or when one is missing, slow or failing, scores stay lexical. Vectors are kept per process
by the text's hash, so a chat that goes on embeds only its new messages.

An embedder is any `fn(texts: list[str]) -> list[list[float]]` (one vector per text, any
length, same length for all). The filter adapts Open WebUI's async `EMBEDDING_FUNCTION` to
this by embedding ahead of the trim and handing the trim a lookup into the cache.

Memory limits (per process): at most `DEFAULT_VECTOR_CACHE_SIZE` (8,192) vectors, stored as
float32 (384 dimensions, MiniLM: 1.5 KiB each, ~13 MiB when full), least recently used out.
"""

from __future__ import annotations

import hashlib
import math
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from operator import mul

from .caches import DEFAULT_VECTOR_CACHE_SIZE, MAX_EMBEDDERS, lru_hit, register
from .conversation import Message, message_text

__all__ = [
    "Embed",
    "VectorCache",
    "VECTORS",
    "similarities",
    "embed_text",
    "SEMANTIC_SHARE",
    "DEFAULT_VECTOR_CACHE_SIZE",
]

Embed = Callable[[list[str]], Sequence[Sequence[float]]]

SEMANTIC_SHARE = 0.35  # of the base relevance signal; the rest is lexical (BM25). bench/quality.py
EMBED_CHARS = 2_000  # text embedded per message: MiniLM reads 256 word pieces (~1,000 chars) anyway


def embed_text(message: Message) -> str:
    """The text of a message as it is embedded: its plain text, cut to `EMBED_CHARS`."""
    return message_text(message)[:EMBED_CHARS]


def _key(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class VectorCache:
    """Unit-length vectors by embedder and the hash of the text; bounded, least recently used out.

    Vectors of different embedders never mix: each embedder (the function object, or a bound
    method's object and function) gets its own key space, and the cache holds a reference to
    the last `MAX_EMBEDDERS` it saw so that a new function cannot take an old one's place.
    """

    def __init__(self, size: int = DEFAULT_VECTOR_CACHE_SIZE) -> None:
        self._size = size
        self._vectors: OrderedDict[tuple[int, bytes], array] = OrderedDict()
        self._spaces: OrderedDict[object, int] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._vectors)

    def clear(self) -> None:
        """Forget every vector (the embedders keep their key spaces: a number is never reused)."""
        with self._lock:
            self._vectors.clear()

    def _space(self, embed: object) -> int:
        with self._lock:
            space = self._spaces.get(embed)
            if space is None:
                space = self._spaces[embed] = max(self._spaces.values(), default=0) + 1
                while len(self._spaces) > MAX_EMBEDDERS:
                    self._spaces.popitem(last=False)
            self._spaces.move_to_end(embed)
            return space

    def get(self, text: str, embed: object) -> array | None:
        """The cached vector `embed` gave for `text`, or None."""
        return self.lookup([text], embed)[0]

    def lookup(self, texts: Sequence[str], embed: object) -> list[array | None]:
        """The cached vector of each text (None where there is none); the embedder's key space
        is found once for all of them."""
        space = self._space(embed)
        found = [lru_hit(self._vectors, (space, _key(text))) for text in texts]
        return [v if isinstance(v, array) else None for v in found]

    def missing(self, texts: Sequence[str], embed: object) -> list[str]:
        """The distinct texts `embed` has no cached vector for, in their first order."""
        distinct = list(dict.fromkeys(texts))
        return [t for t, v in zip(distinct, self.lookup(distinct, embed), strict=True) if v is None]

    def put(self, texts: Sequence[str], vectors: Sequence[Sequence[float]], embed: object) -> None:
        """Store one vector per text (normalised); raises ValueError on a shape that does not fit."""
        if len(vectors) != len(texts):
            raise ValueError(f"the embedder gave {len(vectors)} vectors for {len(texts)} texts")
        unit = [_unit_vector(v) for v in vectors]
        space = self._space(embed)
        with self._lock:
            for text, vector in zip(texts, unit, strict=True):
                key = (space, _key(text))
                self._vectors[key] = vector
                self._vectors.move_to_end(key)
            while len(self._vectors) > self._size:
                self._vectors.popitem(last=False)

    def fill(self, texts: Sequence[str], embed: Embed) -> None:
        """Embed (in one call) the texts not cached yet."""
        todo = self.missing(texts, embed)
        if todo:
            self.put(todo, embed(todo), embed)


VECTORS = VectorCache()  # the process's vectors, shared by every chat (keyed by text)
register("semantic.VECTORS", VECTORS.clear)


def _unit_vector(vector: Sequence[float]) -> array:
    values = array("f", (float(x) for x in vector))
    if not values or not all(map(math.isfinite, values)):
        raise ValueError("the embedder gave an empty or non-finite vector")
    norm = math.sqrt(math.fsum(x * x for x in values))
    return array("f", (x / norm for x in values)) if norm else values


def similarities(
    messages: Sequence[Message],
    question: int,
    cache: VectorCache,
    embed: Embed,
    *,
    fill: bool = True,
    skip: Collection[int] = (),
) -> list[float] | None:
    """Cosine of each message to `messages[question]` (0 for the question and `skip`), or None.

    Texts `embed` has no cached vector for are embedded first (one call); with `fill=False`
    only cached vectors are used and None says some are missing, so the caller scores
    lexically (the filter embeds ahead, off the trim, within its time and count limits).

    Example:
        >>> cache = VectorCache()
        >>> fake = lambda texts: [[1.0, 0.0] if "cat" in t else [0.0, 1.0] for t in texts]
        >>> chat = [{"role": "user", "content": "my cat"}, {"role": "user", "content": "rain"},
        ...         {"role": "user", "content": "what about the cat?"}]
        >>> similarities(chat, 2, cache, fake)
        [1.0, 0.0, 0.0]
    """
    wanted = [i for i in range(len(messages)) if i not in skip]
    texts = {i: embed_text(messages[i]) for i in wanted}
    if fill:
        cache.fill(list(texts.values()), embed)
    vectors = dict(zip(texts, cache.lookup(list(texts.values()), embed), strict=True))
    query = vectors.get(question)
    if query is None or any(v is None or len(v) != len(query) for v in vectors.values()):
        return None
    out = [0.0] * len(messages)
    for i, vector in vectors.items():
        out[i] = math.fsum(map(mul, vector, query))  # type: ignore[arg-type]
    out[question] = 0.0
    return out
