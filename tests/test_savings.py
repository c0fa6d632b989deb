"""Savings arithmetic: exact Decimal, calibration rounding, price tiers, unknown prices, and the
carry between passes of one turn; ledger totals of savings in-process and in real Redis."""

from __future__ import annotations

from datetime import date
from decimal import Decimal

import pytest

from contextwarden.ledger import ledger_totals, read_ledger, record_reply
from contextwarden.pricing import ModelPrice, PriceTier
from contextwarden.savings import carried_savings, estimate_savings
from contextwarden.store import MemoryStore, open_store

D = Decimal
GPT4O = ModelPrice(D("0.0000025"), D("0.00001"))
# Base $1.25/M input; from 200,000 prompt tokens $2.50/M (as gemini-2.5-pro).
TIERED = ModelPrice(D("0.00000125"), D("0.00001"), tiers=(PriceTier(200_000, D("0.0000025"), D("0.000015"), None, None),))


def test_plain_input_price():
    # (96,210 − 7,950) × $2.50/M = 88,260 × 0.0000025 = $0.220650
    s = estimate_savings(96_210, 7_950, price=GPT4O)
    assert (s.tokens_saved, s.cost_saved_usd) == (88_260, D("0.220650"))


def test_calibration_rounds_half_even_then_prices():
    # × 1.25: 96,210 → 120,262.5 → 120,262 (half-even); 7,950 → 9,937.5 → 9,938
    # (120,262 − 9,938) × 0.0000025 = 110,324 × 0.0000025 = $0.275810
    s = estimate_savings(96_210, 7_950, factor=1.25, price=GPT4O)
    assert (s.tokens_before, s.tokens_after, s.tokens_saved) == (120_262, 9_938, 110_324)
    assert s.cost_saved_usd == D("0.275810")


def test_each_side_at_the_tier_its_size_reaches():
    # 250,000 tokens reach the 200k tier: 250,000 × $2.50/M = $0.625
    # 50,000 stay at the base:            50,000 × $1.25/M = $0.0625   → saved $0.5625
    s = estimate_savings(250_000, 50_000, price=TIERED)
    assert s.cost_saved_usd == D("0.5625") and s.tokens_saved == 200_000
    # both under the tier: (150,000 − 50,000) × $1.25/M = $0.125
    assert estimate_savings(150_000, 50_000, price=TIERED).cost_saved_usd == D("0.125")


def test_unknown_price_keeps_the_tokens_but_no_money():
    s = estimate_savings(1_000, 400, price=None)
    assert (s.tokens_saved, s.cost_saved_usd, s.reason) == (600, None, "no price for this model")
    s = estimate_savings(1_000, 400, price=ModelPrice(None, D("0.00001")))
    assert (s.cost_saved_usd, s.reason) == (None, "input price unknown")
    assert estimate_savings(500, 500, price=None).cost_saved_usd == D(0)  # nothing trimmed: nothing unknown


def test_carry_only_when_a_pass_works_on_an_earlier_pass_output():
    note = {"removed": 900, "messages_before": 40}
    assert carried_savings(note, 12, chained=True) == (900, 40)   # enforce: request sees inlet's trimmed chat
    assert carried_savings(note, 40, chained=True) == (0, 40)     # the whole chat again: replace
    assert carried_savings(note, 12, chained=False) == (0, 12)    # shadow never chains
    assert carried_savings({}, 12, chained=True) == (0, 12)


@pytest.fixture(params=["memory", "redis"])
async def store(request):
    if request.param == "memory":
        yield MemoryStore()
        return
    redis_store = open_store(request.getfixturevalue("redis_url"))
    yield redis_store
    await redis_store.aclose()


async def test_ledger_totals_savings_apart_from_shadow_savings(store, unique):
    day = date(2199, 12, 31)
    user = f"saver-{unique}"
    common = dict(user=user, model="openai/gpt-4o", prompt_tokens=800, completion_tokens=20, cost_usd=D("0.0022"),
                  estimated=False, day=day, retention_days=1)
    await record_reply(store, **common, tokens_saved=88_260, cost_saved_usd=D("0.220650"))
    await record_reply(store, **common, tokens_saved=110_324, cost_saved_usd=D("0.275810"))
    await record_reply(store, **common, tokens_saved=200_000, cost_saved_usd=D("0.5625"), shadow=True)
    await record_reply(store, **common, tokens_saved=600, cost_saved_usd=None, shadow=True)  # unpriced model
    await record_reply(store, **common)  # a reply that fit: nothing saved
    [row] = ledger_totals([e for e in await read_ledger(store, since=day, until=day) if e.user == user], "user")
    c = row.counters
    assert (c["requests"], c["trimmed"], c["tokens_saved"]) == (5, 2, 198_584)
    assert (c["shadow_trimmed"], c["shadow_tokens_saved"]) == (2, 200_600)
    # 0.220650 + 0.275810 = 0.496460 exactly, in picodollars through HINCRBY
    assert row.usd("cost_saved_picousd") == D("0.49646") and row.usd("shadow_cost_saved_picousd") == D("0.5625")
    assert row.cost_usd == D("0.011")  # real spend beside it: 5 × 0.0022
    data = row.as_dict()
    assert (data["cost_saved_usd"], data["shadow_cost_saved_usd"], data["cost_usd"]) == ("0.49646", "0.5625", "0.011")
