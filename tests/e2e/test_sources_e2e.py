"""Sources Open WebUI puts before the question, in the real Open WebUI 0.12.4.

A long text attached as a file in full-context mode (what Open WebUI does with a large paste
turned into a file, or a web page attached: a `text` item with its content, `context: "full"`)
goes into its RAG template before the question between inlet and request. In a 4,000-token
window the ~6,000-token text cannot go whole: the request pass sends the passage that answers
the question (middle-out it sent the text's head and tail), with the template, the source tag
and the question whole; the next question in the chat, with the file attached again, is
answered from its own passage while the history is chosen for the bare question.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from test_excerpt_e2e import FACT, pasted_document

from contextwarden.core.tokens import TokenCounter

from fake_backend import FakeBackend
from owui import OpenWebUI, chat
from test_product import BUDGET, MODEL, cw, product  # noqa: F401

pytestmark = pytest.mark.e2e

QUESTION = "In which aisle are the spare turbine blades stored?"


def attached(document: str) -> list[dict[str, Any]]:
    """The chat's `files`: one text in full-context mode, as Open WebUI's chat page sends it."""
    return [
        {
            "type": "text",
            "context": "full",
            "name": "warehouse-report.txt",
            "file": {"data": {"content": document}, "meta": {"name": "warehouse-report.txt"}},
        }
    ]


def test_an_attached_file_too_large_sends_the_passage_that_answers(
    open_webui: OpenWebUI, backend: FakeBackend, cw: str, counter: TokenCounter
) -> None:
    chat_id = f"temporary:{uuid.uuid4()}"
    document = pasted_document(counter)
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": QUESTION},
    ]
    chat(open_webui, MODEL, history, chat_id=chat_id, files=attached(document))
    got = backend.last_request["messages"]
    last = got[-1]["content"]
    assert "<source" in last and 'name="warehouse-report.txt"' in last, "Open WebUI put no source in"
    assert FACT in last, "the passage that answers did not reach the backend"
    assert "tokens cut by contextwarden" in last and last.endswith("\n" + QUESTION)
    assert counter.count_messages(got, MODEL) <= BUDGET

    follow_up = "What else is kept in the Tromsø warehouse besides the blades?"
    history += [{"role": "assistant", "content": backend.default_reply}, {"role": "user", "content": follow_up}]
    chat(open_webui, MODEL, history, chat_id=chat_id, files=attached(document))
    again = backend.last_request["messages"]
    assert again[0] == history[0] and again[-1]["content"].endswith("\n" + follow_up)
    assert FACT in again[-1]["content"]
    assert [m["content"] for m in again[1:-1]] == [QUESTION, backend.default_reply], "not the chat as stored"
    assert counter.count_messages(again, MODEL) <= BUDGET
