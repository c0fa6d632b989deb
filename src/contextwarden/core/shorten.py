"""The mandatory part of a prompt, and shortening it when it alone is over the budget.

What must be sent whatever the budget (system messages, the current turn, pinned messages with
their units), and, when that alone is over, copies of its largest shortenable texts cut with a
marker: system prompts and tool results first, middle-out; the latest user message last (with
them, to one level, when they alone could not cover the excess), by passages: its ends, where
a pasted document's question sits, then what they ask about (`_cut_by_passages`; how many of
its passages went, of how many, is told as a document excerpted: `TrimResult.shortened_passages`).
"""

from __future__ import annotations

import re
from collections.abc import Collection

from .chatview import ChatView
from .conversation import Message, is_tool_images, message_text
from .excerpt import CUT_MARK, chunk_scores, filled_scores, marked_text, split_chunks, with_text
from .relevance import wants_whole
from .selection import mandatory_indices
from .tokens import TOKENS_PER_REPLY, TokenCounter

__all__ = ["SHORTENED_MARK", "PINS_SHORTENED_NOTE", "PINS_DROPPED_NOTE", "MIN_KEPT_TEXT_TOKENS"]

SHORTENED_MARK = CUT_MARK
PINS_SHORTENED_NOTE = "pinned messages over budget: shortened"
PINS_DROPPED_NOTE = "pinned messages over budget even shortened: kept only while they fit"
MIN_KEPT_TEXT_TOKENS = 0
# What the latest user message asks, when it alone must be cut (a pasted document and its
# question in one message): its first and last paragraphs, at most this many characters of each.
# Cut middle-out, an article asked about at its end lost the passage with the answer.
ASK_MAX_CHARS = 500
# A cut marker, with the line breaks around it: a text an earlier pass of the turn cut holds one
# (middle-out) or one a stretch left out (by passages): a later pass's input is what it sent.
_MARK = re.compile(r"\n?" + re.escape(CUT_MARK).replace(re.escape("{n}"), "([0-9,]+)") + r"\n?")
# A cut by passages: the chunks (`excerpt.split_chunks`) sent, and those of the text cut, the
# same count a document excerpted is told by.
Passages = tuple[int, int]


def _mandatory_part(
    view: ChatView,
    costs: list[int],
    max_tokens: int,
    counter: TokenCounter,
    model: str | None,
    pinned: Collection[int],
    shorten: bool = True,
) -> tuple[list[int], dict[int, Message], bool, list[str], Collection[int], dict[int, Passages]]:
    """What must be sent (system, current turn, pins), its shortened copies when it alone is
    over budget, whether it is still over, the notes, the pins that stay mandatory (when even
    shortened pins cannot fit, their markers alone over, the budget wins and they are let go:
    kept only while they fit, like other messages), and the passages of each copy cut by them."""
    hard = mandatory_indices(view)
    mandatory = _with_pins(view, hard, pinned)
    pinned = sorted(set(mandatory).difference(hard))  # with their units and questions
    notes: list[str] = []
    if TOKENS_PER_REPLY + sum(costs[i] for i in mandatory) <= max_tokens:
        return mandatory, {}, False, notes, pinned, {}
    if not shorten:
        return mandatory, {}, True, ["mandatory content over budget: sent whole"], pinned, {}
    replaced, over, passages = _shorten_mandatory(view, mandatory, costs, max_tokens, counter, model)
    if over and len(mandatory) > len(hard):
        mandatory, pinned = hard, ()
        notes.append(PINS_DROPPED_NOTE)
        if TOKENS_PER_REPLY + sum(costs[i] for i in mandatory) <= max_tokens:
            return mandatory, {}, False, notes, pinned, {}
        replaced, over, passages = _shorten_mandatory(view, mandatory, costs, max_tokens, counter, model)
    notes.append("mandatory content over budget: shortened")
    if set(replaced) & set(pinned):
        notes.append(PINS_SHORTENED_NOTE)
    if over:
        notes.append("could not shorten enough")
    return mandatory, replaced, over, notes, pinned, passages


def _with_pins(view: ChatView, mandatory: list[int], pinned: Collection[int]) -> list[int]:
    """The mandatory indices plus every pinned one with the rest of its unit and, for a pinned
    reply, its turn's question (a reply is never sent without it)."""
    if not pinned:
        return mandatory
    pins = set(pinned)
    keep = set(mandatory)
    for turn in view.turns:
        units = [u for u in turn.units if pins.intersection(u.indices)]
        if units and turn.units[0].kind == "user":
            units.append(turn.units[0])
        keep.update(*(u.indices for u in units))
    return sorted(keep)


def _shortenable(view: ChatView, mandatory: list[int]) -> tuple[list[int], int | None]:
    """Mandatory indices whose text may be cut, and the latest user message (cut last): not a
    reply, nor the tool images Open WebUI adds (their text asks the model to look at them)."""
    last_user = view.question
    messages = view.messages
    first_choice = [
        i for i in mandatory if i != last_user and view.role(i) != "assistant" and not is_tool_images(messages[i])
    ]
    return first_choice, last_user


def _shorten_mandatory(
    view: ChatView,
    mandatory: list[int],
    costs: list[int],
    budget: int,
    counter: TokenCounter,
    model: str | None,
) -> tuple[dict[int, Message], bool, dict[int, Passages]]:
    """Cut the largest shortenable texts middle-out, down to one level (`_levels`), until the
    mandatory part fits: two tool results of a loop both keep their ends rather than one kept
    whole and the other cut to its marker. Each copy is cut from the message as it came, once
    a round (a cut of a cut would cut its marker). The latest user message is cut last, unless
    the others together are no more than the excess (all of them would go, each to its marker):
    then they and it are cut to one level, so a pinned line or a short system prompt is not lost
    to spare a pasted document. It is not cut at all when even every text cut to its marker would
    not fit (images alone over the budget): its words are the turn, and it would go over anyway.

    Returns the shortened copies by index, whether it is still over budget, and the passages
    of each copy cut by passages (the latest user message's, unless it fell back to middle-out).
    """
    messages = view.messages
    current = {i: costs[i] for i in mandatory}
    replaced: dict[int, Message] = {}
    passages: dict[int, Passages] = {}
    first_choice, last_user = _shortenable(view, mandatory)
    question = [last_user] if last_user is not None else []
    excess = TOKENS_PER_REPLY + sum(current.values()) - budget
    if question and sum(_cut_most(messages[i], counter, model) for i in first_choice + question) < excess:
        question = []  # cutting the question cannot make the part fit: it goes whole
    together = bool(question) and sum(current[i] for i in first_choice) <= excess
    for pool in [first_choice + question] if together else (first_choice, question):
        candidates = set(pool)
        while candidates:
            excess = TOKENS_PER_REPLY + sum(current.values()) - budget
            if excess <= 0:
                return replaced, False, passages
            for index, level in _levels({i: current[i] for i in candidates}, excess).items():
                cut = _shorten_message(messages[index], costs[index] - level, counter, model, index == last_user)
                cost = counter.count_message(cut[0], model) if cut is not None else current[index]
                if cut is None or cost >= current[index]:  # (None costs current[index])
                    candidates.discard(index)
                    continue
                replaced[index], current[index] = cut[0], cost
                if cut[1] is None:  # (a later round's cut fell back to middle-out)
                    passages.pop(index, None)
                else:
                    passages[index] = cut[1]
    return replaced, TOKENS_PER_REPLY + sum(current.values()) > budget, passages


def _cut_most(message: Message, counter: TokenCounter, model: str | None) -> int:
    """The most tokens cutting `message`'s text could save: all of it but the marker left."""
    text = message_text(message)
    return max(0, counter.count_text(text, model) - _marker_cost(len(text), counter, model))


def _marker_cost(n: int, counter: TokenCounter, model: str | None) -> int:
    """What the marker naming `n` cut tokens costs in a text, with the line breaks around it."""
    return counter.count_text(SHORTENED_MARK.format(n=n), model) + 2


def _levels(current: dict[int, int], excess: int) -> dict[int, int]:
    """What the largest of `current` (tokens by index) are cut to so that together they lose
    `excess`: all to one level, no lower than the next largest (water-filling), none below 0.

    Example:
        >>> _levels({1: 3000, 2: 3000, 3: 10}, 4000), _levels({1: 900, 2: 100}, 500)
        ({1: 1000, 2: 1000}, {1: 400})
    """
    order = sorted(current, key=lambda i: (-current[i], i))
    top = 0
    for k, index in enumerate(order, 1):
        top += current[index]
        following = current[order[k]] if k < len(order) else 0
        if (top - excess) // k >= following:
            break
    level = max(0, (top - excess) // k)
    return {i: level for i in order[:k] if level < current[i]}


def _shorten_message(
    message: Message, excess: int, counter: TokenCounter, model: str | None, asked: bool = False
) -> tuple[Message, Passages | None] | None:
    """A copy of `message` whose largest text is `excess` tokens shorter (or as short as it gets),
    and its passages sent and in all when it was cut by them; `asked` (the latest user message):
    cut by passages, else middle-out."""
    slot = _largest_text(message, counter, model)
    if slot is None:
        return None
    text, part = slot
    cut = (_cut_by_passages if asked else _middle_out)(text, excess, counter, model)
    return None if cut is None else (with_text(message, cut[0], part), cut[1])


def _largest_text(message: Message, counter: TokenCounter, model: str | None) -> tuple[str, int | None] | None:
    """The text a shortening cuts: the string content, or the text part of the most tokens (and its index)."""
    content = message.get("content")
    if isinstance(content, str):
        return content, None
    if not isinstance(content, list):
        return None
    texts = [
        (counter.count_text(part["text"], model), k)
        for k, part in enumerate(content)
        if isinstance(part, dict) and isinstance(part.get("text"), str)
    ]
    if not texts:
        return None
    k = max(texts)[1]
    return content[k]["text"], k


def _cut_middle(text: str, excess: int, counter: TokenCounter, model: str | None) -> str | None:
    """`text` with a middle stretch replaced by a marker, about `excess` tokens shorter. A text
    an earlier pass cut is cut again around its markers (`_cut_again`), never through them."""
    marks = list(_MARK.finditer(text))
    if marks:
        return _cut_again(text, marks, excess, counter, model)
    total = counter.count_text(text, model)
    marker_cost = _marker_cost(total, counter, model)
    keep = max(MIN_KEPT_TEXT_TOKENS, total - excess - marker_cost)
    while keep < total:
        head, tail = counter.keep_ends(text, keep - keep // 3, keep // 3, model)
        cut = SHORTENED_MARK.format(n=max(0, total - keep))
        shorter = f"{head}\n{cut}\n{tail}" if tail else f"{head}\n{cut}"
        # Counts of joined pieces can exceed the pieces' sum (BPE merges, estimate rounding):
        # keep less until the whole is short enough, else a second cut would cut the marker.
        over = counter.count_text(shorter, model) - (total - excess)
        if over <= 0 or keep == MIN_KEPT_TEXT_TOKENS:
            return shorter
        keep = max(MIN_KEPT_TEXT_TOKENS, keep - over)
    return None


def _cut_again(
    text: str, marks: list[re.Match[str]], excess: int, counter: TokenCounter, model: str | None
) -> str | None:
    """`text`, cut before (a later pass's input is what the first pass sent: middle-out, one
    marker; by passages, one a stretch left out), about `excess` tokens shorter: its head (before
    the first marker) and tail (after the last) cut further toward the markers, all between them
    one marker naming every token cut: theirs, and the passages sent between them. None when
    nothing but one marker is left. Cut as text, a marker for 3,001 tokens became one for 12, and
    one cut through the markers of a copy cut by passages named 1,228 of 3,015 (the model told a
    wrong size, and trimming the trimmed prompt changed it)."""
    head, tail = text[: marks[0].start()], text[marks[-1].end() :]
    inner = [text[a.end() : b.start()] for a, b in zip(marks, marks[1:], strict=False)]
    sizes = counter.count_text(head, model), counter.count_text(tail, model)
    if not sum(sizes) and len(marks) == 1:
        return None
    before = sum(int(mark.group(1).replace(",", "")) for mark in marks)
    before += sum(counter.count_text(piece, model) for piece in inner)
    goal = counter.count_text(text, model) - excess
    merged = counter.count_text(text[marks[0].end() : marks[-1].end()], model)  # all but one marker
    keep = max(0, sum(sizes) + merged - excess)
    while True:
        kept_head = min(sizes[0], keep - min(sizes[1], keep // 3))
        kept_tail = min(sizes[1], keep - kept_head)
        new_head = head if kept_head >= sizes[0] else counter.keep_ends(head, kept_head, 0, model)[0]
        new_tail = tail if kept_tail >= sizes[1] else counter.keep_ends(tail, 0, kept_tail, model)[1]
        cut = SHORTENED_MARK.format(n=before + sum(sizes) - kept_head - kept_tail)
        shorter = f"{new_head}\n{cut}\n{new_tail}" if new_tail else f"{new_head}\n{cut}"
        over = counter.count_text(shorter, model) - goal
        if over <= 0 or keep == 0:
            return shorter
        keep = max(0, keep - over)


def _cut_by_passages(
    text: str, excess: int, counter: TokenCounter, model: str | None
) -> tuple[str, Passages | None] | None:
    """`text` about `excess` tokens shorter, by passages: its first and last chunks (where a
    question or instructions sit), then those most relevant to what its end paragraphs ask
    (`_asked`), then the rest spread evenly (all spread for a question about the whole text);
    each stretch left out one marker. An earlier pass's markers stay, each merged with what is
    cut beside it. With the chunks sent and the text's (a copy an earlier pass cut: its own,
    between the markers); middle-out (`_cut_middle`, no passages) when no passage fits."""
    pieces = _cut_pieces(text)
    chunks = [piece for piece in pieces if isinstance(piece, str)]
    if len(chunks) < 3:
        return _middle_out(text, excess, counter, model)
    costs = [counter.count_text(chunk, model) for chunk in chunks]
    goal = counter.count_text(text, model) - excess
    order = _passage_order(chunks)
    mark = _marker_cost(sum(costs), counter, model)
    kept: list[int] = []
    room = goal
    for k in order:
        if costs[k] + mark <= room - mark:
            kept.append(k)
            room -= costs[k] + mark
    while kept:
        shorter = marked_text(pieces, set(kept), costs.__getitem__)[0]
        if counter.count_text(shorter, model) <= goal:
            return shorter, (len(kept), len(chunks))
        kept.pop()  # joined pieces counted more than apart: the last chosen goes
    return _middle_out(text, excess, counter, model)


def _middle_out(text: str, excess: int, counter: TokenCounter, model: str | None) -> tuple[str, None] | None:
    """`_cut_middle`'s cut, with no passages to tell."""
    middle = _cut_middle(text, excess, counter, model)
    return None if middle is None else (middle, None)


def _cut_pieces(text: str) -> list[str | int]:
    """`text` as its chunks (`excerpt.split_chunks`) and an earlier pass's markers (the tokens
    each names, as an int) in their order."""
    pieces: list[str | int] = []
    at = 0
    for mark in _MARK.finditer(text):
        pieces.extend(split_chunks(text[at : mark.start()]))
        pieces.append(int(mark.group(1).replace(",", "")))
        at = mark.end()
    pieces.extend(split_chunks(text[at:]))
    return pieces


def _passage_order(chunks: list[str]) -> list[int]:
    """The chunks in the order a cut keeps them: the first and the last, then the most relevant
    to what the text asks (score above 0), then the rest spread evenly over it (all spread when
    it asks about the text as a whole: `relevance.wants_whole`)."""
    asked = _asked("".join(chunks))
    whole = any(wants_whole(paragraph) for paragraph in asked)
    ranked = filled_scores([0.0] * len(chunks) if whole else chunk_scores(chunks, "\n".join(asked)))
    ranked[0] = ranked[-1] = float("inf")
    return sorted(range(len(chunks)), key=lambda k: (-ranked[k], k))


def _asked(text: str) -> list[str]:
    """What a long message asks: the shorter of its first and last paragraphs, and the other too
    when it is a question or asks for the whole (`relevance.wants_whole`) in at most
    `ASK_MAX_CHARS` (a pasted text's own end paragraph would only blur what is asked of it);
    both ends, `ASK_MAX_CHARS` of each, when neither is that short.

    Example:
        >>> _asked("Read this.\\n\\nA long report ...\\n\\nWho wrote it?")
        ['Read this.', 'Who wrote it?']
        >>> _asked("Who wrote it?\\n\\nA long report.\\n\\nIt ends here.")
        ['Who wrote it?']
    """
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text.strip()) if p.strip()]
    if not paragraphs:
        return []
    ends = [paragraphs[0]] if len(paragraphs) == 1 else [paragraphs[0], paragraphs[-1]]
    shortest = min(ends, key=len)
    if len(shortest) > ASK_MAX_CHARS:
        return [paragraphs[0][:ASK_MAX_CHARS], paragraphs[-1][-ASK_MAX_CHARS:]]
    return [p for p in ends if p is shortest or (len(p) <= ASK_MAX_CHARS and ("?" in p or wants_whole(p)))]
