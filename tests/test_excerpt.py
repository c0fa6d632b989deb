"""Excerpts (issue 15, item 4): a large old message is cut to what the new question needs, not dropped."""

from __future__ import annotations

import random
from dataclasses import replace
from itertools import pairwise

import pytest

from contextwarden import TrimDecision, trim_messages
from contextwarden.core.chatview import ChatView
from contextwarden.core.conversation import RECALL_LABEL
from contextwarden.core.excerpt import CHUNK_CHARS, excerpt_message, excerpt_turns, rebuild, split_chunks
from contextwarden.core.relevance import wants_whole
from contextwarden.core.tokens import TokenCounter

from chats import check_contract

MODEL = "gpt-4o"
FACT = "The spare turbine blades are stored in aisle 42 of the Tromsø warehouse."
QUESTION = "In which aisle are the spare turbine blades stored?"
WORDS = (
    "river market harbour lantern copper meadow violin orchard granite festival ledger summit "
    "canvas pilgrim quartz saddle thunder velvet walnut yacht zephyr bramble cobalt dune ember "
    "falcon glacier hazel island jasmine kettle lagoon mosaic nectar oasis pebble quiver ridge"
).split()


def document(tokens: int, counter: TokenCounter, seed: int = 7, fact_at: float = 0.55) -> str:
    """A pasted document of about `tokens` tokens: paragraphs of filler, `FACT` in one of them."""
    rng = random.Random(seed)
    paragraphs: list[str] = []
    while counter.count_text("\n\n".join(paragraphs), MODEL) < tokens:
        sentences = [
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 16))).capitalize() + "." for _ in range(5)
        ]
        paragraphs.append(" ".join(sentences))
    paragraphs.insert(int(len(paragraphs) * fact_at), paragraphs.pop(int(len(paragraphs) * fact_at)) + " " + FACT)
    return "\n\n".join(paragraphs)


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter(block=True)


def pasted_chat(counter: TokenCounter) -> list[dict]:
    doc = document(6_000, counter)
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Please read this report and keep it in mind:\n\n" + doc},
        {"role": "assistant", "content": "I have read the report. What would you like to know?"},
        {"role": "user", "content": QUESTION},
    ]


def sent_text(result) -> str:
    return "\n".join(str(m.get("content")) for m in result.messages)


def test_split_chunks_is_a_line_aligned_partition(counter):
    text = document(1_500, counter) + "\n" + "x" * (3 * CHUNK_CHARS) + "\nlast line"
    chunks = split_chunks(text)
    assert "".join(chunks) == text
    assert all(len(c) <= CHUNK_CHARS for c in chunks)
    assert all(c.endswith("\n") for c in chunks[:-1] if "x" * CHUNK_CHARS not in c and "\n" in c[:-1] + "\n")


def long_lined(paragraphs: int = 30) -> str:
    """A report whose paragraphs are one long line each, two blank lines between them: a first
    sentence of 600 characters (a chunk), then the rest of the line (another, over a third full)."""
    topics = ("harbour", "orchard", "railway", "glacier", "library", "foundry", "vineyard", "market")
    lines = []
    for k in range(paragraphs):
        first = f"Section {k}. The {topics[k % 8]} committee met on day {k} and reviewed line {k * 7}"
        rest = f"Minutes of meeting {k} were approved after the {topics[(k + 3) % 8]} report. " * 4
        lines.append((first + " and more" * 80)[:598] + ". " + rest)
    return "\n\n\n".join(lines)


def test_blank_lines_are_no_passage_of_their_own():
    """The second blank line between two such paragraphs was a chunk of its own (29 of 89): a
    passage a cut could send, and that its count told. Blank lines now end the chunk before."""
    text = long_lined()
    chunks = split_chunks(text)
    assert "".join(chunks) == text and len(chunks) == 60 and all(chunk.strip() for chunk in chunks)
    assert split_chunks("\n\n  \n") == ["\n\n  \n"] and split_chunks("") == []


def test_fact_in_a_pasted_6k_document_is_sent_as_an_excerpt_in_a_4k_window(counter):
    chat = pasted_chat(counter)
    assert counter.count_text(chat[1]["content"], MODEL) >= 6_000
    result = trim_messages(chat, max_tokens=4_000, model=MODEL, token_counter=counter)
    check_contract(chat, result, counter, MODEL)
    assert result.excerpted == (1,) and 1 in result.shortened and 1 not in result.dropped
    assert 2 in result.kept  # the answer goes with its question
    excerpt = result.messages[1]["content"]
    assert FACT in excerpt
    assert "tokens cut by contextwarden …]" in excerpt
    assert result.tokens_after == counter.count_messages(result.messages, MODEL) <= 4_000
    # the passages are the document's own, in its order
    pieces = [p for p in excerpt.split("\n") if p and not p.startswith("[…")]
    positions = [chat[1]["content"].index(p) for p in pieces]
    assert positions == sorted(positions)


def test_a_pasted_document_then_a_question_over_three_turns_keeps_the_excerpt_bytes(counter):
    """The filter's flow: the paste is this turn (cut middle-out), then the question (excerpt),
    then a turn whose needs are the same: the excerpt is sent again byte for byte."""
    chat = pasted_chat(counter)
    options = {"max_tokens": 4_000, "model": MODEL, "token_counter": counter}
    first = trim_messages(chat[:2], **options)
    assert first.shortened == (1,) and not first.excerpted
    second = trim_messages(chat, previous=TrimDecision.from_json(first.decision.to_json()), **options)
    assert second.excerpted == (1,) and FACT in second.messages[1]["content"]
    assert second.stable_prefix >= 3  # the excerpt is part of the prefix the next turn sends again
    chat += [{"role": "assistant", "content": "They are in aisle 42."}, {"role": "user", "content": "Thanks!"}]
    third = trim_messages(chat, previous=TrimDecision.from_json(second.decision.to_json()), **options)
    check_contract(chat, third, counter, MODEL)
    assert third.reused and third.excerpted == (1,)
    assert third.messages[: second.stable_prefix] == second.messages[: second.stable_prefix]
    assert third.tokens_after == counter.count_messages(third.messages, MODEL) <= 4_000


def test_a_turn_that_keeps_its_excerpts_reads_only_what_is_new(counter):
    """The next turn's shortcut (the previous selection plus the new messages) carries excerpts:
    it does not count the whole chat again, and it sends what the full path would."""
    chat = pasted_chat(counter)
    options = {"max_tokens": 4_000, "model": MODEL}
    second = trim_messages(chat, token_counter=counter, **options)
    chat += [{"role": "assistant", "content": "They are in aisle 42."}, {"role": "user", "content": "Thanks!"}]
    previous = TrimDecision.from_json(second.decision.to_json())

    class Spy(TokenCounter):
        whole = 0

        def count_each_as(self, messages, model):
            Spy.whole += 1
            return super().count_each_as(messages, model)

    spy = Spy(block=True)
    third = trim_messages(chat, previous=previous, token_counter=spy, **options)
    assert third.reused and third.excerpted == (1,) and Spy.whole == 0
    full = trim_messages(chat, previous=replace(previous, seen=0), token_counter=spy, **options)
    assert Spy.whole == 1 and full.messages == third.messages
    assert (full.kept, full.shortened, full.excerpted, full.tokens_after, full.decision) == (
        third.kept,
        third.shortened,
        third.excerpted,
        third.tokens_after,
        third.decision,
    )


def test_a_question_about_another_part_recalls_that_passage(counter):
    """The excerpt goes again byte for byte (the prompt cache keeps hitting up to the question);
    the passage the new question needs is quoted in this turn's recall block, marked."""
    chat = pasted_chat(counter)
    options = {"max_tokens": 4_000, "model": MODEL, "token_counter": counter}
    other = "The harbour inspection moved the glacier survey to the violin hall on Friday."
    doc = chat[1]["content"]
    chat[1] = {**chat[1], "content": doc[:200] + " " + other + " " + doc[200:]}
    second = trim_messages(chat, **options)
    assert FACT in second.messages[1]["content"] and other not in second.messages[1]["content"]
    chat += [
        {"role": "assistant", "content": "Aisle 42."},
        {"role": "user", "content": "Where was the glacier survey moved after the harbour inspection?"},
    ]
    third = trim_messages(chat, previous=second.decision, **options)
    check_contract(chat, third, counter, MODEL)
    assert third.reused and third.excerpted == (1,) and third.messages[: len(second.messages)] == second.messages
    block = third.messages[third.stable_prefix]["content"]
    assert block.startswith(RECALL_LABEL) and other in block and "tokens cut by contextwarden" in block
    assert [i for i, _ in third.recalled_passages] == [1] and third.recalled == (1,)
    ((sent, total),) = third.passages
    assert sent == len(second.decision.excerpts[0][1]) + len(third.recalled_passages[0][1]) and total > sent
    again = TrimDecision.from_json(third.decision.to_json())  # the block is sent again next turn as it was
    chat += [{"role": "assistant", "content": "The violin hall."}, {"role": "user", "content": "Thanks!"}]
    fourth = trim_messages(chat, previous=again, **options)
    assert fourth.reused and fourth.messages[: third.stable_prefix + 3] == third.messages[: third.stable_prefix + 3]


def tool_chat(counter: TokenCounter, question: str) -> list[dict]:
    log = document(5_000, counter, seed=11).replace(FACT, "Valve P7 on the north pump failed its pressure test.")
    call = {"id": "call_1", "type": "function", "function": {"name": "read_log", "arguments": '{"day": "monday"}'}}
    return [
        {"role": "system", "content": "You are a maintenance assistant."},
        {"role": "user", "content": "Read monday's maintenance log for the pump."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": log},
        {"role": "assistant", "content": "I read monday's log for the pump."},
        {"role": "user", "content": question},
    ]


def test_an_old_tool_result_is_excerpted_with_its_call(counter):
    chat = tool_chat(counter, "Which valve on the north pump failed its pressure test?")
    result = trim_messages(chat, max_tokens=2_000, model=MODEL, token_counter=counter)
    check_contract(chat, result, counter, MODEL)
    assert result.excerpted == (3,)
    roles = [m["role"] for m in result.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert result.messages[2] is chat[2] and result.messages[3]["tool_call_id"] == "call_1"
    assert "Valve P7" in result.messages[3]["content"]
    assert result.tokens_after == counter.count_messages(result.messages, MODEL) <= 2_000


def test_an_old_tool_result_with_nothing_relevant_collapses_to_a_placeholder(counter):
    # (A vague follow-up, "Thanks, did you read all of it?", now gets its room filled with
    # passages spread over the log: tests/test_owui_shapes.py. A question of its own does not.)
    chat = tool_chat(counter, "Thanks. Which dessert goes with a pear tart, by the way?")
    result = trim_messages(chat, max_tokens=1_000, model=MODEL, token_counter=counter)
    check_contract(chat, result, counter, MODEL)
    assert result.excerpted == (3,)
    tool = result.messages[3]
    assert tool["role"] == "tool" and tool["tool_call_id"] == "call_1"
    assert tool["content"].startswith("[…") and counter.count_message(tool, MODEL) < 40
    assert result.tokens_after == counter.count_messages(result.messages, MODEL) <= 1_000


def test_budget_is_exact_over_many_budgets(counter):
    chat = pasted_chat(counter)
    for budget in range(300, 8_000, 457):
        result = trim_messages(chat, max_tokens=budget, model=MODEL, token_counter=counter)
        check_contract(chat, result, counter, MODEL)
        assert result.tokens_after == counter.count_messages(result.messages, MODEL)
        assert result.over_budget or result.tokens_after <= budget


def test_excerpt_message_never_exceeds_its_room(counter):
    message = {"role": "user", "content": document(3_000, counter)}
    for room in (5, 20, 60, 200, 999):
        cut = excerpt_message(message, QUESTION, room, counter, MODEL)
        assert cut is None or cut.tokens == counter.count_message(cut.message, MODEL) <= room


def test_status_line_and_explain_say_excerpted(counter):
    from contextwarden.core.flags import Flags
    from contextwarden.face.status import status_line
    from contextwarden.money.records import TurnChoice
    from contextwarden.tools.explain import explain_trim

    chat = pasted_chat(counter)
    result = trim_messages(chat, max_tokens=4_000, model=MODEL, token_counter=counter)
    line = status_line(TurnChoice.of(result, result.messages), Flags())
    ((sent, total),) = result.passages
    assert 0 < sent < total == len(split_chunks(chat[1]["content"]))
    assert f", document excerpted: {sent} of {total} passages" in line and "shortened" not in line
    explanation = explain_trim(chat, result, model=MODEL, token_counter=counter)
    row = explanation.messages[1]
    assert row.action == "excerpted" and "most relevant to the question" in row.reasons[0]
    sent = sum(counter.count_message(m, MODEL) for m in result.messages[1:3])
    assert explanation.budget.history_sent == sent


async def test_through_the_filter_the_fact_goes_and_the_lines_say_excerpted(counter, unique):
    """The filter's own flow, stored decision and both passes (inlet, then request on what inlet
    sent): the question's prompt holds the fact, and the turn's one line, after the reply, says
    `document excerpted: N of M passages`."""
    from helpers import Events, make_filter

    f = make_filter(counter, max_context_tokens=4_000, reserve_output_tokens=0)
    user, chat_id = f"u-{unique}", f"c-{unique}"
    chat = pasted_chat(counter)

    async def both_passes(messages: list[dict], events: Events) -> tuple[dict, dict]:
        metadata = {"chat_id": chat_id, "user_id": user}
        body = {"model": MODEL, "messages": messages, "stream": False, "metadata": metadata}
        first = await f.inlet(body, __user__={"id": user}, __metadata__=metadata, __event_emitter__=events)
        second = await f.request(first, __user__={"id": user}, __metadata__=metadata, __event_emitter__=events)
        return second, metadata

    await both_passes(chat[:2], Events())
    events = Events()
    sent, metadata = await both_passes(chat, events)
    assert FACT in sent["messages"][1]["content"]
    assert counter.count_messages(sent["messages"], MODEL) <= 4_000
    note = next(v for v in metadata.values() if isinstance(v, dict) and "line" in v)
    sent_passages, total = note["passages"]
    assert note["excerpted"] == 1 and 0 < sent_passages < total == len(split_chunks(chat[1]["content"]))
    words = f"document excerpted: {sent_passages} of {total} passages"
    assert events.statuses == [] and note["pending_line"].endswith(f", {words}"), note  # shown after the reply
    reply = {"role": "assistant", "content": "Aisle 42."}
    outlet = {"model": MODEL, "messages": [*sent["messages"], reply]}
    await f.outlet(outlet, __user__={"id": user}, __metadata__=metadata, __event_emitter__=events)
    [line] = events.statuses
    assert line.startswith(note["pending_line"] + " · ") and f", {words} · " in line, line


def test_an_embedder_finds_the_passage_words_do_not(counter):
    """`embed=` scores the chunks semantically too: a question that shares no word with the
    fact's passage gets it only with the embedder (a fake one that knows rotors are turbines)."""

    def embed(texts: list[str]) -> list[list[float]]:
        return [[1.0, 0.0] if any(w in t for w in ("turbine", "rotor", "report")) else [0.0, 1.0] for t in texts]

    chat = pasted_chat(counter)
    chat[-1] = {"role": "user", "content": "Where do we keep the replacement rotor parts?"}
    options = {"max_tokens": 4_000, "model": MODEL, "token_counter": counter}
    lexical = trim_messages(chat, **options)
    semantic = trim_messages(chat, embed=embed, **options)
    check_contract(chat, semantic, counter, MODEL)
    assert FACT not in sent_text(lexical)
    assert semantic.excerpted == (1,) and FACT in semantic.messages[1]["content"]


@pytest.mark.parametrize(
    "question", ["Summarize the document.", "Give me a one-line summary of the whole document", "Overview?"]
)
def test_a_question_about_the_whole_document_fills_the_budget_with_all_of_it_in_order(counter, question):
    """Issue 27 item 2: a summary question gets as much of the document as fits, spread over it
    and in order, even when the previous selection (made for a detail) would still fit."""
    chat = pasted_chat(counter)
    first = trim_messages(chat, max_tokens=4_000, model=MODEL, token_counter=counter)
    assert first.excerpted == (1,) and first.tokens_after < 0.75 * 4_000  # the detail's passages only
    chat += [{"role": "assistant", "content": "Aisle 42."}, {"role": "user", "content": question}]
    for previous in (None, first.decision):
        result = trim_messages(chat, max_tokens=4_000, model=MODEL, token_counter=counter, previous=previous)
        check_contract(chat, result, counter, MODEL)
        assert not result.reused and result.excerpted == (1,) and result.tokens_after >= 0.85 * 4_000
        ((sent, total),) = result.passages
        chunks = split_chunks(chat[1]["content"])
        kept = [k for k, c in enumerate(chunks) if c.strip() and c in result.messages[1]["content"]]
        assert kept[0] == 0 and kept[-1] >= total - 2 and sent == len(kept)  # from its start to its end
        gaps = [b - a for a, b in pairwise(kept)]
        assert max(gaps) <= 3  # spread evenly, not one stretch of it


def test_a_document_turn_between_single_messages_comes_with_the_one_that_bridges_it(counter):
    """A selection by single messages (the embedder's) kept the question before a pasted document
    and the reply after the question that follows it: the document's turn fits in between only
    with the reply before it and that question, and comes with them (it was not sent at all:
    bench/docchat.py, "Summarize the second document" with MiniLM at 16k sent neither)."""
    chat = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "An early question?"},
        {"role": "assistant", "content": "An early answer."},
        {"role": "user", "content": "Here is a second report:\n\n" + document(3_000, counter, seed=3)},
        {"role": "assistant", "content": "I have read it."},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "Aisle 42."},
        {"role": "user", "content": "Summarize the second report."},
    ]
    view, costs = ChatView(chat), counter.count_each(chat, MODEL)
    added, excerpts = excerpt_turns(view, {0, 1, 6, 7}, costs, 2_000, counter, MODEL, whole=True)
    assert added == {2, 3, 4, 5} and list(excerpts) == [3]  # the reply before, the question after
    assert sum(excerpts[3].tokens if i == 3 else costs[i] for i in added) <= 2_000
    added, excerpts = excerpt_turns(view, {0, 1, 2, 5, 6, 7}, costs, 2_000, counter, MODEL, whole=True)
    assert added == {3, 4} and list(excerpts) == [3]  # nothing to bridge


def test_a_turn_whose_question_went_as_a_bridge_is_not_placed_again(counter):
    """Two document turns in a row, the first placed with the question after it as its bridge:
    the second, whose question that is, is not placed over it (it once was, its reply then
    sent beside another reply: two assistant messages in a row, found by a review's random chats)."""
    chat = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Here is a first report:\n\n" + document(1_500, counter, seed=3)},
        {"role": "assistant", "content": "Noted: spare turbine blades, aisle. " + document(300, counter, seed=4)},
        {"role": "user", "content": "And a second report?"},
        {"role": "assistant", "content": "Here it is:\n\n" + document(1_500, counter, seed=5)},
        {"role": "user", "content": "A long aside:\n\n" + document(400, counter, seed=6).replace(FACT, "")},
        {"role": "assistant", "content": "Aisle 42."},
        {"role": "user", "content": QUESTION},
    ]
    view, costs = ChatView(chat), counter.count_each(chat, MODEL)
    added, _ = excerpt_turns(view, {0, 6, 7}, costs, 3_000, counter, MODEL)
    assert added == {1, 2, 3}  # the first report's turn (it holds the answer), the question that bridges
    sent = sorted({0, 6, 7} | added)
    roles = [chat[i]["role"] for i in sent]
    assert all(a != b for a, b in zip(roles[1:], roles[2:], strict=False))  # after the system prompt


def test_a_detail_question_keeps_the_excerpt_for_its_passage(counter):
    """The spread is for whole-document questions only: a detail question still gets its passage."""
    assert not wants_whole(QUESTION) and wants_whole("Compare the two reports.")
    result = trim_messages(pasted_chat(counter), max_tokens=4_000, model=MODEL, token_counter=counter)
    assert FACT in sent_text(result)


async def test_open_webuis_embedder_scores_the_passages_it_embedded_ahead(counter):
    """Issue 27 item 3: the filter's embedder (Open WebUI's, lookup-only in the trim) is asked
    for the passages of long messages too, ahead of the turn; the excerpt then weighs meaning."""
    from contextwarden.core.excerpt import passage_texts
    from contextwarden.face.embedder import OpenWebUIEmbedder

    asked: list[str] = []

    async def function(texts, prefix=None, user=None):  # Open WebUI's embedding function
        asked.extend(texts)
        return [[1.0, 0.0] if any(w in t for w in ("turbine", "rotor", "report")) else [0.0, 1.0] for t in texts]

    chat = pasted_chat(counter)
    chat[-1] = {"role": "user", "content": "Where do we keep the replacement rotor parts?"}
    embedder = OpenWebUIEmbedder(function)
    options = {"max_tokens": 4_000, "model": MODEL, "token_counter": counter, "embed": embedder}
    assert FACT not in sent_text(trim_messages(chat, **options))  # nothing embedded yet: lexical
    await embedder.prefetch(chat, timeout=5, max_texts=1_000)
    assert set(passage_texts(chat)) <= set(asked)
    semantic = trim_messages(chat, **options)
    check_contract(chat, semantic, counter, MODEL)
    assert semantic.excerpted == (1,) and FACT in semantic.messages[1]["content"]


def test_a_collapsed_tool_result_gives_the_passage_a_later_question_needs(counter):
    """A tool result the selection collapsed to its cut mark (the question then was about
    something else) is too large to quote: the next question's recall block quotes its passage,
    and the prompt up to the question is the previous one."""
    chat = tool_chat(counter, "Thanks. Which dessert goes with a pear tart, by the way?")
    options = {"max_tokens": 1_500, "model": MODEL, "token_counter": counter}
    first = trim_messages(chat, **options)
    assert first.excerpted == (3,) and first.passages[0][0] == 0  # the call and its result, the text cut
    chat += [
        {"role": "assistant", "content": "Vanilla ice cream goes well with a pear tart."},
        {"role": "user", "content": "Which valve on the north pump failed its pressure test?"},
    ]
    second = trim_messages(chat, previous=first.decision, **options)
    check_contract(chat, second, counter, MODEL)
    assert second.reused and second.messages[: len(first.messages)] == first.messages
    assert [i for i, _ in second.recalled_passages] == [3] and second.excerpted == (3,)
    block = second.messages[second.stable_prefix]["content"]
    assert "Valve P7 on the north pump failed its pressure test." in block
    assert block.startswith(RECALL_LABEL + "\n\ntool: [… ") and counter.count_text(block, MODEL) < 700


def test_a_placeholder_is_rebuilt_byte_for_byte(counter):
    """An excerpt that keeps no passage (only its cut mark) goes again next turn as it was made:
    the mark's count is its chunks' counts added, as for any other stretch (found by the
    property test: a rebuilt placeholder counted the text joined, 257 against 259 tokens)."""
    message = {"role": "tool", "tool_call_id": "call_1", "content": "river ünïcode émoji " * 200}  # one line
    made = excerpt_message(message, "What is the capital of Peru?", 40, counter, MODEL)
    assert made is not None and made.chunks == ()
    assert rebuild(message, (), counter, MODEL) == made


def _cold(chat: list[dict], previous: TrimDecision | None, options: dict):
    """The trim a worker that has just started makes (every process-wide cache empty, its own counter)."""
    from contextwarden import caches

    caches.clear_all()
    return trim_messages(chat, previous=previous, **{**options, "token_counter": TokenCounter(block=True)})


def test_warm_caches_trim_as_a_cold_process_after_edits_in_place(counter):
    """The chunk indexes, scores and views kept between turns never stand in for a changed
    text: a document edited in place (same length), a changed system prompt, and another
    chat's decision handed in (a chat id reused with other content) trim as a cold process."""
    options = {"max_tokens": 4_000, "model": MODEL, "token_counter": counter}
    chat = pasted_chat(counter)
    first = trim_messages(chat, **options)
    chat += [{"role": "assistant", "content": "Aisle 42."}, {"role": "user", "content": "Which part covers the audit?"}]
    doc = chat[1]["content"]
    at = doc.index(" ", len(doc) // 3)
    edited = [dict(m) for m in chat]
    edited[1]["content"] = doc[:at] + " zzzz" + doc[at + 5 :]  # same length, other words
    assert len(edited[1]["content"]) == len(doc) and edited[1]["content"] != doc
    prompt = [dict(m) for m in chat]
    prompt[0]["content"] = "You are a terse assistant."
    other = pasted_chat(counter)[:1] + [{"role": "user", "content": document(5_000, counter, seed=3)}] + chat[2:]
    kinds = []
    for turn in (chat, edited, prompt, other):
        previous = TrimDecision.from_json(first.decision.to_json())
        warm = trim_messages(turn, previous=previous, **options)
        kinds.append((warm.reused, bool(warm.excerpted or warm.recalled_passages)))
        cold = _cold(turn, TrimDecision.from_json(first.decision.to_json()), options)
        assert warm.messages == cold.messages
        assert warm.decision.to_json() == cold.decision.to_json()
        check_contract(turn, warm, counter, MODEL)
    # The turn as it was and the one with another system prompt carry the excerpt (chunk caches
    # warm); the edited document and the other chat's are selected anew.
    assert kinds == [(True, True), (False, False), (True, True), (False, False)]
