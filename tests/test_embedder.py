"""Open WebUI's embedder as the trim's `embed`: fetched ahead, bounded in count and time."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

import contextwarden.face.embedder as embedder_module
from contextwarden import trim_messages
from contextwarden.core.semantic import PIECE_CHARS, VECTORS, embed_pieces, embed_texts, similarities
from contextwarden.face.embedder import TURN_EMBED_TEXTS, EmbedderResting, EmbedderSlow, OpenWebUIEmbedder, embedder_of

from embedders import chat_about_a_cat, topic_embed


@pytest.fixture(autouse=True)
def ahead_at_once(monkeypatch):
    """The call after a reply starts at once here (in Open WebUI a second later, see
    `test_after_a_reply_the_call_waits_for_the_page`)."""
    monkeypatch.setattr(embedder_module, "AHEAD_DELAY_SECONDS", 0.0)


def request_with(function) -> SimpleNamespace:
    """What a filter gets as `__request__`: the embedder sits on `app.state`."""
    return SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(EMBEDDING_FUNCTION=function)))


class FakeEmbeddingFunction:
    """Open WebUI's async `(texts, prefix=None, user=None)`; records what it was asked."""

    def __init__(self, delay: float = 0.0) -> None:
        self.calls: list[list[str]] = []
        self.delay = delay

    async def __call__(self, texts, prefix=None, user=None):
        self.calls.append(list(texts))
        await asyncio.sleep(self.delay)
        return topic_embed(texts)


def test_one_adapter_per_embedding_function():
    function = FakeEmbeddingFunction()
    assert embedder_of(request_with(function)) is embedder_of(request_with(function))
    assert embedder_of(request_with(FakeEmbeddingFunction())) is not embedder_of(request_with(function))
    assert embedder_of(request_with(None)) is None and embedder_of(None) is None


async def test_prefetch_embeds_newest_first_up_to_the_cap_then_the_rest():
    function = FakeEmbeddingFunction()
    embedder = OpenWebUIEmbedder(function)
    chat = chat_about_a_cat()
    assert await embedder.prefetch(chat, timeout=5, max_texts=4) == 4
    assert function.calls[0][0] == "What was my feline called?"  # the question first
    assert all("Be brief" not in t for t in function.calls[0])  # system prompts are not embedded
    lexical = trim_messages(chat, max_tokens=150, model="gpt-4o", low_watermark=1.0)
    pending = trim_messages(chat, max_tokens=150, model="gpt-4o", low_watermark=1.0, embed=embedder)
    assert pending.kept == lexical.kept and pending.notes == ("some messages not embedded yet: relevance is lexical",)
    while await embedder.prefetch(chat, timeout=5, max_texts=16):
        pass
    ready = trim_messages(chat, max_tokens=150, model="gpt-4o", low_watermark=1.0, embed=embedder)
    assert 1 in ready.kept + ready.recalled and not ready.notes  # sent: in place or quoted
    asked = [t for call in function.calls for t in call]
    assert asked == embed_texts(chat) and len(asked) == len(set(asked))  # each text once
    assert len(asked) > len(chat) - 1  # the one-liners' context windows, after every message's own


async def test_prefetch_embeds_a_long_message_in_its_pieces():
    function = FakeEmbeddingFunction()
    embedder = OpenWebUIEmbedder(function)
    weather = [(f"Day {k}: the storm and the rain kept us in. " * 9)[: PIECE_CHARS - 10] for k in range(6)]
    long = {"role": "assistant", "content": "\n".join([*weather, "I adopted a cat named Miso."])}
    chat = [{"role": "user", "content": "Any news?"}, long, {"role": "user", "content": "What was my feline called?"}]
    while await embedder.prefetch(chat, timeout=5, max_texts=4):
        pass
    asked = [t for call in function.calls for t in call]
    assert asked == ["What was my feline called?", *embed_pieces(long), "Any news?"] and len(asked) > 3
    found = similarities(chat, 2, VECTORS, embedder, fill=False)  # the trim only looks them up
    assert found is not None and found[1] == pytest.approx(1.0)


async def test_a_slow_embedder_times_out_and_nothing_is_cached():
    embedder = OpenWebUIEmbedder(FakeEmbeddingFunction(delay=5))
    with pytest.raises(TimeoutError):
        await embedder.prefetch(chat_about_a_cat(), timeout=0.05, max_texts=8)
    result = trim_messages(chat_about_a_cat(), max_tokens=150, model="gpt-4o", low_watermark=1.0, embed=embedder)
    assert result.notes == ("some messages not embedded yet: relevance is lexical",)


async def test_after_a_timeout_a_turn_asks_for_less_then_for_more_again(monkeypatch):
    monkeypatch.setattr(embedder_module, "BACKOFF_FIRST_SECONDS", 0.0)  # a failed call rests it: not here
    monkeypatch.setattr(embedder_module, "SLOW_RECHECK_SECONDS", 0.0)  # nor does a wait that ran out

    class SlowAndFailing(FakeEmbeddingFunction):
        crashing = True

        async def __call__(self, texts, prefix=None, user=None):
            vectors = await super().__call__(texts)
            if self.crashing:
                raise RuntimeError("model crashed")  # nothing lands: every turn asks again
            return vectors

    function = SlowAndFailing(delay=0.05)
    embedder = OpenWebUIEmbedder(function)
    chat = chat_about_a_cat()
    for expected in (32, 16, 8, 4, 4):
        with pytest.raises(TimeoutError):
            await embedder.prefetch(chat, timeout=0.01, max_texts=32)
        assert len(function.calls[-1]) == expected
        await asyncio.sleep(0.08)  # the call ends (and fails) before the next turn
    function.crashing, function.delay = False, 0.0  # the model is back, and quick
    assert await embedder.prefetch(chat, timeout=5, max_texts=32) == 4  # the slow embedder still makes progress
    assert await embedder.prefetch(chat, timeout=5, max_texts=32) == 8  # and is asked for more once it answers


async def test_a_late_answer_is_kept_and_no_second_call_starts_beside_it(monkeypatch):
    """The embedder's thread runs on after a turn's timeout: its vectors are kept when they land,
    and a turn meanwhile neither starts another call beside it (on 2 CPU cores each extra call
    slows every user) nor waits behind it."""
    monkeypatch.setattr(embedder_module, "SLOW_RECHECK_SECONDS", 0.3)
    function = FakeEmbeddingFunction(delay=0.3)
    embedder = OpenWebUIEmbedder(function)
    chat = chat_about_a_cat()
    with pytest.raises(TimeoutError):
        await embedder.prefetch(chat, timeout=0.05, max_texts=8)
    with pytest.raises(EmbedderSlow):  # at once: a 5 s wait would have seen it land
        await embedder.prefetch(chat, timeout=5, max_texts=8)
    assert len(function.calls) == 1
    await asyncio.sleep(0.35)
    function.delay = 0
    assert await embedder.prefetch(chat, timeout=5, max_texts=8) == 4  # halved after the timeout
    assert set(function.calls[1]).isdisjoint(function.calls[0])  # the late vectors were kept


async def test_after_a_wait_ran_out_turns_neither_wait_nor_call_for_a_while(monkeypatch):
    """An embedder slower than the turn's wait (MiniLM on a loaded CPU) would make every turn wait
    its 0.1 s in vain and run the call beside the request: after one wait runs out, turns go
    lexical at once for `SLOW_RECHECK_SECONDS`, then one turn tries again."""
    monkeypatch.setattr(embedder_module, "SLOW_RECHECK_SECONDS", 0.3)
    function = FakeEmbeddingFunction(delay=0.1)
    embedder = OpenWebUIEmbedder(function)
    chat = chat_about_a_cat()
    with pytest.raises(TimeoutError):
        await embedder.prefetch(chat, timeout=0.02, max_texts=4)
    await asyncio.sleep(0.15)  # that call has landed: no call is running
    with pytest.raises(EmbedderSlow, match="slower than the wait"):
        await embedder.prefetch(chat, timeout=5, max_texts=4)
    assert len(function.calls) == 1  # no call started meanwhile
    assert embedder.ahead(chat, max_texts=8)  # after a reply the chat is still embedded
    await asyncio.sleep(0.3)
    function.delay = 0.0
    chat = [*chat, {"role": "user", "content": "And the dog?"}]
    assert await embedder.prefetch(chat, timeout=5, max_texts=4) >= 1  # tried again: quick now
    assert any("And the dog?" in text for text in function.calls[-1])


async def test_after_a_reply_the_call_waits_for_the_page(monkeypatch):
    """The outlet runs while Open WebUI still sends the status line and the page finishes the
    reply: the call after it starts `AHEAD_DELAY_SECONDS` later, not beside them."""
    monkeypatch.setattr(embedder_module, "AHEAD_DELAY_SECONDS", 0.2)
    function = FakeEmbeddingFunction()
    embedder = OpenWebUIEmbedder(function)
    assert embedder.ahead(chat_about_a_cat(), max_texts=8)
    await asyncio.sleep(0.05)
    assert function.calls == []
    await asyncio.sleep(0.3)
    assert len(function.calls) == 1


async def test_a_turn_right_after_a_reply_goes_before_its_waiting_call(monkeypatch):
    """A turn that comes while the call after the last reply still waits for the page (a quick
    follow-up, a regenerate): that call has asked nothing yet and gives way; the turn's own call
    answers in its wait, and the embedder, shared by every user of the worker, is not taken for
    slow (it was: the turn waited for the delayed call, ran out, and all turns went lexical); the
    call starts again after the turn's."""
    monkeypatch.setattr(embedder_module, "AHEAD_DELAY_SECONDS", 0.5)
    function = FakeEmbeddingFunction()
    embedder = OpenWebUIEmbedder(function)
    assert embedder.ahead(chat_about_a_cat(), max_texts=8)
    waiting = embedder._waiting
    chat = [*chat_about_a_cat(), {"role": "user", "content": "And its favourite toy?"}]
    assert await embedder.prefetch(chat, timeout=0.1, max_texts=4) >= 1
    assert embedder._slow.failures == 0 and len(function.calls) == 1
    assert "And its favourite toy?" in function.calls[0]
    await asyncio.sleep(0.7)  # the call that gave way starts again after the turn's, once its delay is over
    assert function.calls[1] == [text for text in waiting if text not in function.calls[0]]


async def test_a_slow_pause_doubles_while_each_try_runs_out(monkeypatch):
    monkeypatch.setattr(embedder_module, "SLOW_RECHECK_SECONDS", 0.1)
    monkeypatch.setattr(embedder_module, "SLOW_RECHECK_MAX_SECONDS", 0.3)
    function = FakeEmbeddingFunction(delay=0.05)
    embedder = OpenWebUIEmbedder(function)
    loop = asyncio.get_running_loop()
    pauses = []
    for turn in range(4):
        chat = [*chat_about_a_cat(), {"role": "user", "content": f"Question {turn}?"}]
        with pytest.raises(TimeoutError):
            await embedder.prefetch(chat, timeout=0.01, max_texts=4)
        pauses.append(round(embedder._slow.until - loop.time(), 1))
        await asyncio.sleep(embedder._slow.until - loop.time() + 0.06)  # past it, and the call landed
    assert pauses == [0.1, 0.2, 0.3, 0.3]
    function.delay = 0.0
    chat = [*chat_about_a_cat(), {"role": "user", "content": "Quick now?"}]
    assert await embedder.prefetch(chat, timeout=5, max_texts=4) >= 1
    assert embedder._slow.failures == 0  # answered in time: the next slow wait pauses 0.1 s again


async def test_a_wrong_shaped_answer_is_refused():
    async def broken(texts, prefix=None, user=None):
        return {"error": "no model"}

    with pytest.raises(TypeError):
        await OpenWebUIEmbedder(broken).prefetch(chat_about_a_cat(), timeout=1, max_texts=8)


# -- through the filter, as Open WebUI calls it ----------------------------------------------


def cat_body() -> dict:
    return {
        "model": "gpt-4o",
        "messages": chat_about_a_cat(),
        "stream": False,
        "metadata": {"chat_id": "cat", "user_id": "u1"},
    }


async def next_turn_with(counter, function, monkeypatch, wait: float = 0.1, **valves) -> tuple[list, dict]:
    """A chat as Open WebUI runs it: a first turn (a chat this process has not seen), its reply
    through the outlet (which starts embedding the chat), `wait` seconds, then the next turn.
    The `embed` each trim was given (None: by words), and the next turn's body."""
    import contextwarden.face.trimpass as trimpass_module
    from contextwarden import Filter

    embeds: list = []
    real = trimpass_module.trim_messages
    monkeypatch.setattr(trimpass_module, "trim_messages", lambda *a, **k: embeds.append(k["embed"]) or real(*a, **k))
    f = Filter(counter=counter)
    f.valves = f.Valves(
        max_context_tokens=1_174, reserve_output_tokens=1_024, openrouter_pricing=False, low_watermark=1.0, **valves
    )
    request = request_with(function)

    async def turn(messages: list[dict]) -> dict:
        body = {**cat_body(), "messages": messages, "metadata": {"chat_id": "cat", "user_id": "u1"}}
        return await f.inlet(body, __user__={"id": "u1"}, __metadata__=body["metadata"], __request__=request)

    chat = chat_about_a_cat()
    await turn(chat)
    chat.append({"role": "assistant", "content": "I cannot tell, sorry."})
    await f.outlet({"model": "gpt-4o", "messages": chat}, __user__={"id": "u1"}, __request__=request)
    await asyncio.sleep(wait)
    later = await turn([*chat, {"role": "user", "content": "Think again: what was my feline called?"}])
    return embeds, later


def sends_the_cat(body: dict) -> bool:
    return any("named Miso" in str(m.get("content")) for m in body["messages"])


async def test_the_filter_uses_open_webuis_embedder(counter, monkeypatch):
    """Issue 30: the first turn of a chat this process has not seen asks the embedder nothing
    and is trimmed by words (a 64-text call on a CPU embedder ran through the reply: +1.25 s in
    the browser); the outlet embeds the chat after the reply; the next turn asks only for its
    own question and weighs meaning."""
    function = FakeEmbeddingFunction()
    # the turn's wait (0.1 s by default) is for this test's loaded machine a race: 5 s here
    embeds, later = await next_turn_with(counter, function, monkeypatch, embed_timeout_seconds=5)
    assert embeds[0] is None and embeds[-1] is not None and sends_the_cat(later)
    asked, *after = function.calls  # the outlet's call, the whole chat newest first; then the question's
    assert any("Miso" in text for text in asked) and after and all(len(c) <= TURN_EMBED_TEXTS for c in after)
    embeds, _ = await next_turn_with(counter, None, monkeypatch)
    assert embeds == [None, None]  # no embedder loaded: word matching


async def test_a_quick_next_turn_does_not_make_the_embedder_slow(counter, caplog, monkeypatch):
    """The next turn comes before the outlet's call has started (it waits for the page): the
    turn asks for its own texts, nothing is logged or taken for slow, and the outlet's call runs
    after it, so the turn after finds the chat embedded."""
    monkeypatch.setattr(embedder_module, "AHEAD_DELAY_SECONDS", 0.3)
    function = FakeEmbeddingFunction()
    embeds, _ = await next_turn_with(counter, function, monkeypatch, wait=0.0, embed_timeout_seconds=5)
    adapter = embedder_of(request_with(function))
    assert adapter is not None and adapter._slow.failures == 0 and embeds[-1] is adapter
    assert not [r for r in caplog.records if "embedder" in r.getMessage()]
    assert len(function.calls) == 1 and len(function.calls[0]) <= TURN_EMBED_TEXTS  # the turn's own
    await asyncio.sleep(0.5)
    assert len(function.calls) == 2 and any("Miso" in text for text in function.calls[1])  # the outlet's, after


async def test_the_embedder_valve_turns_it_off(counter, monkeypatch):
    function = FakeEmbeddingFunction()
    embeds, _ = await next_turn_with(counter, function, monkeypatch, semantic_relevance=False)
    assert embeds == [None, None] and function.calls == []


async def test_a_slow_embedder_costs_one_timeout_then_no_wait(counter, caplog, monkeypatch):
    function = FakeEmbeddingFunction(delay=5)  # the outlet's call is still running at the next turn
    embeds, later = await next_turn_with(counter, function, monkeypatch, wait=0.01, embed_timeout_seconds=0.05)
    assert embeds == [None, None]
    warnings = [r.getMessage() for r in caplog.records if "embedder" in r.getMessage()]
    assert warnings == ["contextwarden: embedder: not ready in time; relevance is lexical this turn"]
    adapter = embedder_of(request_with(function))
    with pytest.raises(EmbedderSlow):  # the turn after it does not wait (a 5 s wait would see it land)
        await adapter.prefetch(later["messages"], timeout=5, max_texts=4)
    assert len(function.calls) == 1  # nor does it start a call beside the running one


class Reshaping(FakeEmbeddingFunction):
    """An embedder whose vectors grow by `grow` dimensions with each call."""

    def __init__(self, grow: int) -> None:
        super().__init__()
        self.grow = grow

    async def __call__(self, texts, prefix=None, user=None):
        extra = [0.0] * self.grow * len(self.calls)
        return [vector + extra for vector in await super().__call__(texts)]


@pytest.mark.parametrize("grow", [1, 10_000], ids=["other-dimensions", "too-many-dimensions"])
async def test_vectors_of_another_length_or_too_long_are_a_failed_call(counter, caplog, monkeypatch, grow):
    """An answer of other dimensions than the embedder's earlier vectors went lexical silently
    (`similarities` found them unequal); one of 10,003 dimensions was kept whatever its size.
    Both now fail the call: one warning, the embedder rests, the turn is lexical."""
    function = Reshaping(grow)
    embeds, _ = await next_turn_with(counter, function, monkeypatch, embed_timeout_seconds=5)
    assert len(function.calls) == 2 and embeds[-1] is None  # the outlet's call, then the turn's: refused
    warnings = [r.getMessage() for r in caplog.records if "embedder" in r.getMessage()]
    assert warnings == ["contextwarden: embedder: ValueError; relevance is lexical this turn"]
    adapter = embedder_of(request_with(function))
    assert adapter is not None and adapter._rest.failures == 1


async def test_a_failing_embedder_rests_and_no_turn_waits_for_it(monkeypatch):
    """A call that fails makes the embedder rest (30 s, doubling): turns meanwhile ask nothing
    and go lexical at once; once it answers again the back-off starts over."""
    monkeypatch.setattr(embedder_module, "BACKOFF_FIRST_SECONDS", 0.2)

    class Failing(FakeEmbeddingFunction):
        failing = True

        async def __call__(self, texts, prefix=None, user=None):
            vectors = await super().__call__(texts)
            if self.failing:
                raise RuntimeError("model crashed")
            return vectors

    function = Failing()
    embedder = OpenWebUIEmbedder(function)
    chat = chat_about_a_cat()
    with pytest.raises(RuntimeError):
        await embedder.prefetch(chat, timeout=1, max_texts=8)
    with pytest.raises(EmbedderResting):  # at once: no call, no wait
        await embedder.prefetch(chat, timeout=1, max_texts=8)
    assert not embedder.ahead(chat, max_texts=8) and len(function.calls) == 1
    await asyncio.sleep(0.25)
    with pytest.raises(RuntimeError):  # asked again after 0.2 s; fails again: rests 0.4 s now
        await embedder.prefetch(chat, timeout=1, max_texts=8)
    await asyncio.sleep(0.25)
    with pytest.raises(EmbedderResting):
        await embedder.prefetch(chat, timeout=1, max_texts=8)
    await asyncio.sleep(0.2)
    function.failing = False
    assert await embedder.prefetch(chat, timeout=1, max_texts=8) == 8
    assert embedder._rest.failures == 0


async def test_after_a_reply_the_chat_is_embedded_ahead_of_the_next_turn(counter):
    """The outlet starts the call (it does not wait for it): the next turn finds the vectors."""
    function = FakeEmbeddingFunction(delay=0.05)
    from contextwarden import Filter

    f = Filter(counter=counter)
    f.valves = f.Valves(openrouter_pricing=False)
    request = request_with(function)
    chat = [*chat_about_a_cat(), {"role": "assistant", "content": "The cat is called Miso."}]
    await f.outlet({"model": "gpt-4o", "messages": chat}, __user__={"id": "u1"}, __request__=request)
    adapter = embedder_of(request)
    assert VECTORS.missing(embed_texts(chat), adapter)  # the outlet did not wait for the call
    await asyncio.sleep(0.2)
    [asked] = function.calls
    assert any("Miso" in text for text in asked)  # the reply itself, newest first
    assert VECTORS.missing(asked, adapter) == []  # landed, normalised off the loop


async def test_after_a_reply_a_big_chat_is_read_for_the_embedder_off_the_loop(counter, monkeypatch):
    """What a big chat still needs embedded is found in the contextwarden thread (100,000 short
    messages read on the loop held it 337 ms); a small chat's on the loop. The call starts alike."""
    import threading

    from contextwarden import Filter

    threads: list[str] = []
    real = OpenWebUIEmbedder.missing

    def spy(self, messages, max_texts):
        threads.append(threading.current_thread().name)
        return real(self, messages, max_texts)

    monkeypatch.setattr(OpenWebUIEmbedder, "missing", spy)
    function = FakeEmbeddingFunction()
    f = Filter(counter=counter)
    f.valves = f.Valves(openrouter_pricing=False)
    request = request_with(function)
    small = [*chat_about_a_cat(), {"role": "assistant", "content": "The cat is called Miso."}]
    big = [*small[:-2], *({"role": "user", "content": f"Note {k}: the rain again."} for k in range(3_000)), *small[-2:]]
    for chat in (small, big):
        await f.outlet({"model": "gpt-4o", "messages": chat}, __user__={"id": "u1"}, __request__=request)
        await asyncio.sleep(0.1)
    assert threads == [threading.current_thread().name, "contextwarden-cpu_0"] and len(function.calls) == 2


async def test_a_turn_that_keeps_the_selection_recalls_by_meaning_too(counter, monkeypatch):
    """A chat that goes on keeps the previous selection and recalls what the question needs: with
    Open WebUI's embedder loaded, that recall weighs meaning too, so the dropped cat message,
    which shares no word with "feline", is the one quoted. A chat trimmed before is embedded
    first and trimmed once (not lexically, then again with the vectors)."""
    from contextwarden import Filter
    from contextwarden.core.conversation import is_recall_message

    function = FakeEmbeddingFunction()
    f = Filter(counter=counter)
    f.valves = f.Valves(max_context_tokens=1_324, reserve_output_tokens=1_024, low_watermark=0.5)
    chat = chat_about_a_cat()
    chat[-1] = {"role": "user", "content": "Will the storm and the rain go on tomorrow?"}
    meta = {"chat_id": "cat-later", "user_id": "u1"}

    async def turn(messages):
        body = {"model": "gpt-4o", "messages": messages, "stream": False, "metadata": dict(meta)}
        return await f.inlet(
            body, __user__={"id": "u1"}, __metadata__=body["metadata"], __request__=request_with(function)
        )

    first = await turn(chat)
    assert not sends_the_cat(first)
    later = chat + [
        {"role": "assistant", "content": "More rain, I think."},
        {"role": "user", "content": "What was my feline called?"},
    ]
    request = request_with(function)  # the reply went through the outlet, which embedded the chat
    await f.outlet({"model": "gpt-4o", "messages": later[:-1]}, __user__={"id": "u1"}, __request__=request)
    await asyncio.sleep(0.1)
    import contextwarden.face.trimpass as trimpass_module

    trims = []
    real = trimpass_module.trim_messages
    monkeypatch.setattr(trimpass_module, "trim_messages", lambda *a, **k: trims.append(k["embed"]) or real(*a, **k))
    out = await turn(later)
    assert len(trims) == 1 and trims[0] is not None
    state = out["metadata"]["contextwarden"]
    blocks = [m["content"] for m in out["messages"] if is_recall_message(m)]
    assert state.get("reused", True) and blocks, state  # the selection was kept, with a recall block
    assert any("named Miso" in b for b in blocks)


async def test_a_turn_reads_a_big_chat_for_the_embedder_off_the_loop(counter, monkeypatch):
    """A turn asks for its question's vector only, but finding what is missing reads the whole
    chat (every message's pieces, passages and hashes): for a big chat that runs in the
    contextwarden thread, as after a reply (1,000 messages of ~2 KB held the loop 37-72 ms, 3,000
    110-122 ms); a small chat's on the loop. The first pass's wait and a later pass's ask alike."""
    from contextwarden import Filter

    threads: list[str] = []
    real = OpenWebUIEmbedder.missing

    def spy(self, messages, max_texts):
        if len(messages) > 3_000:  # the chat, not what the first pass sent (a later pass reads that)
            threads.append(threading.current_thread().name)
        return real(self, messages, max_texts)

    monkeypatch.setattr(OpenWebUIEmbedder, "missing", spy)
    small = chat_about_a_cat()
    big = [*small[:-1], *({"role": "user", "content": f"Note {k}: the rain again."} for k in range(3_000)), small[-1]]
    function = FakeEmbeddingFunction()
    embedder = OpenWebUIEmbedder(function)
    assert await embedder.prefetch(small, timeout=5, max_texts=4) == 4
    assert await embedder.prefetch(big, timeout=5, max_texts=4) == 4
    loop, cpu = threading.current_thread().name, "contextwarden-cpu_0"
    assert threads == [cpu] and loop != cpu

    f = Filter(counter=counter)
    f.valves = f.Valves(openrouter_pricing=False, max_context_tokens=4_000, embed_timeout_seconds=5)
    request, user, meta = request_with(function), {"id": "u1"}, {"chat_id": "big", "user_id": "u1"}
    for chat in (big, [*big, {"role": "assistant", "content": "Rain."}, {"role": "user", "content": "And then?"}]):
        threads.clear()
        body = {"model": "gpt-4o", "messages": chat, "stream": False, "metadata": dict(meta)}
        sent = await f.inlet(body, __user__=user, __metadata__=body["metadata"], __request__=request)
        await f.request(sent, __user__=user, __metadata__=body["metadata"], __request__=request)
        await f.outlet(
            {"model": "gpt-4o", "messages": [*chat, {"role": "assistant", "content": "Rain."}]},
            __user__=user,
            __request__=request,
        )
        await asyncio.sleep(0.05)
    assert threads == [cpu, cpu], threads  # the next turn's inlet (waiting) and outlet


async def test_a_synchronous_embedding_function_runs_in_a_thread():
    """An embedding function that is not `async` (an older Open WebUI's, or one wrapped by a
    plugin: a CPU model's encode) runs in a worker thread, its answer kept: called on the loop
    it held every user's requests for the whole encode (0.5 s here), then failed on `await`."""
    import time

    calls: list[str] = []

    def encode(texts, prefix=None, user=None):
        calls.append(threading.current_thread().name)
        time.sleep(0.3)
        return topic_embed(texts)

    async def encode_async(texts, prefix=None, user=None):
        return topic_embed(texts)

    loop, longest = asyncio.get_running_loop(), [0.0]

    async def tick():
        last = loop.time()
        while True:
            await asyncio.sleep(0.005)
            longest[0], last = max(longest[0], loop.time() - last), loop.time()

    ticker = asyncio.ensure_future(tick())
    try:
        assert await OpenWebUIEmbedder(encode).prefetch(chat_about_a_cat(), timeout=5, max_texts=4) == 4
    finally:
        ticker.cancel()
    assert longest[0] < 0.2 and calls and calls[0] != threading.current_thread().name
    wrapped = OpenWebUIEmbedder(lambda texts, prefix=None, user=None: encode_async(texts))  # returns a coroutine
    assert await wrapped.prefetch(chat_about_a_cat(), timeout=5, max_texts=4) == 4
