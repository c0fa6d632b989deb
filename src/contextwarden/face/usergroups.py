"""A user's Open WebUI groups (ids and names), read through Open WebUI's own models.

Looked up lazily (in `sys.modules`: Open WebUI has imported its models by the time a chat
runs), only when a limit override names a group; outside Open WebUI, or in a version without
the call, there are no groups and the other limits still apply. Remembered
per worker for a minute: a group change shows within that time.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import sys
import time
from collections.abc import Awaitable, Callable

from ..caches import MAX_REMEMBERED_USERS

__all__ = ["GroupReader", "GROUPS_TTL_SECONDS"]

groups_log = logging.getLogger("contextwarden")

OPEN_WEBUI_GROUPS = "open_webui.models.groups"
GROUPS_TTL_SECONDS = 60.0
MAX_GROUPS_PER_USER = 1_000

Lookup = Callable[[str], Awaitable[object] | object]


def _open_webui_lookup() -> Lookup | None:
    """`Groups.get_groups_by_member_id` of the running Open WebUI, None when it is not there."""
    module = sys.modules.get(OPEN_WEBUI_GROUPS)  # Open WebUI's main module imports it at start-up
    groups = getattr(module, "Groups", None) if module is not None else None
    return getattr(groups, "get_groups_by_member_id", None)


class GroupReader:
    """`await reader.groups(user_id)`: the ids and names of the user's groups (empty when unknown)."""

    def __init__(self, lookup: Lookup | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._lookup = lookup
        self._looked_up = lookup is not None
        self._clock = clock
        self._memo: dict[str, tuple[float, frozenset[str]]] = {}

    async def groups(self, user_id: str) -> frozenset[str]:
        memo = self._memo.get(user_id)
        if memo is not None and memo[0] > self._clock():
            return memo[1]
        if not self._looked_up:
            self._lookup, self._looked_up = _open_webui_lookup(), True
        if self._lookup is None:
            return frozenset()
        try:
            found = await self._call(user_id)
        except Exception as exc:  # the limits without group overrides still apply
            groups_log.warning("contextwarden: user groups not read (%s); group limits skipped", type(exc).__name__)
            return frozenset()
        names = frozenset(
            str(value)
            for group in list(found if isinstance(found, (list, tuple)) else [])[:MAX_GROUPS_PER_USER]
            for value in (getattr(group, "id", None), getattr(group, "name", None))
            if value
        )
        if len(self._memo) >= MAX_REMEMBERED_USERS:
            self._memo.clear()
        self._memo[user_id] = (self._clock() + GROUPS_TTL_SECONDS, names)
        return names

    async def _call(self, user_id: str) -> object:
        lookup = self._lookup
        assert lookup is not None
        if inspect.iscoroutinefunction(lookup):
            return await lookup(user_id)
        result = await asyncio.to_thread(lookup, user_id)  # older versions: synchronous database access
        return await result if inspect.isawaitable(result) else result
