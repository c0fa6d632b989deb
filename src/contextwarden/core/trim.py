"""`trim_messages`: fit an OpenAI-format chat into a token budget.

The API over a pipeline of named stages, each in its own module: an earlier pass's recall blocks
taken out when the chat no longer fits (`_without`); the previous selection carried, reading
only what is new (`carry.py`); the chat whole when it fits; else the mandatory part, shortened
middle-out when it alone is over (`shorten.py`), then the previous selection reused
(`carry.py`) or a new one (`fresh.py`), each with the recall block its question needs
(`recall.py`), made into one `TrimResult` (`trim_types.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from itertools import repeat
from typing import Any

from ..caches import register
from .carry import _extend_previous, _reused
from .chatview import ChatView
from .conversation import Message, latest_question, message_text
from .decision import TrimDecision
from .excerpt import Excerpt
from .fresh import _new_selection, _wants_whole, selection_target
from .recall import (
    _RECALL_WEIGHTS,
    DEFAULT_RECALL_SHARE,
    MAX_RECALL_SHARE,
    _Block,
    _left_out,
    _passages,
    _Pools,
    _quoted_passages,
    _recall_record,
    _recalled,
    _recalled_passages,
    _tool_results,
    _with_blocks,
    recall_room,
)
from .recall_index import indexed
from .relevance import read_ahead, wants_whole
from .selection import (
    DEFAULT_KEEP_LAST_TURNS,
    DEFAULT_STRATEGY,
    MIN_KEEP_LAST_TURNS,
    STRATEGIES,
    Strategy,
    history_chars,
)
from .semantic import Embed
from .shorten import PINS_DROPPED_NOTE, PINS_SHORTENED_NOTE, SHORTENED_MARK, _mandatory_part
from .tokens import TOKENS_PER_REPLY, TokenCounter
from .trim_types import (
    DEFAULT_GROWTH_TURNS,
    DEFAULT_LOW_WATERMARK,
    WHOLE_DOCUMENT_MIN_CHARS,
    TrimOptions,
    TrimResult,
    _Counted,
    documents,
)

__all__ = [
    "TrimOptions",
    "TrimResult",
    "trim_messages",
    "carry_previous",
    "selection_target",
    "default_counter",
    "read_reply",
    "SHORTENED_MARK",
    "PINS_SHORTENED_NOTE",
    "PINS_DROPPED_NOTE",
    "DEFAULT_LOW_WATERMARK",
    "DEFAULT_GROWTH_TURNS",
    "DEFAULT_RECALL_SHARE",
    "recall_room",
]

_default_counter: TokenCounter | None = None


def default_counter() -> TokenCounter:
    """The counter `trim_messages` uses when given none (loads encodings in the caller)."""
    global _default_counter
    if _default_counter is None:
        _default_counter = TokenCounter(block=True)
    return _default_counter


def _clear_default_counter() -> None:
    if _default_counter is not None:
        _default_counter.clear()


register("trim._default_counter", _clear_default_counter)


def read_reply(message: Message, counter: TokenCounter, model: str | None, *, terms: bool = True) -> None:
    """Read a reply that the next turn will send back: count its tokens and, with `terms` (the
    relevance strategy scores it), cut its search terms now, so that turn's trim reads only its
    new question (the filter's outlet calls this).

    Example:
        >>> read_reply({"role": "assistant", "content": "Miso is a tabby cat."}, default_counter(), "gpt-4o")
    """
    counter.count_message(message, model)
    if terms:
        read_ahead(message_text(message))


def trim_messages(
    messages: Sequence[Message] | ChatView,
    *,
    max_tokens: int,
    model: str | None = None,
    token_counter: TokenCounter | None = None,
    strategy: Strategy = DEFAULT_STRATEGY,
    keep_last_turns: int = DEFAULT_KEEP_LAST_TURNS,
    pinned: Collection[int] = (),
    previous: TrimDecision | None = None,
    low_watermark: float = DEFAULT_LOW_WATERMARK,
    growth_turns: int = DEFAULT_GROWTH_TURNS,
    embed: Embed | None = None,
    recall_share: float = DEFAULT_RECALL_SHARE,
    shorten: bool = True,
    added: Collection[int] = (),
) -> TrimResult:
    """Fit `messages` into `max_tokens`, keeping what a valid, useful prompt needs.

    Guarantees: system messages and the latest user message (with everything after it, such
    as a tool loop in progress) are always kept; an assistant `tool_calls` message and its
    `tool` replies are kept or dropped together, and unanswered calls or orphan `tool`
    messages are never sent; the history still starts with a user message; kept messages are
    the same dicts, in their order; the input is never modified. When the mandatory part
    alone is over budget, the largest shortenable text (system prompt, tool results, then the
    latest user message as a last resort, by passages: its ends, then what it asks about) is
    cut with a marker. A chat that fits is
    returned whole without scoring anything, so trimming the result again changes nothing.
    Same input, same output.

    Args:
        messages: OpenAI-format messages (Open WebUI's extra keys are fine), or a `ChatView`
            of them: a caller that trims the same list more than once (other budgets, the
            next turn's shortcut first) reads it once.
        max_tokens: the prompt budget, counted with per-message overhead and images.
        model: model id, to pick the encoding (o200k_base unless GPT-4/3.5).
        token_counter: a shared `TokenCounter`; by default one that loads encodings in the
            calling thread.
        strategy: `"relevance"` (default) keeps the older messages that matter most to the
            latest question (BM25 and friends, see `relevance.py`), whole units, in their
            order; `"recent"` keeps the newest whole turns that fit.
        keep_last_turns: the last N turns (the current one counts) are kept before anything
            else, while they fit. Default 1 (the least): the current turn only.
        pinned: input indices (positions in `messages`) that are mandatory content (with their
            unit), e.g. messages a user marked with `!pin`: kept whatever the watermark; when the
            mandatory part is over budget they are shortened middle-out like the rest of it (a
            note says so).
        previous: the `decision` of this chat's last trim (or its `to_dict()`). While its kept messages are still
            there and they plus everything newer fit, exactly those are sent again plus the
            new messages, so the prompt prefix stays byte-identical and provider caches hit.
            Such a turn reads and counts only those messages: the dropped ones are known
            from the decision, checked by their total length (an edit that keeps a dropped
            message's length shows in `tokens_before` only at the next new selection).
        low_watermark: when a new selection is made, it fills only this share of
            `max_tokens` (default 0.8), so the chat can grow for a few turns on the same
            prefix before the next cut. 1.0 fills the budget, as does a selection made on
            estimated counts (no encoding loaded: they already err 1.1-2x high).
        growth_turns: below a `low_watermark` of 1.0, a new selection also leaves room for
            this many more turns the size of the last one (default 2; never more than half
            the budget), so chats with long turns keep their prefix, and the provider's
            prompt cache, for as many turns as chats with short ones. 0: the watermark only.
        embed: an embedder, `fn(texts) -> vectors` (e.g. a sentence-transformers model's
            `encode`), for semantic relevance: a new selection then weighs each message's
            cosine to the question beside BM25. Vectors are cached per process by text, so
            later turns embed only new messages. When it fails, relevance stays lexical and
            a note says so.
        recall_share: with `previous` given (a chat that goes on) and the relevance
            strategy, up to this share of the budget (default 0.40 at 2,000 tokens; scaled by
            sqrt(2,000 / max_tokens) for other budgets, at most 0.5: see `recall_room`) is kept
            for a recall block: the dropped messages most relevant to the latest question,
            quoted verbatim in one user message right before it, followed by an assistant
            `SUMMARY_ACK` so that roles alternate (`TrimResult.recalled` lists them; the
            budget counts both). The prefix before the block stays the previous turn's, so provider caches
            still hit, while the question still gets what it needs. The previous selection is
            given up (a cache miss) only when it no longer fits beside the block it needs; a
            new one then fills its target less this share. 0: no recall.
        shorten: False sends mandatory content that is over budget whole (`over_budget`)
            instead of cutting it, e.g. when tool definitions alone fill the window and no
            cut could make the prompt fit.
        added: when `messages` is an earlier trim's output (a later pass of the same turn),
            that result's `added`: its recall blocks, kept while the chat fits, else replaced.
            Nothing is taken for the trim's own by its text: a user's message that starts like
            a recall block is the user's.

    Raises:
        TypeError: `messages` is not a list of message dicts, or an argument is not of its type.
        ValueError: an option is out of its range, `pinned` holds a position the chat has not,
            `previous` is a dict that is not a decision's `to_dict()`.

    Example:
        >>> chat = [{"role": "system", "content": "Be brief."},
        ...         {"role": "user", "content": "old question " * 50},
        ...         {"role": "assistant", "content": "old answer " * 50},
        ...         {"role": "user", "content": "What is 2+2?"}]
        >>> result = trim_messages(chat, max_tokens=60, model="gpt-4o")
        >>> result.kept, result.dropped
        ((0, 3), (1, 2))
        >>> chat += [{"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]
        >>> again = trim_messages(chat, max_tokens=60, model="gpt-4o", previous=result.decision)
        >>> again.kept, again.reused
        ((0, 3, 4, 5), True)

    A later question about something dropped gets it recalled, and the prefix stays:

        >>> chat = [{"role": "system", "content": "Be brief."},
        ...         {"role": "user", "content": "My locker code is 4417." + " I keep my swim kit there." * 20},
        ...         {"role": "assistant", "content": "Noted: locker code 4417."}]
        >>> for n in range(8):
        ...     chat += [{"role": "user", "content": f"Tell me fact {n} about rivers. " * 4},
        ...              {"role": "assistant", "content": f"Fact {n}: rivers flow downhill. " * 8}]
        >>> chat.append({"role": "user", "content": "Rivers again?"})
        >>> first = trim_messages(chat, max_tokens=1_000, model="gpt-4o", low_watermark=0.5)
        >>> first.dropped[:2]  # the locker turn is not sent...
        (1, 2)
        >>> chat += [{"role": "assistant", "content": "Yes."},
        ...          {"role": "user", "content": "Which locker code did I ask you to remember at the start?"}]
        >>> later = trim_messages(chat, max_tokens=1_000, model="gpt-4o", previous=first.decision)
        >>> later.reused, later.recalled[:2], later.messages[: len(first.messages)] == first.messages
        (True, (1, 2), True)
        >>> later.stable_prefix == len(first.messages) + 1  # "Yes." too: the next turn sends them again
        True
        >>> block = later.messages[later.stable_prefix]["content"]  # ...until a question needs it
        >>> block.splitlines()[0]
        '[contextwarden] Recalled from earlier in this chat (older messages, quoted verbatim):'
        >>> "user: My locker code is 4417." in block and "assistant: Noted: locker code 4417." in block
        True
        >>> [m["role"] for m in later.messages[-4:]]  # the block, its acknowledgement, the question
        ['assistant', 'user', 'assistant', 'user']
    """
    options = TrimOptions(
        strategy, keep_last_turns, pinned, previous, low_watermark, growth_turns, embed, recall_share, shorten, added
    )
    options = _checked(max_tokens, options, model, token_counter)
    view = _view_of(messages)
    if not all(map(isinstance, view.messages, repeat(dict))):
        index, message = next((i, m) for i, m in enumerate(view.messages) if not isinstance(m, dict))
        raise TypeError(f"messages[{index}] is {type(message).__name__}, not a dict")
    _check_pinned(options.pinned, len(view))
    return _trim(view, max_tokens, model, token_counter or default_counter(), options)


def carry_previous(
    messages: Sequence[Message] | ChatView,
    *,
    max_tokens: int,
    model: str | None = None,
    token_counter: TokenCounter | None = None,
    **options: Any,
) -> TrimResult | None:
    """`trim_messages(messages, max_tokens=..., **options)` when the `previous` decision carries
    into this turn and this process read the chat before, else None (then call that).

    This is the next turn's path alone: the previous selection with the new messages and this
    question's recall, reading only what is new. Its cost is bounded by what is new, so a
    caller can run it where a whole-chat trim would not belong (the filter: on its event loop).
    None also when it would have to read every message first: the previous turn was trimmed
    in another process, the chat was edited, an earlier pass added a recall block, pins.

    Example:
        >>> chat = [{"role": "user", "content": "My locker code is 4417. " + "Filler. " * 60},
        ...         {"role": "assistant", "content": "Noted. " * 60},
        ...         {"role": "user", "content": "Tell me about trains."}]
        >>> first = trim_messages(chat, max_tokens=200, model="gpt-4o")
        >>> chat += [{"role": "assistant", "content": "On rails."}, {"role": "user", "content": "And buses?"}]
        >>> second = trim_messages(chat, max_tokens=200, model="gpt-4o", previous=first.decision)
        >>> chat += [{"role": "assistant", "content": "On roads."}, {"role": "user", "content": "My code?"}]
        >>> carried = carry_previous(chat, max_tokens=200, model="gpt-4o", previous=second.decision)
        >>> carried == trim_messages(chat, max_tokens=200, model="gpt-4o", previous=second.decision)
        True
        >>> carry_previous(chat, max_tokens=200, model="gpt-4o") is None  # no previous decision
        True
    """
    chosen = _checked(max_tokens, TrimOptions(**options), model, token_counter)
    previous = chosen.previous
    view = _view_of(messages)
    messages = view.messages
    _check_pinned(chosen.pinned, len(view))
    if previous is None or not all(map(isinstance, messages, repeat(dict))):
        return None
    if not _carries(chosen, view):
        return None
    room = _recall_room(max_tokens, chosen)
    if room and (chosen.added or not indexed(messages, seen=previous.seen, weights=_RECALL_WEIGHTS)):
        return None
    counter = token_counter or default_counter()
    pools = _Pools(view, counter, model, previous.seen, chosen.embed)
    return _extend_previous(view, previous, max_tokens, counter, model, chosen, room, pools)


# A carried selection sending under this share of the budget and under half what it sent when it
# was made (a tool loop's results gone) is made anew (`_starved`).
STARVED_SHARE = 0.25


def _carries(options: TrimOptions, view: ChatView) -> bool:
    """The previous decision may carry into this turn (the shortcut is worth trying): it saw
    messages, no pin asks for a new selection, and the question is not about the documents as
    a whole (which gets the budget filled: `_wants_whole`)."""
    if options.previous is None or options.previous.seen == 0 or options.pinned:
        return False
    latest = latest_question(view.messages)
    if options.strategy != "relevance" or latest is None or not wants_whole(view.text(latest)):
        return True
    messages, question = view.messages, view.messages[latest]
    return not any(
        len(view.text(i)) >= WHOLE_DOCUMENT_MIN_CHARS for i in range(len(view)) if messages[i] is not question
    )


def _recall_room(max_tokens: int, options: TrimOptions) -> int:
    """The recall's room: a chat that goes on (a previous decision) under the relevance strategy."""
    relevance = options.previous is not None and options.strategy == "relevance"
    return recall_room(max_tokens, options.recall_share) if relevance else 0


def _trim(
    view: ChatView, max_tokens: int, model: str | None, counter: TokenCounter, options: TrimOptions
) -> TrimResult:
    """`trim_messages` in steps: an earlier pass's recall block taken out when the chat no longer
    fits; the previous selection extended, reading only what is new; the chat whole when it fits;
    else a selection (`_select`)."""
    previous, messages = options.previous, view.messages
    room = _recall_room(max_tokens, options)
    earlier = sorted(i for i in set(options.added) if type(i) is int and 0 <= i < len(messages))
    if room and earlier and not _fits_whole(view, max_tokens, counter, model):
        # shorten=True as before this was split into steps (the recursive call did not pass it on)
        rest = replace(
            options,
            pinned=[p - sum(e < p for e in earlier) for p in options.pinned if p not in earlier],
            shorten=True,
            added=(),
        )

        def inner(rest_messages: list[Message]) -> TrimResult:
            return _trim(ChatView(rest_messages), max_tokens, model, counter, rest)

        result = _without(earlier, messages, inner, counter, model)
        return _sent_without_blocks(result, previous) if _in_tool_loop(view) else result
    pools = _Pools(view, counter, model, previous.seen if previous is not None else 0, options.embed)
    if previous is not None and _carries(options, view):
        extended = _extend_previous(view, previous, max_tokens, counter, model, options, room, pools)
        if extended is not None and not _starved(extended, previous, max_tokens):
            return extended
    costs, mode, scheme = counter.count_each_as(messages, model)  # the label goes with these counts
    chat = _Counted(view, costs, mode, scheme, TOKENS_PER_REPLY + sum(costs), pools)
    if chat.before <= max_tokens and not view.orphans:
        everything = tuple(range(len(messages)))
        result = TrimResult(list(messages), everything, (), (), chat.before, chat.before, max_tokens, mode)
        return replace(result, added=tuple(earlier) if room else ())
    result = _select(chat, max_tokens, model, counter, options, room)
    if previous is not None and result.reused and _starved(result, previous, max_tokens):
        return _trim(view, max_tokens, model, counter, replace(options, previous=None))  # as a first turn
    return result


def _starved(result: TrimResult, previous: TrimDecision, max_tokens: int) -> bool:
    """A carried selection made anew: one made for at most half this budget (a `!budget=300`
    turn's: carried once the chat outgrew the budget after turns sent whole, 20 of 32 messages
    went where a new selection sends 26; under a quarter of the budget before that), or one that
    fills under `STARVED_SHARE` of the budget and sends under half what it sent (a tool loop's
    results, gone on a regenerate). Not again the next turn: the new decision is this budget's.
    (The filter stores a decision's budget as the whole prompt's, so the passes of a turn, whose
    fixed parts differ, compare alike: `trimpass._budget_terms`.)"""
    if previous.max_tokens * 2 <= max_tokens:
        return True
    return result.tokens_after < max_tokens * STARVED_SHARE and result.tokens_after * 2 < previous.tokens


def _select(
    chat: _Counted, max_tokens: int, model: str | None, counter: TokenCounter, options: TrimOptions, room: int
) -> TrimResult:
    """The mandatory part (shortened when it alone is over), then the previous selection reused
    or a new one, each with the recall block this question needs."""
    mandatory, replaced, over, notes, pinned, passages = _mandatory_part(
        chat.view, chat.costs, max_tokens, counter, model, options.pinned, options.shorten
    )
    mandatory_cost = TOKENS_PER_REPLY + sum(chat.costs[i] for i in mandatory)
    fingerprints = chat.view.fingerprints
    if mandatory_cost > max_tokens or chat.view.question is None:
        room = 0
    keep: set[int] | None = None
    blocks: list[_Block] = []
    excerpts: dict[int, Excerpt] = {}
    whole = _wants_whole(chat, options)
    if whole:  # the whole budget for the documents as a whole, not the recall of passages
        options, room = replace(options, low_watermark=1.0, growth_turns=0), 0
    if options.previous is not None and mandatory_cost <= max_tokens and not whole:
        keep, blocks, excerpts = _reused(
            chat, options, pinned, fingerprints, set(mandatory), max_tokens, counter, model, room
        )
    reused = keep is not None
    if keep is None:
        keep, blocks, excerpts = _new_selection(
            chat, options, pinned, notes, mandatory_cost, max_tokens, counter, model, room, whole
        )
    # A shortened copy of a message the selection let go (a pinned reply whose turn has no
    # question may not lead the history) is not sent: it is dropped, not shortened.
    replaced = {i: m for i, m in replaced.items() if i in keep}
    cut = tuple((i, *passages[i]) for i in sorted(passages) if i in replaced)
    replaced.update((i, e.message) for i, e in excerpts.items())
    notes += [note for note in chat.pools.notes if note not in notes]
    result = _result(chat, keep, blocks, replaced, excerpts, fingerprints, max_tokens, counter, model, options.strategy)
    return replace(result, over_budget=over, notes=tuple(notes), reused=reused, shortened_passages=cut)


def _result(
    chat: _Counted,
    keep: set[int],
    blocks: list[_Block],
    replaced: dict[int, Message],
    excerpts: dict[int, Excerpt],
    fingerprints: Sequence[str],
    max_tokens: int,
    counter: TokenCounter,
    model: str | None,
    strategy: Strategy,
) -> TrimResult:
    """What to send (kept messages, shortened copies and excerpts, recall blocks), its count, and
    the decision (the caller adds what the selection knows: reused, over budget, notes)."""
    view, costs = chat.view, chat.costs
    messages = view.messages
    order = sorted(keep)
    sent = [replaced.get(i, messages[i]) for i in order]
    after = TOKENS_PER_REPLY + sum(
        counter.count_message(replaced[i], model) if i in replaced else costs[i] for i in order
    )
    system = set(view.system_indices)
    at = tuple(i for i in order if i not in system)
    sent, stable, added = _with_blocks(sent, order, blocks, view.question)
    after += sum(b.tokens for b in blocks)
    quoted = _quoted_passages(view, excerpts, blocks)
    found = documents(view, costs)
    left_out = _left_out(view, found, keep, blocks)
    decision = TrimDecision(
        max_tokens=max_tokens,
        tokens=after,
        strategy=strategy,
        kept=tuple(fingerprints[i] for i in at),
        at=at,
        seen=len(messages),
        seen_tokens=sum(c for i, c in enumerate(costs) if i not in system),
        seen_chars=history_chars(messages, view.system_indices),
        counted_with=chat.scheme,
        recalls=_recall_record(blocks, fingerprints),
        excerpts=tuple((i, e.chunks) for i, e in sorted(excerpts.items())),
        documents=found,
    )
    return TrimResult(
        messages=sent,
        kept=tuple(i for i in order if i not in replaced),
        dropped=tuple(i for i in range(len(messages)) if i not in keep),
        shortened=tuple(sorted(replaced)),
        tokens_before=chat.before,
        tokens_after=after,
        budget=max_tokens,
        count_mode=chat.mode,
        decision=decision,
        recalled=_recalled(blocks),
        stable_prefix=stable,
        excerpted=tuple(sorted(excerpts)),
        added=added,
        passages=_passages(excerpts, blocks),
        recalled_passages=_recalled_passages(blocks),
        quoted_passages=quoted,
        tool_results=_tool_results(excerpts, view, quoted, left_out),
        left_out=left_out,
    )


def _fits_whole(view: ChatView, max_tokens: int, counter: TokenCounter, model: str | None) -> bool:
    """The whole list fits `max_tokens` and holds nothing a trim would leave out (orphans)."""
    fits = TOKENS_PER_REPLY + sum(counter.count_each(view.messages, model)) <= max_tokens
    return fits and not view.orphans


def _without(
    blocks: Sequence[int],
    messages: Sequence[Message],
    trim: Callable[[list[Message]], TrimResult],
    counter: TokenCounter,
    model: str | None,
) -> TrimResult:
    """`trim` of `messages` without the recall blocks an earlier pass added, in the input's
    indices, its decision's too (the blocks count as dropped: a new one is made if the question
    needs it)."""
    skip = set(blocks)
    rest = [i for i in range(len(messages)) if i not in skip]
    inner = trim([messages[i] for i in rest])
    back = rest.__getitem__
    return replace(
        inner,
        kept=tuple(map(back, inner.kept)),
        dropped=tuple(sorted([*map(back, inner.dropped), *blocks])),
        shortened=tuple(map(back, inner.shortened)),
        recalled=tuple(map(back, inner.recalled)),
        recalled_passages=tuple((back(i), c) for i, c in inner.recalled_passages),
        quoted_passages=tuple((back(i), sent, total) for i, sent, total in inner.quoted_passages),
        shortened_passages=tuple((back(i), sent, total) for i, sent, total in inner.shortened_passages),
        excerpted=tuple(map(back, inner.excerpted)),
        tool_results=tuple(map(back, inner.tool_results)),
        left_out=tuple(map(back, inner.left_out)),
        tokens_before=TOKENS_PER_REPLY + sum(counter.count_each(messages, model)),
        decision=None if inner.decision is None else inner.decision.relocated(dict(enumerate(rest))),
    )


def _in_tool_loop(view: ChatView) -> bool:
    """The chat ends in the current turn's tool loop (messages after its question): a loop's call."""
    question = view.question
    return question is not None and question < len(view) - 1


def _sent_without_blocks(result: TrimResult, previous: TrimDecision | None) -> TrimResult:
    """`result` of a tool loop's call that let the earlier pass's recall blocks go and sent the
    rest whole: its decision `previous` (what that rest is) without them, as what went. Stored
    with them, the next turn (the loop now history) put them back before the old question. (A
    request pass cut for the sources keeps the inlet's: see DESIGN.md, later passes.)"""
    if result.decision is not None or previous is None:
        return result
    return replace(result, decision=replace(previous, tokens=result.tokens_after, recalls=()))


def _view_of(messages: object) -> ChatView:
    """`messages` read as a `ChatView`; TypeError naming what they are when not a list of messages."""
    if isinstance(messages, ChatView):
        return messages
    if isinstance(messages, (dict, str, bytes)):
        hint = "pass body['messages']" if isinstance(messages, dict) else "decode the JSON first"
        raise TypeError(f"messages is a {type(messages).__name__}, not a list of messages ({hint})")
    if not isinstance(messages, Sequence):  # None, a generator: its positions name what is kept
        raise TypeError(f"messages must be a list of message dicts, got {type(messages).__name__}")
    return ChatView(messages)


def _checked(max_tokens: int, options: TrimOptions, model: object, counter: object) -> TrimOptions:
    """`options` with `previous` read (a `TrimDecision`, or its `to_dict()`); TypeError or
    ValueError naming the argument that is wrong."""
    _check_options(max_tokens, options)
    if model is not None and not isinstance(model, str):
        raise TypeError(f"model must be a model id (str) or None, got {type(model).__name__}")
    if counter is not None and not isinstance(counter, TokenCounter):
        raise TypeError(f"token_counter must be a TokenCounter or None, got {type(counter).__name__}")
    if options.embed is not None and not callable(options.embed):
        raise TypeError(f"embed must be a function of a list of texts, or None, got {type(options.embed).__name__}")
    if not isinstance(options.shorten, bool):
        raise TypeError(f"shorten must be True or False, got {options.shorten!r}")
    previous: object = options.previous
    if previous is None or isinstance(previous, TrimDecision):
        return options
    if not isinstance(previous, dict):
        raise TypeError(f"previous must be a TrimDecision, its to_dict(), or None, got {type(previous).__name__}")
    try:
        return replace(options, previous=TrimDecision.from_dict(previous))
    except ValueError as exc:
        raise ValueError(f"previous is not a TrimDecision's to_dict() ({exc})") from None


def _check_pinned(pinned: object, count: int) -> None:
    """Raise TypeError or ValueError unless `pinned` holds positions of the `count` messages."""
    if isinstance(pinned, (str, bytes, dict)) or not isinstance(pinned, Collection):
        raise TypeError(f"pinned must be a collection of message positions, got {type(pinned).__name__}")
    for index in pinned:
        if type(index) is not int or not 0 <= index < count:
            positions = f"0-{count - 1}" if count else "none"
            raise ValueError(f"pinned holds {index!r}: not a message position (the chat's: {positions})")


def _check_options(max_tokens: int, options: TrimOptions) -> None:
    """Raise ValueError naming the option and its valid values."""
    strategy, keep_last_turns, low_watermark = options.strategy, options.keep_last_turns, options.low_watermark
    growth_turns, recall_share = options.growth_turns, options.recall_share
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(map(repr, STRATEGIES))}, got {strategy!r}")
    if (
        not isinstance(keep_last_turns, int)
        or isinstance(keep_last_turns, bool)
        or keep_last_turns < MIN_KEEP_LAST_TURNS
    ):
        least = MIN_KEEP_LAST_TURNS
        raise ValueError(
            f"keep_last_turns must be an int >= {least} (the current turn counts), got {keep_last_turns!r}"
        )
    if not isinstance(low_watermark, (int, float)) or not 0.0 < low_watermark <= 1.0:
        raise ValueError(f"low_watermark must be in (0, 1], got {low_watermark!r}")
    if not isinstance(growth_turns, int) or isinstance(growth_turns, bool) or growth_turns < 0:
        raise ValueError(f"growth_turns must be an int >= 0, got {growth_turns!r}")
    if not isinstance(recall_share, (int, float)) or not 0.0 <= recall_share <= MAX_RECALL_SHARE:
        raise ValueError(f"recall_share must be in [0, {MAX_RECALL_SHARE}], got {recall_share!r}")
