"""What a spending-limit check costs per turn: one user's spend today and this month.

The ledger has no per-user index (one key per day, user and model): adding a user's month up
from it scans every key (Redis SCAN MATCH, or the in-process store's dict). The spend keys
(`spendbook.py`, one per user and month) make it one read. This times both against ledgers
of growing size.

    PYTHONPATH=src .venv/bin/python bench/limits.py --redis-url redis://127.0.0.1:6379/15 [--keys 1000,10000,50000]

The Redis database given is flushed first: use a scratch one.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import time
from datetime import date, timedelta

import redis

from contextwarden.money.ledger import _ledger_key, ledger_totals, read_ledger
from contextwarden.money.limits import month_start
from contextwarden.money.spendbook import SpendBook
from contextwarden.state.store import KEY_PREFIX, MemoryStore, RedisStore

TODAY = date(2026, 12, 20)
MODELS = ("openai/gpt-4o", "anthropic/claude-sonnet-4.5", "openai/gpt-4o-mini", "google/gemini-2.5-pro")


def layout(keys: int) -> list[tuple[date, str, str]]:
    """`keys` (day, user, model) keys over 60 days, 4 models: many users, a few days each."""
    out = []
    user = 0
    while len(out) < keys:
        for offset in range(0, 60, 7):
            for model in MODELS[: 1 + user % len(MODELS)]:
                out.append((TODAY - timedelta(days=offset), f"user-{user:06d}", model))
        user += 1
    return out[:keys]


async def fill(store, rows) -> None:
    fields = {"requests": 3, "prompt_tokens": 3000, "completion_tokens": 300, "cost_picousd": 4_500_000_000}
    if isinstance(store, MemoryStore):
        store.max_keys = len(rows) + 10
        for day, user, model in rows:
            await store.incr(_ledger_key(day, user, model), fields, ttl=86_400)
        return
    client = redis.Redis.from_url(store_url)
    pipe = client.pipeline(transaction=False)
    for day, user, model in rows:
        pipe.hset(KEY_PREFIX + _ledger_key(day, user, model), mapping=fields)
    pipe.execute()
    client.close()


async def time_reads(store, user: str, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        entries = await read_ledger(store, since=month_start(TODAY), until=TODAY, user=user)
        [month] = ledger_totals(entries, "user")
        times.append((time.perf_counter() - start) * 1000)
        assert month.counters["requests"] > 0
    return times


async def time_book(store, user: str, repeats: int) -> list[float]:
    """The spend-key read, in a month after the keys began (the steady state)."""
    book = SpendBook()
    await book.record(store, user="-", day=TODAY.replace(day=1) - timedelta(days=1), cost_usd=None, tokens=0)
    await book.record(store, user=user, day=TODAY, cost_usd=None, tokens=10)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        day, month = await book.spend(store, user, TODAY)
        times.append((time.perf_counter() - start) * 1000)
        assert month.requests == 1
    return times


async def main() -> None:
    global store_url
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--keys", default="1000,10000,50000")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    store_url = args.redis_url
    print(f"machine: {platform.processor() or platform.machine()}, load {os.getloadavg()[0]:.1f}")
    print(
        "| ledger keys | ledger scan, memory ms | ledger scan, Redis ms | spend key, memory ms | spend key, Redis ms |"
    )
    print("|--:|--:|--:|--:|--:|")
    for keys in (int(k) for k in args.keys.split(",")):
        rows = layout(keys)
        user = rows[0][1]
        memory = MemoryStore()
        await fill(memory, rows)
        redis.Redis.from_url(store_url).flushdb()
        shared = RedisStore(store_url, timeout=5.0)
        await fill(shared, rows)
        m = statistics.median(await time_reads(memory, user, args.repeats))
        r = statistics.median(await time_reads(shared, user, args.repeats))
        bm = statistics.median(await time_book(memory, user, args.repeats))
        br = statistics.median(await time_book(shared, user, args.repeats))
        await shared.aclose()
        print(f"| {keys:,} | {m:.2f} | {r:.2f} | {bm:.3f} | {br:.3f} |")
    redis.Redis.from_url(store_url).flushdb()


store_url = ""

if __name__ == "__main__":
    asyncio.run(main())
