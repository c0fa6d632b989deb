"""Savings arithmetic: exact Decimal, calibration rounding, price tiers, unknown prices, and the
carry between passes of one turn; ledger totals of savings in-process and in real Redis."""

from __future__ import annotations

from datetime import date
from decimal import Decimal

import pytest

from contextwarden.core.trim import SHORTENED_MARK
from contextwarden.money.ledger import ledger_totals, read_ledger, record_reply
from contextwarden.money.pricing import ModelPrice, PriceTier
from contextwarden.money.savings import Savings, carried_savings, estimate_savings
from contextwarden.state.store import MemoryStore, open_store

D = Decimal
GPT4O = ModelPrice(D("0.0000025"), D("0.00001"))
# Base $1.25/M input; from 200,000 prompt tokens $2.50/M (as gemini-2.5-pro).
TIERED = ModelPrice(
    D("0.00000125"), D("0.00001"), tiers=(PriceTier(200_000, D("0.0000025"), D("0.000015"), None, None),)
)


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
    chat = [{"role": "user", "content": "q"}] * 40
    cut = [{"role": "user", "content": "a document " + SHORTENED_MARK.format(n="5")}]
    assert carried_savings(note, chat[:12], chained=True) == (900, 40)  # enforce: request sees inlet's trimmed chat
    assert carried_savings(note, chat, chained=True) == (0, 40)  # the whole chat again: replace
    assert carried_savings(note, chat[:12], chained=False) == (0, 12)  # shadow never chains
    assert carried_savings({}, chat[:12], chained=True) == (0, 12)
    # a pasted document the inlet cut (1 message stays 1): the request pass sees the cut copy
    assert carried_savings({"removed": 900, "messages_before": 1}, cut, chained=True) == (900, 1)
    assert carried_savings({"removed": 900, "messages_before": 1}, cut, chained=False) == (0, 1)


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
    common = dict(
        user=user,
        model="openai/gpt-4o",
        prompt_tokens=800,
        completion_tokens=20,
        cost_usd=D("0.0022"),
        estimated=False,
        day=day,
        retention_days=1,
    )
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


# ---- cache-aware savings: hand arithmetic at bundled prices ------------------------------------

from contextwarden.face.status import savings_status, usage_status  # noqa: E402
from contextwarden.money.cache_stats import CacheStats, update_cache_stats  # noqa: E402
from contextwarden.money.pricing import PriceBook  # noqa: E402
from contextwarden.money.savings import PromptCache, predicted_cache, price_caches, reply_savings  # noqa: E402
from contextwarden.money.usage import Cost, Usage  # noqa: E402

BUNDLED = PriceBook.from_bundled().prices
SONNET = BUNDLED["anthropic/claude-sonnet-4.5"]  # $3.00 in, $0.30 cache read, $3.75 cache write per M
GPT5 = BUNDLED["openai/gpt-5"]  # $1.25 in, $0.125 cache read per M
DEEPSEEK = BUNDLED["deepseek/deepseek-chat"]  # no cache-read price: priced uncached


def test_bundled_prices_are_what_the_arithmetic_below_uses():
    assert (SONNET.prompt, SONNET.cache_read, SONNET.cache_write) == (D("0.000003"), D("0.0000003"), D("0.00000375"))
    assert (GPT5.prompt, GPT5.cache_read) == (D("0.00000125"), D("0.000000125"))
    assert price_caches(SONNET) and price_caches(GPT5) and not price_caches(DEEPSEEK)


def test_sonnet_reused_trim_saves_and_a_fresh_trim_costs_more_than_everything():
    # untrimmed 26,000: previous prompt 25,000 cached × $0.30/M = $0.0075; 1,000 new written × $3.75/M = $0.00375
    untrimmed = PromptCache(25_000, 1_000)
    # trimmed, prefix reused: 7,000 × $0.30/M = $0.0021 + 1,000 × $3.75/M = $0.00375 → $0.00585; saved $0.0054
    s = estimate_savings(26_000, 8_000, price=SONNET, cache_before=untrimmed, cache_after=PromptCache(7_000, 1_000))
    assert s.cost_saved_usd == D("0.0054") and (s.cached_before, s.cached_after) == (25_000, 7_000)
    # a fresh selection breaks the cache: 8,000 written × $3.75/M = $0.030 → −$0.01875 (untrimmed cheaper)
    s = estimate_savings(26_000, 8_000, price=SONNET, cache_before=untrimmed, cache_after=PromptCache(0, 8_000))
    assert s.cost_saved_usd == D("-0.01875")
    # no cache at all: (26,000 − 8,000) × $3.00/M = $0.054
    assert estimate_savings(26_000, 8_000, price=SONNET).cost_saved_usd == D("0.054")


def test_gpt5_automatic_cache():
    # untrimmed: 1,000 × $1.25/M + 25,000 × $0.125/M = $0.00125 + $0.003125 = $0.004375
    # reused trim: 1,000 × $1.25/M + 7,000 × $0.125/M = $0.00125 + $0.000875 = $0.002125 → saved $0.00225
    s = estimate_savings(26_000, 8_000, price=GPT5, cache_before=PromptCache(25_000), cache_after=PromptCache(7_000))
    assert s.cost_saved_usd == D("0.00225")
    # fresh trim: 8,000 × $1.25/M = $0.01 → −$0.005625
    assert estimate_savings(26_000, 8_000, price=GPT5, cache_before=PromptCache(25_000)).cost_saved_usd == D(
        "-0.005625"
    )


def test_uncached_model_ignores_cache_figures():
    # deepseek-chat lists no cache-read price: (26,000 − 8,000) × $0.2574/M = $0.0046332, whatever is "cached"
    expected = 18_000 * DEEPSEEK.prompt
    assert expected == D("0.0046332")
    assert estimate_savings(26_000, 8_000, price=DEEPSEEK, cache_before=PromptCache(25_000)).cost_saved_usd == expected


def test_predicted_cache_needs_caching_and_the_minimum():
    assert predicted_cache(26_000, 25_000, SONNET, caches=True, minimum=1_024) == PromptCache(
        25_000, 1_000
    )  # writes billed
    assert predicted_cache(26_000, 25_000, GPT5, caches=True, minimum=1_024) == PromptCache(25_000, 0)  # writes free
    assert predicted_cache(26_000, 1_000, GPT5, caches=True, minimum=1_024) == PromptCache()  # below the minimum
    assert predicted_cache(26_000, 25_000, GPT5, caches=False, minimum=1_024) == PromptCache()
    assert predicted_cache(26_000, 25_000, DEEPSEEK, caches=True, minimum=1_024) == PromptCache()


def test_enforce_and_shadow_report_the_same_way():
    # enforce: the trim went out, the backend reported 7,000 cached and 1,000 written of 8,000;
    # the untrimmed 26,000 is assumed cached up to its previous prompt (25,000) and writes the rest
    enforce = reply_savings(
        Usage(8_000, 50, cached_tokens=7_000, cache_write_tokens=1_000),
        shadow=False,
        tokens_saved=18_000,
        other_prefix=25_000,
        price=SONNET,
        caches=True,
        minimum=1_024,
    )
    # shadow: the untrimmed chat went out with 25,000 cached and 1,000 written; the would-be trim reuses 7,000
    shadow = reply_savings(
        Usage(26_000, 50, cached_tokens=25_000, cache_write_tokens=1_000),
        shadow=True,
        tokens_saved=18_000,
        other_prefix=7_000,
        price=SONNET,
        caches=True,
        minimum=1_024,
    )
    assert enforce.cost_saved_usd == shadow.cost_saved_usd == D("0.0054")
    assert (
        (enforce.tokens_before, enforce.tokens_after) == (shadow.tokens_before, shadow.tokens_after) == (26_000, 8_000)
    )
    # a model that does not cache (learned): both sides at the input price, (26,000 − 8,000) × $3/M
    plain = reply_savings(
        Usage(8_000, 50),
        shadow=False,
        tokens_saved=18_000,
        other_prefix=25_000,
        price=SONNET,
        caches=False,
        minimum=1_024,
    )
    assert plain.cost_saved_usd == D("0.054")


def test_a_tool_loops_summed_prompt_neither_reaches_a_tier_nor_outweighs_its_cache():
    """Open WebUI sums a tool loop's prompts (and cached tokens) over its calls. The savings took
    the tier of the sum, which no call reached, and set one call's predicted prefix against every
    call's reported hits: both claimed more than the removed tokens could be worth."""
    # gemini-2.5-pro-like: calls of 60k, 70k, 80k (210,000 summed: past the 200k tier), 40,000 removed.
    # Each call under 200k: 40,000 x $1.25/M = $0.05 (was $0.10 enforce, $0.3125 shadow).
    summed = Usage(210_000, 3_000, calls_summed=True, last_call_prompt=80_000)
    for shadow in (False, True):
        s = reply_savings(
            summed, shadow=shadow, tokens_saved=40_000, other_prefix=0, price=TIERED, caches=False, minimum=1_024
        )
        assert s.cost_saved_usd == D("0.05")
    # gpt-5: three trimmed calls of 100,000 (293,000 of 300,000 served from cache), 40,000 removed a call;
    # the untrimmed chat's first call would have had 130,000 cached, the trimmed one had 95,000:
    # untrimmed 340,000 with 293,000 + 35,000 cached: 12,000 x $1.25/M + 328,000 x $0.125/M = $0.056
    # trimmed: 7,000 x $1.25/M + 293,000 x $0.125/M = $0.045375 -> $0.010625 (was $0.233375,
    # more than 3 x 40,000 tokens at the full rate, $0.15)
    loop = Usage(300_000, 1_500, cached_tokens=293_000, calls_summed=True, last_call_prompt=100_000)
    s = reply_savings(
        loop,
        shadow=False,
        tokens_saved=40_000,
        other_prefix=130_000,
        sent_prefix=95_000,
        price=GPT5,
        caches=True,
        minimum=1_024,
    )
    assert s.cost_saved_usd == D("0.010625") and (s.cached_before, s.cached_after) == (328_000, 293_000)


def test_cache_stats_learn_whether_a_model_caches():
    stats = CacheStats()
    assert update_cache_stats(stats, 900, 0, 1_024) is None  # below the minimum: says nothing
    for _ in range(3):
        stats = update_cache_stats(stats, 2_000, None, 1_024)  # never reported: not caching
    assert stats == CacheStats(3, 0) and stats.caches() is False
    stats = update_cache_stats(stats, 2_000, 1_536, 1_024)
    assert stats.caches() is True
    for _ in range(500):  # bounded: halved past the window, the share kept
        stats = update_cache_stats(stats, 2_000, 1_536, 1_024)
    assert stats.prompts <= 200 and stats.caches() is True


def test_the_lines_say_when_the_untrimmed_chat_is_cheaper():
    cheaper = Savings(26_000, 8_000, D("-0.01875"))
    assert savings_status(cheaper, False) == " · untrimmed about $0.019 cheaper (prompt cache)"
    assert savings_status(Savings(26_000, 8_000, D("0.0054")), True) == " · would save about $0.0054 vs untrimmed"
    assert savings_status(Savings(8_000, 8_000, D(0)), False) == ""
    line = usage_status(Usage(8_000, 50, cached_tokens=7_000), False, Cost(D("0.01"), "price_table"), True, cheaper)
    assert line == "8,000 tokens in (7,000 cached) · 50 out · $0.010 · untrimmed about $0.019 cheaper (prompt cache)"


def test_explain_prices_the_cache_by_hand(counter):
    import json as _json
    from pathlib import Path

    from contextwarden.core.trim import trim_messages
    from contextwarden.tools.explain import explain_trim

    data = _json.loads((Path(__file__).parents[1] / "examples" / "long_chat.json").read_text())
    chat = data["messages"]
    result = trim_messages(chat, max_tokens=1_200, model="gpt-4o", token_counter=counter)
    explanation = explain_trim(chat, result, model="gpt-4o", token_counter=counter, price=BUNDLED["openai/gpt-4o"])
    # the untrimmed chat's previous prompt: all but the last reply and the question, less the reply priming
    prefix = result.tokens_before - 3 - counter.count_messages(chat[-2:], "gpt-4o") + 3
    assert prefix >= 1_024 and not result.reused  # cacheable; the trim is a new selection (system prompt < 1,024)
    # gpt-4o: $2.50/M input, $1.25/M cached
    expected = (
        (result.tokens_before - prefix) * D("0.0000025")
        + prefix * D("0.00000125")
        - result.tokens_after * D("0.0000025")
    )
    assert explanation.savings.cost_saved_usd == expected
    assert explanation.as_dict()["savings"]["assumption"].startswith("savings are estimates, cache-aware")


async def test_negative_savings_reach_the_ledger(store, unique):
    day = date(2199, 12, 30)
    common = dict(
        user=f"neg-{unique}",
        model="anthropic/claude-sonnet-4.5",
        prompt_tokens=8_000,
        completion_tokens=20,
        cost_usd=D("0.03"),
        estimated=False,
        day=day,
        retention_days=1,
    )
    await record_reply(store, **common, tokens_saved=18_000, cost_saved_usd=D("-0.01875"))
    await record_reply(store, **common, tokens_saved=18_000, cost_saved_usd=D("0.0054"))
    [row] = ledger_totals(
        [e for e in await read_ledger(store, since=day, until=day) if e.user == common["user"]], "user"
    )
    assert row.usd("cost_saved_picousd") == D("-0.01335") and row.counters["trimmed"] == 2


def test_cached_prefixes_of_a_reused_selection_stop_before_the_newest_reply(counter):
    from contextwarden.money.savings import cached_prefixes

    def each(part):
        return counter.count_each(part, "gpt-4o")

    system = {"role": "system", "content": "S " * 50}
    old = [{"role": "user", "content": "q0 " * 400}, {"role": "assistant", "content": "a0 " * 400}]
    reply, question = {"role": "assistant", "content": "a1 " * 30}, {"role": "user", "content": "q2?"}
    chat = [system, *old, {"role": "user", "content": "q1"}, reply, question]
    total = counter.count_messages(chat, "gpt-4o")
    previous = counter.count_messages(chat[:4], "gpt-4o") - 3  # the previous prompt: up to q1
    assert cached_prefixes(chat, chat, total, total, True, each) == (previous, previous)
    # a per-turn block between the reply and the question is not part of the cached prefix
    recall = {"role": "user", "content": "[recalled] q0"}
    sent = [*chat[:5], recall, question]
    assert cached_prefixes(chat, sent, total, counter.count_messages(sent, "gpt-4o"), True, each)[1] == previous
    # a new selection: only the system prompt repeats
    assert (
        cached_prefixes(chat, [system, question], total, 0, False, each)[1]
        == counter.count_messages([system], "gpt-4o") - 3
    )
    assert cached_prefixes([system, question], [system, question], 10, 10, True, each) == (0, 0)  # a first turn


def test_shadow_line_says_when_trimming_would_cost_more():
    # the shadow turn's line: what enforce would send (words), then the reply's usage and what
    # the trim would have saved, or that the untrimmed chat was cheaper
    used, cost = Usage(26_000, 5), Cost(D("0.065"), "price_table")
    assert usage_status(used, False, cost, True, Savings(26_000, 8_000, D("-0.01875")), True).endswith(
        " · $0.065 · untrimmed about $0.019 cheaper (prompt cache)"
    )
    assert usage_status(used, False, cost, True, Savings(26_000, 8_000, D("0.0054")), True).endswith(
        " · $0.065 · would save about $0.0054 vs untrimmed"
    )
