"""Prompt-cache breakpoints: who gets them, where they go (stable across reused turns, at most 4,
never below the minimum), how they are put on (text unchanged, input untouched), and the filter's
request pass: only for Claude through an OpenAI-compatible connection, never a second set, none
with the valve off; the outlet's usage line shows what was served from cache."""

from __future__ import annotations

import json
import logging
import random

from contextwarden.core.conversation import message_text
from contextwarden.core.trim import trim_messages
from contextwarden.money.cache_hints import (
    CACHE_MARKER,
    MAX_BREAKPOINTS,
    breakpoint_positions,
    breakpoint_provider,
    carried_prefix,
    has_cache_markers,
    min_cacheable_tokens,
    place_breakpoints,
    remove_breakpoints,
)

from chatgen import random_chat
from chats import frozen
from helpers import Events, body_of, chat_of, grow, make_filter, usage_records

SONNET = "anthropic/claude-sonnet-4.5"
OPENROUTER_SONNET = {
    "id": SONNET,
    "owned_by": "openai",
    "openai": {"id": SONNET},
    "connection_type": "external",
    "urlIdx": 0,
}
GPT4O = {"id": "gpt-4o", "owned_by": "openai", "openai": {"id": "gpt-4o"}, "connection_type": "external", "urlIdx": 0}


def marked_positions(messages: list[dict]) -> list[int]:
    return [
        i
        for i, m in enumerate(messages)
        if isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and "cache_control" in p for p in m["content"])
    ]


def marker_count(messages: list[dict]) -> int:
    return sum(
        1
        for m in messages
        if isinstance(m.get("content"), list)
        for p in m["content"]
        if isinstance(p, dict) and "cache_control" in p
    )


# ---- who ------------------------------------------------------------------------------------


def test_only_claude_named_anthropic_on_an_openai_compatible_connection():
    assert breakpoint_provider(SONNET, SONNET, OPENROUTER_SONNET) == "anthropic"
    assert breakpoint_provider("openai/gpt-4o", "openai/gpt-4o", GPT4O) is None  # automatic caching
    assert breakpoint_provider("gpt-4o", "openai/gpt-4o", GPT4O) is None
    assert breakpoint_provider("google/gemini-2.5-pro", "google/gemini-2.5-pro", GPT4O) is None  # implicit cache
    assert breakpoint_provider(SONNET, SONNET, None) is None  # unknown connection: do nothing
    assert breakpoint_provider(SONNET, SONNET, {**OPENROUTER_SONNET, "pipe": {"type": "pipe"}}) is None
    assert breakpoint_provider(SONNET, SONNET, {"id": SONNET, "owned_by": "ollama", "ollama": {}}) is None
    direct = {
        "id": "claude-sonnet-4-5",
        "owned_by": "openai",
        "openai": {"id": "claude-sonnet-4-5", "owned_by": "anthropic"},
    }
    assert (
        breakpoint_provider("claude-sonnet-4-5", SONNET, direct) is None
    )  # Anthropic's OpenAI-compatible endpoint: unsure
    assert (
        breakpoint_provider("claude-sonnet-4-5", SONNET, {**GPT4O, "id": "claude-sonnet-4-5"}) is None
    )  # bare id, unknown proxy


def test_minimum_cacheable_sizes():
    assert min_cacheable_tokens(SONNET) == 1_024
    assert min_cacheable_tokens("anthropic/claude-opus-4.1") == 1_024
    assert min_cacheable_tokens("anthropic/claude-haiku-4.5") == 4_096
    assert min_cacheable_tokens("anthropic/claude-opus-4.5") == 4_096
    assert min_cacheable_tokens("anthropic/claude-3-haiku") == 2_048
    assert min_cacheable_tokens("anthropic/claude-sonnet-9") == 4_096  # not a family we know: the largest minimum
    assert min_cacheable_tokens("anthropic/claude-fable-5") == 4_096  # unknown Claude: the largest minimum
    assert min_cacheable_tokens("openai/gpt-4o") == 1_024


# ---- where ----------------------------------------------------------------------------------


def long_chat(turns: int) -> list[dict]:
    return chat_of(turns, system="You are helpful. " + "Rules apply. " * 400)  # a system prompt over 1,024 tokens


def test_positions_stable_across_reused_turns(counter):
    """While the prefix holds, the message marked last on one turn is marked again on the next
    (as the previous turn's end), so each turn reads what the last one wrote."""
    chat, previous, last_marked = long_chat(30), None, None
    reused = 0
    for i in range(30, 36):
        # recall_share=0: a recall block moves the carried prefix's end each turn, and whether the
        # last turn's mark is marked again then depends on the spacing (not yet looked into).
        result = trim_messages(
            chat, max_tokens=6_000, model="gpt-4o", token_counter=counter, previous=previous, recall_share=0
        )
        sent = result.messages
        positions = breakpoint_positions(sent, counter.count_each(sent), carried_prefix(result), 1_024)
        assert len(positions) <= MAX_BREAKPOINTS and positions[0] == 0  # the system prompt
        marked = [sent[p] for p in positions]
        if result.reused:
            reused += 1
            assert any(m is last_marked for m in marked)  # the same message, marked again
        assert (
            marked[-1] is sent[carried_prefix(result) - 1]
        )  # the end of the carried prefix (a recall block and its question after it)
        last_marked, previous = marked[-1], result.decision
        chat = grow(chat, i)
    assert reused >= 3


def test_at_most_four_and_never_below_the_minimum(counter):
    rng, found = random.Random(20), 0
    for _ in range(200):
        chat = random_chat(rng, rng.randint(2, 80), system_words=rng.choice([0, 50, 1_500]))
        costs = counter.count_each(chat)
        for carried in (0, len(chat) // 2, len(chat)):
            positions = breakpoint_positions(chat, costs, carried, 1_024)
            assert len(positions) <= MAX_BREAKPOINTS and list(positions) == sorted(set(positions))
            assert all(sum(costs[: p + 1]) >= 1_024 and p < carried for p in positions)
            found += len(positions)
    assert found > 100
    short = chat_of(3)
    assert breakpoint_positions(short, counter.count_each(short), len(short), 1_024) == ()  # under 1,024: none
    chat = long_chat(3)
    assert breakpoint_positions(chat, counter.count_each(chat), len(chat), 100_000) == ()


def test_markers_go_on_copies_and_leave_the_text_unchanged():
    chat = [
        {"role": "system", "content": "S"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "data:,"}}],
        },
        {"role": "user", "content": "q"},
    ]
    before = frozen(chat)
    out, undo = place_breakpoints(chat, (0, 1, 2))
    assert frozen(chat) == before  # the input is not changed
    assert out[0]["content"] == [{"type": "text", "text": "S", "cache_control": CACHE_MARKER}]
    assert out[1]["content"][0] == {"type": "text", "text": "a", "cache_control": CACHE_MARKER}  # the last text part
    assert [message_text(m) for m in out] == [message_text(m) for m in chat]
    assert has_cache_markers(out) and not has_cache_markers(chat) and marker_count(out) == 3
    assert remove_breakpoints(out, undo) == chat  # undone exactly (strings are strings again)
    foreign = [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}]}]
    assert remove_breakpoints(foreign, undo) == foreign  # another's marker stays


# ---- the filter -----------------------------------------------------------------------------


async def two_passes(f, chat, model=SONNET, info=OPENROUTER_SONNET, chat_id="c1") -> tuple[dict, dict]:
    body = body_of(chat, model=model, chat_id=chat_id)
    user = {"id": "u1"}
    first = await f.inlet(body, __user__=user, __metadata__=body["metadata"], __model__=info)
    second = await f.request(first, __user__=user, __metadata__=first["metadata"], __model__=info)
    return first, second


async def test_request_pass_marks_claude_once_and_only_there(counter):
    f = make_filter(counter, max_context_tokens=8_000, reserve_output_tokens=1_000, openrouter_pricing=False)
    chat = long_chat(30)
    before = frozen(chat)
    first, second = await two_passes(f, chat)
    assert not has_cache_markers(first["messages"])  # inlet: never (request follows and may trim again)
    assert frozen(chat) == before
    positions = marked_positions(second["messages"])
    assert positions[0] == 0 and positions[-1] == len(second["messages"]) - 1 and 2 <= len(positions) <= 3
    assert [message_text(m) for m in second["messages"]] == [message_text(m) for m in first["messages"]]
    # Open WebUI calls request again before each call of a tool loop, on what the last pass returned:
    again = await f.request(second, __user__={"id": "u1"}, __metadata__=second["metadata"], __model__=OPENROUTER_SONNET)
    assert marker_count(again["messages"]) == marker_count(second["messages"])  # never a second set
    assert json.dumps(again["messages"], sort_keys=True) == json.dumps(second["messages"], sort_keys=True)


async def test_none_for_gpt4o_none_when_off_none_with_foreign_markers(counter):
    chat = long_chat(30)
    f = make_filter(counter, max_context_tokens=8_000, reserve_output_tokens=1_000, openrouter_pricing=False)
    _, out = await two_passes(f, chat, model="gpt-4o", info=GPT4O, chat_id="c2")
    assert not has_cache_markers(out["messages"])
    off = make_filter(
        counter,
        max_context_tokens=8_000,
        reserve_output_tokens=1_000,
        openrouter_pricing=False,
        prompt_cache_hints="off",
    )
    _, out = await two_passes(off, chat, chat_id="c3")
    assert not has_cache_markers(out["messages"])
    theirs = [
        *chat[:-1],
        {"role": "user", "content": [{"type": "text", "text": "What now?", "cache_control": {"type": "ephemeral"}}]},
    ]
    _, out = await two_passes(f, theirs, chat_id="c4")
    assert marker_count(out["messages"]) == 1  # the caller's own, nothing added
    shadow = make_filter(
        counter, max_context_tokens=8_000, reserve_output_tokens=1_000, openrouter_pricing=False, mode="shadow"
    )
    _, out = await two_passes(shadow, chat, chat_id="c5")
    assert out["messages"] is chat  # shadow sends the body as it came


async def test_bad_valve_value_is_named_and_auto_used(counter):
    f = make_filter(
        counter,
        max_context_tokens=8_000,
        reserve_output_tokens=1_000,
        openrouter_pricing=False,
        prompt_cache_hints="sometimes",
    )
    events = Events()
    body = body_of(long_chat(30), model=SONNET)
    hooks = {
        "__user__": {"id": "u1"},
        "__metadata__": body["metadata"],
        "__model__": OPENROUTER_SONNET,
        "__event_emitter__": events,
    }
    out = await f.request(await f.inlet(body, **hooks), **hooks)
    assert (
        sum("prompt_cache_hints must be one of auto, off; using auto" in s for s in events.statuses) == 1
    )  # once a turn
    assert "sometimes" not in " ".join(events.statuses)  # valve values are never echoed
    assert has_cache_markers(out["messages"])


async def test_outlet_shows_cached_tokens_and_learns_that_a_model_does_not_cache(counter):
    """What a model's cache serves is learned from turns the filter started (inlet), as their
    stream reported it (the outlet's usage is the client's to write)."""
    f = make_filter(counter, max_context_tokens=8_000, reserve_output_tokens=1_000, openrouter_pricing=False)
    events = Events()
    reply = {
        "role": "assistant",
        "content": "ok",
        "usage": {"prompt_tokens": 9_000, "completion_tokens": 20, "prompt_tokens_details": {"cached_tokens": 8_120}},
    }

    async def turn(model: str, reply: dict, events: Events | None = None) -> None:
        question, metadata = [{"role": "user", "content": "q"}], {}
        await f.inlet({"model": model, "messages": question}, __user__={"id": "u1"}, __metadata__=metadata)
        await f.stream({"id": "c1", "choices": [], "usage": reply["usage"]}, __metadata__=metadata)
        await f.outlet(
            {"model": model, "messages": [*question, reply]},
            __user__={"id": "u1"},
            __metadata__=metadata,
            __event_emitter__=events,
        )

    await turn(SONNET, reply, events)
    assert events.statuses[-1].startswith("Whole chat sent · 9,000 tokens in (8,120 cached) · 20 out · $")
    from contextwarden.money.cache_stats import load_cache_stats

    assert (await load_cache_stats(f.store, SONNET)).caches() is True
    for _ in range(3):
        await turn("openai/gpt-4.1", {**reply, "usage": {"prompt_tokens": 9_000, "completion_tokens": 20}})
    assert (await load_cache_stats(f.store, "openai/gpt-4.1")).caches() is False


async def test_a_connection_prefix_is_removed_before_deciding(counter):
    f = make_filter(
        counter,
        max_context_tokens=8_000,
        reserve_output_tokens=1_000,
        openrouter_pricing=False,
        connection_prefixes="openrouter",
    )
    prefixed = "openrouter." + SONNET
    _, out = await two_passes(
        f, long_chat(30), model=prefixed, info={**OPENROUTER_SONNET, "id": prefixed}, chat_id="c6"
    )
    assert marked_positions(out["messages"])


async def test_savings_follow_what_the_model_was_learned_to_do(counter, caplog):
    """The same trimmed reply: priced with the untrimmed chat's previous prompt cached while
    gpt-4.1 is expected to cache; priced uncached once three replies over the minimum had none."""
    from decimal import Decimal

    from contextwarden.money.cache_stats import CacheStats, save_cache_stats

    model = "openai/gpt-4.1"  # $2.00/M input, $0.50/M cached

    caplog.set_level(logging.INFO, logger="contextwarden")

    async def saved(f) -> Decimal:
        note = {
            "mode": "enforce",
            "tokens_saved": 18_000,
            "cache": {"untrimmed": 25_000, "trimmed": 0, "caches": True, "minimum": 1_024},
        }
        reply = {"role": "assistant", "content": "ok", "usage": {"prompt_tokens": 8_000, "completion_tokens": 20}}
        caplog.clear()
        await f.outlet(
            {"model": model, "messages": [{"role": "user", "content": "q"}, reply]},
            __user__={"id": "u1"},
            __metadata__={"contextwarden": note},
        )
        [record] = usage_records(caplog)  # the admin's: the status line no longer carries savings
        return Decimal(record["cost_saved_usd"])

    f = make_filter(counter, openrouter_pricing=False)
    # untrimmed: 1,000 × $2/M + 25,000 × $0.5/M = $0.0145; sent: 8,000 × $2/M = $0.016 → −$0.0015
    assert await saved(f) == Decimal("-0.0015")
    f = make_filter(counter, openrouter_pricing=False)
    await save_cache_stats(f.store, model, CacheStats(3, 0))
    assert await saved(f) == Decimal("0.036")  # 18,000 × $2/M
