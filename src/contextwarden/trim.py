"""`trim_messages`: fit an OpenAI-format chat into a token budget.

Composes the core: the conversation view, token counts, the selection, and middle-out
shortening of mandatory content that alone is over the budget.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from itertools import filterfalse, repeat

from .conversation import Conversation, Message, read_conversation, system_positions
from .selection import (
    STRATEGIES,
    Fingerprints,
    Strategy,
    TrimDecision,
    choose_indices,
    extend_previous,
    history_chars,
    mandatory_indices,
    reuse_previous,
)
from .relevance import score_messages
from .semantic import VECTORS, Embed, similarities
from .tokens import TOKENS_PER_REPLY, CountMode, TokenCounter

__all__ = ["TrimResult", "trim_messages", "selection_target", "default_counter", "SHORTENED_MARK", "PINS_SHORTENED_NOTE", "PINS_DROPPED_NOTE", "DEFAULT_LOW_WATERMARK", "DEFAULT_GROWTH_TURNS"]

DEFAULT_LOW_WATERMARK = 0.8
DEFAULT_GROWTH_TURNS = 2
SHORTENED_MARK = "[… {n} tokens cut by contextwarden …]"
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


@dataclass(frozen=True, slots=True)
class TrimResult:
    """What `trim_messages` chose.

    `messages` is what to send. `kept` holds the ascending input indices sent as the very
    same dicts; `shortened` those sent as shortened copies; `dropped` the rest. `decision`
    is what to pass as `previous` next turn (None when nothing was dropped); `reused` tells
    that the previous turn's selection was kept and only new messages were added.
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
    strategy: Strategy = "relevance",
    keep_last_turns: int = 1,
    pinned: Collection[int] = (),
    previous: TrimDecision | None = None,
    low_watermark: float = DEFAULT_LOW_WATERMARK,
    growth_turns: int = DEFAULT_GROWTH_TURNS,
    embed: Embed | None = None,
    shorten: bool = True,
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
        shorten: False sends mandatory content that is over budget whole (`over_budget`)
            instead of cutting it, e.g. when tool definitions alone fill the window and no
            cut could make the prompt fit.

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
    """
    _check_options(max_tokens, strategy, keep_last_turns, low_watermark, growth_turns)
    if not all(map(isinstance, messages, repeat(dict))):
        index, message = next((i, m) for i, m in enumerate(messages) if not isinstance(m, dict))
        raise TypeError(f"messages[{index}] is {type(message).__name__}, not a dict")
    counter = token_counter or default_counter()
    if previous is not None and previous.seen and not pinned:
        extended = _extend_previous(messages, previous, max_tokens, counter, model, strategy, keep_last_turns)
        if extended is not None:
            return extended
    costs, mode, scheme = counter.count_each_as(messages, model)  # the label goes with these counts
    before = TOKENS_PER_REPLY + sum(costs)
    conversation = read_conversation(messages)

    if before <= max_tokens and not conversation.orphans:
        everything = tuple(range(len(messages)))
        return TrimResult(list(messages), everything, (), (), before, before, max_tokens, mode)

    mandatory, replaced, over, notes, pinned = _mandatory_part(conversation, costs, max_tokens, counter, model, pinned, shorten)
    mandatory_cost = TOKENS_PER_REPLY + sum(costs[i] for i in mandatory)
    fingerprints = Fingerprints(messages)
    keep: set[int] | None = None
    if previous is not None and mandatory_cost <= max_tokens:
        keep = reuse_previous(
            previous, fingerprints, conversation, costs, max_tokens - TOKENS_PER_REPLY,
            keep_last_turns=keep_last_turns, pinned=pinned,
        )
    reused = keep is not None
    if keep is None:
        # Estimated counts already err high (1.1-2x): leaving room to grow as well would
        # starve the prompt, so a selection made on them fills the budget.
        watermark = 1.0 if mode == "estimate" else low_watermark
        target = selection_target(conversation, costs, max_tokens, watermark, growth_turns) - TOKENS_PER_REPLY
        scores = _semantic_scores(conversation, embed, notes) if embed is not None and strategy == "relevance" else None
        keep = choose_indices(
            conversation, costs, target, strategy=strategy, keep_last_turns=keep_last_turns, pinned=pinned,
            scores=scores,
            room=max_tokens - TOKENS_PER_REPLY,  # the latest answer is kept whenever it fits the budget
        )

    order = sorted(keep)
    sent = [replaced.get(i, messages[i]) for i in order]
    after = TOKENS_PER_REPLY + sum(
        counter.count_message(replaced[i], model) if i in replaced else costs[i] for i in order
    )
    system = set(conversation.system_indices)
    at = tuple(i for i in order if i not in system)
    decision = TrimDecision(
        max_tokens=max_tokens, tokens=after, strategy=strategy, kept=tuple(fingerprints[i] for i in at), at=at,
        seen=len(messages), seen_tokens=sum(c for i, c in enumerate(costs) if i not in system),
        seen_chars=history_chars(messages, conversation.system_indices), counted_with=scheme,
    )
    return TrimResult(
        messages=sent,
        kept=tuple(i for i in order if i not in replaced),
        dropped=tuple(i for i in range(len(messages)) if i not in keep),
        shortened=tuple(sorted(replaced)),
        tokens_before=before,
        tokens_after=after,
        budget=max_tokens,
        count_mode=mode,
        over_budget=over,
        notes=tuple(notes),
        decision=decision,
        reused=reused,
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


def _extend_previous(
    messages: Sequence[Message], previous: TrimDecision, max_tokens: int, counter: TokenCounter, model: str | None,
    strategy: Strategy, keep_last_turns: int,
) -> TrimResult | None:
    """The previous turn's selection plus the new messages, reading and counting only what is
    sent and what is new: the messages dropped before are known from the decision's `seen`
    figures (their total length must be unchanged). None when this shortcut cannot tell (the
    chat was edited or shortened, another encoding counts, the whole chat now fits, the
    selection no longer fits); the full path then decides, with the same result."""
    seen = previous.seen
    scheme, mode = counter.scheme(model), counter.mode(model)
    if seen > len(messages) or previous.counted_with != scheme or previous.seen_chars < 0:
        return None
    system = system_positions(messages)
    chars = history_chars(messages, system)
    new_chars = history_chars(messages[seen:], [i - seen for i in system if i >= seen])
    if chars < 0 or new_chars < 0 or chars - new_chars != previous.seen_chars:
        return None
    fingerprints = Fingerprints(messages)
    keep = extend_previous(previous, messages, fingerprints, keep_last_turns=keep_last_turns, system=system)
    if keep is None:
        return None
    order = sorted(keep)
    count = counter.count_message
    cost = {i: count(messages[i], model) for i in order}
    is_system = set(system).__contains__
    new = list(filterfalse(is_system, range(seen, len(messages))))  # kept, but for orphans
    new_cost = sum(cost[i] if i in cost else count(messages[i], model) for i in new)
    before = TOKENS_PER_REPLY + previous.seen_tokens + sum(cost[i] for i in system) + new_cost
    after = TOKENS_PER_REPLY + sum(cost.values())
    if before <= max_tokens or after > max_tokens or counter.scheme(model) != scheme:
        return None  # (an encoding that loaded meanwhile: the full path counts it all alike)
    at = tuple(filterfalse(is_system, order))
    decision = TrimDecision(
        max_tokens=max_tokens, tokens=after, strategy=strategy, kept=tuple(fingerprints[i] for i in at), at=at,
        seen=len(messages), seen_tokens=previous.seen_tokens + new_cost,
        seen_chars=chars, counted_with=scheme,
    )
    return TrimResult(
        messages=[messages[i] for i in order],
        kept=tuple(order),
        dropped=tuple(filterfalse(keep.__contains__, range(len(messages)))),
        shortened=(),
        tokens_before=before,
        tokens_after=after,
        budget=max_tokens,
        count_mode=mode,
        decision=decision,
        reused=True,
    )


def _mandatory_part(
    conversation: Conversation, costs: list[int], max_tokens: int, counter: TokenCounter, model: str | None,
    pinned: Collection[int], shorten: bool = True,
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
    conversation: Conversation, costs: Sequence[int], max_tokens: int, low_watermark: float, growth_turns: int = DEFAULT_GROWTH_TURNS
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


def _check_options(max_tokens: int, strategy: str, keep_last_turns: int, low_watermark: float, growth_turns: int) -> None:
    """Raise ValueError naming the option and its valid values."""
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


def _shortenable(conversation: Conversation, mandatory: list[int]) -> tuple[list[int], int | None]:
    """Mandatory indices whose text may be cut, and the latest user message (cut last)."""
    messages = conversation.messages
    last_user = conversation.question
    first_choice = [
        i for i in mandatory if i != last_user and messages[i].get("role") != "assistant"
    ]
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
            if cost >= current[index]:
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
