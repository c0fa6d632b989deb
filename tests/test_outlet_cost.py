"""The outlet's cost: the usage log line per backend, the status line, stream usage requests,
calibration from real prompt tokens, and price layering (admin file > live OpenRouter > bundled).

Every expected cost is computed by hand from the per-token prices written next to it."""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import logging
import math
from decimal import Decimal

import httpx
import pytest
import respx

from contextwarden.face.filter import wants_stream_usage
from contextwarden.face.status import ESTIMATE_KEY, PART_ESTIMATE_KEY
from contextwarden.money.cache_stats import CacheStats, load_cache_stats
from contextwarden.money.calibration import (
    MAX_EFFECT,
    MIN_EFFECT,
    Calibration,
    calibrated_budget,
    load_calibration,
    save_calibration,
    update_calibration,
)
from contextwarden.money.dollars import format_usd
from contextwarden.money.ledger import read_ledger
from contextwarden.money.live_prices import DEFAULT_OPENROUTER_URL, LivePrices
from contextwarden.money.price_sources import PriceSources
from contextwarden.money.pricing import ModelPrice, PriceBook

from helpers import Events, body_of, chat_of, make_filter, usage_records
from shared_paths import load_fixture

D = Decimal
OPENAI_MODEL = {
    "id": "gpt-4o",
    "owned_by": "openai",
    "openai": {"id": "gpt-4o"},
    "connection_type": "external",
    "urlIdx": 0,
}
OLLAMA_MODEL = {
    "id": "llama3.1:8b",
    "owned_by": "ollama",
    "ollama": {"name": "llama3.1:8b"},
    "connection_type": "local",
}
LOG_KEYS = {
    "model",
    "resolved_model",
    "user_id",
    "chat_id",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "reasoning_tokens",
    "estimated",
    "estimated_prompt_tokens",
    "usage_shape",
    "cost_usd",
    "cost_source",
    "cost_note",
    "mode",
    "tokens_saved",
    "cost_saved_usd",
    "v",
}


def cost_filter(counter, **valves):
    return make_filter(counter, **{"openrouter_pricing": False, **valves})


async def outlet_once(f, caplog, model, usage=None, *, user=None, metadata=None, __model__=None, content="ok"):
    caplog.clear()
    reply = {"role": "assistant", "content": content, **({"usage": usage} if usage is not None else {})}
    body = {"model": model, "messages": [{"role": "user", "content": "Hello?"}, reply], "chat_id": "c9"}
    events = Events()
    assert (
        await f.outlet(
            body, __user__=user or {"id": "u1"}, __metadata__=metadata, __model__=__model__, __event_emitter__=events
        )
        is body
    )
    [record] = usage_records(caplog)
    assert set(record) == LOG_KEYS
    return record, events.statuses


@pytest.fixture
def logs(caplog):
    caplog.set_level(logging.INFO, logger="contextwarden")
    return caplog


# ---- one log line per backend shape ---------------------------------------------------------


async def test_openai_cached_and_reasoning(counter, logs):
    usage = {
        "prompt_tokens": 1234,
        "completion_tokens": 456,
        "total_tokens": 1690,
        "prompt_tokens_details": {"cached_tokens": 980},
        "completion_tokens_details": {"reasoning_tokens": 100},
    }
    record, statuses = await outlet_once(cost_filter(counter), logs, "gpt-4o", usage)
    # openai/gpt-4o: $2.50/M prompt, $1.25/M cached, $10/M completion (reasoning billed as completion)
    # 254 x 0.0000025 + 980 x 0.00000125 + 456 x 0.00001 = 0.000635 + 0.001225 + 0.00456
    assert record["cost_usd"] == "0.00642"
    assert (record["resolved_model"], record["cost_source"], record["cost_note"]) == (
        "openai/gpt-4o",
        "price_table",
        None,
    )
    assert (record["prompt_tokens"], record["cached_tokens"], record["reasoning_tokens"]) == (1234, 980, 100)
    assert (record["estimated"], record["usage_shape"], record["chat_id"]) == (False, "openai", "c9")
    assert statuses == ["1,234 tokens in (980 cached) · 456 out · $0.0064"]


async def test_openrouter_cost_is_the_provider_figure(counter, logs):
    f = cost_filter(counter, connection_prefixes="openrouter, azure")
    usage = {
        "prompt_tokens": 2000,
        "completion_tokens": 300,
        "cost": 0.0105,
        "is_byok": False,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    record, statuses = await outlet_once(f, logs, "openrouter.anthropic/claude-sonnet-4.5", usage)
    assert (record["cost_usd"], record["cost_source"]) == ("0.0105", "provider")
    assert record["resolved_model"] == "anthropic/claude-sonnet-4.5" and record["usage_shape"] == "openrouter"
    assert statuses == ["2,000 tokens in · 300 out · $0.011"]


async def test_anthropic_native_cache_reads_and_writes(counter, logs):
    usage = {
        "input_tokens": 100,
        "cache_read_input_tokens": 1000,
        "cache_creation_input_tokens": 200,
        "output_tokens": 50,
    }
    record, statuses = await outlet_once(cost_filter(counter), logs, "claude-sonnet-4-5-20250929", usage)
    # claude-sonnet-4.5: $3/M in, $0.30/M cache read, $3.75/M cache write, $15/M out
    # 100 x 0.000003 + 1000 x 0.0000003 + 200 x 0.00000375 + 50 x 0.000015 = 0.0003 + 0.0003 + 0.00075 + 0.00075
    assert D(record["cost_usd"]) == D("0.0021") and record["resolved_model"] == "anthropic/claude-sonnet-4.5"
    assert (record["prompt_tokens"], record["cached_tokens"], record["usage_shape"]) == (1300, 1000, "anthropic")
    assert statuses == ["1,300 tokens in (1,000 cached) · 50 out · $0.0021"]


async def test_ollama_unpriced_unless_listed_free(counter, logs):
    usage = {"prompt_eval_count": 50, "eval_count": 7, "total_duration": 123456789}
    record, statuses = await outlet_once(cost_filter(counter), logs, "llama3.1:8b", usage, __model__=OLLAMA_MODEL)
    assert (record["cost_usd"], record["cost_source"], record["resolved_model"]) == (None, None, None)
    assert "free_models" in record["cost_note"] and record["usage_shape"] == "ollama"
    assert statuses == ["50 tokens in · 7 out"]  # unknown price: no $ part, never $0
    record, statuses = await outlet_once(
        cost_filter(counter, free_models='["llama*", "qwen3:*"]'), logs, "llama3.1:8b", usage, __model__=OLLAMA_MODEL
    )
    assert (record["cost_usd"], record["cost_source"], record["resolved_model"]) == ("0", "price_table", "llama3.1:8b")
    assert statuses == ["50 tokens in · 7 out · $0"]


async def test_estimated_usage_is_priced_and_marked(counter, logs):
    f = cost_filter(counter)
    body = body_of(chat_of(2))
    await f.request(await f.inlet(body, __metadata__=body["metadata"]), __metadata__=body["metadata"])
    counted = body["metadata"]["contextwarden"]["estimated_prompt_tokens"]
    record, statuses = await outlet_once(f, logs, "gpt-4o", None, metadata=body["metadata"], content="Hello there.")
    completion = counter.count_text("Hello there.", "gpt-4o")
    assert (record["estimated"], record["prompt_tokens"], record["completion_tokens"]) == (True, counted, completion)
    expected = counted * D("0.0000025") + completion * D("0.00001")
    assert D(record["cost_usd"]) == expected and record["cost_source"] == "price_table"
    assert record["usage_shape"] == "estimate"
    assert statuses == [
        f"Whole chat sent · ~{counted:,} tokens in · ~{completion:,} out · ~${format_usd(expected)} · {ESTIMATE_KEY}"
    ]


async def test_a_half_valid_usage_marks_only_the_count_it_left_out(counter, logs):
    """`{"prompt_tokens": "70", "completion_tokens": "x"}`: "70" is a count `read_count` accepts
    (ASCII digits, bounded), "x" is not. Before, the line read `~70 tokens in · ~2 out · ... · ~ =
    estimated, no usage from the provider`: the reported 70 marked, and a usage said absent."""
    f = cost_filter(counter)
    record, statuses = await outlet_once(f, logs, "gpt-4o", {"prompt_tokens": "70", "completion_tokens": "x"})
    completion = counter.count_text("ok", "gpt-4o")
    assert (record["prompt_tokens"], record["completion_tokens"], record["estimated"]) == (70, completion, True)
    expected = 70 * D("0.0000025") + completion * D("0.00001")
    assert statuses == [f"70 tokens in · ~{completion:,} out · ~${format_usd(expected)} · {PART_ESTIMATE_KEY}"]
    # the ledger counts it as the line shows it: real prompt tokens, an estimated reply
    [entry] = await read_ledger(f.store)
    assert (entry.counters["prompt_tokens"], entry.counters["estimated"]) == (70, 1)


async def test_workspace_model_priced_as_its_base(counter, logs):
    usage = {"prompt_tokens": 1000, "completion_tokens": 1000}
    workspace = {"id": "my-helper", "owned_by": "openai", "info": {"base_model_id": "gpt-4.1"}}
    record, _ = await outlet_once(cost_filter(counter), logs, "my-helper", usage, __model__=workspace)
    # gpt-4.1: $2/M in, $8/M out
    assert (record["model"], record["resolved_model"], D(record["cost_usd"])) == (
        "gpt-4.1",
        "openai/gpt-4.1",
        D("0.01"),
    )


async def test_aliases_and_cost_hidden_by_user_valve(counter, logs):
    f = cost_filter(counter, model_aliases='{"corp-*": "openai/gpt-4o-mini"}')
    user = {"id": "u1", "valves": f.UserValves(show_cost=False)}
    record, statuses = await outlet_once(
        f, logs, "corp-fast", {"prompt_tokens": 10, "completion_tokens": 10}, user=user
    )
    # gpt-4o-mini: $0.15/M in, $0.60/M out
    assert record["resolved_model"] == "openai/gpt-4o-mini" and D(record["cost_usd"]) == D("0.0000075")
    assert statuses == ["10 tokens in · 10 out"]


@pytest.mark.parametrize(
    ("amount", "shown"),
    [
        ("0", "0"),
        ("0.0031", "0.0031"),
        ("0.003125", "0.0031"),
        ("0.00000004", "<0.0001"),
        ("0.0000071", "<0.0001"),
        ("0.00054", "0.0005"),
        ("0.054", "0.054"),
        ("0.5", "0.50"),
        ("1", "1.00"),
        ("1234.567", "1,234.57"),
    ],
)
def test_format_usd(amount, shown):
    assert format_usd(D(amount)) == shown


# ---- stream_options.include_usage -----------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "stream", "asked"),
    [
        (OPENAI_MODEL, True, True),
        ({**OPENAI_MODEL, "provider": "azure"}, True, True),  # 0.12 drops it itself for old api_versions
        ({"id": "ws", "owned_by": "openai", "info": {"base_model_id": "gpt-4o"}}, True, True),
        (OPENAI_MODEL, False, False),
        (OLLAMA_MODEL, True, False),
        ({"id": "x", "owned_by": "ollama"}, True, False),
        ({"id": "ws", "owned_by": "openai", "ollama": {}}, True, False),
        ({"id": "pipe.x", "owned_by": "openai", "pipe": {"type": "pipe"}}, True, False),
        ({"id": "arena", "owned_by": "arena"}, True, False),
        ({**OPENAI_MODEL, "api_type": "responses"}, True, False),
        (None, True, False),
    ],
)
async def test_include_usage_per_backend(counter, model, stream, asked):
    f = cost_filter(counter)
    body = {**body_of(chat_of(1)), "stream": stream, "stream_options": {"other": 1}}
    before = copy.deepcopy({k: v for k, v in body.items() if k != "metadata"})
    for hook in (f.inlet, f.request):
        out = await hook(body, __metadata__=body["metadata"], __model__=model)
        assert {
            k: v for k, v in body.items() if k != "metadata"
        } == before  # never mutated (metadata is the note's place)
        if asked:
            assert out["stream_options"] == {"other": 1, "include_usage": True} and out is not body
        else:
            assert out.get("stream_options") == {"other": 1}


async def test_include_usage_valve_off_and_already_set(counter):
    body = {**body_of(chat_of(1)), "stream": True}
    out = await cost_filter(counter, request_stream_usage=False).inlet(body, __model__=OPENAI_MODEL)
    assert "stream_options" not in out
    asked = {**body, "stream_options": {"include_usage": True}}
    assert not wants_stream_usage(asked, OPENAI_MODEL)
    assert await cost_filter(counter).inlet(asked, __model__=OPENAI_MODEL) is asked


# ---- calibration ------------------------------------------------------------------------------


def test_calibration_rule():
    first = update_calibration(Calibration(), 1000, 1250)
    assert first == Calibration(1.25, 1) and first.active
    assert update_calibration(first, 10, 40) is None  # tiny prompt
    assert update_calibration(first, 1000, 3000) is None  # beyond the clamp
    warm = Calibration(1.2, 5)
    assert update_calibration(warm, 1000, 1900) == Calibration(1.32, 6)  # outlier: counts as 1.5x off (1.8)
    assert update_calibration(warm, 1000, 1300) == Calibration(1.22, 6)  # EMA, alpha 0.2
    assert calibrated_budget(2000, Calibration(1.25, 3)) == 1600
    assert calibrated_budget(2000, Calibration(1.005, 3)) == 2000  # within 1%: not applied


def test_calibration_comes_back_from_a_run_of_odd_replies():
    """One user's crafted turns (each within 1.5x of the factor) drove the shared factor to ~1.95
    (effect 1.5: every user's budget a third smaller); honest replies at 1.0 were all outliers
    and ignored, so it stayed there for good (500 of them: 1.946313). Now they pull it back."""
    cal = Calibration()
    for _ in range(5):
        cal = update_calibration(cal, 1000, 1500) or cal
    for _ in range(10):
        cal = update_calibration(cal, 1000, int(min(2.0, cal.factor * 1.45) * 1000)) or cal
    assert cal.effect == 1.5
    for _ in range(40):
        cal = update_calibration(cal, 1000, 1000) or cal
    assert not cal.active and abs(cal.factor - 1.0) < 0.01
    shifted = Calibration(1.4, 50)  # the model's tokenizer changed: 0.9 is 1.56x off 1.4
    for _ in range(60):
        shifted = update_calibration(shifted, 1000, 900) or shifted
    assert abs(shifted.factor - 0.9) < 0.01


async def test_calibration_makes_real_tokens_fit_the_budget(counter):
    """A backend whose tokenizer counts 1.25x ours: the first turn overflows the real budget,
    every later turn fits it, and the status line says the factor is in use."""
    model = "anthropic/claude-sonnet-4.5"
    f = cost_filter(counter, max_context_tokens=2_500, reserve_output_tokens=500, low_watermark=1.0)
    budget, reals, details = 2_000, [], []
    for turn in range(5):
        body = body_of(chat_of(30 + turn), model=model)
        metadata = body["metadata"]
        out = await f.inlet(body, __metadata__=metadata)
        out = await f.request(out, __metadata__=metadata)
        details.append(metadata["contextwarden"]["line"])  # the admin's detail, logged after the reply
        counted = counter.count_messages(out["messages"], model)
        assert metadata["contextwarden"]["estimated_prompt_tokens"] == counted
        real = math.ceil(counted * 1.25)  # what the provider reports for what we sent
        reals.append(real)
        usage = {"prompt_tokens": real, "completion_tokens": 5}
        await stream_reply(f, metadata, usage)
        reply = {"role": "assistant", "content": "ok", "usage": usage}
        await f.outlet({"model": model, "messages": out["messages"] + [reply]}, __metadata__=metadata)
    assert reals[0] > budget  # uncalibrated: our count fitted, the real one did not
    assert all(real <= budget for real in reals[1:]), reals
    # and the budget is still used: a new selection leaves room for a later turn's recall block
    # (trim.recall_room), so about 80% of it here, where nothing is worth recalling
    assert all(real > 0.75 * budget for real in reals[1:]), reals
    assert "· calibrated ×1.25" in details[-1]
    assert "calibrated" not in details[0]
    assert (await load_calibration(f.store, model)).factor >= 1.25


async def test_calibration_skips_tool_loops_estimates_and_can_be_off(counter):
    """Started, streamed turns that still teach nothing: a tool loop (two provider calls, the
    outlet's usage summed), a backend that reported no usage, and the valve off."""
    model = "gpt-4o"
    for valves, calls in [({}, "loop"), ({}, None), ({"calibrate_counts": False}, "real")]:
        f = cost_filter(counter, **valves)
        body = body_of(chat_of(8), model=model)
        metadata = body["metadata"]
        out = await f.inlet(body, __user__={"id": "u1"}, __metadata__=metadata)
        out = await f.request(out, __user__={"id": "u1"}, __metadata__=metadata)
        real = metadata["contextwarden"]["estimated_prompt_tokens"] * 2 - 1
        usage = None
        if calls == "loop":  # the first call asks for a tool, the second answers: 3x the prompt in all
            await stream_reply(f, metadata, {"prompt_tokens": real, "completion_tokens": 5}, tool_call=True)
            await stream_reply(f, metadata, {"prompt_tokens": 2 * real, "completion_tokens": 5})
            usage = {"prompt_tokens": 2 * real, "completion_tokens": 5, "input_tokens": 3 * real, "output_tokens": 10}
        elif calls == "real":
            usage = {"prompt_tokens": real, "completion_tokens": 5}
            await stream_reply(f, metadata, usage)
        reply = {"role": "assistant", "content": "ok", **({"usage": usage} if usage else {})}
        await f.outlet(
            {"model": model, "messages": out["messages"] + [reply]}, __user__={"id": "u1"}, __metadata__=metadata
        )
        assert await load_calibration(f.store, "openai/gpt-4o") == Calibration()


async def stream_reply(f, metadata: dict, usage: dict, *, tool_call: bool = False) -> None:
    """One provider call as its stream reaches the filter's `stream` hook: a text (or tool-call)
    chunk, then the usage the backend reports on a chunk of its own (OpenAI's include_usage)."""
    stream_id = f"chatcmpl-{next(STREAM_IDS)}"
    if tool_call:
        call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "search_web", "arguments": "{}"}}
        choice = {"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": "tool_calls"}
    else:
        choice = {"index": 0, "delta": {"content": "ok"}, "finish_reason": "stop"}
    await f.stream({"id": stream_id, "choices": [choice]}, __metadata__=metadata)
    await f.stream({"id": stream_id, "choices": [], "usage": usage}, __metadata__=metadata)


STREAM_IDS = itertools.count(1)
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search_web",
            "description": "Search the web.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    }
]


async def learning_turn(
    f, chat, user: str, real_of, *, model: str, tools=None, outlet_of=None, streamed: bool = True, model_item=None
) -> dict:
    """One started turn whose backend reports `real_of(our count)` prompt tokens in the stream
    (none when not `streamed`), and whose outlet says `outlet_of(our count)` (the same by
    default: the outlet's usage is the saved chat's, its user's to write); the note.
    `model_item` is Open WebUI's `__model__` (none by default)."""
    body = body_of(chat, model=model, user_id=user, chat_id=f"c-{user}")
    if tools:
        body["tools"] = tools
    metadata = body["metadata"]
    who = {"__user__": {"id": user}, "__metadata__": metadata, "__model__": model_item}
    out = await f.inlet(body, **who)
    out = await f.request(out, **who)
    note = metadata["contextwarden"]
    counted = note["estimated_prompt_tokens"]
    if streamed:
        await stream_reply(f, metadata, {"prompt_tokens": real_of(counted), "completion_tokens": 5})
    said = (outlet_of or real_of)(counted)
    reply = {"role": "assistant", "content": "ok", "usage": {"prompt_tokens": said, "completion_tokens": 5}}
    await f.outlet({"model": model, "messages": out["messages"] + [reply]}, **who)
    return note


async def test_one_users_image_and_tool_chats_do_not_move_anothers_budget(counter):
    """We count an image 765 tokens, a provider may bill 85; tool definitions we do not count
    at all. Those turns are not comparable, so they teach the model's factor nothing."""
    model = "anthropic/claude-sonnet-4.5"
    f = cost_filter(counter, max_context_tokens=16_000, reserve_output_tokens=1_000)
    with_image = chat_of(4)[:-1] + [{"role": "user", "content": [{"type": "text", "text": "What is in it?"}, IMAGE]}]
    for _ in range(8):  # ratio about 0.6: the image billed 85, not 765
        await learning_turn(f, with_image, "ann", lambda n: n - 680, model=model)
    for _ in range(8):  # ratio 1.6: the tool definitions billed on top
        await learning_turn(f, chat_of(4), "ann", lambda n: int(n * 1.6), model=model, tools=TOOLS)
    tool_loop = chat_of(4) + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "search_web", "arguments": '{"query": "x"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "results " * 50},
    ]
    for _ in range(8):
        await learning_turn(f, tool_loop, "ann", lambda n: int(n * 1.6), model=model)
    assert await load_calibration(f.store, model) == Calibration()
    note = await learning_turn(f, chat_of(4), "bob", lambda n: n, model=model)
    assert note["budget"] == 15_000 and note["calibration"] == 1.0


@pytest.mark.parametrize("where", ["memory", "redis"])
async def test_only_the_usage_a_stream_reported_teaches_the_calibration(counter, request, unique, where):
    """An outlet's usage is the client's to write (Open WebUI 0.12.4 reads it from the saved
    chat): five started turns whose outlet claimed half the prompt we counted set the factor every
    user of the model trims with to 0.5 (effect 0.8: prompts sent up to the window by our count,
    over it for a tokenizer counting 1.2x ours). Only what the backend reported in the stream
    this worker watched teaches it; a turn with no stream report teaches nothing, nor one on a
    direct connection (its stream comes from the user's browser)."""
    valves = {} if where == "memory" else {"redis_url": request.getfixturevalue("redis_url")}
    model = f"acme/calib-{unique}"  # its own key: nothing else on the Redis moves it
    f = cost_filter(counter, max_context_tokens=16_000, reserve_output_tokens=1_000, **valves)
    half = lambda n: n // 2  # noqa: E731
    for _ in range(5):  # a non-streamed request: nothing the backend said was seen
        await learning_turn(f, chat_of(4), "mallory", half, model=model, streamed=False)
    direct = {"id": model, "owned_by": "openai", "direct": True}  # `model_item` as the request sent it
    for _ in range(5):  # streamed, but through the user's own browser: the stream says half too
        await learning_turn(f, chat_of(4), "mallory", half, model=model, model_item=direct)
    assert await load_calibration(f.store, model) == Calibration()
    for _ in range(5):  # streamed, the backend reporting our count: the outlet says half
        await learning_turn(f, chat_of(4), "mallory", lambda n: n, model=model, outlet_of=half)
    learned = await load_calibration(f.store, model)
    assert learned.samples == 5 and not learned.active, learned
    for _ in range(5):  # the backend counts 1.2x ours; the outlet still says half
        await learning_turn(f, chat_of(4), "mallory", lambda n: round(n * 1.2), model=model, outlet_of=half)
    learned = await load_calibration(f.store, model)
    assert learned.samples == 10 and learned.factor == pytest.approx(1.2 - 0.2 * 0.8**5, abs=0.01), learned
    other = cost_filter(counter, max_context_tokens=16_000, reserve_output_tokens=1_000, **valves)
    if where == "memory":
        other = f  # the factor is the process's: another worker shares it through Redis only
    note = await learning_turn(other, chat_of(4), "bob", lambda n: n, model=model)
    assert note["calibration"] == pytest.approx(learned.factor)


async def cache_turn(f, user: str, *, model: str, reported: dict | None, said: dict, model_item=None) -> None:
    """One started turn of `user` whose backend reports the usage `reported` in the stream (none
    when None), and whose outlet says `said` (the saved chat's usage, its user's to write)."""
    body = body_of(chat_of(2), model=model, user_id=user, chat_id=f"c-{user}")
    metadata = body["metadata"]
    who = {"__user__": {"id": user}, "__metadata__": metadata, "__model__": model_item}
    out = await f.request(await f.inlet(body, **who), **who)
    if reported is not None:
        await stream_reply(f, metadata, reported)
    reply = {"role": "assistant", "content": "ok", "usage": said}
    await f.outlet({"model": model, "messages": [*out["messages"], reply]}, **who)


async def savings_shown(f, model: str, chat_id: str) -> tuple[bool, str]:
    """Whether a new chat's trim takes `model` to cache, and the savings it estimates (bob's)."""
    body = body_of(chat_of(30), model=model, user_id="bob", chat_id=chat_id)
    who = {"__user__": {"id": "bob"}, "__metadata__": body["metadata"]}
    await f.request(await f.inlet(body, **who), **who)
    note = body["metadata"]["contextwarden"]
    return note["cache"]["caches"], note["cost_saved_usd"]


@pytest.mark.parametrize("where", ["memory", "redis"])
async def test_only_the_usage_a_stream_reported_teaches_the_cache_statistics(counter, request, where):
    """The cache statistics say for every user of a model whether its provider's cache serves
    anything, and so how each user's savings are priced. Ten started turns whose outlet claimed
    999,999 cached tokens (the saved chat's usage, its user's to write) made Claude without
    breakpoints a model that caches, for everyone (CacheStats(10, 10) on the old code): bob's next
    chat was estimated to save -$0.0041805 (the untrimmed chat cheaper) instead of $0.016128.
    Only the usage the backend reported in the stream this worker watched teaches them; not a
    direct connection's stream (the user's browser relays it)."""
    valves = {} if where == "memory" else {"redis_url": request.getfixturevalue("redis_url")}
    valves = {**valves, "max_context_tokens": 4_000, "reserve_output_tokens": 1_000, "calibrate_counts": False}
    model = "anthropic/claude-sonnet-4.5"  # no breakpoints asked for: not expected to cache
    f = cost_filter(counter, **valves)
    other = f if where == "memory" else cost_filter(counter, **valves)  # another worker, through Redis
    before = await savings_shown(other, model, "c-bob-1")
    assert before == (False, "0.016128")
    plain = {"prompt_tokens": 5_000, "completion_tokens": 5}
    forged = {**plain, "prompt_tokens_details": {"cached_tokens": 999_999}}
    for _ in range(10):  # not streamed: only the outlet's usage says anything
        await cache_turn(f, "mallory", model=model, reported=None, said=forged)
    direct = {"id": model, "owned_by": "openai", "direct": True}  # `model_item` as the request sent it
    for _ in range(5):  # streamed through the user's own browser: its report is the client's too
        await cache_turn(f, "mallory", model=model, reported=forged, said=forged, model_item=direct)
    assert await load_cache_stats(f.store, model) == CacheStats()
    assert await savings_shown(other, model, "c-bob-2") == before
    for _ in range(5):  # the backend reported no cached tokens; the outlet says 999,999
        await cache_turn(f, "mallory", model=model, reported=plain, said=forged)
    assert await load_cache_stats(f.store, model) == CacheStats(5, 0)
    cached = {**plain, "prompt_tokens_details": {"cached_tokens": 4_000}}
    await cache_turn(f, "alice", model=model, reported=cached, said=plain)  # the outlet says none
    assert await load_cache_stats(f.store, model) == CacheStats(6, 1)
    assert (await savings_shown(other, model, "c-bob-3"))[0] is True  # a real hit moves it for all


@pytest.mark.parametrize("factor", [0.5, 0.6, 0.9, 1.6, 2.0])
@pytest.mark.parametrize("user_budget", [0, 8_000])
@pytest.mark.parametrize("by_flag", [False, True])
async def test_a_calibrated_budget_stays_within_the_window_and_the_bounded_effect(
    counter, factor, user_budget, by_flag
):
    """Whatever factor is stored, its effect is within [MIN_EFFECT, MAX_EFFECT] and the budget
    never exceeds the window less the reserve; a user's `!budget=N` is calibrated as the valve is
    (at x1.6 it was 8,000 of our tokens: 12,000 of the provider's)."""
    model = "anthropic/claude-sonnet-4.5"
    f = cost_filter(counter, max_context_tokens=16_000, reserve_output_tokens=1_000)
    await save_calibration(f.store, model, Calibration(factor, 20))
    chat = chat_of(4)
    if by_flag and user_budget:
        chat[-1] = {"role": "user", "content": f"!budget={user_budget} What now?"}
    body = body_of(chat, model=model, user_id="bob", chat_id="c-bob")
    user = {"id": "bob", "valves": f.UserValves(max_context_tokens=0 if by_flag else user_budget)}
    await f.request(body, __user__=user, __metadata__=body["metadata"])
    budget = body["metadata"]["contextwarden"]["budget"]
    effect = min(MAX_EFFECT, max(MIN_EFFECT, factor))
    assert budget == min(15_000, int((user_budget or 15_000) / effect))


# ---- price layering ---------------------------------------------------------------------------


def _price_file(tmp_path, prices: dict[str, ModelPrice]):
    path = tmp_path / "pricing.json"
    path.write_text(PriceBook(prices, source="admin").to_json())
    return str(path)


async def test_pricing_file_over_bundled(counter, logs, tmp_path):
    path = _price_file(
        tmp_path,
        {
            "acme/private-1": ModelPrice(D("0.000001"), D("0.000004")),
            "openai/gpt-4o": ModelPrice(D("0.000003"), D("0.000012")),
        },
    )
    f = cost_filter(counter, pricing_file=path)
    usage = {"prompt_tokens": 1000, "completion_tokens": 100}
    record, _ = await outlet_once(f, logs, "acme/private-1", usage)
    assert (record["resolved_model"], D(record["cost_usd"])) == ("acme/private-1", D("0.0014"))
    record, _ = await outlet_once(f, logs, "gpt-4o", usage)
    assert D(record["cost_usd"]) == D("0.0042")  # 1000 x 3e-6 + 100 x 1.2e-5: the admin's price
    record, _ = await outlet_once(f, logs, "gpt-4.1", usage)
    assert D(record["cost_usd"]) == D("0.0028")  # not in the file: bundled 2e-6 / 8e-6


async def test_unreadable_pricing_file_is_named_and_bundled_prices_go_on(counter, logs, tmp_path):
    f = cost_filter(counter, pricing_file=str(tmp_path / "missing.json"))
    record, statuses = await outlet_once(f, logs, "gpt-4o", {"prompt_tokens": 1000, "completion_tokens": 100})
    assert D(record["cost_usd"]) == D("0.0035")
    assert any("pricing_file" in s and "cannot be read" in s for s in statuses)
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    f.valves = f.Valves(openrouter_pricing=False, pricing_file=str(bad))
    _, statuses = await outlet_once(f, logs, "gpt-4o", {"prompt_tokens": 1, "completion_tokens": 1})
    assert any("pricing_file" in s and "not valid JSON" in s for s in statuses)


def _live_payload() -> dict:
    payload = load_fixture("openrouter_models_sample.json")
    for entry in payload["data"]:
        if entry["id"] == "openai/gpt-4o":
            entry["pricing"] = {**entry["pricing"], "prompt": "0.000005"}  # twice the bundled price
    return payload


def live_prices(store):
    """Price sources with the real LivePrices holder (its client goes to respx's mock)."""
    return PriceSources(store, live_factory=LivePrices)


async def test_live_openrouter_over_bundled_and_file_over_live(counter, logs, tmp_path):
    usage = {"prompt_tokens": 1000, "completion_tokens": 100}
    with respx.mock(assert_all_called=True) as router:
        route = router.get(DEFAULT_OPENROUTER_URL).mock(return_value=httpx.Response(200, json=_live_payload()))
        f = cost_filter(counter, openrouter_pricing=True, prices=live_prices)
        record, _ = await outlet_once(f, logs, "gpt-4o", usage)
        assert D(record["cost_usd"]) == D("0.0035")  # bundled while the fetch runs in the background
        await f.prices.live.settled()
        record, _ = await outlet_once(f, logs, "gpt-4o", usage)
        assert D(record["cost_usd"]) == D("0.006")  # live: 1000 x 5e-6 + 100 x 1e-5
        record, _ = await outlet_once(f, logs, "gpt-4.1", usage)
        assert D(record["cost_usd"]) == D("0.0028")  # same in both
        f.valves = f.Valves(
            openrouter_pricing=True,
            pricing_file=_price_file(tmp_path, {"openai/gpt-4o": ModelPrice(D("0.000001"), D("0.000001"))}),
        )
        record, _ = await outlet_once(f, logs, "gpt-4o", usage)
        assert D(record["cost_usd"]) == D("0.0011")  # the admin's file wins
        assert route.call_count == 1


async def test_openrouter_off_never_fetches(counter, logs):
    with respx.mock(assert_all_called=False) as router:
        route = router.get(DEFAULT_OPENROUTER_URL).mock(return_value=httpx.Response(200, json=_live_payload()))
        f = cost_filter(counter, openrouter_pricing=False, prices=live_prices)
        await outlet_once(f, logs, "gpt-4o", {"prompt_tokens": 1, "completion_tokens": 1})
        await asyncio.sleep(0)
        assert route.call_count == 0 and f.prices.live is None


@pytest.mark.redis
async def test_workers_share_one_fetch_through_redis(counter, logs, redis_url, unique):
    usage = {"prompt_tokens": 1000, "completion_tokens": 100}
    with respx.mock(assert_all_called=True) as router:
        route = router.get(DEFAULT_OPENROUTER_URL).mock(return_value=httpx.Response(200, json=_live_payload()))
        workers = []
        for _ in range(2):
            f = cost_filter(
                counter,
                openrouter_pricing=True,
                redis_url=redis_url,
                calibrate_counts=False,
                prices=lambda store: PriceSources(store, live_factory=LivePrices, shared_key=f"prices:test:{unique}"),
            )
            workers.append(f)
        await asyncio.gather(*(outlet_once(f, logs, "gpt-4o", usage, user={"id": unique}) for f in workers))
        await asyncio.gather(*(f.prices.live.settled() for f in workers))
        assert route.call_count == 1  # one worker fetched, the other took the shared table
        for f in workers:
            record, _ = await outlet_once(f, logs, "gpt-4o", usage, user={"id": unique})
            assert D(record["cost_usd"]) == D("0.006")
        shared = await workers[0].store.get(f"prices:test:{unique}")
        assert json.loads(shared)["models"]["openai/gpt-4o"]["prompt"] == "0.000005"
        for f in workers:
            await f.store.delete(f"prices:test:{unique}")
            await f.store.aclose()
