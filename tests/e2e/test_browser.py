"""What a person sees: the built filter in a real Open WebUI 0.12.4, used from its chat page in a
headless Chromium (``browser.py``). A pasted document and a question in one chat whose window
Open WebUI's own tool definitions fill: the filter drops the document from the second turn, and
each reply has one status line, the filter's, shown after the reply: what the model saw in
plain words, then the fake backend's token counts and the price.

Needs Debian's ``chromium`` + ``chromium-driver`` and ``selenium`` (the dev extra): without them
the test is skipped with the reason, except under ``CI``, where it fails (``.ci/run`` installs
them).
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from contextwarden.core.conversation import RECALL_LABEL, SUMMARY_ACK
from contextwarden.money.dollars import format_usd
from contextwarden.money.pricing import PriceBook, resolve_model
from contextwarden.money.usage import Usage, compute_cost

from browser import Reply, chat_page, expand_status, find_browser, open_chat, read_replies, send, wait_for_replies
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
USAGE_LINE = re.compile(r"(?:^| · )(?P<prompt>[\d,]+) tokens in · (?P<completion>[\d,]+) out · \$(?P<usd>[\d.]+)")
# the turn's words, then its usage: "Sent 1 of 3 messages · tool definitions fill the window · 3,229 tokens in ..."
WORDS = re.compile(r"^(?:Whole chat sent|Sent \d+(?: of \d+)? messages?)[^·]*(?: · [a-z][^·]*)*? · [\d,]+ tokens in")
ADMIN_WORDS = ("→", "(fits", "(budget", "incl.", "Context", "calibrated")  # the admin's detail goes to the log
SCREENSHOTS = Path(__file__).parent / "screenshots"  # the committed pictures of the final lines
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
    """``(prompt, completion, dollars)`` of the ``1,234 tokens in · 56 out · $0.0031`` in a line, else None."""
    match = USAGE_LINE.search(line or "")
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


def keep_screenshot(page: Any, reply_index: int, name: str, tmp_path: Path) -> Path:
    """A picture of one reply (its status line and text, as a person sees them at 1,280 px) to
    ``tmp_path``, and, with ``$CONTEXTWARDEN_SCREENSHOTS`` set, to ``tests/e2e/screenshots`` too."""
    reply = page.find_elements("css selector", ".chat-assistant")[reply_index]
    page.execute_script("arguments[0].scrollIntoView({block: 'center'});", reply)
    shot = tmp_path / name
    reply.screenshot(str(shot))
    if os.environ.get("CONTEXTWARDEN_SCREENSHOTS"):
        SCREENSHOTS.mkdir(exist_ok=True)
        (SCREENSHOTS / name).write_bytes(shot.read_bytes())
    return shot


def assert_one_plain_line(reply: Reply) -> None:
    """A reply's status history (expanded) is one line, the filter's: plain words, then the usage."""
    assert reply.lines == [reply.shown], reply.lines  # one status a turn, no second usage line
    line = reply.shown or ""
    assert WORDS.match(line), line
    assert not [word for word in ADMIN_WORDS if word in line], line


def test_status_line_after_a_trimmed_reply(
    chromium: tuple[str, str], open_webui: OpenWebUI, backend: FakeBackend, quiet_tasks: None, tmp_path: Path
) -> None:
    """Paste a document, ask about it, in a 1,500-token window that Open WebUI's 3,214 tokens of
    tool definitions fill: each reply shows one line, after it, saying what the model saw
    (``Sent 1 of 3 messages · tool definitions fill the window``) and what the reply used (the
    backend's counts and the table's price); the second prompt no longer holds the document."""
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
        keep_screenshot(page, 1, "small-window.png", tmp_path)
        histories = [expand_status(page, index) for index in range(2)]
        page.save_screenshot(str(tmp_path / "browser-status.png"))
    print(f"\nstatus lines shown: {[r.shown for r in replies]}\nexpanded: {[h.lines for h in histories]}")

    assert len(backend.requests) == 2, [body["messages"][-1].get("content", "")[:60] for body in backend.requests]
    first, second = (body["messages"] for body in backend.requests)
    assert first[-1]["role"] == "user" and second[-1] == {"role": "user", "content": QUESTION}
    assert all(DOCUMENT[:40] not in str(message.get("content")) for message in second), "document still sent"
    for reply, sent in zip(replies, backend.requests, strict=True):
        assert usage_numbers(reply.shown) == expected_usage(sent, backend.default_reply), reply
    for history in histories:
        assert_one_plain_line(history)
        assert " · tool definitions fill the window · " in (history.shown or ""), history.shown
    pasted = histories[0].shown or ""  # the document, cut by passages: told as excerpted (`split_chunks`: 19)
    assert re.match(r"Sent 1 message, document excerpted: \d+ of 19 passages · ", pasted), pasted
    assert (histories[1].shown or "").startswith(f"Sent {len(second)} of 3 messages · "), histories[1].shown


def test_the_admins_usage_report_names_users(
    chromium: tuple[str, str], open_webui: OpenWebUI, backend: FakeBackend, quiet_tasks: None, tmp_path: Path
) -> None:
    """``!usage`` typed by an admin in the chat page: the report written into the reply names the
    user who chatted as Open WebUI names them, never by id or email (issue 31)."""
    from selenium.webdriver.common.keys import Keys

    from owui import chat

    name = f"Report Reader {uuid.uuid4().hex[:6]}"
    user = add_user(open_webui, name, f"report-{uuid.uuid4().hex[:8]}@example.com")
    valves = {**base_valves(), "max_context_tokens": 8_000}
    source = BUILT_FILE.read_text("utf-8")
    with installed_function(open_webui, FID, source, valves, name=FID), chat_page(*chromium, tmp_path) as page:
        chat(open_webui, MODEL, [{"role": "user", "content": "Hello there."}], token=user["token"])  # a reply to report
        calls = len(backend.requests)
        open_chat(page, open_webui.base_url, open_webui.token, MODEL)
        page.find_element("css selector", "body").send_keys(Keys.ESCAPE)  # an admin's "What's New" dialog
        send(page, "!usage")
        wait_for_replies(page, 1, lambda reply: "contextwarden usage" in reply.text)
        toasts = error_toasts(page)
        [report] = read_replies(page)
        keep_screenshot(page, 0, "admin-usage-report.png", tmp_path)
    print(f"\nreport: {report.text[:600]}")
    assert len(backend.requests) == calls  # the model was not called
    assert name in report.text, report.text
    assert user["id"] not in report.text and user["email"] not in report.text
    # ended as the Stop button ends a turn: no error under the report, no red toast (before:
    # both said "contextwarden: the usage report is above; the model was not called")
    assert not toasts and "not called" not in report.text, (toasts, report.text[-200:])


def error_toasts(page: Any, seconds: float = 3.0) -> list[str]:
    """The error toasts Open WebUI shows within ``seconds`` (svelte-sonner's ``data-type``)."""
    seen: list[str] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        seen += page.execute_script(
            "return Array.from(document.querySelectorAll('[data-sonner-toast][data-type=\"error\"]'))"
            ".map(t => t.innerText)"
        )
        time.sleep(0.2)
    return list(dict.fromkeys(seen))


def test_flags_typed_in_the_page_are_said_back(
    chromium: tuple[str, str], open_webui: OpenWebUI, backend: FakeBackend, quiet_tasks: None, tmp_path: Path
) -> None:
    """Flags as a person types them, in an 8,000 window where Open WebUI's tool definitions take
    3,214 tokens: a pin, then ``!budget=2000`` (below the definitions alone: the line says the
    turn went over the user's budget, not that the window is full), then ``!budget=2k`` (no
    flag: said back as not understood, after the request pass as after inlet)."""
    user = add_user(open_webui, "Flag user", f"flags-{uuid.uuid4().hex[:8]}@example.com")
    valves = {**base_valves(), "max_context_tokens": 8_000, "reserve_output_tokens": 800}
    pin = "Remember this: the vault code is 7391."

    def finished(reply: Reply) -> bool:
        return reply.text == backend.default_reply and usage_numbers(reply.shown) is not None

    source = BUILT_FILE.read_text("utf-8")
    with installed_function(open_webui, FID, source, valves, name=FID), chat_page(*chromium, tmp_path) as page:
        open_chat(page, open_webui.base_url, user["token"], MODEL)
        for count, text in enumerate((f"{pin} !pin", "What is the vault code? !budget=2000", "Hello !budget=2k"), 1):
            send(page, text)
            replies = wait_for_replies(page, count, finished)
        page.save_screenshot(str(tmp_path / "browser-flags.png"))  # not committed: tmp_path only
    print(f"\nstatus lines shown: {[r.shown for r in replies]}")
    lines = [reply.shown or "" for reply in replies]
    assert lines[0].startswith("Whole chat sent · flags !pin · "), lines[0]
    assert " · over your budget: tool definitions alone fill it · flags !budget=2000 · " in lines[1], lines[1]
    assert "window" not in lines[1] and backend.requests[1]["messages"][0]["content"] == pin
    assert lines[2].startswith("Whole chat sent · not understood: !budget=2k · "), lines[2]


def test_a_trimmed_chat_says_how_many_messages_went(
    chromium: tuple[str, str], open_webui: OpenWebUI, backend: FakeBackend, quiet_tasks: None, tmp_path: Path
) -> None:
    """Four long messages in a 5,000 window (3,214 tokens of it Open WebUI's tool definitions):
    the last reply's one line says how many of the chat's messages the model saw."""
    user = add_user(open_webui, "Trimmed chat", f"trimmed-{uuid.uuid4().hex[:8]}@example.com")
    valves = {**base_valves(), "max_context_tokens": 5_000, "reserve_output_tokens": RESERVE}
    notes = [
        " ".join(f"Note {turn}.{n}: the {word} crew logged signal {n}." for n in range(60))
        for turn, word in enumerate(("harbor", "quartz", "willow", "lantern"))
    ]

    def finished(reply: Reply) -> bool:
        return reply.text == backend.default_reply and usage_numbers(reply.shown) is not None

    source = BUILT_FILE.read_text("utf-8")
    with installed_function(open_webui, FID, source, valves, name=FID), chat_page(*chromium, tmp_path) as page:
        open_chat(page, open_webui.base_url, user["token"], MODEL)
        for count, note in enumerate(notes, start=1):
            send(page, note, paste=True)
            replies = wait_for_replies(page, count, finished)
        keep_screenshot(page, len(notes) - 1, "trimmed-chat.png", tmp_path)
        last = expand_status(page, len(notes) - 1)
    print(f"\nstatus lines shown: {[r.shown for r in replies]}")
    assert_one_plain_line(last)
    sent = backend.requests[-1]["messages"]
    said = re.match(rf"Sent (\d+) of {2 * len(notes) - 1} messages · ", last.shown or "")
    assert said, last.shown
    own = [m for m in sent if m.get("content") != SUMMARY_ACK and not str(m.get("content")).startswith(RECALL_LABEL)]
    blocks = [str(m.get("content")) for m in sent if str(m.get("content")).startswith(RECALL_LABEL)]
    # a note not sent in place but quoted whole in a recall block: the model read it, the line counts it
    quoted = sum(1 for n in notes if all(m.get("content") != n for m in own) and any(n in b for b in blocks))
    quoted += sum(b.count(backend.default_reply) for b in blocks)  # the replies are all alike: each quote is one
    assert int(said[1]) == len(own) + quoted < 2 * len(notes) - 1, (last.shown, [m["role"] for m in sent])
