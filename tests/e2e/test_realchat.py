"""Issue 15 in the real Open WebUI 0.12.4: chats as Open WebUI really makes them.

Browser chats carry the built-in tool definitions in ``body["tools"]`` (an API caller that sends
``tools`` gets them passed through unchanged, so the request hook sees what a browser chat's
sees), and a pinned message must survive turn after turn of a chat that needs trimming.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from contextwarden.budget import fixed_cost
from contextwarden.tokens import TokenCounter
from fake_backend import FakeBackend, expected_prompt_tokens, tool_definition_tokens
from owui import OpenWebUI, chat, set_valves
from test_product import MODEL, WINDOW, RESERVE, assert_valid_prompt, base_valves, cw, is_subsequence, long_chat, one_usage_record, product  # noqa: F401

pytestmark = pytest.mark.e2e

BUILTIN_TOOLS = json.loads((Path(__file__).parents[1] / "fixtures" / "owui_builtin_tools_0.12.4.json").read_text("utf-8"))
BROWSER_TOOLS = BUILTIN_TOOLS[:36]


def test_browser_body_with_tools_fits_with_its_definitions(
    open_webui: OpenWebUI, backend: FakeBackend, cw: str, counter: TokenCounter
) -> None:
    """36 definitions (~3.7k tokens) and a 200-message chat in an 8,000 window: what reaches the
    backend, definitions included, fits the 7,500 budget; the usage line counts both."""
    set_valves(open_webui, cw, {**base_valves(), "max_context_tokens": 8_000})
    sent = long_chat()
    since = open_webui.log_mark()
    chat(open_webui, MODEL, sent, tools=BROWSER_TOOLS)
    request = backend.last_request
    assert request["tools"] == BROWSER_TOOLS
    got = request["messages"]
    assert len(got) < len(sent) and is_subsequence(got, sent)
    assert_valid_prompt(sent, got)
    tools = fixed_cost({"tools": BROWSER_TOOLS}, counter, MODEL).tools
    total = counter.count_messages(got, MODEL) + tools
    assert 7_500 * 0.5 < total <= 7_500
    record = one_usage_record(open_webui, since)
    assert record["estimated_prompt_tokens"] == total
    assert record["prompt_tokens"] == expected_prompt_tokens(got, BROWSER_TOOLS)
    assert tool_definition_tokens(BROWSER_TOOLS) > tools  # the backend bills them (its own rule)


def test_definitions_alone_over_the_window_send_the_question_whole(
    open_webui: OpenWebUI, backend: FakeBackend, cw: str, counter: TokenCounter
) -> None:
    """The issue's case: a 4,000 window, 500 reserved, 36 definitions over the 3,500 budget on
    their own: only the system prompt and the question go, unshortened (no cut could fit)."""
    sent = long_chat()
    since = open_webui.log_mark()
    chat(open_webui, MODEL, sent, tools=BROWSER_TOOLS)
    got = backend.last_request["messages"]
    assert got == [sent[0], sent[-1]]
    tools = fixed_cost({"tools": BROWSER_TOOLS}, counter, MODEL).tools
    assert tools > WINDOW - RESERVE - 64
    assert one_usage_record(open_webui, since)["estimated_prompt_tokens"] == counter.count_messages(got, MODEL) + tools
