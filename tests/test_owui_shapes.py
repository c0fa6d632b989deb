"""Message shapes Open WebUI 0.12.4 really sends (tests/fixtures/owui_tool_output_0.12.4.json, written
by its own `convert_output_to_messages`): trimmed as what they are."""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
from pathlib import Path

import pytest

from contextwarden import trim_messages
from contextwarden.core.chatview import ChatView
from contextwarden.core.conversation import TOOL_IMAGES_TEXT, latest_question
from contextwarden.core.excerpt import CUT_MARK
from contextwarden.core.flags import read_flags

from chats import check_contract
from helpers import Events, make_filter

MODEL = "gpt-4o"
FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "owui_tool_output_0.12.4.json").read_text("utf-8"))
QUESTION = "Use the chart tool to plot our Q3 revenue by region, then by product: which region grew fastest?"


def _history(turns: int) -> list[dict]:
    chat = [{"role": "system", "content": "You are a helpful analyst."}]
    for i in range(turns):
        chat += [
            {"role": "user", "content": f"Tell me about topic {i}. " + "Some more context words here. " * 40},
            {"role": "assistant", "content": f"Topic {i} answer. " + "Details follow in this long answer. " * 60},
        ]
    return chat


def _loop(rows: int, rounds: int = 2, shape: str = "messages_none") -> list[dict]:
    """The tool loop's messages as Open WebUI sends them on its next call (no reply yet), each
    tool result made `rows` rows long."""
    loop = copy.deepcopy(FIXTURE[shape][: 3 * rounds])
    for message in loop:
        if message["role"] == "tool":
            message["content"] += " row data value 123 456;" * rows
    return loop


def _cut_to_nothing(message: dict) -> bool:
    return message["content"].strip().startswith(CUT_MARK.split("{")[0])


def test_the_fixture_is_open_webuis_tool_images_shape():
    roles = [m["role"] for m in FIXTURE["messages_none"]]
    assert roles == ["assistant", "tool", "user", "assistant", "tool", "user", "assistant"]
    images = FIXTURE["messages_none"][2]["content"]
    assert images[0] == {"type": "text", "text": TOOL_IMAGES_TEXT} and images[1]["type"] == "image_url"


def test_tool_images_continue_the_loop_the_question_is_the_users():
    chat = [*_history(3), {"role": "user", "content": QUESTION}, *_loop(0)]
    view = ChatView(chat)
    question = len(_history(3))
    assert view.question == question == latest_question(chat)
    assert view.turns[view.current].indices == list(range(question, len(chat)))
    groups = [u for u in view.turns[view.current].units if u.kind == "tool_group"]
    assert [(u.start, u.stop) for u in groups] == [(question + 1, question + 4), (question + 4, question + 7)]
    assert read_flags(chat, allowed={"pin"}).latest_user == question


def test_the_same_text_typed_after_a_reply_is_a_question():
    typed = {"role": "user", "content": copy.deepcopy(FIXTURE["messages_none"][2]["content"])}
    chat = [*_history(2), typed]
    assert ChatView(chat).question == len(chat) - 1 == latest_question(chat)


def test_a_loop_over_the_budget_is_sent_whole_its_results_cut_alike(counter):
    """s2c: the images message was the question, the loop history: a result excerpted to its
    cut mark, a call and its result left out on the next call."""
    chat = [*_history(12), {"role": "user", "content": QUESTION}, *_loop(400)]
    result = trim_messages(chat, max_tokens=3_072, model=MODEL, token_counter=counter)
    sent = result.messages
    question = next(k for k, m in enumerate(sent) if m.get("content") == QUESTION)
    assert [m["role"] for m in sent[question:]] == ["user", *["assistant", "tool", "user"] * 2]
    tools = [m for m in sent if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tools] == ["call_1", "call_2"]
    assert all(m["content"].startswith(f"Chart {k}: APAC grew 19%") for k, m in enumerate(tools, 1))
    assert not any(_cut_to_nothing(m) for m in tools)
    assert 0.9 * 3_072 <= result.tokens_after <= 3_072


def test_a_running_loop_keeps_its_calls_through_the_request_hook(counter):
    """Each call of the loop runs the `request` filter on the first pass's output plus the
    round's messages (utils/middleware.py): every call and result goes out, the question once."""
    f = make_filter(counter, max_context_tokens=4_096, openrouter_pricing=False)
    metadata = {"chat_id": "c-loop", "message_id": "m1", "session_id": "s", "user_id": "u1"}
    hooks = {"__user__": {"id": "u1"}, "__metadata__": metadata, "__event_emitter__": Events()}

    async def run() -> list[list[dict]]:
        body = {"model": MODEL, "messages": [*_history(12), {"role": "user", "content": QUESTION}]}
        body = await f.request(await f.inlet(body, **hooks), **hooks)
        first, sent = list(body["messages"]), []
        for rounds in (1, 2):
            out = await f.request({"model": MODEL, "messages": [*first, *_loop(400, rounds)]}, **hooks)
            sent.append(out["messages"])
        return sent

    for rounds, messages in enumerate(asyncio.run(run()), 1):
        tools = [m for m in messages if m["role"] == "tool"]
        assert [m["tool_call_id"] for m in tools] == [f"call_{k}" for k in range(1, rounds + 1)]
        assert not any(_cut_to_nothing(m) for m in tools)
        assert [m.get("content") for m in messages].count(QUESTION) == 1
        assert messages[-1]["content"][0]["text"] == TOOL_IMAGES_TEXT


def test_a_replayed_turn_with_tool_images_is_one_turn(counter):
    """A stored turn's output replays with its images message inside it: kept or left whole."""
    old = [{"role": "user", "content": QUESTION}, *copy.deepcopy(FIXTURE["messages_none"])]
    chat = [*_history(1), *old, {"role": "user", "content": "Thanks. Now something else entirely?"}]
    view = ChatView(chat)
    assert len(view.turns) == 3 and view.turns[1].indices == list(range(3, 3 + len(old)))
    for budget in (700, 1_500, 2_000):
        kept = set(trim_messages(chat, max_tokens=budget, model=MODEL, token_counter=counter).kept)
        assert kept.isdisjoint(range(3, 3 + len(old))) or kept.issuperset(range(3, 3 + len(old)))


THOUGHT = "Let me think step by step about which rows to query and why. " * 150


def _without_reasoning(message: dict) -> dict:
    return {k: v for k, v in message.items() if k not in ("thinking", "reasoning_content", "reasoning_details")}


def test_replayed_reasoning_is_counted_once_a_message(counter):
    """s5: `thinking` (Ollama), `reasoning_content` (llama.cpp) and `reasoning_details`
    (OpenRouter) were not counted; a message holding the same thinking twice counts it once."""
    thought = FIXTURE["output"][0]["content"][0]["text"]
    for shape in ("messages_none", "messages_thinking", "messages_reasoning_content"):
        call = FIXTURE[shape][0]
        plain = counter.count_message(_without_reasoning(call), MODEL)
        assert counter.count_message(call, MODEL) == plain + counter.count_text(thought, MODEL), shape
    reply = {"role": "assistant", "content": "Done.", "reasoning": THOUGHT}
    assert counter.count_message(reply, MODEL) == counter.count_message({**reply, "reasoning": ""}, MODEL) + (
        counter.count_text(THOUGHT, MODEL)
    )


def test_a_chat_with_reasoning_is_trimmed_to_what_is_really_sent(counter):
    """Old turns of a thinking model (Ollama): the prompt sent, its thinking included, fits."""
    chat = [{"role": "system", "content": "sys"}]
    for k in range(6):
        chat += [
            {"role": "user", "content": f"Question {k} about orders?"},
            {"role": "assistant", "content": f"Answer {k}.", "thinking": THOUGHT},
        ]
    chat.append({"role": "user", "content": "Which orders were largest?"})
    result = trim_messages(chat, max_tokens=6_000, model=MODEL, token_counter=counter)
    sent = result.messages
    real = counter.count_messages([_without_reasoning(m) for m in sent], MODEL) + sum(
        counter.count_text(m.get("thinking", ""), MODEL) for m in sent
    )
    assert real == result.tokens_after <= 6_000 and len(sent) < len(chat)
    assert all(m is chat[i] for m, i in zip(sent, result.kept, strict=True))  # never stripped


def test_a_loop_of_reasoning_over_the_budget_is_sent_whole_and_said_so(counter):
    chat = [{"role": "system", "content": "sys"}, {"role": "user", "content": "Find the three largest orders."}]
    for k in range(4):
        call = {"id": f"c{k}", "type": "function", "function": {"name": "sql", "arguments": json.dumps({"q": k})}}
        chat += [
            {"role": "assistant", "content": "", "reasoning_content": THOUGHT, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{k}", "content": f"result {k}: " + "row, " * 50},
        ]
    result = trim_messages(chat, max_tokens=3_000, model=MODEL, token_counter=counter)
    assert result.over_budget and result.tokens_after > 4 * counter.count_text(THOUGHT, MODEL)
    assert [m.get("reasoning_content") for m in result.messages if m["role"] == "assistant"] == [THOUGHT] * 4


def test_reasoning_weighs_where_work_runs_and_keeps_a_turn_from_calibrating():
    from contextwarden.face.offloop import heavy
    from contextwarden.money.calibration import comparable_turn

    thinking = {"role": "assistant", "content": "ok", "thinking": "x" * 30_000}
    detailed = {
        "role": "assistant",
        "content": "ok",
        "reasoning_details": [{"type": "reasoning.text", "text": "x"}] * 3_000,
    }
    assert heavy([thinking]) and heavy([detailed]) and not heavy([_without_reasoning(thinking)])
    assert not comparable_turn([{"role": "user", "content": "q"}, thinking], {})
    assert comparable_turn([{"role": "user", "content": "q"}, _without_reasoning(thinking)], {})


RECEIPT = "data:image/jpeg;base64," + "/9j/4AAQSkZJRgABAQ" * 300  # as convert_url_images_to_base64 sends it


def _receipt_chat() -> list[dict]:
    image = {"type": "image_url", "image_url": {"url": RECEIPT}}
    chat = [
        {"role": "system", "content": "You are a helpful assistant."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Here is the receipt from my dinner at Luigi's."}, image],
        },
        {"role": "assistant", "content": "Got it: a receipt from Luigi's trattoria."},
    ]
    for i in range(10):
        chat += [
            {"role": "user", "content": f"Unrelated question {i} about gardening and tomato plants. " + "soil " * 40},
            {"role": "assistant", "content": f"Gardening answer {i}. " + "Plants need care and patience. " * 40},
        ]
    return chat


def _image_parts(messages: list[dict]) -> int:
    return sum(1 for m in messages if isinstance(m.get("content"), list) for p in m["content"] if "image_url" in p)


def test_an_image_the_question_needs_goes_in_place_never_quoted(counter):
    """s9: the receipt message was quoted in a recall block, its image lost, and counted as sent."""
    chat = _receipt_chat()
    first = trim_messages(chat, max_tokens=2_476, model=MODEL, token_counter=counter)
    chat.append({"role": "user", "content": "Look at the receipt from Luigi's trattoria again: what was the total?"})
    later = trim_messages(chat, max_tokens=2_476, model=MODEL, token_counter=counter, previous=first.decision)
    assert 1 not in later.recalled and {1, 2} <= set(later.kept) and _image_parts(later.messages) == 1
    assert later.tokens_after <= 2_476


def _hashed_embed(texts: list[str]) -> list[list[float]]:
    """A deterministic stand-in embedder: a few bytes of each text's hash."""
    return [[b / 255 for b in hashlib.sha256(t.encode()).digest()[:8]] for t in texts]


def test_by_message_an_image_the_question_needs_goes_in_place_with_its_quoted_reply(counter):
    """With the embedder (a selection by message) the receipt's reply was quoted in the
    selection's own block, so the receipt, a user message right before the question's turn,
    had no place: neither sent nor quoted (a quote holds no image). Its turn now comes in place,
    the reply taken out of the block, the rest quoted again."""
    chat = _receipt_chat()
    options = {"max_tokens": 2_476, "model": MODEL, "token_counter": counter, "embed": _hashed_embed}
    first = trim_messages(chat, **options)
    chat.append({"role": "user", "content": "Look at the receipt from Luigi's trattoria again: what was the total?"})
    later = trim_messages(chat, previous=first.decision, **options)
    assert _image_parts(later.messages) == 1 and {1, 2} <= set(later.kept) and 2 not in later.recalled
    quoted = "".join(
        m["content"] for k, m in enumerate(later.messages) if k in later.added and isinstance(m["content"], str)
    )
    assert "Got it: a receipt" not in quoted and later.tokens_after <= 2_476


@pytest.mark.parametrize("budget", [1_800, 2_476, 3_500])
@pytest.mark.parametrize("recall_share", [None, 0.0])
def test_a_first_trim_by_message_sends_the_image_the_question_needs_in_place(counter, budget, recall_share):
    """A first trim (no previous decision: no recall room, `fresh._pictured_in_place` not asked)
    with the embedder ranked the receipt second of all messages, but a follow-up ("again") keeps
    the latest exchange whole, so the receipt met its question in place, and a quote holds no
    image: it went, neither sent nor quoted, while the selection quoted gardening answers (2,605
    of 3,500 tokens sent). It comes in place with its reply now, the reply out of the quotes."""
    question = {"role": "user", "content": "Look at the receipt from Luigi's trattoria again: what was the total?"}
    chat = [*_receipt_chat(), question]
    share = {} if recall_share is None else {"recall_share": recall_share}
    result = trim_messages(chat, max_tokens=budget, model=MODEL, token_counter=counter, embed=_hashed_embed, **share)
    assert _image_parts(result.messages) == 1 and {1, 2, 21, 22} <= set(result.kept) and 2 not in result.recalled
    assert result.tokens_after <= budget
    check_contract(chat, result, counter, MODEL)


def test_an_image_that_cannot_go_in_place_is_left_out_not_quoted(counter):
    chat = _receipt_chat()
    question = {"role": "user", "content": "Which restaurant was the receipt from, Luigi's?"}
    for budget in (700, 1_000, 1_500, 2_476):
        first = trim_messages(chat, max_tokens=budget, model=MODEL, token_counter=counter)
        result = trim_messages(
            [*chat, question], max_tokens=budget, model=MODEL, token_counter=counter, previous=first.decision
        )
        blocks = [m["content"] for m in result.messages if isinstance(m["content"], str) and "Recalled" in m["content"]]
        assert 1 not in result.recalled and not any("Here is the receipt" in b for b in blocks)
        assert (1 in result.kept) == (_image_parts(result.messages) == 1)


def test_a_selection_by_message_never_quotes_an_image():
    from contextwarden.core.alternation import fill_quoting

    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}
    chat = ChatView(
        [
            {"role": "user", "content": [{"type": "text", "text": "a"}, image]},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
            {"role": "assistant", "content": "d"},
            {"role": "user", "content": "e"},
        ]
    )
    units = [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    # 0 meets 2 in place: it comes with its reply 1 as the bridge, quoted or not before
    assert fill_quoting(chat, units, {3, 4}, [2, 0, 1], [5, 5, 5, 5], 20, 4) == ({0, 1, 2}, [])
    assert fill_quoting(chat, units, {3, 4}, [2, 1, 0], [5, 5, 5, 5], 20, 4) == ({0, 1, 2}, [])
    # no room for both: the image is left out, never quoted; its reply is quoted alone
    assert fill_quoting(chat, units, {3, 4}, [2, 0, 1], [5, 2, 5, 5], 11, 4) == ({2}, [1])


def _region_page() -> str:
    topics = ["rivers", "mountains", "harbours", "railways", "orchards", "bridges", "markets", "lighthouses"]
    return "\n\n".join(
        f"Section {n} covers the {topics[n % 8]} of the region in year {1900 + n}. "
        + ("The author says this matters. " if n in (7, 23, 41) else "")
        + f"Records from {topics[(n * 3) % 8]} surveys list figures {n * 17}, {n * 29} and {n * 31}. " * 4
        for n in range(50)
    )


@pytest.mark.parametrize("question", ["What else does it say?", "Tell me more.", "Thanks, did you read all of it?"])
def test_a_vague_follow_up_on_a_long_tool_result_fills_its_room(counter, question):
    """s3: "What else does it say?" on an earlier fetch_url result matched a few passages and
    sent a fraction of what the selection could: the rest now holds passages spread over it."""
    from contextwarden.core.trim import selection_target

    call = {"id": "call_ws", "type": "function", "function": {"name": "fetch_url", "arguments": '{"url": "x"}'}}
    chat = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Read the page on the region and summarize it."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_ws", "content": _region_page()},
        {"role": "assistant", "content": "The page covers the region's history and surveys."},
        {"role": "user", "content": question},
    ]
    result = trim_messages(chat, max_tokens=3_072, model=MODEL, token_counter=counter)
    target = selection_target(ChatView(chat), counter.count_each(chat, MODEL), 3_072, 0.8)
    tool = next(m for m in result.messages if m["role"] == "tool")["content"]
    assert result.excerpted == (3,) and result.tool_results == (3,)
    assert 0.85 * target <= result.tokens_after <= target
    assert "Section 0 " in tool and "Section 49 " in tool
    assert "The author says this matters." in tool or "say" not in question
