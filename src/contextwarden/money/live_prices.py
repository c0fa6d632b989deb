"""Live OpenRouter prices: one fetch of the public model list into a PriceBook, and a holder
that refreshes it in the background (never on the request path) and keeps the last good one."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

import httpx

from ..errors import PricingError
from ..netclient import async_client
from .pricing import PriceBook, openrouter_unlisted

__all__ = [
    "DEFAULT_OPENROUTER_URL",
    "DEFAULT_PRICE_FETCH_TIMEOUT",
    "DEFAULT_PRICING_TTL_HOURS",
    "DEFAULT_PRICE_RETRY_SECONDS",
    "MIN_PRICING_TTL_HOURS",
    "MAX_PRICING_TTL_HOURS",
    "MAX_PRICE_REPLY_BYTES",
    "fetch_openrouter_prices",
    "pricing_ttl_seconds",
    "LivePrices",
]

DEFAULT_OPENROUTER_URL = "https://openrouter.ai/api/v1/models"
DEFAULT_PRICE_FETCH_TIMEOUT = 10.0
DEFAULT_PRICING_TTL_HOURS = 24.0
DEFAULT_PRICE_RETRY_SECONDS = 600.0
# pricing_ttl_hours is kept in this range: 1e-6 would fetch on every request, inf never.
MIN_PRICING_TTL_HOURS = 0.1
MAX_PRICING_TTL_HOURS = 24.0 * 365
MAX_PRICE_REPLY_BYTES = 16 * 1024 * 1024  # OpenRouter's full list is ~1.5 MiB (2026)

_LIVE_PRICES_LOG = logging.getLogger("contextwarden")


async def fetch_openrouter_prices(
    client: httpx.AsyncClient,
    url: str = DEFAULT_OPENROUTER_URL,
    timeout: float = DEFAULT_PRICE_FETCH_TIMEOUT,
    *,
    max_bytes: int = MAX_PRICE_REPLY_BYTES,
) -> PriceBook:
    """GET OpenRouter's public model list (no key needed) and read it into a PriceBook.

    The body is read up to `max_bytes` and parsed in a worker thread, off the event loop.
    Entries without a prompt or completion price are priced as unknown, with one warning.

    Args:
        client: the httpx client to use (the caller owns and closes it).
        url: the models endpoint.
        timeout: seconds for the whole request.
        max_bytes: a larger answer is refused.

    Raises:
        PricingError: timeout, connection or HTTP error, too large, non-JSON body, or no usable model.

    Example:
        >>> async with httpx.AsyncClient() as client:  # doctest: +SKIP
        ...     book = await fetch_openrouter_prices(client)
    """
    try:
        async with asyncio.timeout(timeout):  # one deadline for connect, read and body
            body = await _read_capped(client, url, timeout, max_bytes)
    except (TimeoutError, httpx.TimeoutException) as exc:
        raise PricingError(f"OpenRouter prices: no answer within {timeout:g}s") from exc
    except httpx.HTTPStatusError as exc:
        raise PricingError(f"OpenRouter prices: HTTP {exc.response.status_code}") from exc
    except httpx.HTTPError as exc:
        raise PricingError(f"OpenRouter prices: {type(exc).__name__}") from exc
    now = time.time()
    day = datetime.fromtimestamp(now, tz=UTC).strftime("%Y-%m-%d")
    return await asyncio.to_thread(_parse_openrouter, body, now, day)


async def _read_capped(client: httpx.AsyncClient, url: str, timeout: float, max_bytes: int) -> bytes:
    """The body of a successful GET, refused once it passes `max_bytes` (declared or read)."""
    too_large = PricingError(f"OpenRouter prices: the answer is larger than {max_bytes:,} bytes")
    request = client.build_request("GET", url, timeout=timeout, headers={"Accept": "application/json"})
    response = await client.send(request, stream=True)
    try:
        response.raise_for_status()
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and len(declared) < 20 and int(declared) > max_bytes:
            raise too_large
        chunks, size = [], 0
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > max_bytes:
                raise too_large
            chunks.append(chunk)
    finally:
        await response.aclose()
    return b"".join(chunks)


def _parse_openrouter(body: bytes, now: float, day: str) -> PriceBook:
    """The PriceBook of a models-list body (run in a worker thread: ~1.5 MiB of JSON)."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise PricingError("OpenRouter prices: the answer is not JSON") from exc
    book = PriceBook.from_openrouter(payload, source="openrouter", fetched_at=now, source_date=day)
    missing, entries = openrouter_unlisted(payload)
    if missing:
        _LIVE_PRICES_LOG.warning(
            "contextwarden: OpenRouter prices: %d of %d models have no prompt or completion price "
            "(empty or renamed `pricing` keys); they are priced as unknown, never $0",
            missing,
            entries,
        )
    return book


def pricing_ttl_seconds(hours: float) -> float:
    """pricing_ttl_hours in seconds, kept from MIN_PRICING_TTL_HOURS to MAX_PRICING_TTL_HOURS."""
    hours = hours if isinstance(hours, (int, float)) and math.isfinite(hours) else DEFAULT_PRICING_TTL_HOURS
    return min(max(hours, MIN_PRICING_TTL_HOURS), MAX_PRICING_TTL_HOURS) * 3600.0


class LivePrices:
    """The last good OpenRouter price book, refreshed in the background when stale.

    At most one refresh runs at a time per instance (one instance per worker process);
    the request path reads `book` and calls `refresh_in_background()`, never awaiting a
    fetch. A failed refresh keeps the last good book, logs one warning and waits
    `retry_seconds` before the next attempt. `shared_get`/`shared_put` are the seam for
    sharing the serialized table between workers (e.g. through Redis).
    """

    __slots__ = (
        "_fallback",
        "_live",
        "_url",
        "_ttl_seconds",
        "_timeout",
        "_retry_seconds",
        "_client",
        "_shared_get",
        "_shared_put",
        "_clock",
        "_task",
        "_next_attempt",
    )

    def __init__(
        self,
        fallback: PriceBook,
        *,
        url: str = DEFAULT_OPENROUTER_URL,
        ttl_hours: float = DEFAULT_PRICING_TTL_HOURS,
        timeout: float = DEFAULT_PRICE_FETCH_TIMEOUT,
        retry_seconds: float = DEFAULT_PRICE_RETRY_SECONDS,
        client: httpx.AsyncClient | None = None,
        shared_get: Callable[[], Awaitable[str | None]] | None = None,
        shared_put: Callable[[str], Awaitable[None]] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """Args: fallback is served until a live book arrives (e.g. PriceBook.from_bundled());
        client, when given, is used for fetches and not closed; clock is wall time in seconds."""
        self._fallback = fallback
        self._live: PriceBook | None = None
        self._url = url
        self._ttl_seconds = pricing_ttl_seconds(ttl_hours)
        self._timeout = timeout
        self._retry_seconds = retry_seconds
        self._client = client
        self._shared_get = shared_get
        self._shared_put = shared_put
        self._clock = clock
        self._task: asyncio.Task | None = None
        self._next_attempt = 0.0

    @property
    def book(self) -> PriceBook:
        """The live book when one was fetched, else the fallback."""
        return self._live or self._fallback

    def is_stale(self) -> bool:
        """True when there is no live book yet or it is older than `ttl_hours`."""
        return not self._is_fresh(self._live)

    def _is_fresh(self, book: PriceBook | None) -> bool:
        """A book fetched less than ttl ago."""
        if book is None or book.fetched_at is None:
            return False
        return self._clock() - book.fetched_at < self._ttl_seconds

    def refresh_in_background(self) -> asyncio.Task | None:
        """Start a refresh task when stale and none is running; return it, else None.

        Safe to call on every request: it never blocks and never raises.
        """
        if not self.is_stale() or (self._task is not None and not self._task.done()):
            return None
        if self._clock() < self._next_attempt:
            return None
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return None
        self._task = loop.create_task(self._refresh_quietly())
        return self._task

    async def settled(self) -> None:
        """Wait for the background refresh running now, if any, to end (it never raises)."""
        if self._task is not None:
            await asyncio.shield(self._task)

    async def _refresh_quietly(self) -> None:
        """refresh(), turning any failure into one warning and a retry delay."""
        try:
            await self.refresh()
        except Exception as exc:  # fail open: the last good book stays
            self._next_attempt = self._clock() + self._retry_seconds
            detail = str(exc) if isinstance(exc, PricingError) else type(exc).__name__
            _LIVE_PRICES_LOG.warning(
                "contextwarden: live prices not refreshed (%s); using %s prices from %s",
                detail,
                self.book.source,
                self.book.source_date,
            )

    async def refresh(self) -> PriceBook:
        """Take a fresh shared table if there is one, else fetch from OpenRouter and share it.

        Raises:
            PricingError: the fetch failed (the current book is kept).
        """
        if self._shared_get is not None:
            try:
                text = await self._shared_get()
                shared = await asyncio.to_thread(PriceBook.from_json, text, source="openrouter") if text else None
            except Exception as exc:  # a broken share must not stop the fetch
                _LIVE_PRICES_LOG.debug("contextwarden: shared price table unusable: %s", type(exc).__name__)
                shared = None
            if shared is not None and self._is_fresh(shared):
                self._live = shared
                return shared
        if self._client is not None:
            book = await fetch_openrouter_prices(self._client, self._url, self._timeout)
        else:
            async with await async_client() as client:  # its TLS context made off the loop
                book = await fetch_openrouter_prices(client, self._url, self._timeout)
        self._live = book
        self._next_attempt = 0.0
        if self._shared_put is not None:
            try:
                await self._shared_put(book.to_json())
            except Exception as exc:
                _LIVE_PRICES_LOG.debug("contextwarden: price table not shared: %s", type(exc).__name__)
        return book
