"""The status lines above a reply: what a turn sent (or, in shadow mode, would have sent) and
what the reply cost. Pure formatting of numbers the filter computed; no message text.
"""

from __future__ import annotations

from decimal import Decimal  # noqa: F401  (the doctests use it)

from .flags import Flags
from .money import usd
from .records import TurnChoice
from .savings import Savings
from .usage import Cost, Usage

__all__ = [
    "ESTIMATE_KEY",
    "PENDING_KEY",
    "pending_line",
    "status_line",
    "shadow_status_line",
    "usage_status",
    "savings_status",
]


def _count_text(count: object, mark: str = "") -> str:
    """A token count with thousands separators; "?" for anything but a plausible count."""
    if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count < 10**15:
        return "?"
    return f"{mark}{count:,}"


# Said once, at the end of a usage line whose numbers carry `~`, so nobody has to guess.
ESTIMATE_KEY = "~ = estimated, no usage from the provider"


def usage_status(
    usage: Usage, estimated: bool, cost: Cost, show_cost: bool, savings: Savings | None = None, shadow: bool = False
) -> str:
    """`1,234 tokens in (980 cached) · 456 out · $0.0031 · saved about $0.0054 vs untrimmed`;
    counted here when the provider sent no usage: `~` marks those numbers and the line says so
    last (`ESTIMATE_KEY`). No $ when the price is unknown; savings as `savings_status` words them.

    Example:
        >>> usage_status(Usage(2_974, 7), True, Cost(Decimal("0.0075"), "price_table"), True)
        '~2,974 tokens in · ~7 out · ~$0.0075 · ~ = estimated, no usage from the provider'
    """
    mark = "~" if estimated else ""

    line = f"{_count_text(usage.prompt_tokens, mark)} tokens in"
    if usage.cached_tokens:
        line += f" ({_count_text(usage.cached_tokens)} cached)"
    line += f" · {_count_text(usage.completion_tokens, mark)} out"
    if show_cost and cost.cost_usd is not None:
        line += f" · {mark}{usd(cost.cost_usd)}"
    if show_cost and savings is not None:
        line += savings_status(savings, shadow)
    return line + (f" · {ESTIMATE_KEY}" if estimated else "")


def savings_status(savings: Savings, shadow: bool) -> str:
    """` · saved about $0.0054 vs untrimmed` (shadow: `would save`), or, when the untrimmed chat
    would have cost less (its prompt cache outweighs what the trim removed),
    ` · untrimmed about $0.019 cheaper (prompt cache)`; "" when nothing was trimmed or the price
    is unknown. A saving is always an estimate (of a chat never sent): "about" says so in words.

    Example:
        >>> savings_status(Savings(26_000, 8_000, Decimal("-0.01875")), False)
        ' · untrimmed about $0.019 cheaper (prompt cache)'
    """
    amount = savings.cost_saved_usd
    if amount is None or amount == 0 or savings.tokens_saved <= 0:
        return ""
    if amount > 0:
        return f" · {'would save' if shadow else 'saved'} about {usd(amount)} vs untrimmed"
    return f" · untrimmed about {usd(-amount)} cheaper (prompt cache)"


def _fits(choice: TurnChoice) -> str:
    """`fits 8,000` for a chat sent whole within its budget; `budget 8,000` when even that is over
    (the extras then say `still over budget`): never both."""
    fits = not choice.over_budget and choice.tokens_after <= choice.budget
    return f"{'fits' if fits else 'budget'} {choice.budget:,}"


def status_line(choice: TurnChoice, flags: Flags) -> str:
    """`Context 142 → 38 messages · 96,210 → 7,950 tokens`, or `(fits N)` when nothing was cut."""
    after = len(choice.messages)
    if choice.full:
        line = (
            f"Context {after:,} messages · {choice.tokens_after:,} tokens (not trimmed: !full; budget "
            f"{choice.budget:,})"
        )
    elif choice.count_before != after or choice.tokens_before != choice.tokens_after:
        counts = f"{choice.count_before:,} → {_messages(after)}" if choice.count_before != after else _messages(after)
        line = f"Context {counts} · {choice.tokens_before:,} → {choice.tokens_after:,} tokens"
    else:
        line = f"Context {_messages(after)} · {choice.tokens_after:,} tokens ({_fits(choice)})"
    return line + _status_extras(choice, flags)


def _messages(count: int) -> str:
    return f"{count:,} message" if count == 1 else f"{count:,} messages"


# The turn note's key for the inlet's context line, not yet shown: Open WebUI 0.12 calls
# `request` after `inlet`, with the tool definitions and RAG added, and that pass's line is the
# turn's; a status cannot be edited, so the inlet says nothing and the first pass after it does.
PENDING_KEY = "pending_line"
_LINE_STARTS = ("Context ", "Shadow: ")


def pending_line(note: dict) -> str | None:
    """The inlet's context line that no later pass showed (an Open WebUI without the request
    hook), for the outlet to show once; None when there is none or it is not this filter's
    (outlet input can be user-controlled)."""
    line = note.get(PENDING_KEY)
    if isinstance(line, str) and line.startswith(_LINE_STARTS) and len(line) <= 1_000 and "\n" not in line:
        return line
    return None


def excerpt_words(documents: int, passages: tuple[int, int]) -> str:
    """What a user reads when long messages went out cut: the model did not see all of them.

    Example:
        >>> excerpt_words(1, (3, 24)), excerpt_words(2, (7, 41))
        ('document excerpted: 3 of 24 passages', '2 documents excerpted: 7 of 41 passages')
    """
    what = "document excerpted" if documents == 1 else f"{documents} documents excerpted"
    sent, total = passages
    return f"{what}: {sent:,} of {total:,} passages" if total else what


def _status_extras(choice: TurnChoice, flags: Flags) -> str:
    """The notes both lines share: summary, shortened, over budget, estimate, flags."""
    line = ""
    if choice.fixed_tokens:
        line += f" · incl. {choice.fixed_tokens:,} for {choice.fixed_label}"
        if choice.fixed_over:
            line += " (alone over the budget: only the system prompt and this turn sent)"
    if choice.summarized:
        line += " · earlier messages summarized"
    if choice.shortened:
        line += f" · {choice.shortened} shortened"
    if choice.excerpted:
        line += " · " + excerpt_words(choice.excerpted, choice.passages)
    if choice.pins_shortened:
        line += " · pinned messages shortened to fit"
    if (choice.over_budget or choice.tokens_after > choice.budget) and not choice.full:
        line += " · still over budget"
    if choice.count_mode == "estimate":
        line += " · estimated (tokenizer not loaded)"
    if flags.used:
        line += " · flags " + " ".join(flags.used)
    if flags.refused:
        line += " · not enabled: " + " ".join(flags.refused)
    return line


def shadow_status_line(choice: TurnChoice, flags: Flags, savings: Savings, show_cost: bool) -> str:
    """`Shadow: would send 38 of 142 messages · 96,210 → 7,950 tokens, saving about $0.22`: what
    enforce mode would have done; the chat itself went out unchanged. Money is an estimate ("about").

    Example:
        >>> shadow_status_line(TurnChoice([{}] * 38, 142, 96_210, 7_950, 8_000, "exact"), Flags(),
        ...     Savings(96_210, 7_950, Decimal("0.2206")), True)
        'Shadow: would send 38 of 142 messages · 96,210 → 7,950 tokens, saving about $0.22'
    """
    after = len(choice.messages)
    if choice.full:
        line = (
            f"Shadow: !full, would send all {after:,} messages · {choice.tokens_after:,} tokens (budget "
            f"{choice.budget:,})"
        )
    elif choice.count_before != after or choice.tokens_before != choice.tokens_after:
        counts = f"{after:,} of {choice.count_before:,} messages" if choice.count_before != after else _messages(after)
        line = f"Shadow: would send {counts} · {choice.tokens_before:,} → {choice.tokens_after:,} tokens"
        if show_cost and savings.cost_saved_usd:
            amount = savings.cost_saved_usd
            line += (
                f", saving about {usd(amount)}"
                if amount > 0
                else f" · untrimmed about {usd(-amount)} cheaper (prompt cache)"
            )
    else:
        line = f"Shadow: would send all {after:,} messages · {choice.tokens_after:,} tokens ({_fits(choice)})"
    return line + _status_extras(choice, flags)
