"""Sources Open WebUI puts before the question, in the real Open WebUI 0.12.4.

A long text attached as a file in full-context mode (what Open WebUI does with a large paste
turned into a file, or a web page attached: a `text` item with its content, `context: "full"`)
goes into its RAG template before the question between inlet and request. In a 4,000-token
window the ~6,000-token text cannot go whole: the request pass sends the passage that answers
the question (middle-out it sent the text's head and tail), with the template, the source tag
and the question whole; the next question in the chat, with the file attached again, is
answered from its own passage while the history is chosen for the bare question. A chat
about an article with its best paragraphs attached to every question keeps its prompt from
turn to turn while the history the request pass cut further holds.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
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


def _paragraphs_of(question: str, paragraphs: list[str], k: int = 6) -> list[dict[str, Any]]:
    """The `k` paragraphs sharing most words with `question`, each a full-context text: what a
    knowledge base's retrieval puts before a question, in the shape the chat page sends."""
    words = set(question.lower().split())
    best = sorted(range(len(paragraphs)), key=lambda j: -len(words & set(paragraphs[j].lower().split())))[:k]
    return [
        {"type": "text", "context": "full", "name": f"p{j}.txt", "file": {"data": {"content": paragraphs[j]}}}
        for j in best
    ]


def test_a_chat_about_an_article_with_passages_every_turn_repeats_its_prompt(
    open_webui: OpenWebUI, backend: FakeBackend, cw: str, counter: TokenCounter
) -> None:
    """Questions about an article, each with its best paragraphs attached (as a knowledge base
    retrieves them), the answers sentences of it: more history than fits beside the passages, so
    the request pass cuts the history inlet chose further. The next turn sends that prompt again
    up to its question while the selection holds. Before 2026-12-07 the request pass stored its
    choice at the places of inlet's shorter list; the next turn found no recall block where the
    choice said and chose anew."""
    data = json.loads((Path(__file__).parents[1] / "fixtures" / "squad_article.json").read_text())
    paragraphs = [p["context"] for p in data["paragraphs"]]
    asked = [(q["question"], k) for k, p in enumerate(data["paragraphs"]) for q in p["qas"]]
    chat_id = f"temporary:{uuid.uuid4()}"
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are helpful."}]
    sent: list[list[dict[str, Any]]] = []
    for question, at in asked[:: len(asked) // 32][:32]:
        history.append({"role": "user", "content": question})
        chat(open_webui, MODEL, history, chat_id=chat_id, files=_paragraphs_of(question, paragraphs))
        got = backend.last_request["messages"]
        assert "<source" in got[-1]["content"] and counter.count_messages(got, MODEL) <= BUDGET
        sent.append(got)
        history.append({"role": "assistant", "content": " ".join(paragraphs[at].split(". ")[:6])})
    repeated = [now[: len(before) - 1] == before[:-1] for before, now in zip(sent[6:], sent[7:], strict=False)]
    assert sum(repeated) * 2 > len(repeated), f"{sum(repeated)} of {len(repeated)} turns repeated the prompt before"
