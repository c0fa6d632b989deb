"""`Valves` (admin) and `UserValves` (per user), and the settings derived from them.

Valves are parsed once per call into a frozen `Settings`; problems are collected as
`ConfigError`s naming the valve, so the filter can report them and go on.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, Field

from .errors import ConfigError
from .pricing import parse_aliases

__all__ = ["Valves", "UserValves", "Settings", "read_settings", "DEFAULT_CONTEXT_TOKENS"]

DEFAULT_CONTEXT_TOKENS = 8_192  # when neither the valve nor the model says how big the window is
MIN_BUDGET_TOKENS = 64  # below this no prompt with a system message and a question fits

_SECRET = {"input": {"type": "password"}}


class Valves(BaseModel):
    """Admin settings (Admin > Functions > contextwarden > Valves)."""

    priority: int = Field(default=0, description="Filter order: lower runs first. Keep contextwarden after filters that add content.")
    max_context_tokens: int = Field(
        default=0,
        ge=0,
        description=f"Context window in tokens. 0 = the model's own context length when Open WebUI or the price table knows it, else {DEFAULT_CONTEXT_TOKENS:,}.",
    )
    reserve_output_tokens: int = Field(
        default=1_024, ge=0, description="Tokens kept free for the reply; the prompt budget is the window minus this."
    )
    redis_url: str = Field(
        default="",
        description="redis://host:6379/0 to share state and usage totals between workers; empty = in-process.",
        json_schema_extra=_SECRET,
    )
    model_aliases: str = Field(
        default="",
        description='JSON object mapping model ids (or * globs) to price-table ids, e.g. {"my-gpt": "openai/gpt-4o"}.',
    )
    show_status: bool = Field(default=True, description="Show what was trimmed and what a reply cost above each reply.")


class UserValves(BaseModel):
    """Per-user settings (chat > Controls > Valves)."""

    show_status: bool = Field(default=True, description="Show the context and cost lines above replies.")
    max_context_tokens: int = Field(
        default=0, ge=0, description="Your own context budget in tokens; 0 = the admin's. It can only lower the admin's budget."
    )


@dataclass(frozen=True, slots=True)
class Settings:
    """Valves checked and combined for one call."""

    max_context_tokens: int
    user_max_context_tokens: int
    reserve_output_tokens: int
    redis_url: str
    model_aliases: dict[str, str]
    show_status: bool

    def budget(self, model_context: int | None) -> int:
        """The prompt budget: the window (valve, else the model's, else the default) less the reserve,
        lowered by the user's own budget."""
        window = self.max_context_tokens or model_context or DEFAULT_CONTEXT_TOKENS
        budget = window - self.reserve_output_tokens
        if self.user_max_context_tokens:
            budget = min(budget, self.user_max_context_tokens)
        return max(budget, MIN_BUDGET_TOKENS)


def _field(valves: object, name: str, default):
    value = getattr(valves, name, default)
    if type(value) is type(default):  # exact: True is not an int token budget
        return value, None
    return default, ConfigError(f"{name} has the wrong type ({type(value).__name__}); using {default!r}", valve=name)


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

    window = take(valves, "max_context_tokens", defaults.max_context_tokens)
    reserve = take(valves, "reserve_output_tokens", defaults.reserve_output_tokens)
    if window < 0:
        problems.append(ConfigError("max_context_tokens must be 0 or more; using 0", valve="max_context_tokens"))
        window = 0
    if reserve < 0 or (window and reserve >= window):
        problems.append(
            ConfigError(f"reserve_output_tokens ({reserve}) must be below max_context_tokens ({window}); using 1/4 of it", valve="reserve_output_tokens")
        )
        reserve = window // 4
    try:
        aliases = parse_aliases(take(valves, "model_aliases", ""))
    except ConfigError as exc:
        problems.append(exc)
        aliases = {}
    user_window, show = 0, take(valves, "show_status", True)
    if user_valves is not None:
        user_window = max(0, take(user_valves, "max_context_tokens", 0))
        show = show and take(user_valves, "show_status", True)
    settings = Settings(
        max_context_tokens=window,
        user_max_context_tokens=user_window,
        reserve_output_tokens=reserve,
        redis_url=take(valves, "redis_url", ""),
        model_aliases=aliases,
        show_status=show,
    )
    return settings, problems
