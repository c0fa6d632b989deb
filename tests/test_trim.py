"""The DESIGN.md contract for `trim_messages`, rule by rule, then on random chats."""

from __future__ import annotations

import random
import re

import pytest

from contextwarden import TrimDecision, trim_messages
from contextwarden.core.trim import SHORTENED_MARK, TrimResult, carry_previous

from chatgen import random_chat
from chats import check_contract, frozen
from helpers import chat_of, turn

MODEL = "gpt-4o"


def test_fitting_chat_is_returned_whole(counter):
    chat = chat_of(2)
    result = trim_messages(chat, max_tokens=10_000, model=MODEL, token_counter=counter)
    assert result.messages == chat and all(a is b for a, b in zip(result.messages, chat, strict=True))
    assert not result.changed and result.tokens_before == result.tokens_after == counter.count_messages(chat, MODEL)


def test_keeps_system_and_last_user_and_most_recent_turns(counter):
    chat = chat_of(10)
    per_turn = counter.count_messages(turn(9), MODEL) - 3
    mandatory = counter.count_messages([chat[0], chat[-1]], MODEL)
    result = trim_messages(
        chat,
        max_tokens=mandatory + 3 * per_turn + 5,
        model=MODEL,
        token_counter=counter,
        strategy="recent",
        low_watermark=1.0,
    )
    assert result.kept == (0, 15, 16, 17, 18, 19, 20, 21)
    assert result.dropped == tuple(range(1, 15))
    check_contract(chat, result, counter, MODEL)


def test_tool_group_kept_or_dropped_whole(counter):
    chat = [
        {"role": "system", "content": "tools"},
        {"role": "user", "content": "weather in Paris and Rome? " * 20},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "w", "arguments": '{"city":"Paris"}'}},
                {"id": "b", "type": "function", "function": {"name": "w", "arguments": '{"city":"Rome"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "sunny " * 100},
        {"role": "tool", "tool_call_id": "b", "content": "rain " * 100},
        {"role": "assistant", "content": "Paris sunny, Rome rain."},
        {"role": "user", "content": "and tomorrow?"},
    ]
    for budget in range(30, counter.count_messages(chat, MODEL) + 1, 7):
        result = trim_messages(chat, max_tokens=budget, model=MODEL, token_counter=counter)
        check_contract(chat, result, counter, MODEL)
        assert {2, 3, 4} <= set(result.kept) or not {2, 3, 4} & set(result.kept)


def test_tool_loop_in_progress_is_mandatory(counter):
    chat = chat_of(6) + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "x", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "x", "content": "result"},
    ]
    result = trim_messages(chat, max_tokens=80, model=MODEL, token_counter=counter)
    assert result.kept[-3:] == (len(chat) - 3, len(chat) - 2, len(chat) - 1)
    check_contract(chat, result, counter, MODEL)


def test_orphans_are_never_sent(counter):
    chat = [
        {"role": "tool", "tool_call_id": "zzz", "content": "orphan"},
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "q", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "user", "content": "still there?"},
    ]
    result = trim_messages(chat, max_tokens=10_000, model=MODEL, token_counter=counter)
    assert result.dropped == (0, 2)
    check_contract(chat, result, counter, MODEL)


def test_history_does_not_start_with_assistant(counter):
    chat = chat_of(5)
    for budget in range(40, 900, 13):
        result = trim_messages(chat, max_tokens=budget, model=MODEL, token_counter=counter)
        history = [m for m in result.messages if m["role"] != "system"]
        assert history[0]["role"] == "user"


def test_oversize_system_prompt_is_shortened_middle_out(counter):
    system = "START " + "filler words here " * 3000 + " END"
    chat = chat_of(3, system=system)
    before = frozen(chat)
    result = trim_messages(chat, max_tokens=500, model=MODEL, token_counter=counter)
    assert result.shortened == (0,) and not result.over_budget
    content = result.messages[0]["content"]
    assert content.startswith("START") and content.endswith("END")
    assert SHORTENED_MARK.split("{")[0] in content
    assert result.messages[-1] is chat[-1]
    assert frozen(chat) == before
    check_contract(chat, result, counter, MODEL)


def test_oversize_last_user_message_is_cut_only_as_last_resort(counter):
    chat = chat_of(2, system="Short system prompt.", last="Q " + "huge paste " * 5000)
    result = trim_messages(chat, max_tokens=300, model=MODEL, token_counter=counter)
    assert len(chat) - 1 in result.shortened and 0 in result.kept
    assert result.tokens_after <= 300
    check_contract(chat, result, counter, MODEL)


def test_a_pin_is_not_cut_to_its_marker_to_spare_a_pasted_document(counter):
    """Seen in Open WebUI: `!pin My name is Bob ...` (13 tokens), then a ~4,700-token article
    pasted in a ~4,000-token budget. The pin was cut first, to `[… 13 tokens cut by contextwarden
    …]` alone (3 tokens saved, the pin lost), then the article. What the others cannot cover is
    cut from all of them to one level: the pin is sent whole, the article is cut."""
    pin = "My name is Bob and I always want answers in metric units."
    for system in ("", "You are a careful assistant. " * 40):  # a system prompt too small to cover it
        chat = [{"role": "system", "content": system}] if system else []
        chat += [
            {"role": "user", "content": pin},
            {"role": "assistant", "content": "Noted, Bob."},
            {"role": "user", "content": "Here is an article:\n\n" + "The river flows north past the mill. " * 600},
        ]
        at = chat.index({"role": "user", "content": pin})
        result = trim_messages(chat, max_tokens=2_000, model=MODEL, token_counter=counter, pinned=(at,))
        assert chat[at] in result.messages, "the pin was cut"
        assert len(chat) - 1 in result.shortened and result.tokens_after <= 2_000
        assert not system or chat[0] in result.messages  # a 240-token system prompt stays whole too
        check_contract(chat, result, counter, MODEL, pinned=(at,))


_MARKS = re.compile(r"\n?\[… [0-9,]+ tokens cut by contextwarden …\]\n?")


def _marked(text: str) -> tuple[str, int, str]:
    """A shortened text's head, the tokens its one marker names, and its tail."""
    head, number, tail = re.fullmatch(
        r"(.*?)\n?\[… ([0-9,]+) tokens cut by contextwarden …\]\n?(.*)", text, re.S
    ).groups()
    return head, int(number.replace(",", "")), tail


def test_a_shortened_text_cut_again_keeps_its_marker_true(counter):
    """A later pass (request after inlet, each call of a tool loop) gets what the first pass
    sent: its shortened copies were cut again through their marker, which then named 12 tokens
    where 3,001 were cut, and trimming the trimmed prompt over its budget changed it."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    question = {"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}, image]}
    chat = [{"role": "system", "content": "Rules of the house. " * 600}, question]
    first = trim_messages(chat, max_tokens=700, model=MODEL, token_counter=counter)
    again = trim_messages(first.messages, max_tokens=700, model=MODEL, token_counter=counter)
    assert first.over_budget and _marked(first.messages[0]["content"])[1] == 3_001
    assert again.messages == first.messages
    system = " ".join(f"Rule {i} of the house is to be kind." for i in range(400))
    chat = [{"role": "system", "content": system}, {"role": "user", "content": "What are the rules?"}]
    wider = trim_messages(chat, max_tokens=900, model=MODEL, token_counter=counter)
    narrower = trim_messages(wider.messages, max_tokens=500, model=MODEL, token_counter=counter)
    head, cut, tail = _marked(narrower.messages[0]["content"])
    assert narrower.tokens_after <= 500 and system.startswith(head) and system.endswith(tail)
    assert cut == counter.count_text(system, MODEL) - counter.count_text(head, MODEL) - counter.count_text(tail, MODEL)


# Texts whose tokens split characters: an emoji or a CJK character is often two or three byte
# tokens, an accented letter sometimes one byte token of two (a U+FFFD already there stays).
SPLIT_CHARACTERS = {
    "emoji": "Party 🎉😀👩\u200d👩\u200d👧 time! " * 300,
    "cjk": "豫章故郡，洪都新府。星分翼軫，地接衡廬。鬱蒼とした森、龘靐齉爩。" * 120,
    "accented": "Ça été très élégant, naïve façade ŕéšťůž. " * 200,
    "mixed": "hello 🌍 世界 ñ \ufffd " * 200,
}


@pytest.mark.parametrize("model", [MODEL, "gpt-4"])
@pytest.mark.parametrize("name", sorted(SPLIT_CHARACTERS))
def test_a_middle_out_cut_keeps_whole_characters(counter, name, model):
    """A cut at a token boundary split a character whose bytes lie in two tokens, and decoding
    the kept part gave U+FFFD at its edge: the emoji, CJK and mixed texts at 13-80 of 80 budgets
    each. The head and tail are now the text's own characters, in a first cut and in a later
    pass's cut around the marker (`_cut_again`), and the count still fits."""
    text = SPLIT_CHARACTERS[name]
    total = counter.count_text(text, model)
    for budget in range(60, total, total // 40):
        for chat in (
            [{"role": "system", "content": text}, {"role": "user", "content": "Sum up."}],
            [{"role": "user", "content": text}],
        ):
            first = trim_messages(chat, max_tokens=budget, model=model, token_counter=counter)
            again = trim_messages(first.messages, max_tokens=budget * 2 // 3, model=model, token_counter=counter)
            for result, room in ((first, budget), (again, budget * 2 // 3)):
                pieces = _MARKS.split(result.messages[0]["content"])  # the question: cut by passages
                assert text.startswith(pieces[0]) and text.endswith(pieces[-1]), (room, pieces[0][-3:])
                assert all(piece in text for piece in pieces), room
                assert result.tokens_after == counter.count_messages(result.messages, model) <= room


def _pasted(fact_at: int, paragraphs: int = 40) -> str:
    """A long pasted report: numbered paragraphs of their own words, one of them holding the fact."""
    topics = ("harbour", "orchard", "railway", "glacier", "library", "foundry", "vineyard", "market")
    parts = [
        f"Section {k}. The {topics[k % 8]} committee met on day {k} and reviewed budget line {k * 7}. "
        + f"Minutes of meeting {k} were approved without changes after the {topics[(k + 3) % 8]} report. " * 4
        for k in range(paragraphs)
    ]
    parts[fact_at] = "The lighthouse keeper, Ada Brennan, relit the northern lamp in 1893. " + parts[fact_at]
    return "\n\n".join(parts)


@pytest.mark.parametrize("layout", ["question after", "question before"])
def test_a_document_pasted_with_its_question_keeps_the_passage_it_needs(counter, layout):
    """A document and its question in one message, over the budget alone: cut middle-out, the
    passage with the answer (a middle paragraph) was lost while the question was sent (in Open
    WebUI, "Sent 1 message, shortened to fit", and no answer in what the model got). It is cut
    by passages now: both ends, then what the question asks about."""
    ask = "Who relit the northern lamp of the lighthouse, and when?"
    doc = _pasted(fact_at=21)
    text = f"Here is a report:\n\n{doc}\n\n{ask}" if layout == "question after" else f"{ask}\n\n{doc}"
    chat = [{"role": "system", "content": "Answer from the report."}, {"role": "user", "content": text}]
    for budget in (600, 1_200, 2_400):
        result = trim_messages(chat, max_tokens=budget, model=MODEL, token_counter=counter)
        sent = result.messages[-1]["content"]
        assert result.shortened == (1,) and result.tokens_after <= budget
        assert ask in sent and "Ada Brennan, relit the northern lamp in 1893" in sent, budget
        assert all(piece in text for piece in _MARKS.split(sent))


def test_a_pasted_document_asked_for_a_summary_is_cut_evenly(counter):
    """A "Summarize this report" with the report in the same message kept its first two thirds and
    its end (middle-out): a summary of the beginning. Its passages now spread over all of it."""
    doc = _pasted(fact_at=0)
    chat = [{"role": "user", "content": f"Summarize this report.\n\n{doc}"}]
    result = trim_messages(chat, max_tokens=1_000, model=MODEL, token_counter=counter)
    sent = result.messages[-1]["content"]
    held = {k * 4 // 40 for k in range(40) if f"Section {k}. " in sent}
    assert held == {0, 1, 2, 3} and result.tokens_after <= 1_000  # every quarter


def test_a_question_cut_by_passages_cut_again_merges_its_markers(counter):
    """A later pass (request after inlet, a tool loop's call) gets the passages the first kept and
    their markers: cut again, what it leaves out joins the markers beside it, whose counts add up,
    and no marker is cut through."""
    ask = "Who relit the northern lamp of the lighthouse, and when?"
    text = f"{_pasted(fact_at=21)}\n\n{ask}"
    first = trim_messages([{"role": "user", "content": text}], max_tokens=1_500, model=MODEL, token_counter=counter)
    again = trim_messages(first.messages, max_tokens=700, model=MODEL, token_counter=counter)
    sent = again.messages[-1]["content"]
    assert again.tokens_after <= 700 and ask in sent and "Ada Brennan" in sent
    pieces = _MARKS.split(sent)
    assert all(piece in text for piece in pieces) and len(pieces) >= 3
    named = sum(int(n.replace(",", "")) for n in re.findall(r"\[… ([0-9,]+) tokens cut", sent))
    assert abs(named - (counter.count_text(text, MODEL) - sum(counter.count_text(p, MODEL) for p in pieces))) <= 20


@pytest.mark.parametrize("budget", [100, 60])
def test_a_question_cut_by_passages_cut_again_middle_out_names_every_token_cut(counter, budget):
    """A later pass with no room for a passage of the copy the first cut by passages (a question
    on the last paragraph's line: no chunk fits) cuts it middle-out, through the copy's markers:
    the one marker left named the copy's tokens it cut, 1,228 where 3,015 of the message were."""
    ask = "Who relit the northern lamp of the lighthouse, and when?"
    text = f"{_pasted(fact_at=21)} {ask}"
    first = trim_messages([{"role": "user", "content": text}], max_tokens=1_500, model=MODEL, token_counter=counter)
    assert len(_MARKS.findall(first.messages[-1]["content"])) > 1
    again = trim_messages(first.messages, max_tokens=budget, model=MODEL, token_counter=counter)
    sent = again.messages[-1]["content"]
    head, named, tail = _marked(sent)
    assert again.tokens_after <= budget and text.startswith(head) and text.endswith(tail) and ask in tail
    assert (
        abs(named - (counter.count_text(text, MODEL) - sum(counter.count_text(p, MODEL) for p in (head, tail)))) <= 20
    )


def test_multimodal_parts_pass_through(counter):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    chat = chat_of(3) + [
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "this?"}, image]},
    ]
    result = trim_messages(chat, max_tokens=900, model=MODEL, token_counter=counter)
    assert result.messages[-1] is chat[-1] and result.messages[-1]["content"][1] is image
    assert counter.count_message(chat[-1], MODEL) > counter.image_tokens


def test_idempotent_and_deterministic(counter):
    chat = chat_of(12, system="S " * 1500)
    for budget in (200, 700, 2_000):
        first = trim_messages(chat, max_tokens=budget, model=MODEL, token_counter=counter)
        again = trim_messages(chat, max_tokens=budget, model=MODEL, token_counter=counter)
        assert frozen(first.messages) == frozen(again.messages) and first.kept == again.kept
        second = trim_messages(first.messages, max_tokens=budget, model=MODEL, token_counter=counter)
        assert not second.changed and second.messages == first.messages


def test_bad_arguments_raise_clearly(counter):
    with pytest.raises(ValueError, match="max_tokens"):
        trim_messages([], max_tokens=0)
    with pytest.raises(TypeError, match=r"messages\[1\]"):
        trim_messages([{"role": "user", "content": "x"}, "oops"], max_tokens=100, token_counter=counter)


def _two_turns() -> list[dict]:
    return [{"role": "user", "content": "hello " * 40}, {"role": "assistant", "content": "hi " * 40}] + [
        {"role": "user", "content": "And now?"}
    ]


@pytest.mark.parametrize(
    ("given", "error", "says"),
    [
        ({"previous": {"a": 1}}, ValueError, r"previous is not a TrimDecision's to_dict\(\)"),
        ({"previous": "{}"}, TypeError, "previous must be a TrimDecision, its to_dict"),
        ({"model": 5}, TypeError, r"model must be a model id \(str\) or None, got int"),
        ({"messages": None}, TypeError, "messages must be a list of message dicts, got NoneType"),
        ({"messages": (m for m in _two_turns())}, TypeError, "messages must be a list of message dicts, got generator"),
        ({"pinned": (5,)}, ValueError, r"pinned holds 5: not a message position \(the chat's: 0-2\)"),
        ({"pinned": (-1,)}, ValueError, "pinned holds -1"),
        ({"pinned": (True,)}, ValueError, "pinned holds True"),
        ({"pinned": 1}, TypeError, "pinned must be a collection of message positions, got int"),
        ({"keep_last_turns": 0}, ValueError, r"keep_last_turns must be an int >= 1 \(the current turn counts\)"),
        ({"token_counter": "o200k"}, TypeError, "token_counter must be a TokenCounter or None, got str"),
        ({"embed": 5}, TypeError, "embed must be a function"),
        ({"shorten": "no"}, TypeError, "shorten must be True or False"),
    ],
)
def test_a_bad_argument_is_named_not_a_python_error_deep_inside(counter, given, error, says):
    """A review: `previous={"a": 1}` raised AttributeError 'dict' has no 'seen', `model=5` an
    AttributeError, `messages=None` "'NoneType' object is not iterable", a generator "has no
    len()"; pins out of range were silently ignored, on a chat that needs the trim too."""
    options = {"max_tokens": 30, "model": MODEL, "token_counter": counter, **given}
    messages = options.pop("messages", _two_turns())
    with pytest.raises(error, match=says):
        trim_messages(messages, **options)
    if "messages" not in given:  # the next turn's shortcut checks the same
        with pytest.raises(error, match=says):
            carry_previous(messages, **options)


def test_previous_may_be_the_decisions_dict(counter):
    """A decision kept as JSON (`to_dict()`, as the filter stores it) is read back as `previous`."""
    chat = chat_of(6)
    options = {"max_tokens": 600, "model": MODEL, "token_counter": counter}
    first = trim_messages(chat, **options)
    chat = [*chat, *turn(7)[1:], {"role": "user", "content": "More?"}]
    as_dict = trim_messages(chat, previous=first.decision.to_dict(), **options)
    assert first.decision is not None and as_dict == trim_messages(chat, previous=first.decision, **options)
    assert as_dict.reused


def test_the_library_the_cli_and_the_valve_take_the_same_keep_last_turns(tmp_path, capsys):
    """`keep_last_turns=0` was accepted by `trim_messages` (it means what 1 means: the current turn
    counts) while the command line, the valve and `!keep=0` refused it: one minimum now."""
    from contextwarden.core.selection import MIN_KEEP_LAST_TURNS
    from contextwarden.face.valves import valve_range
    from contextwarden.tools.cli import main

    assert MIN_KEEP_LAST_TURNS == 1 and valve_range("keep_last_turns")[0] == MIN_KEEP_LAST_TURNS
    chat = tmp_path / "chat.json"
    chat.write_text('[{"role": "user", "content": "hi"}]')
    for turns in (0, 1):
        code = main(["trim", str(chat), "--max-tokens", "100", "--keep-last-turns", str(turns)])
        err = capsys.readouterr().err
        try:
            trim_messages([{"role": "user", "content": "hi"}], max_tokens=100, keep_last_turns=turns)
        except ValueError as exc:
            assert code == 2 and "--keep-last-turns must be 1 or more" in err and "keep_last_turns" in str(exc)
        else:
            assert code == 0 and turns == 1


@pytest.mark.parametrize("seed", range(40))
def test_contract_on_random_chats(counter, seed):
    rng = random.Random(seed)
    n = rng.choice([1, 3, 10, 60, 250, 1000])
    chat = random_chat(rng, n, system_words=rng.choice([0, 20, 300, 5000]))
    before = frozen(chat)
    total = counter.count_messages(chat, MODEL)
    for budget in {64, 200, 1_000, max(64, total // 3), total + 10}:
        result = trim_messages(chat, max_tokens=budget, model=MODEL, token_counter=counter)
        check_contract(chat, result, counter, MODEL)
        again = trim_messages(result.messages, max_tokens=budget, model=MODEL, token_counter=counter)
        assert not again.changed
    assert frozen(chat) == before


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ({"model": "gpt-4o", "messages": []}, "messages is a dict, not a list of messages (pass body['messages'])"),
        ('[{"role": "user", "content": "hi"}]', "messages is a str, not a list of messages (decode the JSON first)"),
    ],
)
def test_a_request_body_or_json_text_is_named_for_what_it_is(given, says):
    """Issue 31: a body or a JSON string said `messages[0] is str, not a dict`."""
    with pytest.raises(TypeError) as info:
        trim_messages(given, max_tokens=100)
    assert str(info.value) == says


def test_the_same_turn_trimmed_again_with_its_decision_sends_what_it_sent(counter):
    """A retry (a regenerate, a later pass) of a chat's first trimmed turn, with the decision
    that turn made, sends the same prompt: the latest exchange `keep_last_turns` asks for, which
    did not fit the first time, is not taken in again (it was: over the budget, the selection
    was made anew with a recall block, another prompt and a cache miss; a review's random
    chats, 5 in 800)."""
    words = "river market harbour lantern copper meadow violin orchard granite festival".split()
    rng = random.Random(11)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}  # ~765 tokens
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What do you see?"}, image]},
        {"role": "assistant", "content": " ".join(rng.choice(words) for _ in range(100))},
        {"role": "user", "content": "Which river did we talk about? " + " ".join(rng.choice(words) for _ in range(60))},
    ]
    options = {"max_tokens": 800, "model": MODEL, "token_counter": counter, "low_watermark": 0.5, "keep_last_turns": 2}
    first = trim_messages(chat, **options)
    assert first.kept == (0, 3)
    again = trim_messages(chat, previous=TrimDecision.from_json(first.decision.to_json()), **options)
    assert frozen(again.messages) == frozen(first.messages)


def test_a_selection_made_for_a_far_smaller_budget_is_made_anew(counter):
    """A `!budget=300` turn stored its 4-message selection; the next turn, at the chat's 3,000,
    carried it (286 tokens, 6 messages) and kept doing so until the chat grew into the budget. A
    new selection sends 22 messages (2,334 tokens); the turn after carries that one."""
    chat = chat_of(40)
    small = trim_messages(chat, max_tokens=300, model=MODEL, token_counter=counter)
    chat += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and then?"}]
    carried = trim_messages(chat, max_tokens=3_000, model=MODEL, token_counter=counter, previous=small.decision)
    fresh = trim_messages(chat, max_tokens=3_000, model=MODEL, token_counter=counter)
    assert not carried.reused and carried.messages == fresh.messages and carried.tokens_after > 2_000
    chat += [{"role": "assistant", "content": "fine"}, {"role": "user", "content": "more?"}]
    after = trim_messages(chat, max_tokens=3_000, model=MODEL, token_counter=counter, previous=carried.decision)
    assert after.reused and after.messages[: carried.stable_prefix] == carried.messages[: carried.stable_prefix]


def test_a_carried_selection_is_starved_only_far_below_the_budget_and_what_it_was_made_for():
    """`_starved`: made for at most half the budget, however much it fills; or under a quarter
    of it and sending less than half what it sent (a tool loop's results, gone on a regenerate:
    the simulator's case of 18 tokens sent of 3,072). A selection carried as it was made, at its
    own budget, never is."""
    from contextwarden.core.trim import _starved

    def sent(tokens: int) -> TrimResult:
        return TrimResult([], (), (), (), 9_000, tokens, 3_000, "exact")

    made = TrimDecision(3_000, 2_900, "relevance", ())
    assert _starved(sent(18), made, 3_000) and not _starved(sent(800), made, 3_000)
    assert not _starved(sent(700), TrimDecision(3_000, 650, "relevance", ()), 3_000)  # as it was made
    assert _starved(sent(286), TrimDecision(300, 274, "relevance", ()), 3_000)  # a !budget=300 turn's
    assert not _starved(sent(286), TrimDecision(2_000, 274, "relevance", ()), 3_000)
    assert _starved(sent(2_133), TrimDecision(300, 274, "relevance", ()), 3_000)  # the chat grown into it
    assert _starved(sent(2_133), TrimDecision(1_500, 1_400, "relevance", ()), 3_000)
    assert not _starved(sent(2_133), TrimDecision(1_501, 1_400, "relevance", ()), 3_000)


def test_a_question_is_not_cut_to_its_marker_when_that_cannot_make_it_fit(counter):
    """Found by the filter simulator: a question with images that alone are over the budget had
    its words cut to a bare marker (`[… 391 tokens cut by contextwarden …]`) and went over the
    budget all the same: the turn's question lost for nothing. It now goes whole (over budget,
    as it must); where cutting it can make the part fit, it is still cut to fit."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    words = "Please compare these charts and tell me which quarter grew fastest. " * 30
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": words}, *[image] * 4]},
    ]
    over = trim_messages(chat, max_tokens=1_000, model=MODEL, token_counter=counter)
    assert over.over_budget and over.messages[-1] is chat[-1] and over.shortened == ()
    fits = trim_messages(chat, max_tokens=3_200, model=MODEL, token_counter=counter)
    assert not fits.over_budget and fits.shortened == (1,) and fits.tokens_after <= 3_200


def test_a_document_dropped_whole_is_left_out_on_every_path(counter):
    """`left_out`: the documents neither sent nor quoted. The next turn's shortcut, which reads
    only what is new, finds the same as the full path (from the decision's `documents`); a
    decision stored before they were recorded sends the turn by the full path, once."""
    from dataclasses import replace

    from test_passage_turns import long_text

    chat = [
        {"role": "user", "content": "Please keep this report in mind:\n\n" + long_text(3, 80, 5)},
        {"role": "assistant", "content": "I have read the report."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    options = {"max_tokens": 800, "model": "gpt-4o", "token_counter": counter}
    first = trim_messages(chat, **options)
    assert first.left_out == (0,) and first.decision is not None and first.decision.documents == (0,)
    previous = first.decision
    for city in ("Italy", "Spain", "Greece"):
        chat += [{"role": "assistant", "content": "Paris."}, {"role": "user", "content": f"And of {city}?"}]
        full = trim_messages(chat, **options, previous=previous)
        carried = carry_previous(chat, **options, previous=previous)
        assert full.left_out == (0,) and (carried is None or carried == full)
        previous = full.decision
    assert carried is not None  # the shortcut ran, and agreed
    old = replace(previous, documents=None)
    chat += [{"role": "assistant", "content": "Athens."}, {"role": "user", "content": "And of Malta?"}]
    assert carry_previous(chat, **options, previous=old) is None
    assert trim_messages(chat, **options, previous=old).left_out == (0,)
    short = trim_messages([{"role": "user", "content": "hi " * 900}, *chat[1:]], **options)
    assert 0 in short.dropped and short.left_out == ()  # ~900 tokens: no document


def test_a_long_reply_dropped_is_not_told_a_document_left_out(counter):
    """A long answer of the model's own (a generated report, code) dropped is the chat's history,
    not something the user gave: the status said "document left out" for it."""
    from test_passage_turns import long_text

    chat = [
        {"role": "user", "content": "Write me a long report."},
        {"role": "assistant", "content": long_text(3, 80, 5)},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    result = trim_messages(chat, max_tokens=800, model="gpt-4o", token_counter=counter)
    assert 1 in result.dropped and result.left_out == ()
    assert result.decision is not None and result.decision.documents == (1,)  # still a document to summarize
