"""Counts in the usage reports read right with one as with many: `1 reply`, `2 replies`."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest

from contextwarden.face.adminview import own_usage_text, usage_markdown
from contextwarden.money.ledger import LEDGER_FIELDS, LedgerRow, MonthTotals
from contextwarden.money.limits import LimitRules, Limits, Spend
from contextwarden.tools.report import render_table

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
