"""The DESIGN.md contract as one checking function."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Collection
from itertools import pairwise
from typing import Any

from contextwarden.core.chatview import ChatView
from contextwarden.core.conversation import (
    RECALL_LABEL,
    SUMMARY_ACK_MESSAGE,
    is_recall_message,
    message_text,
    tool_call_ids,
)
from contextwarden.core.decision import TrimDecision
from contextwarden.core.excerpt import split_chunks
from contextwarden.core.selection import mandatory_indices
from contextwarden.core.tokens import TokenCounter
from contextwarden.core.trim import TrimResult


def _check_alternation(chat: list[dict[str, Any]], result: TrimResult, pinned: Collection[int]) -> None:
    """No user (or assistant) message follows one of its role in what is sent unless the chat
    had one of them next to one of its role (a question with no reply, two in a row; orphan
    tool calls, never sent, aside), or one is pinned (a pin goes alone when the rest of its
    turn does not fit) or both are mandatory. What the trim added (recall blocks, their
    acknowledgements: `result.added`) is judged by role alone: a block may follow a message of
    its role only where that message and the block's anchor could meet."""
    view = ChatView(chat)
    skip = {*view.orphan_indices, *view.system_indices}
    pins = set(pinned)
    fixed = {*pins, *mandatory_indices(view)}
    added = set(result.added)
    origin = iter(sorted({*result.kept, *result.shortened}))
    at = [None if k in added else next(origin, None) for k in range(len(result.messages))]
    dialogue = [(m.get("role"), i) for m, i in zip(result.messages, at, strict=True)]
    dialogue = [(r, i) for r, i in dialogue if r not in ("system", "developer")]

    def may_meet(role: object, i: int, j: int) -> bool:
        after = next((chat[k].get("role") for k in range(i + 1, len(chat)) if k not in skip), None)
        before = next((chat[k].get("role") for k in range(j - 1, -1, -1) if k not in skip), None)
        return role in (after, before) or bool({i, j} & pins) or {i, j} <= fixed

    for k, ((role, i), (other, j)) in enumerate(zip(dialogue, dialogue[1:], strict=False)):
        if role not in ("user", "assistant") or other != role:
            continue
        assert i is not None or j is not None, f"two {role} messages in a row added by the trim"
        if j is None:  # a block right after a kept message: where that and the block's anchor may meet
            anchor = next(a for _, a in dialogue[k + 1 :] if a is not None)
            assert may_meet(role, i, anchor), f"two {role} messages in a row, one added by the trim"
        elif i is None:  # an acknowledgement before a kept assistant message: the chat's own two alike
            before = next((chat[a].get("role") for a in range(j - 1, -1, -1) if a not in skip), None)
            assert before == role, f"two {role} messages in a row, one added by the trim"
        else:
            assert may_meet(role, i, j), f"two {role} messages in a row that the chat did not have so"


def check_contract(
    chat: list[dict[str, Any]],
    result: TrimResult,
    counter: TokenCounter,
    model: str | None,
    pinned: Collection[int] = (),
    as_given: bool = True,
) -> None:
    """Assert every rule of DESIGN.md's contract for one trim (`pinned`: the trim's pins;
    `as_given`: `chat` is what the trim got, so a shortened copy holds only its text: not so
    for a filter's input, whose flag text the filter takes out first)."""
    sent = result.messages
    # 0. the decision the filter stores (as JSON) reads back as it was made
    if result.decision is not None:
        assert TrimDecision.from_json(result.decision.to_json()) == result.decision, "decision lost in JSON"
    conversation = ChatView(chat)
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
        assert first_in is not None and first_in.get("role") in ("assistant", "tool"), (
            "history now starts with an assistant or tool message"
        )
    # two user or two assistant messages in a row only where the input had them so.
    _check_alternation(chat, result, pinned)
    # 2. hard budget, counted with the filter's own counter.
    assert result.tokens_after == counter.count_messages(sent, model)
    if not result.over_budget:
        assert result.tokens_after <= result.budget
    # recall blocks: new user messages (not input dicts), each followed by a new assistant
    # acknowledgement right before a kept user message, together quoting each recalled (dropped)
    # message's text verbatim; the one right before the question (this turn's) ends the stable prefix.
    new = [k for k, m in enumerate(sent) if not any(m is x for x in chat)]
    blocks = [k for k in new if sent[k].get("role") == "user" and str(sent[k].get("content")).startswith(RECALL_LABEL)]
    added = set(blocks) | {k + 1 for k in blocks}
    plain = [m for k, m in enumerate(sent) if k not in added]
    if blocks:
        quoted = "".join(sent[k]["content"] for k in blocks)
        assert result.recalled and set(result.recalled) <= set(result.dropped) | set(result.excerpted)
        by_passages = dict(result.recalled_passages)
        assert set(by_passages) <= set(result.recalled)
        for i in result.recalled:  # whole, or each passage verbatim (`excerpt.split_chunks`)
            assert i in by_passages or i in result.dropped
            if i not in by_passages:
                assert message_text(chat[i]) in quoted
                continue
            chunks = split_chunks(message_text(chat[i]))
            assert all(chunks[k] in quoted for k in by_passages[i])
        for k in blocks:
            assert k + 2 < len(sent) and k + 1 in new and sent[k + 1] == SUMMARY_ACK_MESSAGE
            assert sent[k + 2].get("role") == "user" and k + 2 not in blocks
        latest = chat[conversation.question]
        before_question = [k for k in blocks if sent[k + 2] is latest]
        assert result.stable_prefix == (before_question[0] if before_question else len(sent))
    else:
        cut = min(set(result.shortened).difference(result.excerpted), default=None)  # excerpts are sent again
        assert not result.recalled
        assert result.stable_prefix == (
            len(sent) if cut is None else sum(1 for i in result.kept + result.shortened if i < cut)
        )
    # what the trim adds keeps roles alternating: with the blocks and acknowledgements, no more
    # same-role neighbours than without them. (Not none: the selection itself sends two user
    # messages in a row when it drops what stood between them, see `same_role_pairs`.)
    origin = iter(sorted(result.kept + result.shortened))
    at = [None if k in added else next(origin) for k in range(len(sent))]
    pairs = same_role_pairs(chat, sent, at)
    bare = same_role_pairs(chat, [m for k, m in enumerate(sent) if k not in added], [i for i in at if i is not None])
    assert len(pairs) <= len(bare), ("an added message repeats a role", pairs, [m.get("role") for m in sent])
    # 3. untouched means untouched: kept messages are the same dicts, in order.
    assert len(plain) == len(result.kept) + len(result.shortened)
    by_index = dict(zip(sorted(result.kept + result.shortened), plain, strict=True))
    for index in result.kept:
        assert by_index[index] is chat[index]
    assert sorted(result.kept + result.dropped + result.shortened) == list(range(len(chat)))
    # excerpts: earlier messages only (never the system prompt or the current turn). Excerpts
    # and middle-out cuts are copies with every key but the text unchanged, their text the
    # original's pieces in order: whole characters, no U+FFFD of a split one (a lone surrogate
    # in the original is encoded as U+FFFD, so such a text is left out).
    assert set(result.excerpted) <= set(result.shortened)
    assert set(result.excerpted).isdisjoint(mandatory_indices(conversation))
    # a copy cut by passages (the latest user message's) tells some of its passages sent, not all
    for index, sent_passages, total in result.shortened_passages:
        assert index == conversation.question and index in result.shortened and 0 < sent_passages < total
    for index in result.shortened:
        sent_copy, original = by_index[index], chat[index]
        assert {k: v for k, v in sent_copy.items() if k != "content"} == {
            k: v for k, v in original.items() if k != "content"
        }
        text, source = message_text(sent_copy), message_text(original)
        if not as_given and index not in result.excerpted:
            continue
        if not source.isascii() and re.search("[\ud800-\udfff]", source):
            continue
        pieces = [p for p in re.split(r"\n?\[… [0-9,]+ tokens cut by contextwarden …\]\n?", text) if p]
        at = 0
        for piece in pieces:
            found = source.find(piece, at)
            assert found >= 0, "a shortened copy holds text that is not the original's, in its order"
            at = found + len(piece)


def same_role_pairs(chat: list[dict[str, Any]], sent: list[dict[str, Any]], at: list[int | None]) -> list[tuple]:
    """Positions in `sent` (input positions `at`, None for a message the trim added) of consecutive
    non-system messages with the same role that the input did not already have side by side (its
    own repeats, say tool results, are its own): what a strict chat template would refuse, as
    far as the trim made it (a block between two user messages the input had side by side is
    the input's repeat). The selection makes some: a user message whose answer is dropped
    while the next user message is kept (an unanswered tool call, an orphan, is never sent)."""
    system = ("system", "developer")
    rest = [k for k in range(len(sent)) if sent[k].get("role") not in system]
    pairs = []
    for p, q in pairwise(rest):
        if sent[p].get("role") != sent[q].get("role"):
            continue
        i = at[p]
        j = next((x for x in at[q:] if x is not None), None)  # a block stands for the question after it
        if i is None or j is None or any(chat[x].get("role") not in system for x in range(i + 1, j)):
            pairs.append((p, q))
    return pairs


def recall_positions(messages: list[dict]) -> list[int]:
    """Where the recall blocks are in a trim's output (a test knows its chat holds no lookalike)."""
    return [i for i, m in enumerate(messages) if is_recall_message(m)]


def assert_same_trim(a: TrimResult, b: TrimResult) -> None:
    """Two trims of one chat chose alike: the same messages (each kept one the very same dict),
    counts and decision."""
    assert a.messages == b.messages
    sent = sorted(a.kept + a.shortened)
    added = set(a.added)
    plain = [
        (x, y) for k, (x, y) in enumerate(zip(a.messages, b.messages, strict=True)) if k not in added
    ]  # blocks aside
    assert all(x is y for i, (x, y) in zip(sent, plain, strict=True) if i in a.kept)
    assert (
        a.kept,
        a.dropped,
        a.shortened,
        a.tokens_before,
        a.tokens_after,
        a.reused,
        a.decision,
        a.recalled,
        a.stable_prefix,
    ) == (
        b.kept,
        b.dropped,
        b.shortened,
        b.tokens_before,
        b.tokens_after,
        b.reused,
        b.decision,
        b.recalled,
        b.stable_prefix,
    )


def frozen(chat: list[dict[str, Any]]) -> str:
    """A snapshot to prove the input was not mutated."""
    return json.dumps(copy.deepcopy(chat), sort_keys=True, default=str)
