"""Prompt-cache breakpoints inside a real Open WebUI 0.12.4: the built file marks a Claude model's
stable prefix (`cache_control` on content parts) and what reaches the recording backend shows what
Open WebUI passes on; other models get no marker; the valve turns it off."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from contextwarden.core.tokens import TokenCounter

from fake_backend import FakeBackend
from owui import OpenWebUI, chat, set_valves
from test_product import _filler, base_valves, cw, long_chat, one_usage_record, product  # noqa: F401  (fixtures)

pytestmark = pytest.mark.e2e

CLAUDE = "anthropic/claude-sonnet-4.5"
MARKER = {"type": "ephemeral"}


def marked(messages: list[dict[str, Any]]) -> list[int]:
    return [
        i
        for i, m in enumerate(messages)
        if isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and "cache_control" in p for p in m["content"])
    ]


def big_system_chat() -> list[dict[str, Any]]:
    """`long_chat` with a system prompt over Claude's 1,024-token minimum on its own."""
    messages = long_chat(turns=30)
    messages[0] = {"role": "system", "content": "You are careful. " + _filler(7, 6_000)}
    return messages


def test_claude_prefix_arrives_marked_and_the_text_unchanged(
    open_webui: OpenWebUI, backend: FakeBackend, cw: str, counter: TokenCounter
) -> None:
    sent = big_system_chat()
    assert counter.count_messages(sent[:1], CLAUDE) >= 1_024  # the filter marks the system prompt too (unit tests)
    since = open_webui.log_mark()
    chat(open_webui, CLAUDE, sent, chat_id=f"temporary:{uuid.uuid4()}")
    got = backend.last_request["messages"]
    positions = marked(got)
    assert positions and positions[-1] == len(got) - 1, "the end of the carried prefix carries a breakpoint"
    last = got[-1]
    # Open WebUI passes a list content with cache_control through to the backend unchanged:
    assert last["content"] == [{"type": "text", "text": sent[-1]["content"], "cache_control": MARKER}]
    assert all(p["cache_control"] == MARKER for i in positions for p in got[i]["content"] if "cache_control" in p)
    assert len(positions) <= 4
    # Finding: Open WebUI's merge_system_messages (after the request hook) rebuilds the system
    # message as a plain string, so the system prompt's own marker never reaches the provider; the
    # prefix marker after it caches the system prompt too.
    assert got[0]["role"] == "system" and isinstance(got[0]["content"], str) and 0 not in positions
    assert got[0]["content"] == sent[0]["content"]
    assert one_usage_record(open_webui, since)["resolved_model"] == CLAUDE


def test_no_markers_for_gpt4o_or_with_the_valve_off(open_webui: OpenWebUI, backend: FakeBackend, cw: str) -> None:
    chat(open_webui, "gpt-4o", big_system_chat(), chat_id=f"temporary:{uuid.uuid4()}")
    assert marked(backend.last_request["messages"]) == []
    set_valves(open_webui, cw, {**base_valves(), "prompt_cache_hints": "off"})
    chat(open_webui, CLAUDE, big_system_chat(), chat_id=f"temporary:{uuid.uuid4()}")
    got = backend.last_request["messages"]
    assert marked(got) == [] and all(isinstance(m.get("content"), (str, type(None))) for m in got)
