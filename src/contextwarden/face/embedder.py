"""Open WebUI's own embedder as the trim's `embed`: vectors fetched ahead, bounded, never waited on.

Open WebUI loads an embedding model for RAG and a filter reaches it as
`__request__.app.state.EMBEDDING_FUNCTION`: `await fn(texts, prefix=None, user=None)`, a list
of vectors (None when no embedder is loaded; a function that is not `async` is called in a worker
thread). The trim is synchronous, so before it the filter
embeds what is not cached yet (`semantic.embed_texts`: every message newest first, a long one
in its pieces; then the one-liners together with the one before them), at most `max_texts`
texts, into the process's `VECTORS`, waiting `timeout` seconds at most (0.1 by default): the
call itself runs on in the background (bounded by `EMBED_CALL_SECONDS`) and its vectors land
whenever it ends. On the user's path a turn asks only for its own newest texts
(`TURN_EMBED_TEXTS`); after each reply the filter starts the call for the rest of the chat
(`ahead`, up to `max_texts`), so the next turn finds its chat embedded; a turn that comes
before that call has asked anything goes first (the call starts again after the turn's). The
trim then only looks vectors up: when some messages' are still missing (a long chat seen for
the first time, a slow or failing embedder), that turn's relevance is lexical and later turns
fill in the rest.
A call that fails or outlives `EMBED_CALL_SECONDS` makes the embedder rest
(`BACKOFF_FIRST_SECONDS`, doubling up to `BACKOFF_MAX_SECONDS`), as the summary endpoint does:
no turn waits for it meanwhile. Once a turn's wait ran out (its own call, or one still running
from the reply before) the embedder is slow for the turn's path: for `SLOW_RECHECK_SECONDS`
(doubling while each new try runs out too, up to `SLOW_RECHECK_MAX_SECONDS`)
turns neither wait nor call (each would wait in vain, and its call would take the CPU from
the request), then one turn tries again. Vectors are normalised off the event loop.
"""

from __future__ import annotations

import asyncio
import inspect
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ..backoff import Backoff
from ..caches import MAX_EMBEDDERS, register
from ..core.conversation import Message
from ..core.excerpt import passage_texts
from ..core.semantic import VECTORS, embed_texts
from .offloop import compute, heavy

__all__ = [
    "OpenWebUIEmbedder",
    "VectorsPending",
    "EmbedderResting",
    "EmbedderSlow",
    "embedder_of",
    "DEFAULT_EMBED_TIMEOUT",
    "DEFAULT_EMBED_TEXTS",
    "TURN_EMBED_TEXTS",
]

DEFAULT_EMBED_TIMEOUT = 0.1  # seconds a turn waits for the embedder, at most (the call goes on)
EMBED_CALL_SECONDS = 30.0  # one call to the embedder, at most, in the background
BACKOFF_FIRST_SECONDS = 30.0  # after a failed call no turn asks for vectors this long...
BACKOFF_MAX_SECONDS = 600.0  # ...doubling after each further failure up to this
DEFAULT_EMBED_TEXTS = 64  # texts embedded per call after a reply, at most (newest first)
# Texts a turn asks for on the user's path, newest first: its question (a long one in pieces).
# The history is embedded after replies: a 64-text call on a CPU embedder took 10-12 s at load 6
# on 2 cores and ran through the reply beside Open WebUI (bench/browser_reply.py, +1.25 s).
TURN_EMBED_TEXTS = 4
MIN_EMBED_BATCH = 4  # after timeouts a turn still asks for this many
# After a turn's call outlived its wait, turns do not wait for (nor start) a call this long.
# MiniLM on 2 loaded CPU cores takes over 0.1 s for one question: the wait only added its 0.1 s
# and the call ran beside the request (bench/browser_reply.py, turn 2: inlet 136 ms, lexical 23).
SLOW_RECHECK_SECONDS = 60.0
SLOW_RECHECK_MAX_SECONDS = 1_800.0  # ...doubling while each try runs out again (one try a half hour)
# The call after a reply starts this long after the outlet: Open WebUI is still sending the
# status line and the page is finishing the reply; a CPU embedder beside them slowed both
# (bench/browser_reply.py at 3302b65: outlet 74 ms semantic, 29 ms lexical).
AHEAD_DELAY_SECONDS = 1.0
_adapters: OrderedDict[object, OpenWebUIEmbedder] = OrderedDict()
register("embedder._adapters", _adapters.clear)


class VectorsPending(LookupError):
    """Some messages have no vector yet: this turn's relevance is lexical."""


class EmbedderResting(RuntimeError):
    """The embedder failed lately and is not asked again before its back-off ends."""


class EmbedderSlow(TimeoutError):
    """The embedder is busy or lately slower than a turn's wait: this turn neither waits nor calls."""


class OpenWebUIEmbedder:
    """One of Open WebUI's embedding functions, seen by the trim as an `embed` that only looks up.

    One instance per function (see `embedder_of`), so its vectors keep their key space in
    `VECTORS` from turn to turn and a new model's vectors never mix with an old one's.
    """

    def __init__(self, function: Any) -> None:
        self._function = function
        self._batch: int | None = None  # texts a turn asks for now: halved on a timeout, doubled back
        self._running: asyncio.Task[int] | None = None  # the one call in flight, kept past a timeout
        self._due = 0.0  # (loop time) when the running call reaches the embedder: an `ahead` call waits first
        self._waiting: list[str] = []  # what the running call asks for
        self._rest = Backoff()  # after failed calls (loop time): no call starts
        self._slow = Backoff()  # after turns' waits ran out (loop time): no turn waits

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
        waits for it within its own timeout rather than start another beside it, but for the call
        after a reply still waiting out its delay (`ahead`): nothing asked yet, it gives way to
        the turn's own and starts again after it. After a wait that ran out, turns raise
        `EmbedderSlow` at once for `SLOW_RECHECK_SECONDS` (doubling).
        Raises what the embedder raises (and TimeoutError); the caller logs it and goes on.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if self._slow.resting(loop.time()):
            raise EmbedderSlow(f"slower than the wait lately; tried again in {self._slow.until - loop.time():.0f} s")
        todo = await self.todo(messages, max_texts)
        running, put_back = self._running, self._gave_way()
        if not put_back and running is not None and not running.done() and running.get_loop() is loop:
            await asyncio.wait({running}, timeout=timeout)  # its outcome was its own turn's to log
            if not running.done() or loop.time() >= deadline:
                self._slow.failed(loop.time(), SLOW_RECHECK_SECONDS, SLOW_RECHECK_MAX_SECONDS)
                raise TimeoutError("the previous call is still running")
            todo = None if todo is None else VECTORS.missing(todo, self)  # less what that call brought
        try:
            started = self._start(messages, max_texts, todo=todo)
        finally:
            if put_back:  # the call that gave way, again once the turn's own has ended
                self._after(self._running, put_back)
        if started is None:
            return 0
        task, asked = started
        try:
            done = await asyncio.wait_for(asyncio.shield(task), max(0.0, deadline - loop.time()))
        except TimeoutError:
            self._slow.failed(loop.time(), SLOW_RECHECK_SECONDS, SLOW_RECHECK_MAX_SECONDS)
            # A slow embedder (CPU, batch size 1) must still make progress: ask for less next time
            # (a turn's own few texts say nothing of the batch the history's calls can take).
            if max_texts > MIN_EMBED_BATCH:
                self._batch = max(MIN_EMBED_BATCH, asked // 2)
            raise
        if self._batch and max_texts > MIN_EMBED_BATCH:
            self._batch = min(max_texts, 2 * done)
        self._slow.succeeded()
        return done

    def ahead(
        self,
        messages: Sequence[Message],
        *,
        max_texts: int,
        delay: float | None = None,
        todo: list[str] | None = None,
    ) -> bool:
        """Start embedding a chat's uncached messages, without waiting (after a reply, so the
        next turn finds them), `delay` seconds from now (default `AHEAD_DELAY_SECONDS`); True
        when a call was set to start. `todo`: those texts (`missing`), when the caller read a
        big chat off the event loop. Never raises."""
        running = self._running
        if running is not None and not running.done():
            return False
        try:
            wait = AHEAD_DELAY_SECONDS if delay is None else delay
            return self._start(messages, max_texts, wait, todo) is not None
        except Exception:  # resting, or the texts could not be read: the next turn tries again
            return False

    async def todo(self, messages: Sequence[Message], max_texts: int) -> list[str] | None:
        """`missing`, read in the contextwarden thread for a big chat (`offloop.heavy`: 1,000
        messages of ~2 KB held the loop 37-72 ms); None for a small one, read where it is used."""
        return await compute(True, self.missing, messages, max_texts) if heavy(messages) else None

    def missing(self, messages: Sequence[Message], max_texts: int) -> list[str]:
        """Up to `max_texts` (less after timeouts) of a chat's texts without a vector, newest first:
        reading every message, so a big chat's are read off the event loop (`ahead`'s `todo`)."""
        return VECTORS.missing(embed_texts(messages) + passage_texts(messages), self)[: self.batch(max_texts)]

    def _start(
        self, messages: Sequence[Message], max_texts: int, delay: float = 0.0, todo: list[str] | None = None
    ) -> tuple[asyncio.Task[int], int] | None:
        """The call for up to `max_texts` uncached texts, newest first (`todo` when given), and how
        many it asks for (None: nothing to embed), made after `delay` seconds.

        Raises:
            EmbedderResting: a call failed lately; none starts before its back-off ends.
        """
        loop = asyncio.get_running_loop()
        if self._rest.resting(loop.time()):
            raise EmbedderResting(f"resting {self._rest.until - loop.time():.0f} s more after a failed call")
        todo = self.missing(messages, max_texts) if todo is None else todo
        if not todo:
            return None
        return self._call(todo, delay), len(todo)

    def _call(self, todo: list[str], delay: float) -> asyncio.Task[int]:
        """Start the one call for `todo`, `delay` seconds from now."""
        task = self._running = asyncio.ensure_future(self._fetch(todo, delay))
        self._due, self._waiting = asyncio.get_running_loop().time() + delay, todo
        task.add_done_callback(_retrieve)
        return task

    def _gave_way(self) -> list[str]:
        """The texts of the call after a reply, cancelled while it still waits out its delay (a
        turn came: the reply is done, and the turn's own texts go first); [] when there is none."""
        running, loop = self._running, asyncio.get_running_loop()
        if running is None or running.done() or running.get_loop() is not loop or loop.time() >= self._due:
            return []
        running.cancel()
        return self._waiting

    def _after(self, task: asyncio.Task[int] | None, texts: list[str]) -> None:
        """Embed `texts` again after `task` (now when None or done), as a call after a reply."""

        def again(_: object = None) -> None:
            running = self._running
            if (running is None or running.done()) and not self._rest.resting(asyncio.get_running_loop().time()):
                if todo := VECTORS.missing(texts, self):
                    self._call(todo, AHEAD_DELAY_SECONDS)

        if task is None or task.done():
            again()
        else:
            task.add_done_callback(again)

    async def _fetch(self, todo: list[str], delay: float = 0.0) -> int:
        """One call to the embedding function (at most EMBED_CALL_SECONDS) after `delay` seconds;
        its vectors go into `VECTORS`, however late, normalised off the event loop. A failure
        starts a back-off."""
        if delay > 0:
            await asyncio.sleep(delay)
        try:
            vectors = await asyncio.wait_for(_called(self._function, todo), EMBED_CALL_SECONDS)
            if not isinstance(vectors, list):
                raise TypeError(f"the embedder returned {type(vectors).__name__}, not a list")
            await asyncio.to_thread(VECTORS.put, todo, vectors, self)
        except Exception:
            self._rest.failed(asyncio.get_running_loop().time(), BACKOFF_FIRST_SECONDS, BACKOFF_MAX_SECONDS)
            raise
        self._rest.succeeded()
        return len(todo)


async def _called(function: Any, texts: list[str]) -> object:
    """`function(texts, prefix=None, user=None)`, awaited: in a worker thread unless it is `async`
    (a synchronous one, a CPU model's encode, held the loop for the whole call)."""
    call = type(function).__call__  # an object whose __call__ is async is awaited as it is
    if inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(call):
        return await function(texts, prefix=None, user=None)
    answer = await asyncio.to_thread(function, texts, prefix=None, user=None)
    return await answer if inspect.isawaitable(answer) else answer


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
