"""Shared state as bytes and counters: in-process by default, Redis when configured.

The store knows no chats or prices; callers give it keys. Every key lives under one prefix
and expires. A Redis store that cannot reach its server falls back to an in-process store
(with one warning) and goes back to Redis once it answers again; meanwhile a key it swaps (a
chat's state) reads as this worker last read or wrote it in Redis (`LocalCopy`).
"""

from __future__ import annotations

import asyncio
import fnmatch
import hashlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio as aioredis

from ..errors import ConfigError

__all__ = ["Store", "MemoryStore", "RedisStore", "LocalCopy", "open_store", "redis_client", "KEY_PREFIX"]

store_log = logging.getLogger("contextwarden")

KEY_PREFIX = "contextwarden:"
DEFAULT_MEMORY_KEYS = 20_000  # per namespace (`MemoryStore`)
MEMORY_NAMESPACES = 32  # the code uses a dozen; past this many, keys share one LRU
DEFAULT_REDIS_TIMEOUT = 0.5  # seconds to connect; a Redis that is away must not slow every chat down
# An answer may be late without Redis being away: a busy machine reads it late. Answers wait
# this many times the connect timeout (a Redis that is away refuses the connect at once, or
# lets it time out), and a command that timed out is sent once more: every write is named or
# idempotent, so a repeat changes nothing. A refused connect or a second timeout is an outage.
REDIS_READ_TIMEOUT_FACTOR = 4
REDIS_ATTEMPTS = 2
REDIS_RETRY_SECONDS = 30.0
# Only these mean Redis is away (an outage: fall back, hold named increments). Any other
# RedisError is an answer, e.g. a ResponseError for a counter that would overflow: it reaches
# the caller, and the worker keeps using Redis.
_REDIS_ERRORS = (aioredis.ConnectionError, aioredis.TimeoutError, OSError, asyncio.TimeoutError)
REDIS_PENDING_LIMIT = 10_000  # named increments a worker holds while Redis is away
ONCE_MARKER_SECONDS = 86_400  # how long Redis remembers that a named increment was applied
# The markers of named increments live as fields of one hash an hour (`once:<YYYYMMDDHH>`):
# a reply adds a field, not a key, so at most 25 marker keys exist at a time.
ONCE_BUCKET_FORMAT = "%Y%m%d%H"
REDIS_MAX_CONNECTIONS = 32  # per worker; callers beyond that queue for one
# Waiting for a free pooled connection measures a busy event loop, not Redis: each holder's
# command is already bounded by the socket timeouts. Give up only after this long: at load 10-14
# on 2 cores, 300 simultaneous turns waited over 10 s and the worker left Redis ("No connection
# available" is a ConnectionError, an outage); the wait ends as soon as a holder is done.
REDIS_POOL_WAIT_SECONDS = 60.0
# A worker's copy of each key it swaps in Redis (a chat's state), served while Redis is away
# (`LocalCopy`): at most this many keys and bytes, as `_LocalCopies` weighs them: each copy's
# bytes and key, and LOCAL_COPY_OVERHEAD for what holds them (tracemalloc, CPython 3.11: 235
# bytes an entry beside its bytes, 49 for the key's str and 33 for a second copy's bytes).
LOCAL_COPY_KEYS = DEFAULT_MEMORY_KEYS
LOCAL_COPY_BYTES = 32 * 2**20
LOCAL_COPY_OVERHEAD = 320


class Store:
    """Bytes by key and integer counters by key and field, each key with a time to live."""

    async def get(self, key: str) -> bytes | None:
        raise NotImplementedError

    async def set(self, key: str, value: bytes, *, ttl: int) -> None:
        raise NotImplementedError

    async def add(self, key: str, value: bytes, *, ttl: int) -> bool:
        """Set only when absent (a lock); True when this call set it."""
        raise NotImplementedError

    async def swap(self, key: str, expected: bytes | None, value: bytes, *, ttl: int) -> bool:
        """Set only while the key still holds `expected` (None: absent); True when this call set it.

        A read-modify-write that read nothing real (a failed read, or a fallback's empty answer
        while the shared copy was away) then cannot write over what it did not read.
        """
        raise NotImplementedError

    async def delete(self, key: str) -> None:
        raise NotImplementedError

    async def incr(self, key: str, fields: Mapping[str, int], *, ttl: int, once: str | None = None) -> None:
        """Add to integer fields of a counter key atomically, refreshing its expiry.

        `once` names this increment: a second call with the same name adds nothing, so an
        increment whose outcome is unknown (a timeout) can be sent again safely.
        """
        raise NotImplementedError

    async def incr_below(
        self, key: str, fields: Mapping[str, int], *, ttl: int, below: Mapping[str, int], once: str
    ) -> tuple[bool, dict[str, int]]:
        """`incr` only while every counter named in `below` is under its value (absent = 0), in
        one atomic step: whether it was applied, and the counters right before it, what every
        increment before it added in the one order the store applied them (so increments side by
        side in any worker are checked one after another). A repeat of a named increment that
        was applied: True, and the counters less it."""
        raise NotImplementedError

    async def counters(self, key: str) -> dict[str, int]:
        """The integer fields of a counter key ({} when absent). A field or key that is not a
        counter (damaged by hand or by another program) is removed, with one warning."""
        raise NotImplementedError

    async def keys(self, pattern: str) -> list[str]:
        """Keys (without the prefix) matching a glob pattern."""
        raise NotImplementedError

    async def local_copy(self, key: str) -> LocalCopy | None:
        """What this worker holds of a key it swaps, beside the shared copy, once the shared store
        answers again: what it last saw there and what it wrote while the store was away (None
        for a store that is never away, a key it does not hold, or while the store is away:
        `get` and `swap` then use the copy)."""
        return None

    @property
    def shared(self) -> bool:
        """True when other workers see the same state."""
        return False

    async def flush(self) -> bool:
        """Send what the store holds back for its server now, if it answers (a store left behind
        by a `redis_url` change is closed only once this is True: nothing of it is lost)."""
        return True

    async def aclose(self) -> None:
        """Let go of the store's connections (a store no turn uses any more)."""


class MemoryStore(Store):
    """An in-process store: the default, and the test double. Each kind of key (its namespace,
    the text before the first `:`) has its own LRU of `max_keys`, least recently used out first:
    chat states, which every new chat writes, and ledger rows, one per user, model and day, never
    push a user's spend counters out (their limit with them)."""

    def __init__(self, *, max_keys: int = DEFAULT_MEMORY_KEYS) -> None:
        self.max_keys = max_keys
        self._kinds: dict[str, OrderedDict[str, tuple[float, bytes | dict[str, int]]]] = {}
        self._done: dict[str, OrderedDict[str, None]] = {}  # names of `once` increments applied, by namespace

    def _kind(self, key: str) -> OrderedDict[str, tuple[float, bytes | dict[str, int]]]:
        """The LRU of `key`'s namespace."""
        return _namespace_of(self._kinds, key)

    def _live(self, key: str) -> bytes | dict[str, int] | None:
        kept = self._kind(key)
        entry = kept.get(key)
        if entry is None:
            return None
        if entry[0] < time.monotonic():
            del kept[key]
            return None
        kept.move_to_end(key)
        return entry[1]

    def _put(self, key: str, value: bytes | dict[str, int], ttl: int) -> None:
        kept = self._kind(key)
        kept[key] = (time.monotonic() + ttl, value)
        kept.move_to_end(key)
        while len(kept) > self.max_keys:
            kept.popitem(last=False)

    async def get(self, key: str) -> bytes | None:
        value = self._live(key)
        return value if isinstance(value, bytes) else None

    async def set(self, key: str, value: bytes, *, ttl: int) -> None:
        self._put(key, value, ttl)

    async def add(self, key: str, value: bytes, *, ttl: int) -> bool:
        if self._live(key) is not None:
            return False
        self._put(key, value, ttl)
        return True

    async def swap(self, key: str, expected: bytes | None, value: bytes, *, ttl: int) -> bool:
        if self._live(key) != expected:
            return False
        self._put(key, value, ttl)
        return True

    async def delete(self, key: str) -> None:
        self._kind(key).pop(key, None)

    async def incr(self, key: str, fields: Mapping[str, int], *, ttl: int, once: str | None = None) -> None:
        if once is None or self._first(once):
            self._add(key, fields, ttl)

    async def incr_below(
        self, key: str, fields: Mapping[str, int], *, ttl: int, below: Mapping[str, int], once: str
    ) -> tuple[bool, dict[str, int]]:
        current = await self.counters(key)
        if once in _namespace_of(self._done, once):
            return True, _less(current, fields)
        if any(current.get(name, 0) >= cap for name, cap in below.items()):
            return False, current
        self._first(once)
        self._add(key, fields, ttl)
        return True, current

    def _first(self, once: str) -> bool:
        """Mark the named increment applied; False when it already was."""
        done = _namespace_of(self._done, once)
        if once in done:
            return False
        done[once] = None
        if len(done) > self.max_keys:
            done.popitem(last=False)
        return True

    def _add(self, key: str, fields: Mapping[str, int], ttl: int) -> None:
        current = self._live(key)
        totals = dict(current) if isinstance(current, dict) else {}
        for name, amount in fields.items():
            totals[name] = totals.get(name, 0) + int(amount)
        self._put(key, totals, ttl)

    async def counters(self, key: str) -> dict[str, int]:
        value = self._live(key)
        return dict(value) if isinstance(value, dict) else {}

    async def keys(self, pattern: str) -> list[str]:
        keys = [key for kept in self._kinds.values() for key in kept]
        return sorted(k for k in keys if fnmatch.fnmatchcase(k, pattern) and self._live(k) is not None)


_Entry = TypeVar("_Entry")


def _namespace_of(kinds: dict[str, OrderedDict[str, _Entry]], key: str) -> OrderedDict[str, _Entry]:
    """The LRU of `key`'s namespace, the text before its first `:` (made on first use: the
    namespaces are the code's, a handful; keys without one, or past MEMORY_NAMESPACES, share one)."""
    namespace, colon, _ = key.partition(":")
    kept = kinds.get(namespace if colon else "")
    if kept is None:
        namespace = namespace if colon and len(kinds) < MEMORY_NAMESPACES else ""
        kept = kinds.setdefault(namespace, OrderedDict())
    return kept


@dataclass(frozen=True, slots=True)
class LocalCopy:
    """What a worker holds of one key it swaps in Redis: `seen`, the bytes Redis held when this
    worker last read or wrote them (None: none); `written`, what it swapped in while Redis was
    away (None: nothing), which Redis has not got. While Redis is away the key reads as
    `current`; once it answers, the caller decides what wins (`local_copy`)."""

    seen: bytes | None
    written: bytes | None = None

    @property
    def current(self) -> bytes | None:
        """What the key holds as this worker knows it: what it wrote, else what it saw."""
        return self.seen if self.written is None else self.written


class _LocalCopies:
    """The `LocalCopy` of each key a `RedisStore` swapped, least recently used out first, at most
    `max_keys` and `max_bytes` (each weighed as its bytes and key, and `LOCAL_COPY_OVERHEAD`);
    each expires with the time to live of the swap that made it, as Redis's key does."""

    def __init__(self, max_keys: int = LOCAL_COPY_KEYS, max_bytes: int = LOCAL_COPY_BYTES) -> None:
        self.max_keys, self.max_bytes = max_keys, max_bytes
        # key -> (expires, copy, taken: a caller read what was written since it was written)
        self._copies: OrderedDict[str, tuple[float, LocalCopy, bool]] = OrderedDict()
        self.weight = 0

    def __len__(self) -> int:
        return len(self._copies)

    def get(self, key: str, *, take: bool = False) -> LocalCopy | None:
        """The key's copy, marked as just used (and, `take`, as read by a caller that goes on
        from it); None when there is none or it expired."""
        entry = self._copies.get(key)
        if entry is None:
            return None
        if entry[0] < time.monotonic():
            self.drop(key)
            return None
        self._copies.move_to_end(key)
        if take and entry[1].written is not None:
            self._copies[key] = (entry[0], entry[1], True)
        return entry[1]

    def put(self, key: str, copy: LocalCopy, ttl: int | None) -> None:
        """Keep `copy` for `key`, expiring in `ttl` seconds (None: when the one it replaces did)."""
        old = self._copies.get(key)
        expires = old[0] if ttl is None and old is not None else time.monotonic() + (ttl or 0)
        self.drop(key)
        self._copies[key] = (expires, copy, False)
        self.weight += _copy_bytes(key, copy)
        while self._copies and (len(self._copies) > self.max_keys or self.weight > self.max_bytes):
            self.drop(next(iter(self._copies)))

    def drop(self, key: str) -> None:
        """Forget the key's copy."""
        entry = self._copies.pop(key, None)
        if entry is not None:
            self.weight -= _copy_bytes(key, entry[1])

    def saw(self, key: str, value: bytes | None) -> None:
        """Redis answered `value` for `key`: the copy's `seen`, unless the copy holds what this
        worker wrote while Redis was away (its `seen` is what that was written over)."""
        copy = self.get(key)
        if copy is not None and copy.written is None and copy.seen != value:
            self.put(key, LocalCopy(value), None)

    def swapped(self, key: str, value: bytes, ttl: int) -> None:
        """Redis took `value` for `key` in a swap: the copy's `seen`. What was written while Redis
        was away and no caller has read since stays (that swap's value was not made from it)."""
        entry = self._copies.get(key)
        if entry is None or entry[1].written is None or entry[2]:
            self.put(key, LocalCopy(value), ttl)

    def swap(self, key: str, expected: bytes | None, value: bytes, ttl: int, held: bytes | None) -> bool:
        """`Store.swap` on the copy while Redis is away (`held`: the key's bytes in the fallback,
        for a key with no copy): written over what was seen; False when the key holds other bytes."""
        copy = self.get(key)
        if (held if copy is None else copy.current) != expected:
            return False
        self.put(key, LocalCopy(None if copy is None else copy.seen, value), ttl)
        return True


def _copy_bytes(key: str, copy: LocalCopy) -> int:
    """What a copy costs `_LocalCopies`, in bytes."""
    return LOCAL_COPY_OVERHEAD + len(key) + len(copy.seen or b"") + len(copy.written or b"")


class RedisStore(Store):
    """A Redis store under `KEY_PREFIX`, with short timeouts and an in-process fallback.

    While Redis does not answer, calls go to the fallback store, with one warning per outage.
    Named increments (`incr(..., once=...)`, the ledger's) are not: a timed-out one may have
    been applied, so they wait in this worker (up to `REDIS_PENDING_LIMIT`) and are sent again,
    harmlessly, once Redis answers; nothing is counted twice or lost while the worker lives.
    A key written with `swap` (read, changed and written back: a chat's state) keeps a copy in
    this worker (`LocalCopy`), so an outage serves what it last read or wrote there, not nothing.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = DEFAULT_REDIS_TIMEOUT,
        fallback: Store | None = None,
        client: aioredis.Redis | None = None,
    ) -> None:
        """A store on the Redis at `url`.

        Args:
            timeout: seconds a connect may take before Redis counts as away; an answer may take
                `REDIS_READ_TIMEOUT_FACTOR` times it, `REDIS_ATTEMPTS` times in a row.
            fallback: where calls go while Redis is away (default: a new `MemoryStore`).
            client: the client commands are sent with (default: `redis_client(url, timeout)`);
                given, `url` and `timeout` are not read. Tests wrap one to watch or fail commands.

        Raises:
            ConfigError: the URL is not a Redis URL (names the `redis_url` valve).
        """
        self._redis = client if client is not None else redis_client(url, timeout)
        self._own_pool = client is None  # `redis_client`'s pool: this store closes it
        self.fallback = fallback or MemoryStore()
        self._down_since: float | None = None
        # (key, fields, ttl, name, marker bucket): a replay marks the bucket of the first try.
        self._pending: deque[tuple[str, dict[str, int], int, str, str]] = deque(maxlen=REDIS_PENDING_LIMIT)
        self._replaying = False
        # The marker bucket of each capped increment Redis did not answer: an `incr` sent later
        # under its name checks the marker where that try would have left it.
        self._unanswered: OrderedDict[str, str] = OrderedDict()
        self.copies = _LocalCopies()

    @property
    def shared(self) -> bool:
        return self._down_since is None

    async def local_copy(self, key: str) -> LocalCopy | None:
        """The key's copy while Redis answers (None while it is away: `get` reads the copy). The
        next swap Redis applies replaces it: the caller read it here and kept what it chose of it."""
        return self.copies.get(key, take=True) if self.shared else None

    @property
    def held(self) -> tuple[str, ...]:
        """The names of the named increments waiting for Redis to answer again, oldest first."""
        return tuple(held[3] for held in self._pending)

    def _usable(self) -> bool:
        return self._down_since is None or time.monotonic() - self._down_since > REDIS_RETRY_SECONDS

    def _failed(self, exc: BaseException) -> None:
        if self._down_since is None:
            store_log.warning("contextwarden: Redis unavailable (%s); using in-process state", type(exc).__name__)
        self._down_since = time.monotonic()

    def _recovered(self) -> None:
        if self._down_since is not None:
            store_log.warning("contextwarden: Redis reachable again; shared state resumed")
            self._down_since = None

    async def _try_redis(self, name: str, *args, **kwargs) -> tuple[bool, Any]:
        """Run `_redis_<name>` when Redis is usable: `(True, result)`, or `(False, None)`."""
        if not self._usable():
            return False, None
        try:
            result = await self._command(name, *args, **kwargs)
        except _REDIS_ERRORS as exc:
            self._failed(exc)
            return False, None
        self._recovered()
        if self._pending and not self._replaying:
            await self._replay()
        return True, result

    async def _command(self, name: str, *args, **kwargs) -> Any:
        """`_redis_<name>`; one that timed out is sent once more (`REDIS_ATTEMPTS`), so a single
        late answer is not an outage."""
        command = getattr(self, "_redis_" + name)
        for _ in range(REDIS_ATTEMPTS - 1):
            try:
                return await command(*args, **kwargs)
            except aioredis.TimeoutError:
                pass
        return await command(*args, **kwargs)

    async def _call(self, name: str, *args, **kwargs):
        ok, result = await self._try_redis(name, *args, **kwargs)
        return result if ok else await getattr(self.fallback, name)(*args, **kwargs)

    async def _replay(self) -> None:
        """Send the named increments held during an outage (each applies at most once).

        Single-flight: one caller replays while the others go on, and a held increment is
        removed only by the caller that sent it. Nothing raised here reaches the caller, whose
        own command has already succeeded.
        """
        self._replaying = True
        try:
            while self._pending:
                held = self._pending[0]
                try:
                    await self._command("incr", held[0], held[1], ttl=held[2], once=held[3], bucket=held[4])
                except _REDIS_ERRORS as exc:
                    self._failed(exc)
                    return
                except Exception as exc:  # refused for good: sending it again cannot help
                    store_log.warning("contextwarden: held usage increment dropped (%s)", type(exc).__name__)
                if self._pending and self._pending[0] is held:  # a full deque may have dropped it meanwhile
                    self._pending.popleft()
        finally:
            self._replaying = False

    async def get(self, key: str) -> bytes | None:
        ok, value = await self._try_redis("get", key)
        if ok:
            self.copies.saw(key, value)
            return value
        copy = self.copies.get(key)
        return await self.fallback.get(key) if copy is None else copy.current

    async def set(self, key: str, value: bytes, *, ttl: int) -> None:
        self.copies.drop(key)  # a key set outright is the fallback's while Redis is away
        await self._call("set", key, value, ttl=ttl)

    async def add(self, key: str, value: bytes, *, ttl: int) -> bool:
        added = await self._call("add", key, value, ttl=ttl)
        if added:
            self.copies.drop(key)
        return added

    async def swap(self, key: str, expected: bytes | None, value: bytes, *, ttl: int) -> bool:
        ok, swapped = await self._try_redis("swap", key, expected, value, ttl=ttl)
        if ok:
            if swapped:
                self.copies.swapped(key, value, ttl)
            return swapped
        held = None if self.copies.get(key) is not None else await self.fallback.get(key)
        return self.copies.swap(key, expected, value, ttl, held)

    async def delete(self, key: str) -> None:
        self.copies.drop(key)
        await self._call("delete", key)

    async def incr(self, key: str, fields: Mapping[str, int], *, ttl: int, once: str | None = None) -> None:
        if once is None:
            await self._call("incr", key, fields, ttl=ttl)
            return
        bucket = self._unanswered.pop(once, None) or time.strftime(ONCE_BUCKET_FORMAT, time.gmtime())
        done, _ = await self._try_redis("incr", key, fields, ttl=ttl, once=once, bucket=bucket)
        if not done:
            self._pending.append((key, dict(fields), ttl, once, bucket))

    async def incr_below(
        self, key: str, fields: Mapping[str, int], *, ttl: int, below: Mapping[str, int], once: str
    ) -> tuple[bool, dict[str, int]]:
        bucket = time.strftime(ONCE_BUCKET_FORMAT, time.gmtime())
        ok, answer = await self._try_redis("incr_below", key, fields, ttl=ttl, below=below, once=once, bucket=bucket)
        if ok:
            return answer
        self._unanswered[once] = bucket
        while len(self._unanswered) > REDIS_PENDING_LIMIT:
            self._unanswered.popitem(last=False)
        return await self.fallback.incr_below(key, fields, ttl=ttl, below=below, once=once)

    async def counters(self, key: str) -> dict[str, int]:
        return await self._call("counters", key)

    async def keys(self, pattern: str) -> list[str]:
        return await self._call("keys", pattern)

    async def _redis_get(self, key: str) -> bytes | None:
        # redis types every reply as bytes | str; this client never sets decode_responses.
        return await self._redis.get(KEY_PREFIX + key)  # type: ignore[return-value]

    async def _redis_set(self, key: str, value: bytes, *, ttl: int) -> None:
        await self._redis.set(KEY_PREFIX + key, value, ex=ttl)

    async def _redis_add(self, key: str, value: bytes, *, ttl: int) -> bool:
        return bool(await self._redis.set(KEY_PREFIX + key, value, ex=ttl, nx=True))

    async def _redis_swap(self, key: str, expected: bytes | None, value: bytes, *, ttl: int) -> bool:
        digest = "" if expected is None else hashlib.sha1(expected).hexdigest()
        return bool(await self._redis.eval(_SWAP_SCRIPT, 1, KEY_PREFIX + key, digest, value, ttl))

    async def _redis_delete(self, key: str) -> None:
        await self._redis.delete(KEY_PREFIX + key)

    async def _redis_incr(
        self, key: str, fields: Mapping[str, int], *, ttl: int, once: str | None = None, bucket: str = ""
    ) -> None:
        keys = [KEY_PREFIX + key] + ([KEY_PREFIX + "once:" + bucket] if once is not None else [])
        await self._eval_incr(keys, fields, ttl, once or "", None)

    async def _redis_incr_below(
        self, key: str, fields: Mapping[str, int], *, ttl: int, below: Mapping[str, int], once: str, bucket: str
    ) -> tuple[bool, dict[str, int]]:
        answer, before = await self._eval_incr(
            [KEY_PREFIX + key, KEY_PREFIX + "once:" + bucket], fields, ttl, once, below
        )
        if answer == 3:  # a repeat: what the key holds now, less it
            return True, _less(before, fields)
        return answer != 0, before

    async def _eval_incr(
        self, keys: list[str], fields: Mapping[str, int], ttl: int, once: str, below: Mapping[str, int] | None
    ) -> tuple[int, dict[str, int]]:
        """Run `_INCR_SCRIPT`: its answer, and with caps (`below`, even none) the key's counters
        before the increment; a plain increment (None) reads nothing back."""
        flat = [str(x) for name, amount in fields.items() for x in (name, int(amount))]
        caps = [str(x) for name, cap in (below or {}).items() for x in (name, int(cap))]
        capped = "" if below is None else len(below)
        answer, raw = await self._redis.eval(
            _INCR_SCRIPT, len(keys), *keys, ttl, min(ttl, ONCE_MARKER_SECONDS), once, capped, *caps, *flat
        )
        if answer == 2:
            _warn_repaired(keys[0])
        return int(answer), _integers(zip(raw[::2], raw[1::2], strict=True))[0]

    async def _redis_counters(self, key: str) -> dict[str, int]:
        try:
            raw = await self._redis.hgetall(KEY_PREFIX + key)
        except aioredis.ResponseError:  # WRONGTYPE: not a counter key
            await self._redis.delete(KEY_PREFIX + key)
            _warn_repaired(KEY_PREFIX + key)
            return {}
        counters, damaged = _integers(raw.items())
        if damaged:
            await self._redis.hdel(KEY_PREFIX + key, *damaged)
            _warn_repaired(KEY_PREFIX + key)
        return counters

    async def _redis_keys(self, pattern: str) -> list[str]:
        found = [
            k.decode()[len(KEY_PREFIX) :] async for k in self._redis.scan_iter(match=KEY_PREFIX + pattern, count=500)
        ]
        return sorted(found)

    async def flush(self) -> bool:
        """Send the held increments (`held`) now when Redis answers; True when none are left.
        Within REDIS_RETRY_SECONDS of a failure nothing is sent (Redis counts as away)."""
        if self._pending:
            await self._try_redis("ping")
        return not self._pending

    async def aclose(self) -> None:
        """Close the client, and the connection pool this store made (a pool left open keeps its
        connections to the server: the client alone does not close a pool it was given)."""
        if self._own_pool:
            await self._redis.aclose(close_connection_pool=True)
        else:
            await self._redis.aclose()

    async def _redis_ping(self) -> None:
        await self._redis.ping()


def _integers(pairs: Iterable[tuple[bytes | str, bytes | str]]) -> tuple[dict[str, int], list[bytes | str]]:
    """A counter key's fields as Redis answers them (name, value): the integer ones by name, and
    the names of those that are not integers (damaged)."""
    counters: dict[str, int] = {}
    damaged = []
    for name, value in pairs:
        try:
            counters[name.decode() if isinstance(name, bytes) else name] = int(value)
        except ValueError:
            damaged.append(name)
    return counters, damaged


def _less(counters: Mapping[str, int], fields: Mapping[str, int]) -> dict[str, int]:
    """`counters` without the increment `fields` (what they held before it; 0s left out)."""
    return {name: left for name, value in counters.items() if (left := value - fields.get(name, 0))}


def _warn_repaired(key: str) -> None:
    store_log.warning("contextwarden: %s was not a counter (damaged); its bad part removed", key)


# One atomic, all-or-nothing step. ARGV: ttl, marker ttl, the increment's name ("" = none; its
# marker is a field of the hash KEYS[2]), how many caps follow ("" = a plain increment, which
# reads nothing back), the caps as field / value pairs (each field must be under its value), then
# field / amount pairs. Answers {answer, the key's fields and values before the increment (none
# for a plain one)}. Nothing when the marker says this increment was applied (3, with the
# fields as they are) or a field is not under its cap (0); else every field
# is checked first (staying within +-9e18, below the 2^63 where HINCRBY fails) and only then are
# all added, the expiry refreshed and the marker set (1). A refused increment writes nothing
# (Redis does not undo a half-run script). A damaged key (not a hash) or field (not an integer)
# is replaced, answering 2 so it is logged.
_INCR_SCRIPT = """
local plain = ARGV[4] == ''
local function read() if plain then return {} end return redis.call('HGETALL', KEYS[1]) end
if ARGV[3] ~= '' and redis.call('HEXISTS', KEYS[2], ARGV[3]) == 1 then return {3, read()} end
local answer = 1
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind ~= 'hash' and kind ~= 'none' then redis.call('DEL', KEYS[1]); answer = 2 end
local before = read()
local first = 5 + 2 * (tonumber(ARGV[4]) or 0)
for i = 5, first - 1, 2 do
  if (tonumber(redis.call('HGET', KEYS[1], ARGV[i])) or 0) >= tonumber(ARGV[i + 1]) then return {0, before} end
end
local bad = {}
for i = first, #ARGV, 2 do
  local current = redis.call('HGET', KEYS[1], ARGV[i]) or '0'
  if not string.match(current, '^-?%d+$') then bad[i] = true; current = '0' end
  if not string.match(ARGV[i + 1], '^-?%d+$') or math.abs(tonumber(current) + tonumber(ARGV[i + 1])) > 9e18 then
    return redis.error_reply('ERR contextwarden: counter ' .. ARGV[i] .. ' would leave the integer range')
  end
end
for i = first, #ARGV, 2 do
  if bad[i] then redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]); answer = 2
  else redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1]) end
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[2], ARGV[3], '1')
  redis.call('EXPIRE', KEYS[2], ARGV[2])
end
return {answer, before}
"""


# Sets the key only while it holds the value whose SHA-1 is ARGV[1] ("" = absent): one atomic step.
_SWAP_SCRIPT = """
local current = redis.call('GET', KEYS[1])
if current then
  if redis.sha1hex(current) ~= ARGV[1] then return 0 end
elseif ARGV[1] ~= '' then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
return 1
"""


def redis_client(url: str, timeout: float = DEFAULT_REDIS_TIMEOUT) -> aioredis.Redis:
    """The client a `RedisStore` sends with: pooled (`REDIS_MAX_CONNECTIONS`), a connect bounded
    by `timeout` seconds and each answer by `REDIS_READ_TIMEOUT_FACTOR` times that.

    Raises:
        ConfigError: the URL is not a Redis URL (names the `redis_url` valve).
    """
    try:
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=REDIS_MAX_CONNECTIONS,
            timeout=max(timeout, REDIS_POOL_WAIT_SECONDS),
            socket_timeout=timeout * REDIS_READ_TIMEOUT_FACTOR,
            socket_connect_timeout=timeout,
        )
    except ValueError:
        # Not the parser's message: it quotes parts of the URL, password included (a password
        # with "/" or "#" ends the host part early and is read as the port).
        raise ConfigError(
            "redis_url is not a valid Redis URL (check host:port, and %-encode / # ? @ : in the password)",
            valve="redis_url",
        ) from None
    return aioredis.Redis(connection_pool=pool)


def open_store(redis_url: str) -> Store:
    """A `RedisStore` for a URL, or a `MemoryStore` when the URL is empty.

    Raises:
        ConfigError: the URL is not a Redis URL (names the `redis_url` valve).
    """
    url = redis_url.strip()
    if not url:
        return MemoryStore()
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError("redis_url must start with redis://, rediss:// or unix://", valve="redis_url")
    return RedisStore(url)
