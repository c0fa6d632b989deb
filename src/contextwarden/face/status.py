"""The status line above a reply, one a turn: what the model saw (or, in shadow mode, would have
seen), what the reply used and cost; and the admin's detail of each pass, for the log. Pure
formatting of numbers the filter computed; no message text.
"""

from __future__ import annotations

from decimal import Decimal

from ..core.flags import Flags
from ..money.dollars import usd
from ..money.records import TurnChoice
from ..money.savings import Savings
from ..money.usage import Cost, Estimated, Usage

__all__ = [
    "DETAIL_KEY",
    "ESTIMATE_KEY",
    "PART_ESTIMATE_KEY",
    "PENDING_KEY",
    "detail_line",
    "excerpt_words",
    "pending_detail",
    "pending_line",
    "status_line",
    "shadow_status_line",
    "small_window_text",
    "turn_line",
    "usage_status",
    "savings_status",
]


def _count_text(count: object, mark: str = "") -> str:
    """A token count with thousands separators; "?" for anything but a plausible count."""
    if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count < 10**15:
        return "?"
    return f"{mark}{count:,}"


# Said once, at the end of a usage line whose numbers carry `~`, so nobody has to guess; the
# second when the provider's usage held one count and not the other (the unmarked one is its).
ESTIMATE_KEY = "~ = estimated, no usage from the provider"
PART_ESTIMATE_KEY = "~ = estimated, the rest is the provider's"
PINS_DROPPED_WORDS = "pinned messages too long to keep them all"  # even cut, they were over the budget


def usage_status(
    usage: Usage,
    estimated: bool | Estimated,
    cost: Cost,
    show_cost: bool,
    savings: Savings | None = None,
    shadow: bool = False,
) -> str:
    """`1,234 tokens in (980 cached) · 456 out · $0.0031 · saved about $0.0054 vs untrimmed`;
    a count the provider did not give is counted here: `~` marks it (and the cost it makes) and
    the line says so last (`ESTIMATE_KEY`; `PART_ESTIMATE_KEY` when the other count is the
    provider's). `estimated` True = both counts. No $ when the price is unknown; savings as
    `savings_status` words them.

    Example:
        >>> usage_status(Usage(2_974, 7), True, Cost(Decimal("0.0075"), "price_table"), True)
        '~2,974 tokens in · ~7 out · ~$0.0075 · ~ = estimated, no usage from the provider'
        >>> usage_status(Usage(70, 3), Estimated(completion=True), Cost(None, None), True)
        "70 tokens in · ~3 out · ~ = estimated, the rest is the provider's"
    """
    marks = estimated if isinstance(estimated, Estimated) else Estimated(estimated, estimated)

    line = f"{_count_text(usage.prompt_tokens, '~' if marks.prompt else '')} tokens in"
    if usage.cached_tokens:
        line += f" ({_count_text(usage.cached_tokens)} cached)"
    line += f" · {_count_text(usage.completion_tokens, '~' if marks.completion else '')} out"
    if show_cost and cost.cost_usd is not None:
        line += f" · {_cost_text(cost.cost_usd, marks.any)}"
    if show_cost and savings is not None:
        line += savings_status(savings, shadow)
    if not marks.any:
        return line
    return f"{line} · {ESTIMATE_KEY if marks.all else PART_ESTIMATE_KEY}"


def _cost_text(amount: Decimal, estimated: bool) -> str:
    """`$0.0031`, estimated `~$0.0031`; an estimate below the smallest amount shown reads
    `under ~$0.0001` (`~<$0.0001` put two signs in a row).

    Example:
        >>> _cost_text(Decimal("0.0000071"), True), _cost_text(Decimal("0.0000071"), False)
        ('under ~$0.0001', '<$0.0001')
    """
    text = usd(amount)
    if not estimated:
        return text
    return f"under ~{text.removeprefix('<')}" if text.startswith("<") else f"~{text}"


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


def status_line(choice: TurnChoice, flags: Flags, sent: int | None = None) -> str:
    """What the model saw, as a person reads it at a glance and the same way every turn: `Whole
    chat sent`, or `Sent 5 of 9 messages`, and what went out cut. `sent` counts the chat's own
    messages sent (default: all in `choice`; the filter leaves out its recall blocks and summary
    note, and counts the messages a block quotes whole: the model reads them). No token counts,
    budget or tool definitions: those are the admin's (`detail_line`, logged, which names the
    messages recalled apart); the reply's real tokens and cost follow on the same line (`turn_line`).

    Example:
        >>> status_line(TurnChoice([{}] * 5, 9, 10_899, 3_278, 4_000, "exact"), Flags())
        'Sent 5 of 9 messages'
        >>> from contextwarden.money.records import ExcerptCounts
        >>> excerpted = TurnChoice([{}] * 3, 3, 5_648, 3_229, 4_000, "exact", excerpts=ExcerptCounts(1, (3, 24)))
        >>> status_line(excerpted, Flags())
        'Sent 3 messages, document excerpted: 3 of 24 passages'
        >>> status_line(TurnChoice([{}] * 4, 4, 900, 900, 4_000, "exact"), Flags())
        'Whole chat sent'
    """
    return _context_words(choice, flags, sent, shadow=False)


def shadow_status_line(choice: TurnChoice, flags: Flags, sent: int | None = None) -> str:
    """`status_line` for shadow mode, where the chat went out whole: what enforce would have sent.

    Example:
        >>> shadow_status_line(TurnChoice([{}] * 38, 142, 96_210, 7_950, 8_000, "exact"), Flags())
        'Shadow: would send 38 of 142 messages'
    """
    return _context_words(choice, flags, sent, shadow=True)


def _context_words(choice: TurnChoice, flags: Flags, sent: int | None, *, shadow: bool) -> str:
    before = choice.count_before
    sent = len(choice.messages) if sent is None else min(max(sent, 0), max(len(choice.messages), before))
    cuts = _cut_words(choice, sent)
    if choice.full or (sent >= before and not cuts):
        head = "would send the whole chat" if shadow else "Whole chat sent"
    elif sent < before:
        head = f"{'would send' if shadow else 'Sent'} {sent:,} of {_messages(before)}"
    else:
        head = f"{'would send' if shadow else 'Sent'} {_messages(sent)}"
    line = ("Shadow: " if shadow else "") + head + "".join(f", {cut}" for cut in cuts)
    return line + _over_words(choice) + _flag_words(flags)


def _over_words(choice: TurnChoice) -> str:
    """What a user reads when the prompt did not fit: ` · tool definitions fill the window` (the
    admin's window: they are told the fix), ` · over your budget: tool definitions alone fill it`
    when the budget is the user's own (`!budget=N`, their valve), ` · still over budget` (`still
    over your budget`) when what must go was over it even cut; "" when it fit or `!full` sent all.

    Example:
        >>> from dataclasses import replace
        >>> over = TurnChoice([{}] * 2, 11, 6_695, 3_244, 2_000, "exact", over_budget=True, fixed_tokens=3_214,
        ...                   fixed_label="tool definitions", fixed_over=True, own_budget=True)
        >>> _over_words(over), _over_words(replace(over, own_budget=False))
        (' · over your budget: tool definitions alone fill it', ' · tool definitions fill the window')
        >>> _over_words(replace(over, fixed_label="the response format"))
        ' · over your budget: the response format alone fills it'
        >>> _over_words(replace(over, fixed_over=False)), _over_words(replace(over, fixed_over=False, own_budget=False))
        (' · still over your budget', ' · still over budget')
    """
    if choice.full or not (choice.fixed_over or choice.over_budget or choice.tokens_after > choice.budget):
        return ""
    if not choice.fixed_over:
        return " · still over your budget" if choice.own_budget else " · still over budget"
    label = choice.fixed_label or "tool definitions"
    fill = "fills" if label == "the response format" else "fill"
    return f" · over your budget: {label} alone {fill} it" if choice.own_budget else f" · {label} {fill} the window"


def _flag_words(flags: Flags) -> str:
    """What the turn's flags did, for the end of a status line ("" when it had none): of a flag
    written twice, the value that acted (the last), once.

    Example:
        >>> _flag_words(Flags(budget=500, used=("!budget=900", "!pin", "!budget=500", "!+pin", "!-pin")))
        ' · flags !pin !budget=500 !-pin'
        >>> _flag_words(Flags(malformed=("!budget=2k",)))
        ' · not understood: !budget=2k'
    """
    acted: dict[str, str] = {}
    for token in flags.used:
        name = token.partition("=")[0].replace("+pin", "-pin")  # !+pin and !-pin: the last one wins
        acted.pop(name, None)
        acted[name] = token
    used = " · flags " + " ".join(acted.values()) if acted else ""
    refused = " · not enabled: " + " ".join(flags.refused) if flags.refused else ""
    return used + refused + (" · not understood: " + " ".join(flags.malformed) if flags.malformed else "")


def _cut_words(choice: TurnChoice, sent: int) -> list[str]:
    """What went out cut, in words: excerpted documents and those left out whole, shortened
    messages, a summary."""
    if choice.full:
        return []
    told = choice.excerpts.told
    cuts = [excerpt_words(*told)] if told[0] else []
    if choice.shortened:
        cuts.append("shortened to fit" if sent == choice.shortened == 1 else f"{choice.shortened:,} shortened to fit")
    if choice.pins_shortened:
        cuts.append("pinned messages shortened to fit")
    if choice.pins_dropped:
        cuts.append(PINS_DROPPED_WORDS)
    if choice.summarized:
        cuts.append("earlier messages summarized")
    return cuts


def detail_line(choice: TurnChoice, flags: Flags) -> str:
    """The admin's account of a pass, for the log: `Context 142 → 38 messages · 96,210 → 7,950
    tokens · incl. 3,214 for tool definitions · 12 recalled`, or `(fits N)` when nothing was cut.
    The messages count the prompt's; `recalled` the chat's quoted whole in its recall blocks."""
    after = len(choice.messages)
    if choice.full:
        line = (
            f"Context {_messages(after)} · {choice.tokens_after:,} tokens (not trimmed: !full; budget "
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


def turn_line(context: str | None, usage: str, spend: str = "", warning: str = "") -> str:
    """The turn's one status line, shown after the reply: a limit's warning first (Open WebUI
    shows one line and cuts a long one at its end), what the model saw, what the reply used
    and cost, the user's spend (each part only when there is one); the key to `~` last, after
    the spend too, so the line ends with it as the README says.

    Example:
        >>> turn_line("Sent 5 of 9 messages", "3,278 tokens in · 56 out · $0.0087")
        'Sent 5 of 9 messages · 3,278 tokens in · 56 out · $0.0087'
        >>> turn_line(None, f"~8 tokens in · ~3 out · {ESTIMATE_KEY}", "today $0.42 of $2.00")
        '~8 tokens in · ~3 out · today $0.42 of $2.00 · ~ = estimated, no usage from the provider'
        >>> turn_line("Whole chat sent", "80 tokens in · 5 out", "today $1.70 of $2.00", "85% of your daily limit")
        '85% of your daily limit · Whole chat sent · 80 tokens in · 5 out · today $1.70 of $2.00'
    """
    for key in (f" · {ESTIMATE_KEY}", f" · {PART_ESTIMATE_KEY}"):
        if spend and usage.endswith(key):
            usage, spend = usage.removesuffix(key), spend + key
    return " · ".join(part for part in (warning, context, usage, spend) if part)


# The turn note's keys for the words each pass leaves for the outlet: `PENDING_KEY` the plain
# words (`status_line`), `DETAIL_KEY` the admin's (`detail_line`, logged). A status costs Open
# WebUI a save into the chat and cannot be edited: the outlet shows one line a turn, after the
# reply, with what the last pass decided.
PENDING_KEY = "pending_line"
DETAIL_KEY = "line"
_LINE_STARTS = ("Whole chat sent", "Sent ", "Shadow: ")
_DETAIL_STARTS = ("Context ",)


def pending_line(note: dict) -> str | None:
    """The plain words the turn's last pass left for the outlet; None when there are none or
    they are not this filter's (outlet input can be user-controlled)."""
    return _noted_line(note, PENDING_KEY, _LINE_STARTS)


def pending_detail(note: dict) -> str | None:
    """The admin's words the turn's last pass left for the outlet to log (as `pending_line` checks them)."""
    return _noted_line(note, DETAIL_KEY, _DETAIL_STARTS)


def _noted_line(note: dict, key: str, starts: tuple[str, ...]) -> str | None:
    line = note.get(key)
    if isinstance(line, str) and line.startswith(starts) and len(line) <= 1_000 and "\n" not in line:
        return line
    return None


def excerpt_words(documents: int, passages: tuple[int, int], left_out: int = 0, kind: str = "document") -> str:
    """What a user reads when long messages went out cut: the model did not see all of them.
    `passages` counts those sent in part (sent, in all); `left_out` those none of whose
    passages went (each only its cut mark: too large for the room left) or dropped whole
    (`ExcerptCounts.told`), which the model did not see at all: `left out`, not `0 of 2
    passages`. `kind` names them (`records.EXCERPT_KINDS`).

    Example:
        >>> excerpt_words(1, (3, 24)), excerpt_words(2, (7, 41))
        ('document excerpted: 3 of 24 passages', '2 documents excerpted: 7 of 41 passages')
        >>> excerpt_words(1, (0, 0), 1), excerpt_words(2, (0, 0), 2)
        ('document left out', '2 documents left out')
        >>> excerpt_words(2, (1, 9), 1)
        'document excerpted: 1 of 9 passages, 1 left out'
        >>> excerpt_words(1, (2, 6), 0, "tool result"), excerpt_words(2, (0, 0), 2, "long message")
        ('tool result excerpted: 2 of 6 passages', '2 long messages left out')
    """
    sent, total = passages
    excerpted = documents - left_out
    if excerpted <= 0 or (total and not sent):  # (a note written before `left_out`: one summed pair)
        return f"{kind} left out" if documents == 1 else f"{documents:,} {kind}s left out"
    what = f"{kind} excerpted" if excerpted == 1 else f"{excerpted:,} {kind}s excerpted"
    words = f"{what}: {sent:,} of {total:,} passages" if total else what
    return words + (f", {left_out:,} left out" if left_out else "")


def _status_extras(choice: TurnChoice, flags: Flags) -> str:
    """The admin's notes on a pass: the fixed part, summary, cuts, over budget, estimate, flags."""
    line = ""
    if choice.fixed_tokens:
        line += f" · incl. {choice.fixed_tokens:,} for {choice.fixed_label}"
        if choice.fixed_over:
            line += " (alone over the budget: only what must go sent: the system prompt, pins and this turn)"
    if choice.summarized:
        line += " · earlier messages summarized"
    if choice.shortened:
        line += f" · {choice.shortened} shortened"
    if choice.quoted:  # the chat's messages the model read whole in a recall block (the user's line counts them)
        line += f" · {choice.quoted} recalled"
    if (told := choice.excerpts.told)[0]:
        line += " · " + excerpt_words(*told)
    if choice.pins_shortened:
        line += " · pinned messages shortened to fit"
    if choice.pins_dropped:
        line += " · " + PINS_DROPPED_WORDS
    if (choice.over_budget or choice.tokens_after > choice.budget) and not choice.full:
        line += " · still over budget"
    if choice.count_mode == "estimate":
        line += " · estimated (tokenizer not loaded)"
    return line + _flag_words(flags)


def small_window_text(model: str, tools: int, tokens: int, window: int, reserved: int, *, over: bool, need: int) -> str:
    """The admin's notice of a window that Open WebUI's tool definitions (nearly) fill on their
    own: the numbers, what it does to every chat, and the two fixes (`need`: a window to raise
    it to). Numbers and the model id only.

    Example:
        >>> print(small_window_text("gpt-4o", 30, 3_214, 3_000, 300, over=True, need=8_000))
        gpt-4o's window is too small for its tools: 3,000 tokens, 300 kept for the reply, and the \
30 tool definitions Open WebUI adds to each chat take 3,214: every turn sends only the system prompt \
and the latest message. Raise max_context_tokens to 8,000 or more, or turn off Builtin Tools in this \
model's capabilities (Admin Panel > Settings > Models).
        >>> "the tool definition Open WebUI adds to each chat takes 900" in small_window_text(
        ...     "m", 1, 900, 1_000, 300, over=True, need=2_000)
        True
    """
    left = window - reserved - tokens
    effect = (
        "every turn sends only the system prompt and the latest message"
        if over
        else f"{left:,} tokens are left for the chat itself"
    )
    definitions = (
        "the tool definition" if tools == 1 else f"the {tools:,} tool definitions" if tools else "the tool definitions"
    )
    return (
        f"{model[:100]}'s window is too small for its tools: {window:,} tokens, {reserved:,} kept for the "
        f"reply, and {definitions} Open WebUI adds to each chat {'takes' if tools == 1 else 'take'} {tokens:,}: "
        f"{effect}. Raise "
        f"max_context_tokens to {need:,} or more, or turn off Builtin Tools in this model's capabilities "
        "(Admin Panel > Settings > Models)."
    )
