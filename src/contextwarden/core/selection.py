"""Choosing what to keep under a budget, and keeping that choice stable between turns.

The hard part (system messages, the current turn) and pinned units are always kept; then the
last `keep_last_turns` turns while they fit; then either the newest turns (`recent`) or the
units worth most per token (`relevance`). A unit is kept or dropped whole: one message, or an
assistant `tool_calls` message with its `tool` replies. A `TrimDecision` (decision.py) records
what was kept, so the next turn can send the same prefix again (`reuse_previous`,
`extend_previous`).
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Literal

from .alternation import alternate, alternates, fill_alternating, fill_quoting
from .chatview import ChatView
from .conversation import SYSTEM_ROLES, Message, continues_tool_loop, system_positions
from .decision import Recall, TrimDecision
from .relevance import DEFAULT_RELEVANCE_WEIGHTS, RelevanceWeights, leans_on_latest

__all__ = [
    "neighbour_reach",
    "DEFAULT_KEEP_LAST_TURNS",
    "MIN_KEEP_LAST_TURNS",
    "Strategy",
    "STRATEGIES",
    "DEFAULT_STRATEGY",
    "select_recent",
    "select_by_value",
    "choose_indices",
    "latest_question_competes",
    "turn_values",
    "reuse_previous",
    "extend_previous",
    "history_chars",
    "window_start",
    "mandatory_indices",
    "recent_turns",
    "carried_recalls",
]

Strategy = Literal["relevance", "recent"]
STRATEGIES: tuple[Strategy, ...] = ("relevance", "recent")
DEFAULT_STRATEGY: Strategy = "relevance"
# Value per cost ** 0.25: relevance scores are already length-normalised (BM25's b), so
# dividing by the whole cost would penalise long messages twice. Measured in bench/quality.py
# on both dev shapes (all evidence kept at 2k / 8k): 0.5 gave LoCoMo 0.754 / 0.858 and the
# reshaped set 0.695 / 0.847; 0.25 gives 0.761 / 0.858 and 0.707 / 0.851; 0 loses on
# LoCoMo at 8k (0.854).
DEFAULT_COST_EXPONENT = 0.25
# The least relevant picks a reply that would open what is sent looks through for room for its
# question (`_room_for`): bounds the work a reply on a chat of thousands of messages.
MAX_ROOM_SCAN = 256
DEFAULT_KEEP_LAST_TURNS = 1  # the current turn: the latest question and what answers it
MIN_KEEP_LAST_TURNS = 1  # the current turn counts and is always kept: 0 would mean 1 (the API, CLI, valve, !keep)


def select_recent(costs: Sequence[int], budget: int) -> list[int]:
    """Indices of the newest candidates that fit in `budget`, in ascending order.

    Candidates are taken newest first and the walk stops at the first that does not fit, so
    what is kept is one unbroken stretch ending at the newest candidate.

    Example:
        >>> select_recent([50, 10, 20, 30], budget=55)
        [2, 3]
    """
    kept: list[int] = []
    left = budget
    for index in range(len(costs) - 1, -1, -1):
        if costs[index] > left:
            break
        left -= costs[index]
        kept.append(index)
    kept.reverse()
    return kept


def select_by_value(
    costs: Sequence[int], values: Sequence[float], budget: int, *, cost_exponent: float = DEFAULT_COST_EXPONENT
) -> list[int]:
    """Candidates worth most in total within `budget`, in ascending order (0-1 knapsack, greedy).

    Greedy by value per `cost ** cost_exponent` (ties: newer first), skipping what does not
    fit; then a repair
    pass: when the single most valuable candidate that fits is worth more than the greedy
    pick, start from it instead (this bounds the loss at half the optimum).

    Example:
        >>> select_by_value([10, 10, 30], [1.0, 5.0, 9.0], budget=40)
        [1, 2]
    """
    order = sorted(range(len(costs)), key=lambda i: (-values[i] / max(costs[i], 1) ** cost_exponent, -i))

    def fill(start: list[int], left: int) -> list[int]:
        taken = list(start)
        for i in order:
            if i not in start and costs[i] <= left and values[i] > 0:
                taken.append(i)
                left -= costs[i]
        return taken

    greedy = fill([], budget)
    fitting = [i for i in range(len(costs)) if costs[i] <= budget]
    if fitting:
        best = max(fitting, key=lambda i: (values[i], i))
        if values[best] > sum(values[i] for i in greedy):
            greedy = fill([best], budget - costs[best])
    return sorted(greedy)


def mandatory_indices(view: ChatView) -> list[int]:
    """What is always sent: system messages and the current turn (the last user message on)."""
    mandatory = view.system_indices
    turns = view.turns
    current = view.current if view.current is not None else len(turns) - 1
    for turn in turns[current:] if turns else ():
        mandatory.extend(turn.indices)
    return sorted(mandatory)


def _history_start_ok(view: ChatView, keep: Collection[int]) -> bool:
    """The kept history does not begin with an assistant or tool message unless the input did."""
    role = view.role
    first = next((i for i in sorted(keep) if role(i) not in SYSTEM_ROLES), None)
    return first is None or first == _first_in(view) or role(first) not in ("assistant", "tool")


def _first_in(view: ChatView) -> int | None:
    """The input's first message that is not a system message."""
    return next((i for i in range(len(view)) if view.role(i) not in SYSTEM_ROLES), None)


@dataclass(frozen=True, slots=True)
class _Plan:
    """The hard indices, the optional units (oldest first), and each unit's turn number."""

    hard: frozenset[int]
    units: tuple[range, ...]
    unit_turn: tuple[int, ...]
    turn_user: tuple[int | None, ...]


def _plan(view: ChatView) -> _Plan:
    hard = frozenset(mandatory_indices(view))
    units: list[range] = []
    unit_turn: list[int] = []
    turn_user: list[int | None] = []
    for t, turn in enumerate(view.turns):
        first = turn.units[0]
        turn_user.append(first.start if first.kind == "user" else None)
        for unit in turn.units:
            if unit.start not in hard:
                units.append(range(unit.start, unit.stop))
                unit_turn.append(t)
    return _Plan(hard, tuple(units), tuple(unit_turn), tuple(turn_user))


def _pinned_units(plan: _Plan, pinned: Collection[int]) -> list[int]:
    """The optional units holding a pinned index (pins are mandatory: kept whatever they cost)."""
    pins = set(pinned)
    return [u for u, unit in enumerate(plan.units) if pins.intersection(unit)] if pins else []


def _preferred(plan: _Plan, view: ChatView, keep_last_turns: int, pinned: Collection[int]) -> list[int]:
    """Units to add before any other, in order: pinned ones, then the last turns newest first."""
    order = _pinned_units(plan, pinned)
    recent = recent_turns(view, keep_last_turns)
    order += [u for u in range(len(plan.units) - 1, -1, -1) if plan.unit_turn[u] in recent and u not in order]
    return order


def recent_turns(view: ChatView, keep_last_turns: int) -> set[int]:
    """The turns before the current one that `keep_last_turns` keeps first (it counts the current one)."""
    current = view.current if view.current is not None else len(view.turns)
    return set(range(current - max(0, keep_last_turns - 1), current))


def _pick_turns(
    view: ChatView,
    plan: _Plan,
    groups: dict[int, list[int]],
    unit_cost: Sequence[int],
    open_turns: list[int],
    group_cost: list[int],
    left: int,
    strategy: Strategy,
    weights: RelevanceWeights,
    scores: Sequence[float] | None,
) -> list[int]:
    """The strategy's pick among the turns still open (positions in `open_turns`) within `left`."""
    if strategy == "recent":
        return select_recent(group_cost, max(0, left))
    if not (open_turns and left > 0 and view.question is not None):
        return []
    scores = view.relevance(weights) if scores is None else scores
    values = _turn_values(plan, groups, unit_cost, scores, weights, view.latest)
    return select_by_value(group_cost, [values[t] for t in open_turns], left)


def _pick_messages(
    view: ChatView,
    plan: _Plan,
    taken: Collection[int],
    unit_cost: Sequence[int],
    left: int,
    weights: RelevanceWeights,
    scores: Sequence[float] | None,
    frame: int | None = None,
) -> tuple[list[int], list[int]]:
    """The open units (single messages, tool groups) most relevant first while they fit, each
    worth its best message whatever its length, with a bridge where it would put two user or
    two assistant messages together (`alternation.fill_alternating`); then
    `_with_opening_question`, and `alternation.alternate` for what that changed.
    With an embedder, bench/quality.py (all evidence kept, 1k / 2k / 4k / 8k): REALTALK
    0.405 / 0.529 / 0.677 / 0.819 by whole turns, 0.447 / 0.580 / 0.707 / 0.816 by message
    (0.474 / 0.619 / 0.728 / 0.828 before roles had to alternate); LoCoMo 0.722 / 0.800 /
    0.866 / 0.922 and 0.726 / 0.796 / 0.866 / 0.920 (0.733 / 0.805 / 0.872 / 0.928). Lexically
    it loses on LoCoMo (the evidence is often the reply beside the message BM25 matches).
    With a `frame` (what a recall block's label and acknowledgement cost) a pick that would
    clash is quoted in a recall block instead of bridged (`alternation.fill_quoting`): returned
    second, (units in place, units quoted)."""
    if left <= 0 or view.question is None:
        return [], []
    scores = view.relevance(weights) if scores is None else scores
    room = left
    value = {u: max(scores[i] for i in plan.units[u]) for u in range(len(plan.units)) if u not in taken}
    order = sorted((u for u in value if value[u] > 0), key=lambda u: (-value[u], -u))
    fixed = [*plan.hard, *(i for u in taken for i in plan.units[u])]
    if frame is not None:  # what would clash or open what is sent is quoted: nothing to repair
        chosen, quoted = fill_quoting(view, plan.units, fixed, order, unit_cost, left, frame, _first_in(view))
        return sorted(chosen), quoted
    chosen = fill_alternating(view, plan.units, fixed, order, value, unit_cost, left)
    left -= sum(unit_cost[u] for u in chosen)
    starts = [plan.units[u].start for u in taken] + [i for i in plan.hard if view.role(i) not in SYSTEM_ROLES]
    first_in = _first_in(view)
    replies = {u for u in value if view.role(plan.units[u].start) != "user" and plan.units[u].start != first_in}
    filled = set(chosen)
    picked = _with_opening_question(
        plan, chosen, order, value, unit_cost, left, replies, min(starts, default=len(view))
    )
    if set(picked) == filled:  # the fill already alternates
        return picked, []
    left = room - sum(unit_cost[u] for u in picked)
    return sorted(alternate(view, plan.units, fixed, picked, value, unit_cost, left, order)), []


def _with_opening_question(
    plan: _Plan,
    chosen: set[int],
    order: Sequence[int],
    value: Mapping[int, float],
    unit_cost: Sequence[int],
    left: int,
    replies: Collection[int],
    fixed: int,
) -> list[int]:
    """What is sent never opens with a reply (a unit in `replies` before the first of the
    chosen ones and of the fixed part, at `fixed`): that reply brings its turn's user message,
    for which the least relevant picks make room if together they are worth less than it
    (`_room_for`); else it goes. What the replies that went leave is filled again once, by
    `order`, with what does not open."""
    unit_at = {plan.units[u].start: u for u in value}
    least_first = sorted(chosen, key=lambda v: (value[v], v))
    dropped = False
    for lead in sorted(chosen):
        if lead not in replies or plan.units[lead].start >= fixed:
            break
        asked = plan.turn_user[plan.unit_turn[lead]]
        user = unit_at.get(asked) if asked is not None else None
        victims = _room_for(user, lead, least_first, chosen, value, unit_cost, left) if user is not None else None
        if victims is not None and user is not None:
            chosen.difference_update(victims)
            chosen.add(user)
            left += sum(unit_cost[v] for v in victims) - unit_cost[user]
            break
        chosen.discard(lead)
        left += unit_cost[lead]
        dropped = True
    if dropped:
        earliest = min(fixed, plan.units[min(chosen)].start) if chosen else fixed
        for u in order:
            start = plan.units[u].start
            if u not in chosen and unit_cost[u] <= left and (u not in replies or start > earliest):
                chosen.add(u)
                left -= unit_cost[u]
                earliest = min(earliest, start)
    return sorted(chosen)


def _room_for(
    user: int,
    lead: int,
    least_first: Sequence[int],
    chosen: Collection[int],
    value: Mapping[int, float],
    unit_cost: Sequence[int],
    left: int,
) -> list[int] | None:
    """The least relevant chosen units (not `lead`) whose room, with `left`, fits `user`, when
    together they are worth less than `lead`; None when there are none such among the first
    `MAX_ROOM_SCAN` of `least_first`."""
    need, worth, victims = unit_cost[user] - left, 0.0, []
    for v in least_first[:MAX_ROOM_SCAN]:
        if need <= 0:
            break
        if v == lead or v not in chosen:
            continue
        worth += value[v]
        if worth >= value[lead]:
            return None
        victims.append(v)
        need -= unit_cost[v]
    return victims if need <= 0 else None


def choose_indices(
    view: ChatView,
    costs: Sequence[int],
    budget: int,
    *,
    strategy: Strategy = DEFAULT_STRATEGY,
    keep_last_turns: int = DEFAULT_KEEP_LAST_TURNS,
    pinned: Collection[int] = (),
    weights: RelevanceWeights = DEFAULT_RELEVANCE_WEIGHTS,
    scores: Sequence[float] | None = None,
    room: int | None = None,
    by_message: bool = False,
    frame: int | None = None,
    quoted: list[int] | None = None,
) -> set[int]:
    """The message indices to send: hard part, pins, preferred turns, then the strategy's pick.

    Earlier turns go whole (a question with all its replies) or not at all, so a kept question
    has its answer and no reply is sent without its question. Pinned units are mandatory; the
    rest of a pinned turn, the latest turn (the answer just before the current question; by
    message its question only for a follow-up: `_pick_by_message`) and the last
    `keep_last_turns` turns come next, newest first, each while it fits. The latest
    turn may use `room` (default `budget`): the whole budget when `budget` is a watermark.
    `scores` (one per message) replaces the relevance scoring, e.g. to compare scorers.
    With `by_message` the relevance strategy picks single messages rather than whole turns
    (`_pick_messages`): what the embedder's scores are good enough for.

    `budget` covers the messages (reply priming is the caller's); the hard part and the pinned
    units are returned even when they alone are over. The result never begins its history with
    an assistant or tool message unless the input did: such a unit gets its turn's user
    message, or is let go; by message, user and assistant messages alternate where the input's
    do (`alternation`): with a `frame` (what a recall block's label and acknowledgement cost) a
    pick that would put two of one role together, or open the history with a reply, is quoted
    in a recall block instead (`alternation.fill_quoting`; `fresh._quoted_blocks` places it): its
    index goes into `quoted` (ascending) and its cost, with `frame` once, is within `budget`;
    without one it gets a reply from between as a bridge.

    Example:
        >>> chat = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
        ...         {"role": "user", "content": "z"}]
        >>> sorted(choose_indices(ChatView(chat), [5, 5, 5], 10, strategy="recent"))
        [2]
        >>> sorted(choose_indices(ChatView(chat), [5, 5, 5], 15, strategy="recent"))
        [0, 1, 2]
        >>> chat = [{"role": "user", "content": "lamp"}, {"role": "assistant", "content": "ok"},
        ...         {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
        ...         {"role": "user", "content": "lamp?"}]
        >>> quoted: list[int] = []
        >>> sorted(choose_indices(ChatView(chat), [5, 50, 5, 5, 5], 25, scores=[1, 0, 0, 0, 0],
        ...                       by_message=True, frame=5, quoted=quoted)), quoted
        ([2, 3, 4], [0])
    """
    plan = _plan(view)
    if by_message and strategy == "relevance":
        options = _ByMessage(keep_last_turns, pinned, weights, scores, room, frame)
        return _pick_by_message(view, plan, costs, budget, options, quoted)
    keep, taken, left, unit_cost = _first_kept(view, plan, costs, budget, keep_last_turns, pinned, room)
    groups = _turn_groups(plan)
    open_turns = [t for t in sorted(groups) if taken.isdisjoint(groups[t])]
    group_cost = [sum(unit_cost[u] for u in groups[t]) for t in open_turns]
    chosen = _pick_turns(view, plan, groups, unit_cost, open_turns, group_cost, left, strategy, weights, scores)
    for k in chosen:
        taken.update(groups[open_turns[k]])
        left -= group_cost[k]
    for u in taken:
        keep.update(plan.units[u])
    return _repair_history_start(view, plan, keep, costs, left)


def _first_kept(
    view: ChatView,
    plan: _Plan,
    costs: Sequence[int],
    budget: int,
    keep_last_turns: int,
    pinned: Collection[int],
    room: int | None,
    reply_only: bool = False,
) -> tuple[set[int], set[int], int, list[int]]:
    """What goes before any pick: the hard part, the pinned units, then the preferred turns while
    they fit (the latest one may use `room`; with `reply_only` only its reply). Returns the hard
    indices, the units taken, the budget left and every unit's cost."""
    keep = set(plan.hard)
    left = budget - sum(costs[i] for i in keep)
    unit_cost = [sum(costs[i] for i in unit) for unit in plan.units]
    groups = _turn_groups(plan)
    must = _pinned_units(plan, pinned)
    taken: set[int] = set(must)
    left -= sum(unit_cost[u] for u in must)
    latest = view.latest
    extra = max(0, (room if room is not None else budget) - budget)
    for t in _preferred_turns(plan, view, keep_last_turns, must, latest):
        rest = [u for u in groups[t] if u not in taken]
        if t == latest and reply_only:  # its question competes by relevance, like any message
            rest = [u for u in rest if view.role(plan.units[u].start) != "user"]
        cost = sum(unit_cost[u] for u in rest)
        if cost <= left + (extra if t == latest else 0):
            taken.update(rest)
            left -= cost
    return keep, taken, left, unit_cost


@dataclass(frozen=True, slots=True)
class _ByMessage:
    """`choose_indices`' options for a selection by message (see there)."""

    keep_last_turns: int
    pinned: Collection[int]
    weights: RelevanceWeights
    scores: Sequence[float] | None
    room: int | None
    frame: int | None


def _pick_by_message(
    view: ChatView, plan: _Plan, costs: Sequence[int], budget: int, options: _ByMessage, quoted: list[int] | None
) -> set[int]:
    """`choose_indices` by message. The latest exchange's reply is kept first, and its question
    only for a follow-up (`leans_on_latest`) or when `keep_last_turns` asks for that turn whole:
    a question that stands on its own needs the one before it no more than any other message.
    When the reply would then follow no question (a pinned turn's reply before it, nothing in
    place before it), the exchange is kept whole after all. bench/quality.py with MiniLM, all
    evidence kept at 1k / 2k / 4k / 8k: REALTALK 0.480 / 0.616 / 0.731 / 0.831 -> 0.498 / 0.619 /
    0.728 / 0.831; LoCoMo 0.737 / 0.804 -> 0.738 / 0.805 at 1k / 2k (4k, 8k equal)."""
    latest = view.latest
    if latest is not None and latest_question_competes(view, options.keep_last_turns):
        trial: list[int] = []
        keep = _by_message(view, plan, costs, budget, options, trial, reply_only=True)
        if _reply_answers(view, plan, keep, latest):
            if quoted is not None:
                quoted.extend(trial)
            return keep
    return _by_message(view, plan, costs, budget, options, quoted, reply_only=False)


def latest_question_competes(view: ChatView, keep_last_turns: int) -> bool:
    """By message, whether the latest exchange's question competes like any message rather than
    going first with its reply: the current question stands on its own (`leans_on_latest`) and
    `keep_last_turns` does not ask for the latest turn whole (`_pick_by_message`)."""
    latest = view.latest
    return (
        latest is not None
        and view.question is not None
        and latest not in recent_turns(view, keep_last_turns)
        and not leans_on_latest(view.text(view.question))
    )


def _by_message(
    view: ChatView,
    plan: _Plan,
    costs: Sequence[int],
    budget: int,
    options: _ByMessage,
    quoted: list[int] | None,
    *,
    reply_only: bool,
) -> set[int]:
    """One selection by message: what `_first_kept` keeps, then `_pick_messages`."""
    keep, taken, left, unit_cost = _first_kept(
        view, plan, costs, budget, options.keep_last_turns, options.pinned, options.room, reply_only
    )
    picked, quoting = _pick_messages(view, plan, taken, unit_cost, left, options.weights, options.scores, options.frame)
    taken.update(picked)
    left -= sum(unit_cost[u] for u in [*picked, *quoting]) + ((options.frame or 0) if quoting else 0)
    if quoted is not None:
        quoted.extend(sorted(plan.units[u].start for u in quoting))
    for u in taken:
        keep.update(plan.units[u])
    return _repair_history_start(view, plan, keep, costs, left)


def _reply_answers(view: ChatView, plan: _Plan, keep: Collection[int], latest: int) -> bool:
    """The latest exchange's reply, if sent, follows a user message sent in place."""
    replies = [u.start for t, u in zip(plan.unit_turn, plan.units, strict=True) if t == latest]
    first = min((i for i in replies if i in keep and view.role(i) != "user"), default=None)
    if first is None:
        return True
    before = max((i for i in keep if i < first and view.role(i) not in SYSTEM_ROLES), default=None)
    return before is not None and view.role(before) == "user"


def turn_values(
    view: ChatView,
    costs: Sequence[int],
    scores: Sequence[float],
    weights: RelevanceWeights = DEFAULT_RELEVANCE_WEIGHTS,
) -> dict[int, float]:
    """What each earlier turn is worth to the relevance strategy (by turn number), as
    `choose_indices` weighs it before dividing by its cost ** `DEFAULT_COST_EXPONENT`."""
    plan = _plan(view)
    unit_cost = [sum(costs[i] for i in unit) for unit in plan.units]
    return _turn_values(plan, _turn_groups(plan), unit_cost, scores, weights, view.latest)


def neighbour_reach(own: int, theirs: int, weights: RelevanceWeights) -> float:
    """How much of a neighbour's share reaches: all of it while the two (turns, or the recall's
    messages) average at most `weights.turn_reach` tokens, in proportion beyond."""
    return min(1.0, 2 * weights.turn_reach / max(1, own + theirs))


def _turn_values(
    plan: _Plan,
    groups: dict[int, list[int]],
    unit_cost: Sequence[int],
    scores: Sequence[float],
    weights: RelevanceWeights,
    latest: int | None,
) -> dict[int, float]:
    """Each turn's worth when kept whole: its messages' scores plus `weights.turn_share` of the
    best message score in an adjacent turn, in full while the two turns average at most
    `turn_reach` tokens, in proportion beyond (what was said next to a match often completes
    it; a long turn already holds its own context). Only what the neighbour's best holds above
    the chat's median turn counts: next to a turn as ordinary as most, nothing is completed
    (near-alike filler turns would otherwise all gain and pass a real match).
    bench/quality.py: +0.02-0.03 kept at 2k.
    The `latest` turn (kept first anyway) shares nothing: a short question's query is built from
    it, so its score is its own words matching themselves."""
    own = {t: [scores[i] for u in us for i in plan.units[u]] for t, us in groups.items()}
    cost = {t: sum(unit_cost[u] for u in us) for t, us in groups.items()}
    best = {t: max(values, default=0.0) for t, values in own.items() if t != latest}
    typical = statistics.median(best.values()) if best else 0.0
    values = {}
    for t, mine in own.items():
        near = [
            max(0.0, best[j] - typical) * neighbour_reach(cost[t], cost[j], weights)
            for j in (t - 1, t + 1)
            if j in best
        ]
        values[t] = sum(mine) + weights.turn_share * max(near, default=0.0)
    return values


def _turn_groups(plan: _Plan) -> dict[int, list[int]]:
    """The optional units of each turn, by turn number: what goes whole or not at all."""
    groups: dict[int, list[int]] = {}
    for u, t in enumerate(plan.unit_turn):
        groups.setdefault(t, []).append(u)
    return groups


def _preferred_turns(
    plan: _Plan, view: ChatView, keep_last_turns: int, must: list[int], latest: int | None
) -> list[int]:
    """Turns to add whole before the strategy picks, in order: pinned ones (their rest), the
    latest one, then the last `keep_last_turns` turns newest first."""
    order = list(dict.fromkeys(plan.unit_turn[u] for u in must))
    recent = sorted(recent_turns(view, keep_last_turns) | ({latest} if latest is not None else set()), reverse=True)
    present = set(plan.unit_turn)
    return order + [t for t in recent if t in present and t not in order]


def _repair_history_start(view: ChatView, plan: _Plan, keep: set[int], costs: Sequence[int], left: int) -> set[int]:
    """Give a leading assistant/tool unit its turn's user message, or drop it, until valid."""
    unit_of = {unit[0]: u for u, unit in enumerate(plan.units)}
    while not _history_start_ok(view, keep):
        first = next(i for i in sorted(keep) if view.role(i) not in SYSTEM_ROLES)
        if first not in unit_of:  # cannot happen: the hard part starts with a user message
            break
        unit = plan.units[unit_of[first]]
        user = plan.turn_user[plan.unit_turn[unit_of[first]]]
        if user is not None and user not in keep and costs[user] <= left:
            keep.add(user)
            left -= costs[user]
        else:
            keep.difference_update(unit)
            left += sum(costs[i] for i in unit)
    return keep


def reuse_previous(
    previous: TrimDecision,
    fingerprints: Sequence[str],
    view: ChatView,
    costs: Sequence[int],
    budget: int,
    *,
    keep_last_turns: int = DEFAULT_KEEP_LAST_TURNS,
    pinned: Collection[int] = (),
    alone: Collection[int] | None = None,
) -> set[int] | None:
    """The previous selection plus everything after it, if that is still valid and fits.

    The previous kept messages must all be found, in order, among the non-system messages;
    then what is sent is: system messages, those messages, every message after the last of
    them, the hard part, pinned units and the last `keep_last_turns` turns (those the previous
    selection let go only when they fit now) — whole units only, no orphans. None
    when a kept message is gone, the history would start wrongly, two user or two assistant
    messages would meet that the chat did not put together (an edited chat: `alternates`; a
    pin may, and `alone` says which: the messages the user pinned, not their units and
    questions; default `pinned`), or it does not fit `budget`.

    Example:
        >>> chat = [{"role": ("user", "assistant")[k % 2], "content": c} for k, c in enumerate("abcdefg")]
        >>> from contextwarden.core.decision import message_fingerprint
        >>> prints = [message_fingerprint(m) for m in chat]
        >>> before = TrimDecision(100, 20, "relevance", (prints[0], prints[3]))
        >>> sorted(reuse_previous(before, prints, ChatView(chat), [5] * 7, 100))
        [0, 3, 4, 5, 6]
    """
    matched = _find_kept(previous, fingerprints, set(view.system_indices))
    if matched is None:
        return None
    keep = _grown(view, matched, keep_last_turns, pinned)
    if sum(costs[i] for i in keep) > budget:  # recent turns the previous selection let go: still out
        keep = _grown(view, matched, 0, pinned)
    if not _history_start_ok(view, keep) or sum(costs[i] for i in keep) > budget:
        return None
    return keep if alternates(view, keep, mandatory_indices(view), pinned if alone is None else alone) else None


def _grown(view: ChatView, matched: list[int], keep_last_turns: int, pinned: Collection[int]) -> set[int]:
    """`matched` plus everything after the last of it, the hard part, pinned units and the
    last `keep_last_turns` turns (but when `matched` ends at the question: this turn trimmed
    again, a retry or a later pass, whose selection let them go), as whole units without orphans."""
    after = matched[-1] + 1 if matched else 0
    plan = _plan(view)
    keep = set(plan.hard) | set(matched) | set(range(after, len(view.messages)))
    again = bool(matched) and matched[-1] == view.question
    for u in _pinned_units(plan, pinned) if again else _preferred(plan, view, keep_last_turns, pinned):
        keep.update(plan.units[u])
    keep.difference_update(view.orphan_indices)
    for turn in view.turns:
        for unit in turn.units:
            if unit.stop - unit.start > 1 and keep.intersection(unit.indices):
                keep.update(unit.indices)
    return keep


def extend_previous(
    previous: TrimDecision, view: ChatView, *, keep_last_turns: int = DEFAULT_KEEP_LAST_TURNS
) -> set[int] | None:
    """`reuse_previous` without reading the whole chat: the indices it would keep (budget not
    checked), from the previous kept messages at their recorded positions and the messages
    after the last of them; None when that is not enough to know.

    The chat is read only from the last kept message that starts a unit; what comes before
    it is either kept (found by fingerprint) or was dropped and stays dropped. System
    messages are kept wherever they are. None when a kept message is not at its recorded
    place, the window holds no user message, a turn `keep_last_turns` keeps begins before it,
    or roles would not alternate (`alternates`).

    Example:
        >>> chat = [{"role": ("user", "assistant")[k % 2], "content": c} for k, c in enumerate("abcdefg")]
        >>> from contextwarden.core.decision import message_fingerprint
        >>> prints = [message_fingerprint(m) for m in chat]
        >>> before = TrimDecision(100, 20, "relevance", (prints[0], prints[3]), at=(0, 3))
        >>> sorted(extend_previous(before, ChatView(chat)))
        [0, 3, 4, 5, 6]
    """
    at = previous.at
    if not _kept_in_place(previous, view.fingerprints):
        return None
    start = window_start(previous, view)
    if start is None:
        return None
    window = view.window(start)
    if window.current is None:
        return None
    turns = window.turns
    if any(t < 0 or turns[t].units[0].kind != "user" for t in recent_turns(window, keep_last_turns)):
        return None  # a turn kept as recent starts before the window
    grown = _grown(window, [i - start for i in at if i >= start], keep_last_turns, ())
    keep = set(view.system_positions)
    keep.update(i for i in at if i < start)
    keep.update(start + i for i in grown)
    hard = [start + i for i in mandatory_indices(window)]
    return keep if _history_start_ok(view, keep) and alternates(view, keep, hard) else None


def window_start(previous: TrimDecision, view: ChatView) -> int | None:
    """Where `extend_previous` starts reading: the last kept message that starts a unit (not a
    tool result, nor the tool images after one); None when no kept message does."""
    starts = (i for i in reversed(previous.at) if i < len(view) and view.role(i) != "tool")
    return next((i for i in starts if not continues_tool_loop(view.messages, i)), None)


def history_chars(messages: Sequence[Message], system: Sequence[int] | None = None) -> int:
    """Total length of the content of the non-system messages: a cheap check (no pass in
    Python over the texts) that no message was edited; -1 for content without a length.
    `system` gives the system messages' indices when the caller has them (`ChatView`).

    Example:
        >>> history_chars([{"role": "system", "content": "rules"}, {"role": "user", "content": "hi"}])
        2
    """
    try:
        total = sum(map(_content_chars, map(dict.get, messages, repeat("content"))))
        system = system_positions(messages) if system is None else system
        return total - sum(_content_chars(messages[i].get("content")) for i in system)
    except TypeError:  # content that is not text, parts or None
        return -1


def _content_chars(content: object) -> int:
    """A content's length for `history_chars`: a text's characters; for parts, their texts'
    characters and one for each other part (their count alone would miss an edited text part)."""
    if isinstance(content, list):
        return sum(len(p["text"]) if isinstance(p, dict) and type(p.get("text")) is str else 1 for p in content)
    return len(content) if content else 0  # type: ignore[arg-type]  # (no length: TypeError, -1 above)


def _find_kept(previous: TrimDecision, fingerprints: Sequence[str], system: set[int]) -> list[int] | None:
    """Where the previous turn's kept messages are now, in order; None when one is gone.

    First at the positions the decision recorded (a chat only grows at its end, so they are
    usually still right, and only the kept messages are fingerprinted); else the first
    in-order match among all non-system messages.
    """
    wanted = previous.kept
    if system.isdisjoint(previous.at) and _kept_in_place(previous, fingerprints):
        return list(previous.at)
    matched: list[int] = []
    k = 0
    for index in range(len(fingerprints)):
        if k == len(wanted):
            break
        if index not in system and fingerprints[index] == wanted[k]:
            matched.append(index)
            k += 1
    return matched if k == len(wanted) else None


def _kept_in_place(previous: TrimDecision, fingerprints: Sequence[str]) -> bool:
    """The previous turn's kept messages are all still at the positions it recorded."""
    at = previous.at
    return (
        bool(at)
        and at[-1] < len(fingerprints)
        and all(fingerprints[i] == kept for i, kept in zip(at, previous.kept, strict=True))
    )


def carried_recalls(previous: TrimDecision, fingerprints: Sequence[str], keep: Collection[int]) -> list[Recall] | None:
    """The previous turn's recall blocks to send again: each whose quoted messages are all still
    at their recorded places, those quoted whole not sent in place now (a pin may bring one
    back), and whose anchor is kept and is still the message it was (a message inserted
    before it moves it; None when one is not: the prompt could not stay append-only, so the
    caller selects anew). Which of them stay beside this question's block is the caller's to
    say (`carry._recalls_kept`)."""
    if not previous.recalls:
        return []
    n = len(fingerprints)
    anchors = dict(zip(previous.at, previous.kept, strict=False))  # what was at each anchor
    for recall in previous.recalls:
        if (
            recall.anchor not in keep
            or anchors.get(recall.anchor) != fingerprints[recall.anchor]
            or recall.at[-1] >= n
            or any(fingerprints[i] != k for i, k in zip(recall.at, recall.kept, strict=True))
            or any(i in keep and not recall.passages(k) for k, i in enumerate(recall.at))
        ):
            return None
    return list(previous.recalls)
