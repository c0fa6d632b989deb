"""Live OpenRouter prices: one fetch of the public model list into a PriceBook, and a holder
that refreshes it in the background (never on the request path) and keeps the last good one."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone

import httpx

from .errors import PricingError
from .pricing import PriceBook

__all__ = [
    "DEFAULT_OPENROUTER_URL",
    "DEFAULT_PRICE_FETCH_TIMEOUT",
    "DEFAULT_PRICING_TTL_HOURS",
    "DEFAULT_PRICE_RETRY_SECONDS",
    "fetch_openrouter_prices",
    "LivePrices",
]

DEFAULT_OPENROUTER_URL = "https://openrouter.ai/api/v1/models"
DEFAULT_PRICE_FETCH_TIMEOUT = 10.0
DEFAULT_PRICING_TTL_HOURS = 24.0
DEFAULT_PRICE_RETRY_SECONDS = 600.0

_LIVE_PRICES_LOG = logging.getLogger("contextwarden")


async def fetch_openrouter_prices(
    client: httpx.AsyncClient,
    url: str = DEFAULT_OPENROUTER_URL,
    timeout: float = DEFAULT_PRICE_FETCH_TIMEOUT,
) -> PriceBook:
    """GET OpenRouter's public model list (no key needed) and read it into a PriceBook.

    Args:
        client: the httpx client to use (the caller owns and closes it).
        url: the models endpoint.
        timeout: seconds for the whole request.

    Raises:
        PricingError: timeout, connection or HTTP error, non-JSON body, or no usable model.

    Example:
        >>> async with httpx.AsyncClient() as client:  # doctest: +SKIP
        ...     book = await fetch_openrouter_prices(client)
    """
    try:
        async with asyncio.timeout(timeout):  # one deadline for connect, read and body
            response = await client.get(url, timeout=timeout,
                                        headers={"Accept": "application/json"})
        response.raise_for_status()
    except (TimeoutError, httpx.TimeoutException) as exc:
        raise PricingError(f"OpenRouter prices: no answer within {timeout:g}s") from exc
    except httpx.HTTPStatusError as exc:
        raise PricingError(f"OpenRouter prices: HTTP {exc.response.status_code}") from exc
    except httpx.HTTPError as exc:
        raise PricingError(f"OpenRouter prices: {type(exc).__name__}") from exc
    try:
        payload = response.json()
    except ValueError as exc:
        raise PricingError("OpenRouter prices: the answer is not JSON") from exc
    now = time.time()
    day = datetime.fromtimestamp(now, tz=timezone.utc).strftime("%Y-%m-%d")
    return PriceBook.from_openrouter(payload, source="openrouter", fetched_at=now, source_date=day)


class LivePrices:
    """The last good OpenRouter price book, refreshed in the background when stale.

    At most one refresh runs at a time per instance (one instance per worker process);
    the request path reads `book` and calls `refresh_in_background()`, never awaiting a
    fetch. A failed refresh keeps the last good book, logs one warning and waits
    `retry_seconds` before the next attempt. `shared_get`/`shared_put` are the seam for
    sharing the serialized table between workers (e.g. through Redis).
    """

    __slots__ = ("_fallback", "_live", "_url", "_ttl_seconds", "_timeout", "_retry_seconds",
                 "_client", "_shared_get", "_shared_put", "_clock", "_task", "_next_attempt")

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
        self._ttl_seconds = ttl_hours * 3600.0
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

    async def _refresh_quietly(self) -> None:
        """refresh(), turning any failure into one warning and a retry delay."""
        try:
            await self.refresh()
        except Exception as exc:  # fail open: the last good book stays
            self._next_attempt = self._clock() + self._retry_seconds
            detail = str(exc) if isinstance(exc, PricingError) else type(exc).__name__
            _LIVE_PRICES_LOG.warning(
                "contextwarden: live prices not refreshed (%s); using %s prices from %s",
                detail, self.book.source, self.book.source_date)

    async def refresh(self) -> PriceBook:
        """Take a fresh shared table if there is one, else fetch from OpenRouter and share it.

        Raises:
            PricingError: the fetch failed (the current book is kept).
        """
        if self._shared_get is not None:
            try:
                text = await self._shared_get()
                shared = PriceBook.from_json(text, source="openrouter") if text else None
            except Exception as exc:  # a broken share must not stop the fetch
                _LIVE_PRICES_LOG.debug("contextwarden: shared price table unusable: %s",
                                       type(exc).__name__)
                shared = None
            if self._is_fresh(shared):
                self._live = shared
                return shared
        if self._client is not None:
            book = await fetch_openrouter_prices(self._client, self._url, self._timeout)
        else:
            async with httpx.AsyncClient() as client:
                book = await fetch_openrouter_prices(client, self._url, self._timeout)
        self._live = book
        self._next_attempt = 0.0
        if self._shared_put is not None:
            try:
                await self._shared_put(book.to_json())
            except Exception as exc:
                _LIVE_PRICES_LOG.debug("contextwarden: price table not shared: %s",
                                       type(exc).__name__)
        return book
