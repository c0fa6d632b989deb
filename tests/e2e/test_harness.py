"""Smoke test of the e2e harness: a tiny handwritten filter inside a real Open WebUI.

The probe's inlet appends a marker system message (text from an admin valve and a user
valve); its outlet logs ``usage {json}`` on the ``contextwarden`` logger. The tests prove that
the fake backend sees what inlet did, and that outlet runs for API callers and its INFO line
reaches the server log, for non-streaming and streaming chats.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from fake_backend import FakeBackend, expected_prompt_tokens
from owui import (
    OpenWebUI,
    chat,
    get_user_valves,
    installed_function,
    reply_text,
    set_user_valves,
    set_valves,
    wait_for_log,
)

pytestmark = pytest.mark.e2e

PROBE_ID = "e2e_probe"
PROBE_SOURCE = '''"""
title: e2e probe
author: contextwarden e2e harness
version: 0.0.1
"""

from __future__ import annotations

import json
import logging

from pydantic import BaseModel

log = logging.getLogger("contextwarden")


class Filter:
    class Valves(BaseModel):
        priority: int = 0
        marker: str = "E2E-MARKER"
        force_usage: bool = False
        raise_in_inlet: bool = False

    class UserValves(BaseModel):
        tag: str = "none"

    def __init__(self) -> None:
        self.valves = self.Valves()

    def inlet(self, body: dict, __user__: dict | None = None) -> dict:
        user_valves = (__user__ or {}).get("valves")
        tag = getattr(user_valves, "tag", "absent")
        if self.valves.raise_in_inlet:
            raise ValueError("probe inlet refused")
        marker = {"role": "system", "content": f"{self.valves.marker} tag={tag}"}
        body["messages"] = [*body.get("messages", []), marker]
        if self.valves.force_usage and body.get("stream"):
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        return body

    async def outlet(self, body: dict, __metadata__: dict | None = None, __event_emitter__=None) -> dict:
        messages = body.get("messages") or []
        last = messages[-1] if messages else {}
        users = [m for m in messages if m.get("role") == "user"]
        record = {
            "nonce": (users[-1].get("content") if users else None),
            "usage": last.get("usage"),
            "last_role": last.get("role"),
            "last_keys": sorted(last),
            "body_keys": sorted(body),
            "chat_id": body.get("chat_id"),
            "metadata_chat_id": (__metadata__ or {}).get("chat_id"),
            "emitter": __event_emitter__ is not None,
        }
        log.info("usage %s", json.dumps(record, sort_keys=True, default=str))
        return body
'''


@pytest.fixture(scope="module")
def probe(open_webui: OpenWebUI) -> Iterator[str]:
    """Install the probe filter (global) for this module; return its id; delete it after."""
    with installed_function(open_webui, PROBE_ID, PROBE_SOURCE, valves={"marker": "E2E-MARKER"}):
        yield PROBE_ID


def _outlet_record(open_webui: OpenWebUI, nonce: str, since: int) -> dict[str, Any]:
    line = wait_for_log(open_webui, f'"nonce": "{nonce}"', timeout=20, since=since)
    return json.loads(line.split("usage ", 1)[1])


def _sent_texts(backend: FakeBackend) -> list[str]:
    return [str(m.get("content")) for m in backend.last_request["messages"]]


def test_backend_models_are_listed(open_webui: OpenWebUI, backend: FakeBackend) -> None:
    """Open WebUI lists the fake backend's models."""
    models = open_webui.api("GET", "/api/models")
    ids = {m["id"] for m in models["data"]}
    assert {"gpt-4o", "openai/gpt-4o-mini", "small-ctx-model"} <= ids


def test_non_streaming_chat_runs_inlet_and_outlet(open_webui: OpenWebUI, backend: FakeBackend, probe: str) -> None:
    """Inlet's marker reaches the backend; outlet logs the backend's real usage."""
    nonce = f"ping-{uuid.uuid4().hex[:8]}"
    since = open_webui.log_mark()
    started = time.monotonic()
    reply = chat(open_webui, "gpt-4o", [{"role": "user", "content": nonce}])
    assert reply_text(reply) == backend.default_reply

    sent = backend.last_request
    assert any("E2E-MARKER tag=none" in text for text in _sent_texts(backend)), sent["messages"]
    expected = expected_prompt_tokens(sent["messages"])
    assert reply["usage"]["prompt_tokens"] == expected

    record = _outlet_record(open_webui, nonce, since)
    assert record["last_role"] == "assistant"
    assert record["usage"]["prompt_tokens"] == expected
    assert record["usage"]["input_tokens"] == expected  # added by Open WebUI's normalize_usage
    assert record["chat_id"] == ""
    assert record["emitter"] is False
    print(f"non-streaming round trip {time.monotonic() - started:.2f} s; outlet saw {record}")


def test_streaming_chat_runs_inlet_and_outlet(open_webui: OpenWebUI, backend: FakeBackend, probe: str) -> None:
    """Streaming: the joined deltas are the reply; outlet still runs for the API caller."""
    nonce = f"ping-{uuid.uuid4().hex[:8]}"
    since = open_webui.log_mark()
    reply = chat(open_webui, "openai/gpt-4o-mini", [{"role": "user", "content": nonce}], stream=True)
    assert reply_text(reply) == backend.default_reply
    assert "errors" not in reply
    assert any("E2E-MARKER" in text for text in _sent_texts(backend))

    record = _outlet_record(open_webui, nonce, since)
    assert record["last_role"] == "assistant"
    # Open WebUI asks for stream usage only when the model's "usage" capability is on; a
    # connection model without a workspace entry has none, so no usage chunk comes back.
    include_usage = bool((backend.last_request.get("stream_options") or {}).get("include_usage"))
    assert (record["usage"] is not None) == include_usage
    print(f"streaming: stream_options sent={include_usage}; outlet saw {record}")


def test_streaming_usage_when_inlet_asks_for_it(open_webui: OpenWebUI, backend: FakeBackend, probe: str) -> None:
    """An inlet that sets stream_options.include_usage gets real usage in outlet."""
    set_valves(open_webui, probe, {"marker": "E2E-MARKER", "force_usage": True})
    try:
        nonce = f"ping-{uuid.uuid4().hex[:8]}"
        since = open_webui.log_mark()
        reply = chat(open_webui, "gpt-4o", [{"role": "user", "content": nonce}], stream=True)
        sent = backend.last_request
        assert sent["stream_options"] == {"include_usage": True}
        expected = expected_prompt_tokens(sent["messages"])
        assert reply["usage"]["prompt_tokens"] == expected
        record = _outlet_record(open_webui, nonce, since)
        assert record["usage"]["prompt_tokens"] == expected
    finally:
        set_valves(open_webui, probe, {"marker": "E2E-MARKER", "force_usage": False})


def test_user_valves_reach_inlet(open_webui: OpenWebUI, backend: FakeBackend, probe: str) -> None:
    """set_user_valves stores the caller's UserValves and inlet sees them."""
    stored = set_user_valves(open_webui, probe, {"tag": "alpha"})
    assert stored == {"tag": "alpha"}
    assert get_user_valves(open_webui, probe) == {"tag": "alpha"}
    try:
        chat(open_webui, "gpt-4o", [{"role": "user", "content": "valves?"}])
        assert any("E2E-MARKER tag=alpha" in text for text in _sent_texts(backend))
    finally:
        set_user_valves(open_webui, probe, {"tag": "none"})


# --- Open WebUI 0.12.4 behaviour the product relies on (see README.md) -------------------------


def test_system_messages_are_hoisted_and_merged(open_webui: OpenWebUI, backend: FakeBackend, probe: str) -> None:
    """A system message appended by inlet ends up merged into the first system message."""
    chat(
        open_webui,
        "gpt-4o",
        [{"role": "system", "content": "SYS1"}, {"role": "user", "content": "hi"}],
        temperature=0.25,
    )
    sent = backend.last_request
    assert [m["role"] for m in sent["messages"]] == ["system", "user"]
    assert sent["messages"][0]["content"] == "SYS1\nE2E-MARKER tag=none"
    assert sent["temperature"] == 0.25  # other body keys pass through ...
    assert "metadata" not in sent  # ... but metadata is stripped


def test_inlet_exception_is_http_400_for_api_callers(open_webui: OpenWebUI, backend: FakeBackend, probe: str) -> None:
    """An exception in inlet fails the turn; its message is the 400 detail."""
    set_valves(open_webui, probe, {"marker": "E2E-MARKER", "raise_in_inlet": True})
    try:
        for stream in (False, True):
            answer = chat(open_webui, "gpt-4o", [{"role": "user", "content": "x"}], stream=stream, expect=None)
            assert answer == {"status_code": 400, "body": {"detail": "probe inlet refused"}}
        assert backend.requests == []
    finally:
        set_valves(open_webui, probe, {"marker": "E2E-MARKER", "raise_in_inlet": False})


def test_non_streaming_tool_call_reply_skips_outlet(open_webui: OpenWebUI, backend: FakeBackend, probe: str) -> None:
    """Non-streaming API replies without text (tool_calls only) never reach outlet."""
    nonce = f"tool-{uuid.uuid4().hex[:8]}"
    since = open_webui.log_mark()
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    backend.push_reply(tool_calls=[call])
    reply = chat(open_webui, "gpt-4o", [{"role": "user", "content": nonce}])
    assert reply["choices"][0]["message"]["tool_calls"] == [call]
    assert reply["usage"]["prompt_tokens"] == expected_prompt_tokens(backend.last_request["messages"])
    # Outlet runs inline before a non-streaming answer returns: a later chat's line proves the
    # log has caught up, and the tool-call turn left none.
    later = f"ping-{uuid.uuid4().hex[:8]}"
    chat(open_webui, "gpt-4o", [{"role": "user", "content": later}])
    _outlet_record(open_webui, later, since)
    assert nonce not in open_webui.log_text(since)
