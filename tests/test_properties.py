"""Property tests: for any chat and any budget, `trim_messages` keeps the DESIGN.md contract.

Chats are generated two ways. Small ones (up to ~40 messages) are built element by element by
hypothesis, so a failure shrinks to a minimal chat. Large ones (up to 2,000 messages) come from
a seeded generator with the same vocabulary of odd shapes, so they stay fast and reproducible.
A size-weighted draw makes most examples small and some very large.

Example counts: profile `ci` (the default) runs CI_EXAMPLES per test; set
`HYPOTHESIS_PROFILE=thorough` for a long local run.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import random
from collections import Counter as Tally
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import tiktoken
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from contextwarden import Filter, TrimDecision, trim_messages
from contextwarden.core.chatview import ChatView
from contextwarden.core.flags import FLAG_NAMES, pin_fingerprint, read_flags
from contextwarden.core.selection import history_chars, mandatory_indices
from contextwarden.core.tokens import TokenCounter
from contextwarden.core.trim import PINS_DROPPED_NOTE, SHORTENED_MARK, carry_previous
from contextwarden.face.budget import fixed_cost
from contextwarden.money.ledger import read_ledger, usd_to_picodollars
from contextwarden.money.usage import MAX_REPLY_COST_USD, MAX_TOKEN_COUNT

from chats import assert_same_trim, check_contract, frozen, same_role_pairs

CI_EXAMPLES = 1_000
settings.register_profile(
    "ci",
    max_examples=CI_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    max_examples=5_000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

MODELS = ("gpt-4o", "gpt-4", "llama3.1:8b")
FRAGMENTS = (
    "budget",
    "context",
    "the",
    "tool",
    "reply",
    "Paris",
    "2024",
    "3.14159",
    "ünïcode",
    "日本語の文章",
    "émoji 🙂🚀",
    "<|endoftext|>",
    "<|im_start|>",
    "<|fim_prefix|>",
    "def f(x): return {x: []}",
    "\n\n",
    "    ",
    "\t",
    "ﷺ",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "a" * 40,
    "0" * 30,
    "\u200b",
    "\u0000",
    "\ud800",
) + (  # hostile shapes (issue 13): whitespace runs (repeated into long ones), backtick runs, flag spam
    " " * 64,
    "\t" * 16,
    "\u00a0" * 16,
    "`" * 64,
    "``",
    "` `",
    "```\n",
    "!pin",
    "!budget=100 !keep=2",
    "!+pin !-pin",
)
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


# -- text --------------------------------------------------------------------------------------

short_text = st.one_of(
    st.lists(st.sampled_from(FRAGMENTS), max_size=12).map(" ".join),
    st.text(max_size=40),
)


@st.composite
def sized_text(draw, max_repeats: int = 300) -> str:
    """Text from a few fragments repeated: empty up to tens of thousands of tokens."""
    base = draw(st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=6).map(" ".join))
    bucket = draw(st.integers(0, 9))
    repeats = draw(st.integers(0, 3)) if bucket < 6 else draw(st.integers(0, max_repeats))
    return (base + " ") * repeats


# -- messages, hypothesis-native ---------------------------------------------------------------


def _content():
    return st.one_of(
        short_text,
        sized_text(),
        st.none(),
        st.just(""),
        st.lists(
            st.one_of(
                st.builds(lambda t: {"type": "text", "text": t}, short_text), st.just(IMAGE), st.just({"type": "text"})
            ),
            max_size=4,
        ),
    )


@st.composite
def message_block(draw, call_ids) -> list[dict]:
    """One unit-ish block: a user/assistant/system message, a tool group (maybe broken), an orphan."""
    kind = draw(st.sampled_from(["user", "user", "user", "assistant", "assistant", "tools", "orphan", "odd", "system"]))
    if kind in ("user", "assistant"):
        message: dict[str, Any] = {"role": kind, "content": draw(_content())}
        if draw(st.booleans()):
            message["name"] = draw(st.sampled_from(["bob", "ann_2", "日本"]))
        if draw(st.integers(0, 4)) == 0:
            message["id"] = f"m{next(call_ids)}"
            message["info"] = {"usage": {}}
        return [message]
    if kind == "system":
        return [{"role": draw(st.sampled_from(["system", "developer"])), "content": draw(short_text)}]
    if kind == "odd":
        return [{"role": draw(st.sampled_from(["critic", "function", "", None, 7])), "content": draw(short_text)}]
    if kind == "orphan":
        return [{"role": "tool", "tool_call_id": f"gone{next(call_ids)}", "content": draw(short_text)}]
    ids = [f"call_{next(call_ids)}" for _ in range(draw(st.integers(1, 4)))]
    calls = [
        {"id": i, "type": "function", "function": {"name": "lookup", "arguments": json.dumps({"q": draw(short_text)})}}
        for i in ids
    ]
    assistant = {
        "role": "assistant",
        "content": draw(st.sampled_from([None, "", "Let me check."])),
        "tool_calls": calls,
    }
    answered = draw(st.sampled_from(["all", "all", "all", "reversed", "some", "none", "extra"]))
    if answered == "reversed":
        ids = ids[::-1]
    elif answered == "some":
        ids = ids[: max(0, len(ids) - 1)]
    elif answered == "none":
        ids = []
    elif answered == "extra":
        ids = ids + ["stranger"]
    replies = [{"role": "tool", "tool_call_id": i, "content": draw(st.one_of(short_text, sized_text(40)))} for i in ids]
    return [assistant, *replies]


@st.composite
def small_chat(draw) -> list[dict]:
    ids = iter(range(10**9))
    chat: list[dict] = []
    if draw(st.integers(0, 9)) < 8:
        chat.append({"role": "system", "content": draw(sized_text(max_repeats=4_000))})
    for block in draw(st.lists(message_block(ids), max_size=20)):
        chat.extend(block)
    if draw(st.integers(0, 9)) < 8:
        chat.append(
            {"role": "user", "content": draw(st.one_of(short_text, sized_text(), st.lists(st.just(IMAGE), max_size=2)))}
        )
    return chat


# -- messages, seeded (large chats) ------------------------------------------------------------


def seeded_chat(seed: int, n: int, system_repeats: int) -> list[dict]:
    """A chat of about `n` messages with every odd shape, from a seed (fast for thousands)."""
    rng = random.Random(seed)

    def words(k: int) -> str:
        return " ".join(rng.choice(FRAGMENTS) for _ in range(k))

    chat: list[dict] = []
    if rng.random() < 0.85:
        chat.append({"role": "system", "content": (words(8) + " ") * system_repeats})
    call = 0
    while len(chat) < n:
        roll = rng.random()
        if roll < 0.06:
            chat.append({"role": "user", "content": [{"type": "text", "text": words(rng.randint(1, 30))}, IMAGE]})
        elif roll < 0.10:
            chat.append({"role": "user", "content": rng.choice([None, ""]), "name": "bob"})
        elif roll < 0.12:
            chat.append({"role": "tool", "tool_call_id": "orphan", "content": words(5)})
        elif roll < 0.14:
            chat.append({"role": rng.choice(["critic", None, "developer"]), "content": words(6)})
        else:
            chat.append({"role": "user", "content": words(rng.randint(1, 80)), "id": f"u{len(chat)}"})
        for _ in range(rng.choice([0, 0, 0, 1, 2])):
            ids = [f"call_{(call := call + 1)}" for _ in range(rng.randint(1, 3))]
            chat.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": i,
                            "type": "function",
                            "function": {"name": "lookup", "arguments": json.dumps({"q": words(2)})},
                        }
                        for i in ids
                    ],
                }
            )
            answered = ids if rng.random() < 0.9 else ids[:-1]
            chat.extend({"role": "tool", "tool_call_id": i, "content": words(rng.randint(1, 120))} for i in answered)
        chat.append({"role": "assistant", "content": words(rng.randint(0, 100)), "info": {"usage": {}}})
    if rng.random() < 0.8:
        chat.append({"role": "user", "content": words(rng.randint(1, 30))})
    return chat


@st.composite
def any_chat(draw) -> list[dict]:
    """Size-weighted: 70% small (hypothesis-built), 20% up to 200 messages, 10% up to 2,000."""
    bucket = draw(st.integers(0, 9))
    if bucket < 7:
        return draw(small_chat())
    n = draw(st.integers(20, 200)) if bucket < 9 else draw(st.integers(200, 2_000))
    system = draw(st.sampled_from([0, 1, 10, 200, 2_500]))  # up to ~20k tokens of system prompt
    return seeded_chat(draw(st.integers(0, 2**32)), n, system)


budgets = st.one_of(st.integers(64, 400), st.integers(64, 8_000), st.integers(64, 200_000))


# -- the property ------------------------------------------------------------------------------


def estimating_counter() -> TokenCounter:
    """A counter whose encodings failed to load: every count is the offline estimate."""
    counter = TokenCounter(block=True)
    real = tiktoken.get_encoding

    def unavailable(name):
        raise OSError("offline")

    tiktoken.get_encoding = unavailable
    try:
        for model in MODELS:
            counter.mode(model)
    finally:
        tiktoken.get_encoding = real
    assert counter.mode("gpt-4o") == "estimate"
    return counter


ESTIMATOR = None
OVER_BUDGET: Tally = Tally()


def _uncuttable(message: dict, counter: TokenCounter, model: str) -> int:
    """What a mandatory message costs at the least: all of it for assistants (never cut), else
    everything but its text (overhead, role, name, ids, tool-call arguments, images)."""
    if message.get("role") == "assistant":
        return counter.count_message(message, model)
    content = message.get("content")
    images = (
        [p for p in content if isinstance(p, dict) and p.get("type") in ("image_url", "image")]
        if isinstance(content, list)
        else None
    )
    return counter.count_message({**message, "content": images}, model)


def _least_text_cost(message: dict, counter: TokenCounter, model: str) -> int:
    """The fewest tokens a mandatory message's text can shrink to: itself, or a bare cut marker."""
    if message.get("role") == "assistant":
        return 0  # counted whole in _uncuttable
    content = message.get("content")
    texts = (
        [content]
        if isinstance(content, str)
        else [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
        if isinstance(content, list)
        else []
    )
    least = 0
    for text in texts:
        total = counter.count_text(text, model)
        least += min(total, counter.count_text("\n" + SHORTENED_MARK.format(n=total), model)) if total else 0
    return least


def over_budget_reason(chat: list[dict], result, counter: TokenCounter, model: str) -> str:
    """Why the mandatory part could not be cut to the budget (for the report), or 'FIXABLE'."""
    mandatory = mandatory_indices(ChatView(chat))
    floor = 3 + sum(_uncuttable(chat[i], counter, model) for i in mandatory)
    images = sum(
        counter.count_message(chat[i], model) - counter.count_message({**chat[i], "content": None}, model)
        for i in mandatory
        if isinstance(chat[i].get("content"), list)
    )
    if floor > result.budget:
        if images > result.budget // 2:
            return "images in the mandatory part"
        if any(chat[i].get("role") == "assistant" and chat[i].get("content") for i in mandatory):
            return "assistant text in the current turn (never cut)"
        if any(chat[i].get("tool_calls") or chat[i].get("role") == "tool" for i in mandatory):
            return "tool calls and ids of the current turn"
        return "per-message overhead of the mandatory messages"
    # What cannot be cut fits; but each text cut to nothing still carries its marker (~15 tokens),
    # and joined parts may count a token more than apart (one per message of slack).
    least = floor + sum(_least_text_cost(chat[i], counter, model) for i in mandatory)
    if least + len(mandatory) > result.budget:
        return "cut markers on a budget too small for them"
    return "FIXABLE"


def check_trim(chat: list[dict], budget: int, model: str, counter: TokenCounter) -> None:
    before = frozen(chat)
    result = trim_messages(chat, max_tokens=budget, model=model, token_counter=counter)
    check_contract(chat, result, counter, model)
    assert frozen(chat) == before, "input mutated"
    again = trim_messages(copy.deepcopy(chat), max_tokens=budget, model=model, token_counter=counter)
    assert frozen(again.messages) == frozen(result.messages), "not deterministic"
    assert (again.kept, again.dropped, again.shortened) == (result.kept, result.dropped, result.shortened)
    if result.over_budget:
        reason = over_budget_reason(chat, result, counter, model)
        OVER_BUDGET[reason] += 1
        event(f"over_budget: {reason}")
        assert reason != "FIXABLE", "over budget although the uncuttable part fits"
        return
    OVER_BUDGET["within budget"] += 1
    second = trim_messages(result.messages, max_tokens=budget, model=model, token_counter=counter)
    assert not second.changed, "trimming the trimmed chat changed it"
    assert all(a is b for a, b in zip(second.messages, result.messages, strict=True))
    event(f"messages {'>200' if len(chat) > 200 else '21-200' if len(chat) > 20 else '0-20'}")
    event("dropped" if result.dropped else "kept all")
    if result.shortened:
        event("shortened")


@given(chat=any_chat(), budget=budgets, model=st.sampled_from(MODELS))
@example(
    chat=[{"role": "user", "content": "a" + " " * 1_000_000 + "b"}, {"role": "user", "content": "\u00a0" * 1_000_000}],
    budget=500,
    model="gpt-4o",
)
def test_contract_holds_for_any_chat_and_budget(counter, chat, budget, model):
    check_trim(chat, budget, model, counter)


@settings(max_examples=max(50, settings.default.max_examples // 4))
@given(chat=any_chat(), budget=budgets, model=st.sampled_from(MODELS))
# Found by this test: proportional character cuts (keep_ends) and joins counting more than their parts (_cut_middle).
@example(
    chat=[{"role": "system", "content": ""}, {"role": "user", "content": "budget 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 " * 3}],
    budget=64,
    model="gpt-4o",
)
@example(
    chat=[{"role": "system", "content": ""}, {"role": "user", "content": "budget 3.14159 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 " * 2}],
    budget=71,
    model="gpt-4o",
)
# Not fixable (four mandatory system texts, each cut still carries a marker): must not be flagged.
@example(
    chat=[
        {"role": "system", "content": "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 "},
        {"role": "user", "content": ""},
        {"role": "system", "content": "0:0:0:0:"},
        {"role": "system", "content": "𝔘𝔫𝔦𝔠𝔬𝔡𝔢"},
        {"role": "user", "content": "budget budget"},
    ],
    budget=64,
    model="gpt-4o",
)
def test_contract_holds_while_estimating(chat, budget, model):
    global ESTIMATOR
    if ESTIMATOR is None:
        ESTIMATOR = estimating_counter()
    check_trim(chat, budget, model, ESTIMATOR)


@st.composite
def later_turn(draw, chat: list[dict]) -> list[dict]:
    """The chat a later request brings: grown by a reply and a question, and sometimes edited,
    shortened or shifted (a message inserted, removed or changed anywhere)."""
    later = [dict(m) for m in chat]
    for _ in range(draw(st.integers(0, 2))):
        change = draw(st.sampled_from(("insert", "remove", "edit")))
        at = draw(st.integers(0, len(later)))
        if change == "insert":
            later.insert(
                at, {"role": draw(st.sampled_from(("user", "assistant", "system"))), "content": draw(short_text)}
            )
        elif later and at < len(later):
            if change == "remove":
                del later[at]
            else:
                later[at]["content"] = draw(short_text)
    return later + [{"role": "assistant", "content": draw(short_text)}, {"role": "user", "content": draw(short_text)}]


@settings(max_examples=max(50, settings.default.max_examples // 4))
@given(data=st.data(), chat=any_chat(), budget=budgets, model=st.sampled_from(MODELS))
def test_contract_holds_when_the_previous_decision_is_reused(counter, data, chat, budget, model):
    """Next turns pass the last decision (through JSON); whatever changed (messages added,
    inserted, removed or edited), the contract holds and the result is deterministic."""
    first = trim_messages(chat, max_tokens=budget, model=model, token_counter=counter)
    if first.decision is None or first.over_budget:
        return
    later = data.draw(later_turn(chat))
    previous = TrimDecision.from_json(first.decision.to_json())
    result = trim_messages(later, max_tokens=budget, model=model, token_counter=counter, previous=previous)
    check_contract(later, result, counter, model)
    assert frozen(
        trim_messages(later, max_tokens=budget, model=model, token_counter=counter, previous=previous).messages
    ) == frozen(result.messages), "not deterministic"
    event("reused" if result.reused else "selected anew")


@st.composite
def grown_turn(draw, chat: list[dict]) -> list[dict]:
    """The chat a later request brings as Open WebUI sends it (fresh objects): new blocks at
    the end (replies, tool groups, system or odd messages, a question), and sometimes one
    earlier message edited in place to another length."""
    later = json.loads(json.dumps(chat))
    if later and draw(st.booleans()):
        at = draw(st.integers(0, len(later) - 1))
        content = later[at].get("content")
        if isinstance(content, str):
            later[at]["content"] = content + draw(st.text(min_size=1, max_size=20))
    ids = iter(range(10**6, 10**9))
    for block in draw(st.lists(message_block(ids), max_size=4)):
        later.extend(block)
    return later + [{"role": "user", "content": draw(short_text)}]


@settings(max_examples=max(50, settings.default.max_examples // 4))
@given(
    data=st.data(),
    chat=any_chat(),
    budget=budgets,
    model=st.sampled_from(MODELS),
    keep=st.integers(1, 4),
    strategy=st.sampled_from(("relevance", "recent")),
)
def test_next_turn_shortcut_chooses_what_the_full_path_chooses(counter, data, chat, budget, model, keep, strategy):
    """A next turn that reads only the kept and new messages (the decision's size figures) ends
    exactly where reading the whole chat ends: same messages, counts and decision."""
    options = {
        "max_tokens": budget,
        "model": model,
        "token_counter": counter,
        "keep_last_turns": keep,
        "strategy": strategy,
    }
    first = trim_messages(chat, **options)
    if first.decision is None:
        return
    later = data.draw(grown_turn(chat))
    previous = TrimDecision.from_json(first.decision.to_json())
    carried = carry_previous(later, previous=previous, **options)
    fast = trim_messages(later, previous=previous, **options)
    full = trim_messages(later, previous=replace(previous, seen=0), **options)
    assert_same_trim(fast, full)
    if carried is not None:  # the next turn's path alone (the filter runs it on the loop) agrees too
        assert_same_trim(carried, full)
    check_contract(later, fast, counter, model)
    event("reused" if fast.reused else "selected anew")


# -- hostile usage in the outlet (issue 13): whatever a client forges, the body comes back, no
# -- error, and the ledger stays within the per-reply bounds ------------------------------------

HOSTILE_TEXT = (
    "²",
    "١٢",
    "1_000",
    " 12 ",
    "0x10",
    "-1",
    "NaN",
    "sNaN",
    "Infinity",
    "1e999000",
    "1E30",
    "0.0105",
    "1e-999000",
    "9" * 5_000,
    "0." + "1" * 5_000,
    "",
    "12",
)
hostile_number = st.one_of(
    st.integers(min_value=-(10**30), max_value=10**30),
    st.integers(min_value=0, max_value=10**10),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.sampled_from(HOSTILE_TEXT),
    st.text(max_size=12),
    st.decimals().map(str),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
USAGE_KEYS = (
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
    "input_tokens",
    "output_tokens",
    "cost",
    "is_byok",
    "cache_read_input_tokens",
    "cache_creation_input_tokens",
    "prompt_eval_count",
    "eval_count",
    "promptTokenCount",
    "candidatesTokenCount",
    "thoughtsTokenCount",
    "input_tokens_details",
)
DETAIL_KEYS = {
    "prompt_tokens_details": ("cached_tokens", "cache_write_tokens", "cache_creation_tokens"),
    "completion_tokens_details": ("reasoning_tokens",),
    "cost_details": ("upstream_inference_cost",),
}


@st.composite
def hostile_usage(draw) -> dict:
    usage = draw(st.dictionaries(st.sampled_from(USAGE_KEYS), hostile_number, max_size=8))
    for group, keys in DETAIL_KEYS.items():
        if draw(st.booleans()):
            usage[group] = draw(
                st.one_of(st.dictionaries(st.sampled_from(keys), hostile_number, max_size=2), hostile_number)
            )
    return usage


@settings(max_examples=max(50, settings.default.max_examples // 4))
@given(usages=st.lists(hostile_usage(), min_size=1, max_size=4))
@example(
    usages=[
        {"prompt_tokens": 1000, "completion_tokens": 100, "cost": "1e999000"},
        {"prompt_tokens": 1e20, "completion_tokens": "²"},
    ]
)
@example(usages=[{"completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 10**6}}])
def test_outlet_survives_any_forged_usage(counter, usages):
    async def outlets() -> tuple[list, list[str]]:
        f = Filter(counter=counter)
        f.valves = f.Valves(openrouter_pricing=False, calibrate_counts=False)
        statuses: list[str] = []

        async def emit(event: dict) -> None:
            statuses.append(event["data"]["description"])

        for usage in usages:
            body = {
                "model": "gpt-4o",
                "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "ok", "usage": usage}],
            }
            assert await f.outlet(body, __user__={"id": "u"}, __event_emitter__=emit) is body
        return await read_ledger(f.store), statuses

    entries, statuses = asyncio.run(outlets())
    assert not any("internal error" in s for s in statuses) and all(len(s) < 120 for s in statuses)
    [entry] = entries
    replies = len(usages)
    assert entry.counters["requests"] == replies
    for name in ("prompt_tokens", "completion_tokens", "cached_tokens", "reasoning_tokens"):
        assert 0 <= entry.counters[name] <= replies * MAX_TOKEN_COUNT
    assert entry.counters["cached_tokens"] <= entry.counters["prompt_tokens"]
    assert 0 <= entry.counters["cost_picousd"] <= replies * usd_to_picodollars(MAX_REPLY_COST_USD)
    event("estimated" if entry.counters["estimated"] else "believed")


# -- pins and tool definitions (issue 15) ------------------------------------------------------

BUILTIN_TOOLS = json.loads((Path(__file__).parent / "fixtures" / "owui_builtin_tools_0.12.4.json").read_text("utf-8"))
odd_tool = st.one_of(
    st.none(),
    st.integers(),
    short_text,
    st.just({"type": "function"}),
    st.just({"function": {"name": 7}}),
    st.builds(
        lambda name, text: {
            "type": "function",
            "function": {
                "name": name,
                "description": text,
                "parameters": {
                    "type": "object",
                    "properties": {"q": {"type": ["string", "null"], "description": text}},
                },
            },
        },
        st.text(min_size=1, max_size=12),
        short_text,
    ),
)
tool_lists = st.one_of(
    st.none(), st.just([]), st.lists(st.one_of(st.sampled_from(BUILTIN_TOOLS), odd_tool), max_size=40)
)
response_formats = st.one_of(
    st.none(),
    st.just({"type": "text"}),
    st.just({"type": "json_object"}),
    st.builds(
        lambda text: {
            "type": "json_schema",
            "json_schema": {"name": "r", "schema": {"type": "object", "description": text}},
        },
        short_text,
    ),
)


@settings(max_examples=max(50, settings.default.max_examples // 4))
@given(data=st.data(), chat=any_chat(), budget=budgets, model=st.sampled_from(MODELS))
def test_pins_are_sent_unless_even_shortened_they_cannot_fit(counter, data, chat, budget, model):
    """Pinned messages are mandatory: every one is sent (whole or cut middle-out) within the
    budget, unless even their markers cannot fit, and the contract holds either way."""
    pins = data.draw(st.lists(st.integers(0, max(0, len(chat) - 1)), max_size=4, unique=True)) if chat else []
    result = trim_messages(chat, max_tokens=budget, model=model, token_counter=counter, pinned=pins)
    check_contract(chat, result, counter, model, pinned=pins)
    conversation = ChatView(chat)
    # Pins in turns with a question (a reply of a turn without one may not lead the history;
    # orphan tool messages are never sent).
    asked = {i for turn in conversation.turns if turn.units[0].kind == "user" for i in turn.indices}
    sent = set(result.kept) | set(result.shortened)
    if PINS_DROPPED_NOTE not in result.notes:
        assert {p for p in pins if p in asked} <= sent, "a pin was dropped"
        event("pins sent")
    else:
        event("pins over budget even shortened")


@settings(max_examples=max(50, settings.default.max_examples // 4))
@given(
    chat=any_chat(),
    window=st.integers(500, 40_000),
    tools=tool_lists,
    response_format=response_formats,
    model=st.sampled_from(MODELS),
)
def test_the_whole_prompt_fits_with_tool_definitions(counter, chat, window, tools, response_format, model):
    """A body with tool definitions and a response format through the filter: messages plus
    the fixed part fit the budget, unless the mandatory part alone cannot; when the fixed part
    alone fills it, only the mandatory part goes, uncut."""
    f = Filter(counter=counter)
    f.valves = f.Valves(
        max_context_tokens=window, reserve_output_tokens=window // 8, calibrate_counts=False, allowed_user_flags=""
    )
    body: dict[str, Any] = {"model": model, "messages": chat, "metadata": {"chat_id": "", "user_id": "u1"}}
    if tools is not None:
        body["tools"] = tools
    if response_format is not None:
        body["response_format"] = response_format
    out = asyncio.run(f.request(body, __user__={"id": "u1"}, __metadata__=body["metadata"]))
    assert out.get("tools") is body.get("tools") and out["messages"] is not None
    fixed = fixed_cost(body, counter, model).tokens
    total = window - window // 8
    sent = counter.count_messages(out["messages"], model)
    note = body["metadata"]["contextwarden"]
    assert note["estimated_prompt_tokens"] == sent + fixed
    mandatory = [chat[i] for i in mandatory_indices(ChatView(chat))]
    if total - fixed < 64:
        assert all(any(m is s for s in out["messages"]) for m in mandatory), (
            "mandatory part cut although nothing could fit"
        )
        event("fixed part alone over the budget")
    elif sent + fixed > total:
        event("over budget: mandatory part")
    else:
        event("fits with its fixed part" if fixed else "no fixed part")


@pytest.fixture(scope="module", autouse=True)
def report_over_budget():
    yield
    if OVER_BUDGET:
        print("\nover_budget tally:", dict(OVER_BUDGET))


@given(
    texts=st.lists(st.one_of(short_text, sized_text()), min_size=1, max_size=6),
    allowed=st.sets(st.sampled_from(FLAG_NAMES)),
)
# Found by this test: removing every flag moved a fence, so the fingerprint fell back to the text
# as written, which differs by the flags a partial strip had already removed.
@example(texts=["!budget=100 !keep=2 ```\n ```\n !budget=100 !keep=2 ```\n ```\n "], allowed={"budget"})
@example(texts=["!+pin !-pin ```\n !+pin !-pin ```\n !+pin !-pin ```\n !+pin !-pin ```\n "], allowed={"+pin"})
def test_flags_never_break_and_pins_survive_stripping(texts, allowed):
    """Any text (hostile fragments included): flags are read without error or mutation, nothing
    but flag text is removed, and a message's pin fingerprint is the same stripped or not."""
    chat = [{"role": "user", "content": t} for t in texts]
    before = frozen(chat)
    read = read_flags(chat, allowed=allowed)
    assert frozen(chat) == before
    for original, sent in zip(chat, read.messages, strict=True):
        assert pin_fingerprint(original) == pin_fingerprint(sent)
        if sent is not original:
            assert len(sent["content"]) < len(original["content"])
        if not allowed:
            assert sent is original


def _reads_as_seen(sent: list[dict], previous: TrimDecision) -> bool:
    """What was sent is, to `previous`, the chat it saw unchanged: as many messages, as many
    characters (dropped messages as long as the new ones, e.g. all empty). Nothing tells the two
    apart (the kept messages equal the new ones at their places), so a second pass with the
    earlier turn's decision may read it either way; the filter's later passes carry this
    turn's decision instead (`trimpass._relocated`)."""
    return len(sent) == previous.seen and history_chars(sent) == previous.seen_chars


@settings(max_examples=max(50, settings.default.max_examples // 4))
@given(data=st.data(), chat=any_chat(), budget=budgets, model=st.sampled_from(MODELS), turns=st.integers(1, 3))
def test_contract_holds_on_the_recall_path(counter, data, chat, budget, model, turns):
    """A chat that goes on for a few turns, each passing its decision on (through JSON), so that
    recall blocks are made and carried: every turn keeps the contract and is deterministic, the
    fast and the full path agree, roles alternate around each block (its acknowledgement follows
    it: `check_contract`), and a second pass over what was sent (Open WebUI's `request`
    after `inlet`) changes nothing and never adds a second block for the question."""
    result = trim_messages(chat, max_tokens=budget, model=model, token_counter=counter)
    for _ in range(turns):
        if result.decision is None or result.over_budget:
            return
        chat = data.draw(grown_turn(chat))
        previous = TrimDecision.from_json(result.decision.to_json())
        options = {"max_tokens": budget, "model": model, "token_counter": counter, "previous": previous}
        carried = carry_previous(chat, **options)
        result = trim_messages(chat, **options)
        check_contract(chat, result, counter, model)
        if carried is not None:
            assert_same_trim(carried, result)
            event("carried")
        assert_same_trim(result, trim_messages(chat, **{**options, "previous": replace(previous, seen=0)}))
        assert result.recalled == trim_messages(copy.deepcopy(chat), **options).recalled
        if not result.over_budget and not _reads_as_seen(result.messages, previous):
            again = trim_messages(copy.deepcopy(result.messages), **options)
            assert frozen(again.messages) == frozen(result.messages) and not again.changed, (
                "a second pass changed the prompt"
            )
        event("recalled" if result.recalled else "no recall")
        added = set(result.added)
        origin = iter(sorted(result.kept + result.shortened))
        at = [None if k in added else next(origin) for k in range(len(result.messages))]
        if same_role_pairs(chat, result.messages, at):  # the selection's own (check_contract: never the blocks')
            event("two messages with one role in a row (the selection's)")


DOC_WORDS = tuple(
    "river market harbour lantern copper meadow violin orchard granite festival ledger summit canvas pilgrim "
    "quartz saddle thunder velvet walnut yacht zephyr bramble cobalt dune ember falcon glacier hazel Paris 2024 "
    "日本語の文章 émoji ünïcode".split()
) + ("\n", "\n\n", "\n\n", "  ", "<|endoftext|>", "a" * 700)


@st.composite
def document_text(draw) -> str:
    """A pasted document or a tool result: 0 to ~4k tokens of words with line breaks (seeded)."""
    rng = random.Random(draw(st.integers(0, 2**32)))
    return " ".join(rng.choice(DOC_WORDS) for _ in range(draw(st.sampled_from([0, 50, 300, 1_200, 3_000]))))


@st.composite
def document_chat(draw) -> list[dict]:
    """Turns of short questions and answers, pasted documents and tool calls with large results."""
    ids = iter(range(10**9))
    chat: list[dict] = [{"role": "system", "content": "Answer from the documents."}] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["paste", "paste", "tool", "tools", "short"]))
        question = " ".join(draw(st.lists(st.sampled_from(DOC_WORDS[:32]), min_size=1, max_size=6)))
        if kind == "paste":
            content = draw(document_text())
            if draw(st.booleans()):
                content = [{"type": "text", "text": content}, IMAGE] if draw(st.booleans()) else [{"type": "text"}]
            chat.append({"role": "user", "content": content})
        else:
            chat.append({"role": "user", "content": question})
        if kind.startswith("tool"):
            call_ids = [f"call_{next(ids)}" for _ in range(1 if kind == "tool" else draw(st.integers(2, 3)))]
            chat.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": i, "type": "function", "function": {"name": "read", "arguments": "{}"}} for i in call_ids
                    ],
                }
            )
            chat.extend({"role": "tool", "tool_call_id": i, "content": draw(document_text())} for i in call_ids)
        chat.append({"role": "assistant", "content": draw(st.one_of(short_text, document_text()))})
    question = " ".join(draw(st.lists(st.sampled_from(DOC_WORDS[:32]), min_size=1, max_size=6)))
    return chat + [{"role": "user", "content": question + "?"}]


@settings(max_examples=max(50, settings.default.max_examples // 4))
@given(
    data=st.data(),
    chat=document_chat(),
    budget=st.one_of(st.integers(100, 1_500), st.integers(1_500, 8_000)),
    model=st.sampled_from(MODELS),
    turns=st.integers(0, 2),
)
def test_contract_holds_with_large_old_messages_and_tool_results(counter, data, chat, budget, model, turns):
    """Chats with pasted documents and large tool results, over a few turns passing decisions on
    (through JSON): budget, tool pairs and order hold with excerpts; each trim is deterministic,
    the shortcut and the full path agree, and a second pass changes nothing; a turn that keeps the
    selection sends its excerpts again byte for byte."""
    previous = None
    sent: dict[int, dict] = {}
    for _ in range(turns + 1):
        options = {"max_tokens": budget, "model": model, "token_counter": counter, "previous": previous}
        carried = carry_previous(chat, **options)
        result = trim_messages(chat, **options)
        check_contract(chat, result, counter, model)
        if carried is not None:
            assert_same_trim(carried, result)
            event("carried")
        again = trim_messages(copy.deepcopy(chat), **options)
        assert frozen(again.messages) == frozen(result.messages) and again.excerpted == result.excerpted
        if previous is not None:  # the shortcut (reads only what is new) and the full path agree
            assert_same_trim(result, trim_messages(chat, **{**options, "previous": replace(previous, seen=0)}))
        if not result.over_budget:
            second = trim_messages(copy.deepcopy(result.messages), **options)
            assert frozen(second.messages) == frozen(result.messages)
        added = set(result.added)
        plain = dict(
            zip(
                sorted(result.kept + result.shortened),
                [m for k, m in enumerate(result.messages) if k not in added],
                strict=True,
            )
        )
        if result.reused:
            for index in set(sent).intersection(result.excerpted):
                assert plain[index] == sent[index], "a carried excerpt changed"
        event(f"excerpted {min(len(result.excerpted), 2)}" + (" (reused)" if result.reused else ""))
        if result.decision is None or result.over_budget:
            return
        sent = {i: plain[i] for i in result.excerpted}
        previous = TrimDecision.from_json(result.decision.to_json())
        chat = json.loads(json.dumps(chat)) + [
            {"role": "assistant", "content": data.draw(short_text)},
            {"role": "user", "content": data.draw(st.sampled_from(["Thanks!", "ok", "And the river?", "Paris?"]))},
        ]
