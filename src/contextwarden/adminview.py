"""`!usage` inside Open WebUI: a message that is only `!usage` is answered by the filter itself
(the model is not called). Admins get this month's totals by user and by model; everyone else
their own spend and limits. Also the one rule for showing a cost that may be unknown.

In a browser chat the answer is written into the reply (a `replace` event) and the turn ends
with a one-line notice; API callers get the whole answer as the error text (HTTP 400 detail).
The exchange stays in the chat for the user, but is never sent on: every later request of the
chat goes out without it (`without_usage_exchanges`). Both answers read one key each: the
admin's the month key of the ledger, a user's their spend key.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from decimal import Decimal
from typing import Any

from .conversation import Message, message_text
from .ledger import LedgerRow, MonthTotals, read_month
from .limits import (
    KINDS,
    LimitKind,
    LimitRules,
    Limits,
    Spend,
    amount_text,
    check_limits,
    month_start,
    spend_text,
)
from .money import format_usd, usd
from .store import Store

__all__ = [
    "USAGE_COMMAND",
    "is_usage_command",
    "without_usage_exchanges",
    "usage_answer",
    "usage_markdown",
    "cost_cell",
]

USAGE_COMMAND = "!usage"
# How the filter's answers begin (the admin's report, a user's line, the notice in a chat).
ANSWER_STARTS = ("### contextwarden usage", "contextwarden:")
MAX_USER_ROWS = 25
MAX_MODEL_ROWS = 15
BACKGROUND_NOTE = (
    "Not counted: Open WebUI's own background calls (chat titles, tags, follow-up suggestions, "
    "context compaction summaries) pass through no filter."
)
ReplyEmitter = Callable[[dict[str, Any]], Awaitable[Any]]


def cost_cell(counters: dict[str, int], amount: Decimal, *, dollar: bool = False) -> str:
    """A cost that never shows a guessed 0: `unknown` when no reply had a price, `≥x` when some
    did not (x counts the priced ones), else the amount as every amount is shown (`money`).

    Example:
        >>> cost_cell({"requests": 2, "unpriced": 2}, Decimal(0)), cost_cell(
        ...     {"requests": 3, "unpriced": 1}, Decimal("0.5"), dollar=True
        ... )
        ('unknown', '≥$0.50')
    """
    requests, unpriced = counters.get("requests", 0), counters.get("unpriced", 0)
    if requests and unpriced >= requests:
        return "unknown"
    text = usd(amount) if dollar else format_usd(amount)
    return f"≥{text}" if unpriced else text


def is_usage_command(messages: Sequence[Message]) -> bool:
    """True when the latest message is the user's and says only `!usage`."""
    return bool(messages) and _is_command(messages[-1])


def _is_command(message: Message) -> bool:
    if not isinstance(message, dict) or message.get("role") != "user":
        return False
    content = message.get("content")
    if isinstance(content, str):  # the common case, read without message_text (every message, every pass)
        return len(content) <= 64 and content.strip().lower() == USAGE_COMMAND
    return message_text(message).strip().lower() == USAGE_COMMAND


def _is_answer(message: Message) -> bool:
    if not isinstance(message, dict) or message.get("role") != "assistant" or message.get("tool_calls"):
        return False
    text = message_text(message).lstrip()
    return not text or text.startswith(ANSWER_STARTS)


def without_usage_exchanges(messages: Sequence[Message]) -> list[Message] | None:
    """The messages without earlier `!usage` commands and the filter's answers right after them;
    None when there are none. The latest message is left alone (it may be a new command), and
    so is any text that only mentions the command.

    Example:
        >>> chat = [{"role": "user", "content": "!usage"},
        ...         {"role": "assistant", "content": "contextwarden: today $0.01"},
        ...         {"role": "user", "content": "What does !usage do?"}]
        >>> [m["content"] for m in without_usage_exchanges(chat)]
        ['What does !usage do?']
    """
    drop: set[int] = set()
    last = len(messages) - 1
    for at in range(last):
        if _is_command(messages[at]):
            drop.add(at)
            if at + 1 < last and _is_answer(messages[at + 1]):
                drop.add(at + 1)
    return [m for at, m in enumerate(messages) if at not in drop] if drop else None


def _table(rows: Sequence[LedgerRow], heading: str, limit: int) -> list[str]:
    lines = [f"| {heading} | replies | tokens | cost USD |", "|---|--:|--:|--:|"]
    for row in rows[:limit]:
        tokens = row.counters.get("prompt_tokens", 0) + row.counters.get("completion_tokens", 0)
        name = row.key.replace("|", "\\|")
        lines.append(
            f"| {name} | {row.counters.get('requests', 0):,} | {tokens:,} | {cost_cell(row.counters, row.cost_usd)} |"
        )
    if len(rows) > limit:
        lines.append(f"| … {len(rows) - limit:,} more | | | |")
    return lines


def _limits_line(rules: LimitRules) -> str:
    """The valves' limits in words, dollars apart from tokens, and how many overrides there are.

    Example:
        >>> _limits_line(LimitRules(Limits(daily_usd=Decimal("0.05"))))
        'Limits for everyone: $0.05 a day, no monthly dollar limit, no token limits.'
    """
    base = rules.base
    parts = [
        _pair(base, "daily_usd", "monthly_usd", "dollar"),
        _pair(base, "daily_tokens", "monthly_tokens", "token"),
    ]
    said = ", ".join(p for p in parts if p) if base.any else "none"
    counts = [(len(rules.roles or {}), "role"), (len(rules.groups or {}), "group"), (len(rules.users or {}), "user")]
    overrides = [f"{n} {what}{'' if n == 1 else 's'}" for n, what in counts if n]
    return f"Limits for everyone: {said}" + ("; overrides for " + ", ".join(overrides) if overrides else "") + "."


def _pair(limits: Limits, daily: LimitKind, monthly: LimitKind, unit: str) -> str:
    """`$2.00 a day, no monthly dollar limit`, or `no dollar limits` when neither is set."""
    caps = [(limits.cap(daily), daily, "day"), (limits.cap(monthly), monthly, "month")]
    if all(cap is None for cap, _, _ in caps):
        return f"no {unit} limits"
    return ", ".join(
        f"no {kind.split('_')[0]} {unit} limit" if cap is None else f"{amount_text(kind, cap)} a {period}"
        for cap, kind, period in caps
    )


def usage_markdown(month: MonthTotals, now: datetime, rules: LimitRules, *, shared: bool) -> str:
    """The admin's report of this month (UTC) from its totals: today, the month, by user, by model, notes."""
    today = now.date()
    total = month.days
    day_rows = [r for r in total if r.key == today.isoformat()]
    all_month = {
        f: sum(r.counters.get(f, 0) for r in total) for f in ("requests", "unpriced", "estimated", "cost_picousd")
    }
    month_usd = sum((r.cost_usd for r in total), Decimal(0))
    lines = [f"### contextwarden usage · {today:%Y-%m} (UTC, to {now:%Y-%m-%d %H:%M})", ""]
    if day_rows:
        d = day_rows[0]
        lines.append(f"Today: {cost_cell(d.counters, d.cost_usd, dollar=True)} · {d.counters['requests']:,} replies.")
    lines += [
        f"This month: {cost_cell(all_month, month_usd, dollar=True)} · {all_month['requests']:,} replies.",
        "",
    ]
    if not total:
        lines.append("No usage recorded this month.")
    else:
        lines += _table(month.users, "user id", MAX_USER_ROWS) + [""]
        lines += _table(month.models, "model", MAX_MODEL_ROWS) + [""]
    notes = []
    if all_month["unpriced"]:
        notes.append(
            f"{all_month['unpriced']:,} replies had no known price: dollar limits could not count them (token limits "
            "did)."
        )
    if all_month["estimated"]:
        notes.append(f"{all_month['estimated']:,} replies were estimated (the backend sent no usage).")
    if rules.active:
        notes.append(_limits_line(rules))
    if not shared:
        notes.append("These totals are this worker's only (no redis_url): other workers keep their own.")
    notes.append(BACKGROUND_NOTE)
    lines += [f"- {n}" for n in notes]
    lines.append("\nThe full report: `contextwarden usage --redis-url … --html report.html`.")
    return "\n".join(lines)


def own_usage_text(limits: Limits, day: Spend, month: Spend) -> str:
    """What a user sees for `!usage`: their spend today and this month, and their limits."""
    verdict = check_limits(limits, day, month)
    parts = [
        f"contextwarden: {spend_text(limits, day, verdict, True)}",
        f"this month {amount_text('monthly_usd', month.usd)}",
    ]
    monthly = limits.cap("monthly_usd")
    if monthly is not None:
        parts[-1] += f" of {amount_text('monthly_usd', monthly)}"
    for kind in KINDS:
        if kind.endswith("tokens") and limits.cap(kind) is not None:
            spent = (day if kind.startswith("daily") else month).tokens
            parts.append(f"{kind.split('_')[0]} tokens {spent:,} of {limits.cap(kind):,}")
    if month.unpriced:
        parts.append(f"{month.unpriced:,} replies without a known price (not in the dollars)")
    return " · ".join(parts) + "."


async def usage_answer(
    store: Store,
    *,
    now: datetime,
    admin: bool,
    limits: Limits,
    rules: LimitRules,
    emit: ReplyEmitter | None,
    chat: bool,
    spend: Callable[[], Awaitable[tuple[Spend, Spend]]],
) -> str:
    """The `!usage` answer; in a browser chat written into the reply, returning a short notice.
    `spend` reads the user's (today's, this month's) spend (see `SpendBook.spend`)."""
    if admin:
        text = usage_markdown(await read_month(store, month_start(now.date())), now, rules, shared=store.shared)
    else:
        text = own_usage_text(limits, *await spend())
    if chat and emit is not None:
        try:
            await emit({"type": "replace", "data": {"content": text}})
            return "contextwarden: the usage report is above; the model was not called."
        except Exception:  # no chat to write into: the notice carries the answer
            pass
    return text
