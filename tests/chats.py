"""Random chats for tests, and the DESIGN.md contract as one checking function."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

from contextwarden.conversation import read_conversation, tool_call_ids
from contextwarden.tokens import TokenCounter
from contextwarden.trim import TrimResult

WORDS = (
    "budget context token tool call reply model cache prefix system user assistant "
    "garden river Paris 2024 42 ünïcode 日本語 émoji 🙂 <|endoftext|> def return {} [] ;"
).split()
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def random_chat(rng: random.Random, n: int, *, system_words: int | None = None) -> list[dict[str, Any]]:
    """A chat of about `n` messages: system prompt, turns, tool groups (parallel calls too),
    images, `None` and empty content, names, the odd unknown role."""
    chat: list[dict[str, Any]] = []
    if rng.random() < 0.85:
        chat.append({"role": "system", "content": text(rng, system_words if system_words is not None else rng.randint(0, 80))})
    call = 0
    while len(chat) < n:
        roll = rng.random()
        if roll < 0.08:
            chat.append({"role": "user", "content": [{"type": "text", "text": text(rng, rng.randint(1, 40))}, IMAGE]})
        elif roll < 0.12:
            chat.append({"role": "user", "content": None if rng.random() < 0.5 else "", "name": "bob"})
        else:
            chat.append({"role": "user", "content": text(rng, rng.randint(1, 120)), "id": f"u{len(chat)}"})
        for _ in range(rng.randint(0, 2)):
            calls = [{"id": f"call_{(call := call + 1)}", "type": "function", "function": {"name": "lookup", "arguments": json.dumps({"q": text(rng, 3)})}} for _ in range(rng.randint(1, 3))]
            chat.append({"role": "assistant", "content": None, "tool_calls": calls})
            for c in calls:
                chat.append({"role": "tool", "tool_call_id": c["id"], "content": text(rng, rng.randint(1, 200))})
        if rng.random() < 0.03:
            chat.append({"role": "critic", "content": text(rng, 10)})
        chat.append({"role": "assistant", "content": text(rng, rng.randint(1, 150)), "info": {"usage": {}}})
    if chat[-1]["role"] != "user":
        chat.append({"role": "user", "content": text(rng, rng.randint(1, 30))})
    return chat


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
        assert first is first_in, "history now starts with an assistant or tool message"
    # 2. hard budget, counted with the filter's own counter.
    assert result.tokens_after == counter.count_messages(sent, model)
    if not result.over_budget:
        assert result.tokens_after <= result.budget
    # 3. untouched means untouched: kept messages are the same dicts, in order.
    by_index = dict(zip(sorted(result.kept + result.shortened), sent))
    for index in result.kept:
        assert by_index[index] is chat[index]
    assert sorted(result.kept + result.dropped + result.shortened) == list(range(len(chat)))


def frozen(chat: list[dict[str, Any]]) -> str:
    """A snapshot to prove the input was not mutated."""
    return json.dumps(copy.deepcopy(chat), sort_keys=True, default=str)
