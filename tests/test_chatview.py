"""`ChatView`: one read of a chat, the same as reading the raw list, and lazy."""

from __future__ import annotations

import random

from contextwarden.core.chatview import ChatView
from contextwarden.core.conversation import message_text, read_conversation, system_positions
from contextwarden.core.decision import message_fingerprint
from contextwarden.core.relevance import score_messages
from contextwarden.core.semantic import VectorCache, similarities

from chatgen import random_chat

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "a", "content": "42"},
    {"role": "developer", "content": "More rules."},
    {"content": "no role"},
    {"role": "user", "content": "and now?"},
]


def test_view_reads_what_the_raw_list_holds():
    for messages in [CHAT, *(random_chat(random.Random(seed), 30) for seed in range(20))]:
        view = ChatView(messages)
        assert view.texts == [message_text(m) for m in messages]
        assert [view.text(i) for i in range(len(messages))] == view.texts
        assert view.roles == [m.get("role") for m in messages]
        assert list(view.system_positions) == system_positions(messages)
        conversation = read_conversation(messages)
        assert (view.turns, view.current, view.orphans, view.system) == (
            conversation.turns,
            conversation.current,
            conversation.orphans,
            conversation.system,
        )
        assert view.question == conversation.question
        assert list(view.fingerprints) == [message_fingerprint(m) for m in messages]


def test_view_reads_only_what_is_asked_and_once():
    view = ChatView(CHAT)
    assert view.text(6) == "and now?"
    assert view._texts is None and view._conversation is None and view._roles is None
    assert view.text(6) is view.text(6)
    assert view.texts[6] is view.text(6)  # the text read first is the one kept
    indices = view.system_indices
    indices.append(99)  # callers extend it: a new list each time
    assert view.system_indices == [0, 4]


def test_window_is_the_view_of_the_tail():
    view = ChatView(CHAT)
    view.text(6)
    window = view.window(4)
    assert window.messages == CHAT[4:]
    assert window.texts == [message_text(m) for m in CHAT[4:]]
    assert window.question == read_conversation(CHAT[4:]).question == 2


def _fake_embed(texts):
    return [[len(t) % 7 + 1.0, sum(map(ord, t[:40])) % 11 + 1.0, t.count("e") + 1.0] for t in texts]


def test_scorers_given_the_views_texts_and_roles_score_alike():
    for seed in range(25):
        chat = random_chat(random.Random(seed), 40)
        view = ChatView(chat)
        question = view.question
        if question is None:
            continue
        skip = view.system_indices + view.orphan_indices
        read = similarities(chat, question, VectorCache(), _fake_embed, skip=skip)
        given = similarities(chat, question, VectorCache(), _fake_embed, skip=skip, texts=view.texts, roles=view.roles)
        assert given == read, seed
        assert score_messages(chat, question=question, exclude=skip, texts=view.texts, roles=view.roles) == (
            score_messages(chat, question=question, exclude=skip)
        )


def test_relevance_is_score_messages_once_a_view_and_weights():
    from dataclasses import replace

    from contextwarden.core.relevance import DEFAULT_RELEVANCE_WEIGHTS

    other = replace(DEFAULT_RELEVANCE_WEIGHTS, recency=0.0)
    for seed in range(20):
        messages = random_chat(random.Random(seed), 30)
        view = ChatView(messages)
        if view.question is None:
            continue
        excluded = view.system_indices + view.orphan_indices
        for weights in (DEFAULT_RELEVANCE_WEIGHTS, other):
            fresh = score_messages(messages, question=view.question, exclude=excluded, weights=weights)
            first = view.relevance(weights)
            assert first == fresh
            first[0] = -1.0  # a caller's list is its own: the view keeps what it scored
            assert view.relevance(weights) == fresh
        # The same list edited in place is another chat: a new view scores it anew.
        edited = [dict(m) for m in messages]
        edited[0]["content"] = "something else entirely about cats"
        again = ChatView(edited)
        assert again.relevance() == score_messages(
            edited, question=again.question, exclude=again.system_indices + again.orphan_indices
        )
