"""The usage ledger: exact Decimal money, totals by user / model / day, and Redis shared by
several Filter instances adding up exactly."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import pytest
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st

from contextwarden import Filter
from contextwarden.money.ledger import (
    LEDGER_FIELDS,
    ledger_totals,
    picodollars_to_usd,
    read_ledger,
    record_reply,
    usd_to_picodollars,
)
from contextwarden.state.store import KEY_PREFIX, MemoryStore, open_store

from helpers import Events, usage_records

D = Decimal
DAY = date(2026, 8, 19)


@given(st.decimals(min_value=0, max_value=10**6, places=12, allow_nan=False, allow_infinity=False))
def test_picodollars_round_trip_exactly(amount):
    assert picodollars_to_usd(usd_to_picodollars(amount)) == amount


def test_picodollars_round_half_even_below_resolution():
    assert usd_to_picodollars(D("0.0000000000005")) == 0
    assert usd_to_picodollars(D("0.0000000000015")) == 2
    assert picodollars_to_usd(3_100_000_000) == D("0.0031")
    assert picodollars_to_usd(0) == 0


async def _seed(store, **overrides):
    base = dict(prompt_tokens=1000, completion_tokens=100, cached_tokens=200, reasoning_tokens=10, estimated=False)
    rows = [
        ("ann", "openai/gpt-4o", D("0.0031"), DAY),
        ("ann", "openai/gpt-4o", D("0.0009225"), DAY),
        ("ann", "llama3.1:8b", D(0), DAY + timedelta(days=1)),
        ("bob", "openai/gpt-4o", None, DAY + timedelta(days=1)),
        ("bob", "anthropic/claude-sonnet-4.5", D("0.012"), DAY + timedelta(days=2)),
    ]
    for user, model, cost, day in rows:
        await record_reply(store, user=user, model=model, cost_usd=cost, day=day, **{**base, **overrides})


async def test_totals_by_user_model_day_and_since():
    store = MemoryStore()
    await _seed(store)
    await record_reply(
        store, user=None, model="x", prompt_tokens=None, completion_tokens=5, cost_usd=None, estimated=True, day=DAY
    )
    entries = await read_ledger(store)
    by_user = {r.key: r for r in ledger_totals(entries, "user")}
    assert set(by_user) == {"ann", "bob", "-"}
    assert by_user["ann"].cost_usd == D("0.0040225")  # 0.0031 + 0.0009225 + 0
    assert by_user["ann"].counters["requests"] == 3 and by_user["ann"].counters["prompt_tokens"] == 3000
    assert by_user["bob"].counters["unpriced"] == 1 and by_user["bob"].cost_usd == D("0.012")
    assert by_user["-"].counters == {
        **dict.fromkeys(LEDGER_FIELDS, 0),
        "requests": 1,
        "completion_tokens": 5,
        "estimated": 1,
        "unpriced": 1,
    }
    by_model = ledger_totals(entries, "model")
    assert [r.key for r in by_model][:2] == ["anthropic/claude-sonnet-4.5", "openai/gpt-4o"]  # by cost
    gpt = next(r for r in by_model if r.key == "openai/gpt-4o")
    assert (
        gpt.counters["requests"] == 3
        and gpt.counters["cached_tokens"] == 600
        and gpt.counters["reasoning_tokens"] == 30
    )
    by_day = ledger_totals(entries, "day")
    assert [r.key for r in by_day] == ["2026-08-19", "2026-08-20", "2026-08-21"]
    since = ledger_totals(await read_ledger(store, since=DAY + timedelta(days=1)), "day")
    assert [(r.key, r.counters["requests"]) for r in since] == [("2026-08-20", 2), ("2026-08-21", 1)]
    assert by_model[0].as_dict()["cost_usd"] == "0.012"
    with pytest.raises(ValueError, match="Supported: 'user', 'model', 'day'"):
        ledger_totals(entries, "chat")


async def test_ids_with_colons_slashes_and_globs_survive_the_key():
    store = MemoryStore()
    await record_reply(
        store,
        user="a:b*[c]",
        model="ollama.llama3.1:8b/x%y",
        prompt_tokens=1,
        completion_tokens=1,
        cost_usd=D(0),
        estimated=False,
        day=DAY,
    )
    [entry] = await read_ledger(store)
    assert (entry.user, entry.model, entry.day) == ("a:b*[c]", "ollama.llama3.1:8b/x%y", DAY)


def _filter(redis_url=None, **valves):
    f = Filter()
    f.valves = f.Valves(redis_url=redis_url or "", openrouter_pricing=False, **valves)
    return f


def _reply_body(prompt, completion, model="gpt-4o", **usage):
    reply = {
        "role": "assistant",
        "content": "ok",
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, **usage},
    }
    return {"model": model, "messages": [{"role": "user", "content": "q"}, reply], "chat_id": "c"}


async def test_outlet_records_in_process(unique):
    f = _filter()
    for _ in range(3):
        await f.outlet(_reply_body(1000, 100, prompt_tokens_details={"cached_tokens": 400}), __user__={"id": unique})
    [row] = ledger_totals(await read_ledger(f.store), "user")
    # each: 600 x 2.5e-6 + 400 x 1.25e-6 + 100 x 1e-5 = 0.0015 + 0.0005 + 0.001
    assert row.cost_usd == 3 * D("0.003")
    assert (row.counters["requests"], row.counters["cached_tokens"], row.counters["estimated"]) == (3, 1200, 0)


async def test_ledger_failure_keeps_the_log_line_and_counts_once(caplog, monkeypatch, unique):
    import contextwarden.face.bookkeeping as bookkeeping_module

    calls = []

    async def broken(*args, **kwargs):
        calls.append(kwargs)
        raise ConnectionError("redis went away")

    monkeypatch.setattr(bookkeeping_module, "record_reply", broken)
    caplog.set_level(logging.INFO, logger="contextwarden")
    f = _filter()
    events = Events()
    body = _reply_body(10, 2)
    assert await f.outlet(body, __user__={"id": unique}, __event_emitter__=events) is body
    assert len(usage_records(caplog)) == 1 and len(calls) == 1  # logged once, tried once
    assert any("not added to the usage ledger (ConnectionError)" in r.getMessage() for r in caplog.records)
    assert events.statuses == ["10 tokens in · 2 out · <$0.0001"]


@pytest.mark.redis
async def test_two_filters_sharing_redis_add_up_exactly(redis_url, unique):
    workers = [_filter(redis_url), _filter(redis_url)]
    per_worker = 60

    async def replies(f, n):
        for i in range(n):
            body = _reply_body(1000 + i, 7, model="openrouter.openai/gpt-4o", cost="0.000123456789")
            await f.outlet(body, __user__={"id": unique})

    await asyncio.gather(*(replies(f, per_worker) for f in workers))
    store = workers[0].store
    today = datetime.now(UTC).date()
    mine = [e for e in await read_ledger(store, since=today) if e.user == unique]
    [row] = ledger_totals(mine, "model")
    assert row.key == "openai/gpt-4o"  # the resolved id, not the connection-prefixed one
    assert row.counters["requests"] == 2 * per_worker
    assert row.counters["prompt_tokens"] == 2 * sum(1000 + i for i in range(per_worker))
    assert row.cost_usd == 2 * per_worker * D("0.000123456789")  # provider cost, exact
    raw = aioredis.Redis.from_url(redis_url)
    [key] = [k async for k in raw.scan_iter(match=f"{KEY_PREFIX}ledger:*:{unique}:*")]
    assert 399 * 86_400 < await raw.ttl(key) <= 400 * 86_400
    await raw.aclose()
    for f in workers:
        await f.store.aclose()


@pytest.mark.redis
async def test_retention_valve_sets_the_expiry(redis_url, unique):
    f = _filter(redis_url, ledger_retention_days=3)
    await f.outlet(_reply_body(5, 5), __user__={"id": unique})
    raw = aioredis.Redis.from_url(redis_url)
    [key] = [k async for k in raw.scan_iter(match=f"{KEY_PREFIX}ledger:*:{unique}:*")]
    assert 2 * 86_400 < await raw.ttl(key) <= 3 * 86_400
    await raw.aclose()
    await f.store.aclose()


@pytest.mark.redis
async def test_decimal_costs_round_trip_through_redis(redis_url, unique):
    store = open_store(redis_url)
    costs = [D("0.000000000001"), D("0.0031"), D("1.234567890123"), D("0.00000375")]
    for cost in costs:
        await record_reply(
            store,
            user=unique,
            model="m:1",
            prompt_tokens=1,
            completion_tokens=1,
            cost_usd=cost,
            estimated=False,
            day=DAY,
            retention_days=1,
        )
    [entry] = [e for e in await read_ledger(store, since=DAY) if e.user == unique]
    assert entry.cost_usd == sum(costs) == D("1.237671640124")
    assert entry.model == "m:1" and entry.counters["requests"] == 4
    await store.aclose()
