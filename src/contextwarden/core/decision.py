"""What a turn decided to send, as a record the next turn can read: `TrimDecision` (the kept
messages' fingerprints, the recall blocks as `Recall`, the excerpts' chunk numbers; versioned
JSON, never text) and the fingerprints themselves (`message_fingerprint`, `Fingerprints`).
Fingerprints are cached per process (`DEFAULT_FINGERPRINT_CACHE_SIZE` = 20,000 messages, LRU,
under 3 MiB), keyed by a cheap stand-in for the content; the fingerprint itself is BLAKE2b
over canonical JSON, the same in every process.
"""

from __future__ import annotations

import hashlib
import json
import operator
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Any

from ..caches import DEFAULT_FINGERPRINT_CACHE_SIZE, lru_hit, register
from .conversation import Message, part_count

__all__ = ["TrimDecision", "Recall", "message_fingerprint", "Fingerprints", "DECISION_FORMAT"]

# 3: the kept messages' fingerprints run together in one text, their positions with runs of 3
# or more as [start, count] (~16 bytes a kept message, not ~24: `_packed`, `_position_runs`).
# 2: a recall block may quote passages (`Recall.parts`). 1 and 2 are read as well.
DECISION_FORMAT = 3
_READ_FORMATS = (1, 2, DECISION_FORMAT)
_SHORTEST_RUN = 3  # a run of fewer positions is shorter in JSON as its numbers
_FINGERPRINTS = re.compile(r"(?:[0-9a-f]{16})*")  # `_packed` fingerprints: 16 hex digits each
FINGERPRINT_ONE_CALL_PARTS = 1_000  # a message in more parts is encoded piece by piece (`_many_parts`)
_CANONICAL_JSON = json.JSONEncoder(sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
_fingerprint_lock = threading.Lock()
_fingerprint_cache: OrderedDict[int, str] = OrderedDict()  # ~125 bytes an entry: under 3 MiB when full


def _clear_fingerprints() -> None:
    with _fingerprint_lock:
        _fingerprint_cache.clear()


register("decision._fingerprint_cache", _clear_fingerprints)


@dataclass(frozen=True, slots=True)
class Recall:
    """One recall block a turn sent: quoting the messages at input positions `at` (with
    fingerprints `kept`), right before the kept message at position `anchor` (the question it
    was made for; for the block a selection quotes, its first user message sent, which may come
    before what it quotes: `fresh._quoted_blocks`). The next turn sends it again, rebuilt from the
    same messages, while they are still there: the prompt then only grows at its end. `acked`: an
    assistant `SUMMARY_ACK` followed it (False in decisions written before: that block is sent
    again with one, so the prompt differs from the previous one from that block on, once, and
    roles alternate from then on). `parts`:
    per quoted message, the chunk numbers (`excerpt.split_chunks`) of the passages it quotes, or
    () for the whole message; empty when every message is quoted whole.

    Example:
        >>> r = Recall(9, (1, 4), ("a" * 16, "b" * 16), parts=((), (2, 5)))
        >>> Recall.from_list(r.to_list()) == r, r.to_list()[4]
        (True, [[], [2, 5]])
        >>> held = Recall(2, (5, 7), ("a" * 16, "b" * 16))  # a selection's quotes, before its first question
        >>> Recall.from_list(held.to_list()) == held
        True
    """

    anchor: int
    at: tuple[int, ...]
    kept: tuple[str, ...]
    acked: bool = True
    parts: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.parts and not any(self.parts):
            object.__setattr__(self, "parts", ())  # all whole: the short form

    def passages(self, k: int) -> tuple[int, ...]:
        """The chunk numbers quoted of the `k`-th quoted message; () when it goes whole."""
        return self.parts[k] if self.parts else ()

    def to_list(self) -> list[object]:
        """Its JSON form `[anchor, [positions], fingerprints, 1, [[chunks], ...]]` (the 1:
        acknowledged; the chunk lists only when a message is quoted by passages), positions and
        fingerprints stored as the decision's (`_position_runs`, `_packed`; a list of each before
        format 3)."""
        tail = [[list(p) for p in self.parts]] if self.parts else []
        at, kept = _position_runs(self.at), _packed(self.kept)
        return [self.anchor, at, kept, *([1] if self.acked or tail else []), *tail]

    @classmethod
    def from_list(cls, value: object) -> Recall | None:
        """From its JSON form (see `to_list`; without the last items before the acknowledgement
        and passages); None when it is not one."""
        if not (
            isinstance(value, list)
            and 3 <= len(value) <= 5
            and (len(value) == 3 or (value[3] == 1 and type(value[3]) is int))
            and type(value[0]) is int
            and isinstance(value[1], list)
        ):
            return None
        try:
            kept = _stored_kept(value[2], packed=True)
        except ValueError:
            return None
        at = _run_positions(tuple(value[1]), len(kept))
        if not at:
            return None
        parts = _chunk_lists(value[4], len(at)) if len(value) == 5 else ()
        if not _ascending(at) or value[0] in at or parts is None:  # (the anchor is sent in place)
            return None
        return cls(value[0], at, kept, acked=len(value) >= 4, parts=parts)


def _chunk_lists(value: object, count: int) -> tuple[tuple[int, ...], ...] | None:
    """A recall's chunk lists from JSON: one ascending list of ints a quoted message; None when not."""
    if not isinstance(value, list) or len(value) != count:
        return None
    if not all(isinstance(p, list) and _ascending(p) for p in value):
        return None
    return tuple(tuple(p) for p in value)


@dataclass(frozen=True, slots=True)
class TrimDecision:
    """What one trim kept, for the next turn of the same chat: fingerprints, no text.

    `kept` holds the fingerprints (see `message_fingerprint`) of the kept non-system messages
    in order, and `at` their positions in the list it was made for (so the next turn checks
    those positions first instead of fingerprinting the whole chat); `tokens` what was sent;
    `max_tokens` the budget it was made for. `seen` is the length of that list, `seen_tokens`
    what its non-system messages cost as counted with `counted_with` (an encoding's name, or
    "estimate"), and `seen_chars` their `history_chars`: with these the next turn knows the
    whole chat's size without reading the messages it dropped again.

    Example:
        >>> d = TrimDecision(max_tokens=1000, tokens=640, strategy="relevance", kept=("a1b2c3d4e5f60718",))
        >>> TrimDecision.from_json(d.to_json()) == d
        True
    """

    max_tokens: int
    tokens: int
    strategy: str
    kept: tuple[str, ...]
    at: tuple[int, ...] = ()
    seen: int = 0
    seen_tokens: int = 0
    seen_chars: int = -1
    counted_with: str = ""
    recalls: tuple[Recall, ...] = ()
    excerpts: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (position, chunk numbers) of excerpted messages
    # positions of the `seen` messages that are documents (`trim_types.documents`): the next turn's
    # shortcut tells a document it drops without counting it; None when not known (written before)
    documents: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        """Positions that cannot be right (not one ascending int per kept message) are dropped,
        and the size figures with them: they only ever cost the fast path. So are recall blocks
        not anchored at a kept message."""
        at = self.at
        if at and (len(at) != len(self.kept) or not _ascending(at)):
            object.__setattr__(self, "at", ())
        if not self.at and self.seen:
            object.__setattr__(self, "seen", 0)
        if self.recalls and not all(r.anchor in self.at for r in self.recalls):
            object.__setattr__(self, "recalls", ())
        if self.excerpts and not all(_excerpt_record_ok(e, self.at) for e in self.excerpts):
            object.__setattr__(self, "excerpts", ())
        documents = self.documents
        if documents is not None and not (isinstance(documents, tuple) and _ascending(documents, self.seen)):
            object.__setattr__(self, "documents", None)

    def relocated(self, where: Mapping[int, int]) -> TrimDecision:
        """This decision for another list of the same messages (a later pass's input and the
        chat it came from): each position through `where`. A kept message with no place there is
        no longer kept, a recall block or excerpt with one goes; the size figures go (they
        describe the list the decision saw), so the next turn reads the chat whole.

        Example:
            >>> d = TrimDecision(900, 600, "relevance", ("a" * 16, "b" * 16), at=(1, 2), seen=3)
            >>> d.relocated({1: 4, 2: 7}).at, d.relocated({2: 7}).kept
            ((4, 7), ('bbbbbbbbbbbbbbbb',))
        """
        if len(self.at) != len(self.kept):  # no positions recorded: the fingerprints alone
            return TrimDecision(self.max_tokens, self.tokens, self.strategy, self.kept)
        kept = [(k, where[i]) for k, i in zip(self.kept, self.at, strict=True) if i in where]
        recalls = tuple(
            replace(r, anchor=where[r.anchor], at=tuple(where[i] for i in r.at))
            for r in self.recalls
            if r.anchor in where and all(i in where for i in r.at)
        )
        return TrimDecision(
            self.max_tokens,
            self.tokens,
            self.strategy,
            tuple(k for k, _ in kept),
            tuple(i for _, i in kept),
            recalls=recalls,
            excerpts=tuple((where[i], chunks) for i, chunks in self.excerpts if i in where),
        )

    def to_dict(self) -> dict:
        """This decision as JSON values (what the filter stores per chat, inside `ChatState`)."""
        return {
            "v": DECISION_FORMAT,
            "max_tokens": self.max_tokens,
            "tokens": self.tokens,
            "strategy": self.strategy,
            "kept": _packed(self.kept),
            "at": _position_runs(self.at),
            "seen": [self.seen, self.seen_tokens, self.seen_chars, self.counted_with],
            "recalls": [r.to_list() for r in self.recalls],
            "excerpts": [[i, list(chunks)] for i, chunks in self.excerpts],
        } | ({} if self.documents is None else {"docs": list(self.documents)})

    def to_json(self) -> str:
        """A compact JSON text of this decision."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> TrimDecision:
        """Read a decision written by `to_json`; ValueError when it is not one."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a TrimDecision: {type(exc).__name__}") from exc
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: object) -> TrimDecision:
        """Read a decision written by `to_dict`; ValueError when it is not one."""
        if not isinstance(data, dict):
            raise ValueError(f"not a TrimDecision: {type(data).__name__}")
        try:
            if type(data.get("v")) is not int or data["v"] not in _READ_FORMATS:
                raise ValueError(f"unknown decision format {data.get('v')!r}")
            kept = _stored_kept(data["kept"], packed=data["v"] >= 3)
            at = tuple(data.get("at") or ())  # absent in decisions written before positions were kept
            if data["v"] >= 3:
                at = _run_positions(at, len(kept))
            seen = data.get("seen")  # absent in decisions written before the chat's size was kept
            if not (
                isinstance(seen, list)
                and len(seen) == 4
                and all(type(x) is int for x in seen[:3])
                and isinstance(seen[3], str)
            ):
                seen = [0, 0, -1, ""]
            recalls = tuple(Recall.from_list(r) for r in data.get("recalls") or ())  # absent before issue 14
            return cls(
                int(data["max_tokens"]),
                int(data["tokens"]),
                str(data["strategy"]),
                kept,
                at,
                seen[0],
                seen[1],
                seen[2],
                seen[3],
                recalls=tuple(r for r in recalls if r is not None and (not seen[0] or r.at[-1] < seen[0])),
                excerpts=_excerpt_records(data.get("excerpts")),  # absent before excerpts
                documents=tuple(docs) if isinstance(docs := data.get("docs"), list) else None,  # absent before
            )
        except (TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"not a TrimDecision: {type(exc).__name__}") from exc


def _stored_kept(value: object, *, packed: bool) -> tuple[str, ...]:
    """A decision's fingerprints as stored: a list of texts, or (`packed`: format 3) one text
    `_packed` wrote; ValueError when they are not that."""
    if packed and isinstance(value, str):
        return _unpacked(value)
    if not isinstance(value, list) or not all(isinstance(k, str) for k in value):
        raise ValueError("kept must be a list of strings")
    return tuple(value)


def _packed(kept: tuple[str, ...]) -> str | list[str]:
    """Fingerprints as stored: `message_fingerprint`s (16 lowercase hex digits) run together in
    one text (16 characters a message, not 19 as a JSON string and comma; hex, not base64, so the
    single file decodes nothing an auditor has to look twice at); others as a list."""
    joined = "".join(kept)
    if kept and _FINGERPRINTS.fullmatch(joined) and len(joined) == 16 * len(kept):
        return joined
    return list(kept)


def _unpacked(value: str) -> tuple[str, ...]:
    """Fingerprints as `_packed` stored them in one text; ValueError when it is not that."""
    if not _FINGERPRINTS.fullmatch(value):
        raise ValueError("kept is not 16 hex digits a fingerprint")
    return tuple(value[k : k + 16] for k in range(0, len(value), 16))


def _position_runs(at: tuple[int, ...]) -> list[int | list[int]]:
    """Ascending positions as stored: each run of `_SHORTEST_RUN` or more consecutive ones as
    `[start, count]`, the others as themselves (a chat's kept tail is one run).

    Example:
        >>> _position_runs((1, 4, 5, 6, 7, 9, 10)), _run_positions(_position_runs((1, 4, 5, 6, 7, 9, 10)), 7)
        ([1, [4, 4], 9, 10], (1, 4, 5, 6, 7, 9, 10))
    """
    if len(at) >= _SHORTEST_RUN and at[-1] - at[0] == len(at) - 1:  # one run: the common case
        return [[at[0], len(at)]]
    steps = map(operator.sub, at[1:], at)
    ends = [k for k, step in enumerate(steps, 1) if step != 1] + [len(at)]
    out: list[int | list[int]] = []
    start = 0
    for end in ends:
        count = end - start
        out.extend([[at[start], count]] if count >= _SHORTEST_RUN else at[start:end])
        start = end
    return out


def _run_positions(stored: tuple[object, ...], kept: int) -> tuple[int, ...]:
    """Positions as `_position_runs` stored them; () when they are not that or not one for each of the
    `kept` messages (never spread out past that many: a damaged count costs nothing)."""
    at: list[int] = []
    for p in stored:
        if type(p) is int:
            at.append(p)
        elif _is_run(p) and p[1] <= kept - len(at):  # type: ignore[index]
            at.extend(range(p[0], p[0] + p[1]))  # type: ignore[index]
        else:
            return ()
    return tuple(at) if len(at) == kept else ()


def _is_run(value: object) -> bool:
    """A stored `[start, count]` run: two ints, a start of 0 or more and a count of 1 or more."""
    return (
        isinstance(value, list)
        and len(value) == 2
        and type(value[0]) is type(value[1]) is int
        and value[0] >= 0 < value[1]
    )


def _excerpt_records(value: object) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """Excerpt records from their JSON form `[[position, [chunk, ...]], ...]`; () when not that."""
    if not isinstance(value, list) or not all(isinstance(e, list) and len(e) == 2 for e in value):
        return ()
    if not all(type(e[0]) is int and isinstance(e[1], list) and all(type(k) is int for k in e[1]) for e in value):
        return ()
    return tuple((e[0], tuple(e[1])) for e in value)


def _ascending(values: Sequence[Any], below: int | None = None) -> bool:
    """Ints from 0 (below `below`), each greater than the one before: what every position and
    chunk number list of a stored decision must be.

    Example:
        >>> _ascending((0, 3, 7)), _ascending([2, 2]), _ascending((1, 5), below=5), _ascending(("1",))
        (True, False, False, False)
    """
    in_range = all(type(i) is int and 0 <= i and (below is None or i < below) for i in values)
    return in_range and all(a < b for a, b in pairwise(values))


def _excerpt_record_ok(record: object, at: tuple[int, ...]) -> bool:
    """An excerpt record names a kept position and ascending chunk numbers."""
    if not (isinstance(record, tuple) and len(record) == 2 and record[0] in at and isinstance(record[1], tuple)):
        return False
    return _ascending(record[1])


def message_fingerprint(message: Message) -> str:
    """8 bytes of blake2b over the message's canonical JSON, in hex: equal means byte-equal.

    Example:
        >>> message_fingerprint({"role": "user", "content": "hi"})
        'a9a3fe7c2ddc12d3'
    """
    key = _fingerprint_key(message)
    if key is not None:
        cached = lru_hit(_fingerprint_cache, key)
        if cached is not None:
            return cached
    digest = hashlib.blake2b(digest_size=8)
    if _many_parts(message):  # the same bytes piece by piece: one C call would hold the GIL for all
        for piece in _CANONICAL_JSON.iterencode(message):
            digest.update(piece.encode("utf-8", "surrogatepass"))
    else:
        digest.update(_CANONICAL_JSON.encode(message).encode("utf-8", "surrogatepass"))
    fingerprint = digest.hexdigest()
    if key is not None:
        with _fingerprint_lock:
            _fingerprint_cache[key] = fingerprint
            if len(_fingerprint_cache) > DEFAULT_FINGERPRINT_CACHE_SIZE:
                _fingerprint_cache.popitem(last=False)
    return fingerprint


def _many_parts(message: Message) -> bool:
    """More content parts or tool calls than FINGERPRINT_ONE_CALL_PARTS (100,000 parts encode in
    one C call of ~40 ms, every other user's request waiting on the GIL meanwhile)."""
    return part_count(message) > FINGERPRINT_ONE_CALL_PARTS


def _fingerprint_key(message: Message) -> int | None:
    """A cheap stand-in for a message's canonical JSON, in this process only: a message of strings
    only as the hash of its items (CPython keeps each string's hash, so this runs in C); else
    each string as its length and string hash (see `TokenCounter._count`), other JSON scalars
    as their repr, dicts and lists as tagged tuples (a dict in its key order: the same items in
    another order are just a cache miss). None for anything else, and for a message in many
    parts (`_many_parts`): hashed in full, piece by piece."""
    if all(type(value) is str for value in message.values()):  # most messages: hashed in C
        return hash(("s", *message.items()))
    if _many_parts(message):  # its stand-in would be hashed in one C call as long as the encoding
        return None
    try:
        return hash(_key_of(message, 0))
    except _NoKey:
        return None


class _NoKey(Exception):
    """A value `_key_of` does not describe (the message is fingerprinted in full)."""


def _key_of(value: Any, depth: int) -> object:
    kind = type(value)
    if kind is str:
        return (len(value), hash(value))
    if kind is dict and depth < 8:
        return (
            "d",
            *((name, _key_of(item, depth + 1)) if type(name) is str else _no_key() for name, item in value.items()),
        )
    if kind is list and depth < 8:
        return ("l", *(_key_of(item, depth + 1) for item in value))
    if value is None or kind is bool or kind is int or kind is float:
        return repr(value)
    return _no_key()


def _no_key() -> object:
    raise _NoKey


class Fingerprints(Sequence[str]):
    """`message_fingerprint` of each message, computed when first asked for.

    Example:
        >>> prints = Fingerprints([{"role": "user", "content": "hi"}])
        >>> prints[0] == message_fingerprint({"role": "user", "content": "hi"}), len(prints)
        (True, 1)
    """

    __slots__ = ("_messages", "_done")

    def __init__(self, messages: Sequence[Message]) -> None:
        self._messages = messages
        self._done: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._messages)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        done = self._done.get(index)
        if done is None:
            done = self._done[index] = message_fingerprint(self._messages[index])
        return done
