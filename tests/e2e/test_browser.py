"""What a person sees: the built filter in a real Open WebUI 0.12.4, used from its chat page in a
headless Chromium (``browser.py``). A pasted document and a question in one chat: the filter
drops the document from the second turn, and the status line shown above each reply is the
filter's usage line carrying the fake backend's numbers.

Needs Debian's ``chromium`` + ``chromium-driver`` and ``selenium`` (the dev extra): without them
the test is skipped with the reason, except under ``CI``, where it fails (``.ci/run`` installs
them).
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from contextwarden.money import format_usd
from contextwarden.pricing import PriceBook, resolve_model
from contextwarden.usage import Usage, compute_cost

from browser import Reply, chat_page, expand_status, find_browser, open_chat, send, wait_for_replies
from fake_backend import FakeBackend, completion_tokens_for, expected_prompt_tokens
from helpers import BUILT_FILE
from owui import OpenWebUI, add_user, installed_function
from test_product import base_valves

pytestmark = pytest.mark.e2e

FID = "contextwarden_browser"
MODEL = "gpt-4o"  # priced in the bundled table, so the line carries a cost
WINDOW, RESERVE = 1_500, 300  # a 1,200-token budget: the ~2,600-token document cannot stay
DOCUMENT = " ".join(f"Paragraph {n}: the quartz lantern by the river harbor keeps signal {n}." for n in range(150))
QUESTION = "What did the document say about quartz?"
USAGE_LINE = re.compile(r"(?P<prompt>[\d,]+) tokens in · (?P<completion>[\d,]+) out · \$(?P<usd>[\d.]+)")
TRIM = re.compile(r"\b3 → (?P<after>\d+) messages?\b")  # the second turn: document, reply, question
SAME_COUNT = re.compile(r"\b(\d[\d,]*) → \1 messages?\b")  # "1 → 1 message": a count said twice
TASKS_OFF = {"ENABLE_TITLE_GENERATION": False, "ENABLE_TAGS_GENERATION": False, "ENABLE_FOLLOW_UP_GENERATION": False}


@pytest.fixture(scope="session")
def chromium() -> tuple[str, str]:
    """Paths of chromium and chromedriver; skipped with the reason when missing, failed under CI.
    Session-scoped so that it is checked before the (session) Open WebUI is started for it."""
    found = find_browser()
    if isinstance(found, str):
        if os.environ.get("CI"):
            pytest.fail(f"CI is set and the browser test cannot run: {found}", pytrace=False)
        pytest.skip(f"browser test: {found}")
    return found


@pytest.fixture
def quiet_tasks(open_webui: OpenWebUI) -> Iterator[None]:
    """Title, tag and follow-up generation off for the test, restored after: those background
    calls would otherwise reach the fake backend while later tests count its requests."""
    config = open_webui.api("GET", "/api/v1/tasks/config")
    open_webui.api("POST", "/api/v1/tasks/config/update", json_body={**config, **TASKS_OFF})
    try:
        yield
    finally:
        open_webui.api("POST", "/api/v1/tasks/config/update", json_body=config)


def usage_numbers(line: str | None) -> tuple[int, int, str] | None:
    """``(prompt, completion, dollars)`` of a ``1,234 tokens in · 56 out · $0.0031`` line, else None."""
    match = USAGE_LINE.match(line or "")
    if not match:
        return None
    return int(match["prompt"].replace(",", "")), int(match["completion"].replace(",", "")), match["usd"]


def expected_usage(body: dict[str, Any], reply: str) -> tuple[int, int, str]:
    """What the line must say for a request: the fake backend's counts (messages and the tool
    definitions Open WebUI sends from the browser), priced from the table."""
    prompt, completion = expected_prompt_tokens(body["messages"], body.get("tools")), completion_tokens_for(reply)
    cost = compute_cost(Usage(prompt, completion), resolve_model(MODEL, PriceBook.from_bundled()).price).cost_usd
    assert cost is not None
    return prompt, completion, format_usd(cost)


def test_status_line_after_a_trimmed_reply(
    chromium: tuple[str, str], open_webui: OpenWebUI, backend: FakeBackend, quiet_tasks: None, tmp_path: Any
) -> None:
    """Paste a document, ask about it: the page shows each reply with the filter's usage line
    (the backend's counts and the table's price); the second prompt no longer holds the
    document, and the expanded status history says so (3 → 1 messages), in one context line a
    turn: the request pass's, which counts the tool definitions the inlet never sees."""
    user = add_user(open_webui, "Browser user", f"browser-{uuid.uuid4().hex[:8]}@example.com")
    valves = {**base_valves(), "max_context_tokens": WINDOW, "reserve_output_tokens": RESERVE}

    def finished(reply: Reply) -> bool:
        return reply.text == backend.default_reply and usage_numbers(reply.shown) is not None

    source = BUILT_FILE.read_text("utf-8")
    with installed_function(open_webui, FID, source, valves, name=FID), chat_page(*chromium, tmp_path) as page:
        open_chat(page, open_webui.base_url, user["token"], MODEL)
        send(page, DOCUMENT, paste=True)
        wait_for_replies(page, 1, finished)
        send(page, QUESTION)
        replies = wait_for_replies(page, 2, finished)
        histories = [expand_status(page, index) for index in range(2)]
        page.save_screenshot(str(tmp_path / "browser-status.png"))
    history = histories[1]
    print(f"\nstatus lines shown: {[r.shown for r in replies]}\nexpanded: {[h.lines for h in histories]}")

    assert len(backend.requests) == 2, [body["messages"][-1].get("content", "")[:60] for body in backend.requests]
    first, second = (body["messages"] for body in backend.requests)
    assert first[-1]["role"] == "user" and second[-1] == {"role": "user", "content": QUESTION}
    assert all(DOCUMENT[:40] not in str(message.get("content")) for message in second), "document still sent"
    for reply, sent in zip(replies, backend.requests, strict=True):
        assert usage_numbers(reply.shown) == expected_usage(sent, backend.default_reply), reply
    assert history.lines[-1] == history.shown == replies[1].shown, "the line shown is not the reply's last status"
    trims = [match for line in history.lines if (match := TRIM.search(line))]
    assert trims and int(trims[0]["after"]) == len(second), history.lines
    for turn in histories:  # one context line a turn: the request pass's, tool definitions counted
        context = [line for line in turn.lines if line.startswith("Context ")]
        assert len(context) == 1, turn.lines
        assert " for tool definitions" in context[0] and not SAME_COUNT.search(context[0]), context
