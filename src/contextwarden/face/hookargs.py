"""What Open WebUI hands a filter's hooks, read safely: the body's model and messages, the ids in
`__metadata__` (where the turn note travels, under METADATA_KEY), what `__model__` says of the
window and the backend, and the event emitter's type. Request input is hostile: every reader
here takes any shape and answers with a default.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from itertools import repeat
from typing import Any

__all__ = [
    "Emitter",
    "METADATA_KEY",
    "base_model_id",
    "chat_ids",
    "told_as_admin",
    "is_chat_body",
    "is_direct",
    "model_context_length",
    "runs_as_chat_task",
    "wants_stream_usage",
    "with_stream_usage",
]

Emitter = Callable[[dict[str, Any]], Awaitable[Any]]
METADATA_KEY = "contextwarden"


def dict_at(container: dict, key: str) -> dict:
    """`container[key]` when it is a dict, else a new empty one (request input is hostile)."""
    value = container.get(key)
    return value if isinstance(value, dict) else {}


def model_context_length(model: dict[str, Any] | None) -> int | None:
    """The context window Open WebUI knows for a model, if any.

    Looks at the admin's `num_ctx` parameter, then what the connection's `/models` listed
    (`context_length` from OpenRouter, `max_model_len` from vLLM, `top_provider`).
    """
    if not isinstance(model, dict):
        return None
    info = dict_at(model, "info")
    params = dict_at(info, "params")
    listed = dict_at(model, "openai")
    top = dict_at(listed, "top_provider")
    for value in (
        params.get("num_ctx"),
        listed.get("context_length"),
        listed.get("max_model_len"),
        top.get("context_length"),
        model.get("context_length"),
    ):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def base_model_id(body: dict[str, Any], model: dict[str, Any] | None) -> str:
    """The id that names the real model: a workspace model's base, else the body's model."""
    if isinstance(model, dict):
        info = model.get("info")
        if isinstance(info, dict) and isinstance(info.get("base_model_id"), str) and info["base_model_id"]:
            return info["base_model_id"]
    return str(body.get("model") or "")


def is_direct(model: dict[str, Any] | None) -> bool:
    """True for a direct connection's model: Open WebUI 0.12.4 takes it from the request
    (`model_item`, any signed-in user's to send) and relays its stream from the user's browser
    (`utils/chat.py` `generate_direct_chat_completion`), so what that stream reports is the client's."""
    return isinstance(model, dict) and bool(model.get("direct"))


def is_chat_body(body: Any) -> bool:
    """True when `body` is a dict whose `messages` is a list of dicts (a chat the filter reads)."""
    messages = body.get("messages") if isinstance(body, dict) else None
    return isinstance(messages, list) and all(map(isinstance, messages, repeat(dict)))


def wants_stream_usage(body: dict[str, Any], model: dict[str, Any] | None) -> bool:
    """True when a streamed request goes to an OpenAI-compatible connection that should be
    asked for usage (`stream_options.include_usage`) and has not been yet.

    Not for Ollama (`owned_by == "ollama"`), arena or pipe models (a pipe may call any API),
    direct connections, or an unknown backend (`__model__` missing). Open WebUI 0.12 keeps a
    connection's Responses-API or Azure api_version setting out of `__model__`, but drops
    `stream_options` itself where those do not take it.
    """
    if body.get("stream") is not True or not isinstance(model, dict):
        return False
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        return False
    if model.get("owned_by") != "openai" or "ollama" in model or model.get("pipe") or is_direct(model):
        return False
    return model.get("api_type") != "responses"


def with_stream_usage(body: dict[str, Any]) -> dict[str, Any]:
    """A new body asking for usage in the stream (the input is not changed)."""
    options = dict_at(body, "stream_options")
    return {**body, "stream_options": {**options, "include_usage": True}}


def chat_ids(body: dict[str, Any], user: dict | None, metadata: dict | None) -> tuple[str, str]:
    """The user id and chat id of a request ("" when unknown; API callers have no chat id)."""
    metadata = metadata or {}
    user_id = (user or {}).get("id") or metadata.get("user_id") or ""
    chat_id = metadata.get("chat_id") or body.get("chat_id") or ""
    return str(user_id), str(chat_id)


def told_as_admin(user: object) -> bool:
    """Whether `__user__` is told what admins are told (valve problems, the filter's own faults):
    an admin's, or one that names no role (Open WebUI always names it; API callers, scripts)."""
    role = user.get("role") if isinstance(user, dict) else None
    return role is None or role == "admin"


def runs_as_chat_task(metadata: dict | None, request: Any = None) -> bool:
    """Whether Open WebUI runs this turn as a browser chat's task, which nothing awaits (the
    page gets its reply through events): a session, chat and message id, and neither an
    automation's run nor an internal (sub-agent) request, whose caller awaits the task.
    Only such a turn may end with `AnsweredInChat`."""
    if not isinstance(metadata, dict) or metadata.get("automation_id"):
        return False
    if getattr(getattr(request, "state", None), "internal", False) is True:
        return False
    return all(isinstance(metadata.get(key), str) and metadata[key] for key in ("session_id", "chat_id", "message_id"))
