"""The filter's two paths driven on their own, without Open WebUI or a `Filter`: the trim path
(`TrimPass`) and the bookkeeping path (`Bookkeeping`), given plain functions for what the face
hands them (the store, the settings, the price resolution, how to tell problems)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import pytest

from contextwarden.core.conversation import is_recall_message
from contextwarden.errors import ConfigError, TurnRefused
from contextwarden.face.bookkeeping import Bookkeeping
from contextwarden.face.settings import Settings
from contextwarden.face.trimpass import TrimPass
from contextwarden.face.valves import Valves, read_settings
from contextwarden.money.pricing import PriceBook, Resolution, resolve_model
from contextwarden.state.chatstate import chat_state_key
from contextwarden.state.store import MemoryStore

from helpers import body_of, chat_of, sent_count, usage_records

BOOK = PriceBook.from_bundled()
NOW = datetime(2026, 3, 4, 12, tzinfo=UTC)


async def resolve(settings: Settings, model_id: str, emit: object) -> Resolution:
    return resolve_model(model_id, BOOK)


def settings_of(**valves: object) -> Settings:
    settings, problems = read_settings(Valves(**valves))
    assert problems == []
    return settings


async def test_a_pass_trims_notes_the_turn_and_keeps_the_chat_state(counter):
    store, reports, warnings = MemoryStore(), [], []

    async def report(problem: ConfigError, emit: object) -> None:
        reports.append(problem)

    passes = TrimPass(
        counter=counter,
        store=lambda: store,
        resolve=resolve,
        report=report,
        warn_once=warnings.append,
        reported=set(),
    )
    settings = settings_of(max_context_tokens=1_500, reserve_output_tokens=500)
    chat = chat_of(20)
    body = body_of(chat)
    out = await passes.run(body, {"id": "u1"}, body["metadata"], None, None, settings, hook="inlet")
    assert len(out["messages"]) < len(chat) and counter.count_messages(out["messages"], "gpt-4o") <= 1_000
    note = body["metadata"]["contextwarden"]
    in_place = len(out["messages"]) - 2 * sum(map(is_recall_message, out["messages"]))  # a block: quoted, not in place
    assert note["mode"] == "enforce" and note["dropped"] == len(chat) - in_place
    assert note["pending_line"].startswith(f"Sent {sent_count(chat, out['messages'])} of {len(chat)} messages")
    assert await store.get(chat_state_key("u1", "c1")) is not None
    again = await passes.run(out, {"id": "u1"}, body["metadata"], None, None, settings)
    assert again["messages"] == out["messages"]  # a later pass of the turn changes nothing
    assert reports == [] and warnings == []


async def test_bookkeeping_bills_a_reply_and_then_refuses_a_user_over_the_limit(counter, caplog):
    store = MemoryStore()
    settings = settings_of(daily_limit_usd=0.01)

    async def settings_for(user: dict | None) -> Settings:
        return settings

    books = Bookkeeping(
        counter=counter,
        store=lambda: store,
        now=lambda: NOW,
        settings=settings_for,
        resolve=resolve,
        warn_once=lambda text: None,
    )
    user = {"id": "u1", "role": "user"}
    await books.before_turn(body_of(chat_of(2)), user, {}, None)  # nothing spent yet: let through
    reply = {"role": "assistant", "content": "ok", "usage": {"prompt_tokens": 100_000, "completion_tokens": 9_000}}
    body = body_of([*chat_of(2), reply])
    caplog.set_level(logging.INFO, logger="contextwarden")
    booked = await books.reply(body, user, body["metadata"], None, settings, None)
    billed = booked.billed
    assert (billed.prompt_tokens, billed.completion_tokens, booked.estimated.any) == (100_000, 9_000, False)
    assert booked.cost.cost_usd is not None and booked.cost.cost_usd > 0.01  # gpt-4o: about $0.34
    [record] = usage_records(caplog)
    assert record["prompt_tokens"] == 100_000 and record["user_id"] == "u1"
    line = await books.reply_line(settings, user, booked, shown=True)
    assert line is not None and "today" in line
    with pytest.raises(TurnRefused):
        await books.before_turn(body_of(chat_of(2)), user, {}, None)
