"""Sources Open WebUI puts before the latest question between inlet and request (an attached
file, retrieved passages, web results): the request pass keeps the passages that answer the
question, the template and the source tags, and chooses the history for the bare question, so
the next turn (whose stored question is bare) finds the same messages and prefix."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from contextwarden.core.conversation import TOOL_IMAGES_TEXT
from contextwarden.core.decision import message_fingerprint
from contextwarden.core.sources import cut_sources, split_sources, text_digest, with_sources
from contextwarden.money.records import TurnChoice
from contextwarden.state.chatstate import ChatState, chat_state_key

from helpers import Events, make_filter

# Open WebUI 0.12.4's DEFAULT_RAG_TEMPLATE (config.py), shortened: its frame around {{CONTEXT}}.
TEMPLATE = (
    "### Task:\nRespond to the user query using the provided context, incorporating inline citations"
    " in the format [id] **only when the <source> tag includes an explicit id attribute**.\n\n"
    "### Guidelines:\n- If you don't know the answer, clearly state that.\n\n<context>\n{context}\n</context>\n"
)
FILLER = [
    "The harbour authority reviewed the quarterly shipping schedules and the berth allocations.",
    "Committee minutes record a long discussion of the parking arrangements near the old market.",
    "A survey of the footpaths found the gravel surfaces in fair condition after the winter.",
    "The library extended its opening hours on Thursdays during the examination period.",
]


def document(paragraphs: int, facts: dict[int, str]) -> str:
    """Paragraphs of filler, some replaced by facts (a SQuAD-like article in miniature)."""
    return "\n\n".join(
        facts.get(k, f"Section {k}. " + " ".join(FILLER[(k + j) % 4] for j in range(4))) for k in range(paragraphs)
    )


def rag(question: str, files: list[tuple[str, str]]) -> str:
    """The latest user message as Open WebUI leaves it: template with `<source>` blocks, a newline, the question."""
    context = "".join(f'<source id="{k + 1}" name="{name}">{text}</source>\n' for k, (name, text) in enumerate(files))
    return TEMPLATE.format(context=context.strip()) + "\n" + question


FACT = "The observatory on the north ridge was founded in 1887 by the astronomer Helena Marsh."
DOC = document(80, {53: FACT})


@pytest.mark.parametrize("shape", ["text", "parts"])
def test_sources_are_told_apart_from_the_question_and_put_back(shape):
    question = "Who founded the observatory?"
    bare = {"role": "user", "content": question}
    if shape == "parts":
        bare = {
            "role": "user",
            "content": [{"type": "text", "text": question}, {"type": "image_url", "image_url": {"url": "x"}}],
        }
    sent = with_sources(bare, rag("", [("a.txt", "text")]).rstrip("\n"))
    sources, found = split_sources(sent, text_digest(question))
    assert found == bare and with_sources(found, sources) == sent
    assert split_sources(sent, text_digest("Who founded it?")) is None  # another question
    assert split_sources(bare, text_digest(question)) is None  # nothing put before it


def test_sources_that_do_not_fit_keep_the_answering_passage_the_template_and_tags(counter):
    sources = rag("", [("report.txt", DOC), ("notes.txt", document(10, {}))]).rstrip("\n")
    whole = counter.count_text(sources, "gpt-4o")
    cut = cut_sources(sources, "Who founded the observatory on the north ridge?", whole // 4, counter, "gpt-4o")
    assert cut.tokens <= whole // 4 and cut.cut and 0 < cut.kept < cut.total
    assert FACT in cut.text
    assert cut.text.startswith("### Task:") and cut.text.endswith("</context>")
    assert '<source id="1" name="report.txt">' in cut.text and '<source id="2" name="notes.txt">' in cut.text
    assert cut_sources(sources, "Who founded it?", whole, counter, "gpt-4o").text == sources  # fits: whole


def test_many_retrieved_chunks_send_the_one_that_answers_within_the_room(counter):
    """A knowledge base's retrieval with a large top-k: 60 chunks, each its own `<source>` block,
    into 1,200 tokens. Their tags and cut marks alone took more than that: nothing of any chunk
    went, and the sources were over the room. Now the chunks that answer go, with their tags."""
    chunks = [("kb.txt", f"Section {k}. " + " ".join(FILLER[(k + j) % 4] for j in range(3))) for k in range(60)]
    chunks[41] = ("kb.txt", FACT)
    sources = rag("", chunks).rstrip("\n")
    cut = cut_sources(sources, "Who founded the observatory on the north ridge?", 1_200, counter, "gpt-4o")
    assert FACT in cut.text and cut.tokens <= 1_200
    assert cut.text.count("<source ") < 60 and cut.text.endswith("</context>")


def test_a_summary_of_the_sources_gets_passages_spread_over_them(counter):
    sources = rag("", [("report.txt", DOC)]).rstrip("\n")
    cut = cut_sources(sources, "Summarize the whole document", 900, counter, "gpt-4o")
    kept = [k for k in range(80) if f"Section {k}." in cut.text]
    assert kept[0] < 10 and kept[-1] > 70 and len(kept) >= 4


def test_sources_no_passage_of_which_matches_are_sent_spread_over(counter):
    """The user attached them for this question: with no passage matching it, some of each
    part goes rather than nothing but cut marks."""
    sources = rag("", [("report.txt", DOC)]).rstrip("\n")
    cut = cut_sources(sources, "Who signed it?", 900, counter, "gpt-4o")
    kept = [k for k in range(80) if f"Section {k}." in cut.text]
    assert len(kept) >= 4 and kept[-1] - kept[0] > 40


async def _pass(
    f, chat: list[dict], question: str, files: list[tuple[str, str]], events: Events, reply: str | None = None
) -> tuple[list, dict]:
    """inlet, Open WebUI's sources put before the question, request (and outlet of `reply`, if
    given, on the chat as Open WebUI stores it): what request sent, and the note (inlet's in it)."""
    metadata = {"chat_id": "c1", "user_id": "u1", "message_id": f"m{len(chat)}"}
    body = {"model": "gpt-4o", "messages": copy.deepcopy(chat), "stream": True, "metadata": metadata}
    hooks = {"__user__": {"id": "u1", "role": "user"}, "__metadata__": metadata, "__event_emitter__": events}
    out = await f.inlet(body, **hooks)
    first = dict(metadata["contextwarden"])
    if files:
        out["messages"][-1]["content"] = rag(out["messages"][-1]["content"], files)
    sent = await f.request(out, **hooks)
    note = {**metadata["contextwarden"], "inlet": first}
    if reply is not None:
        stored = [*chat, {"role": "assistant", "content": reply}]
        await f.outlet({"model": "gpt-4o", "messages": stored, "chat_id": "c1"}, **hooks)
    return sent["messages"], note


async def test_a_file_too_large_for_the_window_keeps_the_passage_that_answers(counter):
    """A 10k-token file attached to a question in a 4k window: the passage holding the answer is
    sent (middle-out it was lost), with the template, the tag and the question whole."""
    f = make_filter(counter, max_context_tokens=4_096, openrouter_pricing=False)
    question = "Who founded the observatory on the north ridge?"
    chat = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": question}]
    sent, note = await _pass(f, chat, question, [("report.txt", DOC)], Events())
    last = sent[-1]["content"]
    assert FACT in last and last.endswith("\n" + question) and '<source id="1" name="report.txt">' in last
    assert counter.count_messages(sent, "gpt-4o") <= note["budget"]
    assert "document excerpted" in note["pending_line"]


def article() -> tuple[list[str], list[tuple[str, str, int]]]:
    """A SQuAD article (fixtures/SOURCE.md): its paragraphs, and (question, answer, paragraph) triples."""
    data = json.loads((Path(__file__).parent / "fixtures" / "squad_article.json").read_text())
    paragraphs = [p["context"] for p in data["paragraphs"]]
    asked = [(q["question"], q["answers"][0]["text"], k) for k, p in enumerate(data["paragraphs"]) for q in p["qas"]]
    return paragraphs, asked


async def test_an_attached_article_keeps_the_passage_each_question_needs(counter):
    """A whole article attached (Open WebUI's full-context mode) in a 4k window, one question
    each about its middle paragraphs: each answer's paragraph is sent (middle-out kept the
    article's head and tail, and lost them)."""
    paragraphs, asked = article()
    sources = [("Antibiotics.pdf", "\n\n".join(paragraphs))]
    middle = [(q, a, k) for q, a, k in asked if 6 <= k < len(paragraphs) - 6][::5]
    for question, answer, _at in middle:
        f = make_filter(counter, max_context_tokens=4_096, openrouter_pricing=False)
        chat = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": question}]
        sent, note = await _pass(f, chat, question, sources, Events())
        assert answer in sent[-1]["content"] and counter.count_messages(sent, "gpt-4o") <= note["budget"]
    assert len(middle) >= 5


def _reply(paragraph: str) -> str:
    return " ".join(paragraph.split(". ")[:6])


async def _chat_with_sources(counter, turns: int, k: int) -> tuple[list[list[dict]], list[list[dict]], list]:
    """A chat about an article in a 4k window, each question with its `k` best paragraphs as
    Open WebUI's retrieved sources: each turn's chat as read, request sent and stored decision."""
    paragraphs, asked = article()
    f = make_filter(counter, max_context_tokens=4_096, openrouter_pricing=False)
    chat: list[dict] = [{"role": "system", "content": "You are helpful."}]
    sent_each, read_each, decisions = [], [], []
    for question, _answer, at in asked[:: len(asked) // turns][:turns]:
        chat.append({"role": "user", "content": question})
        words = set(question.lower().split())
        best = sorted(range(len(paragraphs)), key=lambda j: -len(words & set(paragraphs[j].lower().split())))[:k]
        files = [("Antibiotics.pdf", paragraphs[j]) for j in best]
        sent, _note = await _pass(f, chat, question, files, Events())
        sent_each.append(sent)
        read_each.append(list(chat))
        decisions.append(ChatState.from_bytes(await f.store.get(chat_state_key("u1", "c1"))).decision)
        chat.append({"role": "assistant", "content": _reply(paragraphs[at])})
    return read_each, sent_each, decisions


async def test_a_decision_the_request_pass_cut_further_names_the_chats_own_messages(counter):
    """The request pass cuts the chat inlet chose further to make room for the sources: the
    decision it stores names each kept and quoted message at its place in the chat as stored,
    which is what the next turn's inlet reads (it recorded places in inlet's shorter list, so
    the next turn found no recall block where it looked and chose anew)."""
    read_each, sent_each, decisions = await _chat_with_sources(counter, 32, 6)
    cut = [k for k, s in enumerate(sent_each) if k and len(s) < len(sent_each[k - 1])]
    assert len(cut) >= 3 and any(decisions[k].recalls for k in cut)
    for chat, decision in zip(read_each, decisions, strict=True):
        if decision is None:
            continue
        assert all(message_fingerprint(chat[i]) == k for i, k in zip(decision.at, decision.kept, strict=True))
        for recall in decision.recalls:
            assert all(message_fingerprint(chat[i]) == k for i, k in zip(recall.at, recall.kept, strict=True))


async def test_sources_stay_told_apart_in_a_tool_loop_that_returned_images(counter):
    """Each call of a tool loop gets the first call's messages, the question with its sources,
    then the loop; a tool that returns images adds Open WebUI's images message after its result.
    Taken for the question, it hid the sources: the question with them was shortened middle-out
    as one text (in a 2,500 window from 1,168 tokens to 335), and the answering passage was lost."""
    f = make_filter(counter, max_context_tokens=2_500, openrouter_pricing=False)
    question = "Who founded the observatory on the north ridge?"
    metadata = {"chat_id": "c-loop", "user_id": "u1", "message_id": "m1"}
    hooks = {"__user__": {"id": "u1"}, "__metadata__": metadata, "__event_emitter__": Events()}
    chat = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": question}]
    out = await f.inlet({"model": "gpt-4o", "messages": copy.deepcopy(chat), "metadata": metadata}, **hooks)
    out["messages"][-1]["content"] = rag(out["messages"][-1]["content"], [("report.txt", DOC)])
    first = (await f.request(out, **hooks))["messages"]
    call = {"id": "call_1", "type": "function", "function": {"name": "chart", "arguments": "{}"}}
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    loop = [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": document(60, {})},
        {"role": "user", "content": [{"type": "text", "text": TOOL_IMAGES_TEXT}, image]},
    ]
    sent = (await f.request({"model": "gpt-4o", "messages": [*first, *loop], "metadata": metadata}, **hooks))[
        "messages"
    ]
    asked = next(m["content"] for m in sent if m["role"] == "user" and isinstance(m["content"], str))
    assert asked.endswith("</context>\n\n" + question) and '<source id="1" name="report.txt">' in asked
    assert FACT in asked
    assert counter.count_messages(sent, "gpt-4o") <= metadata["contextwarden"]["budget"]


def test_a_source_that_holds_source_tags_of_its_own_is_cut_whole(counter):
    """Open WebUI puts a file's text in its `<source id=..>` block as written: a pom.xml's
    `<source>17</source>` ended the block there, the rest of the file went whole as template
    text (4,582 tokens into a room of 900), the report's tags and answering passage were lost."""
    plugin = "<configuration><source>17</source><target>17</target></configuration>"
    pom = "\n\n".join(
        f"<dependency><artifactId>lib-{k}</artifactId><version>1.{k}</version></dependency>"
        + (plugin if k == 3 else "")
        for k in range(200)
    )
    sources = rag("", [("report.txt", DOC), ("pom.xml", pom)]).rstrip("\n")
    cut = cut_sources(sources, "Who founded the observatory on the north ridge?", 900, counter, "gpt-4o")
    assert cut.tokens <= 900 and FACT in cut.text
    assert '<source id="1" name="report.txt">' in cut.text and '<source id="2" name="pom.xml">' in cut.text
    assert cut.text.endswith("</source>\n</context>")


@pytest.mark.parametrize("window", [4_096, 32_000], ids=["cut", "whole"])
@pytest.mark.parametrize("frame_end", ["\n", ""], ids=["newline", "bare"])
@pytest.mark.parametrize(
    "question",
    ["Who founded the observatory?", "/summarize the report", "\nWho founded the observatory?", "(who founded it?)"],
)
async def test_the_noted_prompt_tokens_are_the_sent_prompts_with_sources(counter, question, frame_end, window):
    """The request pass counted the sources and the question apart, but they go as one text,
    joined by a newline: `</context>\\n` + `\\n` + `/summarize` or `\\nWho` merges a token at the
    seam, and `</context>` + `\\n/` splits one. The note's estimate was one high (or low: then
    the prompt could go one over its budget) for such questions: 20 turns in 1,500 of a
    randomized simulation. It is now what the sent prompt counts."""
    f = make_filter(counter, max_context_tokens=window, openrouter_pricing=False)
    chat = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": question}]
    metadata = {"chat_id": "c-seam", "user_id": "u1", "message_id": "m1"}
    hooks = {"__user__": {"id": "u1"}, "__metadata__": metadata, "__event_emitter__": Events()}
    out = await f.inlet({"model": "gpt-4o", "messages": copy.deepcopy(chat), "metadata": metadata}, **hooks)
    sources = rag("", [("report.txt", DOC)]).rstrip("\n")
    out["messages"][-1]["content"] = sources + frame_end + "\n" + out["messages"][-1]["content"]
    sent = (await f.request(out, **hooks))["messages"]
    note = metadata["contextwarden"]
    assert sent[-1]["content"].endswith(frame_end + "\n" + question) and ("report.txt" in sent[-1]["content"])
    assert ("document excerpted" in note["pending_line"]) == (window == 4_096)
    assert note["estimated_prompt_tokens"] == counter.count_messages(sent, "gpt-4o") <= note["budget"]


def test_sources_put_before_a_question_cut_again_are_counted_on_it(counter):
    """The sources are counted on the question the first pass sent; a request pass that cuts
    that question again (here to its marker alone: `\\n[…` where it began with `Who`) puts them
    before another text, and the seam's token goes with it: counted on the copy sent."""
    from contextwarden.face.turnsources import with_turn_sources

    sources, asked = rag("", [("a.txt", FACT)]), "Who founded the observatory? " * 40
    cut = cut_sources(sources, asked, 10_000, counter, "gpt-4o")
    messages = [{"role": "user", "content": "\n[… 401 tokens cut by contextwarden …]"}]
    tokens = counter.count_messages(messages, "gpt-4o") + cut.tokens
    done = with_turn_sources(TurnChoice(messages, 1, tokens, tokens, 10_000, "exact"), cut, counter, "gpt-4o")
    assert done.messages[0]["content"] == sources + "\n" + messages[0]["content"]
    assert done.tokens_after == counter.count_messages(done.messages, "gpt-4o")


async def test_sources_before_a_question_an_earlier_pass_cut_stay_sources_in_a_tool_loop(counter):
    """Inlet cut the question (a pasted log); Open WebUI put sources before it; the request pass
    cut the question again around its marker to give the sources their share. The
    tool loop's next call gets that copy, which is not the question inlet noted: the sources went
    as the question's own words, and the whole was cut again as one text through a stretch of
    the log (two markers in the question). Each pass now notes the question it sent, and the
    first pass's stays known: a tool that cites gets it back, with the sources before it."""
    f = make_filter(counter, max_context_tokens=4_096, openrouter_pricing=False)
    log = "\n".join(f"line {k}: all systems nominal" for k in range(600))
    question = f"Here is the log:\n{log}\nWho founded the observatory on the north ridge?"
    metadata = {"chat_id": "c-cut", "user_id": "u1", "message_id": "m1"}
    hooks = {"__user__": {"id": "u1"}, "__metadata__": metadata, "__event_emitter__": Events()}
    chat = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": question}]
    out = await f.inlet({"model": "gpt-4o", "messages": copy.deepcopy(chat), "metadata": metadata}, **hooks)
    inlet_sent = out["messages"][-1]["content"]
    assert inlet_sent.count("tokens cut by contextwarden") == 1  # inlet cut it
    out["messages"][-1]["content"] = rag(inlet_sent, [("report.txt", DOC)])
    first = (await f.request(out, **hooks))["messages"]
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    loop = [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "The lookup found nothing new. " * 60},
    ]
    second = await f.request({"model": "gpt-4o", "messages": [*first, *loop], "metadata": metadata}, **hooks)
    # a tool that cites: Open WebUI puts inlet's question back, and the sources with the tool's before it
    cited = [first[0], {"role": "user", "content": rag(inlet_sent, [("report.txt", DOC), ("lookup", FILLER[0])])}]
    third = await f.request({"model": "gpt-4o", "messages": [*cited, *loop], "metadata": metadata}, **hooks)
    for sent in (first, second["messages"], third["messages"]):
        sources, seam, asked = sent[1]["content"].partition("</context>\n\n")
        assert seam and sources.startswith("### Task:") and '<source id="1" name="report.txt">' in sources
        assert FACT in sources
        head, cut, tail = re.fullmatch(
            r"(.*?)\n\[… ([0-9,]+) tokens cut by contextwarden …\]\n(.*)", asked, re.S
        ).groups()
        assert question.startswith(head) and question.endswith(tail) and "north ridge?" in tail
        # the marker names the cut chunks' tokens, counted apart (as an excerpt's): a token or so each
        exact = counter.count_text(question, "gpt-4o") - counter.count_text(head, "gpt-4o")
        assert abs(int(cut.replace(",", "")) - (exact - counter.count_text(tail, "gpt-4o"))) <= 8
        assert counter.count_messages(sent, "gpt-4o") <= metadata["contextwarden"]["budget"]


@pytest.mark.parametrize("window", [4_096, 32_000], ids=["cut", "whole"])
async def test_shadow_notes_the_prompt_it_sent_with_the_sources(counter, window):
    """Shadow sends the body as it came, sources whole, and notes what enforce would have sent.
    Its estimate counted the sources twice: once in the body as it came, once as the fixed part
    and what enforce cut of them (10,001 tokens noted for a prompt of 5,013, in either window)."""
    f = make_filter(counter, max_context_tokens=window, openrouter_pricing=False, mode="shadow")
    question = "Who founded the observatory on the north ridge?"
    chat = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": question}]
    sent, note = await _pass(f, chat, question, [("report.txt", DOC)], Events())
    assert sent[-1]["content"] == rag(question, [("report.txt", DOC)])  # as it came
    assert note["estimated_prompt_tokens"] == counter.count_messages(sent, "gpt-4o")
    enforce = make_filter(counter, max_context_tokens=window, openrouter_pricing=False)
    trimmed, _ = await _pass(enforce, chat, question, [("report.txt", DOC)], Events())
    assert note["tokens_saved"] == counter.count_messages(sent, "gpt-4o") - counter.count_messages(trimmed, "gpt-4o")
