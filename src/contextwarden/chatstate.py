"""What the filter remembers about one chat between turns: the last trim decision and the pins.

Pure: the filter reads and writes the bytes through the store. The key hashes the user id
with the chat id, so one user's state can never be read for another user's chat, and no id
appears in a Redis key name.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace

from .flags import Flags

__all__ = ["ChatState", "chat_state_key", "MAX_PINS"]

MAX_PINS = 256  # pinned messages remembered per chat; the oldest pins go first
CHAT_STATE_VERSION = 1


@dataclass(frozen=True, slots=True)
class ChatState:
    """One chat's state.

    `decision` is the last `TrimDecision` really sent, as its own JSON text (opaque here);
    `shadow_decision` the last one shadow mode computed but did not send, kept apart so shadow
    turns simulate enforce's prefix reuse without ever passing an unsent choice to enforce;
    `pins` are `pin_fingerprint`s of pinned messages, oldest first; `pin_mode` is on between
    `!+pin` and `!-pin`.
    """

    decision: str | None = None
    pins: tuple[str, ...] = ()
    pin_mode: bool = False
    shadow_decision: str | None = None

    def to_bytes(self) -> bytes:
        data = {"v": CHAT_STATE_VERSION, "decision": self.decision, "pins": list(self.pins), "pin_mode": self.pin_mode}
        if self.shadow_decision is not None:  # absent otherwise: earlier versions read the same bytes
            data["shadow_decision"] = self.shadow_decision
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes | None) -> ChatState:
        """The state stored as `raw`; an empty state for None or anything this version did not write."""
        return cls.parse(raw) or cls()

    @classmethod
    def parse(cls, raw: bytes | None) -> ChatState | None:
        """The state stored as `raw` (empty for None); None for bytes this version did not write,
        which a caller must not write over (another version's state, or damaged: it expires)."""
        if raw is None:
            return cls()
        try:
            data = json.loads(raw)
            if not isinstance(data, dict) or data.get("v") != CHAT_STATE_VERSION:
                return None
            decision = data["decision"] if isinstance(data["decision"], str) else None
            pins = tuple(p for p in data["pins"] if isinstance(p, str))[-MAX_PINS:]
            shadow = data.get("shadow_decision")
            return cls(decision, pins, data["pin_mode"] is True, shadow if isinstance(shadow, str) else None)
        except (ValueError, KeyError, TypeError):
            return None

    def with_flags(self, flags: Flags, latest_fingerprint: str | None) -> ChatState:
        """The state after the latest user message's flags: `!+pin`/`!-pin` switch pin mode
        (the last one written wins), then the message is pinned when `!pin` or pin mode says so."""
        pin_mode = self.pin_mode if flags.sticky_pin is None else flags.sticky_pin
        pins = self.pins
        if latest_fingerprint is not None and (flags.pin or pin_mode) and latest_fingerprint not in pins:
            pins = (pins + (latest_fingerprint,))[-MAX_PINS:]
        return replace(self, pins=pins, pin_mode=pin_mode)


def chat_state_key(user_id: str, chat_id: str) -> str | None:
    """The store key for one user's chat; None when either id is missing (API callers)."""
    if not user_id or not chat_id:
        return None
    digest = hashlib.blake2b(f"{user_id}\0{chat_id}".encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
    return f"chat:v{CHAT_STATE_VERSION}:{digest}"
