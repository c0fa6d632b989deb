"""What a fault of the filter's own tells, and whom: one log line, and the admins once.

A fault is known by where it happened: the hook, the exception's type and the innermost
`file:line` (never its message, which may quote a chat). One fault is one warning a hook call
(an `inlet` whose limit check, trim and charge all fail at one place logs one line, the other
steps at debug), and one a process for the stream hook, which runs for every chunk of every
reply. Admins are told once a fault and process: by the status of the hook that failed when an
admin's turn hit it, else by a notification after an admin's next reply (shown whole, not
saved into the chat). Other users are not told: they cannot fix it, and their chat went on.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Awaitable, Callable

from .hookargs import told_as_admin

__all__ = ["FaultKey", "Faults", "fault_place", "MAX_TOLD_FAULTS"]

faults_log = logging.getLogger("contextwarden")

MAX_TOLD_FAULTS = 64  # distinct faults a process keeps telling admins about (then the log alone)

FaultKey = tuple[str, str, str]
"""(hook, exception type, `file:line`)."""


def fault_place(exc: BaseException) -> str:
    """`file:line` of the innermost frame, for a log line that carries no message text."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    last = frames[-1]
    return f"{last.filename.rsplit('/', 1)[-1]}:{last.lineno}"


class Faults:
    """The faults one Filter saw: which were logged in a scope, which admins were told of."""

    def __init__(self) -> None:
        self._told: set[FaultKey] = set()
        self._untold: dict[FaultKey, None] = {}  # in the order seen
        self._stream_logged: set[FaultKey] = set()

    def log(self, hook: str, exc: BaseException, what: str, then: str, seen: set[FaultKey] | None = None) -> FaultKey:
        """Log `contextwarden: {what} ({type} at {place}); {then}`: a warning the first time the
        fault comes in `seen` (one hook call's set; the stream hook's is the process's), else at
        debug. Returns the fault's key."""
        key: FaultKey = (hook, type(exc).__name__, fault_place(exc))
        if hook == "stream":
            seen = self._stream_logged
        first = seen is None or (key not in seen and len(seen) < MAX_TOLD_FAULTS)
        if seen is not None:
            seen.add(key)
        faults_log.log(
            logging.WARNING if first else logging.DEBUG, "contextwarden: %s (%s at %s); %s", what, key[1], key[2], then
        )
        if key not in self._told and len(self._untold) < MAX_TOLD_FAULTS:
            self._untold[key] = None
        return key

    def tell_now(self, key: FaultKey, user: object) -> bool:
        """Whether the hook that failed shows its status for this fault: to an admin, once."""
        if not told_as_admin(user) or key in self._told or len(self._told) >= MAX_TOLD_FAULTS:
            return False
        self._told.add(key)
        self._untold.pop(key, None)
        return True

    async def tell_later(self, user: object, notify: Callable[[str], Awaitable[None]]) -> None:
        """After an admin's reply: each fault no admin was told of yet, once (`notify` shows it)."""
        if not self._untold or not told_as_admin(user):
            return
        for key in list(self._untold):
            if key in self._told or len(self._told) >= MAX_TOLD_FAULTS:
                continue
            self._told.add(key)
            self._untold.pop(key, None)
            hook, kind, place = key
            await notify(
                f"contextwarden: an internal error in its {hook} hook ({kind} at {place}) was logged; "
                "chats went on without contextwarden's work there"
            )
