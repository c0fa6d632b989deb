"""`Filter`: the Open WebUI face. Parses what Open WebUI passes, calls the core, returns the body.

One instance serves every user of a worker: per-request values live in locals and in
`__metadata__` (which Open WebUI hands from `inlet`/`request` to `outlet`), never on `self`.
Every hook fails open: on any internal error the body goes on as it came.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import UTC, datetime
from decimal import Decimal
from enum import Enum
from itertools import repeat
from typing import Any, Final

from .adminview import is_usage_command, usage_answer
from .budget import PromptBudget, fixed_cost, prompt_budget
from .cache_hints import (
    breakpoint_positions,
    breakpoint_provider,
    has_cache_markers,
    min_cacheable_tokens,
    needs_breakpoints,
    place_breakpoints,
    remove_breakpoints,
)
from .cache_stats import load_cache_stats, save_cache_stats, update_cache_stats
from .calibration import (
    Calibration,
    comparable_turn,
    load_calibration,
    save_calibration,
    update_calibration,
)
from .chatstate import ChatState, chat_state_key
from .conversation import Message, message_text
from .embedder import OpenWebUIEmbedder, embedder_of
from .errors import ConfigError, TurnRefused
from .flags import FlagRead, Flags, pin_fingerprint, read_flags
from .ledger import record_reply
from .limits import (
    BUSY_TEXT,
    STORE_DOWN_TEXT,
    InFlight,
    Limits,
    Spend,
    check_limits,
    limits_for,
    refusal_text,
    spend_text,
)
from .price_sources import PriceSources
from .pricing import Resolution, resolve_model
from .savings import (
    Savings,
    cached_prefixes,
    calibrated_tokens,
    carried_savings,
    carries_a_cut,
    estimate_savings,
    predicted_cache,
    price_caches,
    reply_savings,
)
from .spendbook import SpendBook
from .status import PENDING_KEY, TurnChoice, pending_line, shadow_status_line, status_line, usage_status
from .store import MemoryStore, RedisStore, Store, open_store
from .summarize import SUMMARY_ACK_MESSAGE, find_summary, insert_summary, summarize_trim, summary_tokens, take_summary
from .tokens import ESTIMATE_HIGH_BY, TOKENS_PER_REPLY, TokenCounter, preload_encodings
from .trim import TrimDecision, TrimResult, trim_messages
from .usage import Usage, compute_cost, read_count, read_usage, with_counts
from .usergroups import GroupReader
from .valves import MIN_BUDGET_TOKENS, MODES, Settings, UserValves, Valves, read_settings, valves_key

__all__ = ["Filter", "model_context_length", "wants_stream_usage"]

filter_log = logging.getLogger("contextwarden")

Emitter = Callable[[dict[str, Any]], Awaitable[Any]]
METADATA_KEY = "contextwarden"
MAX_REPORTED_PROBLEMS = 64
MAX_LOG_TEXT = 200  # characters of an id or note in a usage line (ids come from the client)
SETTINGS_MEMO_SIZE = 1024  # distinct (admin valves, user valves) combinations remembered
# What a hook lets through: the rest, BaseExceptions included (tiktoken's pyo3 PanicException
# is one), fails open. Cancellation and shutdown are not errors of the filter's.
NEVER_SWALLOWED = (asyncio.CancelledError, KeyboardInterrupt, SystemExit, GeneratorExit)


class _Unreadable(Enum):
    """A chat state that could not be read: the turn goes on, nothing is saved over it."""

    STATE = "unreadable"


UNREADABLE: Final = _Unreadable.STATE


# Chats with less text than this are counted and trimmed on the event loop: a cold trim of
# them takes a few ms (bench/loopstall.py: 3 ms, its stall no longer than the machine's own),
# and each hop to the thread costs the loop a GIL hand-over (up to sys.getswitchinterval()).
OFF_LOOP_MIN_CHARS = 25_000
_cpu_worker: tuple[int, ThreadPoolExecutor] | None = None  # (pid, executor): a forked child makes its own


def heavy(messages: Sequence[Message]) -> bool:
    """True when the messages hold OFF_LOOP_MIN_CHARS characters of text or more (stops counting there)."""
    size = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            size += len(content)
        elif isinstance(content, list):
            size += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        if size >= OFF_LOOP_MIN_CHARS:
            return True
    return False


async def compute(off: bool, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)`: with `off`, in the process's one contextwarden thread, so the event
    loop serves other users while a hook counts, scores or trims a big chat (tiktoken releases
    the GIL as it encodes; Python code yields it every `sys.getswitchinterval()`). One thread runs
    the calls one at a time, so the shared caches never see two trims at once. What `fn` raises
    is raised here; if the awaiting request is cancelled, the call runs to its end unseen."""
    if not off:
        return fn(*args, **kwargs)
    global _cpu_worker
    if _cpu_worker is None or _cpu_worker[0] != os.getpid():
        _cpu_worker = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="contextwarden-cpu"))
    return await asyncio.get_running_loop().run_in_executor(_cpu_worker[1], functools.partial(fn, *args, **kwargs))


ENCODING_WAIT_SECONDS = 2.0  # a fresh worker's first trims wait this long in all for tiktoken (off the loop)

preload_encodings()  # when Open WebUI loads this module: its first request should count exactly


def _dict_at(container: dict, key: str) -> dict:
    """`container[key]` when it is a dict, else a new empty one (request input is hostile)."""
    value = container.get(key)
    return value if isinstance(value, dict) else {}


def model_context_length(model: dict[str, Any] | None) -> int | None:
    """The context window Open WebUI knows for a model, if any.

    Looks at the admin's `num_ctx` parameter, then what the connection's `/models` listed
    (`context_length` from OpenRouter, `max_model_len` from vLLM, `top_provider`).
    """
    if not isinstance(model, dict):
        return None
    info = _dict_at(model, "info")
    params = _dict_at(info, "params")
    listed = _dict_at(model, "openai")
    top = _dict_at(listed, "top_provider")
    for value in (
        params.get("num_ctx"),
        listed.get("context_length"),
        listed.get("max_model_len"),
        top.get("context_length"),
        model.get("context_length"),
    ):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _base_model_id(body: dict[str, Any], model: dict[str, Any] | None) -> str:
    """The id that names the real model: a workspace model's base, else the body's model."""
    if isinstance(model, dict):
        info = model.get("info")
        if isinstance(info, dict) and isinstance(info.get("base_model_id"), str) and info["base_model_id"]:
            return info["base_model_id"]
    return str(body.get("model") or "")


def _is_chat_body(body: Any) -> bool:
    messages = body.get("messages") if isinstance(body, dict) else None
    return isinstance(messages, list) and all(map(isinstance, messages, repeat(dict)))


def _where(exc: BaseException) -> str:
    """`file:line` of the innermost frame, for a log line that carries no message text."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    last = frames[-1]
    return f"{last.filename.rsplit('/', 1)[-1]}:{last.lineno}"


def wants_stream_usage(body: dict[str, Any], model: dict[str, Any] | None) -> bool:
    """True when a streamed request goes to an OpenAI-compatible connection that should be
    asked for usage (`stream_options.include_usage`) and has not been yet.

    Not for Ollama (`owned_by == "ollama"`), arena or pipe models (a pipe may call any API),
    direct connections, or an unknown backend (`__model__` missing). Open WebUI 0.12 keeps a
    connection's Responses-API or Azure api_version setting out of `__model__`, but drops
    `stream_options` itself where those do not take it.
    """
    if body.get("stream") is not True or not isinstance(model, dict):
        return False
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        return False
    if model.get("owned_by") != "openai" or "ollama" in model or model.get("pipe") or model.get("direct"):
        return False
    return model.get("api_type") != "responses"


def _with_stream_usage(body: dict[str, Any]) -> dict[str, Any]:
    """A new body asking for usage in the stream (the input is not changed)."""
    options = _dict_at(body, "stream_options")
    return {**body, "stream_options": {**options, "include_usage": True}}


def _ids(body: dict[str, Any], user: dict | None, metadata: dict | None) -> tuple[str, str]:
    """The user id and chat id of a request ("" when unknown; API callers have no chat id)."""
    metadata = metadata or {}
    user_id = (user or {}).get("id") or metadata.get("user_id") or ""
    chat_id = metadata.get("chat_id") or body.get("chat_id") or ""
    return str(user_id), str(chat_id)


def _same_messages(a: Sequence[Message], b: Sequence[Message]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def _flags_of_turn(value: dict) -> Flags:
    """The flags an earlier pass of this turn left in `__metadata__` (none when unreadable)."""
    try:
        return Flags.from_dict(value)
    except (KeyError, TypeError, ValueError):
        return Flags()


def _usd_text(amount: Decimal | None) -> str | None:
    """An exact decimal string for a log line or note (None, and anything not plausible, is None)."""
    if amount is None or not amount.is_finite() or not -30 <= amount.adjusted() <= 30:
        return None
    return format(amount.normalize(), "f")


def _log_value(value: object) -> object:
    """An id or note for a usage line: text clipped to MAX_LOG_TEXT, numbers only when small."""
    if isinstance(value, str):
        return value[:MAX_LOG_TEXT]
    if isinstance(value, (int, float)) and abs(value) < 10**18:
        return value
    return None if value is None else type(value).__name__


def _sent_id(model_id: str, resolution: Resolution) -> str:
    """The model id the connection receives: without the Open WebUI connection prefix the price
    resolution removed (`openrouter.anthropic/claude-sonnet-4.5` -> `anthropic/claude-sonnet-4.5`)."""
    prefix = resolution.prefix
    return model_id[len(prefix) + 1 :] if prefix and model_id.startswith(prefix + ".") else model_id


def _cache_view_ok(view: object) -> bool:
    """True for a cache view an earlier pass of this turn noted (see `Filter._cache_view`)."""
    return (
        isinstance(view, dict)
        and isinstance(view.get("caches"), bool)
        and all(type(view.get(k)) is int and view[k] >= 0 for k in ("untrimmed", "trimmed", "minimum"))
    )


def _turn_so_far(choice: TurnChoice, messages_before: int, removed: int, note: dict) -> TurnChoice:
    """This pass's choice as the turn's: a later pass (request after inlet) sees what an earlier
    pass already trimmed, so its line counts from the chat the turn began with."""
    earlier, excerpts = (
        n if isinstance(n := note.get(key), int) and 0 <= n <= messages_before else 0
        for key in ("shortened", "excerpted")
    )
    return replace(
        choice,
        count_before=messages_before,
        tokens_before=choice.tokens_after + removed,
        shortened=max(choice.shortened, earlier),
        excerpted=max(choice.excerpted, excerpts),
    )


def trim_summary(note: dict) -> str:
    """` · trimmed 9 → 1 messages` for the usage line after a reply (the line left showing), from
    the turn note; "" when nothing was cut or the note is not this filter's (outlet input is hostile)."""
    savings = _dict_at(note, "savings")
    before, after = (
        read_count(v) if isinstance(v, int) else None
        for v in (savings.get("messages_before"), note.get("sent_messages"))
    )
    shortened, excerpted = (
        read_count(note.get(k)) if isinstance(note.get(k), int) else None for k in ("shortened", "excerpted")
    )
    if before is None or after is None or after > before or (before == after and not shortened and not excerpted):
        return ""
    text = (
        f" · trimmed {before:,} → {after:,} {'message' if after == 1 else 'messages'}"
        if before != after
        else " · trimmed"
    )
    return (
        text + (f", {shortened:,} shortened" if shortened else "") + (f", {excerpted:,} excerpted" if excerpted else "")
    )


def _decision(text: str | None) -> TrimDecision | None:
    """The stored decision, or None when there is none or it is from another version."""
    if text is None:
        return None
    try:
        return TrimDecision.from_json(text)
    except Exception:  # a decision written by another version is simply not reused
        filter_log.debug("contextwarden: stored trim decision not readable; starting afresh")
        return None


class Filter:
    """contextwarden for Open WebUI: trims each request to a token budget and logs real usage."""

    Valves = Valves
    UserValves = UserValves

    def __init__(self) -> None:
        self.valves = self.Valves()
        self._counter = TokenCounter()
        self._encodings_wait_until = time.monotonic() + ENCODING_WAIT_SECONDS
        self._store: Store = MemoryStore()
        self._store_url = ""
        self._store_problem: ConfigError | None = None
        self._reported: set[str] = set()
        self._settings_memo: dict[tuple, tuple[Settings, list[ConfigError]]] = {}
        self._prices = PriceSources(lambda: self._store)
        self._inflight = InFlight()
        self._spendbook = SpendBook()
        self._groups = GroupReader()
        self._now: Callable[[], datetime] = lambda: datetime.now(UTC)

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
        adds RAG, memory and tools (older versions only have this hook)."""
        try:
            await self._before_turn(body, __user__, __metadata__, __event_emitter__)
        except (TurnRefused, *NEVER_SWALLOWED):
            raise  # on purpose: Open WebUI shows a refusal's text to the user
        except BaseException as exc:
            filter_log.warning(
                "contextwarden: limits not checked (%s at %s); turn allowed", type(exc).__name__, _where(exc)
            )
        return await self._trim_hook("inlet", body, __user__, __metadata__, __model__, __event_emitter__, __request__)

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

    async def outlet(
        self,
        body: dict,
        __user__: dict | None = None,
        __metadata__: dict | None = None,
        __model__: dict | None = None,
        __event_emitter__: Emitter | None = None,
    ) -> dict:
        """Log what the reply really used: one `usage {json}` line, and a status line."""
        try:
            await self._record(body, __user__, __metadata__, __model__, __event_emitter__)
        except NEVER_SWALLOWED:
            raise
        except BaseException as exc:
            return await self._failed("outlet", exc, body, __event_emitter__)
        finally:  # after the reply is recorded: a turn racing this one sees its cost
            self._release_hold(__user__, __metadata__)
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
    ) -> Any:
        """`inlet` and `request`: trim, ask for stream usage; on any error the body as it came."""
        try:
            trimmed = await self._trim(body, user, metadata, model, emit, request, hook)
        except NEVER_SWALLOWED:
            raise
        except BaseException as exc:
            return await self._failed(hook, exc, body, emit)
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
        """One pass over a request: the budget (valves, model window, calibration), the flags and
        the chat's state in; the body to send, the turn's note for outlet and a status line out."""
        if not _is_chat_body(body):
            return body
        metadata = metadata if isinstance(metadata, dict) else body.get("metadata")
        if isinstance(metadata, dict) and metadata.get("task"):
            return body
        settings = await self._settings(user, emit if hook == "inlet" else None)  # valve problems: once a turn
        if settings.mode == "off":
            return body
        shadow = settings.mode == "shadow"
        model_id = _base_model_id(body, model)
        await self._await_encoding(model_id)
        resolution = await self._resolve(settings, model_id, emit)
        calibration = await self._calibration(settings, resolution)
        window = model_context_length(model) or (resolution.price.context_length if resolution.price else None)
        if (problem := settings.reserve_problem(window)) is not None:
            await self._report(problem, emit)
        note = metadata.get(METADATA_KEY) if isinstance(metadata, dict) else None
        note = note if isinstance(note, dict) else {}
        incoming = body["messages"]
        if isinstance(note.get("cache_marked"), dict):  # an earlier pass's breakpoints off: trim what it saw
            incoming = remove_breakpoints(incoming, note["cache_marked"])
        off = heavy(incoming)
        read = await compute(off, read_flags, incoming, allowed=settings.allowed_flags)
        flags = read.flags
        if not (flags.used or flags.refused) and isinstance(note.get("flags"), dict):
            flags = _flags_of_turn(note["flags"])  # an earlier pass of this turn removed them from the text
        budget = prompt_budget(
            settings.budget(window),
            calibration,
            fixed_cost(body, self._counter, model_id),
            flags.budget,
            ceiling=settings.window_budget(window),
        )
        key = chat_state_key(*_ids(body, user, metadata))
        state, stored_bytes = await self._load_state(key, read, flags)
        # Shadow simulates enforce turn after turn from its own unsent decisions (enforce's last
        # real one to begin with); enforce never sees a decision that was not sent.
        stored = (state.shadow_decision or state.decision) if shadow else state.decision
        chooser = replace(settings, summary=None) if shadow else settings  # no paid summary nobody sees
        embedder = embedder_of(request) if settings.semantic_relevance and settings.strategy == "relevance" else None
        choice = await self._choose(
            read.messages, flags, state, chooser, budget, model_id, _decision(stored), embedder, off=off
        )
        choice = choice.plus_fixed(budget.fixed.tokens, budget.fixed.label, budget.fixed_over, budget.total)
        if shadow and not _same_messages(read.messages, body["messages"]):  # sent as it came, flag text and all
            sent_as_is = await compute(off, self._counter.count_messages, body["messages"], model_id)
            choice = replace(choice, tokens_before=sent_as_is + budget.fixed.tokens)
        if key is not None:
            # A later pass of a turn sees the chat the first pass trimmed: the turn's decision stays.
            later_pass = bool(note.get("decided")) and _same_messages(choice.messages, read.messages)
            decision = stored if choice.decision is None or later_pass else choice.decision.to_json()
            saved = replace(state, shadow_decision=decision) if shadow else replace(state, decision=decision)
            await self._save_state(key, stored_bytes, saved, settings.state_ttl_seconds)
        removed, messages_before = carried_savings(
            note.get("savings") or {}, len(read.messages), chained=not shadow, cut_seen=carries_a_cut(read.messages)
        )
        removed_now = max(0, choice.tokens_before - choice.tokens_after)
        if choice.count_mode == "estimate":  # estimates err high: at most the chat's real size (also
            removed_now = int(removed_now / ESTIMATE_HIGH_BY)  # when a later, exact pass carries it)
        removed += removed_now
        factor = calibration.effect
        hints = (
            settings.prompt_cache_hints == "auto"
            and not shadow
            and breakpoint_provider(_sent_id(model_id, resolution), resolution.model_id, model) is not None
        )
        cache = note.get("cache") if _cache_view_ok(note.get("cache")) else None
        if cache is None:  # a later pass of this turn keeps the first pass's view: that pass saw the whole chat
            cache = await self._cache_view(
                read.messages, choice, choice.tokens_after + removed, resolution, model_id, factor, hints
            )
        savings = estimate_savings(
            choice.tokens_after + removed,
            choice.tokens_after,
            factor=factor,
            price=resolution.price,
            cache_before=predicted_cache(
                calibrated_tokens(choice.tokens_after + removed, factor),
                cache["untrimmed"],
                resolution.price,
                caches=cache["caches"],
                minimum=cache["minimum"],
            ),
            cache_after=predicted_cache(
                calibrated_tokens(choice.tokens_after, factor),
                cache["trimmed"],
                resolution.price,
                caches=cache["caches"],
                minimum=cache["minimum"],
            ),
        )
        if isinstance(metadata, dict):
            sent, sent_messages = choice.tokens_after, choice.messages
            if shadow:  # shadow sends the body as it came: counted above
                sent, sent_messages = choice.tokens_before, body["messages"]
            note.update(
                mode=settings.mode,
                estimated_prompt_tokens=sent,
                count_mode=choice.count_mode,
                budget=choice.budget,
                dropped=0 if shadow else choice.dropped,
                reused=choice.reused,
                decided=key is not None,
                calibration=calibration.effect,
                comparable=comparable_turn(sent_messages, body),
                savings={"removed": removed, "messages_before": messages_before},
                tokens_saved=savings.tokens_saved,
                cost_saved_usd=_usd_text(savings.cost_saved_usd),
                cache=cache,
            )
            if flags.used or flags.refused:
                note["flags"] = flags.to_dict()
            metadata[METADATA_KEY] = note
        if settings.show_status:
            turn = choice if shadow else _turn_so_far(choice, messages_before, removed, note)
            line = (
                shadow_status_line(choice, flags, savings, settings.show_cost) if shadow else status_line(turn, flags)
            )
            line += f" · calibrated ×{calibration.effect:.2f}" if calibration.active else ""
            if hook == "inlet" and isinstance(metadata, dict):
                note[PENDING_KEY] = line  # one line a turn: the request pass (tools added) or else outlet says it
            elif line != note.get("line"):  # a later pass that changes nothing says nothing
                await self._emit(emit, line)
                note["line"] = line
                note.pop(PENDING_KEY, None)
            if isinstance(metadata, dict):
                note.update(sent_messages=len(turn.messages), shortened=turn.shortened, excerpted=turn.excerpted)
        if shadow:
            return body
        out = choice.messages
        if hook == "request" and hints:
            out = self._with_breakpoints(out, choice, cache["minimum"], model_id, note)
        if _same_messages(out, body["messages"]):
            return body
        return {**body, "messages": out}

    def _with_breakpoints(
        self, messages: list[Message], choice: TurnChoice, minimum: int, model_id: str, note: dict
    ) -> list[Message]:
        """`messages` with prompt-cache breakpoints on the stable prefix, unless some are there already
        (another filter's, or the caller's): never a second set. What was marked is noted, so a
        later pass of this turn takes them off before it trims."""
        note.pop("cache_marked", None)
        if has_cache_markers(messages):
            return messages
        carried = len(messages) if choice.carried is None else choice.carried
        positions = breakpoint_positions(messages, self._counter.count_each(messages, model_id), carried, minimum)
        if not positions:
            return messages
        marked, undo = place_breakpoints(messages, positions)
        note["cache_marked"] = undo
        return marked

    async def _cache_view(
        self,
        messages: list[Message],
        choice: TurnChoice,
        untrimmed: int,
        resolution: Resolution,
        model_id: str,
        factor: float,
        hints: bool,
    ) -> dict[str, Any]:
        """What the provider's cache would serve (provider tokens): the untrimmed chat's previous
        prompt (`untrimmed`), the sent prompt's reused prefix (`trimmed`: all but the newest reply
        and turn when the previous selection was reused, else its system prompt); whether the model
        caches at all (learned from replies, else expected from its price and breakpoints)."""
        minimum = min_cacheable_tokens(resolution.model_id or model_id)
        view: dict[str, Any] = {"untrimmed": 0, "trimmed": 0, "caches": False, "minimum": minimum}
        if untrimmed <= choice.tokens_after or not price_caches(resolution.price):
            return view  # nothing removed (savings are 0 whatever is cached), or a model without a cache price
        expected = hints or not needs_breakpoints(resolution.model_id or model_id)
        try:
            learned = (await load_cache_stats(self._store, resolution.model_id or model_id)).caches()
        except Exception as exc:  # stats are an estimate's input: go on with the expectation
            filter_log.debug("contextwarden: cache stats not read (%s)", type(exc).__name__)
            learned = None
        view["caches"] = bool(expected if learned is None else learned)
        untrimmed_prefix, sent_prefix = cached_prefixes(
            messages,
            choice.messages,
            untrimmed,
            choice.tokens_after,
            choice.reused,
            lambda part: self._counter.count_each(part, model_id),
        )
        view["untrimmed"] = calibrated_tokens(untrimmed_prefix, factor)
        view["trimmed"] = calibrated_tokens(sent_prefix, factor)
        return view

    async def _choose(
        self,
        messages: list[Message],
        flags: Flags,
        state: ChatState,
        settings: Settings,
        prompt: PromptBudget,
        model_id: str,
        previous: TrimDecision | None,
        embedder: OpenWebUIEmbedder | None = None,
        *,
        off: bool = False,
    ) -> TurnChoice:
        """Trim `messages` (flags already removed) into what `prompt` leaves for messages, as the
        flags, the pins and `previous` say (`off`: the counting and the trim run off the event loop)."""
        counter = self._counter
        budget = prompt.messages
        if flags.full:
            costs, mode, _ = await compute(
                off, counter.count_each_as, messages, model_id
            )  # the label goes with the counts
            tokens = TOKENS_PER_REPLY + sum(costs)
            return TurnChoice(
                messages, len(messages), tokens, tokens, budget, mode, over_budget=tokens > budget, full=True
            )
        at, merged = find_summary(messages)
        base, summary, ack = take_summary(messages, at) if at is not None else (messages, None, None)
        pins = set(state.pins)
        pinned = (
            [i for i, m in enumerate(base) if m.get("role") == "user" and pin_fingerprint(m) in pins] if pins else []
        )

        def retrim(limit: int, embed: OpenWebUIEmbedder | None = None) -> TrimResult:
            return trim_messages(
                base,
                max_tokens=limit,
                model=model_id,
                token_counter=counter,
                strategy=settings.strategy,
                keep_last_turns=flags.keep or settings.keep_last_turns,
                pinned=pinned,
                previous=previous,
                low_watermark=settings.low_watermark,
                growth_turns=settings.growth_turns,
                embed=embed,
                shorten=not prompt.fixed_over,  # no cut makes it fit: send the question whole
            )

        if summary is not None:  # an earlier pass (or version) summarized: keep its note, never a second one
            cost = counter.count_message(summary, model_id) + counter.count_message(SUMMARY_ACK_MESSAGE, model_id)
            if budget - cost >= MIN_BUDGET_TOKENS:
                result = await compute(off, retrim, budget - cost)
                sent = insert_summary(result.messages, summary, ack)
                added, cost = len(sent) - len(result.messages), summary_tokens(sent, result.messages, counter, model_id)
                # the note goes out again: the line says so (a later pass's line is the one shown)
                return replace(TurnChoice.of(result, sent, extra=added, extra_tokens=cost), summarized=True)
        result = await compute(off, retrim, budget)
        if (
            embedder is not None
            and result.dropped
            and await self._embed_ahead(embedder, base, settings)
            and not result.reused
        ):
            result = await compute(off, retrim, budget, embedder)
        if settings.summary is not None and not flags.nosum and not merged and summary is None and result.dropped:
            done = await summarize_trim(
                base, result, retrim=retrim, config=settings.summary, store=self._store, counter=counter, model=model_id
            )
            if done is not None:
                chosen = TurnChoice.of(done.result, done.messages)
                return replace(
                    chosen, tokens_before=result.tokens_before, tokens_after=done.tokens, budget=budget, summarized=True
                )
        return TurnChoice.of(result, result.messages)

    async def _embed_ahead(self, embedder: OpenWebUIEmbedder, messages: list[Message], settings: Settings) -> bool:
        """Fetch this chat's missing vectors from Open WebUI's embedder, within the turn's limits.

        True when the embedder answered (the trim may use it); a failure is logged once a kind
        and the turn's relevance stays lexical."""
        try:
            await embedder.prefetch(
                messages, timeout=settings.embed_timeout_seconds, max_texts=settings.embed_max_texts
            )
        except Exception as exc:  # the embedder is Open WebUI's or a remote API: anything can fail
            reason = "embedder: " + ("timed out" if isinstance(exc, TimeoutError) else type(exc).__name__)
            if reason not in self._reported and len(self._reported) < MAX_REPORTED_PROBLEMS:
                self._reported.add(reason)
                filter_log.warning("contextwarden: %s; relevance is lexical this turn", reason)
            return False
        return True

    async def _await_encoding(self, model_id: str) -> None:
        """A fresh worker: wait, off the event loop, until the model's encoding is loaded, but
        only until ENCODING_WAIT_SECONDS after the filter was made (then trims estimate)."""
        left = self._encodings_wait_until - time.monotonic()
        if left > 0 and self._counter.mode(model_id) != "exact":
            await asyncio.to_thread(self._counter.wait_ready, model_id, left)

    async def _load_state(
        self, key: str | None, read: FlagRead, flags: Flags
    ) -> tuple[ChatState, bytes | None | _Unreadable]:
        """The chat's stored state with this turn's pin flags applied, and the bytes it was read
        from (`UNREADABLE` when the read failed or the bytes are not this version's)."""
        state = ChatState()
        stored: bytes | None | _Unreadable = None
        if key is not None:
            try:
                stored = await self._store.get(key)
                parsed = ChatState.parse(stored)
            except Exception as exc:  # state is an optimization: the turn goes on without it
                filter_log.warning("contextwarden: chat state not read (%s)", type(exc).__name__)
                parsed = None
            if parsed is None:
                stored = UNREADABLE
            state = parsed or state
        latest = read.messages[read.latest_user] if read.latest_user is not None else None
        pinning = flags.pin or flags.sticky_pin or (state.pin_mode and flags.sticky_pin is None)
        return state.with_flags(flags, pin_fingerprint(latest) if latest is not None and pinning else None), stored

    async def _save_state(self, key: str, stored: bytes | None | _Unreadable, state: ChatState, ttl: int) -> None:
        """Replace the state read as `stored`; never one that could not be read, nor one that
        changed since (a read the fallback answered while Redis was away, or another pass)."""
        if stored is UNREADABLE:
            return
        try:
            await self._store.swap(key, stored, state.to_bytes(), ttl=ttl)
        except Exception as exc:
            filter_log.warning("contextwarden: chat state not saved (%s)", type(exc).__name__)

    # -- limits -----------------------------------------------------------------------------

    async def _before_turn(self, body: Any, user: dict | None, metadata: dict | None, emit: Emitter | None) -> None:
        """Answer `!usage`, or refuse a turn over the user's limits (raises `TurnRefused`); a turn
        let through while the user is near a limit is held until its outlet."""
        if not _is_chat_body(body) or not isinstance(user, dict):
            return
        metadata = metadata if isinstance(metadata, dict) else body.get("metadata")
        if isinstance(metadata, dict) and metadata.get("task"):
            return
        settings = await self._settings(user, None)  # problems are shown once, by the trim
        user_id, role = str(user.get("id") or ""), str(user.get("role") or "")
        if is_usage_command(body["messages"]):
            limits = await self._user_limits(settings, user_id, role)
            raise TurnRefused(
                await usage_answer(
                    self._store,
                    now=self._now(),
                    admin=role == "admin",
                    user_id=user_id,
                    limits=limits,
                    rules=settings.limits,
                    emit=emit,
                    chat=bool(isinstance(metadata, dict) and metadata.get("session_id")),
                )
            )
        limits = await self._user_limits(settings, user_id, role)
        if not limits.any:
            return
        spend = await self._spend_or_none(user_id, settings)
        if spend is None:
            return
        verdict = check_limits(limits, *spend)
        if not verdict.allowed:
            filter_log.info("contextwarden: turn refused (%s limit reached)", verdict.kind)
            raise TurnRefused(refusal_text(verdict, self._now()))
        # No await from here to the hold: a racing turn of this user sees it (one event loop).
        if verdict.near and self._inflight.count(user_id):
            filter_log.info("contextwarden: turn refused (near the %s limit, another turn running)", verdict.warn_kind)
            raise TurnRefused(BUSY_TEXT)
        hold = self._inflight.hold(user_id)
        if isinstance(metadata, dict):
            note = _dict_at(metadata, METADATA_KEY)
            metadata[METADATA_KEY] = {**note, "limit_hold": hold}

    async def _user_limits(self, settings: Settings, user_id: str, role: str) -> Limits:
        """The limits of one user (none without an id, or when no limit is set anywhere)."""
        rules = settings.limits
        if not user_id or not rules.active:
            return Limits()
        groups = await self._groups.groups(user_id) if rules.needs_groups else frozenset()
        return limits_for(rules, role=role, groups=groups, user_id=user_id)

    async def _spend(self, user_id: str) -> tuple[Spend, Spend]:
        """(today's, this month's) spend of a user, from the spend totals (`spendbook.py`).

        Raises:
            ConnectionError: the Redis store did not answer (its in-process fallback is no total).
        """
        spend = await self._spendbook.spend(self._store, user_id, self._now().date())
        if isinstance(self._store, RedisStore) and not self._store.shared:
            raise ConnectionError("usage store unreachable")
        return spend

    async def _spend_or_none(self, user_id: str, settings: Settings) -> tuple[Spend, Spend] | None:
        """The spend to check; None lets the turn go (fail-open); fail-closed refuses it."""
        try:
            return await self._spend(user_id)
        except Exception as exc:
            if settings.limit_store_failure == "fail-closed":
                filter_log.warning(
                    "contextwarden: limits not checked (%s); turn refused (fail-closed)", type(exc).__name__
                )
                raise TurnRefused(STORE_DOWN_TEXT) from None
            filter_log.warning("contextwarden: limits not checked (%s); turn allowed (fail-open)", type(exc).__name__)
            return None

    def _release_hold(self, user: dict | None, metadata: dict | None) -> None:
        """End the hold inlet took for this turn (a user near a limit may start the next)."""
        note = metadata.get(METADATA_KEY) if isinstance(metadata, dict) else None
        hold = note.get("limit_hold") if isinstance(note, dict) else None
        user_id = user.get("id") if isinstance(user, dict) else None
        if isinstance(hold, str) and isinstance(user_id, str):
            self._inflight.release(user_id, hold)

    async def _record_spend(self, user_id: object, cost_usd: Decimal | None, tokens: int) -> None:
        """Add a reply to its user's spend totals (what limits read); never costs the reply."""
        if not isinstance(user_id, str) or not user_id:
            return
        try:
            await self._spendbook.record(
                self._store, user=user_id, day=self._now().date(), cost_usd=cost_usd, tokens=tokens
            )
        except Exception as exc:
            filter_log.warning("contextwarden: reply not added to the spend totals (%s)", type(exc).__name__)

    async def _spend_status(self, settings: Settings, user: dict | None, note: dict, shown: bool) -> str:
        """After a reply: `today $0.42 of $2.00` (and the 80% warning), or ""."""
        user_id, role = str((user or {}).get("id") or ""), str((user or {}).get("role") or "")
        if not user_id or not settings.show_status or not shown:
            return ""
        limits = await self._user_limits(settings, user_id, role)
        if not settings.show_spend or not (limits.any or settings.spend_for_all):
            return ""
        try:
            day, month = await self._spend(user_id)
        except Exception as exc:
            filter_log.debug("contextwarden: spend not read (%s)", type(exc).__name__)
            return ""
        return spend_text(limits, day, check_limits(limits, day, month), settings.show_spend)

    # -- outlet -----------------------------------------------------------------------------

    async def _record(
        self,
        body: Any,
        user: dict | None,
        metadata: dict | None,
        model: dict | None,
        emit: Emitter | None,
    ) -> None:
        if not _is_chat_body(body) or not body["messages"]:
            return
        settings = await self._settings(user, None)  # valve problems were shown before the reply
        metadata = metadata if isinstance(metadata, dict) else {}
        note = _dict_at(metadata, METADATA_KEY)
        model_id = _base_model_id(body, model)
        resolution = await self._resolve(settings, model_id, emit)
        reply = body["messages"][-1]
        rejected: list[str] = []
        usage = read_usage(reply, rejected)
        if rejected:
            self._warn_once(f"contextwarden: reply usage not believed ({', '.join(rejected[:6])}); estimated instead")
        estimated_prompt = note.get("estimated_prompt_tokens")
        estimated_prompt = read_count(estimated_prompt) if isinstance(estimated_prompt, int) else None
        off = heavy(body["messages"])
        billed, estimated = await compute(off, self._billed_usage, usage, estimated_prompt, body["messages"], model_id)
        cost = compute_cost(billed, resolution.price)
        if cost.cost_usd is None:
            cost_note = resolution.reason if resolution.price is None and resolution.reason else cost.reason
        else:
            cost_note = "; ".join(cost.notes) or None
        user_id = (user or {}).get("id")
        mode = note.get("mode") if note.get("mode") in MODES else settings.mode
        tokens_saved = note.get("tokens_saved") if mode != "off" else None
        tokens_saved = read_count(tokens_saved) if isinstance(tokens_saved, int) else None
        savings = await self._reply_savings(billed, note, str(mode), tokens_saved, resolution, model_id)
        cost_saved = savings.cost_saved_usd if savings is not None else None
        record = {
            "model": _log_value(model_id),
            "resolved_model": _log_value(resolution.model_id),
            "user_id": _log_value(user_id),
            "chat_id": _log_value(body.get("chat_id") or metadata.get("chat_id") or None),
            "prompt_tokens": billed.prompt_tokens,
            "completion_tokens": billed.completion_tokens,
            "cached_tokens": billed.cached_tokens,
            "reasoning_tokens": billed.reasoning_tokens,
            "estimated": estimated,
            "estimated_prompt_tokens": estimated_prompt,
            "usage_shape": billed.shape,
            "cost_usd": _usd_text(cost.cost_usd),
            "cost_source": cost.cost_source,
            "cost_note": _log_value(cost_note),
            "mode": mode,
            "tokens_saved": tokens_saved,
            "cost_saved_usd": _usd_text(cost_saved),
        }
        filter_log.info("usage %s", json.dumps(record, separators=(",", ":")))
        try:  # after the log line, once: never retried, so never counted twice
            await record_reply(
                self._store,
                user=user_id,
                model=resolution.model_id or model_id,
                prompt_tokens=billed.prompt_tokens,
                completion_tokens=billed.completion_tokens,
                cached_tokens=billed.cached_tokens,
                reasoning_tokens=billed.reasoning_tokens,
                cost_usd=cost.cost_usd,
                estimated=estimated,
                retention_days=settings.ledger_retention_days,
                day=self._now().date(),
                tokens_saved=tokens_saved or 0,
                cost_saved_usd=cost_saved,
                shadow=mode == "shadow",
            )
        except Exception as exc:
            filter_log.warning("contextwarden: reply not added to the usage ledger (%s)", type(exc).__name__)
        else:
            await self._record_spend(
                user_id, cost.cost_usd, (billed.prompt_tokens or 0) + (billed.completion_tokens or 0)
            )
        if (
            settings.calibrate_counts
            and not estimated
            and usage is not None
            and not usage.calls_summed
            and estimated_prompt is not None
            and note.get("count_mode") == "exact"
            and note.get("comparable") is True
        ):
            try:
                await self._learn_calibration(resolution.model_id or model_id, estimated_prompt, usage.prompt_tokens)
            except Exception as exc:
                filter_log.warning("contextwarden: calibration not updated (%s)", type(exc).__name__)
        if not estimated:
            try:
                await self._learn_caching(resolution.model_id or model_id, billed)
            except Exception as exc:
                filter_log.debug("contextwarden: cache stats not updated (%s)", type(exc).__name__)
        if reply.get("role") == "assistant":
            await compute(
                off, self._counter.count_message, reply, model_id
            )  # sent back next turn: counted now, off that turn's path
        spent = await self._spend_status(settings, user, note, shown=emit is not None)
        if settings.show_status:
            if (waiting := pending_line(note)) is not None:  # no request pass came (older Open WebUI)
                await self._emit(emit, waiting)
            trimmed = trim_summary(note) if mode == "enforce" else ""
            await self._emit(
                emit,
                " · ".join(
                    filter(
                        None,
                        (
                            usage_status(billed, estimated, cost, settings.show_cost, savings, mode == "shadow")
                            + trimmed,
                            spent,
                        ),
                    )
                ),
            )

    async def _reply_savings(
        self, billed: Usage, note: dict, mode: str, tokens_saved: int | None, resolution: Resolution, model_id: str
    ) -> Savings | None:
        """This reply's savings, cache-aware now that the backend said what its cache served (None
        in `off` mode). The model caches when this reply was served from cache, else as learned
        from earlier replies, else as the request hook expected from its price and breakpoints."""
        if tokens_saved is None:
            return None
        model_key = resolution.model_id or model_id
        view = _dict_at(note, "cache")
        caches = bool(billed.cached_tokens)
        if not caches and tokens_saved > 0:
            try:
                learned = (await load_cache_stats(self._store, model_key)).caches()
            except Exception as exc:
                filter_log.debug("contextwarden: cache stats not read (%s)", type(exc).__name__)
                learned = None
            caches = view.get("caches") is True if learned is None else learned
        prefix = view.get("trimmed" if mode == "shadow" else "untrimmed")
        prefix = prefix if isinstance(prefix, int) and not isinstance(prefix, bool) and prefix >= 0 else 0
        return reply_savings(
            billed,
            shadow=mode == "shadow",
            tokens_saved=tokens_saved,
            other_prefix=prefix,
            price=resolution.price,
            caches=caches,
            minimum=min_cacheable_tokens(model_key),
        )

    async def _learn_caching(self, model_key: str, billed: Usage) -> None:
        """Count this reply in the model's cache stats (prompts over the minimum, and cache hits)."""
        stats = await load_cache_stats(self._store, model_key)
        updated = update_cache_stats(stats, billed.prompt_tokens, billed.cached_tokens, min_cacheable_tokens(model_key))
        if updated is not None:
            await save_cache_stats(self._store, model_key, updated)

    def _billed_usage(
        self, usage: Usage | None, estimated_prompt: int | None, messages: list[dict], model_id: str
    ) -> tuple[Usage, bool]:
        """The usage to log and bill: the backend's, with what it left out estimated (and marked)."""
        if usage is not None and usage.prompt_tokens is not None and usage.completion_tokens is not None:
            return usage, False
        prompt = usage.prompt_tokens if usage is not None else None
        if prompt is None:
            prompt = (
                estimated_prompt
                if estimated_prompt is not None
                else self._counter.count_messages(messages[:-1], model_id)
            )
        completion = usage.completion_tokens if usage is not None else None
        if completion is None:
            completion = self._counter.count_text(message_text(messages[-1]), model_id)
        if usage is None:
            return Usage(prompt, completion, shape="estimate"), True
        return with_counts(usage, prompt, completion), True

    # -- prices, calibration, stream usage -----------------------------------------------------

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

    async def _calibration(self, settings: Settings, resolution: Resolution) -> Calibration:
        """The learned count correction for a model (none when switched off or unreadable)."""
        if not settings.calibrate_counts:
            return Calibration()
        try:
            return await load_calibration(self._store, resolution.model_id or resolution.requested)
        except Exception as exc:
            filter_log.debug("contextwarden: calibration not read (%s)", type(exc).__name__)
            return Calibration()

    async def _learn_calibration(self, model_key: str, counted: int, real: int | None) -> None:
        if real is None:
            return
        updated = update_calibration(await load_calibration(self._store, model_key), counted, real)
        if updated is not None:
            await save_calibration(self._store, model_key, updated)

    def _ask_stream_usage(self, body: Any, user: dict | None, model: dict | None) -> Any:
        """The body with `stream_options.include_usage` when the backend should be asked."""
        try:
            if not isinstance(body, dict) or not wants_stream_usage(body, model):
                return body
            user_valves = user.get("valves") if isinstance(user, dict) else None
            settings = self._read_settings(user_valves)[0]
            if settings.mode != "enforce" or not settings.request_stream_usage:
                return body  # shadow and off send the body exactly as it came
            return _with_stream_usage(body)
        except Exception as exc:  # never cost the turn
            filter_log.debug("contextwarden: stream usage not requested (%s)", type(exc).__name__)
            return body

    # -- shared helpers -----------------------------------------------------------------------

    async def _settings(self, user: dict | None, emit: Emitter | None) -> Settings:
        """The turn's settings; valve problems are logged once, and shown (never their values)
        to admins only, since other users cannot fix them: pass `emit` on one pass a turn."""
        user_valves = user.get("valves") if isinstance(user, dict) else None
        role = user.get("role") if isinstance(user, dict) else None
        if role is not None and role != "admin":  # Open WebUI always says; a caller without roles sees them
            emit = None
        settings, problems = self._read_settings(user_valves)
        for problem in problems:
            await self._report(problem, emit)
        if settings.redis_url != self._store_url:
            self._store_problem = None
            try:
                self._store = open_store(settings.redis_url)
            except ConfigError as exc:
                self._store_problem = exc
                self._store = MemoryStore()
            self._store_url = settings.redis_url
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

    async def _failed(self, hook: str, exc: BaseException, body: Any, emit: Emitter | None) -> Any:
        filter_log.warning(
            "contextwarden: %s failed (%s at %s); body passed through unchanged", hook, type(exc).__name__, _where(exc)
        )
        await self._emit(emit, f"contextwarden skipped this {'reply' if hook == 'outlet' else 'turn'} (internal error)")
        return body

    @staticmethod
    async def _emit(emit: Emitter | None, description: str) -> None:
        if emit is None:
            return
        try:
            await emit({"type": "status", "data": {"description": description, "done": True}})
        except Exception as exc:  # a broken emitter must not cost the chat
            filter_log.debug("contextwarden: status not shown (%s)", type(exc).__name__)
