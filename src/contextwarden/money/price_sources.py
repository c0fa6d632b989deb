"""Where the filter's prices come from: the admin's file over live OpenRouter over bundled.

One `PriceSources` per Filter instance (so one per worker). It owns the bundled book, the
`LivePrices` holder (refreshed in the background, never awaited on the request path) and the
admin's pricing file (re-read off the event loop when it changes), and caches their layering. With a shared
(Redis) store the live table is shared: the first worker to miss it takes a lock with
`store.add`, fetches and publishes it; the others wait briefly and take the published table.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from ..errors import ConfigError, PricingError
from ..state.store import Store
from .live_prices import LivePrices, pricing_ttl_seconds
from .pricing import PriceBook

__all__ = ["PriceSources", "SHARED_PRICES_KEY"]

SHARED_PRICES_KEY = "prices:openrouter"
SHARED_PRICES_LOCK_SECONDS = 60  # longer than one fetch may take
SHARED_PRICES_WAIT_STEP = 0.5
SHARED_PRICES_WAIT_STEPS = 30  # a worker without the lock waits up to 15 s for the table


class PriceSources:
    """The layered price book for one worker, and the live table's background refresh."""

    def __init__(
        self,
        store: Callable[[], Store],
        *,
        live_factory: Callable[..., LivePrices] | None = None,
        shared_key: str = SHARED_PRICES_KEY,
    ) -> None:
        """Args: store returns the current store (it changes with the redis_url valve);
        live_factory builds the LivePrices holder (default: LivePrices; tests pass one with a
        mocked client); shared_key names the shared table in the store (its lock adds ':lock')."""
        self._store = store
        self._shared_key = shared_key
        self._live_factory = live_factory
        self._bundled: PriceBook | None = None
        self._live: LivePrices | None = None
        self._live_ttl_hours = 0.0
        self._admin: tuple[tuple[str, float], PriceBook | None, str | None] | None = None
        self._layered: tuple[tuple[PriceBook, ...], PriceBook] | None = None
        self._admin_lock = asyncio.Lock()

    @property
    def live(self) -> LivePrices | None:
        """The live holder, once OpenRouter pricing was asked for."""
        return self._live

    def bundled(self) -> PriceBook:
        """The prices generated into the package (built on first use)."""
        if self._bundled is None:
            self._bundled = PriceBook.from_bundled()
        return self._bundled

    async def book(
        self, *, openrouter: bool, ttl_hours: float, pricing_file: str
    ) -> tuple[PriceBook, list[ConfigError]]:
        """The book to price with now, and problems with the pricing_file valve.

        Starts a background refresh of live prices when they are on and stale; never waits
        for it. Layering: admin file > live OpenRouter > bundled.
        """
        problems: list[ConfigError] = []
        layers = [self.bundled()]
        if openrouter:
            live = self._live_holder(ttl_hours)
            live.refresh_in_background()
            if live.book is not layers[0]:
                layers.append(live.book)
        if pricing_file:
            admin, problem = await self._admin_book(pricing_file)
            if problem:
                problems.append(ConfigError(problem, valve="pricing_file"))
            if admin is not None:
                layers.append(admin)
        cached = self._layered
        if (
            cached is None
            or len(cached[0]) != len(layers)
            or any(a is not b for a, b in zip(cached[0], layers, strict=True))
        ):
            book = layers[0]
            for layer in layers[1:]:
                book = book.layered(layer)
            cached = self._layered = (tuple(layers), book)
        return cached[1], problems

    def _live_holder(self, ttl_hours: float) -> LivePrices:
        ttl_hours = pricing_ttl_seconds(ttl_hours) / 3600  # in range, so NaN never differs from itself
        if self._live is None or ttl_hours != self._live_ttl_hours:
            factory = self._live_factory or LivePrices
            self._live = factory(
                self.bundled(), ttl_hours=ttl_hours, shared_get=self._shared_get, shared_put=self._shared_put
            )
            self._live_ttl_hours = ttl_hours
        return self._live

    async def _admin_book(self, path: str) -> tuple[PriceBook | None, str | None]:
        """The admin's file, re-read (in a worker thread, one read at a time) only when its
        modification time changes. Problems name the valve, never its value (the path)."""
        try:
            stamp = (path, os.stat(path).st_mtime)
        except OSError as exc:
            return None, f"pricing_file cannot be read ({exc.strerror}); using live and bundled prices"
        async with self._admin_lock:
            if self._admin is None or self._admin[0] != stamp:
                try:
                    book, unread = await asyncio.to_thread(PriceBook.from_file_checked, path, source="pricing_file")
                    problem = None if unread is None else f"pricing_file: {unread}"
                    self._admin = (stamp, book, problem)
                except Exception as exc:  # any failure: named, and the other prices go on
                    detail = str(exc) if isinstance(exc, PricingError) else f"unreadable ({type(exc).__name__})"
                    self._admin = (
                        stamp,
                        None,
                        f"pricing_file: {detail.removeprefix('pricing_file: ')}; using live and bundled prices",
                    )
        return self._admin[1], self._admin[2]

    async def _shared_get(self) -> str | None:
        """The table another worker published; None = this worker should fetch it."""
        store = self._store()
        if not store.shared:
            return None
        raw = await store.get(self._shared_key)
        if raw:
            return raw.decode()
        if await store.add(self._shared_key + ":lock", b"1", ttl=SHARED_PRICES_LOCK_SECONDS):
            raw = await store.get(self._shared_key)  # published between the read and the lock?
            if not raw:
                return None
            await store.delete(self._shared_key + ":lock")
            return raw.decode()
        for _ in range(SHARED_PRICES_WAIT_STEPS):  # another worker is fetching: wait for it
            await asyncio.sleep(SHARED_PRICES_WAIT_STEP)
            raw = await store.get(self._shared_key)
            if raw:
                return raw.decode()
        return None

    async def _shared_put(self, text: str) -> None:
        store = self._store()
        if not store.shared:
            return
        await store.set(self._shared_key, text.encode(), ttl=max(60, int(self._live_ttl_hours * 3600)))
        await store.delete(self._shared_key + ":lock")
