"""Carrying the previous turn's decision: its selection sent again, byte for byte, so the
provider's prompt cache keeps hitting, plus what is new.

`_reused` is the full path's (every message read and counted); `_extend_previous` the shortcut
that reads and counts only what is sent and what is new. Both rebuild the previous turn's
excerpts (`_carried_excerpts`) and send its recall blocks again beside a new one for this
question, while they fit and the excerpts still serve it (`_recalls_kept`, `_excerpts_serve`).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import filterfalse

from .chatview import ChatView
from .conversation import Message, latest_question
from .decision import Fingerprints, TrimDecision
from .excerpt import EXCERPT_KEEP_SHARE, Excerpt, fresh_share, rebuild
from .recall import (
    _Block,
    _block,
    _left_out,
    _new_recall,
    _passages,
    _Pool,
    _Pools,
    _quote_anchor,
    _quoted_passages,
    _recall_record,
    _recalled,
    _recalled_passages,
    _sent_chunks,
    _tool_results,
    _with_blocks,
)
from .relevance import leans_on_latest
from .selection import carried_recalls, extend_previous, history_chars, reuse_previous, window_start
from .tokens import TOKENS_PER_REPLY, CountMode, TokenCounter
from .trim_types import TrimOptions, TrimResult, _Counted, _sized, documents

__all__ = ["RECALL_KEEP_SHARE", "FOLLOW_UP_KEEP_SHARE", "MAX_RECALL_BLOCKS"]

# A turn keeps the previous selection while the recall block that fits beside it holds at least
# this share of the relevance the question wants recalled (1.0: all of it). bench/multiturn.py,
# with earlier blocks that hold as much staying (`_Beside.all_kept`) and before
# FOLLOW_UP_KEEP_SHARE (which moves them by 0.005 at most), carried evidence / cacheable share
# at 2k | 4k, lexical: REALTALK 0.5 0.450 / 63.9% | 0.538 / 75.4%, 0.8 0.477 / 59.5% | 0.586 /
# 72.4%, 0.9 0.483 / 58.6% | 0.580 / 71.5%; LoCoMo 0.5 0.674 / 63.4% | 0.743 / 74.9%, 0.8 0.701
# / 58.5% | 0.766 / 72.0%, 0.9 0.701 / 56.9% | 0.772 / 71.4%. At 0.8 the share is about what
# 0.5 kept before earlier blocks stayed (59.4% | 72.1% on REALTALK), with more evidence (0.465
# | 0.550).
RECALL_KEEP_SHARE = 0.8
# ... and a follow-up's ("thanks!", "and in French?": `relevance.leans_on_latest`), which leans on
# the exchange just before it that the prompt holds in place: a trivial turn then keeps the cache.
FOLLOW_UP_KEEP_SHARE = 0.5
_CARRY_RECALLS = True  # earlier turns' blocks sent again (append-only); bench/multiturn.py measures both
MAX_RECALL_BLOCKS = 64  # recall blocks a prompt carries at most; past it, the newest give way


def _reused(
    chat: _Counted,
    options: TrimOptions,
    pinned: Collection[int],
    fingerprints: Fingerprints,
    mandatory: set[int],
    max_tokens: int,
    counter: TokenCounter,
    model: str | None,
    room: int,
) -> tuple[set[int] | None, list[_Block], dict[int, Excerpt]]:
    """The previous selection again, with its excerpts and recall blocks (None when it no longer
    fits, an excerpt cannot be sent again as it was, or it leaves no room for what this question
    needs)."""
    previous = options.previous
    assert previous is not None
    view, question = chat.view, chat.view.question
    excerpts = _carried_excerpts(view, previous, fingerprints, mandatory, counter, model)
    sized = _sized(chat.costs, excerpts or {})
    keep = reuse_previous(
        previous,
        fingerprints,
        view,
        sized,
        max_tokens - TOKENS_PER_REPLY,
        keep_last_turns=options.keep_last_turns,
        pinned=pinned,
        alone=set(pinned).intersection(options.pinned),  # an unpinned message goes alone no more
    )
    if excerpts is None or (keep is not None and not keep.issuperset(excerpts)):
        return None, [], {}  # an excerpt the next prompt cannot send again as it was: select anew
    if keep is None or question is None:  # (room is 0 when there is no question)
        return keep, [], excerpts
    base = TOKENS_PER_REPLY + sum(sized[i] for i in keep)
    system = view.system_indices
    kept_blocks = _recalls_kept(
        previous, fingerprints, keep, question, room, base, max_tokens, system, chat.pools, excerpts
    )
    if kept_blocks is None:  # the selection no longer leaves room for what this question needs
        return None, [], {}
    return keep, kept_blocks, excerpts


def _carried_excerpts(
    view: ChatView,
    previous: TrimDecision,
    fingerprints: Fingerprints,
    mandatory: Collection[int],
    counter: TokenCounter,
    model: str | None,
) -> dict[int, Excerpt] | None:
    """The previous turn's excerpts rebuilt (the same bytes) while their messages are where they
    were, unchanged and not mandatory now; None when one is not (the selection is made anew).
    Whether they still hold what the question needs, with the passages a recall block adds of
    them, is `_excerpts_serve`'s to say."""
    at = {i: k for k, i in enumerate(previous.at)}
    out: dict[int, Excerpt] = {}
    for i, chunks in previous.excerpts:
        k = at.get(i)
        if k is None or i >= len(view) or i in mandatory or fingerprints[i] != previous.kept[k]:
            return None
        excerpt = rebuild(view.messages[i], chunks, counter, model)
        if excerpt is None:
            return None
        out[i] = excerpt
    return out


def _recalls_kept(
    previous: TrimDecision,
    fingerprints: Sequence[str],
    keep: Collection[int],
    question: int,
    room: int,
    base: int,
    max_tokens: int,
    system: Sequence[int],
    pools: _Pools,
    excerpts: Mapping[int, Excerpt],
) -> list[_Block] | None:
    """The recall blocks of a turn that keeps the previous selection (`keep`, costing `base`,
    with its `excerpts`): the earlier turns' blocks again, unchanged, and a new one for this
    question. When they do not all fit, the newest earlier blocks give way first (the prompt
    stays the previous one up to the first that goes), but for those the selection quoted
    (`_held`: they go with it), and unless they, with a new block cut to what they leave,
    hold as much of this question's relevance (`_Beside.all_kept`: a follow-up's block
    stays); with none left, the new block is cut to the room left. None when that would hold
    less than `RECALL_KEEP_SHARE` (`FOLLOW_UP_KEEP_SHARE` for a follow-up) of the relevance
    the question wanted recalled, what it needs most is a message with images the selection
    let go (`_Pool.wants_pictured`: never quoted), an excerpt and
    the passages recalled of it miss what the question needs (`_excerpts_serve`), or an
    earlier block's messages moved: the caller then selects anew. With no `room` (no recall)
    only the selection's own blocks, while the excerpts serve the question. (The chat, its
    counter and model: the `pools`'.)"""
    view, counter, model = pools.view, pools.counter, pools.model
    blocks = _carried_blocks(view, previous, fingerprints, keep, counter, model)
    if blocks is None:
        return None
    if not room:
        held = blocks[: _held(view, keep, blocks)]
        fits = base + sum(b.tokens for b in held) <= max_tokens
        return held if fits and _excerpts_serve(view, excerpts, (), question, counter, model) else None
    if _asked_before(previous, fingerprints, question):  # this turn again (a second pass, a retry): as it was
        return _asked_again(previous, blocks, keep, question, room, (base, max_tokens), pools, system, excerpts)
    count = _held(view, keep, blocks)  # the selection's own: they stay with it, as part of it
    held, blocks = blocks[:count], blocks[count:]
    keep = set(keep).union(*(b.indices for b in held))
    left = max_tokens - base - sum(b.tokens for b in held)
    pool = pools.of(question, system)
    if pool.wants_pictured(keep, room):  # an image is never quoted: a new selection may send it in place
        return None
    beside = _Beside(pools, pool, keep, held, question, room, left, excerpts)
    found = beside.fewer_earlier(blocks)
    if found is None:
        return None
    stayed, chosen = found
    if stayed < len(blocks) and not any(b.chunks() for b in blocks[stayed:]):
        # Earlier blocks gave way for the new block's room: unless they and a new block cut to
        # what they leave hold as much of what this question needs (a follow-up's block, above
        # all): then they stay, and the cache with them. (Not those quoting passages: what a
        # passage holds is not its message's score; in document chats they filled the prompt.)
        every = beside.all_kept(blocks)
        if every is not None and _worth(beside.pool, every) >= _worth(beside.pool, chosen):
            chosen = every
    wanted = [*held, *chosen]
    return wanted if _excerpts_serve(view, excerpts, wanted, question, counter, model) else None


@dataclass(frozen=True, slots=True)
class _Beside:
    """A carried turn's recall blocks beside its selection (`keep`, with the `held` blocks that
    go with it and its `excerpts`), within `left` tokens: which earlier blocks stay, and the
    new block for `question` (at most `room`) from `pool`."""

    pools: _Pools
    pool: _Pool
    keep: Collection[int]
    held: Sequence[_Block]
    question: int
    room: int
    left: int
    excerpts: Mapping[int, Excerpt]

    def new_block(self, blocks: Sequence[_Block], room: int, spare: int | None = None) -> _Block | None:
        """This question's block beside `blocks`, of at most `room` tokens (`spare`: what it
        must fit in, or it is not counted exactly: see `_new_recall`)."""
        pools = self.pools
        used = set(self.keep).union(*(b.indices for b in blocks))
        sent = _sent_chunks(self.excerpts, [*self.held, *blocks])
        return _new_recall(pools.view, used, self.question, room, pools.counter, pools.model, self.pool, spare, sent)

    def fewer_earlier(self, blocks: Sequence[_Block]) -> tuple[int, list[_Block]] | None:
        """How many earlier `blocks` stay, and the blocks sent: the newest earlier blocks give
        way until the new block fits with all its room; when even none do, the new block cut
        to what is left, while it holds `RECALL_KEEP_SHARE` (`FOLLOW_UP_KEEP_SHARE` for a
        follow-up) of the relevance the whole one would (None when it does not: the selection
        misses too much of what the question needs, and goes)."""
        blocks = list(blocks)
        while True:
            spare = self.left - sum(b.tokens for b in blocks)
            # Past the budget already (spare < 0), no block can make it fit: the newest earlier
            # block goes (or, with none left, the selection alone is over and nothing fits).
            block = None
            if spare >= 0:
                block = self.new_block(blocks, self.room, spare)
                if block is None or block.tokens <= spare:
                    return len(blocks), [*blocks, block] if block is not None else blocks
            if not blocks:
                break
            blocks.pop()
        # (`block` is None here only when the selection alone is over the budget: nothing fits.)
        fitting = self.new_block((), self.left)
        view = self.pools.view
        share = FOLLOW_UP_KEEP_SHARE if leans_on_latest(view.text(self.question)) else RECALL_KEEP_SHARE
        if fitting is None or block is None or _worth(self.pool, [fitting]) < share * _worth(self.pool, [block]):
            return None
        return 0, [fitting]

    def all_kept(self, blocks: Sequence[_Block]) -> list[_Block] | None:
        """Every earlier block again and the new block cut to what they leave (at most its
        room); None when they alone are over what is left."""
        spare = self.left - sum(b.tokens for b in blocks)
        if spare < 0:
            return None
        block = self.new_block(blocks, min(self.room, spare))
        return [*blocks, block] if block is not None and block.tokens <= spare else list(blocks)


def _worth(pool: _Pool, blocks: Sequence[_Block]) -> float:
    """The relevance to the pool's question of the messages `blocks` quote whole (each once): a
    message quoted by passages scores as a whole, not by what those passages hold."""
    scores = pool.scores
    whole = set().union(*({i for i in b.indices if i not in b.chunks()} for b in blocks))
    return math.fsum(scores[i] for i in whole)


def _carried_blocks(
    view: ChatView,
    previous: TrimDecision,
    fingerprints: Sequence[str],
    keep: Collection[int],
    counter: TokenCounter,
    model: str | None,
) -> list[_Block] | None:
    """The previous turn's recall blocks made again, byte for byte (None when one cannot be:
    its messages moved, a passage changed)."""
    carried = carried_recalls(previous, fingerprints, keep) if _CARRY_RECALLS else []
    if carried is None:
        return None
    blocks = []
    for recall in carried[: MAX_RECALL_BLOCKS - 1]:
        parts = {i: p for k, i in enumerate(recall.at) if (p := recall.passages(k))}
        block = _block(view, recall.anchor, recall.at, parts, counter, model)
        if block is None:
            return None
        blocks.append(block)
    return blocks


def _held(view: ChatView, keep: Collection[int], blocks: Sequence[_Block]) -> int:
    """How many of the leading `blocks` go with the selection: those anchored at or before its
    first user message (what a selection by message quoted rather than sent in place, before
    what it sent: `fresh._quoted_blocks`). The cache holds them from the start of the history,
    so they stay while the selection does."""
    first = _quote_anchor(view, keep)
    held = 0
    while first is not None and held < len(blocks) and blocks[held].anchor <= first:
        held += 1
    return held


def _excerpts_serve(
    view: ChatView,
    excerpts: Mapping[int, Excerpt],
    blocks: Sequence[_Block],
    question: int | None,
    counter: TokenCounter,
    model: str | None,
) -> bool:
    """Each carried excerpt, with the passages the blocks recall of it, still holds
    `EXCERPT_KEEP_SHARE` of what a fresh excerpt of its size would hold for this question
    (`excerpt.fresh_share`): else what the question needs of it is not sent."""
    if not excerpts:
        return True
    text = view.text(question) if question is not None else ""
    sent = _sent_chunks(excerpts, blocks)
    return all(
        fresh_share(view.messages[i], sorted(sent[i]), text, e.tokens, counter, model) >= EXCERPT_KEEP_SHARE
        for i, e in excerpts.items()
    )


def _asked_again(
    previous: TrimDecision,
    blocks: list[_Block],
    keep: Collection[int],
    question: int,
    room: int,
    within: tuple[int, int],
    pools: _Pools,
    system: Sequence[int],
    excerpts: Mapping[int, Excerpt],
) -> list[_Block] | None:
    """The blocks of a turn trimmed again (a later pass, a retry) beside its selection, `within`
    (its cost, the budget): as they were, and a new one for the question when they hold none and
    the decision sent more than they now do (a regenerate after a tool loop's call that let the
    block go for results now gone: `trim._sent_without_blocks`). None when over the budget."""
    base, max_tokens = within
    sent = base + sum(b.tokens for b in blocks)
    if sent > max_tokens:
        return None
    if not room or previous.tokens <= sent or any(b.anchor == question for b in blocks):
        return blocks
    spare = max_tokens - sent
    beside = _Beside(pools, pools.of(question, system), keep, (), question, room, spare, excerpts)
    block = beside.new_block(blocks, room, spare)
    return [*blocks, block] if block is not None and block.tokens <= spare else blocks


def _asked_before(previous: TrimDecision, fingerprints: Sequence[str], question: int) -> bool:
    """The previous decision already kept this question (the same turn, trimmed again)."""
    at = previous.at
    return question in at and previous.kept[at.index(question)] == fingerprints[question]


def _history_unchanged(view: ChatView, previous: TrimDecision, scheme: str) -> tuple[Sequence[int], int] | None:
    """(system positions, history length) when the messages `previous` saw are there unchanged
    in length and counted alike; None when the shortcut cannot tell (nor when the decision does
    not know their documents: written before it recorded them)."""
    seen, messages = previous.seen, view.messages
    if seen > len(messages) or previous.counted_with != scheme or previous.seen_chars < 0 or previous.documents is None:
        return None
    system = view.system_positions
    chars = history_chars(messages, system)
    new_chars = history_chars(messages[seen:], [i - seen for i in system if i >= seen])
    if chars < 0 or new_chars < 0 or chars - new_chars != previous.seen_chars:
        return None
    return system, chars


def _extend_previous(
    view: ChatView,
    previous: TrimDecision,
    max_tokens: int,
    counter: TokenCounter,
    model: str | None,
    options: TrimOptions,
    room: int,
    pools: _Pools,
) -> TrimResult | None:
    """The previous turn's selection plus the new messages, reading and counting only what is
    sent and what is new: the messages dropped before are known from the decision's `seen`
    figures (their total length must be unchanged). None when this shortcut cannot tell (the
    chat was edited or shortened, another encoding counts, the whole chat now fits, the
    selection no longer fits); the full path then decides, with the same result."""
    scheme, mode = counter.scheme(model), counter.mode(model)
    known = _history_unchanged(view, previous, scheme)
    if known is None:
        return None
    system, chars = known
    fingerprints = view.fingerprints
    keep = extend_previous(previous, view, keep_last_turns=options.keep_last_turns)
    if keep is None:
        return None
    order = sorted(keep)
    question = latest_question(view.messages)
    if question is None or question not in keep:
        return None
    excerpts = _extended_excerpts(view, previous, fingerprints, keep, counter, model)
    if excerpts is None:
        return None
    new_costs, new_cost, before, after = _extended_sizes(view, previous, order, system, excerpts, counter, model)
    if before <= max_tokens or after > max_tokens or counter.scheme(model) != scheme:
        return None  # (an encoding that loaded meanwhile: the full path counts it all alike)
    blocks = _recalls_kept(previous, fingerprints, keep, question, room, after, max_tokens, system, pools, excerpts)
    if blocks is None:
        return None
    sent = [excerpts[i].message if i in excerpts else view.messages[i] for i in order]
    sent, stable, added = _with_blocks(sent, order, blocks, question if room else None)
    after += sum(b.tokens for b in blocks)
    at = tuple(i for i in order if i not in system)
    found = (*(previous.documents or ()), *documents(view, new_costs, previous.seen))
    decision = TrimDecision(
        max_tokens=max_tokens,
        tokens=after,
        strategy=options.strategy,
        kept=tuple(fingerprints[i] for i in at),
        at=at,
        seen=len(view),
        seen_tokens=previous.seen_tokens + new_cost,
        seen_chars=chars,
        counted_with=scheme,
        recalls=_recall_record(blocks, fingerprints),
        excerpts=previous.excerpts,
        documents=found,
    )
    result = _reused_result(
        sent, order, keep, len(view), before, after, max_tokens, mode, decision, blocks, (stable, added), excerpts
    )
    left_out = _left_out(view, found, keep, blocks)
    return _seen_cuts(replace(result, notes=tuple(pools.notes)), view, excerpts, blocks, left_out)


def _seen_cuts(
    result: TrimResult, view: ChatView, excerpts: Mapping[int, Excerpt], blocks: list[_Block], left_out: tuple[int, ...]
) -> TrimResult:
    """The shortcut's result with what it tells that needs the view: the passages only recall
    blocks quote, the documents `left_out`, the tool results among them."""
    quoted = _quoted_passages(view, excerpts, blocks)
    tools = _tool_results(excerpts, view, quoted, left_out)
    return replace(result, quoted_passages=quoted, tool_results=tools, left_out=left_out)


def _extended_sizes(
    view: ChatView,
    previous: TrimDecision,
    order: list[int],
    system: Sequence[int],
    excerpts: dict[int, Excerpt],
    counter: TokenCounter,
    model: str | None,
) -> tuple[list[int], int, int, int]:
    """The shortcut's counts: (each new message's, theirs but the system prompts', the whole
    chat's, what is sent), counting only the kept messages (excerpts at their size) and the new
    ones, each once; the rest is the decision's `seen_tokens`."""
    count, messages = counter.count_message, view.messages
    cost = {i: excerpts[i].tokens if i in excerpts else count(messages[i], model) for i in order}
    new = [cost[i] if i in cost else count(messages[i], model) for i in range(previous.seen, len(messages))]
    new_cost = sum(c for i, c in enumerate(new, previous.seen) if i not in system)  # kept, but for orphans
    before = TOKENS_PER_REPLY + previous.seen_tokens + sum(cost[i] for i in system) + new_cost
    return new, new_cost, before, TOKENS_PER_REPLY + sum(cost.values())


def _extended_excerpts(
    view: ChatView,
    previous: TrimDecision,
    fingerprints: Fingerprints,
    keep: set[int],
    counter: TokenCounter,
    model: str | None,
) -> dict[int, Excerpt] | None:
    """The shortcut's `_carried_excerpts`: the same, while every excerpt lies before the window
    `extend_previous` read (the current and recent turns, which are never excerpted, lie in
    it); None when one does not or cannot be sent again (the full path then decides)."""
    if not previous.excerpts:
        return {}
    start = window_start(previous, view)
    if start is None or any(i >= start or i not in keep for i, _ in previous.excerpts):
        return None
    return _carried_excerpts(view, previous, fingerprints, (), counter, model)


def _reused_result(
    sent: list[Message],
    order: list[int],
    keep: set[int],
    count: int,
    before: int,
    after: int,
    max_tokens: int,
    mode: CountMode,
    decision: TrimDecision,
    blocks: list[_Block],
    placed: tuple[int, tuple[int, ...]],
    excerpts: Mapping[int, Excerpt] | None = None,
) -> TrimResult:
    """The result of a turn that sent the previous selection again (its `excerpts` as well), plus
    what is new; `placed`: `_with_blocks`' stable prefix and where its blocks went. (Its caller
    adds what needs the view: the passages only blocks quote, the tool results among them.)"""
    excerpts = excerpts or {}
    shortened = tuple(sorted(excerpts))
    return TrimResult(
        messages=sent,
        kept=tuple(i for i in order if i not in excerpts) if excerpts else tuple(order),
        dropped=tuple(filterfalse(keep.__contains__, range(count))),
        shortened=shortened,
        excerpted=shortened,
        tokens_before=before,
        tokens_after=after,
        budget=max_tokens,
        count_mode=mode,
        decision=decision,
        reused=True,
        recalled=_recalled(blocks),
        stable_prefix=placed[0],
        added=placed[1],
        passages=_passages(excerpts, blocks),
        recalled_passages=_recalled_passages(blocks),
    )
