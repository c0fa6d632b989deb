"""`ChatView`: one turn's read of the chat, built once and taken by every stage of a trim.

A trim reads the message list once into this view: each message's text and role, the system
messages' positions, the structure (units, turns, the current turn: `read_conversation`) and
each message's fingerprint. Each is read when a stage first asks for it and kept, so the next
turn's shortcut, which reads only what is new, still reads only that. No stage goes back to
the raw list for these; the counts stay with the counted chat (`trim_types._Counted`).
"""

from __future__ import annotations

from collections.abc import Sequence

from .conversation import Conversation, Message, Turn, Unit, message_text, read_conversation, system_positions
from .decision import Fingerprints
from .relevance import DEFAULT_RELEVANCE_WEIGHTS, RelevanceWeights, score_messages

__all__ = ["ChatView"]


class ChatView:
    """A message list read for one turn: the messages as given (never copied or changed) and
    what the stages read of them, each when first asked for (`text`, `texts`, `roles`,
    `system_positions`, `conversation` and its parts, `fingerprints`, `relevance`).

    It does not change once built: the list it reads must not change while it is in use (a
    trim reads a list it never modifies; a new list is a new view).

    Example:
        >>> view = ChatView([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
        >>> view.text(1), view.roles, view.system_positions, view.question
        ('hi', ['system', 'user'], (0,), 1)
    """

    __slots__ = (
        "messages",
        "_conversation",
        "_texts",
        "_some",
        "_roles",
        "_system",
        "_orphans",
        "_fingerprints",
        "_relevance",
    )

    def __init__(self, messages: Sequence[Message], conversation: Conversation | None = None) -> None:
        self.messages = messages
        self._conversation = conversation
        self._texts: list[str] | None = None
        self._some: dict[int, str] = {}  # texts read one by one before all were
        self._roles: list[object] | None = None
        self._system: tuple[int, ...] | None = None
        self._orphans: frozenset[int] | None = None
        self._fingerprints: Fingerprints | None = None
        self._relevance: dict[RelevanceWeights, list[float]] = {}

    def __len__(self) -> int:
        return len(self.messages)

    def text(self, index: int) -> str:
        """`message_text` of `messages[index]`, read once."""
        if self._texts is not None:
            return self._texts[index]
        done = self._some.get(index)
        if done is None:
            done = self._some[index] = message_text(self.messages[index])
        return done

    @property
    def texts(self) -> list[str]:
        """`message_text` of every message, in order (read once; do not modify)."""
        if self._texts is None:
            some = self._some
            self._texts = [some[i] if i in some else message_text(m) for i, m in enumerate(self.messages)]
        return self._texts

    def role(self, index: int) -> object:
        """The `role` of `messages[index]` as given (None when missing; not always a str)."""
        if self._roles is not None:
            return self._roles[index]
        return self.messages[index].get("role")

    @property
    def roles(self) -> list[object]:
        """Each message's `role` as given, in order (read once; do not modify)."""
        if self._roles is None:
            self._roles = [m.get("role") for m in self.messages]
        return self._roles

    @property
    def system_positions(self) -> tuple[int, ...]:
        """Indices of the system (and developer) messages, without reading the structure."""
        if self._system is None:
            self._system = tuple(system_positions(self.messages))
        return self._system

    @property
    def fingerprints(self) -> Fingerprints:
        """Each message's `message_fingerprint`, computed when first asked for."""
        if self._fingerprints is None:
            self._fingerprints = Fingerprints(self.messages)
        return self._fingerprints

    def relevance(self, weights: RelevanceWeights = DEFAULT_RELEVANCE_WEIGHTS) -> list[float]:
        """`score_messages` of every message to the question, the system and orphan messages
        left out, by words alone: scored once a view and `weights` (a new selection ranks the
        turns, then the turns to excerpt, by the same scores); a new list each time.

        Example:
            >>> view = ChatView([{"role": "user", "content": "I have a cat."}, {"role": "user", "content": "My cat?"}])
            >>> view.relevance()[0] > 0, view.relevance() is view.relevance()
            (True, False)
        """
        question = self.question
        if question is None:
            raise ValueError("no question to score the messages against")
        scores = self._relevance.get(weights)
        if scores is None:
            excluded = self.system_indices + self.orphan_indices
            scores = self._relevance[weights] = score_messages(
                self.messages, question=question, exclude=excluded, weights=weights, texts=self.texts, roles=self.roles
            )
        return list(scores)

    @property
    def conversation(self) -> Conversation:
        """The structure (`read_conversation`): system units, turns, the current turn, orphans."""
        if self._conversation is None:
            self._conversation = read_conversation(self.messages)
        return self._conversation

    @property
    def system(self) -> tuple[Unit, ...]:
        return self.conversation.system

    @property
    def turns(self) -> tuple[Turn, ...]:
        return self.conversation.turns

    @property
    def current(self) -> int | None:
        """The index of the turn holding the latest user message (`Conversation.current`)."""
        return self.conversation.current

    @property
    def latest(self) -> int | None:
        """The index of the turn before the current one (the latest exchange, what the current
        question follows); None when the current turn is the first or there is none."""
        current = self.conversation.current
        return current - 1 if current else None

    @property
    def orphans(self) -> tuple[Unit, ...]:
        return self.conversation.orphans

    @property
    def system_indices(self) -> list[int]:
        """The system units' indices (a new list each time: callers extend it)."""
        return self.conversation.system_indices

    @property
    def orphan_indices(self) -> list[int]:
        """Indices of tool messages and calls that are never sent (a new list each time)."""
        return self.conversation.orphan_indices

    @property
    def orphan_set(self) -> frozenset[int]:
        """`orphan_indices` as a set, made once (what `alternation` looks past)."""
        if self._orphans is None:
            self._orphans = frozenset(self.conversation.orphan_indices)
        return self._orphans

    @property
    def question(self) -> int | None:
        """Index of the latest user message; None without one."""
        return self.conversation.question

    def window(self, start: int) -> ChatView:
        """The view of `messages[start:]` (what `selection.extend_previous` reads), sharing the
        texts already read."""
        view = ChatView(self.messages[start:])
        if self._texts is not None:
            view._texts = self._texts[start:]
        else:
            view._some = {i - start: t for i, t in self._some.items() if i >= start}
        return view
