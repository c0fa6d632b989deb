"""Modes: shadow leaves every body byte-identical while recording what enforce would have done
(metadata note, usage line, ledger, per-chat shadow state); off does nothing before the reply
but still records usage; a bad mode value is named and fails open (shadow)."""

from __future__ import annotations

import json
import logging
import re
from datetime import UTC, datetime
from decimal import Decimal

import pytest

from contextwarden.money.accounting import learn_calibration
from contextwarden.money.ledger import ledger_totals, read_ledger
from contextwarden.money.pricing import PriceBook
from contextwarden.money.savings import PromptCache, estimate_savings
from contextwarden.state.chatstate import ChatState, chat_state_key

from chats import frozen
from helpers import Events, body_of, chat_of, grow, make_filter, sent_count, store_of, usage_records

MODEL = "gpt-4o"
GPT4O_INPUT = Decimal("0.0000025")  # bundled price of openai/gpt-4o input, $2.50 / M
GPT4O_CACHED = Decimal("0.00000125")  # and its cache-read price, $1.25 / M


def previous_prompt(chat: list[dict], total: int) -> int:
    """Tokens of the untrimmed chat's previous prompt (all but the last reply and the question,
    less the reply priming): the cached prefix savings assume for the untrimmed chat."""
    return total - 3 - counter_of().count_messages(chat[-2:], MODEL) + 3


def counter_of():
    from contextwarden.core.tokens import TokenCounter

    return TokenCounter(block=True)


def cached_savings(full: int, sent: int, prefix: int, sent_cached: int = 0) -> Decimal:
    """Hand arithmetic: the untrimmed prompt with `prefix` at the cache-read price, minus the sent
    one with `sent_cached` at it (gpt-4o caches automatically from 1,024 tokens)."""
    return ((full - prefix) * GPT4O_INPUT + prefix * GPT4O_CACHED) - (
        (sent - sent_cached) * GPT4O_INPUT + sent_cached * GPT4O_CACHED
    )


@pytest.fixture(params=["memory", "redis"])
def store_valves(request) -> dict:
    return {} if request.param == "memory" else {"redis_url": request.getfixturevalue("redis_url")}


def without_metadata(body: dict) -> str:
    """The JSON that reaches the backend: Open WebUI strips `metadata` before sending."""
    return json.dumps({k: v for k, v in body.items() if k != "metadata"}, sort_keys=True)


DETAIL = r"Context (\d+) → (\d+) messages · ([\d,]+) → ([\d,]+) tokens"


async def inlet_then_request(f, body: dict, user_id: str, events: Events) -> dict:
    user = {"id": user_id}
    first = await f.inlet(
        body,
        __user__=user,
        __metadata__=body["metadata"],
        __model__={"id": MODEL, "owned_by": "openai"},
        __event_emitter__=events,
    )
    return await f.request(
        first,
        __user__=user,
        __metadata__=first["metadata"],
        __model__={"id": MODEL, "owned_by": "openai"},
        __event_emitter__=events,
    )


def reply_with_usage(prompt: int) -> dict:
    return {
        "role": "assistant",
        "content": "Answer.",
        "usage": {"prompt_tokens": prompt, "completion_tokens": 10, "total_tokens": prompt + 10},
    }


async def test_shadow_sends_the_body_unchanged_and_notes_what_enforce_would_have_sent(counter, unique):
    chat = chat_of(20)
    enforce, shadow = (
        make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=500),
        make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=500, mode="shadow"),
    )
    real = body_of(chat, chat_id=f"e-{unique}")
    trimmed = await inlet_then_request(enforce, real, "u1", Events())
    body = body_of(chat, chat_id=f"s-{unique}")
    body["stream"] = True  # an OpenAI connection: enforce would ask for stream usage, shadow must not
    before, snapshot = without_metadata(body), frozen(chat)
    events = Events()
    out = await inlet_then_request(shadow, body, "u1", events)
    assert out is body and out["messages"] is chat and without_metadata(out) == before and frozen(chat) == snapshot
    assert "stream_options" not in out
    sent = counter.count_messages(trimmed["messages"], MODEL)
    full = counter.count_messages(chat, MODEL)
    note = body["metadata"]["contextwarden"]
    assert note["mode"] == "shadow" and note["dropped"] == 0
    assert note["estimated_prompt_tokens"] == full  # what really went out: the whole chat
    assert note["tokens_saved"] == full - sent > 0
    prefix = previous_prompt(chat, full)
    assert prefix >= 1_024  # cacheable: the untrimmed chat's previous prompt is priced as cached
    # the would-be trim is a new selection: only its system prompt repeats, below the 1,024 minimum
    assert Decimal(note["cost_saved_usd"]) == cached_savings(full, sent, prefix)
    system = counter.count_messages(chat[:1], MODEL) - 3
    assert note["cache"] == {"untrimmed": prefix, "trimmed": system, "caches": True, "minimum": 1_024}
    assert events.statuses == []  # the turn's one line comes after the reply
    assert note["pending_line"] == f"Shadow: would send {sent_count(chat, trimmed['messages'])} of {len(chat)} messages"
    assert note["line"].startswith(
        f"Context {len(chat)} → {len(trimmed['messages'])} messages · {full:,} → {sent:,} tokens"
    )


async def test_shadow_turns_simulate_enforce_prefix_reuse_without_touching_the_real_decision(
    counter, store_valves, unique
):
    valves = dict(max_context_tokens=1_500, reserve_output_tokens=0, low_watermark=0.7, **store_valves)
    enforce, shadow = make_filter(counter, **valves), make_filter(counter, mode="shadow", **valves)
    chat = chat_of(20)
    for i in range(20, 24):
        e_body, s_body = (body_of(chat, chat_id=f"{m}-{unique}", user_id="u1") for m in "es")
        await inlet_then_request(enforce, e_body, "u1", Events())
        await inlet_then_request(shadow, s_body, "u1", Events())
        counts = [re.match(DETAIL, b["metadata"]["contextwarden"]["line"]).groups() for b in (e_body, s_body)]
        assert counts[0] == counts[1]  # the same choice, turn after turn
        would = re.match(
            r"Shadow: would send (\d+) of (\d+) messages$", s_body["metadata"]["contextwarden"]["pending_line"]
        )
        recalled = re.search(r" · (\d+) recalled", s_body["metadata"]["contextwarden"]["line"])
        read = int(counts[1][1]) + (int(recalled[1]) if recalled else 0)  # the prompt's, and those quoted whole
        assert would and would[2] == counts[1][0] and int(would[1]) <= read
        chat = grow(chat, i)
    e_state = ChatState.from_bytes(await enforce.store.get(chat_state_key("u1", f"e-{unique}")))
    s_state = ChatState.from_bytes(await shadow.store.get(chat_state_key("u1", f"s-{unique}")))
    assert s_state.decision is None and s_state.shadow_decision == e_state.decision is not None
    assert e_state.shadow_decision is None


async def test_enforce_savings_survive_the_request_pass_on_the_trimmed_body(counter):
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=500)
    chat = chat_of(20)
    body = body_of(chat)
    out = await inlet_then_request(f, body, "u1", Events())
    note = body["metadata"]["contextwarden"]
    full, sent = counter.count_messages(chat, MODEL), counter.count_messages(out["messages"], MODEL)
    assert (
        note["mode"] == "enforce" and note["tokens_saved"] == full - sent > 0
    )  # not reset by the pass that had nothing to cut
    assert Decimal(note["cost_saved_usd"]) == cached_savings(full, sent, previous_prompt(chat, full))


@pytest.mark.parametrize("mode", ["enforce", "shadow"])
async def test_savings_reach_the_usage_line_and_the_ledger(counter, store_valves, unique, caplog, mode):
    caplog.set_level(logging.INFO, logger="contextwarden")
    # calibrate_counts off: a learned factor would land in the shared Redis and shrink other tests' budgets.
    f = make_filter(
        counter, max_context_tokens=1_500, reserve_output_tokens=500, mode=mode, calibrate_counts=False, **store_valves
    )
    user = f"u-{unique}"
    saved_tokens, saved_usd = 0, Decimal(0)
    for turn in range(2):
        chat = chat_of(20 + turn)
        body = body_of(chat, user_id=user, chat_id=f"c-{unique}")
        sent = counter.count_messages((await inlet_then_request(f, body, user, Events()))["messages"], MODEL)
        note = body["metadata"]["contextwarden"]
        saved_tokens += note["tokens_saved"]
        # After the reply the side that went out is priced as reported (1,000 prompt tokens, 400
        # cached); the other as assumed: the untrimmed chat's previous prompt cached, the would-be
        # trim a new selection (nothing cached).
        prompt, cached = (sent, 400) if mode == "enforce" else (sent + note["tokens_saved"], 400)
        if mode == "enforce":
            full = prompt + note["tokens_saved"]
            saved_usd += cached_savings(full, prompt, note["cache"]["untrimmed"], sent_cached=cached)
        else:
            saved_usd += cached_savings(prompt, prompt - note["tokens_saved"], cached)
        reply = reply_with_usage(prompt)
        reply["usage"]["prompt_tokens_details"] = {"cached_tokens": cached}
        out = {"model": MODEL, "messages": chat + [reply], "chat_id": f"c-{unique}"}
        await f.outlet(out, __user__={"id": user}, __metadata__=body["metadata"])
    records = usage_records(caplog)
    assert [r["mode"] for r in records] == [mode, mode]
    assert sum(r["tokens_saved"] for r in records) == saved_tokens > 0
    assert sum(Decimal(r["cost_saved_usd"]) for r in records) == saved_usd > 0
    today = datetime.now(UTC).date()
    [row] = ledger_totals([e for e in await read_ledger(f.store, since=today) if e.user == user], "user")
    real, shadow = (saved_tokens, 0) if mode == "enforce" else (0, saved_tokens)
    assert (row.counters["tokens_saved"], row.counters["shadow_tokens_saved"]) == (real, shadow)
    assert (row.counters["trimmed"], row.counters["shadow_trimmed"]) == ((2, 0) if mode == "enforce" else (0, 2))
    assert row.usd("cost_saved_picousd" if mode == "enforce" else "shadow_cost_saved_picousd") == saved_usd
    assert row.usd("shadow_cost_saved_picousd" if mode == "enforce" else "cost_saved_picousd") == 0
    assert row.counters["requests"] == 2 and row.as_dict()[
        ("" if mode == "enforce" else "shadow_") + "cost_saved_usd"
    ] == format(saved_usd.normalize(), "f")


async def test_calibrated_savings_use_the_factor(counter, unique):
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=500)
    await learn_calibration(f.store, "openai/gpt-4o", 1_000, 1_250)  # factor 1.25 from one sample
    chat = chat_of(20)
    body = body_of(chat, chat_id=f"c-{unique}")
    out = await inlet_then_request(f, body, "u1", Events())
    full, sent = counter.count_messages(chat, MODEL), counter.count_messages(out["messages"], MODEL)
    note = body["metadata"]["contextwarden"]
    # 1.25 × each count, the untrimmed chat's previous prompt (also × 1.25) at the cache-read price
    prefix = round(previous_prompt(chat, full) * 1.25)
    assert note["cache"]["untrimmed"] == prefix
    expected = estimate_savings(
        full,
        sent,
        factor=1.25,
        price=PriceBook.from_bundled().prices["openai/gpt-4o"],
        cache_before=PromptCache(prefix),
    )
    assert expected.cost_saved_usd == cached_savings(round(full * 1.25), round(sent * 1.25), prefix)
    assert note["tokens_saved"] == expected.tokens_saved and note["tokens_saved"] != full - sent
    assert Decimal(note["cost_saved_usd"]) == expected.cost_saved_usd


async def test_off_does_nothing_before_the_reply_but_records_usage(counter, caplog, unique):
    caplog.set_level(logging.INFO, logger="contextwarden")
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=500, mode="off")
    chat = chat_of(20)
    body = body_of(chat, chat_id=f"c-{unique}")
    body["stream"] = True
    before = json.dumps(body, sort_keys=True)
    events = Events()
    assert await inlet_then_request(f, body, "u1", events) is body
    assert json.dumps(body, sort_keys=True) == before and events.items == []  # not even a metadata note
    assert await f.store.get(chat_state_key("u1", f"c-{unique}")) is None
    await f.outlet(
        {"model": MODEL, "messages": chat + [reply_with_usage(4_000)], "chat_id": "c"},
        __user__={"id": "u1"},
        __metadata__=body["metadata"],
        __event_emitter__=events,
    )
    [record] = usage_records(caplog)
    assert (record["mode"], record["tokens_saved"], record["cost_saved_usd"], record["prompt_tokens"]) == (
        "off",
        None,
        None,
        4_000,
    )
    assert events.statuses == ["4,000 tokens in · 10 out · $0.010"]  # 4,000 × $2.50/M + 10 × $10/M = $0.0101
    [row] = ledger_totals(await read_ledger(f.store), "user")
    assert row.counters["requests"] == 1 and row.counters["trimmed"] == row.counters["shadow_trimmed"] == 0


async def test_a_bad_mode_is_named_and_fails_open_to_shadow(counter, caplog):
    caplog.set_level(logging.WARNING, logger="contextwarden")
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=500, mode="enforced")
    chat = chat_of(20)
    body = body_of(chat)
    before = without_metadata(body)
    events = Events()
    out = await f.inlet(body, __user__={"id": "u1"}, __metadata__=body["metadata"], __event_emitter__=events)
    assert out is body and without_metadata(out) == before
    await f.request(out, __user__={"id": "u1"}, __metadata__=body["metadata"], __event_emitter__=events)
    assert (
        "contextwarden: mode must be one of enforce, shadow, off; using shadow (chats are sent unchanged)"
        in events.statuses
    )
    assert body["metadata"]["contextwarden"]["pending_line"].startswith("Shadow: would send ")
    assert any("(valve mode)" in r.getMessage() for r in caplog.records)
    assert body["metadata"]["contextwarden"]["mode"] == "shadow"


def test_mode_valve_renders_as_a_select():
    from contextwarden import Filter

    schema = Filter.Valves.model_json_schema()["properties"]["mode"]
    assert schema["enum"] == ["enforce", "shadow", "off"] and schema["default"] == "enforce"


async def test_the_shadow_lines_before_count_is_what_was_really_sent_flags_and_all(counter, unique):
    """Shadow sends the chat as it came, `!pin` text in older messages included; enforce strips
    it. The line's "before" (and the savings) count the chat really sent, not the stripped one."""
    chat = chat_of(20)
    chat[3] = {**chat[3], "content": chat[3]["content"] + " !pin"}
    chat[5] = {**chat[5], "content": "!pin " + chat[5]["content"]}
    shadow = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=500, mode="shadow")
    body, events = body_of(chat, chat_id=f"s-{unique}"), Events()
    out = await inlet_then_request(shadow, body, "u1", events)
    assert out["messages"] is chat  # sent with the flags in the text
    full = counter.count_messages(chat, MODEL)
    note = body["metadata"]["contextwarden"]
    assert note["estimated_prompt_tokens"] == full
    before = re.match(DETAIL, note["line"])  # the admin's detail, logged after the reply
    assert before is not None and int(before.group(3).replace(",", "")) == full, note["line"]
    assert note["tokens_saved"] == full - int(before.group(4).replace(",", ""))


async def test_shadow_after_enforce_simulates_from_enforces_decision(counter, store_valves, unique, monkeypatch):
    """Shadow, then enforce, then shadow again on one chat: enforce's saves kept the first shadow
    stretch's `shadow_decision`, and the second stretch simulated from it, not from what was sent."""
    import contextwarden.face.trimpass as trimpass_module

    real, previous = trimpass_module.trim_messages, []

    def spy(messages, **options):
        previous.append(options["previous"])
        return real(messages, **options)

    monkeypatch.setattr(trimpass_module, "trim_messages", spy)
    store = store_of(store_valves)
    valves = dict(max_context_tokens=1_500, reserve_output_tokens=0, low_watermark=0.7)
    shadow = make_filter(counter, store=store, mode="shadow", **valves)
    enforce = make_filter(counter, store=store, **valves)
    key, chat = chat_state_key("u1", f"c-{unique}"), chat_of(20)
    for i, f in enumerate([shadow, shadow, enforce, enforce, enforce]):
        await inlet_then_request(f, body_of(chat, chat_id=f"c-{unique}", user_id="u1"), "u1", Events())
        chat = grow(chat, 20 + i, words=150)
    state = ChatState.from_bytes(await store.get(key))
    assert state.decision is not None and state.shadow_decision is None
    previous.clear()
    await inlet_then_request(shadow, body_of(chat, chat_id=f"c-{unique}", user_id="u1"), "u1", Events())
    assert previous[0] == state.decision
    await store.aclose()
