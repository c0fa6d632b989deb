"""Usage and cost of one reply: the real token counts in an Open WebUI outlet message, read
for every backend shape (missing = unknown, never 0), and their price in Decimal USD."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation, localcontext

from .pricing import ModelPrice

__all__ = ["Usage", "Cost", "read_usage", "normalize_usage", "compute_cost"]

# Token counts times prices with up to ~25 significant digits: compute exactly, no rounding.
_COST_PRECISION = 80
_ANTHROPIC_KEYS = ("cache_read_input_tokens", "cache_creation_input_tokens")


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one reply, normalized to OpenAI's meaning. None = not reported.

    `prompt_tokens` includes cached and cache-write tokens; `completion_tokens` includes
    reasoning tokens. `provider_cost` is what the provider said it charged (USD). `shape`
    names the format read: openai, openrouter, gemini, anthropic, openai_responses,
    gemini_native, ollama, open_webui. `calls_summed` is True when Open WebUI added up several
    provider calls (a tool loop) and the counts are those sums.
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


def _usage_int(raw: object) -> int | None:
    """A token count: a non-negative int (or integral float / digit string), else None."""
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        return raw if raw >= 0 else None
    if isinstance(raw, float) and raw.is_integer() and raw >= 0:
        return int(raw)
    if isinstance(raw, str) and raw.strip().isdigit():
        return int(raw.strip())
    return None


def _usage_decimal(raw: object) -> Decimal | None:
    """A non-negative finite USD amount from a number or string, else None."""
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        return None
    try:
        value = Decimal(repr(raw) if isinstance(raw, float) else str(raw).strip())
    except (InvalidOperation, ValueError):
        return None
    return value if value.is_finite() and value >= 0 else None


def _usage_detail(usage: Mapping, group: str, key: str) -> int | None:
    """usage[group][key] as a token count, e.g. prompt_tokens_details.cached_tokens."""
    details = usage.get(group)
    return _usage_int(details.get(key)) if isinstance(details, Mapping) else None


def _usage_first(usage: Mapping, *keys: str) -> int | None:
    """The first of keys present as a token count (for camelCase / snake_case twins)."""
    for key in keys:
        if key in usage:
            return _usage_int(usage[key])
    return None


def _usage_add(*counts: int | None) -> int | None:
    """Sum of counts, None when any is None."""
    return None if any(c is None for c in counts) else sum(counts)  # type: ignore[arg-type]


def _provider_cost(usage: Mapping) -> Decimal | None:
    """OpenRouter's `cost`; with BYOK (`is_byok` true) plus the upstream provider's charge."""
    cost = _usage_decimal(usage.get("cost"))
    details = usage.get("cost_details")
    if cost is not None and usage.get("is_byok") is True and isinstance(details, Mapping):
        upstream = _usage_decimal(details.get("upstream_inference_cost"))
        cost = None if upstream is None else cost + upstream
    return cost


def _read_anthropic(usage: Mapping) -> Usage:
    """Anthropic native: input_tokens excludes cache reads and cache writes."""
    fresh = _usage_int(usage.get("input_tokens"))
    read = _usage_int(usage.get("cache_read_input_tokens")) or 0
    written = _usage_int(usage.get("cache_creation_input_tokens")) or 0
    prompt = _usage_add(fresh, read, written)
    completion = _usage_int(usage.get("output_tokens"))
    return Usage(prompt, completion, cached_tokens=read, cache_write_tokens=written,
                 total_tokens=_usage_add(prompt, completion), shape="anthropic")


def _read_responses(usage: Mapping) -> Usage:
    """OpenAI Responses API: input_tokens includes cached, output_tokens includes reasoning."""
    prompt = _usage_int(usage.get("input_tokens"))
    completion = _usage_int(usage.get("output_tokens"))
    total = _usage_int(usage.get("total_tokens"))
    return Usage(prompt, completion,
                 cached_tokens=_usage_detail(usage, "input_tokens_details", "cached_tokens"),
                 reasoning_tokens=_usage_detail(usage, "output_tokens_details", "reasoning_tokens"),
                 total_tokens=total if total is not None else _usage_add(prompt, completion),
                 shape="openai_responses")


def _read_gemini_native(usage: Mapping) -> Usage:
    """Gemini usageMetadata: candidates exclude thoughts; bill output = candidates + thoughts."""
    prompt = _usage_first(usage, "promptTokenCount", "prompt_token_count")
    thoughts = _usage_first(usage, "thoughtsTokenCount", "thoughts_token_count")
    candidates = _usage_first(usage, "candidatesTokenCount", "candidates_token_count")
    completion = _usage_add(candidates, thoughts or 0)
    total = _usage_first(usage, "totalTokenCount", "total_token_count")
    return Usage(prompt, completion,
                 cached_tokens=_usage_first(usage, "cachedContentTokenCount",
                                            "cached_content_token_count"),
                 reasoning_tokens=thoughts,
                 total_tokens=total if total is not None else _usage_add(prompt, completion),
                 shape="gemini_native")


def _read_ollama(usage: Mapping) -> Usage:
    """Ollama counts. prompt_eval_count is left out when the prompt came from Ollama's cache,
    and Open WebUI then writes 0: a reply never has an empty prompt, so 0 is unknown too."""
    summed_prompt = _usage_int(usage.get("input_tokens"))
    last_prompt = _usage_int(usage.get("prompt_eval_count"))
    prompt = next((c for c in (summed_prompt, last_prompt) if c), None)
    completion = _usage_first(usage, "output_tokens", "eval_count")
    last_completion = _usage_int(usage.get("eval_count"))
    summed = bool(
        (summed_prompt and last_prompt and summed_prompt > last_prompt)
        or (completion is not None and last_completion is not None and completion > last_completion)
    )
    return Usage(prompt, completion, total_tokens=_usage_add(prompt, completion),
                 shape="ollama", calls_summed=summed)


def _read_openai_like(usage: Mapping) -> Usage:
    """OpenAI chat shape (also OpenRouter, Gemini's OpenAI endpoint, vLLM ...), with Open
    WebUI's input/output/total_tokens. In a tool loop those are sums over every provider call
    while prompt/completion_tokens are the last call's: billing needs the sums, so the larger
    of the two is taken (they are equal for a single call)."""
    last_prompt = _usage_int(usage.get("prompt_tokens"))
    last_completion = _usage_int(usage.get("completion_tokens"))
    summed_prompt = _usage_int(usage.get("input_tokens"))
    summed_completion = _usage_int(usage.get("output_tokens"))
    prompt = max((c for c in (last_prompt, summed_prompt) if c is not None), default=None)
    completion = max((c for c in (last_completion, summed_completion) if c is not None),
                     default=None)
    summed = (prompt != last_prompt and last_prompt is not None) or (
        completion != last_completion and last_completion is not None)
    total = _usage_int(usage.get("total_tokens"))
    reasoning = _usage_detail(usage, "completion_tokens_details", "reasoning_tokens")
    is_openrouter = "cost" in usage or "is_byok" in usage
    shape = "openrouter" if is_openrouter else ("openai" if last_prompt is not None
                                                or last_completion is not None else "open_webui")
    if total is not None and prompt is not None and completion is not None \
            and total - prompt > completion:
        # Gemini's OpenAI endpoint leaves thinking tokens out of completion_tokens, but not
        # out of total_tokens: bill output as total - prompt (the notes' max rule).
        gap = total - prompt - completion
        completion = total - prompt
        reasoning = max(reasoning or 0, gap)
        shape = "gemini" if not is_openrouter else shape
    return Usage(
        prompt, completion,
        cached_tokens=_usage_detail(usage, "prompt_tokens_details", "cached_tokens"),
        cache_write_tokens=_usage_detail(usage, "prompt_tokens_details", "cache_write_tokens"),
        reasoning_tokens=reasoning,
        total_tokens=total if total is not None else _usage_add(prompt, completion),
        provider_cost=_provider_cost(usage),
        shape=shape,
        calls_summed=bool(summed),
    )


def normalize_usage(usage: Mapping) -> Usage | None:
    """Read one usage object (any backend shape, with or without Open WebUI's additions).

    Args:
        usage: e.g. a response's or stream's last chunk's `usage`.

    Returns None when it holds no token count at all.

    Example:
        >>> normalize_usage({"prompt_tokens": 10, "completion_tokens": 5}).total_tokens
        15
    """
    if not isinstance(usage, Mapping) or not usage:
        return None
    if any(key in usage for key in _ANTHROPIC_KEYS) and "prompt_tokens_details" not in usage:
        result = _read_anthropic(usage)
    elif "input_tokens_details" in usage or "output_tokens_details" in usage:
        result = _read_responses(usage)
    elif "promptTokenCount" in usage or "prompt_token_count" in usage:
        result = _read_gemini_native(usage)
    elif "prompt_eval_count" in usage or "eval_count" in usage:
        result = _read_ollama(usage)
    else:
        result = _read_openai_like(usage)
    if result.prompt_tokens is None and result.completion_tokens is None:
        return None
    return result


def read_usage(message: Mapping) -> Usage | None:
    """Real usage of an outlet message: `message["usage"]`, else `message["info"]["usage"]`.

    Args:
        message: the assistant message (usually `body["messages"][-1]` in outlet).

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
    return normalize_usage(usage) if isinstance(usage, Mapping) else None


def _cost_term(
    tokens: int | None, rate: Decimal | None, what: str
) -> tuple[Decimal | None, str | None]:
    """tokens x rate; (None, reason) when a non-zero charge cannot be known."""
    if tokens == 0 or rate == 0:
        return Decimal(0), None
    if tokens is None:
        return None, f"{what} token count unknown"
    if rate is None:
        return None, f"{what} price unknown"
    return tokens * rate, None


def compute_cost(usage: Usage | None, price: ModelPrice | None) -> Cost:
    """Cost of one reply in USD: the provider's own figure when given, else usage x price.

    price_table cost = (prompt - cached - cache writes) x prompt + cached x cache read
    + writes x cache write + completion x completion, with the prices of the prompt-size
    tier reached. Reasoning tokens are part of completion (OpenAI semantics) and are billed
    apart only when the model lists a separate `internal_reasoning` rate. Unreported cached or
    cache-write counts are taken as 0 (every prompt token at the full rate).

    Args:
        usage: from read_usage(); None = nothing reported.
        price: from resolve_model(...).price; None = model not priced.

    Example:
        >>> compute_cost(Usage(1000, 100), ModelPrice(Decimal("0.000002"), Decimal("0.000008")))
        Cost(cost_usd=Decimal('0.002800'), cost_source='price_table', reason=None, tier=0, notes=())
    """
    if usage is None:
        return Cost(None, None, reason="the backend reported no usage")
    if usage.provider_cost is not None:
        return Cost(usage.provider_cost, "provider")
    if price is None:
        return Cost(None, None, reason="no price for this model")
    rates = price.rates_for(usage.prompt_tokens)
    cached = usage.cached_tokens or 0
    written = usage.cache_write_tokens or 0
    notes: list[str] = []
    uncached = None if usage.prompt_tokens is None else usage.prompt_tokens - cached - written
    if uncached is not None and uncached < 0:
        notes.append("cached + cache-write tokens exceed prompt tokens; uncached taken as 0")
        uncached = 0
    terms = [(uncached, rates.prompt, "prompt"), (cached, rates.cache_read, "cache read"),
             (written, rates.cache_write, "cache write")]
    reasoning = usage.reasoning_tokens or 0
    completion = usage.completion_tokens
    if price.internal_reasoning and reasoning and completion is not None:
        visible = max(completion - reasoning, 0)
        terms += [(visible, rates.completion, "completion"),
                  (completion - visible, price.internal_reasoning, "reasoning")]
    else:
        terms.append((completion, rates.completion, "completion"))
    if price.varies_by_time:
        notes.append("price varies by time of day; the base price was used")
    total = Decimal(0)
    with localcontext(prec=_COST_PRECISION):
        for tokens, rate, what in terms:
            amount, reason = _cost_term(tokens, rate, what)
            if amount is None:
                return Cost(None, None, reason=reason, tier=rates.min_prompt_tokens,
                            notes=tuple(notes))
            total += amount
    return Cost(total, "price_table", tier=rates.min_prompt_tokens, notes=tuple(notes))
