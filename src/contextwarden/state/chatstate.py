"""What the filter remembers about one chat between turns: the last trim decision and the pins.

Pure: the filter reads and writes the bytes through the store. The key hashes the user id
with the chat id, so one user's state can never be read for another user's chat, and no id
appears in a Redis key name.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection
from dataclasses import dataclass, field, replace

from ..core.chatview import ChatView
from ..core.decision import TrimDecision
from ..core.flags import Flags, pin_fingerprint

__all__ = ["ChatState", "chat_state_key", "MAX_PINS", "CHAT_STATE_VERSION", "MAX_CHAT_STATE_BYTES"]

MAX_PINS = 256  # pinned messages remembered per chat; the oldest pins go first
# 2: decisions as JSON objects. 1: each decision as its own JSON text inside the JSON (still read).
CHAT_STATE_VERSION = 2
READ_VERSIONS = (1, 2)
CHAT_KEY_VERSION = 1  # the key's shape (not the value's): a new value version still finds old state
# A decision costs ~16 bytes a kept message (decision format 3; ~25 in format 2): 30,002 one-word
# messages at a 200k window kept 22,856, 366 KB read and written every pass (569 KB in format 2).
# A state over this many bytes is saved without its decisions (shadow's first): the next turn
# makes a new selection. ~8,170 kept messages (~5,260 in format 2); a chat under it is whole.
MAX_CHAT_STATE_BYTES = 128 * 1024


@dataclass(frozen=True, slots=True)
class ChatState:
    """One chat's state.

    `decision` is the last `TrimDecision` really sent; `shadow_decision` the last one shadow
    mode computed but did not send, kept apart so shadow turns simulate enforce's prefix reuse
    without ever passing an unsent choice to enforce (an enforce save drops it); `pins` are `pin_fingerprint`s of pinned
    messages, oldest first; `pin_mode` is on between `!+pin` and `!-pin`. A decision that cannot
    be read (another version's), or too large to store (`MAX_CHAT_STATE_BYTES`), is None: it is
    simply not reused.

    Example:
        >>> state = ChatState(pins=("a1b2c3d4e5f60718",), pin_mode=True)
        >>> ChatState.from_bytes(state.to_bytes()) == state
        True
    """

    decision: TrimDecision | None = None
    pins: tuple[str, ...] = ()
    pin_mode: bool = False
    shadow_decision: TrimDecision | None = None
    version: int = field(default=CHAT_STATE_VERSION, init=False)  # the format this state is written in

    def to_bytes(self) -> bytes:
        """The state as the store keeps it (compact JSON, this version), at most
        `MAX_CHAT_STATE_BYTES`: without the decisions that would take it over (its pins kept)."""
        text = self.to_json()
        if len(text) > MAX_CHAT_STATE_BYTES:  # ASCII JSON: a character is a byte
            smaller = (replace(self, shadow_decision=None), replace(self, decision=None))
            fitting = (t for t in (s.to_json() for s in smaller) if len(t) <= MAX_CHAT_STATE_BYTES)
            text = next(fitting, replace(self, decision=None, shadow_decision=None).to_json())
        return text.encode()

    def to_json(self) -> str:
        """The whole state as compact JSON (no bound: `to_bytes` is what the store keeps)."""
        data = {
            "v": self.version,
            "decision": None if self.decision is None else self.decision.to_dict(),
            "pins": list(self.pins),
            "pin_mode": self.pin_mode,
        }
        if self.shadow_decision is not None:
            data["shadow_decision"] = self.shadow_decision.to_dict()
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_bytes(cls, raw: bytes | None) -> ChatState:
        """The state stored as `raw`; an empty state for None or anything this version cannot read."""
        return cls.parse(raw) or cls()

    @classmethod
    def from_json(cls, text: str | bytes) -> ChatState | None:
        """The state in a JSON text of version 1 or 2; None for anything else."""
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or data.get("v") not in READ_VERSIONS:
                return None
            pins = tuple(p for p in data["pins"] if isinstance(p, str))[-MAX_PINS:]
            return cls(
                _decision(data["decision"]),
                pins,
                data["pin_mode"] is True,
                _decision(data.get("shadow_decision")),
            )
        except (ValueError, KeyError, TypeError):
            return None

    @classmethod
    def parse(cls, raw: bytes | None) -> ChatState | None:
        """The state stored as `raw` (empty for None); None for bytes this version cannot read,
        which a caller must not write over (a newer version's state, or damaged: it expires)."""
        return cls() if raw is None else cls.from_json(raw)

    @classmethod
    def rejoined(cls, shared: bytes | None, written: bytes | None, seen: bytes | None) -> ChatState | None:
        """The state to go on from once Redis answers again with `shared`, where this worker
        wrote `written` while it was away (None: nothing) over `seen`, what Redis held when the
        worker last read or wrote it. While Redis holds what the worker saw, or nothing (restarted
        empty), the worker's own; else Redis's (another worker saved since: its decisions stay)
        with the pins and pin mode made during the outage. None when `shared` cannot be read.

        Example:
            >>> before, mine, theirs = (ChatState(pins=p).to_bytes() for p in ((), ("p1",), ("p2",)))
            >>> ChatState.rejoined(before, mine, before).pins, ChatState.rejoined(theirs, mine, before).pins
            (('p1',), ('p2', 'p1'))
        """
        current = cls.parse(shared)
        if current is None:
            return None
        if shared is None or shared == seen:  # nothing newer in Redis: what this worker holds
            return cls.parse(written if written is not None else seen) or current
        own = None if written is None else cls.parse(written)
        return current if own is None else own.merged_onto(current, cls.parse(seen)) or current

    def with_pins_of(self, other: ChatState | None, known: Collection[str] = ()) -> ChatState:
        """This state with `other`'s pins added after its own, but for those in `known` (the pins
        both started from: one missing here was pushed out by the limit), the oldest beyond
        `MAX_PINS` out: a pin a worker made while Redis was away joins the shared state."""
        if other is None or not (extra := tuple(p for p in other.pins if p not in self.pins and p not in known)):
            return self
        return replace(self, pins=(self.pins + extra)[-MAX_PINS:])

    def merged_onto(self, current: ChatState | None, read: ChatState | None) -> ChatState | None:
        """What to save over `current`, which another pass saved after this state was made from
        `read`: `current` with the pins this state added to `read` and its pin mode where it
        switched it (the other pass's decisions stay); None when that is `current` itself, or it
        cannot be read. A pin of `read` that `current` no longer holds was pushed out by the
        limit there: it stays out (added again, it would push out a newer one).

        Example:
            >>> ChatState(pins=("p0", "p1")).merged_onto(ChatState(pins=("p2",)), ChatState(pins=("p0",))).pins
            ('p2', 'p1')
        """
        if current is None:
            return None
        merged = current.with_pins_of(self, known=() if read is None else frozenset(read.pins))
        if read is not None and self.pin_mode != read.pin_mode:
            merged = replace(merged, pin_mode=self.pin_mode)
        return None if merged == current else merged

    def decided(self, decision: TrimDecision | None, *, shadow: bool) -> ChatState:
        """The state after a pass chose `decision`: shadow's own, or the one sent, which ends a
        shadow stretch (a later one simulates from what was sent, not from its old choice).

        Example:
            >>> ChatState().decided(None, shadow=False).shadow_decision is None
            True
        """
        if shadow:
            return replace(self, shadow_decision=decision)
        return replace(self, decision=decision, shadow_decision=None)

    def pinned_in(self, view: ChatView, also: Collection[str] = ()) -> list[int]:
        """The positions in `view` of the user messages this state has pinned (and of the copies
        of them an earlier pass of the turn sent: `also`, `TurnNote.pins`)."""
        pins = set(self.pins).union(also)
        if not pins:
            return []
        messages = view.messages
        return [i for i in range(len(view)) if view.role(i) == "user" and pin_fingerprint(messages[i]) in pins]

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
    return f"chat:v{CHAT_KEY_VERSION}:{digest}"


def _decision(raw: object) -> TrimDecision | None:
    """A stored decision: a JSON object (version 2) or its JSON text (version 1); None when absent
    or unreadable (a decision written by another version is simply not reused)."""
    if raw is None:
        return None
    try:
        return TrimDecision.from_json(raw) if isinstance(raw, str) else TrimDecision.from_dict(raw)
    except ValueError:
        return None
