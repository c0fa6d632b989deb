"""A chat's state through a Redis outage: a `redis-server` of the test's own, stopped and
started again (empty, as a cache without persistence restarts, or with its data on disk).

While Redis is away a worker serves each chat from the last state it read or wrote there (its
`LocalCopy`): pins made before the outage stay pinned and the decision is carried (the prefix
stays). Once Redis answers, the shared state wins unless it is what the worker last saw (or is
gone), and what was made during the outage joins it: a stale copy never overwrites newer state.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import redis.asyncio as aioredis

import contextwarden.state.store as store_module
from contextwarden.core.flags import Flags, pin_fingerprint
from contextwarden.state.chatstate import MAX_PINS, ChatState, chat_state_key
from contextwarden.state.store import KEY_PREFIX, RedisStore

from helpers import chat_of, grow, make_filter, send
from turns import OwnRedis, raw_get

PINNED = {"role": "user", "content": "My locker code is 4417."}


@pytest.fixture(params=["empty", "kept"])
def server(request, redis_binary, tmp_path, monkeypatch):
    """A redis-server of this test's own that restarts empty, or with its data kept on disk."""
    monkeypatch.setattr(store_module, "REDIS_RETRY_SECONDS", 0.0)  # each call tries Redis again
    own = OwnRedis(redis_binary, data_dir=str(tmp_path) if request.param == "kept" else "").start()
    yield own
    own.stop()


async def stored(f, user_id: str, chat_id: str):
    """The chat's decision as the filter's store answers it (during an outage: the worker's copy)."""
    return ChatState.from_bytes(await f.store.get(chat_state_key(user_id, chat_id))).decision


def worker(counter, server: OwnRedis):
    """A filter as one Open WebUI worker runs it: its own store on the shared Redis."""
    return make_filter(counter, store=RedisStore(server.url), max_context_tokens=1_500, reserve_output_tokens=0)


def pinning(chat: list[dict], text: str) -> list[dict]:
    """The chat with its last question replaced by `text`, pinned."""
    return chat[:-1] + [{"role": "user", "content": f"{text} !pin"}]


async def test_a_pin_made_before_an_outage_is_sent_during_it(counter, server, unique):
    """Redis stopped after the pin: the worker had no copy of the chat's state, the pinned
    message went at the outage's first turn that needed its room."""
    f = worker(counter, server)
    user_id, chat_id = f"u-{unique}", f"c-{unique}"
    chat = pinning(chat_of(2), PINNED["content"])
    await send(f, chat, user_id, chat_id)
    for i in range(10, 18):
        chat = grow(chat, i)
        out = await send(f, chat, user_id, chat_id)
    assert PINNED in out["messages"] and len(out["messages"]) < len(chat) - 6  # trimmed, the pin kept
    server.stop()
    for i in range(18, 21):
        chat = grow(chat, i)
        out = await send(f, chat, user_id, chat_id)
        assert PINNED in out["messages"], i
    assert not f.store.shared
    await f.store.aclose()


def _words(tag: str, n: int) -> str:
    """`n` words no other message has: no question finds an earlier message to recall."""
    return " ".join(f"{tag}w{k}" for k in range(n))


def _exchange(i: int) -> list[dict]:
    """A reply, then a new question, each in words of its own."""
    return [{"role": "assistant", "content": _words(f"a{i}", 60)}, {"role": "user", "content": _words(f"q{i}", 20)}]


async def test_the_decision_is_carried_through_an_outage(counter, server, trims, unique):
    """Each turn of the outage carries the previous turn's selection: the prompt only grows at
    its end (a new selection every 4th turn here, at 8, 12, ...). Before, the outage's first
    turn found no state and selected anew: the prompt differed from its 2nd message on."""
    f = worker(counter, server)
    user_id, chat_id = f"u-{unique}", f"c-{unique}"
    chat = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": _words("q0", 20)}]
    for i in range(1, 9):
        chat = chat + _exchange(i)
        sent = (await send(f, chat, user_id, chat_id))["messages"]
    assert not trims[-1][1].reused and len(sent) < len(chat) / 3  # a new selection, at turn 8
    server.stop()
    for i in range(9, 12):
        decided = await stored(f, user_id, chat_id)
        chat = chat + _exchange(i)
        before, sent = sent, (await send(f, chat, user_id, chat_id))["messages"]
        options, result = trims[-1]
        assert options["previous"] == decided and result.reused, i
        assert sent[: len(before)] == before and len(sent) == len(before) + 2, i
    decided = await stored(f, user_id, chat_id)
    server.start()  # empty, or as it was before the outage: nobody saved this chat since
    await send(f, chat + _exchange(12), user_id, chat_id)
    assert trims[-1][0]["previous"] == decided  # what the outage decided goes on
    await f.store.aclose()


async def test_a_stale_copy_never_overwrites_newer_shared_state(counter, server, trims, unique):
    """Two workers serve one chat; both lose Redis and take turns meanwhile. Back, the worker
    that saves first finds Redis as it last saw it (or empty) and goes on from its own copy; the
    other finds newer state than its copy: that state's decision is carried, and the pin made
    during the outage joins it. No pin is lost, the one made before the outage included."""
    a, b = worker(counter, server), worker(counter, server)
    user_id, chat_id = f"u-{unique}", f"c-{unique}"
    key = chat_state_key(user_id, chat_id)
    chat = pinning(chat_of(4), "Pin zero.")
    await send(a, chat, user_id, chat_id)
    chat = grow(chat, 5)
    await send(b, chat, user_id, chat_id)
    server.stop()
    chat = pinning(grow(chat, 6), "Pin made on worker A.")
    await send(a, chat, user_id, chat_id)
    chat = grow(chat, 7)
    await send(a, chat, user_id, chat_id)
    chat = pinning(grow(chat, 8), "Pin made on worker B.")
    await send(b, chat, user_id, chat_id)
    server.start()
    chat = grow(chat, 9)
    await send(b, chat, user_id, chat_id)  # B goes on from its own outage state
    newer = ChatState.from_bytes(await raw_get(server.url, key))
    assert len(newer.pins) == 2 and newer.decision == trims[-1][1].decision
    chat = grow(chat, 10)
    out = await send(a, chat, user_id, chat_id)
    assert trims[-1][0]["previous"] == newer.decision  # not A's own, older one
    pins = ("Pin zero.", "Pin made on worker A.", "Pin made on worker B.")
    assert all({"role": "user", "content": text} in out["messages"] for text in pins)
    assert len(ChatState.from_bytes(await raw_get(server.url, key)).pins) == 3
    await a.store.aclose()
    await b.store.aclose()


async def raw_set(url: str, key: str, value: bytes) -> None:
    """Write a store key in Redis itself (a state no filter made: pins up to the limit)."""
    raw = aioredis.Redis.from_url(url)
    try:
        await raw.set(KEY_PREFIX + key, value, ex=3_600)
    finally:
        await raw.aclose()


async def test_a_pin_the_limit_pushed_out_stays_out_when_an_outage_joins(counter, server, trims, unique):
    """A chat one pin under MAX_PINS, its oldest pin a message of the chat. During an outage
    worker A pins one message (the oldest stays) and worker B two (the oldest pushed out). Back,
    B saves first; A's outage state joins B's newer one. Before: A's copy still held the oldest
    pin and the merge added it again as new, pushing out the next oldest instead, and A sent the
    message the limit had let go pinned again. Now the limit keeps the newest MAX_PINS."""
    a, b = worker(counter, server), worker(counter, server)
    user_id, chat_id = f"u-{unique}", f"c-{unique}"
    key = chat_state_key(user_id, chat_id)
    oldest = {"role": "user", "content": "Pin zero, the oldest."}
    chat = pinning(chat_of(4), oldest["content"])
    await send(a, chat, user_id, chat_id)
    state = ChatState.from_bytes(await raw_get(server.url, key))
    others = tuple(f"{k:024x}" for k in range(MAX_PINS - 2))  # pins of messages no longer in the chat
    assert state.pins == (pin_fingerprint(oldest),)
    await raw_set(server.url, key, replace(state, pins=state.pins + others).to_bytes())
    for i, w in ((5, a), (6, b)):  # each worker reads it
        chat = grow(chat, i)
        await send(w, chat, user_id, chat_id)
    server.stop()
    pinned_on = ("Pin made on A.", "Pin B one.", "Pin B two.")
    for i, w, text in zip((7, 8, 9), (a, b, b), pinned_on, strict=True):
        chat = pinning(grow(chat, i), text)
        await send(w, chat, user_id, chat_id)
    server.start()
    chat = grow(chat, 10)
    await send(b, chat, user_id, chat_id)  # B goes on from its own outage state
    newer = ChatState.from_bytes(await raw_get(server.url, key))
    assert len(newer.pins) == MAX_PINS and pin_fingerprint(oldest) not in newer.pins
    chat = grow(chat, 11)
    out = await send(a, chat, user_id, chat_id)
    joined = ChatState.from_bytes(await raw_get(server.url, key)).pins
    assert joined == (newer.pins + (pin_fingerprint({"role": "user", "content": "Pin made on A."}),))[-MAX_PINS:]
    pinned = trims[-1][0]["pinned"]  # what A's trim had to keep as pinned: not the oldest (still sent, carried)
    assert [chat[i]["content"].removesuffix(" !pin") for i in pinned] == list(pinned_on)
    assert all({"role": "user", "content": text} in out["messages"] for text in pinned_on)
    await a.store.aclose()
    await b.store.aclose()


async def test_a_swap_made_from_what_redis_held_leaves_what_the_outage_wrote():
    """A pass that read Redis before an outage and saves after it never read what another pass
    wrote during it: Redis takes its state, and the outage's still joins the next read."""
    LocalCopy = store_module.LocalCopy
    copies = store_module._LocalCopies()
    copies.put("chat:1", LocalCopy(b"before"), 60)
    assert copies.swap("chat:1", b"before", b"outage", 60, None)
    assert not copies.swap("chat:1", b"before", b"other", 60, None)  # the copy holds the outage's now
    copies.swapped("chat:1", b"late pass", 60)
    assert copies.get("chat:1") == LocalCopy(b"before", b"outage")
    assert copies.get("chat:1", take=True) == LocalCopy(b"before", b"outage")
    copies.swapped("chat:1", b"merged", 60)  # a pass that read the copy saved
    assert copies.get("chat:1") == LocalCopy(b"merged")


def test_local_copies_are_bounded_in_bytes_and_keys():
    """At most `max_bytes` as weighed (the bytes, key and `LOCAL_COPY_OVERHEAD`) and `max_keys`,
    least recently used out first; a copy expires with its swap's time to live."""
    LocalCopy = store_module.LocalCopy
    copies = store_module._LocalCopies(max_keys=3, max_bytes=3 * (store_module.LOCAL_COPY_OVERHEAD + 1_005))
    for name in "abcd":
        copies.put(f"k:{name}", LocalCopy(b"x" * 1_000), 60)
    assert len(copies) == 3 and copies.get("k:a") is None
    copies.get("k:b")
    copies.put("k:e", LocalCopy(b"x" * 1_000, b"y" * 1_000), 60)  # weighs two: c and d go
    assert [k for k in "abcde" if copies.get(f"k:{k}")] == ["b", "e"]
    assert copies.weight <= copies.max_bytes
    copies.put("k:f", LocalCopy(b"z"), -1)
    assert copies.get("k:f") is None and copies.weight == sum(
        store_module._copy_bytes(f"k:{k}", copies.get(f"k:{k}")) for k in "be"
    )


def test_what_wins_when_redis_answers_again():
    """Redis's state unless it is what the worker last saw, or gone; the outage's pins and pin
    mode join Redis's newer state; a state this version cannot read is never gone on from."""
    seen = ChatState(pins=("p0",)).to_bytes()
    mine = ChatState(pins=("p0", "p1"), pin_mode=True)
    theirs = ChatState(pins=("p0", "p2"))
    assert ChatState.rejoined(seen, mine.to_bytes(), seen) == mine
    assert ChatState.rejoined(None, mine.to_bytes(), seen) == mine  # Redis restarted empty
    assert ChatState.rejoined(None, None, seen) == ChatState(pins=("p0",))  # the same, no outage turn
    assert ChatState.rejoined(theirs.to_bytes(), None, seen) == theirs
    assert ChatState.rejoined(theirs.to_bytes(), mine.to_bytes(), seen) == ChatState(
        pins=("p0", "p2", "p1"), pin_mode=True
    )
    assert ChatState.rejoined(b'{"v": 99}', mine.to_bytes(), seen) is None


def test_a_merge_at_the_pin_limit_keeps_the_newest_pins():
    """What a pass (or an outage) added to the state it read joins the state saved since; a pin
    of what it read that the saved state's limit pushed out is not added again as new."""
    read = ChatState(pins=tuple(f"old{k}" for k in range(MAX_PINS - 1)))
    mine = read.with_flags(Flags(pin=True), "mine")  # MAX_PINS pins: the oldest still there
    theirs = read.with_flags(Flags(pin=True), "theirs1").with_flags(Flags(pin=True), "theirs2")
    assert "old0" in mine.pins and "old0" not in theirs.pins
    merged = mine.merged_onto(theirs, read)
    assert merged is not None and merged.pins == (
        *(f"old{k}" for k in range(2, MAX_PINS - 1)),
        "theirs1",
        "theirs2",
        "mine",
    )
    assert ChatState.rejoined(theirs.to_bytes(), mine.to_bytes(), read.to_bytes()) == merged
