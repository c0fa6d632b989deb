"""Open WebUI's own embedder as the trim's `embed`: vectors fetched ahead, bounded, never waited on.

Open WebUI loads an embedding model for RAG and a filter reaches it as
`__request__.app.state.EMBEDDING_FUNCTION`: `await fn(texts, prefix=None, user=None)`, a list
of vectors (None when no embedder is loaded). The trim is synchronous, so before it the filter
embeds what is not cached yet (`semantic.embed_texts`: every message newest first, a long one
in its pieces; then the one-liners together with the one before them), at most `max_texts`
texts within `timeout` seconds, into the process's `VECTORS`. The trim then only looks vectors
up: when some messages' are still missing (a long chat seen for the first time, a slow or
failing embedder), that turn's relevance is lexical and later turns fill in the rest.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from .caches import MAX_EMBEDDERS, register
from .conversation import Message
from .semantic import VECTORS, embed_texts

__all__ = ["OpenWebUIEmbedder", "VectorsPending", "embedder_of", "DEFAULT_EMBED_TIMEOUT", "DEFAULT_EMBED_TEXTS"]

DEFAULT_EMBED_TIMEOUT = 2.0  # seconds a turn waits for the embedder, at most
DEFAULT_EMBED_TEXTS = 64  # texts embedded per turn, at most (newest first)
MIN_EMBED_BATCH = 4  # after timeouts a turn still asks for this many
_adapters: OrderedDict[object, OpenWebUIEmbedder] = OrderedDict()
register("embedder._adapters", _adapters.clear)


class VectorsPending(LookupError):
    """Some messages have no vector yet: this turn's relevance is lexical."""


class OpenWebUIEmbedder:
    """One of Open WebUI's embedding functions, seen by the trim as an `embed` that only looks up.

    One instance per function (see `embedder_of`), so its vectors keep their key space in
    `VECTORS` from turn to turn and a new model's vectors never mix with an old one's.
    """

    def __init__(self, function: Any) -> None:
        self._function = function
        self._batch: int | None = None  # texts a turn asks for now: halved on a timeout, doubled back
        self._running: asyncio.Task[int] | None = None  # the one call in flight, kept past a timeout

    def batch(self, max_texts: int) -> int:
        """How many texts the next turn asks for: `max_texts`, less after timeouts."""
        return max(1, min(max_texts, self._batch or max_texts))

    def __call__(self, texts: list[str]) -> list[list[float]]:
        """Called by the trim only for texts without a vector: they were not fetched in time."""
        raise VectorsPending(f"{len(texts)} messages not embedded yet")

    async def prefetch(self, messages: Sequence[Message], *, timeout: float, max_texts: int) -> int:
        """Embed up to `max_texts` uncached messages, newest first, within `timeout`; how many.

        One call at a time: a call that outlives a turn's `timeout` goes on, and its vectors are
        kept when it lands (the embedder's thread runs on whether awaited or not); a later turn
        waits for it within its own timeout rather than start another beside it.
        Raises what the embedder raises (and TimeoutError); the caller logs it and goes on.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        running = self._running
        if running is not None and not running.done() and running.get_loop() is loop:
            await asyncio.wait({running}, timeout=timeout)  # its outcome was its own turn's to log
            if not running.done() or loop.time() >= deadline:
                raise TimeoutError("the previous call is still running")
        todo = VECTORS.missing(embed_texts(messages), self)[: self.batch(max_texts)]
        if not todo:
            return 0
        task = self._running = asyncio.ensure_future(self._fetch(todo))
        task.add_done_callback(_retrieve)
        try:
            done = await asyncio.wait_for(asyncio.shield(task), max(0.0, deadline - loop.time()))
        except TimeoutError:
            # A slow embedder (CPU, batch size 1) must still make progress: ask for less next time.
            self._batch = max(MIN_EMBED_BATCH, len(todo) // 2)
            raise
        self._batch = min(max_texts, 2 * done) if self._batch else None
        return done

    async def _fetch(self, todo: list[str]) -> int:
        """One call to the embedding function; its vectors go into `VECTORS`, however late."""
        vectors = await self._function(todo, prefix=None, user=None)
        if not isinstance(vectors, list):
            raise TypeError(f"the embedder returned {type(vectors).__name__}, not a list")
        VECTORS.put(todo, vectors, self)
        return len(todo)


def _retrieve(task: asyncio.Task[int]) -> None:
    """Read a finished call's outcome, so a failure nobody awaited is not reported as lost
    (the turn that waited for it has logged it already, or its timeout)."""
    if not task.cancelled():
        task.exception()


def embedder_of(request: Any) -> OpenWebUIEmbedder | None:
    """The adapter for the embedder Open WebUI has loaded (`request.app.state`), or None."""
    state = getattr(getattr(request, "app", None), "state", None)
    function = getattr(state, "EMBEDDING_FUNCTION", None)
    if function is None or not callable(function):
        return None
    adapter = _adapters.get(function)
    if adapter is None:
        adapter = _adapters[function] = OpenWebUIEmbedder(function)
        while len(_adapters) > MAX_EMBEDDERS:
            _adapters.popitem(last=False)
    return adapter
