"""Usage reports from ledger totals: a text table, JSON, CSV, and a one-page HTML report.

The HTML page is self-contained (inline CSS and SVG, no script, no network): per day, a bar of
cost stacked by model beside a bar of what trimming saved (solid) and what shadow mode says it
would have saved (hatched), and the totals by model, user and day. Not bundled into the
Open WebUI file; the `contextwarden usage` command uses it.
"""

from __future__ import annotations

import csv
import html
import io
import json
from collections.abc import Sequence
from datetime import date
from decimal import ROUND_CEILING, Decimal

from ..face.adminview import cost_cell, replies_text
from ..money.dollars import format_usd, usd
from ..money.ledger import LEDGER_FIELDS, LEDGER_MONEY_FIELDS, LedgerEntry, LedgerRow, ledger_totals, picodollars_to_usd
from ..money.savings import SAVINGS_ASSUMPTION

__all__ = ["render_table", "render_json", "render_csv", "render_html", "REPORT_COLUMNS", "TABLE_COLUMNS", "TABLE_WIDTH"]

# (field, heading) in the order every format shows them; cost is shown in USD.
REPORT_COLUMNS = (
    ("requests", "requests"),
    ("prompt_tokens", "prompt"),
    ("completion_tokens", "completion"),
    ("cached_tokens", "cached"),
    ("reasoning_tokens", "reasoning"),
    ("cost_usd", "cost USD"),
    ("estimated", "estimated"),
    ("unpriced", "unpriced"),
    ("trimmed", "trimmed"),
    ("tokens_saved", "saved tokens"),
    ("cost_saved_usd", "saved USD~"),
    ("shadow_trimmed", "shadow trimmed"),
    ("shadow_tokens_saved", "shadow saved tokens"),
    ("shadow_cost_saved_usd", "would-save USD~"),
)
# Shown in the text and HTML tables only when some row has them (CSV and JSON always have them).
OPTIONAL_COLUMNS = ("shadow_trimmed", "shadow_tokens_saved", "shadow_cost_saved_usd")
# The text table's default: what fits TABLE_WIDTH columns (`--wide` shows REPORT_COLUMNS).
TABLE_COLUMNS = (
    ("requests", "replies"),
    ("prompt_tokens", "prompt"),
    ("completion_tokens", "completion"),
    ("cost_usd", "cost USD"),
    ("unpriced", "unpriced"),
    ("cost_saved_usd", "saved USD~"),
)
TABLE_WIDTH = 100
MIN_KEY_WIDTH = 12
SAVED_COLOR = "#2e9e5b"
CHART_MODELS = 8  # models drawn apart in the chart; the rest are "other"
CHART_COLORS = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f")


def _report_total(rows: Sequence[LedgerRow]) -> LedgerRow:
    totals = {field: sum(r.counters.get(field, 0) for r in rows) for field in LEDGER_FIELDS}
    return LedgerRow("total", totals)


def _savings_unknown(row: LedgerRow, field: str) -> bool:
    """Whether a row's savings in USD are unknown, not 0: no reply of it had a price, and some
    were trimmed (the ledger adds an unknown saving as 0; nothing trimmed saved $0 at any price)."""
    if field not in ("cost_saved_usd", "shadow_cost_saved_usd"):
        return False
    requests, unpriced = row.counters.get("requests", 0), row.counters.get("unpriced", 0)
    trimmed = row.counters.get(field.replace("cost_saved_usd", "trimmed"), 0)
    return bool(requests and unpriced >= requests and trimmed)


def _report_cell(row: LedgerRow, field: str) -> str:
    money = field.replace("_usd", "_picousd")
    if field == "cost_usd":
        return cost_cell(row.counters, row.cost_usd)  # never a guessed 0 for an unknown price
    if _savings_unknown(row, field):
        return "unknown"
    if money in LEDGER_MONEY_FIELDS:
        return format_usd(row.usd(money))
    return f"{row.counters.get(field, 0):,}"


def _report_columns(
    rows: Sequence[LedgerRow], columns: Sequence[tuple[str, str]] = REPORT_COLUMNS
) -> list[tuple[str, str]]:
    """`columns` less the optional ones no row has (no shadow turns: no shadow columns)."""

    def used(field: str) -> bool:
        return any(r.counters.get(field.replace("_usd", "_picousd"), 0) for r in rows)

    return [(f, h) for f, h in columns if f not in OPTIONAL_COLUMNS or used(f)]


def _fit(key: str, width: int) -> str:
    """A key cut in the middle to `width` characters (model ids differ at both ends)."""
    if len(key) <= width:
        return key
    head = (width - 1) // 2
    return key[:head] + "…" + key[len(key) - (width - 1 - head) :]


def render_table(rows: Sequence[LedgerRow], by: str, *, wide: bool = False) -> str:
    """An aligned text table with a total line: TABLE_COLUMNS in TABLE_WIDTH characters (long
    keys cut in the middle), or every column with `wide`. Unknown costs read `unknown`, costs
    missing some unpriced replies `≥x`.

    Example:
        >>> print(render_table(ledger_totals(entries, "model"), "model"))  # doctest: +SKIP
        model           replies  prompt  ...
    """
    columns = _report_columns(rows, REPORT_COLUMNS if wide else TABLE_COLUMNS)
    header = [by] + [heading for _field, heading in columns]
    body = [[row.key] + [_report_cell(row, field) for field, _h in columns] for row in rows]
    total = _report_total(rows)
    footer = ["total"] + [_report_cell(total, field) for field, _h in columns]
    widths = [max(len(line[i]) for line in [header, *body, footer]) for i in range(len(header))]
    if not wide:
        rest = sum(widths[1:]) + 2 * (len(widths) - 1)
        widths[0] = max(min(widths[0], TABLE_WIDTH - rest), min(widths[0], MIN_KEY_WIDTH))

    def line(cells: list[str]) -> str:
        first = _fit(cells[0], widths[0])
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip([first, *cells[1:]], widths, strict=True))
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    lines = [line(header), rule, *(line(b) for b in body), rule, line(footer)]
    if unpriced := total.counters["unpriced"]:
        their = "its" if unpriced == 1 else "their"
        lines.append(
            f"{replies_text(unpriced)} had no known price: {their} tokens are counted, {their} cost is not (≥, unknown)"
        )
    if estimated := total.counters["estimated"]:
        lines.append(
            f"{replies_text(estimated)} {'was' if estimated == 1 else 'were'} estimated"
            " (the backend sent no usage, or not all of it)"
        )
    if total.counters["tokens_saved"] or total.counters["shadow_tokens_saved"]:
        lines.append(f"~ {SAVINGS_ASSUMPTION}")
    return "\n".join(lines)


def _honest(row: LedgerRow) -> dict[str, object]:
    """`row.as_dict()` with `cost_usd` (and savings of trimmed replies) None when no reply had a
    price, and `cost_complete`."""
    data = row.as_dict()
    requests, unpriced = row.counters.get("requests", 0), row.counters.get("unpriced", 0)
    if requests and unpriced >= requests:
        data["cost_usd"] = None
    for field in ("cost_saved_usd", "shadow_cost_saved_usd"):
        if _savings_unknown(row, field):
            data[field] = None
    data["cost_complete"] = unpriced == 0
    return data


def render_json(rows: Sequence[LedgerRow], by: str, since: date | None, until: date | None = None) -> str:
    """`{"by", "since", "until", "rows": [...], "total": {...}}`: the UTC days read, first and
    last (`null`: no bound, every day kept); costs as exact decimal strings, `null` when unknown
    (`cost_complete` false when some replies had no price)."""
    document = {
        "by": by,
        "since": since.isoformat() if since else None,
        "until": until.isoformat() if until else None,
        "rows": [_honest(row) for row in rows],
        "total": _honest(_report_total(rows)),
    }
    return json.dumps(document, indent=2)


def render_csv(rows: Sequence[LedgerRow], by: str) -> str:
    """One header line and one line per row (no total line, so the file sums cleanly); an
    unknown cost is an empty cell, never 0."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([by] + [field for field, _h in REPORT_COLUMNS])
    for row in rows:
        data = _honest(row)
        writer.writerow([row.key] + ["" if data[field] is None else data[field] for field, _h in REPORT_COLUMNS])
    return out.getvalue()


def _chart_series(entries: Sequence[LedgerEntry]) -> tuple[list[str], list[str], dict[tuple[str, str], int]]:
    """(days, models, cost in picodollars by (day, model)); small models folded into other."""
    by_model: dict[str, int] = {}
    for entry in entries:
        by_model[entry.model] = by_model.get(entry.model, 0) + entry.counters.get("cost_picousd", 0)
    ranked = sorted((m for m in by_model if by_model[m] > 0), key=lambda m: (-by_model[m], m))
    shown = ranked if len(ranked) <= CHART_MODELS + 1 else ranked[:CHART_MODELS]
    folded = len(ranked) > len(shown)
    models = shown + (["other models"] if folded else [])
    cells: dict[tuple[str, str], int] = {}
    days = sorted({e.day.isoformat() for e in entries})
    for entry in entries:
        model = entry.model if entry.model in shown else "other models"
        if model not in models:
            continue
        key = (entry.day.isoformat(), model)
        cells[key] = cells.get(key, 0) + entry.counters.get("cost_picousd", 0)
    return days, models, cells


def _nice_step(top: Decimal) -> Decimal:
    """A round axis step (1, 2 or 5 times a power of ten) giving about five gridlines."""
    raw = top / 5
    power = Decimal(1).scaleb(raw.adjusted())
    for factor in (1, 2, 5, 10):
        if raw <= power * factor:
            return power * factor
    return power * 10


def _savings_by_day(entries: Sequence[LedgerEntry]) -> dict[str, tuple[int, int]]:
    """Per day: (saved, would have saved in shadow mode), in picodollars."""
    days: dict[str, tuple[int, int]] = {}
    for entry in entries:
        saved, shadow = days.get(entry.day.isoformat(), (0, 0))
        days[entry.day.isoformat()] = (
            saved + entry.counters.get("cost_saved_picousd", 0),
            shadow + entry.counters.get("shadow_cost_saved_picousd", 0),
        )
    return days


def _chart_svg(entries: Sequence[LedgerEntry]) -> str:
    """Per day: cost stacked by model, and beside it savings (solid) and shadow would-save (hatched)."""
    days, models, cells = _chart_series(entries)
    savings = _savings_by_day(entries)
    if not days or not (cells or any(a or b for a, b in savings.values())):
        return '<p class="empty">No priced usage in this period.</p>'
    width, height, left, right, top, bottom = 1080, 380, 80, 20, 20, 70
    plot_w, plot_h = width - left - right, height - top - bottom
    day_totals = {d: sum(cells.get((d, m), 0) for m in models) for d in days}
    # Savings are negative where the untrimmed chat would have been cheaper: drawn below $0.
    peak = picodollars_to_usd(max(max(day_totals.values()), *(_signed(s, 1) for s in savings.values())))
    dip = picodollars_to_usd(max((_signed(s, -1) for s in savings.values()), default=0))
    step = _nice_step(peak + dip or picodollars_to_usd(1))
    axis_top = step * ((peak / step).to_integral_value(rounding=ROUND_CEILING) or 1)
    axis_bottom = -step * (dip / step).to_integral_value(rounding=ROUND_CEILING)
    scale = plot_h / float(axis_top - axis_bottom)
    zero = top + float(axis_top) * scale
    slot = plot_w / len(days)
    bar = max(2.0, min(36.0, slot * 0.38))
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="Cost and savings per day">',
        '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">'
        '<rect width="6" height="6" fill="#ffffff"/>'
        f'<rect width="3" height="6" fill="{SAVED_COLOR}"/></pattern></defs>',
    ]
    parts += _chart_grid((axis_bottom, axis_top), step, scale, left, width - right, zero)

    every = max(1, len(days) // 20)
    for i, day in enumerate(days):
        x = left + slot * i + slot / 2 - bar - 1
        parts += _day_bars(day, x, zero, bar, scale, models, cells, savings.get(day, (0, 0)))
        if i % every == 0:
            cx, cy = left + slot * i + slot / 2, top + plot_h + 14
            parts.append(
                f'<text x="{cx:.1f}" y="{cy}" class="xlabel" transform="rotate(-35 {cx:.1f} {cy})">{day}</text>'
            )
    parts.append(f'<line x1="{left}" y1="{zero:.1f}" x2="{width - right}" y2="{zero:.1f}" class="axis"/>')
    parts.append("</svg>")
    return "".join(parts) + _chart_legend(models)


def _signed(amounts: tuple[int, int], sign: int) -> int:
    """The sum of the amounts of one sign (1: above $0, -1: below it, as a size)."""
    return sum(a * sign for a in amounts if a * sign > 0)


def _bar(x: float, y: float, h: float, bar: float, fill: str, title: str) -> str:
    return (
        f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar:.1f}" height="{max(h, 0.5):.1f}" fill="{fill}" '
        f'stroke="{SAVED_COLOR if fill.startswith("url") else "none"}"><title>{html.escape(title)}</title></rect>'
    )


def _day_bars(
    day: str,
    x: float,
    base: float,
    bar: float,
    scale: float,
    models: Sequence[str],
    cells: dict[tuple[str, str], int],
    saved: tuple[int, int],
) -> list[str]:
    """One day's two bars up from `base` ($0): its cost stacked by model, and beside it saved and
    would-have-saved, each below $0 instead when the untrimmed chat would have been cheaper."""
    parts = []
    y = base
    for m_index, model in enumerate(models):
        amount = cells.get((day, model), 0)
        if not amount:
            continue
        h = float(picodollars_to_usd(amount)) * scale
        y -= h
        color = CHART_COLORS[m_index % len(CHART_COLORS)]
        parts.append(_bar(x, y, h, bar, color, f"{day} · {model}: {usd(picodollars_to_usd(amount))}"))
    up = down = base
    kinds = (("saved", SAVED_COLOR, "trimming"), ("would have saved (shadow)", "url(#hatch)", "shadow mode"))
    for amount, (gain, fill, loss) in zip(saved, kinds, strict=True):
        if not amount:
            continue
        size = picodollars_to_usd(abs(amount))
        h = float(size) * scale
        if amount > 0:
            up -= h
            parts.append(_bar(x + bar + 2, up, h, bar, fill, f"{day} · {gain}: about {usd(size)}"))
        else:
            title = f"{day} · {loss}: untrimmed about {usd(size)} cheaper (prompt cache)"
            parts.append(_bar(x + bar + 2, down, h, bar, fill, title))
            down += max(h, 0.5)
    return parts


def _chart_grid(
    axis: tuple[Decimal, Decimal], step: Decimal, scale: float, left: int, right: int, zero: float
) -> list[str]:
    """The horizontal grid lines and their dollar labels, from `axis` bottom ($0 or below) to top;
    `zero` is where $0 is drawn."""
    parts = []
    tick = axis[0]
    while tick <= axis[1]:
        y = zero - float(tick) * scale
        label = f"{'-' if tick < 0 else ''}${abs(tick).normalize():f}"
        parts.append(f'<line x1="{left}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" class="grid"/>')
        parts.append(f'<text x="{left - 8}" y="{y + 4:.1f}" class="ylabel">{label}</text>')
        tick += step
    return parts


def _chart_legend(models: Sequence[str]) -> str:
    """The chart's key: one colour a model, then saved and would-have-saved."""
    keys = [(CHART_COLORS[i % len(CHART_COLORS)], m) for i, m in enumerate(models)]
    keys += [
        (SAVED_COLOR, "saved by trimming (estimate)"),
        (
            f"repeating-linear-gradient(45deg,{SAVED_COLOR} 0 3px,#fff 3px 6px)",
            "would have saved, shadow mode (estimate)",
        ),
    ]
    legend = "".join(
        f'<span class="key"><i style="background:{color}"></i>{html.escape(m)}</span>' for color, m in keys
    )
    return f'<div class="legend">{legend}</div>'


def _html_table(rows: Sequence[LedgerRow], by: str) -> str:
    columns = _report_columns(rows)
    head = "".join(f"<th>{html.escape(h)}</th>" for h in [by] + [h for _f, h in columns])
    total = _report_total(rows)
    lines = []
    for row, css in [*((r, "") for r in rows), (total, ' class="total"')]:
        cells = "".join(f"<td>{_report_cell(row, field)}</td>" for field, _h in columns)
        lines.append(f'<tr{css}><th scope="row">{html.escape(row.key)}</th>{cells}</tr>')
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(lines)}</tbody></table>"


_REPORT_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px auto;\
max-width:1120px;color:#222;padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px}
.sub{color:#666;margin:0 0 16px}.cards{display:flex;gap:12px;flex-wrap:wrap;margin:12px 0}
.card{border:1px solid #ddd;border-radius:8px;padding:10px 14px;min-width:140px}
.card b{display:block;font-size:20px}.card span{color:#666;font-size:12px}
svg{width:100%;height:auto;display:block}.grid{stroke:#e5e5e5}.axis{stroke:#888}
.ylabel{font-size:11px;fill:#555;text-anchor:end}.xlabel{font-size:11px;fill:#555;text-anchor:end}
.legend{display:flex;flex-wrap:wrap;gap:6px 16px;margin:6px 0 0 80px;font-size:12px}
.key i{display:inline-block;width:11px;height:11px;border-radius:2px;margin-right:5px;vertical-align:-1px}
table{border-collapse:collapse;width:100%;font-variant-numeric:tabular-nums;font-size:12px}
th,td{padding:4px 6px;border-bottom:1px solid #eee;text-align:right;white-space:nowrap}
thead th{border-bottom:2px solid #ccc;background:#fafafa;white-space:normal;vertical-align:bottom}
tbody th{text-align:left;font-weight:normal;max-width:360px;overflow:hidden;text-overflow:ellipsis}
thead th:first-child{text-align:left}tr.total th,tr.total td{font-weight:600;border-top:2px solid #ccc}
.empty{color:#666}.note{color:#666;font-size:12px}
.scroll{overflow-x:auto;max-width:100%}
"""


def render_html(entries: Sequence[LedgerEntry], since: date | None) -> str:
    """A one-page report an admin can open offline: cost per day by model, totals tables."""
    by_model, by_user, by_day = (ledger_totals(entries, k) for k in ("model", "user", "day"))
    total = _report_total(by_day)
    first = entries[0].day.isoformat() if entries else (since.isoformat() if since else "—")
    last = max((e.day for e in entries), default=None)
    period = f"{first} to {last.isoformat()}" if last else "no usage recorded"
    cards = [
        (cost_cell(total.counters, total.cost_usd, dollar=True), "total cost (priced replies)"),
        (f"{total.counters['requests']:,}", "replies"),
        (f"{total.counters['prompt_tokens']:,}", "prompt tokens"),
        (f"{total.counters['completion_tokens']:,}", "completion tokens"),
        (f"{total.counters['estimated']:,}", "estimated (no or partial usage)"),
        (f"{total.counters['unpriced']:,}", "unpriced (unknown price)"),
        (
            usd(total.usd("cost_saved_picousd")),
            f"saved by trimming (estimate; trimmed replies: {total.counters['trimmed']:,})",
        ),
    ]
    if total.counters["shadow_trimmed"]:
        cards.append(
            (
                usd(total.usd("shadow_cost_saved_picousd")),
                f"would have saved in shadow mode (estimate; replies: {total.counters['shadow_trimmed']:,})",
            )
        )
    card_html = "".join(f'<div class="card"><b>{v}</b><span>{html.escape(t)}</span></div>' for v, t in cards)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>contextwarden usage, {html.escape(period)}</title><style>{_REPORT_CSS}</style></head><body>"
        f'<h1>contextwarden usage</h1><p class="sub">{html.escape(period)} (UTC days)</p>'
        f'<div class="cards">{card_html}</div>'
        f"<h2>Cost per day by model, and savings</h2>{_chart_svg(entries)}"
        f'<h2>By model</h2><div class="scroll">{_html_table(by_model, "model")}</div>'
        f'<h2>By user</h2><div class="scroll">{_html_table(by_user, "user")}</div>'
        f'<h2>By day</h2><div class="scroll">{_html_table(by_day, "day")}</div>'
        '<p class="note">Costs are the provider\'s own figure when it reported one, else tokens × the price table. '
        "Estimated replies had no usage from the backend, or not all of it: contextwarden counted what was "
        "missing. Unpriced replies add tokens but no cost (≥: some replies unpriced; unknown: none priced). "
        "Open WebUI's own background "
        "calls (titles, tags, follow-ups, compaction summaries) pass no filter and are not here. Savings (~) are "
        "estimates: the untrimmed prompt's input cost minus the sent one's, tokens corrected by the model's "
        f"calibration, with the provider's prompt cache priced in ({html.escape(SAVINGS_ASSUMPTION)}; negative "
        "when the untrimmed chat would have been cheaper); shadow mode's are what it would have saved "
        "(those chats were sent whole).</p></body></html>\n"
    )
