"""The turns this worker started and has not yet seen end: what each was charged, what its
stream showed, and when one that gets no outlet counts as ended.

Open WebUI runs outlet in the worker that ran inlet, but not always (a stopped stream, a reply
of tool calls only, a backend error): a turn's charge is taken when it starts, so one without an
outlet is already counted. What this module decides is when such a turn is over and what it
then cost: a stream that went quiet (`STREAM_IDLE_SECONDS`: stopped, or its client went away)
is settled at what its provider calls reported, else its prompt estimate plus what it
streamed; a turn that showed nothing keeps its estimate once `RESERVATION_SECONDS` have
passed. Either is then added to the usage ledger (estimated when nothing was reported). An
ended turn is kept a while longer (`KEEP_SECONDS`) so a late outlet still settles it at what
it really cost, never below what the worker saw of it (`OpenTurn.sight`: the usage and charge
its outlet's are floored at). Only a turn found here teaches anything (calibration, cache
statistics): a bare outlet may be forged; and both learn only from what its stream reported
(`reported_prompt`, `reported`): the outlet's usage is the client's to write.

Bounded: a user with MAX_USER_OPEN_TURNS open pushes out their own oldest, and a worker with
MAX_OPEN_TURNS its oldest. A turn pushed out is settled as ended at once (as the sweep would
settle it) and its outlet still finds it among the last MAX_GONE_TURNS pushed out, so it is
settled, never added whole on top of its charge; only its stream is no longer watched.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import date
from decimal import Decimal
from functools import reduce
from typing import Any

from ..core.conversation import Message, message_text
from ..state.store import Store
from .calibration import MIN_CALIBRATION
from .pricing import ModelPrice
from .spendbook import Charge
from .usage import ESTIMATE_SHAPE, Usage

__all__ = [
    "OpenTurn",
    "OpenTurns",
    "Seen",
    "read_chunk",
    "reply_allowance",
    "rough_tokens",
    "STREAM_IDLE_SECONDS",
    "RESERVATION_SECONDS",
]

STREAM_IDLE_SECONDS = 120.0  # a stream silent this long was stopped (or its client went away)
RESERVATION_SECONDS = 1_800.0  # a turn that showed nothing is settled at its estimate after this
KEEP_SECONDS = 7_200.0  # an ended turn is still found by a late outlet this long
MAX_OPEN_TURNS = 100_000  # per worker; when full, the oldest is pushed out (settled as ended)
MAX_USER_OPEN_TURNS = 1_000  # per user and worker: a user's own oldest makes room, never another's
MAX_GONE_TURNS = 10_000  # turns pushed out that a late outlet still settles (the last ones)
SWEEP_EVERY_SECONDS = 1.0
CHARS_PER_TOKEN = 4  # what a stopped stream's text counts (its exact count is not worth keeping the text)
MAX_REPLY_ALLOWANCE = 1_000_000  # tokens: a request's max_tokens above this is charged as this
MAX_STREAM_CALLS = 256  # provider calls a turn keeps apart (Open WebUI's tool loops stop far sooner)


@dataclass(frozen=True, slots=True)
class Seen:
    """What a worker saw a turn use (`OpenTurn.sight`): its usage, the charge it prices to (a
    tool loop's calls each at its own tier), and whether any of it was counted here (`counted`)
    rather than reported by the turn's stream."""

    usage: Usage
    charge: Charge
    counted: bool


def _summed(calls: Sequence[Usage], counted: bool) -> Usage:
    """A turn's provider calls as one reply's usage, as Open WebUI adds a tool loop's up: each
    count summed (a count no call reported stays None), the last call's prompt picking the price
    tier, the provider's cost only when every call gave one; shaped `ESTIMATE_SHAPE` when a call
    was counted here (`counted`)."""

    def total(values: Sequence[int | None]) -> int | None:
        known = [v for v in values if v is not None]
        return sum(known) if known else None

    costs = [u.provider_cost for u in calls if u.provider_cost is not None]
    return Usage(
        sum(u.prompt_tokens or 0 for u in calls),
        sum(u.completion_tokens or 0 for u in calls),
        cached_tokens=total([u.cached_tokens for u in calls]),
        cache_write_tokens=total([u.cache_write_tokens for u in calls]),
        reasoning_tokens=total([u.reasoning_tokens for u in calls]),
        provider_cost=sum(costs, Decimal(0)) if len(costs) == len(calls) else None,
        shape=ESTIMATE_SHAPE if counted else calls[0].shape,
        calls_summed=len(calls) > 1,
        last_call_prompt=calls[-1].prompt_tokens if len(calls) > 1 else None,
    )


@dataclass(slots=True)
class OpenTurn:
    """One started turn: who, the price and the prompt estimate it was charged at, and what
    its stream showed so far. `charged` is what the spend totals of `store` (the filter's store
    when it started, whatever `redis_url` says later) hold for it now (None: nothing yet, the user
    had no limit or the store was away; the reply is added whole when it ends)."""

    turn_id: str
    user: str
    day: date
    model: str
    price: ModelPrice | None
    prompt_tokens: int
    reply_tokens: int  # the reply's allowance in the estimate
    charged: Charge | None
    started: float
    store: Store = field(repr=False, compare=False)  # where it was charged: it is settled and booked there
    relayed: bool = False  # its stream comes through the user's browser (a direct connection): the client's
    last_seen: float = 0.0
    streamed: int = 0  # characters of text the stream carried
    stream_usage: list[Usage] = field(default_factory=list)  # one per provider call that reported
    reported_at: int = 0  # `streamed` when the last call reported: what came after is a later call's
    calling: bool = False  # the call streaming now asked for tools
    calls_on: bool = False  # the last call that reported asked for tools: another call follows
    reported_by: object = None  # the stream id (`id`) of the call that reported last
    ended: bool = False
    finished: bool = False  # its outlet came: only that outlet settles it now
    booked: tuple[Usage, Decimal | None] | None = None  # added to the ledger when it ended (no outlet)
    settling: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False, compare=False)  # one settlement at a time

    @property
    def quiet_since(self) -> float:
        return self.last_seen or self.started

    @property
    def estimate(self) -> Charge:
        """The charge when the turn starts: its prompt as counted plus the reply's allowance."""
        return Charge.priced(Usage(self.prompt_tokens, self.reply_tokens), self.price)

    def report(self, usage: Usage, event: Mapping[str, Any]) -> bool:
        """Take the usage a streamed chunk (`event`) reports. A new provider call's (the first, one
        after a call that asked for tools, or of another stream id) is added; the same call's
        again (a backend reporting running totals on every chunk, as vLLM's continuous usage
        stats do) replaces it, so it counts once. True when the charge should be settled now:
        a new call, or a call's last report (its chunk carries no choices, as OpenAI's does).
        At most MAX_STREAM_CALLS calls are kept apart: later ones add to the last."""
        stream = event.get("id")
        same = bool(self.stream_usage) and (stream == self.reported_by if stream is not None else not self.calls_on)
        if same:
            self.stream_usage[-1] = usage
        elif len(self.stream_usage) < MAX_STREAM_CALLS:
            self.stream_usage.append(usage)
        else:
            last = self.stream_usage[-1]
            self.stream_usage[-1] = Usage(
                (last.prompt_tokens or 0) + (usage.prompt_tokens or 0),
                (last.completion_tokens or 0) + (usage.completion_tokens or 0),
            )
        self.reported_by, self.reported_at = stream, self.streamed
        self.calls_on, self.calling = self.calling or (same and self.calls_on), False
        return not same or not event.get("choices")

    def used(self, *, open_turn: bool = False) -> tuple[Usage, Charge]:
        """What the turn used as far as this worker saw, and its charge: the provider calls'
        usage as the stream reported it, and a later call's (after a call that asked for tools,
        or text streamed since the last report) at the last call's prompt plus what it streamed,
        at least its reply allowance while the turn is open (`open_turn`); with no report, the
        prompt plus what streamed, else the estimate."""
        if not self.stream_usage:
            reply = -(-self.streamed // CHARS_PER_TOKEN) if self.streamed else self.reply_tokens
            usage = Usage(self.prompt_tokens, reply)
            return usage, Charge.priced(usage, self.price)
        return self._priced(*self._calls(open_turn))

    def _calls(self, open_turn: bool) -> tuple[list[Usage], bool]:
        """The provider calls' usage as the stream reported it, then a later call's as counted
        here (True when there is one: after a call that asked for tools, or text streamed since
        the last report), at least its reply allowance while the turn is open (`open_turn`)."""
        calls = list(self.stream_usage)
        since = self.streamed - self.reported_at
        if since <= 0 and not self.calls_on:
            return calls, False
        reply = -(-since // CHARS_PER_TOKEN)
        if open_turn and self.calls_on:
            reply = max(reply, self.reply_tokens)
        calls.append(Usage(calls[-1].prompt_tokens or self.prompt_tokens, reply))
        return calls, True

    def _priced(self, calls: Sequence[Usage], counted: bool) -> tuple[Usage, Charge]:
        """The calls as one reply's usage (`_summed`), and their charge, each at its own tier."""
        return _summed(calls, counted), reduce(Charge.plus, (Charge.priced(u, self.price) for u in calls))

    def seen(self) -> Charge:
        """The least this worker saw the turn use, below which its outlet (the client's input:
        Open WebUI reads its usage from the saved chat) cannot settle it (`sight`)."""
        return self.sight().charge

    def sight(self) -> Seen:
        """What this worker saw the turn use, the least its outlet can settle it at (`seen`):
        what its stream's provider calls reported, with text streamed since; with no report,
        MIN_CALIBRATION of its prompt as counted and of what streamed (the fewest tokens a
        provider's tokenizer is believed to count for ours: an honest reply is never charged
        more than it reported). The usage beside the charge is what the ledger then records."""
        if self.stream_usage:
            calls, counted = self._calls(open_turn=False)
            return Seen(*self._priced(calls, counted), counted)
        counts = (self.prompt_tokens, -(-self.streamed // CHARS_PER_TOKEN))
        prompt, reply = (math.floor(tokens * MIN_CALIBRATION) for tokens in counts)
        usage = Usage(prompt, reply, shape=ESTIMATE_SHAPE)
        return Seen(usage, Charge.priced(usage, self.price), True)

    def reported(self) -> Usage | None:
        """The usage the backend reported in the stream for the turn's first provider call (the
        prompt the trim built; a tool loop's later calls read it again), what the cache statistics
        learn from: the outlet's usage is the client's to write, this the provider's, seen by this
        worker. None when the stream reported nothing or was the client's to write (`relayed`)."""
        return None if self.relayed or not self.stream_usage else self.stream_usage[0]

    def reported_prompt(self) -> int | None:
        """The prompt tokens the backend reported in the stream for the turn's one provider call,
        what the calibration learns from (as `reported`). None when the stream reported no call or
        several, a call asked for tools (another follows), its report left a count out, or the
        stream was the client's to write (`relayed`)."""
        usage = self.reported()
        if usage is None or len(self.stream_usage) != 1 or self.calls_on or self.calling:
            return None
        if usage.calls_summed or usage.completion_tokens is None:
            return None
        return usage.prompt_tokens


def read_chunk(event: Any) -> tuple[int, bool]:
    """What one streamed chunk shows, in one pass over it: the characters of reply text it
    carries (content, reasoning, tool-call arguments), and whether its call asks for tools
    (tool-call deltas, or that finish reason: the turn goes on with another call once they ran)."""
    choices = event.get("choices") if isinstance(event, Mapping) else None
    total, tools = 0, False
    for choice in choices[:8] if isinstance(choices, list) else ():
        if not isinstance(choice, Mapping):
            continue
        tools = tools or choice.get("finish_reason") == "tool_calls"
        delta = choice.get("delta")
        if not isinstance(delta, Mapping):
            continue
        for name in ("content", "reasoning_content", "reasoning"):
            if isinstance(text := delta.get(name), str):
                total += len(text)
        calls = delta.get("tool_calls")
        tools = tools or bool(calls)
        for call in calls[:8] if isinstance(calls, list) else ():
            function = call.get("function") if isinstance(call, Mapping) else None
            if isinstance(function, Mapping) and isinstance(arguments := function.get("arguments"), str):
                total += len(arguments)
    return total, tools


def reply_allowance(body: Mapping[str, Any], default: int) -> int:
    """The reply's tokens a turn is charged for at its start: the larger of the request's own
    `max_tokens` and `max_completion_tokens` when it sets one (the body reaches the backend
    whole, and a backend reads the one it knows), else `default` (the `reserve_output_tokens` valve).

    Example:
        >>> reply_allowance({"max_completion_tokens": 1, "max_tokens": 16_000}, 1_024)
        16000
    """
    values = [body.get(name) for name in ("max_completion_tokens", "max_tokens")]
    sizes = [v for v in values if isinstance(v, int) and not isinstance(v, bool) and 0 < v]
    return min(max(sizes), MAX_REPLY_ALLOWANCE) if sizes else default


def rough_tokens(messages: Sequence[Message]) -> int:
    """A prompt's tokens from its characters (`CHARS_PER_TOKEN`), for a turn no trim counted."""
    return -(-sum(len(message_text(m)) for m in messages) // CHARS_PER_TOKEN)


class OpenTurns:
    """The turns of one worker from start to end (bounded, in start order), and the last ones
    pushed out to stay bounded (`MAX_GONE_TURNS`), for their outlets."""

    def __init__(self) -> None:
        self._turns: OrderedDict[str, OpenTurn] = OrderedDict()
        self._of_user: dict[str, OrderedDict[str, None]] = {}  # each user's open turns, in start order
        self._gone: OrderedDict[str, OpenTurn] = OrderedDict()
        self._holding: Counter[Store] = Counter()  # turns kept (open, pushed out, finishing, starting) by store
        self._next_sweep = 0.0

    def start(self, turn: OpenTurn) -> list[OpenTurn]:
        """Register a turn, making room first: the user's own oldest goes when they have
        MAX_USER_OPEN_TURNS open, the oldest of all when the worker has MAX_OPEN_TURNS (so one
        user's flood never pushes out another user's turn). Returns the turns pushed out that had
        not ended: marked ended now, for the caller to settle as the sweep settles a quiet one."""
        pushed = []
        mine = self._of_user.get(turn.user)
        if mine is not None and len(mine) >= MAX_USER_OPEN_TURNS:
            pushed.append(self._push_out(next(iter(mine))))
        while len(self._turns) >= MAX_OPEN_TURNS:
            pushed.append(self._push_out(next(iter(self._turns))))
        self._turns[turn.turn_id] = turn
        self._of_user.setdefault(turn.user, OrderedDict())[turn.turn_id] = None
        self.hold(turn.store)
        return [old for old in pushed if old is not None]

    def holds(self, store: Store) -> bool:
        """Whether a turn kept here (open, pushed out, finishing or starting) is charged in `store`."""
        return self._holding[store] > 0

    def hold(self, store: Store) -> None:
        """A turn charged in `store` is not kept here yet (being charged) or any more (its outlet,
        after `finish`, settling it): `store` is in use until `unhold`."""
        self._holding[store] += 1

    def unhold(self, store: Store) -> None:
        """Undo one `hold`, and the hold a turn `finish` returned keeps until its outlet is done."""
        self._holding[store] -= 1
        if self._holding[store] <= 0:
            del self._holding[store]

    def find(self, turn_id: object) -> OpenTurn | None:
        """An open turn (a turn pushed out is not watched any more: its stream is not followed)."""
        return self._turns.get(turn_id) if isinstance(turn_id, str) else None

    def finish(self, turn_id: object) -> OpenTurn | None:
        """The turn an outlet ends (removed; its store held until the outlet's `unhold`), open or
        pushed out, or None: not started here, pushed out too long ago, or already finished."""
        turn = self.find(turn_id)
        if turn is not None:
            self._forget(turn.turn_id)
        elif isinstance(turn_id, str):
            turn = self._gone.pop(turn_id, None)
        if turn is not None:
            turn.finished = True
        return turn

    def _push_out(self, turn_id: str) -> OpenTurn | None:
        """Take a turn out to make room, keeping it for its outlet; the turn when it had not
        ended (marked ended now: the caller settles it)."""
        turn = self._turns[turn_id]
        self._forget(turn_id)
        self._gone[turn_id] = turn
        while len(self._gone) > MAX_GONE_TURNS:
            self.unhold(self._gone.popitem(last=False)[1].store)
        if turn.ended:
            return None  # settled as ended already (or being settled by a sweep)
        turn.ended = True
        return turn

    def due(self, now: float) -> list[OpenTurn]:
        """Turns that just ended without an outlet (marked ended, kept for a late one); turns
        ended long ago are forgotten. Looks at most once a second."""
        if now < self._next_sweep:
            return []
        self._next_sweep = now + SWEEP_EVERY_SECONDS
        ended, old = [], []
        for turn in self._turns.values():
            if turn.ended:
                if now - turn.quiet_since > KEEP_SECONDS:
                    old.append(turn.turn_id)
            elif (turn.last_seen and now - turn.last_seen > STREAM_IDLE_SECONDS) or (
                now - turn.started > RESERVATION_SECONDS
            ):
                turn.ended = True
                ended.append(turn)
        for turn_id in old:
            self.unhold(self._turns[turn_id].store)
            self._forget(turn_id)
        while self._gone and now - next(iter(self._gone.values())).quiet_since > KEEP_SECONDS:
            self.unhold(self._gone.popitem(last=False)[1].store)
        return ended

    def _forget(self, turn_id: str) -> None:
        turn = self._turns.pop(turn_id, None)
        if turn is None:
            return
        mine = self._of_user.get(turn.user)
        if mine is not None:
            mine.pop(turn_id, None)
            if not mine:
                del self._of_user[turn.user]
