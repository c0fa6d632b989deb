"""The per-turn recall block: what the latest question needs of what the prompt does not send.

A block quotes, in one user message right before the question (then an assistant
acknowledgement, so roles alternate), the passages the question needs of long messages sent in
part or not at all, then the dropped messages most relevant to it. Here: the room a block gets
(`recall_room`), what it chooses from (`recall_candidates` in `recall_order`, `choose_recall`;
`_Pools`: scores, candidates and their costs, made once a trim), making a block (`_new_recall`),
quoting and counting it (`_block`), placing blocks right before their anchors (`_with_blocks`),
and what a result and a decision record of them.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import repeat
from operator import add, mul

from .chatview import ChatView
from .conversation import SUMMARY_ACK_MESSAGE, Message, image_count, recall_message, recall_quotes
from .decision import Recall
from .excerpt import Excerpt, cuttable, passage_count, passage_quote, recall_passages
from .recall_index import recall_scores
from .relevance import DEFAULT_RELEVANCE_WEIGHTS, RelevanceWeights
from .selection import neighbour_reach
from .semantic import VECTORS, Embed, similarities
from .tokens import TOKENS_PER_MESSAGE, TOKENS_PER_ROLE, TokenCounter

__all__ = [
    "DEFAULT_RECALL_SHARE",
    "RECALL_REFERENCE_TOKENS",
    "MAX_RECALL_SHARE",
    "MAX_PASSAGE_MESSAGES",
    "MAX_DROPPED_PASSAGE_MESSAGES",
    "MIN_PASSAGE_ROOM",
    "MIN_PASSAGE_TOKENS",
    "recall_room",
    "recall_candidates",
    "recall_order",
    "choose_recall",
    "RECALLABLE_ROLES",
]

# The share of a RECALL_REFERENCE_TOKENS budget a chat that goes on keeps for its per-turn recall
# block; other budgets keep this share times sqrt(reference / budget), at most MAX_RECALL_SHARE:
# what a question needs recalled grows with the budget, but not in proportion (a question's
# evidence is a few messages; bench/multiturn.py). See `recall_room`. Measured there with the
# recall by relevance alone, carried evidence x fresh trim's / cacheable share at 2k and 8k:
# 0.30 0.91x 69% / 0.93x 85%; 0.35 0.93x 65% / 0.94x 83%; 0.40 0.94x 62% / 0.95x 81%;
# 0.46 0.94x 57% / 0.95x 79%: past 0.40 the cache pays for little more evidence.
DEFAULT_RECALL_SHARE = 0.40
RECALL_REFERENCE_TOKENS = 2_000
MAX_RECALL_SHARE = 0.5
MAX_PASSAGE_MESSAGES = 4  # long messages a recall block looks into for passages, the most relevant first,
MAX_DROPPED_PASSAGE_MESSAGES = 1  # ... of them not in the prompt at all (each is scored anew every turn)
MIN_PASSAGE_ROOM = 64  # tokens left below which a recall block looks for no further passages
# A message costing less is recalled whole or not at all, never by passages: a person's long
# message is not a document (REALTALK at 1k: 0.027 less evidence sent when its passages were).
MIN_PASSAGE_TOKENS = 1_000
# The embedder's share of the recall's base signal, below a new selection's (`SEMANTIC_SHARE`,
# 0.35): the recall ranks single messages by score alone, where the cosine of short messages
# shaped like the question (earlier questions) crowds out the one that names what it asks.
# bench/multiturn.py, carried + embedder at 1k / 2k / 4k / 8k, REALTALK dev | LoCoMo dev:
# 0.35 0.366 / 0.459 / 0.568 / 0.701 | 0.620 / 0.709 / 0.774 / 0.845;
# 0.25 0.384 / 0.486 / 0.571 / 0.719 | 0.634 / 0.705 / 0.776 / 0.849;
# 0.20 0.387 / 0.492 / 0.574 / 0.707 | 0.625 / 0.703 / 0.778 / 0.850; 0.10 and 0.50 worse.
RECALL_SEMANTIC_SHARE = 0.25
_RECALL_WEIGHTS = replace(  # recalled for relevance alone
    DEFAULT_RELEVANCE_WEIGHTS, recency=0.0, semantic_share=RECALL_SEMANTIC_SHARE
)
RECALLABLE_ROLES = frozenset({"user", "assistant", "tool"})
# A recall block takes the dropped messages most relevant to the question first, whatever their
# length (value per cost ** 0): it has little room, and what a question needs is a few messages.
# bench/multiturn.py, carried evidence / fresh trim's at 2k and 8k, conversations 1-2 | 3-5:
# 0.25 (the selection's) 0.875 / 0.927 | 0.876 / 0.915; 0 0.923 / 0.942 | 0.926 / 0.936;
# 0.5 worse (0.840 / 0.932 | 0.780 / 0.911). On the reshaped chats (bench/quality.py) at 2k:
# 0.80x -> 0.94x.
RECALL_COST_EXPONENT = 0.0


def recall_room(max_tokens: int, recall_share: float = DEFAULT_RECALL_SHARE) -> int:
    """Tokens kept for a turn's recall block: `recall_share` of the budget at 2,000 tokens,
    scaled by sqrt(2,000 / budget) elsewhere, never more than half the budget.

    Example:
        >>> recall_room(1_000), recall_room(2_000), recall_room(8_000), recall_room(8_000, 0)
        (500, 800, 1600, 0)
    """
    share = min(MAX_RECALL_SHARE, recall_share * math.sqrt(RECALL_REFERENCE_TOKENS / max_tokens))
    return int(max_tokens * share)


@dataclass(frozen=True, slots=True)
class _Pool:
    """What this turn's recall chooses from: every message's score, the candidates (in
    `recall_order`), their costs; and the relevant messages it may not quote for their images
    (`pictured`: see `recall_candidates`; their costs, images included, in `costs` too), which
    may only go in place: never an orphan (a tool call never answered), which is never sent."""

    scores: list[float]
    candidates: list[int]
    costs: dict[int, int]
    pictured: tuple[int, ...] = ()

    def wants_pictured(self, keep: Collection[int], room: int) -> bool:
        """A message not in `keep` that carries images is one the block would quote in `room`
        were it quotable (`choose_recall` over both): it can only go in place, images and all."""
        if not self.pictured or self.pictured_kept(keep):
            return False
        both = recall_order([*self.candidates, *self.pictured], self.scores, self.costs)
        return not self.pictured_kept(choose_recall(both, keep, self.scores, self.costs, room, ordered=True), True)

    def pictured_kept(self, indices: Collection[int], some: bool = False) -> bool:
        """Every pictured message is in `indices` (`some`: none of them is)."""
        held = [i in indices for i in self.pictured]
        return not any(held) if some else all(held)


def recall_candidates(view: ChatView, scores: Sequence[float]) -> list[int]:
    """The messages a recall block may quote: user, assistant and tool messages with text that
    are relevant to the question (score above 0) and carry no image (a quote holds text only: the
    image would be lost while the message counts as sent); an earlier pass's recall block was
    taken out before (`trim_messages`' `added`)."""
    messages = view.messages
    return [i for i in _relevant(view, scores) if not image_count(messages[i])]


def _relevant(view: ChatView, scores: Sequence[float]) -> list[int]:
    """The user, assistant and tool messages with text that score above 0."""
    return [i for i, score in enumerate(scores) if score > 0 and view.role(i) in RECALLABLE_ROLES and view.text(i)]


def recall_order(candidates: Sequence[int], scores: Sequence[float], costs: Mapping[int, int]) -> list[int]:
    """`candidates` by what they are worth to a recall block: score per cost ** `RECALL_COST_EXPONENT`,
    the most first (ties: the newer first)."""
    if not RECALL_COST_EXPONENT:
        return sorted(candidates, key=lambda i: (-scores[i], -i))
    return sorted(candidates, key=lambda i: (-scores[i] / max(costs[i], 1) ** RECALL_COST_EXPONENT, -i))


def choose_recall(
    candidates: Sequence[int],
    keep: Collection[int],
    scores: Sequence[float],
    costs: Mapping[int, int],
    room: int,
    *,
    ordered: bool = False,
) -> list[int]:
    """The `candidates` (see `recall_candidates`) not in `keep` to quote in this turn's recall
    block, ascending: the most relevant first (`scores`; see `recall_order`), greedily while
    they fit `room` (`costs`). `ordered`: the candidates are already in `recall_order` (a turn sorts them once).

    Example:
        >>> choose_recall([0, 1, 2], {2}, [0.5, 2.0, 1.0], {0: 10, 1: 10, 2: 10}, room=15)
        [1]
    """
    if room <= 0:
        return []
    order = candidates if ordered else recall_order(candidates, scores, costs)
    chosen: list[int] = []
    for i in order:
        if i not in keep and costs[i] <= room:
            chosen.append(i)
            room -= costs[i]
    return sorted(chosen)


class _Pools:
    """One trim's recall pools by question and system messages: each made once, however many
    paths look (the fast path, then the full one). `seen`: how many leading messages the
    previous turn read (see `recall_scores`); `embed`: the trim's embedder, whose cosine the
    recall fuses in as a new selection does, at `RECALL_SEMANTIC_SHARE` (None once it failed:
    one trim asks it once); `notes`
    say when it could not."""

    __slots__ = ("view", "counter", "model", "seen", "embed", "notes", "_made")

    def __init__(
        self, view: ChatView, counter: TokenCounter, model: str | None, seen: int, embed: Embed | None
    ) -> None:
        self.view, self.counter, self.model, self.seen, self.embed = view, counter, model, seen, embed
        self.notes: list[str] = []
        self._made: dict[tuple[int, tuple[int, ...]], _Pool] = {}

    def of(self, question: int, system: Sequence[int]) -> _Pool:
        key = (question, tuple(system))
        pool = self._made.get(key)
        if pool is None:
            view = self.view
            messages, texts = view.messages, view.texts
            similarity = _recall_cosines(view, question, system, self.embed, self.notes) if self.embed else None
            if similarity is None:
                self.embed = None  # failed (or no vectors yet): not asked again this trim
            scores = recall_scores(
                messages,
                question=question,
                exclude=system,
                weights=_RECALL_WEIGHTS,
                seen=self.seen,
                texts=texts,
                similarity=similarity,
                roles=view.roles,
            )
            scores = _with_neighbours(scores, texts, question, _RECALL_WEIGHTS)
            relevant = _relevant(view, scores)
            candidates = [i for i in relevant if not image_count(messages[i])]
            orphans = view.orphan_set  # never sent: no place for their images
            pictured = tuple(i for i in relevant if image_count(messages[i]) and i not in orphans)
            counts = self.counter.count_each([messages[i] for i in [*candidates, *pictured]], self.model)
            costs = dict(zip([*candidates, *pictured], counts, strict=True))
            pool = self._made[key] = _Pool(scores, recall_order(candidates, scores, costs), costs, pictured)
        return pool


def _with_neighbours(
    scores: Sequence[float], texts: Sequence[str], question: int, weights: RelevanceWeights
) -> list[float]:
    """Each message's score plus `turn_share` of its better neighbour's, in full while the two
    average at most `turn_reach` tokens (by length), in proportion beyond: the rule a new
    selection applies to turns (see `selection._turn_values`), for the recall's messages."""
    n = len(scores)
    if n < 2:
        return list(scores)
    sizes = [len(text) // 4 + 1 for text in texts]
    # What reaches between messages k and k + 1 (the same both ways): one figure a pair.
    reach = list(map(neighbour_reach, sizes, sizes[1:], repeat(weights, n - 1)))
    lending = list(scores)
    if 0 <= question < n:
        lending[question] = 0.0  # the question lends nothing (and takes nothing, below)
    from_left = [0.0, *map(mul, lending[:-1], reach)]
    from_right = [*map(mul, lending[1:], reach), 0.0]
    out = list(map(add, scores, map(mul, repeat(weights.turn_share), map(max, from_left, from_right))))
    if 0 <= question < n:
        out[question] = scores[question]
    return out


def _recall_cosines(
    view: ChatView, question: int, system: Sequence[int], embed: Embed, notes: list[str]
) -> list[float] | None:
    """Each message's cosine to the question for the recall; None (lexical, with a note) when
    the embedder fails or its vectors are not there yet."""
    try:
        return similarities(view.messages, question, VECTORS, embed, skip=system, texts=view.texts, roles=view.roles)
    except LookupError:  # vectors not fetched yet (the filter embeds ahead of the trim)
        note = "some messages not embedded yet: recall is lexical"
    except Exception as exc:  # any embedder: its failure must not cost the trim
        note = f"embedder failed ({type(exc).__name__}): recall is lexical"
    if note not in notes:
        notes.append(note)
    return None


@dataclass(frozen=True, slots=True)
class _Block:
    """A recall block: the kept message it goes right before, the input indices it quotes, the
    message itself, what it costs with the acknowledgement sent after it (`_with_blocks`), and
    the passages it quotes of each message (`Recall.parts`: () a message quoted whole)."""

    anchor: int
    indices: tuple[int, ...]
    message: Message
    tokens: int
    parts: tuple[tuple[int, ...], ...] = ()

    def chunks(self) -> dict[int, tuple[int, ...]]:
        """The passages it quotes, by message (messages quoted whole left out)."""
        return {i: p for i, p in zip(self.indices, self.parts, strict=True) if p} if self.parts else {}


def _new_recall(
    view: ChatView,
    keep: Collection[int],
    question: int,
    room: int,
    counter: TokenCounter,
    model: str | None,
    pool: _Pool,
    fits_in: int | None = None,
    sent: Mapping[int, Collection[int]] | None = None,
) -> _Block | None:
    """The recall block for this turn: first the passages the question needs of long messages
    that do not go whole (`_recall_parts`), then the messages not sent otherwise (`keep`) most
    relevant to `question` (by `recall_scores`), while they fit `room` tokens once quoted
    (block, label and the acknowledgement after it included); None when nothing is relevant.
    `sent`: the chunks of long messages the prompt already holds (their excerpts, earlier
    blocks). A block clearly over `fits_in` is not counted exactly (that would encode its text
    for nothing): its `tokens` are then the estimate."""
    frame = _block_tokens(view, (), counter, model)  # the label, overheads, acknowledgement
    if room <= frame:
        return None
    scores, costs = pool.scores, pool.costs
    parts, spent = _recall_parts(view, keep, question, room - frame, pool, sent or {}, counter, model)
    taken = set(keep).union(parts)
    chosen = sorted([*parts, *choose_recall(pool.candidates, taken, scores, costs, room - frame - spent, ordered=True)])
    estimate = frame + spent + sum(costs[i] for i in chosen if i not in parts)
    if chosen and fits_in is not None and estimate > fits_in + len(chosen):  # joins save a token or so each at most
        return _block(view, question, chosen, parts, counter, model, tokens=estimate)
    while chosen:
        block = _block(view, question, chosen, parts, counter, model)
        if block is None:
            return None
        if block.tokens <= room:
            return block
        # Quoting joined the texts into more tokens than they count apart: let the least worth go.
        chosen.remove(min(chosen, key=lambda i: (scores[i] / max(costs[i], 1) ** 0.5, i)))
    return None


def _recall_parts(
    view: ChatView,
    keep: Collection[int],
    question: int,
    room: int,
    pool: _Pool,
    sent: Mapping[int, Collection[int]],
    counter: TokenCounter,
    model: str | None,
) -> tuple[dict[int, tuple[int, ...]], int]:
    """The passages a recall block quotes (by message) and what they cost: of the long messages
    the prompt holds only in part (`sent`) or not at all and cannot quote whole in `room`, the
    most relevant first, each in what the ones before left (`excerpt.recall_passages`: only
    passages near its best; measured on bench/docchat.py, half the room a message held 0.011
    fewer answers at 4k and 0.006 fewer at 8k)."""
    messages, question_text = view.messages, view.text(question)
    parts: dict[int, tuple[int, ...]] = {}
    spent = 0
    tried = [0, 0]  # long messages looked into: in part in the prompt, not in it
    for i in pool.candidates:
        cost = pool.costs[i]
        if tried[0] == MAX_PASSAGE_MESSAGES or room - spent < MIN_PASSAGE_ROOM:
            break
        if cost < MIN_PASSAGE_TOKENS or not (i in sent or (i not in keep and cost > room)):
            continue
        if (i not in sent and tried[1] == MAX_DROPPED_PASSAGE_MESSAGES) or not cuttable(messages[i]):
            continue
        tried[0] += 1
        tried[1] += i not in sent
        chunks, cost = recall_passages(messages[i], question_text, room - spent, sent.get(i, ()), counter, model)
        if chunks:  # (its cost as `_choose` counts it: the block is counted exactly once made)
            parts[i] = chunks
            spent += cost + TOKENS_PER_MESSAGE
    return parts, spent


def _block(
    view: ChatView,
    anchor: int,
    indices: Sequence[int],
    parts: Mapping[int, Sequence[int]],
    counter: TokenCounter,
    model: str | None,
    tokens: int | None = None,
) -> _Block | None:
    """The block quoting `indices` (the passages `parts` of some) before `anchor`, counted
    exactly unless `tokens` is given; None when a passage cannot be quoted (`_quote_texts`)."""
    texts = _quote_texts(view, {i: parts[i] for i in indices if i in parts}, counter, model)
    if texts is None:
        return None
    if tokens is None:
        tokens = _block_tokens(view, indices, counter, model, texts)
    record = tuple(tuple(parts.get(i, ())) for i in indices)
    message = recall_message(view.messages, indices, _quoted(view, indices, texts))
    return _Block(anchor, tuple(indices), message, tokens, record)


def _quote_texts(
    view: ChatView,
    parts: Mapping[int, Sequence[int]],
    counter: TokenCounter,
    model: str | None,
) -> dict[int, str] | None:
    """The text a block quotes of each message quoted by passages (`parts`, by message); None
    when one cannot be quoted so (its text changed: the block cannot be sent again as it was)."""
    texts = {}
    for i, chunks in parts.items():
        text = passage_quote(view.messages[i], chunks, counter, model)
        if text is None:
            return None
        texts[i] = text
    return texts


def _block_tokens(
    view: ChatView,
    indices: Sequence[int],
    counter: TokenCounter,
    model: str | None,
    texts: Mapping[int, str] | None = None,
) -> int:
    """What the recall block quoting `indices` (`texts`: the passages quoted of some) costs sent,
    with the acknowledgement after it (`count_message` of both): its text counted from its
    quotes, each counted once a chat."""
    text = counter.count_joined(recall_quotes(view.messages, indices, _quoted(view, indices, texts or {})), model)
    return TOKENS_PER_MESSAGE + TOKENS_PER_ROLE + text + counter.count_message(SUMMARY_ACK_MESSAGE, model)


def _quoted(view: ChatView, indices: Sequence[int], texts: Mapping[int, str]) -> dict[int, str]:
    """The text a block quotes of each of `indices`: the passages `texts` holds of some, else the
    message's text as the view read it (what `recall_quotes` would read of the message)."""
    return {i: texts.get(i) or view.text(i) for i in indices}


def _quote_anchor(view: ChatView, keep: Collection[int]) -> int | None:
    """Where the block a selection quotes goes (`fresh._quoted_blocks`), and so which carried
    blocks stay with the selection (`carry._held`): right before its first user message sent."""
    return min((i for i in keep if view.role(i) == "user"), default=None)


def _with_blocks(
    sent: list[Message], order: Sequence[int], blocks: Sequence[_Block], question: int | None
) -> tuple[list[Message], int, tuple[int, ...]]:
    """`sent` (the messages at `order`) with each block, then an assistant `SUMMARY_ACK`, right
    before its anchor, and how many leading messages the next turn sends again: all but this
    question's block and what follows.

    The acknowledgement always goes with the block: the block is a user message and its anchor
    (the question it was made for) is a user message too, so without it two user messages would
    follow each other whatever came before, which chat templates that require roles to alternate
    (Gemma's, Mistral's in vLLM or llama.cpp) reject. Before the block is then what came before
    the question: an assistant answer in a chat that alternates (or the system prompt, or the
    start), so user, assistant, user holds; the same constant as the summary note's, so a block
    costs the same few tokens and the next turn sends it again byte for byte. Last, where the
    blocks and their acknowledgements are in what is returned (`TrimResult.added`)."""
    if not blocks:
        return sent, -1, ()  # TrimResult works the prefix out
    by_anchor = {b.anchor: b.message for b in blocks}
    out: list[Message] = []
    added: list[int] = []
    stable = -1
    for index, message in zip(order, sent, strict=True):
        block = by_anchor.get(index)
        if block is not None:
            if index == question:
                stable = len(out)
            added += (len(out), len(out) + 1)
            out += (block, dict(SUMMARY_ACK_MESSAGE))
        out.append(message)
    return out, stable if stable >= 0 else len(out), tuple(added)


def _sent_chunks(excerpts: Mapping[int, Excerpt], blocks: Sequence[_Block]) -> dict[int, set[int]]:
    """The chunks of each long message the prompt holds: its excerpt's and those blocks quote."""
    sent: dict[int, set[int]] = {i: set(e.chunks) for i, e in excerpts.items()}
    for block in blocks:
        for i, chunks in block.chunks().items():
            sent.setdefault(i, set()).update(chunks)
    return sent


def _recalled(blocks: Sequence[_Block]) -> tuple[int, ...]:
    return tuple(sorted(set().union(*(b.indices for b in blocks)))) if blocks else ()


def _recall_record(blocks: Sequence[_Block], fingerprints: Sequence[str]) -> tuple[Recall, ...]:
    return tuple(
        Recall(b.anchor, b.indices, tuple(fingerprints[i] for i in b.indices), parts=b.parts)
        for b in sorted(blocks, key=lambda b: b.anchor)
    )


def _passages(excerpts: Mapping[int, Excerpt], blocks: Sequence[_Block] = ()) -> tuple[tuple[int, int], ...]:
    """(passages sent, passages in all) of each excerpted message, in the messages' order: its
    excerpt's and those the recall blocks quote of it."""
    sent = _sent_chunks(excerpts, blocks)
    return tuple((len(sent[i]), e.total) for i, e in sorted(excerpts.items()))


def _quoted_passages(
    view: ChatView, excerpts: Mapping[int, Excerpt], blocks: Sequence[_Block]
) -> tuple[tuple[int, int, int], ...]:
    """(index, passages quoted, passages in all) of each message the blocks quote by passages and
    that is not excerpted in place: a document the model reads only in part, in a block."""
    quoted = _sent_chunks({}, blocks)
    return tuple((i, len(quoted[i]), passage_count(view.text(i))) for i in sorted(quoted) if i not in excerpts)


def _tool_results(
    excerpts: Mapping[int, Excerpt],
    view: ChatView,
    quoted: Sequence[tuple[int, int, int]] = (),
    left_out: Sequence[int] = (),
) -> tuple[int, ...]:
    """The excerpted messages, those `quoted` by passages (`_quoted_passages`) and those `left_out`
    (`_left_out`) that are tool results (a user is told `tool result`, not `document`)."""
    tools = {i for i, e in excerpts.items() if e.message.get("role") == "tool"}
    tools.update(i for i, _, _ in quoted if view.role(i) == "tool")
    return tuple(sorted(tools.union(i for i in left_out if view.role(i) == "tool")))


def _left_out(
    view: ChatView, documents: Sequence[int], keep: Collection[int], blocks: Sequence[_Block]
) -> tuple[int, ...]:
    """The `documents` a user gave (theirs or a tool's, not a long reply of the model's own: that
    is the chat's history) dropped whole: not sent (in place, shortened or excerpted: all in
    `keep`) and not quoted, whole or by passages, by a recall block."""
    quoted = set(_recalled(blocks))
    return tuple(i for i in documents if i not in keep and i not in quoted and view.role(i) != "assistant")


def _recalled_passages(blocks: Sequence[_Block]) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """The chunk numbers the blocks quote of each message quoted by passages, in order."""
    return tuple((i, tuple(sorted(c))) for i, c in sorted(_sent_chunks({}, blocks).items()))
