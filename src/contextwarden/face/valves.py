"""`Valves` (admin) and `UserValves` (per user), and reading them into `Settings`.

Valves are parsed once per call into a frozen `Settings` (`settings.py`); problems are
collected as `ConfigError`s naming the valve, so the filter can report them and go on.
"""

from __future__ import annotations

import functools
import json
import sys
from decimal import Decimal
from types import FrameType
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..caches import VALVE_RANGE_MEMO_SIZE, register
from ..core.flags import DEFAULT_ALLOWED_FLAGS, FLAG_NAMES, MAX_FLAG_KEEP, parse_flag_names
from ..core.selection import DEFAULT_KEEP_LAST_TURNS, DEFAULT_STRATEGY, MIN_KEEP_LAST_TURNS, STRATEGIES
from ..core.trim import DEFAULT_GROWTH_TURNS, DEFAULT_LOW_WATERMARK
from ..errors import ConfigError
from ..money.ledger import DEFAULT_LEDGER_RETENTION_DAYS
from ..money.limits import MAX_LIMIT_TOKENS, MAX_LIMIT_USD, MAX_OVERRIDES_CHARS, LimitRules, Limits, parse_overrides
from ..money.live_prices import DEFAULT_PRICING_TTL_HOURS, MAX_PRICING_TTL_HOURS, MIN_PRICING_TTL_HOURS
from ..money.pricing import parse_aliases, parse_model_globs, read_decimal
from ..state.store import open_store
from .embedder import DEFAULT_EMBED_TEXTS, DEFAULT_EMBED_TIMEOUT
from .settings import DEFAULT_CONTEXT_TOKENS, DEFAULT_STATE_TTL_HOURS, MIN_BUDGET_TOKENS, MODES, Mode, Settings
from .summarize import SummaryConfig, endpoint_problem, key_problem

__all__ = [
    "Valves",
    "UserValves",
    "Settings",
    "read_settings",
    "valves_key",
    "DEFAULT_CONTEXT_TOKENS",
    "MIN_BUDGET_TOKENS",
    "MODES",
    "Mode",
]

MAX_MODEL_NAMES_CHARS = MAX_OVERRIDES_CHARS  # model_aliases, free_models, connection_prefixes: 64 KB as limit_overrides

MAX_EMBED_TIMEOUT_SECONDS = 30.0
DEFAULT_SUMMARY_TIMEOUT_SECONDS = 10.0
DEFAULT_SUMMARY_MAX_TOKENS = 400
MAX_SUMMARY_TIMEOUT_SECONDS = 120.0
SUMMARY_MAX_TOKENS_RANGE = (32, 4_000)
MAX_WINDOW_TOKENS = 10_000_000  # no model has a window this large; a bigger number is a typo
# Every integer valve's range, declared once for its Field (bounds and description); the check
# `read_settings` makes of values that did not come through pydantic reads the Field's bounds
# back (`valve_range`), for these and the float valves alike.
INT_RANGES: dict[str, tuple[int, int]] = {
    "priority": (-1_000_000, 1_000_000),
    "max_context_tokens": (0, MAX_WINDOW_TOKENS),
    "reserve_output_tokens": (0, 1_000_000),
    "ledger_retention_days": (1, 3_660),
    "keep_last_turns": (MIN_KEEP_LAST_TURNS, MAX_FLAG_KEEP),
    "growth_turns": (0, 10),
    "state_ttl_hours": (1, 8_760),
    "summary_max_tokens": SUMMARY_MAX_TOKENS_RANGE,
    "embed_max_texts": (1, 1_000),
}

_SECRET: dict[str, Any] = {"input": {"type": "password"}}
# A mode we cannot read fails open, like any internal error: bodies pass unchanged, usage
# and would-be savings are still recorded, and the admin is told which valve is wrong.
FALLBACK_MODE: Mode = "shadow"
LIMIT_STORE_FAILURES = ("fail-open", "fail-closed")
CACHE_HINTS = ("auto", "off")


def _number(value: float) -> str:
    """A bound as the form shows it: 1,000 for whole numbers, 0.1 otherwise."""
    return f"{int(value):,}" if float(value).is_integer() else f"{value:g}"


def range_note(low: float, high: float, *, above: bool = False) -> str:
    """How a valve's description ends: its allowed range, so the admin reads it before saving
    (Open WebUI 0.12.4's save error does not name the field: tests/e2e/test_valves_form.py)."""
    return f"(Above {_number(low)}, at most {_number(high)}.)" if above else f"({_number(low)} to {_number(high)}.)"


def _bounded(default: float, description: str, *, low: float, high: float, above: bool = False, **extra: Any) -> Any:
    """A pydantic Field from `low` (excluded when `above`) to `high`, its range stated in its description."""
    text = f"{description} {range_note(low, high, above=above)}"
    if above:
        return Field(default=default, gt=low, le=high, description=text, **extra)
    return Field(default=default, ge=low, le=high, description=text, **extra)


def _int_field(name: str, default: int, description: str, **extra: Any) -> Any:
    """A pydantic Field bounded by `INT_RANGES[name]`, its range stated in its description."""
    low, high = INT_RANGES[name]
    return _bounded(default, description, low=low, high=high, **extra)


# What the valves form shows above each field (Open WebUI renders the schema's titles; without
# them it shows the field name, e.g. "Redis Url"). The admin's window and a user's own prompt
# budget share a field name, so their titles tell them apart.
TITLES = {
    "mode": "Mode: enforce, shadow or off",
    "max_context_tokens": "Context window of the model (tokens, 0 = the model's own)",
    "reserve_output_tokens": "Tokens kept free for the reply",
    "strategy": "What a trim keeps: relevance or recent",
    "keep_last_turns": "Latest turns always kept",
    "low_watermark": "Share of the budget a new trim fills",
    "growth_turns": "Room left for this many more turns",
    "allowed_user_flags": "Inline flags users may use",
    "state_ttl_hours": "Remember a chat's trim and pins for (hours)",
    "show_status": "Show status lines above replies",
    "openrouter_pricing": "Live prices from OpenRouter",
    "pricing_file": "Your own price file (path)",
    "model_aliases": "Model aliases for pricing (JSON)",
    "free_models": "Models that cost nothing",
    "connection_prefixes": "Connection prefixes to strip before pricing",
    "pricing_ttl_hours": "Refresh live prices after (hours)",
    "request_stream_usage": "Ask streamed replies for real usage",
    "prompt_cache_hints": "Prompt-cache markers for Claude: auto or off",
    "daily_limit_usd": "Daily spending limit per user (USD, 0 = none)",
    "monthly_limit_usd": "Monthly spending limit per user (USD, 0 = none)",
    "daily_limit_tokens": "Daily token limit per user (0 = none)",
    "monthly_limit_tokens": "Monthly token limit per user (0 = none)",
    "limit_overrides": "Limit overrides by role, group or user (JSON)",
    "show_spend": "Show users their spend",
    "limit_store_failure": "When usage totals cannot be read: fail-open or fail-closed",
    "ledger_retention_days": "Keep usage totals for (days)",
    "redis_url": "Redis URL (shared state between workers)",
    "semantic_relevance": "Use Open WebUI's embedder for relevance",
    "embed_timeout_seconds": "Longest embedder wait per turn (seconds)",
    "embed_max_texts": "Most texts embedded per turn",
    "summary_enabled": "Summarize what a trim drops",
    "summary_base_url": "Summary API base URL",
    "summary_api_key": "Summary API key",
    "summary_model": "Summary model",
    "summary_timeout_seconds": "Longest summary wait (seconds)",
    "summary_max_tokens": "Longest summary (tokens)",
    "calibrate_counts": "Learn each model's token count correction",
    "priority": "Filter order (lower runs first)",
}
USER_TITLES = {
    "max_context_tokens": "Your own prompt budget (tokens, 0 = the admin's)",
    "show_status": "Show status lines above replies",
    "show_cost": "Show what each reply cost",
    "show_spend": "Show my spend today",
}


def _titled(titles: dict[str, str]) -> ConfigDict:
    """A model config giving each field its title from `titles` (one place for the form's words).
    A validation error quotes no input: Open WebUI logs it, and the input holds the secrets."""
    return ConfigDict(
        field_title_generator=lambda name, _info: titles.get(name, name.replace("_", " ").capitalize()),
        hide_input_in_errors=True,
    )


# Open WebUI's endpoint that stores the admin's valves (0.12.4: routers/functions.py). It builds
# `Valves(**form)` and answers HTTP 400, storing nothing, when that raises. Everywhere else the
# stored values are built the same way (before every hook; when the code is updated) and a raise
# would fail every chat or refuse the update, so bad values are refused only there (DESIGN.md).
SAVE_ENDPOINT = ("open_webui.routers.functions", "update_function_valves_by_id")


def built_by_save_endpoint(frame: FrameType | None) -> bool:
    """Whether the `Valves` whose validator `frame` called was built by Open WebUI's save endpoint
    itself: the first frame from there that is not pydantic's is that function (a `Valves()`
    built inside the check, or anywhere else, is not)."""
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith("pydantic"):
        frame = frame.f_back
    return frame is not None and (frame.f_globals.get("__name__"), frame.f_code.co_name) == SAVE_ENDPOINT


def save_problems(valves: Valves) -> list[ConfigError]:
    """What the filter would report of these valves on every turn (bad JSON, unknown names, a
    reserve over the window, a summary endpoint it cannot call, a redis_url that is no Redis
    URL): each names its valve; checked without any I/O."""
    problems = read_settings(valves)[1]
    try:
        open_store(valves.redis_url)  # parses the URL; connects to nothing
    except ConfigError as exc:
        problems.append(exc)
    return problems


class Valves(BaseModel):
    """Admin settings (Admin > Functions > contextwarden > Valves)."""

    model_config = _titled(TITLES)

    mode: str = Field(
        default="enforce",
        description=(
            "enforce = trim chats to the budget; shadow = send chats unchanged but record and show what trimming would "
            "have sent and saved; off = no trimming, usage and cost still recorded."
        ),
        json_schema_extra={"enum": list(MODES)},
    )
    max_context_tokens: int = _int_field(
        "max_context_tokens",
        0,
        "Context window in tokens. 0 = the model's own context length when Open WebUI or the price table knows it, "
        f"else {DEFAULT_CONTEXT_TOKENS:,}; a window set here is never above the model's own when that is known. "
        "Open WebUI's built-in tool definitions count against it (about 3.2k "
        "tokens a user's chat, 3.9k an admin's, with its 30 built-in tools): under about 6k, use a larger window "
        "or turn off Builtin Tools in the model's capabilities.",
    )
    reserve_output_tokens: int = _int_field(
        "reserve_output_tokens",
        1_024,
        "Tokens kept free for the reply; the prompt budget is the window minus this. Must be below the window.",
    )
    strategy: str = Field(
        default=DEFAULT_STRATEGY,
        description=(
            "What a trim keeps of the older history: relevance = the messages that matter most to the latest question "
            "(BM25 and friends); recent = the newest whole turns that fit (no scoring: the cheapest trim of a long "
            "chat never seen)."
        ),
        json_schema_extra={"enum": list(STRATEGIES)},
    )
    keep_last_turns: int = _int_field(
        "keep_last_turns",
        DEFAULT_KEEP_LAST_TURNS,
        "The latest turns always kept, the current one included (users can change it per message with !keep=N).",
    )
    low_watermark: float = _bounded(
        DEFAULT_LOW_WATERMARK,
        "When a chat must be trimmed, trim it to this share of the budget, then let it grow until the budget is "
        "reached again, so the sent prefix stays the same (and provider prompt caches hit) for several turns. 1 fills "
        "the budget.",
        low=0,
        high=1,
        above=True,
    )
    growth_turns: int = _int_field(
        "growth_turns",
        DEFAULT_GROWTH_TURNS,
        "Below a low_watermark of 1, a new trim also leaves room for this many more turns the size of the last one "
        "(never more than half the budget), so chats with long turns keep their prefix as long as chats with short "
        "ones. 0: the watermark alone.",
    )
    allowed_user_flags: str = Field(
        default=DEFAULT_ALLOWED_FLAGS,
        description=(
            f"Inline flags users may put in a message, comma-separated, from: {', '.join(FLAG_NAMES)} (* = all). full "
            "bypasses the budget and is off by default. Empty = none."
        ),
    )
    state_ttl_hours: int = _int_field(
        "state_ttl_hours",
        DEFAULT_STATE_TTL_HOURS,
        "How long a chat's remembered trim decision and pins are kept after its last message.",
    )
    show_status: bool = Field(default=True, description="Show what was trimmed and what a reply cost above each reply.")
    openrouter_pricing: bool = Field(
        default=True,
        description=(
            "Refresh prices from OpenRouter's public model list in the background. Off for air-gapped installs (the "
            "bundled prices are used)."
        ),
    )
    pricing_file: str = Field(
        default="",
        description=(
            "Path to your own pricing.json (same format as the bundled one); its models win over live and bundled "
            "prices. Empty = none."
        ),
    )
    model_aliases: str = Field(
        default="",
        description=(
            'JSON object mapping model ids (or * globs) to price-table ids, e.g. `{"my-gpt": "openai/gpt-4o"}`.'
        ),
    )
    free_models: str = Field(
        default="",
        description=(
            "Models that cost nothing (local Ollama models, say): ids or * globs, comma-separated or a JSON list, e.g. "
            '"llama*, qwen3:*".'
        ),
    )
    connection_prefixes: str = Field(
        default="",
        description=(
            'Open WebUI connection prefix ids to strip before pricing, comma-separated, e.g. "openrouter,azure".'
        ),
    )
    pricing_ttl_hours: float = _bounded(
        DEFAULT_PRICING_TTL_HOURS,
        "How old live OpenRouter prices may get, in hours, before a background refresh.",
        low=MIN_PRICING_TTL_HOURS,
        high=MAX_PRICING_TTL_HOURS,
    )
    request_stream_usage: bool = Field(
        default=True,
        description=(
            "Ask OpenAI-compatible backends for usage in streamed replies (stream_options.include_usage), so costs are "
            "real, not estimates."
        ),
    )
    prompt_cache_hints: str = Field(
        default="auto",
        description=(
            "auto = mark the stable start of each prompt with cache_control breakpoints for models that cache only "
            "what is marked (Claude through OpenRouter), so repeated prefixes are billed at the cache-read price; off "
            "= never add them."
        ),
        json_schema_extra={"enum": list(CACHE_HINTS)},
    )
    daily_limit_usd: float = _bounded(
        0,
        "Each user's spending limit per UTC day in USD (priced replies); a turn over it is refused before the model is "
        "called. 0 = none. Admins are not limited unless limit_overrides names the admin role.",
        low=0,
        high=float(MAX_LIMIT_USD),
    )
    monthly_limit_usd: float = _bounded(
        0, "Each user's spending limit per calendar month (UTC) in USD. 0 = none.", low=0, high=float(MAX_LIMIT_USD)
    )
    daily_limit_tokens: int = _bounded(
        0,
        "Each user's limit per UTC day in tokens (prompt + completion, priced or not). 0 = none.",
        low=0,
        high=MAX_LIMIT_TOKENS,
    )
    monthly_limit_tokens: int = _bounded(
        0, "Each user's limit per calendar month (UTC) in tokens. 0 = none.", low=0, high=MAX_LIMIT_TOKENS
    )
    limit_overrides: str = Field(
        default="",
        description=(
            "JSON limits by Open WebUI role, group (id or name) and user id; the most specific wins, and of several "
            'groups the most generous. E.g. `{"roles": {"user": {"daily_usd": 2}}, "groups": {"research": '
            '{"monthly_usd": 100}}, "users": {"<user id>": {"daily_tokens": 0}}}`. Keys: daily_usd, monthly_usd, '
            "daily_tokens, monthly_tokens (0 = none)."
        ),
    )
    show_spend: bool = Field(
        default=False,
        description=(
            "Show every user what they spent today in the status line above each reply, also users without a limit "
            "(users with one see it anyway, unless they hide it)."
        ),
    )
    limit_store_failure: str = Field(
        default="fail-open",
        description=(
            "When the usage store (Redis) cannot be read to check a limit: fail-open = let the turn go (logged); "
            "fail-closed = refuse it."
        ),
        json_schema_extra={"enum": list(LIMIT_STORE_FAILURES)},
    )
    ledger_retention_days: int = _int_field(
        "ledger_retention_days",
        DEFAULT_LEDGER_RETENTION_DAYS,
        "How long per user / model / day usage totals are kept (in Redis or in-process).",
    )
    redis_url: str = Field(
        default="",
        description="redis://host:6379/0 to share state and usage totals between workers; empty = in-process.",
        json_schema_extra=_SECRET,
    )
    semantic_relevance: bool = Field(
        default=True,
        description=(
            "Use Open WebUI's own embedding model (the one RAG uses) beside word matching to find what matters to the "
            "latest question. Off, or with no embedder loaded, relevance is word matching only."
        ),
    )
    embed_timeout_seconds: float = _bounded(
        DEFAULT_EMBED_TIMEOUT,
        "Longest wait for the embedder per turn, in seconds; past it that turn uses word matching while the "
        "embedder goes on in the background (each reply's chat is embedded ahead of the next turn).",
        low=0,
        high=MAX_EMBED_TIMEOUT_SECONDS,
        above=True,
    )
    embed_max_texts: int = _int_field(
        "embed_max_texts",
        DEFAULT_EMBED_TEXTS,
        "Most texts embedded per turn, newest first (a long message is embedded in pieces of a line or two); a long "
        "chat seen for the first time is embedded over a few turns.",
    )
    summary_enabled: bool = Field(
        default=False,
        description=(
            "Condense what a trim drops into a short note, with one call to the summary endpoint below (cached)."
        ),
    )
    summary_base_url: str = Field(
        default="",
        description=(
            "OpenAI-compatible API base for summaries, e.g. https://api.openai.com/v1 or http://localhost:11434/v1."
        ),
    )
    summary_api_key: str = Field(
        default="", description="API key for the summary endpoint (sent as a Bearer token).", json_schema_extra=_SECRET
    )
    summary_model: str = Field(default="", description="Model that writes summaries, e.g. gpt-4o-mini.")
    summary_timeout_seconds: float = _bounded(
        DEFAULT_SUMMARY_TIMEOUT_SECONDS,
        "Longest wait for a summary, in seconds; past it the chat goes on without one.",
        low=0,
        high=MAX_SUMMARY_TIMEOUT_SECONDS,
        above=True,
    )
    summary_max_tokens: int = _int_field(
        "summary_max_tokens",
        DEFAULT_SUMMARY_MAX_TOKENS,
        "Longest summary in tokens; this much of the budget is set aside for it when one is added.",
    )
    calibrate_counts: bool = Field(
        default=True,
        description="Learn per model how far our token counts are from the provider's and shrink budgets to match.",
    )
    priority: int = _int_field(
        "priority", 0, "Filter order: lower runs first. Keep contextwarden after filters that add content."
    )

    @model_validator(mode="after")
    def _refuse_bad_values_at_save(self) -> Valves:
        """A save with a value the filter could not use answers HTTP 400 and stores nothing;
        anywhere else (values already stored) the filter reports them and goes on."""
        if built_by_save_endpoint(sys._getframe(1)) and (problems := save_problems(self)):
            raise ValueError("contextwarden: " + "; ".join(str(p) for p in problems))
        return self


class UserValves(BaseModel):
    """Per-user settings (chat > Controls > Valves)."""

    model_config = _titled(USER_TITLES)

    max_context_tokens: int = _int_field(
        "max_context_tokens",
        0,
        "Your own prompt budget in tokens; 0 = the admin's. It can only lower the admin's budget.",
    )
    show_status: bool = Field(default=True, description="Show the context and cost lines above replies.")
    show_cost: bool = Field(
        default=True, description="Show what each reply cost (in dollars) in the status line above it."
    )
    show_spend: bool = Field(
        default=True,
        description=(
            "Show what you spent today (and your limit) in the status line above each reply; shown when you have a "
            "limit or the admin shows spend to everyone."
        ),
    )


def _field(valves: object, name: str, default):
    value = getattr(valves, name, default)
    if type(value) is type(default) or (type(default) is float and type(value) is int):
        return value, None  # exact: True is not an int token budget
    return default, ConfigError(f"{name} has the wrong type ({type(value).__name__}); using {default!r}", valve=name)


def _names_text(text: object, valve: str) -> str:
    """A model-name valve's text, refused (ConfigError naming it) past MAX_MODEL_NAMES_CHARS."""
    text = text if isinstance(text, str) else ""
    if len(text) > MAX_MODEL_NAMES_CHARS:
        raise ConfigError(f"{valve} is longer than {MAX_MODEL_NAMES_CHARS:,} characters; not used", valve=valve)
    return text


def _parse_globs(text: str, valve: str) -> tuple[str, ...]:
    """A comma/newline list or a JSON list of ids or globs.

    Raises:
        ConfigError: a JSON list that is not valid, or holds something other than strings.
    """
    if not text.strip().startswith("["):
        return parse_model_globs(text)
    try:
        items = json.loads(text)
    except ValueError as exc:
        raise ConfigError(
            f"{valve} is not a valid JSON list ({exc}); or write ids separated by commas", valve=valve
        ) from None
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise ConfigError(f"{valve} must be a list of model id strings", valve=valve)
    return tuple(i.strip() for i in items if i.strip())


def valves_key(valves: object | None) -> tuple | None:
    """A snapshot of a valves object's values (`()` for None; hashable unless a value is not),
    or None when the object keeps no `__dict__`.

    Example:
        >>> valves_key(Valves()) == valves_key(Valves()), valves_key(Valves()) == valves_key(Valves(mode="shadow"))
        (True, False)
    """
    if valves is None:
        return ()
    try:
        return (type(valves), tuple(vars(valves).items()))
    except TypeError:
        return None


@functools.lru_cache(maxsize=VALVE_RANGE_MEMO_SIZE)
def valve_range(name: str, model: type[BaseModel] = Valves) -> tuple[float, float, bool]:
    """A numeric valve's bounds as its pydantic Field holds them: (low, high, low excluded).

    Example:
        >>> valve_range("low_watermark"), valve_range("keep_last_turns")
        ((0, 1, True), (1, 1000, False))
    """
    low, high, above = None, None, False
    for bound in model.model_fields[name].metadata:  # annotated_types Gt / Ge / Le
        if getattr(bound, "gt", None) is not None:
            low, above = bound.gt, True
        elif getattr(bound, "ge", None) is not None:
            low = bound.ge
        if getattr(bound, "le", None) is not None:
            high = bound.le
    if low is None or high is None:
        raise TypeError(f"valve {name} has no lower and upper bound")
    return low, high, above


register("valves.valve_range", valve_range.cache_clear)


def _inside(value: Any, name: str, model: type[BaseModel] = Valves) -> bool:
    """Whether `value` is inside the valve's Field range (NaN never is)."""
    low, high, above = valve_range(name, model)
    return bool((low < value if above else low <= value) and value <= high)


def _range_words(name: str, model: type[BaseModel] = Valves) -> str:
    """The valve's Field range as a problem states it: `1 to 1,000`, `above 0 and at most 1`."""
    low, high, above = valve_range(name, model)
    return f"above {_number(low)} and at most {_number(high)}" if above else f"{_number(low)} to {_number(high)}"


def read_settings(valves: object, user_valves: object | None = None) -> tuple[Settings, list[ConfigError]]:
    """Settings from the admin's and the user's valves, with every problem found.

    A bad value never raises: the default is used for it and the problem is returned,
    naming the valve, so the chat goes on and the admin is told.
    """
    problems: list[ConfigError] = []
    defaults = Valves()

    def take(source: object, name: str, default):
        value, problem = _field(source, name, default)
        if problem:
            problems.append(problem)
        return value

    def number(source: object, name: str, default: Any, model: type[BaseModel] = Valves) -> Any:
        return _in_range(take(source, name, default), name, default, problems, model)

    window, reserve = _window(valves, number, defaults, problems)
    aliases, globs = _model_names(valves, take, problems)
    ttl = number(valves, "pricing_ttl_hours", defaults.pricing_ttl_hours)
    retention = number(valves, "ledger_retention_days", defaults.ledger_retention_days)
    user_window, show, show_cost, show_spend = _user_view(valves, user_valves, take, number)
    allowed = _allowed_flags(valves, take, problems)
    strategy = _one_of(take(valves, "strategy", DEFAULT_STRATEGY), "strategy", STRATEGIES, DEFAULT_STRATEGY, problems)
    keep = number(valves, "keep_last_turns", defaults.keep_last_turns)
    watermark = number(valves, "low_watermark", DEFAULT_LOW_WATERMARK)
    growth = number(valves, "growth_turns", DEFAULT_GROWTH_TURNS)
    ttl_hours = number(valves, "state_ttl_hours", DEFAULT_STATE_TTL_HOURS)
    summary = _summary_config(valves, take, ttl_hours * 3600, problems)
    embed_timeout = number(valves, "embed_timeout_seconds", DEFAULT_EMBED_TIMEOUT)
    embed_texts = number(valves, "embed_max_texts", DEFAULT_EMBED_TEXTS)
    mode, cache_hints = _modes(valves, take, problems)
    switches = _switches(valves, take, problems)  # read in this order: problems are told in it
    settings = Settings(
        **switches,
        max_context_tokens=window,
        user_max_context_tokens=user_window,
        reserve_output_tokens=reserve,
        model_aliases=aliases,
        show_status=show,
        show_cost=show_cost,
        pricing_ttl_hours=float(ttl),
        free_models=globs["free_models"],
        connection_prefixes=globs["connection_prefixes"],
        ledger_retention_days=retention,
        strategy=strategy,
        keep_last_turns=keep,
        low_watermark=watermark,
        growth_turns=growth,
        state_ttl_seconds=ttl_hours * 3600,
        allowed_flags=allowed,
        summary=summary,
        mode=mode,
        embed_timeout_seconds=float(embed_timeout),
        embed_max_texts=embed_texts,
        show_spend=show_spend,
        prompt_cache_hints=cache_hints,
    )
    return settings, problems


def _modes(valves: object, take, problems: list[ConfigError]) -> tuple[Mode, str]:
    """The filter's mode and the prompt-cache hints setting."""
    mode = _one_of(
        take(valves, "mode", "enforce"), "mode", MODES, FALLBACK_MODE, problems, " (chats are sent unchanged)"
    )
    cache_hints = _one_of(
        take(valves, "prompt_cache_hints", "auto"), "prompt_cache_hints", CACHE_HINTS, "auto", problems
    )
    return mode, cache_hints


def _switches(valves: object, take, problems: list[ConfigError]) -> dict:
    """The valves taken as they are (the store, prices, usage, calibration, embedder, limits)."""
    return {
        "redis_url": take(valves, "redis_url", ""),
        "openrouter_pricing": take(valves, "openrouter_pricing", True),
        "pricing_file": take(valves, "pricing_file", "").strip(),
        "request_stream_usage": take(valves, "request_stream_usage", True),
        "calibrate_counts": take(valves, "calibrate_counts", True),
        "semantic_relevance": take(valves, "semantic_relevance", True),
        "limits": _limit_rules(valves, take, problems),
        "limit_store_failure": _one_of(
            take(valves, "limit_store_failure", "fail-open"),
            "limit_store_failure",
            LIMIT_STORE_FAILURES,
            "fail-open",
            problems,
        ),
        "spend_for_all": take(valves, "show_spend", False),
    }


def _window(valves: object, number, defaults: Valves, problems: list[ConfigError]) -> tuple[int, int]:
    """The admin's window and output reserve (the reserve below the window)."""
    window = number(valves, "max_context_tokens", defaults.max_context_tokens)
    reserve = number(valves, "reserve_output_tokens", defaults.reserve_output_tokens)
    if window and reserve >= window:
        problems.append(
            ConfigError(
                "reserve_output_tokens must be below max_context_tokens; using 1/4 of the window",
                valve="reserve_output_tokens",
            )
        )
        reserve = window // 4
    return window, reserve


def _model_names(
    valves: object, take, problems: list[ConfigError]
) -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """The model aliases, and the free-model and connection-prefix globs (each valve at most
    MAX_MODEL_NAMES_CHARS: they are matched against every request's model)."""
    try:
        aliases = parse_aliases(_names_text(take(valves, "model_aliases", ""), "model_aliases"))
    except ConfigError as exc:
        problems.append(exc)
        aliases = {}
    globs: dict[str, tuple[str, ...]] = {}
    for name in ("free_models", "connection_prefixes"):
        try:
            globs[name] = _parse_globs(_names_text(take(valves, name, ""), name), name)
        except ConfigError as exc:
            problems.append(exc)
            globs[name] = ()
    return aliases, globs


def _user_view(valves: object, user_valves: object | None, take, number) -> tuple[int, bool, bool, bool]:
    """A user's window, and whether they see status lines, costs and their spend."""
    user_window, show, show_cost, show_spend = 0, take(valves, "show_status", True), True, True
    if user_valves is not None:
        user_window = number(user_valves, "max_context_tokens", 0, UserValves)
        show = show and take(user_valves, "show_status", True)
        show_cost = take(user_valves, "show_cost", True)
        show_spend = take(user_valves, "show_spend", True)
    return user_window, show, show_cost, show_spend


def _allowed_flags(valves: object, take, problems: list[ConfigError]) -> frozenset[str]:
    allowed, unknown = parse_flag_names(take(valves, "allowed_user_flags", DEFAULT_ALLOWED_FLAGS))
    if unknown:
        problems.append(
            ConfigError(
                f"allowed_user_flags: {len(unknown)} unknown flag name(s), ignored (known: {', '.join(FLAG_NAMES)})",
                valve="allowed_user_flags",
            )
        )
    return allowed


def _limit_rules(valves: object, take, problems: list[ConfigError]) -> LimitRules:
    """The limit valves and their overrides; a bad value is named and counts as no limit."""
    amounts: dict[str, Any] = {}
    for name, kind in (
        ("daily_limit_usd", "daily_usd"),
        ("monthly_limit_usd", "monthly_usd"),
        ("daily_limit_tokens", "daily_tokens"),
        ("monthly_limit_tokens", "monthly_tokens"),
    ):
        value = take(valves, name, 0.0 if kind.endswith("usd") else 0)
        ceiling = Decimal(valve_range(name)[1])
        amount = read_decimal(value, ceiling=ceiling) if kind.endswith("usd") else value  # the money parser
        if amount is None or not _inside(amount, name):
            problems.append(
                ConfigError(f"{name} must be {_range_words(name)} (0 = none); no such limit used", valve=name)
            )
            amount = 0
        amounts[kind] = amount
    base = Limits(**amounts)
    try:
        return parse_overrides(take(valves, "limit_overrides", ""), base)
    except ConfigError as exc:
        problems.append(exc)
        return LimitRules(base=base)


def _in_range(
    value: Any, valve: str, fallback: Any, problems: list[ConfigError], model: type[BaseModel] = Valves
) -> Any:
    """`value` when inside the valve's Field range; else `fallback`, with the problem named."""
    if _inside(value, valve, model):
        return value
    problems.append(
        ConfigError(f"{valve} must be {_range_words(valve, model)}; using {_number(fallback)}", valve=valve)
    )
    return fallback


def _one_of(
    value: str, valve: str, choices: tuple[str, ...], fallback: str, problems: list[ConfigError], consequence: str = ""
) -> Any:
    """`value` as one of `choices` (spaces and case ignored); else `fallback`, with the problem named."""
    value = value.strip().lower()
    if value in choices:
        return value
    problems.append(
        ConfigError(f"{valve} must be one of {', '.join(choices)}; using {fallback}{consequence}", valve=valve)
    )
    return fallback


def _summary_config(valves: object, take, ttl: int, problems: list[ConfigError]) -> SummaryConfig | None:
    """The summary endpoint when summaries are on and configured; problems name the valve (never the key)."""
    if not take(valves, "summary_enabled", False):
        return None
    base_url = take(valves, "summary_base_url", "").strip()
    model = take(valves, "summary_model", "").strip()
    timeout = take(valves, "summary_timeout_seconds", DEFAULT_SUMMARY_TIMEOUT_SECONDS)
    max_tokens = take(valves, "summary_max_tokens", DEFAULT_SUMMARY_MAX_TOKENS)
    found: list[ConfigError] = []
    if (url_problem := endpoint_problem(base_url)) is not None:
        found.append(ConfigError(f"summary_base_url {url_problem}; summaries are off", valve="summary_base_url"))
    if not model:
        found.append(ConfigError("summary_model is empty; summaries are off", valve="summary_model"))
    for name, value in (("summary_timeout_seconds", timeout), ("summary_max_tokens", max_tokens)):
        if not _inside(value, name):
            found.append(ConfigError(f"{name} must be {_range_words(name)}; summaries are off", valve=name))
    api_key = take(valves, "summary_api_key", "").strip()
    if (bad_key := key_problem(api_key)) is not None:
        found.append(ConfigError(f"summary_api_key {bad_key}; summaries are off", valve="summary_api_key"))
    problems.extend(found)
    if found:
        return None
    return SummaryConfig(
        base_url=base_url, model=model, api_key=api_key, timeout=timeout, max_tokens=max_tokens, ttl=ttl
    )
