"""The built ``open_webui_filter.py`` inside a real Open WebUI 0.12.4, installed as an admin would.

The file at the repository root (what users paste) goes in through the REST API (create,
activate, make global, set valves). Each scenario then chats as an API caller and checks
what reached the fake backend (trimmed, valid, within budget, counted with the product's own
exact counter) and the ``usage {json}`` line the filter wrote to the server log.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from decimal import Decimal
from itertools import pairwise
from typing import Any

import pytest

from contextwarden.core.conversation import RECALL_LABEL, is_acknowledgement
from contextwarden.core.tokens import TokenCounter
from contextwarden.money.pricing import PriceBook, resolve_model
from contextwarden.money.usage import Usage, compute_cost

from fake_backend import FakeBackend, completion_tokens_for, expected_prompt_tokens
from helpers import BUILT_FILE
from owui import (
    OpenWebUI,
    add_user,
    chat,
    installed_function,
    reply_text,
    set_user_valves,
    set_valves,
    update_function_source,
    wait_for_log,
)

pytestmark = pytest.mark.e2e

FID = "contextwarden"
MODEL = "gpt-4o"  # resolves to openai/gpt-4o in the bundled price table
WINDOW, RESERVE = 4_000, 500
BUDGET = WINDOW - RESERVE
USAGE_LINE = re.compile(r" - usage (\{.*\})\s*$")
WORDS = (
    "river lantern copper meadow signal harbor quartz willow ember falcon orbit cedar prism "
    "tundra velvet anchor basalt citrus dune glacier hollow ivory juniper kelp lagoon marble"
).split()


def base_valves() -> dict[str, Any]:
    """The admin valves every scenario starts from. Hermetic once those valves exist: no live
    price fetch, and no calibration (the fake backend counts len/4 per message, ~1.3x tiktoken,
    so calibration would rightly shrink every later budget; tests/test_workers.py covers it)."""
    valves: dict[str, Any] = {"max_context_tokens": WINDOW, "reserve_output_tokens": RESERVE, "show_status": True}
    source = BUILT_FILE.read_text("utf-8")
    for name in ("openrouter_pricing", "calibrate_counts"):
        if f"{name}: bool" in source:
            valves[name] = False
    return valves


# --- chats ---------------------------------------------------------------------------------------


def _filler(seed: int, chars: int) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append(WORDS[(seed * 7 + len(words) * 3) % len(WORDS)])
    return f"[{seed}] " + " ".join(words)


def _tool_call(call_id: str, name: str = "lookup") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps({"q": call_id})}}


def long_chat(turns: int = 83, tool_every: int = 5, chars: int = 305) -> list[dict[str, Any]]:
    """System prompt, ``turns`` user/assistant turns (every ``tool_every``-th with a tool call and
    its result), then a final question: about 200 messages and 60k characters at the defaults."""
    chat_messages: list[dict[str, Any]] = [{"role": "system", "content": "You are careful. " + _filler(0, 200)}]
    for turn in range(turns):
        chat_messages.append({"role": "user", "content": f"Question {turn}: " + _filler(turn * 3 + 1, chars)})
        if turn % tool_every == 2:
            call_id = f"call_{turn:03d}"
            chat_messages.append({"role": "assistant", "content": "", "tool_calls": [_tool_call(call_id)]})
            chat_messages.append(
                {"role": "tool", "tool_call_id": call_id, "content": "result " + _filler(turn * 3 + 2, chars)}
            )
        chat_messages.append({"role": "assistant", "content": f"Answer {turn}: " + _filler(turn * 3 + 3, chars)})
    chat_messages.append(
        {"role": "user", "content": f"Final question {uuid.uuid4().hex[:8]}: what was said about quartz?"}
    )
    return chat_messages


def short_chat() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Teal."},
        {"role": "user", "content": f"Another one? {uuid.uuid4().hex[:8]}"},
    ]


# --- checks --------------------------------------------------------------------------------------


def assert_valid_prompt(sent: list[dict[str, Any]], got: list[dict[str, Any]]) -> None:
    """DESIGN.md contract rule 1 on what reached the backend (our chat has one system message)."""
    assert got[0] == sent[0], "system message not first or changed"
    assert all(m.get("role") != "system" for m in got[1:])
    assert got[-1] == sent[-1], "last user message not kept verbatim"
    assert got[1].get("role") == "user", f"history starts with {got[1].get('role')}"
    index = 0
    while index < len(got):
        message = got[index]
        assert message.get("role") != "tool", f"orphan tool message at {index}"
        index += 1
        ids = {call["id"] for call in message.get("tool_calls") or []}
        answered = set()
        while index < len(got) and got[index].get("role") == "tool":
            answered.add(got[index].get("tool_call_id"))
            index += 1
        assert ids == answered, f"tool calls {sorted(ids)} answered by {sorted(answered)}"


def is_subsequence(got: list[dict[str, Any]], sent: list[dict[str, Any]]) -> bool:
    """True when every message of ``got`` is, in order, an unchanged message of ``sent``."""
    remaining = iter(sent)
    return all(any(message == candidate for candidate in remaining) for message in got)


def usage_records(owui: OpenWebUI, since: int) -> list[dict[str, Any]]:
    """Every ``usage {json}`` record the filter logged after byte offset ``since``."""
    found = []
    for line in owui.log_text(since).splitlines():
        match = USAGE_LINE.search(line)
        if match:
            found.append(json.loads(match.group(1)))
    return found


def one_usage_record(owui: OpenWebUI, since: int) -> dict[str, Any]:
    """The single usage record of the last reply (waits for it, then checks no second one came)."""
    wait_for_log(owui, " - usage {", timeout=20, since=since)
    time.sleep(0.5)  # a duplicate would be written by the same outlet call, right after
    records = usage_records(owui, since)
    assert len(records) == 1, records
    return records[0]


# --- fixtures ------------------------------------------------------------------------------------


def warm_up(owui: OpenWebUI, backend: FakeBackend, counter: TokenCounter) -> int:
    """Chat until the filter inside Open WebUI counts exactly; return how many chats that took.

    A fresh filter loads its encodings in a background thread and meanwhile trims with the
    conservative estimate (the first request of a worker). Every one of these must still reach
    the backend valid and within budget.
    """
    for attempt in range(1, 41):
        since = owui.log_mark()
        backend.reset()
        sent = long_chat(turns=12)
        chat(owui, MODEL, sent)
        got = backend.last_request["messages"]
        assert is_subsequence(got, sent)
        exact = counter.count_messages(got, MODEL)
        assert exact <= BUDGET
        if one_usage_record(owui, since)["estimated_prompt_tokens"] == exact:
            return attempt
        time.sleep(0.5)
    raise AssertionError("the filter in Open WebUI never counted exactly: encodings missing from TIKTOKEN_CACHE_DIR?")


@pytest.fixture(scope="module")
def product(open_webui: OpenWebUI, fake_backend: FakeBackend, counter: TokenCounter) -> Iterator[str]:
    """The built single file, installed through the REST API as a global filter, counting exactly."""
    source = BUILT_FILE.read_text("utf-8")
    with installed_function(
        open_webui,
        FID,
        source,
        valves=base_valves(),
        name="contextwarden",
        description="contextwarden, the built single file",
    ):
        open_webui.timings["warm_up_chats"] = warm_up(open_webui, fake_backend, counter)
        yield FID


@pytest.fixture
def cw(open_webui: OpenWebUI, product: str, backend: FakeBackend) -> Iterator[str]:
    """The installed product with the base valves, restored after the test."""
    set_valves(open_webui, product, base_valves())
    try:
        yield product
    finally:
        set_valves(open_webui, product, base_valves())


@pytest.fixture(scope="module")
def admin_id(open_webui: OpenWebUI) -> str:
    return open_webui.api("GET", "/api/v1/auths/")["id"]


# --- scenarios -----------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_long_chat_reaches_backend_trimmed_valid_within_budget(
    open_webui: OpenWebUI, backend: FakeBackend, cw: str, counter: TokenCounter, admin_id: str, stream: bool
) -> None:
    """200 messages, ~60k characters: the backend gets a valid subsequence that fits the budget,
    counted exactly inside Open WebUI (the filter's own estimate equals our exact count)."""
    sent = long_chat()
    assert len(sent) >= 200 and sum(len(str(m.get("content"))) for m in sent) >= 55_000
    since = open_webui.log_mark()
    reply = chat(open_webui, MODEL, sent, stream=stream)
    assert reply_text(reply) == backend.default_reply
    assert len(backend.requests) == 1
    got = backend.last_request["messages"]

    assert len(got) < len(sent)
    assert is_subsequence(got, sent)
    assert_valid_prompt(sent, got)
    tokens = counter.count_messages(got, MODEL)
    assert tokens <= BUDGET
    assert tokens > BUDGET * 0.5, "trimmed far more than the budget (and a low watermark) needs"

    record = one_usage_record(open_webui, since)
    assert record["model"] == MODEL and record["user_id"] == admin_id
    # The trim inside Open WebUI counted exactly what we count here: tiktoken's real encodings
    # loaded from TIKTOKEN_CACHE_DIR (an estimate errs high and would differ).
    assert record["estimated_prompt_tokens"] == tokens


def test_next_turn_sends_the_same_prefix(
    open_webui: OpenWebUI, backend: FakeBackend, cw: str, counter: TokenCounter
) -> None:
    """Two turns of one chat (a temporary chat id, which Open WebUI hands to the filter without
    storing the chat): the second prompt starts with exactly what the first one sent, so a
    provider's prompt cache keeps hitting, and it is counted exactly (the dropped messages' size
    comes from the first turn's decision)."""
    chat_id = f"temporary:{uuid.uuid4()}"
    first_chat = long_chat()
    chat(open_webui, MODEL, first_chat, chat_id=chat_id)
    first = backend.last_request["messages"]
    assert len(first) < len(first_chat)
    following = first_chat + [
        {"role": "assistant", "content": backend.default_reply},
        {"role": "user", "content": f"One more {uuid.uuid4().hex[:8]}: and about granite?"},
    ]
    since = open_webui.log_mark()
    chat(open_webui, MODEL, following, chat_id=chat_id)
    second = backend.last_request["messages"]
    assert second[: len(first)] == first, "the second prompt does not start with the first"
    recall = [m for m in second[len(first) :] if m not in following]  # a recall block and its "Noted.", if any
    assert [m for m in second[len(first) :] if m in following] == following[-2:]
    assert recall == [] or (
        len(recall) == 2 and recall[0]["content"].startswith(RECALL_LABEL) and is_acknowledgement(recall[1])
    )
    assert_valid_prompt(following, second)
    tokens = counter.count_messages(second, MODEL)
    assert tokens <= BUDGET
    assert one_usage_record(open_webui, since)["estimated_prompt_tokens"] == tokens


def test_ten_turns_keep_their_prefix_and_an_early_fact_is_recalled(
    open_webui: OpenWebUI, backend: FakeBackend, cw: str, counter: TokenCounter
) -> None:
    """Issue 14 inside the real Open WebUI: a 10-turn chat (one temporary chat id) that opened with
    a fact, long since dropped. Most turns' prompts start with everything the turn before sent
    but its recall block and question (a provider's prompt cache keeps hitting), and the question
    about the early fact gets that fact's message sent, quoted verbatim in a user-role recall
    block right before it (never a system message: Open WebUI would merge it into the system
    prompt). Lexical relevance, so that what is dropped does not hang on the embedder's view of
    this filler (or on its timing)."""
    set_valves(open_webui, cw, {**base_valves(), "semantic_relevance": False})
    chat_id = f"temporary:{uuid.uuid4()}"
    fact = "Remember this: my storage unit is number 5821 at the Lindholm depot, code word pelican."
    # As long as a real message: a turn this short would be kept as fill (room the newest turns
    # leave), and the fact would never be dropped to be recalled.
    aside = " Moving flats last spring took weeks, with boxes in every room until the autumn." * 3
    messages = [
        {"role": "system", "content": "You are careful."},
        {"role": "user", "content": fact + aside},
        {"role": "assistant", "content": "Noted: unit 5821 at Lindholm, code word pelican."},
    ]
    messages += long_chat(turns=40)[1:-1]  # ~120 messages of filler after it
    # Follow-ups that match no filler word and are long enough to be their own query: the filler
    # repeats the same 26 words in every message, so a question naming some of them (or a short
    # one, which draws on the turns before it) would rank the turns by noise.
    parts = "alpha bravo charlie echo foxtrot golf hotel india juliett".split()
    questions = [f"Please go on with the story of the {part} expedition and its crew." for part in parts]
    questions.append("Which storage unit number and depot did I ask you to remember, with the code word?")
    sent: list[list[dict[str, Any]]] = []
    for question in questions:
        messages = messages + [{"role": "user", "content": question}]
        chat(open_webui, MODEL, messages, chat_id=chat_id)
        got = backend.last_request["messages"]
        assert counter.count_messages(got, MODEL) <= BUDGET
        assert got[0] == messages[0] and got[-1] == messages[-1] and all(m["role"] != "system" for m in got[1:])
        sent.append(got)
        messages = messages + [{"role": "assistant", "content": backend.default_reply}]

    def stable(prompt: list[dict[str, Any]]) -> int:
        """What the next turn should send again: all but this turn's recall block (and the
        assistant "Noted." after it, so roles alternate) and question."""
        end = len(prompt) - 1
        block = end >= 2 and is_acknowledgement(prompt[end - 1])
        return end - 2 if block and str(prompt[end - 2].get("content")).startswith(RECALL_LABEL) else end

    kept = sum(now[: stable(before)] == before[: stable(before)] for before, now in pairwise(sent))
    assert kept >= 7, f"the prefix was kept on {kept} of 9 turns"
    assert not any(fact in str(m.get("content")) for m in sent[-2]), "the fact was not dropped before"
    assert any(fact in str(m.get("content")) for m in sent[-1]), "the question about the fact did not get it sent"
    assert is_acknowledgement(sent[-1][-2])
    block = sent[-1][-3]  # here by recall (a new selection would have kept it in place instead)
    assert block["role"] == "user" and block["content"].startswith(RECALL_LABEL) and f"user: {fact}" in block["content"]


def test_usage_line_has_backend_numbers(open_webui: OpenWebUI, backend: FakeBackend, cw: str, admin_id: str) -> None:
    """Non-streaming: exactly one usage line carrying what the backend reported."""
    since = open_webui.log_mark()
    reply = chat(open_webui, MODEL, long_chat())
    got = backend.last_request["messages"]
    record = one_usage_record(open_webui, since)
    assert record["prompt_tokens"] == expected_prompt_tokens(got) == reply["usage"]["prompt_tokens"]
    assert record["completion_tokens"] == completion_tokens_for(backend.default_reply)
    assert record["estimated"] is False
    assert record["user_id"] == admin_id and record["chat_id"] is None


def test_streaming_usage_line_has_backend_numbers(open_webui: OpenWebUI, backend: FakeBackend, cw: str) -> None:
    """Streaming: the inlet asks for usage (include_usage), so the line carries real numbers."""
    since = open_webui.log_mark()
    reply = chat(open_webui, MODEL, long_chat(), stream=True)
    request = backend.last_request
    assert (request.get("stream_options") or {}).get("include_usage") is True
    assert reply["usage"]["prompt_tokens"] == expected_prompt_tokens(request["messages"])
    record = one_usage_record(open_webui, since)
    assert record["prompt_tokens"] == expected_prompt_tokens(request["messages"])
    assert record["completion_tokens"] == completion_tokens_for(backend.default_reply)
    assert record["estimated"] is False


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_priced_model_logs_cost(open_webui: OpenWebUI, backend: FakeBackend, cw: str, stream: bool) -> None:
    """gpt-4o resolves to openai/gpt-4o in the bundled table: the line has the exact Decimal cost."""
    backend.cached_tokens = 1_024
    since = open_webui.log_mark()
    chat(open_webui, MODEL, long_chat(), stream=stream)
    got = backend.last_request["messages"]
    record = one_usage_record(open_webui, since)
    prompt = expected_prompt_tokens(got)
    assert record["resolved_model"] == "openai/gpt-4o"
    assert record["prompt_tokens"] == prompt and record["estimated"] is False
    assert record["cached_tokens"] == 1_024
    price = resolve_model(MODEL, PriceBook.from_bundled()).price
    completion = completion_tokens_for(backend.default_reply)
    expected = compute_cost(Usage(prompt, completion, cached_tokens=1_024), price).cost_usd
    assert expected is not None and expected > 0
    assert Decimal(record["cost_usd"]) == expected
    assert record["cost_source"]


def test_tool_call_chat_keeps_pairs(
    open_webui: OpenWebUI, backend: FakeBackend, cw: str, counter: TokenCounter
) -> None:
    """A tool-heavy chat (every turn calls a tool, some two at once) is trimmed by whole units."""
    sent: list[dict[str, Any]] = [{"role": "system", "content": "Use the tools."}]
    for turn in range(40):
        sent.append({"role": "user", "content": f"Look up {turn}: " + _filler(turn, 200)})
        calls = [_tool_call(f"call_{turn}_a")] + ([_tool_call(f"call_{turn}_b", "search")] if turn % 3 == 0 else [])
        sent.append({"role": "assistant", "content": None, "tool_calls": calls})
        for call in calls:
            sent.append({"role": "tool", "tool_call_id": call["id"], "content": "found " + _filler(turn + 50, 250)})
        sent.append({"role": "assistant", "content": f"Done {turn}."})
    sent.append({"role": "user", "content": "And now?"})
    chat(open_webui, MODEL, sent)
    got = backend.last_request["messages"]
    assert len(got) < len(sent) and is_subsequence(got, sent)
    assert_valid_prompt(sent, got)
    assert any(m.get("tool_calls") for m in got) and any(m.get("role") == "tool" for m in got)
    assert counter.count_messages(got, MODEL) <= BUDGET


def test_tool_loop_in_progress_is_kept(
    open_webui: OpenWebUI, backend: FakeBackend, cw: str, counter: TokenCounter
) -> None:
    """A request that ends in a tool result (the model's next step) keeps the whole loop."""
    sent = long_chat(turns=40)
    tail = [
        {"role": "assistant", "content": "", "tool_calls": [_tool_call("call_live_1"), _tool_call("call_live_2")]},
        {"role": "tool", "tool_call_id": "call_live_1", "content": "live one"},
        {"role": "tool", "tool_call_id": "call_live_2", "content": "live two"},
    ]
    sent += tail
    chat(open_webui, MODEL, sent)
    got = backend.last_request["messages"]
    assert len(got) < len(sent) and is_subsequence(got, sent)
    assert got[-4:] == sent[-4:]  # the latest question and the loop after it
    assert counter.count_messages(got, MODEL) <= BUDGET


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_short_chat_passes_unchanged(open_webui: OpenWebUI, backend: FakeBackend, cw: str, stream: bool) -> None:
    """A chat within budget reaches the backend byte for byte (and other body keys pass through)."""
    sent = short_chat()
    chat(open_webui, MODEL, sent, stream=stream, temperature=0.3, max_tokens=77)
    request = backend.last_request
    assert json.dumps(request["messages"]) == json.dumps(sent)
    assert request["temperature"] == 0.3 and request["max_tokens"] == 77


def test_user_valves_lower_the_budget(
    open_webui: OpenWebUI, backend: FakeBackend, cw: str, counter: TokenCounter
) -> None:
    """A second user's own max_context_tokens gives a smaller prompt; the admin's stays."""
    user = add_user(open_webui, "Budget User", f"budget-{uuid.uuid4().hex[:8]}@example.com")
    assert (
        set_user_valves(open_webui, cw, {"max_context_tokens": 1_200}, token=user["token"])["max_context_tokens"]
        == 1_200
    )
    sent = long_chat()
    since = open_webui.log_mark()
    chat(open_webui, MODEL, sent)
    admin_tokens = counter.count_messages(backend.last_request["messages"], MODEL)
    chat(open_webui, MODEL, sent, token=user["token"])
    got = backend.last_request["messages"]
    user_tokens = counter.count_messages(got, MODEL)
    assert_valid_prompt(sent, got)
    assert user_tokens <= 1_200 < admin_tokens <= BUDGET
    records = usage_records(open_webui, since)
    assert [r["user_id"] for r in records][-1] == user["id"]
    assert records[-1]["prompt_tokens"] == expected_prompt_tokens(got)


def test_bad_valve_is_refused_and_the_chat_goes_on(open_webui: OpenWebUI, backend: FakeBackend, cw: str) -> None:
    """model_aliases="{bad": the save is refused (HTTP 400, a3cc671) and the stored valves stay
    as they were; the chat still trims and answers. (A bad value stored before the check: see
    test_valves_form's upgrade test, where the log names the valve.)"""
    set_valves(open_webui, cw, base_valves())
    url = f"/api/v1/functions/id/{cw}/valves/update"
    open_webui.api("POST", url, json_body={**base_valves(), "model_aliases": "{bad"}, expect=400)
    assert open_webui.api("GET", f"/api/v1/functions/id/{cw}/valves").get("model_aliases") != "{bad"
    since = open_webui.log_mark()
    sent = long_chat()
    reply = chat(open_webui, MODEL, sent)
    assert reply_text(reply) == backend.default_reply
    assert len(backend.last_request["messages"]) < len(sent)  # still trimming
    assert one_usage_record(open_webui, since)["estimated"] is False


FORCED_ERROR = """

def trim_messages(*args, **kwargs):  # e2e: replaces the real one (later definition wins)
    raise RuntimeError("e2e: forced internal error")
"""


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_internal_error_fails_open(open_webui: OpenWebUI, backend: FakeBackend, cw: str, stream: bool) -> None:
    """A variant of the built file whose trim raises: the chat answers 200 and the backend gets
    the untrimmed messages; one warning without message text says which hook failed."""
    source = BUILT_FILE.read_text("utf-8")
    assert "= trim_messages(" in source, "the filter no longer calls trim_messages: update this test"
    update_function_source(open_webui, cw, source + FORCED_ERROR)
    try:
        sent = long_chat()
        since = open_webui.log_mark()
        reply = chat(open_webui, MODEL, sent, stream=stream)
        assert reply_text(reply) == backend.default_reply
        assert backend.last_request["messages"] == sent
        line = wait_for_log(open_webui, "failed (RuntimeError", since=since)
        assert "body passed through unchanged" in line
        assert "quartz" not in open_webui.log_text(since)  # no message text in the log
        one_usage_record(open_webui, since)  # outlet still logs the reply
    finally:
        update_function_source(open_webui, cw, source)
    chat(open_webui, MODEL, long_chat())
    assert len(backend.last_request["messages"]) < len(sent), "the restored file trims again"


def test_forged_usage_through_chat_completed_is_not_believed(open_webui: OpenWebUI, cw: str) -> None:
    """Any signed-in user can POST /api/chat/completed with their own `usage` (issue 13): a cost
    of "1e999000" and counts of 1e20 or "²" are unknown. The reply is priced from its tokens or
    estimated, the usage line stays short, and the server answers (once, this took 33 s and
    stalled every other user)."""
    forged = [
        ({"prompt_tokens": 1000, "completion_tokens": 100, "cost": "1e999000"}, False),
        ({"prompt_tokens": 1e20, "completion_tokens": "²"}, True),
    ]
    for usage, estimated in forged:
        since = open_webui.log_mark()
        body = {
            "model": MODEL,
            "chat_id": f"local:{uuid.uuid4()}",
            "id": str(uuid.uuid4()),
            "session_id": None,
            "messages": [
                {"role": "user", "content": "Hello?"},
                {"role": "assistant", "content": "Hi.", "usage": usage},
            ],
        }
        open_webui.api("POST", "/api/chat/completed", json_body=body)
        line = wait_for_log(open_webui, " - usage {", timeout=20, since=since)
        assert len(line) < 2_000
        record = one_usage_record(open_webui, since)
        assert record["estimated"] is estimated and record["cost_source"] == "price_table"
        assert record["prompt_tokens"] <= 1_000_000_000 and Decimal(record["cost_usd"]) < 1
        if not estimated:  # gpt-4o: 1000 x $2.50/M + 100 x $10/M
            assert Decimal(record["cost_usd"]) == Decimal("0.0035")
        assert "usage not believed" in open_webui.log_text(since)  # one warning, no value in it
        assert "1e999000" not in open_webui.log_text(since)


def test_calibration_learns_from_what_the_stream_reported(open_webui: OpenWebUI, backend: FakeBackend, cw: str) -> None:
    """The fake backend counts ~1.3x tiktoken. A non-streamed reply's usage reaches the filter
    only in its outlet (for a saved chat, the saved message's: its user's to write), so it
    teaches the factor every user of the model trims with nothing. A streamed reply's usage
    passes the filter's `stream` hook inside Open WebUI: that teaches it, and the next turn's
    budget is calibrated."""
    model = "openai/gpt-4o-mini"  # its own factor: no other scenario here learns one for it
    set_valves(open_webui, cw, {**base_valves(), "calibrate_counts": True})

    def factor_shown(stream: bool) -> float | None:
        since = open_webui.log_mark()
        text_only = [m for m in long_chat(turns=12) if m["role"] != "tool" and not m.get("tool_calls")]
        chat(open_webui, model, text_only, stream=stream)
        one_usage_record(open_webui, since)
        shown = re.search(r"calibrated ×([0-9.]+)", open_webui.log_text(since))
        return float(shown.group(1)) if shown else None

    assert [factor_shown(False) for _ in range(6)] == [None] * 6  # usage in the outlet alone
    assert factor_shown(True) is None  # this turn's budget was not calibrated yet; its stream teaches
    learned = factor_shown(True)
    assert learned is not None and 1.15 < learned < 1.45, learned
