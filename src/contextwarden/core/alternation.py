"""Roles that alternate in the chat alternate in what is sent.

Strict chat templates (Mistral's and Gemma's, as vLLM and llama.cpp apply them) reject two user
or two assistant messages in a row. Whole turns kept in order never put two alike together, but
single messages picked by relevance do: two kept user messages whose replies were let go. Here:
whether two messages sent one after the other clash (`clash`), where a turn fits among what is
sent (`fits_between`, `fits_bridged`), and the repair of a selection of single messages
(`alternate`): a reply between them as a bridge, else the less relevant one goes.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Mapping, Sequence

from .chatview import ChatView
from .conversation import image_count

__all__ = [
    "BRIDGE_COST_EXPONENT",
    "MAX_BRIDGE_SCAN",
    "clash",
    "alternates",
    "fits_between",
    "fits_bridged",
    "fill_alternating",
    "fill_quoting",
    "alternate",
]

_DIALOGUE = ("user", "assistant")
# Messages looked at on each side of a gap for a bridge (or for a message of the other role):
# bounds the work on a chat of thousands of messages.
MAX_BRIDGE_SCAN = 64
# A bridge is the message between worth most per cost ** this. bench/quality.py with MiniLM, all
# evidence kept at 1k / 2k / 4k / 8k: 0.5 REALTALK 0.447 / 0.580 / 0.707 / 0.816, LoCoMo 0.726 /
# 0.796 / 0.866 / 0.920; 1 (per token) 0.441 / 0.583 / 0.701 / 0.810 and 0.724 / 0.796 / 0.863 /
# 0.918; the cheapest 0.444 / 0.571 / 0.686 / 0.804 and 0.720 / 0.792 / 0.859 / 0.914; the pick's
# own partner (its reply or its question) 0.417 / 0.559 / 0.683 / 0.804 and 0.733 / 0.801 / 0.867 /
# 0.924 (a person's merged turns are long; LoCoMo's evidence is often the partner).
BRIDGE_COST_EXPONENT = 0.5


def clash(view: ChatView, before: int, after: int) -> bool:
    """Messages `before` < `after`, sent one right after the other, are both user or both
    assistant messages while in the chat each was next to one of another role (after `before`,
    before `after`; system messages and orphans aside): two alike that the chat itself put together (a
    question that had no reply, two in a row) stay as they were.

    Example:
        >>> chat = ChatView([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        ...                  {"role": "user", "content": "c"}, {"role": "user", "content": "d"}])
        >>> clash(chat, 0, 2), clash(chat, 0, 1), clash(chat, 2, 3), clash(chat, 0, 3)
        (True, False, False, False)
    """
    role = view.role(before)
    if role not in _DIALOGUE or view.role(after) != role:
        return False
    return _neighbour_role(view, before, 1) != role and _neighbour_role(view, after, -1) != role


def _neighbour_role(view: ChatView, index: int, step: int) -> object:
    """The role of the chat's nearest dialogue message before or after `index` (`step` -1 or
    1; `_neighbour`), None when there is none."""
    k = _neighbour(view, range(len(view)), index + step, step)
    return None if k is None else view.role(k)


def _neighbour(view: ChatView, indices: Sequence[int], at: int, step: int) -> int | None:
    """The first of `indices[at]`, `indices[at + step]`, ... (message indices: the chat's, or
    those sent) that is a dialogue message: not a system message nor an orphan (a tool call never
    answered, a result without its call: never sent, so no neighbour of what is); None past
    either end, or past `MAX_BRIDGE_SCAN` of them."""
    for k in range(at, at + step * (MAX_BRIDGE_SCAN + 1), step):
        if not 0 <= k < len(indices):
            return None
        i = indices[k]
        if view.role(i) not in ("system", "developer") and i not in view.orphan_set:
            return i
    return None


def alternates(view: ChatView, keep: Collection[int], hard: Collection[int] = (), pins: Collection[int] = ()) -> bool:
    """No two messages of `keep`, sent in order (system messages aside), clash, but where one is
    in `pins` or both are in `hard` (a pin goes alone when the rest of its turn does not fit; the
    latest turn is not ours to drop): what a carried selection must still hold in an edited chat.

    Example:
        >>> chat = ChatView([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        ...                  {"role": "user", "content": "c"}])
        >>> alternates(chat, {0, 2}), alternates(chat, {0, 1, 2}), alternates(chat, {0, 2}, pins={0})
        (False, True, True)
    """
    sent = [i for i in sorted(keep) if view.role(i) not in ("system", "developer")]
    fixed = set(hard)
    return not any(
        clash(view, before, after) and before not in pins and after not in pins and not {before, after} <= fixed
        for before, after in zip(sent, sent[1:], strict=False)
    )


def fits_between(view: ChatView, sent: Sequence[int], first: int, last: int) -> bool:
    """Messages `first`..`last` sent among `sent` (ascending, none of them in it) clash with
    neither the message sent before them nor the one after (`clash`; system messages between
    aside, as `alternates` reads them)."""
    at = bisect.bisect_left(sent, first)
    before = _neighbour(view, sent, at - 1, -1)
    if before is not None and clash(view, before, first):
        return False
    after = _neighbour(view, sent, at, 1)
    return after is None or not clash(view, last, after)


def fits_bridged(
    view: ChatView, sent: Sequence[int], indices: Sequence[int], costs: Sequence[int], max_cost: int
) -> list[int] | None:
    """A turn's messages `indices` as sent among `sent` (ascending): as they are where they fit
    between (`fits_between`), else with the message right before or after them, or both, that
    makes roles alternate (a user message or a reply calling no tool, costing under `max_cost`:
    the reply before, the question after); None when none does, or when one of them is sent
    already (an earlier turn's bridge: placed again, the turn would clash with what is around
    it). A selection by single messages may keep the reply after a pasted document's turn
    without the question it answers: the turn then fits only with that question
    (bench/docchat.py: a summary of the second of two documents sent neither). Unlike
    `_bridge`, only the adjacent message: what lies between a turn's own messages (an orphan
    tool result) is not sent."""
    first, last = indices[0], indices[-1]
    taken = set(sent)
    if not taken.isdisjoint(indices):
        return None
    if fits_between(view, sent, first, last):
        return list(indices)

    def bridge(i: int) -> bool:  # a unit of its own
        if not 0 <= i < len(view) or i in taken or view.role(i) not in _DIALOGUE:
            return False
        return costs[i] < max_cost and not view.messages[i].get("tool_calls")

    for before, after in ((1, 0), (0, 1), (1, 1)):
        lo, hi = first - before, last + after
        if (before and not bridge(lo)) or (after and not bridge(hi)):
            continue
        if fits_between(view, sent, lo, hi):
            return [lo] * before + list(indices) + [hi] * after
    return None


def _between(before: int, after: int) -> list[int]:
    """The positions between two messages a bridge is looked for in: all of them, or the
    nearest `MAX_BRIDGE_SCAN` on each side."""
    if after - before - 1 <= 2 * MAX_BRIDGE_SCAN:
        return list(range(before + 1, after))
    return [*range(before + 1, before + 1 + MAX_BRIDGE_SCAN), *range(after - MAX_BRIDGE_SCAN, after)]


def fill_alternating(
    view: ChatView,
    units: Sequence[range],
    fixed: Collection[int],
    order: Sequence[int],
    value: Mapping[int, float],
    unit_cost: Sequence[int],
    left: int,
) -> set[int]:
    """The units of `order` (the most relevant first) taken while they fit `left`, each with a
    bridge (`_bridge`, by `value`) on either side where it would clash with what is sent (the
    `fixed` messages and the units taken before it); a unit that needs a bridge there is none
    for is passed over.

    Example:
        >>> chat = ChatView([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        ...                  {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"},
        ...                  {"role": "user", "content": "e"}])
        >>> units = [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
        >>> value = {0: 1.0, 1: 0.1, 2: 2.0, 3: 0.1}
        >>> sorted(fill_alternating(chat, units, {4}, [2, 0], value, [5, 1, 5, 9], 20))
        [0, 1, 2, 3]
        >>> sorted(fill_alternating(chat, units, {4}, [2, 0], value, [5, 1, 5, 9], 12))  # 2 needs 3 (9)
        [0, 1]
    """
    unit_at = {units[u].start: u for u in range(len(units))}
    out = sorted(i for i in fixed if view.role(i) not in ("system", "developer"))
    taken: set[int] = set()
    for u in order:
        if u in taken or unit_cost[u] > left:
            continue
        span = units[u]
        at = bisect.bisect_left(out, span.start)
        sides = [(out[at - 1], span.start)] if at else []
        sides += [(span.stop - 1, out[at])] if at < len(out) else []
        bridges = []
        for before, after in sides:
            if clash(view, before, after):
                bridge = _bridge(view, before, after, unit_at, units, taken, unit_cost, left, value)
                if bridge is None:
                    break
                bridges.append(bridge)
        else:
            cost = unit_cost[u] + sum(unit_cost[b] for b in bridges)
            if cost <= left:
                taken.update([u, *bridges])
                left -= cost
                out = sorted([*out, *span, *(i for b in bridges for i in units[b])])
    return taken


def fill_quoting(
    view: ChatView,
    units: Sequence[range],
    fixed: Collection[int],
    order: Sequence[int],
    unit_cost: Sequence[int],
    left: int,
    frame: int,
    opener: int | None = None,
) -> tuple[set[int], list[int]]:
    """The units of `order` (the most relevant first) taken while they fit `left`: in place where
    they clash with nothing sent (the `fixed` messages and the units taken before) and a reply
    would not open what is sent (unless it is `opener`, the chat's own first message), else
    quoted in a recall block (single messages with text and without images only: a quote holds
    text, a message with none would cost a line of its role alone, and an image would be lost;
    the block's label and acknowledgement cost `frame` once;
    `fresh._quoted_blocks` places it). A unit with images that clashes comes in place with the
    message beside it that bridges it (`_pictured_bridged`), a quoted one taken out of the block:
    else it would go, neither sent nor quoted. Returns (units in place, units quoted in `order`).

    Example:
        >>> chat = ChatView([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        ...                  {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"},
        ...                  {"role": "user", "content": "e"}])
        >>> units = [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
        >>> fill_quoting(chat, units, {3, 4}, [2, 0, 1], [5, 5, 5, 5], 20, 4)  # 0 meets 2, 1 opens
        ({2}, [0, 1])
    """
    out = sorted(i for i in fixed if view.role(i) not in ("system", "developer"))
    taken: set[int] = set()
    quoted: list[int] = []
    for u in order:
        span, cost = units[u], unit_cost[u]
        opens = span.start < (out[0] if out else len(view)) and span.start != opener
        if fits_between(view, out, span.start, span.stop - 1) and not (opens and view.role(span.start) != "user"):
            if cost <= left:
                taken.add(u)
                left -= cost
                at = bisect.bisect_left(out, span.start)
                out[at:at] = list(span)
        elif any(image_count(view.messages[i]) for i in span):
            placed = _pictured_bridged(view, units, out, u, taken, unit_cost, left, opener)
            rest = [q for q in quoted if q not in (placed or ())]
            cost = sum(unit_cost[p] for p in placed or () if p not in quoted) - (frame if quoted and not rest else 0)
            if placed is not None and cost <= left:
                quoted[:] = rest
                left -= cost
                taken.update(placed)
                out = sorted([*out, *(i for p in placed for i in units[p])])
        elif len(span) == 1 and view.text(span.start) and (quote := cost + (0 if quoted else frame)) <= left:
            left -= quote
            quoted.append(u)
    return taken, quoted


def _pictured_bridged(
    view: ChatView,
    units: Sequence[range],
    out: Sequence[int],
    u: int,
    taken: Collection[int],
    unit_cost: Sequence[int],
    left: int,
    opener: int | None,
) -> list[int] | None:
    """Unit `u`, with images, that clashes with what is sent (`out`, ascending), placed with the
    message beside it that makes roles alternate (`fits_bridged`: a receipt with its reply): `u`
    and its bridges (single messages not `taken`, each within `left`; a quoted one moves), None
    when there is none or a reply but `opener` would open what is sent."""
    unit_at = {units[k].start: k for k in range(len(units)) if len(units[k]) == 1 and k not in taken}
    costs = [unit_cost[unit_at[i]] if i in unit_at else left + 1 for i in range(len(view))]
    span = units[u]
    placed = fits_bridged(view, out, list(span), costs, left + 1)
    if placed is None:
        return None
    first = placed[0]
    if first < (out[0] if out else len(view)) and first != opener and view.role(first) != "user":
        return None
    return [u, *(unit_at[i] for i in placed if i not in span)]


def alternate(
    view: ChatView,
    units: Sequence[range],
    fixed: Collection[int],
    chosen: Collection[int],
    value: Mapping[int, float],
    unit_cost: Sequence[int],
    left: int,
    order: Sequence[int],
) -> set[int]:
    """The `chosen` units (positions in `units`) made to alternate with each other and with the
    `fixed` messages: where two messages clash (`clash`), the most relevant single message of
    the other role between them that fits `left` goes between as a bridge; else the less
    relevant of the two goes (fixed ones stay); what that freed is filled again by `order` (the
    open units worth anything, the most first). `value`: each open unit's worth.

    Example:
        >>> chat = ChatView([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        ...                  {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"},
        ...                  {"role": "user", "content": "e"}])
        >>> units = [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
        >>> value = {0: 1.0, 1: 0.5, 2: 2.0, 3: 0.1}
        >>> sorted(alternate(chat, units, {4}, {0, 2}, value, [5] * 4, 10, [2, 0, 1, 3]))  # bridged by 1 and 3
        [0, 1, 2, 3]
        >>> sorted(alternate(chat, units, {4}, {0, 2}, value, [5] * 4, 5, [2, 0, 1, 3]))  # 2 clashes with 4: it goes
        [0, 1]
    """
    unit_at = {units[u].start: u for u in range(len(units))}
    owner = {i: u for u in chosen for i in units[u]}
    taken = set(chosen)
    out: list[int] = []  # what is sent so far, in order
    for index in sorted(i for i in [*fixed, *owner] if view.role(i) not in ("system", "developer")):
        if index in owner and owner[index] not in taken:
            continue  # its unit went while an earlier clash was repaired
        while out and clash(view, out[-1], index):
            bridge = _bridge(view, out[-1], index, unit_at, units, taken, unit_cost, left, value)
            if bridge is not None:
                taken.add(bridge)
                owner.update((i, bridge) for i in units[bridge])
                left -= unit_cost[bridge]
                out.extend(units[bridge])
                break
            victim = _less_worth(owner.get(out[-1]), owner.get(index), value)
            if victim is None:
                break  # both are fixed: the chat's pins and its latest turn are not ours to drop
            taken.discard(victim)
            left += unit_cost[victim]
            while out and out[-1] in units[victim]:
                out.pop()
            if index in units[victim]:
                break
        if index not in owner or owner[index] in taken:
            out.append(index)
    return _refilled(view, units, taken, out, order, unit_cost, left)


def _bridge(
    view: ChatView,
    before: int,
    after: int,
    unit_at: Mapping[int, int],
    units: Sequence[range],
    taken: Collection[int],
    unit_cost: Sequence[int],
    left: int,
    value: Mapping[int, float],
) -> int | None:
    """The single message of the other role between `before` and `after` that is not sent and
    fits `left` worth most per cost ** `BRIDGE_COST_EXPONENT` (ties: the earlier), as a unit;
    None when there is none."""
    other = "assistant" if view.role(before) == "user" else "user"
    fitting = [
        u
        for k in _between(before, after)
        if (u := unit_at.get(k)) is not None
        and u not in taken
        and len(units[u]) == 1
        and view.role(k) == other
        and unit_cost[u] <= left
    ]
    return max(
        fitting, key=lambda u: (value.get(u, 0.0) / max(unit_cost[u], 1) ** BRIDGE_COST_EXPONENT, -u), default=None
    )


def _less_worth(first: int | None, second: int | None, value: Mapping[int, float]) -> int | None:
    """Of two units (None: a fixed message), the one worth less; None when both are fixed."""
    options = [u for u in (first, second) if u is not None]
    return min(options, key=lambda u: (value.get(u, 0.0), u)) if options else None


def _refilled(
    view: ChatView,
    units: Sequence[range],
    taken: set[int],
    out: list[int],
    order: Sequence[int],
    unit_cost: Sequence[int],
    left: int,
) -> set[int]:
    """`taken` with what a repair freed filled again, the most relevant first, by units that
    clash with neither neighbour and do not open what is sent."""
    for u in order:
        if u in taken or unit_cost[u] > left:
            continue
        span = units[u]
        at = bisect.bisect_left(out, span.start)
        if (not at and view.role(span.start) != "user") or not fits_between(view, out, span.start, span.stop - 1):
            continue
        taken.add(u)
        left -= unit_cost[u]
        out[at:at] = list(span)
    return taken
