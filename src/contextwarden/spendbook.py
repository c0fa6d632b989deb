"""Each user's spend per month and day, kept for limits in one counter key per user and month.

The ledger keys its totals by day, user and model with no per-user index: adding one user's
month up means scanning every key (about 100 ms at 10,000 keys in Redis on a busy machine, see
`bench/results/limits.md`). So each reply also adds, in one atomic increment, to
`spend:<YYYY-MM>:<user>`: the month's `cost_picousd`, `tokens`, `unpriced`, `requests`, and the
same under `dNN:` for its day. A limit check is then one read (two in the month the keys began,
whose earlier days come from the ledger, read once and remembered: past days do not change).
"""

from __future__ import annotations

import uuid
from datetime import date
from decimal import Decimal
from urllib.parse import quote

from .ledger import picodollars_to_usd, read_ledger, usd_to_picodollars
from .limits import Spend, month_start, spend_of
from .store import Store
from .usage import MAX_REPLY_COST_USD

__all__ = ["SpendBook", "SPEND_TTL_SECONDS"]

SPEND_TTL_SECONDS = 40 * 86_400  # a month's key outlives the month
MAX_REPLY_TOKENS = 10**10
MAX_REMEMBERED_MONTHS = 10_000
STARTED_KEY = "spend:started"
STARTED_TTL_SECONDS = 3_650 * 86_400
FIELDS = ("cost_picousd", "tokens", "unpriced", "requests")


def _spend_key(month: date, user: str) -> str:
    return f"spend:{month:%Y-%m}:{quote(user or '-', safe='')}"


def _fields(day: date, cost_usd: Decimal | None, tokens: int) -> dict[str, int]:
    # Bounded before converting (outlet input is hostile): one reply counts at most MAX_REPLY_COST_USD.
    known = cost_usd is not None and cost_usd.is_finite()
    cost = (
        usd_to_picodollars(min(max(cost_usd, Decimal(0)), MAX_REPLY_COST_USD)) if cost_usd is not None and known else 0
    )
    amounts = (cost, min(max(tokens, 0), MAX_REPLY_TOKENS), int(cost_usd is None), 1)
    fields = dict(zip(FIELDS, amounts, strict=True))
    fields.update({f"d{day.day:02d}:{name}": amount for name, amount in zip(FIELDS, amounts, strict=True)})
    return fields


def _spend(counters: dict[str, int], prefix: str = "") -> Spend:
    return Spend(
        picodollars_to_usd(counters.get(prefix + "cost_picousd", 0)),
        counters.get(prefix + "tokens", 0),
        counters.get(prefix + "requests", 0),
        counters.get(prefix + "unpriced", 0),
    )


def _plus(a: Spend, b: Spend, sign: int = 1) -> Spend:
    return Spend(
        a.usd + sign * b.usd, a.tokens + sign * b.tokens, a.requests + sign * b.requests, a.unpriced + sign * b.unpriced
    )


class SpendBook:
    """Records replies into the month keys and reads (today's, this month's) spend of a user.

    The first reply this version records sets `spend:started` (its UTC day, once, in the shared
    store): months after that day's month are whole in the keys; in that month the ledger counts
    up to and including that day (replies before the keys existed), the key after it.
    """

    def __init__(self) -> None:
        self._started: date | None = None
        self._past: dict[tuple[str, str], tuple[Spend, Spend]] = {}

    async def record(self, store: Store, *, user: str, day: date, cost_usd: Decimal | None, tokens: int) -> None:
        """Add one reply to its user's month and day totals (one named, atomic increment)."""
        if self._started is None:
            await store.add(STARTED_KEY, day.isoformat().encode(), ttl=STARTED_TTL_SECONDS)
            await self._start_day(store)
        fields = _fields(day, cost_usd, tokens)
        await store.incr(
            _spend_key(month_start(day), user), fields, ttl=SPEND_TTL_SECONDS, once=f"spend:{uuid.uuid4().hex}"
        )

    async def spend(self, store: Store, user: str, today: date) -> tuple[Spend, Spend]:
        started = await self._start_day(store)
        if started is None or started > today:  # nothing in the keys yet (or a clock gone back)
            return await _from_ledger(store, user, month_start(today), today)
        counters = await store.counters(_spend_key(month_start(today), user))
        day, month = _spend(counters, f"d{today.day:02d}:"), _spend(counters)
        if month_start(started) < month_start(today):
            return day, month  # a month that began after the keys did: all in them
        # The keys' first month: the ledger up to and including the start day, the key after it.
        if started == today:
            ledger_day, ledger_month = await _from_ledger(store, user, month_start(today), today)
            return ledger_day, _plus(_plus(month, day, -1), ledger_month)
        ledger_month = await self._ledger_until(store, user, started)
        return day, _plus(_plus(month, _spend(counters, f"d{started.day:02d}:"), -1), ledger_month)

    async def _start_day(self, store: Store) -> date | None:
        if self._started is None:
            raw = await store.get(STARTED_KEY)
            try:
                self._started = date.fromisoformat(raw.decode()) if raw else None
            except (UnicodeDecodeError, ValueError):
                self._started = None
        return self._started

    async def _ledger_until(self, store: Store, user: str, last: date) -> Spend:
        """The ledger's spend of `last`'s month up to `last`, a past day (remembered)."""
        key = (user, last.isoformat())
        found = self._past.get(key)
        if found is None:
            found = await _from_ledger(store, user, month_start(last), last)
            if len(self._past) >= MAX_REMEMBERED_MONTHS:
                self._past.clear()
            self._past[key] = found
        return found[1]


async def _from_ledger(store: Store, user: str, since: date, until: date) -> tuple[Spend, Spend]:
    """(the spend of `until`, of `since`..`until`) from the ledger: a scan of its keys."""
    return spend_of(await read_ledger(store, since=since, until=until, user=user), until)
