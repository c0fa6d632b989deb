"""The sources Open WebUI puts before the question between a turn's passes, on a later pass.

Open WebUI (`apply_source_context_to_messages`) puts its RAG template with `<source>` blocks
before the latest question after inlet, and again on a tool loop's calls. A later pass tells them
apart by the digests earlier passes noted of the question they sent (`TurnNote.asked`), trims the
chat without them, cuts them to the room the chat leaves, and puts them back, counted joined to
the question as they are sent (`core.sources` holds the text rules; this, the turn's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ..core.conversation import Message, latest_question
from ..core.sources import (
    SourcesCut,
    cut_sources,
    question_text,
    sources_tokens,
    split_sources,
    text_digest,
    with_sources,
)
from ..core.tokens import TokenCounter
from ..money.records import TurnChoice

__all__ = ["SOURCES_SHARE", "asked_digest", "split_turn_sources", "cut_turn_sources", "with_turn_sources"]

SOURCES_SHARE = 0.5  # sources Open WebUI put before the question may take this much of the budget from history

# Sources are where Open WebUI put them: on the question, the last user message of the turn's
# first call. A tool loop's later calls may follow it with Open WebUI's tool images message, which
# hid the sources when taken for the question: `latest_question` passes over it.


def asked_digest(messages: Sequence[Message]) -> str | None:
    """`text_digest` of the latest user message's text (None without one that has a single text)."""
    if (at := latest_question(messages)) is None or (text := question_text(messages[at])) is None:
        return None
    return text_digest(text)


def split_turn_sources(messages: list[Message], asked: Sequence[str]) -> tuple[int, str, list[Message]] | None:
    """(the latest user message's index, the sources before it, the messages with the question
    as an earlier pass sent it, `asked` its digests) when Open WebUI put sources before it since;
    else None."""
    if (at := latest_question(messages)) is None:
        return None
    for digest in reversed(asked):  # the newest copy first: what a tool loop's next call gets
        if (found := split_sources(messages[at], digest)) is not None:
            sources, question = found
            return at, sources, [*messages[:at], question, *messages[at + 1 :]]
    return None


def cut_turn_sources(
    text: str, messages: list[Message], at: int, room: int, counter: TokenCounter, model_id: str
) -> SourcesCut:
    """The sources within what the chat the first pass chose leaves of `room`, and at least
    `SOURCES_SHARE` of it: what they add to the question holds the answer more often than
    what it would push out of the history."""
    chat = counter.count_messages(messages, model_id)
    room = max(room - chat, int(room * SOURCES_SHARE))
    return cut_sources(text, question_text(messages[at]) or "", room, counter, model_id)


def with_turn_sources(choice: TurnChoice, cut: SourcesCut, counter: TokenCounter, model_id: str) -> TurnChoice:
    """`choice` with the sources Open WebUI put before the question after the first pass put
    back (the last user message, a cut copy or not); what was cut of them counted as removed
    and as a document excerpted. The sources were counted on the question the first pass sent:
    one this pass cut again may join them with another token at the seam, counted here."""
    messages = choice.messages
    if (at := latest_question(messages)) is None:
        return choice
    sent = [*messages[:at], with_sources(messages[at], cut.text), *messages[at + 1 :]]
    asked = question_text(messages[at])
    seam = 0 if asked is None else sources_tokens(cut.text, asked, counter, model_id) - cut.tokens
    excerpts = choice.excerpts
    if cut.cut:
        kind = "document" if not excerpts.told[0] or excerpts.kind == "document" else "long message"
        passages = (excerpts.passages[0] + cut.kept, excerpts.passages[1] + cut.total)
        excerpts = replace(excerpts, count=excerpts.count + 1, passages=passages, kind=kind)
    removed = cut.whole - cut.tokens
    return replace(
        choice,
        messages=sent,
        tokens_before=choice.tokens_before + removed + seam,
        tokens_after=choice.tokens_after + seam,
        excerpts=excerpts,
    )
