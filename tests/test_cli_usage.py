"""`contextwarden usage` against a real Redis: table, JSON, CSV and the HTML report.

Records go to far-future days unique to the run (and expire in a day), so `--since` selects
exactly this test's data even on a Redis other runs share."""

from __future__ import annotations

import csv
import io
import json
import random
from datetime import date, timedelta
from decimal import Decimal

import pytest

from contextwarden.money.ledger import record_reply
from contextwarden.state.store import open_store
from contextwarden.tools.cli import main

D = Decimal
pytestmark = pytest.mark.redis


@pytest.fixture
async def seeded(redis_url, unique):
    start = date(2200, 1, 1) + timedelta(days=random.Random(unique).randrange(300_000))
    ann, bob = f"ann-{unique}", f"bob-{unique}"
    gpt, claude, local = "openai/gpt-4o", "anthropic/claude-sonnet-4.5", "llama3.1:8b"
    rows = [  # (day offset, user, model, prompt, completion, cost, estimated)
        (0, ann, gpt, 1000, 100, D("0.0035"), False),
        (0, bob, claude, 2000, 300, D("0.0105"), False),
        (1, ann, gpt, 500, 50, D("0.00175"), True),
        (1, ann, local, 800, 80, D(0), False),
        (2, bob, gpt, 100, 10, None, False),
    ]
    store = open_store(redis_url)
    for offset, user, model, prompt, completion, cost, estimated in rows:
        await record_reply(
            store,
            user=user,
            model=model,
            prompt_tokens=prompt,
            completion_tokens=completion,
            cached_tokens=prompt // 10,
            cost_usd=cost,
            estimated=estimated,
            day=start + timedelta(days=offset),
            retention_days=1,
        )
    await store.aclose()
    until = (start + timedelta(days=2)).isoformat()
    return {
        "url": redis_url,
        "since": start.isoformat(),
        "start": start,
        "ann": ann,
        "bob": bob,
        "range": ["--since", start.isoformat(), "--until", until],
    }


def run(capsys, *args):
    code = main(["usage", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_table_by_model(seeded, capsys):
    code, out, _ = run(capsys, "--redis-url", seeded["url"], *seeded["range"])
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["model", "replies", "prompt", "completion", "cost", "USD", "unpriced", "saved", "USD~"]
    assert max(map(len, lines)) <= 100
    table = lines[: lines.index(next(line for line in lines if line.startswith("total"))) + 1]
    models = [line.split()[0] for line in table[2:-2]]
    assert models == ["anthropic/claude-sonnet-4.5", "openai/gpt-4o", "llama3.1:8b"]  # by cost
    gpt = next(line for line in lines if line.startswith("openai/gpt-4o")).split()
    assert gpt[1:] == ["3", "1,600", "160", "≥0.0053", "1", "0"]  # one of its replies had no price
    assert next(line for line in lines if line.startswith("llama3.1:8b")).split()[4] == "0"  # priced at 0: free
    assert table[-1].split() == ["total", "5", "4,400", "540", "≥0.016", "1", "0"]
    assert lines[len(table) :] == [
        "1 reply had no known price: its tokens are counted, its cost is not (≥, unknown)",
        "1 reply was estimated (the backend sent no usage, or not all of it)",
    ]
    assert "shadow" not in lines[0] and "estimates" not in out  # no savings recorded: no note, no shadow columns


def test_unknown_price_is_unknown_in_every_format(seeded, capsys):
    _, out, _ = run(capsys, "--redis-url", seeded["url"], "--by", "day", *seeded["range"])
    last_day = (seeded["start"] + timedelta(days=2)).isoformat()
    assert next(line for line in out.splitlines() if line.startswith(last_day)).split()[4] == "unknown"
    _, out, _ = run(capsys, "--redis-url", seeded["url"], "--by", "day", *seeded["range"], "--format", "json")
    rows = {r["key"]: r for r in json.loads(out)["rows"]}
    assert rows[last_day]["cost_usd"] is None and rows[last_day]["cost_complete"] is False
    assert rows[seeded["since"]]["cost_usd"] == "0.014" and rows[seeded["since"]]["cost_complete"] is True


def test_long_keys_are_cut_to_fit_and_wide_shows_everything(redis_url, unique, capsys):
    import asyncio

    day = date(2199, 1, 1) + timedelta(days=random.Random(unique).randrange(10_000))
    model = f"openrouter/some-provider/{'x' * 60}-{unique}-instruct"

    async def seed():
        store = open_store(redis_url)
        await record_reply(
            store,
            user=unique,
            model=model,
            prompt_tokens=123_456_789,
            completion_tokens=9_876_543,
            cached_tokens=5,
            cost_usd=D("12345.678901"),
            estimated=False,
            day=day,
            retention_days=1,
        )
        await store.aclose()

    asyncio.run(seed())
    span = ["--since", day.isoformat(), "--until", day.isoformat()]
    _, out, _ = run(capsys, "--redis-url", redis_url, *span)
    assert max(map(len, out.splitlines())) <= 100
    cut = out.splitlines()[2].split()[0]
    assert "…" in cut and cut.startswith("openrouter/") and cut.endswith("-instruct")
    _, wide, _ = run(capsys, "--redis-url", redis_url, *span, "--wide")
    assert model in wide and wide.splitlines()[0].split()[:6] == [
        "model",
        "requests",
        "prompt",
        "completion",
        "cached",
        "reasoning",
    ]


def test_json_by_user_is_exact(seeded, capsys):
    code, out, _ = run(capsys, "--redis-url", seeded["url"], "--by", "user", *seeded["range"], "--format", "json")
    assert code == 0
    document = json.loads(out)
    rows = {r["key"]: r for r in document["rows"]}
    assert set(rows) == {seeded["ann"], seeded["bob"]} and document["since"] == seeded["since"]
    assert rows[seeded["ann"]]["cost_usd"] == "0.00525" and rows[seeded["ann"]]["estimated"] == 1
    assert rows[seeded["bob"]]["cost_usd"] == "0.0105" and rows[seeded["bob"]]["unpriced"] == 1
    assert document["total"]["cost_usd"] == "0.01575" and document["total"]["prompt_tokens"] == 4400


def test_json_states_the_days_it_covers(seeded, capsys):
    """`--format json` said `since` but not `until`: a report of days 1-2 of 3 read like one of
    every day from day 1 on. It states both bounds of the days read; `null` is no bound."""
    start, url = seeded["start"], seeded["url"]
    second, third = ((start + timedelta(days=n)).isoformat() for n in (1, 2))
    code, out, _ = run(
        capsys, "--redis-url", url, "--by", "day", "--since", seeded["since"], "--until", second, "--format", "json"
    )
    document = json.loads(out)
    assert code == 0 and (document["since"], document["until"]) == (seeded["since"], second)
    assert [r["key"] for r in document["rows"]] == [seeded["since"], second]
    document = json.loads(run(capsys, "--redis-url", url, "--by", "day", "--since", second, "--format", "json")[1])
    assert (document["since"], document["until"]) == (second, None) and third in [r["key"] for r in document["rows"]]
    document = json.loads(run(capsys, "--redis-url", url, "--by", "day", "--until", second, "--format", "json")[1])
    assert (document["since"], document["until"]) == (None, second) and third not in [
        r["key"] for r in document["rows"]
    ]


def test_csv_by_day_and_since(seeded, capsys):
    later = (seeded["start"] + timedelta(days=1)).isoformat()
    code, out, _ = run(
        capsys, "--redis-url", seeded["url"], "--by", "day", *seeded["range"], "--since", later, "--format", "csv"
    )
    assert code == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [r["day"] for r in rows] == [later, (seeded["start"] + timedelta(days=2)).isoformat()]
    assert (rows[0]["requests"], rows[0]["cost_usd"], rows[0]["cached_tokens"]) == ("2", "0.00175", "130")
    assert (rows[1]["cost_usd"], rows[1]["unpriced"]) == ("", "1")  # unknown: empty, never a guessed 0


def test_html_report_is_self_contained(seeded, capsys, tmp_path):
    path = tmp_path / "report.html"
    code, out, err = run(capsys, "--redis-url", seeded["url"], *seeded["range"], "--html", str(path))
    assert code == 0 and "wrote" in err and out.startswith("model")
    page = path.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page
    assert "<script" not in page and "<link" not in page and "src=" not in page and "@import" not in page
    assert (
        page.count('<rect x="') == 3
    )  # (day, model) cells with a cost: gpt d0, claude d0, gpt d1 (llama is $0, bob d2 unpriced)
    for text in (
        "Cost per day by model",
        "By model",
        "By user",
        "By day",
        seeded["ann"],
        "anthropic/claude-sonnet-4.5",
        "$0.016",
        seeded["since"],
    ):
        assert text in page, text


def test_without_until_every_later_day_kept_is_read(seeded, capsys):
    """No `--until`: no upper bound (its help said "default: today"; these days are far ahead)."""
    code, out, _ = run(capsys, "--redis-url", seeded["url"], "--since", seeded["since"], "--by", "day")
    last = (seeded["start"] + timedelta(days=2)).isoformat()
    assert code == 0 and last in out
    span = ["--since", "1999-01-01", "--until", "1999-01-02"]  # no test records there
    assert run(capsys, "--redis-url", seeded["url"], *span)[1] == "no usage recorded from 1999-01-01 to 1999-01-02\n"


def test_html_escapes_ids(redis_url, unique, capsys, tmp_path):
    import asyncio

    day = date(2199, 12, 31) - timedelta(days=random.Random(unique).randrange(10_000))

    async def seed():
        store = open_store(redis_url)
        await record_reply(
            store,
            user=f"<b>{unique}</b>",
            model="<script>x</script>",
            prompt_tokens=1,
            completion_tokens=1,
            cost_usd=D("1"),
            estimated=False,
            day=day,
            retention_days=1,
        )
        await store.aclose()

    asyncio.run(seed())
    path = tmp_path / "r.html"
    assert (
        main(
            [
                "usage",
                "--redis-url",
                redis_url,
                "--since",
                day.isoformat(),
                "--until",
                day.isoformat(),
                "--html",
                str(path),
            ]
        )
        == 0
    )
    page = path.read_text()
    assert "<script>" not in page and "&lt;script&gt;x&lt;/script&gt;" in page and f"&lt;b&gt;{unique}" in page


def test_without_redis_url_explains_and_fails(capsys):
    code, out, err = run(capsys)
    assert code == 2 and out == ""
    assert "in memory inside each Open WebUI worker" in err and "--redis-url" in err


def test_unreachable_or_bad_redis_fails(capsys):
    code, _, err = run(capsys, "--redis-url", "redis://127.0.0.1:1/0")
    assert code == 2 and "Redis at 127.0.0.1:1 did not answer: connection refused" in err
    code, _, err = run(capsys, "--redis-url", "http://localhost")
    assert code == 2 and "redis_url must start with redis://" in err
    with pytest.raises(SystemExit):
        main(["usage", "--redis-url", "redis://x", "--since", "yesterday"])


def test_a_refused_login_is_one_line_without_the_password(redis_url, capsys):
    """Redis answers, but not to this user: said so (it was "did not answer" before), password hidden."""
    host_port = redis_url.removeprefix("redis://").split("/")[0]
    code, _, err = run(capsys, "--redis-url", f"redis://nobody:pw-s3cret@{host_port}/0")
    assert code == 2 and err.count("\n") == 1
    assert f"Redis at {host_port} refused the command" in err and "pw-" not in err


def test_html_tables_scroll_on_narrow_screens(seeded, capsys, tmp_path):
    """Below ~800 px the wide tables scroll inside the page instead of being cut off."""
    path = tmp_path / "report.html"
    code, _out, _err = run(capsys, "--redis-url", seeded["url"], *seeded["range"], "--html", str(path))
    page = path.read_text()
    assert code == 0
    assert ".scroll{overflow-x:auto" in page
    assert page.count('<div class="scroll"><table>') == page.count("<table>") == 3


def test_savings_of_unpriced_trimmed_replies_are_unknown_not_zero(redis_url, unique, capsys):
    """A trimmed reply of a model with no price saved tokens, but the report said `saved USD~ 0`
    (JSON "0", CSV 0) beside `cost USD unknown`: the ledger adds an unknown saving as 0."""
    import asyncio

    day = date(2200, 1, 1) + timedelta(days=random.Random(unique).randrange(300_000))

    async def seed():  # carl's reply had no price at all; dora's was priced by its provider
        store = open_store(redis_url)
        for user, cost, saved in ((f"carl-{unique}", None, None), (f"dora-{unique}", D("0.002"), D("0.001"))):
            await record_reply(
                store,
                user=user,
                model="mystery-7b",
                prompt_tokens=3000,
                completion_tokens=9,
                cost_usd=cost,
                estimated=False,
                day=day,
                retention_days=1,
                tokens_saved=2750,
                cost_saved_usd=saved,
            )
        await store.aclose()

    asyncio.run(seed())
    since = ["--since", day.isoformat(), "--until", day.isoformat(), "--by", "user"]
    _, out, _ = run(capsys, "--redis-url", redis_url, *since)
    cells = {line.split()[0]: line.split() for line in out.splitlines()}
    assert cells[f"carl-{unique}"][-2:] == ["1", "unknown"] and cells[f"dora-{unique}"][-2:] == ["0", "0.0010"]
    _, out, _ = run(capsys, "--redis-url", redis_url, *since, "--format", "json")
    rows = {r["key"]: r for r in json.loads(out)["rows"]}
    assert rows[f"carl-{unique}"]["cost_saved_usd"] is None and rows[f"dora-{unique}"]["cost_saved_usd"] == "0.001"
    _, out, _ = run(capsys, "--redis-url", redis_url, *since, "--format", "csv")
    assert {r["user"]: r["cost_saved_usd"] for r in csv.DictReader(io.StringIO(out))}[f"carl-{unique}"] == ""
