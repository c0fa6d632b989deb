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

from contextwarden.core.tokens import TokenCounter
from contextwarden.face.budget import fixed_cost

from fake_backend import FakeBackend, expected_prompt_tokens, tool_definition_tokens
from helpers import BUILT_FILE
from owui import OpenWebUI, chat, install_function, set_valves, start_open_webui
from test_product import (
    BUDGET,
    MODEL,
    RESERVE,
    WINDOW,
    assert_valid_prompt,
    base_valves,
    cw,
    is_subsequence,
    long_chat,
    one_usage_record,
    product,
)  # noqa: F401

pytestmark = pytest.mark.e2e

BUILTIN_TOOLS = json.loads(
    (Path(__file__).parents[1] / "fixtures" / "owui_builtin_tools_0.12.4.json").read_text("utf-8")
)
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


def test_pinned_message_survives_turn_after_turn(
    open_webui: OpenWebUI, backend: FakeBackend, cw: str, counter: TokenCounter
) -> None:
    """A ~1,400-token message pinned with ``!pin`` in a 2,976-token budget is sent on every one
    of six later turns of the chat (a temporary chat id keeps the pin), flag text removed."""
    set_valves(open_webui, cw, {**base_valves(), "max_context_tokens": 2_976 + RESERVE})
    chat_id = f"temporary:{uuid.uuid4()}"
    notes = "Project notes to keep: " + " ".join(f"item{k} quartz{k % 13} harbor" for k in range(280))
    assert 1_300 <= counter.count_text(notes, MODEL) <= 1_500
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "Be careful."},
        {"role": "user", "content": notes + " !pin"},
    ]
    chat(open_webui, MODEL, history, chat_id=chat_id)
    assert backend.last_request["messages"][1]["content"] == notes
    for turn in range(6):
        answer = f"Answer {turn}: " + " ".join(f"step{k} willow{turn}" for k in range(330))
        history = history + [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": f"Next {turn} {uuid.uuid4().hex[:6]}?"},
        ]
        chat(open_webui, MODEL, history, chat_id=chat_id)
        got = backend.last_request["messages"]
        assert any(m.get("content") == notes for m in got), f"the pin was dropped on turn {turn}"
        assert counter.count_messages(got, MODEL) <= 2_976
    assert len(got) < len(history)  # the chat was being trimmed


def test_first_request_of_a_freshly_started_server(
    owui_venv: Path, fake_backend: FakeBackend, tmp_path_factory: pytest.TempPathFactory, counter: TokenCounter
) -> None:
    """A server of its own, started for this test (no encoding loaded in its process): the
    built file is installed and the very first chat, ~200 messages, is trimmed to fill the
    budget, not starved (the issue saw 362 of 2,976 tokens), and counted exactly when the
    encodings load within the bounded wait; its savings are never more than the chat."""
    fresh = start_open_webui(owui_venv, fake_backend, tmp_path_factory.mktemp("fresh-open-webui"))
    try:
        install_function(
            fresh, "contextwarden", BUILT_FILE.read_text("utf-8"), valves=base_valves(), name="contextwarden"
        )
        fake_backend.reset()
        sent = long_chat()
        since = fresh.log_mark()
        chat(fresh, MODEL, sent)
        got = fake_backend.last_request["messages"]
        assert is_subsequence(got, sent)
        assert_valid_prompt(sent, got)
        exact = counter.count_messages(got, MODEL)
        assert BUDGET * 0.55 <= exact <= BUDGET
        record = one_usage_record(fresh, since)
        fresh.timings["first_request_exact"] = float(record["estimated_prompt_tokens"] == exact)
        assert record["tokens_saved"] <= counter.count_messages(sent, MODEL) - exact
    finally:
        fresh.stop()


def excerpt_of(message: dict[str, Any], got: list[dict[str, Any]]) -> bool:
    """Whether `got` holds an excerpt of `message`: its role, contextwarden's cut marker, and
    only passages of the original text (an answer too large for the room goes that way)."""
    for candidate in got:
        content = candidate.get("content")
        if candidate.get("role") != message["role"] or not isinstance(content, str) or CUT_WORDS not in content:
            continue
        passages = [line.strip() for line in content.split("\n") if line.strip() and CUT_WORDS not in line]
        if passages and all(passage in message["content"] for passage in passages):
            return True
    return False


CUT_WORDS = "tokens cut by contextwarden"


def test_long_answers_go_with_their_questions(
    open_webui: OpenWebUI, backend: FakeBackend, cw: str, counter: TokenCounter
) -> None:
    """The issue's chat in an 8,192 window (1,024 reserved): ten questions with ~3.5k-token
    answers, then "Continue with the next step". The defaults sent the ten questions and none
    of their answers; now the latest answer goes with its question and no turn goes in part
    (an earlier answer too large for the room may go as an excerpt, with its question)."""
    set_valves(open_webui, cw, {**base_valves(), "max_context_tokens": 8_192, "reserve_output_tokens": 1_024})
    sent: list[dict[str, Any]] = [{"role": "system", "content": "You are a patient tutor."}]
    for step in range(10):
        sent += [
            {"role": "user", "content": f"Step {step}: and then? {uuid.uuid4().hex[:6]}"},
            {
                "role": "assistant",
                "content": f"Step {step} answer: " + " ".join(f"part{k} lantern{step}" for k in range(800)),
            },
        ]
    sent.append({"role": "user", "content": "Continue with the next step"})
    assert 3_000 <= counter.count_message(sent[2], MODEL) <= 4_000
    chat(open_webui, MODEL, sent)
    got = backend.last_request["messages"]
    assert_valid_prompt(sent, got)
    assert got[-3:] == sent[-3:], "the latest answer and its question were not sent"
    for question, answer in zip(sent[1:-1:2], sent[2:-1:2], strict=True):
        answer_sent = answer in got or excerpt_of(answer, got)
        assert (question in got) == answer_sent, "a turn was sent in part"
    assert counter.count_messages(got, MODEL) <= 8_192 - 1_024
