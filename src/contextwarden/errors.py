"""Exceptions factored out to avoid import loops.

ContextWardenError
├── ConfigError        a valve (or option) has a value we cannot use; names the valve
├── PricingError       a price table could not be loaded or parsed
└── TurnRefused        a turn stopped on purpose (a limit); its text is shown to the user

Shared state has no error of its own: the store falls back to memory and the filter goes on
(fail open), so a Redis failure surfaces as the redis client's or Python's ConnectionError.
"""

from __future__ import annotations

__all__ = ["ContextWardenError", "ConfigError", "PricingError", "TurnRefused"]


class ContextWardenError(Exception):
    """Base class of every error contextwarden raises on purpose."""


class ConfigError(ContextWardenError):
    """A valve or option value is unusable; `valve` names it for the admin."""

    def __init__(self, message: str, *, valve: str | None = None) -> None:
        super().__init__(message)
        self.valve = valve


class PricingError(ContextWardenError):
    """A price table could not be loaded or parsed."""


class TurnRefused(ContextWardenError):
    """A turn stopped on purpose before the model is called (a spending limit, an admin
    command's answer). Its text is for the user: Open WebUI shows it. The hooks' fail-open
    wrapper re-raises it; never put message text, keys or emails in it."""
