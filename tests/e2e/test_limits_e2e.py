"""Spending limits and `!usage` inside a real Open WebUI 0.12.4 (the built single file).

What a refused user gets is Open WebUI's own answer to an exception in inlet: HTTP 400 with the
refusal as `detail`, and the backend is never called. Group limits read the user's groups
through Open WebUI's own `Groups` model, made through its REST API here.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from fake_backend import FakeBackend
from owui import OpenWebUI, add_user, chat, reply_text, set_valves
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
    assert report.startswith("### contextwarden usage · ") and f"| {user['id']} | 1 | " in report
    assert "background calls" in report
    own = chat(open_webui, MODEL, [{"role": "user", "content": "!usage"}], token=user["token"], expect=None)
    assert own["status_code"] == 400 and len(backend.requests) == calls
    assert (
        own["body"]["detail"] == "contextwarden: today $0.013 of $0.01 · 125% of your daily limit · this month $0.013."
    )
