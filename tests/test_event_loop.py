"""The trim of a big chat runs off the event loop: other users' requests go on meanwhile; an
outbound HTTP client's TLS context is made once, off the loop.

How long the loop stalls is measured in bench/loopstall.py (results in bench/results/); these
tests check what must hold whatever the timing: a big chat's counting and trimming run in the
contextwarden thread, the loop serves other coroutines while they run, errors raised there
still fail open, a cancelled request writes no state, and the result is the one the loop
itself would have computed.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import ssl
import threading
from dataclasses import replace

import httpx
import pytest
import respx

import contextwarden.face.offloop as offloop_module
import contextwarden.face.trimpass as trimpass_module
import contextwarden.netclient as netclient_module
from contextwarden import caches
from contextwarden.face.offloop import EXCERPTS_ON_LOOP_MAX_CHARS
from contextwarden.face.summarize import SummaryConfig, summarize_messages
from contextwarden.money.live_prices import DEFAULT_OPENROUTER_URL, LivePrices
from contextwarden.money.pricing import PriceBook
from contextwarden.state.chatstate import chat_state_key
from contextwarden.state.store import MemoryStore

from helpers import Events, chat_of, grow, make_filter
from shared_paths import load_fixture
from turns import run_turn

MODEL = "gpt-4o"


def big_chat(turns: int = 60) -> list[dict]:
    chat = chat_of(turns)
    assert offloop_module.heavy(chat) and not offloop_module.heavy(chat_of(3))
    return chat


def test_what_holds_the_loop_besides_text_goes_to_the_thread():
    """A chat light in text but heavy to read leaves the loop too (a review held it 96-1,068 ms
    with each): big tool-call arguments, thousands of empty text parts or of image parts with an
    empty text, thousands of one-letter messages. A few short messages stay."""
    heavy = offloop_module.heavy
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "x" * 1_000_000}}
    image = {"type": "image_url", "text": "", "image_url": {"url": "data:image/png;base64,AAAA"}}
    assert heavy([{"role": "assistant", "content": "ok", "tool_calls": [call]}])
    assert heavy([{"role": "user", "content": [{"type": "text", "text": ""}] * 3_000}])
    assert heavy([{"role": "user", "content": [image] * 30}])
    assert heavy([{"role": "user", "content": "a"}] * 3_000)
    assert not heavy([{"role": "user", "content": "a"}] * 100) and not heavy(chat_of(3))


def body(chat: list[dict], chat_id: str = "c1") -> dict:
    return {"model": MODEL, "messages": chat, "stream": False, "metadata": {"chat_id": chat_id, "user_id": "u1"}}


async def request(f, b: dict, events=None) -> dict:
    return await f.request(b, __user__={"id": "u1"}, __metadata__=b["metadata"], __event_emitter__=events)


@pytest.fixture
def spy_trim(monkeypatch):
    """Wraps `trim_messages`: `spy.threads` are the threads it ran in; `spy.before` runs first."""
    real = trimpass_module.trim_messages

    class Spy:
        threads: list[str] = []
        before = None

        def __call__(self, messages, **options):
            self.threads.append(threading.current_thread().name)
            if self.before is not None:
                self.before()
            return real(messages, **options)

    spy = Spy()
    spy.threads = []
    monkeypatch.setattr(trimpass_module, "trim_messages", spy)
    return spy


async def test_a_big_chat_is_trimmed_in_the_worker_thread_a_small_one_on_the_loop(counter, spy_trim):
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=0, openrouter_pricing=False)
    await request(f, body(big_chat()))
    await request(f, body(chat_of(3), "c2"))
    assert spy_trim.threads == ["contextwarden-cpu_0", threading.current_thread().name]


async def test_a_chat_of_many_tiny_messages_is_trimmed_in_the_worker_thread(counter, spy_trim):
    """A trim costs each message ~200 characters' worth whatever its text (2,000 one-letter
    messages, 25,000 characters' weight at 10 a message, held the loop 45 ms on it): a chat of
    1,000 one-letter messages goes to the thread; one of 100 stays on the loop."""
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=0, openrouter_pricing=False)
    for n, chat_id in ((1_000, "c1"), (100, "c2")):
        chat = [{"role": ("user", "assistant")[k % 2], "content": "abcdefghij"[k % 10]} for k in range(n - 1)]
        await request(f, body([*chat, {"role": "user", "content": "And now?"}], chat_id))
    assert spy_trim.threads == ["contextwarden-cpu_0", threading.current_thread().name]


async def test_flags_are_read_on_the_loop_unless_the_chat_has_very_many_messages(counter, monkeypatch):
    """Reading flags costs ~0.5 µs a message: a big chat's are read on the loop (a hop to the
    thread would cost more), those of a chat of more than READS_ON_LOOP_MAX_ITEMS messages and
    content parts in the thread."""
    real = trimpass_module.read_flags
    threads: list[str] = []
    monkeypatch.setattr(
        trimpass_module, "read_flags", lambda *a, **k: threads.append(threading.current_thread().name) or real(*a, **k)
    )
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=0, openrouter_pricing=False)
    await request(f, body(big_chat()))
    monkeypatch.setattr(offloop_module, "READS_ON_LOOP_MAX_ITEMS", 10)
    await request(f, body(big_chat(), "c2"))
    assert threads == [threading.current_thread().name, "contextwarden-cpu_0"]


async def test_a_chat_of_very_many_messages_is_read_for_commands_notes_and_pins_in_the_thread(counter, monkeypatch):
    """Finding earlier `!usage` exchanges, the summary note, the pins and what earlier passes added
    reads every message (100,000 one-letter messages held the loop ~55 ms with them): like the
    flags, on the loop up to READS_ON_LOOP_MAX_ITEMS messages, in the thread past it."""
    import contextwarden.face.filter as filter_module

    threads: list[tuple[str, str]] = []

    def spy(module, name: str) -> None:
        real = getattr(module, name)
        here = threading.current_thread
        monkeypatch.setattr(module, name, lambda *a: threads.append((name, here().name)) or real(*a))

    spy(filter_module, "without_usage_exchanges")
    spy(trimpass_module, "read_chat")
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=0, openrouter_pricing=False)
    await request(f, body(big_chat()))
    loop, worker = threading.current_thread().name, "contextwarden-cpu_0"
    assert threads == [("without_usage_exchanges", loop), ("read_chat", loop)]
    monkeypatch.setattr(offloop_module, "READS_ON_LOOP_MAX_ITEMS", 10)
    threads.clear()
    await request(f, body(big_chat(), "c2"))
    assert threads == [("without_usage_exchanges", worker), ("read_chat", worker)]


def test_flags_of_a_message_in_thousands_of_parts_are_read_off_the_loop():
    """A few messages whose content is thousands of parts weigh as many items as a long chat."""
    parts = [{"type": "text", "text": ""}] * (offloop_module.READS_ON_LOOP_MAX_ITEMS + 1)
    few = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]
    assert offloop_module.reads_off_loop(True, few)
    assert not offloop_module.reads_off_loop(True, chat_of(3)) and not offloop_module.reads_off_loop(False, few)


async def test_a_big_chat_s_next_turn_is_carried_on_the_loop_when_this_process_read_it(counter, spy_trim, monkeypatch):
    """A next turn that carries the previous selection costs what is new: it runs on the loop (the
    hop to the thread would cost about as much). The turn before it was read here only in part,
    and after the caches are gone (as in a worker that never saw the chat), the carry declines at
    once and the trim goes to the thread."""
    real = trimpass_module.carry_previous
    carried: list[tuple[str, bool]] = []

    def spy_carry(messages, **options):
        result = real(messages, **options)
        carried.append((threading.current_thread().name, result is not None))
        return result

    monkeypatch.setattr(trimpass_module, "carry_previous", spy_carry)
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=0, openrouter_pricing=False)
    chat = big_chat()
    loop, worker = threading.current_thread().name, "contextwarden-cpu_0"
    for i in range(3):
        out = await request(f, body(chat))
        chat = grow(chat, 100 + i)
    assert carried == [(loop, False), (loop, True)]  # turn 2: turn 1 read no recall index; turn 3 on the loop
    assert spy_trim.threads == [worker, worker]
    caches.clear_all()
    out = await request(f, body(chat))
    assert carried[-1] == (loop, False) and spy_trim.threads[-1] == worker
    assert len(out["messages"]) < len(chat)


def test_a_next_turn_with_a_big_excerpted_message_stays_in_the_thread(counter):
    """A carried excerpt is cut into chunks again every turn, in proportion to its message, and
    so is a dropped long message the recall may quote passages of: a next turn whose excerpted
    or dropped long messages hold EXCERPTS_ON_LOOP_MAX_CHARS or more is not carried on the loop."""
    chat = big_chat()
    decision = trimpass_module.trim_messages(chat, max_tokens=1_500, model=MODEL, token_counter=counter).decision
    later = grow(chat, 100)
    assert offloop_module.light_next_turn(later, decision)
    k = decision.at[0]  # a kept message, made a big document that the decision excerpted
    with_document = [*later[:k], {**later[k], "content": "word " * (EXCERPTS_ON_LOOP_MAX_CHARS // 5)}, *later[k + 1 :]]
    excerpted = replace(decision, excerpts=((k, (0,)),))
    assert excerpted.excerpts and not offloop_module.light_next_turn(with_document, excerpted)
    assert offloop_module.light_next_turn(with_document, decision)  # sent whole: not read again
    # Dropped, it may be quoted by passages: the recall cuts and scores it for every question.
    dropped = [i for i in range(decision.seen) if i not in decision.at and later[i].get("role") != "system"]
    k = dropped[0]
    with_document = [*later[:k], {**later[k], "content": "word " * (EXCERPTS_ON_LOOP_MAX_CHARS // 5)}, *later[k + 1 :]]
    assert not offloop_module.light_next_turn(with_document, decision)


async def test_the_loop_serves_others_while_a_big_chat_is_trimmed(counter, spy_trim):
    """The trim waits for a coroutine on the loop: on the loop itself it could never finish."""
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=0, openrouter_pricing=False)
    served = threading.Event()

    async def another_user() -> None:
        await asyncio.sleep(0.01)
        served.set()

    spy_trim.before = lambda: served.wait(10) or pytest.fail("the event loop was blocked during the trim")
    other = asyncio.create_task(another_user())
    out = await request(f, body(big_chat()))
    await other
    assert len(out["messages"]) < len(big_chat())


async def test_hooks_started_together_take_turns_with_the_loop_s_other_work(counter, spy_trim):
    """Small turns stay on the loop, each a few ms; 50 started together ran one after another in
    one iteration of the loop, a stall of their sum (175-253 ms). Each hook now waits its turn:
    the loop serves its other callbacks between one hook's trim and the next."""
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=0, openrouter_pricing=False)
    order: list[str] = []
    spy_trim.before = lambda: order.append("trim")

    async def other_work() -> None:
        while True:
            order.append("other")
            await asyncio.sleep(0)

    other = asyncio.create_task(other_work())
    outs = await asyncio.gather(*(request(f, body(chat_of(3), f"c{i}")) for i in range(3)))
    other.cancel()
    trims = [k for k, what in enumerate(order) if what == "trim"]
    assert len(trims) == 3 and all("other" in order[a:b] for a, b in zip(trims, trims[1:], strict=False))
    assert spy_trim.threads == [threading.current_thread().name] * 3 and all(out["messages"] for out in outs)


async def test_a_trim_in_the_thread_runs_without_the_collector_s_automatic_passes(counter, spy_trim):
    """A big chat's trim holds many objects while it runs: the collector's automatic passes
    (each a C call over the whole heap that holds the GIL, and so the loop) are off meanwhile and
    on again after it; turned off by someone else, they stay off."""
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=0, openrouter_pricing=False)
    enabled: list[bool] = []
    spy_trim.before = lambda: enabled.append(gc.isenabled())
    await request(f, body(big_chat()))
    assert spy_trim.threads == ["contextwarden-cpu_0"] and enabled == [False] and gc.isenabled()
    gc.disable()
    try:
        await request(f, body(big_chat(), "c2"))
        assert enabled == [False, False] and not gc.isenabled()
    finally:
        gc.enable()


async def test_what_a_compute_in_the_thread_keeps_is_not_left_young():
    """Objects a compute made and kept go to the oldest generation unscanned: left young, the
    first collection after it read them all in one C call (20-40 ms for 100,000 one-letter
    messages). Objects the process froze itself stay frozen."""
    young = 60_000  # several times the young generations' thresholds

    def keep() -> list[list[int]]:
        return [[k] for k in range(young)]

    kept = await offloop_module.compute(True, keep)
    oldest = {id(obj) for obj in gc.get_objects(generation=2)}
    assert all(id(item) in oldest for item in kept) and gc.isenabled()
    frozen = [[k] for k in range(100)]
    gc.freeze()
    try:
        await offloop_module.compute(True, keep)
        tracked = {id(obj) for generation in range(3) for obj in gc.get_objects(generation=generation)}
        assert gc.get_freeze_count() >= len(frozen) and not any(id(item) in tracked for item in frozen)
    finally:
        gc.unfreeze()


async def test_an_error_in_the_worker_thread_fails_open(counter, spy_trim, caplog):
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=0, openrouter_pricing=False)

    def broken() -> None:
        raise RuntimeError("secret message text")

    spy_trim.before = broken
    events = Events()
    b = body(big_chat())
    assert await request(f, b, events) is b
    assert spy_trim.threads == ["contextwarden-cpu_0"]
    [warning] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "failed" in r.getMessage()]
    assert "request failed (RuntimeError at test_event_loop.py:" in warning and "secret" not in warning
    assert "internal error" in events.statuses[-1]


async def test_a_request_cancelled_during_the_trim_writes_no_state(counter, spy_trim):
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=0, openrouter_pricing=False)
    key = chat_state_key("u1", "c1")
    chat = big_chat()
    await request(f, body(chat[:-1] + [{"role": "user", "content": "Remember this !pin"}]))
    before = await f.store.get(key)
    entered, release = threading.Event(), threading.Event()
    spy_trim.before = lambda: (entered.set(), release.wait(10))
    task = asyncio.create_task(request(f, body(chat[:-1] + [{"role": "user", "content": "Forget it !pin"}])))
    while not entered.is_set():
        await asyncio.sleep(0.005)
    task.cancel()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.05)  # the thread finishes its trim; nobody takes its result
    assert await f.store.get(key) == before
    spy_trim.before = None
    out = await request(f, body(chat))  # and the chat goes on
    assert len(out["messages"]) < len(chat)


async def test_off_the_loop_the_trim_is_the_same_deterministic_and_idempotent(counter, monkeypatch):
    chat = big_chat(80)
    results = []
    for threshold in (offloop_module.OFF_LOOP_MIN_CHARS, 10**12):  # in the thread, then on the loop
        monkeypatch.setattr(offloop_module, "OFF_LOOP_MIN_CHARS", threshold)
        f = make_filter(counter, max_context_tokens=2_000, reserve_output_tokens=0, openrouter_pricing=False)
        runs = [await run_turn(f, chat, chat_id=f"c{i}") for i in range(2)]
        again = await request(f, body(runs[0].after_request["messages"], "c9"))
        assert again["messages"] == runs[0].after_request["messages"]
        results.append([r.after_request["messages"] for r in runs])
    assert results[0] == results[1] and results[0][0] == results[0][1]


async def test_many_tools_a_response_format_and_many_images_are_counted_in_the_thread(counter, spy_trim, monkeypatch):
    """Open WebUI's 30 built-in tools are counted on the loop; 3,000 tool definitions or any
    response format in the thread; a chat of 10,000 image parts (little text) is trimmed there."""
    real = trimpass_module.fixed_cost
    threads: list[str] = []
    monkeypatch.setattr(
        trimpass_module, "fixed_cost", lambda *a, **k: threads.append(threading.current_thread().name) or real(*a, **k)
    )
    f = make_filter(counter, max_context_tokens=100_000, reserve_output_tokens=0, openrouter_pricing=False)

    def tool(i: int) -> dict:
        return {"type": "function", "function": {"name": f"t{i}", "description": "Looks a thing up."}}

    loop, worker = threading.current_thread().name, "contextwarden-cpu_0"
    await request(f, {**body(chat_of(3), "c1"), "tools": [tool(i) for i in range(30)]})
    await request(f, {**body(chat_of(3), "c2"), "tools": [tool(i) for i in range(3_000)]})
    await request(f, {**body(chat_of(3), "c3"), "response_format": {"type": "json_object"}})
    assert threads == [loop, worker, worker]
    images = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{i:08d}"}} for i in range(10_000)]
    chat = chat_of(3)
    chat[-1] = {"role": "user", "content": [{"type": "text", "text": "What are these?"}, *images]}
    spy_trim.threads.clear()
    await request(f, body(chat, "c4"))
    assert spy_trim.threads == [worker]


def test_what_a_request_carries_besides_messages_is_weighed_not_only_counted():
    """64 tool definitions (the most counted on the loop) with big schemas go to the thread too
    (5 MB of them held the loop 300 ms), a schema nested far deeper than recursion allows is
    weighed all the same, and so are 3,000 tool calls in one reply (300,000 held it 120 ms)."""
    big = {"type": "object", "properties": {f"p{k}": {"type": "string", "description": "x" * 500} for k in range(50)}}
    tools = [{"type": "function", "function": {"name": f"t{i}", "parameters": big}} for i in range(64)]
    assert offloop_module.heavy_extras({"tools": tools})
    small = [{"type": "function", "function": {"name": f"t{i}", "parameters": {"type": "object"}}} for i in range(64)]
    assert not offloop_module.heavy_extras({"tools": small})
    deep: dict = {"type": "string"}
    for _ in range(100_000):
        deep = {"type": "object", "properties": {"p": deep}}
    assert offloop_module.heavy_extras({"tools": [{"type": "function", "function": {"name": "t", "parameters": deep}}]})
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    reply = {"role": "assistant", "content": "", "tool_calls": [call] * 3_000}
    assert offloop_module.reads_off_loop(True, [{"role": "user", "content": "Go"}, reply])


def test_the_command_in_parts_is_not_read_when_they_hold_megabytes(monkeypatch):
    """A user message in a few parts is read for `!usage` only while its text is short (16 parts
    of 300 KB in 6 messages held the loop 176 ms): a long one is not joined at all."""
    from contextwarden.face import adminview

    assert adminview.is_usage_command([{"role": "user", "content": [{"type": "text", "text": " !usage "}]}])
    monkeypatch.setattr(adminview, "message_text", lambda message: pytest.fail("a long message was joined"))
    parts = [{"type": "text", "text": "x" * 300_000}] * 15 + [{"type": "text", "text": "!usage"}]
    assert not adminview.is_usage_command([{"role": "user", "content": parts}])


# -- outbound HTTP clients: their TLS context is made once, off the loop -----------------------------


@pytest.fixture
def tls_contexts_made(monkeypatch) -> list[threading.Thread]:
    """The threads that made a TLS context (httpx makes one for every client it builds), in a
    process that made none yet."""
    made: list[threading.Thread] = []
    real = ssl.create_default_context

    def spy(*args, **kwargs):
        made.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(ssl, "create_default_context", spy)
    monkeypatch.setattr(netclient_module, "_tls", [])
    return made


async def test_summary_calls_make_their_tls_context_once_and_off_the_loop(tls_contexts_made):
    # Before: each call built httpx.AsyncClient() on the loop: a new TLS context, 30-100 ms a call.
    config = SummaryConfig(base_url="https://llm.test/v1", model="mini", timeout=5.0, max_tokens=50)
    reply = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Short."}, "finish_reason": "stop"}],
    }
    with respx.mock(assert_all_called=True) as mock:
        route = mock.post("https://llm.test/v1/chat/completions").mock(return_value=httpx.Response(200, json=reply))
        for i in range(3):
            dropped = [{"role": "user", "content": f"question {i}"}]
            assert await summarize_messages(dropped, config=config, store=MemoryStore()) == "Short."
    assert route.call_count == 3
    assert len(tls_contexts_made) == 1 and tls_contexts_made[0] is not threading.main_thread()


async def test_a_price_refresh_makes_its_tls_context_off_the_loop(tls_contexts_made):
    live = LivePrices(PriceBook.from_bundled())  # no client given: it makes its own, as in the filter
    with respx.mock(assert_all_called=True) as mock:
        mock.get(DEFAULT_OPENROUTER_URL).mock(
            return_value=httpx.Response(200, json=load_fixture("openrouter_models_sample.json"))
        )
        await live.refresh()
        await live.refresh()
    assert live.book.source == "openrouter"
    assert len(tls_contexts_made) == 1 and tls_contexts_made[0] is not threading.main_thread()
