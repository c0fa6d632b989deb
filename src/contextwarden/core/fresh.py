"""A new selection: the tokens it fills (`selection_target`: watermark and growth room), relevance
with the embedder's cosines when there is one, a question about the documents as a whole, large
old messages excerpted into what the selection left, and the recall block the question needs.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from .alternation import fits_bridged
from .chatview import ChatView
from .conversation import image_count
from .excerpt import MIN_EXCERPT_TOKENS, Excerpt, excerpt_turns
from .recall import _Block, _block, _block_tokens, _new_recall, _quote_anchor
from .relevance import score_messages, wants_whole
from .selection import choose_indices, mandatory_indices
from .semantic import VECTORS, Embed, similarities
from .tokens import TOKENS_PER_REPLY, TokenCounter
from .trim_types import (
    DEFAULT_GROWTH_TURNS,
    WHOLE_DOCUMENT_MIN_CHARS,
    WHOLE_DOCUMENT_MIN_TOKENS,
    TrimOptions,
    _Counted,
    _sized,
    documents,
)

__all__ = [
    "WHOLE_DOCUMENT_SHARE",
    "WHOLE_DOCUMENT_MIN_TOKENS",
    "WHOLE_DOCUMENT_MIN_CHARS",
    "BY_MESSAGE_TURNS",
    "selection_target",
    "picks_messages",
]

# A question about the documents as a whole (a summary, an overview) in a chat that holds one (an
# earlier message of at least WHOLE_DOCUMENT_MIN_TOKENS: `trim_types.documents`) gets this share
# of what the mandatory part leaves for the large old messages, before the rest is chosen.
WHOLE_DOCUMENT_SHARE = 0.75
# A lexical selection picks single messages, not whole turns, when what the budget leaves beside
# the mandatory part holds fewer than this many of the chat's earlier turns on average
# (`picks_messages`). At 1k the dev sets sit on either side: REALTALK's merged turns 4.7-6.5
# (chat 5: 13), LoCoMo's 11-13. bench/quality.py, lexical, all evidence kept, 1k: REALTALK
# 0.423 -> 0.483 (halves 0.465 / 0.397 -> 0.551 / 0.441; BM25 0.423, 0.472 / 0.392); LoCoMo and
# every larger budget on both unchanged; any value from 6.5 to 11 gives these numbers, 12 moves
# REALTALK 2k and LoCoMo 1k as well, always by message loses LoCoMo up to 0.034 (bench/README.md,
# "Lexical by message when the room holds few turns").
BY_MESSAGE_TURNS = 8


def selection_target(
    view: ChatView,
    costs: Sequence[int],
    max_tokens: int,
    low_watermark: float,
    growth_turns: int = DEFAULT_GROWTH_TURNS,
) -> int:
    """The tokens a new selection fills: `low_watermark` of the budget and, below 1.0, at most
    the budget less room for `growth_turns` turns like the last one (what came since the
    previous user message: its replies and this turn), never less than half the budget.

    Example:
        >>> chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        ...         {"role": "user", "content": "c"}]
        >>> selection_target(ChatView(chat), [100, 900, 100], 10_000, 0.8)
        8000
        >>> selection_target(ChatView(chat), [100, 900, 100], 4_000, 0.8)
        2000
    """
    target = int(max_tokens * low_watermark)
    current = view.current
    if low_watermark >= 1.0 or growth_turns <= 0 or not current:
        return target
    since = view.turns[current - 1].units[0].stop
    growth = sum(costs[since:])
    return min(target, max_tokens - min(growth_turns * growth, max_tokens // 2))


def picks_messages(view: ChatView, costs: Sequence[int], max_tokens: int) -> bool:
    """Whether a new selection without the embedder picks single messages rather than whole turns:
    in a chat of at least `BY_MESSAGE_TURNS` earlier turns and no images, the room `max_tokens`
    leaves beside the mandatory part and reply priming holds fewer than `BY_MESSAGE_TURNS` of
    them at their average cost. There a whole turn's other message takes
    room that other evidence needed (people's chats: several merged messages a turn); with room
    for many short turns, a matched message's reply beside it is what whole turns buy (LoCoMo).

    Example:
        >>> chat = [{"role": ("user", "assistant")[k % 2], "content": "x"} for k in range(17)]
        >>> picks_messages(ChatView(chat), [100] * 16 + [10], 1_000), picks_messages(ChatView(chat), [10] * 17, 1_000)
        (True, False)
    """
    earlier = view.turns[: view.current or 0]
    if len(earlier) < BY_MESSAGE_TURNS:  # a short chat (a pasted document, a tool's result) goes by turns
        return False
    if any(image_count(view.messages[i]) for turn in earlier for i in turn.indices):
        return False  # a quote holds no image: by message, one that would clash goes unless a bridge fits
    room = max_tokens - TOKENS_PER_REPLY - sum(costs[i] for i in mandatory_indices(view))
    return room * len(earlier) < BY_MESSAGE_TURNS * sum(costs[i] for turn in earlier for i in turn.indices)


def _new_selection(
    chat: _Counted,
    options: TrimOptions,
    pinned: Collection[int],
    notes: list[str],
    mandatory_cost: int,
    max_tokens: int,
    counter: TokenCounter,
    model: str | None,
    room: int,
    whole: bool = False,
) -> tuple[set[int], list[_Block], dict[int, Excerpt]]:
    """A new selection up to its target (watermark and growth room), less the recall room; large
    old messages excerpted into what it left; the recall block of what the question needs.
    `whole` (a question about the documents as a whole): `WHOLE_DOCUMENT_SHARE` of what the
    mandatory part leaves goes to the large old messages first, their chunks spread evenly."""
    view, costs, question = chat.view, chat.costs, chat.view.question
    # Estimated counts err high (1.1-2x): room to grow as well would starve the prompt; fill it.
    watermark = 1.0 if chat.mode == "estimate" else options.low_watermark
    target = selection_target(view, costs, max_tokens, watermark, options.growth_turns) - TOKENS_PER_REPLY
    embed = chat.pools.embed if options.strategy == "relevance" else None  # None once it failed this trim
    scores = semantic_scores(view, embed, notes) if embed is not None else None
    if embed is not None and scores is None:
        chat.pools.embed = None  # failed: the recall block is lexical too, without asking again
    reserve = int((target - mandatory_cost) * WHOLE_DOCUMENT_SHARE) if whole else 0
    by_message = scores is not None or (options.strategy == "relevance" and picks_messages(view, costs, max_tokens))
    frame = _block_tokens(view, (), counter, model) if by_message else None
    quoted: list[int] = []
    keep = choose_indices(
        view,
        costs,
        target - room - reserve,
        strategy=options.strategy,
        keep_last_turns=options.keep_last_turns,
        pinned=pinned,
        scores=scores,
        room=max_tokens - TOKENS_PER_REPLY,  # the latest answer is kept whenever it fits the budget
        by_message=by_message,  # the embedder's relevance holds for single messages, and small rooms need them
        frame=frame,  # a pick that would put two of one role together is quoted in the block
        quoted=quoted,
    )
    quotes = sum(costs[i] for i in quoted) + ((frame or 0) if quoted else 0)
    excerpts: dict[int, Excerpt] = {}
    if options.strategy == "relevance" and options.shorten and mandatory_cost <= max_tokens:
        # What the selection left: large old messages cut to it. With a document in the chat the
        # recall's room too (its passages are what the question needs; the recall, which quotes
        # whole messages, takes what is left); without one the recall keeps its room (chats of
        # long merged turns, REALTALK's, lost evidence when their excerpts took it). A follow-up on
        # a long text's exchange fills what its excerpt leaves: the recall's room aside.
        free = room if _holds_document(chat, keep) else 0
        spare = target - sum(costs[i] for i in keep) - quotes - (room - free)
        added, excerpts = excerpt_turns(
            view, keep, costs, spare, counter, model, scores=scores, embed=chat.pools.embed, whole=whole, keep_free=free
        )
        keep.update(added)
        quoted = [i for i in quoted if i not in keep]  # an excerpt's turn brought it in place
    blocks = _quoted_blocks(view, keep, quoted, quotes, counter, model)
    if not (room and question is not None):
        return keep, blocks, excerpts
    left = max_tokens - TOKENS_PER_REPLY - sum(_sized(costs, excerpts)[i] for i in keep)
    placed = _pictured_in_place(chat, keep, question, blocks, min(room, left - sum(b.tokens for b in blocks)))
    blocks = _requoted(view, keep, quoted, quotes, blocks, counter, model)
    room, left = room - placed, left - placed
    return keep, _with_recall(chat, keep, question, blocks, excerpts, room, left, counter, model), excerpts


def _requoted(
    view: ChatView,
    keep: Collection[int],
    quoted: Sequence[int],
    room: int,
    blocks: list[_Block],
    counter: TokenCounter,
    model: str | None,
) -> list[_Block]:
    """`blocks` (the selection's quote block) made again without the messages a pictured turn
    took in place (`_pictured_in_place`), within the `room` the selection counted for them."""
    if set(keep).isdisjoint(quoted):
        return blocks
    rest = [i for i in quoted if i not in keep]
    return _quoted_blocks(view, keep, rest, room, counter, model)


def _pictured_in_place(chat: _Counted, keep: set[int], question: int, blocks: Sequence[_Block], room: int) -> int:
    """The messages with images the question needs (`recall._Pool.wants_pictured`: its recall
    block would quote them, but a quote holds no image) added to `keep` in place, the most
    relevant first, each with its turn (or alone where the turn is partly sent), bridged where
    roles would not alternate (`alternation.fits_bridged`), out of the recall's `room`; what
    they cost. Messages the selection's own quote block (`blocks`) holds may come in place with
    such a turn (the caller quotes the rest again): a receipt's reply quoted by a selection by
    message left the receipt itself, a user message before the question's, no place to go."""
    view, costs = chat.view, chat.costs
    pool = chat.pools.of(question, view.system_indices)
    taken = keep.union(*(b.indices for b in blocks))
    if not pool.wants_pictured(taken, room):
        return 0
    spent = 0
    for i in sorted((i for i in pool.pictured if i not in taken), key=lambda i: (-pool.scores[i], i)):
        turn = next(t for t in view.turns if t.units[0].start <= i < t.units[-1].stop)
        unit = next(u for u in turn.units if i in u.indices)
        whole = turn.indices if keep.isdisjoint(turn.indices) else list(unit.indices)
        placed = fits_bridged(view, sorted(keep), whole, costs, MIN_EXCERPT_TOKENS)
        cost = sum(costs[k] for k in placed) if placed else room + 1
        if placed and keep.isdisjoint(placed) and spent + cost <= room:
            keep.update(placed)
            taken.update(placed)
            spent += cost
    return spent


def _with_recall(
    chat: _Counted,
    keep: set[int],
    question: int,
    blocks: list[_Block],
    excerpts: dict[int, Excerpt],
    room: int,
    left: int,
    counter: TokenCounter,
    model: str | None,
) -> list[_Block]:
    """`blocks` (the selection's quotes) and the recall block of what the question needs: its
    `room` within what is `left` of the budget less `blocks`; one block when both go right
    before the question."""
    view = chat.view
    pool = chat.pools.of(question, view.system_indices)
    sent = {i: e.chunks for i, e in excerpts.items()}
    taken = keep.union(*(b.indices for b in blocks))
    block = _new_recall(
        view, taken, question, min(room, left - sum(b.tokens for b in blocks)), counter, model, pool, sent=sent
    )
    if block is None:
        return blocks
    if blocks and blocks[0].anchor == question:  # one block a question: the quotes and the recall together
        merged = _block(view, question, sorted([*blocks[0].indices, *block.indices]), block.chunks(), counter, model)
        fits = merged is not None and merged.tokens <= blocks[0].tokens + block.tokens  # a frame less, always
        return [merged] if fits and merged else blocks
    return [*blocks, block]


def _quoted_blocks(
    view: ChatView, keep: Collection[int], quoted: Sequence[int], room: int, counter: TokenCounter, model: str | None
) -> list[_Block]:
    """The block (none or one) quoting the messages a selection by message quotes rather than sends in place
    (`selection.choose_indices`), within the `room` it counted for them: right before the first
    user message sent, so that it stays in the prefix the next turns send again (the question's
    own recall block comes and goes). Quoting joins texts into a few more tokens than they count
    apart: then the latest quoted go until it fits."""
    anchor = _quote_anchor(view, keep)
    chosen = list(quoted)
    while chosen and anchor is not None:
        block = _block(view, anchor, chosen, {}, counter, model)
        if block is None or block.tokens <= room:
            return [block] if block is not None else []
        chosen.pop()
    return []


def semantic_scores(view: ChatView, embed: Embed, notes: list[str]) -> list[float] | None:
    """Relevance with the embedder's similarities fused in; None (lexical, with a note in
    `notes`) when it fails. A selection on these scores picks single messages."""
    question = view.question
    if question is None:
        return None
    excluded = view.system_indices + view.orphan_indices
    try:
        similarity = similarities(
            view.messages, question, VECTORS, embed, skip=excluded, texts=view.texts, roles=view.roles
        )
    except LookupError:  # vectors not fetched yet (the filter embeds ahead of the trim)
        notes.append("some messages not embedded yet: relevance is lexical")
        return None
    except Exception as exc:  # any embedder: its failure must not cost the trim
        notes.append(f"embedder failed ({type(exc).__name__}): relevance is lexical")
        return None
    if similarity is None:
        return None
    return score_messages(
        view.messages, question=question, exclude=excluded, similarity=similarity, texts=view.texts, roles=view.roles
    )


def _documents(chat: _Counted) -> tuple[int, ...]:
    """The chat's documents (`trim_types.documents`) before the latest question."""
    question = chat.view.question
    return documents(chat.view, chat.costs if question is None else chat.costs[:question])


def _holds_document(chat: _Counted, keep: Collection[int]) -> bool:
    """A message the selection left out is a document (`_documents`)."""
    return any(i not in keep for i in _documents(chat))


def _wants_whole(chat: _Counted, options: TrimOptions) -> bool:
    """The latest question is about the documents as a whole (`relevance.wants_whole`) and the
    chat holds one before it (a chat of short messages keeps its selection: "summarise
    everything" there is served by the recall, and the prompt cache keeps hitting)."""
    question = chat.view.question
    if options.strategy != "relevance" or not options.shorten or question is None:
        return False
    return bool(_documents(chat)) and wants_whole(chat.view.text(question))
