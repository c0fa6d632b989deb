"""Prompt-cache breakpoints: `cache_control` markers for providers that cache only what is marked.

OpenAI, DeepSeek, Grok and Gemini 2.5 cache a repeated prompt prefix on their own; Anthropic
models (directly or through OpenRouter) cache only up to a `cache_control: {"type":
"ephemeral"}` breakpoint, at most 4 per request, and never a prefix below the model's minimum.
Pure: which provider a model needs, where the markers go, and putting them on copies of the
messages (a string content becomes one text part with the marker; the text is unchanged).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..core.conversation import Message
from ..core.decision import message_fingerprint
from ..core.trim import TrimResult

__all__ = [
    "CACHE_MARKER",
    "MAX_BREAKPOINTS",
    "carried_prefix",
    "breakpoint_provider",
    "needs_breakpoints",
    "min_cacheable_tokens",
    "breakpoint_positions",
    "has_cache_markers",
    "place_breakpoints",
    "remove_breakpoints",
]

CACHE_MARKER = {"type": "ephemeral"}
MAX_BREAKPOINTS = 4  # Anthropic's limit per request
AUTOMATIC_MIN_TOKENS = 1_024  # OpenAI, DeepSeek, Grok, Gemini 2.5: automatic from this prompt size
# Anthropic's minimum cacheable prefix per model family (their prompt-caching docs); a Claude model
# not listed gets the largest minimum, so a marker is never placed below what it needs.
_CLAUDE_MIN_TOKENS = (
    (("claude-3-haiku", "claude-3.5-haiku", "claude-3-5-haiku"), 2_048),
    (("claude-sonnet-4", "claude-opus-4", "claude-3-7-sonnet", "claude-3.7-sonnet"), 1_024),
)
_CLAUDE_MIN_EXCEPTIONS = ("claude-opus-4.5", "claude-opus-4-5")  # 4,096, though named like opus-4
CLAUDE_DEFAULT_MIN_TOKENS = 4_096


def carried_prefix(result: TrimResult) -> int:
    """How many leading messages of `result.messages` the next turn sends again unchanged.

    The one place that says it: until `TrimResult` carries `stable_prefix`, derived from what
    the trim decision records. The next turn's reuse path sends this turn's kept messages again
    and appends the new ones, so every sent message up to the first shortened copy carries over.
    """
    stable = getattr(result, "stable_prefix", None)
    if isinstance(stable, int) and not isinstance(stable, bool):
        return max(0, min(stable, len(result.messages)))
    if not result.shortened:
        return len(result.messages)
    first_cut = min(result.shortened)
    return sum(1 for i in (*result.kept, *result.shortened) if i < first_cut)


def _bare(model_id: str) -> str:
    return model_id.lower().rpartition("/")[2]


def min_cacheable_tokens(model_id: str) -> int:
    """The smallest prefix (provider tokens) the model caches.

    Example:
        >>> min_cacheable_tokens("anthropic/claude-sonnet-4.5"), min_cacheable_tokens("anthropic/claude-haiku-4.5")
        (1024, 4096)
    """
    bare = _bare(model_id)
    if not bare.startswith("claude"):
        return AUTOMATIC_MIN_TOKENS
    if bare.startswith(_CLAUDE_MIN_EXCEPTIONS):
        return CLAUDE_DEFAULT_MIN_TOKENS
    for prefixes, minimum in _CLAUDE_MIN_TOKENS:
        if bare.startswith(prefixes):
            return minimum
    return CLAUDE_DEFAULT_MIN_TOKENS


def breakpoint_provider(sent_id: str, resolved_id: str | None, model: Mapping[str, Any] | None) -> str | None:
    """ "anthropic" when this request should carry breakpoints, else None (do nothing when unsure).

    Yes only for a Claude model named `anthropic/...` (after the connection prefix: OpenRouter's
    and LiteLLM's naming, both of which pass `cache_control` on content parts to Anthropic) on an
    OpenAI-compatible connection Open WebUI knows (`__model__` present, not Ollama, not a pipe or
    direct connection). A direct api.anthropic.com connection (listed with `owned_by: anthropic`)
    goes to Anthropic's OpenAI-compatible endpoint in Open WebUI 0.12.4, where breakpoints on
    content parts are not documented: nothing. Automatic providers (OpenAI, ...) never get one.

    Args:
        sent_id: the model id as sent, connection prefix removed (e.g. "anthropic/claude-sonnet-4.5").
        resolved_id: the price-table id it resolved to, if any.
        model: Open WebUI's `__model__`.
    """
    if not isinstance(model, Mapping) or model.get("owned_by") != "openai":
        return None
    if "ollama" in model or model.get("pipe") or model.get("direct"):
        return None
    listed = model.get("openai")
    if isinstance(listed, Mapping) and listed.get("owned_by") == "anthropic":
        return None
    namespace, slash, name = sent_id.lower().partition("/")
    if not slash or namespace != "anthropic" or not name.startswith("claude"):
        return None
    if resolved_id is not None and not resolved_id.lower().startswith("anthropic/"):
        return None
    return "anthropic"


def _markable(message: Message) -> bool:
    content = message.get("content")
    if isinstance(content, str):
        return bool(content)
    return isinstance(content, list) and any(isinstance(part, dict) and part.get("type") for part in content)


def breakpoint_positions(
    messages: Sequence[Message], costs: Sequence[int], carried: int, minimum: int
) -> tuple[int, ...]:
    """Where the markers go: the end of the system prompt, the end of the previous turn's prompt
    inside the carried prefix (its last user message before the prefix's end), and the end of the
    carried prefix. A position is taken only when the prefix through it reaches `minimum` tokens;
    at most `MAX_BREAKPOINTS`. While the prefix holds, this turn's last marker is on the message
    the next turn marks as the previous turn's end, so each turn reads what the last one wrote.

    Example:
        >>> chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"},
        ...         {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
        >>> breakpoint_positions(chat, [2_000, 10, 10, 10], 4, 1_024)
        (0, 1, 3)
    """
    carried = max(0, min(carried, len(messages), len(costs)))
    system_end = 0
    while system_end < carried and messages[system_end].get("role") == "system":
        system_end += 1
    wanted: list[int] = []
    if system_end:
        wanted.append(system_end - 1)
    end = carried - 1
    if end >= system_end:
        previous = next((i for i in range(end - 1, system_end - 1, -1) if messages[i].get("role") == "user"), None)
        if previous is not None:
            wanted.append(previous)
        wanted.append(end)
    through, total, chosen = 0, 0, []
    for position in sorted(set(wanted)):
        total += sum(costs[through : position + 1])
        through = position + 1
        if total >= minimum and _markable(messages[position]):
            chosen.append(position)
    return tuple(chosen[-MAX_BREAKPOINTS:])


def has_cache_markers(messages: Sequence[Message]) -> bool:
    """True when any content part already carries `cache_control` (ours from an earlier pass, or another's)."""
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(isinstance(part, dict) and "cache_control" in part for part in content):
            return True
    return False


def _marked(message: Message) -> Message:
    content = message["content"]
    if isinstance(content, str):
        return {**message, "content": [{"type": "text", "text": content, "cache_control": dict(CACHE_MARKER)}]}
    parts = list(content)
    last = max(
        (k for k, part in enumerate(parts) if isinstance(part, dict) and part.get("type") == "text"), default=None
    )
    if last is None:
        last = max(k for k, part in enumerate(parts) if isinstance(part, dict) and part.get("type"))
    parts[last] = {**parts[last], "cache_control": dict(CACHE_MARKER)}
    return {**message, "content": parts}


def place_breakpoints(messages: Sequence[Message], positions: Sequence[int]) -> tuple[list[Message], dict[str, bool]]:
    """Copies of the messages with a marker at each position (the input is not changed), and
    for each marked copy its fingerprint -> whether its content was a string (to undo it)."""
    out = list(messages)
    undo: dict[str, bool] = {}
    for position in positions:
        marked = _marked(messages[position])
        out[position] = marked
        undo[message_fingerprint(marked)] = isinstance(messages[position].get("content"), str)
    return out, undo


def remove_breakpoints(messages: Sequence[Message], undo: Mapping[str, bool]) -> list[Message]:
    """The messages with the markers `place_breakpoints` put there taken off again (others' stay):
    a later pass of the same turn then trims and marks what the first pass saw."""
    out = list(messages)
    for k, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(isinstance(p, dict) and "cache_control" in p for p in content):
            continue
        was_string = undo.get(message_fingerprint(message))
        if was_string is None:
            continue
        parts = [
            {key: v for key, v in p.items() if key != "cache_control"} if isinstance(p, dict) else p for p in content
        ]
        if was_string and len(parts) == 1 and isinstance(parts[0].get("text"), str):
            out[k] = {**message, "content": parts[0]["text"]}
        else:
            out[k] = {**message, "content": parts}
    return out


def needs_breakpoints(model_id: str) -> bool:
    """True for models whose provider caches only what a breakpoint marks (Claude)."""
    return _bare(model_id).startswith("claude")
