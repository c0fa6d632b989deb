"""Reading usage for every backend shape, and cost checked against hand computations."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contextwarden.money.pricing import FREE_PRICE, ModelPrice, PriceBook, PriceTier
from contextwarden.money.usage import Cost, Usage, compute_cost, normalize_usage, read_usage

D = Decimal


@pytest.fixture(scope="module")
def prices():
    return PriceBook.from_bundled().prices


def _msg(usage: dict) -> dict:
    return {"role": "assistant", "content": "hi", "usage": usage}


# ---- where usage is found ------------------------------------------------------------------


def test_usage_then_info_usage():
    assert read_usage(_msg({"prompt_tokens": 7, "completion_tokens": 3})).prompt_tokens == 7
    saved = {"role": "assistant", "info": {"usage": {"prompt_tokens": 9, "completion_tokens": 1}}}
    assert read_usage(saved).prompt_tokens == 9
    saved["usage"] = {}
    assert read_usage(saved).prompt_tokens == 9  # empty usage falls back to info.usage


@pytest.mark.parametrize(
    "message",
    [
        {},
        {"usage": None},
        {"usage": {}},
        {"info": {}},
        {"info": {"usage": "x"}},
        "not a dict",
        {"usage": {"response_token/s": 12.5}},
        {"usage": {"prompt_tokens": -5, "completion_tokens": True}},
    ],
)
def test_no_usable_usage_is_none(message):
    assert read_usage(message) is None


def test_counts_are_validated():
    usage = normalize_usage({"prompt_tokens": "12", "completion_tokens": 4.0, "total_tokens": -1})
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (12, 4, 16)


# ---- each backend shape --------------------------------------------------------------------


def test_openai_with_cached_and_reasoning_details():
    usage = read_usage(
        _msg(
            {
                "prompt_tokens": 2000,
                "completion_tokens": 500,
                "total_tokens": 2500,
                "prompt_tokens_details": {"cached_tokens": 1536, "audio_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": 400},
            }
        )
    )
    assert usage == Usage(
        2000, 500, cached_tokens=1536, cache_write_tokens=None, reasoning_tokens=400, total_tokens=2500, shape="openai"
    )


def test_openai_without_details_leaves_them_unknown():
    usage = read_usage(_msg({"prompt_tokens": 10, "completion_tokens": 2}))
    assert usage.cached_tokens is None and usage.reasoning_tokens is None and usage.total_tokens == 12


def test_openrouter_cost_and_cache_writes():
    usage = read_usage(
        _msg(
            {
                "prompt_tokens": 194,
                "completion_tokens": 2,
                "total_tokens": 196,
                "cost": 0.95,
                "is_byok": False,
                "cost_details": {"upstream_inference_cost": 0.95},
                "prompt_tokens_details": {"cached_tokens": 100, "cache_write_tokens": 50},
                "completion_tokens_details": {"reasoning_tokens": 0},
            }
        )
    )
    assert usage.shape == "openrouter"
    assert usage.provider_cost == D("0.95")  # not BYOK: upstream is the same money, not added
    assert (usage.cached_tokens, usage.cache_write_tokens, usage.reasoning_tokens) == (100, 50, 0)


def test_openrouter_byok_adds_the_upstream_charge():
    usage = normalize_usage(
        {
            "prompt_tokens": 10,
            "completion_tokens": 1,
            "cost": 0.000095,
            "is_byok": True,
            "cost_details": {"upstream_inference_cost": 0.0019},
        }
    )
    assert usage.provider_cost == D("0.001995")  # 0.000095 + 0.0019


@pytest.mark.parametrize("cost", [-1, "-0.5", "abc", None, True])
def test_negative_or_malformed_provider_cost_is_ignored(cost):
    assert normalize_usage({"prompt_tokens": 1, "completion_tokens": 1, "cost": cost}).provider_cost is None


def test_anthropic_native_prompt_is_the_sum():
    usage = read_usage(
        _msg(
            {
                "input_tokens": 50,
                "cache_read_input_tokens": 10000,
                "cache_creation_input_tokens": 2000,
                "output_tokens": 500,
            }
        )
    )
    # prompt = 50 + 10000 + 2000 = 12050
    assert usage == Usage(
        12050, 500, cached_tokens=10000, cache_write_tokens=2000, total_tokens=12550, shape="anthropic"
    )


def test_anthropic_without_input_tokens_has_unknown_prompt():
    usage = normalize_usage({"cache_read_input_tokens": 5, "output_tokens": 9})
    assert usage.prompt_tokens is None and usage.completion_tokens == 9


def test_litellm_style_openai_with_anthropic_cache_keys_reads_as_openai():
    usage = normalize_usage(
        {
            "prompt_tokens": 300,
            "completion_tokens": 10,
            "prompt_tokens_details": {"cached_tokens": 200},
            "cache_read_input_tokens": 200,
            "cache_creation_input_tokens": 0,
        }
    )
    assert (usage.shape, usage.prompt_tokens, usage.cached_tokens) == ("openai", 300, 200)


# LiteLLM v1.80.11, Anthropic behind its OpenAI API (BerriAI/litellm issue 11364, verbatim):
# prompt_tokens = input + cache reads + cache writes (its anthropic/chat/transformation.py).
LITELLM_ANTHROPIC_USAGE = {
    "total_tokens": 103925,
    "prompt_tokens": 98805,
    "completion_tokens": 5120,
    "prompt_tokens_details": {
        "text_tokens": None,
        "audio_tokens": None,
        "image_tokens": None,
        "cached_tokens": 66360,
        "cache_creation_tokens": 32435,
    },
    "cache_read_input_tokens": 66360,
    "completion_tokens_details": {
        "text_tokens": None,
        "audio_tokens": None,
        "image_tokens": None,
        "reasoning_tokens": 1710,
        "accepted_prediction_tokens": None,
        "rejected_prediction_tokens": None,
    },
    "cache_creation_input_tokens": 32435,
}


def test_litellm_anthropic_usage_bills_cache_writes(prices):
    usage = normalize_usage(LITELLM_ANTHROPIC_USAGE)
    assert (usage.shape, usage.prompt_tokens, usage.cached_tokens, usage.cache_write_tokens) == (
        "openai",
        98805,
        66360,
        32435,
    )
    #    10 x 0.000003   = 0.00003   (98805 - 66360 - 32435)
    # 66360 x 0.0000003  = 0.019908
    # 32435 x 0.00000375 = 0.12163125
    #  5120 x 0.000015   = 0.0768
    #                      0.21836925 (writes at the input rate, as before: 0.194043)
    assert compute_cost(usage, prices["anthropic/claude-sonnet-4.5"]).cost_usd == D("0.21836925")


@pytest.mark.parametrize("with_details", [True, False])
def test_litellm_top_level_cache_writes_are_billed_as_writes(prices, with_details):
    """Older LiteLLM reports writes only as a top-level `cache_creation_input_tokens`, inside
    `prompt_tokens`; Open WebUI adds input/output_tokens. Writes were billed at the input rate
    ($0.0255), or, without `prompt_tokens_details`, read as Anthropic's own shape and counted twice."""
    usage = {
        "prompt_tokens": 8000,
        "completion_tokens": 100,
        "total_tokens": 8100,
        "cache_creation_input_tokens": 6000,
        "cache_read_input_tokens": 0,
        "input_tokens": 8000,
        "output_tokens": 100,
    }
    if with_details:
        usage["prompt_tokens_details"] = {"cached_tokens": 0}
    read = normalize_usage(usage)
    assert (read.shape, read.prompt_tokens, read.cached_tokens, read.cache_write_tokens) == ("openai", 8000, 0, 6000)
    # 2000 x 0.000003 + 6000 x 0.00000375 + 100 x 0.000015 = 0.006 + 0.0225 + 0.0015
    assert compute_cost(read, prices["anthropic/claude-sonnet-4.5"]).cost_usd == D("0.03")


# Anthropic's own usage of one call (BerriAI/litellm issue 9812, verbatim; its billing console:
# 12,304 written $0.04614, 550 out $0.00825, $0.05439 in all) as LiteLLM's mid-2025 revision of
# anthropic/chat/transformation.py `calculate_usage` reported it: prompt_tokens = input_tokens +
# cache_read_input_tokens (its writes left out), details with cached_tokens only, both cache keys
# at the top level; Open WebUI adds input/output_tokens.
ANTHROPIC_9812 = {
    "input_tokens": 3,
    "cache_creation_input_tokens": 12304,
    "cache_read_input_tokens": 0,
    "output_tokens": 550,
}
LITELLM_MID_2025_USAGE = {
    "completion_tokens": 550,
    "prompt_tokens": 3,
    "total_tokens": 553,
    "completion_tokens_details": None,
    "prompt_tokens_details": {"audio_tokens": None, "cached_tokens": 0, "text_tokens": None, "image_tokens": None},
    "cache_creation_input_tokens": 12304,
    "cache_read_input_tokens": 0,
}


@pytest.mark.parametrize("open_webui", [False, True])
def test_litellm_usage_that_left_its_cache_writes_out_of_prompt_tokens(prices, open_webui):
    """Before: the 12,304 writes were counted only up to prompt_tokens (3): $0.00826125, 15% of
    what Anthropic billed. Writes above prompt_tokens cannot be inside it: they are added."""
    block = dict(LITELLM_MID_2025_USAGE)
    if open_webui:
        block |= {"input_tokens": 3, "output_tokens": 550}
    usage = normalize_usage(block)
    assert (usage.prompt_tokens, usage.cached_tokens, usage.cache_write_tokens) == (12307, 0, 12304)
    assert (usage.completion_tokens, usage.total_tokens, usage.shape) == (550, 12857, "openai")
    cost = compute_cost(usage, prices["anthropic/claude-sonnet-4.5"])  # Sonnet 3.7's prices
    #  3 x 0.000003 + 12304 x 0.00000375 + 550 x 0.000015 = 0.000009 + 0.04614 + 0.00825
    assert (cost.cost_usd, cost.notes) == (D("0.054399"), ())
    native = compute_cost(normalize_usage(ANTHROPIC_9812), prices["anthropic/claude-sonnet-4.5"])
    assert native.cost_usd == cost.cost_usd  # as Anthropic's own shape reads


def test_litellm_mid_2025_usage_with_reads_costs_what_the_later_revision_says(prices):
    """The call of LITELLM_ANTHROPIC_USAGE (10 in, 66,360 read, 32,435 written) as the mid-2025
    revision reported it: prompt_tokens 66,370. It costs the same as the v1.80.11 block."""
    usage = normalize_usage(
        {
            "completion_tokens": 5120,
            "prompt_tokens": 66370,
            "total_tokens": 71490,
            "prompt_tokens_details": {"cached_tokens": 66360},
            "cache_creation_input_tokens": 32435,
            "cache_read_input_tokens": 66360,
        }
    )
    assert (usage.prompt_tokens, usage.cached_tokens, usage.cache_write_tokens) == (98805, 66360, 32435)
    assert compute_cost(usage, prices["anthropic/claude-sonnet-4.5"]).cost_usd == D("0.21836925")


def test_only_litellm_top_level_writes_are_put_back_into_the_prompt(prices):
    """Writes in prompt_tokens_details are inside prompt_tokens by every revision that sends them
    (OpenRouter's cache_write_tokens, LiteLLM's cache_creation_tokens): more than the prompt
    there is counted up to it, as before."""
    usage = normalize_usage(
        {"prompt_tokens": 3, "completion_tokens": 550, "prompt_tokens_details": {"cache_creation_tokens": 12304}}
    )
    assert (usage.prompt_tokens, usage.cache_write_tokens) == (3, 3)
    assert compute_cost(usage, prices["anthropic/claude-sonnet-4.5"]).notes == ()
    over = normalize_usage({"prompt_tokens": 100, "completion_tokens": 5, "cache_read_input_tokens": 300})
    assert (over.prompt_tokens, over.cached_tokens) == (100, 100)  # reads are always inside: no writes to add


def test_litellm_one_hour_cache_writes(prices):
    usage = normalize_usage(
        {
            "prompt_tokens": 12_100,
            "completion_tokens": 100,
            "prompt_tokens_details": {
                "cached_tokens": 0,
                "cache_creation_tokens": 12_000,
                "cache_creation_token_details": {
                    "ephemeral_5m_input_tokens": 2_000,
                    "ephemeral_1h_input_tokens": 10_000,
                },
            },
            "cache_creation_input_tokens": 12_000,
        }
    )
    assert (usage.cache_write_tokens, usage.cache_write_1h_tokens) == (12_000, 10_000)
    # the same sum as Anthropic's own shape: 0.0003 + 0.0075 + 0.06 + 0.0015
    assert compute_cost(usage, prices["anthropic/claude-sonnet-4.5"]).cost_usd == D("0.0693")


def test_gemini_openai_compat_bills_thinking_as_output():
    usage = normalize_usage({"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 320})
    # output = max(20, 320 - 100) = 220; thinking = 200
    assert (usage.shape, usage.completion_tokens, usage.reasoning_tokens) == ("gemini", 220, 200)


def test_gemini_native_usage_metadata():
    usage = normalize_usage(
        {
            "promptTokenCount": 500,
            "candidatesTokenCount": 100,
            "thoughtsTokenCount": 50,
            "totalTokenCount": 650,
            "cachedContentTokenCount": 200,
        }
    )
    assert usage == Usage(500, 150, cached_tokens=200, reasoning_tokens=50, total_tokens=650, shape="gemini_native")


def test_openai_responses_api():
    usage = normalize_usage(
        {
            "input_tokens": 1000,
            "output_tokens": 300,
            "total_tokens": 1300,
            "input_tokens_details": {"cached_tokens": 600},
            "output_tokens_details": {"reasoning_tokens": 200},
        }
    )
    assert usage == Usage(
        1000, 300, cached_tokens=600, reasoning_tokens=200, total_tokens=1300, shape="openai_responses"
    )


def test_ollama_raw_counts():
    usage = read_usage(
        _msg(
            {
                "prompt_eval_count": 26,
                "eval_count": 290,
                "total_duration": 5_000_000_000,
                "prompt_eval_duration": 130_000_000,
                "eval_duration": 4_700_000_000,
            }
        )
    )
    assert usage == Usage(26, 290, total_tokens=316, shape="ollama")


def test_ollama_missing_prompt_eval_count_is_unknown_not_zero():
    assert normalize_usage({"eval_count": 290}).prompt_tokens is None
    # Open WebUI's conversion writes 0 for the missing count (and copies it to input_tokens)
    converted = normalize_usage(
        {
            "prompt_eval_count": 0,
            "eval_count": 290,
            "input_tokens": 0,
            "output_tokens": 290,
            "prompt_tokens": 0,
            "completion_tokens": 290,
            "total_tokens": 290,
        }
    )
    assert (converted.prompt_tokens, converted.completion_tokens, converted.total_tokens) == (None, 290, None)


def test_open_webui_tool_loop_bills_the_sums():
    # Open WebUI sums input/output/total_tokens (and detail maps) over the provider calls of a
    # tool loop; prompt_tokens / completion_tokens are the last call's.
    usage = read_usage(
        _msg(
            {
                "prompt_tokens": 1500,
                "completion_tokens": 80,
                "input_tokens": 2700,
                "output_tokens": 200,
                "total_tokens": 2900,
                "prompt_tokens_details": {"cached_tokens": 1024},
            }
        )
    )
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (2700, 200, 2900)
    assert usage.calls_summed and usage.reasoning_tokens is None  # 2900 - 2700 = 200: no gap
    single = normalize_usage(
        {"prompt_tokens": 10, "completion_tokens": 2, "input_tokens": 10, "output_tokens": 2, "total_tokens": 12}
    )
    assert not single.calls_summed and single.shape == "openai"


def test_open_webui_only_keys():
    usage = normalize_usage({"input_tokens": 40, "output_tokens": 8, "total_tokens": 48})
    assert (usage.shape, usage.prompt_tokens, usage.completion_tokens) == ("open_webui", 40, 8)


# ---- cost (every expected value worked out by hand in the comment) ----------------------


def test_cost_plain(prices):
    cost = compute_cost(Usage(1234, 456), prices["openai/gpt-4o"])
    # 1234 x 0.0000025 = 0.003085
    #  456 x 0.00001   = 0.00456
    #                    0.007645
    assert cost == Cost(D("0.007645"), "price_table")


def test_cost_with_cached_tokens(prices):
    cost = compute_cost(Usage(2000, 100, cached_tokens=1536), prices["openai/gpt-4o"])
    # (2000 - 1536) = 464 x 0.0000025  = 0.00116
    #          1536 x 0.00000125        = 0.00192
    #           100 x 0.00001           = 0.001
    #                                     0.00408
    assert cost.cost_usd == D("0.00408")


def test_cost_anthropic_cache_read_and_write(prices):
    usage = normalize_usage(
        {
            "input_tokens": 50,
            "cache_read_input_tokens": 10000,
            "cache_creation_input_tokens": 2000,
            "output_tokens": 500,
        }
    )
    cost = compute_cost(usage, prices["anthropic/claude-sonnet-4.5"])
    #    50 x 0.000003    = 0.00015
    # 10000 x 0.0000003   = 0.003
    #  2000 x 0.00000375  = 0.0075
    #   500 x 0.000015    = 0.0075
    #                       0.01815
    assert (cost.cost_usd, cost.tier) == (D("0.01815"), 0)


def test_cost_anthropic_long_prompt_tier(prices):
    usage = normalize_usage(
        {
            "input_tokens": 150000,
            "cache_read_input_tokens": 60000,
            "cache_creation_input_tokens": 0,
            "output_tokens": 1000,
        }
    )
    cost = compute_cost(usage, prices["anthropic/claude-sonnet-4.5"])
    # prompt 210000 >= 200000: tier prices 0.000006 / 0.0000006 / 0.0000225
    # 150000 x 0.000006   = 0.9
    #  60000 x 0.0000006  = 0.036
    #   1000 x 0.0000225  = 0.0225
    #                       0.9585
    assert (cost.cost_usd, cost.tier) == (D("0.9585"), 200000)


def test_cost_anthropic_one_hour_cache_writes(prices):
    """Anthropic splits its cache writes by time to live: those kept an hour cost the model's
    `cache_write_1h` rate (claude-sonnet-4.5: $6 a million, 5 minutes $3.75; they were once all
    billed at the 5-minute rate)."""
    usage = normalize_usage(
        {
            "input_tokens": 100,
            "cache_creation_input_tokens": 12_000,
            "cache_creation": {"ephemeral_5m_input_tokens": 2_000, "ephemeral_1h_input_tokens": 10_000},
            "output_tokens": 100,
        }
    )
    assert usage is not None and (usage.cache_write_tokens, usage.cache_write_1h_tokens) == (12_000, 10_000)
    # 100 x 0.000003 + 2000 x 0.00000375 + 10000 x 0.000006 + 100 x 0.000015
    # = 0.0003 + 0.0075 + 0.06 + 0.0015 = 0.0693
    assert compute_cost(usage, prices["anthropic/claude-sonnet-4.5"]).cost_usd == D("0.0693")


def test_cost_tier_boundary(prices):
    gemini = prices["google/gemini-2.5-pro"]
    below = compute_cost(Usage(199_999, 1000), gemini)
    # 199999 x 0.00000125 = 0.24999875 ; 1000 x 0.00001 = 0.01 ; sum 0.25999875
    assert (below.cost_usd, below.tier) == (D("0.25999875"), 0)
    above = compute_cost(Usage(250_000, 1000), gemini)
    # 250000 x 0.0000025 = 0.625 ; 1000 x 0.000015 = 0.015 ; sum 0.64
    assert (above.cost_usd, above.tier) == (D("0.64"), 200000)


def test_a_tool_loop_is_priced_at_its_calls_tier_not_its_sums(prices):
    """Three calls of an 80,000-token prompt: their sum (240,000) reaches Gemini 2.5 Pro's
    200,000 tier, none of the calls did (the sum once picked the tier: $0.6225)."""
    summed = {"prompt_tokens": 80_000, "completion_tokens": 500, "input_tokens": 240_000, "output_tokens": 1_500}
    usage = normalize_usage({**summed, "total_tokens": 241_500})
    cost = compute_cost(usage, prices["google/gemini-2.5-pro"])
    # 240000 x 0.00000125 = 0.3 ; 1500 x 0.00001 = 0.015 ; sum 0.315
    assert (cost.cost_usd, cost.tier) == (D("0.315"), 0)


def test_cost_second_tier(prices):
    cost = compute_cost(Usage(300_000, 2000, cached_tokens=100_000), prices["qwen/qwen3.7-flash"])
    # tier 256000: prompt 0.0000002, cache read 0.00000004, completion 0.0000008
    # 200000 x 0.0000002   = 0.04
    # 100000 x 0.00000004  = 0.004
    #   2000 x 0.0000008   = 0.0016
    #                        0.0456
    assert (cost.cost_usd, cost.tier) == (D("0.0456"), 256000)


def test_cost_gemini_thinking(prices):
    usage = normalize_usage({"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 320})
    cost = compute_cost(usage, prices["google/gemini-2.5-pro"])
    # 100 x 0.00000125 = 0.000125 ; (320 - 100) = 220 x 0.00001 = 0.0022 ; sum 0.002325
    assert cost.cost_usd == D("0.002325")


def test_cost_reasoning_not_double_counted(prices):
    cost = compute_cost(Usage(1000, 500, reasoning_tokens=400), prices["openai/o3-mini"])
    # reasoning is inside completion: 1000 x 0.0000011 = 0.0011 ; 500 x 0.0000044 = 0.0022
    assert cost.cost_usd == D("0.0033")


def test_cost_separate_reasoning_rate(prices):
    cost = compute_cost(Usage(100, 1000, reasoning_tokens=600), prices["perplexity/sonar-deep-research"])
    # 100 x 0.000002            = 0.0002
    # (1000 - 600) = 400 x 0.000008 = 0.0032
    # 600 x 0.000003 (internal_reasoning) = 0.0018
    #                              0.0052
    assert cost.cost_usd == D("0.0052")


def test_zero_internal_reasoning_rate_means_billed_as_completion():
    price = ModelPrice(D("0.000001"), D("0.000004"), internal_reasoning=D(0))
    # 10 x 0.000001 = 0.00001 ; 50 x 0.000004 = 0.0002 (reasoning not free) ; sum 0.00021
    assert compute_cost(Usage(10, 50, reasoning_tokens=30), price).cost_usd == D("0.00021")


def test_cost_long_decimal_cache_write_price(prices):
    usage = Usage(20000, 10, cached_tokens=0, cache_write_tokens=12345)
    cost = compute_cost(usage, prices["google/gemini-3.7-flash"])
    # (20000 - 12345) = 7655 x 0.000000375   = 0.002870625
    # 12345 x 0.0000000208333333333333       = 0.0002571874999999995885
    #   (208333333333333 x 12345 = 2571874999999995885, 22 decimals)
    # 10 x 0.000001875                       = 0.00001875
    #                                          0.0031465624999999995885
    assert cost.cost_usd == D("0.0031465624999999995885")


def test_cost_responses_and_gemini_native(prices):
    responses = normalize_usage(
        {
            "input_tokens": 1000,
            "output_tokens": 300,
            "input_tokens_details": {"cached_tokens": 600},
            "output_tokens_details": {"reasoning_tokens": 200},
        }
    )
    # 400 x 0.000002 = 0.0008 ; 600 x 0.0000005 = 0.0003 ; 300 x 0.000008 = 0.0024 ; sum 0.0035
    assert compute_cost(responses, prices["openai/gpt-4.1"]).cost_usd == D("0.0035")
    native = normalize_usage(
        {"promptTokenCount": 500, "candidatesTokenCount": 100, "thoughtsTokenCount": 50, "cachedContentTokenCount": 200}
    )
    # 300 x 0.00000125 = 0.000375 ; 200 x 0.000000125 = 0.000025 ; 150 x 0.00001 = 0.0015
    # sum 0.0019
    assert compute_cost(native, prices["google/gemini-2.5-pro"]).cost_usd == D("0.0019")


def test_cost_tool_loop_uses_sums(prices):
    usage = normalize_usage(
        {
            "prompt_tokens": 1500,
            "completion_tokens": 80,
            "input_tokens": 2700,
            "output_tokens": 200,
            "total_tokens": 2900,
            "prompt_tokens_details": {"cached_tokens": 1024},
        }
    )
    cost = compute_cost(usage, prices["openai/gpt-4o-mini"])
    # (2700 - 1024) = 1676 x 0.00000015 = 0.0002514
    #          1024 x 0.000000075       = 0.0000768
    #           200 x 0.0000006         = 0.00012
    #                                     0.0004482
    assert cost.cost_usd == D("0.0004482")


def test_provider_cost_wins(prices):
    usage = normalize_usage({"prompt_tokens": 194, "completion_tokens": 2, "cost": 0.00123})
    assert compute_cost(usage, prices["openai/gpt-4o"]) == Cost(D("0.00123"), "provider")
    assert compute_cost(usage, None) == Cost(D("0.00123"), "provider")
    free = normalize_usage({"prompt_tokens": 5, "completion_tokens": 5, "cost": 0})
    assert compute_cost(free, prices["openai/gpt-4o"]) == Cost(D(0), "provider")


def test_a_tool_loop_s_provider_cost_is_its_sum(prices):
    """Open WebUI 0.12.4 (`utils/response.merge_usage`) sums a tool loop's token counts, its
    detail maps and the provider's cost keys (`cost` among them) over the calls; only
    `prompt_tokens` / `completion_tokens` are the last call's. The summed cost is the reply's
    (a4ed6e3 took it for the last call's and priced the sums instead: reverted)."""
    calls = [{"prompt_tokens": 1000, "completion_tokens": 20, "cost": 0.0027}]
    calls += [{"prompt_tokens": 1100, "completion_tokens": 200, "cost": 0.00475}]
    summed = {**calls[-1], "input_tokens": 2100, "output_tokens": 220, "total_tokens": 2320, "cost": 0.00745}
    usage = normalize_usage(summed)
    assert usage is not None and usage.calls_summed and (usage.prompt_tokens, usage.completion_tokens) == (2100, 220)
    assert compute_cost(usage, prices["openai/gpt-4o"]) == Cost(D("0.00745"), "provider")


def test_negative_provider_cost_falls_back_to_the_price_table(prices):
    usage = normalize_usage({"prompt_tokens": 1000, "completion_tokens": 0, "cost": -1})
    # 1000 x 0.0000025 = 0.0025
    assert compute_cost(usage, prices["openai/gpt-4o"]) == Cost(D("0.0025"), "price_table")


def test_unknown_cost_is_none_with_a_reason(prices):
    assert compute_cost(None, prices["openai/gpt-4o"]).reason == "the backend reported no usage"
    no_price = compute_cost(Usage(10, 10), None)
    assert (no_price.cost_usd, no_price.cost_source, no_price.reason) == (None, None, "no price for this model")
    dynamic = compute_cost(Usage(10, 10), prices["openrouter/auto"])
    assert (dynamic.cost_usd, dynamic.reason) == (None, "prompt price unknown")
    no_read_price = ModelPrice(D("0.000001"), D("0.000002"), cache_read=None)
    assert compute_cost(Usage(10, 1, cached_tokens=5), no_read_price).reason == "cache read price unknown"
    assert compute_cost(Usage(10, 1, cached_tokens=0), no_read_price).cost_usd == D("0.000012")
    unknown_prompt = compute_cost(normalize_usage({"eval_count": 9}), prices["openai/gpt-4o"])
    assert (unknown_prompt.cost_usd, unknown_prompt.reason) == (None, "prompt token count unknown")


def test_free_model_costs_zero_even_with_unknown_counts():
    assert compute_cost(normalize_usage({"eval_count": 9}), FREE_PRICE) == Cost(D(0), "price_table")


def test_cost_notes(prices):
    timed = compute_cost(Usage(1000, 0), prices["deepseek/deepseek-v4-pro-0813"])
    # 1000 x 0.00000066 = 0.00066 (base window price)
    assert timed.cost_usd == D("0.00066") and "time of day" in timed.notes[0]
    odd = compute_cost(Usage(100, 0, cached_tokens=150), prices["openai/gpt-4o"])
    # cached counted up to the 100-token prompt (never billed beyond it): 100 x 0.00000125 = 0.000125
    assert odd.cost_usd == D("0.000125") and "exceed" in odd.notes[0]


_counts = st.one_of(st.none(), st.integers(min_value=0, max_value=3_000_000))
_rates = st.one_of(st.none(), st.decimals(min_value=0, max_value=1, places=12, allow_nan=False))


@given(
    prompt=_counts,
    completion=_counts,
    cached=_counts,
    written=_counts,
    reasoning=_counts,
    rates=st.tuples(_rates, _rates, _rates, _rates, _rates),
    threshold=st.integers(1, 2_000_000),
)
def test_cost_is_never_negative_and_unknown_is_never_zero(
    prompt, completion, cached, written, reasoning, rates, threshold
):
    tier = PriceTier(threshold, *rates[:4])
    price = ModelPrice(rates[0], rates[1], rates[2], rates[3], internal_reasoning=rates[4], tiers=(tier,))
    cost = compute_cost(Usage(prompt, completion, cached, written, reasoning), price)
    if cost.cost_usd is None:
        assert cost.reason and cost.cost_source is None
    else:
        assert cost.cost_usd >= 0 and cost.cost_source == "price_table"
