"""Fault injection: whatever breaks underneath, the chat goes on with a valid body.

Faults: tiktoken encodings unavailable, failing oddly or slow to load; Redis refused at start,
killed and restarted mid-run, cut off and restored (a proxy), slow (a proxy that delays
replies); malformed bodies, messages, hook arguments and replies; valves of the wrong type or
with invalid JSON. Redis here is a `redis-server` of the test's own, on a free port.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from decimal import Decimal

import httpx
import pytest
import respx
import tiktoken

import contextwarden.state.store as store_module
from contextwarden import Filter
from contextwarden.core.conversation import is_recall_message, message_text
from contextwarden.core.tokens import TokenCounter
from contextwarden.core.trim import TrimResult
from contextwarden.face.bookkeeping import FLOORED_NOTE
from contextwarden.money import price_sources
from contextwarden.money.ledger import read_ledger
from contextwarden.money.live_prices import DEFAULT_OPENROUTER_URL, LivePrices
from contextwarden.money.usage import MAX_REPLY_COST_USD, MAX_TOKEN_COUNT, read_count
from contextwarden.state.chatstate import ChatState, chat_state_key
from contextwarden.state.store import RedisStore, redis_client

from chats import check_contract, frozen
from helpers import Events, chat_of, make_filter, sent_count
from turns import OwnRedis, free_port, raw_get, run_turn, usage_lines

MODEL = "gpt-4o"


def warnings_about(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


def assert_valid_turn(run, budget: int | None, counter) -> None:
    """The chat went on: every hook returned a chat body; what was sent keeps the contract.

    The filter's choice may differ from a stateless `trim_messages` (relevance, reuse of the
    previous turn's selection), so the contract is checked on what it sent.
    """
    for body in (run.after_inlet, run.after_request):
        assert isinstance(body, dict) and isinstance(body["messages"], list)
    assert run.after_outlet is run.outlet_body
    if budget is not None:
        chat, sent = run.sent_in["messages"], run.after_request["messages"]
        where = {id(m): i for i, m in enumerate(chat)}
        kept, shortened, last = [], [], -1
        blocks = []
        for j, m in enumerate(sent):  # in input order: the very dict, or a shortened copy (or a recall block)
            if id(m) in where:
                last = where[id(m)]
                kept.append(last)
                continue
            if is_recall_message(m) or j - 1 in blocks:  # a block, or the acknowledgement after it
                blocks.append(j)
                continue
            upper = next((where[id(n)] for n in sent[j + 1 :] if id(n) in where), len(chat))
            same_keys = [
                i
                for i in range(last + 1, upper)
                if {k: v for k, v in chat[i].items() if k != "content"}
                == {k: v for k, v in m.items() if k != "content"}
            ]
            last = max(same_keys, key=lambda i: counter.count_message(chat[i], MODEL))  # the largest text is cut
            shortened.append(last)
        after = counter.count_messages(sent, MODEL)
        dropped = tuple(i for i in range(len(chat)) if i not in kept + shortened)
        added = tuple(blocks)  # the blocks with their acknowledgements
        blocks = [j for j in blocks if is_recall_message(sent[j])]
        quoted = "".join(sent[j]["content"] for j in blocks)
        recalled = tuple(i for i in dropped if blocks and message_text(chat[i]) and message_text(chat[i]) in quoted)
        question = max((i for i, m in enumerate(chat) if m.get("role") == "user"), default=None)
        stable = next((j for j in blocks if question is not None and sent[j + 2] is chat[question]), -1)
        result = TrimResult(
            list(sent),
            tuple(kept),
            dropped,
            tuple(shortened),
            counter.count_messages(chat, MODEL),
            after,
            budget,
            "exact",
            over_budget=after > budget,
            notes=("shortened",) if shortened else (),
            recalled=recalled,
            stable_prefix=stable,
            added=added,
        )
        check_contract(chat, result, counter, MODEL, as_given=False)  # the flags' text was taken out


# -- tiktoken ----------------------------------------------------------------------------------


def offline_filter(counter: TokenCounter | None = None, **valves) -> Filter:
    f = Filter(counter=counter)  # by default its own counter, loading in the background as in Open WebUI
    f.valves = f.Valves(**valves)
    return f


async def test_encodings_unavailable_estimates_within_budget(counter, monkeypatch, caplog):
    def unavailable(name):
        raise OSError("network is unreachable")

    monkeypatch.setattr(tiktoken, "get_encoding", unavailable)
    caplog.set_level(logging.INFO, logger="contextwarden")
    f = offline_filter(max_context_tokens=1_500, reserve_output_tokens=500)
    chat = chat_of(30)
    runs = [await run_turn(f, chat, chat_id=f"c{i}") for i in range(20)]
    assert not f.counter.wait_ready(MODEL)
    for run in runs:
        sent = run.after_request["messages"]
        assert len(sent) < len(chat)
        assert f.counter.count_messages(sent, MODEL) <= 1_000
        assert counter.count_messages(sent, MODEL) <= 1_000  # the estimate errs high: exact fits too
        assert "estimated (tokenizer not loaded)" in run.metadata["contextwarden"]["line"]  # the admin's detail
        read = sent_count(chat, sent)  # in place, or quoted whole
        assert run.events.statuses[-1].startswith(f"Sent {read} of {len(chat)} messages · ~")  # usage estimated
    assert len(warnings_about(caplog, "tiktoken encoding o200k_base unavailable")) == 1
    lines = usage_lines(caplog.records)
    assert len(lines) == 20 and all(line["estimated"] for line in lines)


@pytest.mark.parametrize(
    "error", [ValueError("corrupt cache"), KeyError("o200k_base"), MemoryError(), RuntimeError("x")]
)
async def test_encodings_failing_oddly_still_estimate(error, monkeypatch):
    def broken(name):
        raise error

    monkeypatch.setattr(tiktoken, "get_encoding", broken)
    f = offline_filter(
        TokenCounter(block=True), max_context_tokens=900, reserve_output_tokens=100
    )  # fail in the calling thread: the error reaches our code
    run = await run_turn(f, chat_of(20))
    assert f.counter.count_messages(run.after_request["messages"], MODEL) <= 800
    assert "estimated" in run.metadata["contextwarden"]["line"]


async def test_encodings_slow_to_load_do_not_block_and_then_count_exactly(counter, monkeypatch):
    real = tiktoken.get_encoding
    gate = threading.Event()

    def slow(name):
        gate.wait(30)  # the loader thread waits; the event loop must not
        return real(name)

    monkeypatch.setattr(tiktoken, "get_encoding", slow)
    f = offline_filter(max_context_tokens=1_500, reserve_output_tokens=500)
    while_loading = await run_turn(f, chat_of(30))
    assert not gate.is_set()  # the turn finished while the encoding was still loading
    assert "estimated (tokenizer not loaded)" in while_loading.metadata["contextwarden"]["line"]
    assert f.counter.count_messages(while_loading.after_request["messages"], MODEL) <= 1_000
    gate.set()
    assert f.counter.wait_ready(MODEL)
    loaded = await run_turn(f, chat_of(30))
    assert "estimated" not in loaded.metadata["contextwarden"]["line"]
    assert counter.count_messages(loaded.after_request["messages"], MODEL) <= 1_000


async def test_an_encoding_that_breaks_while_counting_fails_open(monkeypatch, caplog):
    class Broken:
        def encode_ordinary(self, text):
            raise RuntimeError("secret message text")

    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: Broken())
    f = offline_filter(TokenCounter(block=True), max_context_tokens=500, reserve_output_tokens=0)
    chat = chat_of(10)
    run = await run_turn(f, chat)
    assert run.after_inlet is run.sent_in and run.after_request is run.sent_in  # passed through
    assert run.events.statuses[0] == "contextwarden skipped this turn (internal error)"
    assert "secret message text" not in caplog.text


class Panic(BaseException):
    """Like pyo3's PanicException (tiktoken's, on ~1M spaces): a BaseException, not an Exception."""


@pytest.mark.parametrize("hook", ["inlet", "request", "outlet"])
async def test_a_base_exception_inside_a_hook_fails_open(monkeypatch, caplog, hook):
    class Panicking:
        def encode_ordinary(self, text):
            raise Panic("secret message text")

    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: Panicking())
    f = offline_filter(TokenCounter(block=True), max_context_tokens=500, reserve_output_tokens=0)
    body = {
        "model": MODEL,
        "messages": chat_of(10) + ([{"role": "assistant", "content": "ok"}] if hook == "outlet" else []),
    }
    events = Events()
    assert await getattr(f, hook)(body, __user__={"id": "u"}, __metadata__={}, __event_emitter__=events) is body
    assert any("skipped" in s for s in events.statuses) and "secret message text" not in caplog.text
    assert warnings_about(caplog, "Panic at")


@pytest.mark.parametrize("stop", [asyncio.CancelledError, KeyboardInterrupt, SystemExit, GeneratorExit])
async def test_cancellation_and_shutdown_are_not_swallowed(monkeypatch, stop):
    f = offline_filter(max_context_tokens=500, reserve_output_tokens=0)

    async def stopped(*args, **kwargs):
        raise stop()

    monkeypatch.setattr(f, "_trim", stopped)
    monkeypatch.setattr(f, "_record", stopped)
    for hook in (f.inlet, f.request, f.outlet):
        with pytest.raises(stop):
            await hook({"model": MODEL, "messages": chat_of(2)}, __user__={"id": "u"})


@pytest.mark.parametrize("run", ["spaces", "tabs", "nbsp"])
async def test_a_million_spaces_in_a_message_trim_and_count(counter, run):
    # Before: tiktoken panicked, the panic escaped the hook, Open WebUI answered HTTP 500.
    text = {"spaces": " ", "tabs": "\t", "nbsp": "\u00a0"}[run] * 1_000_000
    f = make_filter(counter, max_context_tokens=2_000, reserve_output_tokens=200)
    chat = chat_of(6)
    chat = chat[:3] + [{"role": "user", "content": "look: " + text + " end"}] + chat[3:]
    run_ = await run_turn(f, chat)
    assert not any("skipped" in s for s in run_.events.statuses), run_.events.statuses
    assert_valid_turn(run_, 1_800, counter)


# -- what a fault tells ------------------------------------------------------------------------------


def loud_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def notifications(events: Events) -> list[str]:
    return [e["data"]["content"] for e in events.items if e["type"] == "notification"]


async def test_one_fault_is_one_warning_a_turn_and_told_to_admins_once(counter, caplog, monkeypatch):
    # Before: the limit check, the trim and the charge each logged it (two or three warnings an
    # inlet), and every user saw "skipped this turn (internal error)" every turn.
    import contextwarden.face.filter as filter_module

    def broken(*args, **kwargs):
        raise RuntimeError("secret message text")

    monkeypatch.setattr(filter_module, "resolve_model", broken)
    caplog.set_level(logging.DEBUG, logger="contextwarden")
    f = make_filter(counter, openrouter_pricing=False, max_context_tokens=1_500)
    shown: dict[str, list[list[str]]] = {"user": [], "admin": []}
    for role in ("user", "user", "user", "admin", "admin"):
        caplog.clear()
        events, metadata = Events(), {"chat_id": f"c-{role}"}
        body = {"model": MODEL, "messages": chat_of(10), "metadata": metadata}
        hooks = {"__user__": {"id": f"id-{role}", "role": role}, "__metadata__": metadata}
        assert await f.inlet(body, **hooks, __event_emitter__=events) is body
        [line] = loud_lines(caplog)
        assert line.startswith("contextwarden: inlet failed (RuntimeError at test_faults.py:")
        assert "secret" not in caplog.text
        debug = [
            r.getMessage()
            for r in caplog.records
            if r.levelno == logging.DEBUG and "turn not charged" in r.getMessage()
        ]
        assert len(debug) == 1  # the other step it failed, at debug
        shown[role].append(events.statuses)
    assert shown["user"] == [[], [], []]  # they cannot fix it, and their chat went on
    assert shown["admin"] == [["contextwarden skipped this turn (internal error)"], []]


async def test_a_stream_fault_is_one_warning_a_place_and_told_after_an_admins_reply(counter, caplog, monkeypatch):
    # Before: logged at debug only, for every chunk; at INFO nothing was logged and no one told.
    import contextwarden.face.bookkeeping as bookkeeping_module

    async def broken(self, *args, **kwargs):
        raise RuntimeError("secret message text")

    f = make_filter(counter, openrouter_pricing=False)
    monkeypatch.setattr(bookkeeping_module.Bookkeeping, "stream_event", broken)
    metadata = {"chat_id": "c", "message_id": "m"}
    for _ in range(50):
        await f.stream({"choices": [{"delta": {"content": "tok "}}]}, __metadata__=metadata)
    [line] = loud_lines(caplog)
    assert line.startswith("contextwarden: stream chunk not read (RuntimeError at test_faults.py:")
    assert "secret" not in caplog.text
    user_run = await run_turn(f, chat_of(3), user={"id": "u1", "role": "user"})
    assert notifications(user_run.events) == []
    admin_runs = [await run_turn(f, chat_of(3), user={"id": "a1", "role": "admin"}) for _ in range(2)]
    [told] = notifications(admin_runs[0].events)
    assert "internal error in its stream hook (RuntimeError at test_faults.py:" in told and "secret" not in told
    assert notifications(admin_runs[1].events) == []  # once
    assert not any("skipped" in s for run in admin_runs for s in run.events.statuses)


# -- Redis ---------------------------------------------------------------------------------------


@pytest.fixture
def own_redis(redis_binary):
    server = OwnRedis(redis_binary).start()
    yield server
    server.stop()


class Proxy:
    """A TCP proxy in front of Redis that can delay replies, cut connections and refuse new ones."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.delay = 0.0
        self.delays: list[float] = []  # for the next replies, one each, before `delay` applies again
        self.port = free_port()
        self.server: asyncio.AbstractServer | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> Proxy:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        return self

    async def cut(self) -> None:
        """Stop listening and drop every open connection (a network partition)."""
        self.server.close()
        for writer in self._writers:
            writer.close()
        self._writers.clear()
        await self.server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self._writers += [writer, up_writer]

        async def pipe(source, sink, delayed: bool) -> None:
            try:
                while data := await source.read(65_536):
                    pause = (self.delays.pop(0) if self.delays else self.delay) if delayed else 0.0
                    if pause:
                        await asyncio.sleep(pause)
                    sink.write(data)
                    await sink.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                sink.close()

        await asyncio.gather(pipe(reader, up_writer, False), pipe(up_reader, writer, True))

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


async def raw_counters(url: str, key: str) -> dict[str, int]:
    import redis.asyncio as aioredis

    raw = aioredis.Redis.from_url(url)
    try:
        return {k.decode(): int(v) for k, v in (await raw.hgetall(store_module.KEY_PREFIX + key)).items()}
    finally:
        await raw.aclose()


async def test_redis_refused_at_start_chat_goes_on(counter, caplog, unique):
    f = make_filter(
        counter, redis_url=f"redis://127.0.0.1:{free_port()}/0", max_context_tokens=900, reserve_output_tokens=100
    )
    runs = [await run_turn(f, chat_of(12), chat_id=f"{unique}{i}") for i in range(5)]
    for run in runs:
        assert_valid_turn(run, 800, counter)
    assert isinstance(f.store, RedisStore)
    for _ in range(20):  # what the ledger and chat state will do through the filter's store
        await f.store.incr(f"t:{unique}", {"n": 1}, ttl=60)
    assert await f.store.counters(f"t:{unique}") == {"n": 20} and not f.store.shared
    assert len(warnings_about(caplog, "Redis unavailable")) == 1


async def test_redis_killed_and_restarted_mid_run(counter, own_redis, caplog, monkeypatch, unique):
    monkeypatch.setattr(store_module, "REDIS_RETRY_SECONDS", 0.0)  # retry at once instead of in 30 s
    f = make_filter(counter, redis_url=own_redis.url, max_context_tokens=900, reserve_output_tokens=100)
    key = f"t:{unique}"

    async def phase(tag: str, n: int) -> None:
        for i in range(n):
            assert_valid_turn(await run_turn(f, chat_of(8), chat_id=f"{tag}{i}"), 800, counter)
            await f.store.incr(key, {"n": 1}, ttl=60)
            await f.store.set(f"{key}:{tag}{i}", b"x", ttl=60)

    await phase("up", 10)
    assert f.store.shared and await raw_counters(own_redis.url, key) == {"n": 10}
    own_redis.stop()
    await phase("down", 10)
    assert not f.store.shared
    assert await f.store.fallback.counters(key) == {"n": 10}
    own_redis.start()  # same port, empty (no persistence): what a restarted cache looks like
    await phase("back", 10)
    assert f.store.shared and await raw_counters(own_redis.url, key) == {"n": 10}
    assert await f.store.get(f"{key}:back3") == b"x"
    assert len(warnings_about(caplog, "Redis unavailable")) == 1
    assert len(warnings_about(caplog, "Redis reachable again")) == 1


async def test_redis_partition_loses_nothing_and_counts_once(counter, own_redis, caplog, monkeypatch, unique):
    """Cut off (Redis keeps its data) and restored: every plain increment is in Redis or in the
    worker's fallback, exactly once; the ledger's named increments are held and replayed, so all
    replies end up in Redis, once each."""
    monkeypatch.setattr(store_module, "REDIS_RETRY_SECONDS", 0.0)
    proxy = await Proxy(own_redis.port).start()
    store = RedisStore(proxy.url, timeout=0.3)
    f = make_filter(counter, store=store, redis_url=proxy.url, max_context_tokens=900, reserve_output_tokens=100)
    key = f"t:{unique}"
    increments = 0
    for step in range(3):
        for i in range(15):
            await store.incr(key, {"n": 1, "tokens": 7}, ttl=60)
            increments += 1
            if i < 5:  # and whole turns, whose outlets add to the usage ledger
                run = await run_turn(f, chat_of(8), user={"id": f"u-{unique}"}, chat_id=f"p{step}{i}")
                assert_valid_turn(run, 800, counter)
        if step == 0:
            await proxy.cut()
        elif step == 1:
            await proxy.start()
    in_redis = await raw_counters(own_redis.url, key)
    in_worker = await store.fallback.counters(key)
    assert in_redis == {"n": 30, "tokens": 210} and in_worker == {"n": 15, "tokens": 105}
    assert in_redis["n"] + in_worker["n"] == increments
    direct = RedisStore(own_redis.url)
    ledger_redis = sum(e.counters["requests"] for e in await read_ledger(direct) if e.user == f"u-{unique}")
    ledger_worker = sum(e.counters["requests"] for e in await read_ledger(store.fallback) if e.user == f"u-{unique}")
    assert (ledger_redis, ledger_worker) == (15, 0)  # 15 replies, each recorded exactly once, all shared
    await direct.aclose()
    assert store.shared
    assert len(warnings_about(caplog, "Redis unavailable")) == 1
    await store.aclose()
    await proxy.cut()


async def test_slow_redis_times_out_falls_back_and_recovers_consistent(counter, own_redis, caplog, monkeypatch, unique):
    monkeypatch.setattr(store_module, "REDIS_RETRY_SECONDS", 0.0)
    proxy = await Proxy(own_redis.port).start()
    store = RedisStore(proxy.url, timeout=0.1)
    f = make_filter(counter, store=store, max_context_tokens=900, reserve_output_tokens=100)
    for i in range(10):
        await store.set(f"k:{unique}:{i}", str(i).encode(), ttl=600)
    proxy.delay = 1.0  # every reply arrives after the store's bound (4 x 0.1 s), on both tries
    for i in range(4):
        # bounded: each call gives up after its two tries (the guard only catches a hang)
        await asyncio.wait_for(store.set(f"slow:{unique}:{i}", b"s", ttl=60), 10)
    # every store call of the turn tries the slow Redis (no rest): ~0.8 s each, and it still works
    assert_valid_turn(await run_turn(f, chat_of(8), chat_id="slow"), 800, counter)
    assert not store.shared
    assert await store.get(f"slow:{unique}:3") == b"s"  # served by the fallback
    proxy.delay = 0.0
    await asyncio.sleep(2.5)  # let the delayed replies of timed-out calls (and their one retry) arrive, discarded
    # back to Redis, and no reply of an abandoned call is read as the answer to a new one
    for i in range(10):
        assert await store.get(f"k:{unique}:{i}") == str(i).encode()
    assert store.shared
    assert len(warnings_about(caplog, "Redis unavailable")) == 1
    await store.aclose()
    await proxy.cut()


async def test_a_busy_event_loop_is_not_a_redis_outage(own_redis, caplog, unique):
    """Redis answered at once, but this worker's loop was busy (other users' turns) for longer
    than the store's bound: the answer is read, the store stays shared."""
    store = RedisStore(own_redis.url, timeout=0.2)  # bound: 4 x 0.2 s of a responsive loop
    await store.set(f"k:{unique}", b"v", ttl=60)

    async def busy_worker() -> None:
        await asyncio.sleep(0.01)  # the store's command is out
        time.sleep(1.5)  # the loop is held, as by other turns' CPU work

    got, _ = await asyncio.gather(store.get(f"k:{unique}"), busy_worker())
    assert got == b"v" and store.shared
    assert not warnings_about(caplog, "Redis unavailable")
    await store.aclose()


async def test_one_late_answer_is_sent_again_and_applied_once(own_redis, caplog, unique):
    """A turn's charge whose answer came too late is sent once more: Redis applies it once, the
    caller hears it was applied, and the store stays shared."""
    proxy = await Proxy(own_redis.port).start()
    store = RedisStore(proxy.url, timeout=0.1)
    key = f"t:{unique}"
    await store.counters(key)  # connected
    proxy.delays = [1.0]  # the first answer is late (bound 0.4 s); Redis did apply the charge
    applied, before = await store.incr_below(
        key, {"requests": 1, "cost": 5}, ttl=60, below={"cost": 9}, once=f"{unique}:a"
    )
    assert applied and before == {} and store.shared  # the repeat: what the key held before it
    assert await raw_counters(own_redis.url, key) == {"requests": 1, "cost": 5}
    assert not warnings_about(caplog, "Redis unavailable")
    await store.aclose()
    await proxy.cut()


async def test_slow_redis_does_not_double_count(own_redis, monkeypatch, unique):
    """A named increment whose reply times out is held and sent again; Redis applies it once."""
    monkeypatch.setattr(store_module, "REDIS_RETRY_SECONDS", 0.0)
    proxy = await Proxy(own_redis.port).start()
    store = RedisStore(proxy.url, timeout=0.2)
    key = f"t:{unique}"
    await store.incr(key, {"n": 1}, ttl=60, once=f"{unique}:1")
    proxy.delay = 1.0
    await store.incr(key, {"n": 1}, ttl=60, once=f"{unique}:2")  # reaches Redis; the reply comes too late
    assert store.held == (f"{unique}:2",) and not await store.fallback.counters(key)
    await asyncio.sleep(1.2)
    proxy.delay = 0.0
    await store.incr(key, {"n": 1}, ttl=60, once=f"{unique}:3")  # Redis answers: the held one is sent again
    await store.incr(key, {"n": 1}, ttl=60, once=f"{unique}:3")  # a repeat of a named increment adds nothing
    assert not store.held
    assert (await raw_counters(own_redis.url, key))["n"] == 3
    await store.aclose()
    await proxy.cut()


async def test_refused_redis_holds_named_increments_until_it_returns(own_redis, monkeypatch, unique):
    """While Redis is down, ledger increments wait in the worker and land once it is back."""
    monkeypatch.setattr(store_module, "REDIS_RETRY_SECONDS", 0.0)
    store = RedisStore(own_redis.url, timeout=0.2)
    key = f"t:{unique}"
    own_redis.stop()
    for i in range(5):
        await store.incr(key, {"n": 1}, ttl=60, once=f"{unique}:{i}")
    assert store.held == tuple(f"{unique}:{i}" for i in range(5))
    own_redis.start()
    await store.incr(key, {"n": 1}, ttl=60, once=f"{unique}:5")
    assert not store.held and (await raw_counters(own_redis.url, key))["n"] == 6
    await store.aclose()


class IncrSpy:
    """Wraps a Redis client: counts its named increments in flight and records each one sent
    (by name); `before(name)` runs first and may raise, as Redis would."""

    def __init__(self, client, before=None) -> None:
        self.client, self.before, self.sent, self.pause = client, before, [], 0.0
        self.running = self.most = 0

    def __getattr__(self, name):
        return getattr(self.client, name)

    async def eval(self, script, numkeys, *args):
        # A named increment: KEYS are the counter and its marker bucket; ARGV[3] is its name.
        once = args[numkeys + 2] if numkeys == 2 else ""
        if not once:
            return await self.client.eval(script, numkeys, *args)
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            if self.before is not None:
                await self.before(once)
            await asyncio.sleep(self.pause)
            answer = await self.client.eval(script, numkeys, *args)
            self.sent.append(once)
            return answer
        finally:
            self.running -= 1


async def test_concurrent_callers_replay_held_increments_once(own_redis, monkeypatch, unique):
    """Once Redis answers, one caller replays what was held; the others are answered at once,
    and none sees an error of the replay (it used to pop an emptied deque: IndexError)."""
    monkeypatch.setattr(store_module, "REDIS_RETRY_SECONDS", 0.0)
    client = IncrSpy(redis_client(own_redis.url, timeout=0.2))
    store = RedisStore(own_redis.url, client=client)
    key = f"t:{unique}"
    await store.set(f"k:{unique}", b"v", ttl=60)
    own_redis.stop()
    for i in range(30):
        await store.incr(key, {"n": 1}, ttl=60, once=f"{unique}:{i}")
    own_redis.start()
    await RedisStore(own_redis.url).set(f"k:{unique}", b"v", ttl=60)  # a restarted Redis is empty
    client.sent.clear()  # the refused sends of the outage
    client.pause = 0.001
    answers = await asyncio.gather(*(store.get(f"k:{unique}") for _ in range(40)))
    assert answers == [b"v"] * 40
    assert client.most == 1 and client.sent == [f"{unique}:{i}" for i in range(30)]  # one replayer, in order, each once
    assert not store.held and (await raw_counters(own_redis.url, key))["n"] == 30
    await store.aclose()


async def test_a_replay_that_fails_never_fails_the_call(own_redis, monkeypatch, caplog, unique):
    """A held increment Redis cannot take is dropped (logged); one dropped meanwhile by a full
    queue is not taken for the next, unsent one."""
    monkeypatch.setattr(store_module, "REDIS_RETRY_SECONDS", 0.0)
    monkeypatch.setattr(store_module, "REDIS_PENDING_LIMIT", 3)
    key = f"t:{unique}"
    refused = {f"{unique}:{i}" for i in range(4)}  # each refused once (held); :3 is the replay's rival

    async def before(once):
        if once in refused:
            refused.discard(once)
            raise store_module.aioredis.ConnectionError("refused")
        if once == f"{unique}:0":  # while it is sent, another caller's increment is held, fills the queue
            await store.incr(key, {"n": 100}, ttl=60, once=f"{unique}:3")  # and pushes it out
        if once == f"{unique}:1":
            raise ValueError("cannot apply")

    store = RedisStore(own_redis.url, client=IncrSpy(redis_client(own_redis.url, timeout=0.2), before=before))
    for i in range(3):
        await store.incr(key, {"n": 1}, ttl=60, once=f"{unique}:{i}")
    assert store.held == (f"{unique}:0", f"{unique}:1", f"{unique}:2")
    assert await store.get(f"absent:{unique}") is None
    assert not store.held and (await raw_counters(own_redis.url, key))["n"] == 102  # 0, 2 and 3; 1 dropped
    assert warnings_about(caplog, "held usage increment dropped (ValueError)")
    await store.aclose()


async def test_redis_paused_and_resumed_loses_no_pin(counter, own_redis, caplog, monkeypatch, unique):
    """SIGSTOP / SIGCONT of redis-server with 40 pinned chats taking turns at once, three rounds.

    While Redis is paused, reads time out and fall back and the ledger's increments are held;
    once it answers, the held increments are replayed by one caller while the rest go on; a state
    read that failed or came from the fallback is never written over the real one in Redis.
    """
    monkeypatch.setattr(store_module, "REDIS_RETRY_SECONDS", 0.0)  # every call tries Redis again
    f = make_filter(
        counter,
        store=RedisStore(own_redis.url, timeout=0.2),
        redis_url=own_redis.url,
        max_context_tokens=900,
        reserve_output_tokens=100,
    )
    user = {"id": f"u-{unique}"}
    chats = {f"c{i}": chat_of(6, last=f"My locker code is {4000 + i}. !pin") for i in range(40)}
    for chat_id, chat in chats.items():
        await run_turn(f, chat, user=user, chat_id=chat_id)

    async def next_turn(chat_id: str, step: int) -> None:
        chats[chat_id] = chats[chat_id][:-1] + [
            {"role": "user", "content": chats[chat_id][-1]["content"].replace(" !pin", "")},
            {"role": "assistant", "content": "Noted. " + "lorem " * 80},
            {"role": "user", "content": f"step {step}: what else?"},
        ]
        run = await run_turn(f, chats[chat_id], user=user, chat_id=chat_id)
        assert_valid_turn(run, 800, counter)

    for step in range(3):
        os.kill(own_redis.process.pid, signal.SIGSTOP)
        try:
            turns = asyncio.gather(*(next_turn(chat_id, step) for chat_id in chats))
            await asyncio.sleep((0.3, 1.0, 1.8)[step])  # resumed while the turns are in flight (reads, saves, outlets)
        finally:
            os.kill(own_redis.process.pid, signal.SIGCONT)
        await turns
    await asyncio.gather(*(next_turn(chat_id, 9) for chat_id in chats))  # Redis up: every pin is read back
    lost = []
    for chat_id in chats:
        state = ChatState.from_bytes(await raw_get(own_redis.url, chat_state_key(user["id"], chat_id)))
        if len(state.pins) != 1:
            lost.append(chat_id)
    assert not lost, f"{len(lost)} of 40 chats lost their pin"
    assert not warnings_about(caplog, "chat state not read")  # the replay's trouble never reached a read
    assert not f.store.held
    direct = RedisStore(own_redis.url)
    replies = sum(e.counters["requests"] for e in await read_ledger(direct) if e.user == user["id"])
    assert replies == 40 * 5  # every reply recorded once, in Redis, the held ones replayed
    await direct.aclose()
    await f.store.aclose()


# -- OpenRouter prices ------------------------------------------------------------------------------

OPENROUTER_FAULTS = {
    "timeout": dict(side_effect=httpx.ReadTimeout("slow")),
    "refused": dict(side_effect=httpx.ConnectError("refused")),
    "500": dict(return_value=httpx.Response(500, text="upstream error")),
    "garbage": dict(return_value=httpx.Response(200, text="<html>not json")),
    "wrong shape": dict(return_value=httpx.Response(200, json={"data": "nope"})),
    "negative prices": dict(
        return_value=httpx.Response(
            200, json={"data": [{"id": "openai/gpt-4o", "pricing": {"prompt": "-1", "completion": "-0.5"}}]}
        )
    ),
}


@pytest.mark.parametrize("fault", list(OPENROUTER_FAULTS))
async def test_openrouter_failing_never_breaks_a_turn_or_the_ledger(counter, fault, caplog, unique, monkeypatch):
    monkeypatch.setattr(price_sources, "LivePrices", LivePrices)  # the real one (conftest stubs it); respx answers
    f = make_filter(counter, openrouter_pricing=True, max_context_tokens=900, reserve_output_tokens=100)
    caplog.set_level(logging.INFO, logger="contextwarden")
    with respx.mock(assert_all_called=False) as mock:
        route = mock.get(DEFAULT_OPENROUTER_URL).mock(**OPENROUTER_FAULTS[fault])
        for i in range(4):
            usage = {"prompt_tokens": 700, "completion_tokens": 30}
            run = await run_turn(
                f,
                chat_of(8),
                user={"id": f"u-{unique}"},
                chat_id=f"or{i}",
                reply={"role": "assistant", "content": "ok", "usage": usage},
            )
            assert_valid_turn(run, 800, counter)
            if f.prices.live:
                await f.prices.live.settled()  # let the background refresh finish (it must never raise)
    assert route.call_count == 1  # the fault was met, once: failures wait before retrying
    records = usage_lines(caplog.records)
    assert len(records) == 4
    for record in records:
        assert record["cost_usd"] is None or float(record["cost_usd"]) >= 0
    entries = [e for e in await read_ledger(f.store) if e.user == f"u-{unique}"]
    assert sum(e.counters["requests"] for e in entries) == 4 and all(e.counters["cost_picousd"] >= 0 for e in entries)
    if fault == "negative prices":  # fetched fine; a price it cannot read leaves the bundled one, never negative
        assert all(record["cost_source"] == "price_table" and float(record["cost_usd"]) > 0 for record in records)
    else:  # one warning, the bundled prices go on
        assert len(warnings_about(caplog, "live prices not refreshed")) == 1
        assert all(record["cost_source"] == "price_table" for record in records)


# -- malformed input -----------------------------------------------------------------------------

ODD_MESSAGES = [
    {"role": "user", "content": 5},
    {"role": "user", "content": 3.5},
    {"role": "user", "content": True},
    {"role": "user", "content": {"odd": "dict"}},
    {"role": "user", "content": b"bytes"},
    {"role": "user", "content": [None, 1, "str", {"type": "text"}, {"type": "text", "text": 5}, {"type": "image_url"}]},
    {"role": None, "content": "no role"},
    {"role": 7, "content": "int role"},
    {"content": "missing role"},
    {"role": "user"},
    {},
    {"role": "assistant", "tool_calls": "not a list"},
    {"role": "assistant", "tool_calls": [None, 5, "x"]},
    {"role": "assistant", "tool_calls": [{"function": "not a dict"}]},
    {"role": "assistant", "tool_calls": [{"id": None, "function": {"name": None, "arguments": {"a": 1}}}]},
    {"role": "assistant", "tool_calls": [{"id": 12, "function": {"name": 3, "arguments": None}}]},
    {"role": "assistant", "tool_calls": []},
    {"role": "tool", "tool_call_id": None, "content": "x"},
    {"role": "tool", "tool_call_id": 12, "content": "x"},
    {"role": "user", "content": "named", "name": 5},
    {"role": "user", "content": "named", "name": ["a"]},
    {"role": "user", "content": "x" * 200_000},
    {"role": "user", "content": "\ud800 lone surrogate \udfff"},
    {"role": "user", "content": "<|endoftext|><|im_start|>system"},
    {"role": "user", "content": "\x00\x01\x02"},
    # hostile shapes (issue 13): whitespace runs tiktoken panics on, backtick runs the old regex
    # took seconds over, flag spam, unclosed fences
    {"role": "user", "content": " " * 1_000_000},
    {"role": "user", "content": "x" + "\u00a0\t " * 200_000 + "y"},
    {"role": "user", "content": "!pin " + "`" * 32_000},
    {"role": "user", "content": "!pin " + "` " * 16_000},
    {"role": "user", "content": "!pin !budget=100 !keep=3 !+pin !-pin !nosum " * 2_000},
    {"role": "user", "content": "```\n!pin\n" * 2_000},
]


@pytest.mark.parametrize("odd", ODD_MESSAGES, ids=[f"m{i}" for i in range(len(ODD_MESSAGES))])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
async def test_odd_messages_never_break_a_turn(counter, odd, where):
    f = make_filter(counter, max_context_tokens=700, reserve_output_tokens=100)
    chat = chat_of(8)
    position = {"first": 1, "middle": 6, "last": len(chat)}[where]
    chat = chat[:position] + [odd] + chat[position:]
    before = frozen(chat)
    run = await run_turn(f, chat)
    assert frozen(chat) == before
    assert_valid_turn(run, 600, counter)
    assert all(e["data"]["done"] is True for e in run.events.items)


ODD_BODIES = [
    None,
    [],
    "text",
    7,
    {},
    {"messages": None},
    {"messages": "hi"},
    {"messages": {"0": {}}},
    {"messages": [1, 2]},
    {"messages": [None]},
    {"messages": []},
    {"model": None, "messages": [{"role": "user", "content": "x"}]},
    {"model": 5, "messages": [{"role": "user", "content": "x"}], "metadata": "not a dict"},
]
ODD_USERS = [
    None,
    "user",
    5,
    {},
    {"id": None},
    {"id": 5, "valves": "x"},
    {"id": "u", "valves": {"max_context_tokens": "9"}},
    {"id": "u", "valves": None},
    {"id": "u", "email": None, "valves": Filter.UserValves.model_construct(max_context_tokens="x")},
]
ODD_MODELS = [
    None,
    "gpt-4o",
    5,
    {},
    {"info": "x"},
    {"info": {"base_model_id": 5, "params": "x"}},
    {"openai": {"context_length": "big"}},
    {"openai": {"context_length": -5}},
    {"info": {"params": {"num_ctx": 10**12}}},
]
ODD_METADATA = [
    None,
    "x",
    {},
    {"task": "title_generation"},
    {"chat_id": 5},
    {"contextwarden": "x"},
    {"contextwarden": {"estimated_prompt_tokens": "x"}},
]


async def sync_emitter(event):  # awaitable but raising
    raise ConnectionResetError("socket gone")


def not_awaitable(event):
    return None


@pytest.mark.parametrize("body", ODD_BODIES, ids=[f"b{i}" for i in range(len(ODD_BODIES))])
async def test_odd_bodies_pass_through_every_hook(counter, body):
    f = make_filter(counter, max_context_tokens=100, reserve_output_tokens=0)
    for hook in (f.inlet, f.request, f.outlet):
        out = await hook(body, __user__={"id": "u"}, __metadata__={}, __event_emitter__=Events())
        assert out is body or (isinstance(out, dict) and isinstance(out.get("messages"), list))


async def test_odd_hook_arguments_never_break_a_turn(counter):
    f = make_filter(counter, max_context_tokens=700, reserve_output_tokens=100)
    emitters = [None, Events(), sync_emitter, not_awaitable]
    combos = 0
    for user in ODD_USERS:
        for model in ODD_MODELS:
            for metadata in ODD_METADATA:
                emit = emitters[combos % len(emitters)]
                chat = chat_of(8)
                body = {"model": "gpt-4o", "messages": chat, "metadata": metadata}
                hooks = {"__user__": user, "__metadata__": metadata, "__model__": model, "__event_emitter__": emit}
                sent = await f.inlet(body, **hooks)
                sent = await f.request(sent, **hooks)
                assert (
                    isinstance(sent, dict) and isinstance(sent["messages"], list) and sent["messages"][-1] is chat[-1]
                )
                out_body = {"model": "gpt-4o", "messages": sent["messages"] + [{"role": "assistant", "content": "ok"}]}
                assert await f.outlet(out_body, **hooks) is out_body
                combos += 1
    assert combos == len(ODD_USERS) * len(ODD_MODELS) * len(ODD_METADATA)


ODD_BELOW_SEEN = [  # believed, but under half the prompt the worker counted (`OpenTurn.seen`)
    {"prompt_tokens": "12", "completion_tokens": None},
    {"input_tokens": 3, "output_tokens": 4},
    {"prompt_tokens": 5, "completion_tokens": 5, "cost": 1e30},
    {"prompt_tokens": 10, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 10**6}},
]
ODD_REPLIES = [
    {"role": "assistant", "content": None},
    {"role": "assistant", "content": [{"type": "text", "text": "parts"}]},
    {"role": "assistant", "content": "x", "usage": "not a dict"},
    {"role": "assistant", "content": "x", "usage": {}},
    {"role": "assistant", "content": "x", "usage": {"prompt_tokens": "12", "completion_tokens": None}},
    {"role": "assistant", "content": "x", "usage": {"prompt_tokens": None, "completion_tokens": 5}},
    {"role": "assistant", "content": "x", "usage": {"prompt_tokens": 10**30, "completion_tokens": 1}},
    {"role": "assistant", "content": "x", "info": "not a dict"},
    {"role": "assistant", "content": "x", "info": {"usage": [1, 2]}},
    {"role": "assistant", "content": "x", "usage": {"input_tokens": 3, "output_tokens": 4}},
    # forged through POST /api/chat/completed (issue 13): unknown, so estimated, never trusted
    {
        "role": "assistant",
        "content": "x",
        "usage": {"prompt_tokens": 1000, "completion_tokens": 100, "cost": "1e999000"},
    },
    {"role": "assistant", "content": "x", "usage": {"prompt_tokens": 5, "completion_tokens": 5, "cost": 1e30}},
    {"role": "assistant", "content": "x", "usage": {"prompt_tokens": 1e20, "completion_tokens": 1}},
    {"role": "assistant", "content": "x", "usage": {"prompt_tokens": "²", "completion_tokens": "١٢"}},
    {"role": "assistant", "content": "x", "usage": {"prompt_tokens": -3, "completion_tokens": float("nan")}},
    {"role": "assistant", "content": "x", "usage": {"prompt_tokens": {"a": [1]}, "completion_tokens": [2]}},
    {
        "role": "assistant",
        "content": "x",
        "usage": {"prompt_tokens": "9" * 100_000, "completion_tokens": 2, "cost": "1" * 100_000},
    },
    {
        "role": "assistant",
        "content": "x",
        "usage": {"prompt_tokens": 10, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 10**6}},
    },
]


@pytest.mark.parametrize("reply", ODD_REPLIES, ids=[f"r{i}" for i in range(len(ODD_REPLIES))])
async def test_odd_replies_log_one_usage_line(counter, reply, caplog):
    caplog.set_level(logging.INFO, logger="contextwarden")
    f = make_filter(counter)
    run = await run_turn(f, chat_of(3), reply=reply)
    assert run.after_outlet is run.outlet_body
    [record] = usage_lines(caplog.records)
    assert isinstance(record["prompt_tokens"], int) and 0 <= record["prompt_tokens"] <= MAX_TOKEN_COUNT
    read = reply.get("usage")
    believed = isinstance(read, dict) and all(
        read_count(read.get(k)) is not None for k in ("prompt_tokens", "completion_tokens")
    )
    floored = FLOORED_NOTE in (record["cost_note"] or "")  # below half the prompt counted: booked as counted
    assert floored is (read in ODD_BELOW_SEEN)
    assert record["estimated"] is (floored or not (believed or read == {"input_tokens": 3, "output_tokens": 4}))
    assert record["cached_tokens"] is None or record["cached_tokens"] <= record["prompt_tokens"]
    assert record["cost_usd"] is None or Decimal(record["cost_usd"]) <= MAX_REPLY_COST_USD
    assert max(len(r.getMessage()) for r in caplog.records) < 2_000  # no echo of a huge value


# -- valves ----------------------------------------------------------------------------------------

BAD_VALVES = [
    ("max_context_tokens", "lots"),
    ("max_context_tokens", None),
    ("max_context_tokens", -5),
    ("max_context_tokens", True),
    ("max_context_tokens", 1.5),
    ("reserve_output_tokens", -1),
    ("reserve_output_tokens", "x"),
    ("reserve_output_tokens", 10**9),
    ("redis_url", 5),
    ("redis_url", None),
    ("redis_url", "http://x"),
    ("redis_url", "redis://h:port/0"),
    ("model_aliases", "{bad"),
    ("model_aliases", "[1, 2]"),
    ("model_aliases", '{"a": 1}'),
    ("model_aliases", None),
    ("model_aliases", 5),
    ("show_status", "yes"),
    ("show_status", None),
    ("show_status", 0),
    ("strategy", "smartest"),
    ("strategy", 5),
    ("strategy", None),
]


@pytest.mark.parametrize(("valve", "value"), BAD_VALVES, ids=[f"{v}={x!r}"[:40] for v, x in BAD_VALVES])
async def test_bad_admin_valves_are_named_and_the_chat_goes_on(counter, valve, value, caplog):
    f = make_filter(counter)
    f.valves = f.Valves.model_construct(**{"max_context_tokens": 1_000, "reserve_output_tokens": 200, valve: value})
    run = await run_turn(f, chat_of(20))
    budget = run.metadata["contextwarden"]["budget"]
    assert isinstance(budget, int) and budget >= 64
    assert_valid_turn(run, budget, counter)
    assert any(valve in s for s in run.events.statuses), run.events.statuses
    logged = warnings_about(caplog, valve)  # three hooks ran: each problem is logged once, not three times
    assert logged and len(logged) == len(set(logged))


@pytest.mark.parametrize(
    "user_valves",
    [
        Filter.UserValves.model_construct(max_context_tokens="x"),
        Filter.UserValves.model_construct(max_context_tokens=-100),
        Filter.UserValves.model_construct(show_status="no"),
        {"max_context_tokens": 100},
        "valves",
        5,
    ],
)
async def test_bad_user_valves_never_break_a_turn(counter, user_valves):
    f = make_filter(counter, max_context_tokens=1_000, reserve_output_tokens=200)
    run = await run_turn(f, chat_of(20), user={"id": "u", "valves": user_valves})
    assert_valid_turn(run, run.metadata["contextwarden"]["budget"], counter)
    assert 64 <= run.metadata["contextwarden"]["budget"] <= 800
