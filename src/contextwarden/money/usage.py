"""Usage and cost of one reply: the real token counts in an Open WebUI outlet message, read
for every backend shape (missing = unknown, never 0), and their price in Decimal USD."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from decimal import Decimal, localcontext

from .pricing import ModelPrice, PriceTier, read_decimal

__all__ = [
    "MAX_TOKEN_COUNT",
    "MAX_REPLY_COST_USD",
    "ESTIMATE_SHAPE",
    "Usage",
    "Estimated",
    "Cost",
    "read_count",
    "read_cost",
    "read_usage",
    "normalize_usage",
    "with_counts",
    "compute_cost",
]

# What the outlet believes (its input is the client's: POST /api/chat/completed): a count or
# cost outside these is unknown, and the turn is estimated instead. Each bound in one place.
MAX_TOKEN_COUNT = 1_000_000_000  # per reply and field; real windows are at most a few million
MAX_REPLY_COST_USD = Decimal(1000)  # per reply; the dearest real replies cost a few dollars
ESTIMATE_SHAPE = "estimate"  # `Usage.shape` of a reply's usage counted by contextwarden, not read
_MAX_COUNT_CHARS = 12
_COUNT_TEXT = re.compile(r"[0-9]{1,10}")
# Token counts times prices with up to ~25 significant digits: compute exactly, no rounding.
_COST_PRECISION = 80
_ANTHROPIC_KEYS = ("cache_read_input_tokens", "cache_creation_input_tokens")
# Anthropic's own usage never has these; LiteLLM's OpenAI-shaped usage has them beside the above.
_OPENAI_PROMPT_KEYS = ("prompt_tokens", "prompt_tokens_details")


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one reply, normalized to OpenAI's meaning. None = not reported.

    `prompt_tokens` includes cached and cache-write tokens; `completion_tokens` includes
    reasoning tokens. `provider_cost` is what the provider said it charged (USD). `shape`
    names the format read: openai, openrouter, gemini, anthropic, openai_responses,
    gemini_native, ollama, open_webui. `calls_summed` is True when Open WebUI added up several
    provider calls (a tool loop) and the counts are those sums; `last_call_prompt` is then the
    last call's prompt (the longest: each call sends the results before it), whose size picks
    the price tier rather than the sum's.
    """

    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None = None
    cache_write_tokens: int | None = None
    reasoning_tokens: int | None = None
    total_tokens: int | None = None
    provider_cost: Decimal | None = None
    shape: str = "openai"
    calls_summed: bool = False
    last_call_prompt: int | None = None  # summed: the last (longest) call's prompt, which picks a price tier
    cache_write_1h_tokens: int | None = None  # of `cache_write_tokens`, those written for an hour (Anthropic)


@dataclass(frozen=True, slots=True)
class Estimated:
    """Which of a reply's two counts contextwarden counted itself: the backend's usage left it
    out, or held nothing believable there. False (the default) = the backend's own count."""

    prompt: bool = False
    completion: bool = False

    @property
    def any(self) -> bool:
        """True when either count, and so the cost, is an estimate."""
        return self.prompt or self.completion

    @property
    def all(self) -> bool:
        """True when both counts are estimates (the backend sent no usage to read)."""
        return self.prompt and self.completion


@dataclass(frozen=True, slots=True)
class Cost:
    """What one reply cost. `cost_usd` None = unknown (see `reason`), never a guessed 0.

    `cost_source` is "provider" (the backend's own figure), "price_table" (usage x price) or
    None; `tier` is the prompt-size tier applied (0 = base prices).
    """

    cost_usd: Decimal | None
    cost_source: str | None
    reason: str | None = None
    tier: int = 0
    notes: tuple[str, ...] = ()


def read_count(raw: object) -> int | None:
    """A token count from 0 to MAX_TOKEN_COUNT (an int, a whole float or ASCII digit text), else
    None. Bools, Unicode digits ("²", "١٢"), "1_000", NaN and larger values are refused before
    any conversion: outlet input is the client's, and int("²") raises."""
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        value = raw
    elif isinstance(raw, float) and raw.is_integer():
        value = int(raw)
    elif isinstance(raw, str) and len(raw) <= _MAX_COUNT_CHARS and _COUNT_TEXT.fullmatch(raw.strip()):
        value = int(raw.strip())
    else:
        return None
    return value if 0 <= value <= MAX_TOKEN_COUNT else None


def read_cost(raw: object) -> Decimal | None:
    """A reply's cost in USD from 0 to MAX_REPLY_COST_USD (bounded before parsing), else None."""
    return read_decimal(raw, ceiling=MAX_REPLY_COST_USD)


def _described(raw: object) -> str:
    """What a refused value was, never the value itself: its type and size."""
    if isinstance(raw, str):
        return f"str of {len(raw):,} char{'' if len(raw) == 1 else 's'}"
    if isinstance(raw, (Mapping, list, tuple)):
        return f"{type(raw).__name__} of {len(raw):,} items"
    if isinstance(raw, (bool, int, float, Decimal)):
        return f"{type(raw).__name__} out of range"
    return type(raw).__name__[:20]


class _Fields:
    """Reads the fields of one usage object, noting each value present but not believed."""

    __slots__ = ("usage", "rejected")

    def __init__(self, usage: Mapping, rejected: list[str] | None) -> None:
        self.usage = usage
        self.rejected = rejected

    def _read(self, key: str, group: str | None, parse):  # parse: read_count or read_cost
        source = self.usage.get(group) if group else self.usage
        raw = source.get(key) if isinstance(source, Mapping) else None
        value = None if raw is None else parse(raw)
        if value is None and raw is not None and self.rejected is not None:
            note = f"{group + '.' if group else ''}{key} ({_described(raw)})"
            if note not in self.rejected:
                self.rejected.append(note)
        return value

    def count(self, key: str, group: str | None = None) -> int | None:
        """usage[key] (or usage[group][key]) as a token count; None = absent or refused."""
        return self._read(key, group, read_count)

    def cost(self, key: str, group: str | None = None) -> Decimal | None:
        """usage[key] (or usage[group][key]) as a USD amount; None = absent or refused."""
        return self._read(key, group, read_cost)

    def first(self, *keys: str) -> int | None:
        """The first of keys present as a token count (for camelCase / snake_case twins)."""
        for key in keys:
            if key in self.usage:
                return self.count(key)
        return None


def _usage_add(*counts: int | None) -> int | None:
    """Sum of counts, None when any is None."""
    return None if any(c is None for c in counts) else sum(counts)  # type: ignore[arg-type]


def _cache_parts(prompt: int | None, cached: int | None, written: int | None) -> tuple[int | None, int | None]:
    """Cached and cache-write counts within the prompt they are part of (never billed beyond it)."""
    if prompt is None:
        return cached, written
    cached = None if cached is None else min(cached, prompt)
    written = None if written is None else min(written, prompt - (cached or 0))
    return cached, written


def _provider_cost(fields: _Fields) -> Decimal | None:
    """OpenRouter's `cost`; with BYOK (`is_byok` true) plus the upstream provider's charge."""
    cost = fields.cost("cost")
    if (
        cost is not None
        and fields.usage.get("is_byok") is True
        and isinstance(fields.usage.get("cost_details"), Mapping)
    ):
        upstream = fields.cost("upstream_inference_cost", "cost_details")
        cost = None if upstream is None else cost + upstream
    return cost if cost is None or cost <= MAX_REPLY_COST_USD else None


def _read_anthropic(fields: _Fields) -> Usage:
    """Anthropic native: input_tokens excludes cache reads and cache writes."""
    fresh = fields.count("input_tokens")
    read = fields.count("cache_read_input_tokens") or 0
    written = fields.count("cache_creation_input_tokens") or 0
    prompt = _usage_add(fresh, read, written)
    completion = fields.count("output_tokens")
    return Usage(
        prompt,
        completion,
        cached_tokens=read,
        cache_write_tokens=written,
        total_tokens=_usage_add(prompt, completion),
        shape="anthropic",
        cache_write_1h_tokens=fields.count("ephemeral_1h_input_tokens", "cache_creation"),
    )


def _read_responses(fields: _Fields) -> Usage:
    """OpenAI Responses API: input_tokens includes cached, output_tokens includes reasoning."""
    prompt = fields.count("input_tokens")
    completion = fields.count("output_tokens")
    total = fields.count("total_tokens")
    return Usage(
        prompt,
        completion,
        cached_tokens=fields.count("cached_tokens", "input_tokens_details"),
        reasoning_tokens=fields.count("reasoning_tokens", "output_tokens_details"),
        total_tokens=total if total is not None else _usage_add(prompt, completion),
        shape="openai_responses",
    )


def _read_gemini_native(fields: _Fields) -> Usage:
    """Gemini usageMetadata: candidates exclude thoughts; bill output = candidates + thoughts."""
    prompt = fields.first("promptTokenCount", "prompt_token_count")
    thoughts = fields.first("thoughtsTokenCount", "thoughts_token_count")
    candidates = fields.first("candidatesTokenCount", "candidates_token_count")
    completion = _usage_add(candidates, thoughts or 0)
    total = fields.first("totalTokenCount", "total_token_count")
    return Usage(
        prompt,
        completion,
        cached_tokens=fields.first("cachedContentTokenCount", "cached_content_token_count"),
        reasoning_tokens=thoughts,
        total_tokens=total if total is not None else _usage_add(prompt, completion),
        shape="gemini_native",
    )


def _read_ollama(fields: _Fields) -> Usage:
    """Ollama counts. prompt_eval_count is left out when the prompt came from Ollama's cache,
    and Open WebUI then writes 0: a reply never has an empty prompt, so 0 is unknown too."""
    summed_prompt = fields.count("input_tokens")
    last_prompt = fields.count("prompt_eval_count")
    prompt = next((c for c in (summed_prompt, last_prompt) if c), None)
    completion = fields.first("output_tokens", "eval_count")
    last_completion = fields.count("eval_count")
    summed = bool(
        (summed_prompt and last_prompt and summed_prompt > last_prompt)
        or (completion is not None and last_completion is not None and completion > last_completion)
    )
    return Usage(prompt, completion, total_tokens=_usage_add(prompt, completion), shape="ollama", calls_summed=summed)


def _read_openai_like(fields: _Fields) -> Usage:
    """OpenAI chat shape (also OpenRouter, LiteLLM, Gemini's OpenAI endpoint, vLLM ...), with Open
    WebUI's input/output/total_tokens. In a tool loop those are sums over every provider call
    while prompt/completion_tokens are the last call's: billing needs the sums, so the larger
    of the two is taken (they are equal for a single call)."""
    usage = fields.usage
    last_prompt = fields.count("prompt_tokens")
    last_completion = fields.count("completion_tokens")
    summed_prompt = fields.count("input_tokens")
    summed_completion = fields.count("output_tokens")
    prompt = max((c for c in (last_prompt, summed_prompt) if c is not None), default=None)
    completion = max((c for c in (last_completion, summed_completion) if c is not None), default=None)
    summed = (prompt != last_prompt and last_prompt is not None) or (
        completion != last_completion and last_completion is not None
    )
    total = fields.count("total_tokens")
    reasoning = fields.count("reasoning_tokens", "completion_tokens_details")
    cached, written, written_1h, top_level = _openai_cache_counts(fields)
    if top_level and prompt is not None and written and (cached or 0) <= prompt < (cached or 0) + written:
        prompt += written  # LiteLLM's mid-2025 Anthropic usage: prompt and total left its writes out
        total = None if total is None else total + written
    is_openrouter = "cost" in usage or "is_byok" in usage
    shape = (
        "openrouter"
        if is_openrouter
        else ("openai" if last_prompt is not None or last_completion is not None else "open_webui")
    )
    if total is not None and prompt is not None and completion is not None and total - prompt > completion:
        # Gemini's OpenAI endpoint leaves thinking tokens out of completion_tokens, but not
        # out of total_tokens: bill output as total - prompt (the notes' max rule).
        gap = total - prompt - completion
        completion = total - prompt
        reasoning = max(reasoning or 0, gap)
        shape = "gemini" if not is_openrouter else shape
    return Usage(
        prompt,
        completion,
        cached_tokens=cached,
        cache_write_tokens=written,
        reasoning_tokens=reasoning,
        total_tokens=total if total is not None else _usage_add(prompt, completion),
        provider_cost=_provider_cost(fields),  # Open WebUI sums `cost` over a tool loop's calls too
        shape=shape,
        calls_summed=bool(summed),
        last_call_prompt=last_prompt if summed else None,
        cache_write_1h_tokens=written_1h,
    )


def _openai_cache_counts(fields: _Fields) -> tuple[int | None, int | None, int | None, bool]:
    """Cache reads, writes and 1-hour writes of an OpenAI-shaped usage, and whether the writes
    are only LiteLLM's top-level key. OpenRouter: `prompt_tokens_details.cache_write_tokens`.
    LiteLLM (Anthropic behind its OpenAI API): `prompt_tokens_details.cache_creation_tokens`
    (newer) or top-level `cache_creation_input_tokens` / `cache_read_input_tokens`, its 1-hour
    writes in `prompt_tokens_details.cache_creation_token_details`.

    All are within prompt_tokens, but for one LiteLLM revision: its Anthropic transformation
    (llms/anthropic/chat/transformation.py) made prompt_tokens input + reads + writes before and
    after mid-2025, and input + reads in between (writes in the top-level key alone: a call
    Anthropic billed $0.05439, 3 in, 12,304 written, 550 out, read as $0.0083). The keys are
    the same, so only the counts tell: reads and writes above prompt_tokens cannot both be in
    it, and every revision counts the reads in (`_read_openai_like` adds the writes back)."""
    details = "prompt_tokens_details"
    cached = fields.count("cached_tokens", details)
    if cached is None:
        cached = fields.count("cache_read_input_tokens")
    openrouter, litellm = fields.count("cache_write_tokens", details), fields.count("cache_creation_tokens", details)
    detailed = openrouter if openrouter is not None else litellm
    written = detailed if detailed is not None else fields.count("cache_creation_input_tokens")
    split = fields.usage.get(details)
    hour = None
    if isinstance(split, Mapping):
        hour = _Fields(split, fields.rejected).count("ephemeral_1h_input_tokens", "cache_creation_token_details")
    return cached, written, hour, detailed is None and written is not None


def normalize_usage(usage: Mapping, rejected: list[str] | None = None) -> Usage | None:
    """Read one usage object (any backend shape, with or without Open WebUI's additions).

    Every count is bounded (0 to MAX_TOKEN_COUNT) and the provider's cost too (0 to
    MAX_REPLY_COST_USD): a value outside is unknown, as if absent, so the caller estimates it.

    Args:
        usage: e.g. a response's or stream's last chunk's `usage`.
        rejected: when given, gets one short note per value refused ("cost (str of 8 chars)"),
            never the value itself.

    Returns None when it holds no token count at all.

    Example:
        >>> normalize_usage({"prompt_tokens": 10, "completion_tokens": 5}).total_tokens
        15
    """
    if not isinstance(usage, Mapping) or not usage:
        return None
    fields = _Fields(usage, rejected)
    if any(key in usage for key in _ANTHROPIC_KEYS) and not any(key in usage for key in _OPENAI_PROMPT_KEYS):
        result = _read_anthropic(fields)
    elif "input_tokens_details" in usage or "output_tokens_details" in usage:
        result = _read_responses(fields)
    elif "promptTokenCount" in usage or "prompt_token_count" in usage:
        result = _read_gemini_native(fields)
    elif "prompt_eval_count" in usage or "eval_count" in usage:
        result = _read_ollama(fields)
    else:
        result = _read_openai_like(fields)
    if result.prompt_tokens is None and result.completion_tokens is None:
        return None
    return with_counts(result, result.prompt_tokens, result.completion_tokens)


def with_counts(usage: Usage, prompt_tokens: int | None, completion_tokens: int | None) -> Usage:
    """`usage` with its prompt and completion counts replaced (e.g. by estimates), the cached
    parts kept within the new prompt.

    Example:
        >>> with_counts(Usage(None, 5, cached_tokens=10**6), 8, 5).cached_tokens
        8
    """
    cached, written = _cache_parts(prompt_tokens, usage.cached_tokens, usage.cache_write_tokens)
    return replace(
        usage,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=cached,
        cache_write_tokens=written,
    )


def read_usage(message: Mapping, rejected: list[str] | None = None) -> Usage | None:
    """Real usage of an outlet message: `message["usage"]`, else `message["info"]["usage"]`.

    Args:
        message: the assistant message (usually `body["messages"][-1]` in outlet).
        rejected: collects notes on values not believed (see `normalize_usage`).

    Returns None when the backend reported no usage (the caller then estimates).

    Example:
        >>> read_usage({"role": "assistant", "usage": {"prompt_tokens": 7,
        ...     "completion_tokens": 3}}).prompt_tokens
        7
    """
    if not isinstance(message, Mapping):
        return None
    usage = message.get("usage")
    if not isinstance(usage, Mapping) or not usage:
        info = message.get("info")
        usage = info.get("usage") if isinstance(info, Mapping) else None
    return normalize_usage(usage, rejected) if isinstance(usage, Mapping) else None


def _cost_term(tokens: int | None, rate: Decimal | None, what: str) -> tuple[Decimal | None, str | None]:
    """tokens x rate; (None, reason) when a non-zero charge cannot be known."""
    if tokens == 0 or rate == 0:
        return Decimal(0), None
    if tokens is None:
        return None, f"{what} token count unknown"
    if rate is None:
        return None, f"{what} price unknown"
    return tokens * rate, None


def _cost_terms(
    usage: Usage, price: ModelPrice, rates: PriceTier
) -> tuple[list[tuple[int | None, Decimal | None, str]], list[str]]:
    """The (tokens, rate, what) terms of a price_table cost, and notes on what was assumed."""
    reported = (usage.cached_tokens or 0, usage.cache_write_tokens or 0)
    parts = _cache_parts(usage.prompt_tokens, *reported)
    cached, written = parts[0] or 0, parts[1] or 0
    notes: list[str] = []
    if (cached, written) != reported:
        notes.append("cached + cache-write tokens exceed prompt tokens; counted up to the prompt")
    uncached = None if usage.prompt_tokens is None else usage.prompt_tokens - cached - written
    hour = min(usage.cache_write_1h_tokens or 0, written) if rates.cache_write_1h is not None else 0
    terms = [
        (uncached, rates.prompt, "prompt"),
        (cached, rates.cache_read, "cache read"),
        (written - hour, rates.cache_write, "cache write"),
        (hour, rates.cache_write_1h, "1-hour cache write"),
    ]
    reasoning = usage.reasoning_tokens or 0
    completion = usage.completion_tokens
    if price.internal_reasoning and reasoning and completion is not None:
        visible = max(completion - reasoning, 0)
        terms += [
            (visible, rates.completion, "completion"),
            (completion - visible, price.internal_reasoning, "reasoning"),
        ]
    else:
        terms.append((completion, rates.completion, "completion"))
    return terms, notes


def compute_cost(usage: Usage | None, price: ModelPrice | None) -> Cost:
    """Cost of one reply in USD: the provider's own figure when given, else usage x price.

    price_table cost = (prompt - cached - cache writes) x prompt + cached x cache read
    + writes x cache write + completion x completion, with the prices of the prompt-size
    tier reached. Reasoning tokens are part of completion (OpenAI semantics) and are billed
    apart only when the model lists a separate `internal_reasoning` rate. Unreported cached or
    cache-write counts are taken as 0 (every prompt token at the full rate); more than the
    prompt are counted up to it. Counts beyond MAX_TOKEN_COUNT or a total above
    MAX_REPLY_COST_USD are unknown (None), never converted.

    Args:
        usage: from read_usage(); None = nothing reported.
        price: from resolve_model(...).price; None = model not priced.

    Example:
        >>> compute_cost(Usage(1000, 100), ModelPrice(Decimal("0.000002"), Decimal("0.000008")))
        Cost(cost_usd=Decimal('0.002800'), cost_source='price_table', reason=None, tier=0, notes=())
    """
    if usage is None:
        return Cost(None, None, reason="the backend reported no usage")
    if usage.provider_cost is not None and read_cost(usage.provider_cost) is not None:
        return Cost(usage.provider_cost, "provider")
    if price is None:
        return Cost(None, None, reason="no price for this model")
    counts = (
        usage.prompt_tokens,
        usage.completion_tokens,
        usage.cached_tokens,
        usage.cache_write_tokens,
        usage.reasoning_tokens,
    )
    if any(c is not None and read_count(c) is None for c in counts):
        return Cost(None, None, reason=f"a token count is beyond {MAX_TOKEN_COUNT:,}")
    # A tool loop's calls are priced each at its own prompt's tier: the sum reaches a tier none did.
    tier_prompt = usage.last_call_prompt if usage.last_call_prompt is not None else usage.prompt_tokens
    rates = price.rates_for(tier_prompt)
    terms, notes = _cost_terms(usage, price, rates)
    if price.varies_by_time:
        notes.append("price varies by time of day; the base price was used")
    total = Decimal(0)
    with localcontext(prec=_COST_PRECISION):
        for tokens, rate, what in terms:
            amount, reason = _cost_term(tokens, rate, what)
            if amount is None:
                return Cost(None, None, reason=reason, tier=rates.min_prompt_tokens, notes=tuple(notes))
            total += amount
    if total > MAX_REPLY_COST_USD:
        return Cost(
            None,
            None,
            reason=f"cost above the ${MAX_REPLY_COST_USD:,} per-reply ceiling",
            tier=rates.min_prompt_tokens,
            notes=tuple(notes),
        )
    return Cost(total, "price_table", tier=rates.min_prompt_tokens, notes=tuple(notes))
