"""Inline `!flags` in a user's message, and the admin's allowlist of which flags users may use.

A flag is a word of its own (whitespace or the text's edge on both sides) outside code:
`!full`, `!budget=N`, `!keep=N`, `!pin`, `!nosum`, `!+pin`, `!-pin` (case-insensitive).
Only the latest user message's flags act; allowed flags are removed from every user message
(as copies) so the model never sees them. Anything else that looks like a flag (`!budget=abc`,
`!pinned`, `a!b`, a flag in a code span, any flag in a text over `MAX_FLAG_SCAN_CHARS`) is
ordinary text and stays as it was. Code spans are found in linear time (hostile backtick
runs cost no more than text); older messages' results are memoised. No I/O.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Collection, Iterable, Sequence
from dataclasses import asdict, dataclass, replace

from ..caches import CODE_MEMO_SIZE, register
from .conversation import Message, latest_question, message_text

__all__ = [
    "code_spans",
    "MAX_FLAG_SCAN_CHARS",
    "FLAG_NAMES",
    "DEFAULT_ALLOWED_FLAGS",
    "Flags",
    "FlagRead",
    "read_flags",
    "already_read",
    "parse_flag_names",
    "pin_fingerprint",
]

FLAG_NAMES = ("full", "budget", "keep", "pin", "nosum", "+pin", "-pin")
DEFAULT_ALLOWED_FLAGS = "budget,keep,pin,nosum,+pin,-pin"  # `full` bypasses the budget: admins opt in
MAX_FLAG_BUDGET = 999_999_999  # nine digits: any larger number is not a flag
MAX_FLAG_KEEP = 1_000
MAX_MALFORMED_SHOWN = 3  # `!budget=` / `!keep=` words of a question said back as not understood, at most

# A flag stands alone: nothing but whitespace (or the text's edge) on either side.
_FLAG_TOKEN = re.compile(r"(?<!\S)!(\+pin|-pin|full|pin|nosum|budget=\d{1,9}|keep=\d{1,4})(?!\S)", re.IGNORECASE)
# A fence opens a block at a line's start (after spaces or tabs) and closes at a line holding
# just the same fence; unclosed, it runs to the end. Outside fences, a run of N backticks opens
# a code span that closes at the next run of exactly N (CommonMark); unmatched runs are text.
_FENCE_LINE = re.compile(r"^[ \t]*(`{3,}|~{3,})", re.MULTILINE)
_BACKTICK_RUN = re.compile(r"`+")
# Flags are read in texts up to this long; a longer text is sent as written. All or nothing, so
# removing flags never brings unread text into reach: a second read (request after inlet) and a
# pin fingerprint see what the first read saw.
MAX_FLAG_SCAN_CHARS = 32_768
_outside_code_memo: dict[tuple[int, int], tuple[int, ...]] = {}  # older messages come back every turn
register("flags._outside_code_memo", _outside_code_memo.clear)
# What every flag contains: a text without it has no flag, whatever its code spans (a literal
# "!" first lets the regex engine skip to each "!" instead of trying every position).
_FLAG_HINT = re.compile(r"!(?:[+-]pin|full|pin|nosum|budget=\d|keep=\d)", re.IGNORECASE)
_FLAG_START = re.compile(r"![-+pfnbkPFNBK]")  # a cheaper first test: a case-insensitive search scans slower
# A word that means a number flag but is none (`!budget=2k`, `!keep=0`, `!budget=2000.`): said
# back in the status line, so the user knows it did not act; its value shown only when plain.
_MEANT_FLAG = re.compile(r"(?<!\S)!(budget|keep)=(\S*)", re.IGNORECASE)
_PLAIN_VALUE = re.compile(r"[A-Za-z0-9.,:+-]{1,12}\Z")
_SPACES_AFTER = re.compile(r"[ \t]*")
_SPACES_BEFORE = re.compile(r"[ \t]*\Z")


@dataclass(frozen=True, slots=True)
class Flags:
    """What the latest user message asked for.

    `sticky_pin` is True for `!+pin`, False for `!-pin`, None when neither was given.
    `used` lists the flags that act, as normalized text (`!budget=2000`); `refused` the
    well-formed flags the admin has not enabled (left in the text); `malformed` the words meant
    as a number flag that are none (`!budget=2k`: left in the text, said back as not understood).
    """

    full: bool = False
    budget: int | None = None
    keep: int | None = None
    pin: bool = False
    nosum: bool = False
    sticky_pin: bool | None = None
    used: tuple[str, ...] = ()
    refused: tuple[str, ...] = ()
    malformed: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        """A JSON-ready form (to hand the flags from `inlet` to later passes of the same turn)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, value: dict) -> Flags:
        """The inverse of `to_dict`; raises on anything it did not write."""
        return cls(
            full=value["full"] is True,
            budget=_positive_or_none(value["budget"]),
            keep=_positive_or_none(value["keep"]),
            pin=value["pin"] is True,
            nosum=value["nosum"] is True,
            sticky_pin=value["sticky_pin"] if isinstance(value["sticky_pin"], bool) else None,
            used=tuple(str(x) for x in value["used"]),
            refused=tuple(str(x) for x in value["refused"]),
            malformed=tuple(str(x) for x in value.get("malformed", ())),  # a note of an older worker
        )


@dataclass(frozen=True, slots=True)
class FlagRead:
    """The messages with allowed flag text removed (copies where changed), and the flags.

    `latest_user` is the index of the latest user message, the question (`latest_question`: not
    the tool images Open WebUI adds in a tool loop); None when there is none.
    """

    messages: list[Message]
    flags: Flags
    latest_user: int | None

    def changed(self, original: Sequence[Message]) -> bool:
        """True when some message of `original` had flag text removed."""
        return any(a is not b for a, b in zip(self.messages, original, strict=True))


def _positive_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def parse_flag_names(text: str) -> tuple[frozenset[str], list[str]]:
    """The flag names an allowlist valve names, and the entries it did not understand.

    Entries are comma- or space-separated flag names with or without `!` (`budget, !pin`);
    `*` or `all` means every flag, `full` included.

    Example:
        >>> allowed, unknown = parse_flag_names("budget, !pin, +pin, shout")
        >>> sorted(allowed), unknown
        (['+pin', 'budget', 'pin'], ['shout'])
    """
    allowed: set[str] = set()
    unknown: list[str] = []
    for entry in re.split(r"[,\s]+", text.strip().lower()):
        name = entry.removeprefix("!").split("=", 1)[0]
        if not name:
            continue
        if name in ("*", "all"):
            allowed.update(FLAG_NAMES)
        elif name in FLAG_NAMES:
            allowed.add(name)
        else:
            unknown.append(entry)
    return frozenset(allowed), unknown


def _fences(text: str) -> list[tuple[int, int]]:
    """The fenced blocks of `text` as (start, end) spans, in one pass over its fence lines."""
    spans: list[tuple[int, int]] = []
    opener: re.Match[str] | None = None
    for line in _FENCE_LINE.finditer(text):
        if opener is None:
            if text.find("\n", line.end()) >= 0:  # an opener needs a line after it
                opener = line
        elif line.group(1) == opener.group(1) and not text[line.end() : _line_end(text, line.end())].strip(" \t"):
            spans.append((opener.start(), _line_end(text, line.end())))
            opener = None
    if opener is not None:
        spans.append((opener.start(), len(text)))
    return spans


def _line_end(text: str, position: int) -> int:
    end = text.find("\n", position)
    return len(text) if end < 0 else end


def _inline_spans(text: str, start: int, end: int) -> list[tuple[int, int]]:
    """Code spans in text[start:end]: each backtick run paired with the next run of its length.

    Linear: one pass over the runs from the right notes each run's next run of the same
    length; one pass from the left takes the spans (an unpaired run is ordinary text).
    """
    runs = [m.span() for m in _BACKTICK_RUN.finditer(text, start, end)]
    following: list[int] = [-1] * len(runs)
    latest: dict[int, int] = {}
    for index in range(len(runs) - 1, -1, -1):
        length = runs[index][1] - runs[index][0]
        following[index] = latest.get(length, -1)
        latest[length] = index
    spans: list[tuple[int, int]] = []
    index = 0
    while index < len(runs):
        closer = following[index]
        if closer < 0:
            index += 1
            continue
        spans.append((runs[index][0], runs[closer][1]))
        index = closer + 1
    return spans


def code_spans(text: str) -> list[tuple[int, int]]:
    r"""Where `text` holds code (fenced blocks, then inline spans between them), in order.

    Example:
        >>> code_spans("a `b` ``c`` ` d\n```\ne\n```")
        [(2, 5), (6, 11), (16, 25)]
    """
    if "`" not in text and "~~~" not in text:
        return []
    spans: list[tuple[int, int]] = []
    position = 0
    for fence_start, fence_end in (*_fences(text), (len(text), len(text))):
        if "`" in text[position:fence_start]:
            spans += _inline_spans(text, position, fence_start)
        if fence_start < fence_end:
            spans.append((fence_start, fence_end))
        position = fence_end
    return spans


def _may_hold_flags(text: str) -> bool:
    """Whether a flag name follows some `!` in `text` (most messages hold none)."""
    return "!" in text and _FLAG_START.search(text) is not None and _FLAG_HINT.search(text) is not None


def _readable(text: str) -> bool:
    """Whether flags in `text` are read: not too long, and some `!` followed by a flag name."""
    return len(text) <= MAX_FLAG_SCAN_CHARS and _may_hold_flags(text)


def _flag_matches(text: str) -> Iterable[re.Match[str]]:
    """Well-formed flags outside code, in order (none in a text over `MAX_FLAG_SCAN_CHARS`)."""
    if not _readable(text):
        return []
    matches = list(_FLAG_TOKEN.finditer(text))
    if not matches or ("`" not in text and "~~~" not in text):
        return matches
    key = (len(text), hash(text))
    starts = _outside_code_memo.get(key)
    if starts is None:
        starts = _outside_code(text, [m.start() for m in matches])
        if len(_outside_code_memo) >= CODE_MEMO_SIZE:
            _outside_code_memo.clear()
        _outside_code_memo[key] = starts
    return [m for m in matches if m.start() in starts]


def _outside_code(text: str, positions: list[int]) -> tuple[int, ...]:
    """The ascending `positions` that no code span of `text` covers."""
    code = code_spans(text)
    kept, at = [], 0
    for position in positions:  # both in order: one walk
        while at < len(code) and code[at][1] <= position:
            at += 1
        if at == len(code) or position < code[at][0]:
            kept.append(position)
    return tuple(kept)


def _flag_name(token: str) -> str:
    return token.lower().split("=", 1)[0]


def _valid(token: str) -> bool:
    """The value of `budget`/`keep` is in range (`!budget=0`, `!keep=0` are malformed)."""
    if "=" not in token:
        return True
    name, value = token.lower().split("=", 1)
    number = int(value)
    return 1 <= number <= (MAX_FLAG_BUDGET if name == "budget" else MAX_FLAG_KEEP)


def _strip(text: str, allowed: Collection[str]) -> tuple[str, list[str], list[str]]:
    """`text` without its allowed flags, the allowed tokens removed and the refused ones kept."""
    out: list[str] = []
    used: list[str] = []
    refused: list[str] = []
    position = 0
    for match in _flag_matches(text):
        token = match.group(1)
        if not _valid(token):
            continue
        if _flag_name(token) not in allowed:
            refused.append("!" + token.lower())
            continue
        used.append("!" + token.lower())
        before = text[position : match.start()]
        spaces = _SPACES_AFTER.match(text, match.end())  # both patterns always match
        after_end = spaces.end() if spaces else match.end()
        if after_end == len(text) or text[after_end] == "\n":
            trailing = _SPACES_BEFORE.search(before)
            before = before[: trailing.start() if trailing else len(before)]  # flag ended the line
            line_start = position + len(before)
            if after_end < len(text) and (line_start == 0 or text[line_start - 1] == "\n"):
                after_end += 1  # and was alone on it: drop the emptied line
        out.append(before)
        position = after_end
    if not used:
        return text, used, refused
    out.append(text[position:])
    stripped = "".join(out).strip()
    left = ["!" + m.group(1).lower() for m in _flag_matches(stripped) if _valid(m.group(1))]
    if left != refused:
        # Removing them turned code into flags (`!pin ``` `) or flags into code (a fence now
        # opens before a `!pin`): leave it all as written, so the message means what it did.
        return text, [], refused
    return stripped, used, refused


def _strip_message(message: Message, allowed: Collection[str]) -> tuple[Message, list[str], list[str]]:
    """A copy of `message` without allowed flags (the same dict when it has none)."""
    content = message.get("content")
    if isinstance(content, str):
        text, used, refused = _strip(content, allowed)
        return ({**message, "content": text} if used else message), used, refused
    if not isinstance(content, list):
        return message, [], []
    parts: list = []
    used = []
    refused = []
    for part in content:
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            text, part_used, part_refused = _strip(part["text"], allowed)
            used += part_used
            refused += part_refused
            if part_used:
                if not text:
                    continue  # an empty text part is rejected by some providers
                part = {**part, "text": text}
        parts.append(part)
    if not used:
        return message, used, refused
    if not parts:
        parts = [{"type": "text", "text": ""}]
    return {**message, "content": parts}, used, refused


def _flags_of(used: Sequence[str], refused: Sequence[str]) -> Flags:
    """Flags from the tokens of one message, in order: a later value wins."""
    values: dict = {}
    for token in used:
        name, _, number = token[1:].partition("=")
        if name in ("budget", "keep"):
            values[name] = int(number)
        elif name in ("+pin", "-pin"):
            values["sticky_pin"] = name == "+pin"
        else:
            values[name] = True
    return Flags(**values, used=tuple(dict.fromkeys(used)), refused=tuple(dict.fromkeys(refused)))


def read_flags(messages: Sequence[Message], *, allowed: Collection[str]) -> FlagRead:
    """Remove allowed flags from user messages and read those of the latest user message.

    Flags in older user messages are removed too (they acted on their own turn; Open WebUI
    sends the history as the user typed it) but do not act again. Messages without flags are
    passed on as the same dicts; the input is never modified.

    Args:
        messages: OpenAI-format messages.
        allowed: flag names users may use (see `FLAG_NAMES`, `parse_flag_names`).

    Example:
        >>> read = read_flags([{"role": "user", "content": "!budget=2000 Why? !pin"}], allowed={"budget", "pin"})
        >>> read.messages[0]["content"], read.flags.budget, read.flags.pin
        ('Why?', 2000, True)
    """
    latest = latest_question(messages)
    out = list(messages)
    flags = Flags()
    for index, message in enumerate(messages):
        if message.get("role") != "user" or (index != latest and not allowed):
            continue  # with no flag allowed, nothing is removed: only the latest is read (to say so)
        content = message.get("content")
        if type(content) is str and not _readable(content):
            continue  # most messages: no flag can be in them
        out[index], used, refused = _strip_message(message, allowed)
        if index == latest:
            flags = _flags_of(used, refused)
    if latest is not None and (malformed := _malformed(message_text(messages[latest]))):
        flags = replace(flags, malformed=malformed)
    return FlagRead(out, flags, latest)


def _malformed(text: str) -> tuple[str, ...]:
    """The words of `text` outside code meant as `!budget=` or `!keep=` that are no flag, as shown
    back (`!budget=2k`; `!budget=…` when the value is not plain), at most `MAX_MALFORMED_SHOWN`.

    Example:
        >>> _malformed("!budget=2k and !keep=0, !budget=3000 `!keep=x`")
        ('!budget=2k', '!keep=0,')
    """
    if len(text) > MAX_FLAG_SCAN_CHARS or "=" not in text:
        return ()
    found = [m for m in _MEANT_FLAG.finditer(text) if not _flag_word(m.group(0))]
    if found and ("`" in text or "~~~" in text):
        outside = set(_outside_code(text, [m.start() for m in found]))
        found = [m for m in found if m.start() in outside]
    shown = (f"!{m.group(1).lower()}={m.group(2) if _PLAIN_VALUE.match(m.group(2)) else '…'}" for m in found)
    return tuple(dict.fromkeys(shown))[:MAX_MALFORMED_SHOWN]


def already_read(messages: Sequence[Message], flags: Flags) -> FlagRead:
    """The messages as a later pass of a turn reads them: as they come, with the `flags` its first
    pass read (and removed). Not read again: a text that pass left alone, too long to read
    (`MAX_FLAG_SCAN_CHARS`), may since have been shortened or excerpted into range, and its flag
    would then act in one pass and not the other.

    Example:
        >>> read = already_read([{"role": "user", "content": "Why? !pin"}], Flags(budget=2000))
        >>> read.messages[0]["content"], read.flags.budget, read.flags.pin
        ('Why? !pin', 2000, False)
    """
    return FlagRead(list(messages), flags, latest_question(messages))


def pin_fingerprint(message: Message) -> str:
    """A short hash naming a message by its words, less every word that is a well-formed flag.

    Stable whether or not the flags were stripped and whichever flags are allowed, so a pin
    made on one turn finds its message on later turns: stripping removes only flag words and
    whitespace, so the words left are the same. Not `_strip` with every flag allowed: that
    leaves a text as written when removing its flags would move code (a flag before a fence),
    and what it left then depended on which flags an earlier strip had taken out.

    Example:
        >>> text = "!budget=100 !keep=2 ```\\n ```\\n !budget=100 !keep=2 ```\\n ```"
        >>> sent = read_flags([{"role": "user", "content": text}], allowed={"budget"}).messages[0]
        >>> sent["content"][:8], pin_fingerprint(sent) == pin_fingerprint({"role": "user", "content": text})
        ('!keep=2 ', True)
    """
    text = message_text(message)
    words = text.split()
    if _may_hold_flags(text):
        words = [w for w in words if not _flag_word(w)]
    data = f"{message.get('role')}\0{' '.join(words)}".encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=12).hexdigest()


def _flag_word(word: str) -> bool:
    """Whether one whitespace-delimited word is a well-formed flag (in code or not)."""
    match = _FLAG_TOKEN.fullmatch(word) if word.startswith("!") else None
    return match is not None and _valid(match.group(1))
