"""What a summary call costs is the turn's user's: its usage (or an estimate) priced for the
summary model, one `usage` line, a ledger row under that model, the user's spend and limits.
A mocked endpoint (respx) with OpenAI's reply shape; the in-process store and a real Redis."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from datetime import UTC, datetime
from decimal import Decimal

import httpx
import pytest
import respx
from test_summarize import OPENAI_USAGE
from test_summarize import completion as openai_completion

import contextwarden.face.bookkeeping as bookkeeping_module
import contextwarden.face.summarize as summarize_module
from contextwarden.errors import TurnRefused
from contextwarden.face.summarize import SUMMARY_LABEL, SummaryCall, SummaryConfig, summarize_messages
from contextwarden.money.ledger import read_ledger, read_month
from contextwarden.money.records import UsageRecord
from contextwarden.money.spendbook import SpendBook
from contextwarden.state.store import MemoryStore

from helpers import chat_of, make_filter, store_of, usage_records
from turns import reply_of, run_turn

D = Decimal
URL = "http://llm.test/v1"
KEY = "sk-test-SECRET-0123456789"
SUMMARY = "The user asked twenty questions about lorem ipsum; the answers were dolor sit."
NOW = datetime(2026, 12, 1, 12, tzinfo=UTC)
# gpt-4o-mini in the bundled table: $0.15 per 1M prompt tokens, $0.60 per 1M completion tokens.
MINI_COST = D(812) * D("0.00000015") + D(19) * D("0.0000006")
DROPPED_TEXT = [{"role": "user", "content": "My cat is called Ada."}]


def completion(usage: dict | None) -> httpx.Response:
    """OpenAI's completion of this file's SUMMARY with `usage` (None: left out)."""
    return openai_completion(SUMMARY, usage)


def summary_valves(model: str = "gpt-4o-mini", **more) -> dict:
    return dict(
        summary_enabled=True,
        summary_base_url=URL,
        summary_model=model,
        summary_api_key=KEY,
        summary_max_tokens=120,
        max_context_tokens=2_400,  # a room for 8 of chat_of's turns: whole turns, one summary
        reserve_output_tokens=0,
        openrouter_pricing=False,  # the bundled prices: no fetch beside the mocked endpoint
        **more,
    )


class Clock:
    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture
def llm():
    with respx.mock(assert_all_called=False) as mock:
        yield mock


@pytest.fixture(params=["memory", "redis"])
def store_valves(request) -> dict:
    return {} if request.param == "memory" else {"redis_url": request.getfixturevalue("redis_url")}


def filter_with(counter, valves: dict, now: datetime = NOW):
    """A filter holding the store its valves name from the start, on a fixed clock."""
    return make_filter(counter, store=store_of(valves), clock=Clock(now), **valves)


def summary_lines(caplog) -> list[dict]:
    return [r for r in usage_records(caplog) if r.get("call") == "summary"]


def no_secret(caplog) -> None:
    for secret in (KEY, "lorem", "dolor", "ann@example.com"):
        assert secret not in caplog.text


def user_of(unique: str) -> dict:
    return {"id": f"u-{unique}", "role": "user", "name": "Ann", "email": "ann@example.com"}


async def test_a_summary_call_is_logged_priced_and_counted_as_the_users(llm, counter, caplog, store_valves, unique):
    route = llm.post(f"{URL}/chat/completions").mock(return_value=completion(OPENAI_USAGE))
    f = filter_with(counter, {**store_valves, **summary_valves()})
    user = user_of(unique)
    caplog.set_level(logging.INFO, logger="contextwarden")
    run = await run_turn(f, chat_of(20), user=user, chat_id=f"c-{unique}")
    assert run.after_request["messages"][1]["content"].startswith(SUMMARY_LABEL) and route.call_count == 1
    [line] = summary_lines(caplog)
    assert line["model"] == "gpt-4o-mini" and line["resolved_model"] == "openai/gpt-4o-mini"
    assert (line["user_id"], line["chat_id"]) == (user["id"], f"c-{unique}")
    assert (line["prompt_tokens"], line["completion_tokens"], line["estimated"]) == (812, 19, False)
    assert D(line["cost_usd"]) == MINI_COST and line["cost_source"] == "price_table"
    assert UsageRecord.from_json(json.dumps(line)).call == "summary"
    assert len(usage_records(caplog)) == 2  # the summary call's line and the reply's, which has no `call`
    rows = {(e.user, e.model): e for e in await read_ledger(f.store)}
    mini = rows[(user["id"], "openai/gpt-4o-mini")]  # its own row, beside the reply's under gpt-4o
    assert (mini.counters["requests"], mini.counters["prompt_tokens"], mini.cost_usd) == (1, 812, MINI_COST)
    assert (user["id"], "openai/gpt-4o") in rows
    month = await read_month(f.store, NOW.date())  # what `!usage` reads
    assert "openai/gpt-4o-mini" in {row.key for row in month.models}
    day, _ = await SpendBook().spend(f.store, user["id"], NOW.date())
    reply_cost = rows[(user["id"], "openai/gpt-4o")].cost_usd
    assert day.usd == MINI_COST + reply_cost and day.requests == 2
    no_secret(caplog)


async def test_a_cached_summary_costs_nothing(llm, counter, caplog, unique):
    route = llm.post(f"{URL}/chat/completions").mock(return_value=completion(OPENAI_USAGE))
    f = filter_with(counter, summary_valves())
    user = user_of(unique)
    caplog.set_level(logging.INFO, logger="contextwarden")
    await run_turn(f, chat_of(20), user=user, chat_id="c1")
    again = await run_turn(f, chat_of(20), user=user, chat_id="c2")  # the same dropped history: the cache's
    assert again.after_request["messages"][1]["content"].startswith(SUMMARY_LABEL)
    assert route.call_count == 1 and len(summary_lines(caplog)) == 1
    mini = [e for e in await read_ledger(f.store) if e.model == "openai/gpt-4o-mini"]
    assert [e.counters["requests"] for e in mini] == [1]
    day, _ = await SpendBook().spend(f.store, user["id"], NOW.date())
    assert day.requests == 3  # one summary call, two replies


async def test_a_reply_without_usage_is_estimated_from_what_was_sent_and_received(llm, counter, caplog, unique):
    route = llm.post(f"{URL}/chat/completions").mock(return_value=completion(None))
    f = filter_with(counter, summary_valves())
    user = user_of(unique)
    caplog.set_level(logging.INFO, logger="contextwarden")
    await run_turn(f, chat_of(20), user=user)
    sent = json.loads(route.calls.last.request.content)["messages"]
    prompt, completion_tokens = counter.count_messages(sent, "gpt-4o-mini"), counter.count_text(SUMMARY, "gpt-4o-mini")
    [line] = summary_lines(caplog)
    assert (line["prompt_tokens"], line["completion_tokens"]) == (prompt, completion_tokens) and prompt > 100
    assert line["estimated"] is True and line["usage_shape"] == "estimate"
    assert D(line["cost_usd"]) == prompt * D("0.00000015") + completion_tokens * D("0.0000006")
    [mini] = [e for e in await read_ledger(f.store) if e.model == "openai/gpt-4o-mini"]
    assert (mini.counters["estimated"], mini.counters["prompt_tokens"]) == (1, prompt)
    no_secret(caplog)


async def test_an_unknown_summary_price_is_unknown_never_zero(llm, counter, caplog, unique):
    llm.post(f"{URL}/chat/completions").mock(return_value=completion(OPENAI_USAGE))
    f = filter_with(counter, summary_valves("local-summarizer-7b"))
    user = user_of(unique)
    caplog.set_level(logging.INFO, logger="contextwarden")
    await run_turn(f, chat_of(20), user=user)
    [line] = summary_lines(caplog)
    assert line["cost_usd"] is None and line["resolved_model"] is None and line["cost_note"]
    [row] = [e for e in await read_ledger(f.store) if e.model == "local-summarizer-7b"]
    assert (row.counters["unpriced"], row.counters["prompt_tokens"]) == (1, 812)
    day, _ = await SpendBook().spend(f.store, user["id"], NOW.date())
    assert day.unpriced == 1 and day.tokens >= 831  # token limits count it, dollar limits cannot


async def test_a_daily_limit_refuses_the_next_turn_once_summaries_take_the_user_over(
    llm, counter, store_valves, unique
):
    """gpt-4o as the summary model: 399,600 prompt tokens at $2.50 per 1M are $0.999, under the
    $1 limit; the reply (1,000 prompt tokens, $0.0025) takes the day over, and the next turn is
    refused. Without the summary's cost the day held $0.0025."""
    usage = {"prompt_tokens": 399_600, "completion_tokens": 0, "total_tokens": 399_600}
    llm.post(f"{URL}/chat/completions").mock(return_value=completion(usage))
    f = filter_with(counter, {**store_valves, **summary_valves("gpt-4o"), "daily_limit_usd": 1})
    user = user_of(unique)
    await run_turn(f, chat_of(20), user=user, reply=reply_of(usage={"prompt_tokens": 1_000, "completion_tokens": 0}))
    day, _ = await SpendBook().spend(f.store, user["id"], NOW.date())
    assert day.usd == D("0.999") + D("0.0025")
    with pytest.raises(TurnRefused, match=r"daily limit of \$1.00 is reached \(\$1.00 used today\)"):
        await run_turn(f, chat_of(1), user=user, chat_id="c2")


async def test_workers_on_one_redis_count_each_call_once_and_share_the_cache(llm, counter, caplog, redis_url, unique):
    route = llm.post(f"{URL}/chat/completions").mock(return_value=completion(OPENAI_USAGE))
    valves = {"redis_url": redis_url, **summary_valves()}
    one, two = filter_with(counter, valves), filter_with(counter, valves)
    user = user_of(unique)
    caplog.set_level(logging.INFO, logger="contextwarden")
    await run_turn(one, chat_of(20), user=user, chat_id="c1")
    await run_turn(two, chat_of(20), user=user, chat_id="c2")  # the summary another worker cached
    other = chat_of(20)
    other[1] = {"role": "user", "content": "question zero, put otherwise " + "lorem ipsum " * 60}
    await run_turn(two, other, user=user, chat_id="c3")  # other dropped messages: a new call
    assert route.call_count == 2 and len(summary_lines(caplog)) == 2
    [mini] = [e for e in await read_ledger(one.store) if e.model == "openai/gpt-4o-mini"]
    assert (mini.counters["requests"], mini.cost_usd) == (2, 2 * MINI_COST)
    day, _ = await SpendBook().spend(two.store, user["id"], NOW.date())
    assert day.requests == 5  # two summary calls, three replies, in either worker's view


async def test_a_failure_to_count_never_costs_the_turn_its_summary(llm, counter, caplog, monkeypatch, unique):
    llm.post(f"{URL}/chat/completions").mock(return_value=completion(OPENAI_USAGE))
    f = filter_with(counter, summary_valves())
    user = user_of(unique)

    async def broken(*args, **kwargs):
        raise ConnectionError(f"ledger down for {KEY}")

    monkeypatch.setattr(bookkeeping_module, "record_reply", broken)
    caplog.set_level(logging.INFO, logger="contextwarden")
    sent = await f.inlet(
        {"model": "gpt-4o", "messages": chat_of(20), "metadata": {"chat_id": "c1"}}, __user__=user, __metadata__={}
    )
    assert sent["messages"][1]["content"].startswith(SUMMARY_LABEL)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == ["contextwarden: summary call not added to the usage ledger (ConnectionError)"]
    day, _ = await SpendBook().spend(f.store, user["id"], NOW.date())
    assert day.usd >= MINI_COST  # the spend is written whether or not the ledger was

    async def unpriceable(*args, **kwargs):
        raise RuntimeError("price book broken")

    monkeypatch.setattr(f, "_resolve", unpriceable)  # anything else: one warning, the summary stays
    monkeypatch.setattr(f._books, "_resolve", unpriceable)
    caplog.clear()
    other = chat_of(20)
    other[1] = {"role": "user", "content": "question zero, put otherwise " + "lorem ipsum " * 60}
    again = await f.inlet({"model": "gpt-4o", "messages": other}, __user__=user)
    assert any(SUMMARY_LABEL in str(m.get("content")) for m in again["messages"])
    assert "contextwarden: summary call not counted (RuntimeError)" in caplog.text
    no_secret(caplog)


async def test_a_summary_call_the_spend_totals_refuse_is_named_as_one(llm, counter, caplog, monkeypatch, unique):
    """The spend write's warning said "reply" for a summary call (its `what` was not passed on)."""
    llm.post(f"{URL}/chat/completions").mock(return_value=completion(OPENAI_USAGE))
    f = filter_with(counter, summary_valves())

    async def broken(*args, **kwargs):
        raise ConnectionError("spend totals down")

    monkeypatch.setattr(f._books._spendbook, "record", broken)
    caplog.set_level(logging.INFO, logger="contextwarden")
    sent = await f.inlet(
        {"model": "gpt-4o", "messages": chat_of(20), "metadata": {"chat_id": "c1"}}, __user__=user_of(unique)
    )
    assert sent["messages"][1]["content"].startswith(SUMMARY_LABEL)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == ["contextwarden: summary call not added to the spend totals (ConnectionError)"]


# What a provider's API answers when it fails or refuses (OpenAI's error bodies, as returned).
OPENAI_500 = {
    "error": {
        "message": "The server had an error while processing your request. Sorry about that!",
        "type": "server_error",
        "param": None,
        "code": None,
    }
}
OPENAI_429 = {
    "error": {
        "message": "Rate limit reached for gpt-4o-mini in organization org-AbC123 on tokens per min (TPM): "
        "Limit 200000, Used 199856, Requested 812. Please try again in 200ms. Visit "
        "https://platform.openai.com/account/rate-limits to learn more.",
        "type": "tokens",
        "param": None,
        "code": "rate_limit_exceeded",
    }
}
OPENAI_401 = {
    "error": {
        "message": "Incorrect API key provided: sk-test-**************6789. You can find your API key at "
        "https://platform.openai.com/account/api-keys.",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }
}
# A reasoning model that spent the whole max_tokens thinking: 200, empty content, real usage.
THOUGHT_ONLY_USAGE = {
    "prompt_tokens": 812,
    "completion_tokens": 120,
    "total_tokens": 932,
    "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
    "completion_tokens_details": {
        "reasoning_tokens": 120,
        "audio_tokens": 0,
        "accepted_prediction_tokens": 0,
        "rejected_prediction_tokens": 0,
    },
}


def thought_only() -> httpx.Response:
    response = openai_completion("", THOUGHT_ONLY_USAGE)
    body = json.loads(response.content)
    body["choices"][0]["finish_reason"] = "length"
    return httpx.Response(200, json=body, headers={"content-type": "application/json"})


ASKED: list[httpx.Request] = []  # what a hanging endpoint got (respx records a call once it is answered)


async def never_answers(request):
    ASKED.append(request)
    await asyncio.Event().wait()


def asked(route) -> list[httpx.Request]:
    """What the route was asked, answered or not."""
    return [call.request for call in route.calls] + ASKED


SENT_THEN_FAILED = {  # the request was written whole: the provider may have run it
    "read timeout": {"side_effect": httpx.ReadTimeout("timed out")},
    "no answer within summary_timeout_seconds": {"side_effect": never_answers},
    "connection dropped": {"side_effect": httpx.RemoteProtocolError("Server disconnected without sending a response.")},
    "200 that is not JSON": {"return_value": httpx.Response(200, text="<html>upstream error</html>")},
}
NEVER_RUN = {  # nothing reached the provider, or it answered that it failed: no cost
    "connection refused": {"side_effect": httpx.ConnectError("[Errno 111] Connection refused")},
    "connect timeout": {"side_effect": httpx.ConnectTimeout("timed out")},
    "HTTP 429": {"return_value": httpx.Response(429, json=OPENAI_429)},
    "HTTP 401": {"return_value": httpx.Response(401, json=OPENAI_401)},
    "HTTP 500 with OpenAI's body": {"return_value": httpx.Response(500, json=OPENAI_500)},
    "HTTP 502 without a body": {"return_value": httpx.Response(502)},
}


@pytest.mark.parametrize("mock", SENT_THEN_FAILED.values(), ids=SENT_THEN_FAILED.keys())
async def test_a_call_that_failed_after_it_was_sent_is_charged_the_most_it_can_cost(
    llm, counter, caplog, store_valves, unique, mock
):
    """Before: not counted at all, though the provider may bill it (it generated tokens until the
    timeout). Now: the prompt sent (our count) and the summary_max_tokens asked for (120), marked
    estimated, shape `upper_bound`, in the usage line, the ledger and the user's spend."""
    ASKED.clear()
    route = llm.post(f"{URL}/chat/completions").mock(**mock)
    f = filter_with(counter, {**store_valves, **summary_valves(summary_timeout_seconds=0.3)})
    user = user_of(unique)
    caplog.set_level(logging.INFO, logger="contextwarden")
    run = await run_turn(f, chat_of(20), user=user, chat_id=f"c-{unique}")
    assert not any(SUMMARY_LABEL in str(m.get("content")) for m in run.after_request["messages"])
    [request] = asked(route)  # the request pass does not ask again (the failure is remembered)
    sent = json.loads(request.content)["messages"]
    prompt = counter.count_messages(sent, "gpt-4o-mini")
    cost = prompt * D("0.00000015") + 120 * D("0.0000006")
    [line] = summary_lines(caplog)
    assert (line["prompt_tokens"], line["completion_tokens"], line["estimated"]) == (prompt, 120, True) and prompt > 100
    assert line["usage_shape"] == "upper_bound" and D(line["cost_usd"]) == cost
    rows = {(e.user, e.model): e for e in await read_ledger(f.store)}
    mini = rows[(user["id"], "openai/gpt-4o-mini")]
    assert (mini.counters["requests"], mini.counters["estimated"], mini.cost_usd) == (1, 1, cost)
    assert (mini.counters["prompt_tokens"], mini.counters["completion_tokens"]) == (prompt, 120)
    day, _ = await SpendBook().spend(f.store, user["id"], NOW.date())
    assert day.usd == cost + rows[(user["id"], "openai/gpt-4o")].cost_usd and day.requests == 2
    no_secret(caplog)


@pytest.mark.parametrize("mock", NEVER_RUN.values(), ids=NEVER_RUN.keys())
async def test_a_call_never_sent_or_refused_costs_nothing(llm, counter, caplog, store_valves, unique, mock):
    route = llm.post(f"{URL}/chat/completions").mock(**mock)
    f = filter_with(counter, {**store_valves, **summary_valves()})
    user = user_of(unique)
    caplog.set_level(logging.INFO, logger="contextwarden")
    await run_turn(f, chat_of(20), user=user, chat_id=f"c-{unique}")
    assert route.call_count == 1 and summary_lines(caplog) == []
    assert {e.model for e in await read_ledger(f.store) if e.user == user["id"]} == {"openai/gpt-4o"}
    day, _ = await SpendBook().spend(f.store, user["id"], NOW.date())
    assert day.requests == 1
    no_secret(caplog)


async def test_a_reply_that_is_all_thinking_is_charged_its_real_usage(llm, counter, caplog, unique):
    """A 200 with empty content (a reasoning model spent max_tokens thinking) was dropped as a
    failure and not counted; the provider billed its 812 + 120 tokens, which are now counted."""
    llm.post(f"{URL}/chat/completions").mock(return_value=thought_only())
    f = filter_with(counter, summary_valves())
    caplog.set_level(logging.INFO, logger="contextwarden")
    await run_turn(f, chat_of(20), user=user_of(unique))
    [line] = summary_lines(caplog)
    assert (line["prompt_tokens"], line["completion_tokens"], line["reasoning_tokens"]) == (812, 120, 120)
    assert line["estimated"] is False and line["usage_shape"] == "openai"
    assert D(line["cost_usd"]) == D(812) * D("0.00000015") + D(120) * D("0.0000006")


async def test_calls_never_started_cost_nothing_and_a_hung_one_is_charged_once(llm, counter, monkeypatch):
    """While a call hangs, the other turns start none (in-flight limit, then the back-off after
    it fails): of 21 turns, one call, charged once at its bound; the 20 turns are not charged."""
    monkeypatch.setattr(summarize_module, "SUMMARY_SLOW_SECONDS", 0.05)
    ASKED.clear()
    route = llm.post(f"{URL}/chat/completions").mock(side_effect=never_answers)
    spent: list[SummaryCall] = []

    async def spend(call: SummaryCall) -> None:
        spent.append(call)

    config = SummaryConfig(base_url=URL, model="gpt-4o-mini", timeout=0.3, max_tokens=120, spent=spend)
    store = MemoryStore()
    hung = asyncio.ensure_future(summarize_messages([{"role": "user", "content": "hung"}], config=config, store=store))
    await asyncio.sleep(0.1)
    for i in range(10):
        assert await summarize_messages([{"role": "user", "content": f"busy {i}"}], config=config, store=store) is None
    assert await hung is None
    for i in range(10):
        assert await summarize_messages([{"role": "user", "content": f"later {i}"}], config=config, store=store) is None
    assert len(asked(route)) == 1 and len(spent) == 1
    [call] = spent
    assert (call.reply, call.usage, call.max_tokens, call.sent[1]["content"]) == (None, None, 120, "user: hung")


async def test_a_real_socket_tells_a_request_sent_from_one_never_sent(counter):
    """Without a mock: a server that reads the request and never answers is charged (the
    request was written whole); a port nobody listens on is not (nothing was sent)."""
    received = asyncio.Event()

    async def reads_and_hangs(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        received.set()
        await asyncio.Event().wait()

    spent: list[SummaryCall] = []

    async def spend(call: SummaryCall) -> None:
        spent.append(call)

    server = await asyncio.start_server(reads_and_hangs, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        config = SummaryConfig(f"http://127.0.0.1:{port}/v1", "gpt-4o-mini", timeout=0.3, max_tokens=120, spent=spend)
        assert await summarize_messages(DROPPED_TEXT, config=config, store=MemoryStore()) is None
        assert received.is_set() and [c.reply for c in spent] == [None]
    finally:
        server.close()
    with socket.socket() as probe:  # a port that was free a moment ago: connection refused
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    config = SummaryConfig(f"http://127.0.0.1:{closed}/v1", "gpt-4o-mini", timeout=0.3, max_tokens=120, spent=spend)
    assert await summarize_messages(DROPPED_TEXT, config=config, store=MemoryStore()) is None
    assert len(spent) == 1


async def charges_done() -> None:
    """Wait for the summary charges running in tasks of their own (`summarize._charge`)."""
    await asyncio.gather(*getattr(summarize_module, "_charging", ()))


async def cancelled_once_asked(hook, asked_event: asyncio.Event) -> None:
    """Run `hook` as a task, cancel it once the endpoint holds its summary request (the user
    stopped the turn); the cancellation reaches the caller."""
    task = asyncio.ensure_future(hook)
    await asyncio.wait_for(asked_event.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 1)


async def test_a_turn_stopped_while_its_summary_call_waits_is_charged_the_most_it_can_cost(
    llm, counter, caplog, store_valves, unique
):
    """The user stops the turn (its task cancelled) while the endpoint holds the request it got
    whole. Before: the cancellation went past the charge, nothing was counted ($0), though the
    provider runs and bills the call. Now: the upper bound, as for a call that timed out, in the
    usage line, the ledger and the spend; and the cancellation still reaches the caller."""
    ASKED.clear()
    asked_event = asyncio.Event()

    async def holds(request):
        asked_event.set()
        await never_answers(request)

    route = llm.post(f"{URL}/chat/completions").mock(side_effect=holds)
    f = filter_with(counter, {**store_valves, **summary_valves(summary_timeout_seconds=30)})
    user = user_of(unique)
    caplog.set_level(logging.INFO, logger="contextwarden")
    metadata = {"chat_id": f"c-{unique}", "user_id": user["id"], "message_id": "m1"}
    body = {"model": "gpt-4o", "messages": chat_of(20), "stream": True, "metadata": metadata}
    await cancelled_once_asked(f.inlet(body, __user__=user, __metadata__=metadata), asked_event)
    await charges_done()
    [request] = asked(route)
    prompt = counter.count_messages(json.loads(request.content)["messages"], "gpt-4o-mini")
    cost = prompt * D("0.00000015") + 120 * D("0.0000006")
    [line] = summary_lines(caplog)
    assert (line["prompt_tokens"], line["completion_tokens"], line["estimated"]) == (prompt, 120, True) and prompt > 100
    assert line["usage_shape"] == "upper_bound" and D(line["cost_usd"]) == cost
    assert (line["user_id"], line["chat_id"]) == (user["id"], f"c-{unique}")
    [mini] = [e for e in await read_ledger(f.store) if e.user == user["id"]]  # the turn never started
    assert (mini.model, mini.counters["requests"], mini.counters["estimated"], mini.cost_usd) == (
        "openai/gpt-4o-mini",
        1,
        1,
        cost,
    )
    day, _ = await SpendBook().spend(f.store, user["id"], NOW.date())
    assert (day.usd, day.tokens, day.requests) == (cost, prompt + 120, 1)
    no_secret(caplog)


async def test_a_stopped_turn_goes_on_at_once_and_its_charge_is_bounded(llm, monkeypatch, caplog):
    """The charge of a call the stopped turn leaves behind runs in a task of its own: the
    cancellation is not held up by it (a store that hangs), and it is given up after
    SUMMARY_CHARGE_SECONDS with one warning. A turn stopped before its request was written
    (here, while its client is made) is charged nothing."""
    ASKED.clear()
    asked_event = asyncio.Event()

    async def holds(request):
        asked_event.set()
        await never_answers(request)

    llm.post(f"{URL}/chat/completions").mock(side_effect=holds)
    monkeypatch.setattr(summarize_module, "SUMMARY_CHARGE_SECONDS", 0.2, raising=False)
    entered, given_up, spent = asyncio.Event(), asyncio.Event(), []

    async def hangs(call: SummaryCall) -> None:
        spent.append(call)
        entered.set()
        try:
            await asyncio.Event().wait()
        finally:
            given_up.set()

    config = SummaryConfig(base_url=URL, model="gpt-4o-mini", timeout=30, max_tokens=120, spent=hangs)
    caplog.set_level(logging.INFO, logger="contextwarden")
    await cancelled_once_asked(summarize_messages(DROPPED_TEXT, config=config, store=MemoryStore()), asked_event)
    assert not given_up.is_set()  # the turn went on while its charge still waits for the store
    await asyncio.wait_for(entered.wait(), 1)
    assert [(c.reply, c.max_tokens) for c in spent] == [(None, 120)]
    await asyncio.wait_for(given_up.wait(), 1)
    await charges_done()
    assert "contextwarden: summary call not counted (TimeoutError)" in caplog.text

    client_made, never_made = asyncio.Event(), asyncio.Event()

    async def slow_client(**kwargs):
        client_made.set()
        await never_made.wait()

    monkeypatch.setattr(summarize_module, "async_client", slow_client)
    ASKED.clear()
    await cancelled_once_asked(summarize_messages(DROPPED_TEXT, config=config, store=MemoryStore()), client_made)
    await charges_done()
    assert len(spent) == 1 and ASKED == []
