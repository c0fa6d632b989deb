"""Spending limits: which limits apply to a user, whether a turn may start, the 80% warning,
and when a limit resets. Pure rules over ledger totals; the filter does the I/O.

Limits are per UTC day and per calendar month (UTC), as the ledger keys its totals. Dollar
limits count priced replies only (an unknown price adds tokens, never a guessed 0); token
limits count prompt + completion tokens of every reply. Admins are not limited unless the
overrides name the `admin` role.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import ConfigError
from .dollars import usd

__all__ = [
    "Limits",
    "LimitRules",
    "Spend",
    "Verdict",
    "parse_overrides",
    "limits_for",
    "check_limits",
    "month_start",
    "next_reset",
    "refusal_text",
    "spend_text",
    "spend_parts",
    "spent_usd_text",
    "amount_text",
    "share_text",
    "WARN_FRACTION",
    "STORE_DOWN_TEXT",
    "LimitKind",
]

WARN_FRACTION = Decimal("0.8")  # the status line warns from here
MAX_SHOWN_PERCENT = 9_999  # of a limit; past it the line says `over 9,999%`
MAX_OVERRIDES_CHARS = 65_536  # also bounds the entries: at most about 9,000
MAX_LIMIT_USD = Decimal(1_000_000_000)
MAX_LIMIT_TOKENS = 10**15
OVERRIDES_VALVE = "limit_overrides"
LimitKind = Literal["daily_usd", "daily_tokens", "monthly_usd", "monthly_tokens"]
CENT = Decimal("0.01")
KINDS: tuple[LimitKind, ...] = ("daily_usd", "daily_tokens", "monthly_usd", "monthly_tokens")


@dataclass(frozen=True, slots=True)
class Limits:
    """Limits of one level: None = not set here (a lower level's applies), 0 = no limit."""

    daily_usd: Decimal | None = None
    monthly_usd: Decimal | None = None
    daily_tokens: int | None = None
    monthly_tokens: int | None = None

    def cap(self, kind: LimitKind) -> Decimal | int | None:
        """The limit of a kind, None when there is none (unset or 0)."""
        value = getattr(self, kind)
        return value if value else None

    @property
    def any(self) -> bool:
        return any(self.cap(kind) is not None for kind in KINDS)

    def over(self, other: Limits) -> Limits:
        """These limits where set, else `other`'s."""
        return Limits(**{f.name: _either(getattr(self, f.name), getattr(other, f.name)) for f in fields(Limits)})


def _either(mine, other):
    return other if mine is None else mine


@dataclass(frozen=True, slots=True)
class LimitRules:
    """The valves' limits (`base`) and the overrides by role, group (id or name) and user id."""

    base: Limits = Limits()
    roles: dict[str, Limits] | None = None
    groups: dict[str, Limits] | None = None
    users: dict[str, Limits] | None = None

    @property
    def needs_groups(self) -> bool:
        return bool(self.groups)

    @property
    def levels(self) -> list[Limits]:
        """Every set of limits: the valves' (`base`), then each override."""
        return [self.base, *(self.roles or {}).values(), *(self.groups or {}).values(), *(self.users or {}).values()]

    @property
    def active(self) -> bool:
        """Some limit may apply to someone (else nothing needs reading)."""
        return any(level.any for level in self.levels)


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    daily_usd: Decimal | None = Field(default=None, ge=0, le=MAX_LIMIT_USD, allow_inf_nan=False)
    monthly_usd: Decimal | None = Field(default=None, ge=0, le=MAX_LIMIT_USD, allow_inf_nan=False)
    daily_tokens: int | None = Field(default=None, ge=0, le=MAX_LIMIT_TOKENS)
    monthly_tokens: int | None = Field(default=None, ge=0, le=MAX_LIMIT_TOKENS)


class _Overrides(BaseModel):
    model_config = ConfigDict(extra="forbid")
    roles: dict[str, _Spec] = {}
    groups: dict[str, _Spec] = {}
    users: dict[str, _Spec] = {}


_OVERRIDE_SECTIONS = tuple(_Overrides.model_fields)
_PYDANTIC_CLASS = re.compile(r" or instance of _\w+")  # pydantic names our private model: not the admin's words


def _limits(spec: _Spec) -> Limits:
    return Limits(spec.daily_usd, spec.monthly_usd, spec.daily_tokens, spec.monthly_tokens)


def parse_overrides(text: str, base: Limits) -> LimitRules:
    """The `limit_overrides` valve: `{"roles": {...}, "groups": {...}, "users": {...}}`, each
    name mapping to `{"daily_usd", "monthly_usd", "daily_tokens", "monthly_tokens"}` (0 = none).

    Raises:
        ConfigError: not JSON, too large, or a wrong field; names the valve and the place
            (never the value).

    Example:
        >>> rules = parse_overrides('{"groups": {"interns": {"daily_usd": 0.5}}}', Limits())
        >>> rules.groups["interns"].daily_usd
        Decimal('0.5')
    """
    if not text.strip():
        return LimitRules(base=base)
    if len(text) > MAX_OVERRIDES_CHARS:
        raise ConfigError(
            f"{OVERRIDES_VALVE} is longer than {MAX_OVERRIDES_CHARS:,} characters; no overrides used",
            valve=OVERRIDES_VALVE,
        )
    try:
        document = json.loads(text, parse_float=Decimal)
    except ValueError as exc:
        where = f"line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else "somewhere"
        raise ConfigError(
            f"{OVERRIDES_VALVE} is not valid JSON (at {where}); no overrides used", valve=OVERRIDES_VALVE
        ) from None
    try:
        parsed = _Overrides.model_validate(document)
    except ValidationError as exc:
        first = exc.errors()[0]
        what = _PYDANTIC_CLASS.sub("", first["msg"])
        raise ConfigError(
            f"{OVERRIDES_VALVE}: {_overrides_place(document, first['loc'])}: {what}; no overrides used",
            valve=OVERRIDES_VALVE,
        ) from None
    return LimitRules(
        base=base,
        roles={k: _limits(v) for k, v in parsed.roles.items()},
        groups={k: _limits(v) for k, v in parsed.groups.items()},
        users={k: _limits(v) for k, v in parsed.users.items()},
    )


def _overrides_place(document: object, loc: Sequence[int | str]) -> str:
    """Where in `limit_overrides` a problem is, by the schema's own names and, for the admin's
    keys (user ids, often emails by mistake; group and role names), by position: `users entry 2,
    daily_usd` (as `parse_aliases` names its entries), never a key itself."""
    words: list[str] = []
    node = document
    for depth, key in enumerate(loc):
        known = _OVERRIDE_SECTIONS if depth == 0 else _Spec.model_fields if depth == 2 else ()
        keys = list(node) if isinstance(node, dict) else []
        if key in known:
            words.append(str(key))
        elif depth == 1 and key in keys:
            words.append(f"entry {keys.index(key) + 1}")
        elif key in keys:
            words.append(f"key {keys.index(key) + 1} (not one of {', '.join(known)})")
        else:
            words.append("?")
        node = node.get(key) if isinstance(node, dict) else None
    return " ".join(words[:2]) + "".join(f", {w}" for w in words[2:]) if words else "the top level"


def _most_generous(levels: Sequence[Limits]) -> Limits:
    """Of several groups' limits, per kind the most generous one that is set (0 = none wins)."""
    out: dict[str, Any] = {}
    for kind in KINDS:
        values = [getattr(level, kind) for level in levels if getattr(level, kind) is not None]
        out[kind] = None if not values else (0 if 0 in values else max(values))
    return Limits(**out)


def limits_for(rules: LimitRules, *, role: str, groups: Iterable[str], user_id: str) -> Limits:
    """The limits of one user: the valves', then their role's, their groups' (the most generous
    of them), their own; per kind the most specific level that sets it wins. Admins: none
    unless the `admin` role has an override.

    Example:
        >>> overrides = '{"roles": {"user": {"daily_usd": 2}}, "users": {"u1": {"daily_usd": 5}}}'
        >>> rules = parse_overrides(overrides, Limits())
        >>> limits_for(rules, role="user", groups=[], user_id="u1").daily_usd
        Decimal('5')
    """
    roles, by_group, users = rules.roles or {}, rules.groups or {}, rules.users or {}
    if role == "admin" and "admin" not in roles:
        return Limits(Decimal(0), Decimal(0), 0, 0)
    chosen = rules.base
    if role in roles:
        chosen = roles[role].over(chosen)
    mine = [by_group[g] for g in dict.fromkeys(groups) if g in by_group]
    if mine:
        chosen = _most_generous(mine).over(chosen)
    if user_id in users:
        chosen = users[user_id].over(chosen)
    return chosen


@dataclass(frozen=True, slots=True)
class Spend:
    """What one user used in a period: priced cost, tokens, and replies without a price."""

    usd: Decimal = Decimal(0)
    tokens: int = 0
    requests: int = 0
    unpriced: int = 0

    def of(self, kind: LimitKind) -> Decimal | int:
        return self.usd if kind.endswith("_usd") else self.tokens


def month_start(day: date) -> date:
    return day.replace(day=1)


def next_reset(kind: LimitKind, now: datetime) -> datetime:
    """The next UTC midnight (daily) or first of the next month (monthly)."""
    today = now.astimezone(UTC).date()
    if kind.startswith("daily"):
        start = today + timedelta(days=1)
    else:
        start = (today.replace(day=28) + timedelta(days=4)).replace(day=1)
    return datetime(start.year, start.month, start.day, tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class Verdict:
    """May a turn start? When not: the limit reached. `warn`: the highest share of a limit used
    (0 to 1+) and its kind, when at least `WARN_FRACTION`."""

    allowed: bool
    kind: LimitKind | None = None
    spent: Decimal | int = 0
    cap: Decimal | int = 0
    warn_kind: LimitKind | None = None
    warn_share: Decimal = Decimal(0)

    @property
    def near(self) -> bool:
        return self.warn_kind is not None


def check_limits(limits: Limits, day: Spend, month: Spend) -> Verdict:
    """Refused when any limit is reached (spent >= limit); else allowed, with the 80% warning.

    Example:
        >>> check_limits(Limits(daily_usd=Decimal(2)), Spend(usd=Decimal("2.01")), Spend()).kind
        'daily_usd'
    """
    warn_kind, warn_share = None, Decimal(0)
    for kind in KINDS:
        cap = limits.cap(kind)
        if cap is None:
            continue
        spent = (day if kind.startswith("daily") else month).of(kind)
        if spent >= cap:
            return Verdict(False, kind, spent, cap, kind, Decimal(spent) / Decimal(cap))
        share = Decimal(spent) / Decimal(cap)
        if share >= WARN_FRACTION and share > warn_share:
            warn_kind, warn_share = kind, share
    return Verdict(True, warn_kind=warn_kind, warn_share=warn_share)


def amount_text(kind: LimitKind, value: Decimal | int) -> str:
    """`$2.00` (whole cents), `$0.013` (else as every amount is shown: `money.usd`), `12,000 tokens`."""
    if kind.endswith("_usd"):
        amount = Decimal(value)
        return f"${amount:,.2f}" if amount == amount.quantize(CENT) else usd(amount)
    return f"{int(value):,} tokens"


def spent_usd_text(spend: Spend, cap: Decimal | int | None = None) -> str:
    """A user's dollars spent as they read it: `$0.42`; `≥$0.42` when some replies had no known
    price (the amount counts the priced ones); `unknown` when none had one, except beside the
    dollar limit it is held to (`cap`), which counts the priced ones: `≥$0 of $2.00`.

    Example:
        >>> spent_usd_text(Spend(Decimal("0.0026"), 1_515, 2, 1)), spent_usd_text(Spend(Decimal(0), 5, 1, 1))
        ('≥$0.0026', 'unknown')
    """
    if spend.unpriced and spend.unpriced >= spend.requests and cap is None:
        return "unknown"
    text = amount_text("daily_usd", spend.usd)
    text = f"≥{text}" if spend.unpriced else text
    return text if cap is None else f"{text} of {amount_text('daily_usd', cap)}"


def _until(reset: datetime, now: datetime) -> str:
    left = max(timedelta(0), reset - now)
    hours, minutes = divmod(int(left.total_seconds()) // 60, 60)
    return f"{hours} h {minutes:02d} min" if hours < 48 else f"{left.days} days"


def refusal_text(verdict: Verdict, now: datetime) -> str:
    """What a refused user reads: the limit, what was used, when it resets.

    Example:
        >>> print(refusal_text(Verdict(False, "daily_usd", Decimal("2.034"), Decimal(2)),
        ...                    datetime(2026, 12, 1, 20, 48, tzinfo=UTC)))  # doctest: +NORMALIZE_WHITESPACE
        contextwarden: your daily limit of $2.00 is reached ($2.03 used today).
        It resets at 00:00 UTC (in 3 h 12 min).
    """
    kind = verdict.kind or "daily_usd"
    reset = next_reset(kind, now)
    period = "today" if kind.startswith("daily") else "this month"
    when = "00:00 UTC" if kind.startswith("daily") else f"00:00 UTC on {reset.date().isoformat()}"
    return (
        f"contextwarden: your {kind.split('_')[0]} limit of {amount_text(kind, verdict.cap)} is reached "
        f"({amount_text(kind, verdict.spent)} used {period}). It resets at {when} (in {_until(reset, now)})."
    )


STORE_DOWN_TEXT = (
    "contextwarden: usage limits cannot be checked right now (the usage store is unreachable); try again shortly."
)


def spend_text(limits: Limits, day: Spend, verdict: Verdict, show_spend: bool) -> str:
    """`today $0.42 of $2.00` (the limit only when there is one), and the warning from 80%.

    Example:
        >>> verdict = Verdict(True, warn_kind="daily_usd", warn_share=Decimal("0.85"))
        >>> spend_text(Limits(daily_usd=Decimal(2)), Spend(usd=Decimal("1.7")), verdict, True)
        'today $1.70 of $2.00 · 85% of your daily limit'
    """
    return " · ".join(part for part in spend_parts(limits, day, verdict, show_spend) if part)


def spend_parts(limits: Limits, day: Spend, verdict: Verdict, show_spend: bool) -> tuple[str, str]:
    """`spend_text` in its two parts, (spend, warning), each "" when there is none: a status
    line shows the warning first (a long line is cut at the end, where the spend goes)."""
    spend = ""
    if show_spend:
        usd_cap, token_cap = limits.cap("daily_usd"), limits.cap("daily_tokens")
        spend = f"today {spent_usd_text(day, usd_cap)}"
        if usd_cap is None and token_cap is not None:
            spend = f"today {day.tokens:,} of {token_cap:,} tokens"
        if day.unpriced and usd_cap is not None:
            spend += " (some replies unpriced)"
    warning = ""
    if verdict.warn_kind is not None:
        warning = f"{share_text(verdict.warn_share)} of your {verdict.warn_kind.split('_')[0]} limit" + (
            "" if verdict.warn_kind.endswith("usd") else " (tokens)"
        )
    return spend, warning


def share_text(share: Decimal) -> str:
    """A share of a limit as people read it: `86%`, `1,180%` (one expensive reply can pass a
    limit many times over), `over 9,999%` past that (a forged reply: the number says nothing more).

    Example:
        >>> share_text(Decimal("0.86")), share_text(Decimal("11.8")), share_text(Decimal(250))
        ('86%', '1,180%', 'over 9,999%')
    """
    percent = int(share * 100)
    return f"over {MAX_SHOWN_PERCENT:,}%" if percent > MAX_SHOWN_PERCENT else f"{percent:,}%"
