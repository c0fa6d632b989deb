"""Status lines: what they say matches the numbers, and never contradicts itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contextwarden.flags import Flags
from contextwarden.records import TurnChoice
from contextwarden.savings import Savings
from contextwarden.status import shadow_status_line, status_line

from helpers import Events, make_filter
from turns import run_turn

BUILTIN_TOOLS = json.loads((Path(__file__).parent / "fixtures" / "owui_builtin_tools_0.12.4.json").read_text("utf-8"))


def lines(choice: TurnChoice) -> list[str]:
    return [status_line(choice, Flags()), shadow_status_line(choice, Flags(), Savings(0, 0, None), True)]


@pytest.mark.parametrize(("tokens", "over"), [(900, True), (900, False), (400, True)])
def test_an_untouched_chat_over_its_budget_never_fits(tokens, over):
    # Before: "Context 3 messages · 900 tokens (fits 500) · still over budget".
    choice = TurnChoice([{}] * 3, 3, tokens, tokens, 500, "exact", over_budget=over)
    for line in lines(choice):
        assert "fits" not in line and "(budget 500)" in line and line.endswith("· still over budget"), line


def test_an_untouched_chat_within_its_budget_fits():
    for line in lines(TurnChoice([{}] * 3, 3, 400, 400, 500, "exact")):
        assert "(fits 500)" in line and "over budget" not in line, line


async def test_a_mandatory_part_over_the_budget_is_told_once(counter):
    # The current question holds an image (765 tokens, never cut) over a 100-token budget.
    f = make_filter(counter, max_context_tokens=100, reserve_output_tokens=0)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    run = await run_turn(f, [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}])
    context = [s for s in run.events.statuses if s.startswith("Context")]
    assert len(context) == 1  # one line a turn: the request pass changes nothing, so it says nothing
    for line in context:
        assert line.count("over budget") == 1 and "fits" not in line, line


# -- what is left showing after a reply (issue 17 items 1, 2, 5) -------------------------------


def long_chat(turns: int = 12) -> list[dict]:
    chat: list[dict] = [{"role": "system", "content": "Be brief."}]
    for i in range(turns):
        chat += [
            {"role": "user", "content": f"Question {i} about the harbour " * 20},
            {"role": "assistant", "content": f"Answer {i} about the lantern " * 20},
        ]
    return chat + [{"role": "user", "content": "And now?"}]


async def test_one_context_line_a_turn_and_the_last_line_says_what_the_trim_did(counter):
    f = make_filter(counter, max_context_tokens=1_000, reserve_output_tokens=300)
    chat = long_chat()
    run = await run_turn(f, chat)
    sent = run.after_request["messages"]
    assert len(sent) < len(chat)
    statuses = run.events.statuses
    assert len(statuses) == 2  # the turn's one context line (said by the request pass), then usage
    assert statuses[0].startswith(f"Context {len(chat)} → {len(sent)} messages · ")
    assert statuses[-1].endswith(f" · trimmed {len(chat)} → {len(sent)} messages"), statuses[-1]


async def test_the_turn_has_one_context_line_from_the_request_pass_with_its_tools(counter):
    # Open WebUI 0.12 calls inlet before it adds the tool definitions and request after: the
    # inlet's line would be contradicted by the request's; only the request pass speaks.
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=300)
    tools = BUILTIN_TOOLS[:4]
    metadata = {"chat_id": "tools", "user_id": "u1", "message_id": "m1"}
    hooks = {"__user__": {"id": "u1"}, "__metadata__": metadata}
    events = Events()
    body = {"model": "gpt-4o", "messages": long_chat(), "stream": True, "metadata": metadata}
    first = await f.inlet(body, __event_emitter__=events, **hooks)
    assert not [s for s in events.statuses if s.startswith("Context")]  # the inlet's line waits
    await f.request({**first, "tools": tools}, __event_emitter__=events, **hooks)
    context = [s for s in events.statuses if s.startswith("Context")]
    assert len(context) == 1 and " for tool definitions" in context[0], context
    assert context[0].startswith(f"Context {len(long_chat())} → "), context


async def test_a_document_the_inlet_shortened_is_still_told_by_the_request_pass(counter):
    # The browser test's first turn: one pasted document, cut by the inlet (1 message stays 1);
    # the request pass sees the cut copy and must still count from the document as pasted.
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=300)
    document = " ".join(f"Paragraph {n}: the quartz lantern by the river harbor keeps signal {n}." for n in range(150))
    metadata = {"chat_id": "doc", "user_id": "u1", "message_id": "m1"}
    hooks = {"__user__": {"id": "u1"}, "__metadata__": metadata}
    events = Events()
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": document}], "metadata": metadata}
    first = await f.inlet(body, __event_emitter__=events, **hooks)
    await f.request({**first, "tools": BUILTIN_TOOLS[:1]}, __event_emitter__=events, **hooks)
    [line] = [s for s in events.statuses if s.startswith("Context")]
    pasted = counter.count_messages(body["messages"], "gpt-4o")
    assert line.startswith("Context 1 message · ") and " → " in line and " · 1 shortened" in line, line
    before = int(line.split(" · ")[1].split(" → ")[0].replace(",", ""))
    assert before >= pasted, (line, pasted)
    assert metadata["contextwarden"]["tokens_saved"] > 0


async def test_without_a_request_pass_the_outlet_shows_the_inlets_line_once(counter):
    # An Open WebUI without the request hook: the inlet's line is shown after the reply,
    # once, before the usage line (which stays last and says what the trim did).
    f = make_filter(counter, max_context_tokens=1_000, reserve_output_tokens=300)
    chat = long_chat()
    metadata = {"chat_id": "old", "user_id": "u1", "message_id": "m1"}
    hooks = {"__user__": {"id": "u1"}, "__metadata__": metadata}
    events = Events()
    sent = await f.inlet({"model": "gpt-4o", "messages": chat, "metadata": metadata}, __event_emitter__=events, **hooks)
    reply = {"role": "assistant", "content": "The answer."}
    await f.outlet({"model": "gpt-4o", "messages": sent["messages"] + [reply]}, __event_emitter__=events, **hooks)
    statuses = events.statuses
    assert len(statuses) == 2 and statuses[0].startswith(f"Context {len(chat)} → "), statuses
    assert statuses[1].endswith(f" · trimmed {len(chat)} → {len(sent['messages'])} messages"), statuses


async def test_a_request_pass_that_changes_nothing_shows_the_inlets_line_once(counter):
    f = make_filter(counter, max_context_tokens=1_000, reserve_output_tokens=300)
    run = await run_turn(f, long_chat())
    context = [s for s in run.events.statuses if s.startswith("Context")]
    assert len(context) == 1 and run.events.statuses[0] == context[0], run.events.statuses


async def test_a_later_pass_that_adds_content_counts_from_the_turns_start(counter):
    f = make_filter(counter, max_context_tokens=1_000, reserve_output_tokens=300)
    chat = long_chat()
    events_hooks = {"__user__": {"id": "u1"}}
    body = {"model": "gpt-4o", "messages": chat, "metadata": {"chat_id": "rag", "user_id": "u1"}}
    from helpers import Events

    events = Events()
    first = await f.inlet(body, __metadata__=body["metadata"], __event_emitter__=events, **events_hooks)
    rag = {"role": "user", "content": "Context from your documents: " + "harbour facts " * 60}
    grown = {**first, "messages": first["messages"][:-1] + [rag, first["messages"][-1]]}
    await f.request(grown, __metadata__=body["metadata"], __event_emitter__=events, **events_hooks)
    context = [s for s in events.statuses if s.startswith("Context")]
    assert len(context) == 1 and context[0].startswith(f"Context {len(chat)} → "), context


@pytest.mark.parametrize("count", [1, 3])
def test_a_count_that_did_not_change_is_said_once(count):
    # Before: "Context 1 → 1 message · 2,153 → 834 tokens · 1 shortened".
    choice = TurnChoice([{}] * count, count, 2_153, 834, 1_200, "exact", shortened=1)
    said = f"{count} message" + ("s" if count > 1 else "")
    assert status_line(choice, Flags()) == f"Context {said} · 2,153 → 834 tokens · 1 shortened"
    shadow = shadow_status_line(choice, Flags(), Savings(0, 0, None), True)
    assert shadow == f"Shadow: would send {said} · 2,153 → 834 tokens · 1 shortened"
    assert "→ 1 message" not in status_line(choice, Flags())


def test_one_message_is_singular():
    assert status_line(TurnChoice([{}], 1, 40, 40, 500, "exact"), Flags()).startswith("Context 1 message · 40 tokens")
    assert status_line(TurnChoice([{}], 3, 90, 40, 500, "exact"), Flags()).startswith("Context 3 → 1 message · ")


@pytest.mark.parametrize(
    "note",
    [
        {"savings": {"messages_before": 10**30}, "sent_messages": 1},
        {"savings": {"messages_before": "9"}, "sent_messages": 1},
        {"savings": {"messages_before": 3}, "sent_messages": 9},
        {"savings": [], "sent_messages": True},
        {},
    ],
)
def test_the_trim_summary_ignores_a_note_it_did_not_write(note):
    from contextwarden.filter import trim_summary

    assert trim_summary(note) == ""


async def test_valve_problems_are_shown_to_admins_once_a_turn_and_never_to_users(counter):
    f = make_filter(counter, max_context_tokens=1_000, reserve_output_tokens=300, strategy="newest-please")
    told = "strategy must be one of relevance, recent; using relevance"
    admin = await run_turn(f, long_chat(), user={"id": "a1", "role": "admin"}, chat_id="a")
    assert sum(told in s for s in admin.events.statuses) == 1  # inlet only: not request, not outlet
    plain = await run_turn(f, long_chat(), user={"id": "u1", "role": "user"}, chat_id="u")
    assert not any("strategy" in s for s in plain.events.statuses)
    assert all("newest-please" not in s for s in admin.events.statuses)  # never the value


# ---- wording: what a reader can tell from the line alone ----------------------------------------

from decimal import Decimal as D  # noqa: E402

from contextwarden.money import usd  # noqa: E402
from contextwarden.status import ESTIMATE_KEY, savings_status, usage_status  # noqa: E402
from contextwarden.usage import Cost, Usage  # noqa: E402

PRICED = Cost(D("0.0073"), "price_table")


def test_the_usage_line_says_tokens_once_at_the_start():
    # Before: "2,974 in · 7 out · $0.0073": in and out of what?
    assert usage_status(Usage(2_974, 7), False, PRICED, True) == "2,974 tokens in · 7 out · $0.0073"
    cached = usage_status(Usage(2_974, 7, cached_tokens=2_048), False, PRICED, True)
    assert cached == "2,974 tokens in (2,048 cached) · 7 out · $0.0073"


def test_the_estimate_mark_is_explained_once_on_the_line_that_carries_it():
    # Before: "~2,974 in · ~7 out · ~$0.0073" and nothing said what ~ meant.
    line = usage_status(Usage(2_974, 7), True, PRICED, True)
    assert line == f"~2,974 tokens in · ~7 out · ~$0.0073 · {ESTIMATE_KEY}" and line.count(ESTIMATE_KEY) == 1
    assert ESTIMATE_KEY.startswith("~ = estimated")
    assert "~" not in usage_status(Usage(2_974, 7), False, PRICED, True)  # real usage: no mark, no key


def test_savings_say_about_in_words_never_minus_tilde():
    # Before: "saved ~$0.0054" on the usage line and "(−~$0.00054)" on the shadow line.
    saving = Savings(26_000, 8_000, D("0.00054"))
    assert savings_status(saving, False) == " · saved about $0.0005 vs untrimmed"
    shadow = shadow_status_line(TurnChoice([{}] * 2, 9, 26_000, 8_000, 8_000, "exact"), Flags(), saving, True)
    assert shadow == "Shadow: would send 2 of 9 messages · 26,000 → 8,000 tokens, saving about $0.0005"
    for text in (savings_status(saving, True), shadow):
        assert "~" not in text and "−" not in text and "(+" not in text


@pytest.mark.parametrize(
    ("amount", "shown"),
    [
        ("0.0000071", "<$0.0001"),  # before: $0.0000071
        ("0.00054", "$0.0005"),  # before: $0.00054 (never finer than a hundredth of a cent)
        ("0.0073", "$0.0073"),
        ("0.054", "$0.054"),
        ("12.345", "$12.35"),
        ("0", "$0"),
    ],
)
def test_one_money_rule_for_every_line(amount, shown):
    assert usd(D(amount)) == shown
    assert usage_status(Usage(10, 2), False, Cost(D(amount), "price_table"), True).endswith(" · " + shown)


@pytest.mark.parametrize(
    "value", [None, 3, "", "usage forged", "Context 1 message\nforged", "Context " + "x" * 2_000, ["Context 1"]]
)
def test_a_waiting_line_the_filter_did_not_write_is_not_shown(value):
    from contextwarden.status import PENDING_KEY, pending_line

    assert pending_line({PENDING_KEY: value}) is None
    assert pending_line({PENDING_KEY: "Context 3 messages · 90 tokens (fits 500)"}) is not None
