"""Hostile numbers never stall a worker or tear the ledger (issue 13, items 1, 5, 7 and the
money part of "wrong numbers"): what the outlet believes is bounded, every money formatter is
total, a Redis data error is not an outage and writes nothing, and a bad `pricing_file` is
named while the bundled prices go on."""

from __future__ import annotations

import json
import logging
import os
import threading
from decimal import Decimal

import httpx
import pytest
import redis.asyncio as aioredis
import respx

import contextwarden.money.pricing as pricing_module
from contextwarden.errors import PricingError
from contextwarden.face.status import usage_status
from contextwarden.money.dollars import format_usd
from contextwarden.money.ledger import read_ledger, record_reply, usd_to_picodollars
from contextwarden.money.live_prices import (
    DEFAULT_OPENROUTER_URL,
    MIN_PRICING_TTL_HOURS,
    LivePrices,
    fetch_openrouter_prices,
)
from contextwarden.money.price_sources import PriceSources
from contextwarden.money.pricing import (
    FREE_PRICE,
    MAX_PRICE_FILE_BYTES,
    ModelPrice,
    PriceBook,
)
from contextwarden.money.usage import (
    MAX_REPLY_COST_USD,
    MAX_TOKEN_COUNT,
    Cost,
    Usage,
    compute_cost,
    read_usage,
)
from contextwarden.state.store import KEY_PREFIX, MemoryStore, RedisStore

from helpers import Events, make_filter, usage_records

D = Decimal
GPT4O = ModelPrice(D("0.0000025"), D("0.00001"), cache_read=D("0.00000125"))

# Token counts no backend sends: each must be read as unknown, never trusted or crashed on.
HOSTILE_COUNTS = [
    True,
    False,
    -1,
    -(10**20),
    10**20,
    MAX_TOKEN_COUNT + 1,
    1e20,
    1.5,
    float("nan"),
    float("inf"),
    float("-inf"),
    "²",
    "١٢",
    "1_000",
    " 1e3",
    "0x10",
    "-5",
    "9" * 100_000,
    "",
    {"n": 1},
    [1],
    object(),
]
# Costs no reply can have: unknown (the turn is priced from its tokens instead).
HOSTILE_COSTS = [
    "1e999000",
    "1E999999999",
    1e30,
    "1e30",
    str(MAX_REPLY_COST_USD + 1),
    float(MAX_REPLY_COST_USD) * 2,
    10**400,
    "NaN",
    "sNaN",
    "Infinity",
    "-Infinity",
    float("nan"),
    float("inf"),
    "-0.5",
    -1,
    True,
    "1" * 100_000,
    "0." + "1" * 100_000,
    "1e-999000",
    "١",
    "0x10",
    "1_0",
    {"usd": 1},
    [1],
]


# -- item 1: counts and costs the outlet believes ----------------------------------------------


@pytest.mark.parametrize("raw", HOSTILE_COUNTS, ids=lambda r: f"{type(r).__name__}:{str(r)[:12]}")
def test_hostile_token_counts_are_unknown_and_noted_briefly(raw):
    rejected: list[str] = []
    usage = read_usage({"role": "assistant", "usage": {"prompt_tokens": raw, "completion_tokens": 5}}, rejected)
    assert usage is not None and usage.prompt_tokens is None and usage.completion_tokens == 5
    assert rejected and all(note.startswith("prompt_tokens") and len(note) < 60 for note in rejected)
    assert all(str(raw)[:6] not in note for note in rejected if len(str(raw)) > 3)  # no value echoed


@pytest.mark.parametrize("raw", [0, 12, "12", 4.0, MAX_TOKEN_COUNT, float(MAX_TOKEN_COUNT)])
def test_plain_token_counts_are_read(raw):
    rejected: list[str] = []
    usage = read_usage({"usage": {"prompt_tokens": raw, "completion_tokens": 1}}, rejected)
    assert usage.prompt_tokens == int(raw) and rejected == []


@pytest.mark.parametrize("raw", HOSTILE_COSTS, ids=lambda r: f"{type(r).__name__}:{str(r)[:12]}")
def test_hostile_costs_are_unknown_and_priced_from_tokens(raw):
    rejected: list[str] = []
    usage = read_usage({"usage": {"prompt_tokens": 1000, "completion_tokens": 100, "cost": raw}}, rejected)
    assert usage.provider_cost is None
    assert len(rejected) == 1 and rejected[0].startswith("cost") and len(rejected[0]) < 60
    cost = compute_cost(usage, GPT4O)
    assert (cost.cost_usd, cost.cost_source) == (D("0.0035"), "price_table")


def test_byok_upstream_cost_is_bounded_too():
    usage = read_usage(
        {
            "usage": {
                "prompt_tokens": 1,
                "completion_tokens": 1,
                "cost": "0.5",
                "is_byok": True,
                "cost_details": {"upstream_inference_cost": "1e999000"},
            }
        }
    )
    assert usage.provider_cost is None


@pytest.mark.parametrize("cost", ["0", "0.0105", 0.0105, 3, str(MAX_REPLY_COST_USD)])
def test_plausible_costs_are_believed(cost):
    usage = read_usage({"usage": {"prompt_tokens": 1, "completion_tokens": 1, "cost": cost}})
    assert usage.provider_cost == D(repr(cost) if isinstance(cost, float) else str(cost))


def test_nested_and_huge_usage_objects_are_unknown_not_errors():
    deep: dict = {}
    node = deep
    for _ in range(10_000):
        node["prompt_tokens_details"] = node = {}
    for usage in (
        {"prompt_tokens": deep, "completion_tokens": {"x": [1] * 1000}},
        {"prompt_tokens_details": {"cached_tokens": "9" * 1_000_000}, "prompt_tokens": 3, "completion_tokens": 1},
        {f"k{i}": i for i in range(100_000)} | {"prompt_tokens": 3, "completion_tokens": 1},
    ):
        read = read_usage({"usage": usage})
        assert read is None or (read.prompt_tokens in (None, 3) and read.cached_tokens is None)


def test_cached_tokens_never_exceed_the_prompt():
    usage = read_usage(
        {
            "usage": {
                "prompt_tokens": 100,
                "completion_tokens": 10,
                "prompt_tokens_details": {"cached_tokens": 1_000_000, "cache_write_tokens": 50},
            }
        }
    )
    assert (usage.cached_tokens, usage.cache_write_tokens) == (100, 0)
    # 100 cached x 1.25e-6 + 10 x 1e-5: never 1,000,000 cached billed against a 100-token prompt
    assert compute_cost(usage, GPT4O).cost_usd == D("0.000225")
    direct = compute_cost(Usage(100, 10, cached_tokens=1_000_000), GPT4O)
    assert direct.cost_usd == D("0.000225") and direct.notes


def test_a_price_table_cost_beyond_the_ceiling_is_unknown():
    absurd = ModelPrice(D("1"), D("1"))  # $1 a token: 1e9 tokens would be $1e9
    cost = compute_cost(Usage(MAX_TOKEN_COUNT, 0), absurd)
    assert cost.cost_usd is None and "ceiling" in cost.reason


@pytest.mark.parametrize(
    "amount",
    [
        None,
        D("NaN"),
        D("sNaN"),
        D("Infinity"),
        D("-Infinity"),
        D("1e30"),
        D("1e999999"),
        D("-5"),
        D("1e-999999"),
        D("-1e-30"),
        D(10**40),
        D("0.00000004"),
    ],
)
def test_format_usd_is_total(amount):
    shown = format_usd(amount)
    assert isinstance(shown, str) and 0 < len(shown) <= 24


def test_usage_status_is_total():
    line = usage_status(Usage(10**40, -3, cached_tokens=10**30), False, Cost(D("1e999999"), "provider"), True)
    assert len(line) < 120


@pytest.mark.parametrize("amount", [D("1e999000"), D("1e30"), D("NaN"), D("Infinity"), D("-1")])
def test_picodollars_refuse_unbounded_amounts_without_converting(amount):
    with pytest.raises(ValueError):
        usd_to_picodollars(amount)


class IncrCounting(MemoryStore):
    """A MemoryStore that counts the increments it is asked for."""

    increments = 0

    async def incr(self, key, fields, *, ttl, once=None):
        self.increments += 1
        await super().incr(key, fields, ttl=ttl, once=once)


async def test_ledger_refuses_out_of_range_values_before_writing():
    store = IncrCounting()
    for bad in (
        {"prompt_tokens": 10**20},
        {"completion_tokens": -1},
        {"cost_usd": D("1e999000")},
        {"tokens_saved": 10**20},
    ):
        args = {"prompt_tokens": 1, "completion_tokens": 1, "cost_usd": D("0.01"), **bad}
        with pytest.raises(ValueError):
            await record_reply(store, user="u", model="m", estimated=False, **args)
    assert await read_ledger(store) == [] and store.increments == 0  # refused before any increment


# -- the outlet end to end ------------------------------------------------------------------------


async def _outlet(f, usage, caplog, *, note=None) -> tuple[dict, list[str], str]:
    caplog.clear()
    reply = {"role": "assistant", "content": "ok", "usage": usage}
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "Hello?"}, reply], "chat_id": "c9"}
    events = Events()
    metadata = {"contextwarden": note} if note else None
    assert await f.outlet(body, __user__={"id": "u1"}, __metadata__=metadata, __event_emitter__=events) is body
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("usage ")]
    [record] = usage_records(caplog)
    return record, events.statuses, lines[0]


async def test_forged_cost_is_estimated_logged_once_and_the_ledger_stays_sane(counter, caplog):
    caplog.set_level(logging.INFO, logger="contextwarden")
    f = make_filter(counter, openrouter_pricing=False, calibrate_counts=False)
    forged = {"prompt_tokens": 1000, "completion_tokens": 100, "cost": "1e999000"}
    for _ in range(3):
        record, statuses, line = await _outlet(f, forged, caplog)
        assert len(line) < 2_000
        assert (record["cost_usd"], record["cost_source"]) == ("0.0035", "price_table")
        assert statuses == ["1,000 tokens in · 100 out · $0.0035"]
    [entry] = await read_ledger(f.store)
    assert entry.counters["cost_picousd"] == 3 * 3_500_000_000 and entry.counters["requests"] == 3
    f2 = make_filter(counter, openrouter_pricing=False, calibrate_counts=False)
    with caplog.at_level(logging.WARNING, logger="contextwarden"):
        caplog.clear()
        for _ in range(3):
            await f2.outlet({"model": "gpt-4o", "messages": [{"role": "assistant", "content": "x", "usage": forged}]})
        warned = [r.getMessage() for r in caplog.records if "usage not believed" in r.getMessage()]
    assert len(warned) == 1 and "1e999000" not in warned[0] and "cost" in warned[0]


@pytest.mark.parametrize(
    "usage",
    [
        {"prompt_tokens": 1e20, "completion_tokens": 5},
        {"prompt_tokens": "²", "completion_tokens": 5},
        {"prompt_tokens": 10**20, "completion_tokens": 10**20, "total_tokens": 10**30},
        {"prompt_tokens": -7, "completion_tokens": float("nan")},
        {"prompt_tokens": 5, "completion_tokens": 5, "cost": 1e30},
        {"input_tokens": "9" * 1_000_000, "output_tokens": 3, "cache_read_input_tokens": 10**19},
        {"promptTokenCount": {"a": {"b": 1}}, "candidatesTokenCount": [1, 2]},
        {"prompt_eval_count": 10**20, "eval_count": "²"},
    ],
    ids=lambda u: "-".join(f"{k}={str(v)[:8]}" for k, v in u.items())[:60],
)
async def test_forged_counts_are_estimated_and_bounded_everywhere(counter, caplog, usage):
    caplog.set_level(logging.INFO, logger="contextwarden")
    f = make_filter(counter, openrouter_pricing=False, calibrate_counts=False)
    record, statuses, line = await _outlet(f, usage, caplog)
    assert len(line) < 2_000
    for name in ("prompt_tokens", "completion_tokens", "cached_tokens", "reasoning_tokens"):
        assert record[name] is None or 0 <= record[name] <= MAX_TOKEN_COUNT
    assert record["cost_usd"] is None or D(record["cost_usd"]) <= MAX_REPLY_COST_USD
    [entry] = await read_ledger(f.store)
    assert all(0 <= v <= MAX_TOKEN_COUNT for k, v in entry.counters.items() if not k.endswith("picousd"))
    assert entry.counters["cost_picousd"] <= usd_to_picodollars(MAX_REPLY_COST_USD)
    assert statuses and len(statuses[-1]) < 100


async def test_forged_outlet_notes_are_bounded(counter, caplog):
    caplog.set_level(logging.INFO, logger="contextwarden")
    f = make_filter(counter, openrouter_pricing=False, calibrate_counts=False)
    note = {"estimated_prompt_tokens": 10**30, "tokens_saved": 10**20, "cost_saved_usd": "1e999000", "mode": "enforce"}
    record, _, line = await _outlet(f, {"completion_tokens": 3}, caplog, note=note)
    assert (
        record["estimated_prompt_tokens"] is None
        and record["tokens_saved"] is None
        and record["cost_saved_usd"] is None
    )
    assert 0 < record["prompt_tokens"] <= MAX_TOKEN_COUNT and len(line) < 2_000


async def test_huge_model_and_chat_ids_keep_the_usage_line_small(counter, caplog):
    caplog.set_level(logging.INFO, logger="contextwarden")
    f = make_filter(counter, openrouter_pricing=False)
    body = {
        "model": "m" * 1_000_000,
        "messages": [{"role": "assistant", "content": "x", "usage": {"prompt_tokens": 1, "completion_tokens": 1}}],
        "chat_id": "c" * 1_000_000,
    }
    assert await f.outlet(body, __user__={"id": "u" * 100_000}) is body
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("usage ")]
    assert len(line) < 4_000


# -- item 5: a Redis data error is not an outage; the ledger step is all or nothing -----------------


@pytest.mark.redis
@pytest.mark.parametrize("once", ["ledger:test-once", None])
async def test_redis_overflow_writes_nothing_and_is_not_an_outage(redis_url, unique, caplog, once):
    store = RedisStore(redis_url)
    raw = aioredis.Redis.from_url(redis_url)
    key = f"ledger:{unique}"
    await raw.hset(KEY_PREFIX + key, mapping={"requests": 5, "prompt_tokens": 2**63 - 10})
    once = once and f"{once}:{unique}"
    with pytest.raises(aioredis.ResponseError):
        await store.incr(key, {"requests": 1, "prompt_tokens": 100, "completion_tokens": 7}, ttl=60, once=once)
    assert await raw.hgetall(KEY_PREFIX + key) == {b"requests": b"5", b"prompt_tokens": str(2**63 - 10).encode()}
    if once:  # the marker (a field of the hour's marker hash) says nothing was applied
        assert not [k async for k in raw.scan_iter(KEY_PREFIX + "once:*") if await raw.hexists(k, once)]
    assert store.shared and not store.held  # not an outage: Redis is still used
    await store.incr(key + ":ok", {"requests": 1}, ttl=60, once=once and once + ":2")
    assert await raw.hget(KEY_PREFIX + key + ":ok", "requests") == b"1"
    assert not [r for r in caplog.records if "Redis unavailable" in r.getMessage()]
    await raw.hset(KEY_PREFIX + key, "requests", "not a number")  # damaged: replaced, and said once
    await store.incr(key, {"completion_tokens": 1, "requests": 1}, ttl=60, once=once and once + ":3")
    assert await raw.hget(KEY_PREFIX + key, "requests") == b"1"
    assert await raw.hget(KEY_PREFIX + key, "completion_tokens") == b"1"
    assert "was not a counter (damaged)" in caplog.text
    await raw.aclose()
    await store.aclose()


@pytest.mark.redis
async def test_forged_usage_never_tears_the_redis_ledger(counter, redis_url, unique, caplog):
    caplog.set_level(logging.INFO, logger="contextwarden")
    f = make_filter(counter, openrouter_pricing=False, calibrate_counts=False, redis_url=redis_url)
    for usage in (
        {"prompt_tokens": 1e20, "completion_tokens": 5},
        {"prompt_tokens": 10**20, "completion_tokens": 5},
        {"prompt_tokens": 1000, "completion_tokens": 100, "cost": "1e999000"},
    ):
        reply = {"role": "assistant", "content": "ok", "usage": usage}
        body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "Hi"}, reply]}
        assert await f.outlet(body, __user__={"id": unique}) is body
    assert f.store.shared and not f.store.held
    rows = [e for e in await read_ledger(f.store) if e.user == unique]
    assert len(rows) == 1 and rows[0].counters["requests"] == 3
    assert rows[0].counters["prompt_tokens"] < 3 * MAX_TOKEN_COUNT
    assert not [r for r in caplog.records if "Redis unavailable" in r.getMessage()]
    await f.store.aclose()


# -- item 7: pricing_file ------------------------------------------------------------------------


def _sources() -> PriceSources:
    return PriceSources(MemoryStore)


async def _admin_problem(path: str) -> str:
    book, problems = await _sources().book(openrouter=False, ttl_hours=24, pricing_file=path)
    assert "openai/gpt-4o" in book.prices  # the bundled prices go on
    [problem] = problems
    assert problem.valve == "pricing_file" and str(problem).startswith("pricing_file")
    assert path not in str(problem)  # a valve value is never echoed
    return str(problem)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\xff\xfe{\x00", "UTF-8"),
        (b"[" * 200_000 + b"]" * 200_000, "nested"),
        (b'{"models": ', "not valid JSON"),
        (b'{"models": {}, "fetched_at": ' + b"9" * 5_000 + b"}", "not valid JSON"),
    ],
)
async def test_bad_pricing_files_are_named_and_bundled_prices_go_on(tmp_path, content, message):
    path = tmp_path / "prices.json"
    path.write_bytes(content)
    assert message in await _admin_problem(str(path))


@pytest.mark.parametrize(
    ("content", "prompt"),
    [
        (b'{"models": {"a/b": {"prompt": "1e999999999"}}, "fetched_at": 1e400}', None),
        (b'{"models": {"a/b": {"prompt": "0.1"}}, "fetched_at": ' + b"9" * 4_000 + b"}", D("0.1")),
        (b'{"models": {"a/b": {"prompt": "' + b"1" * 10_000 + b'"}}, "source_date": [1]}', None),
    ],
)
async def test_odd_values_in_a_pricing_file_are_unknown_and_named(tmp_path, content, prompt):
    path = tmp_path / "prices.json"
    path.write_bytes(content)
    book, problems = await _sources().book(openrouter=False, ttl_hours=24, pricing_file=str(path))
    assert book.prices["a/b"].prompt == prompt
    assert [str(p) for p in problems] == [
        "pricing_file: 1 of 1 entries unreadable (entry 1: no completion price); "
        "entries that are not objects are left out, unreadable prices are unknown"
    ]


@pytest.mark.parametrize(
    ("models", "named"),
    [
        # Before: each of these was read without a word; the models were priced as unknown or not at all
        ({"gpt-4o": 5, "my-model": "0.001"}, "2 of 2 entries unreadable (entry 1: not an object)"),
        ({"gpt-4o": {"prompt": "abc", "completion": "-1"}}, "1 of 1 entries unreadable (entry 1: prompt is not a"),
        ({"a/b": {"prompt": 2.5e-6, "completion": 1e-5}, "gpt-4o": {"prompt": 2.5, "completion": 10}}, "1 of 2 "),
        (
            {"gpt-4o": {"prompt": 2.5, "completion": 10}},
            "(entry 1: prompt is over $1 a token (prices are USD per token",
        ),
        ({"gpt-4o": {"input": 2.5e-6, "completion": 1e-5}}, "(entry 1: no prompt price)"),
        ({"a/b": {"prompt": 0, "completion": 0, "tiers": [{"min_prompt_tokens": 0}]}}, "(entry 1: tier 1 is not"),
        ({"a/b": {"prompt": 0, "completion": 0, "tiers": [{"min_prompt_tokens": 9, "prompt": "x"}]}}, "tier 1: prompt"),
        ({}, "pricing_file: no entries in its 'models' object"),
    ],
)
async def test_unreadable_entries_in_a_pricing_file_are_named_by_position(tmp_path, models, named):
    path = tmp_path / "prices.json"
    path.write_text(json.dumps({"models": models}))
    problem = await _admin_problem(str(path))
    assert named in problem and not any(model_id in problem for model_id in models)


async def test_a_readable_pricing_file_names_nothing(tmp_path):
    path = tmp_path / "prices.json"
    models = {
        "a/b": {"prompt": "0.000001", "completion": 2e-6, "cache_read": None},
        "c/d": {"prompt": 0, "completion": 0},
    }
    path.write_text(json.dumps({"models": models}))
    book, problems = await _sources().book(openrouter=False, ttl_hours=24, pricing_file=str(path))
    assert problems == [] and book.prices["a/b"].completion == D("0.000002")


async def test_oversized_pricing_file_is_refused_unread(tmp_path):
    path = tmp_path / "big.json"
    with path.open("wb") as out:
        out.truncate(MAX_PRICE_FILE_BYTES + 1)  # sparse: no disk used
    assert "MiB" in await _admin_problem(str(path))


async def test_a_fifo_or_device_is_refused_before_opening(tmp_path):
    fifo = tmp_path / "prices.fifo"
    os.mkfifo(fifo)
    opened, stop = threading.Event(), threading.Event()

    def unblock_a_reader() -> None:  # if the filter ever opens the FIFO, let it go on (and fail the test)
        while not stop.wait(0.05):
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                continue
            opened.set()
            os.write(fd, b"{}")
            os.close(fd)
            return

    watchdog = threading.Thread(target=unblock_a_reader, daemon=True)
    watchdog.start()
    try:
        assert "not a regular file" in await _admin_problem(str(fifo))
    finally:
        stop.set()
        watchdog.join()
    assert not opened.is_set()
    assert "not a regular file" in await _admin_problem("/dev/zero")


async def test_pricing_file_is_read_off_the_event_loop(tmp_path, monkeypatch):
    path = tmp_path / "prices.json"
    path.write_text(PriceBook({"a/b": FREE_PRICE}, source="x").to_json())
    threads: list[threading.Thread] = []
    real = pricing_module._price_document

    def spy(*args, **kwargs):
        threads.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(pricing_module, "_price_document", spy)
    book, problems = await _sources().book(openrouter=False, ttl_hours=24, pricing_file=str(path))
    assert problems == [] and "a/b" in book.prices
    assert threads and all(t is not threading.main_thread() for t in threads)


async def test_pricing_file_problem_reaches_the_admin_and_the_chat_goes_on(counter, caplog, tmp_path):
    caplog.set_level(logging.INFO, logger="contextwarden")
    path = tmp_path / "prices.json"
    path.write_bytes(b"\xff\xfe")
    f = make_filter(counter, openrouter_pricing=False, pricing_file=str(path))
    record, statuses, _ = await _outlet(f, {"prompt_tokens": 1000, "completion_tokens": 100}, caplog)
    assert record["cost_usd"] == "0.0035"  # bundled
    assert any("pricing_file" in s for s in statuses)
    assert any("pricing_file" in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


# -- "wrong numbers": OpenRouter shapes, the TTL floor, huge replies ------------------------------


def _payload(*entries) -> dict:
    return {"data": list(entries)}


@respx.mock
async def test_openrouter_entries_without_prompt_or_completion_prices_are_unknown(caplog):
    payload = _payload(
        {"id": "x/empty", "pricing": {}},
        {"id": "x/renamed", "pricing": {"input": "0.000001", "output": "0.000002"}},
        {"id": "x/half", "pricing": {"prompt": "0.000001"}},
        {"id": "x/ok", "pricing": {"prompt": "0.000001", "completion": "0.000002"}},
        {"id": "x/free", "pricing": {"prompt": "0", "completion": "0"}},
    )
    respx.get(DEFAULT_OPENROUTER_URL).mock(return_value=httpx.Response(200, json=payload))
    with caplog.at_level(logging.WARNING, logger="contextwarden"):
        async with httpx.AsyncClient() as client:
            book = await fetch_openrouter_prices(client)
    for model in ("x/empty", "x/renamed"):
        assert (book.prices[model].prompt, book.prices[model].completion) == (None, None)
    assert book.prices["x/half"].completion is None
    assert compute_cost(Usage(10, 10), book.prices["x/empty"]).cost_usd is None  # null, never $0
    assert compute_cost(Usage(10, 10), book.prices["x/free"]).cost_usd == 0
    [warning] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "3 of 5" in warning


@respx.mock
@pytest.mark.parametrize("declared", [True, False])
async def test_huge_openrouter_replies_are_refused(declared):
    body = b'{"data": [' + b" " * 2_000 + b"]}"
    headers = {} if declared else {"transfer-encoding": "chunked"}

    async def chunks():
        yield body

    response = httpx.Response(200, content=body if declared else chunks(), headers=headers)
    respx.get(DEFAULT_OPENROUTER_URL).mock(return_value=response)
    async with httpx.AsyncClient() as client:
        with pytest.raises(PricingError, match="larger than"):
            await fetch_openrouter_prices(client, max_bytes=1_000)


@respx.mock
async def test_openrouter_reply_is_parsed_off_the_event_loop(monkeypatch):
    payload = _payload({"id": "x/ok", "pricing": {"prompt": "0.000001", "completion": "0.000002"}})
    respx.get(DEFAULT_OPENROUTER_URL).mock(return_value=httpx.Response(200, json=payload))
    threads: list[threading.Thread] = []
    real = PriceBook.from_openrouter.__func__

    def spy(cls, *args, **kwargs):
        threads.append(threading.current_thread())
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(PriceBook, "from_openrouter", classmethod(spy))
    async with httpx.AsyncClient() as client:
        book = await fetch_openrouter_prices(client)
    assert "x/ok" in book.prices and threads and threads[0] is not threading.main_thread()


class _Clock:
    now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@respx.mock
async def test_pricing_ttl_is_floored(counter):
    payload = _payload({"id": "x/ok", "pricing": {"prompt": "0.000001", "completion": "0.000002"}})
    route = respx.get(DEFAULT_OPENROUTER_URL).mock(return_value=httpx.Response(200, json=payload))
    clock = _Clock()
    live = LivePrices(PriceBook.from_bundled(), ttl_hours=1e-6, clock=clock)
    clock.now = 2e9
    await live.refresh_in_background()
    clock.now = live.book.fetched_at + MIN_PRICING_TTL_HOURS * 3600 - 1
    assert live.refresh_in_background() is None and route.call_count == 1  # not a fetch per request
    clock.now += 2
    assert live.is_stale()
    with pytest.raises(ValueError, match="pricing_ttl_hours"):
        make_filter(counter, pricing_ttl_hours=1e-6)
