"""Spending limits: the rules (role, group, user; admins), resets at the UTC day and month
boundary, refusals through the fail-open wrapper, the store down, turns charged when they start
and settled when they end (outlet, the stream's usage, or going quiet), the status line with
spend, `!usage` inside Open WebUI and never sent on, damaged keys. Memory store and a real Redis."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import sys
import threading
import types
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal

import httpx
import pytest
import redis.asyncio as aioredis
import respx

import contextwarden.face.bookkeeping as bookkeeping_module
import contextwarden.face.filter as filter_module
import contextwarden.face.summarize as summarize_module
import contextwarden.money.openturns as openturns_module
from contextwarden.errors import AnsweredInChat, ConfigError, TurnRefused
from contextwarden.face.adminview import usage_markdown
from contextwarden.face.bookkeeping import FLOORED_NOTE
from contextwarden.face.usergroups import GroupReader
from contextwarden.face.valves import read_settings
from contextwarden.money.cache_stats import CacheStats, load_cache_stats
from contextwarden.money.calibration import load_calibration
from contextwarden.money.dollars import format_usd
from contextwarden.money.ledger import MonthTotals, ledger_totals, read_ledger, read_month, record_reply
from contextwarden.money.limits import (
    STORE_DOWN_TEXT,
    Limits,
    Spend,
    Verdict,
    check_limits,
    limits_for,
    next_reset,
    parse_overrides,
    refusal_text,
    spend_text,
)
from contextwarden.money.records import TurnNote
from contextwarden.money.spendbook import SpendBook
from contextwarden.state.store import MemoryStore, RedisStore

from helpers import Events, chat_of, make_filter, store_of, usage_records
from turns import free_port, reply_of, run_turn

D = Decimal
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a fjord?"}]


class Clock:
    """The filter's clock, set by the test."""

    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture(params=["memory", "redis"])
def store_valves(request) -> dict:
    return {} if request.param == "memory" else {"redis_url": request.getfixturevalue("redis_url")}


async def limited(counter, valves: dict, now: datetime | Clock, wrap=None):
    """A filter with these valves on this clock (a `Clock` the test moves on, or a fixed time), given
    the store the valves name (`wrap`ped, when given) from the start."""
    store = store_of(valves) if wrap is None else wrap(store_of(valves))
    return make_filter(counter, store=store, clock=now if isinstance(now, Clock) else Clock(now), **valves)


async def spent(f, user: str, usd: str | None, day: date, tokens: int = 1_000) -> None:
    """One reply of `user` on `day` in the filter's ledger and spend totals, as an outlet records
    it (usd None: an unknown price)."""
    cost = None if usd is None else D(usd)
    await SpendBook().record(f.store, user=user, day=day, cost_usd=cost, tokens=tokens)
    await record_reply(
        f.store,
        user=user,
        model="openai/gpt-4o",
        prompt_tokens=tokens,
        completion_tokens=0,
        cost_usd=None if usd is None else D(usd),
        estimated=False,
        day=day,
        retention_days=1,
    )


def turn(
    user: str, role: str = "user", text: str = "What is a fjord?", max_tokens: int | None = None, **metadata
) -> tuple[dict, dict]:
    meta = {"chat_id": "", "user_id": user, "message_id": "m1", **metadata}
    body = {
        "model": "gpt-4o",
        "messages": [CHAT[0], {"role": "user", "content": text}],
        "stream": False,
        "metadata": meta,
    }
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body, {"id": user, "role": role, "name": "N", "email": "ann@example.com"}


async def inlet(f, user: str, role: str = "user", events=None, text: str = "What is a fjord?", **metadata):
    body, who = turn(user, role, text, **metadata)
    return await f.inlet(body, __user__=who, __metadata__=body["metadata"], __event_emitter__=events)


# -- the rules ------------------------------------------------------------------------------


OVERRIDES = """{
  "roles": {"user": {"daily_usd": 2}, "pending": {"daily_usd": 0.1}},
  "groups": {
    "research": {"daily_usd": 10, "monthly_tokens": 5000000},
    "g-42": {"daily_usd": 4},
    "interns": {"daily_usd": 0}
  },
  "users": {"u-vip": {"daily_usd": 0, "monthly_usd": 500}}
}"""


def test_most_specific_level_wins_per_kind():
    rules = parse_overrides(OVERRIDES, Limits(daily_usd=D(1), monthly_usd=D(30)))
    assert limits_for(rules, role="user", groups=[], user_id="u1") == Limits(D(2), D(30), None, None)
    assert limits_for(rules, role="pending", groups=[], user_id="u1").daily_usd == D("0.1")
    research = limits_for(rules, role="user", groups=["research"], user_id="u1")
    assert (research.daily_usd, research.monthly_usd, research.monthly_tokens) == (D(10), D(30), 5_000_000)
    # Of several groups the most generous; 0 (no limit) is the most generous of all.
    assert limits_for(rules, role="user", groups=["g-42", "research"], user_id="u1").daily_usd == D(10)
    assert limits_for(rules, role="user", groups=["g-42", "interns"], user_id="u1").cap("daily_usd") is None
    vip = limits_for(rules, role="user", groups=["research"], user_id="u-vip")
    assert vip.cap("daily_usd") is None and vip.monthly_usd == D(500) and vip.monthly_tokens == 5_000_000


def test_admins_are_unlimited_unless_their_role_has_an_override():
    base = Limits(daily_usd=D(1))
    assert not limits_for(parse_overrides(OVERRIDES, base), role="admin", groups=["research"], user_id="u-vip").any
    rules = parse_overrides('{"roles": {"admin": {"monthly_usd": 50}}}', base)
    admin = limits_for(rules, role="admin", groups=[], user_id="a1")
    assert admin.daily_usd == D(1) and admin.monthly_usd == D(50)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("{not json", "not valid JSON (at line 1 column 2)"),
        (
            '{"roles": {"user": {"daily_usd": -1}}}',
            "roles entry 1, daily_usd: Input should be greater than or equal to 0",
        ),
        ('{"roles": {"user": {"daily_usd": "sk-secret-123"}}}', "roles entry 1, daily_usd"),
        ('{"groups": {"g": {"weekly_usd": 1}}}', "groups entry 1, key 1 (not one of daily_usd, monthly_usd, "),
        ('{"teams": {}}', "key 1 (not one of roles, groups, users): Extra inputs are not permitted"),
        ('{"users": {"u": {"daily_tokens": 1e30}}}', "users entry 1, daily_tokens"),
        ('{"roles": {"user": {"daily_usd": NaN}}}', "roles entry 1, daily_usd"),
        # Before: the admin's keys were echoed, and user ids are often emails by mistake
        ('{"users": {"u1": {}, "ann.secretname@example.org": {"daily_usd": "two"}}}', "users entry 2, daily_usd"),
        ('{"users": {"ann.secretname@example.org": 5}}', "users entry 1: Input should be a valid dictionary;"),
        ('{"users": {"u": {"ann.secretname@example.org": 5}}}', "users entry 1, key 1 (not one of"),
        ('{"ann.secretname@example.org": {"daily_usd": 1}}', "key 1 (not one of roles, groups, users)"),
        ('[{"ann.secretname@example.org": 1}]', "the top level: Input should be a valid dictionary;"),
    ],
)
def test_bad_overrides_are_named_without_their_values(text, named):
    settings, problems = read_settings(make_filter(None, daily_limit_usd=3, limit_overrides=text).valves)
    assert [p.valve for p in problems] == ["limit_overrides"]
    assert named in str(problems[0]) and "no overrides used" in str(problems[0])
    assert "sk-secret" not in str(problems[0]) and "secretname" not in str(problems[0])
    assert settings.limits.base.daily_usd == D(3) and not settings.limits.roles  # the valve limits still apply


def test_overrides_are_bounded():
    with pytest.raises(ConfigError, match="longer than 65,536"):
        parse_overrides('{"users": {' + ",".join(f'"u{i}": {{}}' for i in range(9_000)) + "}}", Limits())


def test_a_bad_limit_valve_is_named():
    valves = make_filter(None).valves.model_copy(update={"daily_limit_usd": float("inf"), "monthly_limit_tokens": -5})
    settings, problems = read_settings(valves)
    assert {p.valve for p in problems} == {"daily_limit_usd", "monthly_limit_tokens"}
    assert not settings.limits.active


@pytest.mark.parametrize(
    ("now", "kind", "reset"),
    [
        (datetime(2026, 12, 1, 20, 48, tzinfo=UTC), "daily_usd", datetime(2026, 12, 2, tzinfo=UTC)),
        (datetime(2026, 12, 31, 23, 59, 59, tzinfo=UTC), "daily_tokens", datetime(2027, 1, 1, tzinfo=UTC)),
        (datetime(2026, 12, 31, 23, 59, 59, tzinfo=UTC), "monthly_usd", datetime(2027, 1, 1, tzinfo=UTC)),
        (datetime(2028, 2, 29, 0, 0, tzinfo=UTC), "monthly_usd", datetime(2028, 3, 1, tzinfo=UTC)),
        (datetime(2026, 1, 31, 12, 0, tzinfo=UTC), "monthly_tokens", datetime(2026, 2, 1, tzinfo=UTC)),
        (
            datetime(2026, 12, 1, 23, 30, tzinfo=timezone(timedelta(hours=-5))),
            "daily_usd",
            datetime(2026, 12, 3, tzinfo=UTC),
        ),
    ],
)
def test_limits_reset_at_the_utc_day_and_month(now, kind, reset):
    assert next_reset(kind, now) == reset


def test_refusal_names_the_limit_the_spend_and_the_reset():
    now = datetime(2026, 12, 1, 20, 48, tzinfo=UTC)
    verdict = check_limits(Limits(daily_usd=D(2)), Spend(usd=D("2.034")), Spend(usd=D("2.034")))
    assert refusal_text(verdict, now) == (
        "contextwarden: your daily limit of $2.00 is reached ($2.03 used today). "
        "It resets at 00:00 UTC (in 3 h 12 min)."
    )
    monthly = check_limits(Limits(monthly_tokens=100_000), Spend(tokens=5), Spend(tokens=100_000))
    assert refusal_text(monthly, now) == (
        "contextwarden: your monthly limit of 100,000 tokens is reached (100,000 tokens used this month). "
        "It resets at 00:00 UTC on 2027-01-01 (in 30 days)."
    )


def test_warning_from_80_percent_of_the_nearest_limit():
    limits = Limits(daily_usd=D(2), monthly_tokens=1_000)
    assert not check_limits(limits, Spend(usd=D("1.59")), Spend(tokens=799)).near
    verdict = check_limits(limits, Spend(usd=D("1.60")), Spend(tokens=900))
    assert verdict.allowed and verdict.warn_kind == "monthly_tokens" and verdict.warn_share == D("0.9")


# -- the filter: refusals, resets, unknown prices -----------------------------------------------


async def test_turn_over_the_daily_limit_is_refused_before_the_model(counter, store_valves, unique):
    now = datetime(2026, 12, 1, 20, 48, tzinfo=UTC)
    clock = Clock(now)
    f = await limited(counter, {**store_valves, "daily_limit_usd": 2}, clock)
    user = f"u-{unique}"
    await spent(f, user, "1.99", now.date())
    assert (await inlet(f, user))["messages"][-1]["content"] == "What is a fjord?"  # under the limit: goes on
    await spent(f, user, "0.005", now.date())  # over, with that turn's charge (~$0.0103: its estimate)
    with pytest.raises(TurnRefused) as refused:
        await inlet(f, user)
    assert str(refused.value) == (
        "contextwarden: your daily limit of $2.00 is reached ($2.01 used today). "
        "It resets at 00:00 UTC (in 3 h 12 min)."
    )
    assert "ann@example.com" not in str(refused.value)
    await inlet(f, f"other-{unique}")  # another user is not held back
    clock.now = datetime(2026, 12, 2, 0, 0, 0, tzinfo=UTC)  # the next UTC day
    assert await inlet(f, user)


async def test_monthly_limit_resets_on_the_first(counter, store_valves, unique):
    clock = Clock(datetime(2026, 12, 31, 23, 59, tzinfo=UTC))
    f = await limited(counter, {**store_valves, "monthly_limit_usd": 10}, clock)
    user = f"u-{unique}"
    await spent(f, user, "6", date(2026, 12, 3))
    await spent(f, user, "4", date(2026, 12, 31))
    await spent(f, user, "50", date(2026, 11, 30))  # last month does not count
    with pytest.raises(
        TurnRefused,
        match=r"monthly limit of \$10.00 is reached \(\$10.00 used this month\). "
        r"It resets at 00:00 UTC on 2027-01-01 \(in 0 h 01 min\)",
    ):
        await inlet(f, user)
    clock.now = datetime(2027, 1, 1, 0, 0, tzinfo=UTC)
    assert await inlet(f, user)


async def test_limits_per_role_group_and_user_in_the_filter(counter, store_valves, unique, monkeypatch):
    """Groups come from Open WebUI's own model (`open_webui.models.groups.Groups`), async in 0.12."""
    now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    members = {f"in-research-{unique}": ["research"]}

    class Group:
        def __init__(self, name: str) -> None:
            self.id, self.name = f"id-{name}", name

    class Groups:
        calls = 0

        @classmethod
        async def get_groups_by_member_id(cls, user_id):
            cls.calls += 1
            return [Group(n) for n in members.get(user_id, [])]

    monkeypatch.setitem(sys.modules, "open_webui.models.groups", types.SimpleNamespace(Groups=Groups))
    overrides = json.dumps(
        {
            "roles": {"user": {"daily_usd": 1}},
            "groups": {"research": {"daily_usd": 5}},
            "users": {f"vip-{unique}": {"daily_usd": 0}},
        }
    )
    f = await limited(counter, {**store_valves, "daily_limit_usd": 0.5, "limit_overrides": overrides}, now)
    for user in ("plain", "in-research", "vip", "admin", "pending"):
        await spent(f, f"{user}-{unique}", "3", now.date())
    with pytest.raises(TurnRefused, match=r"daily limit of \$1.00"):
        await inlet(f, f"plain-{unique}")
    with pytest.raises(TurnRefused, match=r"daily limit of \$0.50"):  # a role without an override: the valve
        await inlet(f, f"pending-{unique}", role="pending")
    assert await inlet(f, f"in-research-{unique}")  # the group's $5
    assert await inlet(f, f"vip-{unique}")  # the user's own: none
    assert await inlet(f, f"admin-{unique}", role="admin")  # admins: none without an admin role override
    calls = Groups.calls
    await inlet(f, f"in-research-{unique}")
    assert Groups.calls == calls  # remembered a minute


async def test_unknown_prices_count_tokens_not_dollars(counter, store_valves, unique):
    now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    f = await limited(counter, {**store_valves, "daily_limit_usd": 1, "daily_limit_tokens": 50_000}, now)
    user = f"u-{unique}"
    for _ in range(4):
        await spent(f, user, None, now.date(), tokens=12_000)  # unpriced: no dollars, 48,000 tokens
    assert await inlet(f, user)
    await spent(f, user, None, now.date(), tokens=2_000)
    with pytest.raises(TurnRefused, match="daily limit of 50,000 tokens is reached"):
        await inlet(f, user)


async def test_a_real_turn_counts_toward_the_limit(counter, store_valves, unique):
    """The outlet's own ledger record is what the next inlet checks (gpt-4o: $2.50 per 1M in)."""
    now = datetime.now(UTC)
    f = await limited(counter, {**store_valves, "daily_limit_usd": 1}, now)
    user = {"id": f"u-{unique}", "role": "user"}
    await run_turn(f, CHAT, user=user, reply=reply_of(usage={"prompt_tokens": 400_000, "completion_tokens": 0}))
    with pytest.raises(TurnRefused, match=r"\$1.00 is reached \(\$1.00 used today\)"):
        await run_turn(f, CHAT, user=user)


# -- the store down ---------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["fail-open", "fail-closed"])
async def test_store_unreachable_follows_the_valve(counter, caplog, policy):
    caplog.set_level(logging.INFO, logger="contextwarden")
    valves = {"redis_url": f"redis://127.0.0.1:{free_port()}/0", "daily_limit_usd": 1, "limit_store_failure": policy}
    f = await limited(counter, valves, datetime.now(UTC))
    if policy == "fail-open":
        assert await inlet(f, "u1")
        assert "limits not checked (ConnectionError); turn allowed (fail-open)" in caplog.text
    else:
        with pytest.raises(TurnRefused) as refused:
            await inlet(f, "u1")
        assert str(refused.value) == STORE_DOWN_TEXT
        assert "turn refused (fail-closed)" in caplog.text


def test_a_bad_store_failure_valve_is_named():
    settings, problems = read_settings(make_filter(None, limit_store_failure="closed").valves)
    assert [p.valve for p in problems] == ["limit_store_failure"] and settings.limit_store_failure == "fail-open"


async def test_other_errors_in_the_limit_check_fail_open(counter, caplog, monkeypatch, unique):
    f = await limited(counter, {"daily_limit_usd": 1}, datetime.now(UTC))

    def broken(*args, **kwargs):
        raise ZeroDivisionError

    monkeypatch.setattr(bookkeeping_module, "limits_for", broken)
    assert await inlet(f, f"u-{unique}")
    assert "limits not checked (ZeroDivisionError" in caplog.text


# -- turns charged when they start, settled when they end ------------------------------------------


class SlowStore:
    """Wraps a store so every read yields to the loop a few times (turns interleave)."""

    def __init__(self, store) -> None:
        self._inner = store

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def counters(self, key):
        for _ in range(3):
            await asyncio.sleep(0)
        return await self._inner.counters(key)


async def started(f, body: dict, who: dict) -> dict | Exception:
    try:
        return await f.inlet(body, __user__=who, __metadata__=body["metadata"])
    except TurnRefused as refused:
        return refused


async def test_turns_started_side_by_side_see_each_others_charge(counter, store_valves, unique):
    """30 turns at once from $0 against $0.05, each charged $0.02 (its 2,000-token allowance at
    gpt-4o's $10 per million out) when it starts: three start, the rest are refused as over."""
    now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    f = await limited(counter, {**store_valves, "daily_limit_usd": 0.05}, now, wrap=SlowStore)
    user = f"u-{unique}"
    results = await asyncio.gather(*(started(f, *turn(user, max_tokens=2_000)) for _ in range(30)))
    refused = [r for r in results if isinstance(r, TurnRefused)]
    assert len(results) - len(refused) == 3
    assert all(str(r).startswith("contextwarden: your daily limit of $0.05 is reached ($0.06") for r in refused)
    day, _ = await SpendBook().spend(f.store, user, now.date())
    assert D("0.06") < day.usd < D("0.061") and day.requests == 3


async def test_a_crowd_of_turns_in_two_workers_never_passes_the_limit(counter, redis_url, unique):
    """200 turns at once, half through each of two workers on one Redis, against $0.30: just the
    turns the limit allows start, each checked after the charges before it (a check that lost to
    other writes eight times once charged without one: 34 of 50 started, 107 of 400 at $1)."""
    now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    valves = {"redis_url": redis_url, "daily_limit_usd": 0.3}
    workers = [await limited(counter, valves, now, wrap=SlowStore) for _ in range(2)]
    user = f"u-{unique}"
    results = await asyncio.gather(*(started(workers[k % 2], *turn(user)) for k in range(200)))
    allowed = sum(not isinstance(r, Exception) for r in results)
    day, _ = await SpendBook().spend(workers[0].store, user, now.date())
    each = day.usd / allowed  # every turn's estimate is the same (~$0.0103)
    assert allowed == math.ceil(D("0.3") / each) and day.requests == allowed
    assert D("0.3") <= day.usd < D("0.3") + each


async def test_other_chats_never_push_a_users_spend_out_of_the_in_process_store(counter, unique):
    """A user at the limit is still refused after other users' chats filled the in-process
    store many times over (the spend key once shared one LRU with chat states: 20,000 chats
    pushed it out, and the limit with it)."""
    now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    f = make_filter(counter, store=MemoryStore(max_keys=40), clock=Clock(now), daily_limit_usd=0.01)
    user = f"u-{unique}"
    await spent(f, user, "0.02", now.date())
    for k in range(200):  # each chat writes its own state (admins: no limit, no spend key)
        body, who = turn(f"other-{k}", role="admin", chat_id=f"c-{unique}-{k}")
        await f.inlet(body, __user__=who, __metadata__=body["metadata"])
    assert isinstance(await started(f, *turn(user)), TurnRefused)


async def test_a_clock_in_another_zone_keeps_utc_days(counter, unique):
    """Days are UTC days whatever zone the clock gives: at 20:00 UTC-5 (01:00 UTC the next day)
    a turn is charged to the UTC day, and local midnight resets nothing (the old code filed it
    under the local date and let the next turn start at 00:30 local)."""
    local = timezone(timedelta(hours=-5))
    clock = Clock(datetime(2026, 12, 1, 20, 0, tzinfo=local))
    f = make_filter(counter, clock=clock, daily_limit_usd=0.01)
    user = f"u-{unique}"
    await spent(f, user, "0.02", date(2026, 12, 2))
    assert isinstance(await started(f, *turn(user)), TurnRefused)
    clock.now = datetime(2026, 12, 2, 0, 30, tzinfo=local)  # 05:30 UTC, the same UTC day
    assert isinstance(await started(f, *turn(user)), TurnRefused)


async def test_ledger_rows_never_push_a_users_spend_out_of_the_in_process_store(counter, unique):
    """A user at the limit is still refused after replies of 200 models were logged (a ledger
    row each, per user, model and day: they once shared the spend key's LRU, and a user's
    direct connection can name any model)."""
    now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    f = make_filter(counter, store=MemoryStore(max_keys=40), clock=Clock(now), daily_limit_usd=0.01)
    user = f"u-{unique}"
    await spent(f, user, "0.02", now.date())
    for k in range(200):
        body, who = turn(f"other-{unique}", role="admin", chat_id=f"c-{unique}-{k}")
        reply = reply_of(usage={"prompt_tokens": 10, "completion_tokens": 2})
        await f.outlet({**body, "model": f"model-{k}", "messages": [*body["messages"], reply]}, __user__=who)
    assert isinstance(await started(f, *turn(user)), TurnRefused)


async def test_turns_whose_outlet_never_comes_stay_charged(counter, store_valves, unique):
    """20 turns of ~40k tokens whose replies never reach outlet, against $0.01: one gets through."""
    now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    f = await limited(counter, {**store_valves, "daily_limit_usd": 0.01}, now)
    user = f"u-{unique}"
    document = " ".join(f"word{i % 997}" for i in range(20_000))
    results = [await started(f, *turn(user, text=document)) for _ in range(20)]
    assert sum(not isinstance(r, Exception) for r in results) == 1
    day, _ = await SpendBook().spend(f.store, user, now.date())
    assert day.usd > D("0.09") and day.tokens > 39_000  # $2.50 per million in, the allowance at $10 out


async def test_a_failed_call_costs_its_estimate_and_locks_nobody_out(counter, store_valves, unique):
    """At 85%, a turn whose call fails (no outlet) is charged its estimate; the next one is served."""
    now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    f = await limited(counter, {**store_valves, "daily_limit_usd": 1}, now)
    user = f"u-{unique}"
    await spent(f, user, "0.85", now.date())
    assert not isinstance(await started(f, *turn(user)), Exception)  # the call fails: no outlet
    assert not isinstance(await started(f, *turn(user)), Exception)
    day, _ = await SpendBook().spend(f.store, user, now.date())
    assert D("0.87") < day.usd < D("0.871")  # two estimates of ~$0.0103 each (1,024 tokens out at $10)


async def test_an_outlet_settles_the_turn_at_what_it_really_cost(counter, store_valves, unique):
    now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    f = await limited(counter, {**store_valves, "daily_limit_usd": 1}, now)
    user = f"u-{unique}"
    body, who = turn(user)
    await f.inlet(body, __user__=who, __metadata__=body["metadata"])
    book = SpendBook()
    day, _ = await book.spend(f.store, user, now.date())
    assert D("0.01") < day.usd < D("0.011") and day.requests == 1  # the estimate
    reply = reply_of(usage={"prompt_tokens": 40_000, "completion_tokens": 100})
    await f.outlet(
        {"model": "gpt-4o", "messages": [*body["messages"], reply]}, __user__=who, __metadata__=body["metadata"]
    )
    assert await book.spend(f.store, user, now.date()) == (Spend(D("0.101"), 40_100, 1, 0),) * 2
    await f.outlet(
        {"model": "gpt-4o", "messages": [*body["messages"], reply]}, __user__=who, __metadata__=body["metadata"]
    )
    day, _ = await book.spend(f.store, user, now.date())  # the same outlet again: a reply of its own
    assert day == Spend(D("0.202"), 80_200, 2, 0)


def stream_chunk(text: str = "", usage: dict | None = None) -> dict:
    """One streamed chunk as Open WebUI hands it to a `stream` filter (OpenAI's shape)."""
    chunk: dict = {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}
    if usage is not None:
        chunk["choices"], chunk["usage"] = [], usage
    return chunk


async def test_a_stream_settles_at_its_usage_chunk_and_a_stopped_one_when_it_goes_quiet(
    counter, store_valves, unique, monkeypatch
):
    monkeypatch.setattr(openturns_module, "SWEEP_EVERY_SECONDS", 0.0)
    now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    f = await limited(counter, {**store_valves, "daily_limit_usd": 10}, now)
    book, user = SpendBook(), f"u-{unique}"
    # A stream with a usage chunk: settled at it, though no outlet ever comes.
    body, who = turn(user)
    await f.inlet(body, __user__=who, __metadata__=body["metadata"])
    for part in ("Fjords ", "are ", "long."):
        assert await f.stream(stream_chunk(part), __metadata__=body["metadata"]) == stream_chunk(part)
    await f.stream(stream_chunk(usage={"prompt_tokens": 4_000, "completion_tokens": 3}), __metadata__=body["metadata"])
    assert await book.spend(f.store, user, now.date()) == (Spend(D("0.01003"), 4_003, 1, 0),) * 2
    # A stream the user stops: no usage, no outlet. Once quiet, the prompt plus what it streamed.
    body, who = turn(user)
    await f.inlet(body, __user__=who, __metadata__=body["metadata"])
    prompt = TurnNote.from_dict(body["metadata"]["contextwarden"]).estimated_prompt_tokens
    await f.stream(stream_chunk("x" * 400), __metadata__=body["metadata"])
    monkeypatch.setattr(openturns_module, "STREAM_IDLE_SECONDS", 0.0)
    await asyncio.sleep(0.01)
    await started(f, *turn(f"other-{unique}"))  # any turn's start settles the ended ones
    day, _ = await book.spend(f.store, user, now.date())
    assert day.tokens == 4_003 + prompt + 100 and day.requests == 2
    assert day.usd == D("0.01003") + D(prompt) * D("0.0000025") + D("0.001")
    [both] = [e for e in await read_ledger(f.store) if e.user == user]  # both ended without an outlet
    assert (both.counters["requests"], both.counters["estimated"], both.counters["completion_tokens"]) == (2, 1, 103)


FORGED_LOW = [
    {"prompt_tokens": 1, "completion_tokens": 1},
    {"prompt_tokens": 1, "completion_tokens": 1, "cost": 0},
    {"prompt_tokens": 10**9, "completion_tokens": 10**9},  # over the $1,000 ceiling: unpriced
    {"prompt_tokens": 30, "completion_tokens": 10_000, "prompt_tokens_details": {"cached_tokens": 999_999}},
]


@pytest.mark.parametrize("forged", FORGED_LOW, ids=["counts", "cost", "absurd", "cached"])
async def test_a_forged_outlet_never_settles_a_turn_below_what_its_stream_showed(counter, store_valves, unique, forged):
    """The outlet's usage is the client's (Open WebUI reads it from the saved chat, which the
    user writes). A stream that reported 10,030 tokens ($0.100075) stays charged that much
    whatever the outlet says; without a report, at least half of what the worker counted (the
    prompt and 40,000 streamed characters). Either way the $0.05 limit refuses the next turn:
    the forged outlet settled the turn at $0.0000125, $0 or unpriced, and the user went on. A
    forged cached count (the prompt at the cache-read price, $0.1000375) settles it no lower."""
    now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    book, user = SpendBook(), f"u-{unique}"
    for reported in (True, False):
        f = await limited(counter, {**store_valves, "daily_limit_usd": 0.05}, now)
        who = f"{user}-{reported}"
        body, caller = turn(who)
        await f.inlet(body, __user__=caller, __metadata__=body["metadata"])
        prompt = TurnNote.from_dict(body["metadata"]["contextwarden"]).estimated_prompt_tokens
        await f.stream(stream_chunk("x" * 40_000), __metadata__=body["metadata"])
        if reported:
            usage = stream_chunk(usage={"prompt_tokens": 30, "completion_tokens": 10_000})
            await f.stream(usage, __metadata__=body["metadata"])
        reply = reply_of("x" * 40_000, usage=forged)
        outlet = {"model": "gpt-4o", "messages": [*body["messages"], reply]}
        await f.outlet(outlet, __user__=caller, __metadata__=body["metadata"])
        day, _ = await book.spend(f.store, who, now.date())
        least = D("0.100075") if reported else D(prompt // 2) * D("0.0000025") + D("0.05")
        assert day.usd >= least and day.tokens >= 5_000 and day.unpriced == 0
        assert isinstance(await started(f, *turn(who)), TurnRefused)


STREAM_SHOWED = {"prompt_tokens": 30, "completion_tokens": 10_000}  # $0.100075 at $2.50 / $10 a million
HONEST_MORE = {"prompt_tokens": 4_030, "completion_tokens": 10_000, "prompt_tokens_details": {"cached_tokens": 4_000}}
BOOKED = [
    ({"prompt_tokens": 1, "completion_tokens": 1}, (30, 10_000, 0, D("0.100075")), True),
    ({"prompt_tokens": 1, "completion_tokens": 1, "cost": 0}, (30, 10_000, 0, D("0.100075")), True),
    ({**STREAM_SHOWED, "prompt_tokens_details": {"cached_tokens": 999_999}}, (30, 10_000, 0, D("0.100075")), True),
    (STREAM_SHOWED, (30, 10_000, 0, D("0.100075")), False),
    (HONEST_MORE, (4_030, 10_000, 4_000, D("0.105075")), False),  # 30 + 4,000 cached at $1.25 a million
]


@pytest.mark.parametrize(
    ("outlet_usage", "booked", "floored"), BOOKED, ids=["counts", "cost", "cached", "honest", "honest-more"]
)
async def test_the_ledger_books_a_forged_outlet_at_what_its_stream_showed(
    counter, store_valves, unique, caplog, outlet_usage, booked, floored
):
    """A stream that reported 10,030 tokens ($0.100075) and an outlet forged below it: the ledger
    row, the admin's month totals and report, the usage line and the user's status line all show
    the stream's figures, as the spend totals do (the ledger once booked the forged 2 tokens at
    $0.0000125, or $0: the user spent within limits, and the admin's report showed next to
    nothing). An honest outlet, as much or more, is booked exactly as it says."""
    now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    f = await limited(counter, {**store_valves, "daily_limit_usd": 1}, now)
    user, events = f"u-{unique}", Events()
    body, caller = turn(user)
    await f.inlet(body, __user__=caller, __metadata__=body["metadata"])
    await f.stream(stream_chunk("x" * 40_000), __metadata__=body["metadata"])
    await f.stream(stream_chunk(usage=STREAM_SHOWED), __metadata__=body["metadata"])
    caplog.set_level(logging.INFO, logger="contextwarden")
    outlet = {"model": "gpt-4o", "messages": [*body["messages"], reply_of("x" * 40_000, usage=outlet_usage)]}
    await f.outlet(outlet, __user__=caller, __metadata__=body["metadata"], __event_emitter__=events)
    prompt, completion, cached, usd = booked
    [entry] = [e for e in await read_ledger(f.store) if e.user == user]
    counters = {k: entry.counters[k] for k in ("requests", "prompt_tokens", "completion_tokens", "cached_tokens")}
    assert counters == {
        "requests": 1,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_tokens": cached,
    }
    assert (entry.cost_usd, entry.counters["estimated"], entry.counters["unpriced"]) == (usd, 0, 0)
    [row] = [r for r in ledger_totals(await read_ledger(f.store), "user") if r.key == user]  # `contextwarden report`
    assert (row.usd("cost_picousd"), row.counters["prompt_tokens"]) == (usd, prompt)
    [month] = [r for r in (await read_month(f.store, now.date())).users if r.key == user]  # `!usage`
    assert (month.usd("cost_picousd"), month.counters["completion_tokens"]) == (usd, completion)
    assert await SpendBook().spend(f.store, user, now.date()) == (Spend(usd, prompt + completion, 1, 0),) * 2
    [line] = usage_records(caplog)
    assert (line["prompt_tokens"], line["completion_tokens"], D(line["cost_usd"]), line["estimated"]) == (
        prompt,
        completion,
        usd,
        False,
    )
    assert (FLOORED_NOTE in (line["cost_note"] or "")) is floored
    [status] = [s for s in events.statuses if " out · " in s]
    assert f"{prompt:,} tokens in" in status and f" · {completion:,} out · ${format_usd(usd)}" in status
    assert "~" not in status


async def test_a_forged_outlet_of_a_stream_that_reported_nothing_is_booked_as_counted(counter, store_valves, unique):
    """With no usage in the stream, a forged outlet is booked at what `OpenTurn.seen` prices:
    half the prompt as counted and of the 10,000 tokens streamed, marked estimated (`~`)."""
    now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    f = await limited(counter, {**store_valves, "daily_limit_usd": 1}, now)
    user, events = f"u-{unique}", Events()
    body, caller = turn(user)
    await f.inlet(body, __user__=caller, __metadata__=body["metadata"])
    prompt = TurnNote.from_dict(body["metadata"]["contextwarden"]).estimated_prompt_tokens // 2
    await f.stream(stream_chunk("x" * 40_000), __metadata__=body["metadata"])
    forged = reply_of("x" * 40_000, usage={"prompt_tokens": 1, "completion_tokens": 1})
    outlet = {"model": "gpt-4o", "messages": [*body["messages"], forged]}
    await f.outlet(outlet, __user__=caller, __metadata__=body["metadata"], __event_emitter__=events)
    usd = D(prompt) * D("0.0000025") + D("0.05")
    [entry] = [e for e in await read_ledger(f.store) if e.user == user]
    counters = {k: entry.counters[k] for k in ("requests", "prompt_tokens", "completion_tokens", "estimated")}
    assert counters == {"requests": 1, "prompt_tokens": prompt, "completion_tokens": 5_000, "estimated": 1}
    assert entry.cost_usd == usd
    assert await SpendBook().spend(f.store, user, now.date()) == (Spend(usd, prompt + 5_000, 1, 0),) * 2
    [status] = [s for s in events.statuses if " out · " in s]
    assert f"~{prompt:,} tokens in · ~5,000 out · ~${format_usd(usd)}" in status


async def test_a_tool_loop_holds_its_charge_and_a_stop_counts_the_later_call(counter, unique, monkeypatch):
    """A call that asks for tools reports its usage; the turn then still holds a call's worth
    (the next call's prompt and the reply allowance), and a later call stopped mid-stream is
    counted at the last prompt plus what it streamed (it was once dropped: settled at the
    first call's $0.0027 while 10,000 tokens of the second streamed)."""
    monkeypatch.setattr(openturns_module, "SWEEP_EVERY_SECONDS", 0.0)
    now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    f = await limited(counter, {"daily_limit_usd": 10}, now)
    book, user = SpendBook(), f"u-{unique}"
    body, who = turn(user, max_tokens=4_000)
    await f.inlet(body, __user__=who, __metadata__=body["metadata"])
    estimate, _ = await book.spend(f.store, user, now.date())
    call = {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}}]}
    await f.stream(call, __metadata__=body["metadata"])
    await f.stream(stream_chunk(usage={"prompt_tokens": 1_000, "completion_tokens": 20}), __metadata__=body["metadata"])
    day, _ = await book.spend(f.store, user, now.date())
    assert day.tokens == 1_020 + 1_000 + 4_000 and day.usd > estimate.usd  # the call to come held
    for _ in range(100):  # the next call streams 40,000 characters, then the user stops it
        await f.stream(stream_chunk("w" * 400), __metadata__=body["metadata"])
    monkeypatch.setattr(openturns_module, "STREAM_IDLE_SECONDS", 0.0)
    await asyncio.sleep(0.01)
    await started(f, *turn(f"other-{unique}"))  # any turn's start settles the ended ones
    day, _ = await book.spend(f.store, user, now.date())
    assert day == Spend(D("0.1052"), 12_020, 1, 0)  # 2,000 in at $2.50 and 10,020 out at $10 a million


async def test_a_turn_stopped_during_its_summary_call_keeps_each_charge_once(
    counter, store_valves, unique, monkeypatch
):
    """A tool loop's request pass drops history and asks the summary endpoint, which holds the
    request; the user stops the turn (its task cancelled). The turn keeps the estimate inlet
    charged, settled at it once it counts as ended (nothing streamed), and the call, sent whole,
    adds its upper bound once beside it: before, it added nothing, though the provider bills it."""
    monkeypatch.setattr(openturns_module, "SWEEP_EVERY_SECONDS", 0.0)
    now, url = datetime(2026, 12, 1, 12, tzinfo=UTC), "http://llm.test/v1"
    summaries = dict(summary_enabled=True, summary_base_url=url, summary_model="gpt-4o-mini", summary_max_tokens=120)
    valves = {
        **store_valves,
        **summaries,
        "daily_limit_usd": 1,
        "max_context_tokens": 1_500,
        "openrouter_pricing": False,
    }
    asked: list[httpx.Request] = []
    holding = asyncio.Event()

    async def holds(request: httpx.Request) -> None:
        asked.append(request)
        holding.set()
        await asyncio.Event().wait()

    with respx.mock(assert_all_called=False) as llm:
        llm.post(f"{url}/chat/completions").mock(side_effect=holds)
        f = await limited(counter, {**valves, "reserve_output_tokens": 0}, now)
        book, user = SpendBook(), f"u-{unique}"
        who, metadata = {"id": user, "role": "user"}, {"chat_id": f"c-{unique}", "user_id": user, "message_id": "m1"}
        body = {"model": "gpt-4o", "messages": chat_of(5), "stream": True, "metadata": metadata}
        sent = await f.inlet(body, __user__=who, __metadata__=metadata)
        estimate, _ = await book.spend(f.store, user, now.date())
        assert not asked and estimate.requests == 1  # the chat fit: no summary, the turn charged
        call = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": "{}"}}
        loop = [{"role": "assistant", "content": "", "tool_calls": [call]}]
        loop.append({"role": "tool", "tool_call_id": "call_1", "content": "result " * 500})
        more = {**sent, "messages": [*sent["messages"], *loop]}
        task = asyncio.ensure_future(f.request(more, __user__=who, __metadata__=metadata))
        await asyncio.wait_for(holding.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 1)
        await asyncio.gather(*getattr(summarize_module, "_charging", ()))  # the charge's own task
    prompt = counter.count_messages(json.loads(asked[0].content)["messages"], "gpt-4o-mini")
    bound = Spend(prompt * D("0.00000015") + 120 * D("0.0000006"), prompt + 120, 1, 0)
    both = Spend(estimate.usd + bound.usd, estimate.tokens + bound.tokens, 2, 0)
    assert await book.spend(f.store, user, now.date()) == (both, both)
    monkeypatch.setattr(openturns_module, "RESERVATION_SECONDS", 0.0)
    await started(f, *turn(f"other-{unique}"))  # any turn's start settles the ended ones
    assert await book.spend(f.store, user, now.date()) == (both, both)
    rows = {e.model: e for e in await read_ledger(f.store) if e.user == user}
    assert rows["openai/gpt-4o-mini"].cost_usd == bound.usd and rows["openai/gpt-4o"].counters["requests"] == 1


def test_a_stream_s_calls_are_told_apart_by_their_stream_id():
    """Reports of one call (one stream id) replace each other; another id is another call; with
    no id, a report after a call that asked for tools is a new call, else the same one's again."""
    from contextwarden.money.openturns import OpenTurn
    from contextwarden.money.usage import Usage

    def opened() -> OpenTurn:
        return OpenTurn("t", "u", date(2026, 12, 1), "openai/gpt-4o", None, 100, 50, None, 0.0, MemoryStore())

    turn = opened()
    chunk = {"choices": [{"index": 0, "delta": {"content": "x"}}]}
    assert turn.report(Usage(100, 1), {**chunk, "id": "a"})  # a new call: settle
    assert not turn.report(Usage(100, 2), {**chunk, "id": "a"})  # its running total: not yet
    assert turn.report(Usage(100, 3), {"id": "a", "choices": []})  # its last report
    assert turn.report(Usage(200, 5), {**chunk, "id": "b"})  # another call
    assert [(u.prompt_tokens, u.completion_tokens) for u in turn.stream_usage] == [(100, 3), (200, 5)]
    turn = opened()
    turn.report(Usage(100, 1), chunk)
    turn.report(Usage(100, 4), chunk)  # no id, no tools asked: the same call's running total
    turn.calling = True  # the call asked for tools: the next report is the next call's
    turn.report(Usage(100, 6), {"choices": []})
    turn.report(Usage(150, 9), chunk)
    assert [(u.prompt_tokens, u.completion_tokens) for u in turn.stream_usage] == [(100, 6), (150, 9)]


async def test_running_usage_totals_on_every_chunk_count_once(counter, unique, monkeypatch):
    """A backend that reports its running totals on every chunk (vLLM's continuous usage stats,
    which a request may ask for) charges its call once, at the last totals, and settles it
    twice at most (every report once counted as a call of its own: 1,000 chunks were charged
    1,000 calls and held the event loop 3.6 s)."""
    settled: list[object] = []
    real_settle = SpendBook.settle

    async def counting(self, *args, **kwargs):
        settled.append(kwargs.get("real"))
        await real_settle(self, *args, **kwargs)

    monkeypatch.setattr(SpendBook, "settle", counting)
    now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    f = await limited(counter, {"daily_limit_usd": 10}, now)
    user = f"u-{unique}"
    body, who = turn(user)
    await f.inlet(body, __user__=who, __metadata__=body["metadata"])
    for k in range(1, 1_001):
        chunk = {**stream_chunk("x" * 4), "id": "chatcmpl-1", "usage": {"prompt_tokens": 1_000, "completion_tokens": k}}
        await f.stream(chunk, __metadata__=body["metadata"])
    final = {"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 1_000, "completion_tokens": 1_000}}
    await f.stream(final, __metadata__=body["metadata"])
    assert len(settled) <= 2
    assert await SpendBook().spend(f.store, user, now.date()) == (Spend(D("0.0125"), 2_000, 1, 0),) * 2


async def test_a_late_outlet_replaces_the_ledger_entry_of_its_ended_turn(counter, unique, monkeypatch):
    """A turn settled when its stream went quiet (a tool ran longer than two minutes) is in the
    ledger as an estimated reply; its outlet, coming after all, puts the real reply in its place
    (it was once added beside it: requests 2, estimated 1, both costs)."""
    monkeypatch.setattr(openturns_module, "SWEEP_EVERY_SECONDS", 0.0)
    now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    f = await limited(counter, {"daily_limit_usd": 10}, now)
    user = f"u-{unique}"
    body, who = turn(user)
    await f.inlet(body, __user__=who, __metadata__=body["metadata"])
    await f.stream(stream_chunk("x" * 400), __metadata__=body["metadata"])
    monkeypatch.setattr(openturns_module, "STREAM_IDLE_SECONDS", 0.0)
    await asyncio.sleep(0.01)
    await started(f, *turn(f"other-{unique}"))  # settles the quiet turn, and adds it to the ledger
    [entry] = [e for e in await read_ledger(f.store) if e.user == user]
    assert (entry.counters["requests"], entry.counters["estimated"]) == (1, 1)
    reply = reply_of(usage={"prompt_tokens": 1_000, "completion_tokens": 300})
    await f.outlet(
        {"model": "gpt-4o", "messages": [*body["messages"], reply]}, __user__=who, __metadata__=body["metadata"]
    )
    [entry] = [e for e in await read_ledger(f.store) if e.user == user]
    counters = {k: entry.counters[k] for k in ("requests", "estimated", "prompt_tokens", "completion_tokens")}
    assert counters == {"requests": 1, "estimated": 0, "prompt_tokens": 1_000, "completion_tokens": 300}
    assert entry.usd("cost_picousd") == D("0.0055")  # $2.50 a million in, $10 out
    [month] = [row for row in (await read_month(f.store, now.date())).users if row.key == user]
    assert (month.counters["requests"], month.counters["cost_picousd"]) == (1, 5_500_000_000)
    assert await SpendBook().spend(f.store, user, now.date()) == (Spend(D("0.0055"), 1_300, 1, 0),) * 2


async def test_a_turn_that_took_no_charge_counts_when_it_ends_without_an_outlet(counter, unique, monkeypatch):
    """A turn of a user with no limit at its start (or one the store was away for) took no
    charge; stopped mid-stream, it still reaches the spend totals when it goes quiet, so a
    limit set later counts it (it once reached only the ledger: spend $0, the next turn let
    through)."""
    monkeypatch.setattr(openturns_module, "SWEEP_EVERY_SECONDS", 0.0)
    now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    f = await limited(counter, {}, now)
    user = f"u-{unique}"
    body, who = turn(user)
    await f.inlet(body, __user__=who, __metadata__=body["metadata"])
    for _ in range(50):  # 20,000 characters streamed, then the user stops
        await f.stream(stream_chunk("x" * 400), __metadata__=body["metadata"])
    monkeypatch.setattr(openturns_module, "STREAM_IDLE_SECONDS", 0.0)
    await asyncio.sleep(0.01)
    await started(f, *turn(f"other-{unique}"))  # any turn's start settles the ended ones
    day, _ = await SpendBook().spend(f.store, user, now.date())
    assert day.requests == 1 and day.tokens > 5_000 and day.usd > D("0.05")
    f.valves = f.Valves(openrouter_pricing=False, daily_limit_usd=0.04)
    assert isinstance(await started(f, *turn(user)), TurnRefused)


async def test_a_quiet_turn_that_streams_again_is_charged_for_what_follows(counter, unique, monkeypatch):
    """A tool that runs past STREAM_IDLE_SECONDS gets its turn swept as ended; when the stream
    goes on and the user then stops it, what it streamed after the sweep is charged as if the
    tool had been quick (it was once never settled again: $0.0052 instead of $0.1052)."""
    monkeypatch.setattr(openturns_module, "SWEEP_EVERY_SECONDS", 0.0)
    now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    f = await limited(counter, {"daily_limit_usd": 10}, now)
    book, user = SpendBook(), f"u-{unique}"
    body, who = turn(user, max_tokens=4_000)
    meta = body["metadata"]
    await f.inlet(body, __user__=who, __metadata__=meta)
    call = {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}}]}
    await f.stream(call, __metadata__=meta)
    await f.stream(stream_chunk(usage={"prompt_tokens": 1_000, "completion_tokens": 20}), __metadata__=meta)
    monkeypatch.setattr(openturns_module, "STREAM_IDLE_SECONDS", 0.0)  # the tool runs long: swept
    await asyncio.sleep(0.01)
    await started(f, *turn(f"other-{unique}"))
    monkeypatch.setattr(openturns_module, "STREAM_IDLE_SECONDS", 120.0)
    for _ in range(100):  # the last call streams 40,000 characters, then the user stops it
        await f.stream(stream_chunk("w" * 400), __metadata__=meta)
    monkeypatch.setattr(openturns_module, "STREAM_IDLE_SECONDS", 0.0)
    await asyncio.sleep(0.01)
    await started(f, *turn(f"other-{unique}"))
    assert await book.spend(f.store, user, now.date()) == (Spend(D("0.1052"), 12_020, 1, 0),) * 2
    [entry] = [e for e in await read_ledger(f.store) if e.user == user]  # booked once, at the end
    assert (entry.counters["requests"], entry.counters["completion_tokens"]) == (1, 10_020)


async def test_settlements_of_one_turn_that_overlap_apply_one_after_the_other(counter, unique, monkeypatch):
    """The sweep of a quiet turn and its late outlet, at once against a slow store: each
    settles from what the other left (both once read the same charge, and the sweep's
    difference came on top of the outlet's: -$0.49 spent)."""
    monkeypatch.setattr(openturns_module, "SWEEP_EVERY_SECONDS", 0.0)
    now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    writing = asyncio.Event()

    class SlowSpend(MemoryStore):
        async def incr(self, key, fields, **options):
            if key.startswith("spend:"):
                writing.set()
                await asyncio.sleep(0.05)
            await super().incr(key, fields, **options)

    f = make_filter(counter, store=SlowSpend(), clock=Clock(now), daily_limit_usd=10)
    user = f"u-{unique}"
    body, who = turn(user, max_tokens=50_000)
    await f.inlet(body, __user__=who, __metadata__=body["metadata"])
    await f.stream(stream_chunk("x" * 400), __metadata__=body["metadata"])
    monkeypatch.setattr(openturns_module, "STREAM_IDLE_SECONDS", 0.0)
    await asyncio.sleep(0.01)

    async def late_outlet() -> None:
        await writing.wait()  # while the sweep's settlement is being written
        reply = reply_of(usage={"prompt_tokens": 1_000, "completion_tokens": 300})
        await f.outlet({**body, "messages": [*body["messages"], reply]}, __user__=who, __metadata__=body["metadata"])

    await asyncio.gather(started(f, *turn(f"other-{unique}")), late_outlet())
    assert await SpendBook().spend(f.store, user, now.date()) == (Spend(D("0.0055"), 1_300, 1, 0),) * 2


class GatedSpend(MemoryStore):
    """A store whose next spend write, once `hold` is called, waits until `release`."""

    def __init__(self) -> None:
        super().__init__()
        self.held, self.gate = asyncio.Event(), asyncio.Event()
        self.gate.set()

    def hold(self) -> None:
        self.held.clear()
        self.gate.clear()

    async def incr(self, key, fields, **options):
        if key.startswith("spend:") and not self.gate.is_set() and not self.held.is_set():
            self.held.set()  # this write waits; the ones after it go on
            await self.gate.wait()
        await super().incr(key, fields, **options)


async def quiet_turns(f, users: list[str], monkeypatch) -> list[tuple[dict, dict]]:
    """Turns of these users that streamed a little and then went quiet (the next start sweeps them)."""
    turns = [turn(user) for user in users]
    for body, who in turns:
        await f.inlet(body, __user__=who, __metadata__=body["metadata"])
        await f.stream(stream_chunk("x" * 40), __metadata__=body["metadata"])
    monkeypatch.setattr(openturns_module, "STREAM_IDLE_SECONDS", 0.0)
    await asyncio.sleep(0.01)
    return turns


async def test_a_sweep_leaves_a_turn_whose_outlet_came_while_it_settled_others(counter, unique, monkeypatch):
    """A sweep picks two quiet turns and settles the first against a slow store; meanwhile the
    second streams its last chunk and its outlet books the real reply. The sweep leaves that
    turn alone (it once settled it again at its stale figure, $0.27 spent down to $0.00016,
    and added it to the ledger a second time, as an estimated reply)."""
    monkeypatch.setattr(openturns_module, "SWEEP_EVERY_SECONDS", 0.0)
    now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    store = GatedSpend()
    f = make_filter(counter, store=store, clock=Clock(now), daily_limit_usd=10)
    user = f"u-{unique}"
    _, (body, who) = await quiet_turns(f, [f"older-{unique}", user], monkeypatch)
    store.hold()
    sweep = asyncio.create_task(started(f, *turn(f"other-{unique}")))
    await store.held.wait()  # the sweep is settling the older turn
    monkeypatch.setattr(openturns_module, "STREAM_IDLE_SECONDS", 120.0)
    await f.stream(stream_chunk("done"), __metadata__=body["metadata"])
    reply = reply_of(usage={"prompt_tokens": 100_000, "completion_tokens": 2_000})
    await f.outlet({**body, "messages": [*body["messages"], reply]}, __user__=who, __metadata__=body["metadata"])
    store.gate.set()
    await sweep
    assert await SpendBook().spend(store, user, now.date()) == (Spend(D("0.27"), 102_000, 1, 0),) * 2
    [entry] = await read_ledger(store, user=user)
    assert (entry.counters["requests"], entry.counters["estimated"], entry.usd("cost_picousd")) == (1, 0, D("0.27"))


async def test_an_outlet_during_its_turn_s_sweep_takes_the_sweep_s_ledger_entry_back(counter, unique, monkeypatch):
    """The outlet of a turn comes while the sweep settles that same turn: the real reply goes in
    the ledger and the spend, the sweep's estimated entry is taken back (it was once written
    after the outlet had looked for it: two replies in the ledger, one estimated)."""
    monkeypatch.setattr(openturns_module, "SWEEP_EVERY_SECONDS", 0.0)
    now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    store = GatedSpend()
    f = make_filter(counter, store=store, clock=Clock(now), daily_limit_usd=10)
    user = f"u-{unique}"
    [(body, who)] = await quiet_turns(f, [user], monkeypatch)
    store.hold()
    sweep = asyncio.create_task(started(f, *turn(f"other-{unique}")))
    await store.held.wait()  # the sweep is settling this turn
    monkeypatch.setattr(openturns_module, "STREAM_IDLE_SECONDS", 120.0)
    ledger_write = store.incr

    async def incr(key, fields, **options):  # the outlet's real reply is in the ledger: the sweep goes on
        await ledger_write(key, fields, **options)
        if key.startswith("ledger:") and fields.get("estimated") == 0:
            store.gate.set()

    monkeypatch.setattr(store, "incr", incr)
    reply = reply_of(usage={"prompt_tokens": 1_000, "completion_tokens": 300})
    await f.outlet({**body, "messages": [*body["messages"], reply]}, __user__=who, __metadata__=body["metadata"])
    await sweep
    assert await SpendBook().spend(store, user, now.date()) == (Spend(D("0.0055"), 1_300, 1, 0),) * 2
    [entry] = await read_ledger(store, user=user)
    assert (entry.counters["requests"], entry.counters["estimated"], entry.usd("cost_picousd")) == (1, 0, D("0.0055"))


async def test_a_flood_of_one_user_s_turns_never_pushes_out_another_user_s(counter, unique, monkeypatch):
    """A user without a limit starts turns that get no outlet, more than a worker keeps: their own
    oldest make room (settled as ended, at their estimate), never another user's turn in flight
    (it was once pushed out, and its outlet, taken for a bare one, added the reply whole on top
    of the estimate its start charged: $0.01039 instead of $0.0001)."""
    monkeypatch.setattr(openturns_module, "MAX_OPEN_TURNS", 10)
    monkeypatch.setattr(openturns_module, "MAX_USER_OPEN_TURNS", 5)
    now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    f = await limited(counter, {"limit_overrides": json.dumps({"users": {f"u-{unique}": {"daily_usd": 1}}})}, now)
    body, who = turn(f"u-{unique}")
    await f.inlet(body, __user__=who, __metadata__=body["metadata"])
    for k in range(20):
        await inlet(f, f"flood-{unique}", text=f"q{k}")
    reply = reply_of(usage={"prompt_tokens": 20, "completion_tokens": 5})
    await f.outlet({**body, "messages": [*body["messages"], reply]}, __user__=who, __metadata__=body["metadata"])
    assert await SpendBook().spend(f.store, f"u-{unique}", now.date()) == (Spend(D("0.0001"), 25, 1, 0),) * 2
    flood, _ = await SpendBook().spend(f.store, f"flood-{unique}", now.date())
    assert flood.requests == 15  # pushed out by their own later turns: each settled at its estimate


async def test_a_turn_pushed_out_of_a_full_worker_is_settled_by_its_late_outlet(counter, unique, monkeypatch):
    """A worker with MAX_OPEN_TURNS open pushes out its oldest turn: settled as ended at once
    (its estimate, an estimated ledger entry), and its outlet, when it comes, replaces that with
    the real reply instead of adding the reply on top (charged twice)."""
    monkeypatch.setattr(openturns_module, "MAX_OPEN_TURNS", 3)
    now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    f = await limited(counter, {"daily_limit_usd": 1}, now)
    user = f"u-{unique}"
    body, who = turn(user)
    await f.inlet(body, __user__=who, __metadata__=body["metadata"])
    for k in range(3):  # other users' turns fill the worker
        await inlet(f, f"other{k}-{unique}")
    [entry] = await read_ledger(f.store, user=user)
    assert (entry.counters["requests"], entry.counters["estimated"]) == (1, 1)
    reply = reply_of(usage={"prompt_tokens": 20, "completion_tokens": 5})
    await f.outlet({**body, "messages": [*body["messages"], reply]}, __user__=who, __metadata__=body["metadata"])
    assert await SpendBook().spend(f.store, user, now.date()) == (Spend(D("0.0001"), 25, 1, 0),) * 2
    [entry] = await read_ledger(f.store, user=user)
    assert (entry.counters["requests"], entry.counters["estimated"], entry.counters["prompt_tokens"]) == (1, 0, 20)


def test_open_turns_stay_bounded_and_find_what_they_pushed_out(monkeypatch):
    """Every structure of OpenTurns is bounded: open turns in all and per user, and the turns
    pushed out that an outlet still finds (the oldest of those forgotten first)."""
    monkeypatch.setattr(openturns_module, "MAX_OPEN_TURNS", 6)
    monkeypatch.setattr(openturns_module, "MAX_USER_OPEN_TURNS", 4)
    monkeypatch.setattr(openturns_module, "MAX_GONE_TURNS", 5)
    turns, store = openturns_module.OpenTurns(), MemoryStore()

    def new(user: str, k: int) -> openturns_module.OpenTurn:
        return openturns_module.OpenTurn(
            f"{user}{k}", user, date(2026, 12, 1), "m", None, 10, 10, None, float(k), store
        )

    pushed = [old.turn_id for k in range(6) for old in turns.start(new("a", k))]
    assert pushed == ["a0", "a1"]  # a's own oldest made room
    pushed = [old.turn_id for k in range(6) for old in turns.start(new(f"u{k}-", k))]
    assert pushed == ["a2", "a3", "a4", "a5"]  # a full worker: the oldest of all
    assert all(turns._turns[t].ended is False for t in turns._turns) and len(turns._turns) == 6
    assert sum(map(len, turns._of_user.values())) == 6 and set(turns._of_user) == {f"u{k}-" for k in range(6)}
    assert turns.finish("a0") is None  # forgotten: the five pushed out after it are kept
    late = turns.finish("a1")
    assert late is not None and late.ended and late.finished and turns.finish("a1") is None
    assert len(turns._gone) == 4
    turns.unhold(late.store)  # its outlet is done: the store is held by the 6 open and 4 pushed out
    assert turns._holding == {store: 10} and turns.holds(store) and not turns.holds(MemoryStore())


async def outlet(f, body: dict, who: dict, prompt: int, completion: int) -> None:
    """The turn's outlet, its reply reporting this usage."""
    reply = reply_of(usage={"prompt_tokens": prompt, "completion_tokens": completion})
    await f.outlet({**body, "messages": [*body["messages"], reply]}, __user__=who, __metadata__=body["metadata"])


@pytest.mark.redis
async def test_turns_in_flight_when_redis_url_is_set_settle_where_they_were_charged(counter, redis_url, unique):
    """The admin sets `redis_url` while four turns charged in the in-process store are in
    flight: each is settled there, and Redis, which never had their estimates, gets nothing. Its
    totals once went to -$0.04 (what the settlements took off): credit past the limit, 7 turns of
    $0.015 let through against $0.05 instead of 4."""
    now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    f = make_filter(counter, clock=Clock(now), daily_limit_usd=0.05)  # no store given, as in Open WebUI
    user, book = f"u-{unique}", SpendBook()
    flight = [turn(user) for _ in range(4)]
    for body, who in flight:
        await f.inlet(body, __user__=who, __metadata__=body["metadata"])
    in_process = f.store
    f.valves = f.Valves(daily_limit_usd=0.05, redis_url=redis_url)
    for body, who in flight:
        await outlet(f, body, who, 20, 5)
    assert isinstance(f.store, RedisStore) and await f.store.counters(f"spend:2026-12:{user}") == {}
    assert await book.spend(in_process, user, now.date()) == (Spend(D("0.0004"), 100, 4, 0),) * 2
    let_through = 0
    for _ in range(10):
        body, who = turn(user)
        if isinstance(await started(f, body, who), TurnRefused):
            break
        let_through += 1
        await outlet(f, body, who, 2_000, 1_000)  # $0.015 each
    assert let_through == 4 and (await book.spend(f.store, user, now.date()))[0] == Spend(D("0.06"), 12_000, 4, 0)
    await f.store.aclose()


class LeftStore(MemoryStore):
    """A store a filter opens for a `redis_url`: says whether it holds usage back, and whether it was closed."""

    def __init__(self) -> None:
        super().__init__()
        self.holding_back, self.closed = False, False

    async def flush(self) -> bool:
        return not self.holding_back

    async def aclose(self) -> None:
        self.closed = True


async def test_the_store_redis_url_leaves_is_closed_once_its_turns_are_settled(counter, unique, monkeypatch):
    """A store `redis_url` no longer names stays open while a turn charged in it is in flight
    (its outlet settles it there, not in the new store) and while it holds usage back for its
    server; then it is closed (it was once dropped as it was: held usage lost, connections open)."""
    opened: dict[str, LeftStore] = {}
    monkeypatch.setattr(filter_module, "open_store", lambda url: opened.setdefault(url, LeftStore()))
    now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    f = make_filter(counter, clock=Clock(now), daily_limit_usd=1, redis_url="redis://a")
    user = f"u-{unique}"
    body, who = turn(user)
    await f.inlet(body, __user__=who, __metadata__=body["metadata"])
    f.valves = f.Valves(daily_limit_usd=1, redis_url="redis://b")
    await inlet(f, f"other-{unique}")  # the filter moves to b
    assert f.store is opened["redis://b"] and not opened["redis://a"].closed
    await outlet(f, body, who, 20, 5)
    assert await SpendBook().spend(opened["redis://a"], user, now.date()) == (Spend(D("0.0001"), 25, 1, 0),) * 2
    assert await opened["redis://b"].counters(f"spend:2026-12:{user}") == {}
    opened["redis://a"].holding_back = True
    await inlet(f, f"other-{unique}")
    assert not opened["redis://a"].closed
    opened["redis://a"].holding_back = False
    await inlet(f, f"other-{unique}")
    assert opened["redis://a"].closed and not opened["redis://b"].closed


async def test_stores_redis_url_left_are_kept_bounded(counter, unique, monkeypatch):
    """Each store left holds a turn that never ends; past MAX_RETIRED_STORES the oldest is closed."""
    opened: dict[str, LeftStore] = {}
    monkeypatch.setattr(filter_module, "open_store", lambda url: opened.setdefault(url, LeftStore()))
    f = make_filter(counter, daily_limit_usd=1)
    for k in range(20):
        f.valves = f.Valves(daily_limit_usd=1, redis_url=f"redis://h{k}")
        await inlet(f, f"u{k}-{unique}")
    closed = [url for url, store in opened.items() if store.closed]
    assert closed == [f"redis://h{k}" for k in range(20 - 1 - bookkeeping_module.MAX_RETIRED_STORES)]


@pytest.mark.redis
@pytest.mark.parametrize("policy", ["fail-open", "fail-closed"])
async def test_a_reserve_redis_applied_but_answered_too_late_counts_once(
    counter, redis_url, unique, policy, monkeypatch
):
    """Redis applies a turn's check-and-charge but both tries of its answer time out: the store
    counts an outage. Let through (fail-open), the turn ends charged what it cost, once (it was
    once charged the estimate as well); refused (fail-closed), nothing stays charged."""
    from contextwarden.state import store as store_module

    class LateAnswers:
        def __init__(self, inner) -> None:
            self.inner, self.late = inner, True

        def __getattr__(self, name):
            return getattr(self.inner, name)

        async def eval(self, script, keys, *args):
            result = await self.inner.eval(script, keys, *args)
            if self.late and script == store_module._INCR_SCRIPT and args[5] != "":  # a capped one: a reserve
                raise aioredis.TimeoutError("Timeout reading from socket")
            return result

    client = LateAnswers(store_module.redis_client(redis_url))
    now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    f = make_filter(
        counter,
        store=RedisStore(redis_url, client=client),
        clock=Clock(now),
        daily_limit_usd=1,
        limit_store_failure=policy,
    )
    user = f"u-{unique}"
    body, who = turn(user)
    outcome = await started(f, body, who)
    client.late = False
    monkeypatch.setattr(store_module, "REDIS_RETRY_SECONDS", 0.0)  # Redis answers again
    book = SpendBook()
    await book.spend(f.store, user, now.date())  # sends what the outage held
    if policy == "fail-closed":
        assert isinstance(outcome, TurnRefused)
        assert await book.spend(f.store, user, now.date()) == (Spend(D(0), 0, 0, 0),) * 2
        return
    reply = reply_of(usage={"prompt_tokens": 1_000, "completion_tokens": 100})
    await f.outlet({**body, "messages": [*body["messages"], reply]}, __user__=who, __metadata__=body["metadata"])
    assert await book.spend(f.store, user, now.date()) == (Spend(D("0.0035"), 1_100, 1, 0),) * 2


async def test_a_reply_the_ledger_refuses_still_reaches_the_spend_totals(counter, unique, monkeypatch):
    """The ledger and the spend totals are written apart: a reply the ledger could not take
    (a store error, counts out of its range) is still in what limits read (it once skipped
    both, so a turn that took no charge never counted)."""

    async def refused(*args, **kwargs):
        raise ValueError("counter would leave the integer range")

    monkeypatch.setattr(bookkeeping_module, "record_reply", refused)
    now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    f = await limited(counter, {}, now)
    user = f"u-{unique}"
    body, who = turn(user)
    await f.inlet(body, __user__=who, __metadata__=body["metadata"])
    reply = reply_of(usage={"prompt_tokens": 1_000, "completion_tokens": 100})
    await f.outlet({**body, "messages": [*body["messages"], reply]}, __user__=who, __metadata__=body["metadata"])
    assert await SpendBook().spend(f.store, user, now.date()) == (Spend(D("0.0035"), 1_100, 1, 0),) * 2


async def test_a_reply_across_midnight_is_on_its_turn_s_day_in_the_ledger_and_the_spend(counter, unique):
    """A turn started at 23:59:50 UTC whose reply ends after midnight is on the day it started,
    in the ledger as in the spend totals its charge settled (the ledger once took the outlet's
    day, so the report and the limits disagreed)."""
    clock = Clock(datetime(2026, 12, 1, 23, 59, 50, tzinfo=UTC))
    f = await limited(counter, {"daily_limit_usd": 10}, clock)
    user = f"u-{unique}"
    body, who = turn(user)
    await f.inlet(body, __user__=who, __metadata__=body["metadata"])
    clock.now = datetime(2026, 12, 2, 0, 0, 20, tzinfo=UTC)
    reply = reply_of(usage={"prompt_tokens": 1_000, "completion_tokens": 100})
    await f.outlet({**body, "messages": [*body["messages"], reply]}, __user__=who, __metadata__=body["metadata"])
    [entry] = [e for e in await read_ledger(f.store) if e.user == user]
    assert entry.day == date(2026, 12, 1)
    day, _ = await SpendBook().spend(f.store, user, date(2026, 12, 1))
    assert day == Spend(D("0.0035"), 1_100, 1, 0)


async def test_only_turns_started_here_teach(counter, unique):
    """Forged `POST /api/chat/completed` bodies carry no turn of this worker's: they are booked
    to their sender, but never move the cache statistics or the calibration others see. A turn
    started here teaches them what its stream reported."""
    f = await limited(counter, {}, datetime.now(UTC))
    cached = {"prompt_tokens": 5_000, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 4_000}}
    body, who = turn(f"u-{unique}")
    for _ in range(20):
        await f.outlet({"model": "gpt-4o", "messages": [*body["messages"], reply_of(usage=cached)]}, __user__=who)
    assert await load_cache_stats(f.store, "openai/gpt-4o") == CacheStats()
    assert (await load_calibration(f.store, "openai/gpt-4o")).samples == 0
    await f.inlet(body, __user__=who, __metadata__=body["metadata"])
    await f.stream(stream_chunk(usage=cached), __metadata__=body["metadata"])  # the backend's report
    outlet = {"model": "gpt-4o", "messages": [*body["messages"], reply_of(usage=cached)]}
    await f.outlet(outlet, __user__=who, __metadata__=body["metadata"])
    assert await load_cache_stats(f.store, "openai/gpt-4o") == CacheStats(1, 1)


# -- the status line with spend ----------------------------------------------------------------


async def test_status_line_shows_spend_and_the_limit(counter, store_valves, unique):
    f = await limited(counter, {**store_valves, "daily_limit_usd": 2}, datetime.now(UTC))
    user = {"id": f"u-{unique}", "role": "user"}
    await spent(f, user["id"], "0.4", datetime.now(UTC).date())
    run = await run_turn(f, CHAT, user=user, reply=reply_of(usage={"prompt_tokens": 8_000, "completion_tokens": 0}))
    assert run.events.statuses[-1] == "Whole chat sent · 8,000 tokens in · 0 out · $0.020 · today $0.42 of $2.00"
    await spent(f, user["id"], "1.3", datetime.now(UTC).date())
    run = await run_turn(f, CHAT, user=user, reply=reply_of(usage={"prompt_tokens": 4_000, "completion_tokens": 0}))
    assert (
        run.events.statuses[-1]
        == "86% of your daily limit · Whole chat sent · 4,000 tokens in · 0 out · $0.010 · today $1.73 of $2.00"
    )


async def test_spend_hidden_by_the_user_valve_and_off_without_a_limit(counter, unique):
    f = await limited(counter, {"daily_limit_usd": 2}, datetime.now(UTC))
    hidden = {"id": f"u-{unique}", "role": "user", "valves": f.UserValves(show_spend=False)}
    run = await run_turn(f, CHAT, user=hidden, reply=reply_of(usage={"prompt_tokens": 8_000, "completion_tokens": 0}))
    assert run.events.statuses[-1] == "Whole chat sent · 8,000 tokens in · 0 out · $0.020"
    g = await limited(counter, {}, datetime.now(UTC))  # no limit: not shown unless the admin asks
    run = await run_turn(
        g, CHAT, user={"id": "u2"}, reply=reply_of(usage={"prompt_tokens": 8_000, "completion_tokens": 0})
    )
    assert run.events.statuses[-1] == "Whole chat sent · 8,000 tokens in · 0 out · $0.020"
    g.valves = g.Valves(show_spend=True)
    run = await run_turn(
        g, CHAT, user={"id": "u2"}, reply=reply_of(usage={"prompt_tokens": 4_000, "completion_tokens": 0})
    )
    assert run.events.statuses[-1] == "Whole chat sent · 4,000 tokens in · 0 out · $0.010 · today $0.03"


# -- !usage ------------------------------------------------------------------------------------


async def test_admin_usage_command_answers_without_the_model(counter, store_valves, unique):
    now = datetime(2026, 12, 1, 9, 30, tzinfo=UTC)
    f = await limited(
        counter, {**store_valves, "daily_limit_usd": 2, "limit_overrides": '{"groups": {"g": {"daily_usd": 5}}}'}, now
    )
    ann, bob = f"ann-{unique}", f"bob-{unique}"
    await spent(f, ann, "1.25", now.date(), tokens=500_000)
    await spent(f, ann, "0.5", date(2026, 12, 1) - timedelta(days=0))
    await spent(f, bob, None, date(2026, 12, 1), tokens=777)
    await spent(f, bob, "9", date(2026, 11, 30))  # last month: not shown
    body, who = turn("admin-1", role="admin", text="  !usage ")
    with pytest.raises(TurnRefused) as answer:  # an API caller: the answer is the error text
        await f.inlet(body, __user__=who, __metadata__=body["metadata"])
    text = str(answer.value)
    assert text.startswith("### contextwarden usage · 2026-12 (UTC, to 2026-12-01 09:30)")
    assert "Today: ≥$1.75 · 3 replies." in text
    assert f"| {ann} | 2 | 501,000 | 1.75 |" in text and f"| {bob} | 1 | 777 | unknown |" in text
    # no token limit is set: "(token limits did)" was said all the same
    said = "1 reply had no known price: its tokens are counted, its cost is not (≥, unknown);"
    assert f"{said} dollar limits could not count it." in text
    assert "Limits for everyone: $2.00 a day," in text and "overrides for 1 group." in text
    assert "background calls" in text
    assert "9.0000" not in text


@pytest.mark.parametrize(
    ("valves", "said"),
    [
        ({}, "."),
        ({"daily_limit_usd": 2}, "; dollar limits could not count it."),
        ({"monthly_limit_tokens": 10**6}, "; token limits counted it."),
        ({"daily_limit_usd": 2, "daily_limit_tokens": 10**6}, "; dollar limits could not count it (token limits did)."),
        ({"limit_overrides": '{"users": {"x": {"monthly_tokens": 5}}}'}, "; token limits counted it."),
    ],
)
async def test_usage_command_words_an_unpriced_reply_as_the_limits_set(counter, unique, valves, said):
    """The default filter, a gpt-4o reply and one of a model without a price, then `!usage`.
    Before: the admin read "dollar limits could not count it (token limits did)" with no limit
    set at all, and the user "today $0.0026 · this month $0.0026" for a day that was more."""
    f = make_filter(counter, **valves)
    user = {"id": f"ann-{unique}", "role": "user"}
    priced = reply_of(usage={"prompt_tokens": 1_000, "completion_tokens": 10})
    await run_turn(f, CHAT, user=user, reply=priced)  # gpt-4o: 1000 x $2.50/M + 10 x $10/M = $0.0026
    unpriced = reply_of(usage={"prompt_tokens": 500, "completion_tokens": 5})
    await run_turn(f, CHAT, user=user, model="mystery-model-9", reply=unpriced)
    body, who = turn("admin-1", role="admin", text="!usage")
    with pytest.raises(TurnRefused) as answer:
        await f.inlet(body, __user__=who, __metadata__=body["metadata"])
    unpriced_note = "- 1 reply had no known price: its tokens are counted, its cost is not (≥, unknown)"
    assert f"{unpriced_note}{said}\n" in str(answer.value)
    body, who = turn(user["id"], text="!usage")
    with pytest.raises(TurnRefused) as answer:
        await f.inlet(body, __user__=who, __metadata__=body["metadata"])
    own = str(answer.value)
    assert own.startswith("contextwarden: today ≥$0.0026") and " · this month ≥$0.0026" in own, own


async def test_usage_command_in_a_browser_chat_writes_the_reply_and_ends_without_an_error(counter, unique):
    """Seen in the browser: the answer was written into the reply, then the turn ended with a
    `TurnRefused`, which Open WebUI 0.12.4 shows as an error under it and a red toast ("the
    usage report is above; the model was not called"). Now it ends as the Stop button ends a
    turn: a `CancelledError`, which Open WebUI's chat task answers with `chat:tasks:cancel`."""
    f = await limited(counter, {"daily_limit_usd": 2}, datetime(2026, 12, 1, 9, 30, tzinfo=UTC))
    await spent(f, f"ann-{unique}", "0.25", date(2026, 12, 1))
    events = Events()
    with pytest.raises(asyncio.CancelledError) as answer:
        await inlet(f, "admin-1", role="admin", events=events, text="!usage", session_id="s1", chat_id="c1")
    assert isinstance(answer.value, AnsweredInChat) and not isinstance(answer.value, Exception)
    [replace] = [e for e in events.items if e["type"] == "replace"]
    assert f"| ann-{unique} | 1 |" in replace["data"]["content"]


@pytest.mark.parametrize(
    ("ids", "request_state"),
    [
        ({"session_id": "s1"}, None),  # no chat id: an API caller awaits the turn
        ({"chat_id": "c1"}, None),  # no session: no page to write into
        ({"session_id": "s1", "chat_id": "c1", "automation_id": "a1"}, None),  # an automation awaits its task
        ({"session_id": "s1", "chat_id": "c1"}, True),  # a sub-agent's request (internal)
    ],
)
async def test_usage_command_awaited_by_its_caller_is_its_error_text(counter, unique, ids, request_state):
    """Where Open WebUI awaits the turn, a `CancelledError` would leave the caller without an
    answer: the answer is the refusal's text, as for an API caller."""
    f = await limited(counter, {}, datetime(2026, 12, 1, 9, 30, tzinfo=UTC))
    body, who = turn(f"ann-{unique}", text="!usage", **ids)
    request = types.SimpleNamespace(state=types.SimpleNamespace(internal=request_state))
    with pytest.raises(TurnRefused) as answer:
        await f.inlet(
            body, __user__=who, __metadata__=body["metadata"], __event_emitter__=Events(), __request__=request
        )
    assert str(answer.value).startswith("contextwarden: today $0.00")


async def test_usage_command_for_users_shows_their_own_spend_only(counter, unique):
    f = await limited(
        counter, {"daily_limit_usd": 2, "monthly_limit_tokens": 1_000_000}, datetime(2026, 12, 1, 9, 30, tzinfo=UTC)
    )
    await spent(f, f"ann-{unique}", "0.25", date(2026, 12, 1))
    await spent(f, f"bob-{unique}", "1.5", date(2026, 12, 1))
    body, who = turn(f"ann-{unique}", text="!usage")
    with pytest.raises(TurnRefused) as answer:
        await f.inlet(body, __user__=who, __metadata__=body["metadata"])
    assert str(answer.value) == (
        "contextwarden: today $0.25 of $2.00 · this month $0.25 · monthly tokens 1,000 of 1,000,000."
    )
    assert "bob" not in str(answer.value)


async def test_usage_inside_a_longer_message_is_just_text(counter):
    f = await limited(counter, {}, datetime.now(UTC))
    body, who = turn("admin-1", role="admin", text="what does !usage do?")
    assert (await f.inlet(body, __user__=who, __metadata__=body["metadata"]))["messages"][-1][
        "content"
    ] == "what does !usage do?"


LIMIT_LINES = [  # (the valves' limits, the overrides, what the admin's report says of them)
    (Limits(daily_usd=D("0.05")), "", "Limits for everyone: $0.05 a day, no monthly dollar limit, no token limits."),
    (
        Limits(daily_usd=D(2), monthly_usd=D("40.5"), monthly_tokens=5_000_000),
        '{"groups": {"g": {"daily_usd": 5}}}',
        "Limits for everyone: $2.00 a day, $40.50 a month, no daily token limit, 5,000,000 tokens a month; "
        "overrides for 1 group.",
    ),
    (
        Limits(daily_tokens=100_000),
        '{"roles": {"user": {}, "pending": {}}, "users": {"u1": {"daily_usd": 1}}}',
        "Limits for everyone: no dollar limits, 100,000 tokens a day, no monthly token limit; "
        "overrides for 2 roles, 1 user.",
    ),
    (Limits(), '{"users": {"u1": {"daily_usd": 1}}}', "Limits for everyone: none; overrides for 1 user."),
]


@pytest.mark.parametrize(("base", "overrides", "said"), LIMIT_LINES)
def test_the_admin_report_says_which_limits_are_dollars_and_which_tokens(base, overrides, said):
    """It said `daily $0.05, monthly none, daily none, monthly none`: which were tokens?"""
    now = datetime(2026, 12, 1, 9, 30, tzinfo=UTC)
    text = usage_markdown(MonthTotals([], [], []), now, parse_overrides(overrides, base), shared=True)
    assert f"- {said}\n" in text


@pytest.mark.parametrize(
    ("share", "said"),
    [("0.85", "85%"), ("1.25", "125%"), ("11.8", "1,180%"), ("99.99", "9,999%"), ("100.5", "over 9,999%")],
)
def test_a_share_of_a_limit_is_shown_as_it_is(share, said):
    """A user at 1,180% of a limit was shown `999%`."""
    verdict = Verdict(False, "daily_usd", D(0), D(1), warn_kind="daily_usd", warn_share=D(share))
    assert spend_text(Limits(daily_usd=D(1)), Spend(), verdict, False) == f"{said} of your daily limit"


class OpenWebUIUsers:
    """`open_webui.models.users.Users` as Open WebUI 0.12.4 has it: `get_user_by_id` is async and
    gives a model with `.name` and `.email` (None for an id it does not know)."""

    def __init__(self, people: dict[str, str]) -> None:
        self.people, self.asked = people, []

    async def get_user_by_id(self, user_id: str):
        self.asked.append(user_id)
        name = self.people.get(user_id)
        return None if name is None else types.SimpleNamespace(id=user_id, name=name, email=f"{user_id}@example.com")


async def admin_report(f) -> str:
    body, who = turn("admin-1", role="admin", text="!usage")
    with pytest.raises(TurnRefused) as answer:
        await f.inlet(body, __user__=who, __metadata__=body["metadata"])
    return str(answer.value)


async def test_the_admin_report_names_users_as_open_webui_does(counter, unique, monkeypatch, caplog):
    """Users were listed by id only; now by their Open WebUI name (read through its `Users`
    model), the id where none can be read, and never an email."""
    ann, bob, gone = f"ann-{unique}", f"bob-{unique}", f"gone-{unique}"
    users = OpenWebUIUsers({ann: "Ann Lee", bob: "Bob | <b>*Ops*</b>\nteam"})
    monkeypatch.setitem(sys.modules, "open_webui.models.users", types.SimpleNamespace(Users=users))
    f = await limited(counter, {"daily_limit_usd": 2}, datetime(2026, 12, 1, 9, 30, tzinfo=UTC))
    for user, usd in ((ann, "0.5"), (bob, "0.25"), (gone, "0.125")):
        await spent(f, user, usd, date(2026, 12, 1))
    with caplog.at_level(logging.INFO, logger="contextwarden"):
        text = await admin_report(f)
    assert "| user | replies | tokens | cost USD |" in text
    assert "| Ann Lee | 1 | 1,000 | 0.50 |" in text
    assert "| Bob \\| \\<b\\>\\*Ops\\*\\</b\\> team | 1 |" in text  # markup shown as text, one line
    assert f"| {gone} | 1 |" in text  # a user Open WebUI no longer knows: the id
    assert sorted(users.asked) == sorted([ann, bob, gone])
    assert "example.com" not in text + caplog.text


async def test_users_with_one_name_are_told_apart_by_their_id(counter, unique, monkeypatch):
    ann1, ann2 = f"a1-{unique}", f"a2-{unique}"
    users = OpenWebUIUsers({ann1: "Ann", ann2: "Ann"})
    monkeypatch.setitem(sys.modules, "open_webui.models.users", types.SimpleNamespace(Users=users))
    f = await limited(counter, {"daily_limit_usd": 2}, datetime(2026, 12, 1, 9, 30, tzinfo=UTC))
    await spent(f, ann1, "0.5", date(2026, 12, 1))
    await spent(f, ann2, "0.25", date(2026, 12, 1))
    text = await admin_report(f)
    assert f"| Ann ({ann1}) | 1 |" in text and f"| Ann ({ann2}) | 1 |" in text


async def test_names_read_slowly_or_not_at_all_leave_the_ids(counter, unique, monkeypatch, caplog):
    """An older Open WebUI's synchronous `get_user_by_id` runs off the event loop, and the report
    waits for names at most `USER_NAMES_TIMEOUT_SECONDS`; a failing one leaves the ids, logged once."""
    import contextwarden.face.adminview as adminview

    monkeypatch.setattr(adminview, "USER_NAMES_TIMEOUT_SECONDS", 0.2)
    threads, release = [], threading.Event()

    class SlowUsers:
        def get_user_by_id(self, user_id):
            threads.append(threading.current_thread())
            release.wait(5)
            return types.SimpleNamespace(name="Late")

    class BrokenUsers:
        def get_user_by_id(self, user_id):
            raise RuntimeError("database is locked")

    f = await limited(counter, {"daily_limit_usd": 2}, datetime(2026, 12, 1, 9, 30, tzinfo=UTC))
    ids = [f"u{n}-{unique}" for n in range(3)]
    for user in ids:
        await spent(f, user, "0.5", date(2026, 12, 1))
    for users in (SlowUsers(), BrokenUsers()):
        monkeypatch.setitem(sys.modules, "open_webui.models.users", types.SimpleNamespace(Users=users))
        caplog.clear()
        started = asyncio.get_running_loop().time()
        text = await admin_report(f)
        assert asyncio.get_running_loop().time() - started < 2
        assert all(f"| {user} | 1 |" in text for user in ids) and "Late" not in text
        assert caplog.text.count("user names not read") == 1
    release.set()
    assert threads and threading.main_thread() not in threads


async def test_the_admin_report_outside_open_webui_shows_ids(counter, unique, monkeypatch):
    monkeypatch.delitem(sys.modules, "open_webui.models.users", raising=False)
    f = await limited(counter, {"daily_limit_usd": 2}, datetime(2026, 12, 1, 9, 30, tzinfo=UTC))
    await spent(f, f"ann-{unique}", "0.5", date(2026, 12, 1))
    assert f"| ann-{unique} | 1 |" in await admin_report(f)


async def test_the_admin_report_says_where_the_full_report_comes_from(counter, unique):
    """An admin who pasted the single file has no `contextwarden` command: the report says it
    comes with the package (it read as if it were there)."""
    f = await limited(counter, {"daily_limit_usd": 2}, datetime(2026, 12, 1, 9, 30, tzinfo=UTC))
    await spent(f, f"ann-{unique}", "0.5", date(2026, 12, 1))
    last = (await admin_report(f)).rstrip().splitlines()[-1]
    assert "contextwarden package" in last and "`contextwarden usage" in last


# -- groups outside Open WebUI -------------------------------------------------------------


async def test_group_reader_without_open_webui_and_with_a_sync_lookup(monkeypatch):
    monkeypatch.delitem(sys.modules, "open_webui.models.groups", raising=False)
    assert await GroupReader().groups("u1") == frozenset()
    threads = []

    def sync_lookup(user_id):  # older Open WebUI: synchronous database access, run off the event loop
        threads.append(threading.current_thread())
        return [types.SimpleNamespace(id="gid", name="Research")]

    assert await GroupReader(sync_lookup).groups("u1") == frozenset({"gid", "Research"})
    assert threads and threads[0] is not threading.main_thread()

    def broken(user_id):
        raise RuntimeError("db down")

    assert await GroupReader(broken).groups("u1") == frozenset()


# -- the spend totals limits read (one key per user and month) ------------------------------------


class CountingStore:
    """Counts scans (`keys`) of the store it wraps."""

    def __init__(self, store) -> None:
        self._inner, self.scans = store, 0

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def keys(self, pattern):
        self.scans += 1
        return await self._inner.keys(pattern)


async def test_no_request_path_scans_the_store(counter, store_valves, unique):
    """A limited turn, its outlet, a user's and an admin's `!usage`: each reads keys by name."""
    now = datetime.now(UTC)
    f = await limited(counter, {**store_valves, "daily_limit_usd": 5}, now, wrap=CountingStore)
    user = {"id": f"u-{unique}", "role": "user"}
    await run_turn(f, CHAT, user=user, reply=reply_of(usage={"prompt_tokens": 400, "completion_tokens": 5}))
    for who in (user["id"], "admin-1"):
        body, caller = turn(who, role="admin" if who == "admin-1" else "user", text="!usage")
        with pytest.raises(TurnRefused):
            await f.inlet(body, __user__=caller, __metadata__=body["metadata"])
    assert f.store.scans == 0


async def test_spend_counts_a_forged_reply_within_bounds(counter, unique):
    """Outlet input is user-controlled: a reply counts at most $1,000 toward limits, never below 0."""
    f = await limited(counter, {"daily_limit_usd": 5}, datetime(2026, 12, 1, tzinfo=UTC))
    book = SpendBook()  # the filter's replies are recorded by one like it, on its store
    await book.record(f.store, user=unique, day=date(2026, 12, 1), cost_usd=D("1e30"), tokens=10**30)
    await book.record(f.store, user=unique, day=date(2026, 12, 1), cost_usd=D("-5"), tokens=-5)
    day, _ = await SpendBook().spend(f.store, unique, date(2026, 12, 1))
    assert day.usd == D(1000) and day.tokens == 10**10
    with pytest.raises(TurnRefused, match=r"\(\$1,000.00 used today\)"):  # the filter reads the same
        await inlet(f, unique)


async def test_a_damaged_spend_key_is_repaired_and_locks_nobody_out(counter, redis_url, unique, caplog):
    """A spend key of the wrong type, or with a field that is not a number, is named once and
    repaired; the user is served (fail-closed included) and the next reply counts."""
    valves = {"redis_url": redis_url, "daily_limit_usd": 1, "limit_store_failure": "fail-closed"}
    now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    f = await limited(counter, valves, now)
    raw = aioredis.from_url(redis_url)
    wrong, bad_field = f"u-{unique}", f"v-{unique}"
    await raw.set(f"contextwarden:spend:2026-12:{wrong}", "garbage", ex=60)
    await raw.hset(f"contextwarden:spend:2026-12:{bad_field}", mapping={"d01:cost_picousd": "x1", "tokens": "7"})
    for user in (wrong, bad_field, wrong, bad_field):
        assert not isinstance(await started(f, *turn(user)), Exception)
    assert caplog.text.count("was not a counter (damaged)") == 2
    for user in (wrong, bad_field):
        day, _ = await SpendBook().spend(f.store, user, now.date())
        assert day.requests == 2 and D("0.02") < day.usd < D("0.021")
    await raw.aclose()


# -- !usage is never sent on -------------------------------------------------------------------


async def test_usage_exchanges_are_never_sent_on(counter):
    f = await limited(counter, {"daily_limit_usd": 5}, datetime.now(UTC))
    chat = [
        CHAT[0],
        {"role": "user", "content": "What is a fjord?"},
        {"role": "assistant", "content": "A sea inlet."},
        {"role": "user", "content": " !usage"},
        {"role": "assistant", "content": "### contextwarden usage · 2026-12\n| user id | replies |"},
        {"role": "user", "content": "!USAGE"},
        {"role": "assistant", "content": "contextwarden: today $0.42 of $5.00."},
        {"role": "user", "content": "What does !usage show?"},
        {"role": "assistant", "content": "Your spend."},
        {"role": "user", "content": "Thanks. And a glacier?"},
    ]
    run = await run_turn(f, chat, user={"id": "u1", "role": "admin"})
    for sent in (run.after_inlet, run.after_request):
        texts = [m["content"] for m in sent["messages"]]
        assert texts == [m["content"] for m in chat[:3] + chat[7:]]
    g = await limited(counter, {"mode": "off"}, datetime.now(UTC))  # even with trimming off
    run = await run_turn(g, chat, user={"id": "u1"})
    assert len(run.after_request["messages"]) == 6


def test_the_command_in_parts_is_read_only_in_a_few():
    """`!usage` sent as content parts is the command; a message in thousands of parts is not read
    for it (every pass reads every earlier user message: 100,000 parts held the loop)."""
    from contextwarden.face.adminview import COMMAND_MAX_PARTS, is_usage_command

    command = {"type": "text", "text": "!usage"}
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    assert is_usage_command([{"role": "user", "content": [command]}])
    assert is_usage_command([{"role": "user", "content": [image, command]}])
    empty = [{"type": "text", "text": ""}] * COMMAND_MAX_PARTS
    assert not is_usage_command([{"role": "user", "content": [*empty, command]}])


async def test_a_turn_without_metadata_is_charged_too(counter, unique):
    """A caller that passes no `__metadata__` (no note can reach its outlet) is still charged
    when its turn starts: of 20 such turns of ~$0.0103 each against $0.02, two start."""
    f = await limited(counter, {"daily_limit_usd": 0.02}, datetime(2026, 12, 1, 12, tzinfo=UTC))
    user = {"id": f"u-{unique}", "role": "user"}
    results = []
    for _ in range(20):
        try:
            results.append(await f.inlet({"model": "gpt-4o", "messages": [*CHAT]}, __user__=user))
        except TurnRefused as refused:
            results.append(refused)
    assert sum(not isinstance(r, Exception) for r in results) == 2
