"""The README's own example (`examples/long_chat.json`, gpt-4o, a 1,200-token budget) says what
the code prints today: the commands' output block by block, the status lines, the usage line's
savings, the hand arithmetic and the `usage` report. Issue 31: the README showed
`22 → 10 messages · 2,054 → 805 tokens` and `$0.0007` long after the command printed
`22 → 14 messages · 2,054 → 930 tokens` and `$0.0004`; these tests fail when the two drift apart.
When one fails, run the command it names and paste what it prints into the README."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shlex
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from contextwarden.core.tokens import TokenCounter
from contextwarden.money.dollars import usd
from contextwarden.tools.cli import main

from helpers import Events, make_filter, usage_records

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text("utf-8")
FLAT = " ".join(README.split())  # the prose with its line breaks undone
EXAMPLE = json.loads((ROOT / "examples" / "long_chat.json").read_text("utf-8"))["messages"]
BUDGET = 1_200
GPT4O = {"id": "gpt-4o", "owned_by": "openai"}


def block_after(command: str) -> list[str]:
    """The lines of the README's code block that starts with `$ command`."""
    start = README.index(f"```\n$ {command}\n") + len(f"```\n$ {command}\n")
    return README[start : README.index("```", start)].rstrip("\n").split("\n")


def run(capsys: pytest.CaptureFixture[str], command: str) -> list[str]:
    """What `command` (a `contextwarden ...` line of the README) prints, line by line."""
    argv = shlex.split(command)
    assert argv[0] == "contextwarden"
    assert main(argv[1:]) == 0
    return [line.rstrip() for line in capsys.readouterr().out.rstrip("\n").split("\n")]


@pytest.fixture(autouse=True)
def _in_the_repository(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the README's commands name examples/long_chat.json


def test_the_try_it_command_prints_what_the_readme_says(capsys):
    try_it = README[README.index("## Try it") :].split("```")[1]
    command = "contextwarden " + try_it.split("contextwarden ", 1)[1].split("\n")[0]
    assert command == f"contextwarden trim examples/long_chat.json --max-tokens {BUDGET}"
    last = run(capsys, command)[-1]
    assert f"what a {len(EXAMPLE)}-message chat keeps in {BUDGET:,} tokens" in FLAT
    assert f"and ends `{last}`" in FLAT, last


def test_the_explain_block_is_what_the_command_prints(capsys):
    command = f"contextwarden trim examples/long_chat.json --max-tokens {BUDGET} --explain"
    assert block_after(command) == run(capsys, command)


def test_the_fill_line_quoted_is_the_commands(capsys):
    out = run(capsys, f"contextwarden trim examples/long_chat.json --max-tokens {BUDGET} --explain")
    [fill] = [line for line in out if line.startswith("fill ")]
    quoted = re.findall(r"`(fill [^`]*) …`", README)
    assert quoted and all(fill.startswith(q) for q in quoted), (quoted, fill)


async def _turn(counter: TokenCounter, mode: str, user: str, **valves: Any) -> tuple[list[str], dict[str, Any]]:
    """One turn of the example chat through the filter (inlet, request, outlet with the usage a
    provider with a cold cache reports): the status lines and the turn's note."""
    f = make_filter(
        counter,
        max_context_tokens=BUDGET,
        reserve_output_tokens=0,
        mode=mode,
        openrouter_pricing=False,
        calibrate_counts=False,
        **valves,
    )
    events, who = Events(), {"id": user}
    body = {"model": "gpt-4o", "messages": EXAMPLE, "stream": False, "metadata": {"chat_id": f"c-{user}"}}
    body["metadata"]["user_id"] = user
    out = await f.inlet(body, __user__=who, __metadata__=body["metadata"], __model__=GPT4O, __event_emitter__=events)
    out = await f.request(out, __user__=who, __metadata__=out["metadata"], __model__=GPT4O, __event_emitter__=events)
    sent = counter.count_messages(out["messages"], "gpt-4o")
    reply = {
        "role": "assistant",
        "content": "Day 3.",
        "usage": {"prompt_tokens": sent, "completion_tokens": 9, "total_tokens": sent + 9},
    }
    done = {"model": "gpt-4o", "messages": [*EXAMPLE, reply], "chat_id": f"c-{user}"}
    await f.outlet(done, __user__=who, __metadata__=body["metadata"], __model__=GPT4O, __event_emitter__=events)
    return events.statuses, body["metadata"]["contextwarden"]


def _quotes(pattern: str) -> list[str]:
    """Every backticked stretch of the README that matches `pattern` at its start."""
    return [q for q in re.findall(r"`([^`\n]+)`", README) if re.match(pattern, q)]


async def test_the_status_lines_and_the_arithmetic_are_the_filters(counter, caplog):
    caplog.set_level(logging.INFO, logger="contextwarden")
    shadow, shadow_note = await _turn(counter, "shadow", "ann")
    enforce, note = await _turn(counter, "enforce", "bob")
    # the lines above a reply: each quote is the start of what the filter shows
    said = [line for line in README.split("\n") if line.startswith("status: Shadow: would send ")]
    assert said and all(shadow[0].startswith(line.removeprefix("status: ")) for line in said), (said, shadow)
    [line] = enforce  # one line a turn, after the reply
    context = _quotes(rf"Sent \d+ of {len(EXAMPLE)} messages")
    assert context and all(line.startswith(q) for q in context), (context, enforce)
    detail = _quotes(rf"Context {len(EXAMPLE)} → ")  # the admin's, logged
    assert detail and all(note["line"].startswith(q) for q in detail), (detail, note["line"])
    # the hand arithmetic: removed tokens, the cached previous prompt, what the trim saves
    removed, previous, sent = note["tokens_saved"], note["cache"]["untrimmed"], note["estimated_prompt_tokens"]
    before = sent + removed
    saved = Decimal(note["cost_saved_usd"])
    assert (
        saved == ((before - previous) * Decimal("2.50") + previous * Decimal("1.25") - sent * Decimal("2.50")) / 10**6
    )
    assert (
        f"Without the cache the {removed:,} removed tokens would be worth {usd(removed * Decimal('2.50') / 10**6)}"
        f" (× $2.50/M); with gpt-4o's automatic cache the untrimmed chat's previous {previous:,} tokens cost"
        f" $1.25/M, so the trim saves about {usd(saved)} (${saved} = {before - previous:,} × $2.50 +"
        f" {previous:,} × $1.25 − {sent:,} × $2.50, per M)"
    ) in FLAT
    # the usage lines logged for ann (shadow, nothing cached) and bob (enforced)
    ann, bob = usage_records(caplog)
    assert ann["mode"] == "shadow" and shadow_note["tokens_saved"] == ann["tokens_saved"]
    assert f'`"mode":"shadow","tokens_saved":{ann["tokens_saved"]},"cost_saved_usd":"{ann["cost_saved_usd"]}"`' in FLAT
    assert f'"tokens_saved":{bob["tokens_saved"]},"cost_saved_usd":"{bob["cost_saved_usd"]}"' in README
    [line] = [line for line in README.split("\n") if line.startswith("usage {")]
    assert list(json.loads(line.removeprefix("usage "))) == list(bob)  # the same keys, in the same order


async def test_the_usage_report_is_the_commands(counter, redis_server, redis_url, capsys, tmp_path):
    """After one shadow reply (ann) and one enforced one (bob), the README's `usage` table."""
    if not redis_server[1]:
        pytest.skip("needs a Redis of this session's own (redis-server): the table lists every user recorded")
    await _turn(counter, "shadow", "ann", redis_url=redis_url)
    await _turn(counter, "enforce", "bob", redis_url=redis_url)
    command = "contextwarden usage --redis-url redis://127.0.0.1:6379/13 --by user --wide --html report.html"
    block = block_after(command)
    ours = command.replace("redis://127.0.0.1:6379/13", redis_url).replace("report.html", str(tmp_path / "r.html"))
    assert block == await asyncio.to_thread(run, capsys, ours)  # the command runs its own event loop
