"""The usage ledger: totals per (UTC day, user, model), added to atomically in the store.

One counter key per day, user and model holds requests, token counts, cost in integer
picodollars (1e-12 USD, so Redis HINCRBY adds exactly) and how many replies were estimated
or unpriced; beside real spend, what trimming saved (`trimmed`, `tokens_saved`,
`cost_saved_picousd`: estimates, from turns really trimmed) and, apart, what shadow mode says it
would have saved (`shadow_*`: the chat went out whole, nothing was saved). Several workers
sharing one Redis add up exactly; without Redis each worker keeps its own totals. Query helpers
add the keys up by user, model or day.

Beside them, one key a month (`ledger-month:<YYYY-MM>`) holds the month's figures a report
shows, by user, by model and by day, so `!usage` reads one key instead of scanning the store.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Literal
from urllib.parse import quote, unquote

from ..state.store import Store
from .usage import MAX_TOKEN_COUNT

__all__ = [
    "LedgerEntry",
    "LedgerRow",
    "LEDGER_FIELDS",
    "LEDGER_MONEY_FIELDS",
    "DEFAULT_LEDGER_RETENTION_DAYS",
    "record_reply",
    "read_ledger",
    "read_month",
    "MonthTotals",
    "ledger_totals",
    "usd_to_picodollars",
    "picodollars_to_usd",
]

DEFAULT_LEDGER_RETENTION_DAYS = 400
LEDGER_KEY_PREFIX = "ledger:"
MAX_KEY_ID_CHARS = 200  # of a user or model id in a ledger key; real ids are far shorter
PICODOLLARS_PER_USD = 10**12
# The most one increment may add, in USD: far below the 9.2e18 picodollars (9.2 million USD) a
# Redis counter holds, and far above a reply's cost ceiling (usage.MAX_REPLY_COST_USD).
MAX_INCREMENT_USD = Decimal(10**6)
# Counter fields of one ledger key, in the order reports show them.
LEDGER_FIELDS = (
    "requests",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "reasoning_tokens",
    "cost_picousd",
    "estimated",
    "unpriced",
    "trimmed",
    "tokens_saved",
    "cost_saved_picousd",
    "shadow_trimmed",
    "shadow_tokens_saved",
    "shadow_cost_saved_picousd",
)
# Counters holding picodollars, shown as USD under the name without `_picousd`.
LEDGER_MONEY_FIELDS = ("cost_picousd", "cost_saved_picousd", "shadow_cost_saved_picousd")

# Savings may be negative (the untrimmed chat would have cost less, prompt cache counted).
SIGNED_MONEY_FIELDS = frozenset({"cost_saved_picousd", "shadow_cost_saved_picousd"})
# The most one reply may add to a field: a token count's bound, or for money the increment bound.
_FIELD_LIMITS = {name: int(MAX_INCREMENT_USD) * PICODOLLARS_PER_USD for name in LEDGER_MONEY_FIELDS}

LedgerGrouping = Literal["user", "model", "day"]
MONTH_KEY_PREFIX = "ledger-month:"
# The figures of the month key, each by user (`u`), model (`m`) and day of the month (`d`).
MONTH_FIELDS = ("requests", "prompt_tokens", "completion_tokens", "cost_picousd", "unpriced", "estimated")
MONTH_TTL_SECONDS = 40 * 86_400  # at least: a month's key outlives the month


def usd_to_picodollars(amount: Decimal) -> int:
    """USD as whole picodollars (1e-12 USD), rounded half-even below that.

    Raises:
        ValueError: not finite, negative or above MAX_INCREMENT_USD (checked before converting:
            int() of a forged Decimal("1e999000") would take half a minute).

    Example:
        >>> usd_to_picodollars(Decimal("0.0031"))
        3100000000
    """
    if not amount.is_finite() or not 0 <= amount <= MAX_INCREMENT_USD:
        raise ValueError("a ledger amount must be from 0 to MAX_INCREMENT_USD")
    return int((amount * PICODOLLARS_PER_USD).to_integral_value(rounding=ROUND_HALF_EVEN))


def picodollars_to_usd(amount: int) -> Decimal:
    """Picodollars back to an exact Decimal USD amount.

    Example:
        >>> picodollars_to_usd(3100000000)
        Decimal('0.0031')
    """
    return (Decimal(amount) / PICODOLLARS_PER_USD).normalize() if amount else Decimal(0)


def _key_ids(user: str, model: str) -> tuple[str, str]:
    """A user and model id as keys hold them: cut to MAX_KEY_ID_CHARS (a model id in the outlet
    body is the client's) and percent-encoded (model ids hold ':' and '/')."""
    return quote(user[:MAX_KEY_ID_CHARS], safe=""), quote(model[:MAX_KEY_ID_CHARS], safe="")


def _ledger_key(day: date, user: str, model: str) -> str:
    """`ledger:YYYY-MM-DD:<user>:<model>`, ids as `_key_ids` writes them."""
    return f"{LEDGER_KEY_PREFIX}{day.isoformat()}:" + ":".join(_key_ids(user, model))


def _ledger_key_parts(key: str) -> tuple[date, str, str] | None:
    """(day, user, model) of a ledger key, None for anything else."""
    if not key.startswith(LEDGER_KEY_PREFIX):
        return None
    parts = key[len(LEDGER_KEY_PREFIX) :].split(":")
    if len(parts) != 3:
        return None
    try:
        day = date.fromisoformat(parts[0])
    except ValueError:
        return None
    return day, unquote(parts[1]), unquote(parts[2])


class _Money:
    """Dollar amounts of the integer picodollar counters in `counters`."""

    __slots__ = ()
    counters: dict[str, int]

    def usd(self, field: str) -> Decimal:
        """A money counter (`cost_picousd`, `cost_saved_picousd`, ...) in USD."""
        return picodollars_to_usd(self.counters.get(field, 0))

    @property
    def cost_usd(self) -> Decimal:
        """The priced replies' cost in USD (unpriced replies add nothing; see `unpriced`)."""
        return self.usd("cost_picousd")


@dataclass(frozen=True, slots=True)
class LedgerEntry(_Money):
    """Totals of one (day, user, model) key."""

    day: date
    user: str
    model: str
    counters: dict[str, int]


@dataclass(frozen=True, slots=True)
class LedgerRow(_Money):
    """Totals added up for one user, model or day."""

    key: str
    counters: dict[str, int]

    def as_dict(self) -> dict[str, object]:
        """JSON-ready: every counter; money as exact decimal strings under `*_usd` names."""
        out: dict[str, object] = {"key": self.key}
        for name in LEDGER_FIELDS:
            if name in LEDGER_MONEY_FIELDS:
                out[name.replace("_picousd", "_usd")] = format(self.usd(name), "f")
            else:
                out[name] = self.counters.get(name, 0)
        return out


def _savings_fields(tokens_saved: int, cost_saved_usd: Decimal | None, shadow: bool) -> dict[str, int]:
    """The counters of a trimmed reply (`shadow_*` when shadow mode only estimated them)."""
    prefix = "shadow_" if shadow else ""
    saved = cost_saved_usd or Decimal(0)  # negative when the untrimmed chat was cheaper (prompt cache)
    return {
        prefix + "trimmed": 1,
        prefix + "tokens_saved": tokens_saved,
        prefix + "cost_saved_picousd": (
            -usd_to_picodollars(-saved) if saved.is_finite() and saved < 0 else usd_to_picodollars(saved)
        ),
    }


def _check_fields(fields: dict[str, int]) -> None:
    """ValueError unless every counter is an int within its limit (checked before anything is written)."""
    for name, amount in fields.items():
        limit = _FIELD_LIMITS.get(name, MAX_TOKEN_COUNT)
        low = -limit if name in SIGNED_MONEY_FIELDS else 0
        if not isinstance(amount, int) or isinstance(amount, bool) or not low <= amount <= limit:
            raise ValueError(f"ledger field {name} out of range")


async def record_reply(
    store: Store,
    *,
    user: str | None,
    model: str,
    prompt_tokens: int | None,
    completion_tokens: int | None,
    cached_tokens: int | None = None,
    reasoning_tokens: int | None = None,
    cost_usd: Decimal | None,
    estimated: bool,
    day: date | None = None,
    retention_days: int = DEFAULT_LEDGER_RETENTION_DAYS,
    tokens_saved: int = 0,
    cost_saved_usd: Decimal | None = None,
    shadow: bool = False,
    taken_back: bool = False,
) -> str:
    """Add one reply to its (day, user, model) totals in a single atomic increment.

    Every value is checked first (counts 0 to MAX_TOKEN_COUNT, money 0 to MAX_INCREMENT_USD):
    out of range raises ValueError and nothing is written.

    Counted once: the increment is named (a fresh id), so when a Redis timeout leaves unknown
    whether it was applied, the store can send it again and Redis applies it only once.

    Args:
        user: Open WebUI user id (None = "-").
        model: the resolved price-book id, else the model id as sent.
        cost_usd: None when the price is unknown (counted in `unpriced`).
        day: UTC date of the reply; default today.
        retention_days: the key expires this long after its last reply.
        tokens_saved: tokens trimming removed from this reply's prompt (estimate; 0 = none).
        cost_saved_usd: what those tokens would have cost at the input price (None = unknown).
        shadow: the savings are what shadow mode would have saved (`shadow_*` counters).
        taken_back: take out a reply added before with these figures (each subtracted): a turn
            added when it ended without an outlet, whose outlet then came after all.

    Returns the key written (without the store prefix).

    Example:
        >>> await record_reply(MemoryStore(), user="u1", model="openai/gpt-4o", prompt_tokens=10,
        ...     completion_tokens=5, cost_usd=Decimal("0.000075"), estimated=False)  # doctest: +SKIP
        'ledger:2026-08-19:u1:openai%2Fgpt-4o'
    """
    day = day or datetime.now(UTC).date()
    key = _ledger_key(day, user or "-", model or "-")
    fields = {
        "requests": 1,
        "prompt_tokens": prompt_tokens or 0,
        "completion_tokens": completion_tokens or 0,
        "cached_tokens": cached_tokens or 0,
        "reasoning_tokens": reasoning_tokens or 0,
        "cost_picousd": usd_to_picodollars(cost_usd) if cost_usd is not None else 0,
        "estimated": int(bool(estimated)),
        "unpriced": int(cost_usd is None),
    }
    if tokens_saved > 0:
        fields.update(_savings_fields(tokens_saved, cost_saved_usd, shadow))
    _check_fields(fields)
    if taken_back:
        fields = {name: -amount for name, amount in fields.items()}
    ttl = max(1, retention_days) * 86_400
    await store.incr(key, fields, ttl=ttl, once=f"ledger:{uuid.uuid4().hex}")
    await store.incr(
        _month_key(day),
        _month_fields(day, _key_ids(user or "-", model or "-"), fields),
        ttl=max(ttl, MONTH_TTL_SECONDS),
        once=f"ledger-month:{uuid.uuid4().hex}",
    )
    return key


def _month_key(day: date) -> str:
    return f"{MONTH_KEY_PREFIX}{day:%Y-%m}"


def _month_fields(day: date, ids: tuple[str, str], fields: dict[str, int]) -> dict[str, int]:
    """A reply's figures under `u:<user>:`, `m:<model>:` and `d:<DD>:` (ids as `_key_ids` writes them)."""
    user, model = ids
    out = {}
    for group in (f"u:{user}", f"m:{model}", f"d:{day.day:02d}"):
        out.update({f"{group}:{name}": fields[name] for name in MONTH_FIELDS if fields[name]})
    return out


@dataclass(frozen=True, slots=True)
class MonthTotals:
    """One month's figures from its month key: rows by user and by model (largest cost first)
    and by day (`YYYY-MM-DD`, in order), each with the `MONTH_FIELDS` counters."""

    users: list[LedgerRow]
    models: list[LedgerRow]
    days: list[LedgerRow]


async def read_month(store: Store, month: date) -> MonthTotals:
    """The month of `month` as a report shows it: one read of its month key.

    Example:
        >>> (await read_month(store, date(2026, 12, 1))).users[0].key  # doctest: +SKIP
        'u-1'
    """
    groups: dict[tuple[str, str], dict[str, int]] = {}
    for name, amount in (await store.counters(_month_key(month))).items():
        parts = name.split(":")
        if len(parts) != 3 or parts[0] not in ("u", "m", "d") or parts[2] not in MONTH_FIELDS:
            continue
        what = unquote(parts[1]) if parts[0] != "d" else f"{month:%Y-%m}-{parts[1]}"
        groups.setdefault((parts[0], what), dict.fromkeys(MONTH_FIELDS, 0))[parts[2]] = amount
    rows = {kind: [LedgerRow(key, totals) for (k, key), totals in groups.items() if k == kind] for kind in "umd"}
    return MonthTotals(_by_cost(rows["u"]), _by_cost(rows["m"]), sorted(rows["d"], key=lambda r: r.key))


def _by_cost(rows: list[LedgerRow]) -> list[LedgerRow]:
    return sorted(rows, key=lambda r: (-r.counters["cost_picousd"], -r.counters["requests"], r.key))


async def read_ledger(
    store: Store, *, since: date | None = None, until: date | None = None, user: str | None = None
) -> list[LedgerEntry]:
    """Every ledger key from `since` to `until` (both inclusive), sorted by day, user, model;
    only one user's when `user` is given (a spending limit reads just those)."""
    pattern = LEDGER_KEY_PREFIX + "*"
    if user is not None:  # ids are percent-encoded: no glob character is left in them
        month = (
            since.isoformat()[:8]
            if since is not None and until is not None and since.isoformat()[:8] == until.isoformat()[:8]
            else ""
        )
        pattern = f"{LEDGER_KEY_PREFIX}{month}*:{quote(user or '-', safe='')}:*"
    entries = []
    for key in await store.keys(pattern):
        parts = _ledger_key_parts(key)
        if parts is None or (since is not None and parts[0] < since) or (until is not None and parts[0] > until):
            continue
        if user is not None and parts[1] != (user or "-"):
            continue
        counters = await store.counters(key)
        if counters:
            entries.append(LedgerEntry(parts[0], parts[1], parts[2], counters))
    return sorted(entries, key=lambda e: (e.day, e.user, e.model))


def ledger_totals(entries: Iterable[LedgerEntry], by: LedgerGrouping) -> list[LedgerRow]:
    """Add entries up by user, model or day; sorted by day ascending, else by cost descending.

    Raises:
        ValueError: `by` is not one of user, model, day.

    Example:
        >>> [r.key for r in ledger_totals(await read_ledger(store), "model")]  # doctest: +SKIP
        ['anthropic/claude-sonnet-4.5', 'openai/gpt-4o']
    """
    if by not in ("user", "model", "day"):
        raise ValueError(f"Unrecognized by={by!r}. Supported: 'user', 'model', 'day'.")
    groups: dict[str, dict[str, int]] = {}
    for entry in entries:
        name = entry.day.isoformat() if by == "day" else getattr(entry, by)
        totals = groups.setdefault(name, {field: 0 for field in LEDGER_FIELDS})
        for field in LEDGER_FIELDS:
            totals[field] += entry.counters.get(field, 0)
    rows = [LedgerRow(name, totals) for name, totals in groups.items()]
    return sorted(rows, key=lambda r: r.key) if by == "day" else _by_cost(rows)
