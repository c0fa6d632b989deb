"""Each user's spend per month and day, in one counter key per user and month: what limits read.

`spend:<YYYY-MM>:<user>` holds the month's `cost_picousd`, `tokens`, `unpriced` and `requests`,
the same under `dNN:` for its day. A limit check is one read of it. A turn is charged when it
starts (`reserve`: its estimate added only while every limit's counter is under its cap, in one
atomic step of the store, so the charges of every worker are checked one after another) and
settled when its reply ends (`settle`: what it really cost replaces the estimate). A reply
of a turn that took no charge is added whole (`record`).
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from datetime import date
from decimal import Decimal
from urllib.parse import quote

from ..state.store import Store
from .ledger import PICODOLLARS_PER_USD, picodollars_to_usd, usd_to_picodollars
from .limits import KINDS, Limits, Spend, Verdict, check_limits, month_start
from .pricing import ModelPrice
from .usage import MAX_REPLY_COST_USD, Usage, compute_cost

__all__ = ["SpendBook", "Charge", "SPEND_TTL_SECONDS"]

SPEND_TTL_SECONDS = 40 * 86_400  # a month's key outlives the month
MAX_REPLY_TOKENS = 10**10
FIELDS = ("cost_picousd", "tokens", "unpriced", "requests")


@dataclass(frozen=True, slots=True)
class Charge:
    """What a turn adds to its user's spend: dollars (None: no known price) and tokens.

    Example:
        >>> Charge(Decimal("0.0125"), 5_000).amounts()
        (12500000000, 5000, 0)
    """

    cost_usd: Decimal | None
    tokens: int

    @classmethod
    def of(cls, usage: Usage, cost_usd: Decimal | None) -> Charge:
        """A reply's charge: its cost, and its prompt + completion tokens (what token limits count)."""
        return cls(cost_usd, (usage.prompt_tokens or 0) + (usage.completion_tokens or 0))

    @classmethod
    def priced(cls, usage: Usage, price: ModelPrice | None) -> Charge:
        """What a reply with this usage costs at this price (unknown price: tokens only)."""
        return cls.of(usage, compute_cost(usage, price).cost_usd)

    def plus(self, other: Charge) -> Charge:
        """Both charges (the dollars unknown when either's are)."""
        cost = None if self.cost_usd is None or other.cost_usd is None else self.cost_usd + other.cost_usd
        return Charge(cost, self.tokens + other.tokens)

    def at_least(self, other: Charge) -> Charge:
        """This charge raised to `other` where it is less: the larger of the dollars known (None
        when neither is) and of the tokens.

        Example:
            >>> Charge(None, 2).at_least(Charge(Decimal("0.01"), 900))
            Charge(cost_usd=Decimal('0.01'), tokens=900)
        """
        known = [cost for cost in (self.cost_usd, other.cost_usd) if cost is not None]
        return Charge(max(known) if known else None, max(self.tokens, other.tokens))

    def amounts(self) -> tuple[int, int, int]:
        """(picodollars, tokens, unpriced), each bounded: outlet input is hostile, and one
        reply counts at most MAX_REPLY_COST_USD and MAX_REPLY_TOKENS."""
        cost = self.cost_usd
        known = cost is not None and cost.is_finite()
        pico = usd_to_picodollars(min(max(cost, Decimal(0)), MAX_REPLY_COST_USD)) if cost is not None and known else 0
        return pico, min(max(self.tokens, 0), MAX_REPLY_TOKENS), int(cost is None)


def _spend_key(month: date, user: str) -> str:
    return f"spend:{month:%Y-%m}:{quote(user or '-', safe='')}"


def _fields(day: date, amounts: tuple[int, int, int], requests: int) -> dict[str, int]:
    """The month's and the day's fields for these amounts (those that are not 0)."""
    values = dict(zip(FIELDS, (*amounts, requests), strict=True))
    fields = {**values, **{f"d{day.day:02d}:{name}": amount for name, amount in values.items()}}
    return {name: amount for name, amount in fields.items() if amount}


def _caps(limits: Limits, day: date) -> dict[str, int]:
    """Each limit as the counter `check_limits` reads for it (the day's under `dNN:`) and the
    amount at which it is reached: a charge goes in only while every counter is under its cap."""
    caps = {}
    for kind in KINDS:
        cap = limits.cap(kind)
        if cap is not None:
            prefix = f"d{day.day:02d}:" if kind.startswith("daily") else ""
            usd = kind.endswith("_usd")
            caps[prefix + ("cost_picousd" if usd else "tokens")] = (
                math.ceil(cap * PICODOLLARS_PER_USD) if usd else int(cap)
            )
    return caps


def _spend(counters: dict[str, int], prefix: str = "") -> Spend:
    return Spend(
        picodollars_to_usd(max(counters.get(prefix + "cost_picousd", 0), 0)),
        counters.get(prefix + "tokens", 0),
        counters.get(prefix + "requests", 0),
        counters.get(prefix + "unpriced", 0),
    )


class SpendBook:
    """Reads (today's, this month's) spend of a user and writes charges, settlements and replies."""

    async def spend(self, store: Store, user: str, today: date) -> tuple[Spend, Spend]:
        """(today's, this month's) spend: one read."""
        counters = await store.counters(_spend_key(month_start(today), user))
        return _spend(counters, f"d{today.day:02d}:"), _spend(counters)

    async def reserve(
        self, store: Store, *, user: str, day: date, charge: Charge, limits: Limits, name: str
    ) -> Verdict:
        """Check the user's spend against `limits` and, when the turn may start, charge its
        estimate: one atomic step of the store (`incr_below`), so turns started side by side in
        any worker are checked one after another, each seeing the charges before it. `name`
        (unique to the turn) makes the charge apply once however often it is sent."""
        key = _spend_key(month_start(day), user)
        fields = _fields(day, charge.amounts(), 1)
        _, before = await store.incr_below(key, fields, ttl=SPEND_TTL_SECONDS, below=_caps(limits, day), once=name)
        return check_limits(limits, _spend(before, f"d{day.day:02d}:"), _spend(before))

    async def charge(self, store: Store, *, user: str, day: date, charge: Charge, name: str, keep: bool) -> None:
        """For a `reserve` whose answer was lost (the store away): it may or may not have been
        applied. Charge the estimate unchecked under the reserve's `name` (nothing when it was
        applied; else added, or held until the store answers), so it counts exactly once; then,
        unless `keep` (a turn refused for the store's failure), take it back."""
        key = _spend_key(month_start(day), user)
        await store.incr(key, _fields(day, charge.amounts(), 1), ttl=SPEND_TTL_SECONDS, once=name)
        if not keep:
            usd, tokens, unpriced = charge.amounts()
            await self._add(store, user, day, _fields(day, (-usd, -tokens, -unpriced), -1))

    async def settle(self, store: Store, *, user: str, day: date, charged: Charge | None, real: Charge) -> None:
        """Replace a turn's charge by what its reply really cost (added once, even when retried);
        a turn that took no charge (`charged` None) is added whole, as a reply (`record`)."""
        if charged is None:
            await self._add(store, user, day, _fields(day, real.amounts(), 1))
            return
        was, now = charged.amounts(), real.amounts()
        delta = (now[0] - was[0], now[1] - was[1], now[2] - was[2])
        if any(delta):
            await self._add(store, user, day, _fields(day, delta, 0))

    async def record(self, store: Store, *, user: str, day: date, cost_usd: Decimal | None, tokens: int) -> None:
        """Add one reply that took no charge to its user's month and day totals."""
        await self.settle(store, user=user, day=day, charged=None, real=Charge(cost_usd, tokens))

    @staticmethod
    async def _add(store: Store, user: str, day: date, fields: dict[str, int]) -> None:
        key = _spend_key(month_start(day), user)
        await store.incr(key, fields, ttl=SPEND_TTL_SECONDS, once=f"spend:{uuid.uuid4().hex}")
