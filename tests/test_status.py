"""Status lines: what they say matches the numbers, and never contradicts itself."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import replace
from pathlib import Path

import pytest

from contextwarden.core.excerpt import split_chunks
from contextwarden.core.flags import FLAG_NAMES, Flags, read_flags
from contextwarden.core.trim import trim_messages
from contextwarden.face.budget import fixed_cost
from contextwarden.face.status import detail_line, shadow_status_line, status_line
from contextwarden.money.records import ExcerptCounts, TurnChoice
from contextwarden.money.savings import Savings

from helpers import Events, body_of, chat_of, make_filter, quoted_whole, sent_count
from turns import reply_of, run_turn

BUILTIN_TOOLS = json.loads((Path(__file__).parent / "fixtures" / "owui_builtin_tools_0.12.4.json").read_text("utf-8"))


def lines(choice: TurnChoice) -> list[str]:
    return [status_line(choice, Flags()), shadow_status_line(choice, Flags())]


@pytest.mark.parametrize(("tokens", "over"), [(900, True), (900, False), (400, True)])
def test_an_untouched_chat_over_its_budget_never_fits(tokens, over):
    # Before: "Context 3 messages · 900 tokens (fits 500) · still over budget".
    choice = TurnChoice([{}] * 3, 3, tokens, tokens, 500, "exact", over_budget=over)
    for line in lines(choice):
        assert "fits" not in line and line.endswith(" · still over budget"), line
    detail = detail_line(choice, Flags())
    assert "fits" not in detail and "(budget 500)" in detail and detail.endswith("· still over budget"), detail


def test_an_untouched_chat_within_its_budget_fits():
    choice = TurnChoice([{}] * 3, 3, 400, 400, 500, "exact")
    assert lines(choice) == ["Whole chat sent", "Shadow: would send the whole chat"]
    assert "(fits 500)" in detail_line(choice, Flags())


async def test_a_mandatory_part_over_the_budget_is_told_once(counter):
    # The current question holds an image (765 tokens, never cut) over a 100-token budget.
    f = make_filter(counter, max_context_tokens=100, reserve_output_tokens=0)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    run = await run_turn(f, [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}])
    [line] = run.events.statuses  # one line a turn, after the reply
    assert line.count("over budget") == 1 and "fits" not in line, line


# -- one plain line a turn, after the reply (issue 31; issue 30: each status costs a save) --------


def long_chat(turns: int = 12) -> list[dict]:
    chat: list[dict] = [{"role": "system", "content": "Be brief."}]
    for i in range(turns):
        chat += [
            {"role": "user", "content": f"Question {i} about the harbour " * 20},
            {"role": "assistant", "content": f"Answer {i} about the lantern " * 20},
        ]
    return chat + [{"role": "user", "content": "And now?"}]


USAGE_PART = re.compile(r"[\d,]+ tokens in · [\d,]+ out · \$[\d.]+( · saved about \$[\d.]+ vs untrimmed)?$")


async def test_one_line_a_turn_after_the_reply_says_what_was_left_out_and_the_cost(counter):
    f = make_filter(counter, max_context_tokens=1_000, reserve_output_tokens=300)
    chat = long_chat()
    run = await run_turn(f, chat, reply=reply_of(usage={"prompt_tokens": 700, "completion_tokens": 9}))
    sent = [m for m in run.after_request["messages"] if any(m is c for c in chat)]  # not the recall blocks
    assert len(sent) < len(chat)
    [line] = run.events.statuses  # before: a context line at request, then a usage line at outlet
    context, usage = line.split(" · ", 1)
    read = len(sent) + quoted_whole(chat, run.after_request["messages"])  # in place, or quoted whole
    assert context == f"Sent {read} of {len(chat)} messages", line
    assert USAGE_PART.match(usage) and usage.startswith("700 tokens in · 9 out · $"), line
    for admin_words in ("→", "fits", "budget", "tool definitions", "Context"):
        assert admin_words not in line, line


async def test_nothing_is_shown_before_the_reply(counter):
    # An emit in inlet or request delays the reply (Open WebUI saves each status into the chat).
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=300)
    tools = BUILTIN_TOOLS[:4]
    metadata = {"chat_id": "tools", "user_id": "u1", "message_id": "m1"}
    hooks = {"__user__": {"id": "u1"}, "__metadata__": metadata}
    events = Events()
    body = {"model": "gpt-4o", "messages": long_chat(), "stream": True, "metadata": metadata}
    first = await f.inlet(body, __event_emitter__=events, **hooks)
    sent = await f.request({**first, "tools": tools}, __event_emitter__=events, **hooks)
    assert events.statuses == []
    note = metadata["contextwarden"]
    own = sum(any(m is c for c in body["messages"]) for m in sent["messages"])  # not the recall blocks
    own += quoted_whole(body["messages"], sent["messages"])
    assert note["pending_line"] == f"Sent {own} of {len(long_chat())} messages"
    assert " for tool definitions" in note["line"] and note["line"].startswith(f"Context {len(long_chat())} → ")
    reply = {"role": "assistant", "content": "The answer."}
    await f.outlet({"model": "gpt-4o", "messages": [*sent["messages"], reply]}, __event_emitter__=events, **hooks)
    assert len(events.statuses) == 1 and events.statuses[0].startswith(note["pending_line"] + " · ")


async def test_the_words_are_stable_from_turn_to_turn(counter):
    # Before: the "before" token count jumped between turns of one chat (10,823; 3,299; 3,329;
    # 10,899): the line now says messages, which only grow by the turn's two.
    f = make_filter(counter, max_context_tokens=1_000, reserve_output_tokens=300)
    chat, said = long_chat(), []
    for turn in range(4):
        run = await run_turn(f, chat, chat_id="stable")
        said.append(re.match(r"Sent (\d+) of (\d+) messages · ", run.events.statuses[0]))
        chat = [*chat, {"role": "assistant", "content": f"Reply {turn}."}, {"role": "user", "content": f"More {turn}?"}]
    assert all(said) and [int(m[2]) for m in said] == [len(long_chat()) + 2 * t for t in range(4)], said


def _passages_in(text: str, sent: str) -> tuple[int, int]:
    """The passages (`excerpt.split_chunks`) of `text` that `sent` holds whole, and how many it has
    (a cut mark after a passage takes its last line break)."""
    chunks = split_chunks(text)
    return sum(chunk.rstrip("\n") in sent for chunk in chunks), len(chunks)


@pytest.mark.parametrize(("tools", "cut_again"), [(1, False), (3, True)])
async def test_a_document_the_inlet_shortened_is_still_told_by_the_request_pass(counter, tools, cut_again):
    # The browser test's first turn: one pasted document, cut by the inlet (1 message stays 1);
    # the request pass sees the cut copy and must still count from the document as pasted: its
    # passages sent of those it has (the copy's own passages, cut again, are fewer: 5 of 8).
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=300)
    document = " ".join(f"Paragraph {n}: the quartz lantern by the river harbor keeps signal {n}." for n in range(150))
    metadata = {"chat_id": "doc", "user_id": "u1", "message_id": "m1"}
    hooks = {"__user__": {"id": "u1"}, "__metadata__": metadata}
    events = Events()
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": document}], "metadata": metadata}
    first = await f.inlet(body, __event_emitter__=events, **hooks)
    sent = await f.request({**first, "tools": BUILTIN_TOOLS[:tools]}, __event_emitter__=events, **hooks)
    copy = sent["messages"][-1]["content"]
    assert (copy != first["messages"][-1]["content"]) is cut_again
    note = metadata["contextwarden"]
    went, total = _passages_in(document, copy)
    told = f"document excerpted: {went} of {total} passages"
    assert note["pending_line"] == f"Sent 1 message, {told}" and 0 < went < total == 19, note
    detail = note["line"]
    pasted = counter.count_messages(body["messages"], "gpt-4o")
    assert detail.startswith("Context 1 message · ") and " → " in detail and f" · {told}" in detail, detail
    assert "shortened" not in detail
    before = int(detail.split(" · ")[1].split(" → ")[0].replace(",", ""))
    assert before >= pasted, (detail, pasted)
    assert note["tokens_saved"] > 0


async def _pasted_then_tools(counter, document: str, tools: int) -> tuple[str, str, dict]:
    """The browser test's first turn: `document` pasted alone in a 1,200-token budget, its inlet
    pass, then its request pass with `tools` of Open WebUI's tool definitions: the inlet's copy,
    what the request pass sent, and the turn's note."""
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=300)
    metadata = {"chat_id": "doc", "user_id": "u1", "message_id": "m1"}
    hooks = {"__user__": {"id": "u1"}, "__metadata__": metadata}
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": document}], "metadata": metadata}
    first = await f.inlet(body, __event_emitter__=Events(), **hooks)
    sent = await f.request({**first, "tools": BUILTIN_TOOLS[:tools]}, __event_emitter__=Events(), **hooks)
    return first["messages"][-1]["content"], sent["messages"][-1]["content"], metadata["contextwarden"]


async def test_a_question_the_request_pass_cut_again_middle_out_is_shortened_to_fit(counter):
    """The inlet cut the pasted document by passages (8 of 19); six tool definitions leave the
    request pass no room for a passage of that copy, and it cuts it middle-out: the model saw a
    few lines, not 8 passages. It read "document excerpted: 8 of 19 passages, shortened to fit"."""
    document = " ".join(f"Paragraph {n}: the quartz lantern by the river harbor keeps signal {n}." for n in range(150))
    copy, sent, note = await _pasted_then_tools(counter, document, 6)
    assert _passages_in(document, copy) == (8, 19) and sent != copy and _passages_in(document, sent)[0] < 8
    assert note["pending_line"] == "Sent 1 message, shortened to fit", note
    assert note["line"].endswith(" · 1 shortened") and "excerpted" not in note["line"], note
    assert "question_passages" not in note and not note.get("excerpted"), note


async def test_a_question_cut_again_is_told_of_the_passages_the_document_has(counter):
    """Paragraphs of one 599-character line: each blank line between them was a passage of its
    own (`split_chunks`: 40, now 21), sent and counted: "6 of 40", where `_passages_in` found 25
    (each blank one "in" the text sent). The request pass that cut the inlet's copy again counts
    the passages it sent of those the document has."""
    said = " ".join(f"Lantern {{n}}.{k} keeps its signal." for k in range(30))
    document = "\n\n".join(said.format(n=n)[:599] for n in range(20)) + "\n\nWhat does it say about lantern 7?"
    copy, sent, note = await _pasted_then_tools(counter, document, 1)
    went, total = _passages_in(document, sent)
    assert total == 21 and sent != copy and 0 < went < _passages_in(document, copy)[0], note
    assert note["pending_line"] == f"Sent 1 message, document excerpted: {went} of 21 passages", note


async def test_the_request_pass_counts_what_the_inlets_recall_block_quotes(counter):
    """A carried turn's inlet quotes older messages in a recall block; the request pass sends
    that block again as it was and its line (the one the user sees) still counts them."""
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=500)
    chat = chat_of(20)
    body = body_of(chat)
    out = await f.inlet(body, __user__={"id": "u1"}, __metadata__=body["metadata"], __event_emitter__=Events())
    await f.request(out, __user__={"id": "u1"}, __metadata__=out["metadata"], __event_emitter__=Events())
    chat = chat + [{"role": "assistant", "content": "Noted well."}, {"role": "user", "content": "What was question 3?"}]
    body = body_of(chat)
    first = await f.inlet(body, __user__={"id": "u1"}, __metadata__=body["metadata"], __event_emitter__=Events())
    sent = await f.request(first, __user__={"id": "u1"}, __metadata__=first["metadata"], __event_emitter__=Events())
    in_place = sum(1 for m in sent["messages"] if any(m is c for c in chat))
    quoted = quoted_whole(chat, sent["messages"])
    assert quoted  # the block is there
    assert body["metadata"]["contextwarden"]["pending_line"] == f"Sent {in_place + quoted} of {len(chat)} messages"


async def test_a_cut_a_later_pass_dropped_is_not_told(counter):
    # The browser test's second turn: the inlet (no tools yet) excerpts the pasted document; the
    # request pass, with 30 tool definitions filling the window, drops that excerpt. Before, the
    # line said "Sent 1 of 3 messages, document excerpted: 6 of 19 passages".
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=300)
    document = " ".join(f"Paragraph {n}: the quartz lantern by the river harbor keeps signal {n}." for n in range(150))
    chat = [
        {"role": "user", "content": document},
        {"role": "assistant", "content": "Hello from the fake backend."},
        {"role": "user", "content": "What did the document say about quartz?"},
    ]
    metadata = {"chat_id": "dropped-cut", "user_id": "u1", "message_id": "m1"}
    hooks = {"__user__": {"id": "u1"}, "__metadata__": metadata}
    first = await f.inlet({"model": "gpt-4o", "messages": chat, "metadata": metadata}, **hooks)
    assert metadata["contextwarden"]["excerpted"] == 1  # the inlet sent an excerpt
    sent = await f.request({**first, "tools": BUILTIN_TOOLS[:30]}, **hooks)
    assert sent["messages"] == [chat[-1]]
    assert metadata["contextwarden"]["pending_line"] == "Sent 1 of 3 messages · tool definitions fill the window"


@pytest.mark.parametrize("mode", ["enforce", "shadow"])
async def test_tool_definitions_filling_the_window_keep_the_inlets_cut_question_told(counter, mode):
    # One pasted document, excerpted by the inlet (no tools yet); 30 tool definitions fill the
    # window at the request pass, which then cuts nothing (`shorten=False`). Enforce sends the
    # inlet's excerpt; shadow's request pass reads the document as pasted and said "Shadow:
    # would send the whole chat · tool definitions fill the window".
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=300, mode=mode)
    document = " ".join(f"Paragraph {n}: the quartz lantern by the river harbor keeps signal {n}." for n in range(150))
    metadata = {"chat_id": f"doc-tools-{mode}", "user_id": "u1", "message_id": "m1"}
    hooks = {"__user__": {"id": "u1"}, "__metadata__": metadata}
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": document}], "metadata": metadata}
    first = await f.inlet(body, **hooks)
    told = "1 message, document excerpted: 8 of 19 passages"
    assert metadata["contextwarden"]["pending_line"].endswith(told), metadata["contextwarden"]
    await f.request({**first, "tools": BUILTIN_TOOLS[:30]}, **hooks)
    said = "Shadow: would send" if mode == "shadow" else "Sent"
    assert metadata["contextwarden"]["pending_line"] == f"{said} {told} · tool definitions fill the window"


@pytest.mark.parametrize("own", ["flag", "valve"])
async def test_a_users_budget_below_the_tool_definitions_says_the_turn_went_over_it(counter, own):
    # Seen in the browser: `!budget=2000` in an 8,000 window, Open WebUI's 30 tool definitions
    # (~3,200 tokens) alone over it. The line said "tool definitions fill the window" (not the
    # window: the user's budget) and not that the turn went over the budget (the log did).
    f = make_filter(counter, max_context_tokens=8_000, reserve_output_tokens=300)
    question = "What is the vault code?" + (" !budget=2000" if own == "flag" else "")
    chat = [*long_chat(), {"role": "user", "content": question}]
    user = {"id": "u1", "valves": f.UserValves(max_context_tokens=2_000) if own == "valve" else None}
    metadata = {"chat_id": f"own-{own}", "user_id": "u1", "message_id": "m1"}
    hooks = {"__user__": user, "__metadata__": metadata}
    first = await f.inlet({"model": "gpt-4o", "messages": chat, "metadata": metadata}, **hooks)
    sent = await f.request({**first, "tools": BUILTIN_TOOLS[:30]}, **hooks)
    tools = fixed_cost({"tools": BUILTIN_TOOLS[:30]}, counter, "gpt-4o").tools
    assert tools + counter.count_messages(sent["messages"], "gpt-4o") > 2_000  # over it indeed
    line = metadata["contextwarden"]["pending_line"]
    assert " · over your budget: tool definitions alone fill it" in line and "window" not in line, line


async def test_without_a_request_pass_the_outlet_shows_the_inlets_words(counter):
    # An Open WebUI without the request hook: the inlet's words, after the reply, in its one line.
    f = make_filter(counter, max_context_tokens=1_000, reserve_output_tokens=300)
    chat = long_chat()
    metadata = {"chat_id": "old", "user_id": "u1", "message_id": "m1"}
    hooks = {"__user__": {"id": "u1"}, "__metadata__": metadata}
    events = Events()
    sent = await f.inlet({"model": "gpt-4o", "messages": chat, "metadata": metadata}, __event_emitter__=events, **hooks)
    reply = {"role": "assistant", "content": "The answer."}
    await f.outlet({"model": "gpt-4o", "messages": sent["messages"] + [reply]}, __event_emitter__=events, **hooks)
    [line] = events.statuses
    assert line.startswith(f"Sent {sent_count(chat, sent['messages'])} of {len(chat)} messages · "), line


async def test_a_later_pass_that_adds_content_counts_from_the_turns_start(counter):
    f = make_filter(counter, max_context_tokens=1_000, reserve_output_tokens=300)
    chat = long_chat()
    body = {"model": "gpt-4o", "messages": chat, "metadata": {"chat_id": "rag", "user_id": "u1"}}
    hooks = {"__user__": {"id": "u1"}, "__metadata__": body["metadata"]}
    first = await f.inlet(body, **hooks)
    rag = {"role": "user", "content": "Context from your documents: " + "harbour facts " * 60}
    grown = {**first, "messages": first["messages"][:-1] + [rag, first["messages"][-1]]}
    await f.request(grown, **hooks)
    note = body["metadata"]["contextwarden"]
    assert re.fullmatch(rf"Sent \d+ of {len(chat)} messages", note["pending_line"]), note["pending_line"]
    assert note["line"].startswith(f"Context {len(chat)} → "), note["line"]


async def test_a_tool_loops_calls_are_counted_with_the_chat_not_as_its_messages(counter):
    """Each call of a tool loop sends the first call's messages and the loop: counted as the
    chat's own, a 22-message chat sent as 14 read "Sent 20 of 22" after three calls and "Whole
    chat sent" from the fourth (its savings gone too: the pass took the body for a fresh chat)."""
    f = make_filter(counter, max_context_tokens=2_000, reserve_output_tokens=0, openrouter_pricing=False)
    chat = chat_of(10)
    metadata = {"chat_id": "c-loop-line", "user_id": "u1", "message_id": "m1"}
    events = Events()
    hooks = {"__user__": {"id": "u1"}, "__metadata__": metadata, "__event_emitter__": events}
    first = (await f.request(await f.inlet(body_of(chat), **hooks), **hooks))["messages"]
    saved = metadata["contextwarden"]["tokens_saved"]
    assert len(first) < len(chat) and saved > 0
    loop: list[dict] = []
    for k in range(5):
        call = {"id": f"call_{k}", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
        loop += [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{k}", "content": f"result {k}"},
        ]
        await f.request(body_of([*first, *loop]), **hooks)
        note = metadata["contextwarden"]
        assert note["pending_line"] == f"Sent {sent_count(chat, first) + len(loop)} of {len(chat) + len(loop)} messages"
        assert note["tokens_saved"] == saved
    await f.outlet(body_of([*chat, *loop, reply_of()]), **hooks)
    assert events.statuses[-1].startswith(f"Sent {sent_count(chat, first) + 10} of {len(chat) + 10} messages · ")


async def test_status_off_shows_nothing_and_the_detail_is_still_logged(counter, caplog):
    caplog.set_level(logging.INFO, logger="contextwarden")
    f = make_filter(counter, max_context_tokens=1_000, reserve_output_tokens=300, show_status=False)
    run = await run_turn(f, long_chat())
    assert run.events.statuses == []
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("contextwarden: Context ")]
    assert logged == [f"contextwarden: {run.metadata['contextwarden']['line']}"] and " → " in logged[0], logged


# -- a window Open WebUI's tool definitions fill: the admin is told once ------------------------


async def test_a_window_the_tool_definitions_fill_is_told_to_admins_once(counter, caplog):
    # Open WebUI 0.12.4 adds its built-in tool definitions to every browser chat: a 3,000 window
    # cannot hold them (issue 31). Before, every turn said it in the collapsed history only.
    caplog.set_level(logging.INFO, logger="contextwarden")
    f = make_filter(counter, max_context_tokens=3_000, reserve_output_tokens=300)
    tools = BUILTIN_TOOLS[:30]
    tokens = fixed_cost({"tools": tools}, counter, "gpt-4o").tools
    assert tokens > 2_700

    async def turn(user: dict, chat_id: str) -> tuple[list[str], list[str]]:
        metadata = {"chat_id": chat_id, "user_id": user["id"], "message_id": "m1"}
        hooks = {"__user__": user, "__metadata__": metadata}
        events = Events()
        first = await f.inlet({"model": "gpt-4o", "messages": long_chat(), "metadata": metadata}, **hooks)
        sent = await f.request({**first, "tools": tools}, __event_emitter__=events, **hooks)
        assert events.statuses == []
        reply = {"role": "assistant", "content": "The answer."}
        await f.outlet({"model": "gpt-4o", "messages": [*sent["messages"], reply]}, __event_emitter__=events, **hooks)
        notices = [e["data"]["content"] for e in events.items if e["type"] == "notification"]
        assert all(e["data"]["type"] == "warning" for e in events.items if e["type"] == "notification")
        return events.statuses, notices

    user, told = await turn({"id": "u1", "role": "user"}, "a")
    assert (
        not told
        and len(user) == 1
        and user[0].startswith(f"Sent 2 of {len(long_chat())} messages · tool definitions fill the window · ")
    )
    admin, told = await turn({"id": "a1", "role": "admin"}, "b")
    assert len(admin) == 1 and admin[0].startswith("Sent 2 of "), admin  # the turn's one line
    [notice] = told  # a notification: shown whole, at once, not saved into the chat
    assert notice.startswith("contextwarden: gpt-4o's window is too small for its tools: 3,000 tokens, 300 kept")
    assert f"the 30 tool definitions Open WebUI adds to each chat take {tokens:,}" in notice
    assert "only the system prompt and the latest message" in notice and "Builtin Tools" in notice
    need = int(re.search(r"max_context_tokens to ([\d,]+) or more", notice)[1].replace(",", ""))
    assert need >= tokens + 300 + 1_000
    again, told = await turn({"id": "a1", "role": "admin"}, "c")
    assert not told and len(again) == 1 and again[0].startswith("Sent 2 of "), again  # told once
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "too small for its tools" in r.getMessage()]
    assert len(warned) == 1  # logged once a process


async def test_a_window_with_room_for_the_chat_is_not_told(counter, caplog):
    caplog.set_level(logging.INFO, logger="contextwarden")
    f = make_filter(counter, max_context_tokens=8_000, reserve_output_tokens=300)
    metadata = {"chat_id": "roomy", "user_id": "a1"}
    hooks = {"__user__": {"id": "a1", "role": "admin"}, "__metadata__": metadata}
    events = Events()
    body = {"model": "gpt-4o", "messages": long_chat(), "tools": BUILTIN_TOOLS[:30], "metadata": metadata}
    sent = await f.request(body, **hooks)
    reply = {"role": "assistant", "content": "The answer."}
    await f.outlet({"model": "gpt-4o", "messages": [*sent["messages"], reply]}, __event_emitter__=events, **hooks)
    assert len(events.items) == 1 and "too small" not in caplog.text  # one status, no notice


async def test_an_attached_file_is_not_told_as_tool_definitions(counter, caplog):
    # Seen in Open WebUI 0.12.4: a file attached in full context to a chat with an 8,000 window
    # made the admin's notice say "the 30 tool definitions ... take 6,818: 382 tokens are left"
    # (3,214 of them tools, the rest the file's passages) and ask for 12,000 or no Builtin Tools.
    from test_sources import DOC, rag

    caplog.set_level(logging.INFO, logger="contextwarden")
    f = make_filter(counter, max_context_tokens=8_000, reserve_output_tokens=800, openrouter_pricing=False)
    metadata = {"chat_id": "file", "user_id": "a1", "message_id": "m1"}
    hooks = {"__user__": {"id": "a1", "role": "admin"}, "__metadata__": metadata}
    question = "Who founded the observatory on the north ridge?"
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": question}], "metadata": metadata}
    first = await f.inlet(body, **hooks)
    first["messages"][-1]["content"] = rag(question, [("report.txt", DOC * 2)])
    events = Events()
    sent = await f.request({**first, "tools": BUILTIN_TOOLS[:30]}, __event_emitter__=events, **hooks)
    assert "the sources" in metadata["contextwarden"]["line"]  # the file took much of the window
    reply = {"role": "assistant", "content": "The answer."}
    await f.outlet({"model": "gpt-4o", "messages": [*sent["messages"], reply]}, __event_emitter__=events, **hooks)
    assert "too small" not in caplog.text
    assert not [e for e in events.items if e["type"] == "notification"]


@pytest.mark.parametrize("count", [1, 3])
def test_a_count_that_did_not_change_is_said_once(count):
    # Before: "Context 1 → 1 message · 2,153 → 834 tokens · 1 shortened".
    choice = TurnChoice([{}] * count, count, 2_153, 834, 1_200, "exact", shortened=1)
    said = f"{count} message" + ("s" if count > 1 else "")
    assert detail_line(choice, Flags()) == f"Context {said} · 2,153 → 834 tokens · 1 shortened"
    cut = "shortened to fit" if count == 1 else "1 shortened to fit"
    assert status_line(choice, Flags()) == f"Sent {said}, {cut}"
    assert shadow_status_line(choice, Flags()) == f"Shadow: would send {said}, {cut}"


def test_a_document_pasted_with_its_question_is_told_as_excerpted(counter):
    """The latest user message alone over the budget (a document pasted with its question) is cut
    by passages, but its line said "Sent 1 message, shortened to fit", as for a middle-out cut:
    nothing of how much of the document the model saw. It is told as a document excerpted now,
    with the passages sent of those the message has (`excerpt.split_chunks`, as excerpts count)."""
    from test_trim import _pasted

    ask = "Who relit the northern lamp of the lighthouse, and when?"
    text = f"Here is a report:\n\n{_pasted(fact_at=21)}\n\n{ask}"
    result = trim_messages([{"role": "user", "content": text}], max_tokens=1_200, model="gpt-4o", token_counter=counter)
    went, total = _passages_in(text, result.messages[-1]["content"])
    assert result.shortened == (0,) and result.shortened_passages == ((0, went, total),) and 2 < went < total
    choice = TurnChoice.of(result, result.messages)
    told = f"document excerpted: {went:,} of {total:,} passages"
    assert lines(choice) == [f"Sent 1 message, {told}", f"Shadow: would send 1 message, {told}"]
    assert detail_line(choice, Flags()).endswith(f" · {told}")


def test_a_document_pasted_with_its_question_is_told_by_its_passages_not_its_blank_lines(counter):
    """A summary asked of a report whose paragraphs are long lines, two blank lines between: the
    second blank line was a passage of its own (`split_chunks`), the spread cut sent blank ones
    and they were told: "11 of 90 passages" where 6 of its 61 went (the ask and 5 of the report's)."""
    from test_excerpt import long_lined

    text = f"Summarize this report.\n\n\n{long_lined()}"
    result = trim_messages([{"role": "user", "content": text}], max_tokens=600, model="gpt-4o", token_counter=counter)
    sent = result.messages[-1]["content"]
    went = 1 + len(set(re.findall(r"Section (\d+)\. ", sent))) + len(set(re.findall(r"meeting (\d+) were", sent)))
    assert result.shortened_passages == ((0, went, 61),) and went > 3


def test_a_cut_middle_out_is_still_shortened_to_fit(counter):
    """What is cut middle-out keeps its words: a system prompt over the budget, and a latest
    question too short for three passages (`shorten._cut_by_passages` then cuts middle-out)."""
    rules = [{"role": "system", "content": "rules " * 2_000}, {"role": "user", "content": "Hi?"}]
    short = [{"role": "user", "content": "word " * 110}]  # one passage
    for chat, budget, said in (
        (rules, 300, "Sent 2 messages, 1 shortened to fit"),
        (short, 60, "Sent 1 message, shortened to fit"),
    ):
        result = trim_messages(chat, max_tokens=budget, model="gpt-4o", token_counter=counter)
        assert result.shortened and not result.shortened_passages
        choice = TurnChoice.of(result, result.messages)
        assert status_line(choice, Flags()) == said and choice.excerpts == ExcerptCounts()
        assert detail_line(choice, Flags()).endswith(" · 1 shortened")


def test_one_message_is_singular():
    assert detail_line(TurnChoice([{}], 1, 40, 40, 500, "exact"), Flags()).startswith("Context 1 message · 40 tokens")
    assert detail_line(TurnChoice([{}], 3, 90, 40, 500, "exact"), Flags()).startswith("Context 3 → 1 message · ")
    assert status_line(TurnChoice([{}], 3, 90, 40, 500, "exact"), Flags()) == "Sent 1 of 3 messages"
    full = TurnChoice([{}], 1, 40, 40, 500, "exact", full=True)
    assert detail_line(full, Flags()).startswith("Context 1 message · 40 tokens (not trimmed: !full")


def test_the_chats_own_messages_are_counted_not_the_filters():
    # a recall block and its acknowledgement went out with 3 of the chat's 9 messages
    choice = TurnChoice([{}] * 5, 9, 9_000, 3_000, 4_000, "exact")
    assert status_line(choice, Flags(), sent=3) == "Sent 3 of 9 messages"


def test_messages_a_block_quotes_whole_count_as_sent(counter):
    """With the embedder a selection quotes some picks in a recall block (`choose_quoting`): the
    model reads them, so the line counts them with the messages sent in place."""
    from test_selection_messages import _lighthouse_chat, _topic_embed

    from contextwarden import trim_messages
    from contextwarden.face.trimpass import _chat_messages_sent

    chat = _lighthouse_chat()
    result = trim_messages(chat, max_tokens=500, model="gpt-4o", token_counter=counter, embed=_topic_embed)
    assert result.recalled and not result.recalled_passages
    choice = TurnChoice.of(result, result.messages)
    sent = _chat_messages_sent(choice)
    assert sent == len(result.kept) + len(result.recalled) < len(chat)
    assert status_line(choice, Flags(), sent=sent) == f"Sent {sent} of {len(chat)} messages"
    assert f" · {len(result.recalled)} recalled" in detail_line(choice, Flags())  # the admin's line says so apart


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

from contextwarden.face.status import (  # noqa: E402
    ESTIMATE_KEY,
    PART_ESTIMATE_KEY,
    savings_status,
    turn_line,
    usage_status,
)
from contextwarden.money.dollars import usd  # noqa: E402
from contextwarden.money.usage import Cost, Estimated, Usage  # noqa: E402

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


def test_only_the_count_the_provider_left_out_is_marked():
    # Before: a reported prompt count was marked `~` with the completion the provider left out,
    # and the key said there was no usage from the provider at all.
    line = usage_status(Usage(70, 3), Estimated(completion=True), PRICED, True)
    assert line == f"70 tokens in · ~3 out · ~$0.0073 · {PART_ESTIMATE_KEY}"
    line = usage_status(Usage(70, 3), Estimated(prompt=True), PRICED, True)
    assert line == f"~70 tokens in · 3 out · ~$0.0073 · {PART_ESTIMATE_KEY}"
    assert usage_status(Usage(70, 3), Estimated(True, True), PRICED, True).endswith(ESTIMATE_KEY)
    assert turn_line(None, line, "today $0.42").endswith(f"today $0.42 · {PART_ESTIMATE_KEY}")


def test_an_estimated_cost_too_small_to_show_reads_in_words():
    # Before: "~8 tokens in · ~3 out · ~<$0.0001": two signs in a row before the amount.
    tiny = Cost(D("0.0000071"), "price_table")
    line = usage_status(Usage(8, 3), True, tiny, True)
    assert line == f"~8 tokens in · ~3 out · under ~$0.0001 · {ESTIMATE_KEY}"
    assert usage_status(Usage(8, 3), False, tiny, True) == "8 tokens in · 3 out · <$0.0001"


async def test_the_estimate_key_ends_the_line_after_the_spend(counter):
    # Before: "Whole chat sent · ~8 tokens in · ~3 out · ~<$0.0001 · ~ = estimated, no usage from
    # the provider · today <$0.0001 of $2.00": the key mid-line, the line not ending as told.
    f = make_filter(counter, daily_limit_usd=2)
    run = await run_turn(f, [{"role": "user", "content": "hello"}])  # the reply reports no usage
    [line] = run.events.statuses
    assert line.endswith(f" · today <$0.0001 of $2.00 · {ESTIMATE_KEY}") and line.count(ESTIMATE_KEY) == 1, line


def test_savings_say_about_in_words_never_minus_tilde():
    # Before: "saved ~$0.0054" on the usage line and "(−~$0.00054)" on the shadow line.
    saving = Savings(26_000, 8_000, D("0.00054"))
    assert savings_status(saving, False) == " · saved about $0.0005 vs untrimmed"
    assert savings_status(saving, True) == " · would save about $0.0005 vs untrimmed"
    for text in (savings_status(saving, True), savings_status(saving, False)):
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
    "value",
    [None, 3, "", "usage forged", "Sent 1 message\nforged", "Sent " + "x" * 2_000, ["Sent 1"], "Context 3 messages"],
)
def test_words_the_filter_did_not_write_are_not_shown(value):
    from contextwarden.face.status import DETAIL_KEY, PENDING_KEY, pending_detail, pending_line

    assert pending_line({PENDING_KEY: value}) is None
    assert pending_line({PENDING_KEY: "Sent 3 of 9 messages"}) == "Sent 3 of 9 messages"
    assert pending_line({PENDING_KEY: "Whole chat sent"}) is not None
    assert pending_detail({DETAIL_KEY: value if value != "Context 3 messages" else "Sent 3"}) is None
    assert pending_detail({DETAIL_KEY: "Context 3 messages · 90 tokens (fits 500)"}) is not None


# -- a long message cut down to its cut mark --------------------------------------------------

SENSOR_ROWS = "\n".join(f"row {n}: station {n % 7} reading {n * 13 % 101} units, status nominal" for n in range(200))
TOOL_CHAT = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Fetch the sensor table."},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "sensors", "arguments": "{}"}}],
    },
    {"role": "tool", "tool_call_id": "c1", "content": SENSOR_ROWS},
    {"role": "assistant", "content": "Here is the table summary: 200 rows."},
    {"role": "user", "content": "Write me a haiku about autumn leaves please."},
]


def test_a_document_with_no_passage_sent_is_said_to_be_left_out():
    # Before: "Sent 6 messages, document excerpted: 0 of 19 passages", which reads as if the
    # model saw some of it.
    left_out = TurnChoice([{}] * 6, 6, 3_000, 400, 400, "exact", excerpts=ExcerptCounts(1, (0, 19)))
    assert lines(left_out) == ["Sent 6 messages, document left out", "Shadow: would send 6 messages, document left out"]
    assert detail_line(left_out, Flags()).endswith(" · document left out")
    both = TurnChoice([{}] * 5, 9, 9_000, 400, 400, "exact", excerpts=ExcerptCounts(2, (0, 7)))
    assert status_line(both, Flags()) == "Sent 5 of 9 messages, 2 documents left out"


def test_one_document_excerpted_and_one_left_out_are_told_apart():
    """Two long messages cut, one of them only to its mark: the line says which, not "2 documents
    excerpted: 1 of 9 passages" (the passages of the one the model saw)."""
    from contextwarden.core.trim_types import TrimResult

    result = TrimResult(
        [{}] * 5,
        (0, 3, 4),
        (5, 6, 7, 8),
        (1, 2),
        9_000,
        400,
        400,
        "exact",
        excerpted=(1, 2),
        passages=((0, 12), (1, 9)),
    )
    choice = TurnChoice.of(result, result.messages)
    assert choice.excerpts == ExcerptCounts(2, (1, 9), 1, "document")
    assert status_line(choice, Flags()) == "Sent 5 of 9 messages, document excerpted: 1 of 9 passages, 1 left out"
    tools = replace(result, tool_results=(2,))  # one of them a tool result: neither word fits both
    assert status_line(TurnChoice.of(tools, tools.messages), Flags()).endswith(
        ", long message excerpted: 1 of 9 passages, 1 left out"
    )
    some = TurnChoice([{}] * 6, 6, 3_000, 400, 400, "exact", excerpts=ExcerptCounts(1, (1, 19)))
    assert status_line(some, Flags()) == "Sent 6 messages, document excerpted: 1 of 19 passages"


async def test_a_tool_result_cut_to_its_mark_is_told_left_out_after_the_reply(counter):
    # An old tool result too large for what the question left: its tool call stays answered by
    # a copy holding only the cut mark, through both passes (the request pass sees that copy).
    f = make_filter(counter, max_context_tokens=500, reserve_output_tokens=0)
    run = await run_turn(f, TOOL_CHAT, reply=reply_of(usage={"prompt_tokens": 300, "completion_tokens": 9}))
    note = run.metadata["contextwarden"]
    assert note["excerpted"] == 1 and note["left_out"] == 1 and note["passages"] == [0, 0], note
    assert note["excerpt_kind"] == "tool result"
    [line] = run.events.statuses
    assert line.startswith("Sent 6 messages, tool result left out · 300 tokens in · "), line
    assert "passages" not in line


def test_a_flag_written_twice_is_told_by_the_value_that_acted():
    # Before: "Sent 2 of 4 messages · flags !budget=200 !budget=300": which budget held?
    choice = TurnChoice([{}] * 2, 4, 900, 250, 300, "exact")
    question = {"role": "user", "content": "!budget=200 hi !budget=300 !+pin !-pin"}
    flags = read_flags([question], allowed=FLAG_NAMES).flags
    assert flags.budget == 300 and flags.sticky_pin is False
    assert status_line(choice, flags) == "Sent 2 of 4 messages · flags !budget=300 !-pin"


def test_a_document_read_only_in_a_recall_block_is_said_to_be_excerpted(counter):
    """Seen in the browser: a pasted article dropped from the selection, its passage quoted in the
    turn's recall block, and the line said only `Sent 8 of 9 messages`. A document the model
    reads in part, in a block alone, is now told as one excerpted in place is."""
    from test_passage_turns import FILLER, THINGS, long_text

    from contextwarden import trim_messages
    from contextwarden.face.trimpass import _chat_messages_sent

    doc = "Keep this inventory in mind:\n\n" + long_text(7, 120, 12)
    chat = [
        {"role": "system", "content": "Answer from the document."},
        {"role": "user", "content": doc},
        {"role": "assistant", "content": "I have read it."},
    ]
    previous = None
    for word in FILLER[:10]:  # other topics, until the selection lets the document go
        chat.append({"role": "user", "content": f"Tell me a long story about {word} please."})
        result = trim_messages(chat, max_tokens=1_500, model="gpt-4o", token_counter=counter, previous=previous)
        previous = result.decision or previous
        chat.append({"role": "assistant", "content": f"Once upon a time the {word} sang. " * 30})
    assert 1 in result.dropped
    chat.append({"role": "user", "content": f"Who owns the {THINGS[3]}?"})
    result = trim_messages(chat, max_tokens=1_500, model="gpt-4o", token_counter=counter, previous=previous)
    assert result.reused and not result.excerpted and result.quoted_passages == ((1, 1, 120),)
    choice = TurnChoice.of(result, result.messages)
    sent = _chat_messages_sent(choice)
    assert sent < len(chat) and 1 not in result.kept
    line = status_line(choice, Flags(), sent=sent)
    assert line == f"Sent {sent} of 24 messages, document excerpted: 1 of 120 passages"


# -- a document dropped whole (found in use: a smaller window dropped a pasted report, unsaid) --


def _report_chat() -> list[dict]:
    """A pasted report (~5,100 tokens) answered, then questions on other things."""
    from test_passage_turns import long_text

    return [
        {"role": "user", "content": "Please keep this report in mind:\n\n" + long_text(3, 80, 5)},
        {"role": "assistant", "content": "I have read the report."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
    ]


async def test_a_document_dropped_whole_is_told_left_out(counter):
    """Seen in Open WebUI 0.12.4: the chat switched to a model with a smaller window, the pasted
    document no longer fit and went whole (not excerpted, not recalled), and the line said only
    `Sent 3 of 5 messages`. It says `document left out`, turn after turn (the next turns carry
    the selection by the shortcut that reads only what is new)."""
    f = make_filter(counter, max_context_tokens=1_000, reserve_output_tokens=200)
    chat = _report_chat()
    for turn in range(3):
        run = await run_turn(
            f, chat, chat_id="report", reply=reply_of(usage={"prompt_tokens": 300, "completion_tokens": 9})
        )
        assert not any(m is chat[0] for m in run.after_request["messages"])
        [line] = run.events.statuses
        assert line.startswith(f"Sent {3 + 2 * turn} of {5 + 2 * turn} messages, document left out · 300 tokens in"), (
            line
        )
        note = run.metadata["contextwarden"]
        assert note["dropped_documents"] == 1 and note["excerpted"] == 0, note  # inlet's, not counted again by request
        assert "document left out" in note["line"]  # the admin's detail too
        chat = [*chat, {"role": "assistant", "content": "Rome."}, {"role": "user", "content": f"And of Spain {turn}?"}]


def test_left_out_documents_are_told_in_the_words_of_excerpts():
    """The same words as an excerpt none of whose passages fit, counted with them; a short
    message dropped is no document, and a tool result is told as one."""
    from contextwarden.core.trim_types import TrimResult

    result = TrimResult([{}] * 5, (0, 1, 2, 3, 4), (5, 6, 7, 8), (), 9_000, 400, 400, "exact")
    assert status_line(TurnChoice.of(result, result.messages), Flags()) == "Sent 5 of 9 messages"
    one = replace(result, left_out=(5,))
    assert status_line(TurnChoice.of(one, one.messages), Flags()) == "Sent 5 of 9 messages, document left out"
    two = replace(result, left_out=(5, 7))
    assert status_line(TurnChoice.of(two, two.messages), Flags()) == "Sent 5 of 9 messages, 2 documents left out"
    tool = replace(result, left_out=(6,), tool_results=(6,))
    assert status_line(TurnChoice.of(tool, tool.messages), Flags()) == "Sent 5 of 9 messages, tool result left out"
    cut = replace(one, kept=(0, 2, 3, 4), shortened=(1,), excerpted=(1,), passages=((3, 24),))
    choice = TurnChoice.of(cut, cut.messages)
    assert status_line(choice, Flags()) == "Sent 5 of 9 messages, document excerpted: 3 of 24 passages, 1 left out"
    assert detail_line(choice, Flags()).endswith(" · document excerpted: 3 of 24 passages, 1 left out")
    mixed = replace(cut, tool_results=(5,))
    assert status_line(TurnChoice.of(mixed, mixed.messages), Flags()).endswith(
        ", long message excerpted: 3 of 24 passages, 1 left out"
    )
