"""Spending limits and `!usage` inside a real Open WebUI 0.12.4 (the built single file).

What a refused user gets is Open WebUI's own answer to an exception in inlet: HTTP 400 with the
refusal as `detail`, and the backend is never called. Group limits read the user's groups
through Open WebUI's own `Groups` model, made through its REST API here.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from typing import Any

import pytest

from fake_backend import FakeBackend
from helpers import BUILT_FILE
from owui import OpenWebUI, add_user, chat, installed_function, reply_text, set_valves, start_open_webui
from test_product import FID, MODEL, base_valves, product, short_chat  # noqa: F401  (fixtures)

pytestmark = pytest.mark.e2e

# gpt-4o: $2.50 per million prompt tokens; one reply of 5,000 prompt tokens costs $0.0125.
BIG_REPLY = {"prompt_tokens": 5_000, "completion_tokens": 0, "total_tokens": 5_000}


@pytest.fixture
def limited(open_webui: OpenWebUI, product: str, backend: FakeBackend) -> Iterator[dict[str, Any]]:  # noqa: F811
    """The product with a $0.01 daily limit for everyone; restored afterwards."""
    valves = {**base_valves(), "daily_limit_usd": 0.01}
    set_valves(open_webui, product, valves)
    try:
        yield valves
    finally:
        set_valves(open_webui, product, base_valves())


def new_user(owui: OpenWebUI) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    return add_user(owui, f"User {tag}", f"user-{tag}@example.com")


def test_a_user_over_the_limit_is_refused_with_a_text_that_says_why(open_webui, backend, limited):
    user = new_user(open_webui)
    backend.push_reply(content="Teal.", usage=BIG_REPLY)
    assert reply_text(chat(open_webui, MODEL, short_chat(), token=user["token"])) == "Teal."
    calls = len(backend.requests)
    refused = chat(open_webui, MODEL, short_chat(), token=user["token"], expect=None)
    assert refused["status_code"] == 400
    detail = refused["body"]["detail"]
    assert detail.startswith(
        "contextwarden: your daily limit of $0.01 is reached ($0.013 used today). It resets at 00:00 UTC (in "
    )
    assert len(backend.requests) == calls  # the model was not called
    streamed = chat(open_webui, MODEL, short_chat(), stream=True, token=user["token"], expect=None)
    assert streamed["status_code"] == 400 and streamed["body"]["detail"] == detail
    # Another user, and the admin (not limited without an admin role override), go on.
    assert reply_text(chat(open_webui, MODEL, short_chat(), token=new_user(open_webui)["token"]))
    for _ in range(2):  # the admin: over $0.01 after the first, still served (HTTP 200)
        backend.push_reply(content="Ok.", usage=BIG_REPLY)
        assert reply_text(chat(open_webui, MODEL, short_chat())) == "Ok."


def test_a_group_override_read_from_open_webui(open_webui, backend, limited, product):  # noqa: F811
    user = new_user(open_webui)
    name = f"research-{uuid.uuid4().hex[:6]}"
    group = open_webui.api("POST", "/api/v1/groups/create", json_body={"name": name, "description": "limits test"})
    open_webui.api("POST", f"/api/v1/groups/id/{group['id']}/users/add", json_body={"user_ids": [user["id"]]})
    set_valves(open_webui, product, {**limited, "limit_overrides": f'{{"groups": {{"{name}": {{"daily_usd": 100}}}}}}'})
    for _ in range(2):
        backend.push_reply(content="Teal.", usage=BIG_REPLY)
        assert reply_text(chat(open_webui, MODEL, short_chat(), token=user["token"])) == "Teal."
    other = new_user(open_webui)  # not in the group: the $0.01 for everyone
    backend.push_reply(content="Teal.", usage=BIG_REPLY)
    chat(open_webui, MODEL, short_chat(), token=other["token"])
    assert chat(open_webui, MODEL, short_chat(), token=other["token"], expect=None)["status_code"] == 400


def test_usage_command_answers_admins_without_the_model(open_webui, backend, limited):
    user = new_user(open_webui)
    backend.push_reply(content="Teal.", usage=BIG_REPLY)
    chat(open_webui, MODEL, short_chat(), token=user["token"])
    calls = len(backend.requests)
    answer = chat(open_webui, MODEL, [{"role": "user", "content": "!usage"}], expect=None)
    assert answer["status_code"] == 400 and len(backend.requests) == calls
    report = answer["body"]["detail"]
    assert report.startswith("### contextwarden usage · ") and f"| {user['name']} | 1 | " in report
    assert user["id"] not in report and user["email"] not in report  # named as Open WebUI names them
    assert "background calls" in report
    own = chat(open_webui, MODEL, [{"role": "user", "content": "!usage"}], token=user["token"], expect=None)
    assert own["status_code"] == 400 and len(backend.requests) == calls
    assert (
        own["body"]["detail"] == "contextwarden: today $0.013 of $0.01 · 125% of your daily limit · this month $0.013."
    )


# --- charged when a turn starts: outlets that never come, two workers --------------------------------


def spent_today(owui: OpenWebUI, token: str) -> Decimal:
    """The user's spend today as their own `!usage` answer says it."""
    answer = chat(owui, MODEL, [{"role": "user", "content": "!usage"}], token=token, expect=None)
    found = re.search(r"today \$([\d.]+)", answer["body"]["detail"])
    assert found, answer
    return Decimal(found.group(1))


def test_a_stream_the_caller_stops_is_charged(open_webui, backend, limited):
    """Open WebUI runs no outlet after a stream its caller drops (its CancelledError path): the
    turn was charged its estimate when it started (the prompt, and the 500-token reply allowance
    at gpt-4o's $10 a million: at least $0.005)."""
    user = new_user(open_webui)
    backend.push_reply(content="A slow and long answer. " * 40, piece_delay=0.05)  # 120 chunks, about 6 s
    body = {"model": MODEL, "messages": short_chat(), "stream": True}
    with open_webui.client(user["token"]) as client, client.stream("POST", "/api/chat/completions", json=body) as got:
        assert got.status_code == 200
        for n, _ in enumerate(got.iter_lines()):
            if n == 10:
                break  # the caller stops reading and closes the stream mid-way
    deadline = time.monotonic() + 10
    while not backend.requests and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(backend.requests) == 1  # the model was called
    spent = spent_today(open_webui, user["token"])
    assert Decimal("0.005") < spent < Decimal("0.01"), spent
    log = open_webui.log_text()
    assert f'"user_id": "{user["id"]}"' not in log  # no outlet ran: no usage line for this user


WORKER_START_TRIES = 3
WORKERS_SETTLE_S = 3.0  # after /health: the other worker's start-up, failed or not, is in the log by then


def _start_two_workers(owui_venv, fake_backend, tmp_path_factory) -> OpenWebUI:
    """Open WebUI with two uvicorn workers, both serving. In a new database Open WebUI 0.12.4's
    workers race to write its config row: one can fail its start-up ("UNIQUE constraint failed:
    config.key", "Application startup failed") while the other serves, and uvicorn then stops
    them all at its next health check, mid-test. Such a start is made again in a new folder."""
    for _ in range(WORKER_START_TRIES):
        owui = start_open_webui(
            owui_venv, fake_backend, tmp_path_factory.mktemp("owui-two-workers"), extra_env={"UVICORN_WORKERS": "2"}
        )
        time.sleep(WORKERS_SETTLE_S)
        log = owui.log_path.read_text("utf-8", "replace")
        if log.count("Started server process") >= 2 and "Application startup failed" not in log:
            return owui
        owui.stop()
    raise AssertionError(f"two Open WebUI workers did not both start in {WORKER_START_TRIES} tries ({owui.log_path})")


@pytest.fixture(scope="module")
def two_workers(owui_venv, fake_backend, tmp_path_factory, redis_server) -> Iterator[OpenWebUI]:
    """A second Open WebUI with two uvicorn workers (two filter instances), the product on one Redis."""
    owui = _start_two_workers(owui_venv, fake_backend, tmp_path_factory)
    try:
        valves = {**base_valves(), "daily_limit_usd": 0.01, "redis_url": redis_server[0], "semantic_relevance": False}
        with installed_function(owui, FID, BUILT_FILE.read_text("utf-8"), valves=valves, name="contextwarden"):
            yield owui
    finally:
        owui.stop()


def test_two_workers_charge_parallel_turns_as_one(two_workers, backend):
    """20 streamed turns of one user at once, spread over two workers sharing one Redis, against
    $0.01 a day: each is charged ~$0.004 when it starts (400 tokens out), atomically across the
    workers, so three start (the third crosses the limit) and the rest are refused naming it."""
    user = new_user(two_workers)
    for _ in range(20):
        backend.push_reply(content="Slowly. " * 40, piece_delay=0.1)  # 40 chunks: 4 s, all start meanwhile

    def one_turn(_: int) -> dict[str, Any]:
        return chat(two_workers, MODEL, short_chat(), stream=True, token=user["token"], expect=None, max_tokens=400)

    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(one_turn, range(20)))
    refused = [r["body"]["detail"] for r in results if r.get("status_code") == 400]
    assert len(results) - len(refused) == 3, refused
    assert all(d.startswith("contextwarden: your daily limit of $0.01 is reached ($0.01") for d in refused), refused


def test_a_usage_exchange_never_reaches_the_backend(open_webui, backend, limited):
    """The chat as Open WebUI stores it after `!usage` (the command, the report written into the
    reply): the next turn goes out without both; a question that mentions it goes out as is."""
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "!usage"},
        {"role": "assistant", "content": "### contextwarden usage · 2026-12 (UTC)\n| user id | replies |"},
        {"role": "user", "content": "What does !usage show?"},
    ]
    chat(open_webui, MODEL, history)
    sent = backend.last_request["messages"]
    assert [m["content"] for m in sent] == ["Be brief.", "What does !usage show?"]
