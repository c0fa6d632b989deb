"""`Filter`: the Open WebUI face. Parses what Open WebUI passes, calls the core, returns the body.

One instance serves every user of a worker: per-request values live in locals and in
`__metadata__` (which Open WebUI hands from `inlet`/`request` to `outlet`), never on `self`.
Every hook fails open: on any internal error the body goes on as it came.
"""

from __future__ import annotations

import json
import logging
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

from .conversation import message_text
from .errors import ConfigError
from .store import MemoryStore, Store, open_store
from .tokens import TokenCounter
from .trim import TrimResult, trim_messages
from .usage import read_usage
from .valves import Settings, UserValves, Valves, read_settings

__all__ = ["Filter", "model_context_length"]

filter_log = logging.getLogger("contextwarden")

Emitter = Callable[[dict[str, Any]], Awaitable[Any]]
METADATA_KEY = "contextwarden"
MAX_REPORTED_PROBLEMS = 64


def model_context_length(model: dict[str, Any] | None) -> int | None:
    """The context window Open WebUI knows for a model, if any.

    Looks at the admin's `num_ctx` parameter, then what the connection's `/models` listed
    (`context_length` from OpenRouter, `max_model_len` from vLLM, `top_provider`).
    """
    if not isinstance(model, dict):
        return None
    info = model.get("info") if isinstance(model.get("info"), dict) else {}
    params = info.get("params") if isinstance(info.get("params"), dict) else {}
    listed = model.get("openai") if isinstance(model.get("openai"), dict) else {}
    top = listed.get("top_provider") if isinstance(listed.get("top_provider"), dict) else {}
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


def _base_model_id(body: dict[str, Any], model: dict[str, Any] | None) -> str:
    """The id that names the real model: a workspace model's base, else the body's model."""
    if isinstance(model, dict):
        info = model.get("info")
        if isinstance(info, dict) and isinstance(info.get("base_model_id"), str) and info["base_model_id"]:
            return info["base_model_id"]
    return str(body.get("model") or "")


def _is_chat_body(body: Any) -> bool:
    messages = body.get("messages") if isinstance(body, dict) else None
    return isinstance(messages, list) and all(isinstance(m, dict) for m in messages)


def _where(exc: BaseException) -> str:
    """`file:line` of the innermost frame, for a log line that carries no message text."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    last = frames[-1]
    return f"{last.filename.rsplit('/', 1)[-1]}:{last.lineno}"


def _status_line(result: TrimResult) -> str:
    before, after = len(result.kept) + len(result.dropped) + len(result.shortened), len(result.messages)
    if result.changed:
        line = f"Context {before:,} → {after:,} messages · {result.tokens_before:,} → {result.tokens_after:,} tokens"
    else:
        line = f"Context {after:,} messages · {result.tokens_after:,} tokens (fits {result.budget:,})"
    if result.shortened:
        line += f" · {len(result.shortened)} shortened"
    if result.over_budget:
        line += " · still over budget"
    if result.count_mode == "estimate":
        line += " · estimated (tokenizer not loaded)"
    return line


class Filter:
    """contextwarden for Open WebUI: trims each request to a token budget and logs real usage."""

    Valves = Valves
    UserValves = UserValves

    def __init__(self) -> None:
        self.valves = self.Valves()
        self._counter = TokenCounter()
        self._store: Store = MemoryStore()
        self._store_url = ""
        self._reported: set[str] = set()

    # -- hooks ------------------------------------------------------------------------------

    async def inlet(
        self,
        body: dict,
        __user__: dict | None = None,
        __metadata__: dict | None = None,
        __model__: dict | None = None,
        __event_emitter__: Emitter | None = None,
    ) -> dict:
        """Trim before Open WebUI adds RAG, memory and tools (older versions only have this hook)."""
        try:
            return await self._trim(body, __user__, __metadata__, __model__, __event_emitter__)
        except Exception as exc:
            return await self._failed("inlet", exc, body, __event_emitter__)

    async def request(
        self,
        body: dict,
        __user__: dict | None = None,
        __metadata__: dict | None = None,
        __model__: dict | None = None,
        __event_emitter__: Emitter | None = None,
    ) -> dict:
        """Trim right before each provider call, after RAG and tools were added (idempotent)."""
        try:
            return await self._trim(body, __user__, __metadata__, __model__, __event_emitter__)
        except Exception as exc:
            return await self._failed("request", exc, body, __event_emitter__)

    async def outlet(
        self,
        body: dict,
        __user__: dict | None = None,
        __metadata__: dict | None = None,
        __model__: dict | None = None,
        __event_emitter__: Emitter | None = None,
    ) -> dict:
        """Log what the reply really used: one `usage {json}` line, and a status line."""
        try:
            await self._record(body, __user__, __metadata__, __model__, __event_emitter__)
        except Exception as exc:
            return await self._failed("outlet", exc, body, __event_emitter__)
        return body

    # -- inlet / request ----------------------------------------------------------------------

    async def _trim(
        self,
        body: Any,
        user: dict | None,
        metadata: dict | None,
        model: dict | None,
        emit: Emitter | None,
    ) -> Any:
        if not _is_chat_body(body):
            return body
        metadata = metadata if isinstance(metadata, dict) else body.get("metadata")
        if isinstance(metadata, dict) and metadata.get("task"):
            return body
        settings = await self._settings(user, emit)
        model_id = _base_model_id(body, model)
        budget = settings.budget(model_context_length(model))
        result = trim_messages(body["messages"], max_tokens=budget, model=model_id, token_counter=self._counter)
        if isinstance(metadata, dict):
            metadata[METADATA_KEY] = {
                "estimated_prompt_tokens": result.tokens_after,
                "count_mode": result.count_mode,
                "budget": budget,
                "dropped": len(result.dropped),
            }
        if settings.show_status:
            await self._emit(emit, _status_line(result))
        if not result.changed:
            return body
        return {**body, "messages": result.messages}

    # -- outlet -----------------------------------------------------------------------------

    async def _record(
        self,
        body: Any,
        user: dict | None,
        metadata: dict | None,
        model: dict | None,
        emit: Emitter | None,
    ) -> None:
        if not _is_chat_body(body) or not body["messages"]:
            return
        settings = await self._settings(user, emit)
        metadata = metadata if isinstance(metadata, dict) else {}
        note = metadata.get(METADATA_KEY) if isinstance(metadata.get(METADATA_KEY), dict) else {}
        model_id = _base_model_id(body, model)
        reply = body["messages"][-1]
        usage = read_usage(reply)
        estimated_prompt = note.get("estimated_prompt_tokens")
        if usage is not None and usage.prompt_tokens is not None:
            prompt, completion, estimated = usage.prompt_tokens, usage.completion_tokens, False
        else:
            if not isinstance(estimated_prompt, int):
                estimated_prompt = self._counter.count_messages(body["messages"][:-1], model_id)
            prompt, estimated = estimated_prompt, True
            completion = self._counter.count_text(message_text(reply), model_id)
        record = {
            "model": model_id,
            "user_id": (user or {}).get("id"),
            "chat_id": body.get("chat_id") or metadata.get("chat_id") or None,
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "estimated": estimated,
            "estimated_prompt_tokens": estimated_prompt if isinstance(estimated_prompt, int) else None,
            "cost_usd": None,
        }
        filter_log.info("usage %s", json.dumps(record, separators=(",", ":")))
        if settings.show_status:
            mark = "~" if estimated else ""
            out = f"{completion:,}" if isinstance(completion, int) else "?"
            await self._emit(emit, f"{mark}{prompt:,} in · {mark}{out} out")

    # -- shared helpers -----------------------------------------------------------------------

    async def _settings(self, user: dict | None, emit: Emitter | None) -> Settings:
        user_valves = user.get("valves") if isinstance(user, dict) else None
        settings, problems = read_settings(self.valves, user_valves)
        for problem in problems:
            await self._report(problem, emit)
        if settings.redis_url != self._store_url:
            try:
                self._store = open_store(settings.redis_url)
            except ConfigError as exc:
                await self._report(exc, emit)
                self._store = MemoryStore()
            self._store_url = settings.redis_url
        return settings

    async def _report(self, problem: ConfigError, emit: Emitter | None) -> None:
        """Tell the admin about a bad valve: a warning once per process, a status every time."""
        text = f"contextwarden: {problem}"
        if text not in self._reported and len(self._reported) < MAX_REPORTED_PROBLEMS:
            self._reported.add(text)
            filter_log.warning("%s (valve %s)", text, problem.valve)
        await self._emit(emit, text)

    async def _failed(self, hook: str, exc: BaseException, body: Any, emit: Emitter | None) -> Any:
        filter_log.warning(
            "contextwarden: %s failed (%s at %s); body passed through unchanged", hook, type(exc).__name__, _where(exc)
        )
        await self._emit(emit, f"contextwarden skipped this {'reply' if hook == 'outlet' else 'turn'} (internal error)")
        return body

    @staticmethod
    async def _emit(emit: Emitter | None, description: str) -> None:
        if emit is None:
            return
        try:
            await emit({"type": "status", "data": {"description": description, "done": True}})
        except Exception as exc:  # a broken emitter must not cost the chat
            filter_log.debug("contextwarden: status not shown (%s)", type(exc).__name__)
