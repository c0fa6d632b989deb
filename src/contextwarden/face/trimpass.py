"""The trim path: one pass of a turn over a request, apart from the Open WebUI face.

`TrimPass.run` takes a chat body (the filter has read the settings and found a turn to trim)
and goes through named steps over one `_Turn` view: open (the model and its price, the
calibration, the earlier passes' note, the flags, the prompt's budget), decide (the chat's
stored state in, the choice made, with the embedder's vectors and the summary, the state
saved), money (the tokens removed, the cache view, the savings), note and line (the turn's
figures and words left in `__metadata__` for later passes and the outlet), send (prompt-cache
breakpoints on a `request` pass). After a reply it embeds the chat ahead and counts the reply
for the next turn. The filter passes the counter, the store, the price resolution and how to
report problems in; a test can drive it without Open WebUI.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Final

from ..core.conversation import Message
from ..core.decision import TrimDecision
from ..core.flags import FlagRead, Flags, already_read, pin_fingerprint, read_flags
from ..core.sources import SourcesCut
from ..core.tokens import ESTIMATE_HIGH_BY, TOKENS_PER_REPLY, TokenCounter
from ..core.trim import TrimResult, carry_previous, read_reply, trim_messages
from ..errors import ConfigError
from ..money.accounting import cache_view, trim_savings
from ..money.cache_hints import (
    breakpoint_positions,
    breakpoint_provider,
    has_cache_markers,
    place_breakpoints,
    remove_breakpoints,
)
from ..money.calibration import Calibration, comparable_turn, load_calibration
from ..money.pricing import Resolution
from ..money.records import CacheView, ExcerptCounts, TurnChoice, TurnNote
from ..money.savings import Savings, cached_prefixes, carried_savings, carries_a_cut, loop_length
from ..state.chatstate import ChatState, chat_state_key
from ..state.store import Store
from .budget import PromptBudget, fixed_cost, prompt_budget
from .embedder import TURN_EMBED_TEXTS, EmbedderResting, EmbedderSlow, OpenWebUIEmbedder, embedder_of
from .hookargs import METADATA_KEY, Emitter, base_model_id, chat_ids, model_context_length
from .offloop import compute, heavy, heavy_extras, light_next_turn, reads_off_loop
from .settings import MIN_BUDGET_TOKENS, Settings
from .status import detail_line, shadow_status_line, small_window_text, status_line
from .summarize import (
    SUMMARY_ACK_MESSAGE,
    insert_summary,
    own_messages,
    read_chat,
    summarize_trim,
    summary_tokens,
)
from .turnsources import asked_digest, cut_turn_sources, split_turn_sources, with_turn_sources

__all__ = ["TrimPass", "WindowNotices", "load_chat_state", "save_chat_state", "UNREADABLE"]

pass_log = logging.getLogger("contextwarden")

MAX_REPORTED_PROBLEMS = 64  # distinct warnings a process logs once each (then at debug)
# The tool definitions Open WebUI adds to every browser chat (30, 3,214 tokens for a user; 3,923
# for an admin) leaving less than this of the window for the chat: the admin is told once.
SMALL_WINDOW_ROOM = 1_000
ENCODING_WAIT_SECONDS = 2.0  # a fresh worker's first trims wait this long in all for tiktoken (off the loop)


class _Unreadable(Enum):
    """A chat state that could not be read: the turn goes on, nothing is saved over it."""

    STATE = "unreadable"


UNREADABLE: Final = _Unreadable.STATE


def _same_messages(a: Sequence[Message], b: Sequence[Message]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def _sent_id(model_id: str, resolution: Resolution) -> str:
    """The model id the connection receives: without the Open WebUI connection prefix the price
    resolution removed (`openrouter.anthropic/claude-sonnet-4.5` -> `anthropic/claude-sonnet-4.5`)."""
    prefix = resolution.prefix
    return model_id[len(prefix) + 1 :] if prefix and model_id.startswith(prefix + ".") else model_id


def _turn_so_far(
    choice: TurnChoice, messages_before: int, removed: int, note: TurnNote, loop: int, recut: bool = False
) -> TurnChoice:
    """This pass's choice as the turn's: a later pass (request after inlet) sees what an earlier
    pass already trimmed, so its line counts from the chat the turn began with (and the `loop`
    messages of its tool loop since, which it sends); an earlier
    pass's cuts count while a cut copy is still sent (this pass may have dropped it), and the
    documents it dropped whole while this pass works on what it sent (`removed`: not in its input)."""
    earlier = note.shortened if note.shortened is not None and note.shortened <= messages_before else 0
    noted = note.excerpt_counts(messages_before)
    cut = carries_a_cut(choice.messages)
    if (earlier or noted.count) and not cut:
        earlier, noted = 0, ExcerptCounts(kind=noted.kind, dropped=noted.dropped)
    quoted = choice.quoted
    if not quoted and own_messages(choice.messages, choice.own):  # an earlier pass's blocks, sent again
        quoted = note.quoted
    return replace(
        choice,
        count_before=messages_before + loop,
        quoted=quoted,
        tokens_before=choice.tokens_after + removed,
        shortened=max(choice.shortened, earlier),
        excerpts=_excerpts_so_far(choice.excerpts, noted, removed > 0, recut),
        pins_shortened=choice.pins_shortened or (note.pins_shortened and cut),
        pins_dropped=choice.pins_dropped or note.pins_dropped,
    )


def _excerpts_so_far(own: ExcerptCounts, noted: ExcerptCounts, chained: bool, recut: bool = False) -> ExcerptCounts:
    """A pass's excerpt counts as the turn's: the earlier pass's when it excerpted more, with
    the documents each dropped whole (`ExcerptCounts.after`); a question the earlier pass cut by
    passages and this one cut again counted from the message as pasted (`cut_again`), or not by
    those passages when this one cut it middle-out (`recut`: "8 of 19" where ~100 tokens went)."""
    if chained:
        own = own.cut_again(noted)
        noted = noted.without_question() if recut and not own.question[1] else noted
    base = own if own.count >= noted.count else replace(noted, dropped=own.dropped)
    return base.after(noted, chained)


def _question_cut(turn: _Turn, choice: TurnChoice) -> bool:
    """This pass cut the question an earlier pass cut by passages: it sends a copy of what it got
    (read before the sources go back, which make a copy too)."""
    at = turn.read.latest_user
    asked = None if at is None or turn.note.question_passages is None else turn.read.messages[at]
    return asked is not None and all(m is not asked for m in choice.messages)


def _chat_messages_sent(choice: TurnChoice) -> int:
    """How many of the chat's own messages a choice sends: its messages less what the filter
    added (recall blocks, a summary note, their acknowledgements), plus the messages its recall
    blocks quote whole (the model reads them, in a block)."""
    return len(choice.messages) - len(own_messages(choice.messages, choice.own)) + choice.quoted


def _sent_question(turn: _Turn, choice: TurnChoice) -> str | None:
    """`text_digest` of the question as this pass sends it, without the sources it puts back:
    how a later pass of the turn tells them apart (None for a later pass in shadow, which sends
    the body as it came: the first pass's question)."""
    if turn.shadow:
        return None if turn.note.mode is not None else asked_digest(turn.body["messages"])
    return asked_digest(choice.messages)


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
    reads_off: bool  # and read every message and part off it too (`offloop.reads_off_loop`)
    key: str | None  # the chat's state key; None for API callers
    window: int | None = None  # the model's context window, as Open WebUI or the price book knows it
    sources: SourcesCut | None = None  # what Open WebUI put before the question since the first pass

    @property
    def shadow(self) -> bool:
        return self.settings.mode == "shadow"

    def write(self, note: TurnNote) -> None:
        """Leave `note` in `__metadata__` for later passes and outlet."""
        if isinstance(self.metadata, dict):
            self.metadata[METADATA_KEY] = note.to_dict()


def _relocated(turn: _Turn, decision: TrimDecision | None, *, to_chat: bool) -> TrimDecision | None:
    """`decision` moved between the chat's positions and a later pass's input (what the first
    pass sent, mapped by `TurnNote.origins`): the stored one to the input's to be carried, this
    pass's to the chat's to be stored. Else a later pass that must cut more (sources, tool
    results) finds none of its recall blocks, and the next turn none of its."""
    origins = () if turn.shadow or turn.note.mode is None else turn.note.origins
    if decision is None or not origins:
        return decision
    pairs = [(k, c) for k, c in enumerate(origins) if c >= 0]
    return decision.relocated(dict(pairs) if to_chat else {c: k for k, c in pairs})


def _budget_terms(turn: _Turn, decision: TrimDecision | None, *, stored: bool) -> TrimDecision | None:
    """`decision` with the budget it was made for as the store keeps it (`stored`: the whole
    prompt's, `PromptBudget.total`) or as this pass reads it (what this pass's fixed part leaves
    the messages of it). The passes of one turn leave the messages different budgets (the tool
    definitions Open WebUI adds after inlet, the sources): compared as the trim made them, 4,029
    tokens of definitions in an 8k window read every request pass's selection at the next inlet
    as made for under half its budget, and `trim._starved` made each turn's anew."""
    if decision is None:
        return None
    fixed = turn.budget.total - turn.budget.messages
    return replace(decision, max_tokens=decision.max_tokens + fixed if stored else max(1, decision.max_tokens - fixed))


@dataclass(frozen=True, slots=True)
class _TurnMoney:
    """The tokens a turn removed (earlier passes' included), the cache view and the savings."""

    removed: int
    messages_before: int
    hints: bool  # prompt-cache breakpoints go on the sent body
    cache: CacheView
    savings: Savings


async def _noted(turn: _Turn, choice: TurnChoice, money: _TurnMoney, asked: str | None) -> TurnNote:
    """The note with this pass's figures (what outlet and later passes read), written to
    `__metadata__`; `asked`: the digest of the question as this pass sent it, less the sources."""
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
        comparable=await compute(turn.reads_off, comparable_turn, sent_messages, body),
        removed=money.removed,
        messages_before=money.messages_before,
        tokens_saved=money.savings.tokens_saved,
        cost_saved_usd=money.savings.cost_saved_usd,
        cache=money.cache,
        flags=turn.flags if turn.flags != Flags() else turn.note.flags,  # a later pass reads none
        added=() if shadow else turn.note.added_with(choice.own),
        pins=turn.note.pins_with(choice.pins),
        asked=turn.note.asked_with(asked),
        origins=turn.note.origins if turn.note.mode is not None else () if shadow else choice.origins,
    )
    turn.write(note)
    return note


def _leave_line(turn: _Turn, choice: TurnChoice, money: _TurnMoney, note: TurnNote, hook: str, recut: bool) -> TurnNote:
    """Leave the turn's words so far in its note, for the outlet's one line after the reply
    (a status costs Open WebUI a save into the chat, so one shown before the reply delays
    it; and it cannot be edited): the plain words (the last pass's win), and the admin's
    detail, logged; `recut`: this pass cut the question again (`_question_cut`)."""
    if not isinstance(turn.metadata, dict):
        return note
    flags, calibration, loop = turn.flags, turn.calibration, loop_length(turn.read.messages)
    before, removed = money.messages_before, money.removed
    done = note.in_shadow(choice) if turn.shadow else _turn_so_far(choice, before, removed, note, loop, recut)
    sent = _chat_messages_sent(done)
    plain = shadow_status_line(done, flags, sent) if turn.shadow else status_line(done, flags, sent)
    detail = detail_line(done, flags) + (f" · calibrated ×{calibration.effect:.2f}" if calibration.active else "")
    pass_log.debug("contextwarden: %s pass: %s", hook, detail)
    note = replace(
        note,
        line=detail,
        pending_line=plain if turn.settings.show_status else None,
        sent_messages=len(done.messages),
        shortened=done.shortened,
        quoted=done.quoted,
        pins_shortened=done.pins_shortened,
        pins_dropped=done.pins_dropped,
    ).with_excerpts(done.excerpts)
    turn.write(note)
    return note


async def _untrimmed(
    counter: TokenCounter, messages: list[Message], budget: int, model_id: str, off: bool
) -> TurnChoice:
    """`!full`: the chat as it is, counted (the count's label goes with the counts)."""
    costs, mode, _ = await compute(off, counter.count_each_as, messages, model_id)
    tokens = TOKENS_PER_REPLY + sum(costs)
    everything = tuple(range(len(messages)))
    return TurnChoice(
        messages,
        len(messages),
        tokens,
        tokens,
        budget,
        mode,
        over_budget=tokens > budget,
        full=True,
        origins=everything,
    )


def _with_breakpoints(
    counter: TokenCounter, messages: list[Message], choice: TurnChoice, minimum: int, model_id: str
) -> tuple[list[Message], dict[str, bool] | None]:
    """`messages` with prompt-cache breakpoints on the stable prefix, unless some are there already
    (another filter's, or the caller's): never a second set. What was marked is returned for the
    note, so a later pass of this turn takes them off before it trims."""
    if has_cache_markers(messages):
        return messages, None
    carried = len(messages) if choice.carried is None else choice.carried
    positions = breakpoint_positions(messages, counter.count_each(messages, model_id), carried, minimum)
    if not positions:
        return messages, None
    return place_breakpoints(messages, positions)


async def load_chat_state(
    store: Store, key: str | None, read: FlagRead, flags: Flags
) -> tuple[ChatState, bytes | None | _Unreadable]:
    """The chat's stored state with this turn's pin flags applied, and the bytes it was read
    from (`UNREADABLE` when the read failed or the bytes are not this version's)."""
    state = ChatState()
    stored: bytes | None | _Unreadable = None
    if key is not None:
        try:
            stored = await store.get(key)
            local = await store.local_copy(key)  # what this worker held while Redis was away
            parsed = ChatState.parse(stored) if local is None else ChatState.rejoined(stored, local.written, local.seen)
        except Exception as exc:  # state is an optimization: the turn goes on without it
            pass_log.warning("contextwarden: chat state not read (%s)", type(exc).__name__)
            parsed = None
        if parsed is None:
            stored = UNREADABLE
        state = parsed or state
    latest = read.messages[read.latest_user] if read.latest_user is not None else None
    pinning = flags.pin or flags.sticky_pin or (state.pin_mode and flags.sticky_pin is None)
    return state.with_flags(flags, pin_fingerprint(latest) if latest is not None and pinning else None), stored


async def save_chat_state(
    store: Store, key: str, stored: bytes | None | _Unreadable, state: ChatState, ttl: int
) -> None:
    """Replace the state read as `stored`; never one that could not be read. One that changed
    since (another pass saved) keeps its decisions and gets this turn's pins, tried once more."""
    if stored is UNREADABLE:
        return
    try:
        if not await store.swap(key, stored, state.to_bytes(), ttl=ttl):
            current = await store.get(key)
            merged = state.merged_onto(ChatState.parse(current), ChatState.parse(stored))
            if merged is not None:
                await store.swap(key, current, merged.to_bytes(), ttl=ttl)
    except Exception as exc:
        pass_log.warning("contextwarden: chat state not saved (%s)", type(exc).__name__)


class WindowNotices:
    """The small-window notices of one filter: a model whose window the tool definitions (nearly)
    fill on their own is told once a process, in the log (`check`, on a pass) and to an admin
    after their next reply from that model (`take`, on the outlet)."""

    def __init__(self, warn_once: Callable[[str], None]) -> None:
        self._told: dict[str, str | None] = {}  # model id -> its small-window notice, None once shown
        self._warn_once = warn_once

    def check(self, turn: _Turn) -> None:
        """A window the tool definitions (nearly) fill on their own: the admin is told once a model
        a process, in the log and, after their next reply from that model, in their chat. Only the
        definitions count: a file attached to one turn (its sources) is not the model's window."""
        definitions, settings = turn.budget.fixed.tools, turn.settings
        if not definitions or turn.model_id in self._told:
            return
        window = settings.window(turn.window)
        room = settings.window_budget(turn.window)  # the window less what is kept for the reply
        if room - definitions >= SMALL_WINDOW_ROOM:
            return
        tools = turn.body.get("tools")
        text = small_window_text(
            turn.model_id,
            len(tools) if isinstance(tools, list) else 0,
            definitions,
            window,
            window - room,
            over=room - definitions < MIN_BUDGET_TOKENS,
            need=-(-(definitions + window - room + SMALL_WINDOW_ROOM * 4) // 1_000) * 1_000,
        )
        if len(self._told) < MAX_REPORTED_PROBLEMS:
            self._told[turn.model_id] = text
            self._warn_once(f"contextwarden: {text}")

    def take(self, model_id: str) -> str | None:
        """The model's notice when it was not shown yet (and from now on, shown)."""
        text = self._told.get(model_id)
        if text is not None:
            self._told[model_id] = None
        return text


class TrimPass:
    """The trim path of one filter: each pass of a turn (`run`), and after a reply the work that
    readies the next turn (`embed_for_next_turn`, `count_reply`)."""

    def __init__(
        self,
        *,
        counter: TokenCounter,
        store: Callable[[], Store],
        resolve: Callable[[Settings, str, Emitter | None], Awaitable[Resolution]],
        report: Callable[[ConfigError, Emitter | None], Awaitable[None]],
        warn_once: Callable[[str], None],
        reported: set[str],
    ) -> None:
        """`store` returns the filter's current store (it follows the `redis_url` valve);
        `resolve` is the price book's model for an id, `report` tells the admin of a bad valve,
        `warn_once` logs a warning once a process, `reported` are the warnings told so far."""
        self._counter = counter
        self._store_of = store
        self._resolve = resolve
        self._report = report
        self._reported = reported
        self._encodings_wait_until = time.monotonic() + ENCODING_WAIT_SECONDS
        self.windows = WindowNotices(warn_once)

    @property
    def _store(self) -> Store:
        return self._store_of()

    async def run(
        self,
        body: dict,
        user: dict | None,
        metadata: dict | None,
        model: dict | None,
        emit: Emitter | None,
        settings: Settings,
        request: Any = None,
        hook: str = "request",
    ) -> dict:
        """One pass over a chat body: the budget (valves, model window, calibration), the flags and
        the chat's state in; the body to send out, the turn's note for outlet in `metadata`."""
        turn = await self._open_turn(body, user, metadata, model, emit, settings)
        choice = await self._decide(turn, request)
        asked = _sent_question(turn, choice)  # before the sources go back
        recut = _question_cut(turn, choice)
        if turn.sources is not None:
            choice = await compute(turn.off, with_turn_sources, choice, turn.sources, self._counter, turn.model_id)
        if turn.shadow and not _same_messages(turn.read.messages, body["messages"]):
            choice = await self._as_it_came(turn, choice)
        money = await self._turn_money(turn, choice, model)
        note = await _noted(turn, choice, money, asked)
        note = _leave_line(turn, choice, money, note, hook, recut)
        self.windows.check(turn)
        if turn.shadow:
            return body
        out = choice.messages
        if hook == "request" and money.hints:
            out, marked = _with_breakpoints(self._counter, out, choice, money.cache.minimum, turn.model_id)
            note = replace(note, cache_marked=marked)
            turn.write(note)
        if _same_messages(out, body["messages"]):
            return body
        return {**body, "messages": out}

    async def _as_it_came(self, turn: _Turn, choice: TurnChoice) -> TurnChoice:
        """A shadow choice whose untrimmed count is the body as it came (what shadow sends: flag
        text and all, and the sources Open WebUI put in whole), with what the request bills
        besides messages (the sources are in them: counted once)."""
        fixed = turn.budget.fixed
        as_is = await compute(turn.off, self._counter.count_messages, turn.body["messages"], turn.model_id)
        return replace(choice, tokens_before=as_is + fixed.tokens - fixed.sources)

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
        model_id = base_model_id(body, model)
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
        reads_off = reads_off_loop(off, incoming)
        if note.mode is None:  # the turn's first pass reads the flags (and removes them)
            read = await compute(reads_off, read_flags, incoming, allowed=settings.allowed_flags)
        else:
            read = already_read(incoming, note.flags or Flags())
        flags = read.flags
        fixed = await compute(heavy_extras(body), fixed_cost, body, self._counter, model_id)
        budget = prompt_budget(
            settings.budget(window), calibration, fixed, flags.budget, ceiling=settings.window_budget(window)
        )
        sources = None
        if note.mode is not None and note.asked and (found := split_turn_sources(read.messages, note.asked)):
            at, text, bare = found  # the turn trims the chat as the first pass sent it, less the sources
            read = replace(read, messages=bare)
            sources = await compute(off, cut_turn_sources, text, bare, at, budget.messages, self._counter, model_id)
            budget = prompt_budget(
                settings.budget(window),
                calibration,
                replace(fixed, sources=sources.tokens),
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
            reads_off,
            chat_state_key(*chat_ids(body, user, metadata)),
            window,
            sources,
        )

    async def _decide(self, turn: _Turn, request: Any) -> TurnChoice:
        """Choose what to send from the chat's stored state, and store this pass's decision."""
        settings, shadow, key = turn.settings, turn.shadow, turn.key
        state, stored_bytes = await load_chat_state(self._store, key, turn.read, turn.flags)
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
            _budget_terms(turn, _relocated(turn, stored, to_chat=False), stored=False),
            embedder,
            off=turn.off,
            reads_off=turn.reads_off,
            own=turn.note.added,
            pins=turn.note.pins,
        )
        choice = choice.with_pins_sent(turn.read.messages, {*state.pins, *turn.note.pins})
        fixed = turn.budget.fixed
        choice = choice.plus_fixed(fixed.tokens, fixed.label, turn.budget.fixed_over, turn.budget.total)
        choice = replace(choice, own_budget=turn.budget.own)
        if key is not None:
            # A later pass of a turn sees the chat the first pass trimmed: the turn's decision stays.
            later_pass = turn.note.decided and _same_messages(choice.messages, turn.read.messages)
            if choice.decision is None or later_pass:
                decision = stored
            elif choice.summarized:  # its trim read the chat less the summary note: left as it is
                decision = _budget_terms(turn, choice.decision, stored=True)
            else:
                decision = _budget_terms(turn, _relocated(turn, choice.decision, to_chat=True), stored=True)
            saved = state.decided(decision, shadow=shadow)
            await save_chat_state(self._store, key, stored_bytes, saved, settings.state_ttl_seconds)
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
            untrimmed = choice.tokens_after + removed
            count = functools.partial(self._counter.count_each, model=model_id)
            cache = await cache_view(
                self._store,
                lambda: compute(
                    turn.reads_off,
                    cached_prefixes,
                    turn.read.messages,
                    choice.messages,
                    untrimmed,
                    choice.tokens_after,
                    choice.reused,
                    count,
                ),
                choice,
                untrimmed,
                resolution,
                model_id,
                factor,
                hints,
            )
        savings = trim_savings(choice.tokens_after + removed, choice.tokens_after, factor, resolution, cache)
        return _TurnMoney(removed, messages_before, hints, cache, savings)

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
        reads_off: bool = False,
        own: tuple[str, ...] = (),
        pins: tuple[str, ...] = (),
    ) -> TurnChoice:
        """Trim `messages` (flags already removed) into what `prompt` leaves for messages, as the
        flags, the pins and `previous` say (`off`: the counting and the trim run off the event loop,
        `reads_off`: the chat's first read too, `read_chat`; `own`: what earlier passes of this
        turn added, `pins`: the pinned copies they sent, as their note recorded them)."""
        counter = self._counter
        budget = prompt.messages
        if flags.full:
            return await _untrimmed(counter, messages, budget, model_id, off)
        pins_in = functools.partial(state.pinned_in, also=pins)
        read = await compute(reads_off, read_chat, messages, own, pins_in)
        view, base, summary, ack = read.view, read.base, read.summary, read.ack
        options: dict[str, Any] = {
            "model": model_id,
            "token_counter": counter,
            "strategy": settings.strategy,
            "keep_last_turns": flags.keep or settings.keep_last_turns,
            "pinned": read.pinned,
            "previous": previous,
            "low_watermark": settings.low_watermark,
            "growth_turns": settings.growth_turns,
            "shorten": not prompt.fixed_over,  # no cut makes it fit: send the question whole
            "added": read.added,  # an earlier pass's recall blocks
        }

        def retrim(limit: int, embed: OpenWebUIEmbedder | None = None) -> TrimResult:
            return trim_messages(view, max_tokens=limit, embed=embed, **options)

        def carry(limit: int, embed: OpenWebUIEmbedder | None = None) -> TrimResult | None:
            return carry_previous(view, max_tokens=limit, embed=embed, **options)

        if summary is not None:  # an earlier pass (or version) summarized: keep its note, never a second one
            cost = counter.count_message(summary, model_id) + counter.count_message(SUMMARY_ACK_MESSAGE, model_id)
            if budget - cost >= MIN_BUDGET_TOKENS:
                result = await compute(off, retrim, budget - cost)
                sent = insert_summary(result.messages, summary, ack)
                added, cost = len(sent) - len(result.messages), summary_tokens(sent, result.messages, counter, model_id)
                # the note goes out again: the line says so (a later pass's line is the one shown)
                return replace(TurnChoice.of(result, sent, extra=added, extra_tokens=cost), summarized=True)
        result = await self._semantic_trim(retrim, carry, budget, base, settings, embedder, previous, off)
        if settings.summary is not None and not flags.nosum and not read.merged and summary is None and result.dropped:
            summarized = await self._summarized(base, result, retrim, settings, model_id, budget, off)
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
        if off and previous is not None and light_next_turn(base, previous):
            carried = await compute(False, carry, budget, embed)
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
        off: bool,
    ) -> TurnChoice | None:
        """The trim with a summary of what it dropped (None when no summary came; `off`: its
        retrim runs off the loop, as the turn's own)."""
        assert settings.summary is not None
        done = await summarize_trim(
            base,
            result,
            retrim=retrim,
            config=settings.summary,
            store=self._store,
            counter=self._counter,
            model=model_id,
            off=off,
        )
        if done is None:
            return None
        chosen = TurnChoice.of(done.result, done.messages)
        return replace(
            chosen, tokens_before=result.tokens_before, tokens_after=done.tokens, budget=budget, summarized=True
        )

    async def _embed_ahead(self, embedder: OpenWebUIEmbedder, messages: list[Message], settings: Settings) -> bool:
        """Fetch the turn's missing vectors (its newest texts, `TURN_EMBED_TEXTS`) from Open
        WebUI's embedder, within the turn's wait.

        True when the embedder answered (the trim may use it); a failure is logged once a kind
        and the turn's relevance stays lexical. With no time left (`embed_timeout_seconds` 0: a
        later pass of a turn whose first pass waited) what is missing is only asked for."""
        texts = min(settings.embed_max_texts, TURN_EMBED_TEXTS)
        if settings.embed_timeout_seconds <= 0:  # what is missing read off the loop for a big chat
            return not embedder.ahead(messages, max_texts=texts, delay=0.0, todo=await embedder.todo(messages, texts))
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
            pass_log.debug("contextwarden: %s; relevance is lexical this turn", reason)
            if reason not in self._reported and len(self._reported) < MAX_REPORTED_PROBLEMS:
                self._reported.add(reason)
                pass_log.warning("contextwarden: %s; relevance is lexical this turn", reason)
            return False
        return True

    async def _await_encoding(self, model_id: str) -> None:
        """A fresh worker: wait, off the event loop, until the model's encoding is loaded, but
        only until ENCODING_WAIT_SECONDS after the filter was made (then trims estimate)."""
        left = self._encodings_wait_until - time.monotonic()
        if left > 0 and self._counter.mode(model_id) != "exact":
            await asyncio.to_thread(self._counter.wait_ready, model_id, left)

    async def _calibration(self, settings: Settings, resolution: Resolution) -> Calibration:
        """The learned count correction for a model (none when switched off or unreadable)."""
        if not settings.calibrate_counts:
            return Calibration()
        try:
            return await load_calibration(self._store, resolution.model_id or resolution.requested)
        except Exception as exc:
            pass_log.debug("contextwarden: calibration not read (%s)", type(exc).__name__)
            return Calibration()

    async def embed_for_next_turn(self, messages: list[Message], settings: Settings, request: Any) -> None:
        """After a reply: start embedding the chat with Open WebUI's embedder, so the next turn
        finds it embedded (in the background; nothing waits for the call). A big chat's texts
        are read in the thread first (100,000 short messages held the loop 337 ms)."""
        if settings.semantic_relevance and settings.strategy == "relevance" and settings.mode != "off":
            if (embedder := embedder_of(request)) is not None:
                texts = settings.embed_max_texts
                todo = await embedder.todo(messages, texts)  # a big chat's read off the loop
                embedder.ahead(messages, max_texts=texts, todo=todo)

    async def count_reply(self, messages: list[Message], settings: Settings, model_id: str, off: bool) -> None:
        """After a reply: count it and cut its search terms now, off the next turn's path (it is
        sent back then)."""
        reply = messages[-1]
        if reply.get("role") == "assistant":
            await compute(off, read_reply, reply, self._counter, model_id, terms=settings.strategy == "relevance")
