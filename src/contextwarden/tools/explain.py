"""Why a trim kept, dropped, shortened or summarized each message, and what the budget was made of.

Re-derived after the fact from the input, the `TrimResult` and the options it was made with
(the conversation view, the same relevance scores, pins, recent turns, the previous
decision), so `trim_messages` pays nothing for it. Pure; for the `contextwarden trim
--explain` command and for anyone auditing a trim. Not bundled into the Open WebUI file.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..core.chatview import ChatView
from ..core.conversation import Message
from ..core.decision import message_fingerprint
from ..core.fresh import picks_messages, semantic_scores
from ..core.selection import (
    DEFAULT_COST_EXPONENT,
    latest_question_competes,
    mandatory_indices,
    recent_turns,
    turn_values,
)
from ..core.tokens import TOKENS_PER_REPLY, TokenCounter
from ..core.trim import TrimOptions, TrimResult, selection_target
from ..money.cache_hints import min_cacheable_tokens
from ..money.pricing import ModelPrice
from ..money.savings import (
    SAVINGS_ASSUMPTION,
    Savings,
    cached_prefixes,
    estimate_savings,
    predicted_cache,
    price_caches,
)

__all__ = ["MessageReason", "BudgetParts", "Explanation", "explain_trim"]


@dataclass(frozen=True, slots=True)
class MessageReason:
    """One input message: what happened to it (`action`) and why (`reasons`, most decisive first)."""

    index: int
    role: str
    tokens: int
    action: str  # kept | dropped | shortened | excerpted (or a question cut by passages) | recalled | summarized
    reasons: tuple[str, ...]
    score: float | None = None

    def as_dict(self) -> dict[str, object]:
        return {
            "index": self.index,
            "role": self.role,
            "tokens": self.tokens,
            "action": self.action,
            "reasons": list(self.reasons),
            "score": None if self.score is None else round(self.score, 4),
        }


@dataclass(frozen=True, slots=True)
class BudgetParts:
    """What the prompt budget was made of, in our token counts.

    `window`, `reserve` and `calibration` are None unless the caller says how the budget was
    derived (budget = (window − reserve) / calibration).
    """

    budget: int
    system_tokens: int
    current_turn_tokens: int
    reply_priming_tokens: int
    history_available: int
    history_target: int
    history_sent: int
    window: int | None = None
    recall_sent: int = 0  # the recall blocks with their acknowledgements
    reserve: int | None = None
    calibration: float | None = None
    prompt_sent: int = 0  # the whole prompt sent, reply priming included
    fill: float = 0.0  # prompt_sent / budget
    fill_rule: str = ""  # why it fills that much

    def as_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(frozen=True, slots=True)
class Explanation:
    """Per-message reasons and the budget's parts of one trim."""

    messages: tuple[MessageReason, ...]
    budget: BudgetParts
    reused: bool
    notes: tuple[str, ...]
    savings: Savings | None = None  # with a price: the input cost difference, cache-aware (SAVINGS_ASSUMPTION)

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "budget": self.budget.as_dict(),
            "reused_previous_decision": self.reused,
            "notes": list(self.notes),
            "messages": [m.as_dict() for m in self.messages],
        }
        if self.savings is not None:
            saved = self.savings.cost_saved_usd
            out["savings"] = {
                "tokens_saved": self.savings.tokens_saved,
                "cached_before": self.savings.cached_before,
                "cached_after": self.savings.cached_after,
                "cost_saved_usd": None if saved is None else format(saved.normalize(), "f"),
                "assumption": SAVINGS_ASSUMPTION,
            }
        return out


def _turn_of(view: ChatView) -> dict[int, int]:
    return {i: t for t, turn in enumerate(view.turns) for i in turn.indices}


def _unit_of(view: ChatView) -> dict[int, range]:
    units = [*view.system, *view.orphans, *(u for turn in view.turns for u in turn.units)]
    return {i: unit.indices for unit in units for i in unit.indices}


def explain_trim(
    messages: Sequence[Message] | ChatView,
    result: TrimResult,
    *,
    model: str | None = None,
    token_counter: TokenCounter,
    summarized: Collection[int] = (),
    window: int | None = None,
    reserve: int | None = None,
    calibration: float | None = None,
    price: ModelPrice | None = None,
    **options: Any,
) -> Explanation:
    """Explain `result`, a `trim_messages(messages, ...)` made with the same options.

    Args:
        messages, model, token_counter: as given to `trim_messages` (the messages or their view).
        options: the rest of what was given to it (`strategy`, `keep_last_turns`, `pinned`,
            `previous`, ...), as they were: read into one `TrimOptions`, so their defaults are
            the trim's own and a name it does not know is a TypeError.
        summarized: dropped indices a summary note stands for (shown as "summarized").
        window, reserve, calibration: how the budget was derived, when it was, to show it.
        price: the model's price, to show what the trim saved (cache-aware, see `SAVINGS_ASSUMPTION`;
            a Claude model is taken to get the filter's breakpoints).

    Example:
        >>> result = trim_messages(chat, max_tokens=1200, model="gpt-4o")  # doctest: +SKIP
        >>> explain_trim(chat, result, model="gpt-4o", token_counter=counter).messages[0].reasons  # doctest: +SKIP
        ('mandatory: system prompt',)
    """
    chosen = TrimOptions(**options)
    view = messages if isinstance(messages, ChatView) else ChatView(messages)
    messages = view.messages
    facts = _facts(view, result, model, token_counter, chosen, summarized)
    rows = tuple(_row(i, message, facts) for i, message in enumerate(messages))
    parts = _budget_parts(facts, result, chosen, window, reserve, calibration)
    if result.excerpted:  # the excerpts sent cost what their copies do, not the messages they were cut from
        parts = replace(parts, history_sent=parts.history_sent + _excerpts_cost(result, token_counter, model))
    if result.added:  # what the recall blocks quote, with their acknowledgements
        blocks = [result.messages[k] for k in result.added]
        parts = replace(parts, recall_sent=sum(token_counter.count_each(blocks, model)))
    savings = _savings(messages, result, model, token_counter, price) if price is not None else None
    return Explanation(rows, parts, result.reused, result.notes, savings)


@dataclass(frozen=True, slots=True)
class _Facts:
    """What explaining each message needs, read once from the chat and the result."""

    view: ChatView
    costs: list[int]
    result: TrimResult
    strategy: str
    keep_last_turns: int
    kept: set[int]
    shortened: set[int]
    covered: set[int]
    system: set[int]
    mandatory: set[int]
    orphans: set[int]
    turn_of: dict[int, int]
    unit_of: dict[int, range]
    recent: Collection[int]
    pins: set[int]
    remembered: set[str]
    trimmed: bool
    scores: list[float] | None
    worth: dict[int, float]
    by_message: bool  # the selection picked single messages (the embedder's, or a small room), not turns
    embedded: bool  # its scores had the embedder's similarities fused in


def _facts(
    view: ChatView,
    result: TrimResult,
    model: str | None,
    token_counter: TokenCounter,
    options: TrimOptions,
    summarized: Collection[int],
) -> _Facts:
    previous = options.previous
    messages = view.messages
    system, orphans = set(view.system_indices), set(view.orphan_indices)
    unit_of = _unit_of(view)
    trimmed = bool(result.dropped or result.shortened)
    question = view.question
    by_message = embedded = False
    costs = token_counter.count_each(messages, model)
    scores: list[float] | None = None
    worth: dict[int, float] = {}
    if trimmed and not result.reused and question is not None and options.strategy == "relevance":
        scores = semantic_scores(view, options.embed, []) if options.embed is not None else None
        embedded = scores is not None
        by_message = embedded or picks_messages(view, costs, result.budget)
        if scores is None:
            scores = view.relevance()
            worth = {} if by_message else turn_values(view, costs, scores)
    return _Facts(
        view=view,
        costs=costs,
        result=result,
        strategy=options.strategy,
        keep_last_turns=options.keep_last_turns,
        kept=set(result.kept),
        shortened=set(result.shortened),
        covered=set(summarized),
        system=system,
        mandatory=set(mandatory_indices(view)),
        orphans=orphans,
        turn_of=_turn_of(view),
        unit_of=unit_of,
        recent=recent_turns(view, options.keep_last_turns),
        pins={i for p in options.pinned for i in unit_of.get(p, (p,))},
        remembered=set(previous.kept) if previous is not None and result.reused else set(),
        trimmed=trimmed,
        scores=scores,
        worth=worth,
        by_message=by_message,
        embedded=embedded,
    )


def _row(i: int, message: Message, facts: _Facts) -> MessageReason:
    """One message's action and reasons: why it was sent or not, then what it was sent with."""
    quoted = i in facts.result.recalled and i not in facts.kept and i not in facts.shortened
    sent = i in facts.kept or i in facts.shortened or quoted
    action = (
        "shortened" if i in facts.shortened else "kept" if sent else "summarized" if i in facts.covered else "dropped"
    )
    passages = {k: (n, total) for k, n, total in facts.result.shortened_passages}
    action = "excerpted" if i in facts.result.excerpted or i in passages else "recalled" if quoted else action
    reasons = _why(i, message, sent, facts) + _together(i, facts)
    if quoted:
        reasons.insert(0, "quoted verbatim in a recall block, not in its place")
    elif i in facts.result.excerpted:
        reasons.insert(0, "too large for what was left: its passages most relevant to the question, the rest cut")
    elif i in passages:
        n, total = passages[i]
        reasons.insert(0, f"mandatory content over budget: cut by passages, {n:,} of {total:,} sent")
    elif i in facts.shortened:
        reasons.insert(0, "mandatory content over budget: cut middle-out")
    if i in facts.covered:
        reasons.append("a summary note stands for it")
    scores = facts.scores
    return MessageReason(
        i,
        str(message.get("role", "?")),
        facts.costs[i],
        action,
        tuple(reasons),
        scores[i] if scores is not None and i not in facts.mandatory | facts.orphans else None,
    )


def _why(i: int, message: Message, sent: bool, facts: _Facts) -> list[str]:
    """Why message `i` was sent or not: its place in the chat, pins, recency, reuse, its score."""
    view, result = facts.view, facts.result
    if i in facts.orphans:
        return ["orphan tool message: its call is not in the chat, never sent"]
    if i in facts.system:
        return ["mandatory: system prompt"]
    if i in facts.mandatory:
        return ["mandatory: current turn" if i != view.question else "mandatory: current turn (latest question)"]
    if not facts.trimmed:
        return ["everything fits the budget"]
    reasons: list[str] = []
    if i in facts.pins:
        reasons.append("pinned (mandatory)" if sent else "pinned, but over budget even shortened")
    if facts.turn_of.get(i) in facts.recent:
        reasons.append(f"recent (keep_last_turns={facts.keep_last_turns})" + ("" if sent else ", but did not fit"))
    elif view.latest is not None and facts.turn_of.get(i) == view.latest and not result.reused:
        alone = facts.by_message and latest_question_competes(view, facts.keep_last_turns)  # its answer went first
        if alone and view.role(i) == "user":
            competed = _score_reason(i, sent, facts)
            reasons.append(f"the latest question; the new one stands alone, so it competed: {competed}")
        else:
            reasons.append(
                (
                    "the latest answer, kept whenever it fits"
                    if alone
                    else "the latest answer and its question, kept whenever they fit"
                )
                + ("" if sent and i not in result.excerpted else ": did not")
            )
    if result.reused:
        if sent and message_fingerprint(message) in facts.remembered:
            reasons.append("reused from the previous decision (same prefix, provider cache hits)")
        elif sent:
            reasons.append("new since the previous decision")
    elif facts.scores is not None and not reasons:
        reasons.append(_score_reason(i, sent, facts))
    if not reasons:
        newest = facts.strategy == "recent" and not result.reused
        reasons.append(("among the newest turns that fit" if newest else "kept") if sent else "older than what fit")
    return reasons


def _score_reason(i: int, sent: bool, facts: _Facts) -> str:
    """The value of message `i`'s turn as selection weighs it (scores per token^exponent)."""
    assert facts.scores is not None
    if facts.by_message:
        how = " with the embedder" if facts.embedded else ""
        return f"score: {facts.scores[i]:.3f}{how}, chosen by message: " + (
            "among the most relevant that fit" if sent else "below what was kept, or did not fit"
        )
    turn_of, mandatory, scores, costs = facts.turn_of, facts.mandatory, facts.scores, facts.costs
    whole = [j for j in facts.view.turns[turn_of[i]].indices if j not in mandatory] if i in turn_of else [i]
    worth = facts.worth
    total = worth[turn_of[i]] if turn_of.get(i) in worth else sum(scores[j] for j in whole)
    value = total / max(1, sum(costs[j] for j in whole)) ** DEFAULT_COST_EXPONENT
    return f"score: its turn's value {value:.3f} per token^{DEFAULT_COST_EXPONENT:g}, " + (
        "worth its tokens" if sent else "below what was kept, or did not fit"
    )


def _together(i: int, facts: _Facts) -> list[str]:
    """The units message `i` goes with: its tool pair, its whole turn."""
    reasons = []
    unit = facts.unit_of.get(i)
    if unit is not None and len(unit) > 1 and i not in facts.orphans:
        reasons.append(f"tool pair: messages {unit.start}–{unit.stop - 1} are kept or dropped together")
    turn_of = facts.turn_of
    turn = facts.view.turns[turn_of[i]].indices if i in turn_of and i not in facts.mandatory else []
    if facts.trimmed and len(turn) > 1 and not facts.by_message:
        reasons.append(f"whole turn: messages {turn[0]}–{turn[-1]} are kept or dropped together")
    return reasons


def _budget_parts(
    facts: _Facts,
    result: TrimResult,
    options: TrimOptions,
    window: int | None,
    reserve: int | None,
    calibration: float | None,
) -> BudgetParts:
    """What the budget was made of: system prompt, current turn, reply priming, the history's share."""
    costs, system, mandatory, trimmed = facts.costs, facts.system, facts.mandatory, facts.trimmed
    system_tokens = sum(costs[i] for i in system)
    current_tokens = sum(costs[i] for i in mandatory - system)
    available = result.budget - TOKENS_PER_REPLY - system_tokens - current_tokens
    watermark = 1.0 if result.count_mode == "estimate" else options.low_watermark  # as trim_messages does
    whole = selection_target(facts.view, costs, result.budget, watermark, options.growth_turns)
    target = whole - TOKENS_PER_REPLY - system_tokens - current_tokens
    return BudgetParts(
        budget=result.budget,
        system_tokens=system_tokens,
        current_turn_tokens=current_tokens,
        reply_priming_tokens=TOKENS_PER_REPLY,
        history_available=available,
        history_target=available if result.reused or not trimmed else target,
        history_sent=sum(costs[i] for i in facts.kept if i not in mandatory),
        window=window,
        reserve=reserve,
        calibration=calibration,
        prompt_sent=result.tokens_after,
        fill=result.tokens_after / result.budget,
        fill_rule=_fill_rule(result, trimmed, whole, watermark, options.growth_turns),
    )


def _excerpts_cost(result: TrimResult, counter: TokenCounter, model: str | None) -> int:
    """What the excerpts sent cost (the sent copies, not the messages they were cut from)."""
    if not result.excerpted:
        return 0
    added = set(result.added)  # recall blocks and their acknowledgements
    plain = [m for k, m in enumerate(result.messages) if k not in added]
    sent_at = dict(zip(sorted(result.kept + result.shortened), plain, strict=True))
    return sum(counter.count_message(sent_at[i], model) for i in result.excerpted)


def _savings(
    messages: Sequence[Message], result: TrimResult, model: str | None, counter: TokenCounter, price: ModelPrice
) -> Savings:
    """What the trim saved at `price`, the untrimmed and the sent prompt each with the prefix the
    previous turn's prompt shares with it priced as cached (as the filter estimates it)."""
    before, after = result.tokens_before, result.tokens_after
    untrimmed, sent = cached_prefixes(
        messages, result.messages, before, after, result.reused, lambda part: counter.count_each(part, model)
    )
    minimum, caches = min_cacheable_tokens(model or ""), price_caches(price)
    return estimate_savings(
        before,
        after,
        price=price,
        cache_before=predicted_cache(before, untrimmed, price, caches=caches, minimum=minimum),
        cache_after=predicted_cache(after, sent, price, caches=caches, minimum=minimum),
    )


def _fill_rule(result: TrimResult, trimmed: bool, target: int, watermark: float, growth_turns: int) -> str:
    """Why a trim fills the share of the budget it does, in a sentence."""
    if not trimmed:
        return "everything fits"
    if result.over_budget:
        return "the mandatory part alone is over the budget"
    if result.reused:
        return "the previous decision's messages plus what is new: it fills up as the chat grows, until the next cut"
    share = f"{target / result.budget:.0%}"
    if result.count_mode == "estimate":
        why = "the whole budget: counts are estimates (no encoding loaded), which already err high"
    elif target == int(result.budget * watermark):
        why = f"{share}, the low watermark"
    else:
        why = (
            f"{share}: the low watermark ({watermark:.0%}) less room for {growth_turns} more turns like the last one "
            "(at most half the budget)"
        )
    return (
        f"a new cut fills up to {why}, so the next turns keep the same prefix and the provider's prompt "
        "cache; whole messages only (whole turns where the room holds many), so a little under"
    )
