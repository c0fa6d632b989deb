"""`Filter` hooks as Open WebUI calls them: trimming, status, usage line, fail-open, valves."""

from __future__ import annotations

import logging

import pytest

from contextwarden import Filter, trim_messages
from contextwarden.core.conversation import RECALL_LABEL, SUMMARY_ACK, is_recall_message, recall_message
from contextwarden.face.filter import model_context_length
from contextwarden.face.summarize import SUMMARY_LABEL

from chats import check_contract, frozen
from helpers import Events, body_of, chat_of, grow, make_filter, sent_count, usage_records
from turns import run_turn


async def test_inlet_and_request_trim_once_and_agree(counter):
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=500)
    chat = chat_of(20)
    before = frozen(chat)
    body = body_of(chat)
    events = Events()
    first = await f.inlet(body, __user__={"id": "u1"}, __metadata__=body["metadata"], __event_emitter__=events)
    assert len(first["messages"]) < len(chat) and counter.count_messages(first["messages"], "gpt-4o") <= 1_000
    second = await f.request(first, __user__={"id": "u1"}, __metadata__=first["metadata"], __event_emitter__=events)
    assert second["messages"] == first["messages"] and all(
        a is b for a, b in zip(second["messages"], first["messages"], strict=True)
    )
    assert frozen(chat) == before and body["messages"] is chat
    assert events.statuses == []  # one line a turn, after the reply: nothing before it
    words = body["metadata"]["contextwarden"]["pending_line"]  # what the outlet will show
    assert words == f"Sent {sent_count(chat, first['messages'])} of {len(chat)} messages", words
    assert body["metadata"]["contextwarden"]["estimated_prompt_tokens"] == counter.count_messages(
        first["messages"], "gpt-4o"
    )


@pytest.mark.parametrize("label", [RECALL_LABEL, SUMMARY_LABEL])
async def test_a_question_that_reads_like_the_filters_own_message_is_the_users(counter, label):
    """Found by fuzzing: a latest question starting with the recall block's or the summary
    note's label was dropped (or moved after the system prompt with a `Noted.`), and the chat
    sent ended with an assistant message. The filter knows its own messages by what the
    turn's note recorded, not by their text."""
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=100)
    chat = chat_of(30)
    await run_turn(f, chat, chat_id="lookalike")
    chat = grow(chat, 31)
    chat[-1] = {"role": "user", "content": f"{label}\nWhat did question 3 say?"}
    run = await run_turn(f, chat, chat_id="lookalike")
    for sent in (run.after_inlet["messages"], run.after_request["messages"]):
        assert sent[-1] is chat[-1]
        assert sum(m is chat[-1] for m in sent) == 1 and len(sent) < len(chat)


async def test_short_chat_passes_unchanged(counter):
    f = make_filter(counter)
    body = body_of(chat_of(1))
    assert await f.inlet(body) is body


async def test_task_calls_are_skipped(counter):
    f = make_filter(counter, max_context_tokens=200, reserve_output_tokens=0)
    body = body_of(chat_of(20), task="title_generation")
    assert await f.inlet(body, __metadata__=body["metadata"]) is body


async def test_budget_from_model_context_length(counter):
    f = make_filter(counter, reserve_output_tokens=100)
    body = body_of(chat_of(30))
    model = {"id": "x", "openai": {"id": "x", "context_length": 1_100}}
    out = await f.inlet(body, __metadata__=body["metadata"], __model__=model)
    assert body["metadata"]["contextwarden"]["budget"] == 1_000
    check_contract(body["messages"], _result_of(counter, body, out), counter, "gpt-4o")


async def test_the_valves_window_is_capped_by_a_smaller_models_own(counter):
    """Seen in the chat page: one admin window (8,000) for every model, and a chat switched to
    a model that lists 4,096 tokens was sent ~7,100 (the provider refuses it). The valve's
    window is at most the model's own; a larger model keeps the valve's."""
    f = make_filter(counter, max_context_tokens=8_000, reserve_output_tokens=100)
    small = {"id": "small", "openai": {"id": "small", "context_length": 1_100}}
    body = body_of(chat_of(60))
    out = await f.inlet(body, __metadata__=body["metadata"], __model__=small)
    assert body["metadata"]["contextwarden"]["budget"] == 1_000
    assert counter.count_messages(out["messages"], "gpt-4o") <= 1_000
    large = {"id": "large", "openai": {"id": "large", "context_length": 128_000}}
    body = body_of(chat_of(60))
    await f.inlet(body, __metadata__=body["metadata"], __model__=large)
    assert body["metadata"]["contextwarden"]["budget"] == 7_900


def _result_of(counter, body, out):

    return trim_messages(
        body["messages"], max_tokens=body["metadata"]["contextwarden"]["budget"], model="gpt-4o", token_counter=counter
    )


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ({"info": {"params": {"num_ctx": 4096}}, "openai": {"context_length": 128000}}, 4096),
        ({"openai": {"max_model_len": 32768}}, 32768),
        ({"openai": {"top_provider": {"context_length": 200000}}}, 200000),
        ({"openai": {"context_length": True}}, None),
        (None, None),
    ],
)
def test_model_context_length(model, expected):
    assert model_context_length(model) == expected


async def test_user_budget_only_lowers(counter):
    f = make_filter(counter, max_context_tokens=3_000, reserve_output_tokens=0)
    chat = chat_of(30)
    low = body_of(chat)
    await f.inlet(
        low, __user__={"id": "u1", "valves": f.UserValves(max_context_tokens=800)}, __metadata__=low["metadata"]
    )
    assert low["metadata"]["contextwarden"]["budget"] == 800
    high = body_of(chat)
    await f.inlet(
        high, __user__={"id": "u1", "valves": f.UserValves(max_context_tokens=90_000)}, __metadata__=high["metadata"]
    )
    assert high["metadata"]["contextwarden"]["budget"] == 3_000


async def test_user_can_hide_status(counter):
    f = make_filter(counter)
    events = Events()
    body = body_of(chat_of(2))
    await f.inlet(body, __user__={"id": "u", "valves": f.UserValves(show_status=False)}, __event_emitter__=events)
    assert events.items == []


async def test_workspace_model_uses_base_model_encoding(counter):
    f = make_filter(counter, max_context_tokens=2_000, reserve_output_tokens=0)
    body = body_of(chat_of(30), model="my-helper")
    await f.inlet(
        body, __metadata__=body["metadata"], __model__={"id": "my-helper", "info": {"base_model_id": "gpt-4"}}
    )
    sent = (await f.inlet(body_of(chat_of(30), model="gpt-4"), __metadata__={}))["messages"]
    assert body["metadata"]["contextwarden"]["estimated_prompt_tokens"] == counter.count_messages(sent, "gpt-4")


async def test_outlet_logs_one_real_usage_line(counter, caplog):
    caplog.set_level(logging.INFO, logger="contextwarden")
    f = make_filter(counter)
    chat = chat_of(2)
    body = body_of(chat)
    user = {"id": "u1", "email": "ann@example.com"}
    await f.request(await f.inlet(body, __user__=user, __metadata__=body["metadata"]), __user__=user)
    reply = {
        "role": "assistant",
        "content": "Answer.",
        "usage": {"prompt_tokens": 321, "completion_tokens": 12, "total_tokens": 333},
    }
    events = Events()
    out_body = {"model": "gpt-4o", "messages": chat + [reply], "chat_id": "c1"}
    assert (
        await f.outlet(
            out_body,
            __user__={"id": "u1", "email": "ann@example.com"},
            __metadata__=body["metadata"],
            __event_emitter__=events,
        )
        is out_body
    )
    [record] = usage_records(caplog)
    assert record == {
        "model": "gpt-4o",
        "resolved_model": "openai/gpt-4o",
        "user_id": "u1",
        "chat_id": "c1",
        "prompt_tokens": 321,
        "completion_tokens": 12,
        "cached_tokens": None,
        "reasoning_tokens": None,
        "estimated": False,
        "estimated_prompt_tokens": counter.count_messages(chat, "gpt-4o"),
        "usage_shape": "openai",
        # 321 x $2.50/M + 12 x $10/M
        "cost_usd": "0.0009225",
        "cost_source": "price_table",
        "cost_note": None,
        "mode": "enforce",
        "tokens_saved": 0,
        "cost_saved_usd": "0",  # the chat fit: nothing trimmed
        "v": 1,  # records.USAGE_RECORD_VERSION
    }
    assert "ann@example.com" not in caplog.text and "lorem" not in caplog.text
    assert events.statuses == ["Whole chat sent · 321 tokens in · 12 out · $0.0009"]


async def test_outlet_usage_in_info_and_estimates(counter, caplog):
    caplog.set_level(logging.INFO, logger="contextwarden")
    f = make_filter(counter)
    chat = chat_of(1)
    saved = {"role": "assistant", "content": "Hi.", "info": {"usage": {"prompt_eval_count": 50, "eval_count": 7}}}
    await f.outlet({"model": "llama3.1:8b", "messages": chat + [saved]}, __user__={"id": "u2"})
    bare = {"role": "assistant", "content": "Hello there."}
    await f.outlet({"model": "gpt-4o", "messages": chat + [bare]}, __user__={"id": "u2"})
    real, estimate = usage_records(caplog)
    assert (real["prompt_tokens"], real["completion_tokens"], real["estimated"]) == (50, 7, False)
    assert estimate["estimated"] is True
    assert estimate["prompt_tokens"] == counter.count_messages(chat, "gpt-4o")
    assert estimate["completion_tokens"] == counter.count_text("Hello there.", "gpt-4o")


@pytest.mark.parametrize(
    "body",
    [
        None,
        [],
        "text",
        {},
        {"messages": None},
        {"messages": "hi"},
        {"messages": [1, 2]},
        {"messages": [{"role": "user", "content": 5}]},
        {"messages": [{"role": "user", "content": {"odd": True}}, None]},
        {"messages": []},
    ],
)
async def test_malformed_bodies_pass_through(counter, body):
    f = make_filter(counter, max_context_tokens=100, reserve_output_tokens=0)
    for hook in (f.inlet, f.request, f.outlet):
        assert await hook(body, __user__={"id": "u"}, __metadata__={}) is body


async def test_internal_error_fails_open(counter, caplog, monkeypatch):
    import contextwarden.face.trimpass as trimpass_module

    def broken(*args, **kwargs):
        raise KeyError("secret message text")

    monkeypatch.setattr(trimpass_module, "trim_messages", broken)
    f = make_filter(counter)
    events = Events()
    body = body_of(chat_of(3))
    assert await f.inlet(body, __event_emitter__=events) is body
    assert "secret message text" not in caplog.text
    [line] = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert line.startswith("contextwarden: inlet failed (KeyError at test_filter.py:")
    assert events.statuses == ["contextwarden skipped this turn (internal error)"]


async def test_broken_emitter_does_not_break_the_turn(counter):
    async def emitter(event):
        raise RuntimeError("socket closed")

    f = make_filter(counter, max_context_tokens=500, reserve_output_tokens=0)
    out = await f.inlet(body_of(chat_of(10)), __event_emitter__=emitter)
    assert len(out["messages"]) < 21


async def test_bad_valves_are_named_and_chat_goes_on(counter, caplog):
    f = make_filter(counter, model_aliases="{not json", redis_url="http://nope")
    events = Events()
    body = body_of(chat_of(2))
    assert (await f.inlet(body, __event_emitter__=events))["messages"] == body["messages"]
    text = " ".join(events.statuses)
    assert "model_aliases is not valid JSON" in text and "redis_url must start with redis://" in text
    f.valves = f.Valves(max_context_tokens=1_000, reserve_output_tokens=5_000)
    events.items.clear()
    await f.inlet(body_of(chat_of(2)), __event_emitter__=events)
    assert any("reserve_output_tokens" in s for s in events.statuses)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert all("valve" in r.getMessage() for r in warnings)
    # the same problem is logged once, not on every request
    await f.inlet(body_of(chat_of(2)), __event_emitter__=events)
    assert len([r for r in caplog.records if "reserve_output_tokens" in r.getMessage()]) == 1


async def test_valves_of_the_wrong_type_are_named(counter):
    f = make_filter(counter)
    f.valves = f.Valves.model_construct(max_context_tokens="lots", show_status=True)
    events = Events()
    await f.inlet(body_of(chat_of(2)), __event_emitter__=events)
    assert any("max_context_tokens has the wrong type" in s for s in events.statuses)


def test_valves_are_described_and_secrets_hidden():
    for model in (Filter.Valves, Filter.UserValves):
        for name, field in model.model_fields.items():
            assert field.description, name
    assert Filter.Valves.model_json_schema()["properties"]["redis_url"]["input"] == {"type": "password"}
    assert list(Filter.Valves.model_fields)[0] == "mode"  # Open WebUI reads priority by name; the form starts with mode


async def test_window_falls_back_to_the_price_table(counter):
    f = make_filter(counter, reserve_output_tokens=1_000, openrouter_pricing=False)
    known = body_of(chat_of(2), model="gpt-4o")
    await f.inlet(known, __metadata__=known["metadata"])
    assert known["metadata"]["contextwarden"]["budget"] == 128_000 - 1_000  # openai/gpt-4o in the bundled table
    unknown = body_of(chat_of(2), model="my-local-model")
    await f.inlet(unknown, __metadata__=unknown["metadata"])
    assert unknown["metadata"]["contextwarden"]["budget"] == 8_192 - 1_000  # the documented default
    listed = body_of(chat_of(2), model="gpt-4o")
    await f.inlet(listed, __metadata__=listed["metadata"], __model__={"id": "gpt-4o", "context_length": 16_000})
    assert listed["metadata"]["contextwarden"]["budget"] == 15_000  # what the connection lists wins


async def test_outlet_counts_the_reply_so_the_next_turn_encodes_only_the_question():
    from contextwarden.core.tokens import TokenCounter

    class Spy:
        """An encoding that records which texts it was asked to encode."""

        def __init__(self, inner):
            self.inner, self.texts = inner, []

        def encode_ordinary(self, text):
            self.texts.append(text)
            return self.inner.encode_ordinary(text)

    counter = TokenCounter(block=True)
    assert counter.wait_ready("gpt-4o")
    spy = counter._encodings["o200k_base"] = Spy(counter._encodings["o200k_base"])
    # a room for 8 of chat_of's turns: whole turns, the first trim quotes nothing
    f = make_filter(counter, max_context_tokens=2_900, reserve_output_tokens=500)
    chat = chat_of(20)
    await f.inlet(body_of(chat), __user__={"id": "u1"}, __metadata__={"chat_id": "c1"})
    reply = {
        "role": "assistant",
        "content": "A reply nobody has counted yet, with some words.",
        "usage": {"prompt_tokens": 9, "completion_tokens": 9},
    }
    await f.outlet(
        {"model": "gpt-4o", "messages": chat + [reply], "chat_id": "c1"},
        __user__={"id": "u1"},
        __metadata__={"chat_id": "c1"},
    )
    assert spy.texts[-1] == reply["content"]
    spy.texts.clear()
    question = {"role": "user", "content": "And a new question?"}
    out = await f.inlet(
        body_of(chat + [{"role": "assistant", "content": reply["content"]}, question]),
        __user__={"id": "u1"},
        __metadata__={"chat_id": "c1"},
    )
    # The question, and the recall block's quotes when this turn quotes older messages (and its
    # bare label, counted once): nothing that was sent before.
    recalled = [m["content"] for m in out["messages"] if is_recall_message(m)]
    label = recall_message([], ())["content"]
    encoded = [t for t in spy.texts if t not in (label, SUMMARY_ACK)]
    assert encoded[0] == question["content"]
    assert recalled, "the question recalls older messages here"
    assert ["".join([label, *encoded[1:]])] == recalled


async def test_settings_follow_the_valves_values_not_the_objects(counter):
    f = make_filter(counter, max_context_tokens=1_500, reserve_output_tokens=500)
    chat = chat_of(20)
    first = await f.inlet(body_of(chat), __user__={"id": "u1"}, __metadata__={"chat_id": "a"})
    assert len(first["messages"]) < len(chat)
    f.valves = f.Valves(max_context_tokens=1_500, reserve_output_tokens=500)  # a new object, same values: same settings
    assert (await f.inlet(body_of(chat), __user__={"id": "u1"}, __metadata__={"chat_id": "b"}))["messages"] == first[
        "messages"
    ]
    f.valves.mode = "off"  # changed in place, as an admin saving the valves form may
    assert (await f.inlet(body_of(chat), __user__={"id": "u1"}, __metadata__={"chat_id": "c"}))["messages"] is chat
    f.valves = f.Valves(max_context_tokens=1_500, reserve_output_tokens=500, model_aliases="{not json")
    events = Events()
    await f.inlet(body_of(chat), __user__={"id": "u1"}, __metadata__={"chat_id": "d"}, __event_emitter__=events)
    await f.inlet(body_of(chat), __user__={"id": "u1"}, __metadata__={"chat_id": "e"}, __event_emitter__=events)
    assert sum("model_aliases" in s for s in events.statuses) == 2  # a bad valve is still named every turn
