"""The summary note inside a real Open WebUI 0.12.4: with the summary valves set (the fake backend
doubles as the summary endpoint), what reaches the backend on two consecutive turns of one chat
has exactly the chat's system prompt as its system message, and the summary in a user message
after it; the second turn sends the first turn's prompt again from its start, summary included,
without a second summary call."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from contextwarden.core.tokens import TokenCounter
from contextwarden.face.summarize import SUMMARY_ACK, SUMMARY_LABEL, SUMMARY_PROMPT

from fake_backend import FakeBackend
from owui import OpenWebUI, chat, set_valves
from test_product import BUDGET, MODEL, base_valves, cw, long_chat, one_usage_record, product  # noqa: F401  (fixtures)

pytestmark = pytest.mark.e2e

SUMMARY_MODEL = "openai/gpt-4o-mini"
SUMMARY_TEXT = "Earlier the user asked 83 questions about quartz, cedar and harbors; tool lookups answered some."


def summary_valves(backend: FakeBackend) -> dict[str, Any]:
    return {
        **base_valves(),
        "summary_enabled": True,
        "summary_base_url": backend.url,
        "summary_model": SUMMARY_MODEL,
        "summary_api_key": "sk-e2e-summary",
        "summary_max_tokens": 200,
    }


def calls(backend: FakeBackend) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The recorded bodies split into summary calls (the summary model, our prompt) and chat calls."""
    summaries = [r for r in backend.requests if r.get("model") == SUMMARY_MODEL]
    chats = [r for r in backend.requests if r.get("model") == MODEL]
    assert len(summaries) + len(chats) == len(backend.requests)
    assert all(r["messages"][0] == {"role": "system", "content": SUMMARY_PROMPT} for r in summaries)
    return summaries, chats


def test_the_system_prompt_arrives_unchanged_and_the_summary_in_a_user_message(
    open_webui: OpenWebUI, backend: FakeBackend, cw: str, counter: TokenCounter
) -> None:
    set_valves(open_webui, cw, summary_valves(backend))
    backend.push_reply(content=SUMMARY_TEXT)  # the first call is the summary (inlet), then the chat
    chat_id = f"temporary:{uuid.uuid4()}"
    first_chat = long_chat()
    chat(open_webui, MODEL, first_chat, chat_id=chat_id)
    following = first_chat + [
        {"role": "assistant", "content": backend.default_reply},
        {"role": "user", "content": "Thanks, please go on."},
    ]
    since = open_webui.log_mark()
    chat(open_webui, MODEL, following, chat_id=chat_id)
    summaries, chats = calls(backend)
    assert len(summaries) == 1 and len(chats) == 2, "one summary call, then the cached summary"
    note = {"role": "user", "content": f"{SUMMARY_LABEL}\n{SUMMARY_TEXT}"}
    for sent, prompt in zip((first_chat, following), (c["messages"] for c in chats), strict=True):
        # after Open WebUI's merge_system_messages: the one system message is the chat's own prompt
        assert prompt[0] == {"role": "system", "content": sent[0]["content"]}
        assert [m["role"] for m in prompt].count("system") == 1
        assert prompt[1] == note and prompt[2] == {"role": "assistant", "content": SUMMARY_ACK}
        assert prompt[3]["role"] == "user" and prompt[3] in sent and prompt[-1] == sent[-1]
        assert counter.count_messages(prompt, MODEL) <= BUDGET
    first, second = (c["messages"] for c in chats)
    assert len(first) < len(first_chat)
    assert second[: len(first)] == first, "the second prompt does not start with the first"
    assert one_usage_record(open_webui, since)["estimated_prompt_tokens"] == counter.count_messages(second, MODEL)
