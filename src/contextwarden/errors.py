"""Exceptions factored out to avoid import loops.

ContextWardenError
├── ConfigError        a valve (or option) has a value we cannot use; names the valve
├── PricingError       a price table could not be loaded or parsed
└── TurnRefused        a turn stopped on purpose (a limit); its text is shown to the user
asyncio.CancelledError
└── AnsweredInChat     a browser chat's turn the filter answered itself (`!usage`): ends it quietly

Shared state has no error of its own: the store falls back to memory and the filter goes on
(fail open), so a Redis failure surfaces as the redis client's or Python's ConnectionError.
"""

from __future__ import annotations

import asyncio

__all__ = ["AnsweredInChat", "ContextWardenError", "ConfigError", "PricingError", "TurnRefused"]


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


class AnsweredInChat(asyncio.CancelledError):
    """A browser chat's turn the filter answered itself, its answer already written into the
    reply (`!usage`): raised from `inlet` to end the turn before the model is called, as Open
    WebUI's Stop button does. Open WebUI 0.12.4 runs a browser chat's turn as a task
    (`main.py` `chat_completion`: `create_task(process_chat(...))` when the request has a
    session, chat and message id); `process_chat` turns any `Exception` from `inlet` into a
    `chat:message:error` event, which the page shows as an error under the reply and a red
    toast (`Chat.svelte` `handleOpenAIError`), but answers a `CancelledError` with
    `chat:tasks:cancel`: the reply is marked done, nothing else is shown. Only for such a task
    (`hookargs.runs_as_chat_task`): an API caller, an automation's run or a sub-agent awaits
    the turn and would get no answer. Its text is never shown."""
