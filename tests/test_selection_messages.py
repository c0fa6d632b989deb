"""With the embedder's scores the relevance strategy picks single messages, not whole turns
(`selection._pick_messages`): a relevant reply goes without the rest of its turn, what is sent
never opens with a reply, and the contract holds on any chat."""

from __future__ import annotations

import hashlib
import random

import pytest

from contextwarden import TrimDecision, trim_messages
from contextwarden.core.chatview import ChatView
from contextwarden.core.conversation import RECALL_LABEL
from contextwarden.core.fresh import picks_messages
from contextwarden.core.selection import choose_indices
from contextwarden.tools.explain import explain_trim

from chatgen import random_chat
from chats import check_contract, frozen
from embedders import topic_embed
from helpers import chat_of

MODEL = "gpt-4o"


def _chat(n: int) -> list[dict]:
    """n messages, user and assistant in turn, then the question."""
    chat = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(n)]
    return chat + [{"role": "user", "content": "question?"}]


def test_a_relevant_reply_goes_without_the_rest_of_its_turn():
    chat = _chat(6)  # turns (0, 1), (2, 3), latest (4, 5); the question at 6
    scores = [0.1, 6.0, 0.1, 5.0, 0.0, 0.0, 0.0]
    view, costs = ChatView(chat), [10] * 7
    # hard 10 (the question) + latest turn 20: 30 of the 60 left
    assert choose_indices(view, costs, 60, scores=scores) == {0, 1, 4, 5, 6}  # one whole turn
    # by message: reply 1, and 3 with the user message 2 between them (roles alternate); 1
    # would open what is sent, so its question 0 comes in: 2 and then 3 give way to it
    assert choose_indices(view, costs, 60, scores=scores, by_message=True) == {0, 1, 4, 5, 6}
    # with room for all four: the two replies, the question opening them, the bridge between
    assert choose_indices(view, costs, 70, scores=scores, by_message=True) == {0, 1, 2, 3, 4, 5, 6}


def test_a_reply_whose_question_does_not_fit_goes_and_its_room_is_filled_again():
    chat = _chat(6)
    scores = [0.1, 6.0, 0.1, 0.2, 0.0, 0.0, 0.0]
    costs = [50, 10, 10, 10, 10, 10, 10]  # message 0, the question of reply 1, is large
    kept = choose_indices(ChatView(chat), costs, 50, scores=scores, by_message=True)
    assert kept == {2, 3, 4, 5, 6}  # 1 went (0 did not fit); 2 took its room, 3 no longer opens


def test_the_embedder_picks_single_messages_in_a_trim():
    def embed(texts: list[str]) -> list[list[float]]:
        return [[1.0, 0.1] if "lighthouse" in t or "tower" in t else [0.1, 1.0] for t in texts]

    filler = "We talked about the garden and the weather again today. " * 3
    chat = []
    for i in range(12):
        chat.append({"role": "user", "content": f"{filler} part {i}"})
        reply = "I once visited a lighthouse." if i == 3 else f"{filler} reply {i}"
        chat.append({"role": "assistant", "content": reply})
    chat.append({"role": "user", "content": "Which coastal tower did I mention?"})
    result = trim_messages(chat, max_tokens=220, model=MODEL, low_watermark=1.0, embed=embed)
    # the reply, quoted at the start of what is sent: in its place it would open it
    assert 7 in result.recalled and chat[7]["content"] in result.messages[0]["content"]
    lexical = trim_messages(chat, max_tokens=220, model=MODEL, low_watermark=1.0)
    assert 7 not in lexical.kept  # no word of the question is in it
    reasons = explain_trim(chat, result, model=MODEL, token_counter=_counter(), low_watermark=1.0, embed=embed)
    assert reasons.messages[7].action == "recalled"
    assert "chosen by message" in " ".join(reasons.messages[7].reasons)
    assert not any("whole turn" in r for m in reasons.messages for r in m.reasons)


def _counter():
    from contextwarden.core.tokens import TokenCounter

    return TokenCounter()


def _hashed(texts: list[str]) -> list[list[float]]:
    """Any text to a fixed unit-ish vector: an embedder for arbitrary chats."""
    out = []
    for t in texts:
        digest = hashlib.sha256(t.encode()).digest()
        out.append([b / 255 + 0.01 for b in digest[:8]])
    return out


@pytest.mark.parametrize("seed", range(20))
def test_contract_and_determinism_hold_by_message(counter, seed):
    rng = random.Random(5000 + seed)
    chat = random_chat(rng, rng.choice([3, 10, 60, 250]), system_words=rng.choice([0, 20, 300]))
    before = frozen(chat)
    total = counter.count_messages(chat, MODEL)
    pins = rng.sample(range(len(chat)), k=min(2, len(chat)))
    for budget in {64, 300, 1_500, max(64, total // 3)}:
        options = {"pinned": pins, "low_watermark": rng.choice([0.8, 1.0]), "embed": _hashed}
        result = trim_messages(chat, max_tokens=budget, model=MODEL, token_counter=counter, **options)
        check_contract(chat, result, counter, MODEL, pinned=pins)
        same = trim_messages(chat, max_tokens=budget, model=MODEL, token_counter=counter, **options)
        assert same.kept == result.kept and frozen(same.messages) == frozen(result.messages)
        if result.decision is not None:  # the filter stores it as JSON: what it reads back is what was decided
            assert TrimDecision.from_json(result.decision.to_json()) == result.decision
    assert frozen(chat) == before


def _topic_embed(texts: list[str]) -> list[list[float]]:
    """Lighthouse talk on one axis, everything else on the other."""
    return [[1.0, 0.1] if "lighthouse" in t or "tower" in t else [0.1, 1.0] for t in texts]


def _lighthouse_chat() -> list[dict]:
    """Long user turns about nothing, two short lighthouse messages far apart: one a question's
    reply, one a question whose reply is filler (neither fits with its partner)."""
    filler = "We talked about the garden and the weather again today. " * 4
    chat: list[dict] = [{"role": "system", "content": "Be brief."}]
    for i in range(14):
        user = "Did you see the lighthouse?" if i == 9 else f"{filler} part {i}"
        reply = "I once climbed a lighthouse." if i == 3 else f"{filler} reply {i}"
        chat += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    return chat + [{"role": "user", "content": "Which coastal tower came up?"}]


def test_what_would_clash_in_place_is_quoted_before_the_first_user_message_and_carried(counter):
    chat = _lighthouse_chat()
    options = {"model": MODEL, "token_counter": counter, "embed": _topic_embed}
    first = trim_messages(chat, max_tokens=500, **options)
    check_contract(chat, first, counter, MODEL)
    assert {8, 19} <= set(first.recalled)  # the reply would open the history, the question meet another
    start = next(k for k, m in enumerate(first.messages) if m["role"] != "system")
    assert start in first.added and first.messages[start]["content"].startswith(RECALL_LABEL)
    assert first.stable_prefix == len(first.messages)  # the block belongs to what the next turn sends again
    assert first.decision is not None
    grown = chat + [{"role": "assistant", "content": "The lighthouse."}, {"role": "user", "content": "Thanks!"}]
    second = trim_messages(grown, max_tokens=500, previous=first.decision, **options)
    check_contract(grown, second, counter, MODEL)
    assert second.reused and second.messages[: first.stable_prefix] == first.messages[: first.stable_prefix]


def test_a_question_that_stands_alone_keeps_the_latest_reply_not_its_question(counter):
    """By message the latest exchange's reply is kept first; its question only for a follow-up.
    A question that stands on its own lets the previous question compete (here it loses: it is
    about the garden), while "say that again" keeps the exchange whole."""
    chat = _lighthouse_chat()[:-1] + [
        {"role": "user", "content": "What should we plant in the garden beds this spring, do you think?"},
        {"role": "assistant", "content": "Tulips, I would say."},
    ]
    latest_question, latest_reply = len(chat) - 2, len(chat) - 1
    options = {"max_tokens": 500, "model": MODEL, "token_counter": counter, "embed": _topic_embed}
    alone = chat + [{"role": "user", "content": "Which coastal tower did we discuss during our long chat?"}]
    result = trim_messages(alone, **options)
    check_contract(alone, result, counter, MODEL)
    assert latest_reply in result.kept and latest_question not in {*result.kept, *result.recalled}
    assert {8, 19} <= {*result.kept, *result.recalled}  # the room went to the lighthouse
    why = explain_trim(alone, result, model=MODEL, token_counter=counter, embed=_topic_embed).messages
    assert "stands alone, so it competed" in why[latest_question].reasons[0]
    assert why[latest_reply].reasons == ("the latest answer, kept whenever it fits",)
    follow_up = chat + [{"role": "user", "content": "Can you say that again?"}]
    result = trim_messages(follow_up, **options)
    check_contract(follow_up, result, counter, MODEL)
    assert {latest_question, latest_reply} <= set(result.kept)


def test_a_quoted_block_after_a_pin_is_sent_again_through_the_stored_decision(counter):
    """A pinned early question is the first user message sent, so the block the selection quotes
    goes before it and quotes later messages. The filter passes the decision on as JSON: read
    back, it must still hold that block, or the next turn sends neither the quotes nor the
    prefix the provider cached (before the fix, `Recall.from_list` dropped a block quoting
    past its anchor)."""
    chat = _lighthouse_chat()
    options = {"max_tokens": 500, "model": MODEL, "token_counter": counter, "embed": _topic_embed, "pinned": [1]}
    first = trim_messages(chat, **options)
    assert first.decision is not None
    [held] = [r for r in first.decision.recalls if r.anchor == 1]
    assert 8 in held.at and min(held.at) > held.anchor  # the climbed lighthouse, quoted past the pin
    stored = TrimDecision.from_json(first.decision.to_json())
    assert stored.recalls == first.decision.recalls
    grown = chat + [{"role": "assistant", "content": "The lighthouse."}, {"role": "user", "content": "Thanks!"}]
    second = trim_messages(grown, previous=stored, **options)
    check_contract(grown, second, counter, MODEL, pinned=[1])
    assert second.reused and second.messages[: first.stable_prefix] == first.messages[: first.stable_prefix]


def test_the_quoted_block_stays_while_the_selection_is_carried(counter):
    """Later questions' recall blocks come and go (the newest give way first); the block the
    selection quoted stays at the front, byte for byte, until the selection is made anew."""
    chat = _lighthouse_chat()
    options = {"model": MODEL, "token_counter": counter, "embed": _topic_embed}
    result = trim_messages(chat, max_tokens=500, **options)
    front = result.messages[:3]  # the system prompt, the quotes, the acknowledgement
    assert front[1]["content"].startswith(RECALL_LABEL)
    carried = 0
    for k in range(8):
        chat = chat + [{"role": "assistant", "content": f"Answer {k}."}]
        chat = chat + [{"role": "user", "content": f"What about the garden, part {k + 2}?"}]
        assert result.decision is not None
        result = trim_messages(chat, max_tokens=500, previous=result.decision, **options)
        check_contract(chat, result, counter, MODEL)
        if not result.reused:
            break
        carried += 1
        assert result.messages[:3] == front
    assert carried >= 2


@pytest.mark.parametrize("odd", [{"role": "user", "content": 5}, {}, {"role": "assistant", "tool_calls": []}])
def test_a_message_without_text_is_never_quoted(counter, odd):
    """A quote holds text: a message with none (content not text, a reply with no words) that
    would clash in place goes, rather than costing a recall line with nothing after its role."""
    chat = chat_of(8)
    chat[6:6] = [odd]  # after a user message: in place it would clash
    result = trim_messages(chat, max_tokens=600, model=MODEL, token_counter=counter, embed=topic_embed)
    check_contract(chat, result, counter, MODEL)
    assert 6 in result.dropped and 6 not in result.recalled


def _violin_chat(reply_words: int) -> list[dict]:
    """Ten turns of a short user message and a reply of `reply_words` filler words; the user
    messages of turns 2 and 6 are about the violin, which the question asks about."""
    said = {2: "I left my violin at the studio on Main Street.", 6: "The violin lesson moved to Friday."}
    chat = []
    for t in range(10):
        chat.append({"role": "user", "content": said.get(t, f"Day {t}: we cooked pasta and watched a film.")})
        chat.append({"role": "assistant", "content": " ".join(["garden"] * reply_words) + f" ({t})"})
    return chat + [{"role": "user", "content": "Where is my violin, and when is the violin lesson?"}]


def test_a_room_for_few_turns_picks_single_messages_without_the_embedder(counter):
    """Lexically, when the room holds fewer than `BY_MESSAGE_TURNS` of the chat's turns, a turn's
    long reply no longer takes the room a second match needs: both violin messages are sent
    (whole turns, the latest first, had room for one). With room for many turns they go whole."""
    chat = _violin_chat(reply_words=240)
    costs = counter.count_each(chat, MODEL)
    assert picks_messages(ChatView(chat), costs, 700)
    result = trim_messages(chat, max_tokens=700, model=MODEL, token_counter=counter, low_watermark=1.0)
    check_contract(chat, result, counter, MODEL)
    assert {4, 12} <= {*result.kept, *result.recalled}
    assert 5 not in result.kept and 13 not in result.kept  # their long replies stay out
    why = explain_trim(chat, result, model=MODEL, token_counter=counter, low_watermark=1.0).messages
    assert "chosen by message" in " ".join(why[4].reasons)
    assert not any("whole turn" in r for m in why for r in m.reasons)
    short = _violin_chat(reply_words=8)
    assert not picks_messages(ChatView(short), counter.count_each(short, MODEL), 700)
    result = trim_messages(short, max_tokens=700, model=MODEL, token_counter=counter, low_watermark=1.0)
    assert {4, 5, 12, 13} <= set(result.kept)  # each match with its reply: whole turns
