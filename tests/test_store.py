"""The store: in-process and against a real Redis, including a refused or lost server."""

from __future__ import annotations

import asyncio
import logging

import pytest
import redis.asyncio as aioredis

from contextwarden.errors import ConfigError
from contextwarden.state import store as store_module
from contextwarden.state.store import KEY_PREFIX, MemoryStore, RedisStore, open_store, redis_client

STEADY_TIMEOUT = 10.0  # seconds: long enough for 200 queued commands on a loaded 2-core runner


async def exercise(store, unique: str) -> None:
    key = f"test:{unique}"
    assert await store.get(key) is None
    await store.set(key, b"v1", ttl=60)
    assert await store.get(key) == b"v1"
    assert await store.add(key, b"v2", ttl=60) is False
    assert await store.add(key + ":lock", b"me", ttl=60) is True
    await store.delete(key)
    assert await store.get(key) is None
    # swap: set only over exactly what was read (None = absent)
    assert await store.swap(key, b"other", b"s1", ttl=60) is False and await store.get(key) is None
    assert await store.swap(key, None, b"s1", ttl=60) is True and await store.get(key) == b"s1"
    assert await store.swap(key, None, b"s2", ttl=60) is False
    assert await store.swap(key, b"s", b"s2", ttl=60) is False and await store.get(key) == b"s1"
    assert await store.swap(key, b"s1", b"s2", ttl=60) is True and await store.get(key) == b"s2"
    await store.delete(key)
    await asyncio.gather(*(store.incr(f"{key}:n", {"requests": 1, "tokens": 10}, ttl=60) for _ in range(200)))
    assert await store.counters(f"{key}:n") == {"requests": 200, "tokens": 2000}
    assert f"{key}:n" in await store.keys(f"test:{unique}:*")


async def test_memory_store(unique):
    await exercise(MemoryStore(), unique)


async def test_memory_store_expires_and_is_bounded():
    store = MemoryStore(max_keys=10)
    await store.set("gone", b"x", ttl=-1)
    assert await store.get("gone") is None
    for i in range(50):
        await store.set(f"k{i}", b"x", ttl=60)
    assert len(await store.keys("*")) == 10 and await store.get("k49") == b"x" and await store.get("k0") is None


async def test_memory_store_bounds_each_kind_of_key_apart():
    """Keys of one namespace (ledger rows: one per user, model and day) never push out another's
    (a user's spend counters): each namespace has its own LRU of `max_keys`."""
    store = MemoryStore(max_keys=10)
    await store.incr("spend:2026-12:u1", {"usd": 5}, ttl=60, once="spend:a")
    for i in range(50):
        await store.incr(f"ledger:2026-12-01:u2:model-{i}", {"requests": 1}, ttl=60, once=f"ledger:{i}")
    assert await store.counters("spend:2026-12:u1") == {"usd": 5}
    assert len(await store.keys("ledger:*")) == 10 and await store.counters("ledger:2026-12-01:u2:model-0") == {}
    await store.incr("spend:2026-12:u1", {"usd": 5}, ttl=60, once="spend:a")  # still known: not applied again
    assert await store.counters("spend:2026-12:u1") == {"usd": 5}


@pytest.mark.redis
async def test_redis_store(redis_url, unique):
    opened = open_store(redis_url)
    assert isinstance(opened, RedisStore) and opened.shared
    await opened.aclose()
    # The 200 concurrent increments below queue for 32 pooled connections; with the default 0.5 s
    # socket timeout a loaded machine timed one out once, and it went to the in-process fallback
    # (counters 199 + 1). This test checks what Redis does, not how fast a busy runner is.
    store = RedisStore(redis_url, timeout=STEADY_TIMEOUT)
    await exercise(store, unique)
    assert store.shared  # no call fell back
    raw = aioredis.Redis.from_url(redis_url)
    keys = [k.decode() async for k in raw.scan_iter(match=f"*{unique}*")]
    assert keys and all(k.startswith(KEY_PREFIX) for k in keys)
    for k in keys:
        assert 0 < await raw.ttl(k) <= 60
    await raw.aclose()
    await store.aclose()


@pytest.mark.redis
async def test_redis_refused_falls_back_with_one_warning(caplog, unique):
    store = RedisStore("redis://127.0.0.1:1/0", timeout=0.2)
    for _ in range(5):
        await store.set(f"k:{unique}", b"x", ttl=60)
    assert await store.get(f"k:{unique}") == b"x"  # served by the in-process fallback
    assert not store.shared
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "Redis unavailable" in warnings[0].getMessage()


class FlakyClient:
    """A stand-in Redis client: refuses every command while `down`, else records what it was sent."""

    def __init__(self) -> None:
        self.down, self.sent = True, []

    async def eval(self, script, numkeys, *args):
        if self.down:
            raise aioredis.ConnectionError("refused")
        self.sent.append((args[0], args[numkeys + 2]))  # the counter key and the increment's name
        return 1

    async def get(self, key):
        if self.down:
            raise aioredis.ConnectionError("refused")
        return None

    async def ping(self):
        if self.down:
            raise aioredis.ConnectionError("refused")
        return True

    async def aclose(self) -> None:
        pass


async def test_a_redis_store_sends_through_the_client_it_is_given_and_shows_what_it_holds(monkeypatch):
    monkeypatch.setattr(store_module, "REDIS_RETRY_SECONDS", 0.0)
    client = FlakyClient()
    store = RedisStore("redis://never-dialled:1/0", client=client)
    await store.incr("t", {"n": 1}, ttl=60, once="a")
    await store.incr("t", {"n": 2}, ttl=60, once="b")
    assert store.held == ("a", "b") and not store.shared and not await store.fallback.counters("t")
    client.down = False
    assert await store.get("x") is None  # Redis answers: the held increments are sent, in order
    assert store.held == () and store.shared
    assert client.sent == [(KEY_PREFIX + "t", "a"), (KEY_PREFIX + "t", "b")]
    await store.aclose()


async def test_flush_sends_what_a_redis_store_holds_once_redis_answers(monkeypatch):
    """`flush` is how a store the filter left (`redis_url` changed) gets its held increments out
    before it is closed: False while Redis is away, True once they were sent."""
    monkeypatch.setattr(store_module, "REDIS_RETRY_SECONDS", 0.0)
    client = FlakyClient()
    store = RedisStore("redis://never-dialled:1/0", client=client)
    assert await store.flush() and await MemoryStore().flush()  # nothing held: nothing to send
    await store.incr("t", {"n": 1}, ttl=60, once="a")
    assert not await store.flush() and store.held == ("a",)
    client.down = False
    assert await store.flush() and store.held == () and client.sent == [(KEY_PREFIX + "t", "a")]


@pytest.mark.redis
async def test_aclose_lets_go_of_the_store_s_connections(redis_url, unique):
    """A closed RedisStore leaves no connection open on the server (its client did not close the
    pool it was given, and a store the filter left kept its connections for good)."""
    raw = aioredis.Redis.from_url(redis_url)
    before = {c["id"] for c in await raw.client_list()}
    store = open_store(redis_url)
    await store.set(f"k:{unique}", b"x", ttl=60)
    opened = {c["id"] for c in await raw.client_list()} - before
    assert opened
    await store.aclose()
    for _ in range(200):  # the server sees the close when it reads it
        if not opened & {c["id"] for c in await raw.client_list()}:
            break
        await asyncio.sleep(0.01)
    assert not opened & {c["id"] for c in await raw.client_list()}
    await raw.aclose()


def test_bad_redis_url_names_the_valve():
    with pytest.raises(ConfigError) as info:
        open_store("localhost:6379")
    assert info.value.valve == "redis_url"
    assert isinstance(open_store("  "), MemoryStore)


def test_connect_and_read_timeouts_are_apart():
    """Redis away is told by the connect (0.5 s); a late answer on a busy machine gets 4x that."""
    kwargs = redis_client("redis://127.0.0.1:6379/0").connection_pool.connection_kwargs
    assert (kwargs["socket_connect_timeout"], kwargs["socket_timeout"]) == (0.5, 2.0)
