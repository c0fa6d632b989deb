"""What the admin reads and gets in the valves form: the window valve's warning about Open WebUI's
built-in tool definitions, and a save refused when a value cannot be used (issue 31)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from contextwarden.face.valves import Valves, save_problems

ROOT = Path(__file__).resolve().parents[1]
# Measured in Open WebUI 0.12.4's browser chats (tests/e2e/README.md): its 30 built-in tools'
# definitions, as the budget counts them, for a plain user and for an admin.
USER_TOOLS, ADMIN_TOOLS = 3_214, 3_923


def test_the_window_valve_says_the_built_in_tools_count_against_it():
    """A 3,000 window sent only the system prompt and the question every turn, and the form gave
    no hint. The description names the tools' size, the smallest window that works with them on,
    and both fixes; the README's row says the same with the exact numbers."""
    text = Valves.model_json_schema()["properties"]["max_context_tokens"]["description"]
    assert "built-in tool definitions count against it" in text
    assert f"about {USER_TOOLS / 1000:.1f}k" in text and f"{ADMIN_TOOLS / 1000:.1f}k an admin's" in text
    # the admin's tools, the default reply reserve and a turn or two of chat: about 6k
    smallest = ADMIN_TOOLS + Valves().reserve_output_tokens + 1_000
    assert f"under about {round(smallest / 1000)}k" in text
    assert "larger window" in text and "Builtin Tools" in text  # Open WebUI's name for the capability
    readme = " ".join((ROOT / "README.md").read_text("utf-8").split())
    row = re.search(r"\| `max_context_tokens` \|[^\n]*?\|([^|]*)\|", readme)
    assert row and f"{USER_TOOLS:,} tokens" in row[1] and f"{ADMIN_TOOLS:,}" in row[1]
    assert f"under about {round(smallest / 1000):,},000" in row[1] and "*Builtin Tools*" in row[1]


# -- bad values refused at save, read leniently everywhere else (issue 31) ---------------------


def _open_webui_function(module: str, name: str) -> Any:
    """An async function `name` of a module named `module` that builds `Valves(**form)` as Open
    WebUI 0.12.4 does (routers/functions.py saves; utils/filter.py, before each hook, reads)."""
    namespace: dict[str, Any] = {"__name__": module}
    exec(f"async def {name}(Valves, form):\n    return Valves(**form)\n", namespace)
    return namespace[name]


SAVE = _open_webui_function("open_webui.routers.functions", "update_function_valves_by_id")
HOOK = _open_webui_function("open_webui.utils.filter", "get_function_valves")
CODE_UPDATE = _open_webui_function("open_webui.utils.valves", "validate_valves")

BAD = {  # a value the filter could not use, and the valve the refusal names
    "model_aliases": '{"my-gpt": "openai/gpt-4o",}',
    "limit_overrides": '{"roles": {"user": {"daily_usd": "lots"}}}',
    "free_models": '["llama*", 3]',
    "mode": "enforced",
    "strategy": "smart",
    "prompt_cache_hints": "on",
    "allowed_user_flags": "keep,fulll",
    "redis_url": "localhost:6379",
    "summary_base_url": "api.openai.com/v1",
}
ALONG = {"summary_base_url": {"summary_enabled": True, "summary_model": "gpt-4o-mini"}}  # checked when on
SECRETS = {"summary_api_key": "sk-do-not-log-me", "redis_url": "redis://:hunter2secret@127.0.0.1:6379/0"}


@pytest.mark.parametrize("name", list(BAD))
async def test_a_save_with_a_value_the_filter_cannot_use_is_refused_naming_it(name):
    """Invalid JSON in model_aliases saved "successfully" and was named only in the admin's next
    reply's collapsed status. At save it now raises, so Open WebUI answers HTTP 400 and stores
    nothing; the message names the valve and quotes no input (Open WebUI logs it: secrets)."""
    form = {**SECRETS, **ALONG.get(name, {}), name: BAD[name]}
    with pytest.raises(ValidationError) as refused:
        await SAVE(Valves, form)
    said = str(refused.value)
    assert f"contextwarden: {name}" in said
    assert "sk-do-not-log-me" not in said and "hunter2secret" not in said
    # the same values already stored: read before every hook and on a code update, never raised
    for reader in (HOOK, CODE_UPDATE):
        valves = await reader(Valves, form)
        assert getattr(valves, name) == BAD[name]
        assert [p.valve for p in save_problems(valves)] == [name]  # what the next turn tells instead
    assert getattr(Valves(**form), name) == BAD[name]


async def test_a_save_of_good_values_goes_through():
    assert (await SAVE(Valves, {})) == Valves()
    good = {
        "model_aliases": '{"my-gpt": "openai/gpt-4o"}',
        "free_models": "llama*, qwen3:*",
        "redis_url": "redis://127.0.0.1:6379/0",
        "max_context_tokens": 8_000,
        "reserve_output_tokens": 1_000,
        **{k: v for k, v in SECRETS.items() if k != "redis_url"},
    }
    assert (await SAVE(Valves, good)).model_aliases == good["model_aliases"]


async def test_a_reserve_over_the_window_is_refused_at_save():
    with pytest.raises(ValidationError, match="reserve_output_tokens must be below max_context_tokens"):
        await SAVE(Valves, {"max_context_tokens": 1_000, "reserve_output_tokens": 2_000})
