"""Summaries of what a trim dropped: one mocked call (respx), cache, failures, budget, idempotence."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import tracemalloc
import zlib
from itertools import pairwise

import httpx
import pytest
import respx
from hypothesis import given, settings
from hypothesis import strategies as st

import contextwarden.face.summarize as summarize_module
from contextwarden import trim_messages
from contextwarden.face.summarize import (
    LEGACY_SUMMARY_LABEL,
    SUMMARY_ACK,
    SUMMARY_LABEL,
    SummaryConfig,
    endpoint_problem,
    find_summary,
    insert_summary,
    summarize_messages,
    summarize_trim,
    summary_note,
)
from contextwarden.state.store import MemoryStore

from chatgen import random_chat
from chats import frozen
from helpers import Events, body_of, chat_of, make_filter

URL = "http://llm.test/v1"
# A window whose room holds 8 of chat_of's turns: whole turns, so the same history is dropped
# turn after turn and its summary is made once (a room for fewer picks single messages:
# `fresh.picks_messages`).
WINDOW = 2_400
ANY_POSITION = range(10_000)  # find_summary by the note's text alone (the filter passes what its note recorded)
KEY = "sk-test-SECRET-0123456789"
SUMMARY = "The user asked ten questions about lorem ipsum; the answers were dolor sit."
CONFIG = SummaryConfig(base_url=URL, model="mini", api_key=KEY, timeout=2.0, max_tokens=120)
DROPPED = [{"role": "user", "content": "My cat is called Ada."}, {"role": "assistant", "content": "Nice name."}]
SUMMARY_VALVES = dict(
    summary_enabled=True, summary_base_url=URL, summary_model="mini", summary_api_key=KEY, summary_max_tokens=120
)


OPENAI_USAGE = {
    "prompt_tokens": 812,
    "completion_tokens": 19,
    "total_tokens": 831,
    "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
    "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0},
}


def completion(text: str = SUMMARY, usage: dict | None = OPENAI_USAGE) -> httpx.Response:
    """A chat completion as OpenAI's API returns one (non-streaming); `usage` None: left out."""
    body = {
        "id": "chatcmpl-AbC123summary",
        "object": "chat.completion",
        "created": 1764547200,
        "model": "gpt-4o-mini-2024-07-18",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None, "annotations": []},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "service_tier": "default",
        "system_fingerprint": "fp_560af6e559",
    }
    if usage is not None:
        body["usage"] = usage
    return httpx.Response(200, json=body, headers={"content-type": "application/json"})


def merge_system_messages(messages: list[dict]) -> list[dict]:
    """What Open WebUI 0.12.4 does after the `request` hook (`utils/misc.py`): every system
    message's text joined into one at position 0 (string contents here)."""
    system = [m["content"] for m in messages if m.get("role") == "system" and m.get("content")]
    others = [m for m in messages if m.get("role") != "system"]
    return [{"role": "system", "content": "\n".join(system)}, *others] if system else others


def assert_alternates(messages: list[dict]) -> None:
    """After the system prompt: a user message first, then user and assistant turns in turn
    (a `tool` reply belongs to the assistant turn before it). Recall blocks too: each is followed
    by its acknowledgement."""
    roles = [m["role"] for m in messages if m["role"] not in ("system", "tool")]
    assert roles[0] == "user" and all(a != b for a, b in pairwise(roles)), roles


@pytest.fixture
def llm():
    with respx.mock(assert_all_called=False) as mock:
        yield mock


def no_secret(caplog, events: Events | None = None) -> None:
    assert KEY not in caplog.text and "Ada" not in caplog.text and "lorem" not in caplog.text
    if events is not None:
        assert KEY not in json.dumps(events.items)


async def test_success_sends_one_bounded_request(llm):
    route = llm.post(f"{URL}/chat/completions").mock(return_value=completion())
    assert await summarize_messages(DROPPED, config=CONFIG, store=MemoryStore()) == SUMMARY
    request = route.calls.last.request
    assert request.headers["authorization"] == f"Bearer {KEY}"
    sent = json.loads(request.content)
    assert sent["model"] == "mini" and sent["max_tokens"] == 120 and sent["stream"] is False
    assert sent["messages"][1]["content"] == "user: My cat is called Ada.\nassistant: Nice name."


async def test_input_and_output_are_bounded(llm):
    route = llm.post(f"{URL}/chat/completions").mock(return_value=completion("word " * 50_000))
    huge = [{"role": "user", "content": f"message {i} " + "x" * 9_000} for i in range(40)]
    text = await summarize_messages(huge, config=CONFIG, store=MemoryStore())
    assert len(text) <= CONFIG.max_tokens * 8
    transcript = json.loads(route.calls.last.request.content)["messages"][1]["content"]
    assert len(transcript) <= 24_000 and "message 39 " in transcript and "message 0 " not in transcript


async def test_cache_hit_makes_no_second_call(llm):
    route = llm.post(f"{URL}/chat/completions").mock(return_value=completion())
    store = MemoryStore()
    first = await summarize_messages(DROPPED, config=CONFIG, store=store)
    second = await summarize_messages([dict(m) for m in DROPPED], config=CONFIG, store=store)
    assert first == second == SUMMARY and route.call_count == 1
    [key] = await store.keys("summary:*")
    other = await summarize_messages(DROPPED[:1], config=CONFIG, store=store)  # other content, other key
    assert other == SUMMARY and route.call_count == 2 and len(await store.keys("summary:*")) == 2
    assert KEY not in key


async def test_cache_is_shared_through_redis(llm, redis_url, unique):
    from contextwarden.state.store import RedisStore

    route = llm.post(f"{URL}/chat/completions").mock(return_value=completion())
    llm.route(host="127.0.0.1").pass_through()
    content = [{"role": "user", "content": f"unique {unique}"}]
    one, two = RedisStore(redis_url), RedisStore(redis_url)
    try:
        assert await summarize_messages(content, config=CONFIG, store=one) == SUMMARY
        assert await summarize_messages(content, config=CONFIG, store=two) == SUMMARY
        assert route.call_count == 1 and one.shared and two.shared
    finally:
        await one.aclose()
        await two.aclose()


@pytest.mark.parametrize(
    ("effect", "reason"),
    [
        (httpx.ReadTimeout("timed out"), "ReadTimeout"),
        (httpx.ConnectError("refused"), "ConnectError"),
        (httpx.Response(500, text=f"upstream said {KEY}"), "HTTP 500"),
        (httpx.Response(200, text="<html>not json</html>"), "unreadable reply"),
        (httpx.Response(200, json={"choices": []}), "unreadable reply"),
        (httpx.Response(200, json={"choices": [{"message": {"content": "  "}}]}), "empty reply"),
    ],
)
async def test_failures_give_none_and_one_clean_warning(llm, caplog, effect, reason):
    caplog.set_level(logging.DEBUG, logger="contextwarden")
    route = llm.post(f"{URL}/chat/completions").mock(side_effect=[effect])
    store = MemoryStore()
    assert await summarize_messages(DROPPED, config=CONFIG, store=store) is None
    [line] = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert line.getMessage() == f"contextwarden: summary skipped ({reason}); trimmed without one"
    no_secret(caplog)
    # not retried at once (a tool loop calls the filter again within seconds)
    assert await summarize_messages(DROPPED, config=CONFIG, store=store) is None and route.call_count == 1


async def test_a_hanging_endpoint_is_abandoned_at_the_timeout(llm, caplog):
    hang = asyncio.Event()

    async def never_answers(request):
        await hang.wait()

    llm.post(f"{URL}/chat/completions").mock(side_effect=never_answers)
    config = SummaryConfig(base_url=URL, model="mini", api_key=KEY, timeout=0.05, max_tokens=120)
    assert await summarize_messages(DROPPED, config=config, store=MemoryStore()) is None
    assert "summary skipped (TimeoutError)" in caplog.text or "summary skipped (ReadTimeout)" in caplog.text


async def test_concurrent_turns_do_not_all_wait_for_a_hanging_endpoint(llm, monkeypatch):
    """Before: 50 turns at once against a hanging endpoint made 50 calls and each waited the
    whole timeout (the back-off starts only once a call failed). Now at most `MAX_SUMMARY_CALLS`
    calls are in flight per endpoint, and none starts once one has been for
    `SUMMARY_SLOW_SECONDS`: the other turns go on without a summary at once."""
    monkeypatch.setattr(summarize_module, "SUMMARY_SLOW_SECONDS", 0.3)
    calls = 0

    async def never_answers(request):
        nonlocal calls
        calls += 1
        await asyncio.Event().wait()

    llm.post(f"{URL}/chat/completions").mock(side_effect=never_answers)
    config = SummaryConfig(base_url=URL, model="mini", api_key=KEY, timeout=1.0, max_tokens=120)
    store = MemoryStore()
    loop = asyncio.get_running_loop()

    async def turn(i: int) -> float:
        start = loop.time()
        assert await summarize_messages([{"role": "user", "content": f"chat {i}"}], config=config, store=store) is None
        return loop.time() - start

    one = asyncio.ensure_future(turn(-1))  # a call in flight, past the slow mark by the time the others come
    await asyncio.sleep(0.4)
    waits = await asyncio.gather(*(turn(i) for i in range(50)))
    assert calls == 1 and max(waits) < 0.1  # none called, none waited
    assert await one >= 0.95 and summarize_module._pending == {}
    summarize_module._backoff.clear()
    waits = await asyncio.gather(*(turn(i) for i in range(50, 100)))  # all at once: the slow mark is not reached
    assert calls == 1 + summarize_module.MAX_SUMMARY_CALLS
    assert sum(w >= 0.95 for w in waits) == summarize_module.MAX_SUMMARY_CALLS and sorted(waits)[-5] < 0.1


async def test_a_slow_but_healthy_endpoint_is_not_taken_for_a_hanging_one(llm, monkeypatch):
    """Before: a call in flight for `SUMMARY_SLOW_SECONDS` kept every other turn from calling,
    whatever the endpoint's pace: a model that takes 5 s a summary (3 s the mark) cost every
    other user theirs while one call ran. Now the mark is the endpoint's own pace once it has
    answered (`SUMMARY_PACE_FACTOR` x its slowest recent answer), so turns beside a call as slow
    as the endpoint's usual get theirs; one past that pace still stops new calls."""
    monkeypatch.setattr(summarize_module, "SUMMARY_SLOW_SECONDS", 0.2)
    delay, calls = 0.4, 0

    async def answers(request):
        nonlocal calls
        calls += 1
        await asyncio.sleep(delay)
        return completion()

    llm.post(f"{URL}/chat/completions").mock(side_effect=answers)
    config = SummaryConfig(base_url=URL, model="mini", api_key=KEY, timeout=5.0, max_tokens=120)
    store = MemoryStore()

    def turn(i: int):
        return summarize_messages([{"role": "user", "content": f"chat {i}"}], config=config, store=store)

    assert await turn(0) == SUMMARY  # its pace: 0.4 s, so the mark is 0.6 s
    one = asyncio.ensure_future(turn(1))
    await asyncio.sleep(0.3)  # past SUMMARY_SLOW_SECONDS, within the endpoint's pace
    assert await turn(2) == SUMMARY and await one == SUMMARY
    assert calls == 3
    delay = 5.0  # now it hangs: a call past 1.5 x its pace stops new ones
    late = asyncio.ensure_future(turn(3))
    await asyncio.sleep(0.7)
    assert await turn(4) is None and calls == 4
    late.cancel()


async def test_concurrent_turns_against_a_healthy_endpoint_each_get_their_summary(llm):
    async def answers(request):
        await asyncio.sleep(0.05)
        return completion()

    route = llm.post(f"{URL}/chat/completions").mock(side_effect=answers)
    dropped = [[{"role": "user", "content": f"chat {i}"}] for i in range(summarize_module.MAX_SUMMARY_CALLS)]
    store = MemoryStore()
    texts = await asyncio.gather(*(summarize_messages(d, config=CONFIG, store=store) for d in dropped))
    assert texts == [SUMMARY] * len(dropped) and route.call_count == len(dropped)
    assert summarize_module._pending == {}


def test_api_key_is_not_in_the_config_repr():
    assert KEY not in repr(CONFIG)


async def test_summarize_trim_fits_the_budget_and_covers_what_it_dropped(llm, counter):
    llm.post(f"{URL}/chat/completions").mock(return_value=completion())
    chat = chat_of(20)

    def retrim(limit):
        return trim_messages(chat, max_tokens=limit, model="gpt-4o", token_counter=counter)

    first = retrim(WINDOW)
    done = await summarize_trim(
        chat, first, retrim=retrim, config=CONFIG, store=MemoryStore(), counter=counter, model="gpt-4o"
    )
    assert done is not None and done.tokens == counter.count_messages(done.messages, "gpt-4o") <= WINDOW
    assert done.messages[0] is chat[0] and done.messages[1] is done.note
    assert done.note == {"role": "user", "content": f"{SUMMARY_LABEL}\n{SUMMARY}"}
    assert done.messages[2] == {"role": "assistant", "content": SUMMARY_ACK}  # the first kept one is a user's
    assert done.messages[3:] == done.result.messages[1:] and find_summary(done.messages, ANY_POSITION) == (1, True)
    assert_alternates(done.messages)
    transcript = json.loads(llm.calls.last.request.content)["messages"][1]["content"]
    assert transcript.count("\n") + 1 == len(done.result.dropped)


async def test_summarize_trim_gives_up_when_there_is_no_room(llm, counter):
    route = llm.post(f"{URL}/chat/completions").mock(return_value=completion())
    chat = chat_of(20)

    def retrim(limit):
        return trim_messages(chat, max_tokens=limit, model="gpt-4o", token_counter=counter)

    first = retrim(150)  # mandatory part alone nearly fills it: no room for 120 summary tokens
    assert (
        await summarize_trim(
            chat, first, retrim=retrim, config=CONFIG, store=MemoryStore(), counter=counter, model="gpt-4o"
        )
        is None
    )
    assert route.call_count == 0


# -- through the filter ----------------------------------------------------------------------


async def test_filter_adds_one_summary_and_a_second_pass_keeps_it(llm, counter, caplog):
    route = llm.post(f"{URL}/chat/completions").mock(return_value=completion())
    f = make_filter(counter, max_context_tokens=WINDOW, reserve_output_tokens=0, **SUMMARY_VALVES)
    chat = chat_of(20)
    before = frozen(chat)
    body = body_of(chat)
    events = Events()
    user = {"id": "u1"}
    first = await f.inlet(body, __user__=user, __metadata__=body["metadata"], __event_emitter__=events)
    sent = first["messages"]
    assert [m["role"] for m in sent[:4]] == ["system", "user", "assistant", "user"]
    assert sent[1]["content"].startswith(SUMMARY_LABEL) and sent[2]["content"] == SUMMARY_ACK
    assert counter.count_messages(sent, "gpt-4o") <= WINDOW == body["metadata"]["contextwarden"]["budget"]
    second = await f.request(first, __user__=user, __metadata__=first["metadata"], __event_emitter__=events)
    assert not events.statuses  # the turn's one line comes after the reply
    assert body["metadata"]["contextwarden"]["pending_line"].endswith(", earlier messages summarized")
    assert second["messages"] == sent and all(a is b for a, b in zip(second["messages"], sent, strict=True))
    assert route.call_count == 1 and frozen(chat) == before
    # next turn: the same history is dropped, so the cached summary keeps the prefix identical
    nxt = chat + [{"role": "assistant", "content": "Four."}, {"role": "user", "content": "And 3+3?"}]
    body2 = body_of(nxt)
    third = await f.inlet(body2, __user__=user, __metadata__=body2["metadata"])
    assert third["messages"][: len(sent)] == sent
    assert route.call_count == 1
    no_secret(caplog, events)


async def test_a_big_chats_trim_for_the_summary_runs_off_the_loop(llm, counter, monkeypatch):
    """The trim that makes room for the note (the chat trimmed again, to the budget less the
    note's) runs where the turn's own trim runs: a big chat's in the contextwarden thread. On
    the loop, 20,000 one-liners' retrim raised the turn's longest stall from 34-49 to 99-135 ms."""
    import threading

    import contextwarden.face.trimpass as trimpass_module

    llm.post(f"{URL}/chat/completions").mock(return_value=completion())
    threads: list[str] = []
    real = trimpass_module.trim_messages
    monkeypatch.setattr(
        trimpass_module,
        "trim_messages",
        lambda *a, **k: threads.append(threading.current_thread().name) or real(*a, **k),
    )
    f = make_filter(counter, max_context_tokens=2_000, reserve_output_tokens=0, **SUMMARY_VALVES)
    chat = chat_of(60, last="What did we say about the lorem ipsum?")
    chat[1:-1] = [{**m, "content": m["content"] * 8} for m in chat[1:-1]]  # some 100,000 characters
    body = body_of(chat)
    sent = await f.inlet(body, __user__={"id": "u1"}, __metadata__=body["metadata"])
    assert sent["messages"][1]["content"].startswith(SUMMARY_LABEL)
    assert len(threads) == 2 and set(threads) == {"contextwarden-cpu_0"}, threads  # the trim, the summary's


NEXT = ["Go on, please.", "Anything else?"]  # words of no dropped message: the selection holds


async def test_the_system_prompt_reaches_the_provider_unchanged_on_every_turn(llm, counter):
    # Before: the note was a system message, which Open WebUI merges into the system prompt
    # after `request`: the prompt's first message changed, and the provider's cache missed.
    route = llm.post(f"{URL}/chat/completions").mock(return_value=completion())
    f = make_filter(counter, max_context_tokens=WINDOW, reserve_output_tokens=0, **SUMMARY_VALVES)
    chat, user = chat_of(20), {"id": "u1"}
    prompts = []
    for turn in range(2):
        body = body_of(chat)
        out = await f.inlet(body, __user__=user, __metadata__=body["metadata"])
        out = await f.request(out, __user__=user, __metadata__=out["metadata"])
        provider = merge_system_messages(out["messages"])  # what Open WebUI sends on
        assert provider[0] == chat[0] and [m["role"] for m in provider].count("system") == 1
        note = provider[1]
        assert note["role"] == "user" and note["content"] == f"{SUMMARY_LABEL}\n{SUMMARY}"
        assert_alternates(provider)
        assert counter.count_messages(out["messages"], "gpt-4o") <= WINDOW
        prompts.append(provider)
        chat = chat + [{"role": "assistant", "content": f"Reply {turn}."}, {"role": "user", "content": NEXT[turn]}]
    for before, now in pairwise(prompts):  # the selection held: each prompt starts with the last
        assert now[: len(before)] == before
    assert route.call_count == 1  # summarized once, then the cached summary


async def test_a_legacy_system_note_is_recognized_and_moved_out_of_the_system_prompt(llm, counter):
    # An older version's note (a system message right after the system prompt) in the input:
    # the same summary goes on, as a user note, never a second one (no call).
    route = llm.post(f"{URL}/chat/completions").mock(return_value=completion())
    f = make_filter(counter, max_context_tokens=WINDOW, reserve_output_tokens=0, **SUMMARY_VALVES)
    legacy = {"role": "system", "content": f"{LEGACY_SUMMARY_LABEL}\nold summary"}
    chat = chat_of(20)
    chat.insert(1, legacy)
    assert find_summary(chat, ANY_POSITION) == (1, True)
    out = await f.request(body_of(chat), __user__={"id": "u1"})
    sent = out["messages"]
    assert route.call_count == 0
    assert sent[0] is chat[0] and [m["role"] for m in sent].count("system") == 1
    assert sent[1] == {"role": "user", "content": f"{SUMMARY_LABEL}\nold summary"} and find_summary(
        sent, ANY_POSITION
    ) == (1, True)
    assert [m for m in sent if LEGACY_SUMMARY_LABEL in str(m["content"]) or SUMMARY_LABEL in str(m["content"])] == [
        sent[1]
    ]
    assert_alternates(sent) and counter.count_messages(sent, "gpt-4o") <= WINDOW
    again = await f.request(out, __user__={"id": "u1"})
    assert again["messages"] == sent and route.call_count == 0


def test_the_note_goes_where_the_dropped_messages_were_and_keeps_the_roles_valid():
    note = summary_note("s")
    system = {"role": "system", "content": "S"}
    user, answer = {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]}
    result = {"role": "tool", "tool_call_id": "c1", "content": "r"}
    ack = {"role": "assistant", "content": SUMMARY_ACK}
    assert insert_summary([system, user, answer], note) == [system, note, ack, user, answer]
    assert insert_summary([system, answer, user], note) == [system, note, answer, user]
    assert insert_summary([system, call, result, user], note) == [system, note, call, result, user]
    assert insert_summary([user], note) == [note, ack, user]
    for messages in ([system, note, ack, user, answer], [system, note, answer, user], [note, ack, user]):
        at, present = find_summary(messages, ANY_POSITION)
        assert present and messages[at] is note
    assert find_summary([system, user, ack], ANY_POSITION) == (None, False)
    assert find_summary([system, {"role": "assistant", "content": note["content"]}], ANY_POSITION) == (None, False)


async def test_filter_respects_a_merged_summary(llm, counter):
    route = llm.post(f"{URL}/chat/completions").mock(return_value=completion())
    f = make_filter(counter, max_context_tokens=WINDOW, reserve_output_tokens=0, **SUMMARY_VALVES)
    # an older version's note, merged into the system prompt as Open WebUI merges system messages
    chat = chat_of(20, system=f"You are helpful.\n{LEGACY_SUMMARY_LABEL}\nold summary")
    out = await f.request(body_of(chat), __user__={"id": "u1"})
    assert (
        route.call_count == 0
        and find_summary(out["messages"], ANY_POSITION) == (None, True)
        and out["messages"][0] is chat[0]
    )
    assert counter.count_messages(out["messages"], "gpt-4o") <= WINDOW


async def test_nosum_flag_and_failures_trim_without_a_summary(llm, counter, caplog):
    route = llm.post(f"{URL}/chat/completions").mock(side_effect=[httpx.Response(503)])
    f = make_filter(counter, max_context_tokens=WINDOW, reserve_output_tokens=0, **SUMMARY_VALVES)
    nosum = await f.inlet(body_of(chat_of(20, last="What now? !nosum")), __user__={"id": "u1"})
    assert route.call_count == 0 and find_summary(nosum["messages"], ANY_POSITION) == (None, False)
    assert nosum["messages"][-1]["content"] == "What now?"
    events, failing = Events(), body_of(chat_of(20))
    failed = await f.request(failing, __user__={"id": "u1"}, __event_emitter__=events)
    assert route.call_count == 1 and find_summary(failed["messages"], ANY_POSITION) == (None, False)
    assert counter.count_messages(failed["messages"], "gpt-4o") <= WINDOW
    assert "summarized" not in failing["metadata"]["contextwarden"]["pending_line"]
    no_secret(caplog, events)


async def test_summary_valves_are_checked(counter):
    f = make_filter(counter, summary_enabled=True, summary_base_url="llm.test", summary_api_key=KEY)
    events = Events()
    await f.inlet(body_of(chat_of(2)), __event_emitter__=events)
    text = " ".join(events.statuses)
    assert "summary_base_url must start with http" in text and "summary_model is empty" in text
    assert KEY not in text
    schema = f.Valves.model_json_schema()["properties"]
    assert schema["summary_api_key"]["input"] == {"type": "password"}
    assert f.Valves().summary_enabled is False


# -- careless admins, dead endpoints, huge replies (issue 13) ------------------------------------


@pytest.mark.parametrize(
    ("valve", "value", "kind"),
    [
        ("summary_api_key", "sk-test\u200b0123", "HTTP header cannot carry"),  # a zero-width space pasted along
        ("summary_api_key", "sk-tést-0123", "HTTP header cannot carry"),
        ("summary_api_key", "sk-test 0123", "HTTP header cannot carry"),
        ("summary_base_url", "http://llm.test:99999/v1", "port"),
        ("summary_base_url", "http://llm.test:0/v1", "port"),
        ("summary_base_url", "http://:8080/v1", "no host"),
        ("summary_base_url", "http://llm.test:80x/v1", "port"),
        ("summary_base_url", "http://llm test/v1", "space"),
        # Before: accepted, and httpx logged the URL, key and all, at INFO on every summary call
        # (the query form also went to /v1?key=.../chat/completions).
        ("summary_base_url", f"http://proxyuser:{KEY}@llm.test/v1", "put the key in summary_api_key"),
        ("summary_base_url", f"http://{KEY}@llm.test/v1", "user name or password"),
        ("summary_base_url", f"http://llm.test/v1?key={KEY}", "put a key in summary_api_key"),
        ("summary_base_url", f"http://llm.test/v1#{KEY}", "fragment"),
    ],
)
async def test_unusable_endpoint_valves_are_named_and_the_turn_is_trimmed_without_a_summary(
    llm, counter, caplog, valve, value, kind
):
    # Before: every trimmed turn went out untrimmed with "internal error" (UnicodeEncodeError
    # from the header, InvalidURL from the port).
    caplog.set_level(logging.INFO)  # httpx logs each request's URL at INFO, as Open WebUI shows it
    route = llm.route(host="llm.test").mock(return_value=completion())  # any call to the summary host
    f = make_filter(counter, max_context_tokens=WINDOW, reserve_output_tokens=0, **{**SUMMARY_VALVES, valve: value})
    events = Events()
    chat = chat_of(20)
    out = await f.inlet(body_of(chat), __user__={"id": "u1"}, __event_emitter__=events)
    assert route.call_count == 0, [str(c.request.url) for c in route.calls]
    assert len(out["messages"]) < len(chat) and counter.count_messages(out["messages"], "gpt-4o") <= WINDOW
    assert find_summary(out["messages"], ANY_POSITION) == (None, False)
    [named] = [s for s in events.statuses if valve in s]
    assert kind in named and "summaries are off" in named and value not in named
    assert not any("internal error" in s for s in events.statuses)
    assert value not in caplog.text and KEY not in caplog.text


async def test_a_key_that_cannot_be_sent_fails_like_the_endpoint_not_the_turn(llm, caplog):
    llm.post(f"{URL}/chat/completions").mock(return_value=completion())
    config = SummaryConfig(base_url=URL, model="mini", api_key="sk-\u200b", timeout=2.0, max_tokens=120)
    assert await summarize_messages(DROPPED, config=config, store=MemoryStore()) is None
    assert "summary skipped (UnicodeEncodeError)" in caplog.text


async def test_a_dead_endpoint_is_skipped_with_a_growing_pause(llm, caplog, monkeypatch):
    # Before: every new trim (new dropped content) waited the full timeout for a dead endpoint.
    now = [1_000.0]
    monkeypatch.setattr(summarize_module.time, "monotonic", lambda: now[0])
    route = llm.post(f"{URL}/chat/completions").mock(side_effect=httpx.ConnectError("refused"))
    store = MemoryStore()

    def dropped(i):
        return [{"role": "user", "content": f"question {i}"}]

    assert await summarize_messages(dropped(1), config=CONFIG, store=store) is None and route.call_count == 1
    assert await summarize_messages(dropped(2), config=CONFIG, store=store) is None and route.call_count == 1  # skipped
    first, longest = summarize_module.SUMMARY_BACKOFF_SECONDS
    now[0] += first + 0.1
    assert await summarize_messages(dropped(3), config=CONFIG, store=store) is None and route.call_count == 2
    now[0] += first + 0.1  # the pause doubled: still skipped
    assert await summarize_messages(dropped(4), config=CONFIG, store=store) is None and route.call_count == 2
    other = SummaryConfig(base_url="http://other.test/v1", model="mini", timeout=2.0, max_tokens=120)
    llm.post("http://other.test/v1/chat/completions").mock(return_value=completion())
    assert await summarize_messages(dropped(4), config=other, store=store) == SUMMARY  # per endpoint
    for _ in range(12):  # bounded: never longer than the longest pause
        now[0] += longest + 0.1
        await summarize_messages(dropped(now[0]), config=CONFIG, store=store)
    calls = route.call_count
    assert calls == 2 + 12
    route.mock(side_effect=None, return_value=completion())
    now[0] += longest + 0.1
    assert await summarize_messages(dropped(5), config=CONFIG, store=store) == SUMMARY and route.call_count == calls + 1
    assert await summarize_messages(dropped(6), config=CONFIG, store=store) == SUMMARY  # success ends the pause
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == calls


@pytest.mark.parametrize("chunked", [False, True])
async def test_a_huge_reply_is_not_read_past_the_cap(llm, caplog, chunked):
    huge = json.dumps({"choices": [{"message": {"content": "word " * 300_000}}]}).encode()
    if chunked:  # no content-length: the read itself stops at the cap
        response = httpx.Response(200, stream=httpx.ByteStream(huge), headers={"transfer-encoding": "chunked"})
    else:
        response = httpx.Response(200, content=huge)
    llm.post(f"{URL}/chat/completions").mock(return_value=response)
    assert await summarize_messages(DROPPED, config=CONFIG, store=MemoryStore()) is None
    assert "summary skipped (reply too large)" in caplog.text


def gzipped(data: bytes) -> bytes:
    pack = zlib.compressobj(9, zlib.DEFLATED, 31)  # gzip
    return pack.compress(data) + pack.flush()


async def test_a_compressed_reply_is_refused_uninflated(caplog, monkeypatch):
    """A small gzip body that inflates past the cap (a broken or hostile endpoint, no
    content-length) is refused, not inflated: httpx inflated each read whole, a 64 KiB read of
    zeros 67 MB (250-325 ms of the event loop, 128 MB more memory). The reply is asked for
    plain, and one compressed anyway is a failure. Served by httpx's MockTransport: respx
    reads (and inflates) a reply in advance."""
    bomb = gzipped(b'{"choices": [{"message": {"content": "' + b"a" * 30_000_000)
    plain = completion().content
    replies = {"bomb": ("gzip", bomb), "gzip": ("gzip", gzipped(plain)), "deflate": ("deflate", zlib.compress(plain))}
    replies |= {"identity": ("identity", plain), "br": ("br", plain)}
    asked: list[httpx.Request] = []

    def endpoint(request: httpx.Request) -> httpx.Response:
        asked.append(request)
        encoding, body = replies[json.loads(request.content)["messages"][1]["content"].split(": ")[-1]]
        headers = {"content-encoding": encoding, "transfer-encoding": "chunked"}
        return httpx.Response(200, stream=httpx.ByteStream(body), headers=headers)

    async def client(**options):
        return httpx.AsyncClient(transport=httpx.MockTransport(endpoint), **options)

    def asking(kind: str) -> list[dict]:
        summarize_module._backoff.clear()  # each reply on its own: a failure pauses the endpoint
        return [{"role": "user", "content": f"reply: {kind}"}]

    monkeypatch.setattr(summarize_module, "async_client", client)
    tracemalloc.start()
    try:
        assert await summarize_messages(asking("bomb"), config=CONFIG, store=MemoryStore()) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "summary skipped (reply in an encoding not asked for)" in caplog.text and peak < 4_000_000, peak
    assert asked[0].headers["accept-encoding"] == "identity"  # asked for it plain
    assert await summarize_messages(asking("identity"), config=CONFIG, store=MemoryStore()) == SUMMARY
    for encoding in ("gzip", "deflate", "br"):  # a server (or proxy) that compresses anyway: no summary
        assert await summarize_messages(asking(encoding), config=CONFIG, store=MemoryStore()) is None


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.text(max_size=40),
        st.text(max_size=30).map(lambda t: "http://" + t),
        st.integers(-5, 10**6).map(lambda p: f"http://h:{p}/v1"),
    )
)
def test_endpoint_check_never_raises_and_passes_only_callable_urls(url):
    problem = endpoint_problem(url)
    if problem is None:
        parsed = httpx.URL(url)
        assert (
            parsed.scheme in ("http", "https") and parsed.host and (parsed.port is None or 1 <= parsed.port <= 65_535)
        )
        assert not parsed.userinfo and not parsed.query and not parsed.fragment and not {"?", "#"} & set(url)


@pytest.mark.parametrize("seed", range(24))
async def test_random_chats_get_a_valid_note_and_a_second_pass_keeps_it(llm, counter, seed):
    llm.post(f"{URL}/chat/completions").mock(return_value=completion())
    f = make_filter(counter, max_context_tokens=900, reserve_output_tokens=0, **SUMMARY_VALVES)
    chat = random_chat(random.Random(seed), 60)
    out = await f.request(body_of(chat), __user__={"id": "u1"})
    sent = out["messages"]
    at, present = find_summary(sent, ANY_POSITION)
    if at is None:  # no room for a note beside the mandatory part: a plain trim
        assert not present and counter.count_messages(sent, "gpt-4o") <= 900
        return
    assert (
        all(m.get("role") in ("system", "developer") for m in sent[:at])
        and sent[:at] == [m for m in chat if m.get("role") in ("system", "developer")][:at]
    )
    after = sent[at + 1] if at + 1 < len(sent) else None
    if after is not None and after.get("content") == SUMMARY_ACK:
        assert after["role"] == "assistant" and sent[at + 2]["role"] == "user"
    else:
        assert after is None or after["role"] == "assistant"  # a tool group goes after the note whole
    check_tool_pairs(sent)
    assert counter.count_messages(sent, "gpt-4o") <= 900
    again = await f.request(out, __user__={"id": "u1"})
    assert again["messages"] == sent


def check_tool_pairs(sent: list[dict]) -> None:
    """Every assistant `tool_calls` answered by the `tool` messages right after it; no orphan."""
    i = 0
    while i < len(sent):
        ids = {c["id"] for c in sent[i].get("tool_calls") or []} if sent[i].get("role") == "assistant" else set()
        assert sent[i].get("role") != "tool", f"orphan tool message at {i}"
        i += 1
        answered = set()
        while i < len(sent) and sent[i].get("role") == "tool":
            answered.add(sent[i].get("tool_call_id"))
            i += 1
        assert ids == answered, f"tool calls {sorted(ids)} answered by {sorted(answered)}"
