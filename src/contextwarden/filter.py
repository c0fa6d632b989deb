"""`Filter`: the Open WebUI face. Parses what Open WebUI passes, calls the core, returns the body.

One instance serves every user of a worker: per-request values live in locals and in
`__metadata__` (which Open WebUI hands from `inlet`/`request` to `outlet`), never on `self`.
Every hook fails open: on any internal error the body goes on as it came.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from enum import Enum
from itertools import repeat
from typing import Any, Final

from .accounting import (
    billed_usage,
    cache_view,
    learn_caching,
    learn_calibration,
    reply_savings_of,
    trim_savings,
    usage_record,
)
from .adminview import is_usage_command, usage_answer, without_usage_exchanges
from .budget import PromptBudget, fixed_cost, prompt_budget
from .cache_hints import (
    breakpoint_positions,
    breakpoint_provider,
    has_cache_markers,
    place_breakpoints,
    remove_breakpoints,
)
from .caches import SETTINGS_MEMO_SIZE
from .calibration import Calibration, comparable_turn, load_calibration
from .chatstate import ChatState, chat_state_key
from .conversation import Message
from .embedder import TURN_EMBED_TEXTS, EmbedderResting, EmbedderSlow, OpenWebUIEmbedder, embedder_of
from .errors import ConfigError, TurnRefused
from .flags import FlagRead, Flags, pin_fingerprint, read_flags
from .ledger import record_reply
from .limits import (
    STORE_DOWN_TEXT,
    Limits,
    Spend,
    Verdict,
    check_limits,
    limits_for,
    refusal_text,
    spend_text,
)
from .openturns import OpenTurn, OpenTurns, reply_allowance, rough_tokens, streamed_chars
from .price_sources import PriceSources
from .pricing import Resolution, resolve_model
from .records import CacheView, TurnChoice, TurnNote, UsageRecord
from .savings import Savings, carried_savings, carries_a_cut
from .spendbook import Charge, SpendBook
from .status import (
    detail_line,
    pending_detail,
    pending_line,
    shadow_status_line,
    small_window_text,
    status_line,
    turn_line,
    usage_status,
)
from .store import MemoryStore, RedisStore, Store, open_store
from .summarize import (
    SUMMARY_ACK_MESSAGE,
    find_summary,
    insert_summary,
    own_messages,
    summarize_trim,
    summary_tokens,
    take_summary,
)
from .tokens import ESTIMATE_HIGH_BY, TOKENS_PER_REPLY, TokenCounter, preload_encodings
from .trim import MIN_PASSAGE_TOKENS, TrimDecision, TrimResult, carry_previous, read_reply, trim_messages
from .usage import Cost, Usage, compute_cost, read_usage
from .usergroups import GroupReader
from .valves import MIN_BUDGET_TOKENS, MODES, Settings, UserValves, Valves, read_settings, valves_key

__all__ = ["Filter", "model_context_length", "wants_stream_usage"]

filter_log = logging.getLogger("contextwarden")

Emitter = Callable[[dict[str, Any]], Awaitable[Any]]
METADATA_KEY = "contextwarden"
MAX_REPORTED_PROBLEMS = 64
# The tool definitions Open WebUI adds to every browser chat (30, 3,214 tokens for a user; 3,923
# for an admin) leaving less than this of the window for the chat: the admin is told once.
SMALL_WINDOW_ROOM = 1_000
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
PART_WEIGHT_CHARS = 1_000  # what a non-text part (an image) weighs toward OFF_LOOP_MIN_CHARS
TOOLS_ON_LOOP_MAX = 64  # tool definitions rendered and counted on the loop (Open WebUI's built-in: 30)
_cpu_worker: tuple[int, ThreadPoolExecutor] | None = None  # (pid, executor): a forked child makes its own
# Reading the flags costs ~0.5 µs a message whatever their length (0.1 ms for 200 messages, 0.9 ms
# for 2,000 at load 4): up to this many it runs on the loop, where the hop to the thread would
# cost more (0.4 ms idle, 2-3 ms at load 4, the thread waiting for a core).
FLAGS_ON_LOOP_MAX_MESSAGES = 2_000
# A next turn that carries the previous selection reads only what is new, but still passes over
# every message a few times (~10 µs each): up to this many it runs on the loop (at most ~10 ms),
# where the hop to the thread costs about what the turn does. When it cannot be carried (a new
# selection, a worker that never read the chat), the trim goes to the thread as before.
NEXT_TURN_ON_LOOP_MAX_MESSAGES = 1_000
# A carried excerpt is checked against each new question, its message cut into chunks again
# (~27 µs per 1,000 characters: a 350k-character document 9 ms): up to this much excerpted text
# (~3 ms) a carried turn stays on the loop.
EXCERPTS_ON_LOOP_MAX_CHARS = 100_000
# A message shorter than this is never quoted by passages (trim.MIN_PASSAGE_TOKENS, 4 characters
# a token): it costs the recall nothing more than its score.
PASSAGE_SOURCE_CHARS = 4 * MIN_PASSAGE_TOKENS


def _light_next_turn(messages: Sequence[Message], previous: TrimDecision) -> bool:
    """A next turn that may be carried on the loop: at most NEXT_TURN_ON_LOOP_MAX_MESSAGES
    messages, those new since `previous` with less than OFF_LOOP_MIN_CHARS of text, and the
    long messages its recall may read passages of (excerpted or dropped: each is cut and scored
    for the new question) with less than EXCERPTS_ON_LOOP_MAX_CHARS."""
    if len(messages) > NEXT_TURN_ON_LOOP_MAX_MESSAGES or heavy(messages[previous.seen :]):
        return False
    whole = set(previous.at).difference(at for at, _ in previous.excerpts)
    read = [m for i, m in enumerate(messages[: previous.seen]) if i not in whole and _passage_source(m)]
    return not heavy(read, EXCERPTS_ON_LOOP_MAX_CHARS)


def _passage_source(message: Message) -> bool:
    """A message the recall may quote passages of: not a system prompt, long or in parts."""
    content = message.get("content")
    long = isinstance(content, list) or (isinstance(content, str) and len(content) >= PASSAGE_SOURCE_CHARS)
    return long and message.get("role") != "system"


def heavy(messages: Sequence[Message], limit: int = OFF_LOOP_MIN_CHARS) -> bool:
    """True when the messages hold `limit` characters of text or more (stops counting there);
    a part that is not text (an image) counts as PART_WEIGHT_CHARS: walking it costs the same."""
    size = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            size += len(content)
        elif isinstance(content, list):
            for part in content:
                text = part.get("text") if isinstance(part, dict) else None
                size += len(text) if isinstance(text, str) else PART_WEIGHT_CHARS
                if size >= limit:
                    return True
        if size >= limit:
            return True
    return False


def _heavy_extras(body: dict[str, Any]) -> bool:
    """True when a request's tool definitions or response format are worth counting off the loop
    (3,000 tool definitions stalled it 120-180 ms; a 2 MB response format 280-310 ms)."""
    tools = body.get("tools")
    return (isinstance(tools, list) and len(tools) > TOOLS_ON_LOOP_MAX) or isinstance(body.get("response_format"), dict)


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


def _sent_id(model_id: str, resolution: Resolution) -> str:
    """The model id the connection receives: without the Open WebUI connection prefix the price
    resolution removed (`openrouter.anthropic/claude-sonnet-4.5` -> `anthropic/claude-sonnet-4.5`)."""
    prefix = resolution.prefix
    return model_id[len(prefix) + 1 :] if prefix and model_id.startswith(prefix + ".") else model_id


def _pinned(messages: list[Message], state: ChatState) -> list[int]:
    """The positions of the user messages the chat's state has pinned."""
    pins = set(state.pins)
    if not pins:
        return []
    return [i for i, m in enumerate(messages) if m.get("role") == "user" and pin_fingerprint(m) in pins]


def _turn_so_far(choice: TurnChoice, messages_before: int, removed: int, note: TurnNote) -> TurnChoice:
    """This pass's choice as the turn's: a later pass (request after inlet) sees what an earlier
    pass already trimmed, so its line counts from the chat the turn began with; an earlier
    pass's cuts count while a cut copy is still sent (this pass may have dropped it)."""
    earlier, excerpts = (n if n is not None and n <= messages_before else 0 for n in (note.shortened, note.excerpted))
    if (earlier or excerpts) and not carries_a_cut(choice.messages):
        earlier = excerpts = 0
    passages = choice.passages if choice.excerpted >= excerpts else (note.passages or (0, 0))
    return replace(
        choice,
        count_before=messages_before,
        tokens_before=choice.tokens_after + removed,
        shortened=max(choice.shortened, earlier),
        excerpted=max(choice.excerpted, excerpts),
        passages=passages,
    )


def _chat_messages_sent(choice: TurnChoice) -> int:
    """How many of the chat's own messages a choice sends: its messages less what the filter
    added (recall quotes, a summary note, their acknowledgements)."""
    return len(choice.messages) - len(own_messages(choice.messages, choice.own))


@dataclass(slots=True)
class _Turn:
    """One pass's inputs, read once and handed from step to step (a local: never on `self`)."""

    body: dict
    metadata: dict | None
    settings: Settings
    model_id: str
    resolution: Resolution
    calibration: Calibration
    note: TurnNote  # what earlier passes of this turn noted
    read: FlagRead
    flags: Flags
    budget: PromptBudget
    off: bool  # count and trim off the event loop
    key: str | None  # the chat's state key; None for API callers
    window: int | None = None  # the model's context window, as Open WebUI or the price book knows it

    @property
    def shadow(self) -> bool:
        return self.settings.mode == "shadow"

    def write(self, note: TurnNote) -> None:
        """Leave `note` in `__metadata__` for later passes and outlet."""
        if isinstance(self.metadata, dict):
            self.metadata[METADATA_KEY] = note.to_dict()


@dataclass(frozen=True, slots=True)
class _TurnMoney:
    """The tokens a turn removed (earlier passes' included), the cache view and the savings."""

    removed: int
    messages_before: int
    hints: bool  # prompt-cache breakpoints go on the sent body
    cache: CacheView
    savings: Savings


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
            clock: the current time, timezone-aware (default: UTC now); days and months of
                limits and the ledger follow it.
            prices: builds the price sources from a function returning the current store
                (default: `PriceSources`, which fetches OpenRouter in the background).
        """
        self.valves = self.Valves()
        self._counter = counter or TokenCounter()
        self._encodings_wait_until = time.monotonic() + ENCODING_WAIT_SECONDS
        self._store: Store = store or MemoryStore()
        self._store_given = store is not None
        self._store_url = ""
        self._store_problem: ConfigError | None = None
        self._reported: set[str] = set()
        self._window_told: dict[str, str | None] = {}  # model id -> its small-window notice, None once shown
        self._settings_memo: dict[tuple, tuple[Settings, list[ConfigError]]] = {}
        self._prices = (prices or PriceSources)(lambda: self._store)
        self._open = OpenTurns()
        self._spendbook = SpendBook()
        self._groups = GroupReader()
        self._now: Callable[[], datetime] = clock or (lambda: datetime.now(UTC))

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
        adds RAG, memory and tools (older versions only have this hook)."""
        try:
            await self._before_turn(body, __user__, __metadata__, __event_emitter__)
        except (TurnRefused, *NEVER_SWALLOWED):
            raise  # on purpose: Open WebUI shows a refusal's text to the user
        except BaseException as exc:
            filter_log.warning(
                "contextwarden: limits not checked (%s at %s); turn allowed", type(exc).__name__, _where(exc)
            )
        out = await self._trim_hook("inlet", body, __user__, __metadata__, __model__, __event_emitter__, __request__)
        try:
            await self._start_turn(out, __user__, __metadata__, __model__)
        except (TurnRefused, *NEVER_SWALLOWED):
            raise
        except BaseException as exc:
            filter_log.warning(
                "contextwarden: turn not charged (%s at %s); turn allowed", type(exc).__name__, _where(exc)
            )
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
            note = __metadata__.get(METADATA_KEY) if isinstance(__metadata__, dict) else None
            turn = self._open.find(note.get("turn") if isinstance(note, dict) else None)
            if turn is not None:
                await self._watch(turn, event)
        except NEVER_SWALLOWED:
            raise
        except BaseException as exc:
            filter_log.debug("contextwarden: stream chunk not read (%s)", type(exc).__name__)
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
        try:
            await self._record(body, __user__, __metadata__, __model__, __event_emitter__, __request__)
        except NEVER_SWALLOWED:
            raise
        except BaseException as exc:
            return await self._failed("outlet", exc, body, __event_emitter__)
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
        if (kept := without_usage_exchanges(body["messages"])) is not None:  # never sent on, whatever the mode
            body = {**body, "messages": kept}
        if settings.mode == "off":
            return body
        turn = await self._open_turn(body, user, metadata, model, emit, settings)
        choice = await self._decide(turn, request)
        money = await self._turn_money(turn, choice, model)
        note = await self._noted(turn, choice, money)
        note = self._leave_line(turn, choice, money, note, hook)
        self._check_window(turn)
        if turn.shadow:
            return body
        out = choice.messages
        if hook == "request" and money.hints:
            out, marked = self._with_breakpoints(out, choice, money.cache.minimum, turn.model_id)
            note = replace(note, cache_marked=marked)
            turn.write(note)
        if _same_messages(out, body["messages"]):
            return body
        return {**body, "messages": out}

    async def _open_turn(
        self,
        body: dict,
        user: dict | None,
        metadata: dict | None,
        model: dict | None,
        emit: Emitter | None,
        settings: Settings,
    ) -> _Turn:
        """What a pass knows before it chooses: the model and its price, the calibration, the
        earlier passes' note, the flags (their text removed) and the prompt's budget."""
        model_id = _base_model_id(body, model)
        await self._await_encoding(model_id)
        resolution = await self._resolve(settings, model_id, emit)
        calibration = await self._calibration(settings, resolution)
        window = model_context_length(model) or (resolution.price.context_length if resolution.price else None)
        if (problem := settings.reserve_problem(window)) is not None:
            await self._report(problem, emit)
        note = TurnNote.from_dict(metadata.get(METADATA_KEY)) if isinstance(metadata, dict) else TurnNote()
        incoming = body["messages"]
        if note.cache_marked is not None:  # an earlier pass's breakpoints off: trim what it saw
            incoming = remove_breakpoints(incoming, note.cache_marked)
        off = heavy(incoming)
        flags_off = off and len(incoming) > FLAGS_ON_LOOP_MAX_MESSAGES
        read = await compute(flags_off, read_flags, incoming, allowed=settings.allowed_flags)
        flags = read.flags
        if not (flags.used or flags.refused) and note.flags is not None:
            flags = note.flags  # an earlier pass of this turn removed them from the text
        budget = prompt_budget(
            settings.budget(window),
            calibration,
            await compute(_heavy_extras(body), fixed_cost, body, self._counter, model_id),
            flags.budget,
            ceiling=settings.window_budget(window),
        )
        return _Turn(
            body,
            metadata,
            settings,
            model_id,
            resolution,
            calibration,
            note,
            read,
            flags,
            budget,
            off,
            chat_state_key(*_ids(body, user, metadata)),
            window,
        )

    async def _decide(self, turn: _Turn, request: Any) -> TurnChoice:
        """Choose what to send from the chat's stored state, and store this pass's decision."""
        settings, shadow, key = turn.settings, turn.shadow, turn.key
        state, stored_bytes = await self._load_state(key, turn.read, turn.flags)
        # Shadow simulates enforce turn after turn from its own unsent decisions (enforce's last
        # real one to begin with); enforce never sees a decision that was not sent.
        stored = (state.shadow_decision or state.decision) if shadow else state.decision
        chooser = replace(settings, summary=None) if shadow else settings  # no paid summary nobody sees
        if turn.note.decided:  # a later pass: the turn's wait for the embedder was the first pass's
            chooser = replace(chooser, embed_timeout_seconds=0.0)
        embedder = embedder_of(request) if settings.semantic_relevance and settings.strategy == "relevance" else None
        choice = await self._choose(
            turn.read.messages,
            turn.flags,
            state,
            chooser,
            turn.budget,
            turn.model_id,
            stored,
            embedder,
            off=turn.off,
            own=turn.note.added,
        )
        fixed = turn.budget.fixed
        choice = choice.plus_fixed(fixed.tokens, fixed.label, turn.budget.fixed_over, turn.budget.total)
        if shadow and not _same_messages(
            turn.read.messages, turn.body["messages"]
        ):  # sent as it came, flag text and all
            sent_as_is = await compute(turn.off, self._counter.count_messages, turn.body["messages"], turn.model_id)
            choice = replace(choice, tokens_before=sent_as_is + fixed.tokens)
        if key is not None:
            # A later pass of a turn sees the chat the first pass trimmed: the turn's decision stays.
            later_pass = turn.note.decided and _same_messages(choice.messages, turn.read.messages)
            decision = stored if choice.decision is None or later_pass else choice.decision
            saved = replace(state, shadow_decision=decision) if shadow else replace(state, decision=decision)
            await self._save_state(key, stored_bytes, saved, settings.state_ttl_seconds)
        return choice

    async def _turn_money(self, turn: _Turn, choice: TurnChoice, model: dict | None) -> _TurnMoney:
        """The tokens this turn removed (earlier passes' included), the cache view and the savings."""
        removed, messages_before = carried_savings(turn.note.carried, turn.read.messages, chained=not turn.shadow)
        removed_now = max(0, choice.tokens_before - choice.tokens_after)
        if choice.count_mode == "estimate":  # estimates err high: at most the chat's real size (also
            removed_now = int(removed_now / ESTIMATE_HIGH_BY)  # when a later, exact pass carries it)
        removed += removed_now
        factor = turn.calibration.effect
        resolution, model_id = turn.resolution, turn.model_id
        hints = (
            turn.settings.prompt_cache_hints == "auto"
            and not turn.shadow
            and breakpoint_provider(_sent_id(model_id, resolution), resolution.model_id, model) is not None
        )
        cache = turn.note.cache
        if cache is None:  # a later pass of this turn keeps the first pass's view: that pass saw the whole chat
            cache = await cache_view(
                self._store,
                lambda part: self._counter.count_each(part, model_id),
                turn.read.messages,
                choice,
                choice.tokens_after + removed,
                resolution,
                model_id,
                factor,
                hints,
            )
        savings = trim_savings(choice.tokens_after + removed, choice.tokens_after, factor, resolution, cache)
        return _TurnMoney(removed, messages_before, hints, cache, savings)

    async def _noted(self, turn: _Turn, choice: TurnChoice, money: _TurnMoney) -> TurnNote:
        """The note with this pass's figures (what outlet and later passes read), written to `__metadata__`."""
        if not isinstance(turn.metadata, dict):
            return turn.note
        body, shadow = turn.body, turn.shadow
        sent, sent_messages = choice.tokens_after, choice.messages
        if shadow:  # shadow sends the body as it came: counted in _decide
            sent, sent_messages = choice.tokens_before, body["messages"]
        note = replace(
            turn.note,
            mode=turn.settings.mode,
            estimated_prompt_tokens=sent,
            count_mode=choice.count_mode,
            budget=choice.budget,
            dropped=0 if shadow else choice.dropped,
            reused=choice.reused,
            decided=turn.key is not None,
            calibration=turn.calibration.effect,
            comparable=comparable_turn(sent_messages, body),
            removed=money.removed,
            messages_before=money.messages_before,
            tokens_saved=money.savings.tokens_saved,
            cost_saved_usd=money.savings.cost_saved_usd,
            cache=money.cache,
            flags=turn.flags if turn.flags.used or turn.flags.refused else turn.note.flags,
            added=() if shadow else choice.own,
        )
        turn.write(note)
        return note

    def _leave_line(self, turn: _Turn, choice: TurnChoice, money: _TurnMoney, note: TurnNote, hook: str) -> TurnNote:
        """Leave the turn's words so far in its note, for the outlet's one line after the reply
        (a status costs Open WebUI a save into the chat, so one shown before the reply delays
        it; and it cannot be edited): the plain words (the last pass's win), and the admin's
        detail, logged."""
        if not isinstance(turn.metadata, dict):
            return note
        flags, calibration = turn.flags, turn.calibration
        done = choice if turn.shadow else _turn_so_far(choice, money.messages_before, money.removed, note)
        sent = _chat_messages_sent(done)
        plain = shadow_status_line(done, flags, sent) if turn.shadow else status_line(done, flags, sent)
        detail = detail_line(done, flags) + (f" · calibrated ×{calibration.effect:.2f}" if calibration.active else "")
        filter_log.debug("contextwarden: %s pass: %s", hook, detail)
        note = replace(
            note,
            line=detail,
            pending_line=plain if turn.settings.show_status else None,
            sent_messages=len(done.messages),
            shortened=done.shortened,
            excerpted=done.excerpted,
            passages=done.passages if done.excerpted else None,
        )
        turn.write(note)
        return note

    def _check_window(self, turn: _Turn) -> None:
        """A window the tool definitions (nearly) fill on their own: the admin is told once a model
        a process, in the log and, after their next reply from that model, in their chat."""
        fixed, settings = turn.budget.fixed, turn.settings
        if not fixed.tools or turn.model_id in self._window_told:
            return
        window = settings.window(turn.window)
        room = settings.window_budget(turn.window)  # the window less what is kept for the reply
        if room - fixed.tokens >= SMALL_WINDOW_ROOM:
            return
        tools = turn.body.get("tools")
        text = small_window_text(
            turn.model_id,
            len(tools) if isinstance(tools, list) else 0,
            fixed.tokens,
            window,
            window - room,
            over=room - fixed.tokens < MIN_BUDGET_TOKENS,
            need=-(-(fixed.tokens + window - room + SMALL_WINDOW_ROOM * 4) // 1_000) * 1_000,
        )
        if len(self._window_told) < MAX_REPORTED_PROBLEMS:
            self._window_told[turn.model_id] = text
            self._warn_once(f"contextwarden: {text}")

    def _with_breakpoints(
        self, messages: list[Message], choice: TurnChoice, minimum: int, model_id: str
    ) -> tuple[list[Message], dict[str, bool] | None]:
        """`messages` with prompt-cache breakpoints on the stable prefix, unless some are there already
        (another filter's, or the caller's): never a second set. What was marked is returned for the
        note, so a later pass of this turn takes them off before it trims."""
        if has_cache_markers(messages):
            return messages, None
        carried = len(messages) if choice.carried is None else choice.carried
        positions = breakpoint_positions(messages, self._counter.count_each(messages, model_id), carried, minimum)
        if not positions:
            return messages, None
        return place_breakpoints(messages, positions)

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
        own: tuple[str, ...] = (),
    ) -> TurnChoice:
        """Trim `messages` (flags already removed) into what `prompt` leaves for messages, as the
        flags, the pins and `previous` say (`off`: the counting and the trim run off the event loop;
        `own`: what earlier passes of this turn added, as their note recorded it)."""
        counter = self._counter
        budget = prompt.messages
        if flags.full:
            return await self._untrimmed(messages, budget, model_id, off)
        at, merged = find_summary(messages, own_messages(messages, own))
        base, summary, ack = take_summary(messages, at) if at is not None else (messages, None, None)
        pinned = _pinned(base, state)

        options: dict[str, Any] = {
            "model": model_id,
            "token_counter": counter,
            "strategy": settings.strategy,
            "keep_last_turns": flags.keep or settings.keep_last_turns,
            "pinned": pinned,
            "previous": previous,
            "low_watermark": settings.low_watermark,
            "growth_turns": settings.growth_turns,
            "shorten": not prompt.fixed_over,  # no cut makes it fit: send the question whole
            "added": own_messages(base, own),  # an earlier pass's recall blocks
        }

        def retrim(limit: int, embed: OpenWebUIEmbedder | None = None) -> TrimResult:
            return trim_messages(base, max_tokens=limit, embed=embed, **options)

        def carry(limit: int, embed: OpenWebUIEmbedder | None = None) -> TrimResult | None:
            return carry_previous(base, max_tokens=limit, embed=embed, **options)

        if summary is not None:  # an earlier pass (or version) summarized: keep its note, never a second one
            cost = counter.count_message(summary, model_id) + counter.count_message(SUMMARY_ACK_MESSAGE, model_id)
            if budget - cost >= MIN_BUDGET_TOKENS:
                result = await compute(off, retrim, budget - cost)
                sent = insert_summary(result.messages, summary, ack)
                added, cost = len(sent) - len(result.messages), summary_tokens(sent, result.messages, counter, model_id)
                # the note goes out again: the line says so (a later pass's line is the one shown)
                return replace(TurnChoice.of(result, sent, extra=added, extra_tokens=cost), summarized=True)
        result = await self._semantic_trim(retrim, carry, budget, base, settings, embedder, previous, off)
        if settings.summary is not None and not flags.nosum and not merged and summary is None and result.dropped:
            summarized = await self._summarized(base, result, retrim, settings, model_id, budget)
            if summarized is not None:
                return summarized
        return TurnChoice.of(result, result.messages)

    async def _semantic_trim(
        self,
        retrim: Callable[[int, OpenWebUIEmbedder | None], TrimResult],
        carry: Callable[[int, OpenWebUIEmbedder | None], TrimResult | None],
        budget: int,
        base: list[Message],
        settings: Settings,
        embedder: OpenWebUIEmbedder | None,
        previous: TrimDecision | None,
        off: bool,
    ) -> TrimResult:
        """`retrim(budget)`, with the embedder's vectors when there is one: a new selection weighs
        meaning, and so does the recall of a turn that keeps the previous selection. A chat
        trimmed before asks for its question's vector first (its history was embedded after the
        replies) and is trimmed once; a chat this process sees for the first time is trimmed by
        words, and embedded after the reply (the outlet's `ahead`), never on the user's path.
        A next turn this process can carry (`carry`) is trimmed on the loop: its cost is what is
        new, less than the hop to the thread would cost."""
        ready = embedder is not None and previous is not None and await self._embed_ahead(embedder, base, settings)
        embed = embedder if ready else None
        if off and previous is not None and _light_next_turn(base, previous):
            carried = carry(budget, embed)
            if carried is not None:
                return carried
        return await compute(off, retrim, budget, embed)

    async def _summarized(
        self,
        base: list[Message],
        result: TrimResult,
        retrim: Callable[[int], TrimResult],
        settings: Settings,
        model_id: str,
        budget: int,
    ) -> TurnChoice | None:
        """The trim with a summary of what it dropped (None when no summary came)."""
        assert settings.summary is not None
        done = await summarize_trim(
            base,
            result,
            retrim=retrim,
            config=settings.summary,
            store=self._store,
            counter=self._counter,
            model=model_id,
        )
        if done is None:
            return None
        chosen = TurnChoice.of(done.result, done.messages)
        return replace(
            chosen, tokens_before=result.tokens_before, tokens_after=done.tokens, budget=budget, summarized=True
        )

    async def _untrimmed(self, messages: list[Message], budget: int, model_id: str, off: bool) -> TurnChoice:
        """`!full`: the chat as it is, counted (the count's label goes with the counts)."""
        costs, mode, _ = await compute(off, self._counter.count_each_as, messages, model_id)
        tokens = TOKENS_PER_REPLY + sum(costs)
        return TurnChoice(messages, len(messages), tokens, tokens, budget, mode, over_budget=tokens > budget, full=True)

    async def _embed_ahead(self, embedder: OpenWebUIEmbedder, messages: list[Message], settings: Settings) -> bool:
        """Fetch the turn's missing vectors (its newest texts, `TURN_EMBED_TEXTS`) from Open
        WebUI's embedder, within the turn's wait.

        True when the embedder answered (the trim may use it); a failure is logged once a kind
        and the turn's relevance stays lexical. With no time left (`embed_timeout_seconds` 0: a
        later pass of a turn whose first pass waited) what is missing is only asked for."""
        texts = min(settings.embed_max_texts, TURN_EMBED_TEXTS)
        if settings.embed_timeout_seconds <= 0:
            return not embedder.ahead(messages, max_texts=texts)
        try:
            await embedder.prefetch(messages, timeout=settings.embed_timeout_seconds, max_texts=texts)
        except Exception as exc:  # the embedder is Open WebUI's or a remote API: anything can fail
            reason = "embedder: " + (
                "busy or slower than the wait, not waited for"
                if isinstance(exc, EmbedderSlow)
                else "not ready in time"
                if isinstance(exc, TimeoutError)
                else "resting after a failed call"
                if isinstance(exc, EmbedderResting)
                else type(exc).__name__
            )
            filter_log.debug("contextwarden: %s; relevance is lexical this turn", reason)
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
                    limits=limits,
                    rules=settings.limits,
                    emit=emit,
                    chat=bool(isinstance(metadata, dict) and metadata.get("session_id")),
                    spend=functools.partial(self._spendbook.spend, self._store, user_id or "-", self._now().date()),
                )
            )
        limits = await self._user_limits(settings, user_id, role)
        if not limits.any:
            return
        spend = await self._spend_or_none(user_id, settings)
        if spend is None:
            return
        self._refuse_over(check_limits(limits, *spend))

    def _refuse_over(self, verdict: Verdict) -> Verdict:
        """Raise `TurnRefused` (the limit, the spend, the reset) when the verdict is a refusal."""
        if not verdict.allowed:
            filter_log.info("contextwarden: turn refused (%s limit reached)", verdict.kind)
            raise TurnRefused(refusal_text(verdict, self._now()))
        return verdict

    async def _start_turn(self, body: Any, user: dict | None, metadata: dict | None, model: dict | None) -> None:
        """Start the turn in this worker (`OpenTurns`, its id in the note) and, for a user with a
        limit, charge its estimate: the prompt as counted plus the reply's allowance, at the
        model's price. Refuses it (`TurnRefused`) when a turn that started meanwhile took the
        rest of the limit."""
        if not _is_chat_body(body):
            return
        metadata = metadata if isinstance(metadata, dict) else body.get("metadata")
        if not isinstance(metadata, dict):
            metadata = {}  # no note can reach an outlet: the turn is still charged (an outlet adds it whole)
        if metadata.get("task") or is_usage_command(body["messages"]):
            return
        await self._settle_ended()
        user = user if isinstance(user, dict) else {}
        settings = await self._settings(user, None)
        user_id, role = str(user.get("id") or ""), str(user.get("role") or "")
        limits = await self._user_limits(settings, user_id, role)
        if settings.mode == "off" and not limits.any:
            return  # off sends the body exactly as it came, its metadata included
        note = TurnNote.from_dict(metadata.get(METADATA_KEY))
        model_id = _base_model_id(body, model)
        resolution = await self._resolve(settings, model_id, None)
        turn = OpenTurn(
            turn_id=uuid.uuid4().hex,
            user=user_id,
            day=self._now().date(),
            model=resolution.model_id or model_id,
            price=resolution.price,
            prompt_tokens=note.estimated_prompt_tokens or rough_tokens(body["messages"]),
            reply_tokens=reply_allowance(body, settings.reserve_output_tokens),
            charged=None,
            started=time.monotonic(),
        )
        if limits.any:
            if await self._reserve(turn, turn.estimate, limits, settings):
                turn.charged = turn.estimate
        self._open.start(turn)
        metadata[METADATA_KEY] = replace(note, turn_id=turn.turn_id).to_dict()

    async def _reserve(self, turn: OpenTurn, estimate: Charge, limits: Limits, settings: Settings) -> bool:
        """Check and charge in one step (`SpendBook.reserve`); False when the store failed and
        the valve lets the turn go uncharged (fail-open)."""
        try:
            verdict = await self._spendbook.reserve(
                self._store,
                user=turn.user,
                day=turn.day,
                charge=estimate,
                check=lambda day, month: check_limits(limits, day, month),
            )
            self._check_shared()
        except Exception as exc:
            await self._store_failed(exc, settings)
            return False
        self._refuse_over(verdict)
        return True

    async def _watch(self, turn: OpenTurn, event: Any) -> None:
        """One streamed chunk of a started turn: its text counted, its usage settled."""
        turn.last_seen = time.monotonic()
        turn.streamed += streamed_chars(event)
        raw = event.get("usage") if isinstance(event, dict) else None
        usage = read_usage({"usage": raw}) if isinstance(raw, dict) else None
        if usage is not None:
            turn.stream_usage.append(usage)
            await self._settle(turn, turn.used()[1])

    async def _settle(self, turn: OpenTurn, real: Charge) -> None:
        """Replace what a turn was charged by `real` (nothing for a turn that took no charge)."""
        if turn.charged is None or turn.charged == real:
            return
        try:
            await self._spendbook.settle(self._store, user=turn.user, day=turn.day, charged=turn.charged, real=real)
        except Exception as exc:
            filter_log.warning("contextwarden: turn not settled (%s)", type(exc).__name__)
            return
        turn.charged = real

    async def _settle_ended(self) -> None:
        """Turns that ended without an outlet (`OpenTurns.due`): a stopped stream settled at its
        prompt estimate plus what it streamed, one that showed nothing kept at its estimate;
        each added to the ledger as an estimated reply."""
        for turn in self._open.due(time.monotonic()):
            used, charge = turn.used()
            await self._settle(turn, charge)
            filter_log.info("contextwarden: a turn ended without an outlet; settled at what this worker saw")
            try:
                await record_reply(
                    self._store,
                    user=turn.user,
                    model=turn.model,
                    prompt_tokens=used.prompt_tokens,
                    completion_tokens=used.completion_tokens,
                    cost_usd=charge.cost_usd,
                    estimated=not turn.stream_usage,
                    day=turn.day,
                )
            except Exception as exc:
                filter_log.warning("contextwarden: ended turn not added to the usage ledger (%s)", type(exc).__name__)

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
        self._check_shared()
        return spend

    def _check_shared(self) -> None:
        """ConnectionError when the Redis store answered from its in-process fallback: that is
        no user's total, so what limits read or charged there does not count.

        Raises:
            ConnectionError: the Redis store is away.
        """
        if isinstance(self._store, RedisStore) and not self._store.shared:
            raise ConnectionError("usage store unreachable")

    async def _spend_or_none(self, user_id: str, settings: Settings) -> tuple[Spend, Spend] | None:
        """The spend to check; None lets the turn go (fail-open); fail-closed refuses it."""
        try:
            return await self._spend(user_id)
        except Exception as exc:
            await self._store_failed(exc, settings)
            return None

    @staticmethod
    async def _store_failed(exc: Exception, settings: Settings) -> None:
        """The spend could not be read: fail-closed refuses the turn (`TurnRefused`), fail-open logs it."""
        if settings.limit_store_failure == "fail-closed":
            filter_log.warning("contextwarden: limits not checked (%s); turn refused (fail-closed)", type(exc).__name__)
            raise TurnRefused(STORE_DOWN_TEXT) from None
        filter_log.warning("contextwarden: limits not checked (%s); turn allowed (fail-open)", type(exc).__name__)

    async def _record_spend(self, user_id: object, charge: Charge) -> None:
        """Add a reply to its user's spend totals (what limits read); never costs the reply."""
        if not isinstance(user_id, str) or not user_id:
            return
        try:
            await self._spendbook.record(
                self._store, user=user_id, day=self._now().date(), cost_usd=charge.cost_usd, tokens=charge.tokens
            )
        except Exception as exc:
            filter_log.warning("contextwarden: reply not added to the spend totals (%s)", type(exc).__name__)

    async def _spend_status(self, settings: Settings, user: dict | None, note: TurnNote, shown: bool) -> str:
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
        request: Any = None,
    ) -> None:
        """After a reply: bill its usage, log one `usage {json}` line, add it to the ledger and the
        spend totals, learn from it, and show a status line."""
        if not _is_chat_body(body) or not body["messages"]:
            return
        settings = await self._settings(user, None)  # valve problems were shown before the reply
        if settings.semantic_relevance and settings.strategy == "relevance" and settings.mode != "off":
            if (embedder := embedder_of(request)) is not None:  # the next turn finds the chat embedded
                embedder.ahead(body["messages"], max_texts=settings.embed_max_texts)
        metadata = metadata if isinstance(metadata, dict) else {}
        note = TurnNote.from_dict(metadata.get(METADATA_KEY))
        started = self._open.finish(note.turn_id)  # None: a bare outlet (another worker's, or forged)
        model_id = _base_model_id(body, model)
        resolution = await self._resolve(settings, model_id, emit)
        usage = self._reply_usage(body["messages"][-1])
        off = heavy(body["messages"])
        billed, estimated = await compute(
            off, billed_usage, self._counter, usage, note.estimated_prompt_tokens, body["messages"], model_id
        )
        cost = compute_cost(billed, resolution.price)
        mode = note.mode if note.mode in MODES else settings.mode
        tokens_saved = note.tokens_saved if mode != "off" else None
        savings = await reply_savings_of(self._store, billed, note, str(mode), tokens_saved, resolution, model_id)
        record = usage_record(
            model_id=model_id,
            resolution=resolution,
            user_id=(user or {}).get("id"),
            chat_id=body.get("chat_id") or metadata.get("chat_id") or None,
            billed=billed,
            estimated=estimated,
            estimated_prompt=note.estimated_prompt_tokens,
            cost=cost,
            mode=str(mode),
            tokens_saved=tokens_saved,
            savings=savings,
        )
        filter_log.info("usage %s", record.to_json())
        await self._book(
            settings, (user or {}).get("id"), resolution.model_id or model_id, billed, estimated, cost, record, started
        )
        if started is not None:  # only a turn this worker started teaches (a bare outlet may be forged)
            await self._learn(settings, usage, billed, estimated, note, resolution.model_id or model_id)
        reply = body["messages"][-1]
        if reply.get("role") == "assistant":  # sent back next turn: counted and read now, off that turn's path
            await compute(off, read_reply, reply, self._counter, model_id, terms=settings.strategy == "relevance")
        noted = note.to_dict()
        if (detail := pending_detail(noted)) is not None:
            filter_log.info("contextwarden: %s", detail)
        spent = await self._spend_status(settings, user, note, shown=emit is not None)
        if settings.show_status:  # the turn's one line: what the model saw, what the reply cost
            shadow = mode == "shadow"  # what a trim saves is the admin's (log, report), but shadow's point
            used = usage_status(billed, estimated, cost, settings.show_cost, savings if shadow else None, shadow)
            await self._emit(emit, turn_line(pending_line(noted), used, spent))
        await self._tell_window(model_id, user, emit)

    async def _tell_window(self, model_id: str, user: dict | None, emit: Emitter | None) -> None:
        """Show an admin the model's small-window notice (`_check_window`), once, after the reply:
        a notification (Open WebUI shows it whole, at once, and does not save it into the chat)."""
        text = self._window_told.get(model_id)
        if text is None or emit is None or (user or {}).get("role") != "admin":
            return
        self._window_told[model_id] = None
        try:
            await emit({"type": "notification", "data": {"type": "warning", "content": f"contextwarden: {text}"}})
        except Exception as exc:  # a broken emitter must not cost the chat
            filter_log.debug("contextwarden: notice not shown (%s)", type(exc).__name__)

    def _reply_usage(self, reply: dict) -> Usage | None:
        """The usage the backend reported on the reply; what it said that cannot be true is warned about."""
        rejected: list[str] = []
        usage = read_usage(reply, rejected)
        if rejected:
            self._warn_once(f"contextwarden: reply usage not believed ({', '.join(rejected[:6])}); estimated instead")
        return usage

    async def _book(
        self,
        settings: Settings,
        user_id: Any,  # the client's: record_reply and the spend totals check it
        model_key: str,
        billed: Usage,
        estimated: bool,
        cost: Cost,
        record: UsageRecord,
        started: OpenTurn | None,
    ) -> None:
        """The reply into the usage ledger, then the spend totals (its turn's charge settled, or
        the reply added whole): after the log line, once (never retried, so never counted twice)."""
        try:
            await record_reply(
                self._store,
                user=user_id,
                model=model_key,
                prompt_tokens=billed.prompt_tokens,
                completion_tokens=billed.completion_tokens,
                cached_tokens=billed.cached_tokens,
                reasoning_tokens=billed.reasoning_tokens,
                cost_usd=cost.cost_usd,
                estimated=estimated,
                retention_days=settings.ledger_retention_days,
                day=self._now().date(),
                tokens_saved=record.tokens_saved or 0,
                cost_saved_usd=record.cost_saved_usd,
                shadow=record.mode == "shadow",
            )
        except Exception as exc:
            filter_log.warning("contextwarden: reply not added to the usage ledger (%s)", type(exc).__name__)
        else:
            charge = Charge.of(billed, cost.cost_usd)
            if started is not None and started.charged is not None:
                await self._settle(started, charge)
            else:
                await self._record_spend(user_id, charge)

    async def _learn(
        self, settings: Settings, usage: Usage | None, billed: Usage, estimated: bool, note: TurnNote, model_key: str
    ) -> None:
        """What a reply with real usage teaches: the count calibration (a comparable, exactly
        counted prompt) and whether the model's cache serves anything."""
        if (
            settings.calibrate_counts
            and not estimated
            and usage is not None
            and not usage.calls_summed
            and note.estimated_prompt_tokens is not None
            and note.count_mode == "exact"
            and note.comparable
        ):
            try:
                await self._learn_calibration(model_key, note.estimated_prompt_tokens, usage.prompt_tokens)
            except Exception as exc:
                filter_log.warning("contextwarden: calibration not updated (%s)", type(exc).__name__)
        if not estimated:
            try:
                await learn_caching(self._store, model_key, billed)
            except Exception as exc:
                filter_log.debug("contextwarden: cache stats not updated (%s)", type(exc).__name__)

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
        await learn_calibration(self._store, model_key, counted, real)

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
        if settings.redis_url != self._store_url and not self._store_given:
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
