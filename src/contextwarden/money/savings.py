"""What a trim saved: tokens removed and the input cost difference, with the provider's prompt cache.

An estimate, always labelled so. Tokens are our own counts corrected by the model's
calibration factor. Money is the input cost of the untrimmed prompt minus that of the sent one,
each at the price tier its size reaches, and each with its cached part at the model's
cache-read price (and cache writes at the write price) when the model caches: the side that
really went out with what the backend reported, the other side as `SAVINGS_ASSUMPTION` says.
A trim that breaks the cache can cost more than sending everything: savings are then negative.
Pure: the filter passes the numbers in and carries the result to the outlet in `__metadata__`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal

from ..core.conversation import Message, latest_question, message_text
from ..core.tokens import TOKENS_PER_REPLY
from ..core.trim import SHORTENED_MARK
from .pricing import ModelPrice
from .usage import Usage

__all__ = [
    "SAVINGS_ASSUMPTION",
    "Savings",
    "PromptCache",
    "estimate_savings",
    "carried_savings",
    "loop_length",
    "carries_a_cut",
    "calibrated_tokens",
    "previous_prompt_end",
    "cached_prefixes",
    "price_caches",
    "predicted_cache",
    "reply_savings",
]

SAVINGS_ASSUMPTION = (
    "savings are estimates, cache-aware: cached tokens at the cache-read price; the untrimmed chat "
    "is assumed to have its previous prompt cached, the trimmed one its reused prefix, when the model caches"
)


@dataclass(frozen=True, slots=True)
class PromptCache:
    """How much of one prompt the provider's cache serves (`cached`) and stores (`written`), in provider tokens."""

    cached: int = 0
    written: int = 0


@dataclass(frozen=True, slots=True)
class Savings:
    """Tokens and input cost removed from one prompt (calibrated tokens; USD; None = unknown).

    `tokens_before`/`tokens_after` are the untrimmed and the sent prompt in the provider's
    tokens (our count × calibration factor, rounded); `cached_before`/`cached_after` how much
    of each the cache serves. `cost_saved_usd` is negative when the untrimmed chat would have
    been cheaper (its cached prefix outweighs the tokens removed).
    """

    tokens_before: int
    tokens_after: int
    cost_saved_usd: Decimal | None
    reason: str | None = None
    cached_before: int = 0
    cached_after: int = 0

    @property
    def tokens_saved(self) -> int:
        return self.tokens_before - self.tokens_after


def calibrated_tokens(tokens: int, factor: float) -> int:
    """`tokens × factor`, rounded half-even to whole tokens (exact: factor as written)."""
    if factor == 1.0:
        return tokens
    return int((tokens * Decimal(repr(factor))).to_integral_value(rounding=ROUND_HALF_EVEN))


def price_caches(price: ModelPrice | None) -> bool:
    """True when the model's price lists a cache-read rate below its input rate (240 of the 414 bundled)."""
    return (
        price is not None
        and price.prompt is not None
        and price.cache_read is not None
        and 0 < price.cache_read < price.prompt
    )


def _input_cost(tokens: int, cache: PromptCache, price: ModelPrice, tier: int | None = None) -> Decimal | None:
    """Input cost of a prompt: uncached at the input rate, cached at the read rate, written at the
    write rate (the input rate where no write rate is listed), at the tier `tier` tokens reach
    (default `tokens`); None when the input rate is unknown."""
    rates = price.rates_for(tokens if tier is None else tier)
    if rates.prompt is None:
        return None
    cached = min(max(0, cache.cached), tokens) if price_caches(price) else 0
    written = min(max(0, cache.written), tokens - cached)
    read = rates.cache_read if rates.cache_read is not None else rates.prompt
    write = rates.cache_write if rates.cache_write else rates.prompt
    return (tokens - cached - written) * rates.prompt + cached * read + written * write


def estimate_savings(
    tokens_before: int,
    tokens_after: int,
    *,
    factor: float = 1.0,
    price: ModelPrice | None = None,
    cache_before: PromptCache = PromptCache(),
    cache_after: PromptCache = PromptCache(),
    tiers: tuple[int | None, int | None] = (None, None),
) -> Savings:
    """What trimming a prompt from `tokens_before` to `tokens_after` (our counts) saved.

    Money: the untrimmed prompt's input cost (at the tier `before` reaches, `cache_before` of it
    served or written by the cache) − the sent prompt's (likewise); negative when the untrimmed
    one is cheaper; None (with a reason) when the model or its input price is unknown.

    Args:
        tokens_before: the untrimmed prompt, counted by our counter.
        tokens_after: the prompt sent (or, in shadow mode, that would have been sent).
        factor: the model's calibration factor (real / counted); 1.0 when not calibrated.
        price: the resolved model's price; None when unknown.
        cache_before, cache_after: each prompt's cached and written tokens (provider tokens);
            counted only for a model whose price lists a cache-read rate.
        tiers: the prompt sizes that pick each side's price tier (provider tokens; None: its own
            size). A tool loop's summed prompt reaches a tier none of its calls did.

    Example:
        >>> gpt4o = ModelPrice(Decimal("0.0000025"), Decimal("0.00001"), cache_read=Decimal("0.00000125"))
        >>> estimate_savings(10_000, 2_000, price=gpt4o).cost_saved_usd
        Decimal('0.02000000')
        >>> estimate_savings(10_000, 2_000, price=gpt4o, cache_before=PromptCache(9_000)).cost_saved_usd
        Decimal('0.00875000')
    """
    before = calibrated_tokens(max(0, tokens_before), factor)
    after = min(before, calibrated_tokens(max(0, tokens_after), factor))
    cached = (min(cache_before.cached, before), min(cache_after.cached, after))
    if before == after:
        return Savings(before, after, Decimal(0), None, *cached)
    if price is None:
        return Savings(before, after, None, "no price for this model", *cached)
    cost_before = _input_cost(before, cache_before, price, tiers[0])
    cost_after = _input_cost(after, cache_after, price, tiers[1])
    if cost_before is None or cost_after is None:
        return Savings(before, after, None, "input price unknown", *cached)
    return Savings(before, after, cost_before - cost_after, None, *cached)


def predicted_cache(tokens: int, prefix: int, price: ModelPrice | None, *, caches: bool, minimum: int) -> PromptCache:
    """The cache a prompt of `tokens` would meet when its first `prefix` tokens were sent the
    turn before: nothing unless the model caches and the prefix reaches `minimum`; where the
    provider bills writes above the input rate (Anthropic), the rest is written.

    Example:
        >>> sonnet = ModelPrice(Decimal("0.000003"), Decimal("0.000015"), Decimal("0.0000003"), Decimal("0.00000375"))
        >>> predicted_cache(26_000, 25_000, sonnet, caches=True, minimum=1_024)
        PromptCache(cached=25000, written=1000)
    """
    if not caches or prefix < minimum or not price_caches(price):
        return PromptCache()
    cached = min(prefix, tokens)
    writes = (
        price is not None
        and price.cache_write is not None
        and price.prompt is not None
        and price.cache_write > price.prompt
    )
    return PromptCache(cached, tokens - cached if writes else 0)


def reply_savings(
    usage: Usage,
    *,
    shadow: bool,
    tokens_saved: int,
    other_prefix: int,
    price: ModelPrice | None,
    caches: bool,
    minimum: int,
    sent_prefix: int = 0,
) -> Savings:
    """Savings of one reply, priced after the backend reported what its cache served.

    The prompt that went out (the trimmed one; in shadow mode the untrimmed one) is priced with
    the reported cached and written tokens; the other with `predicted_cache` of its
    `other_prefix` (the untrimmed chat's previous prompt, or the trimmed chat's reused prefix),
    writing the rest when this reply wrote to the cache. A tool loop's reply (counts summed over
    its calls) is priced by `_loop_savings`.

    Args:
        usage: the reply's usage (billed: reported, or estimated where the backend said nothing).
        shadow: the untrimmed chat went out (shadow mode).
        tokens_saved: tokens the trim removed (calibrated, as the request hook noted).
        other_prefix: the cached prefix assumed for the prompt that did not go out (provider tokens).
        sent_prefix: the one assumed for the prompt that went out (read for a tool loop only).
        caches: the model caches (reported this reply, learned, or expected from its price).
        minimum: the model's minimum cacheable prefix.
    """
    sent = max(0, usage.prompt_tokens or 0)
    reported = PromptCache(usage.cached_tokens or 0, usage.cache_write_tokens or 0)
    other_tokens = max(0, sent - tokens_saved) if shadow else sent + max(0, tokens_saved)
    other = predicted_cache(other_tokens, other_prefix, price, caches=caches, minimum=minimum)
    if usage.calls_summed:
        mine = predicted_cache(sent, sent_prefix, price, caches=caches, minimum=minimum)
        return _loop_savings(usage, reported, other_tokens, other.cached - mine.cached, shadow, tokens_saved, price)
    if reported.written > 0 and other.written == 0:
        other = PromptCache(other.cached, other_tokens - other.cached)
    if shadow:
        return estimate_savings(sent, other_tokens, price=price, cache_before=reported, cache_after=other)
    return estimate_savings(other_tokens, sent, price=price, cache_before=other, cache_after=reported)


def _loop_savings(
    usage: Usage,
    reported: PromptCache,
    other_tokens: int,
    moved: int,
    shadow: bool,
    tokens_saved: int,
    price: ModelPrice | None,
) -> Savings:
    """A tool loop's savings: its counts are sums over its calls (cached ones too), so the other
    prompt's cache is the reported one, `moved` by what its first call's prefix would have held
    more (or less), not a single call's prefix set against N calls' hits (which claimed more than
    the removed tokens were worth); each side at the tier of its last call, as `compute_cost`
    prices it; the tokens removed counted once (what the later calls saved too is not claimed)."""
    cached = min(max(0, reported.cached + moved), other_tokens)
    other = PromptCache(cached, min(reported.written, other_tokens - cached))
    last = usage.last_call_prompt
    other_last = None if last is None else (max(0, last - tokens_saved) if shadow else last + max(0, tokens_saved))
    sent = max(0, usage.prompt_tokens or 0)
    if shadow:
        return estimate_savings(
            sent, other_tokens, price=price, cache_before=reported, cache_after=other, tiers=(last, other_last)
        )
    return estimate_savings(
        other_tokens, sent, price=price, cache_before=other, cache_after=reported, tiers=(other_last, last)
    )


_CUT_TEXT = SHORTENED_MARK.split("}", 1)[1]  # " tokens cut by contextwarden …]"


def carries_a_cut(messages: Sequence[Message]) -> bool:
    """Whether a chat holds a copy an earlier pass shortened (its marker): then this pass works on
    what that pass sent, although no message was dropped (a pasted document cut, 1 → 1 message)."""
    return any(_CUT_TEXT in message_text(m) for m in messages if isinstance(m, dict))


def loop_length(messages: Sequence[Message]) -> int:
    """How many of `messages` follow the latest question: the turn's tool loop so far, which
    each call of the loop sends after what the turn's first call sent (none on a first pass).

    Example:
        >>> loop_length([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": []}])
        1
    """
    question = latest_question(messages)
    return 0 if question is None else len(messages) - 1 - question


def carried_savings(note: Mapping, messages: Sequence[Message], *, chained: bool) -> tuple[int, int]:
    """(tokens already removed earlier this turn, message count of the untrimmed chat, its
    tool loop aside: `loop_length`), for a pass that sees `messages`.

    Open WebUI may call the filter several times a turn (inlet, then request before each
    provider call). When a later pass works on what an earlier pass sent (`chained`: enforce
    mode, and fewer messages than the earlier pass saw, or a copy it shortened: `carries_a_cut`,
    read only when the earlier pass removed something), what that pass removed still counts;
    otherwise (shadow mode, or a fresh body) this pass's numbers replace the earlier ones.

    Example:
        >>> carried_savings({"removed": 900, "messages_before": 40}, [{"role": "user"}] * 12, chained=True)
        (900, 40)

    A tool loop's calls are not the chat's: counted as its messages, a chat sent as 14 of 22
    with four calls made looked whole, and the earlier pass's savings were dropped.
    """
    count = len(messages) - loop_length(messages)
    removed, seen = note.get("removed"), note.get("messages_before")
    if not chained or not isinstance(removed, int) or not isinstance(seen, int):
        return 0, count
    if count >= seen and not (removed > 0 and carries_a_cut(messages)):
        return 0, count
    return removed, seen


def previous_prompt_end(messages: Sequence[Message]) -> int | None:
    """Where the chat's previous prompt ended: the index of the last assistant message before the
    latest user message (the previous reply, which that prompt did not hold); None on a first turn.

    Example:
        >>> previous_prompt_end([{"role": "user"}, {"role": "assistant"}, {"role": "user"}])
        1
    """
    latest = latest_question(messages)
    if latest is None:
        return None
    return next((i for i in range(latest - 1, -1, -1) if messages[i].get("role") == "assistant"), None)


def cached_prefixes(
    messages: Sequence[Message],
    sent: Sequence[Message],
    untrimmed_tokens: int,
    sent_tokens: int,
    reused: bool,
    count_each: Callable[[Sequence[Message]], list[int]],
) -> tuple[int, int]:
    """(untrimmed, sent) prefix tokens, our counts, that the previous turn's prompt shares with
    each prompt: the untrimmed chat's previous prompt (all but the newest reply and turn); for the
    sent prompt, when the previous selection was reused, what it sends before the newest reply
    (wherever that is: a per-turn block before the question is not counted), else only its
    leading system messages. Prompts count their reply priming; prefixes do not.

    Args:
        messages: the untrimmed chat; sent: what was (or would be) sent.
        untrimmed_tokens, sent_tokens: their prompt tokens (`count_messages`).
        reused: the trim kept the previous turn's selection (`TrimResult.reused`).
        count_each: the token counter's `count_each` for the model.
    """
    end = previous_prompt_end(messages)
    if end is None:
        return 0, 0
    tail = messages[end:]
    tail_tokens = sum(count_each(tail))
    untrimmed = max(0, untrimmed_tokens - TOKENS_PER_REPLY - tail_tokens)
    reply = messages[end]
    at = next((k for k in range(len(sent) - 1, -1, -1) if sent[k] is reply), None) if reused else None
    if at is not None:
        return untrimmed, max(0, sent_tokens - TOKENS_PER_REPLY - sum(count_each(sent[at:])))
    leading = next((i for i, m in enumerate(sent) if m.get("role") != "system"), len(sent))
    return untrimmed, sum(count_each(sent[:leading]))
