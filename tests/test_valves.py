"""Valves: every number has a range pydantic enforces and the description states; values that
reach the filter another way are checked against the same range and named; no status line
carries a valve's value."""

from __future__ import annotations

import pydantic
import pytest

from contextwarden.face.valves import INT_RANGES, MIN_BUDGET_TOKENS, UserValves, Valves, read_settings

from helpers import chat_of, make_filter
from turns import run_turn

NUMERIC = [
    (cls, name)
    for cls in (Valves, UserValves)
    for name, field in cls.model_fields.items()
    if field.annotation in (int, float)
]


@pytest.mark.parametrize(("cls", "name"), NUMERIC, ids=[f"{c.__name__}.{n}" for c, n in NUMERIC])
def test_every_numeric_valve_is_bounded_both_ways_and_says_so(cls, name):
    field = cls.model_fields[name]
    bounds = {type(m).__name__: m for m in field.metadata}
    assert {"Ge", "Gt"} & bounds.keys() and "Le" in bounds, (name, field.metadata)
    high = bounds["Le"].le
    assert any(f"{form}" in field.description for form in (f"{high:,}", f"{high:g}", f"{high:,.0f}")), field.description
    with pytest.raises(pydantic.ValidationError, match=name):
        cls(**{name: high * 10 + 1 if field.annotation is int else high * 10})
    low = bounds["Ge"].ge if "Ge" in bounds else bounds["Gt"].gt
    with pytest.raises(pydantic.ValidationError, match=name):
        cls(**{name: low - 1 if "Ge" in bounds else low})
    cls(**{name: high})  # the bounds themselves are allowed


def test_keep_last_turns_of_fifty_million_is_refused_and_named():
    # Before: no upper bound; `set(range(N))` per turn took 7.6 s and 4.4 GiB at 50M.
    with pytest.raises(pydantic.ValidationError, match="keep_last_turns"):
        Valves(keep_last_turns=50_000_000)
    settings, problems = read_settings(Valves.model_construct(keep_last_turns=50_000_000))
    assert settings.keep_last_turns == 1
    assert [p.valve for p in problems] == ["keep_last_turns"] and "1 to 1,000" in str(problems[0])


@pytest.mark.parametrize(
    "name", sorted(set(INT_RANGES) - {"priority", "summary_max_tokens"})
)  # Open WebUI reads priority;
def test_out_of_range_values_that_skip_pydantic_are_named(name):  # summary_max_tokens: test_summarize
    low, high = INT_RANGES[name]
    for value in (low - 1, high + 1):
        settings, problems = read_settings(Valves.model_construct(**{name: value}))
        named = [p for p in problems if p.valve == name]
        assert named, (name, value, problems)
        assert f"{high + 1}" not in str(named[0]) and f"{high + 1:,}" not in str(named[0])
        assert getattr(settings, name, None) in (None, getattr(Valves(), name))
    _, problems = read_settings(Valves(), UserValves.model_construct(max_context_tokens=-1))
    assert [p.valve for p in problems] == ["max_context_tokens"]


def _outside(field) -> list[float]:
    """Values just outside a numeric Field's bounds (and NaN for a float one)."""
    bounds = {type(m).__name__: m for m in field.metadata}
    high = bounds["Le"].le
    if "Gt" in bounds:
        lows = [bounds["Gt"].gt]
    else:
        lows = [bounds["Ge"].ge - (1 if field.annotation is int else bounds["Ge"].ge / 2 or 0.5)]
    step = 1 if field.annotation is int else max(high / 1_000, 0.001)
    return [*lows, high + step, *([float("nan")] if field.annotation is float else [])]


SUMMARY_ON = {
    "summary_enabled": True,
    "summary_base_url": "https://llm.example/v1",
    "summary_model": "mini",
    "summary_api_key": "sk-x",
}


@pytest.mark.parametrize("name", [n for c, n in NUMERIC if c is Valves and n != "priority"])
def test_every_numeric_valve_that_skips_pydantic_is_checked_against_its_field(name):
    # One range per valve: the Field's. Before, pricing_ttl_hours was checked only against 0 (a
    # model_construct value of 0.05 or 9,000 h, or NaN, went through unnamed) and
    # low_watermark / embed_timeout_seconds restated their bounds by hand.
    field = Valves.model_fields[name]
    default = field.default
    for value in _outside(field):
        settings, problems = read_settings(Valves.model_construct(**{**SUMMARY_ON, name: value}))
        named = [p for p in problems if p.valve == name]
        assert len(named) == 1, (name, value, problems)
        assert f"{name} must be" in str(named[0])
        assert not value > default or repr(value) not in str(named[0])  # the value is never echoed
        if name.startswith("summary_"):
            assert settings.summary is None and "summaries are off" in str(named[0])
        elif name.endswith(("_usd", "_tokens")) and "limit" in name:
            assert "no such limit used" in str(named[0])
        else:
            kept = getattr(settings, name, None)
            assert kept is None or kept == default, (name, value, kept)


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("low_watermark", "low_watermark must be above 0 and at most 1; using 0.8"),
        ("embed_timeout_seconds", "embed_timeout_seconds must be above 0 and at most 30; using 0.1"),
        ("pricing_ttl_hours", "pricing_ttl_hours must be 0.1 to 8,760; using 24"),
    ],
)
def test_a_float_valve_out_of_its_range_is_named_with_the_fields_range_and_falls_back(name, words):
    for value in (-1.0, 0.0, 0.05, 1e6, float("nan")):
        if name != "pricing_ttl_hours" and value == 0.05:
            continue  # inside the other two ranges
        settings, problems = read_settings(Valves.model_construct(**{name: value}))
        assert [str(p) for p in problems] == [words], (value, problems)
        assert getattr(settings, name) == Valves.model_fields[name].default
    settings, problems = read_settings(Valves.model_construct(**{name: 0.5}))
    assert not problems and getattr(settings, name) == 0.5


async def test_reserve_at_or_above_the_models_window_is_named_not_a_64_token_budget(counter):
    # Before: with the window from the model (num_ctx 2,048) and the reserve at 4,096 the
    # budget silently became 64 tokens.
    f = make_filter(counter, reserve_output_tokens=4_096)
    run = await run_turn(f, chat_of(20), model_info={"id": "gpt-4o", "info": {"params": {"num_ctx": 2_048}}})
    budget = run.metadata["contextwarden"]["budget"]
    assert budget == 2_048 - 2_048 // 4 > MIN_BUDGET_TOKENS
    assert any("reserve_output_tokens is not below this model's context window" in s for s in run.events.statuses)
    assert not any("4096" in s or "4,096" in s for s in run.events.statuses)


def test_reserve_below_the_window_reports_nothing():
    settings, problems = read_settings(Valves(reserve_output_tokens=1_000))
    assert not problems and settings.reserve_problem(2_000) is None and settings.budget(2_000) == 1_000
    assert settings.reserve_problem(1_000) is not None and settings.budget(1_000) == 750


SECRET = "sk-live-0123456789abcdef"


@pytest.mark.parametrize(
    ("valve", "value"),
    [
        ("model_aliases", f'{{"{SECRET}": 5}}'),
        ("model_aliases", f'{{"gpt": ["{SECRET}"]}}'),
        ("model_aliases", SECRET),
        ("allowed_user_flags", f"pin, {SECRET}"),
        ("free_models", f'["{SECRET}", 5]'),
        ("connection_prefixes", f'[{{"{SECRET}": 1}}]'),
    ],
)
async def test_bad_valve_values_are_never_echoed_into_status_lines(counter, caplog, valve, value):
    f = make_filter(counter)
    f.valves = f.Valves(**{valve: value})
    run = await run_turn(f, chat_of(4))
    statuses = run.events.statuses
    assert any(valve in s for s in statuses), statuses
    assert not any(SECRET in s or SECRET[:8] in s for s in statuses), statuses
    assert SECRET not in caplog.text


def test_every_valve_has_a_real_title_and_the_two_budgets_are_named_apart():
    """Open WebUI's form shows the schema titles; without them it shows "Redis Url"."""
    from contextwarden.face.valves import TITLES, USER_TITLES, UserValves, Valves

    for model, titles in ((Valves, TITLES), (UserValves, USER_TITLES)):
        assert set(titles) == set(model.model_fields)  # one title each, none for a gone field
        schema = model.model_json_schema()["properties"]
        for name, spec in schema.items():
            assert spec["title"] == titles[name] and spec["title"] != name.replace("_", " ").title(), name
    admin = Valves.model_json_schema()["properties"]["max_context_tokens"]["title"]
    user = UserValves.model_json_schema()["properties"]["max_context_tokens"]["title"]
    assert "window" in admin.lower() and "budget" in user.lower() and admin != user
    # the user's description names the same thing its title does (it said "context budget")
    assert "prompt budget" in UserValves.model_fields["max_context_tokens"].description


# The valves form lists fields in the model's order: what an admin sets first comes first.
FORM_GROUPS = (
    ("mode", "max_context_tokens", "reserve_output_tokens", "strategy", "keep_last_turns", "low_watermark"),
    ("growth_turns", "allowed_user_flags", "state_ttl_hours", "show_status"),  # trim, then what users see
    ("openrouter_pricing", "pricing_file", "model_aliases", "free_models", "connection_prefixes"),  # cost
    ("pricing_ttl_hours", "request_stream_usage", "prompt_cache_hints"),
    ("daily_limit_usd", "monthly_limit_usd", "daily_limit_tokens", "monthly_limit_tokens", "limit_overrides"),
    ("show_spend", "limit_store_failure", "ledger_retention_days"),  # limits
    ("redis_url",),
    ("semantic_relevance", "embed_timeout_seconds", "embed_max_texts", "summary_enabled", "summary_base_url"),
    ("summary_api_key", "summary_model", "summary_timeout_seconds", "summary_max_tokens"),
    ("calibrate_counts", "priority"),  # diagnostics and plumbing
)


def test_the_admin_form_starts_with_the_window_and_trim_and_ends_with_plumbing():
    """A new valve must be placed in its group here, not appended after `priority`."""
    expected = [name for group in FORM_GROUPS for name in group]
    assert list(Valves.model_fields) == expected
    assert list(Valves.model_json_schema()["properties"]) == expected  # what Open WebUI renders
    assert list(UserValves.model_fields) == ["max_context_tokens", "show_status", "show_cost", "show_spend"]


def _shown(value: float) -> str:
    return f"{int(value):,}" if float(value).is_integer() else f"{value:g}"


@pytest.mark.parametrize(("cls", "name"), NUMERIC, ids=[f"{c.__name__}.{n}" for c, n in NUMERIC])
def test_every_range_is_the_last_thing_its_description_says(cls, name):
    """Open WebUI's save error does not name the field (tests/e2e/test_valves_form.py): the
    description is the only place an admin learns the range, so both ends are stated."""
    field = cls.model_fields[name]
    bounds = {type(m).__name__: m for m in field.metadata}
    high = _shown(bounds["Le"].le)
    if "Gt" in bounds:
        note = f"(Above {_shown(bounds['Gt'].gt)}, at most {high}.)"
    else:
        note = f"({_shown(bounds['Ge'].ge)} to {high}.)"
    assert field.description.endswith(" " + note), field.description


def test_descriptions_survive_the_forms_markdown():
    """Open WebUI renders descriptions as markdown through DOMPurify: a bare `<user id>` became
    an empty tag, so JSON examples are code spans."""
    import re

    for cls in (Valves, UserValves):
        for name, field in cls.model_fields.items():
            outside_code = re.sub(r"`[^`]*`", "", field.description)
            assert "<" not in outside_code and "{" not in outside_code, name


def test_cost_and_spend_are_said_to_be_above_the_reply_where_the_line_is():
    for cls in (Valves, UserValves):
        for name in ("show_cost", "show_spend"):
            if name in cls.model_fields:
                text = cls.model_fields[name].description
                assert "after" not in text and "above" in text, (cls.__name__, name, text)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("model_aliases", "{" + ", ".join(f'"m{i}": "openai/gpt-4o"' for i in range(4_000)) + "}"),
        ("free_models", ",".join(f"llama-{i}-*" for i in range(8_000))),
        ("connection_prefixes", "\n".join(f"prefix{i}" for i in range(8_000))),
    ],
)
def test_model_name_valves_are_bounded_like_the_overrides(name, value):
    """Each is matched against every request's model: past 64 KB it is refused, named, and not used."""
    assert len(value) > 65_536
    settings, problems = read_settings(Valves(**{name: value}))
    assert [p.valve for p in problems] == [name]
    assert "longer than 65,536 characters" in str(problems[0])
    assert not getattr(settings, name)
