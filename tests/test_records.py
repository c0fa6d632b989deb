"""The records that cross a boundary (`records.py`, `chatstate.py`): round trips, and reading
what the previous version wrote (a worker upgraded mid-chat, or Open WebUI re-executing the
module between a turn's inlet and its outlet)."""

from __future__ import annotations

import json
from dataclasses import replace
from decimal import Decimal as D

import pytest

from contextwarden.core.decision import Recall, TrimDecision
from contextwarden.core.flags import Flags
from contextwarden.money.records import (
    MAX_ASKED,
    NOTE_VERSION,
    SUMMARY_CALL,
    USAGE_RECORD_VERSION,
    CacheView,
    TurnNote,
    UsageRecord,
)
from contextwarden.state.chatstate import CHAT_STATE_VERSION, MAX_CHAT_STATE_BYTES, MAX_PINS, ChatState

DECISION = TrimDecision(
    max_tokens=1_000,
    tokens=640,
    strategy="relevance",
    kept=("a1b2c3d4e5f60718", "0f1e2d3c4b5a6978"),
    at=(3, 7),
    seen=9,
    seen_tokens=2_400,
    seen_chars=9_000,
    counted_with="o200k_base",
    recalls=(Recall(7, (1,), ("1122334455667788",)),),
)

# What the previous version (main before typed records, with excerpts) left in __metadata__ after inlet and request.
PREVIOUS_NOTE = {
    "turn": "h-1",
    "mode": "enforce",
    "estimated_prompt_tokens": 640,
    "count_mode": "exact",
    "budget": 1_000,
    "dropped": 3,
    "reused": False,
    "decided": True,
    "calibration": 1.0,
    "comparable": True,
    "savings": {"removed": 900, "messages_before": 40},
    "tokens_saved": 900,
    "cost_saved_usd": "0.00225",
    "cache": {"untrimmed": 0, "trimmed": 0, "caches": False, "minimum": 1_024},
    "flags": Flags(keep=2, used=("keep",)).to_dict(),
    "line": "kept 12 of 40 messages",
    "sent_messages": 12,
    "shortened": 1,
    "excerpted": 2,
    "cache_marked": {"a1b2c3d4e5f60718": True},
}
# The previous version's usage line (after "usage "), as tests/test_filter.py saw it.
PREVIOUS_USAGE_LINE = (
    '{"model":"gpt-4o","resolved_model":"openai/gpt-4o","user_id":"u1","chat_id":"c1","prompt_tokens":321,'
    '"completion_tokens":12,"cached_tokens":null,"reasoning_tokens":null,"estimated":false,'
    '"estimated_prompt_tokens":530,"usage_shape":"openai","cost_usd":"0.0009225","cost_source":"price_table",'
    '"cost_note":null,"mode":"enforce","tokens_saved":0,"cost_saved_usd":"0"}'
)


# ---- the turn note -------------------------------------------------------------------------


def test_a_turn_note_reads_the_previous_versions_note_and_writes_it_back_with_its_version():
    note = TurnNote.from_dict(PREVIOUS_NOTE)
    assert (note.mode, note.estimated_prompt_tokens, note.removed, note.messages_before) == ("enforce", 640, 900, 40)
    assert note.cost_saved_usd == D("0.00225")  # a number inside, text only in the JSON
    assert note.cache == CacheView(0, 0, False, 1_024) and note.flags == Flags(keep=2, used=("keep",))
    assert (note.line, note.sent_messages, note.shortened, note.excerpted) == ("kept 12 of 40 messages", 12, 1, 2)
    assert note.turn_id == "h-1"
    assert note.to_dict() == {**PREVIOUS_NOTE, "v": NOTE_VERSION}


def test_a_turn_note_round_trips():
    note = TurnNote(
        mode="shadow", estimated_prompt_tokens=10, cost_saved_usd=D("-0.01875"), cache=CacheView(5, 1, True, 0)
    )
    assert TurnNote.from_dict(note.to_dict()) == note
    assert TurnNote.from_json(note.to_json()) == note
    assert TurnNote.from_dict(TurnNote().to_dict()) == TurnNote() and TurnNote().to_dict() == {"v": NOTE_VERSION}


def test_a_turn_notes_origins_go_as_runs_and_come_back():
    """Where each message the first pass sent came from, for a later pass: runs, not one int a message."""
    note = TurnNote(mode="enforce", origins=(0, 1, 2, 7, 8, -1, -1, 9, *range(20, 520)))
    assert note.to_dict()["origins"] == [[0, 3], [7, 2], [-1, 2], [9, 1], [20, 500]]
    assert TurnNote.from_dict(note.to_dict()) == note


@pytest.mark.parametrize(
    "origins",
    [[[0, 2], [5, -1]], [[-2, 1]], [[0, 10**9]], [[0, 1]] * 100_001, [[0, True]], "0-9"],
)
def test_a_turn_notes_origins_are_bounded(origins):
    assert TurnNote.from_dict({"mode": "enforce", "origins": origins}).origins == ()


def test_a_turn_notes_the_questions_sent_first_and_newest():
    """`asked`: the first pass's question (a tool loop that cites puts the sources before it
    again) and the newest copies later passes cut again, bounded; one text as written before."""
    note = TurnNote(mode="enforce", asked=("12:aa",))
    for k in range(20):
        note = replace(note, asked=note.asked_with(f"{k}:bb"))
    assert note.asked[0] == "12:aa" and note.asked[-1] == "19:bb" and len(note.asked) == MAX_ASKED
    assert note.asked_with("19:bb") == note.asked and note.asked_with(None) == note.asked
    assert TurnNote.from_dict(note.to_dict()) == note
    assert TurnNote.from_dict({"mode": "enforce", "asked": "12:aa"}).asked == ("12:aa",)
    assert TurnNote.from_dict({"mode": "enforce", "asked": ["x"] * (MAX_ASKED + 1)}).asked == ()


@pytest.mark.parametrize(
    "raw",
    [
        None,
        [],
        {"v": NOTE_VERSION + 1, "mode": "enforce"},  # a newer version's note: nothing of it is trusted
        {"estimated_prompt_tokens": 10**30, "tokens_saved": True, "cost_saved_usd": "1e999000", "shortened": -1},
        {"cache": {"untrimmed": -1, "trimmed": 0, "caches": True, "minimum": 0}, "flags": {"full": 1}},
    ],
)
def test_a_turn_note_bounds_what_it_reads(raw):
    note = TurnNote.from_dict(raw)
    assert note.estimated_prompt_tokens is None and note.tokens_saved is None and note.cost_saved_usd is None
    assert note.shortened is None and note.cache is None
    assert note.flags in (None, Flags())


# ---- the usage line ------------------------------------------------------------------------


def test_a_usage_record_reads_the_previous_versions_line():
    record = UsageRecord.from_json(PREVIOUS_USAGE_LINE)
    assert (record.model, record.prompt_tokens, record.cost_usd, record.cost_saved_usd) == (
        "gpt-4o",
        321,
        D("0.0009225"),
        D("0"),
    )
    assert json.loads(record.to_json()) == {**json.loads(PREVIOUS_USAGE_LINE), "v": USAGE_RECORD_VERSION}


def test_a_usage_record_round_trips_and_clips_what_it_logs():
    record = UsageRecord(model="m" * 1_000, user_id="u1", cost_saved_usd=D("-0.5"), estimated=True, mode="shadow")
    again = UsageRecord.from_json(record.to_json())
    assert again.model == "m" * 200 and again.cost_saved_usd == D("-0.5") and again.estimated is True
    assert UsageRecord.from_json(again.to_json()) == again
    with pytest.raises(ValueError):
        UsageRecord.from_json('{"v": 99}')
    with pytest.raises(ValueError):
        UsageRecord.from_json("usage {")


def test_a_summary_calls_line_says_so_and_a_replys_line_is_as_it_was():
    """`call` is added within version 1: a reply's line has no such key (byte for byte the line
    before it), a summary call's names it before `v`, and a reader that knows no `call` reads it."""
    line = UsageRecord(model="gpt-4o-mini", prompt_tokens=812, call=SUMMARY_CALL).to_json()
    assert line.endswith(f',"call":"summary","v":{USAGE_RECORD_VERSION}}}')
    assert UsageRecord.from_json(line).call == SUMMARY_CALL and USAGE_RECORD_VERSION == 1
    assert "call" not in json.loads(UsageRecord(model="gpt-4o").to_json())
    assert UsageRecord.from_json(PREVIOUS_USAGE_LINE).call is None


# ---- the chat state ------------------------------------------------------------------------


def test_chat_state_round_trips_with_decisions_as_json_objects():
    state = ChatState(decision=DECISION, pins=("p1", "p2"), pin_mode=True, shadow_decision=DECISION)
    raw = state.to_bytes()
    data = json.loads(raw)
    assert data["v"] == CHAT_STATE_VERSION == 2 and isinstance(data["decision"], dict)  # no JSON inside the JSON
    assert ChatState.from_bytes(raw) == state
    assert "shadow_decision" not in json.loads(ChatState(decision=DECISION).to_bytes())


def _decision_keeping(count: int) -> TrimDecision:
    return TrimDecision(200_000, 190_000, "relevance", tuple(f"{i:016x}" for i in range(count)), tuple(range(count)))


def test_a_chat_state_is_stored_within_its_byte_cap_without_the_decisions_over_it():
    """A review: 30,002 one-word messages at a 200k window kept 22,856 of them, and the state
    written every pass was 568,719 bytes (~25 a kept message), unbounded. Over the cap the
    state goes without its decisions, shadow's first; pins stay; a normal state is unchanged.
    (Decision format 3 stores ~16 bytes a kept message: that state is 365,885 bytes now.)"""
    pins = tuple(f"{i:024x}" for i in range(MAX_PINS))
    huge, normal = _decision_keeping(22_856), _decision_keeping(400)
    assert len(ChatState(decision=huge).to_json()) > 1.8 * MAX_CHAT_STATE_BYTES
    state = ChatState(decision=huge, pins=pins, pin_mode=True)
    raw = state.to_bytes()
    assert len(raw) <= MAX_CHAT_STATE_BYTES and ChatState.from_bytes(raw) == ChatState(pins=pins, pin_mode=True)
    shadowed = ChatState(decision=normal, pins=pins, shadow_decision=huge)
    assert ChatState.from_bytes(shadowed.to_bytes()) == ChatState(decision=normal, pins=pins)
    both = ChatState(decision=huge, pins=pins, shadow_decision=normal)
    assert ChatState.from_bytes(both.to_bytes()) == ChatState(pins=pins, shadow_decision=normal)
    kept = ChatState(decision=normal, pins=pins, shadow_decision=normal)
    assert kept.to_bytes() == kept.to_json().encode() and ChatState.from_bytes(kept.to_bytes()) == kept


def test_a_decision_is_stored_in_about_16_bytes_a_kept_message():
    """Decision format 3: the fingerprints run together in one text, the positions as runs. A
    state of 8,000 kept messages (over the ~5,260 that fit the cap at ~25 bytes each, as format 2
    stored them) is stored with its decision, within the cap."""
    big = _decision_keeping(8_000)
    raw = ChatState(decision=big, pins=("p1",)).to_bytes()
    assert len(raw) <= MAX_CHAT_STATE_BYTES and ChatState.from_bytes(raw).decision == big
    assert len(raw) / 8_000 < 16.1
    stored = json.loads(raw)["decision"]
    assert stored["v"] == 3 and isinstance(stored["kept"], str) and stored["at"] == [[0, 8_000]]
    scattered = TrimDecision(900, 600, "relevance", ("a" * 16, "b" * 16, "c" * 16, "d" * 16), at=(1, 4, 5, 6))
    assert scattered.to_dict()["at"] == [1, [4, 3]] and TrimDecision.from_dict(scattered.to_dict()) == scattered


# What format 2 stored (main before the packed fingerprints): a decision with a recall block.
FORMAT_2 = (
    '{"v":2,"max_tokens":1000,"tokens":640,"strategy":"relevance","kept":["a1b2c3d4e5f60718","0f1e2d3c4b5a6978"],'
    '"at":[3,7],"seen":[9,2400,9000,"o200k_base"],"recalls":[[7,[1],["1122334455667788"],1]],"excerpts":[]}'
)


def test_a_decision_format_2_stored_still_reads():
    assert TrimDecision.from_json(FORMAT_2) == DECISION
    state = json.dumps({"v": 2, "decision": json.loads(FORMAT_2), "pins": ["p1"], "pin_mode": False}).encode()
    assert ChatState.parse(state) == ChatState(decision=DECISION, pins=("p1",))
    written = json.loads(DECISION.to_json())  # as format 3, a recall block's fingerprints packed too
    assert written["kept"] == "a1b2c3d4e5f607180f1e2d3c4b5a6978"
    assert written["recalls"] == [[7, [1], "1122334455667788", 1]]
    assert TrimDecision.from_json(DECISION.to_json()) == DECISION


def test_fingerprints_that_are_not_a_messages_are_kept_as_a_list():
    for kept in (("aa", "bb"), ("A1B2C3D4E5F60718",), ("a1b2c3d4e5f6071 ",), ("a1b2c3d4e5f60718" * 2,)):
        decision = TrimDecision(100, 80, "recent", kept)
        assert decision.to_dict()["kept"] == list(kept) and TrimDecision.from_dict(decision.to_dict()) == decision


@pytest.mark.parametrize(
    ("kept", "at"),
    [
        ("a1b2c3d4e5f607180f1e2d3c4b5a6978", [[0, 10**12]]),  # a damaged count: never spread out
        ("a1b2c3d4e5f607180f1e2d3c4b5a6978", [[3, 3]]),  # three positions for two messages
        ("a1b2c3d4e5f607180f1e2d3c4b5a6978", [3, [7, 0]]),
        ("a1b2c3d4e5f607180f1e2d3c4b5a6978", [3, [-7, 1]]),
        ("a1b2c3d4e5f607180f1e2d3c4b5a6978", [3, [7, True]]),
        ("a1b2c3d4e5f607180f1e2d3c4b5a6978", "3-7"),
    ],
)
def test_damaged_stored_positions_are_dropped_not_spread(kept, at):
    decision = TrimDecision.from_dict(
        {"v": 3, "max_tokens": 9, "tokens": 8, "strategy": "recent", "kept": kept, "at": at}
    )
    assert decision.kept == DECISION.kept and decision.at == ()


@pytest.mark.parametrize("kept", ["a1b2c3d4e5f607180f1e2d", "not hex digits!!", "A1B2C3D4E5F60718", "a1b2c3d4e5f6071 "])
def test_damaged_packed_fingerprints_are_not_a_decision(kept):
    with pytest.raises(ValueError):
        TrimDecision.from_dict({"v": 3, "max_tokens": 9, "tokens": 8, "strategy": "recent", "kept": kept})
    assert ChatState.parse(json.dumps({"v": 2, "decision": {"v": 3, "kept": kept}, "pins": [], "pin_mode": False}))


def test_chat_state_reads_what_the_previous_version_stored():
    """Version 1 (main before typed records) kept each decision as its own JSON text."""
    previous = json.dumps(
        {
            "v": 1,
            "decision": DECISION.to_json(),
            "pins": ["p1"],
            "pin_mode": True,
            "shadow_decision": DECISION.to_json(),
        },
        separators=(",", ":"),
    ).encode()
    assert ChatState.parse(previous) == ChatState(
        decision=DECISION, pins=("p1",), pin_mode=True, shadow_decision=DECISION
    )
    unreadable = json.dumps({"v": 1, "decision": "{broken", "pins": ["p1"], "pin_mode": False}).encode()
    assert ChatState.parse(unreadable) == ChatState(pins=("p1",))  # the pins live on; the decision is not reused
    assert ChatState.parse(b'{"v": 3, "decision": null, "pins": [], "pin_mode": false}') is None


def test_documents_dropped_whole_go_in_the_note_and_an_older_note_reads_without_them():
    """`dropped_documents` is written only when a pass dropped one: a note written before it
    (PREVIOUS_NOTE) reads as none dropped, and a version before this one reads a new note's
    other figures as it did (it knows no such key)."""
    from contextwarden.money.records import ExcerptCounts

    note = TurnNote(mode="enforce", sent_messages=3, shortened=0).with_excerpts(ExcerptCounts(dropped=1))
    raw = note.to_dict()
    assert raw["dropped_documents"] == 1 and raw["excerpted"] == 0
    assert TurnNote.from_dict(raw).excerpt_counts(5) == note.excerpt_counts(5) == ExcerptCounts(dropped=1)
    assert note.excerpt_counts(0) == ExcerptCounts()  # counts over the chat's messages: not this chat's
    assert TurnNote.from_dict(PREVIOUS_NOTE).dropped_documents == 0
    assert "dropped_documents" not in TurnNote(mode="enforce", sent_messages=3, shortened=0).to_dict()
    assert TurnNote.from_dict({**raw, "dropped_documents": "1"}).dropped_documents == 0  # bounded: ints only


def test_a_decision_keeps_its_documents_and_one_written_before_knows_none():
    """The positions of the documents a decision saw go with it (the next turn's shortcut tells
    one it drops without counting it again); a decision stored before has None, not ()."""
    with_docs = replace(DECISION, documents=(1, 4))
    assert with_docs.to_dict()["docs"] == [1, 4] and TrimDecision.from_json(with_docs.to_json()) == with_docs
    assert TrimDecision.from_json(FORMAT_2).documents is None and "docs" not in DECISION.to_dict()
    assert TrimDecision.from_dict({**with_docs.to_dict(), "docs": [4, 1]}).documents is None  # not ascending
    assert TrimDecision.from_dict({**with_docs.to_dict(), "docs": [9]}).documents is None  # past what it saw
    assert with_docs.relocated({3: 3, 7: 7}).documents is None  # the size figures go with the list they describe


def test_a_questions_passages_go_in_the_note_and_an_older_note_reads_without_them():
    """`question_passages` (the latest user message's cut by passages, which a later pass that
    cuts its copy again counts from) is written only when a pass cut it: a note written before
    it reads as none, and one whose figures do not hold it (the client's outlet input) as none."""
    from contextwarden.money.records import ExcerptCounts

    cut = ExcerptCounts(1, (8, 19), question=(8, 19))
    note = TurnNote(mode="enforce", sent_messages=1, shortened=0).with_excerpts(cut)
    raw = note.to_dict()
    assert raw["question_passages"] == [8, 19] and raw["passages"] == [8, 19] and raw["excerpted"] == 1
    assert TurnNote.from_dict(raw).excerpt_counts(1) == note.excerpt_counts(1) == cut
    assert TurnNote.from_dict(PREVIOUS_NOTE).question_passages is None
    assert (
        "question_passages"
        not in TurnNote(mode="enforce", sent_messages=1).with_excerpts(ExcerptCounts(1, (3, 9))).to_dict()
    )
    assert TurnNote.from_dict({**raw, "question_passages": [9, 8]}).question_passages is None  # sent <= in all
    assert TurnNote.from_dict({**raw, "question_passages": [9, 20]}).excerpt_counts(1).question == (
        0,
        0,
    )  # over passages
    assert replace(note, question_passages=None).excerpt_counts(1) == replace(cut, question=(0, 0))
