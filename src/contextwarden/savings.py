"""What a trim saved: tokens removed and what they would have cost at the model's input price.

An estimate, always labelled so: tokens are our own counts corrected by the model's
calibration factor, and money is the input-price difference between the untrimmed and the
trimmed prompt (each at the price tier its size reaches), as if nothing were cached. Pure:
the filter passes the numbers in and carries the result to the outlet in `__metadata__`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal

from .pricing import ModelPrice

__all__ = ["Savings", "estimate_savings", "carried_savings"]


@dataclass(frozen=True, slots=True)
class Savings:
    """Tokens and input cost removed from one prompt (calibrated tokens; USD; None = unknown).

    `tokens_before`/`tokens_after` are the untrimmed and the sent prompt in the provider's
    tokens (our count × calibration factor, rounded).
    """

    tokens_before: int
    tokens_after: int
    cost_saved_usd: Decimal | None
    reason: str | None = None

    @property
    def tokens_saved(self) -> int:
        return self.tokens_before - self.tokens_after


def _calibrated_tokens(tokens: int, factor: float) -> int:
    """`tokens × factor`, rounded half-even to whole tokens (exact: factor as written)."""
    if factor == 1.0:
        return tokens
    return int((tokens * Decimal(repr(factor))).to_integral_value(rounding=ROUND_HALF_EVEN))


def estimate_savings(
    tokens_before: int, tokens_after: int, *, factor: float = 1.0, price: ModelPrice | None = None
) -> Savings:
    """What trimming a prompt from `tokens_before` to `tokens_after` (our counts) saved.

    Money: before × input rate of the tier `before` reaches − after × input rate of the tier
    `after` reaches; None (with a reason) when the model or its input price is unknown.

    Args:
        tokens_before: the untrimmed prompt, counted by our counter.
        tokens_after: the prompt sent (or, in shadow mode, that would have been sent).
        factor: the model's calibration factor (real / counted); 1.0 when not calibrated.
        price: the resolved model's price; None when unknown.

    Example:
        >>> estimate_savings(10_000, 2_000, price=ModelPrice(Decimal("0.0000025"), Decimal("0.00001")))
        Savings(tokens_before=10000, tokens_after=2000, cost_saved_usd=Decimal('0.0200000'), reason=None)
    """
    before = _calibrated_tokens(max(0, tokens_before), factor)
    after = min(before, _calibrated_tokens(max(0, tokens_after), factor))
    if before == after:
        return Savings(before, after, Decimal(0))
    if price is None:
        return Savings(before, after, None, "no price for this model")
    rate_before, rate_after = price.rates_for(before).prompt, price.rates_for(after).prompt
    if rate_before is None or rate_after is None:
        return Savings(before, after, None, "input price unknown")
    return Savings(before, after, max(Decimal(0), before * rate_before - after * rate_after))


def carried_savings(note: Mapping, message_count: int, *, chained: bool) -> tuple[int, int]:
    """(tokens already removed earlier this turn, message count of the untrimmed chat).

    Open WebUI may call the filter several times a turn (inlet, then request before each
    provider call). When a later pass works on what an earlier pass sent (`chained`: enforce
    mode, and fewer messages than the earlier pass saw), what that pass removed still counts;
    otherwise (shadow mode, or a fresh body) this pass's numbers replace the earlier ones.

    Example:
        >>> carried_savings({"removed": 900, "messages_before": 40}, 12, chained=True)
        (900, 40)
    """
    removed, seen = note.get("removed"), note.get("messages_before")
    if not chained or not isinstance(removed, int) or not isinstance(seen, int) or message_count >= seen:
        return 0, message_count
    return removed, seen
