"""`trim_messages`: fit an OpenAI-format chat into a token budget.

Composes the core: the conversation view, token counts, the selection, and middle-out
shortening of mandatory content that alone is over the budget.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import filterfalse, repeat
from operator import add, mul
from typing import Any

from .caches import register
from .conversation import (
    SUMMARY_ACK_MESSAGE,
    Conversation,
    Message,
    message_text,
    read_conversation,
    recall_message,
    recall_quotes,
    system_positions,
)
from .excerpt import (
    CUT_MARK,
    EXCERPT_KEEP_SHARE,
    Excerpt,
    cuttable,
    excerpt_turns,
    fresh_share,
    passage_quote,
    rebuild,
    recall_passages,
)
from .recall_index import indexed, recall_scores
from .relevance import DEFAULT_RELEVANCE_WEIGHTS, RelevanceWeights, read_ahead, score_messages, wants_whole
from .selection import (
    DEFAULT_KEEP_LAST_TURNS,
    DEFAULT_STRATEGY,
    STRATEGIES,
    Fingerprints,
    Recall,
    Strategy,
    TrimDecision,
    carried_recalls,
    choose_indices,
    choose_recall,
    extend_previous,
    history_chars,
    mandatory_indices,
    neighbour_reach,
    recall_candidates,
    recall_order,
    reuse_previous,
    window_start,
)
from .semantic import VECTORS, Embed, similarities
from .tokens import TOKENS_PER_MESSAGE, TOKENS_PER_REPLY, TOKENS_PER_ROLE, CountMode, TokenCounter

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

DEFAULT_LOW_WATERMARK = 0.8
DEFAULT_GROWTH_TURNS = 2
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
# A turn keeps the previous selection while the recall block that fits beside it holds at least
# this share of the relevance the question wants recalled (1.0: all of it; bench/multiturn.py,
# before main's cost exponent 0.25: 0.5 sends the evidence a little less often, 0.79 vs 0.83 of
# a fresh trim's at 2k, and misses the cache on 4 turns in 100 instead of 6).
RECALL_KEEP_SHARE = 0.5
_CARRY_RECALLS = True  # earlier turns' blocks sent again (append-only); bench/multiturn.py measures both
MAX_RECALL_BLOCKS = 64  # recall blocks a prompt carries at most; past it, the newest give way
MAX_PASSAGE_MESSAGES = 4  # long messages a recall block looks into for passages, the most relevant first,
MAX_DROPPED_PASSAGE_MESSAGES = 1  # ... of them not in the prompt at all (each is scored anew every turn)
MIN_PASSAGE_ROOM = 64  # tokens left below which a recall block looks for no further passages
# A message costing less is recalled whole or not at all, never by passages: a person's long
# message is not a document (REALTALK at 1k: 0.027 less evidence sent when its passages were).
MIN_PASSAGE_TOKENS = 1_000
# A question about the documents as a whole (a summary, an overview) in a chat that holds one (an
# earlier message of at least WHOLE_DOCUMENT_MIN_TOKENS) gets this share of what the mandatory
# part leaves for the large old messages, before the rest is chosen.
WHOLE_DOCUMENT_SHARE = 0.75
WHOLE_DOCUMENT_MIN_TOKENS = 2_000
# The next turn's shortcut checks for such a message by its length: a token is at least 3 characters
# in the texts this holds for (bench/speed.py's chats of ~500-token turns use "summary" freely).
WHOLE_DOCUMENT_MIN_CHARS = 3 * WHOLE_DOCUMENT_MIN_TOKENS
_RECALL_WEIGHTS = replace(DEFAULT_RELEVANCE_WEIGHTS, recency=0.0)  # recalled for relevance alone
SHORTENED_MARK = CUT_MARK
PINS_SHORTENED_NOTE = "pinned messages over budget: shortened"
PINS_DROPPED_NOTE = "pinned messages over budget even shortened: kept only while they fit"
MIN_KEPT_TEXT_TOKENS = 0

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


@dataclass(frozen=True, slots=True)
class TrimResult:
    """What `trim_messages` chose.

    `messages` is what to send. `kept` holds the ascending input indices sent as the very
    same dicts; `shortened` those sent as shortened copies; `dropped` the rest. `decision`
    is what to pass as `previous` next turn (None when nothing was dropped); `reused` tells
    that the previous turn's selection was kept and only new messages were added.

    `recalled` holds the input indices this turn's recall blocks quote (each a user message and
    an assistant acknowledgement right before a kept user message, see `trim_messages`): dropped
    messages, whole or by passages, and excerpted ones by passages their excerpt left out;
    `recalled_passages` the chunk numbers quoted of those quoted by passages;
    `stable_prefix` how many leading messages of `messages` the next turn will send again
    unchanged while its selection holds: all of them, or those before this turn's recall block
    or the first shortened copy.

    `excerpted` holds the shortened indices that are earlier messages too large for what was
    left, sent as excerpts for the latest question (see `excerpt.py`); the next turn sends
    them again, byte for byte, while it keeps the selection.

    `added` holds the positions in `messages` of what the trim added (recall blocks, each with
    its acknowledgement): a later pass over these messages passes them as `added=`. `passages`
    says, for each excerpted message in order, how many of its passages (chunks) were sent of
    how many it has: what a user is told (`document excerpted: 3 of 24 passages`).
    """

    messages: list[Message]
    kept: tuple[int, ...]
    dropped: tuple[int, ...]
    shortened: tuple[int, ...]
    tokens_before: int
    tokens_after: int
    budget: int
    count_mode: CountMode
    over_budget: bool = False
    notes: tuple[str, ...] = field(default=())
    decision: TrimDecision | None = None
    reused: bool = False
    recalled: tuple[int, ...] = ()
    stable_prefix: int = -1
    excerpted: tuple[int, ...] = ()
    added: tuple[int, ...] = ()
    passages: tuple[tuple[int, int], ...] = ()
    recalled_passages: tuple[tuple[int, tuple[int, ...]], ...] = ()

    def __post_init__(self) -> None:
        if self.stable_prefix < 0:  # no recall block: all, up to the first shortened copy (cut anew next turn)
            cut = min(set(self.shortened).difference(self.excerpted), default=None)
            stable = len(self.messages) if cut is None else sum(1 for i in (*self.kept, *self.shortened) if i < cut)
            object.__setattr__(self, "stable_prefix", stable)

    @property
    def changed(self) -> bool:
        """True when what is sent differs from the input."""
        return bool(self.dropped or self.shortened)


def trim_messages(
    messages: Sequence[Message],
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
    latest user message as a last resort) is cut middle-out with a marker. A chat that fits is
    returned whole without scoring anything, so trimming the result again changes nothing.
    Same input, same output.

    Args:
        messages: OpenAI-format messages (Open WebUI's extra keys are fine).
        max_tokens: the prompt budget, counted with per-message overhead and images.
        model: model id, to pick the encoding (o200k_base unless GPT-4/3.5).
        token_counter: a shared `TokenCounter`; by default one that loads encodings in the
            calling thread.
        strategy: `"relevance"` (default) keeps the older messages that matter most to the
            latest question (BM25 and friends, see `relevance.py`), whole units, in their
            order; `"recent"` keeps the newest whole turns that fit.
        keep_last_turns: the last N turns (the current one counts) are kept before anything
            else, while they fit. Default 1: the current turn only.
        pinned: input indices that are mandatory content (with their unit), e.g. messages a
            user marked with `!pin`: kept whatever the watermark; when the mandatory part is
            over budget they are shortened middle-out like the rest of it (a note says so).
        previous: the `decision` of this chat's last trim. While its kept messages are still
            there and they plus everything newer fit, exactly those are sent again plus the
            new messages, so the prompt prefix stays byte-identical and provider caches hit.
            Such a turn reads and counts only those messages: the dropped ones are known
            from the decision, checked by their total length (an edit that keeps a dropped
            message's length shows in `tokens_before` only at the next new selection).
        low_watermark: when a new selection is made, it fills only this share of
            `max_tokens` (default 0.8), so the chat can grow for a few turns on the same
            prefix before the next cut. 1.0 fills the budget, as does a selection made on
            estimated counts (no encoding loaded: they already err 1.1-1.6x high).
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
        >>> for n in range(6):
        ...     chat += [{"role": "user", "content": f"Tell me fact {n} about rivers. " * 4},
        ...              {"role": "assistant", "content": f"Fact {n}: rivers flow downhill. " * 8}]
        >>> chat.append({"role": "user", "content": "Rivers again?"})
        >>> first = trim_messages(chat, max_tokens=400, model="gpt-4o", low_watermark=0.5)
        >>> first.dropped[:2]  # the locker turn is not sent...
        (1, 2)
        >>> chat += [{"role": "assistant", "content": "Yes."},
        ...          {"role": "user", "content": "Which locker code did I ask you to remember at the start?"}]
        >>> later = trim_messages(chat, max_tokens=400, model="gpt-4o", previous=first.decision)
        >>> later.reused, later.recalled, later.messages[: len(first.messages)] == first.messages
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
    _check_options(max_tokens, options)
    if isinstance(messages, (dict, str, bytes)):
        hint = "pass body['messages']" if isinstance(messages, dict) else "decode the JSON first"
        raise TypeError(f"messages is a {type(messages).__name__}, not a list of messages ({hint})")
    if not all(map(isinstance, messages, repeat(dict))):
        index, message = next((i, m) for i, m in enumerate(messages) if not isinstance(m, dict))
        raise TypeError(f"messages[{index}] is {type(message).__name__}, not a dict")
    return _trim(messages, max_tokens, model, token_counter or default_counter(), options)


def carry_previous(
    messages: Sequence[Message],
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
    chosen = TrimOptions(**options)
    _check_options(max_tokens, chosen)
    previous = chosen.previous
    if previous is None or not all(map(isinstance, messages, repeat(dict))) or not _carries(chosen, messages):
        return None
    room = _recall_room(max_tokens, chosen)
    if room and (chosen.added or not indexed(messages, seen=previous.seen, weights=_RECALL_WEIGHTS)):
        return None
    counter = token_counter or default_counter()
    pools = _Pools(messages, counter, model, previous.seen, chosen.embed)
    return _extend_previous(messages, previous, max_tokens, counter, model, chosen, room, pools)


def _carries(options: TrimOptions, messages: Sequence[Message]) -> bool:
    """The previous decision may carry into this turn (the shortcut is worth trying): it saw
    messages, no pin asks for a new selection, and the question is not about the documents as
    a whole (which gets the budget filled: `_wants_whole`)."""
    if options.previous is None or options.previous.seen == 0 or options.pinned:
        return False
    latest = next((m for m in reversed(messages) if m.get("role") == "user"), None)
    if options.strategy != "relevance" or latest is None or not wants_whole(message_text(latest)):
        return True
    return not any(len(message_text(m)) >= WHOLE_DOCUMENT_MIN_CHARS for m in messages if m is not latest)


def _recall_room(max_tokens: int, options: TrimOptions) -> int:
    """The recall's room: a chat that goes on (a previous decision) under the relevance strategy."""
    relevance = options.previous is not None and options.strategy == "relevance"
    return recall_room(max_tokens, options.recall_share) if relevance else 0


@dataclass(frozen=True, slots=True)
class TrimOptions:
    """How `trim_messages` chooses, besides the budget and the counter (each as its Args say).

    Made once a call and handed from step to step, so no step retypes the options."""

    strategy: Strategy = DEFAULT_STRATEGY
    keep_last_turns: int = DEFAULT_KEEP_LAST_TURNS
    pinned: Collection[int] = ()
    previous: TrimDecision | None = None
    low_watermark: float = DEFAULT_LOW_WATERMARK
    growth_turns: int = DEFAULT_GROWTH_TURNS
    embed: Embed | None = None
    recall_share: float = DEFAULT_RECALL_SHARE
    shorten: bool = True
    added: Collection[int] = ()


@dataclass(frozen=True, slots=True)
class _Counted:
    """The chat read and counted once: its view, each message's tokens and the label they go with."""

    messages: Sequence[Message]
    conversation: Conversation
    costs: list[int]
    mode: CountMode
    scheme: str
    before: int  # the whole chat, reply priming included
    pools: _Pools  # this trim's recall pools, shared with the fast path


def _trim(
    messages: Sequence[Message], max_tokens: int, model: str | None, counter: TokenCounter, options: TrimOptions
) -> TrimResult:
    """`trim_messages` in steps: an earlier pass's recall block taken out when the chat no longer
    fits; the previous selection extended, reading only what is new; the chat whole when it fits;
    else a selection (`_select`)."""
    previous = options.previous
    room = _recall_room(max_tokens, options)
    earlier = sorted(i for i in set(options.added) if type(i) is int and 0 <= i < len(messages))
    if room and earlier and not _fits_whole(messages, max_tokens, counter, model):
        # shorten=True as before this was split into steps (the recursive call did not pass it on)
        rest = replace(
            options,
            pinned=[p - sum(e < p for e in earlier) for p in options.pinned if p not in earlier],
            shorten=True,
            added=(),
        )
        return _without(earlier, messages, lambda m: _trim(m, max_tokens, model, counter, rest), counter, model)
    pools = _Pools(messages, counter, model, previous.seen if previous is not None else 0, options.embed)
    if previous is not None and _carries(options, messages):
        extended = _extend_previous(messages, previous, max_tokens, counter, model, options, room, pools)
        if extended is not None:
            return extended
    costs, mode, scheme = counter.count_each_as(messages, model)  # the label goes with these counts
    conversation = read_conversation(messages)
    chat = _Counted(messages, conversation, costs, mode, scheme, TOKENS_PER_REPLY + sum(costs), pools)
    if chat.before <= max_tokens and not chat.conversation.orphans:
        everything = tuple(range(len(messages)))
        result = TrimResult(list(messages), everything, (), (), chat.before, chat.before, max_tokens, mode)
        return replace(result, added=tuple(earlier) if room else ())
    return _select(chat, max_tokens, model, counter, options, room)


def _select(
    chat: _Counted, max_tokens: int, model: str | None, counter: TokenCounter, options: TrimOptions, room: int
) -> TrimResult:
    """The mandatory part (shortened when it alone is over), then the previous selection reused
    or a new one, each with the recall block this question needs."""
    mandatory, replaced, over, notes, pinned = _mandatory_part(
        chat.conversation, chat.costs, max_tokens, counter, model, options.pinned, options.shorten
    )
    mandatory_cost = TOKENS_PER_REPLY + sum(chat.costs[i] for i in mandatory)
    fingerprints = Fingerprints(chat.messages)
    if mandatory_cost > max_tokens or chat.conversation.question is None:
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
    replaced.update((i, e.message) for i, e in excerpts.items())
    notes += [note for note in chat.pools.notes if note not in notes]
    result = _result(chat, keep, blocks, replaced, excerpts, fingerprints, max_tokens, counter, model, options.strategy)
    return replace(result, over_budget=over, notes=tuple(notes), reused=reused)


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
    conversation, question = chat.conversation, chat.conversation.question
    excerpts = _carried_excerpts(chat.messages, previous, fingerprints, mandatory, counter, model)
    sized = _sized(chat.costs, excerpts or {})
    keep = reuse_previous(
        previous,
        fingerprints,
        conversation,
        sized,
        max_tokens - TOKENS_PER_REPLY,
        keep_last_turns=options.keep_last_turns,
        pinned=pinned,
    )
    if excerpts is None or (keep is not None and not keep.issuperset(excerpts)):
        return None, [], {}  # an excerpt the next prompt cannot send again as it was: select anew
    if keep is None or question is None:  # (room is 0 when there is no question)
        return keep, [], excerpts
    base = TOKENS_PER_REPLY + sum(sized[i] for i in keep)
    system = conversation.system_indices
    kept_blocks = _recalls_kept(
        previous, fingerprints, keep, question, room, base, max_tokens, system, chat.pools, excerpts
    )
    if kept_blocks is None:  # the selection no longer leaves room for what this question needs
        return None, [], {}
    return keep, kept_blocks, excerpts


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
    conversation, costs, question = chat.conversation, chat.costs, chat.conversation.question
    # Estimated counts already err high (1.1-2x): leaving room to grow as well would
    # starve the prompt, so a selection made on them fills the budget.
    watermark = 1.0 if chat.mode == "estimate" else options.low_watermark
    target = selection_target(conversation, costs, max_tokens, watermark, options.growth_turns) - TOKENS_PER_REPLY
    semantic = options.embed is not None and options.strategy == "relevance"
    scores = _semantic_scores(conversation, options.embed, notes) if semantic and options.embed is not None else None
    reserve = int((target - mandatory_cost) * WHOLE_DOCUMENT_SHARE) if whole else 0
    keep = choose_indices(
        conversation,
        costs,
        target - room - reserve,
        strategy=options.strategy,
        keep_last_turns=options.keep_last_turns,
        pinned=pinned,
        scores=scores,
        room=max_tokens - TOKENS_PER_REPLY,  # the latest answer is kept whenever it fits the budget
    )
    excerpts: dict[int, Excerpt] = {}
    if options.strategy == "relevance" and options.shorten and mandatory_cost <= max_tokens:
        # What the selection left: large old messages cut to it. With a document in the chat the
        # recall's room too (its passages are what the question needs; the recall, which quotes
        # whole messages, takes what is left); without one the recall keeps its room (chats of
        # long merged turns, REALTALK's, lost evidence when their excerpts took it).
        spare = target - sum(costs[i] for i in keep) - (0 if _holds_document(chat, keep) else room)
        added, excerpts = excerpt_turns(
            conversation, keep, costs, spare, counter, model, scores=scores, embed=options.embed, whole=whole
        )
        keep.update(added)
    if not (room and question is not None):
        return keep, [], excerpts
    left = max_tokens - TOKENS_PER_REPLY - sum(_sized(costs, excerpts)[i] for i in keep)
    pool = chat.pools.of(question, conversation.system_indices)
    sent = {i: e.chunks for i, e in excerpts.items()}
    block = _new_recall(chat.messages, keep, question, min(room, left), counter, model, pool, sent=sent)
    return keep, [block] if block is not None else [], excerpts


def _result(
    chat: _Counted,
    keep: set[int],
    blocks: list[_Block],
    replaced: dict[int, Message],
    excerpts: dict[int, Excerpt],
    fingerprints: Fingerprints,
    max_tokens: int,
    counter: TokenCounter,
    model: str | None,
    strategy: Strategy,
) -> TrimResult:
    """What to send (kept messages, shortened copies and excerpts, recall blocks), its count, and
    the decision (the caller adds what the selection knows: reused, over budget, notes)."""
    messages, costs, conversation = chat.messages, chat.costs, chat.conversation
    order = sorted(keep)
    sent = [replaced.get(i, messages[i]) for i in order]
    after = TOKENS_PER_REPLY + sum(
        counter.count_message(replaced[i], model) if i in replaced else costs[i] for i in order
    )
    system = set(conversation.system_indices)
    at = tuple(i for i in order if i not in system)
    sent, stable, added = _with_blocks(sent, order, blocks, conversation.question)
    after += sum(b.tokens for b in blocks)
    decision = TrimDecision(
        max_tokens=max_tokens,
        tokens=after,
        strategy=strategy,
        kept=tuple(fingerprints[i] for i in at),
        at=at,
        seen=len(messages),
        seen_tokens=sum(c for i, c in enumerate(costs) if i not in system),
        seen_chars=history_chars(messages, conversation.system_indices),
        counted_with=chat.scheme,
        recalls=_recall_record(blocks, fingerprints),
        excerpts=tuple((i, e.chunks) for i, e in sorted(excerpts.items())),
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
    )


def _passages(excerpts: Mapping[int, Excerpt], blocks: Sequence[_Block] = ()) -> tuple[tuple[int, int], ...]:
    """(passages sent, passages in all) of each excerpted message, in the messages' order: its
    excerpt's and those the recall blocks quote of it."""
    sent = _sent_chunks(excerpts, blocks)
    return tuple((len(sent[i]), e.total) for i, e in sorted(excerpts.items()))


def _recalled_passages(blocks: Sequence[_Block]) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """The chunk numbers the blocks quote of each message quoted by passages, in order."""
    return tuple((i, tuple(sorted(c))) for i, c in sorted(_sent_chunks({}, blocks).items()))


def _documents(chat: _Counted) -> list[int]:
    """The chat's documents: messages before the latest question (no system prompt) of
    `WHOLE_DOCUMENT_MIN_TOKENS` or more."""
    question = chat.conversation.question
    system = set(chat.conversation.system_indices)
    before = chat.costs if question is None else chat.costs[:question]
    return [i for i, c in enumerate(before) if c >= WHOLE_DOCUMENT_MIN_TOKENS and i not in system]


def _holds_document(chat: _Counted, keep: Collection[int]) -> bool:
    """A message the selection left out is a document (`_documents`)."""
    return any(i not in keep for i in _documents(chat))


def _wants_whole(chat: _Counted, options: TrimOptions) -> bool:
    """The latest question is about the documents as a whole (`relevance.wants_whole`) and the
    chat holds one before it (a chat of short messages keeps its selection: "summarise
    everything" there is served by the recall, and the prompt cache keeps hitting)."""
    question = chat.conversation.question
    if options.strategy != "relevance" or not options.shorten or question is None:
        return False
    return bool(_documents(chat)) and wants_whole(message_text(chat.messages[question]))


def _sized(costs: list[int], excerpts: dict[int, Excerpt]) -> list[int]:
    """`costs` with each excerpted message at what its excerpt costs."""
    if not excerpts:
        return costs
    return [excerpts[i].tokens if i in excerpts else c for i, c in enumerate(costs)]


def _carried_excerpts(
    messages: Sequence[Message],
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
        if k is None or i >= len(messages) or i in mandatory or fingerprints[i] != previous.kept[k]:
            return None
        excerpt = rebuild(messages[i], chunks, counter, model)
        if excerpt is None:
            return None
        out[i] = excerpt
    return out


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
    stays the previous one up to the first that goes); then the new block is cut to the room
    left. None when that would hold less than half of the relevance the question wanted
    recalled, an excerpt and the passages recalled of it miss what the question needs
    (`_excerpts_serve`), or an earlier block's messages moved: the caller then selects anew.
    With no `room` (no recall) no blocks, while the excerpts serve the question. (The chat, its
    counter and model: the `pools`'.)"""
    messages, counter, model = pools.messages, pools.counter, pools.model
    if not room:
        return [] if _excerpts_serve(messages, excerpts, (), question, counter, model) else None
    carried = carried_recalls(previous, fingerprints, keep) if _CARRY_RECALLS else []
    if carried is None:
        return None
    blocks = []
    for recall in carried[: MAX_RECALL_BLOCKS - 1]:
        parts = {i: p for k, i in enumerate(recall.at) if (p := recall.passages(k))}
        block = _block(messages, recall.anchor, recall.at, parts, counter, model)
        if block is None:
            return None
        blocks.append(block)
    if _asked_before(previous, fingerprints, question):  # this turn again (a second pass, a retry): as it was
        return blocks if base + sum(b.tokens for b in blocks) <= max_tokens else None
    pool = pools.of(question, system)
    while True:
        used = set(keep).union(*(b.indices for b in blocks))
        left = max_tokens - base - sum(b.tokens for b in blocks)
        sent = _sent_chunks(excerpts, blocks)
        block = _new_recall(messages, used, question, room, counter, model, pool, fits_in=left, sent=sent)
        wanted = blocks + [block] if block is not None else blocks
        if base + sum(b.tokens for b in wanted) <= max_tokens:
            return wanted if _excerpts_serve(messages, excerpts, wanted, question, counter, model) else None
        if not blocks:
            break
        blocks.pop()
    # What still fits beside the selection: enough while it holds half of what the question
    # would have recalled (its relevance); else the selection misses too much, and goes.
    sent = _sent_chunks(excerpts, ())
    fitting = _new_recall(messages, keep, question, max_tokens - base, counter, model, pool, sent=sent)
    scores = pool.scores
    # (`block` is None here only when `base` alone is over the budget: then nothing fits.)
    if (
        fitting is not None
        and block is not None
        and sum(scores[i] for i in fitting.indices) >= RECALL_KEEP_SHARE * sum(scores[i] for i in block.indices)
        and _excerpts_serve(messages, excerpts, [fitting], question, counter, model)
    ):
        return [fitting]
    return None


def _sent_chunks(excerpts: Mapping[int, Excerpt], blocks: Sequence[_Block]) -> dict[int, set[int]]:
    """The chunks of each long message the prompt holds: its excerpt's and those blocks quote."""
    sent: dict[int, set[int]] = {i: set(e.chunks) for i, e in excerpts.items()}
    for block in blocks:
        for i, chunks in block.chunks().items():
            sent.setdefault(i, set()).update(chunks)
    return sent


def _excerpts_serve(
    messages: Sequence[Message],
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
    text = message_text(messages[question]) if question is not None else ""
    sent = _sent_chunks(excerpts, blocks)
    return all(
        fresh_share(messages[i], sorted(sent[i]), text, e.tokens, counter, model) >= EXCERPT_KEEP_SHARE
        for i, e in excerpts.items()
    )


def _asked_before(previous: TrimDecision, fingerprints: Sequence[str], question: int) -> bool:
    """The previous decision already kept this question (the same turn, trimmed again)."""
    at = previous.at
    return question in at and previous.kept[at.index(question)] == fingerprints[question]


def _block_tokens(
    messages: Sequence[Message],
    indices: Sequence[int],
    counter: TokenCounter,
    model: str | None,
    texts: Mapping[int, str] | None = None,
) -> int:
    """What the recall block quoting `indices` (`texts`: the passages quoted of some) costs sent,
    with the acknowledgement after it (`count_message` of both): its text counted from its
    quotes, each counted once a chat."""
    text = counter.count_joined(recall_quotes(messages, indices, texts), model)
    return TOKENS_PER_MESSAGE + TOKENS_PER_ROLE + text + counter.count_message(SUMMARY_ACK_MESSAGE, model)


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


def _recall_record(blocks: Sequence[_Block], fingerprints: Sequence[str]) -> tuple[Recall, ...]:
    return tuple(
        Recall(b.anchor, b.indices, tuple(fingerprints[i] for i in b.indices), parts=b.parts)
        for b in sorted(blocks, key=lambda b: b.anchor)
    )


def _quote_texts(
    messages: Sequence[Message],
    parts: Mapping[int, Sequence[int]],
    counter: TokenCounter,
    model: str | None,
) -> dict[int, str] | None:
    """The text a block quotes of each message quoted by passages (`parts`, by message); None
    when one cannot be quoted so (its text changed: the block cannot be sent again as it was)."""
    texts = {}
    for i, chunks in parts.items():
        text = passage_quote(messages[i], chunks, counter, model)
        if text is None:
            return None
        texts[i] = text
    return texts


def _block(
    messages: Sequence[Message],
    anchor: int,
    indices: Sequence[int],
    parts: Mapping[int, Sequence[int]],
    counter: TokenCounter,
    model: str | None,
    tokens: int | None = None,
) -> _Block | None:
    """The block quoting `indices` (the passages `parts` of some) before `anchor`, counted
    exactly unless `tokens` is given; None when a passage cannot be quoted (`_quote_texts`)."""
    texts = _quote_texts(messages, {i: parts[i] for i in indices if i in parts}, counter, model)
    if texts is None:
        return None
    if tokens is None:
        tokens = _block_tokens(messages, indices, counter, model, texts)
    record = tuple(tuple(parts.get(i, ())) for i in indices)
    return _Block(anchor, tuple(indices), recall_message(messages, indices, texts), tokens, record)


def _recalled(blocks: Sequence[_Block]) -> tuple[int, ...]:
    return tuple(sorted(set().union(*(b.indices for b in blocks)))) if blocks else ()


@dataclass(frozen=True, slots=True)
class _Pool:
    """What this turn's recall chooses from: every message's score, the candidates (in
    `recall_order`), their costs."""

    scores: list[float]
    candidates: list[int]
    costs: dict[int, int]


class _Pools:
    """One trim's recall pools by question and system messages: each made once, however many
    paths look (the fast path, then the full one). `seen`: how many leading messages the
    previous turn read (see `recall_scores`); `embed`: the trim's embedder, whose cosine the
    recall fuses in as a new selection does; `notes` say when it could not."""

    __slots__ = ("messages", "counter", "model", "seen", "embed", "notes", "_made")

    def __init__(
        self, messages: Sequence[Message], counter: TokenCounter, model: str | None, seen: int, embed: Embed | None
    ) -> None:
        self.messages, self.counter, self.model, self.seen, self.embed = messages, counter, model, seen, embed
        self.notes: list[str] = []
        self._made: dict[tuple[int, tuple[int, ...]], _Pool] = {}

    def of(self, question: int, system: Sequence[int]) -> _Pool:
        key = (question, tuple(system))
        pool = self._made.get(key)
        if pool is None:
            messages = self.messages
            texts = list(map(message_text, messages))
            similarity = _recall_cosines(messages, question, system, self.embed, self.notes) if self.embed else None
            scores = recall_scores(
                messages,
                question=question,
                exclude=system,
                weights=_RECALL_WEIGHTS,
                seen=self.seen,
                texts=texts,
                similarity=similarity,
            )
            scores = _with_neighbours(scores, texts, question, _RECALL_WEIGHTS)
            candidates = recall_candidates(messages, scores, texts)
            counts = self.counter.count_each([messages[i] for i in candidates], self.model)
            costs = dict(zip(candidates, counts, strict=True))
            pool = self._made[key] = _Pool(scores, recall_order(candidates, scores, costs), costs)
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
    messages: Sequence[Message], question: int, system: Sequence[int], embed: Embed, notes: list[str]
) -> list[float] | None:
    """Each message's cosine to the question for the recall; None (lexical, with a note) when
    the embedder fails or its vectors are not there yet."""
    try:
        return similarities(messages, question, VECTORS, embed, skip=system)
    except LookupError:  # vectors not fetched yet (the filter embeds ahead of the trim)
        note = "some messages not embedded yet: recall is lexical"
    except Exception as exc:  # any embedder: its failure must not cost the trim
        note = f"embedder failed ({type(exc).__name__}): recall is lexical"
    if note not in notes:
        notes.append(note)
    return None


def _new_recall(
    messages: Sequence[Message],
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
    frame = _block_tokens(messages, (), counter, model)  # the label, overheads, acknowledgement
    if room <= frame:
        return None
    scores, costs = pool.scores, pool.costs
    parts, spent = _recall_parts(messages, keep, question, room - frame, pool, sent or {}, counter, model)
    taken = set(keep).union(parts)
    chosen = sorted([*parts, *choose_recall(pool.candidates, taken, scores, costs, room - frame - spent, ordered=True)])
    estimate = frame + spent + sum(costs[i] for i in chosen if i not in parts)
    if chosen and fits_in is not None and estimate > fits_in + len(chosen):  # joins save a token or so each at most
        return _block(messages, question, chosen, parts, counter, model, tokens=estimate)
    while chosen:
        block = _block(messages, question, chosen, parts, counter, model)
        if block is None:
            return None
        if block.tokens <= room:
            return block
        # Quoting joined the texts into more tokens than they count apart: let the least worth go.
        chosen.remove(min(chosen, key=lambda i: (scores[i] / max(costs[i], 1) ** 0.5, i)))
    return None


def _recall_parts(
    messages: Sequence[Message],
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
    question_text = message_text(messages[question])
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


def _fits_whole(messages: Sequence[Message], max_tokens: int, counter: TokenCounter, model: str | None) -> bool:
    """The whole list fits `max_tokens` and holds nothing a trim would leave out (orphans)."""
    fits = TOKENS_PER_REPLY + sum(counter.count_each(messages, model)) <= max_tokens
    return fits and not read_conversation(messages).orphans


def _without(
    blocks: Sequence[int],
    messages: Sequence[Message],
    trim: Callable[[list[Message]], TrimResult],
    counter: TokenCounter,
    model: str | None,
) -> TrimResult:
    """`trim` of `messages` without the recall blocks an earlier pass added, in the input's
    indices (the blocks count as dropped: a new one is made if the question needs it)."""
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
        excerpted=tuple(map(back, inner.excerpted)),
        tokens_before=TOKENS_PER_REPLY + sum(counter.count_each(messages, model)),
    )


def _semantic_scores(conversation: Conversation, embed: Embed, notes: list[str]) -> list[float] | None:
    """Relevance with the embedder's similarities fused in; None (lexical) when it fails."""
    question = conversation.question
    if question is None:
        return None
    excluded = conversation.system_indices + conversation.orphan_indices
    try:
        similarity = similarities(conversation.messages, question, VECTORS, embed, skip=excluded)
    except LookupError:  # vectors not fetched yet (the filter embeds ahead of the trim)
        notes.append("some messages not embedded yet: relevance is lexical")
        return None
    except Exception as exc:  # any embedder: its failure must not cost the trim
        notes.append(f"embedder failed ({type(exc).__name__}): relevance is lexical")
        return None
    if similarity is None:
        return None
    return score_messages(conversation.messages, question=question, exclude=excluded, similarity=similarity)


def _history_unchanged(
    messages: Sequence[Message], previous: TrimDecision, scheme: str
) -> tuple[list[int], int] | None:
    """(system positions, history length) when the messages `previous` saw are there unchanged
    in length and counted alike; None when the shortcut cannot tell."""
    seen = previous.seen
    if seen > len(messages) or previous.counted_with != scheme or previous.seen_chars < 0:
        return None
    system = system_positions(messages)
    chars = history_chars(messages, system)
    new_chars = history_chars(messages[seen:], [i - seen for i in system if i >= seen])
    if chars < 0 or new_chars < 0 or chars - new_chars != previous.seen_chars:
        return None
    return system, chars


def _extend_previous(
    messages: Sequence[Message],
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
    known = _history_unchanged(messages, previous, scheme)
    if known is None:
        return None
    system, chars = known
    fingerprints = Fingerprints(messages)
    keep = extend_previous(previous, messages, fingerprints, keep_last_turns=options.keep_last_turns, system=system)
    if keep is None:
        return None
    order = sorted(keep)
    question = next(i for i in reversed(order) if messages[i].get("role") == "user")
    excerpts = _extended_excerpts(messages, previous, fingerprints, keep, counter, model)
    if excerpts is None:
        return None
    new_cost, before, after = _extended_sizes(messages, previous, order, system, excerpts, counter, model)
    if before <= max_tokens or after > max_tokens or counter.scheme(model) != scheme:
        return None  # (an encoding that loaded meanwhile: the full path counts it all alike)
    blocks = _recalls_kept(previous, fingerprints, keep, question, room, after, max_tokens, system, pools, excerpts)
    if blocks is None:
        return None
    sent = [excerpts[i].message if i in excerpts else messages[i] for i in order]
    sent, stable, added = _with_blocks(sent, order, blocks, question if room else None)
    after += sum(b.tokens for b in blocks)
    at = tuple(i for i in order if i not in system)
    decision = TrimDecision(
        max_tokens=max_tokens,
        tokens=after,
        strategy=options.strategy,
        kept=tuple(fingerprints[i] for i in at),
        at=at,
        seen=len(messages),
        seen_tokens=previous.seen_tokens + new_cost,
        seen_chars=chars,
        counted_with=scheme,
        recalls=_recall_record(blocks, fingerprints),
        excerpts=previous.excerpts,
    )
    result = _reused_result(
        sent, order, keep, len(messages), before, after, max_tokens, mode, decision, blocks, (stable, added), excerpts
    )
    return replace(result, notes=tuple(pools.notes))


def _extended_sizes(
    messages: Sequence[Message],
    previous: TrimDecision,
    order: list[int],
    system: list[int],
    excerpts: dict[int, Excerpt],
    counter: TokenCounter,
    model: str | None,
) -> tuple[int, int, int]:
    """The shortcut's counts: (the new messages', the whole chat's, what is sent), counting only
    the kept messages (excerpts at their size) and the new ones; the rest is the decision's `seen_tokens`."""
    count = counter.count_message
    cost = {i: excerpts[i].tokens if i in excerpts else count(messages[i], model) for i in order}
    new = [i for i in range(previous.seen, len(messages)) if i not in system]  # kept, but for orphans
    new_cost = sum(cost[i] if i in cost else count(messages[i], model) for i in new)
    before = TOKENS_PER_REPLY + previous.seen_tokens + sum(cost[i] for i in system) + new_cost
    return new_cost, before, TOKENS_PER_REPLY + sum(cost.values())


def _extended_excerpts(
    messages: Sequence[Message],
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
    start = window_start(previous, messages)
    if start is None or any(i >= start or i not in keep for i, _ in previous.excerpts):
        return None
    return _carried_excerpts(messages, previous, fingerprints, (), counter, model)


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
    what is new; `placed`: `_with_blocks`' stable prefix and where its blocks went."""
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


def recall_room(max_tokens: int, recall_share: float = DEFAULT_RECALL_SHARE) -> int:
    """Tokens kept for a turn's recall block: `recall_share` of the budget at 2,000 tokens,
    scaled by sqrt(2,000 / budget) elsewhere, never more than half the budget.

    Example:
        >>> recall_room(1_000), recall_room(2_000), recall_room(8_000), recall_room(8_000, 0)
        (500, 800, 1600, 0)
    """
    share = min(MAX_RECALL_SHARE, recall_share * math.sqrt(RECALL_REFERENCE_TOKENS / max_tokens))
    return int(max_tokens * share)


def _mandatory_part(
    conversation: Conversation,
    costs: list[int],
    max_tokens: int,
    counter: TokenCounter,
    model: str | None,
    pinned: Collection[int],
    shorten: bool = True,
) -> tuple[list[int], dict[int, Message], bool, list[str], Collection[int]]:
    """What must be sent (system, current turn, pins), its shortened copies when it alone is
    over budget, whether it is still over, the notes, and the pins that stay mandatory: when
    even shortened pins cannot fit (their markers alone are over), the budget wins and they
    are let go (kept only while they fit, like other messages)."""
    hard = mandatory_indices(conversation)
    mandatory = _with_pins(conversation, hard, pinned)
    pinned = sorted(set(mandatory).difference(hard))  # with their units and questions
    notes: list[str] = []
    if TOKENS_PER_REPLY + sum(costs[i] for i in mandatory) <= max_tokens:
        return mandatory, {}, False, notes, pinned
    if not shorten:
        return mandatory, {}, True, ["mandatory content over budget: sent whole"], pinned
    replaced, over = _shorten_mandatory(conversation, mandatory, costs, max_tokens, counter, model)
    if over and len(mandatory) > len(hard):
        mandatory, pinned = hard, ()
        notes.append(PINS_DROPPED_NOTE)
        if TOKENS_PER_REPLY + sum(costs[i] for i in mandatory) <= max_tokens:
            return mandatory, {}, False, notes, pinned
        replaced, over = _shorten_mandatory(conversation, mandatory, costs, max_tokens, counter, model)
    notes.append("mandatory content over budget: shortened")
    if set(replaced) & set(pinned):
        notes.append(PINS_SHORTENED_NOTE)
    if over:
        notes.append("could not shorten enough")
    return mandatory, replaced, over, notes, pinned


def _with_pins(conversation: Conversation, mandatory: list[int], pinned: Collection[int]) -> list[int]:
    """The mandatory indices plus every pinned one with the rest of its unit and, for a pinned
    reply, its turn's question (a reply is never sent without it)."""
    if not pinned:
        return mandatory
    pins = set(pinned)
    keep = set(mandatory)
    for turn in conversation.turns:
        units = [u for u in turn.units if pins.intersection(u.indices)]
        if units and turn.units[0].kind == "user":
            units.append(turn.units[0])
        keep.update(*(u.indices for u in units))
    return sorted(keep)


def selection_target(
    conversation: Conversation,
    costs: Sequence[int],
    max_tokens: int,
    low_watermark: float,
    growth_turns: int = DEFAULT_GROWTH_TURNS,
) -> int:
    """The tokens a new selection fills: `low_watermark` of the budget and, below 1.0, at most
    the budget less room for `growth_turns` turns like the last one (what came since the
    previous user message: its replies and this turn), never less than half the budget.

    Example:
        >>> from contextwarden.conversation import read_conversation
        >>> chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        ...         {"role": "user", "content": "c"}]
        >>> selection_target(read_conversation(chat), [100, 900, 100], 10_000, 0.8)
        8000
        >>> selection_target(read_conversation(chat), [100, 900, 100], 4_000, 0.8)
        2000
    """
    target = int(max_tokens * low_watermark)
    current = conversation.current
    if low_watermark >= 1.0 or growth_turns <= 0 or not current:
        return target
    since = conversation.turns[current - 1].units[0].stop
    growth = sum(costs[since:])
    return min(target, max_tokens - min(growth_turns * growth, max_tokens // 2))


def _check_options(max_tokens: int, options: TrimOptions) -> None:
    """Raise ValueError naming the option and its valid values."""
    strategy, keep_last_turns, low_watermark = options.strategy, options.keep_last_turns, options.low_watermark
    growth_turns, recall_share = options.growth_turns, options.recall_share
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(map(repr, STRATEGIES))}, got {strategy!r}")
    if not isinstance(keep_last_turns, int) or isinstance(keep_last_turns, bool) or keep_last_turns < 0:
        raise ValueError(f"keep_last_turns must be an int >= 0, got {keep_last_turns!r}")
    if not isinstance(low_watermark, (int, float)) or not 0.0 < low_watermark <= 1.0:
        raise ValueError(f"low_watermark must be in (0, 1], got {low_watermark!r}")
    if not isinstance(growth_turns, int) or isinstance(growth_turns, bool) or growth_turns < 0:
        raise ValueError(f"growth_turns must be an int >= 0, got {growth_turns!r}")
    if not isinstance(recall_share, (int, float)) or not 0.0 <= recall_share <= MAX_RECALL_SHARE:
        raise ValueError(f"recall_share must be in [0, {MAX_RECALL_SHARE}], got {recall_share!r}")


def _shortenable(conversation: Conversation, mandatory: list[int]) -> tuple[list[int], int | None]:
    """Mandatory indices whose text may be cut, and the latest user message (cut last)."""
    messages = conversation.messages
    last_user = conversation.question
    first_choice = [i for i in mandatory if i != last_user and messages[i].get("role") != "assistant"]
    return first_choice, last_user


def _shorten_mandatory(
    conversation: Conversation,
    mandatory: list[int],
    costs: list[int],
    budget: int,
    counter: TokenCounter,
    model: str | None,
) -> tuple[dict[int, Message], bool]:
    """Cut the largest shortenable texts middle-out until the mandatory part fits.

    Returns the shortened copies by index and whether it is still over budget.
    """
    messages = conversation.messages
    current = {i: costs[i] for i in mandatory}
    replaced: dict[int, Message] = {}
    first_choice, last_user = _shortenable(conversation, mandatory)
    for pool in (first_choice, [last_user] if last_user is not None else []):
        candidates = set(pool)
        while candidates:
            excess = TOKENS_PER_REPLY + sum(current.values()) - budget
            if excess <= 0:
                return replaced, False
            index = max(candidates, key=lambda i: (current[i], -i))
            shorter = _shorten_message(replaced.get(index, messages[index]), excess, counter, model)
            cost = counter.count_message(shorter, model) if shorter is not None else current[index]
            if shorter is None or cost >= current[index]:  # (None costs current[index])
                candidates.discard(index)
                continue
            replaced[index], current[index] = shorter, cost
    return replaced, TOKENS_PER_REPLY + sum(current.values()) > budget


def _shorten_message(message: Message, excess: int, counter: TokenCounter, model: str | None) -> Message | None:
    """A copy of `message` whose largest text is `excess` tokens shorter (or as short as it gets)."""
    content = message.get("content")
    if isinstance(content, str):
        new_text = _cut_middle(content, excess, counter, model)
        return None if new_text is None else {**message, "content": new_text}
    if isinstance(content, list):
        texts = [
            (counter.count_text(part["text"], model), k)
            for k, part in enumerate(content)
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        ]
        if not texts:
            return None
        _, k = max(texts)
        new_text = _cut_middle(content[k]["text"], excess, counter, model)
        if new_text is None:
            return None
        parts = list(content)
        parts[k] = {**content[k], "text": new_text}
        return {**message, "content": parts}
    return None


def _cut_middle(text: str, excess: int, counter: TokenCounter, model: str | None) -> str | None:
    """`text` with a middle stretch replaced by a marker, about `excess` tokens shorter."""
    total = counter.count_text(text, model)
    marker_cost = counter.count_text(SHORTENED_MARK.format(n=total), model) + 2
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
