"""Reading real usage out of an outlet message (placeholder until the money branch lands)."""

from __future__ import annotations

from dataclasses import dataclass

from .conversation import Message

__all__ = ["Usage", "read_usage"]


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts a backend reported; None = not reported."""

    prompt_tokens: int | None
    completion_tokens: int | None


def read_usage(message: Message) -> Usage | None:
    """Usage from `message["usage"]`, else `message["info"]["usage"]`."""
    raw = message.get("usage")
    if not isinstance(raw, dict):
        info = message.get("info")
        raw = info.get("usage") if isinstance(info, dict) else None
    if not isinstance(raw, dict):
        return None
    prompt = raw.get("prompt_tokens", raw.get("input_tokens", raw.get("prompt_eval_count")))
    completion = raw.get("completion_tokens", raw.get("output_tokens", raw.get("eval_count")))
    if not isinstance(prompt, int) and not isinstance(completion, int):
        return None
    return Usage(prompt if isinstance(prompt, int) else None, completion if isinstance(completion, int) else None)
