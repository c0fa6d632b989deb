"""How dollar amounts read wherever people see them (status lines, `!usage`, the command line's
tables and HTML report): one rule, so `$0.0000071` or `0.000007` never show. CSV and JSON keep
exact amounts.

The rule: cents from $1 up (`$12.35`); below $1 two significant digits but never finer than a
hundredth of a cent (`$0.0031`, `$0.054`, `$0.0005`); a positive amount below that is
`<$0.0001`; zero is `$0`.
"""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal

__all__ = ["SMALLEST_SHOWN_USD", "format_usd", "usd"]

SMALLEST_SHOWN_USD = Decimal("0.0001")  # a hundredth of a cent: finer digits are noise to a reader
# Beyond these an amount is shown in scientific notation, never a million digits.
_USD_PLAIN_RANGE = (Decimal("1e-12"), Decimal("1e12"))


def format_usd(amount: Decimal | None) -> str:
    """An amount of dollars without the sign, by the rule above (for table columns headed USD).
    Total: None, NaN and infinities give "?"; amounts of 1e12 and more scientific notation.

    Example:
        >>> [format_usd(Decimal(a)) for a in ("0.003125", "12.3456", "0.00054", "0.0000071", "0", "1e30")]
        ['0.0031', '12.35', '0.0005', '<0.0001', '0', '1.0E+30']
        >>> [format_usd(Decimal(a)) for a in ("0.0995", "0.00996", "0.995", "0.00099996")]
        ['0.10', '0.010', '1.00', '0.0010']
    """
    if not isinstance(amount, Decimal) or not amount.is_finite():
        return "?"
    if amount == 0:
        return "0"
    if amount < 0:
        return "-" + format_usd(-amount)
    if amount < SMALLEST_SHOWN_USD:
        return f"<{SMALLEST_SHOWN_USD}"
    if amount >= _USD_PLAIN_RANGE[1]:
        return format(amount, ".1E")
    if amount >= 1:
        return f"{amount.quantize(Decimal('0.01'), rounding=ROUND_HALF_UP):,}"
    shown = _two_digits(amount, amount.adjusted())
    if shown.adjusted() > amount.adjusted():  # rounding carried into a new digit: 0.0995 -> 0.10, not 0.100
        if shown >= 1:
            return f"{shown.quantize(Decimal('0.01')):,}"
        shown = _two_digits(shown, shown.adjusted())
    return format(shown, "f")


def _two_digits(amount: Decimal, leading: int) -> Decimal:
    """`amount` to two significant digits below a leading digit at `leading`, never past the smallest shown."""
    step = max(leading - 1, SMALLEST_SHOWN_USD.adjusted())
    return amount.quantize(Decimal(1).scaleb(step), rounding=ROUND_HALF_UP)


def usd(amount: Decimal | None) -> str:
    """An amount with its dollar sign where a reader expects it: `$0.0031`, `<$0.0001`, `-$0.50`.

    Example:
        >>> usd(Decimal("0.0073")), usd(Decimal("0.0000071")), usd(Decimal("-0.5")), usd(None)
        ('$0.0073', '<$0.0001', '-$0.50', '$?')
    """
    text = format_usd(amount)
    sign = text[0] if text[0] in "-<" else ""
    if text.startswith("-<"):
        sign = "-<"
    return f"{sign}${text[len(sign) :]}"
