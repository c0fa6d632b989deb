"""Roles that alternate in the chat alternate in what is sent (`core/alternation.py`): strict chat
templates (Mistral's, Gemma's in vLLM or llama.cpp) reject two user or two assistant messages in a
row, and single messages picked by relevance would put them together."""

from __future__ import annotations

import hashlib
import random

import pytest

from contextwarden import TrimDecision, trim_messages
from contextwarden.core.alternation import MAX_BRIDGE_SCAN, alternate, clash, fill_alternating, fits_between
from contextwarden.core.chatview import ChatView
from contextwarden.core.decision import message_fingerprint
from contextwarden.core.selection import choose_indices

from chats import check_contract

MODEL = "gpt-4o"
WORDS = "garden weather lighthouse tower river train museum recipe guitar marathon winter island".split()


def _dialogue(n: int) -> list[dict]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(n)]


def _hashed(texts: list[str]) -> list[list[float]]:
    """Any text to a fixed vector: an embedder for arbitrary chats."""
    return [[b / 255 + 0.01 for b in hashlib.sha256(t.encode()).digest()[:8]] for t in texts]


def _clashes(messages: list[dict]) -> list[int]:
    """Positions where a user or assistant message follows one of the same role."""
    roles = [m["role"] for m in messages if m["role"] not in ("system", "developer")]
    return [k for k in range(1, len(roles)) if roles[k] == roles[k - 1] and roles[k] in ("user", "assistant")]


def test_clash_is_two_alike_that_the_chat_had_apart():
    view = ChatView(
        [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "a"},
            {"role": "user", "content": "b"},  # the chat's own: two user messages in a row
            {"role": "assistant", "content": "c"},
            {"role": "tool", "content": "t", "tool_call_id": "x"},
            {"role": "assistant", "content": "d"},
            {"role": "user", "content": "e"},
        ]
    )
    assert not clash(view, 1, 2)  # next to each other in the chat: left as they are
    assert clash(view, 2, 6)  # the assistant messages after 2 and before 6 were let go
    assert not clash(view, 1, 6)  # 1 had no reply in the chat: the chat put two user messages together
    assert not clash(view, 3, 5)  # between them only a result without its call (never sent): the chat's own
    assert not clash(view, 0, 1) and not clash(view, 2, 3)


def test_fits_between_looks_at_both_neighbours():
    view = ChatView(_dialogue(8))
    assert fits_between(view, [0, 1, 6, 7], 2, 3)  # user 2, assistant 3 between assistant 1 and user 6
    assert not fits_between(view, [0, 7], 2, 3)  # user 2 after user 0
    assert not fits_between(view, [1, 5], 2, 3)  # assistant 3 before assistant 5
    assert fits_between(view, [], 2, 3)


def test_a_tool_call_never_answered_is_no_neighbour():
    """An assistant message whose tool call was never answered is never sent: the reply after it
    followed a question as far as what is sent goes, and two replies sent together clash (a
    review's random chats sent 48 and 51, the orphan call 50 between them in the chat)."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    chat = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "assistant", "content": "a2"},
        {"role": "user", "content": "q3"},
    ]
    view = ChatView(chat)
    assert view.orphan_set == {3} and clash(view, 1, 4)


def test_fits_between_looks_past_a_system_message_sent():
    """A system message in the chat's middle sent right before the turn hides nothing: user 0
    and user 3 would still meet (a review's random chats sent user, system, user so)."""
    roles = ("user", "system", "assistant", "user", "assistant")
    view = ChatView([{"role": role, "content": f"m{k}"} for k, role in enumerate(roles)])
    assert not fits_between(view, [0, 1], 3, 4)
    assert fits_between(view, [0, 1, 2], 3, 4)
    assert fits_between(view, [1, 2], 3, 4)  # assistant 2 before user 3, the system message aside


def test_an_unpinned_message_no_longer_goes_alone_in_a_carried_selection(counter):
    """Pinned, a question may go without its reply next to another question; once unpinned, the
    selection that kept it so is made anew (it was carried, user beside user)."""
    long = " ".join(["filler"] * 400)
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "u1 " + " ".join(["alpha"] * 30)},
        {"role": "assistant", "content": long},
        {"role": "user", "content": "u2 " + " ".join(["beta"] * 30)},
        {"role": "assistant", "content": long},
        {"role": "user", "content": "u3 " + " ".join(["gamma"] * 30)},
        {"role": "assistant", "content": "a3 " + " ".join(["delta"] * 30)},
    ]
    for k in range(6):
        chat += [
            {"role": "user", "content": f"q{k} " + " ".join(["filler"] * 150)},
            {"role": "assistant", "content": "ok " * 150},
        ]
    chat.append({"role": "user", "content": "What now?"})
    options = {"max_tokens": 1_000, "model": MODEL, "token_counter": counter}
    first = trim_messages(chat, pinned=[1, 3, 6], **options)
    assert {3, 5} <= set(first.kept) and 4 not in first.kept  # pinned 3 goes alone before 5
    chat += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "And then?"}]
    previous = TrimDecision.from_json(first.decision.to_json())
    result = trim_messages(chat, pinned=[1, 6], previous=previous, **options)
    assert not result.reused and 3 not in result.kept
    check_contract(chat, result, counter, MODEL, pinned=[1, 6])


def test_a_pick_brings_the_cheapest_reply_between_it_and_the_next_question():
    view = ChatView(_dialogue(9))  # the question at 8
    units = [range(i, i + 1) for i in range(8)]
    costs = [10, 40, 10, 5, 10, 30, 10, 20]
    value = dict.fromkeys(range(8), 1.0)
    # user 2 alone before the user message 6 needs an assistant message between: 3, the cheapest
    # of those worth alike
    assert fill_alternating(view, units, {6, 7, 8}, [2], value, costs, 100) == {2, 3}
    value[5] = 4.0  # 5 is worth more than its cost: 5 ** 0.5 * 4 > 30 ** 0.5
    assert fill_alternating(view, units, {6, 7, 8}, [2], value, costs, 100) == {2, 5}
    # without room for one it is passed over
    assert fill_alternating(view, units, {6, 7, 8}, [2], value, costs, 14) == set()


def test_the_repair_bridges_or_lets_the_less_relevant_go():
    view = ChatView(_dialogue(7))  # the question at 6
    units = [range(i, i + 1) for i in range(6)]
    value = {0: 3.0, 1: 0.1, 2: 1.0, 3: 0.1, 4: 0.2}  # the open units (5 is fixed)
    costs = [10] * 6
    order = sorted(value, key=lambda u: (-value[u], -u))
    assert alternate(view, units, {5, 6}, {0, 2}, value, costs, 10, order) == {0, 1, 2}  # 1 bridges 0 and 2
    assert alternate(view, units, {5, 6}, {0, 2}, value, costs, 0, order) == {0}  # no room: 2 (worth less) goes


def test_a_bridge_is_looked_for_near_both_ends_of_a_long_gap():
    n = 4 * MAX_BRIDGE_SCAN + 3
    view = ChatView(_dialogue(n))
    units = [range(i, i + 1) for i in range(n)]
    costs = [10] * n
    far = n - 1 if (n - 1) % 2 == 0 else n - 2  # a user message at the end
    kept = fill_alternating(view, units, {far}, [0], dict.fromkeys(range(n), 1.0), costs, 20)
    assert kept == {0, 1}  # the reply right after it, found among the nearest (ties: the earlier)


@pytest.mark.parametrize("seed", range(12))
def test_what_is_sent_alternates_where_the_chat_does(counter, seed):
    """Dialogues of short and long messages (some long enough to be excerpted), with and without
    an embedder, fresh and carried over turns that go on: never two alike in a row."""
    rng = random.Random(9000 + seed)
    chat: list[dict] = [{"role": "system", "content": "Be brief."}]
    for i in range(rng.choice([20, 60, 140])):
        size = rng.choice([3, 8, 20, 60]) if rng.random() > 0.05 else 900
        words = " ".join(rng.choice(WORDS) for _ in range(size))
        chat.append({"role": "user" if i % 2 == 0 else "assistant", "content": f"{i}: {words}"})
    if chat[-1]["role"] == "user":
        chat.pop()
    for embed in (None, _hashed):
        stored: str | None = None
        turn = list(chat)
        for step in range(4):
            turn.append({"role": "user", "content": f"What about the {rng.choice(WORDS)} and the {rng.choice(WORDS)}?"})
            previous = TrimDecision.from_json(stored) if stored else None
            budget = rng.choice([300, 800, 2_000, 5_000])
            result = trim_messages(
                turn, max_tokens=budget, model=MODEL, token_counter=counter, previous=previous, embed=embed
            )
            assert _clashes(result.messages) == [], (seed, embed is not None, step, budget)
            check_contract(turn, result, counter, MODEL)
            if result.decision is not None:
                stored = result.decision.to_json()
            turn.append({"role": "assistant", "content": f"answer {step}"})


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def _pictured(message: dict) -> bool:
    return isinstance(message.get("content"), list) and IMAGE in message["content"]


@pytest.mark.parametrize("seed", range(8))
def test_by_message_images_go_in_place_or_not_at_all(counter, seed):
    """Dialogues with images here and there, with the embedder (a selection by message that
    quotes what would clash), fresh and carried: roles alternate, a message with images is
    never quoted, and one that is kept is sent with its images (`alternation.fill_quoting`
    places one that would clash with its bridge)."""
    rng = random.Random(7000 + seed)
    chat: list[dict] = [{"role": "system", "content": "Be brief."}]
    for i in range(rng.choice([12, 30, 80])):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.choice([3, 20, 60])))
        text = f"{i}: {words}"
        content = [{"type": "text", "text": text}, IMAGE] if rng.random() < 0.2 else text
        chat.append({"role": "user" if i % 2 == 0 else "assistant", "content": content})
    if chat[-1]["role"] == "user":
        chat.pop()
    stored: str | None = None
    for step in range(3):
        chat.append({"role": "user", "content": f"The {rng.choice(WORDS)} picture, and the {rng.choice(WORDS)}?"})
        previous = TrimDecision.from_json(stored) if stored else None
        budget = rng.choice([400, 1_000, 2_500])
        result = trim_messages(
            chat, max_tokens=budget, model=MODEL, token_counter=counter, previous=previous, embed=_hashed
        )
        assert _clashes(result.messages) == [], (seed, step, budget)
        check_contract(chat, result, counter, MODEL)
        assert not any(_pictured(chat[i]) for i in result.recalled)
        sent = sum(1 for m in result.messages if _pictured(m))
        assert sent == sum(1 for i in result.kept if _pictured(chat[i]))
        if result.decision is not None:
            stored = result.decision.to_json()
        chat.append({"role": "assistant", "content": f"answer {step}"})


@pytest.mark.parametrize("fast", [True, False])
def test_a_carried_selection_is_made_anew_when_an_edit_puts_two_alike_together(counter, fast):
    """The previous turn kept two questions the chat had side by side; a reply since inserted
    between them would leave them clashing if carried: the trim selects anew (found by the
    property suite). `fast`: the decision knows where its messages were (`extend_previous`)."""
    before = [{"role": "user", "content": "tea"}, {"role": "user", "content": "coffee"}]
    kept = tuple(message_fingerprint(m) for m in before)
    previous = TrimDecision(100, 30, "relevance", kept, at=(0, 1) if fast else ())
    reply = {"role": "assistant", "content": " ".join(WORDS * 30)}  # too long for the budget
    edited = [before[0], reply, before[1], {"role": "user", "content": "and?"}]
    result = trim_messages(edited, max_tokens=100, model=MODEL, token_counter=counter, previous=previous)
    assert not result.reused and result.kept == (2, 3)  # the chat's own pair: "coffee", "and?"
    check_contract(edited, result, counter, MODEL)


def test_by_message_picks_alternate_on_a_long_chat_within_bounded_work():
    """Relevant short replies to long questions: each reply after the first needs a question
    between it and the next (roles alternate), so few go; the bridge search stays bounded."""
    n = 2_000
    chat = _dialogue(n) + [{"role": "user", "content": "q"}]
    rng = random.Random(1)
    costs = [1_000 if i % 2 == 0 else 10 for i in range(n)] + [10]
    scores = [0.0 if i % 2 == 0 else rng.random() + 0.01 for i in range(n)] + [0.0]
    kept = sorted(choose_indices(ChatView(chat), costs, 8_000, scores=scores, by_message=True))
    assert chat[kept[0]]["role"] == "user"
    assert _clashes([chat[i] for i in kept]) == []
    assert sum(costs[i] for i in kept) <= 8_000
