"""Price book, model resolution, alias parsing, the generator, and live OpenRouter prices."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
from decimal import Decimal

import httpx
import pytest
import respx

from contextwarden.errors import ConfigError, PricingError
from contextwarden.money.live_prices import DEFAULT_OPENROUTER_URL, LivePrices, fetch_openrouter_prices
from contextwarden.money.pricing import (
    FREE_PRICE,
    ModelPrice,
    PriceBook,
    PriceTier,
    parse_aliases,
    parse_model_globs,
    resolve_model,
)

from shared_paths import REPO_ROOT, fixture_path, load_fixture

FULL_DUMP = "openrouter_models_2026-08.json"
SAMPLE_2026 = "openrouter_models_sample.json"
SAMPLE_2025 = "openrouter_models_sample_2025_schema.json"
D = Decimal


@pytest.fixture(scope="module")
def book() -> PriceBook:
    return PriceBook.from_bundled()


@pytest.fixture(scope="module")
def full_payload() -> dict:
    return load_fixture(FULL_DUMP)


def _payload(*entries: dict) -> dict:
    return {"data": list(entries)}


def _entry(model_id: str, **pricing: object) -> dict:
    return {"id": model_id, "canonical_slug": model_id, "context_length": 1000, "pricing": pricing}


# ---- the generator and the three ways to load prices -------------------------------------


def test_generated_files_are_fresh():
    spec = importlib.util.spec_from_file_location("make_pricing", REPO_ROOT / "build" / "make_pricing.py")
    make_pricing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_pricing)
    argv = [str(fixture_path(FULL_DUMP)), "--source-date", "2026-08-19", "--check"]
    assert make_pricing.main(argv) == 0, "run: python build/make_pricing.py --source-date 2026-08-19"


def test_bundled_file_and_payload_agree(book, full_payload):
    from_payload = PriceBook.from_openrouter(full_payload)
    from_file = PriceBook.from_file(REPO_ROOT / "pricing.json")
    assert len(book.prices) == len(full_payload["data"]) == 414
    assert dict(from_payload.prices) == dict(book.prices)
    assert dict(from_file.prices) == dict(book.prices)
    assert book.source_date == from_file.source_date == "2026-08-19"


def test_pricing_json_is_sorted_and_has_no_negative_price():
    text = (REPO_ROOT / "pricing.json").read_text(encoding="utf-8")
    document = json.loads(text)
    assert text == json.dumps(document, indent=2, sort_keys=True) + "\n"
    for record in document["models"].values():
        for name in ("prompt", "completion", "cache_read", "cache_write", "cache_write_1h"):
            assert record[name] is None or D(record[name]) >= 0


def test_2026_shape_missing_keys_are_zero(book):
    gpt4o = book.prices["openai/gpt-4o"]
    assert (gpt4o.prompt, gpt4o.completion, gpt4o.cache_read) == (D("0.0000025"), D("0.00001"), D("0.00000125"))
    assert gpt4o.cache_write == D(0)  # key left out by the 2026 API = 0
    assert gpt4o.cache_write_1h is None  # not listed
    assert gpt4o.internal_reasoning is None
    assert gpt4o.context_length == 128000


def test_2026_sample_reads_the_same_as_the_full_dump(book):
    sample = PriceBook.from_openrouter(load_fixture(SAMPLE_2026))
    assert len(sample.prices) == 16
    for model_id, price in sample.prices.items():
        assert price == book.prices[model_id]


def test_2025_shape():
    old = PriceBook.from_openrouter(load_fixture(SAMPLE_2025))
    sonnet = old.prices["anthropic/claude-3.5-sonnet"]
    assert sonnet == ModelPrice(
        prompt=D("0.000003"),
        completion=D("0.000015"),
        cache_read=D("0.0000003"),
        cache_write=D("0.00000375"),
        cache_write_1h=None,
        internal_reasoning=None,  # "0" = no own rate
        context_length=200000,
        canonical_slug=None,
    )
    assert old.prices["meta-llama/llama-3.1-8b-instruct"].prompt == D("0.00000002")
    assert "anthropic/claude-3.7-sonnet:thinking" in old.prices


def test_router_models_have_unknown_prices_not_negative(book):
    auto = book.prices["openrouter/auto"]
    assert auto.prompt is None and auto.completion is None


@pytest.mark.parametrize("bad", ["-1", "-0.000001", "abc", "", "NaN", "Infinity", None, True, [], {}])
def test_negative_or_malformed_price_is_unknown(bad):
    parsed = PriceBook.from_openrouter(
        _payload(
            _entry(
                "x/m",
                prompt=bad,
                completion="0.000002",
                input_cache_read=bad,
                overrides=[{"min_prompt_tokens": 100, "prompt": bad, "completion": "-5"}],
            )
        )
    )
    price = parsed.prices["x/m"]
    assert price.prompt is None and price.cache_read is None
    assert price.completion == D("0.000002")
    assert price.tiers == (PriceTier(100, None, None, None, D(0), None),)


def test_internal_reasoning_kept_only_as_a_separate_rate(book):
    assert book.prices["perplexity/sonar-deep-research"].internal_reasoning == D("0.000003")
    assert book.prices["google/gemini-2.5-pro"].internal_reasoning is None  # equals completion


@pytest.mark.parametrize("payload", [None, [], {}, {"data": "x"}, {"data": []}, {"data": [{"id": 3}]}])
def test_unusable_payload_raises(payload):
    with pytest.raises(PricingError):
        PriceBook.from_openrouter(payload)


def test_bad_price_files_raise(tmp_path):
    with pytest.raises(PricingError, match="cannot read"):
        PriceBook.from_file(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{nope", encoding="utf-8")
    with pytest.raises(PricingError, match="not valid JSON"):
        PriceBook.from_file(tmp_path / "bad.json")
    with pytest.raises(PricingError, match="'models'"):
        PriceBook.from_json("[]")


def test_admin_file_missing_prices_are_unknown_and_tiers_inherit():
    admin = PriceBook.from_json(
        json.dumps(
            {
                "models": {
                    "local/m": {
                        "prompt": "0.000001",
                        "completion": "0.000002",
                        "tiers": [{"min_prompt_tokens": 1000, "prompt": "0.000003"}],
                    }
                }
            }
        )
    )
    price = admin.prices["local/m"]
    assert price.cache_read is None and price.cache_write is None
    assert price.tiers == (PriceTier(1000, D("0.000003"), D("0.000002"), None, None, None),)


@pytest.mark.parametrize("tiers", [7, "abc", [3, {"min_prompt_tokens": -1}, {"prompt": "1"}]])
def test_admin_file_malformed_tiers_are_ignored(tiers):
    admin = PriceBook.from_json(json.dumps({"models": {"m": {"prompt": "1", "tiers": tiers}}}))
    assert admin.prices["m"].tiers == ()


def test_round_trip_and_layering(book):
    again = PriceBook.from_json(book.to_json())
    assert dict(again.prices) == dict(book.prices)
    top = PriceBook({"openai/gpt-4o": FREE_PRICE, "local/x": FREE_PRICE}, source="admin")
    layered = book.layered(top)
    assert layered.prices["openai/gpt-4o"] == FREE_PRICE
    assert layered.prices["openai/gpt-4.1"] == book.prices["openai/gpt-4.1"]
    assert "local/x" in layered.prices and layered.source == "admin+bundled"


def test_a_live_entry_it_cannot_read_does_not_hide_a_bundled_price(book):
    """A live OpenRouter entry whose prices are unreadable (NaN, "-1", missing) leaves the bundled
    price in place (it once replaced it: gpt-4o unpriced, its replies outside dollar limits)."""
    for bad in ({"prompt": "NaN", "completion": "0.00001"}, {"prompt": "-1", "completion": "-1"}, {}):
        live = PriceBook.from_openrouter({"data": [{"id": "openai/gpt-4o", "pricing": bad}]})
        assert book.layered(live).prices["openai/gpt-4o"] == book.prices["openai/gpt-4o"]
    pricing = {"prompt": "0.000003", "completion": "0.000012"}
    good = PriceBook.from_openrouter({"data": [{"id": "openai/gpt-4o", "pricing": pricing}]})
    assert book.layered(good).prices["openai/gpt-4o"].prompt == D("0.000003")


# ---- prompt-size tiers ----------------------------------------------------------------------


def test_tiers_from_overrides(book):
    gemini = book.prices["google/gemini-2.5-pro"]
    assert gemini.rates_for(199_999).prompt == D("0.00000125")
    top = gemini.rates_for(200_000)
    assert (top.min_prompt_tokens, top.prompt, top.completion) == (200_000, D("0.0000025"), D("0.000015"))
    assert top.cache_read == D("0.00000025")
    assert top.cache_write == D("0.000000375")  # not in the override: inherited from the base
    assert gemini.rates_for(None).min_prompt_tokens == 0


def test_two_tiers_pick_the_highest_reached(book):
    qwen = book.prices["qwen/qwen3.7-flash"]
    assert [t.min_prompt_tokens for t in qwen.tiers] == [32000, 256000]
    assert qwen.rates_for(31_999).prompt == D("0.00000003")
    assert qwen.rates_for(32_000).prompt == D("0.0000001")
    assert qwen.rates_for(300_000).prompt == D("0.0000002")


def test_time_of_day_overrides_are_flagged_not_tiers(book):
    deepseek = book.prices["deepseek/deepseek-v4-pro-0813"]
    assert deepseek.varies_by_time and deepseek.tiers == ()
    assert deepseek.prompt == D("0.00000066")


# ---- model resolution ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model_id", "kwargs", "expected", "step"),
    [
        ("gpt-4.1", {}, "openai/gpt-4.1", "bare"),  # never split on the dot into "1"
        ("gemini-2.5-pro", {}, "google/gemini-2.5-pro", "bare"),
        (
            "openrouter.anthropic/claude-sonnet-4.5",
            {"prefixes": ("openrouter",)},
            "anthropic/claude-sonnet-4.5",
            "exact",
        ),
        ("openrouter.anthropic/claude-sonnet-4.5", {}, "anthropic/claude-sonnet-4.5", "exact"),
        ("anthropic/claude-sonnet-4.5:thinking", {}, "anthropic/claude-sonnet-4.5", "variant"),
        ("gpt-4o-2024-08-06", {}, "openai/gpt-4o-2024-08-06", "bare"),
        ("openai/gpt-4o:nitro", {}, "openai/gpt-4o", "variant"),
        ("openai/gpt-4o:batch", {}, "openai/gpt-4o:batch", "exact"),  # listed variants are priced apart
        ("openai/gpt-4o", {}, "openai/gpt-4o", "exact"),
        ("OpenAI/GPT-4o", {}, "openai/gpt-4o", "exact"),
        ("anthropic/claude-4.5-sonnet-20250929", {}, "anthropic/claude-sonnet-4.5", "canonical_slug"),
        ("gpt-4.1-2025-04-14", {}, "openai/gpt-4.1", "bare"),  # bare canonical slug
        ("gpt-4o-2099-01-01", {}, "openai/gpt-4o", "date_suffix"),
        ("claude-sonnet-4-5-20250929", {}, "anthropic/claude-sonnet-4.5", "dots_dashes"),
        ("claude-opus-4-1-20250805", {}, "anthropic/claude-opus-4.1", "dots_dashes"),
        ("azure.gpt-4.1", {"prefixes": ("azure",)}, "openai/gpt-4.1", "bare"),
        ("my.conn.openai/gpt-4o", {}, "openai/gpt-4o", "exact"),
    ],
)
def test_resolves(book, model_id, kwargs, expected, step):
    resolution = resolve_model(model_id, book, **kwargs)
    assert (resolution.model_id, resolution.step) == (expected, step), resolution.reason
    assert resolution.price == book.prices[expected]


def test_prefix_is_reported(book):
    assert resolve_model("openrouter.anthropic/claude-sonnet-4.5", book).prefix == "openrouter"
    assert resolve_model("gpt-4.1", book).prefix is None


@pytest.mark.parametrize(
    "model_id",
    [
        "codex-auto-review",  # must not be priced as openrouter/auto by substring
        "azure.gpt-4.1",  # no configured prefix: the dot is not split blindly
        "gpt-4.1.1",
        "llama3.1:8b",
        "deepseek-r1:7b",  # Ollama tags: local models, not the API models of the same name
        "deepseek-r1:latest",
        "qwen3-coder:30b",
        "kimi-k2:latest",
        "",
        "   ",
    ],
)
def test_does_not_resolve(book, model_id):
    resolution = resolve_model(model_id, book)
    assert resolution.model_id is None and resolution.price is None
    assert resolution.reason


def test_local_models_cost_zero_only_when_configured(book):
    unpriced = resolve_model("llama3.1:8b", book)
    assert "free_models" in unpriced.reason and "Ollama" in unpriced.reason
    free = resolve_model("llama3.1:8b", book, free_models=parse_model_globs("qwen*, llama3*"))
    assert (free.model_id, free.step, free.price) == ("llama3.1:8b", "free", FREE_PRICE)
    prefixed = resolve_model("ollama.llama3.1:8b", book, prefixes=("ollama",), free_models=("llama*",))
    assert (prefixed.step, prefixed.prefix) == ("free", "ollama")


def test_aliases_come_first_exact_then_globs(book):
    aliases = parse_aliases(
        '{"gpt-4.1": "openai/gpt-4o", "team-*": "anthropic/claude-sonnet-4.5", "*": "openai/gpt-4o-mini"}'
    )
    assert resolve_model("gpt-4.1", book, aliases=aliases).model_id == "openai/gpt-4o"
    team = resolve_model("team-writer", book, aliases=aliases)
    assert (team.model_id, team.step) == ("anthropic/claude-sonnet-4.5", "alias")
    assert resolve_model("anything", book, aliases=aliases).model_id == "openai/gpt-4o-mini"


def test_many_glob_aliases_are_compiled_once_and_keep_fnmatch_order(book, monkeypatch):
    """Past fnmatch's own cache (32,768 patterns) every request used to compile them all again
    (4 s a request at 34,000): the matcher is compiled once per valve value."""
    import fnmatch

    import contextwarden.money.pricing as pricing

    aliases = {f"team-{i}-*": "openai/gpt-4o" for i in range(34_000)}
    aliases |= {"team-7-exact": "anthropic/claude-sonnet-4.5", "team-[7]-?x": "openai/gpt-4o-mini"}
    compiled = []
    real = pricing._glob_matcher
    monkeypatch.setattr(pricing, "_glob_matcher", lambda patterns: compiled.append(1) or real(patterns))
    for _ in range(3):
        assert resolve_model("team-7-exact", book, aliases=aliases).model_id == "anthropic/claude-sonnet-4.5"
        assert resolve_model("team-33999-a", book, aliases=aliases).model_id == "openai/gpt-4o"
        assert resolve_model("nobody", book, aliases=aliases).model_id is None
    assert len(compiled) == 1
    patterns = ("a*", "ab?", "[ab]c", "abc")
    for name in ("abc", "abd", "bc", "zzz", "a"):
        expected = name if name in patterns else next((p for p in patterns if fnmatch.fnmatchcase(name, p)), None)
        assert pricing._model_glob_match(name, patterns) == expected


def test_alias_target_goes_through_the_chain(book):
    resolution = resolve_model("house-model", book, aliases={"house-model": "claude-sonnet-4.5"})
    assert (resolution.model_id, resolution.step) == ("anthropic/claude-sonnet-4.5", "alias")


def test_alias_to_unknown_target_is_unresolved_with_reason(book):
    resolution = resolve_model("x", book, aliases={"x": "nope/nothing"})
    assert resolution.model_id is None
    assert "model_aliases" in resolution.reason and "nope/nothing" in resolution.reason


def test_ambiguous_step_is_not_accepted():
    price = ModelPrice(D(1), D(1))
    book = PriceBook({"a/shared-name": price, "b/shared-name": price, "c/other": price}, source="t")
    resolution = resolve_model("shared-name", book)
    assert resolution.model_id is None
    assert "ambiguous" in resolution.reason and "a/shared-name" in resolution.reason


def test_variants_are_never_fuzzy_matched():
    book = PriceBook({"x/solo:free": FREE_PRICE}, source="t")
    assert resolve_model("solo", book).model_id is None
    assert resolve_model("x/solo:free", book).model_id == "x/solo:free"


# ---- valve parsing -------------------------------------------------------------------------


def test_parse_aliases_valid_and_empty():
    assert parse_aliases(' {"a": " openai/gpt-4o "} ') == {"a": "openai/gpt-4o"}
    assert parse_aliases("") == {} and parse_aliases("  \n") == {}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not valid JSON"),
        ('["openai/gpt-4o"]', "JSON list"),
        ('"openai/gpt-4o"', "JSON str"),
        ('{"a": 3}', "must be a model id string"),
        ('{"a": ""}', "must be a model id string"),
        ('{"a": null}', "must be a model id string"),
        ('{" ": "openai/gpt-4o"}', "empty model id"),
    ],
)
def test_parse_aliases_errors_name_the_valve(text, message):
    with pytest.raises(ConfigError, match=message) as caught:
        parse_aliases(text)
    assert caught.value.valve == "model_aliases"


def test_parse_model_globs():
    assert parse_model_globs("llama*, qwen3:*\n\n ollama.* ,") == ("llama*", "qwen3:*", "ollama.*")
    assert parse_model_globs("") == ()


# ---- live prices (respx) -------------------------------------------------------------------


@respx.mock
async def test_fetch_success_with_fixture_payload(full_payload):
    respx.get(DEFAULT_OPENROUTER_URL).mock(return_value=httpx.Response(200, json=full_payload))
    async with httpx.AsyncClient() as client:
        live = await fetch_openrouter_prices(client)
    assert len(live.prices) == 414 and live.source == "openrouter" and live.fetched_at
    assert dict(live.prices) == dict(PriceBook.from_bundled().prices)


@respx.mock
async def test_fetch_reads_negative_prices_as_unknown():
    payload = _payload(
        _entry("openrouter/auto", prompt="-1", completion="-1"), _entry("x/m", prompt="0.000001", completion="0.000002")
    )
    respx.get(DEFAULT_OPENROUTER_URL).mock(return_value=httpx.Response(200, json=payload))
    async with httpx.AsyncClient() as client:
        live = await fetch_openrouter_prices(client)
    assert live.prices["openrouter/auto"].prompt is None
    assert live.prices["x/m"].completion == D("0.000002")


@pytest.mark.parametrize(
    ("response", "message"),
    [
        (httpx.ReadTimeout("slow"), "no answer within"),
        (httpx.ConnectError("refused"), "ConnectError"),
        (httpx.Response(500, text="oops"), "HTTP 500"),
        (httpx.Response(200, text="<html>not json"), "not JSON"),
        (httpx.Response(200, json={"models": []}), "'data' list"),
    ],
)
@respx.mock
async def test_fetch_failures_raise_pricing_error(response, message):
    route = respx.get(DEFAULT_OPENROUTER_URL)
    if isinstance(response, Exception):
        route.mock(side_effect=response)
    else:
        route.mock(return_value=response)
    async with httpx.AsyncClient() as client:
        with pytest.raises(PricingError, match=message):
            await fetch_openrouter_prices(client, timeout=0.5)


class _Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@respx.mock
async def test_live_prices_refresh_once_at_a_time(full_payload):
    route = respx.get(DEFAULT_OPENROUTER_URL).mock(return_value=httpx.Response(200, json=full_payload))
    clock = _Clock()
    fallback = PriceBook({"x/m": FREE_PRICE}, source="fallback")
    live = LivePrices(fallback, ttl_hours=1, clock=clock)
    assert live.is_stale() and live.book is fallback
    first = live.refresh_in_background()
    assert first is not None
    assert live.refresh_in_background() is None  # one refresh at a time
    await first
    assert route.call_count == 1 and live.book.source == "openrouter" and len(live.book.prices) == 414
    clock.now = live.book.fetched_at + 10  # fetched_at is wall time from the fetch
    assert not live.is_stale() and live.refresh_in_background() is None
    clock.now += 3600
    assert live.is_stale()
    await live.refresh_in_background()
    assert route.call_count == 2


@respx.mock
async def test_live_prices_failure_keeps_last_good_book_and_warns_once(caplog, full_payload):
    route = respx.get(DEFAULT_OPENROUTER_URL)
    route.mock(return_value=httpx.Response(200, json=full_payload))
    clock = _Clock()
    live = LivePrices(PriceBook.from_bundled(), ttl_hours=1, retry_seconds=600, clock=clock)
    await live.refresh_in_background()
    good = live.book
    clock.now = good.fetched_at + 7200
    route.mock(return_value=httpx.Response(503))
    with caplog.at_level(logging.WARNING, logger="contextwarden"):
        await live.refresh_in_background()
    assert live.book is good
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "HTTP 503" in warnings[0].getMessage()
    assert live.refresh_in_background() is None  # waits retry_seconds before trying again
    clock.now += 601
    route.mock(return_value=httpx.Response(200, json=full_payload))
    assert live.refresh_in_background() is not None


async def test_live_prices_survive_unexpected_errors(caplog):
    class Broken(httpx.AsyncClient):
        async def send(self, *args, **kwargs):
            raise RuntimeError("secret-token-should-not-appear")

    live = LivePrices(PriceBook.from_bundled(), client=Broken())
    with caplog.at_level(logging.WARNING, logger="contextwarden"):
        await live.refresh_in_background()
    assert live.book.source == "bundled"
    assert "RuntimeError" in caplog.text and "secret-token" not in caplog.text


def test_refresh_without_event_loop_does_nothing():
    assert LivePrices(PriceBook.from_bundled()).refresh_in_background() is None


@respx.mock
async def test_live_prices_shared_table_seam(full_payload):
    route = respx.get(DEFAULT_OPENROUTER_URL).mock(return_value=httpx.Response(200, json=full_payload))
    clock = _Clock()
    stored: list[str] = []

    async def put(text: str) -> None:
        stored.append(text)

    async def get() -> str | None:
        return stored[-1] if stored else None

    worker_a = LivePrices(PriceBook.from_bundled(), clock=clock, shared_get=get, shared_put=put)
    worker_a_book = await worker_a.refresh()
    clock.now = worker_a_book.fetched_at + 60
    assert route.call_count == 1 and len(stored) == 1
    worker_b = LivePrices(PriceBook.from_bundled(), clock=clock, shared_get=get, shared_put=put)
    await worker_b.refresh_in_background()
    assert route.call_count == 1  # took the fresh shared table instead of fetching
    assert dict(worker_b.book.prices) == dict(worker_a_book.prices)


async def test_fetch_has_one_overall_deadline():
    class Trickle(httpx.AsyncClient):
        async def send(self, *args, **kwargs):
            await asyncio.sleep(5)  # e.g. a body dribbling in under every per-read timeout

    with pytest.raises(PricingError, match="no answer within 0.05s"):
        await fetch_openrouter_prices(Trickle(), timeout=0.05)


async def test_background_refresh_does_not_block_the_caller():
    gate = asyncio.Event()

    class Slow(httpx.AsyncClient):
        async def send(self, *args, **kwargs):
            await gate.wait()
            raise httpx.ReadTimeout("late")

    live = LivePrices(PriceBook.from_bundled(), client=Slow())
    task = live.refresh_in_background()
    assert task is not None and not task.done() and live.book.source == "bundled"
    gate.set()
    await task
