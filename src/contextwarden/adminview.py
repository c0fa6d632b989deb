"""`!usage` inside Open WebUI: a message that is only `!usage` is answered by the filter itself
(the model is not called). Admins get this month's totals by user and by model; everyone else
their own spend and limits. Also the one rule for showing a cost that may be unknown.

In a browser chat the answer is written into the reply (a `replace` event) and the turn ends
with a one-line notice; API callers get the whole answer as the error text (HTTP 400 detail).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from decimal import Decimal
from typing import Any

from .conversation import Message, message_text
from .ledger import LedgerEntry, LedgerRow, ledger_totals, read_ledger
from .limits import KINDS, LimitRules, Limits, amount_text, check_limits, month_start, spend_of, spend_text
from .money import format_usd, usd
from .store import Store

__all__ = ["USAGE_COMMAND", "is_usage_command", "usage_answer", "usage_markdown", "cost_cell"]

USAGE_COMMAND = "!usage"
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
    if not messages or messages[-1].get("role") != "user":
        return False
    content = messages[-1].get("content")
    if isinstance(content, str) and len(content) > 64:
        return False
    return message_text(messages[-1]).strip().lower() == USAGE_COMMAND


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
    def money(value: Decimal | int | None, unit: str) -> str:
        return "none" if not value else (f"${value:,}" if unit == "$" else f"{value:,} tokens")

    base = rules.base
    line = (
        f"Limits for everyone: daily {money(base.cap('daily_usd'), '$')}, monthly "
        f"{money(base.cap('monthly_usd'), '$')}, "
        f"daily {money(base.cap('daily_tokens'), 't')}, monthly {money(base.cap('monthly_tokens'), 't')}"
    )
    counts = [(len(rules.roles or {}), "role"), (len(rules.groups or {}), "group"), (len(rules.users or {}), "user")]
    return line + "; overrides for " + ", ".join(f"{n} {what}{'' if n == 1 else 's'}" for n, what in counts) + "."


def usage_markdown(entries: Sequence[LedgerEntry], now: datetime, rules: LimitRules, *, shared: bool) -> str:
    """The admin's report of this month (UTC) from ledger entries: totals, by user, by model, notes."""
    today = now.date()
    month = [e for e in entries if month_start(today) <= e.day <= today]
    total = ledger_totals(month, "day")
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
    if not month:
        lines.append("No usage recorded this month.")
    else:
        lines += _table(ledger_totals(month, "user"), "user id", MAX_USER_ROWS) + [""]
        lines += _table(ledger_totals(month, "model"), "model", MAX_MODEL_ROWS) + [""]
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


def own_usage_text(limits: Limits, entries: Sequence[LedgerEntry], now: datetime) -> str:
    """What a user sees for `!usage`: their spend today and this month, and their limits."""
    day, month = spend_of(entries, now.date())
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
    user_id: str,
    limits: Limits,
    rules: LimitRules,
    emit: ReplyEmitter | None,
    chat: bool,
) -> str:
    """The `!usage` answer; in a browser chat written into the reply, returning a short notice."""
    today = now.date()
    if admin:
        entries = await read_ledger(store, since=month_start(today), until=today)
        text = usage_markdown(entries, now, rules, shared=store.shared)
    else:
        text = own_usage_text(
            limits, await read_ledger(store, since=month_start(today), until=today, user=user_id or "-"), now
        )
    if chat and emit is not None:
        try:
            await emit({"type": "replace", "data": {"content": text}})
            return "contextwarden: the usage report is above; the model was not called."
        except Exception:  # no chat to write into: the notice carries the answer
            pass
    return text
