"""A small OpenAI-compatible chat backend for end-to-end tests.

It runs in a thread on 127.0.0.1, records every ``POST /v1/chat/completions`` body and answers
with deterministic usage numbers, so a test can predict what Open WebUI (and the filter) will
see:

- ``prompt_tokens`` = :func:`expected_prompt_tokens` of the request's messages: for each message
  ``len(text) // 4 + 3``, where ``text`` is the string content, or the joined ``text`` parts of
  a multimodal content list, plus the JSON of any assistant ``tool_calls``; plus the request's
  tool definitions (:func:`tool_definition_tokens`), which providers bill on every call.
- ``completion_tokens`` = ``max(1, len(reply_text) // 4)`` (tool-call replies: of the JSON of
  the calls).
- ``prompt_tokens_details.cached_tokens`` = :attr:`FakeBackend.cached_tokens` (default 0),
  capped at ``prompt_tokens``.

Streaming answers are SSE ``data: {chunk}`` lines ending with ``data: [DONE]``; a final usage
chunk (``choices: []``) is sent only when the request has ``stream_options.include_usage``
true, as the real OpenAI API does.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = [
    "DEFAULT_MODELS",
    "FakeBackend",
    "ScriptedReply",
    "completion_tokens_for",
    "expected_prompt_tokens",
    "tool_definition_tokens",
    "message_text",
]

DEFAULT_MODELS: list[dict[str, Any]] = [
    {"id": "gpt-4o", "object": "model", "created": 1715367049, "owned_by": "system"},
    {"id": "openai/gpt-4o-mini", "object": "model", "created": 1721172741, "owned_by": "openai"},
    # An OpenRouter-style entry (no owned_by): the Claude id the filter marks with cache breakpoints.
    {"id": "anthropic/claude-sonnet-4.5", "object": "model", "created": 1759161676, "context_length": 1000000},
    {
        "id": "small-ctx-model",
        "object": "model",
        "created": 1700000000,
        "owned_by": "fake",
        "context_length": 4096,
    },
]
"""Models listed by ``GET /v1/models``; one carries a ``context_length``."""

STREAM_PIECE_CHARS = 8
"""Characters of reply text per streamed content chunk."""


def message_text(message: dict[str, Any]) -> str:
    """Return the text the fake backend counts for one message."""
    content = message.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "".join(
            part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text"
        )
    else:
        text = ""
    if message.get("tool_calls"):
        text += json.dumps(message["tool_calls"], sort_keys=True)
    return text


def tool_definition_tokens(tools: Any) -> int:
    """Return what the fake backend bills for a request's ``tools``, as providers do: every
    definition is rendered into the prompt (OpenAI: about 7 tokens a function plus its name,
    description and parameters, 12 at the end); here ``len(text) // 4 + 7`` per definition,
    text being the name, description and the JSON of the parameters, plus 12."""
    if not isinstance(tools, list) or not tools:
        return 0
    total = 12
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        function = function if isinstance(function, dict) else {"name": json.dumps(tool)}
        text = f"{function.get('name', '')}:{function.get('description', '')}:" + json.dumps(
            function.get("parameters") or {}, sort_keys=True, separators=(",", ":")
        )
        total += len(text) // 4 + 7
    return total


def expected_prompt_tokens(messages: list[dict[str, Any]], tools: Any = None) -> int:
    """Return the ``prompt_tokens`` the fake backend reports for these messages (and tools)."""
    return sum(len(message_text(m)) // 4 + 3 for m in messages) + tool_definition_tokens(tools)


def completion_tokens_for(text: str) -> int:
    """Return the ``completion_tokens`` the fake backend reports for a reply text."""
    return max(1, len(text) // 4)


@dataclass
class ScriptedReply:
    """One reply a test queues with :meth:`FakeBackend.push_reply`.

    ``status`` other than 200 answers with ``{"error": {"message": error}}``. ``usage`` replaces
    the computed usage dict entirely when given. ``piece_delay`` seconds pass between streamed
    content chunks (a slow model, for a client that stops the stream mid-way).
    """

    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    status: int = 200
    error: str = "scripted error"
    piece_delay: float = 0.0


@dataclass
class FakeBackend:
    """An OpenAI-compatible server in a thread; see the module docstring for the numbers."""

    models: list[dict[str, Any]] = field(default_factory=lambda: [dict(m) for m in DEFAULT_MODELS])
    cached_tokens: int = 0
    default_reply: str = "Hello from the fake backend. This reply is deterministic."
    requests: list[dict[str, Any]] = field(default_factory=list)
    """Every ``POST /v1/chat/completions`` body, in arrival order."""
    headers: list[dict[str, str]] = field(default_factory=list)
    """The request headers of each recorded body (same index as :attr:`requests`)."""

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._script: deque[ScriptedReply] = deque()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> FakeBackend:
        """Bind a free port on 127.0.0.1 and serve in a daemon thread."""
        backend = self

        class Handler(_Handler):
            fake = backend

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-openai", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    @property
    def port(self) -> int:
        """The bound port."""
        assert self._server is not None, "backend not started"
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        """Base URL including ``/v1``, as Open WebUI's ``OPENAI_API_BASE_URL`` wants it."""
        return f"http://127.0.0.1:{self.port}/v1"

    # --- test controls -----------------------------------------------------------------------

    def push_reply(self, reply: ScriptedReply | None = None, /, **kwargs: Any) -> None:
        """Queue the reply for the next chat request (FIFO); kwargs build a ScriptedReply."""
        with self._lock:
            self._script.append(reply if reply is not None else ScriptedReply(**kwargs))

    def reset(self) -> None:
        """Forget recorded requests and queued replies; restore the default cached tokens."""
        with self._lock:
            self.requests.clear()
            self.headers.clear()
            self._script.clear()
            self.cached_tokens = 0

    @property
    def last_request(self) -> dict[str, Any]:
        """The most recent chat request body."""
        with self._lock:
            assert self.requests, "the backend has received no chat request"
            return self.requests[-1]

    # --- internals ---------------------------------------------------------------------------

    def _record(self, body: dict[str, Any], headers: dict[str, str]) -> ScriptedReply | None:
        with self._lock:
            self.requests.append(body)
            self.headers.append(headers)
            return self._script.popleft() if self._script else None

    def usage_for(self, messages: list[dict[str, Any]], completion_text: str, tools: Any = None) -> dict[str, Any]:
        """Build the usage dict this backend reports for a request and reply."""
        prompt = expected_prompt_tokens(messages, tools)
        completion = completion_tokens_for(completion_text)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": min(self.cached_tokens, prompt)},
            "completion_tokens_details": {"reasoning_tokens": 0},
        }


class _Handler(BaseHTTPRequestHandler):
    """HTTP handler; ``fake`` is bound to the owning FakeBackend by a subclass."""

    fake: FakeBackend
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        """Stay quiet."""

    def _send_json(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        """Serve ``/v1/models`` (also ``/models``)."""
        if self.path.rstrip("/") in ("/v1/models", "/models"):
            self._send_json(200, {"object": "list", "data": self.fake.models})
        else:
            self._send_json(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        """Serve ``/v1/chat/completions`` (also ``/chat/completions``)."""
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if self.path.rstrip("/") not in ("/v1/chat/completions", "/chat/completions"):
            self._send_json(404, {"error": {"message": f"no route {self.path}"}})
            return
        try:
            body = json.loads(raw or b"{}")
        except json.JSONDecodeError:
            self._send_json(400, {"error": {"message": "invalid JSON"}})
            return
        headers = {k.lower(): v for k, v in self.headers.items() if k.lower() != "authorization"}
        script = self.fake._record(body, headers) or ScriptedReply()
        if script.status != 200:
            self._send_json(script.status, {"error": {"message": script.error, "type": "fake"}})
            return

        messages = body.get("messages") or []
        model = body.get("model") or "unknown"
        content = script.content
        if content is None and not script.tool_calls:
            content = self.fake.default_reply
        counted = content or json.dumps(script.tool_calls or [], sort_keys=True)
        usage = script.usage if script.usage is not None else self.fake.usage_for(messages, counted, body.get("tools"))
        finish = script.finish_reason or ("tool_calls" if script.tool_calls else "stop")
        ident = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())

        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            try:
                self._stream(
                    ident, created, model, content, script.tool_calls, finish, usage, include_usage, script.piece_delay
                )
            except (BrokenPipeError, ConnectionResetError):  # the caller stopped the stream
                pass
            return

        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        if script.tool_calls:
            message["tool_calls"] = script.tool_calls
        self._send_json(
            200,
            {
                "id": ident,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
                "usage": usage,
                "system_fingerprint": "fp_fake",
            },
        )

    def _stream(
        self,
        ident: str,
        created: int,
        model: str,
        content: str | None,
        tool_calls: list[dict[str, Any]] | None,
        finish: str,
        usage: dict[str, Any],
        include_usage: bool,
        piece_delay: float = 0.0,
    ) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> None:
            payload: dict[str, Any] = {
                "id": ident,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "system_fingerprint": "fp_fake",
                "choices": choices,
            }
            if include_usage:
                payload["usage"] = None
            payload.update(extra)
            self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
            self.wfile.flush()

        chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        for start in range(0, len(content or ""), STREAM_PIECE_CHARS):
            piece = (content or "")[start : start + STREAM_PIECE_CHARS]
            chunk([{"index": 0, "delta": {"content": piece}, "finish_reason": None}])
            time.sleep(piece_delay)
        for position, call in enumerate(tool_calls or []):
            delta_call = {"index": position, **call}
            chunk([{"index": 0, "delta": {"tool_calls": [delta_call]}, "finish_reason": None}])
        chunk([{"index": 0, "delta": {}, "finish_reason": finish}])
        if include_usage:
            chunk([], usage=usage)
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
