"""Inline flags: each flag, the allowlist, text left alone when it is not a flag, copies not edits."""

from __future__ import annotations

import pytest

from contextwarden.chatstate import ChatState, chat_state_key
from contextwarden.flags import DEFAULT_ALLOWED_FLAGS, FLAG_NAMES, Flags, parse_flag_names, pin_fingerprint, read_flags
from contextwarden.valves import Valves, read_settings

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
    assert content == text and flags == Flags()


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
    assert parse_flag_names(" !Budget, keep  pin,+pin ,-pin") == (frozenset({"budget", "keep", "pin", "+pin", "-pin"}), [])
    assert parse_flag_names("*") == (ALL, [])
    assert parse_flag_names("pin, loud, !x") == (frozenset({"pin"}), ["loud", "!x"])
    assert "full" not in DEFAULT and DEFAULT == ALL - {"full"}


def test_allowlist_valve_reports_unknown_names():
    settings, problems = read_settings(Valves(allowed_user_flags="pin, shout"))
    assert settings.allowed_flags == frozenset({"pin"})
    assert [p.valve for p in problems] == ["allowed_user_flags"] and "shout" in str(problems[0])
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
