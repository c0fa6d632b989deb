"""Recall blocks that quote passages of a long message (issue 27, item 1), turn after turn.

A chat about a pasted document (or a long tool result) goes on for several turns, each question
about another part of it, each turn passing its decision on through JSON: every turn keeps the
contract (`check_contract`), the shortcut and the full path agree, no passage is sent twice, a turn
that keeps the selection and every earlier block sends the previous prompt again as its prefix,
and a second pass over what was sent changes nothing.
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import replace

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from contextwarden import TrimDecision, trim_messages
from contextwarden.core.excerpt import split_chunks
from contextwarden.core.tokens import TokenCounter
from contextwarden.core.trim import TrimResult, carry_previous

from chats import assert_same_trim, check_contract, frozen

FILLER = (
    "river market harbour lantern copper meadow violin orchard granite festival ledger summit canvas "
    "pilgrim quartz saddle thunder velvet walnut yacht zephyr bramble cobalt dune ember falcon glacier"
).split()
THINGS = (
    "tractor umbrella saxophone telescope bicycle typewriter harpsichord lawnmower chandelier wheelbarrow "
    "accordion microscope sundial xylophone kayak metronome trombone catapult periscope zeppelin"
).split()
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
_COUNTER: TokenCounter | None = None


def counter() -> TokenCounter:
    global _COUNTER
    if _COUNTER is None:
        _COUNTER = TokenCounter(block=True)
    return _COUNTER


def fact(k: int) -> str:
    return f"The {THINGS[k]} belongs to owner {k * 37 + 11}."


def long_text(seed: int, paragraphs: int, facts: int) -> str:
    """Paragraphs of filler (seeded), `facts` of them ending with a `fact`, spread over the text."""
    rng = random.Random(seed)
    out = []
    every = max(1, paragraphs // max(1, facts))
    for p in range(paragraphs):
        text = " ".join(
            " ".join(rng.choice(FILLER) for _ in range(rng.randint(6, 14))).capitalize() + "." for _ in range(5)
        )
        if p % every == every // 2 and p // every < facts:
            text += " " + fact(p // every)
        out.append(text)
    return "\n\n".join(out)


@st.composite
def document_chat(draw) -> tuple[list[dict], int]:
    """A chat that pastes a long document (or reads a long tool result), then a few short turns,
    then a question about one of its facts; and how many facts it holds."""
    facts = draw(st.integers(3, len(THINGS)))
    text = long_text(draw(st.integers(0, 2**16)), draw(st.integers(40, 220)), facts)
    chat: list[dict] = [{"role": "system", "content": "Answer from the document."}] if draw(st.booleans()) else []
    shape = draw(st.sampled_from(["paste", "paste", "parts", "tool"]))
    if shape == "tool":
        chat += [
            {"role": "user", "content": "Read the inventory file."},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "read", "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": text},
        ]
    elif shape == "parts":
        chat.append({"role": "user", "content": [{"type": "text", "text": text}, IMAGE]})
    else:
        chat.append({"role": "user", "content": "Keep this inventory in mind:\n\n" + text})
    chat.append({"role": "assistant", "content": "I have read it."})
    for n in range(draw(st.integers(0, 6))):
        chat += [
            {"role": "user", "content": f"Tell me something about {FILLER[n]} and {FILLER[-n - 1]}."},
            {"role": "assistant", "content": f"{FILLER[n].capitalize()} is a word. " * draw(st.integers(1, 20))},
        ]
    chat.append({"role": "user", "content": f"Who owns the {THINGS[draw(st.integers(0, facts - 1))]}?"})
    return chat, facts


def blocks_chunks(result: TrimResult) -> list[tuple[int, int]]:
    """(message, chunk) for each passage the decision's recall blocks quote, with repeats."""
    assert result.decision is not None
    return [(i, c) for r in result.decision.recalls for k, i in enumerate(r.at) for c in r.passages(k)]


def check_passages(chat: list[dict], result: TrimResult) -> None:
    """No passage goes twice (in an excerpt and a block, or in two blocks); the result's figures
    say what the blocks and excerpts send."""
    assert result.decision is not None
    quoted = blocks_chunks(result)
    assert len(quoted) == len(set(quoted)), "a passage quoted twice"
    excerpts = dict(result.decision.excerpts)
    assert not any(c in excerpts.get(i, ()) for i, c in quoted), "a passage in its excerpt and a block"
    by_message: dict[int, set[int]] = {}
    for i, c in quoted:
        by_message.setdefault(i, set()).add(c)
    assert dict(result.recalled_passages) == {i: tuple(sorted(c)) for i, c in by_message.items()}
    for i, (sent, total) in zip(result.excerpted, result.passages, strict=True):
        assert (sent, total) == (len(set(excerpts[i]) | by_message.get(i, set())), len(split_chunks(text_of(chat[i]))))
    only_quoted = sorted(set(by_message).difference(result.excerpted))  # read in a block alone
    assert result.quoted_passages == tuple(
        (i, len(by_message[i]), len(split_chunks(text_of(chat[i])))) for i in only_quoted
    )
    if only_quoted:
        event("passages quoted of a message not excerpted")


def text_of(message: dict) -> str:
    content = message["content"]
    return content if isinstance(content, str) else max((p["text"] for p in content if "text" in p), key=len)


def question(draw, facts: int) -> str:
    return draw(
        st.one_of(
            st.integers(0, facts - 1).map(lambda k: f"And who owns the {THINGS[k]}?"),
            st.sampled_from(["Thanks!", "Summarize the whole document.", "Which owners are listed near the end?"]),
        )
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    data=st.data(),
    chat_facts=document_chat(),
    budget=st.integers(1_200, 9_000),
    model=st.sampled_from(["gpt-4o", "gpt-4"]),
    turns=st.integers(2, 6),
)
def test_passages_keep_the_contract_turn_after_turn(data, chat_facts, budget, model, turns):
    chat, facts = chat_facts
    count = counter()
    options = {"max_tokens": budget, "model": model, "token_counter": count}
    result = trim_messages(chat, **options)
    check_contract(chat, result, count, model)
    for _ in range(turns):
        if result.decision is None or result.over_budget:
            return
        last = result
        chat = json.loads(json.dumps(chat)) + [
            {"role": "assistant", "content": "It is in the document."},
            {"role": "user", "content": question(data.draw, facts)},
        ]
        previous = TrimDecision.from_json(last.decision.to_json())
        turn = {**options, "previous": previous}
        carried = carry_previous(chat, **turn)
        result = trim_messages(chat, **turn)
        check_contract(chat, result, count, model)
        if result.decision is not None:
            check_passages(chat, result)
        if carried is not None:
            assert_same_trim(carried, result)
        assert_same_trim(result, trim_messages(chat, **{**turn, "previous": replace(previous, seen=0)}))
        kept_blocks = result.decision is not None and set(previous.recalls) <= set(result.decision.recalls)
        if result.reused and kept_blocks:  # the previous prompt, byte for byte, then what is new
            assert frozen(result.messages[: len(last.messages)]) == frozen(last.messages)
        if not result.over_budget:  # a second pass over what was sent changes nothing
            again = trim_messages(copy.deepcopy(result.messages), **turn)
            assert frozen(again.messages) == frozen(result.messages) and not again.changed
        event("passages" if result.recalled_passages else "no passages")
        event("reused" if result.reused else "selected anew")


def test_a_later_pass_keeps_the_excerpt_of_a_document_sent_with_an_image():
    """A document sent with an image (content parts) that a summary request excerpts: a second
    pass over what was sent (Open WebUI's `request` after `inlet`), with the turn's `previous`,
    sends it again. Found by the property above: the shortcut's length check (`history_chars`)
    sees the same number of parts, takes the excerpt for the document the previous turn dropped,
    and drops it (1,135 tokens sent, then 46). With the text as a plain string it holds."""
    count = counter()
    text = long_text(1, 60, 3)
    chat = [
        {"role": "user", "content": [{"type": "text", "text": text}, IMAGE]},
        {"role": "assistant", "content": "I have read it."},
        {"role": "user", "content": "Tell me about the weather."},
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "Who owns the zeppelin?"},  # in no passage: the document is dropped
    ]
    options = {"max_tokens": 1_200, "model": "gpt-4o", "token_counter": count}
    first = trim_messages(chat, **options)
    assert first.dropped[:1] == (0,) and first.decision is not None
    chat += [{"role": "assistant", "content": "Nobody."}, {"role": "user", "content": "Summarize the whole document."}]
    previous = TrimDecision.from_json(first.decision.to_json())
    summary = trim_messages(chat, previous=previous, **options)
    assert summary.excerpted == (0,)
    again = trim_messages(copy.deepcopy(summary.messages), previous=previous, **options)
    assert frozen(again.messages) == frozen(summary.messages) and not again.changed
