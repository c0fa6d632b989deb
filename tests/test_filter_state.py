"""Per-chat state through the store (in-process and real Redis): trim decisions carried across
turns, pins, flags across passes of one turn, and isolation between users and chats."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading

import pytest
import redis
import redis.asyncio as aioredis

import contextwarden.face.trimpass as trimpass_module
import contextwarden.state.store as store_module
from contextwarden.state.chatstate import ChatState, chat_state_key
from contextwarden.state.store import KEY_PREFIX, RedisStore

from helpers import Events, chat_of, grow, make_filter, send, shown, store_of, turn

MODEL = "gpt-4o"


@pytest.fixture(params=["memory", "redis"])
def store_valves(request) -> dict:
    """Valves for an in-process store, or for the real Redis."""
    return {} if request.param == "memory" else {"redis_url": request.getfixturevalue("redis_url")}


def body(chat, user_id: str, chat_id: str) -> dict:
    return {"model": MODEL, "messages": chat, "stream": False, "metadata": {"chat_id": chat_id, "user_id": user_id}}


async def stored_state(f, user_id: str, chat_id: str) -> ChatState:
    return ChatState.from_bytes(await f.store.get(chat_state_key(user_id, chat_id)))


async def test_decision_is_saved_and_passed_back_next_turn(counter, store_valves, trims, unique):
    f = make_filter(
        counter,
        max_context_tokens=1_500,
        reserve_output_tokens=0,
        keep_last_turns=2,
        low_watermark=0.7,
        growth_turns=3,
        **store_valves,
    )
    user_id, chat_id = f"u-{unique}", f"c-{unique}"
    chat = chat_of(20)
    await send(f, chat, user_id, chat_id)
    ((options, result),) = trims
    assert (
        options["previous"] is None
        and options["keep_last_turns"] == 2
        and options["low_watermark"] == 0.7
        and options["growth_turns"] == 3
    )
    assert list(options["pinned"]) == [] and result.decision is not None
    saved = await stored_state(f, user_id, chat_id)
    assert saved.decision == result.decision
    chat = grow(chat, 20)
    await send(f, chat, user_id, chat_id)
    options, second = trims[-1]
    assert options["previous"] == saved.decision
    assert (await stored_state(f, user_id, chat_id)).decision == second.decision


async def test_a_later_pass_of_the_same_turn_keeps_the_turns_decision(counter, store_valves, trims, unique):
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=0, **store_valves)
    user_id, chat_id = f"u-{unique}", f"c-{unique}"
    b = body(chat_of(20), user_id, chat_id)
    first = await f.inlet(b, __user__={"id": user_id}, __metadata__=b["metadata"])
    decided = (await stored_state(f, user_id, chat_id)).decision
    again = await f.request(first, __user__={"id": user_id}, __metadata__=first["metadata"])
    assert again["messages"] == first["messages"]
    assert (await stored_state(f, user_id, chat_id)).decision == decided


async def _stable_share(f, counter, user_id: str, chat_id: str, turns: int) -> float:
    """Share of the tokens sent that repeat the previous turn's prompt from its start (whole
    leading messages equal): what a provider's prompt cache can serve."""
    chat = chat_of(12)
    previous = (await send(f, chat, user_id, chat_id))["messages"]
    cacheable = sent_tokens = 0
    for i in range(turns):
        chat = grow(chat, 100 + i, words=30)
        sent = (await send(f, chat, user_id, chat_id))["messages"]
        pairs = enumerate(zip(previous, sent, strict=False))
        same = next((k for k, (a, b) in pairs if a != b), min(len(previous), len(sent)))
        cacheable += counter.count_messages(sent[:same], "gpt-4o")
        sent_tokens += counter.count_messages(sent, "gpt-4o")
        previous = sent
    return cacheable / sent_tokens


async def test_hysteresis_keeps_the_sent_prefix_across_turns(counter, store_valves, unique):
    f = make_filter(counter, max_context_tokens=1_600, reserve_output_tokens=0, **store_valves)
    with_state = await _stable_share(f, counter, f"u-{unique}", f"c-{unique}", 20)
    without_state = await _stable_share(f, counter, f"u-{unique}", "", 20)  # API callers: no chat id, no state
    # Every message shares words with the question here, so a full recall block always wants its
    # whole room: the selection goes when it leaves less (0.55 with state, 0.28 without).
    assert with_state >= 0.5 and with_state > 1.5 * without_state
    if not store_valves:  # in-process: only the chat with an id left state
        assert await f.store.keys("chat:*") == [chat_state_key(f"u-{unique}", f"c-{unique}")]


async def test_api_callers_leave_no_state(counter, trims, unique):
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=0)
    await send(f, chat_of(20, last="Go !pin"), f"u-{unique}", "")
    await send(f, chat_of(20), f"u-{unique}", "")
    assert await f.store.keys("*") == [] and trims[-1][0]["previous"] is None


async def test_state_is_isolated_between_users_and_chats(counter, store_valves, trims, unique):
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=0, **store_valves)
    ann, bob, chat_id = f"ann-{unique}", f"bob-{unique}", f"c-{unique}"
    chat = chat_of(20, last="Ann's secret plan !+pin")
    await send(f, chat, ann, chat_id)
    assert (await stored_state(f, ann, chat_id)).pin_mode
    # the same chat id under another user, and another chat of the same user, start clean
    for user_id, other_chat in ((bob, chat_id), (ann, f"other-{unique}")):
        await send(f, grow(chat, 20), user_id, other_chat)
        options, _ = trims[-1]
        assert options["previous"] is None and list(options["pinned"]) == []
        assert await stored_state(f, user_id, other_chat) == ChatState(
            decision=trims[-1][1].decision, pins=(), pin_mode=False
        )
    # Ann's own chat still has her pins, pin mode and decision
    await send(f, grow(chat, 20), ann, chat_id)
    options, _ = trims[-1]
    assert options["previous"] is not None and list(options["pinned"]) == [41, 43]


async def test_state_expires_after_the_ttl_valve(counter, redis_url, unique):
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=0, redis_url=redis_url, state_ttl_hours=2)
    await send(f, chat_of(20), f"u-{unique}", f"c-{unique}")
    client = aioredis.from_url(redis_url)
    try:
        key = KEY_PREFIX + chat_state_key(f"u-{unique}", f"c-{unique}")
        assert 7_000 < await client.ttl(key) <= 7_200
        assert f"u-{unique}".encode() not in await client.get(key)
    finally:
        await client.aclose()


async def test_pin_keeps_a_message_on_later_turns(counter, store_valves, trims, unique):
    f = make_filter(counter, max_context_tokens=1_200, reserve_output_tokens=0, **store_valves)
    user_id, chat_id = f"u-{unique}", f"c-{unique}"
    chat = chat_of(3, last="My locker code is 4711. !pin")
    events = Events()
    first = await shown(f, chat, user_id, chat_id, events)
    assert first["messages"][-1]["content"] == "My locker code is 4711."
    assert " · flags !pin · " in events.statuses[-1], events.statuses
    pinned_text = chat[-1]["content"]
    for i in range(25):  # many turns later, far beyond the budget, the pinned message is still sent
        chat = grow(chat, 10 + i)
        sent = (await send(f, chat, user_id, chat_id))["messages"]
        assert any(m["content"] == "My locker code is 4711." for m in sent)
        assert pinned_text not in [m["content"] for m in sent]  # the flag text never reaches the model
    assert len(sent) < len(chat) / 3 and sent[1]["content"] == "My locker code is 4711."  # the turns around it went
    assert chat.index(next(m for m in chat if m["content"] == pinned_text)) in trims[-1][0]["pinned"]


async def test_sticky_pin_pins_until_unpinned(counter, trims, unique):
    f = make_filter(counter, max_context_tokens=100_000, reserve_output_tokens=0)
    user_id, chat_id = f"u-{unique}", f"c-{unique}"
    chat = [{"role": "user", "content": "zero"}]
    script = ["one !+pin", "two", "three !-pin", "four", "five !pin"]
    for text in script:
        chat = chat + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": text}]
        await send(f, chat, user_id, chat_id)
    pinned = [chat[i]["content"] for i in trims[-1][0]["pinned"]]
    assert pinned == ["one !+pin", "two", "five !pin"]


async def test_flags_hold_for_every_pass_of_a_turn(counter, trims, unique):
    f = make_filter(counter, max_context_tokens=5_000, reserve_output_tokens=0)
    b = body(chat_of(30, last="Short answer please !budget=700 !keep=2"), f"u-{unique}", f"c-{unique}")
    user = {"id": f"u-{unique}"}
    events = Events()
    first = await f.inlet(b, __user__=user, __metadata__=b["metadata"], __event_emitter__=events)
    assert first["messages"][-1]["content"] == "Short answer please"
    second = await f.request(first, __user__=user, __metadata__=first["metadata"], __event_emitter__=events)
    assert [o["max_tokens"] for o, _ in trims] == [700, 700] and [o["keep_last_turns"] for o, _ in trims] == [2, 2]
    assert second["messages"] == first["messages"]
    assert events.statuses == []  # shown after the reply
    assert first["metadata"]["contextwarden"]["pending_line"].endswith(" · flags !budget=700 !keep=2")
    assert counter.count_messages(second["messages"], MODEL) <= 700


async def test_a_flag_too_deep_to_read_stays_text_in_every_pass(counter, trims, unique):
    """A flag at the end of a text over MAX_FLAG_SCAN_CHARS is ordinary text: inlet leaves it and
    shortens the text into range; the request pass does not read it there either (it once did,
    and sent 300 tokens where inlet had sent 2,000)."""
    from contextwarden.core.flags import MAX_FLAG_SCAN_CHARS

    f = make_filter(counter, max_context_tokens=2_000, reserve_output_tokens=0)
    paste = "\n".join(f"Line {i}: the river market harbour lantern copper meadow violin." for i in range(3_000))
    question = paste + "\nWhat does line 7 say? !budget=300"
    assert len(question) > MAX_FLAG_SCAN_CHARS
    b = body(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}],
        f"u-{unique}",
        f"c-{unique}",
    )
    user = {"id": f"u-{unique}"}
    first = await f.inlet(b, __user__=user, __metadata__=b["metadata"])
    sent = [dict(m) for m in first["messages"]]
    assert sent[-1]["content"].endswith("!budget=300") and len(sent[-1]["content"]) < MAX_FLAG_SCAN_CHARS
    second = await f.request(first, __user__=user, __metadata__=first["metadata"])
    assert second["messages"] == sent and [o["max_tokens"] for o, _ in trims] == [2_000, 2_000]


async def test_budget_flag_only_lowers(counter, trims, unique):
    f = make_filter(counter, max_context_tokens=1_000, reserve_output_tokens=0)
    await send(f, chat_of(20, last="More! !budget=50000"), f"u-{unique}", f"c-{unique}")
    await send(f, chat_of(20, last="Tiny !budget=5"), f"u-{unique}", f"c-{unique}")
    assert [o["max_tokens"] for o, _ in trims] == [1_000, 64]


async def test_a_number_flag_written_wrong_is_said_back_as_not_understood(counter, trims, unique):
    """Seen in the browser: `!budget=2k` went to the model as typed and the status line said
    nothing, so the user took their budget as applied. Now the line says it was not understood;
    the text still goes as written, and the budget is the valve's."""
    chat = chat_of(20, last="Short please !budget=2k !keep=x`y` `!keep=0`")
    f = make_filter(counter, max_context_tokens=1_000, reserve_output_tokens=0)
    events = Events()
    out = await shown(f, chat, f"u-{unique}", f"c-{unique}", events)
    assert out["messages"][-1]["content"] == chat[-1]["content"] and [o["max_tokens"] for o, _ in trims] == [1_000]
    assert " · not understood: !budget=2k !keep=… · " in events.statuses[-1], events.statuses


async def test_a_flag_not_understood_is_said_after_the_request_pass_too(counter, unique):
    """Seen in the browser (inlet, then request, then outlet): "Hello !budget=2k" showed "Whole
    chat sent · ..." without "not understood": the turn note kept the flags only when one acted
    or was refused, so the request pass, which reads the first pass's flags, had none."""
    f = make_filter(counter, max_context_tokens=8_000, reserve_output_tokens=0)
    chat = chat_of(4, last="Hello !budget=2k")
    metadata = {"chat_id": f"c-{unique}", "user_id": f"u-{unique}", "message_id": "m1"}
    events = Events()
    hooks = {"__user__": {"id": f"u-{unique}"}, "__metadata__": metadata, "__event_emitter__": events}
    first = await f.inlet({"model": "gpt-4o", "messages": chat, "metadata": metadata}, **hooks)
    sent = await f.request(first, **hooks)
    reply = {"role": "assistant", "content": "Noted."}
    await f.outlet({"model": "gpt-4o", "messages": [*sent["messages"], reply], "chat_id": metadata["chat_id"]}, **hooks)
    [line] = events.statuses
    assert line.startswith("Whole chat sent · not understood: !budget=2k · "), line


async def test_a_budget_flags_selection_is_made_anew_once_the_chat_outgrows_the_budget(counter, store_valves, unique):
    """A turn asked for `!budget=300` and its selection was stored; the turns after it fit whole
    and left it there. When the chat outgrew the budget, that selection, made for a tenth of it,
    was carried (2,133 tokens, over the quarter `_starved` looked for): 20 of 32 messages sent
    where a new selection sends 26, reported as the previous one reused."""
    from contextwarden import trim_messages
    from contextwarden.core.flags import read_flags

    f = make_filter(counter, max_context_tokens=3_000, reserve_output_tokens=0, **store_valves)
    user_id, chat_id = f"u-{unique}", f"c-{unique}"
    chat = chat_of(8, last="!budget=300 Quick: what now?")
    for k in range(8):
        body = {"model": MODEL, "messages": chat, "metadata": {"chat_id": chat_id, "user_id": user_id}}
        hooks = {"__user__": {"id": user_id}, "__metadata__": body["metadata"]}
        first = await f.inlet(body, **hooks)
        note = dict(body["metadata"]["contextwarden"])
        sent = (await f.request(first, **hooks))["messages"]
        chat = [*chat, {"role": "assistant", "content": "Short answer."}, turn(100 + k)[0]]
    unflagged = read_flags(body["messages"], allowed={"budget"}).messages
    fresh = trim_messages(unflagged, max_tokens=3_000, model=MODEL, token_counter=counter)
    assert len(body["messages"]) == 32 and "→" in note["line"] and not note["reused"]
    assert sent == fresh.messages


async def test_tool_definitions_after_inlet_do_not_make_each_turn_anew(counter, unique):
    """Open WebUI adds the tool definitions after inlet: the request pass leaves the messages less
    of the budget. 4,029 tokens of them in an 8k window: the request pass's selection, compared
    with the next inlet's budget as the trim made it, looked made for under half of it and
    `_starved` made every turn anew (its prompt new from the second message). Stored as the whole
    prompt's budget, the next turn repeats the previous prompt."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{k}",
                "description": "Does a useful thing with the records. " * 12,
                "parameters": {
                    "type": "object",
                    "properties": {"q": {"type": "string", "description": "what to look for"}},
                },
            },
        }
        for k in range(34)
    ]
    f = make_filter(counter, max_context_tokens=8_192)
    user_id, chat_id = f"u-{unique}", f"c-{unique}"
    chat, sent = chat_of(40), []
    for k in range(3):
        body = {"model": MODEL, "messages": chat, "metadata": {"chat_id": chat_id, "user_id": user_id}}
        hooks = {"__user__": {"id": user_id}, "__metadata__": body["metadata"]}
        sent.append((await f.request({**await f.inlet(body, **hooks), "tools": tools}, **hooks))["messages"])
        assert "4,029 for tool definitions" in body["metadata"]["contextwarden"]["line"]
        await f.outlet({"model": MODEL, "messages": [*chat, {"role": "assistant", "content": "ok"}]}, **hooks)
        chat = grow(chat, 200 + k)
    for before, after in itertools.pairwise(sent):  # all but the question and its recall block, if any
        assert after[: len(before) - 3] == before[:-3] and len(before) > 10


async def test_full_flag_only_when_enabled(counter, trims, unique):
    chat = chat_of(20, last="Everything! !full")
    f = make_filter(counter, max_context_tokens=1_000, reserve_output_tokens=0)
    events = Events()
    out = await shown(f, chat, f"u-{unique}", f"c-{unique}", events)
    assert len(out["messages"]) < len(chat) and out["messages"][-1]["content"] == "Everything! !full"
    assert " · not enabled: !full · " in events.statuses[-1], events.statuses
    f.valves = f.Valves(max_context_tokens=1_000, reserve_output_tokens=0, allowed_user_flags="full")
    events = Events()
    out = await shown(f, chat, f"u-{unique}", f"c-{unique}", events)
    assert len(out["messages"]) == len(chat) and out["messages"][-1]["content"] == "Everything!"
    assert out["messages"][:-1] == chat[:-1] and all(
        a is b for a, b in zip(out["messages"][:-1], chat[:-1], strict=True)
    )
    assert events.statuses[-1].startswith("Whole chat sent · flags !full · "), events.statuses
    assert len(trims) == 1  # !full skipped trim_messages


async def test_strategy_valve_reaches_the_trim(counter, trims):
    """strategy = recent: the history sent is the newest turns that fit (one unbroken stretch
    before the question); the valve is read case-insensitively, and a bad one is named."""
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=0, strategy="Recent")
    chat = chat_of(20)
    await send(f, chat, "u", "c")
    ((options, result),) = trims
    assert options["strategy"] == "recent" and result.dropped
    history = [i for i in result.kept if chat[i]["role"] != "system"]
    assert max(result.dropped) < min(history)
    f.valves = f.Valves.model_construct(**{**f.Valves().model_dump(), "strategy": "smartest"})
    events = Events()
    await f.inlet(body(chat_of(2), "u", "c2"), __user__={"id": "u"}, __event_emitter__=events)
    assert any("strategy must be one of relevance, recent; using relevance" in s for s in events.statuses), (
        events.statuses
    )
    assert trims[-1][0]["strategy"] == "relevance"


async def test_state_valves_are_checked(counter):
    f = make_filter(counter)
    f.valves = f.Valves.model_construct(
        **{
            **f.Valves().model_dump(),
            "low_watermark": 1.5,
            "keep_last_turns": 0,
            "state_ttl_hours": 0,
            "growth_turns": -1,
        }
    )
    events = Events()
    await f.inlet(body(chat_of(2), "u", "c"), __user__={"id": "u"}, __event_emitter__=events)
    text = " ".join(events.statuses)
    assert "low_watermark must be" in text and "keep_last_turns must be" in text and "state_ttl_hours must be" in text
    assert "growth_turns must be 0 to 10" in text


async def test_unreadable_state_is_ignored(counter, trims, unique):
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=0)
    key = chat_state_key(f"u-{unique}", f"c-{unique}")
    await f.store.set(key, json.dumps({"v": 1, "decision": "{broken", "pins": [], "pin_mode": False}).encode(), ttl=60)
    out = await send(f, chat_of(20), f"u-{unique}", f"c-{unique}")
    assert trims[-1][0]["previous"] is None and len(out["messages"]) < 41


@pytest.mark.parametrize("raw", [b'{"v": 3, "pins": ["from a newer version"]}', b"\xff not json", b""])
async def test_state_this_version_cannot_read_is_never_written_over(counter, store_valves, trims, unique, raw):
    store = store_of(store_valves)
    f = make_filter(counter, store=store, max_context_tokens=1_500, reserve_output_tokens=0, **store_valves)
    key = chat_state_key(f"u-{unique}", f"c-{unique}")
    await store.set(key, raw, ttl=60)
    out = await send(f, chat_of(20, last="Keep this !pin"), f"u-{unique}", f"c-{unique}")
    assert len(out["messages"]) < 41 and out["messages"][-1]["content"] == "Keep this"  # the turn went on
    assert await f.store.get(key) == raw


async def test_a_failed_state_read_saves_nothing(counter, trims, unique, caplog):
    """A read that raised says nothing of what is stored: the turn trims without state and
    nothing is written over the state it could not read."""
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=0)
    user_id, chat_id = f"u-{unique}", f"c-{unique}"
    await send(f, chat_of(20, last="Keep this !pin"), user_id, chat_id)
    pinned = await stored_state(f, user_id, chat_id)
    assert len(pinned.pins) == 1
    real_get = f.store.get

    async def failing_get(key):
        raise RuntimeError("read failed")

    f.store.get = failing_get
    out = await send(f, grow(chat_of(20, last="Keep this"), 30), user_id, chat_id)
    assert len(out["messages"]) < 43 and trims[-1][0]["previous"] is None
    f.store.get = real_get
    assert await stored_state(f, user_id, chat_id) == pinned
    assert [r.getMessage() for r in caplog.records if "chat state" in r.getMessage()] == [
        "contextwarden: chat state not read (RuntimeError)"
    ]


async def test_a_state_changed_since_it_was_read_is_not_written_over(counter, store_valves, unique, monkeypatch):
    """Between this turn's read and its save another pass saved: the other pass's state stays."""
    store = store_of(store_valves)
    f = make_filter(counter, store=store, max_context_tokens=1_500, reserve_output_tokens=0, **store_valves)
    user_id, chat_id = f"u-{unique}", f"c-{unique}"
    key = chat_state_key(user_id, chat_id)
    other = ChatState(pins=("someone else's pin",)).to_bytes()
    real_trim = trimpass_module.trim_messages

    def trim_while_another_pass_saves(messages, **options):
        if store_valves:  # another worker, through its own connection
            with redis.Redis.from_url(store_valves["redis_url"]) as client:
                client.set(KEY_PREFIX + key, other, ex=60)
        else:  # another pass of this worker; this thread may hold the event loop, so the save runs on its own
            saver = threading.Thread(target=asyncio.run, args=(store.set(key, other, ttl=60),))
            saver.start()
            saver.join()
        return real_trim(messages, **options)

    monkeypatch.setattr(trimpass_module, "trim_messages", trim_while_another_pass_saves)
    await send(f, chat_of(20), user_id, chat_id)
    assert await store.get(key) == other


async def test_foreign_flags_in_metadata_are_ignored(counter, trims, unique):
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=0)
    b = body(chat_of(20), f"u-{unique}", f"c-{unique}")
    b["metadata"]["contextwarden"] = {"flags": {"budget": "lots"}}
    out = await f.request(b, __user__={"id": f"u-{unique}"}, __metadata__=b["metadata"])
    assert trims[-1][0]["max_tokens"] == 1_500 and len(out["messages"]) < 41


async def test_a_worker_upgraded_mid_chat_reuses_the_state_the_previous_version_stored(
    counter, store_valves, trims, unique
):
    """Version 1 of the chat state (each decision as JSON text inside the JSON) is read, its
    decision reused, and the state written back in the current version."""
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=0, **store_valves)
    user_id, chat_id = f"u-{unique}", f"c-{unique}"
    chat = chat_of(20)
    await send(f, chat, user_id, chat_id)
    decision = trims[-1][1].decision
    key = chat_state_key(user_id, chat_id)
    previous = {"v": 1, "decision": decision.to_json(), "pins": ["p1"], "pin_mode": False}
    await f.store.set(key, json.dumps(previous, separators=(",", ":")).encode(), ttl=60)
    await send(f, grow(chat, 20), user_id, chat_id)
    assert trims[-1][0]["previous"] == decision
    state = await stored_state(f, user_id, chat_id)
    assert json.loads(await f.store.get(key))["v"] == 2 and state.pins == ("p1",)


class _SwitchedRedis:
    """A real Redis client that can be switched off: every command then fails as a refused connection."""

    def __init__(self, url: str) -> None:
        self.real = aioredis.Redis.from_url(url)
        self.down = False

    def __getattr__(self, name: str):
        attr = getattr(self.real, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            if self.down:
                raise aioredis.ConnectionError("refused")
            return attr(*args, **kwargs)

        return call


async def test_a_pin_made_while_redis_was_away_joins_the_shared_state(counter, redis_url, unique, monkeypatch):
    """While Redis is away a worker keeps the chat's state in its fallback; a pin made then was
    lost once Redis answered again (its older state has no such pin) and the pinned message was
    dropped two turns later. Pins only grow, so the fallback's join Redis's."""
    monkeypatch.setattr(store_module, "REDIS_RETRY_SECONDS", 0.0)
    client = _SwitchedRedis(redis_url)
    store = RedisStore(redis_url, client=client)
    f = make_filter(counter, store=store, max_context_tokens=1_500, reserve_output_tokens=0)
    user_id, chat_id = f"u-{unique}", f"c-{unique}"
    chat = chat_of(4)
    await send(f, chat, user_id, chat_id)  # Redis answers: the chat's state is shared
    client.down = True
    chat = chat[:-1] + [{"role": "user", "content": "My locker code is 4417. !pin"}]
    await send(f, chat, user_id, chat_id)  # Redis away: the pin is this worker's alone
    assert not store.shared and len((await stored_state(f, user_id, chat_id)).pins) == 1
    client.down = False
    pinned, dropped = {"role": "user", "content": "My locker code is 4417."}, 0
    for i in range(10, 18):
        chat = grow(chat, i)
        out = await send(f, chat, user_id, chat_id)
        assert pinned in out["messages"], i
        dropped = max(dropped, len(chat) - len(out["messages"]))
    assert dropped >= 6  # the chat was trimmed, the pin kept
    assert store.shared and len((await stored_state(f, user_id, chat_id)).pins) == 1  # in Redis now
    await store.aclose()


async def test_two_workers_on_one_redis_send_what_one_worker_sends(counter, redis_url, unique):
    """30 turns of one chat through one filter, and alternating between two filters on one Redis
    (each turn's process caches emptied, as in a worker that never saw the chat): every turn
    sends the same messages, so the prompt cache hits as often on several workers as on one."""
    from contextwarden.caches import clear_all

    words = "amber basin cobalt delta ember fjord granite harbor indigo jasper kestrel lumen".split()

    def text(i: int, n: int) -> str:
        return " ".join(words[(i * 7 + k * k) % len(words)] for k in range(n))

    async def run(filters, chat_id: str) -> list[list[dict]]:
        chat, sent = [{"role": "system", "content": "You are helpful."}], []
        for i in range(30):
            chat = chat + [{"role": "user", "content": f"q{i} " + text(i, 20 + i * 37 % 130)}]
            if len(filters) > 1:
                clear_all()
            sent.append((await send(filters[i % len(filters)], chat, f"u-{unique}", chat_id))["messages"])
            chat = chat + [{"role": "assistant", "content": f"a{i} " + text(i + 1, 30 + i * 53 % 220)}]
        return sent

    valves = {"max_context_tokens": 3_000, "reserve_output_tokens": 500, "redis_url": redis_url}
    one = await run([make_filter(counter, **valves)], f"one-{unique}")
    two = await run([make_filter(counter, **valves), make_filter(counter, **valves)], f"two-{unique}")
    assert [len(s) for s in one] == [len(s) for s in two] and one == two
    assert sum(len(s) < 2 * i + 2 for i, s in enumerate(one)) >= 10  # the chat was trimmed on many turns


class _RacedStore:
    """A store whose chat-state saves wait until two passes have read the state and want to save:
    the save that pins nothing goes first, so the pinning pass's save finds the state changed."""

    def __init__(self, store) -> None:
        self.store = store
        self.waiting: list[tuple[bytes, asyncio.Event]] = []
        self.first_saved = asyncio.Event()

    def __getattr__(self, name: str):
        return getattr(self.store, name)

    async def swap(self, key: str, expected, value: bytes, *, ttl: int) -> bool:
        if not key.startswith("chat:") or self.first_saved.is_set():
            return await self.store.swap(key, expected, value, ttl=ttl)
        turn = asyncio.Event()
        self.waiting.append((value, turn))
        if len(self.waiting) == 2:  # both passes read the same state: the unpinned save goes first
            min(self.waiting, key=lambda w: bool(ChatState.from_bytes(w[0]).pins))[1].set()
        await turn.wait()
        if self.first_saved.is_set():
            return await self.store.swap(key, expected, value, ttl=ttl)
        saved = await self.store.swap(key, expected, value, ttl=ttl)
        self.first_saved.set()
        max(self.waiting, key=lambda w: bool(ChatState.from_bytes(w[0]).pins))[1].set()
        return saved


async def test_a_pin_survives_another_pass_saving_the_chat_state_first(counter, store_valves, unique):
    """Two passes of one chat read its state at once; the other one saved first, so the pinning
    pass's compare-and-swap failed and its `!pin` was lost: the pinned message was dropped later."""
    store = _RacedStore(store_of(store_valves))
    f = make_filter(counter, store=store, max_context_tokens=1_500, reserve_output_tokens=0)
    user_id, chat_id = f"u-{unique}", f"c-{unique}"
    chat = chat_of(10)
    pinning = chat[:-1] + [{"role": "user", "content": "My locker code is 4711. !pin"}]
    await asyncio.gather(send(f, pinning, user_id, chat_id), send(f, chat, user_id, chat_id))
    assert len(store.waiting) == 2  # both passes saved after both had read
    state = await stored_state(f, user_id, chat_id)
    assert len(state.pins) == 1 and state.decision is not None
    chat = pinning
    for i in range(10, 20):
        chat = grow(chat, i)
        sent = (await send(f, chat, user_id, chat_id))["messages"]
        assert {"role": "user", "content": "My locker code is 4711."} in sent, i
    assert len(sent) < len(chat) / 2
    await store.store.aclose()


async def test_a_chat_whose_state_is_over_the_cap_is_trimmed_anew_each_turn(
    counter, store_valves, trims, unique, monkeypatch
):
    """A state over `MAX_CHAT_STATE_BYTES` is saved without its decision (pins kept): the next
    turn makes a new selection, never an error, and the stored bytes stay within the cap."""
    import contextwarden.state.chatstate as chatstate_module

    monkeypatch.setattr(chatstate_module, "MAX_CHAT_STATE_BYTES", 250)  # a 20-turn chat's state is ~320
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=0, **store_valves)
    user_id, chat_id = f"u-{unique}", f"c-{unique}"
    key = chat_state_key(user_id, chat_id)
    chat = chat_of(20, last="My locker code is 4711. !pin")
    for i in range(20, 24):
        sent = (await send(f, chat, user_id, chat_id))["messages"]
        assert {"role": "user", "content": "My locker code is 4711."} in sent and len(sent) < len(chat) / 2
        raw = await f.store.get(key)
        assert (
            len(raw) <= 250 and ChatState.from_bytes(raw).decision is None and len(ChatState.from_bytes(raw).pins) == 1
        )
        assert trims[-1][0]["previous"] is None and trims[-1][1].decision is not None
        chat = grow(chat, i)


async def test_a_chat_state_keeps_its_decision_in_fewer_bytes(counter, store_valves, trims, unique, monkeypatch):
    """Decision format 3 (fingerprints run together, positions as runs): 401 short messages trimmed
    to 1,500 tokens keep 71-169 and store 2,902-4,306 bytes a turn (format 2: 3,993-5,253). Under a
    cap of 4,500 each turn keeps its decision and the next carries it; format 2 stored none on 3 of
    6 turns. At the real cap: ~8,170 kept messages in one run, not ~5,260."""
    import contextwarden.state.chatstate as chatstate_module

    monkeypatch.setattr(chatstate_module, "MAX_CHAT_STATE_BYTES", 4_500)
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=0, **store_valves)
    user_id, chat_id = f"u-{unique}", f"c-{unique}"
    chat = [{"role": "system", "content": "You are helpful."}]
    for i in range(200):
        chat += [{"role": "user", "content": f"q{i} note"}, {"role": "assistant", "content": f"a{i} ok"}]
    for i in range(200, 206):
        chat.append({"role": "user", "content": f"q{i} note"})
        await send(f, chat, user_id, chat_id)
        raw = await f.store.get(chat_state_key(user_id, chat_id))
        assert len(raw) <= 4_500 and ChatState.from_bytes(raw).decision is not None, i
        assert (trims[-1][0]["previous"] is None) == (i == 200), i
        chat.append({"role": "assistant", "content": f"a{i} ok"})
