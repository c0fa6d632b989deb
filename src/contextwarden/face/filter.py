"""`Filter`: the Open WebUI face. Reads what Open WebUI passes, hands each hook's work to its two
collaborators, and returns the body.

The trim path (`trimpass.TrimPass`: each pass of a turn) and the bookkeeping path
(`bookkeeping.Bookkeeping`: limits, usage, spend, the ledger) do the work; the filter holds the
valves and the settings read from them, the store they name, the prices, the problems told to
the admin, and the fail-open wrapper: every hook fails open, on any internal error the body
goes on as it came. One instance serves every user of a worker: per-request values live in
locals and in `__metadata__` (which Open WebUI hands from `inlet`/`request` to `outlet`), never
on `self`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from ..caches import SETTINGS_MEMO_SIZE
from ..core.tokens import TokenCounter, preload_encodings
from ..errors import ConfigError, TurnRefused
from ..money.price_sources import PriceSources
from ..money.pricing import Resolution, resolve_model
from ..state.store import MemoryStore, Store, open_store
from .adminview import without_usage_exchanges
from .bookkeeping import Bookkeeping
from .faults import FaultKey, Faults
from .hookargs import Emitter, is_chat_body, model_context_length, told_as_admin, wants_stream_usage, with_stream_usage
from .offloop import compute, many_messages, take_turn
from .trimpass import MAX_REPORTED_PROBLEMS, TrimPass
from .valves import Settings, UserValves, Valves, read_settings, valves_key

__all__ = ["Filter", "model_context_length", "wants_stream_usage"]

filter_log = logging.getLogger("contextwarden")

# What a hook lets through: the rest, BaseExceptions included (tiktoken's pyo3 PanicException
# is one), fails open. Cancellation and shutdown are not errors of the filter's.
NEVER_SWALLOWED = (asyncio.CancelledError, KeyboardInterrupt, SystemExit, GeneratorExit)


preload_encodings()  # when Open WebUI loads this module: its first request should count exactly


class Filter:
    """contextwarden for Open WebUI: trims each request to a token budget and logs real usage."""

    Valves = Valves
    UserValves = UserValves

    def __init__(
        self,
        *,
        store: Store | None = None,
        counter: TokenCounter | None = None,
        clock: Callable[[], datetime] | None = None,
        prices: Callable[[Callable[[], Store]], PriceSources] | None = None,
    ) -> None:
        """Open WebUI makes it with no arguments; each argument replaces one part (tests, embedding).

        Args:
            store: shared state; given, it is used whatever the `redis_url` valve says
                (default: in-process, then the valve's Redis once it is set).
            counter: the token counter (default: one that loads encodings in the background).
            clock: the current time, timezone-aware, in any zone (default: UTC now); days and
                months of limits and the ledger are its UTC days and months.
            prices: builds the price sources from a function returning the current store
                (default: `PriceSources`, which fetches OpenRouter in the background).
        """
        self.valves = self.Valves()
        self._counter = counter or TokenCounter()
        self._store: Store = store or MemoryStore()
        self._store_given = store is not None
        self._store_url = ""
        self._store_problem: ConfigError | None = None
        self._reported: set[str] = set()
        self._faults = Faults()
        self._settings_memo: dict[tuple, tuple[Settings, list[ConfigError]]] = {}
        self._prices = (prices or PriceSources)(lambda: self._store)
        self._now: Callable[[], datetime] = (lambda: clock().astimezone(UTC)) if clock else (lambda: datetime.now(UTC))
        self._passes = TrimPass(
            counter=self._counter,
            store=lambda: self._store,
            resolve=self._resolve,
            report=self._report,
            warn_once=self._warn_once,
            reported=self._reported,
        )
        self._books = Bookkeeping(
            counter=self._counter,
            store=lambda: self._store,
            now=lambda: self._now(),
            settings=lambda user: self._settings(user, None),  # problems are shown once, by the trim
            resolve=self._resolve,
            warn_once=self._warn_once,
        )

    @property
    def store(self) -> Store:
        """The store this filter uses now (it changes with the `redis_url` valve unless one was given)."""
        return self._store

    @property
    def counter(self) -> TokenCounter:
        """The token counter this filter counts with."""
        return self._counter

    @property
    def prices(self) -> PriceSources:
        """Where this filter's prices come from (admin file, live OpenRouter, bundled)."""
        return self._prices

    # -- hooks ------------------------------------------------------------------------------

    async def inlet(
        self,
        body: dict,
        __user__: dict | None = None,
        __metadata__: dict | None = None,
        __model__: dict | None = None,
        __event_emitter__: Emitter | None = None,
        __request__: Any = None,
    ) -> dict:
        """Refuse a turn over its spending limit (or answer `!usage`); then trim, before Open WebUI
        adds RAG, memory and tools (older versions only have this hook). One fault logs one
        warning however many of these steps it fails (`Faults`)."""
        seen: set[FaultKey] = set()
        await take_turn()  # hooks started together take turns on the loop
        try:
            await self._books.before_turn(body, __user__, __metadata__, __event_emitter__, __request__)
        except (TurnRefused, *NEVER_SWALLOWED):
            raise  # on purpose: Open WebUI shows a refusal's text to the user (AnsweredInChat: nothing)
        except BaseException as exc:
            self._faults.log("inlet", exc, "limits not checked", "turn allowed", seen)
        args = (body, __user__, __metadata__, __model__, __event_emitter__, __request__)
        out = await self._trim_hook("inlet", *args, seen=seen)
        try:
            await self._books.start_turn(out, __user__, __metadata__, __model__)
        except (TurnRefused, *NEVER_SWALLOWED):
            raise
        except BaseException as exc:
            self._faults.log("inlet", exc, "turn not charged", "turn allowed", seen)
        return out

    async def request(
        self,
        body: dict,
        __user__: dict | None = None,
        __metadata__: dict | None = None,
        __model__: dict | None = None,
        __event_emitter__: Emitter | None = None,
        __request__: Any = None,
    ) -> dict:
        """Trim right before each provider call, after RAG and tools were added (idempotent)."""
        return await self._trim_hook("request", body, __user__, __metadata__, __model__, __event_emitter__, __request__)

    async def stream(self, event: Any, __metadata__: dict | None = None) -> Any:
        """Watch a streamed reply as it goes: how much it carried, and each provider call's
        usage (settled at once: a stream the user stops gets no outlet). Returns the event as it came."""
        try:
            await self._books.stream_event(__metadata__, event)
        except NEVER_SWALLOWED:
            raise
        except BaseException as exc:  # a warning once a fault and process: this runs for every chunk
            self._faults.log("stream", exc, "stream chunk not read", "the reply goes on, its usage may be missed")
        return event

    async def outlet(
        self,
        body: dict,
        __user__: dict | None = None,
        __metadata__: dict | None = None,
        __model__: dict | None = None,
        __event_emitter__: Emitter | None = None,
        __request__: Any = None,
    ) -> dict:
        """Log what the reply really used: one `usage {json}` line, and a status line; start
        embedding the chat for the next turn."""
        await take_turn()
        try:
            await self._record(body, __user__, __metadata__, __model__, __event_emitter__, __request__)
        except NEVER_SWALLOWED:
            raise
        except BaseException as exc:
            return await self._failed("outlet", exc, body, __user__, __event_emitter__)
        return body

    # -- inlet / request ----------------------------------------------------------------------

    async def _trim_hook(
        self,
        hook: str,
        body: Any,
        user: dict | None,
        metadata: dict | None,
        model: dict | None,
        emit: Emitter | None,
        request: Any = None,
        *,
        seen: set[FaultKey] | None = None,
    ) -> Any:
        """`inlet` and `request`: trim, ask for stream usage; on any error the body as it came."""
        await take_turn()
        try:
            trimmed = await self._trim(body, user, metadata, model, emit, request, hook)
        except NEVER_SWALLOWED:
            raise
        except BaseException as exc:
            return await self._failed(hook, exc, body, user, emit, seen)
        return self._ask_stream_usage(trimmed, user, model)

    async def _trim(
        self,
        body: Any,
        user: dict | None,
        metadata: dict | None,
        model: dict | None,
        emit: Emitter | None,
        request: Any = None,
        hook: str = "request",
    ) -> Any:
        """One pass over a request: a chat to trim (not a task's, not in mode `off`) goes to the
        trim path; `!usage` exchanges are never sent on, whatever the mode."""
        if not is_chat_body(body):
            return body
        metadata = metadata if isinstance(metadata, dict) else body.get("metadata")
        if isinstance(metadata, dict) and metadata.get("task"):
            return body
        settings = await self._settings(user, emit if hook == "inlet" else None)  # valve problems: once a turn
        messages = body["messages"]
        kept = await compute(many_messages(messages), without_usage_exchanges, messages)
        if kept is not None:
            body = {**body, "messages": kept}
        if settings.mode == "off":
            return body
        settings = self._books.billing_summaries(settings, body, user, metadata)  # a summary call is the user's cost
        return await self._passes.run(body, user, metadata, model, emit, settings, request, hook)

    # -- outlet -----------------------------------------------------------------------------

    async def _record(
        self,
        body: Any,
        user: dict | None,
        metadata: dict | None,
        model: dict | None,
        emit: Emitter | None,
        request: Any = None,
    ) -> None:
        """After a reply: the chat embedded ahead for the next turn, the reply booked (usage,
        ledger, spend, what it teaches) and counted for the next turn, and the turn's one status line."""
        if not is_chat_body(body) or not body["messages"]:
            return
        settings = await self._settings(user, None)  # valve problems were shown before the reply
        await self._passes.embed_for_next_turn(body["messages"], settings, request)
        booked = await self._books.reply(body, user, metadata, model, settings, emit)
        await self._passes.count_reply(body["messages"], settings, booked.model_id, booked.off)
        line = await self._books.reply_line(settings, user, booked, shown=emit is not None)
        if line is not None:
            await self._emit(emit, line)
        await self._tell_window(booked.model_id, user, emit)
        if emit is not None:
            await self._faults.tell_later(user, lambda text: self._notify(emit, text))

    async def _tell_window(self, model_id: str, user: dict | None, emit: Emitter | None) -> None:
        """Show an admin the model's small-window notice (`WindowNotices`), once, after the reply:
        a notification (Open WebUI shows it whole, at once, and does not save it into the chat)."""
        if emit is None or (user or {}).get("role") != "admin":
            return
        if (text := self._passes.windows.take(model_id)) is None:
            return
        await self._notify(emit, f"contextwarden: {text}")

    @staticmethod
    async def _notify(emit: Emitter, text: str) -> None:
        """A warning notification: shown whole, at once, and not saved into the chat."""
        try:
            await emit({"type": "notification", "data": {"type": "warning", "content": text}})
        except Exception as exc:  # a broken emitter must not cost the chat
            filter_log.debug("contextwarden: notice not shown (%s)", type(exc).__name__)

    # -- prices, stream usage, settings ---------------------------------------------------------

    async def _resolve(self, settings: Settings, model_id: str, emit: Emitter | None) -> Resolution:
        """The price-book model for an id (admin file > live OpenRouter > bundled)."""
        book, problems = await self._prices.book(
            openrouter=settings.openrouter_pricing,
            ttl_hours=settings.pricing_ttl_hours,
            pricing_file=settings.pricing_file,
        )
        for problem in problems:
            await self._report(problem, emit)
        return resolve_model(
            model_id,
            book,
            aliases=settings.model_aliases,
            prefixes=settings.connection_prefixes,
            free_models=settings.free_models,
        )

    def _ask_stream_usage(self, body: Any, user: dict | None, model: dict | None) -> Any:
        """The body with `stream_options.include_usage` when the backend should be asked."""
        try:
            if not isinstance(body, dict) or not wants_stream_usage(body, model):
                return body
            user_valves = user.get("valves") if isinstance(user, dict) else None
            settings = self._read_settings(user_valves)[0]
            if settings.mode != "enforce" or not settings.request_stream_usage:
                return body  # shadow and off send the body exactly as it came
            return with_stream_usage(body)
        except Exception as exc:  # never cost the turn
            filter_log.debug("contextwarden: stream usage not requested (%s)", type(exc).__name__)
            return body

    # -- shared helpers -----------------------------------------------------------------------

    async def _settings(self, user: dict | None, emit: Emitter | None) -> Settings:
        """The turn's settings; valve problems are logged once, and shown (never their values)
        to admins only, since other users cannot fix them: pass `emit` on one pass a turn."""
        user_valves = user.get("valves") if isinstance(user, dict) else None
        if not told_as_admin(user):
            emit = None
        settings, problems = self._read_settings(user_valves)
        for problem in problems:
            await self._report(problem, emit)
        if settings.redis_url != self._store_url and not self._store_given:
            self._store_problem, left = None, self._store
            try:
                self._store = open_store(settings.redis_url)
            except ConfigError as exc:
                self._store_problem = exc
                self._store = MemoryStore()
            self._store_url = settings.redis_url
            await self._books.retire(left)  # kept until the turns charged in it are settled there
        if self._store_problem is not None:  # told on every call, like any other bad valve
            await self._report(self._store_problem, emit)
        return settings

    def _read_settings(self, user_valves: object | None) -> tuple[Settings, list[ConfigError]]:
        """`read_settings`, remembered by the valves' values (Open WebUI builds new valve objects
        for every request; reading them costs more than a short chat's whole trim)."""
        key = (valves_key(self.valves), valves_key(user_valves))
        if None in key:
            return read_settings(self.valves, user_valves)
        try:
            read = self._settings_memo.get(key)
        except TypeError:  # a valve value that cannot be hashed: read every time
            return read_settings(self.valves, user_valves)
        if read is None:
            read = read_settings(self.valves, user_valves)
            if len(self._settings_memo) >= SETTINGS_MEMO_SIZE:
                self._settings_memo.clear()
            self._settings_memo[key] = read
        return read

    async def _report(self, problem: ConfigError, emit: Emitter | None) -> None:
        """Tell the admin about a bad valve: a warning once per process, a status every time."""
        text = f"contextwarden: {problem}"
        self._warn_once(f"{text} (valve {problem.valve})")
        await self._emit(emit, text)

    def _warn_once(self, text: str) -> None:
        """One warning per distinct text per process (at most MAX_REPORTED_PROBLEMS), then debug."""
        if text not in self._reported and len(self._reported) < MAX_REPORTED_PROBLEMS:
            self._reported.add(text)
            filter_log.warning("%s", text)
        else:
            filter_log.debug("%s", text)

    async def _failed(
        self,
        hook: str,
        exc: BaseException,
        body: Any,
        user: dict | None,
        emit: Emitter | None,
        seen: set[FaultKey] | None = None,
    ) -> Any:
        """Fail open: the body as it came, one log line, and an admin's status once a fault."""
        key = self._faults.log(hook, exc, f"{hook} failed", "body passed through unchanged", seen)
        if emit is not None and self._faults.tell_now(key, user):
            await self._emit(
                emit, f"contextwarden skipped this {'reply' if hook == 'outlet' else 'turn'} (internal error)"
            )
        return body

    @staticmethod
    async def _emit(emit: Emitter | None, description: str) -> None:
        if emit is None:
            return
        try:
            await emit({"type": "status", "data": {"description": description, "done": True}})
        except Exception as exc:  # a broken emitter must not cost the chat
            filter_log.debug("contextwarden: status not shown (%s)", type(exc).__name__)
