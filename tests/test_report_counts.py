"""Counts in the usage reports read right with one as with many (`1 reply`, `2 replies`), and the
HTML report's chart draws every amount where it can be seen."""

from __future__ import annotations

import html
import re
from datetime import UTC, date, datetime
from decimal import Decimal

import pytest

from contextwarden.face.adminview import own_usage_text, usage_markdown
from contextwarden.money.ledger import LEDGER_FIELDS, LedgerEntry, LedgerRow, MonthTotals
from contextwarden.money.limits import LimitRules, Limits, Spend
from contextwarden.tools.report import render_html, render_table

NOW = datetime(2026, 12, 1, 9, 30, tzinfo=UTC)


def row(key: str, requests: int, unpriced: int = 0, estimated: int = 0) -> LedgerRow:
    counters = dict.fromkeys(LEDGER_FIELDS, 0)
    counters.update(requests=requests, unpriced=unpriced, estimated=estimated, cost_picousd=10**9 * requests)
    return LedgerRow(key, counters)


def admin_report(requests: int, unpriced: int, estimated: int) -> str:
    today = row("2026-12-01", requests, unpriced, estimated)
    month = MonthTotals(
        [row("u-1", requests, unpriced, estimated)], [row("gpt-4o", requests, unpriced, estimated)], [today]
    )
    return usage_markdown(month, NOW, LimitRules(), shared=True)


def test_admin_report_says_one_reply():
    text = admin_report(requests=1, unpriced=1, estimated=1)
    assert "Today: unknown · 1 reply." in text
    assert "This month: unknown · 1 reply." in text
    assert "- 1 reply had no known price: its tokens are counted, its cost is not (≥, unknown)." in text
    assert "- 1 reply was estimated (the backend sent no usage, or not all of it)." in text
    assert "1 replies" not in text


def test_admin_report_says_replies_for_more_than_one():
    text = admin_report(requests=1_200, unpriced=2, estimated=3)
    assert "Today: ≥$1.20 · 1,200 replies." in text
    assert "This month: ≥$1.20 · 1,200 replies." in text
    assert "- 2 replies had no known price: their tokens are counted, their cost is not (≥, unknown)." in text
    assert "- 3 replies were estimated (the backend sent no usage, or not all of it)." in text


@pytest.mark.parametrize(("unpriced", "words"), [(1, "1 reply without"), (2, "2 replies without")])
def test_a_users_own_usage_counts_unpriced_replies(unpriced, words):
    text = own_usage_text(Limits(), Spend(), Spend(Decimal("0.01"), 10, 3, unpriced))
    assert f"{words} a known price (not in the dollars)" in text


def test_text_table_notes_say_one_reply():
    lines = render_table([row("gpt-4o", 3, unpriced=1, estimated=1)], "model").splitlines()
    assert lines[-2:] == [
        "1 reply had no known price: its tokens are counted, its cost is not (≥, unknown)",
        "1 reply was estimated (the backend sent no usage, or not all of it)",
    ]
    lines = render_table([row("gpt-4o", 3, unpriced=2, estimated=2)], "model").splitlines()
    assert lines[-2:] == [
        "2 replies had no known price: their tokens are counted, their cost is not (≥, unknown)",
        "2 replies were estimated (the backend sent no usage, or not all of it)",
    ]


def _svg_bars(page: str) -> dict[str, tuple[float, float]]:
    """Each bar of the HTML report's chart by its title: (top y, height)."""
    svg = page[page.index("<svg") : page.index("</svg>")]
    bars = re.findall(r'<rect x="[^"]*" y="([^"]*)" width="[^"]*" height="([^"]*)"[^>]*><title>([^<]*)</title>', svg)
    return {html.unescape(title): (float(y), float(h)) for y, h, title in bars}


def test_negative_savings_are_drawn_below_zero_at_their_size():
    """A day whose untrimmed chat would have been cheaper (savings -$0.004) was drawn as a 0.5 px
    sliver at y=426, below the 380 px chart: invisible. Now it hangs below the $0 line, its size
    to scale, beside a day that saved $0.003."""
    entries = []
    for day, saved in ((1, -4 * 10**9), (2, 3 * 10**9)):
        counters = dict.fromkeys(LEDGER_FIELDS, 0)
        counters.update(requests=3, cost_picousd=10**10, trimmed=3, cost_saved_picousd=saved)
        entries.append(LedgerEntry(date(2026, 12, day), "u", "openai/gpt-4o", counters))
    page = render_html(entries, None)
    bars = _svg_bars(page)
    cost_top, cost_h = bars["2026-12-01 · openai/gpt-4o: $0.010"]
    zero = cost_top + cost_h  # the cost bar stands on $0
    scale = cost_h / 0.010
    low_top, low_h = bars["2026-12-01 · trimming: untrimmed about $0.0040 cheaper (prompt cache)"]
    assert low_top == pytest.approx(zero, abs=0.1) and low_h == pytest.approx(0.004 * scale, abs=0.2)
    assert low_top + low_h <= 380 - 70  # inside the plot, above the day labels
    high_top, high_h = bars["2026-12-02 · saved: about $0.0030"]
    assert high_top + high_h == pytest.approx(zero, abs=0.1) and high_h == pytest.approx(0.003 * scale, abs=0.2)
    assert 'class="ylabel">-$0.005<' in page
