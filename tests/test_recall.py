"""The per-turn recall block of a chat that goes on (issue 14): the dropped messages the new
question needs are quoted right before it, while the prompt before them stays the previous
turn's, and earlier turns' blocks are sent again unchanged (the prompt grows append-only)."""

from __future__ import annotations

import asyncio
import copy
import json
from dataclasses import replace
from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contextwarden import Filter, TrimDecision, trim_messages
from contextwarden.core.chatview import ChatView
from contextwarden.core.conversation import RECALL_LABEL, is_recall_message, recall_message
from contextwarden.core.decision import Recall
from contextwarden.core.recall import _Pools, choose_recall, recall_candidates
from contextwarden.core.recall_index import RECALL_CONTEXT_TERMS, recall_scores
from contextwarden.core.relevance import DEFAULT_RELEVANCE_WEIGHTS, relevance_terms, score_messages

from chats import check_contract, recall_positions

MODEL = "gpt-4o"
BUDGET = 600
# A budget whose room holds 8 of river_chat(20)'s turns: whole turns, so that a chat's first trim
# quotes nothing (a room for fewer picks single messages and may quote some of its own picks:
# `fresh.picks_messages`, tests/test_selection_messages.py).
ROOMY = 1_300


def river_chat(turns: int = 8) -> list[dict]:
    """An early fact (a locker code), then turns of filler about rivers, then a question."""
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "My locker code is 4417 and my bike is a green Batavus."},
        {"role": "assistant", "content": "Noted: locker 4417, green Batavus bike."},
    ]
    for n in range(turns):
        chat += [
            {"role": "user", "content": f"Tell me fact {n} about rivers and deltas. " * 3},
            {"role": "assistant", "content": f"Fact {n}: rivers carry silt to their deltas, slowly. " * 6},
        ]
    chat.append({"role": "user", "content": "More about deltas?"})
    return chat


def next_turn(chat: list[dict], question: str, reply: str = "Sure.") -> list[dict]:
    return chat + [{"role": "assistant", "content": reply}, {"role": "user", "content": question}]


def trim(chat, previous=None, **options):
    """A trim at BUDGET; a chat's first trim (no `previous`) fills half of it, so that the next
    turn has room for a recall block (a first trim at the default watermark leaves none, and
    the next turn selects anew: see test_a_selection_without_room_for_the_recall_is_redone)."""
    options = {"max_tokens": BUDGET, "model": MODEL, **({"low_watermark": 0.5} if previous is None else {}), **options}
    return trim_messages(chat, previous=previous, **options)


def test_a_dropped_fact_is_recalled_and_the_prefix_is_kept(counter):
    chat = river_chat()
    first = trim(chat, token_counter=counter)
    assert 1 in first.dropped and 1 not in first.recalled  # the locker fact is not sent
    later_chat = next_turn(chat, "Which locker code did I ask you to remember at the start?")
    later = trim(later_chat, TrimDecision.from_json(first.decision.to_json()), token_counter=counter)
    check_contract(later_chat, later, counter, MODEL)
    assert later.reused and {1, 2} <= set(later.recalled)
    assert later.messages[: len(first.messages)] == first.messages
    block = later.messages[later.stable_prefix]
    assert block["role"] == "user" and block["content"].startswith(RECALL_LABEL)
    assert "user: My locker code is 4417 and my bike is a green Batavus." in block["content"]
    assert later.messages[later.stable_prefix + 2] is later_chat[-1]
    assert later.stable_prefix == len(later.messages) - 3
    assert later.tokens_after == counter.count_messages(later.messages, MODEL) <= BUDGET


def test_earlier_blocks_are_sent_again_unchanged(counter):
    chat = river_chat()
    first = trim(chat, token_counter=counter)
    second_chat = next_turn(chat, "What is my locker code?")
    # blocks of at most a fifth of the budget: the second turn's and the third's fit side by side
    second = trim(second_chat, first.decision, token_counter=counter, recall_share=0.2)
    third_chat = next_turn(second_chat, "And which bike did I say I ride, Batavus?")
    third = trim(third_chat, TrimDecision.from_json(second.decision.to_json()), token_counter=counter, recall_share=0.2)
    check_contract(third_chat, third, counter, MODEL)
    assert third.reused and alternates(third.messages)
    # Everything the second turn sent, its block included, is the third turn's prefix.
    assert third.messages[: len(second.messages)] == second.messages
    assert set(second.recalled) <= set(third.recalled)
    new_block = is_recall_message(third.messages[-3])
    assert third.stable_prefix == len(third.messages) - (3 if new_block else 0)
    # The bike message is quoted already: it is not quoted a second time.
    assert sum(m["content"].count("green Batavus bike") for m in third.messages if is_recall_message(m)) == 1


def test_a_follow_up_keeps_the_block_that_holds_what_it_needs(counter):
    """The earlier block holds what a follow-up needs: it stays (and the cache with it) rather
    than give way to a new block quoting the same messages again."""
    chat = river_chat()
    first = trim(chat, token_counter=counter)
    second_chat = next_turn(chat, "Which locker code did I ask you to remember at the start?")
    second = trim(second_chat, first.decision, token_counter=counter)
    assert second.reused and {1, 2} <= set(second.recalled)
    # It needs the locker messages again, and a little of the filler: old code let the block go
    # for a new one quoting the same messages, and the cache missed from there on.
    third_chat = next_turn(second_chat, "Was locker code 4417 near the rivers and deltas?", reply="It is 4417.")
    third = trim(third_chat, TrimDecision.from_json(second.decision.to_json()), token_counter=counter)
    check_contract(third_chat, third, counter, MODEL)
    assert third.reused
    assert third.messages[: len(second.messages)] == second.messages  # the block stayed: all of it is cached
    assert set(second.recalled) < set(third.recalled)  # and a new block with what it adds
    assert sum(m["content"].count("locker code is 4417") for m in third.messages if is_recall_message(m)) == 1


def test_a_question_that_stands_alone_is_selected_for_sooner_than_a_follow_up(counter):
    """A carried turn keeps the selection while the block beside it holds RECALL_KEEP_SHARE (0.8)
    of what the question wants recalled; a follow-up leans on the exchange the prompt holds in
    place, and keeps it while the block holds FOLLOW_UP_KEEP_SHARE (0.5)."""
    chat = river_chat(12)
    first = trim_messages(chat, max_tokens=BUDGET, model=MODEL, token_counter=counter)  # fills 80%
    alone = next_turn(chat, "Which facts about rivers carrying silt to deltas did you tell me?")
    thanks = next_turn(chat, "Thanks!")
    options = {"max_tokens": BUDGET, "model": MODEL, "token_counter": counter, "previous": first.decision}
    assert not trim_messages(alone, **options).reused  # the room left holds too little of it
    assert trim_messages(thanks, **options).reused
    assert trim_messages(next_turn(chat, "Thanks, please go on."), **options).reused


def test_nothing_relevant_means_no_block(counter):
    chat = river_chat(20)
    first = trim(chat, token_counter=counter, max_tokens=ROOMY)
    later_chat = next_turn(chat, "Could you summarise everything politely in German please?")
    later = trim(later_chat, first.decision, token_counter=counter, max_tokens=ROOMY)
    assert later.reused and not later.recalled
    assert later.stable_prefix == len(later.messages)
    assert not later.added and not any(map(is_recall_message, later.messages))


@pytest.mark.parametrize("options", [{"recall_share": 0}, {"strategy": "recent"}])
def test_no_recall_when_switched_off_or_not_scoring(counter, options):
    chat = river_chat(20)
    first = trim(chat, token_counter=counter, max_tokens=ROOMY, **options)
    later_chat = next_turn(chat, "What is my locker code?")
    later = trim(later_chat, first.decision, token_counter=counter, max_tokens=ROOMY, **options)
    assert not later.recalled and not recall_positions(later.messages)


def test_trimming_the_result_again_adds_no_second_block(counter):
    chat = river_chat()
    first = trim(chat, token_counter=counter)
    later_chat = next_turn(chat, "What is my locker code?")
    later = trim(later_chat, first.decision, token_counter=counter)
    assert later.recalled
    again = trim(copy.deepcopy(later.messages), first.decision, token_counter=counter, added=later.added)
    assert again.messages == later.messages and not again.changed and again.added == later.added
    # Grown past the budget on a second pass (say RAG text added), the old block is replaced, not doubled.
    grown = copy.deepcopy(later.messages)
    grown[-1]["content"] += " Context: " + "deltas form where rivers meet the sea. " * 25
    redone = trim(grown, first.decision, token_counter=counter, added=later.added)
    check_contract(grown, redone, counter, MODEL)
    assert len(recall_positions(redone.messages)) <= 1
    assert recall_positions(grown)[0] in redone.dropped


def test_a_question_that_reads_like_a_recall_block_is_the_users(counter):
    """Only what the earlier pass recorded (`added`) is taken for its block: a user's latest
    question that starts with the label is kept, last, as the question."""
    chat = river_chat()
    first = trim(chat, token_counter=counter)
    lookalike = {"role": "user", "content": f"{RECALL_LABEL}\n\nWhat is my locker code?"}
    later_chat = [*chat, {"role": "assistant", "content": "Rivers flow."}, lookalike]
    later = trim(later_chat, first.decision, token_counter=counter)
    check_contract(later_chat, later, counter, MODEL)
    assert later.messages[-1] is lookalike and len(later_chat) - 1 in later.kept


def test_a_selection_without_room_for_the_recall_is_redone(counter):
    chat = river_chat()
    first = trim(chat, token_counter=counter)
    question = "Which locker code did I ask you to remember at the start?"
    # A reply long enough that the previous selection plus this turn leaves under 20 tokens free.
    for words in range(400, 0, -1):
        later_chat = next_turn(chat, question, reply="Sure. " * words)
        plain = trim(later_chat, first.decision, token_counter=counter, recall_share=0)
        if plain.reused and plain.tokens_after >= BUDGET - 20:
            break
    else:
        pytest.fail("no reply length leaves the selection just fitting")
    later = trim(later_chat, first.decision, token_counter=counter)
    check_contract(later_chat, later, counter, MODEL)
    assert not later.reused  # no room for what the question needs: a new selection, with room for it
    assert {1, 2} <= set(later.recalled) | set(later.kept)


def test_fast_and_full_path_agree_with_blocks(counter):
    chat = river_chat()
    first = trim(chat, token_counter=counter)
    second_chat = next_turn(chat, "What is my locker code?")
    second = trim(second_chat, first.decision, token_counter=counter)
    third_chat = json.loads(json.dumps(next_turn(second_chat, "Which bike, the Batavus?")))
    previous = TrimDecision.from_json(second.decision.to_json())
    fast = trim(third_chat, previous, token_counter=counter)
    full = trim(third_chat, replace(previous, seen=0), token_counter=counter)
    assert fast.messages == full.messages and fast.decision == full.decision
    assert (fast.recalled, fast.stable_prefix, fast.tokens_after) == (
        full.recalled,
        full.stable_prefix,
        full.tokens_after,
    )


def test_an_edited_recalled_message_ends_the_selection(counter):
    chat = river_chat()
    first = trim(chat, token_counter=counter)
    second_chat = next_turn(chat, "What is my locker code?")
    second = trim(second_chat, first.decision, token_counter=counter)
    assert second.recalled
    edited = copy.deepcopy(next_turn(second_chat, "Anything else about deltas?"))
    edited[1]["content"] = "My locker code is 9999."
    third = trim(edited, second.decision, token_counter=counter)
    check_contract(edited, third, counter, MODEL)
    assert not third.reused  # the block could not be sent again as it was: a new selection


def test_a_message_inserted_before_a_blocks_question_ends_the_selection(counter):
    """A block is anchored at the question it was made for: when a message inserted earlier in
    the chat moves that question, the block is not sent before whatever now sits there (an
    assistant reply: two assistant messages in a row)."""
    chat = river_chat()
    first = trim(chat, token_counter=counter)
    second_chat = next_turn(chat, "What is my locker code?")
    second = trim(second_chat, first.decision, token_counter=counter, recall_share=0.2)
    assert second.recalled and second.reused
    third_chat = copy.deepcopy(next_turn(second_chat, "And which bike do I ride?"))
    third_chat.insert(5, {"role": "user", "content": "An aside about lakes."})
    third = trim(third_chat, TrimDecision.from_json(second.decision.to_json()), token_counter=counter)
    check_contract(third_chat, third, counter, MODEL)


def test_a_recalled_message_pinned_later_is_not_quoted_again(counter):
    """A message an earlier block quoted that this turn sends in place (the user pinned it) is
    not quoted as well: that block cannot be sent again as it was, so the selection is made anew."""
    chat = river_chat()
    first = trim(chat, token_counter=counter)
    second_chat = next_turn(chat, "What is my locker code?")
    second = trim(second_chat, first.decision, token_counter=counter, recall_share=0.2)
    assert 1 in second.recalled and second.reused
    third_chat = next_turn(second_chat, "Thanks.")
    third = trim(third_chat, TrimDecision.from_json(second.decision.to_json()), token_counter=counter, pinned=[1])
    check_contract(third_chat, third, counter, MODEL)
    assert 1 in third.kept and 1 not in third.recalled and not third.reused


def test_recall_share_is_checked():
    with pytest.raises(ValueError, match="recall_share"):
        trim_messages([{"role": "user", "content": "x"}], max_tokens=100, recall_share=0.9)


def test_decision_keeps_its_recalls_through_json():
    decision = TrimDecision(
        1000,
        500,
        "relevance",
        ("a" * 16, "b" * 16),
        at=(3, 9),
        seen=10,
        recalls=(Recall(9, (1, 2), ("c" * 16, "d" * 16)),),
    )
    assert TrimDecision.from_json(decision.to_json()) == decision
    data = json.loads(decision.to_json())
    assert TrimDecision.from_json(json.dumps({**data, "recalls": [[3, [5], ["e" * 16]]]})).recalls == (
        Recall(3, (5,), ("e" * 16,), acked=False),  # a selection's quotes: past its anchor, within what was seen
    )
    bad_ones = ([[9, [2, 1], ["x", "y"]]], [[9, [1], []]], [[9, [12], ["x"]]], [[9, [9], ["x"]]], [["9", [1], ["x"]]])
    for bad in (*bad_ones, "nope"):  # (12: past the 10 messages the decision saw; 9: the anchor itself)
        data["recalls"] = bad
        assert TrimDecision.from_json(json.dumps(data)).recalls == ()
    assert replace(decision, at=(3, 8), kept=decision.kept).recalls == ()  # anchor not kept: dropped
    del data["recalls"]  # decisions written before recall still read
    assert TrimDecision.from_json(json.dumps(data)).recalls == ()


def test_a_recall_of_passages_goes_through_json_and_format_1_still_reads():
    recall = Recall(9, (1, 2), ("c" * 16, "d" * 16), parts=((), (4, 7)))
    decision = TrimDecision(1000, 500, "relevance", ("a" * 16, "b" * 16), at=(3, 9), seen=10, recalls=(recall,))
    data = json.loads(decision.to_json())
    assert data["v"] == 3 and data["recalls"] == [[9, [1, 2], "c" * 16 + "d" * 16, 1, [[], [4, 7]]]]
    assert TrimDecision.from_json(decision.to_json()) == decision
    data.update(v=2, kept=["a" * 16, "b" * 16])  # format 2: fingerprints as lists of texts
    for bad in ([[1]], [[], [7, 4]], [[], [-1]], [[], ["4"]], [[]], "x"):  # one list a message, ascending ints
        data["recalls"] = [[9, [1, 2], ["c" * 16, "d" * 16], 1, bad]]
        assert TrimDecision.from_json(json.dumps(data)).recalls == ()
    data["recalls"] = [[9, [1, 2], ["c" * 16, "d" * 16], 1]]
    data["v"] = 1  # written before passages: every message quoted whole
    assert TrimDecision.from_json(json.dumps(data)).recalls == (replace(recall, parts=()),)
    for v in (4, True, "2", None):
        data["v"] = v
        with pytest.raises(ValueError, match="unknown decision format"):
            TrimDecision.from_json(json.dumps(data))


def test_choose_recall_takes_the_most_relevant_per_token_that_fit():
    chat = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b " * 50},
        {"role": "user", "content": "c"},
        {"role": "tool", "content": ""},
        {"role": "system", "content": "s"},
        recall_message([{"role": "user", "content": "z"}], [0]),
        {"role": "user", "content": "q"},
    ]
    scores = [1.0, 9.0, 0.0, 5.0, 5.0, 5.0, 0.0]
    # the tool message has no text, the system one is not recallable; a message that reads like
    # a recall block is a user's (an earlier pass's own block is taken out before: `added`)
    candidates = recall_candidates(ChatView(chat), scores)
    assert candidates == [0, 1, 5]
    candidates = candidates[:2]
    costs = {0: 5, 1: 60}
    # message 1 is worth most per square-root token (9 / 60 ** 0.5 > 1 / 5 ** 0.5)
    assert choose_recall(candidates, {6}, scores, costs, room=64) == [1]
    assert choose_recall(candidates, {6}, scores, costs, room=65) == [0, 1]
    assert choose_recall(candidates, {6}, scores, costs, room=59) == [0]
    assert choose_recall(candidates, {6, 0}, scores, costs, room=4) == []


def test_choose_recall_takes_the_most_relevant_first_whatever_its_length():
    """A recall block has little room and a question needs a few messages: the most relevant
    goes first even when a shorter, less relevant one is worth more per token."""
    scores = [4.0, 5.0, 0.0]
    costs = {0: 5, 1: 60}
    assert choose_recall([0, 1], {2}, scores, costs, room=60) == [1]
    assert choose_recall([0, 1], {2}, scores, costs, room=65) == [0, 1]
    assert choose_recall([0, 1], {2}, scores, costs, room=59) == [0]


@pytest.mark.parametrize(
    "question", ["More about deltas?", "Which green bike brand and locker code did I mention?", "Thanks!"]
)
def test_recall_scores_are_score_messages_on_the_questions_own_terms(question):
    chat = river_chat()
    chat[-1] = {"role": "user", "content": question}
    q = len(chat) - 1
    short = len(set(relevance_terms(question))) <= RECALL_CONTEXT_TERMS  # a follow-up: the turns before it count
    weights = DEFAULT_RELEVANCE_WEIGHTS if short else replace(DEFAULT_RELEVANCE_WEIGHTS, context_weight=0.0)
    assert recall_scores(chat, question=q, exclude=[0]) == pytest.approx(
        score_messages(chat, question=q, exclude=[0], weights=weights), rel=1e-12, abs=1e-15
    )


def test_filter_request_pass_keeps_the_one_block():
    """inlet then request (Open WebUI runs both) with the chat's stored decision: one block."""
    f = Filter()
    f.valves.max_context_tokens = ROOMY + 1024
    f.valves.openrouter_pricing = False
    chat = river_chat(20)
    # long enough that whole-turn packing lets the locker turn go on the first trim
    chat[1] = {**chat[1], "content": chat[1]["content"] + " I keep my swim kit there." * 20}
    meta = {"chat_id": "c1", "user_id": "u1"}
    user = {"id": "u1"}

    async def turn(messages):
        body = {"model": MODEL, "messages": messages, "metadata": dict(meta)}
        out = await f.inlet(body, __user__=user, __metadata__=body["metadata"])
        again = await f.request(copy.deepcopy(out), __user__=user, __metadata__=body["metadata"])
        return out["messages"], again["messages"]

    first, _ = asyncio.run(turn(chat))
    assert not any("4417" in str(m["content"]) for m in first)
    sent, resent = asyncio.run(turn(next_turn(chat, "What is my locker code?")))
    assert resent == sent
    assert len(recall_positions(sent)) == 1 and "4417" in sent[recall_positions(sent)[0]]["content"]


def test_with_an_embedder_the_recall_weighs_meaning_too(counter):
    """`embed` given: the recall fuses the cosine into its scores as a new selection does, so a
    dropped message that shares no word with the question but its meaning is recalled."""
    chat = river_chat()
    first = trim(chat, token_counter=counter)
    assert 1 in first.dropped
    later_chat = next_turn(chat, "Where do I store my swimming things?")

    def embed(texts):
        return [[1.0, 0.0] if ("4417" in t or "swimming" in t) else [0.0, 1.0] for t in texts]

    lexical = trim(later_chat, first.decision, token_counter=counter)
    assert 1 not in lexical.recalled
    semantic = trim(later_chat, first.decision, token_counter=counter, embed=embed)
    check_contract(later_chat, semantic, counter, MODEL)
    assert semantic.reused and 1 in semantic.recalled


def test_a_word_of_the_question_outranks_a_message_close_only_in_meaning(counter):
    """The recall fuses less cosine than a new selection (`RECALL_SEMANTIC_SHARE`): a message that
    names what the question asks (the ferry, twice) is recalled before one only close in meaning
    (boats to the archipelago), which at the selection's share (0.35) came first."""
    filler = [
        "We watched a film.",
        "Dinner was pasta.",
        "The cat slept.",
        "Work was busy.",
        "I bought socks.",
        "It rained.",
        "My sister called.",
        "The bus was late.",
    ]
    said = [
        "The ferry to the island leaves from pier 3 at 07:40 on weekdays.",
        *filler[:3],
        "I moved my ferry booking; the ferry staff were kind.",
        *filler[3:6],
        "Boats out to the archipelago depart early in the morning.",
        *filler[6:],
        "Noted.",
        "When does the island ferry leave?",
    ]
    chat = [{"role": "system", "content": "You are helpful."}]
    chat += [{"role": ("user", "assistant")[k % 2], "content": text} for k, text in enumerate(said)]

    def embed(texts):
        return [[1.0, 0.0] if ("archipelago" in t or "When does" in t) else [0.0, 1.0] for t in texts]

    order = _Pools(ChatView(chat), counter, MODEL, 0, embed).of(len(chat) - 1, [0]).candidates
    booking, boats = 5, 9
    assert order.index(booking) < order.index(boats)


def test_a_failing_embedder_leaves_the_recall_lexical_with_a_note(counter):
    chat = river_chat()
    first = trim(chat, token_counter=counter)
    later_chat = next_turn(chat, "What is my locker code?")

    def broken(texts):
        raise RuntimeError("down")

    later = trim(later_chat, first.decision, token_counter=counter, embed=broken)
    assert later.reused and {1, 2} <= set(later.recalled)
    assert "embedder failed (RuntimeError): recall is lexical" in later.notes


def test_a_failing_embedder_is_asked_once_a_trim(counter):
    """A turn that selects anew tries the carried selection's recall first, then a new selection
    and its recall: an embedder that failed (a timeout, say) is not asked again in that trim."""
    chat = river_chat()
    first = trim_messages(chat, max_tokens=BUDGET, model=MODEL, token_counter=counter)  # fills 80%
    calls = []

    def broken(texts):
        calls.append(len(texts))
        raise TimeoutError("slow")

    later_chat = next_turn(chat, "Which facts about rivers carrying silt to deltas did you tell me?")
    options = {"max_tokens": BUDGET, "model": MODEL, "token_counter": counter, "embed": broken}
    later = trim_messages(later_chat, previous=first.decision, **options)
    assert not later.reused and later.recalled  # a new selection, with its recall block
    assert len(calls) == 1 and any("embedder failed (TimeoutError)" in note for note in later.notes)


def test_the_short_reply_next_to_a_match_ranks_before_filler(counter):
    """A fact split over two short lines ("What is your dog called?" / "Biscuit."): the reply
    shares no word with the question, filler shares one; the recall ranks the reply first as
    the match's neighbour (the turn rule of a new selection, applied to the recall's messages).
    bench/multiturn.py: evidence carried 0.659 -> 0.680 at 2k, 0.801 -> 0.812 at 8k."""
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Guess what, I finally adopted a dog from the shelter!"},
        {"role": "assistant", "content": "Wonderful! What is your new dog called?"},
        {"role": "user", "content": "Biscuit."},
        {"role": "assistant", "content": "A lovely name."},
    ]
    for n in range(4):
        chat += [
            {"role": "user", "content": f"Tell me fact {n} about rivers and deltas."},
            {"role": "assistant", "content": f"Fact {n}: the shelter of a delta is silt."},
        ]
    chat.append({"role": "user", "content": "What name did my adopted shelter dog get?"})
    pool = _Pools(ChatView(chat), counter, MODEL, 0, None).of(len(chat) - 1, [0])
    fillers = [i for i in pool.candidates if i > 4]
    assert pool.candidates.index(3) < min(map(pool.candidates.index, fillers))


# -- roles alternate around the recall block (chat templates that require it) ----------------


def alternates(messages: list[dict]) -> bool:
    """No two consecutive messages with the same role once the system prompt is set aside: what
    strict chat templates (Gemma, Mistral in vLLM or llama.cpp) require of a chat without tools."""
    roles = [m["role"] for m in messages if m["role"] not in ("system", "developer")]
    return all(a != b for a, b in pairwise(roles))


def test_the_recall_block_is_followed_by_the_acknowledgement(counter):
    """Each block (the new one and the earlier ones sent again) is a user message followed by an
    assistant SUMMARY_ACK, then the question it was made for: roles alternate, the budget counts
    the acknowledgement, and the previous prompt is the prefix of the next, byte for byte."""
    from contextwarden.face.summarize import SUMMARY_ACK

    chat = river_chat()
    result = trim(chat, token_counter=counter)
    assert alternates(result.messages)
    previous_sent = result.messages
    questions = ["What is my locker code?", "And which bike did I say I ride, Batavus?", "Locker 4417 again?"]
    blocks = 0
    for question in questions:
        chat = next_turn(chat, question)
        result = trim(chat, TrimDecision.from_json(result.decision.to_json()), token_counter=counter, recall_share=0.2)
        check_contract(chat, result, counter, MODEL)
        assert alternates(result.messages), [m["role"] for m in result.messages]
        for k in recall_positions(result.messages):
            assert result.messages[k + 1] == {"role": "assistant", "content": SUMMARY_ACK}
            assert result.messages[k + 2]["role"] == "user" and not is_recall_message(result.messages[k + 2])
        assert result.tokens_after == counter.count_messages(result.messages, MODEL) <= BUDGET
        if result.reused:
            assert json.dumps(result.messages[: len(previous_sent)]) == json.dumps(previous_sent)
        blocks += len(recall_positions(result.messages))
        previous_sent = result.messages
    assert blocks


def test_a_decision_from_before_the_acknowledgement_still_reads(counter):
    """Decisions stored before the acknowledgement record blocks as `[anchor, at, kept]`: they
    still read (as not acknowledged), and their blocks are sent again with the acknowledgement."""
    chat = river_chat()
    first = trim(chat, token_counter=counter)
    second_chat = next_turn(chat, "What is my locker code?")
    second = trim(second_chat, first.decision, token_counter=counter, recall_share=0.2)
    assert second.recalled and all(r.acked for r in second.decision.recalls)
    data = json.loads(second.decision.to_json())
    assert all(len(r) == 4 for r in data["recalls"])
    data["recalls"] = [r[:3] for r in data["recalls"]]  # as written before
    old = TrimDecision.from_json(json.dumps(data))
    assert old.recalls and not any(r.acked for r in old.recalls)
    third_chat = next_turn(second_chat, "And which bike did I say I ride, Batavus?")
    third = trim(third_chat, old, token_counter=counter, recall_share=0.2)
    check_contract(third_chat, third, counter, MODEL)
    assert alternates(third.messages) and third.reused
    assert third.messages == trim(third_chat, second.decision, token_counter=counter, recall_share=0.2).messages


@given(
    scores=st.lists(st.floats(0, 50, allow_nan=False) | st.just(0.0), max_size=12),
    sizes=st.lists(st.integers(0, 2_000), min_size=12, max_size=12),
    question=st.integers(-1, 12),
)
def test_neighbour_shares_are_those_of_the_rule_message_by_message(scores, sizes, question):
    """`_with_neighbours` (in C) gives, bit for bit, each message plus `turn_share` of its better
    neighbour's score times `neighbour_reach`, the question lending and taking nothing."""
    from contextwarden.core.recall import _RECALL_WEIGHTS, _with_neighbours
    from contextwarden.core.selection import neighbour_reach

    texts = ["x" * (4 * s) for s in sizes[: len(scores)]]
    n = len(scores)
    expected = list(scores)
    for i in range(n):
        if i != question:
            near = [
                scores[j] * neighbour_reach(len(texts[i]) // 4 + 1, len(texts[j]) // 4 + 1, _RECALL_WEIGHTS)
                for j in (i - 1, i + 1)
                if 0 <= j < n and j != question
            ]
            expected[i] += _RECALL_WEIGHTS.turn_share * max(near, default=0.0)
    assert _with_neighbours(scores, texts, question, _RECALL_WEIGHTS) == expected


async def test_a_block_a_loop_call_let_go_is_still_the_filters_own_on_the_next_call(counter):
    """Each call of a tool loop gets the first call's messages, its recall block in them, and
    the loop. A call that needed the block's room let it go and noted nothing added; the next
    call took the block for the user's message, sent it, and a new block after it."""
    from contextwarden.core.decision import message_fingerprint

    from helpers import body_of, make_filter

    f = make_filter(counter, max_context_tokens=ROOMY, reserve_output_tokens=0, low_watermark=0.5)
    metadata: dict = {"chat_id": "c-loop-block", "user_id": "u1"}
    hooks = {"__user__": {"id": "u1"}, "__metadata__": metadata}
    chat = river_chat(20)
    await f.request(await f.inlet(body_of(copy.deepcopy(chat)), **hooks), **hooks)
    await f.outlet(body_of([*chat, {"role": "assistant", "content": "Deltas grow."}]), **hooks)
    chat = next_turn(chat, "Which locker code did I ask you to remember at the start?", reply="Deltas grow.")
    metadata.clear()
    metadata.update({"chat_id": "c-loop-block", "user_id": "u1"})
    first = (await f.request(await f.inlet(body_of(copy.deepcopy(chat)), **hooks), **hooks))["messages"]
    assert sum(map(is_recall_message, first)) == 1
    loop: list[dict] = []
    for k, rows in enumerate((550, 5, 5)):
        call = {"id": f"call_{k}", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
        loop += [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{k}", "content": "row " * rows},
        ]
        sent = (await f.request(body_of([*first, *loop]), **hooks))["messages"]
        blocks = [message_fingerprint(m) for m in sent if is_recall_message(m)]
        assert len(blocks) <= 1 and set(blocks) <= set(metadata["contextwarden"].get("added", ())), k


# Open WebUI 0.12.4 adds the tool definitions after `inlet` (utils/middleware.py): the request
# pass and every call of a tool loop trim with less room than the turn's inlet.
LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a thing up in the records. " * 2,
        "parameters": {"type": "object", "properties": {"q": {"type": "string", "description": "what"}}},
    },
}


async def _loop_turn_that_lets_the_block_go(counter) -> tuple:
    """river_chat in a 600-token window with a tool: the turn asking for the locker code sends a
    recall block, then a tool loop's call whose 60-row result needs its room sends the rest whole.
    Returns the filter, the hooks, the chat of that turn, its first call's and loop call's
    messages, the loop, and the stored decision's reader."""
    from contextwarden.state.chatstate import ChatState, chat_state_key

    from helpers import body_of, make_filter

    f = make_filter(counter, max_context_tokens=600, reserve_output_tokens=0, low_watermark=0.5)
    metadata: dict = {"chat_id": "c-loop-sent", "user_id": "u1"}
    hooks = {"__user__": {"id": "u1"}, "__metadata__": metadata}

    async def stored() -> TrimDecision | None:
        return ChatState.from_bytes(await f.store.get(chat_state_key("u1", "c-loop-sent"))).decision

    async def passes(chat: list[dict]) -> tuple[list[dict], list[dict]]:
        metadata.clear()
        metadata.update({"chat_id": "c-loop-sent", "user_id": "u1"})
        inlet = await f.inlet(body_of(copy.deepcopy(chat)), **hooks)
        return inlet["messages"], (await f.request({**inlet, "tools": [LOOKUP_TOOL]}, **hooks))["messages"]

    chat = river_chat()
    await passes(chat)
    await f.outlet(body_of([*chat, {"role": "assistant", "content": "Deltas grow."}]), **hooks)
    chat = next_turn(chat, "Which locker code did I ask you to remember at the start?", reply="Deltas grow.")
    _, first = await passes(chat)
    call = {"id": "call_0", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    loop = [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": "row " * 60},
    ]
    sent = (await f.request({**body_of([*first, *loop]), "tools": [LOOKUP_TOOL]}, **hooks))["messages"]
    assert sum(map(is_recall_message, first)) >= 1 and not any(map(is_recall_message, sent))
    return f, hooks, passes, stored, chat, first, sent, loop


async def test_the_next_turn_carries_what_a_loop_call_sent_not_the_block_it_let_go(counter):
    """A tool loop's call that let the turn's recall block go (its result needed the room) and
    sent the rest whole stored the first call's decision, block and all: the next turn's inlet
    put the block back before the old question (its prompt left the last call's after 7 of 10
    messages) and the request pass, with the tool definitions, then let it go and sent no block
    for the new question. Now the stored decision is what the call sent."""
    from helpers import body_of

    f, hooks, passes, stored, chat, first, sent, loop = await _loop_turn_that_lets_the_block_go(counter)
    decision = await stored()
    assert decision is not None and decision.recalls == ()  # the call sent none
    await f.outlet(body_of([*chat, *loop, {"role": "assistant", "content": "It is 4417."}]), **hooks)
    chat = next_turn([*chat, *loop], "And my bike?", reply="It is 4417.")
    inlet, request = await passes(chat)
    assert inlet[: len(sent)] == sent and request[: len(sent)] == sent
    assert [is_recall_message(m) for m in request[len(sent) :]] == [False, True, False, False]  # reply, block, ack, q
    decision = await stored()
    assert decision is not None and [r.anchor for r in decision.recalls] == [len(chat) - 1]


async def test_a_regenerate_after_a_loop_call_that_let_the_block_go_sends_the_block_again(counter):
    """That call's decision has no block; on a regenerate (its result gone) the question's block
    is made again in the room the result took, locker code and all. (A room for few of this
    chat's turns: its selection is by message and quoted two of its picks in a block of its own,
    which the loop call let go too; so the regenerate's prompt is not the first call's bytes.)"""
    f, hooks, passes, stored, chat, first, sent, loop = await _loop_turn_that_lets_the_block_go(counter)
    inlet, request = await passes(chat)
    blocks = [m["content"] for m in request if is_recall_message(m)]
    assert inlet == request and len(blocks) == 1 and "4417" in blocks[0]
    assert request[-1] == first[-1] and request[0] == first[0]


@pytest.mark.parametrize("embed", [None, "hashed"])
def test_an_orphan_with_an_image_is_no_message_to_send_in_place(counter, embed):
    """A reply with an image whose tool call was never answered (an orphan: never sent) counted
    among the messages the recall wants in place for their images; on a later turn's new
    selection `fresh._pictured_in_place` looked for its turn, found none, and the trim raised
    StopIteration (found by a hypothesis run with images and the embedder)."""
    import hashlib

    def hashed(texts: list[str]) -> list[list[float]]:
        return [[b / 255 + 0.01 for b in hashlib.sha256(t.encode()).digest()[:8]] for t in texts]

    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    orphan = {"role": "assistant", "content": [{"type": "text", "text": "The lighthouse photo."}, image]}
    orphan["tool_calls"] = [call]
    options = {"max_tokens": 2_000, "model": MODEL, "token_counter": counter, "embed": hashed if embed else None}
    first = trim_messages([orphan], **options)
    later = [orphan, {"role": "user", "content": "Where is the lighthouse photo?"}]
    result = trim_messages(later, previous=first.decision, **options)
    assert result.kept == (1,) and result.dropped == (0,)
    check_contract(later, result, counter, MODEL)
