"""A turn's money, apart from the Open WebUI face: what the trim saved, what the reply cost.

Before the reply: the cache view (what the provider's cache would serve with and without the
trim) and the savings estimate it prices. After the reply: the usage to bill (the backend's,
estimated where it said nothing), its cost and cache-aware savings, the `UsageRecord` logged,
and what the reply teaches (the count calibration, whether the model's cache serves anything).
The filter passes the store, the counter and the price resolution in; nothing here reads valves.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from ..core.conversation import message_text
from ..core.tokens import TokenCounter
from ..state.store import Store
from .cache_hints import min_cacheable_tokens, needs_breakpoints
from .cache_stats import load_cache_stats, save_cache_stats, update_cache_stats
from .calibration import load_calibration, save_calibration, update_calibration
from .pricing import Resolution
from .records import CacheView, TurnChoice, TurnNote, UsageRecord
from .savings import (
    Savings,
    calibrated_tokens,
    estimate_savings,
    predicted_cache,
    price_caches,
    reply_savings,
)
from .usage import ESTIMATE_SHAPE, Cost, Estimated, Usage, with_counts

__all__ = [
    "cache_view",
    "trim_savings",
    "billed_usage",
    "cost_note",
    "reply_savings_of",
    "usage_record",
    "learn_calibration",
    "learn_caching",
]

accounting_log = logging.getLogger("contextwarden")


async def cache_view(
    store: Store,
    prefixes: Callable[[], Awaitable[tuple[int, int]]],
    choice: TurnChoice,
    untrimmed: int,
    resolution: Resolution,
    model_id: str,
    factor: float,
    hints: bool,
) -> CacheView:
    """What the provider's cache would serve (provider tokens): the untrimmed chat's previous
    prompt (`untrimmed`), the sent prompt's reused prefix (`trimmed`: all but the newest reply
    and turn when the previous selection was reused, else its system prompt); whether the model
    caches at all (learned from replies, else expected from its price and breakpoints).
    `prefixes` counts both (`savings.cached_prefixes`) where the caller says: a big chat's newest
    messages are counted off the event loop."""
    model_key = resolution.model_id or model_id
    minimum = min_cacheable_tokens(model_key)
    if untrimmed <= choice.tokens_after or not price_caches(resolution.price):
        return CacheView(minimum=minimum)  # nothing removed (savings are 0 whatever is cached), or no cache price
    expected = hints or not needs_breakpoints(model_key)
    try:
        learned = (await load_cache_stats(store, model_key)).caches()
    except Exception as exc:  # stats are an estimate's input: go on with the expectation
        accounting_log.debug("contextwarden: cache stats not read (%s)", type(exc).__name__)
        learned = None
    untrimmed_prefix, sent_prefix = await prefixes()
    return CacheView(
        untrimmed=calibrated_tokens(untrimmed_prefix, factor),
        trimmed=calibrated_tokens(sent_prefix, factor),
        caches=bool(expected if learned is None else learned),
        minimum=minimum,
    )


def trim_savings(untrimmed: int, sent: int, factor: float, resolution: Resolution, cache: CacheView) -> Savings:
    """The savings estimate of a turn (our counts `untrimmed` and `sent`), each side with the
    cache `cache` says it would meet."""
    price = resolution.price
    return estimate_savings(
        untrimmed,
        sent,
        factor=factor,
        price=price,
        cache_before=predicted_cache(
            calibrated_tokens(untrimmed, factor), cache.untrimmed, price, caches=cache.caches, minimum=cache.minimum
        ),
        cache_after=predicted_cache(
            calibrated_tokens(sent, factor), cache.trimmed, price, caches=cache.caches, minimum=cache.minimum
        ),
    )


def billed_usage(
    counter: TokenCounter,
    usage: Usage | None,
    estimated_prompt: int | None,
    messages: list[dict],
    model_id: str,
    reply_at_most: int | None = None,
) -> tuple[Usage, Estimated]:
    """The usage to log and bill: the backend's, with what it left out estimated, and which of the
    two counts that is (a count the backend did report stays its own, unmarked). `reply_at_most`:
    no reply came back (a summary call that failed after it was sent), so a completion not
    reported is billed at this, the most it can be (shape `upper_bound` when nothing was)."""
    prompt = usage.prompt_tokens if usage is not None else None
    completion = usage.completion_tokens if usage is not None else None
    estimated = Estimated(prompt=prompt is None, completion=completion is None)
    if not estimated.any and usage is not None:
        return usage, estimated
    if prompt is None:
        prompt = estimated_prompt if estimated_prompt is not None else counter.count_messages(messages[:-1], model_id)
    if completion is None and reply_at_most is not None:
        completion = reply_at_most
    elif completion is None:
        completion = counter.count_text(message_text(messages[-1]), model_id)
    if usage is None:
        return Usage(prompt, completion, shape=ESTIMATE_SHAPE if reply_at_most is None else "upper_bound"), estimated
    return with_counts(usage, prompt, completion), estimated


def cost_note(cost: Cost, resolution: Resolution) -> str | None:
    """Why a cost is unknown (the price's reason first), or what an estimate of it assumed."""
    if cost.cost_usd is None:
        return resolution.reason if resolution.price is None and resolution.reason else cost.reason
    return "; ".join(cost.notes) or None


async def reply_savings_of(
    store: Store,
    billed: Usage,
    note: TurnNote,
    mode: str,
    tokens_saved: int | None,
    resolution: Resolution,
    model_id: str,
) -> Savings | None:
    """A reply's savings, cache-aware now that the backend said what its cache served (None in
    `off` mode). The model caches when this reply was served from cache, else as learned from
    earlier replies, else as the request hook expected from its price and breakpoints."""
    if tokens_saved is None:
        return None
    model_key = resolution.model_id or model_id
    view = note.cache or CacheView()
    caches = bool(billed.cached_tokens)
    if not caches and tokens_saved > 0:
        try:
            learned = (await load_cache_stats(store, model_key)).caches()
        except Exception as exc:
            accounting_log.debug("contextwarden: cache stats not read (%s)", type(exc).__name__)
            learned = None
        caches = (note.cache is not None and view.caches) if learned is None else learned
    return reply_savings(
        billed,
        shadow=mode == "shadow",
        tokens_saved=tokens_saved,
        other_prefix=view.trimmed if mode == "shadow" else view.untrimmed,
        sent_prefix=view.untrimmed if mode == "shadow" else view.trimmed,
        price=resolution.price,
        caches=caches,
        minimum=min_cacheable_tokens(model_key),
    )


def usage_record(
    *,
    model_id: str,
    resolution: Resolution,
    user_id: object,
    chat_id: object,
    billed: Usage,
    estimated: bool,
    estimated_prompt: int | None,
    cost: Cost,
    mode: str,
    tokens_saved: int | None,
    savings: Savings | None,
) -> UsageRecord:
    """The record of one reply for the `usage {json}` line."""
    return UsageRecord(
        model=model_id,
        resolved_model=resolution.model_id,
        user_id=user_id,
        chat_id=chat_id,
        prompt_tokens=billed.prompt_tokens,
        completion_tokens=billed.completion_tokens,
        cached_tokens=billed.cached_tokens,
        reasoning_tokens=billed.reasoning_tokens,
        estimated=estimated,
        estimated_prompt_tokens=estimated_prompt,
        usage_shape=billed.shape,
        cost_usd=cost.cost_usd,
        cost_source=cost.cost_source,
        cost_note=cost_note(cost, resolution),
        mode=mode,
        tokens_saved=tokens_saved,
        cost_saved_usd=savings.cost_saved_usd if savings is not None else None,
    )


async def learn_calibration(store: Store, model_key: str, counted: int, real: int | None) -> None:
    """Fold one reply's real prompt tokens into the model's count correction."""
    if real is None:
        return
    updated = update_calibration(await load_calibration(store, model_key), counted, real)
    if updated is not None:
        await save_calibration(store, model_key, updated)


async def learn_caching(store: Store, model_key: str, reported: Usage) -> None:
    """Count a turn's provider call in the model's cache stats (prompts over the minimum, and
    cache hits): its usage as the backend `reported` it in the stream, never the outlet's."""
    stats = await load_cache_stats(store, model_key)
    updated = update_cache_stats(stats, reported.prompt_tokens, reported.cached_tokens, min_cacheable_tokens(model_key))
    if updated is not None:
        await save_cache_stats(store, model_key, updated)
