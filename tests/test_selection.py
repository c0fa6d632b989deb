"""Selection: value-based choice of whole units, pins, last turns, prefix reuse across turns."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from contextwarden import TrimDecision, trim_messages
from contextwarden.core.chatview import ChatView
from contextwarden.core.conversation import is_acknowledgement, is_recall_message
from contextwarden.core.decision import FINGERPRINT_ONE_CALL_PARTS, message_fingerprint
from contextwarden.core.relevance import DEFAULT_RELEVANCE_WEIGHTS
from contextwarden.core.selection import choose_indices, reuse_previous, select_by_value
from contextwarden.core.tokens import TokenCounter

from chatgen import random_chat
from chats import assert_same_trim, check_contract, frozen

MODEL = "gpt-4o"
TOPICS = [
    "garden tomatoes",
    "kernel compile",
    "violin lessons",
    "tax return",
    "marathon training",
    "sourdough starter",
    "python asyncio",
    "roof repair",
    "chess openings",
    "moving to Lisbon",
]


def topic_chat(turns: int, last: str, *, system: str = "You are helpful.") -> list[dict]:
    chat = [{"role": "system", "content": system}]
    for i in range(turns):
        topic = TOPICS[i % len(TOPICS)]
        chat += [
            {"role": "user", "content": f"Question {i} about {topic}: " + "some detail here " * 20},
            {"role": "assistant", "content": f"Answer {i} on {topic}. " + "more words follow " * 20},
        ]
    return chat + [{"role": "user", "content": last}]


def test_select_by_value_prefers_value_per_token_and_repairs_with_the_single_best():
    assert select_by_value([10, 10, 30], [1.0, 5.0, 9.0], budget=40) == [1, 2]
    # greedy by density would take the two small ones (worth 2); the big one alone is worth 10
    assert select_by_value([1, 1, 10], [1.0, 1.0, 10.0], budget=10, cost_exponent=1.0) == [2]
    assert select_by_value([5, 5], [0.0, 0.0], budget=100) == []


def test_relevance_keeps_the_old_turn_about_the_question(counter):
    chat = topic_chat(30, "Back to sourdough starter: how often to feed it?")
    result = trim_messages(chat, max_tokens=600, model=MODEL, token_counter=counter)
    check_contract(chat, result, counter, MODEL)
    sourdough = [i for i, m in enumerate(chat[:-1]) if "sourdough" in str(m["content"])]
    assert set(sourdough) & {*result.kept, *result.recalled}  # in place, or quoted (a room for few turns)
    recent = trim_messages(chat, max_tokens=600, model=MODEL, token_counter=counter, strategy="recent")
    assert not set(sourdough[:-2]) & set(recent.kept)


def test_history_never_starts_with_a_kept_reply_whose_question_was_dropped(counter):
    chat = [
        {"role": "user", "content": "filler " * 300},
        {"role": "assistant", "content": "The secret word is zanzibar."},
        {"role": "user", "content": "padding " * 300},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "What was the secret word zanzibar?"},
    ]
    for budget in range(40, 700, 9):
        result = trim_messages(chat, max_tokens=budget, model=MODEL, token_counter=counter, low_watermark=1.0)
        check_contract(chat, result, counter, MODEL)
        assert result.messages[0]["role"] == "user"


def test_tool_group_and_units_kept_whole(counter):
    chat = [
        {"role": "user", "content": "weather in Paris? " * 10},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "Paris sunny 25C " * 30},
        {"role": "assistant", "content": "Sunny in Paris."},
        {"role": "user", "content": "unrelated " * 50},
        {"role": "assistant", "content": "fine"},
        {"role": "user", "content": "Paris weather again?"},
    ]
    for budget in range(30, counter.count_messages(chat, MODEL) + 1, 11):
        result = trim_messages(chat, max_tokens=budget, model=MODEL, token_counter=counter, low_watermark=1.0)
        check_contract(chat, result, counter, MODEL)
        assert {1, 2} <= set(result.kept) or not {1, 2} & set(result.kept)


def test_pinned_and_last_turns_are_kept_first(counter):
    chat = topic_chat(20, "What about chess openings?")
    budget = 700
    plain = trim_messages(chat, max_tokens=budget, model=MODEL, token_counter=counter)
    assert 3 not in plain.kept
    pinned = trim_messages(chat, max_tokens=budget, model=MODEL, token_counter=counter, pinned=[3])
    assert {3, 4} <= set(pinned.kept)  # the pinned question with its answer: whole turns
    check_contract(chat, pinned, counter, MODEL, pinned=[3])
    last = trim_messages(chat, max_tokens=budget, model=MODEL, token_counter=counter, keep_last_turns=3)
    assert set(range(len(chat) - 5, len(chat))) <= set(last.kept)
    check_contract(chat, last, counter, MODEL)


def test_pins_and_last_turns_yield_to_the_hard_budget(counter):
    chat = topic_chat(20, "and now?")
    result = trim_messages(
        chat, max_tokens=150, model=MODEL, token_counter=counter, keep_last_turns=10, pinned=range(len(chat))
    )
    check_contract(chat, result, counter, MODEL)
    assert result.tokens_after <= 150 and len(chat) - 1 in result.kept


def test_low_watermark_cuts_below_the_budget(counter):
    chat = topic_chat(30, "tax return deadline?")
    full = trim_messages(chat, max_tokens=2_000, model=MODEL, token_counter=counter, low_watermark=1.0)
    low = trim_messages(chat, max_tokens=2_000, model=MODEL, token_counter=counter)
    assert low.tokens_after <= 0.8 * 2_000 < full.tokens_after <= 2_000


def test_long_turns_get_room_for_two_more_before_the_next_cut(counter):
    chat = topic_chat(30, "tax return deadline?")
    turn = [
        {"role": "assistant", "content": "A long reply about taxes. " + "words " * 300},
        {"role": "user", "content": "And the deadline for the return? " + "context " * 60},
    ]
    chat = chat + turn
    growth = sum(counter.count_message(m, MODEL) for m in turn)
    budget = 3_000
    assert 2 * growth > 0.2 * budget  # the watermark alone would leave room for less than two such turns
    result = trim_messages(chat, max_tokens=budget, model=MODEL, token_counter=counter)
    assert result.tokens_after <= budget - 2 * growth
    plain = trim_messages(chat, max_tokens=budget, model=MODEL, token_counter=counter, growth_turns=0)
    assert budget - 2 * growth < plain.tokens_after <= 0.8 * budget
    # Two more such turns reuse the selection; the third needs a new one (no recall block here:
    # a first selection does not leave room for one, see test_recall.py).
    decision, reused = result.decision, []
    for k in range(3):
        chat = chat + [dict(m, content=f"{m['content']} {k}") for m in turn]
        result = trim_messages(
            chat, max_tokens=budget, model=MODEL, token_counter=counter, previous=decision, recall_share=0
        )
        reused.append(result.reused)
        decision = result.decision
    assert reused == [True, True, False]
    # Never more than half the budget is left free for growth.
    huge = topic_chat(30, "tax?") + [
        {"role": "assistant", "content": "words " * 3_000},
        {"role": "user", "content": "tax?"},
    ]
    assert (
        budget // 2 - 200
        < trim_messages(huge, max_tokens=budget, model=MODEL, token_counter=counter).tokens_after
        <= budget // 2
    )


def test_hysteresis_across_turns_through_json(counter):
    """Turn after turn the sent prefix is last turn's, until the budget forces a new cut."""
    chat = topic_chat(25, "tax return deadline?")
    budget = 1_500
    decision: TrimDecision | None = None
    sent_before: list[dict] | None = None
    reused = reselected = stable_before = 0
    for turn in range(15):
        stored = decision.to_json() if decision else None
        previous = TrimDecision.from_json(stored) if stored else None
        result = trim_messages(chat, max_tokens=budget, model=MODEL, token_counter=counter, previous=previous)
        check_contract(chat, result, counter, MODEL)
        assert result.tokens_after <= budget
        if result.reused:
            reused += 1  # all but the last turn's recall block and question are sent again...
            before = sent_before[:stable_before]
            # ...but for an earlier question's block that gave way to this one's (and what follows)
            gone = next((k for k, m in enumerate(before) if is_recall_message(m) and m not in result.messages), None)
            assert result.messages[: len(before) if gone is None else gone] == before[:gone]
            own = [m for m in before if not (is_recall_message(m) or is_acknowledgement(m))]
            now = [m for m in result.messages if not (is_recall_message(m) or is_acknowledgement(m))]
            assert now[: len(own)] == own
        else:
            reselected += 1
            assert result.tokens_after <= 0.8 * budget
        assert stored is None or "tax" not in stored  # fingerprints, never text
        decision, sent_before, stable_before = result.decision, list(result.messages), result.stable_prefix
        topic = TOPICS[turn % len(TOPICS)]
        chat = chat + [
            {"role": "assistant", "content": f"Reply {turn} on {topic}. " + "words " * 40},
            {"role": "user", "content": f"Follow-up {turn} on {topic}?"},
        ]
    assert reused >= 10 and reselected >= 2


def test_reuse_refused_when_a_kept_message_is_gone_or_over_budget(counter):
    chat = topic_chat(20, "marathon training plan?")  # a room for 8 turns: whole turns, no quoted block
    first = trim_messages(chat, max_tokens=1_800, model=MODEL, token_counter=counter)
    kept_history = [i for i in first.kept if i > 0 and i < len(chat) - 1]
    assert kept_history
    edited = [dict(m) for m in chat]
    edited[kept_history[0]]["content"] = "edited by the user"
    conversation = ChatView(edited)
    costs = [counter.count_message(m, MODEL) for m in edited]
    prints = [message_fingerprint(m) for m in edited]
    assert reuse_previous(first.decision, prints, conversation, costs, 1_800) is None
    same = ChatView(chat)
    costs = [counter.count_message(m, MODEL) for m in chat]
    prints = [message_fingerprint(m) for m in chat]
    assert reuse_previous(first.decision, prints, same, costs, 1_800) == set(first.kept)
    assert reuse_previous(first.decision, prints, same, costs, first.tokens_after - 10) is None


def test_system_prompt_change_keeps_the_history_selection(counter):
    chat = topic_chat(20, "violin lessons price?")
    first = trim_messages(chat, max_tokens=900, model=MODEL, token_counter=counter)
    changed = [{"role": "system", "content": "You are helpful. Today is Monday."}] + chat[1:]
    again = trim_messages(changed, max_tokens=900, model=MODEL, token_counter=counter, previous=first.decision)
    assert again.reused and again.kept == first.kept


def test_decision_json_round_trip_and_rejects_garbage():
    decision = TrimDecision(max_tokens=100, tokens=80, strategy="recent", kept=("00ff00ff00ff00ff",))
    assert TrimDecision.from_json(decision.to_json()) == decision
    for bad in ("", "[]", '{"v": 2}', '{"v": 1, "kept": [1]}', "not json"):
        with pytest.raises(ValueError):
            TrimDecision.from_json(bad)


def test_fitting_chat_has_no_decision_and_bad_options_raise(counter):
    chat = topic_chat(2, "hi")
    assert trim_messages(chat, max_tokens=10_000, token_counter=counter).decision is None
    for options in (
        {"strategy": "best"},
        {"keep_last_turns": -1},
        {"low_watermark": 0.0},
        {"low_watermark": 1.5},
        {"growth_turns": -1},
    ):
        with pytest.raises(ValueError, match=next(iter(options))):
            trim_messages(chat, max_tokens=100, token_counter=counter, **options)


def test_choose_indices_recent_keeps_whole_turns():
    chat = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
        {"role": "user", "content": "e"},
    ]
    conversation = ChatView(chat)
    assert choose_indices(conversation, [5] * 5, 15, strategy="recent") == {2, 3, 4}
    assert choose_indices(conversation, [5] * 5, 14, strategy="recent") == {4}


@pytest.mark.parametrize("seed", range(30))
def test_contract_idempotence_determinism_on_random_chats(counter, seed):
    rng = random.Random(1000 + seed)
    chat = random_chat(rng, rng.choice([3, 10, 60, 250, 700]), system_words=rng.choice([0, 20, 300]))
    before = frozen(chat)
    total = counter.count_messages(chat, MODEL)
    pins = rng.sample(range(len(chat)), k=min(3, len(chat)))
    for budget in {64, 300, 1_500, max(64, total // 3), total + 10}:
        options = {
            "keep_last_turns": rng.choice([1, 2, 3]),
            "pinned": pins,
            "low_watermark": rng.choice([0.6, 0.8, 1.0]),
        }
        result = trim_messages(chat, max_tokens=budget, model=MODEL, token_counter=counter, **options)
        check_contract(chat, result, counter, MODEL, pinned=pins)
        same = trim_messages(chat, max_tokens=budget, model=MODEL, token_counter=counter, **options)
        assert same.kept == result.kept and frozen(same.messages) == frozen(result.messages)
        again = trim_messages(
            result.messages, max_tokens=budget, model=MODEL, token_counter=counter, previous=result.decision
        )
        assert not again.changed
        if result.decision is not None:
            grown = chat + [{"role": "assistant", "content": "reply"}, {"role": "user", "content": "next?"}]
            follow = trim_messages(
                grown,
                max_tokens=budget,
                model=MODEL,
                token_counter=counter,
                previous=TrimDecision.from_json(result.decision.to_json()),
                **options,
            )
            check_contract(grown, follow, counter, MODEL, pinned=pins)
    assert frozen(chat) == before


def test_cached_fingerprints_equal_the_full_hash_and_tell_json_types_apart():
    """The fingerprint cache's cheap key never lets two messages with different canonical JSON
    share a fingerprint (True, 1, 1.0, "1", None, "None", [], {} ...), and it caches only."""
    import hashlib
    import json

    def full(message):
        canonical = json.dumps(message, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
        return hashlib.blake2b(canonical.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()

    values = [True, 1, 1.0, "1", None, "None", [], {}, [{}], {"a": []}, {"a": "b"}, ["a", "b"], [["a"], "b"], -0.0, 0.0]
    messages = [{"role": "user", "content": "hi", "x": v} for v in values]
    messages += [
        {"content": "hi", "role": "user"},
        {"role": "user", "content": "hi"},
        {"role": "user", "content": "hi\ud800"},
    ]
    messages += random_chat(random.Random(11), 80)
    many = [{"type": "text", "text": f"é{k}\ud800"} for k in range(FINGERPRINT_ONE_CALL_PARTS + 1)]
    messages += [{"role": "user", "content": many}, {"role": "user", "content": many[:-1]}]  # piece by piece / not
    for _ in range(2):  # the second pass is served by the cache
        prints = [message_fingerprint(m) for m in messages]
        assert prints == [full(m) for m in messages]
    assert len(set(prints[: len(values)])) == len(values)


class CountingPrints(list):
    """Fingerprints that count how many were looked at."""

    looked = 0

    def __getitem__(self, index):
        CountingPrints.looked += 1
        return super().__getitem__(index)


def test_reuse_checks_recorded_positions_first_and_falls_back_to_a_scan(counter):
    chat = topic_chat(40, "marathon training plan?")
    first = trim_messages(chat, max_tokens=2_000, model=MODEL, token_counter=counter)
    assert first.dropped and len(first.decision.at) == len(first.decision.kept)
    grown = chat + [{"role": "assistant", "content": "Run slowly."}, {"role": "user", "content": "How far?"}]
    prints = CountingPrints(message_fingerprint(m) for m in grown)
    CountingPrints.looked = 0
    keep = reuse_previous(
        first.decision, prints, ChatView(grown), [counter.count_message(m, MODEL) for m in grown], 2_000
    )
    assert keep is not None and CountingPrints.looked == len(first.decision.kept)
    # A message inserted before the kept ones moves them: the positions miss, the scan finds them.
    shifted = [chat[0], {"role": "user", "content": "inserted"}, {"role": "assistant", "content": "ok"}] + grown[1:]
    again = trim_messages(
        shifted, max_tokens=2_000, model=MODEL, token_counter=counter, previous=first.decision, recall_share=0
    )  # the reuse itself; recall blocks: tests/test_recall.py
    assert again.reused and [again.messages[k] for k in range(len(again.messages))][-2:] == grown[-2:]
    assert again.decision.at == tuple(i for i in again.kept if i > 0)


def test_reuse_keeps_the_recorded_copy_of_a_repeated_message():
    chat = [
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": "y"},
        {"role": "user", "content": "z"},
    ]
    prints = [message_fingerprint(m) for m in chat]
    kept = TrimDecision(100, 20, "relevance", (prints[2], prints[3]), (2, 3))
    assert reuse_previous(kept, prints, ChatView(chat), [5] * 5, 100) == {2, 3, 4}
    # Without positions the first "ok" in the chat is taken for the kept one.
    assert reuse_previous(replace(kept, at=()), prints, ChatView(chat), [5] * 5, 100) == {0, 3, 4}


def test_decision_positions_are_optional_and_checked():
    old = '{"v":1,"max_tokens":100,"tokens":80,"strategy":"recent","kept":["aa","bb"]}'
    assert TrimDecision.from_json(old).at == ()
    bad = '{"v":1,"max_tokens":100,"tokens":80,"strategy":"recent","kept":["aa","bb"],"at":[3]}'
    assert TrimDecision.from_json(bad).at == ()
    good = TrimDecision(100, 80, "recent", ("aa", "bb"), (2, 5))
    assert TrimDecision.from_json(good.to_json()) == good


class SpyCounter(TokenCounter):
    """A counter that remembers which text objects it was asked to count."""

    def __init__(self) -> None:
        super().__init__(block=True)
        self.asked: list[str] = []

    def _count(self, text, name, encoding):
        self.asked.append(text)
        return super()._count(text, name, encoding)


def _next_turn(counter, chat, budget, extra):
    """Trim `chat`, then the same chat grown by `extra` (a fresh JSON copy, as Open WebUI sends it)
    with the decision passed through JSON: (first, grown, previous)."""
    first = trim_messages(chat, max_tokens=budget, model=MODEL, token_counter=counter)
    grown = json.loads(json.dumps(chat + extra))
    return first, grown, TrimDecision.from_json(first.decision.to_json())


def test_next_turn_reads_only_what_it_sends_and_what_is_new():
    spy = SpyCounter()
    chat = topic_chat(40, "marathon training plan?")
    extra = [{"role": "assistant", "content": "Run slowly."}, {"role": "user", "content": "How far this week?"}]
    first, grown, previous = _next_turn(spy, chat, 2_000, extra)
    assert previous.seen == len(chat) and previous.counted_with == "o200k_base" and previous.seen_chars > 0
    spy.asked.clear()
    # (The recall block of a chat that goes on looks up the counts of messages it may quote, all
    # cache hits: tests/test_recall.py. Here the selection itself.)
    result = trim_messages(grown, max_tokens=2_000, model=MODEL, token_counter=spy, previous=previous, recall_share=0)
    assert result.reused and result.messages[-1] == grown[-1]
    if result.recalled:
        assert result.messages[-3] == grown[-2] and result.stable_prefix == len(result.messages) - 2
    else:
        assert result.messages[-2:] == grown[-2:]
    asked = {id(text) for text in spy.asked}
    # Only a recalled message's count is looked up (a cache hit: the text was counted before).
    assert not any(id(grown[i]["content"]) in asked for i in result.dropped if i not in result.recalled), (
        "a dropped message was counted"
    )
    assert result.tokens_before == spy.count_messages(grown, MODEL)
    # The full path (no size figures in the decision) makes the very same choice.
    assert_same_trim(
        result,
        trim_messages(
            grown, max_tokens=2_000, model=MODEL, token_counter=spy, previous=replace(previous, seen=0), recall_share=0
        ),
    )
    check_contract(grown, result, spy, MODEL)


def test_next_turn_shortcut_declines_when_the_history_changed(counter):
    chat = topic_chat(40, "marathon training plan?")
    extra = [{"role": "assistant", "content": "Run slowly."}, {"role": "user", "content": "How far?"}]
    first, grown, previous = _next_turn(counter, chat, 2_000, extra)
    dropped = first.dropped[3]
    grown[dropped]["content"] += " (edited)"
    result = trim_messages(grown, max_tokens=2_000, model=MODEL, token_counter=counter, previous=previous)
    assert result.reused and result.tokens_before == counter.count_messages(grown, MODEL)
    assert_same_trim(
        result,
        trim_messages(grown, max_tokens=2_000, model=MODEL, token_counter=counter, previous=replace(previous, seen=0)),
    )
    # Another encoding counts (the model changed): the old figures are not used either.
    gpt4 = trim_messages(grown, max_tokens=2_000, model="gpt-4", token_counter=counter, previous=previous)
    assert gpt4.tokens_before == counter.count_messages(grown, "gpt-4")
    # A chat that now fits whole is sent whole, as without a decision.
    roomy = trim_messages(grown, max_tokens=100_000, model=MODEL, token_counter=counter, previous=previous)
    assert not roomy.dropped and not roomy.reused


def test_next_turn_carries_the_count_of_a_dropped_message_edited_to_the_same_length(counter):
    """The documented limit of the shortcut: it checks dropped messages by their total length only,
    so an in-place edit that keeps the length is counted as before until the next new selection."""
    chat = topic_chat(40, "marathon training plan?")
    extra = [{"role": "assistant", "content": "Run slowly."}, {"role": "user", "content": "How far?"}]
    first, grown, previous = _next_turn(counter, chat, 2_000, extra)
    dropped = first.dropped[3]
    grown[dropped]["content"] = "x" * len(grown[dropped]["content"])
    result = trim_messages(grown, max_tokens=2_000, model=MODEL, token_counter=counter, previous=previous)
    assert result.reused and result.dropped == first.dropped
    assert result.tokens_before == first.tokens_before + counter.count_messages(extra, MODEL) - 3
    check_contract(grown, result, counter, MODEL)


def test_decision_size_figures_round_trip_and_are_optional():
    decision = TrimDecision(
        100, 80, "recent", ("aa", "bb"), (2, 5), seen=9, seen_tokens=700, seen_chars=2_100, counted_with="o200k_base"
    )
    assert TrimDecision.from_json(decision.to_json()) == decision
    old = '{"v":1,"max_tokens":100,"tokens":80,"strategy":"recent","kept":["aa","bb"],"at":[2,5]}'
    assert TrimDecision.from_json(old).seen == 0
    odd = old[:-1] + ',"seen":[9,"700",2100,"o200k_base"]}'
    assert TrimDecision.from_json(odd).seen == 0
    unordered = (
        '{"v":1,"max_tokens":100,"tokens":80,"strategy":"recent","kept":["aa","bb"],"at":[5,2],"seen":[9,700,2100,"x"]}'
    )
    assert TrimDecision.from_json(unordered).at == () and TrimDecision.from_json(unordered).seen == 0


def _four_turn_chat() -> list[dict]:
    """Turns 0-3 (a user message and its reply each), then the question."""
    chat = []
    for t in range(4):
        chat += [{"role": "user", "content": f"u{t}"}, {"role": "assistant", "content": f"a{t}"}]
    return chat + [{"role": "user", "content": "q"}]


def test_a_turn_next_to_a_strong_match_shares_in_it():
    chat = _four_turn_chat()
    scores = [1.0, 0.0, 0.1, 0.0, 0.1, 0.0, 0.0, 0.0, 0.0]  # turn 0 matches; turns 1 and 2 tie
    costs = [10] * 9
    budget = 7 * 10  # the question, the latest turn (3), turn 0 and one more turn
    conversation = ChatView(chat)
    weights = DEFAULT_RELEVANCE_WEIGHTS
    assert choose_indices(conversation, costs, budget, scores=scores, weights=weights) == {0, 1, 2, 3, 6, 7, 8}
    alone = replace(weights, turn_share=0.0)  # without it, the tie goes to the newer turn
    assert choose_indices(conversation, costs, budget, scores=scores, weights=alone) == {0, 1, 4, 5, 6, 7, 8}


def test_a_long_turn_gets_less_of_its_neighbours_score():
    chat = _four_turn_chat()
    scores = [1.0, 0.0, 0.1, 0.0, 0.2, 0.0, 0.0, 0.0, 0.0]
    costs = [10, 10, 500, 500, 500, 500, 10, 10, 10]  # turns 1 and 2 are long (1,000 tokens each)
    budget = 50 + 1000  # the question, the latest turn, turn 0 and one long turn
    conversation = ChatView(chat)
    reach = DEFAULT_RELEVANCE_WEIGHTS.turn_reach
    near = replace(DEFAULT_RELEVANCE_WEIGHTS, turn_reach=10_000)  # as if turn 1 were short: its neighbour counts
    assert choose_indices(conversation, costs, budget, scores=scores, weights=near) == {0, 1, 2, 3, 6, 7, 8}
    # at the default reach turn 1 gets 0.5 * 1.0 * 2 * reach / 1,020 of turn 0's score: less than turn 2's lead
    assert 0.5 * 2 * reach / 1020 < 0.1
    assert choose_indices(conversation, costs, budget, scores=scores) == {0, 1, 4, 5, 6, 7, 8}


def test_the_latest_turn_lifts_no_neighbour():
    """A short question's query is built from the latest turn: its score must not pull in the turn before it."""
    chat = _four_turn_chat()
    scores = [0.0, 0.0, 0.2, 0.0, 0.1, 0.0, 5.0, 5.0, 0.0]  # the latest turn (3) matches itself
    conversation = ChatView(chat)
    kept = choose_indices(conversation, [10] * 9, 5 * 10, scores=scores)  # room for one turn besides it
    assert kept == {2, 3, 6, 7, 8}  # turn 1 on its own score, not turn 2 for being next to the latest


@pytest.mark.parametrize("strategy", ["recent", "relevance"])
def test_recent_turns_the_previous_selection_let_go_do_not_end_its_reuse(counter, strategy):
    """With `keep_last_turns` 3 and a recent turn whose tool result is far over the budget, the
    first trim lets that turn go; the next turn sends its selection again, prefix and all (the
    recent turn was once added back, over the budget, and the selection made anew)."""
    chat = [{"role": "system", "content": "Be brief."}]
    for i in range(6):
        chat += [
            {"role": "user", "content": f"Question {i} about trains and rails?"},
            {"role": "assistant", "content": f"Answer {i}: trains run on rails. " * 5},
        ]
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    chat += [
        {"role": "user", "content": "Look up the timetable."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "timetable row 12:00 platform 3\n" * 800},
        {"role": "assistant", "content": "Here it is."},
        {"role": "user", "content": "Thanks. Question about buses?"},
    ]
    options = dict(max_tokens=800, model=MODEL, token_counter=counter, keep_last_turns=3, strategy=strategy)
    first = trim_messages(chat, **options)
    assert 16 not in first.kept  # the tool result did not fit
    later = chat + [{"role": "assistant", "content": "Buses run on roads."}, {"role": "user", "content": "And trams?"}]
    again = trim_messages(later, previous=TrimDecision.from_json(first.decision.to_json()), **options)
    assert again.reused and again.messages[: first.stable_prefix] == first.messages[: first.stable_prefix]
