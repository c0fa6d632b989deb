"""Inline flags: each flag, the allowlist, text left alone when it is not a flag, copies not edits."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextwarden.core.flags import (
    DEFAULT_ALLOWED_FLAGS,
    FLAG_NAMES,
    MAX_FLAG_SCAN_CHARS,
    Flags,
    code_spans,
    parse_flag_names,
    pin_fingerprint,
    read_flags,
)
from contextwarden.face.valves import Valves, read_settings
from contextwarden.state.chatstate import ChatState, chat_state_key

from chats import frozen

ALL = frozenset(FLAG_NAMES)
DEFAULT, _ = parse_flag_names(DEFAULT_ALLOWED_FLAGS)


def user(content) -> dict:
    return {"role": "user", "content": content}


def read_one(text: str, allowed=ALL):
    read = read_flags([{"role": "system", "content": "sys"}, user(text)], allowed=allowed)
    return read.messages[1]["content"], read.flags


@pytest.mark.parametrize(
    ("text", "expected", "flags"),
    [
        ("!full Tell me everything", "Tell me everything", Flags(full=True, used=("!full",))),
        ("Short please !budget=2000", "Short please", Flags(budget=2000, used=("!budget=2000",))),
        ("!keep=3 go on", "go on", Flags(keep=3, used=("!keep=3",))),
        ("Remember: my id is 42 !pin", "Remember: my id is 42", Flags(pin=True, used=("!pin",))),
        ("!nosum what now", "what now", Flags(nosum=True, used=("!nosum",))),
        ("!+pin from here on", "from here on", Flags(sticky_pin=True, used=("!+pin",))),
        ("enough !-pin", "enough", Flags(sticky_pin=False, used=("!-pin",))),
    ],
)
def test_each_flag_is_read_and_removed(text, expected, flags):
    assert read_one(text) == (expected, flags)


def test_several_flags_case_and_last_value_wins():
    text, flags = read_one("!PIN a !Budget=900 b !budget=500 !keep=2 c !+pin !-pin")
    assert text == "a b c"
    assert (flags.pin, flags.budget, flags.keep, flags.sticky_pin) == (True, 500, 2, False)
    assert flags.used == ("!pin", "!budget=900", "!budget=500", "!keep=2", "!+pin", "!-pin")


@pytest.mark.parametrize(
    "text",
    [
        "!budget=abc please",
        "!budget= please",
        "!budget=0 please",
        "!budget=2k please",
        "!keep=0 go",
        "!keep=-1 go",
        "!foo bar",
        "!pinned note",
        "!pin, then",
        "mail me at a!b.com",
        "wow!pin",
        "see `!pin` and ``!full``",
        "```\n!pin\n!budget=100\n```",
        "~~~python\nx = '!nosum'\n~~~",
        "unclosed fence\n```\n!pin",
        "!! !",
        "",
    ],
)
def test_unknown_malformed_and_code_are_left_untouched(text):
    content, flags = read_one(text)
    assert content == text and replace(flags, malformed=()) == Flags()


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("!budget=abc please", ("!budget=abc",)),
        ("!budget= please", ("!budget=…",)),
        ("!BUDGET=2k please !budget=2k", ("!budget=2k",)),
        ("!keep=-1 go !keep=0", ("!keep=-1", "!keep=0")),
        ("!budget=2000. and !budget=<b>x</b>", ("!budget=2000.", "!budget=…")),
        ("see `!budget=2k` and\n```\n!keep=x\n```", ()),
        ("!budget=2000 fine", ()),
        ("!budget=1 !budget=2 !budget=x !budget=y !budget=z !budget=w", ("!budget=x", "!budget=y", "!budget=z")),
    ],
)
def test_number_flags_written_wrong_are_listed_to_say_back(text, said):
    """Left in the text as before; named so the status line can say they were not understood."""
    content, flags = read_one(text)
    assert flags.malformed == said and (content == text) == (not flags.used)


def test_a_number_flag_written_wrong_is_listed_only_in_the_latest_question_and_in_range():
    read = read_flags([user("!budget=2k old"), {"role": "assistant", "content": "ok"}, user("new")], allowed=ALL)
    assert read.flags.malformed == ()
    assert read_one("!budget=2k " + "x" * MAX_FLAG_SCAN_CHARS)[1].malformed == ()
    parts = [{"type": "text", "text": "look"}, {"type": "text", "text": "!keep=two"}]
    assert read_flags([user(parts)], allowed=ALL).flags.malformed == ("!keep=two",)


def test_flag_next_to_code_still_counts():
    content, flags = read_one("`!pin` is how you pin !pin\n```\n!nosum\n```")
    assert content == "`!pin` is how you pin\n```\n!nosum\n```" and flags.used == ("!pin",)


def test_line_layout_survives_removal():
    assert read_one("first line\n!pin\nsecond line")[0] == "first line\nsecond line"
    assert read_one("a !nosum\n\nb")[0] == "a\n\nb"
    assert read_one("!budget=300\n\ncode follows")[0] == "code follows"


def test_disallowed_flags_stay_in_text_and_are_reported():
    content, flags = read_one("!full !pin all of it", allowed=DEFAULT)
    assert content == "!full all of it"
    assert flags.full is False and flags.pin is True
    assert flags.used == ("!pin",) and flags.refused == ("!full",)


def test_no_flags_allowed_means_plain_text():
    content, flags = read_one("!pin !budget=10 hi", allowed=frozenset())
    assert content == "!pin !budget=10 hi"
    assert flags.used == () and flags.refused == ("!pin", "!budget=10")


def test_input_is_never_mutated_and_untouched_messages_are_the_same_dicts():
    chat = [
        {"role": "system", "content": "!pin system text is not a user message"},
        user("old question !pin"),
        {"role": "assistant", "content": "!nosum answer"},
        user("plain question"),
        user("newest !budget=700 question"),
    ]
    before = frozen(chat)
    read = read_flags(chat, allowed=ALL)
    assert frozen(chat) == before
    assert read.messages[0] is chat[0] and read.messages[2] is chat[2] and read.messages[3] is chat[3]
    # older user messages lose their flag text too, but their flags do not act again
    assert read.messages[1] == {"role": "user", "content": "old question"} and read.messages[1] is not chat[1]
    assert read.messages[4]["content"] == "newest question"
    assert read.flags == Flags(budget=700, used=("!budget=700",)) and read.latest_user == 4
    assert read.changed(chat) and not read_flags(read.messages, allowed=ALL).changed(read.messages)


def test_list_content_text_parts():
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    chat = [user([{"type": "text", "text": "What is this? !pin"}, image, {"type": "text", "text": "!nosum"}])]
    before = frozen(chat)
    read = read_flags(chat, allowed=ALL)
    assert frozen(chat) == before
    parts = read.messages[0]["content"]
    assert parts == [{"type": "text", "text": "What is this?"}, image] and parts[1] is image
    assert read.flags.pin and read.flags.nosum


def test_flags_only_in_latest_user_message_act():
    chat = [user("!full long ago"), {"role": "assistant", "content": "ok"}, user("now")]
    read = read_flags(chat, allowed=ALL)
    assert read.flags == Flags() and read.messages[0]["content"] == "long ago"


def test_flags_round_trip_through_metadata():
    flags = read_one("!pin !budget=900 !keep=2 !+pin !nosum x !full", allowed=DEFAULT)[1]
    assert Flags.from_dict(flags.to_dict()) == flags


def test_parse_flag_names():
    assert parse_flag_names("") == (frozenset(), [])
    assert parse_flag_names(" !Budget, keep  pin,+pin ,-pin") == (
        frozenset({"budget", "keep", "pin", "+pin", "-pin"}),
        [],
    )
    assert parse_flag_names("*") == (ALL, [])
    assert parse_flag_names("pin, loud, !x") == (frozenset({"pin"}), ["loud", "!x"])
    assert "full" not in DEFAULT and DEFAULT == ALL - {"full"}


def test_allowlist_valve_reports_unknown_names():
    settings, problems = read_settings(Valves(allowed_user_flags="pin, shout"))
    assert settings.allowed_flags == frozenset({"pin"})
    assert [p.valve for p in problems] == ["allowed_user_flags"] and "1 unknown flag name" in str(problems[0])
    assert "shout" not in str(problems[0])  # a valve's value is never echoed into status lines
    assert read_settings(Valves())[0].allowed_flags == DEFAULT


def test_pin_fingerprint_ignores_flags_and_spacing_not_words():
    assert pin_fingerprint(user("remember  this !pin")) == pin_fingerprint(user("remember this"))
    assert pin_fingerprint(user([{"type": "text", "text": "remember this"}])) == pin_fingerprint(user("remember this"))
    assert pin_fingerprint(user("remember that")) != pin_fingerprint(user("remember this"))
    assert pin_fingerprint({"role": "assistant", "content": "remember this"}) != pin_fingerprint(user("remember this"))


def test_pin_mode_semantics():
    a, b, c = "fa", "fb", "fc"
    state = ChatState().with_flags(Flags(pin=True), a)
    assert state.pins == (a,) and not state.pin_mode
    state = state.with_flags(Flags(), b)  # no flag: not pinned
    assert state.pins == (a,)
    state = state.with_flags(Flags(sticky_pin=True), b)  # !+pin pins its own message and what follows
    state = state.with_flags(Flags(), c)
    assert state.pins == (a, b, c) and state.pin_mode
    state = state.with_flags(Flags(sticky_pin=False), "fd")  # !-pin: not pinned; earlier pins stay
    assert state.pins == (a, b, c) and not state.pin_mode
    state = state.with_flags(Flags(sticky_pin=False, pin=True), "fe")  # an explicit !pin still pins
    assert state.pins[-1] == "fe"
    assert ChatState.from_bytes(state.to_bytes()) == state


def test_chat_state_bytes_and_keys():
    assert ChatState.from_bytes(None) == ChatState()
    assert ChatState.from_bytes(b"not json") == ChatState()
    assert ChatState.from_bytes(b'{"v": 99, "pins": ["x"]}') == ChatState()
    assert chat_state_key("u1", "") is None and chat_state_key("", "c1") is None
    key = chat_state_key("u1", "c1")
    assert key != chat_state_key("u2", "c1") and key != chat_state_key("u1", "c2")
    assert "u1" not in key and "c1" not in key


# -- hostile shapes (issue 13, item 2) ---------------------------------------------------------


def _commonmark_inline(text: str) -> list[tuple[int, int]]:
    """The CommonMark pairing written the obvious (quadratic) way: each run looks ahead for
    the next run of its length; an unpaired run is text and the search goes on after it."""
    runs, i = [], 0
    while i < len(text):
        if text[i] == "`":
            j = i
            while j < len(text) and text[j] == "`":
                j += 1
            runs.append((i, j))
            i = j
        else:
            i += 1
    spans, k = [], 0
    while k < len(runs):
        partner = next((m for m in range(k + 1, len(runs)) if runs[m][1] - runs[m][0] == runs[k][1] - runs[k][0]), None)
        if partner is None:
            k += 1
        else:
            spans.append((runs[k][0], runs[partner][1]))
            k = partner + 1
    return spans


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="`` a!", max_size=60))
def test_inline_code_spans_pair_backtick_runs_of_equal_length(text):
    assert code_spans(text) == _commonmark_inline(text)


def _python_lines(fn, *args, **kwargs) -> int:
    """How many lines of Python `fn(*args)` runs: a deterministic measure of work."""
    steps = 0

    def tracer(frame, event, arg):
        nonlocal steps
        if event == "line":
            steps += 1
        return tracer

    sys.settrace(tracer)
    try:
        fn(*args, **kwargs)
    finally:
        sys.settrace(None)
    return steps


@pytest.mark.parametrize("unit", ["`", "` ", "``x`", "```\n"])
def test_backtick_runs_cost_linear_work(unit):
    # `!pin` then N backticks cost 1.6 s at 8k and 22 s at 32k (a backtracking regex): now the
    # work grows with the text (4x the text, at most ~4x the steps), and the flag still acts.
    small, large = "!pin " + unit * (2_000 // len(unit)), "!pin " + unit * (8_000 // len(unit))
    ratio = _python_lines(code_spans, large) / max(1, _python_lines(code_spans, small))
    assert ratio <= 4.5, ratio
    for n in (8_000, 32_000):
        body = unit * (n // len(unit))
        content, flags = read_one("!pin " + body)
        assert flags.pin and content == body.strip()


def test_flags_are_read_in_texts_up_to_the_limit_only():
    head = "x " * ((MAX_FLAG_SCAN_CHARS - 5) // 2)
    assert read_one("!pin " + head)[1].pin and len("!pin " + head) <= MAX_FLAG_SCAN_CHARS
    long = "!pin " + head + "xx"
    assert read_one(long) == (long, Flags())  # over the limit: sent as written, like any text
    assert _python_lines(read_one, "!pin " + "` " * 500_000) < 100


def test_a_second_read_finds_nothing_more():
    # Flags past a scan window came into reach once earlier ones were removed: request (which
    # reads what inlet sent) removed more than inlet, and pins were looked up by another text.
    text = "!pin " * 4_000 + "tail " * 4_000 + "!nosum"
    assert len(text) > MAX_FLAG_SCAN_CHARS > len(text) - 4_000 * 5
    once = read_flags([user(text)], allowed=ALL).messages
    assert read_flags(once, allowed=ALL).messages[0] is once[0]
    assert pin_fingerprint(once[0]) == pin_fingerprint(user(text))
    short = "!pin " * 1_000 + "tail !nosum"
    once = read_flags([user(short)], allowed=ALL).messages
    assert once[0]["content"] == "tail" and read_flags(once, allowed=ALL).messages[0] is once[0]


def test_older_messages_are_scanned_once_per_text():
    # Older user messages come back on every turn: the code spans of each are found once.
    chat = [user("!pin " + "` " * 5_000 + str(i)) for i in range(20)] + [user("now")]
    first = _python_lines(read_flags, chat, allowed=ALL)
    again = _python_lines(read_flags, [dict(m) for m in chat], allowed=ALL)
    assert again * 5 < first
    older = read_flags(chat, allowed=ALL).messages[:-1]  # the last, "now", has no flag
    assert all(m["content"] == c["content"][5:] for m, c in zip(older, chat[:-1], strict=True))


def test_with_no_flag_allowed_older_messages_are_not_read():
    chat = [user("!pin " + "` " * 5_001 + str(i)) for i in range(20)] + [user("!pin now")]
    assert _python_lines(read_flags, chat, allowed=frozenset()) < 1_000  # first: before any memo
    read = read_flags(chat, allowed=frozenset())
    assert read.messages == chat and all(a is b for a, b in zip(read.messages, chat, strict=True))
    assert read.flags.refused == ("!pin",)


def test_removing_a_flag_never_exposes_one_that_was_code():
    # Found by the property suite: "!PIN ```" is not a fence line, but it is once the flag is
    # removed, and the last !PIN (inside the following fence) then stood outside code: a second
    # read (request after inlet) removed it and the pin fingerprint changed with stripping.
    text = "```\n```\n!PIN ```\n```\n!PIN"
    read = read_flags([user(text)], allowed=ALL)
    assert read.messages[0]["content"] == text and read.flags == Flags()
    assert read_flags(read.messages, allowed=ALL).messages[0] is read.messages[0]
    assert pin_fingerprint(user(text)) == pin_fingerprint(read.messages[0])
    assert read_one("!pin\n```\ncode\n```") == ("```\ncode\n```", Flags(pin=True, used=("!pin",)))


def test_stripping_never_turns_a_flag_into_code():
    """Found by the property test: removing `!budget=1 !keep=1 ` put the ``` at the start of its
    line, opening a fence over the `!pin` below, so the pin's fingerprint changed. Such a text is
    left as written."""
    chat = [{"role": "user", "content": "!BUDGET=1 !KEEP=1 ```\n!PIN"}]
    read = read_flags(chat, allowed={"budget", "keep"})
    assert read.messages[0] is chat[0]
    assert pin_fingerprint(read.messages[0]) == pin_fingerprint(chat[0])
