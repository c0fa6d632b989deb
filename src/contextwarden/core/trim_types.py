"""What the trim's stages hand each other: `TrimOptions` (made once a call), the chat read and
counted once (`_Counted`: its `ChatView` with the counts), and `TrimResult`, what a trim chose.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from .chatview import ChatView
from .conversation import Message, image_count
from .decision import TrimDecision
from .excerpt import Excerpt, cuttable
from .recall import DEFAULT_RECALL_SHARE, _Pools
from .selection import DEFAULT_KEEP_LAST_TURNS, DEFAULT_STRATEGY, Strategy
from .semantic import Embed
from .tokens import CountMode

__all__ = [
    "TrimOptions",
    "TrimResult",
    "DEFAULT_LOW_WATERMARK",
    "DEFAULT_GROWTH_TURNS",
    "WHOLE_DOCUMENT_MIN_TOKENS",
    "WHOLE_DOCUMENT_MIN_CHARS",
    "documents",
]

DEFAULT_LOW_WATERMARK = 0.8
DEFAULT_GROWTH_TURNS = 2
# A document: a message (not a system prompt) of at least this many tokens, not pictures alone (a
# message with images is one when it has a text to cut: `excerpt.cuttable`). A question about
# the documents as a whole gets the budget filled with them (`fresh.WHOLE_DOCUMENT_SHARE`); one
# dropped whole is told (`TrimResult.left_out`).
WHOLE_DOCUMENT_MIN_TOKENS = 2_000
# The next turn's shortcut checks for such a message by its length: a token is at least 3 characters
# in the texts this holds for (bench/speed.py's chats of ~500-token turns use "summary" freely).
WHOLE_DOCUMENT_MIN_CHARS = 3 * WHOLE_DOCUMENT_MIN_TOKENS


def documents(view: ChatView, costs: Sequence[int], start: int = 0) -> tuple[int, ...]:
    """The documents (see `WHOLE_DOCUMENT_MIN_TOKENS`) among the messages from `start` on, whose
    tokens `costs` holds: the one rule for what a user is told is a document, and a whole-text
    question reads.

    Example:
        >>> view = ChatView([{"role": "system", "content": "s"}, {"role": "user", "content": "d"},
        ...                  {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
        >>> documents(view, [2_500] * 3), documents(view, [2_500, 9], start=1)
        ((1,), (1,))
    """
    large = [i for i, c in enumerate(costs, start) if c >= WHOLE_DOCUMENT_MIN_TOKENS]
    system, messages = view.system_positions, view.messages
    return tuple(i for i in large if i not in system and (not image_count(messages[i]) or cuttable(messages[i])))


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
    unchanged while its selection holds and its own recall block fits beside this one's: all
    of them, or those before this turn's recall block or the first shortened copy. (A next
    turn whose block needs their room lets earlier questions' blocks go, the newest first: its
    prompt then repeats this one up to the first that goes.)

    `excerpted` holds the shortened indices that are earlier messages too large for what was
    left, sent as excerpts for the latest question (see `excerpt.py`); the next turn sends
    them again, byte for byte, while it keeps the selection.

    `added` holds the positions in `messages` of what the trim added (recall blocks, each with
    its acknowledgement): a later pass over these messages passes them as `added=`. `passages`
    says, for each excerpted message in order, how many of its passages (chunks) were sent of
    how many it has: what a user is told (`document excerpted: 3 of 24 passages`);
    `quoted_passages` the same, as (index, sent, in all), of each message only recall blocks
    quote by passages (not excerpted in place); `shortened_passages` the same of each shortened
    copy cut by passages (the latest user message alone over the budget, a document pasted with
    its question: `shorten._cut_by_passages`; a copy a later pass cut again counts its own
    chunks), told as a document excerpted, not `shortened to fit`; `left_out` the documents (`documents`) dropped
    whole: neither sent, in part or whole, nor quoted by a recall block (a user is told `document
    left out`); `tool_results` which of the excerpted, quoted and left out messages are tool
    results (told as such, not documents).
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
    quoted_passages: tuple[tuple[int, int, int], ...] = ()
    shortened_passages: tuple[tuple[int, int, int], ...] = ()
    tool_results: tuple[int, ...] = ()
    left_out: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.stable_prefix < 0:  # no recall block: all, up to the first shortened copy (cut anew next turn)
            cut = min(set(self.shortened).difference(self.excerpted), default=None)
            stable = len(self.messages) if cut is None else sum(1 for i in (*self.kept, *self.shortened) if i < cut)
            object.__setattr__(self, "stable_prefix", stable)

    @property
    def changed(self) -> bool:
        """True when what is sent differs from the input."""
        return bool(self.dropped or self.shortened)

    @property
    def origins(self) -> tuple[int, ...]:
        """For each of `messages`, the input index it was sent from (as is or shortened), -1
        for what the trim added; () when they do not line up (a caller changed `messages`)."""
        sent, added = iter(sorted((*self.kept, *self.shortened))), set(self.added)
        origins = tuple(-1 if k in added else next(sent, -2) for k in range(len(self.messages)))
        return origins if -2 not in origins and next(sent, None) is None else ()


@dataclass(frozen=True, slots=True)
class _Counted:
    """The chat read and counted once: its view, each message's tokens and the label they go with."""

    view: ChatView
    costs: list[int]
    mode: CountMode
    scheme: str
    before: int  # the whole chat, reply priming included
    pools: _Pools  # this trim's recall pools, shared with the fast path

    @property
    def messages(self) -> Sequence[Message]:
        return self.view.messages


def _sized(costs: list[int], excerpts: dict[int, Excerpt]) -> list[int]:
    """`costs` with each excerpted message at what its excerpt costs."""
    if not excerpts:
        return costs
    return [excerpts[i].tokens if i in excerpts else c for i, c in enumerate(costs)]
