"""Sources Open WebUI puts before the latest question after inlet, and their cut to a room.

Open WebUI (0.12.4: `apply_source_context_to_messages`) adds an attached file's text, its
retrieved passages or web results to the latest user message between the inlet and the
request hooks: its RAG template holding `<source id=.. name=..>...</source>` blocks, a newline,
then the text inlet sent. The stored chat keeps the question bare, so the request pass tells
the sources apart from the user's own words (inlet records the text it sent by `text_digest`),
chooses the history for the bare question (the next turn then finds the same messages and the
same prefix), and sends the sources whole when they fit, else each source's body cut to its
passages most relevant to the question: the template and the source tags stay, so the model
still reads its instructions and cites by id.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from .conversation import Message
from .excerpt import CUT_MARK, chunk_scores, excerpt_text, split_chunks, spread_scores, with_text
from .relevance import wants_whole
from .tokens import TokenCounter

__all__ = [
    "SourcesCut",
    "text_digest",
    "question_text",
    "split_sources",
    "with_sources",
    "sources_tokens",
    "cut_sources",
]

# A block opens with Open WebUI's tag, which always has an id (`get_source_context`); its body is
# the document as written, so it may hold `<source>` tags of its own (a pom.xml's
# `<source>17</source>`): a block ends at the last `</source>` before the next block's tag.
_OPEN = re.compile(r'<source id="[^"]*"[^>]*>')
_CLOSE = "</source>"
# Where the blocks begin: the template's own words name `<source>` tags too ("only when the
# <source> tag includes an explicit id attribute"), so blocks are read only after this.
_CONTEXT = re.compile(r'<context>\s*(?=<source id=")')
LISTED_SHARE = 0.25  # every source's tags stay (cut to nothing or not) while they take at most this of the room


@dataclass(frozen=True, slots=True)
class SourcesCut:
    """The sources as sent: their text, the tokens they add to the question (`sources_tokens`),
    the passages kept of how many, and the tokens the sources uncut would add."""

    text: str
    tokens: int
    kept: int
    total: int
    whole: int

    @property
    def cut(self) -> bool:
        return self.kept < self.total


def text_digest(text: str) -> str:
    """A short digest of a text with its length: how a later pass knows what inlet sent."""
    return f"{len(text)}:{hashlib.blake2b(text.encode('utf-8', 'surrogatepass'), digest_size=8).hexdigest()}"


def _one_text(message: Message) -> tuple[str, int | None] | None:
    """The message's one text: string content, or its only text part (and that part's index)."""
    content = message.get("content")
    if isinstance(content, str):
        return content, None
    if isinstance(content, list):
        texts = [k for k, p in enumerate(content) if isinstance(p, dict) and isinstance(p.get("text"), str)]
        if len(texts) == 1:
            return content[texts[0]]["text"], texts[0]
    return None


def question_text(message: Message) -> str | None:
    """The text `text_digest` is taken of (None for a message with no text or several parts)."""
    slot = _one_text(message)
    return None if slot is None else slot[0]


def split_sources(message: Message, digest: str) -> tuple[str, Message] | None:
    """(the sources, the message as inlet sent it) when `message` is that message, whose
    `text_digest` is `digest`, with text put before it and a newline, as Open WebUI does;
    None otherwise.

    Example:
        >>> asked = {"role": "user", "content": "Who founded it?"}
        >>> sent = {"role": "user", "content": "<context>...</context>\\nWho founded it?"}
        >>> split_sources(sent, text_digest("Who founded it?"))
        ('<context>...</context>', {'role': 'user', 'content': 'Who founded it?'})
    """
    slot = _one_text(message)
    length, _, _ = digest.partition(":")
    if slot is None or not length.isdigit():
        return None
    text, part = slot
    start = len(text) - int(length)
    if start < 1 or text[start - 1] != "\n" or text_digest(text[start:]) != digest:
        return None
    return text[: start - 1], with_text(message, text[start:], part)


def with_sources(message: Message, sources: str) -> Message:
    """`message` with `sources` put back before its text, as Open WebUI put them."""
    slot = _one_text(message)
    if slot is None:
        return message
    return with_text(message, f"{sources}\n{slot[0]}", slot[1])


def sources_tokens(sources: str, question: str, counter: TokenCounter, model: str | None) -> int:
    """The tokens `sources` add to `question` put before it with a newline (`with_sources`): their
    own, the newline's, and the seam's, as the joined text counts: the join may merge a token
    (`</context>\\n` + `\\n` + `\\nWho`) or split one (`</context>` + `\\n` + `/summarize`).

    Example:
        >>> from contextwarden.core.tokens import TokenCounter
        >>> counter = TokenCounter(block=True)
        >>> counter.count_text("</context>\\n", "gpt-4o"), counter.count_text("</context>", "gpt-4o")
        (3, 3)
        >>> sources_tokens("</context>\\n", "\\nWho", counter, "gpt-4o")  # 3 alone: the seam merges one
        2
        >>> sources_tokens("</context>", "/summarize", counter, "gpt-4o")  # 3 alone: the seam splits one
        4
    """
    return counter.count_joined([f"{sources}\n", question], model) - counter.count_text(question, model)


def cut_sources(sources: str, question: str, room: int, counter: TokenCounter, model: str | None) -> SourcesCut:
    """`sources` within `room` tokens (what they add to `question`, `sources_tokens`): whole
    when they fit, else each source body cut to the passages most relevant to `question`
    (spread evenly over them for a question about the whole, `wants_whole`, or when none
    matches it: the user attached them for it), the rest marked as cut; the template and the
    tags are kept. A source none of whose passages goes keeps its tags and a cut mark while
    those of all the sources take at most `LISTED_SHARE` of the room (a few attached files: the
    model knows each); else it is left out, tags and all (many retrieved chunks: their tags and
    cut marks alone would fill the room).

    Example:
        >>> from contextwarden.core.tokens import TokenCounter
        >>> body = "\\n\\n".join(f"Part {n}. " + "Filler text about nothing. " * 20 for n in range(8))
        >>> body += "\\n\\nThe vault code is 7731."
        >>> sources = f'Use the context.\\n<context>\\n<source id="1" name="a.txt">{body}</source>\\n</context>'
        >>> cut = cut_sources(sources, "What is the vault code?", 300, TokenCounter(), None)
        >>> "7731" in cut.text, '<source id="1" name="a.txt">' in cut.text, cut.cut
        (True, True, True)
    """
    whole = sources_tokens(sources, question, counter, model)
    pieces = _source_pieces(sources)
    bodies = [split_chunks(body) for body in pieces[2::4]] if len(pieces) > 1 else [split_chunks(sources)]
    total = sum(len(chunks) for chunks in bodies)
    if whole <= room:
        return SourcesCut(sources, whole, total, total, whole)
    chunks = [chunk for body in bodies for chunk in body]
    owner = [b for b, body in enumerate(bodies) for _ in body]
    scores = [] if wants_whole(question) else chunk_scores(chunks, question)
    if not any(score > 0 for score in scores):  # about the whole, or no passage matches: a spread
        scores = spread_scores(len(chunks))
    mark = counter.count_text(CUT_MARK.format(n="99,999"), model) + 1
    opening = _opening_costs(pieces, len(bodies), counter, model, mark)
    left = room - _kept_frame(pieces, counter, model)
    listed = set(range(len(bodies))) if sum(opening) <= left * LISTED_SHARE else set()  # a few: each named
    left -= sum(opening[b] for b in listed)
    chosen: set[int] = set()
    opened = set(listed)
    for k in sorted((k for k, s in enumerate(scores) if s > 0), key=lambda k: (-scores[k], k)):
        cost = counter.count_text(chunks[k], model) + mark + (0 if owner[k] in opened else opening[owner[k]])
        if cost <= left:
            chosen.add(k)
            opened.add(owner[k])
            left -= cost
    while True:
        text = _rebuilt(pieces, bodies, chosen, listed, counter, model)
        tokens = sources_tokens(text, question, counter, model)
        if tokens <= room or not chosen:
            return SourcesCut(text, tokens, len(chosen), total, whole)
        chosen.remove(min(chosen, key=lambda k: (scores[k], -k)))  # joined, the marks counted more


def _kept_frame(pieces: list[str], counter: TokenCounter, model: str | None) -> int:
    """What the sources cost with none of them: the template around the blocks."""
    return counter.count_text(pieces[0] + pieces[-1], model) if len(pieces) > 1 else 0


def _opening_costs(pieces: list[str], count: int, counter: TokenCounter, model: str | None, mark: int) -> list[int]:
    """What sending a source at all costs, each: its tags, what follows it, and one cut mark."""
    if len(pieces) == 1:
        return [mark]
    last = count - 1
    return [
        counter.count_text(pieces[4 * b + 1] + pieces[4 * b + 3] + (pieces[4 * b + 4] if b < last else ""), model)
        + mark
        for b in range(count)
    ]


def _source_pieces(sources: str) -> list[str]:
    """The sources as frame, open tag, body, close tag, frame, ... (one piece when the blocks
    are not inside a `<context>` as Open WebUI's templates put them). A block's body runs to
    the last `</source>` before the next block (the last block's, before `</context>`): read
    up to the first, a document's own `</source>` ended its block, and the rest of it went
    whole as frame (a pom.xml and a report sent 4,582 tokens into a room of 900)."""
    found = _CONTEXT.search(sources)
    if found is None:
        return [sources]
    rest = sources[found.end() :]
    tags = list(_OPEN.finditer(rest))
    pieces = [sources[: found.end()] + rest[: tags[0].start()]]
    for k, tag in enumerate(tags):
        end = tags[k + 1].start() if k + 1 < len(tags) else len(rest)
        segment = rest[tag.end() : end]
        stop = segment.rfind("</context>") if k + 1 == len(tags) else -1
        stop = stop if stop >= 0 else len(segment)
        close = segment.rfind(_CLOSE, 0, stop)
        if close < 0:  # an unclosed block: its text is its body
            pieces += [tag.group(0), segment[:stop], "", segment[stop:]]
        else:
            pieces += [tag.group(0), segment[:close], _CLOSE, segment[close + len(_CLOSE) :]]
    return pieces


def _rebuilt(
    pieces: list[str],
    bodies: list[list[str]],
    chosen: set[int],
    listed: set[int],
    counter: TokenCounter,
    model: str | None,
) -> str:
    """The sources with each body's chunks kept as `chosen` says (numbered across all bodies);
    a source none of whose chunks is chosen left out, its tags and the text after it too,
    unless `listed` (then its tags and one cut mark go)."""
    first = 0
    if len(pieces) == 1:
        return excerpt_text(bodies[0], sorted(chosen), counter, model)[0]
    out = [pieces[0]]
    for b, chunks in enumerate(bodies):
        kept = [k - first for k in range(first, first + len(chunks)) if k in chosen]
        first += len(chunks)
        if kept or b in listed:
            cut = excerpt_text(chunks, kept, counter, model)[0]
            out += [pieces[4 * b + 1], cut, pieces[4 * b + 3], pieces[4 * b + 4]]
    if len(out) > 1:
        out[-1] = pieces[-1]  # the last source sent ends the blocks as the last one did
    else:
        out.append(pieces[-1])
    return "".join(out)
