"""The DESIGN.md contract as one checking function."""

from __future__ import annotations

import copy
import json
from typing import Any

from contextwarden.conversation import read_conversation, tool_call_ids
from contextwarden.tokens import TokenCounter
from contextwarden.trim import TrimResult


def check_contract(chat: list[dict[str, Any]], result: TrimResult, counter: TokenCounter, model: str | None) -> None:
    """Assert every rule of DESIGN.md's contract for one trim."""
    sent = result.messages
    conversation = read_conversation(chat)
    # 1. valid output: every tool_calls id answered right after; no orphan tool message.
    i = 0
    while i < len(sent):
        ids = tool_call_ids(sent[i]) if sent[i].get("role") == "assistant" else []
        if ids:
            answered = []
            j = i + 1
            while j < len(sent) and sent[j].get("role") == "tool":
                answered.append(str(sent[j].get("tool_call_id")))
                j += 1
            assert set(ids) <= set(answered), f"unanswered tool calls at {i}"
            i = j
            continue
        assert sent[i].get("role") != "tool", f"orphan tool message at {i}"
        i += 1
    # system messages kept, in front of the history they led.
    for unit in conversation.system:
        assert unit.start in result.kept or unit.start in result.shortened
    # the latest user message is kept (verbatim unless it alone was over budget).
    if conversation.current is not None:
        last_user = conversation.turns[conversation.current].units[0].start
        assert last_user in result.kept or (last_user in result.shortened and result.notes)
    # history after the system prompt starts with a user message unless the input did not.
    first = next((m for m in sent if m.get("role") not in ("system", "developer")), None)
    first_in = next((m for m in chat if m.get("role") not in ("system", "developer")), None)
    if first is not None and first.get("role") in ("assistant", "tool"):
        # "unless the input did": an orphan tool message first in the input is dropped, and
        # what followed it (an assistant reply) then leads; that is the input's own start.
        assert first_in is not None and first_in.get("role") in ("assistant", "tool"), "history now starts with an assistant or tool message"
    # 2. hard budget, counted with the filter's own counter.
    assert result.tokens_after == counter.count_messages(sent, model)
    if not result.over_budget:
        assert result.tokens_after <= result.budget
    # 3. untouched means untouched: kept messages are the same dicts, in order.
    by_index = dict(zip(sorted(result.kept + result.shortened), sent))
    for index in result.kept:
        assert by_index[index] is chat[index]
    assert sorted(result.kept + result.dropped + result.shortened) == list(range(len(chat)))


def assert_same_trim(a: TrimResult, b: TrimResult) -> None:
    """Two trims of one chat chose alike: the same messages (each kept one the very same dict),
    counts and decision."""
    assert a.messages == b.messages
    sent = sorted(a.kept + a.shortened)
    assert all(x is y for i, x, y in zip(sent, a.messages, b.messages) if i in a.kept)
    assert (a.kept, a.dropped, a.shortened, a.tokens_before, a.tokens_after, a.reused, a.decision) == \
        (b.kept, b.dropped, b.shortened, b.tokens_before, b.tokens_after, b.reused, b.decision)


def frozen(chat: list[dict[str, Any]]) -> str:
    """A snapshot to prove the input was not mutated."""
    return json.dumps(copy.deepcopy(chat), sort_keys=True, default=str)
