"""Issue 15: the trim is right in chats as Open WebUI really makes them: pins are mandatory,
tool definitions and response formats are counted, a cold worker fills its budget, the fill is
told. Each test failed before its fix."""

from __future__ import annotations

import pytest

from contextwarden.flags import Flags
from contextwarden.status import TurnChoice, status_line
from contextwarden.trim import trim_messages

from chats import check_contract
from test_filter import Events, make_filter
from test_filter_state import send

MODEL = "gpt-4o"
PIN_BUDGET = 2_976


def words(seed: int, count: int) -> str:
    vocabulary = "river lantern copper meadow signal harbor quartz willow ember falcon orbit cedar".split()
    return " ".join(vocabulary[(seed * 7 + k * 3) % len(vocabulary)] for k in range(count))


def pinned_text(counter) -> str:
    text = "Project notes to keep: " + words(1, 1_380)
    assert 1_350 <= counter.count_text(text, MODEL) <= 1_450
    return text


# --- item 2: a pin keeps the message -----------------------------------------------------------


def test_pin_is_mandatory_under_the_low_watermark(counter):
    """A ~1,400-token pin in a 2,976-token budget: the watermark and growth room shrink the
    target below what the pin costs, yet the pin is sent (it was dropped before)."""
    pin = {"role": "user", "content": pinned_text(counter)}
    chat = [{"role": "system", "content": "Be helpful."}, pin, {"role": "assistant", "content": words(2, 300)}]
    for i in range(6):
        chat += [{"role": "user", "content": f"q{i} " + words(i, 250)}, {"role": "assistant", "content": words(i + 9, 600)}]
    chat.append({"role": "user", "content": "And now? " + words(40, 300)})
    result = trim_messages(chat, max_tokens=PIN_BUDGET, model=MODEL, token_counter=counter, pinned=[1])
    assert 1 in result.kept
    check_contract(chat, result, counter, MODEL)


def test_pins_over_the_budget_are_shortened_not_dropped(counter):
    """Pins alone over the budget: cut middle-out with the marker, and the trim says so."""
    chat = [{"role": "system", "content": "Be helpful."}]
    for i in range(3):
        chat += [{"role": "user", "content": pinned_text(counter) + f" part {i}"}, {"role": "assistant", "content": "ok"}]
    chat.append({"role": "user", "content": "Summarise the notes."})
    result = trim_messages(chat, max_tokens=PIN_BUDGET, model=MODEL, token_counter=counter, pinned=[1, 3, 5])
    check_contract(chat, result, counter, MODEL)
    assert result.tokens_after <= PIN_BUDGET and not result.over_budget
    assert set(result.shortened) & {1, 3, 5} and set(result.kept) | set(result.shortened) >= {1, 3, 5}
    assert any("pinned" in note for note in result.notes)
    assert "pinned messages shortened" in status_line(TurnChoice.of(result, result.messages), Flags())
    assert all("cut by contextwarden" in m["content"] for i, m in zip(sorted(result.kept + result.shortened), result.messages)
               if i in result.shortened)


async def test_pinned_message_survives_many_turns_in_the_filter(counter, unique):
    """Through the filter, with its stored decision and default watermark: the pinned ~1,400
    tokens are sent on every later turn of a 2,976-token budget, and a shortened pin is named."""
    f = make_filter(counter, max_context_tokens=PIN_BUDGET, reserve_output_tokens=0)
    user_id, chat_id = f"u-{unique}", f"c-{unique}"
    text = pinned_text(counter)
    chat = [{"role": "system", "content": "Be helpful."}, {"role": "user", "content": text + " !pin"}]
    await send(f, chat, user_id, chat_id)
    for i in range(8):
        chat = chat + [{"role": "assistant", "content": words(i, 700)}, {"role": "user", "content": f"next {i} " + words(i + 3, 120)}]
        events = Events()
        sent = (await send(f, chat, user_id, chat_id, events=events))["messages"]
        assert any(m["content"] == text for m in sent), f"pin dropped on turn {i}"
        assert counter.count_messages(sent, MODEL) <= PIN_BUDGET
    assert "→" in events.statuses[-1]  # the chat was being trimmed all along
