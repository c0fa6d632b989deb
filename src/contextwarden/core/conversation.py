"""Reading an OpenAI / Open WebUI message list into units and turns.

A *unit* is what must be kept or dropped whole: one message, or an assistant message with
`tool_calls` together with the `tool` messages answering it (and Open WebUI's message carrying
their images, `is_tool_images`). A *turn* is a user message with
everything up to the next user message, except that the user message Open WebUI adds after tool
results that returned images (`is_tool_images`) belongs to the turn of the tool loop it follows.
Nothing here copies or changes a message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import repeat
from typing import Any, Literal

from ..caches import UNIT_MEMO_SIZE, register

__all__ = [
    "Message",
    "UnitKind",
    "Unit",
    "Turn",
    "Conversation",
    "read_conversation",
    "TOOL_IMAGES_TEXT",
    "is_tool_images",
    "continues_tool_loop",
    "latest_question",
    "message_text",
    "REASONING_KEYS",
    "reasoning_text",
    "image_count",
    "part_count",
    "tool_call_ids",
    "system_positions",
    "RECALL_LABEL",
    "recall_message",
    "recall_quotes",
    "is_recall_message",
    "SUMMARY_ACK",
    "SUMMARY_ACK_MESSAGE",
    "is_acknowledgement",
]

Message = dict[str, Any]
"""One chat message in OpenAI format (Open WebUI adds keys such as `id`, `info`)."""

UnitKind = Literal["system", "user", "assistant", "tool_group", "orphan_tool", "other"]

SYSTEM_ROLES = frozenset({"system", "developer"})
# The assistant's short turn after a user-role note contextwarden adds (the summary note, a recall
# block) when a user message follows it: roles alternate, as strict chat templates require.
SUMMARY_ACK = "Noted."
SUMMARY_ACK_MESSAGE: Message = {"role": "assistant", "content": SUMMARY_ACK}  # a template: copied, never sent
RECALL_LABEL = "[contextwarden] Recalled from earlier in this chat (older messages, quoted verbatim):"
# The text of the user message Open WebUI 0.12.4 adds after tool results that returned images
# (utils/misc.py convert_output_to_messages with flatten_tool_images, utils/middleware.py's tool
# loop): Chat Completions tool messages cannot hold images, so they follow in this message.
TOOL_IMAGES_TEXT = "Here are the images from the tool results above. Please analyze them."
# Where Open WebUI 0.12.4 replays an assistant's reasoning beside its content for the provider to
# read again (utils/misc.py convert_output_to_messages: `thinking` for Ollama, `reasoning_content`
# for llama.cpp, both by utils/middleware.py get_reasoning_format; `reasoning_details` for the
# model that wrote them; utils/payload.py reads `reasoning` too): sent, so counted, never scored.
REASONING_KEYS = frozenset({"thinking", "reasoning_content", "reasoning", "reasoning_details"})
_REASONING_STRINGS = ("thinking", "reasoning_content", "reasoning")
_REASONING_DETAIL_TEXTS = ("text", "summary", "data")  # (not a detail's signature, id or format)


@dataclass(frozen=True, slots=True)
class Unit:
    """Message indices `start..stop-1` that are kept or dropped together."""

    start: int
    stop: int
    kind: UnitKind

    @property
    def indices(self) -> range:
        return range(self.start, self.stop)


@dataclass(frozen=True, slots=True)
class Turn:
    """A user message and what followed it, as units (the first turn may lack the user)."""

    units: tuple[Unit, ...]

    @property
    def indices(self) -> list[int]:
        return [i for unit in self.units for i in unit.indices]


@dataclass(frozen=True, slots=True)
class Conversation:
    """An indexed view of a message list: system units, turns, and the current turn.

    `current` is the index of the turn holding the last user message (everything after it is
    the turn in progress, e.g. a tool loop); `None` when there is no user message.
    """

    messages: Sequence[Message]
    system: tuple[Unit, ...]
    turns: tuple[Turn, ...]
    current: int | None
    orphans: tuple[Unit, ...]

    @property
    def system_indices(self) -> list[int]:
        """Indices of the system (and developer) messages."""
        return [i for unit in self.system for i in unit.indices]

    @property
    def orphan_indices(self) -> list[int]:
        """Indices of tool messages and calls that are never sent (see `read_conversation`)."""
        return [i for unit in self.orphans for i in unit.indices]

    @property
    def question(self) -> int | None:
        """Index of the latest question: the current turn's first message, the last user message
        that is not Open WebUI's tool images (`continues_tool_loop`); None without one."""
        return None if self.current is None else self.turns[self.current].units[0].start


def message_text(message: Message) -> str:
    """The text a message carries: string content, the text parts of a list, tool-call arguments.

    Example:
        >>> message_text({"role": "user", "content": [{"type": "text", "text": "hi"}]})
        'hi'
    """
    content = message.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "\n".join(
            part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    else:
        text = ""
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                text += "\n" + str(function.get("name") or "") + str(function.get("arguments") or "")
    return text


def reasoning_text(message: Mapping[str, Any]) -> str:
    """The reasoning a message carries beside its content (`REASONING_KEYS`), as the provider
    reads it: the longest of its reasoning strings and its `reasoning_details` texts joined,
    since they hold the same thinking in other forms and a provider reads one (Open WebUI's
    Ollama conversion takes `thinking`, else `reasoning_content` or `reasoning`); '' when none.

    Example:
        >>> reasoning_text({"role": "assistant", "content": "4", "thinking": "2+2 is 4."})
        '2+2 is 4.'
    """
    if REASONING_KEYS.isdisjoint(message):
        return ""
    texts = [value for key in _REASONING_STRINGS if isinstance(value := message.get(key), str)]
    details = message.get("reasoning_details")
    if isinstance(details, list):
        texts.append(
            "\n".join(
                text
                for detail in details
                if isinstance(detail, dict)
                for key in _REASONING_DETAIL_TEXTS
                if isinstance(text := detail.get(key), str) and text
            )
        )
    return max(texts, key=len, default="")


def part_count(message: Message) -> int:
    """How many content parts, tool calls and reasoning details a message holds (each read on
    its own, whatever its length: what makes a message in many pieces slow to walk).

    Example:
        >>> part_count({"role": "user", "content": [{"type": "text", "text": "a"}] * 3}), part_count({"content": "a"})
        (3, 0)
    """
    return sum(
        len(value) for key in ("content", "tool_calls", "reasoning_details") if type(value := message.get(key)) is list
    )


def image_count(message: Message) -> int:
    """How many image parts a message's content holds."""
    content = message.get("content")
    if not isinstance(content, list):
        return 0
    return sum(1 for part in content if isinstance(part, dict) and part.get("type") in ("image_url", "image"))


def tool_call_ids(message: Message) -> list[str]:
    """The ids of an assistant message's `tool_calls` (empty when it has none)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return []
    return [str(call.get("id")) for call in calls if isinstance(call, dict)]


def system_positions(messages: Sequence[Message]) -> list[int]:
    """Indices of the system (and developer) messages, without reading the chat's structure.

    Example:
        >>> system_positions([{"role": "system", "content": "x"}, {"role": "user", "content": "y"}])
        [0]
    """
    roles = list(map(dict.get, messages, repeat("role")))
    found: list[int] = []
    for role in SYSTEM_ROLES:  # list.count and list.index run in C; a chat has few system messages
        at = -1
        for _ in range(roles.count(role)):
            at = roles.index(role, at + 1)
            found.append(at)
    return sorted(found)


def _role(message: Message) -> str:
    role = message.get("role")
    return role if isinstance(role, str) else ""


_UNIT_KIND_BY_ROLE: dict[str, UnitKind] = {
    **{role: "system" for role in SYSTEM_ROLES},
    "user": "user",
    "assistant": "assistant",
    "tool": "orphan_tool",  # a `tool` message not taken by the tool group before it
}


@lru_cache(maxsize=UNIT_MEMO_SIZE)
def _unit(start: int, stop: int, kind: UnitKind) -> Unit:
    """The unit for these values, built once: units are immutable values, and a frozen
    dataclass costs about 4x a cache lookup to construct (a chat is re-read every turn)."""
    return Unit(start, stop, kind)


register("conversation._unit", _unit.cache_clear)


def _split_units(messages: Sequence[Message]) -> list[Unit]:
    """Cut the list into units; a tool group takes the `tool` replies that answer its calls, and
    the images Open WebUI moved out of them into a user message (`continues_tool_loop`)."""
    units: list[Unit] = []
    kinds = _UNIT_KIND_BY_ROLE
    i, n = 0, len(messages)
    unit = _unit
    while i < n:
        message = messages[i]
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls") and (ids := tool_call_ids(message)):
            pending = set(ids)
            j = i + 1
            while j < n and _role(messages[j]) == "tool" and pending:
                pending.discard(str(messages[j].get("tool_call_id")))
                j += 1
            if not pending and j < n and continues_tool_loop(messages, j):
                j += 1  # the images its results returned travel with them
            # A group whose calls are not all answered is invalid for every provider.
            units.append(unit(i, j, "orphan_tool" if pending else "tool_group"))
            i = j
            continue
        units.append(unit(i, i + 1, kinds.get(role, "other") if type(role) is str else "other"))
        i += 1
    return units


def read_conversation(messages: Sequence[Message]) -> Conversation:
    """Index a message list into system units, turns and the current turn.

    Orphan tool messages and unanswered tool calls are set apart: sending them would make the
    provider reject the request, so they are never part of a turn. A user message that only
    carries a tool's images (`continues_tool_loop`) stays in the turn of the loop it follows: the
    current turn begins at the real question, so a loop in progress is sent whole.
    """
    system: list[Unit] = []
    orphans: list[Unit] = []
    turns: list[list[Unit]] = []
    for unit in _split_units(messages):
        if unit.kind == "system":
            system.append(unit)
        elif unit.kind == "orphan_tool":
            orphans.append(unit)
        elif (unit.kind == "user" and not continues_tool_loop(messages, unit.start)) or not turns:
            turns.append([unit])
        else:
            turns[-1].append(unit)
    current = None
    for t in range(len(turns) - 1, -1, -1):  # (a turn's later user messages are tool images)
        if turns[t][0].kind == "user":
            current = t
            break
    return Conversation(
        messages=messages,
        system=tuple(system),
        turns=tuple(Turn(tuple(units)) for units in turns),
        current=current,
        orphans=tuple(orphans),
    )


def is_tool_images(message: Message) -> bool:
    """True for a message shaped as the one Open WebUI adds after tool results that returned
    images: a user message whose content is exactly `TOOL_IMAGES_TEXT` then image parts.

    Example:
        >>> image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}
        >>> is_tool_images({"role": "user", "content": [{"type": "text", "text": TOOL_IMAGES_TEXT}, image]})
        True
    """
    content = message.get("content")
    if message.get("role") != "user" or not isinstance(content, list) or len(content) < 2:
        return False
    first = content[0]
    if not isinstance(first, dict) or first.get("type") != "text" or first.get("text") != TOOL_IMAGES_TEXT:
        return False
    return all(isinstance(part, dict) and part.get("type") == "image_url" for part in content[1:])


def continues_tool_loop(messages: Sequence[Message], index: int) -> bool:
    """`messages[index]` is Open WebUI's tool images (`is_tool_images`) right after a tool result:
    part of the tool loop before it, not a question (a user's own message never has that shape
    and place: the text is Open WebUI's, and a user message follows a reply, not a tool result)."""
    return index > 0 and _role(messages[index - 1]) == "tool" and is_tool_images(messages[index])


def latest_question(messages: Sequence[Message]) -> int | None:
    """Index of the latest question without reading the chat's structure: the last user message
    that does not continue a tool loop (`continues_tool_loop`); None without one.

    Example:
        >>> latest_question([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])
        0
    """
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "user" and not continues_tool_loop(messages, i):
            return i
    return None


def recall_message(
    messages: Sequence[Message], indices: Sequence[int], texts: Mapping[int, str] | None = None
) -> Message:
    """The user-role message that quotes `messages[i]` for each of `indices` (in that order),
    verbatim, under `RECALL_LABEL`: each as its role, a colon and its text (`message_text`, or
    `texts[i]` when given: the passages quoted of a long message, `excerpt.passage_quote`).
    A user message, never a system one: Open WebUI merges system messages into the system
    prompt, which would rewrite the cached prefix every turn.

    Example:
        >>> recall_message([{"role": "user", "content": "My cat is Miso."}], [0])["content"].splitlines()[-1]
        'user: My cat is Miso.'
    """
    return {"role": "user", "content": "".join(recall_quotes(messages, indices, texts))}


def recall_quotes(
    messages: Sequence[Message], indices: Sequence[int], texts: Mapping[int, str] | None = None
) -> list[str]:
    """The text of `recall_message` in parts: the label, then each quoted message (every part
    but the last ends with the blank line between them), so that its count can be made of the
    parts' (see `TokenCounter.count_joined`).

    Example:
        >>> recall_quotes([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], [0, 1])[1:]
        ['user: a\\n\\n', 'assistant: b']
    """
    texts = texts or {}
    quotes = [f"{messages[i].get('role')}: {texts.get(i) or message_text(messages[i])}\n\n" for i in indices]
    if quotes:
        quotes[-1] = quotes[-1][:-2]
    return [f"{RECALL_LABEL}\n\n", *quotes]


def is_recall_message(message: Message) -> bool:
    """True for a user message that starts with `RECALL_LABEL`: what `recall_message` writes, or
    a user's text that reads like it (`summarize.own_messages` tells them apart)."""
    content = message.get("content")
    return message.get("role") == "user" and type(content) is str and content.startswith(RECALL_LABEL)


def is_acknowledgement(message: Message) -> bool:
    """True for an assistant `SUMMARY_ACK` without tool calls (what follows an added note)."""
    return (
        message.get("role") == "assistant" and message.get("content") == SUMMARY_ACK and not message.get("tool_calls")
    )
