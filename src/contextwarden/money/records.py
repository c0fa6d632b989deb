"""The records a turn carries: those that cross a boundary, each a typed dataclass with a version
and one reader, and the in-process one they are made from.

- `TurnChoice`: what one pass decided to send, with the numbers the status line, the note and
  the accounting read (in this process only: never stored, so it has no version).
- `TurnNote`: what `inlet`/`request` leave in `__metadata__["contextwarden"]` for later passes
  of the same turn and for `outlet` (the same dict object; Open WebUI may re-exec this module
  between them, so a note another version wrote is read too).
- `UsageRecord`: the `usage {json}` log line, one per reply (admins parse it).

The stored chat state is `chatstate.ChatState`; the trim decision inside it `decision.TrimDecision`.
Money is carried as `Decimal` and written as exact decimal text (JSON has no exact decimals);
outlet input is the client's, so every reader bounds what it accepts.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Any

from ..core.conversation import Message
from ..core.decision import TrimDecision, message_fingerprint
from ..core.flags import Flags, pin_fingerprint
from ..core.trim import PINS_DROPPED_NOTE, PINS_SHORTENED_NOTE, TrimResult
from .cache_hints import carried_prefix
from .pricing import read_decimal
from .usage import read_count

__all__ = [
    "NOTE_VERSION",
    "USAGE_RECORD_VERSION",
    "SUMMARY_CALL",
    "CacheView",
    "EXCERPT_KINDS",
    "excerpt_kind",
    "ExcerptCounts",
    "TurnChoice",
    "TurnNote",
    "UsageRecord",
    "usd_text",
    "read_usd",
    "log_value",
]

NOTE_VERSION = 1  # a note without "v" (written before versions were recorded) has this shape
MAX_ORIGINS = 100_000  # messages a first pass sent whose chat positions its note records for later passes
MAX_ADDED = 64  # recall blocks and a summary note one pass adds: one a question the selection kept
PIN_PRINT_LENGTH = 24  # `flags.pin_fingerprint`: 12 bytes as hex
MAX_ASKED = 8  # the question's digests a turn notes (`TurnNote.asked`): the first pass's and the newest copies
USAGE_RECORD_VERSION = 1  # a line without "v" has this shape too
# A usage line's `call` for the summary endpoint's calls; a reply's line has no `call` (added in
# version 1: a reader of it that knows no `call` reads the line as one more priced call).
SUMMARY_CALL = "summary"
MAX_LOG_TEXT = 200  # characters of an id or note in a usage line (ids come from the client)
MAX_RECORD_USD = Decimal(10**9)  # larger amounts in a record are not believed


def usd_text(amount: Decimal | None) -> str | None:
    """An exact decimal string for a log line or note (None, and anything not plausible, is None)."""
    if amount is None or not amount.is_finite() or not -30 <= amount.adjusted() <= 30:
        return None
    return format(amount.normalize(), "f")


def read_usd(raw: object) -> Decimal | None:
    """An amount of USD written by `usd_text` (or a number), signed, bounded; else None."""
    if isinstance(raw, str) and raw.startswith("-"):
        value = read_decimal(raw[1:], ceiling=MAX_RECORD_USD)
        return None if value is None else -value
    return read_decimal(raw, ceiling=MAX_RECORD_USD)


def log_value(value: object) -> object:
    """An id or note for a usage line: text clipped to MAX_LOG_TEXT, numbers only when small."""
    if isinstance(value, str):
        return value[:MAX_LOG_TEXT]
    if isinstance(value, (int, float)) and abs(value) < 10**18:
        return value
    return None if value is None else type(value).__name__


def _count(raw: object) -> int | None:
    """A token or message count from a note (ints only, as the filter writes them), else None."""
    return read_count(raw) if isinstance(raw, int) else None


def _text(raw: object) -> str | None:
    """A short text from a record (clipped as the log line clips it), else None."""
    return raw[:MAX_LOG_TEXT] if isinstance(raw, str) else None


@dataclass(frozen=True, slots=True)
class CacheView:
    """What the provider's cache would serve this turn (provider tokens), noted by the first pass:
    the untrimmed chat's previous prompt, the sent prompt's reused prefix, whether the model
    caches at all, and its minimum cacheable prompt."""

    untrimmed: int = 0
    trimmed: int = 0
    caches: bool = False
    minimum: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"untrimmed": self.untrimmed, "trimmed": self.trimmed, "caches": self.caches, "minimum": self.minimum}

    @classmethod
    def from_dict(cls, raw: object) -> CacheView | None:
        """The view written by `to_dict`; None for anything else (a note is client input in outlet)."""
        if not (
            isinstance(raw, dict)
            and isinstance(raw.get("caches"), bool)
            and all(type(raw.get(k)) is int and raw[k] >= 0 for k in ("untrimmed", "trimmed", "minimum"))
        ):
            return None
        return cls(raw["untrimmed"], raw["trimmed"], raw["caches"], raw["minimum"])


@dataclass(frozen=True, slots=True)
class ExcerptCounts:
    """What a turn sent of earlier messages too large for what was left (sent as excerpts for the
    question), and of a latest user message cut by passages (a document pasted with its
    question): how many, the passages of those sent in part (sent, in all), how many only their
    cut mark went of (too large for the room left), how many documents were `dropped` whole (not
    sent, not quoted: `TrimResult.left_out`), and what they all are in a user's words (`EXCERPT_KINDS`);
    `question` the latest user message's share of `passages` (a later pass that cuts its copy
    again counts from the message as pasted: `cut_again`)."""

    count: int = 0
    passages: tuple[int, int] = (0, 0)
    left_out: int = 0
    kind: str = "document"
    dropped: int = 0
    question: tuple[int, int] = (0, 0)

    @property
    def told(self) -> tuple[int, tuple[int, int], int, str]:
        """`status.excerpt_words`' arguments: the documents excerpted or dropped, the passages,
        those the model saw nothing of, their kind."""
        return self.count + self.dropped, self.passages, self.left_out + self.dropped, self.kind

    def after(self, earlier: ExcerptCounts, chained: bool) -> ExcerptCounts:
        """These counts with the documents an `earlier` pass of the turn dropped, when this pass
        works on what it sent (`chained`: they are not in its input, so it cannot count them)."""
        if not chained or not earlier.dropped:
            return self
        mixed = (self.count or self.dropped) and self.kind != earlier.kind
        return replace(self, dropped=self.dropped + earlier.dropped, kind="long message" if mixed else earlier.kind)

    def cut_again(self, earlier: ExcerptCounts) -> ExcerptCounts:
        """These counts, of a pass that cut by passages again the question an `earlier` pass of the
        turn cut by them (its copy: the chunks sent and the markers), against the message as
        pasted: of the passages the earlier pass counted it has. Not the copy's own chunks and
        those cut before: the copy's text between two cut marks is chunked anew, not as pasted.

        Example:
            >>> ExcerptCounts(1, (5, 7), question=(5, 7)).cut_again(ExcerptCounts(1, (8, 41), question=(8, 41)))
            ExcerptCounts(count=1, passages=(5, 41), left_out=0, kind='document', dropped=0, question=(5, 41))
        """
        (sent, total), pasted = self.question, earlier.question[1]
        if not total or not sent < pasted:
            return self
        return replace(self, passages=(self.passages[0], self.passages[1] - total + pasted), question=(sent, pasted))

    def without_question(self) -> ExcerptCounts:
        """These counts less the latest user message's (`question`): a later pass of the turn that
        cut its copy again middle-out sent none of the passages counted whole.

        Example:
            >>> ExcerptCounts(2, (9, 60), question=(8, 19)).without_question()
            ExcerptCounts(count=1, passages=(1, 41), left_out=0, kind='document', dropped=0, question=(0, 0))
        """
        if not self.question[1] or not self.count:
            return self
        sent, total = self.passages[0] - self.question[0], self.passages[1] - self.question[1]
        count = self.count - 1
        return replace(self, count=count, passages=(sent, total), left_out=min(self.left_out, count), question=(0, 0))


@dataclass(frozen=True, slots=True)
class TurnChoice:
    """What one pass decided to send, with the numbers the status line and outlet need."""

    messages: list[Message]
    count_before: int
    tokens_before: int
    tokens_after: int
    budget: int
    count_mode: str
    decision: TrimDecision | None = None
    dropped: int = 0
    shortened: int = 0
    excerpts: ExcerptCounts = ExcerptCounts()
    over_budget: bool = False
    summarized: bool = False
    full: bool = False
    reused: bool = False  # the previous turn's selection was sent again (the provider's prompt cache can hit)
    carried: int | None = None  # leading messages the next turn sends again unchanged; None = all
    pins_shortened: bool = False  # pinned messages alone were over the budget and were cut middle-out
    pins_dropped: bool = False  # even cut they were over it: kept only while they fit
    fixed_tokens: int = 0  # tool definitions and response format, in every count above
    fixed_label: str = ""  # what they are ("tool definitions", ...)
    fixed_over: bool = False  # they alone fill the budget: only the mandatory messages were sent
    own_budget: bool = False  # `budget` is the user's own (`!budget=N`, their valve), below the window's
    own: tuple[str, ...] = ()  # fingerprints of what the filter added to `messages` (see `added_fingerprints`)
    quoted: int = 0  # the chat's messages its recall blocks quote whole (sent, in a block)
    origins: tuple[int, ...] = ()  # each message's index in the input (-1: added); () unknown
    pins: tuple[str, ...] = ()  # `pin_fingerprint`s of the copies of pinned messages sent (see `with_pins_sent`)

    def with_pins_sent(self, messages: Sequence[Message], pins: Collection[str]) -> TurnChoice:
        """This choice with the `pin_fingerprint` of each pinned message it sends as a changed
        copy (shortened, its flags removed): a later pass of the turn gets that copy, whose own
        fingerprint is no pin of the chat's, and knows it by this (`TurnNote.pins`). `messages`
        is the trim's input, `pins` the pins it knew."""
        if not pins or not self.origins:
            return self
        sent = [
            copy
            for m, k in zip(self.messages, self.origins, strict=True)
            if k >= 0
            and m is not messages[k]
            and messages[k].get("role") == "user"
            and pin_fingerprint(messages[k]) in pins
            and (copy := pin_fingerprint(m)) not in pins  # not its flags alone removed: it reads as the pin
        ]
        return replace(self, pins=tuple(sent[:MAX_ADDED]))

    def plus_fixed(self, tokens: int, label: str, over: bool, total: int) -> TurnChoice:
        """This choice with the request's fixed part (billed with every prompt) in its counts,
        and the whole prompt's budget `total` when that part alone is over it."""
        if not tokens:
            return self
        return replace(
            self,
            tokens_before=self.tokens_before + tokens,
            tokens_after=self.tokens_after + tokens,
            budget=total if over else self.budget + tokens,
            fixed_tokens=tokens,
            fixed_label=label,
            fixed_over=over,
            over_budget=self.over_budget or over,
        )

    @classmethod
    def of(cls, result: TrimResult, messages: list[Message], *, extra: int = 0, extra_tokens: int = 0) -> TurnChoice:
        """From a trim; `extra`/`extra_tokens` count a summary note that was already in the input."""
        count = len(result.kept) + len(result.dropped) + len(result.shortened) + extra
        cut = [p for p in result.passages if p[0] or not p[1]]  # some passages went (or it has no count)
        cut += [(sent, total) for _, sent, total in result.quoted_passages]  # a document read in a block only
        asked = [(sent, total) for _, sent, total in result.shortened_passages]  # a document pasted with its question
        cut += asked
        excerpted = len(result.excerpted) + len(result.quoted_passages) + len(asked)
        return cls(
            messages=messages,
            count_before=count,
            tokens_before=result.tokens_before + extra_tokens,
            tokens_after=result.tokens_after + extra_tokens,
            budget=result.budget + extra_tokens,
            count_mode=result.count_mode,
            decision=result.decision,
            dropped=len(result.dropped),
            shortened=len(result.shortened) - len(result.excerpted) - len(asked),
            excerpts=ExcerptCounts(
                excerpted,
                (sum(p[0] for p in cut), sum(p[1] for p in cut)),
                excerpted - len(cut),
                excerpt_kind(excerpted + len(result.left_out), len(result.tool_results)),
                len(result.left_out),
                (sum(p[0] for p in asked), sum(p[1] for p in asked)),
            ),
            over_budget=result.over_budget,
            reused=result.reused,
            carried=carried_prefix(result) + len(messages) - len(result.messages),  # a summary note goes in before it
            pins_shortened=PINS_SHORTENED_NOTE in result.notes,
            pins_dropped=PINS_DROPPED_NOTE in result.notes,
            own=added_fingerprints(result, messages),
            quoted=len(set(result.recalled).difference(i for i, _ in result.recalled_passages)),
            origins=result.origins if messages is result.messages else (),
        )


# What excerpted long messages, and documents left out whole, are called in the status line:
# pasted documents, tool results (a web search's, a file's), or both in one turn.
EXCERPT_KINDS = ("document", "tool result", "long message")


def excerpt_kind(excerpted: int, tool_results: int) -> str:
    """The word for `excerpted` long messages of which `tool_results` are tool results.

    Example:
        >>> excerpt_kind(2, 0), excerpt_kind(1, 1), excerpt_kind(2, 1)
        ('document', 'tool result', 'long message')
    """
    return (
        "tool result" if tool_results and tool_results >= excerpted else "long message" if tool_results else "document"
    )


def added_fingerprints(result: TrimResult, messages: Sequence[Message]) -> tuple[str, ...]:
    """Fingerprints of what the filter added to `messages` (the trim's output, maybe with a
    summary note put in): its recall blocks and that note, so that a later pass of the turn
    knows them by what was recorded, not by their text (`summarize.own_messages`)."""
    blocks = [result.messages[i] for i in result.added if result.messages[i].get("role") == "user"]
    if len(messages) != len(result.messages):
        trimmed = {id(m) for m in result.messages}
        blocks += [m for m in messages if id(m) not in trimmed and m.get("role") == "user"]
    return tuple(message_fingerprint(m) for m in blocks[:MAX_ADDED])


@dataclass(frozen=True, slots=True)
class TurnNote:
    """One turn's note, from the request hooks to later passes and to outlet.

    Written in groups, each present only once its pass set it: `turn_id` (inlet started the
    turn in this worker: `openturns.OpenTurns` knows it); the trim's figures (`mode` ... `cache`, all set together);
    `flags` (an earlier pass removed them from the text); the context line shown (`line`) or
    left for a later pass or outlet to show (`pending_line`, written by inlet), and its figures
    (`sent_messages`, `shortened`, `excerpted`, `dropped_documents`, `question_passages`: the
    latest user message's cut by passages, which a later pass cutting its copy again counts
    from, `quoted`: the chat's messages its recall blocks quote whole, which a later pass
    sending those blocks again as they were counts too);
    `cache_marked` (the prompt-cache breakpoints this turn placed,
    to take off before trimming again); `added` (the fingerprints of the recall blocks and summary
    note this pass added: how a later pass knows them, see `summarize.own_messages`); `asked` (the
    `sources.text_digest` of the latest question as the first pass sent it, then of each copy a
    later pass cut again to make room for sources: how a later pass tells the sources Open WebUI
    put before it from the user's words, on the first pass's question, which Open WebUI puts
    them before again in a tool loop, or on the copy the previous call sent).
    `removed`/`messages_before` are the tokens an earlier pass removed and the untrimmed chat's
    message count (see `savings.carried_savings`).

    Example:
        >>> note = TurnNote(mode="enforce", estimated_prompt_tokens=640, cost_saved_usd=Decimal("0.0021"))
        >>> TurnNote.from_dict(note.to_dict()) == note
        True
    """

    turn_id: str | None = None
    mode: str | None = None
    estimated_prompt_tokens: int | None = None
    count_mode: str | None = None
    budget: int | None = None
    dropped: int | None = None
    reused: bool = False
    decided: bool = False
    calibration: float | None = None
    comparable: bool = False
    removed: int | None = None
    messages_before: int | None = None
    tokens_saved: int | None = None
    cost_saved_usd: Decimal | None = None
    cache: CacheView | None = None
    flags: Flags | None = None
    line: str | None = None
    sent_messages: int | None = None
    shortened: int | None = None
    quoted: int = 0
    excerpted: int | None = None
    passages: tuple[int, int] | None = None
    left_out: int | None = None
    excerpt_kind: str | None = None
    dropped_documents: int = 0  # documents dropped whole (`ExcerptCounts.dropped`; absent in notes before)
    question_passages: tuple[int, int] | None = None  # `ExcerptCounts.question` (absent in notes before)
    pending_line: str | None = None
    cache_marked: dict[str, Any] | None = None
    added: tuple[str, ...] = ()
    asked: tuple[str, ...] = ()
    origins: tuple[int, ...] = ()
    pins: tuple[str, ...] = ()  # the pinned messages earlier passes sent as copies (`TurnChoice.pins`)
    pins_shortened: bool = False  # an earlier pass shortened pins to fit (its copies may go on as they are)
    pins_dropped: bool = False  # an earlier pass kept pins only while they fit
    version: int = field(default=NOTE_VERSION, init=False)  # the format this note is written in

    def pins_with(self, sent: Sequence[str]) -> tuple[str, ...]:
        """The pins earlier passes sent as copies, and a pass's own (`TurnChoice.pins`)."""
        return _prints_joined(self.pins, sent)

    def added_with(self, own: Sequence[str]) -> tuple[str, ...]:
        """What earlier passes of the turn added, and what a pass adds (`TurnChoice.own`): each
        call of a tool loop gets the first call's output, whose blocks a call in between may have
        let go; noted as its own alone, the next call took such a block for the user's message."""
        return _prints_joined(self.added, own)

    def asked_with(self, digest: str | None) -> tuple[str, ...]:
        """The question's digests with a pass's copy's: the first pass's kept (Open WebUI puts
        the sources before it again in a tool loop that cites), the newest after it."""
        if digest is None or digest in self.asked:
            return self.asked
        return (*self.asked[:1], *self.asked[1:][-(MAX_ASKED - 2) :], digest)

    def excerpt_counts(self, at_most: int) -> ExcerptCounts:
        """The excerpt figures an earlier pass noted, as `ExcerptCounts`; none excerpted when the
        note counts more than `at_most` (the messages the turn began with: not this chat's).

        Example:
            >>> TurnNote(excerpted=2, passages=(1, 9), left_out=1).excerpt_counts(5)
            ExcerptCounts(count=2, passages=(1, 9), left_out=1, kind='document', dropped=0, question=(0, 0))
        """
        count = self.excerpted if self.excerpted is not None and self.excerpted <= at_most else 0
        dropped = self.dropped_documents if self.dropped_documents <= at_most else 0
        passages, kind = self.passages or (0, 0), self.excerpt_kind or "document"
        question = self.question_passages or (0, 0)
        if not count or question[0] > passages[0] or question[1] > passages[1]:  # (not this note's own)
            question = (0, 0)
        return ExcerptCounts(count, passages, min(self.left_out or 0, count), kind, dropped, question)

    def in_shadow(self, choice: TurnChoice) -> TurnChoice:
        """A shadow pass's `choice` with the question as an earlier pass cut it by passages, when
        the fixed part alone is over the budget: the trim then cuts nothing (`shorten=False`, the
        question goes as the earlier pass left it), but shadow's pass reads it as pasted and told
        the whole chat where enforce sends the earlier pass's cut."""
        asked = self.excerpt_counts(choice.count_before).question
        if not choice.fixed_over or choice.full or choice.excerpts.told[0] or not asked[1]:
            return choice
        return replace(choice, excerpts=ExcerptCounts(1, asked, kind=self.excerpt_kind or "document", question=asked))

    def with_excerpts(self, excerpts: ExcerptCounts) -> TurnNote:
        """This note with a pass's excerpt figures (none written when nothing was excerpted or dropped)."""
        if not excerpts.count and not excerpts.dropped:
            return replace(
                self,
                excerpted=0,
                passages=None,
                left_out=None,
                excerpt_kind=None,
                dropped_documents=0,
                question_passages=None,
            )
        return replace(
            self,
            excerpted=excerpts.count,
            passages=excerpts.passages,
            left_out=excerpts.left_out,
            excerpt_kind=excerpts.kind,
            dropped_documents=excerpts.dropped,
            question_passages=excerpts.question if excerpts.question[1] else None,
        )

    @property
    def carried(self) -> dict[str, int]:
        """The earlier pass's savings figures as `savings.carried_savings` reads them."""
        return {
            k: v for k, v in (("removed", self.removed), ("messages_before", self.messages_before)) if v is not None
        }

    def to_dict(self) -> dict[str, Any]:
        """The note as `__metadata__` holds it (JSON values only)."""
        out: dict[str, Any] = {"v": self.version}
        if self.turn_id is not None:
            out["turn"] = self.turn_id
        if self.mode is not None:
            out.update(
                mode=self.mode,
                estimated_prompt_tokens=self.estimated_prompt_tokens,
                count_mode=self.count_mode,
                budget=self.budget,
                dropped=self.dropped,
                reused=self.reused,
                decided=self.decided,
                calibration=self.calibration,
                comparable=self.comparable,
                savings=self.carried,
                tokens_saved=self.tokens_saved,
                cost_saved_usd=usd_text(self.cost_saved_usd),
                cache=None if self.cache is None else self.cache.to_dict(),
            )
        if self.flags is not None:
            out["flags"] = self.flags.to_dict()
        if self.line is not None:
            out["line"] = self.line
        if self.pending_line is not None:
            out["pending_line"] = self.pending_line
        if self.sent_messages is not None:
            out.update(sent_messages=self.sent_messages, shortened=self.shortened, excerpted=self.excerpted)
            if self.quoted:
                out["quoted"] = self.quoted
            if self.passages is not None:
                out["passages"] = list(self.passages)
            if self.left_out:
                out["left_out"] = self.left_out
            if self.excerpt_kind is not None:
                out["excerpt_kind"] = self.excerpt_kind
            if self.dropped_documents:
                out["dropped_documents"] = self.dropped_documents
            if self.question_passages is not None:
                out["question_passages"] = list(self.question_passages)
        if self.cache_marked is not None:
            out["cache_marked"] = self.cache_marked
        if self.added:
            out["added"] = list(self.added)
        if self.asked:
            out["asked"] = list(self.asked)
        if self.origins:
            out["origins"] = _runs(self.origins)
        if self.pins:
            out["pins"] = list(self.pins)
        out.update(
            {k: True for k, v in (("pins_shortened", self.pins_shortened), ("pins_dropped", self.pins_dropped)) if v}
        )
        return out

    @classmethod
    def from_dict(cls, raw: object) -> TurnNote:
        """The note in `raw`: what this version and earlier ones wrote; every field bounded (outlet
        input is the client's), anything unreadable left at its default, an unknown version empty."""
        if not isinstance(raw, dict) or raw.get("v", NOTE_VERSION) != NOTE_VERSION:
            return cls()
        carried = raw.get("savings")
        savings: dict[str, Any] = carried if isinstance(carried, dict) else {}
        flags = raw.get("flags")
        line = raw.get("line")
        turn_id = raw.get("turn")
        mode, count_mode = raw.get("mode"), raw.get("count_mode")
        calibration = raw.get("calibration")
        return cls(
            turn_id=turn_id if isinstance(turn_id, str) and len(turn_id) <= 64 else None,
            mode=mode if isinstance(mode, str) else None,
            estimated_prompt_tokens=_count(raw.get("estimated_prompt_tokens")),
            count_mode=count_mode if isinstance(count_mode, str) else None,
            budget=_count(raw.get("budget")),
            dropped=_count(raw.get("dropped")),
            reused=raw.get("reused") is True,
            decided=bool(raw.get("decided")),
            calibration=calibration if isinstance(calibration, float) else None,
            comparable=raw.get("comparable") is True,
            removed=savings.get("removed") if isinstance(savings.get("removed"), int) else None,
            messages_before=savings.get("messages_before") if isinstance(savings.get("messages_before"), int) else None,
            tokens_saved=_count(raw.get("tokens_saved")),
            cost_saved_usd=read_usd(raw.get("cost_saved_usd")),
            cache=CacheView.from_dict(raw.get("cache")),
            flags=_flags_of_turn(flags) if isinstance(flags, dict) else None,
            line=line if isinstance(line, str) else None,
            sent_messages=_count(raw.get("sent_messages")),
            shortened=_count(raw.get("shortened")),
            quoted=_count(raw.get("quoted")) or 0,
            excerpted=_count(raw.get("excerpted")),
            passages=_passage_counts(raw.get("passages")),
            left_out=_count(raw.get("left_out")),
            excerpt_kind=raw["excerpt_kind"] if raw.get("excerpt_kind") in EXCERPT_KINDS else None,
            dropped_documents=_count(raw.get("dropped_documents")) or 0,
            question_passages=_passage_counts(raw.get("question_passages")),
            pending_line=raw["pending_line"] if isinstance(raw.get("pending_line"), str) else None,
            cache_marked=raw["cache_marked"] if isinstance(raw.get("cache_marked"), dict) else None,
            added=_fingerprints(raw.get("added")),
            asked=_digests(raw.get("asked")),
            origins=_unrun(raw.get("origins")),
            pins=_fingerprints(raw.get("pins"), PIN_PRINT_LENGTH),
            pins_shortened=raw.get("pins_shortened") is True,
            pins_dropped=raw.get("pins_dropped") is True,
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> TurnNote:
        """The note in a JSON text (an empty note when it is not JSON)."""
        try:
            return cls.from_dict(json.loads(text))
        except ValueError:
            return cls()


def _prints_joined(earlier: Sequence[str], new: Sequence[str]) -> tuple[str, ...]:
    """`earlier` then `new`, each fingerprint once, the newest `MAX_ADDED`."""
    return tuple(dict.fromkeys((*earlier, *new)))[-MAX_ADDED:]


def _passage_counts(value: object) -> tuple[int, int] | None:
    """`passages` as an earlier pass wrote it: (sent, in all), each a count (else none)."""
    if not isinstance(value, list) or len(value) != 2:
        return None
    sent, total = (_count(v) for v in value)
    return (sent, total) if sent is not None and total is not None and sent <= total else None


def _runs(origins: Sequence[int]) -> list[list[int]]:
    """`origins` as runs `[first, length]` of consecutive positions (-1 for a run of the filter's own)."""
    runs: list[list[int]] = []
    for i in origins:
        last = runs[-1] if runs else None
        if last is not None and (i == -1 == last[0] or (i >= 0 and last[0] >= 0 and i == last[0] + last[1])):
            last[1] += 1
        else:
            runs.append([i, 1])
    return runs


def _unrun(raw: object) -> tuple[int, ...]:
    """The origins `_runs` wrote; () for anything else or more than `MAX_ORIGINS` messages."""
    if (
        not isinstance(raw, list)
        or len(raw) > MAX_ORIGINS
        or not all(
            isinstance(r, list) and len(r) == 2 and type(r[0]) is int and type(r[1]) is int and r[0] >= -1 and r[1] > 0
            for r in raw
        )
    ):
        return ()
    if sum(r[1] for r in raw) > MAX_ORIGINS:
        return ()
    return tuple(i for first, n in raw for i in ([-1] * n if first < 0 else range(first, first + n)))


def _fingerprints(value: object, length: int = 16) -> tuple[str, ...]:
    """`added` (or `pins`, `length` 24) as an earlier pass wrote it: at most `MAX_ADDED`
    fingerprints (else none)."""
    if not isinstance(value, list) or len(value) > MAX_ADDED:
        return ()
    return tuple(v for v in value if isinstance(v, str) and len(v) == length)


def _digests(value: object) -> tuple[str, ...]:
    """`asked` as an earlier pass wrote it: a list of at most `MAX_ASKED` digests (one text
    before they were listed), each at most 40 characters (else none)."""
    listed = [value] if isinstance(value, str) else value
    if not isinstance(listed, list) or len(listed) > MAX_ASKED:
        return ()
    return tuple(v for v in listed if isinstance(v, str) and len(v) <= 40)


def _flags_of_turn(value: dict) -> Flags:
    """The flags an earlier pass of this turn left in the note (none when unreadable)."""
    try:
        return Flags.from_dict(value)
    except (KeyError, TypeError, ValueError):
        return Flags()


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """One reply's (or summary call's: `call`) `usage {json}` line: who, which model, the billed
    counts, cost and savings.

    Ids and notes are clipped (`log_value`), money is exact decimal text, `null` means unknown.

    Example:
        >>> r = UsageRecord(model="gpt-4o", prompt_tokens=321, completion_tokens=12, cost_usd=Decimal("0.0009225"))
        >>> UsageRecord.from_json(r.to_json()) == r
        True
    """

    model: object = None
    resolved_model: object = None
    user_id: object = None
    chat_id: object = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None
    estimated: bool = False
    estimated_prompt_tokens: int | None = None
    usage_shape: str | None = None
    cost_usd: Decimal | None = None
    cost_source: str | None = None
    cost_note: object = None
    mode: str | None = None
    tokens_saved: int | None = None
    cost_saved_usd: Decimal | None = None
    call: str | None = None  # `SUMMARY_CALL` for a summary call; None (no key) for a reply
    version: int = field(default=USAGE_RECORD_VERSION, init=False)  # the format this line is written in

    def to_dict(self) -> dict[str, Any]:
        call = {} if self.call is None else {"call": log_value(self.call)}
        return {
            "model": log_value(self.model),
            "resolved_model": log_value(self.resolved_model),
            "user_id": log_value(self.user_id),
            "chat_id": log_value(self.chat_id),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "reasoning_tokens": self.reasoning_tokens,
            "estimated": self.estimated,
            "estimated_prompt_tokens": self.estimated_prompt_tokens,
            "usage_shape": self.usage_shape,
            "cost_usd": usd_text(self.cost_usd),
            "cost_source": self.cost_source,
            "cost_note": log_value(self.cost_note),
            "mode": self.mode,
            "tokens_saved": self.tokens_saved,
            "cost_saved_usd": usd_text(self.cost_saved_usd),
            **call,
            "v": self.version,
        }

    def to_json(self) -> str:
        """The JSON after `usage ` in the log line (compact, keys in a fixed order)."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> UsageRecord:
        """A record from a line's JSON, this version's or an earlier one's (no "v"); ValueError
        when it is not one."""
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"not a usage record: {type(exc).__name__}") from exc
        if not isinstance(data, dict) or data.get("v", USAGE_RECORD_VERSION) != USAGE_RECORD_VERSION:
            raise ValueError("not a usage record of this version")
        return cls(
            model=log_value(data.get("model")),
            resolved_model=log_value(data.get("resolved_model")),
            user_id=log_value(data.get("user_id")),
            chat_id=log_value(data.get("chat_id")),
            prompt_tokens=_count(data.get("prompt_tokens")),
            completion_tokens=_count(data.get("completion_tokens")),
            cached_tokens=_count(data.get("cached_tokens")),
            reasoning_tokens=_count(data.get("reasoning_tokens")),
            estimated=data.get("estimated") is True,
            estimated_prompt_tokens=_count(data.get("estimated_prompt_tokens")),
            usage_shape=_text(data.get("usage_shape")),
            cost_usd=read_usd(data.get("cost_usd")),
            cost_source=_text(data.get("cost_source")),
            cost_note=log_value(data.get("cost_note")),
            mode=_text(data.get("mode")),
            tokens_saved=_count(data.get("tokens_saved")),
            cost_saved_usd=read_usd(data.get("cost_saved_usd")),
            call=_text(data.get("call")),
        )
