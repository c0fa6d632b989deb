"""Issue 15 item 4 in the real Open WebUI 0.12.4: a pasted document, then a question about one fact.

A ~6,000-token document pasted into a chat whose window is 4,000 tokens (3,500 budget): the
paste itself goes cut by passages (it is that turn's question); a later question about one fact
in it gets the document's passages that hold the fact sent as an excerpt, in place, with a
visible cut marker, instead of the whole document being dropped; the turn after that, whose
needs are the same, sends the very same excerpt again (the prefix a prompt cache keeps).
"""

from __future__ import annotations

import random
import uuid
from typing import Any

import pytest

from contextwarden.core.tokens import TokenCounter

from fake_backend import FakeBackend
from owui import OpenWebUI, chat
from test_product import BUDGET, MODEL, assert_valid_prompt, cw, product  # noqa: F401

pytestmark = pytest.mark.e2e

FACT = "The spare turbine blades are stored in aisle 42 of the Tromsø warehouse."
FILLER = (
    "river market harbour lantern copper meadow violin orchard granite festival ledger summit "
    "canvas pilgrim quartz saddle thunder velvet walnut yacht zephyr bramble cobalt dune ember"
).split()


def pasted_document(counter: TokenCounter, tokens: int = 6_000) -> str:
    """Paragraphs of filler, about `tokens` long, with `FACT` in one past the middle."""
    rng = random.Random(3)
    paragraphs: list[str] = []
    while counter.count_text("\n\n".join(paragraphs), MODEL) < tokens:
        paragraphs.append(" ".join(" ".join(rng.choice(FILLER) for _ in range(12)) + "." for _ in range(5)))
    at = len(paragraphs) * 3 // 5
    paragraphs[at] += " " + FACT
    return "\n\n".join(paragraphs)


def test_a_fact_in_a_pasted_document_reaches_the_backend(
    open_webui: OpenWebUI, backend: FakeBackend, cw: str, counter: TokenCounter
) -> None:
    chat_id = f"temporary:{uuid.uuid4()}"
    document = pasted_document(counter)
    assert counter.count_text(document, MODEL) >= 6_000
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Here is our warehouse report:\n\n" + document},
    ]
    chat(open_webui, MODEL, history, chat_id=chat_id)
    pasted = backend.last_request["messages"][-1]["content"]
    assert "tokens cut by contextwarden" in pasted  # the paste itself, cut by passages

    history += [
        {"role": "assistant", "content": "I have read the report."},
        {"role": "user", "content": "In which aisle are the spare turbine blades stored?"},
    ]
    chat(open_webui, MODEL, history, chat_id=chat_id)
    got = backend.last_request["messages"]
    assert_valid_prompt(history, got)
    assert counter.count_messages(got, MODEL) <= BUDGET
    assert [m["role"] for m in got] == ["system", "user", "assistant", "user"]
    excerpt = got[1]["content"]
    assert FACT in excerpt, "the fact did not reach the backend"
    assert "tokens cut by contextwarden …]" in excerpt and len(excerpt) < len(history[1]["content"])

    history += [
        {"role": "assistant", "content": backend.default_reply},
        {"role": "user", "content": "Thanks, that helps."},
    ]
    chat(open_webui, MODEL, history, chat_id=chat_id)
    again = backend.last_request["messages"]
    assert again[: len(got)] == got, "the excerpt was not sent again unchanged"
    assert counter.count_messages(again, MODEL) <= BUDGET


def test_a_document_pasted_with_its_question_sends_the_passage_it_asks_about(
    open_webui: OpenWebUI, backend: FakeBackend, cw: str, counter: TokenCounter
) -> None:
    """The document and the question in one message, over the budget alone: the model got the
    question and the document's ends (cut middle-out), not the fact it asked about."""
    question = "In which aisle of the warehouse are the spare turbine blades stored?"
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Here is our warehouse report:\n\n" + pasted_document(counter) + "\n\n" + question},
    ]
    chat(open_webui, MODEL, history, chat_id=f"temporary:{uuid.uuid4()}")
    got = backend.last_request["messages"]
    sent = got[-1]["content"]
    assert counter.count_messages(got, MODEL) <= BUDGET
    assert "tokens cut by contextwarden" in sent and sent.endswith(question)
    assert FACT in sent, "the passage the question asks about did not reach the backend"
