"""`Settings`: what the admin's and the user's valves mean for one call, checked and frozen.

`valves.read_settings` makes it (a bad value replaced by its default, the problem named); every
other part reads it. The window and budget rules that follow from it live here: the window (the
valve's, at most the model's own; else the model's; else DEFAULT_CONTEXT_TOKENS), less the
reserve for the reply, lowered by the user's own budget, never below MIN_BUDGET_TOKENS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..core.selection import DEFAULT_KEEP_LAST_TURNS, DEFAULT_STRATEGY, Strategy
from ..core.trim import DEFAULT_GROWTH_TURNS, DEFAULT_LOW_WATERMARK
from ..errors import ConfigError
from ..money.ledger import DEFAULT_LEDGER_RETENTION_DAYS
from ..money.limits import LimitRules
from ..money.live_prices import DEFAULT_PRICING_TTL_HOURS
from .embedder import DEFAULT_EMBED_TEXTS, DEFAULT_EMBED_TIMEOUT
from .summarize import SummaryConfig

__all__ = ["Settings", "Mode", "MODES", "DEFAULT_CONTEXT_TOKENS", "MIN_BUDGET_TOKENS", "DEFAULT_STATE_TTL_HOURS"]

DEFAULT_CONTEXT_TOKENS = 8_192  # when neither the valve nor the model says how big the window is
MIN_BUDGET_TOKENS = 64  # below this no prompt with a system message and a question fits
DEFAULT_STATE_TTL_HOURS = 72
Mode = Literal["enforce", "shadow", "off"]
MODES: tuple[Mode, ...] = ("enforce", "shadow", "off")


@dataclass(frozen=True, slots=True)
class Settings:
    """Valves checked and combined for one call."""

    max_context_tokens: int
    user_max_context_tokens: int
    reserve_output_tokens: int
    redis_url: str
    model_aliases: dict[str, str]
    show_status: bool
    show_cost: bool = True
    openrouter_pricing: bool = True
    pricing_ttl_hours: float = DEFAULT_PRICING_TTL_HOURS
    pricing_file: str = ""
    free_models: tuple[str, ...] = ()
    connection_prefixes: tuple[str, ...] = ()
    request_stream_usage: bool = True
    calibrate_counts: bool = True
    ledger_retention_days: int = DEFAULT_LEDGER_RETENTION_DAYS
    strategy: Strategy = DEFAULT_STRATEGY
    keep_last_turns: int = DEFAULT_KEEP_LAST_TURNS
    low_watermark: float = DEFAULT_LOW_WATERMARK
    growth_turns: int = DEFAULT_GROWTH_TURNS
    state_ttl_seconds: int = DEFAULT_STATE_TTL_HOURS * 3600
    allowed_flags: frozenset[str] = frozenset()
    summary: SummaryConfig | None = None
    mode: Mode = "enforce"
    semantic_relevance: bool = True
    embed_timeout_seconds: float = DEFAULT_EMBED_TIMEOUT
    embed_max_texts: int = DEFAULT_EMBED_TEXTS
    limits: LimitRules = LimitRules()
    limit_store_failure: str = "fail-open"
    show_spend: bool = True
    spend_for_all: bool = False
    prompt_cache_hints: str = "auto"

    def window_budget(self, model_context: int | None) -> int:
        """The window (valve, else the model's, else the default) less the reserve: no budget,
        calibrated or not, goes past it. A reserve at or above the window keeps a quarter of it."""
        window = self.window(model_context)
        return window - (self.reserve_output_tokens if self.reserve_output_tokens < window else window // 4)

    def window(self, model_context: int | None) -> int:
        """The context window: the valve's, else the model's, else the default. The valve's is
        never above the model's own when that is known: one valve serves every model, and a
        chat switched to a 4,096-token model was sent 7,100 tokens under an 8,000 valve."""
        if self.max_context_tokens and model_context:
            return min(self.max_context_tokens, model_context)
        return self.max_context_tokens or model_context or DEFAULT_CONTEXT_TOKENS

    def budget(self, model_context: int | None) -> int:
        """The prompt budget: the window (valve, else the model's, else the default) less the reserve,
        lowered by the user's own budget."""
        budget = self.window_budget(model_context)
        if self.user_max_context_tokens:
            budget = min(budget, self.user_max_context_tokens)
        return max(budget, MIN_BUDGET_TOKENS)

    def reserve_problem(self, model_context: int | None) -> ConfigError | None:
        """The problem when the reserve is not below the window `budget` uses (read_settings
        checks it against the valve's own window; this, against the model's)."""
        if self.reserve_output_tokens < self.window(model_context):
            return None
        return ConfigError(
            "reserve_output_tokens is not below this model's context window; using 1/4 of the window",
            valve="reserve_output_tokens",
        )
