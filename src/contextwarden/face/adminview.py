"""`!usage` inside Open WebUI: a message that is only `!usage` is answered by the filter itself
(the model is not called). Admins get this month's totals by user and by model; everyone else
their own spend and limits. Also the one rule for showing a cost that may be unknown.

In a browser chat the answer is written into the reply (a `replace` event) and the turn ends as
Open WebUI's Stop button ends one (`errors.AnsweredInChat`: no error shown); API callers get the
whole answer as the error text (HTTP 400 detail).
The exchange stays in the chat for the user, but is never sent on: every later request of the
chat goes out without it (`without_usage_exchanges`). Both answers read one key each: the
admin's the month key of the ledger, a user's their spend key.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from decimal import Decimal
from typing import Any

from ..core.conversation import Message, message_text
from ..money.dollars import format_usd, usd
from ..money.ledger import LedgerRow, MonthTotals, read_month
from ..money.limits import (
    KINDS,
    LimitKind,
    LimitRules,
    Limits,
    Spend,
    amount_text,
    check_limits,
    month_start,
    spend_text,
    spent_usd_text,
)
from ..state.store import Store

__all__ = [
    "USAGE_COMMAND",
    "USAGE_WRITTEN",
    "is_usage_command",
    "without_usage_exchanges",
    "usage_answer",
    "usage_markdown",
    "cost_cell",
    "replies_text",
]

USAGE_COMMAND = "!usage"
# What ends a browser chat's `!usage` turn once its answer is in the reply (`AnsweredInChat`'s
# text): Open WebUI shows none of it, its log at most.
USAGE_WRITTEN = "contextwarden: the usage answer is written into the reply; the model was not called."
COMMAND_MAX_CHARS = 64  # a longer message is never the command (so it is not read on every pass)
COMMAND_MAX_PARTS = 16  # nor is a message in more content parts (attachments and the command's text)
# How the filter's answers begin (the admin's report, a user's line, the notice in a chat).
ANSWER_STARTS = ("### contextwarden usage", "contextwarden:")
MAX_USER_ROWS = 25
MAX_MODEL_ROWS = 15
BACKGROUND_NOTE = (
    "Not counted: Open WebUI's own background calls (chat titles, tags, follow-up suggestions, "
    "context compaction summaries) pass through no filter."
)
ReplyEmitter = Callable[[dict[str, Any]], Awaitable[Any]]
UserLookup = Callable[[str], Awaitable[object] | object]

admin_log = logging.getLogger("contextwarden")

OPEN_WEBUI_USERS = "open_webui.models.users"
# The report waits this long for the names of the users it lists (at most MAX_USER_ROWS
# look-ups, one database read each); whatever is not read by then shows as its id.
USER_NAMES_TIMEOUT_SECONDS = 2.0
MAX_NAME_CHARS = 64
_MARKUP = re.compile(r"([\\`*_\[\]<>|~])")  # what could start markup in a Markdown table cell


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


def replies_text(count: int) -> str:
    """A count of replies as it reads in a sentence.

    Example:
        >>> replies_text(1), replies_text(1_200)
        ('1 reply', '1,200 replies')
    """
    return f"{count:,} {'reply' if count == 1 else 'replies'}"


def is_usage_command(messages: Sequence[Message]) -> bool:
    """True when the latest message is the user's and says only `!usage`."""
    return bool(messages) and _is_command(messages[-1])


def _is_command(message: Message) -> bool:
    if not isinstance(message, dict) or message.get("role") != "user":
        return False
    content = message.get("content")
    if isinstance(content, str):  # the common case, read without message_text (every message, every pass)
        return len(content) <= COMMAND_MAX_CHARS and content.strip().lower() == USAGE_COMMAND
    if not isinstance(content, list) or len(content) > COMMAND_MAX_PARTS:  # not read: thousands of parts stall the loop
        return False
    texts = [part.get("text") for part in content if isinstance(part, dict)]
    if sum(len(text) for text in texts if isinstance(text, str)) > COMMAND_MAX_CHARS:  # nor megabytes of text
        return False
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


def _table(rows: Sequence[LedgerRow], heading: str, limit: int, names: Mapping[str, str] | None = None) -> list[str]:
    """A Markdown table of the first `limit` rows, each named by `names` (already escaped) or by its key."""
    lines = [f"| {heading} | replies | tokens | cost USD |", "|---|--:|--:|--:|"]
    for row in rows[:limit]:
        tokens = row.counters.get("prompt_tokens", 0) + row.counters.get("completion_tokens", 0)
        name = (names or {}).get(row.key) or row.key.replace("|", "\\|")
        lines.append(
            f"| {name} | {row.counters.get('requests', 0):,} | {tokens:,} | {cost_cell(row.counters, row.cost_usd)} |"
        )
    if len(rows) > limit:
        lines.append(f"| … {len(rows) - limit:,} more | | | |")
    return lines


def _unpriced_note(unpriced: int, rules: LimitRules) -> str:
    """What unpriced replies mean for the totals, and for the kinds of limit set (anywhere).

    Example:
        >>> _unpriced_note(1, LimitRules())
        '1 reply had no known price: its tokens are counted, its cost is not (≥, unknown).'
    """
    kinds = {kind for level in rules.levels for kind in KINDS if level.cap(kind) is not None}
    dollars, tokens = (any(kind.endswith(unit) for kind in kinds) for unit in ("_usd", "_tokens"))
    them, their = ("it", "its") if unpriced == 1 else ("them", "their")
    note = f"{replies_text(unpriced)} had no known price: {their} tokens are counted, {their} cost is not (≥, unknown)"
    if dollars:
        return f"{note}; dollar limits could not count {them}" + (" (token limits did)." if tokens else ".")
    return f"{note}; token limits counted {them}." if tokens else f"{note}."


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


def usage_markdown(
    month: MonthTotals, now: datetime, rules: LimitRules, *, shared: bool, names: Mapping[str, str] | None = None
) -> str:
    """The admin's report of this month (UTC) from its totals: today, the month, by user (named
    by `names`, user id to the text shown; else by id), by model, notes."""
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
        lines.append(
            f"Today: {cost_cell(d.counters, d.cost_usd, dollar=True)} · {replies_text(d.counters['requests'])}."
        )
    lines += [
        f"This month: {cost_cell(all_month, month_usd, dollar=True)} · {replies_text(all_month['requests'])}.",
        "",
    ]
    if not total:
        lines.append("No usage recorded this month.")
    else:
        lines += _table(month.users, "user", MAX_USER_ROWS, names) + [""]
        lines += _table(month.models, "model", MAX_MODEL_ROWS) + [""]
    notes = []
    if unpriced := all_month["unpriced"]:
        notes.append(_unpriced_note(unpriced, rules))
    if estimated := all_month["estimated"]:
        notes.append(
            f"{replies_text(estimated)} {'was' if estimated == 1 else 'were'} estimated"
            " (the backend sent no usage, or not all of it)."
        )
    if rules.active:
        notes.append(_limits_line(rules))
    if not shared:
        notes.append("These totals are this worker's only (no redis_url): other workers keep their own.")
    notes.append(BACKGROUND_NOTE)
    lines += [f"- {n}" for n in notes]
    lines.append(
        '\nThe full report, from a machine with the contextwarden package (README, "Usage totals"):'
        " `contextwarden usage --redis-url … --html report.html`."
    )
    return "\n".join(lines)


def own_usage_text(limits: Limits, day: Spend, month: Spend) -> str:
    """What a user sees for `!usage`: their spend today and this month, and their limits."""
    verdict = check_limits(limits, day, month)
    parts = [
        f"contextwarden: {spend_text(limits, day, verdict, True)}",
        f"this month {spent_usd_text(month, limits.cap('monthly_usd'))}",
    ]
    for kind in KINDS:
        if kind.endswith("tokens") and limits.cap(kind) is not None:
            spent = (day if kind.startswith("daily") else month).tokens
            parts.append(f"{kind.split('_')[0]} tokens {spent:,} of {limits.cap(kind):,}")
    if month.unpriced:
        parts.append(f"{replies_text(month.unpriced)} without a known price (not in the dollars)")
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
) -> tuple[str, bool]:
    """The `!usage` answer, and whether it was written into the reply (a browser chat's turn,
    `chat`: else the caller gets it as the turn's refusal text). `spend` reads the user's
    (today's, this month's) spend (see `SpendBook.spend`)."""
    if admin:
        month = await read_month(store, month_start(now.date()))
        names = await user_names([row.key for row in month.users[:MAX_USER_ROWS]], _open_webui_user_lookup())
        text = usage_markdown(month, now, rules, shared=store.shared, names=names)
    else:
        text = own_usage_text(limits, *await spend())
    if chat and emit is not None:
        try:
            await emit({"type": "replace", "data": {"content": text}})
            return text, True
        except Exception:  # no chat to write into: the refusal carries the answer
            pass
    return text, False


def _open_webui_user_lookup() -> UserLookup | None:
    """`Users.get_user_by_id` of the running Open WebUI (async in 0.12), None when it is not there."""
    module = sys.modules.get(OPEN_WEBUI_USERS)  # Open WebUI imports its models at start-up
    users = getattr(module, "Users", None) if module is not None else None
    return getattr(users, "get_user_by_id", None)


async def user_names(user_ids: Sequence[str], lookup: UserLookup | None) -> dict[str, str]:
    """What the admin's report shows for these user ids: each one's Open WebUI name, escaped for
    a table cell (with its id when two share a name). Ids whose name cannot be read (unknown to
    Open WebUI, an error, none within `USER_NAMES_TIMEOUT_SECONDS`) are left out: the report
    shows the id. Only names are read: an email is never shown or logged."""
    found: dict[str, str] = {}
    errors: list[str] = []
    if lookup is None or not user_ids:
        return found

    async def read_all() -> None:
        for user_id in user_ids:
            try:
                name = _cell_text(getattr(await _looked_up(lookup, user_id), "name", None))
            except Exception as exc:  # this user shows as the id; the others are still read
                errors.append(type(exc).__name__)
                continue
            if name:
                found[user_id] = name

    try:
        await asyncio.wait_for(read_all(), USER_NAMES_TIMEOUT_SECONDS)
    except TimeoutError:
        errors.append(f"none within {USER_NAMES_TIMEOUT_SECONDS:g} s")
    if errors:
        admin_log.warning(
            "contextwarden: user names not read (%s); %d of %d users shown by id",
            errors[-1],
            len(user_ids) - len(found),
            len(user_ids),
        )
    return _told_apart(found)


async def _looked_up(lookup: UserLookup, user_id: str) -> object:
    """One user through Open WebUI's model: awaited when async, else off the event loop (older
    versions read the database synchronously)."""
    if inspect.iscoroutinefunction(lookup):
        return await lookup(user_id)
    result = await asyncio.to_thread(lookup, user_id)
    return await result if inspect.isawaitable(result) else result


def _cell_text(name: object) -> str:
    """A user's name as one table cell's text: one line, at most MAX_NAME_CHARS, markup escaped
    (a name is the user's own: `<b>` or `|` in it must read as text)."""
    if not isinstance(name, str):
        return ""
    flat = " ".join(name.split())
    if len(flat) > MAX_NAME_CHARS:
        flat = flat[: MAX_NAME_CHARS - 1] + "…"
    return _MARKUP.sub(r"\\\1", flat)


def _told_apart(names: dict[str, str]) -> dict[str, str]:
    """Names more than one user has get the user's id after them (`Ann (<id>)`): the admin can
    tell them apart, and the id is what `limit_overrides` names a user by."""
    seen: dict[str, int] = {}
    for name in names.values():
        seen[name] = seen.get(name, 0) + 1
    return {user_id: name if seen[name] == 1 else f"{name} ({_cell_text(user_id)})" for user_id, name in names.items()}
