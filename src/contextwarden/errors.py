"""Exceptions factored out to avoid import loops.

    ContextWardenError
    ├── ConfigError        a valve (or option) has a value we cannot use; names the valve
    ├── StoreError         shared state (Redis) could not be read or written
    └── PricingError       a price table could not be loaded or parsed
"""

from __future__ import annotations

__all__ = ["ContextWardenError", "ConfigError", "StoreError", "PricingError"]


class ContextWardenError(Exception):
    """Base class of every error contextwarden raises on purpose."""


class ConfigError(ContextWardenError):
    """A valve or option value is unusable; `valve` names it for the admin."""

    def __init__(self, message: str, *, valve: str | None = None) -> None:
        super().__init__(message)
        self.valve = valve


class StoreError(ContextWardenError):
    """Shared state could not be read or written."""


class PricingError(ContextWardenError):
    """A price table could not be loaded or parsed."""
