"""Generate pricing.json and src/contextwarden/price_data.py from an OpenRouter models dump.

Stdlib only. Usage (from the repository root):

    python build/make_pricing.py [DUMP.json] [--source-date YYYY-MM-DD] [--check]

DUMP defaults to ../shared/fixtures/openrouter_models_2026-08.json (a saved response of
GET https://openrouter.ai/api/v1/models). Output is deterministic: same dump, same bytes.

Rules (the same ones `contextwarden.pricing` applies to a live payload; a test holds them equal):
- Prices are USD per token, kept as the decimal strings OpenRouter gave.
- A key that is missing means 0 (the 2026 API leaves zero prices out), except
  `input_cache_write_1h`, which is null when not listed (5-minute writes are the default).
- A negative (OpenRouter's "-1" = dynamic) or malformed price is null: unknown, never 0.
- `internal_reasoning` is kept only when it is a separate rate (positive and different from
  `completion`); otherwise reasoning tokens are billed as completion tokens and it is null.
- `overrides` with `min_prompt_tokens` become prompt-size tiers, each complete (fields the
  override does not name are inherited from the base price). Time-of-day overrides
  (`utc_start`/`utc_end`) are not applied: the model is flagged `varies_by_time`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from datetime import datetime, timezone
from decimal import Decimal, InvalidOperation
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DUMP = REPO_ROOT / ".." / "shared" / "fixtures" / "openrouter_models_2026-08.json"
DEFAULT_JSON_OUT = REPO_ROOT / "pricing.json"
DEFAULT_PY_OUT = REPO_ROOT / "src" / "contextwarden" / "price_data.py"
SOURCE_URL = "https://openrouter.ai/api/v1/models"

# OpenRouter pricing key -> our field name; tier fields are the same minus internal_reasoning.
PRICE_KEYS = (
    ("prompt", "prompt"),
    ("completion", "completion"),
    ("input_cache_read", "cache_read"),
    ("input_cache_write", "cache_write"),
    ("input_cache_write_1h", "cache_write_1h"),
)
NULL_WHEN_MISSING = frozenset({"cache_write_1h"})
TIER_FIELDS = tuple(field for _key, field in PRICE_KEYS)
COLUMNS = (
    "canonical_slug",
    "context_length",
    "prompt",
    "completion",
    "cache_read",
    "cache_write",
    "cache_write_1h",
    "internal_reasoning",
    "varies_by_time",
    "tiers",
)


def price_text(raw: object) -> str | None:
    """A validated decimal string for one price, or None when negative or malformed."""
    if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
        return None
    text = str(raw).strip()
    try:
        value = Decimal(text)
    except (InvalidOperation, ValueError):
        return None
    if not value.is_finite() or value < 0:
        return None
    return text


def read_prices(pricing: dict, base: dict | None) -> dict:
    """Our price fields from one OpenRouter pricing object (or override, inheriting `base`)."""
    out: dict = {}
    for key, field in PRICE_KEYS:
        if key in pricing:
            out[field] = price_text(pricing[key])
        elif base is not None:
            out[field] = base[field]
        else:
            out[field] = None if field in NULL_WHEN_MISSING else "0"
    return out


def separate_reasoning_rate(pricing: dict, completion: str | None) -> str | None:
    """`internal_reasoning` only when it is a rate of its own (positive, not = completion)."""
    text = price_text(pricing.get("internal_reasoning"))
    if text is None or Decimal(text) == 0:
        return None
    if completion is not None and Decimal(text) == Decimal(completion):
        return None
    return text


def convert_model(entry: dict) -> tuple[str, dict] | None:
    """One catalogue entry -> (id, our record), or None when the entry has no usable id."""
    model_id = entry.get("id")
    pricing = entry.get("pricing")
    if not isinstance(model_id, str) or not model_id or not isinstance(pricing, dict):
        return None
    record = read_prices(pricing, None)
    record["internal_reasoning"] = separate_reasoning_rate(pricing, record["completion"])
    slug = entry.get("canonical_slug")
    record["canonical_slug"] = slug if isinstance(slug, str) and slug else None
    length = entry.get("context_length")
    record["context_length"] = length if isinstance(length, int) and length > 0 else None
    tiers = []
    varies_by_time = False
    overrides = pricing.get("overrides")
    for override in overrides if isinstance(overrides, list) else ():
        if not isinstance(override, dict):
            continue
        if "utc_start" in override or "utc_end" in override:
            varies_by_time = True
            continue
        threshold = override.get("min_prompt_tokens")
        if isinstance(threshold, int) and not isinstance(threshold, bool) and threshold > 0:
            tier = read_prices(override, record)
            tier["min_prompt_tokens"] = threshold
            tiers.append(tier)
    tiers.sort(key=lambda tier: tier["min_prompt_tokens"])
    record["tiers"] = tiers
    record["varies_by_time"] = varies_by_time
    return model_id, record


def default_source_date(dump_path: Path, entries: list) -> str:
    """A YYYY-MM-DD in the file name, else the day of the newest model (a lower bound)."""
    found = re.search(r"(\d{4}-\d{2}-\d{2})", dump_path.name)
    if found:
        return found.group(1)
    created = [e.get("created") for e in entries if isinstance(e.get("created"), int)]
    if not created:
        return "unknown"
    return datetime.fromtimestamp(max(created), tz=timezone.utc).strftime("%Y-%m-%d")


def build_table(dump: dict) -> dict:
    """id -> record for every usable entry of a models dump."""
    entries = dump.get("data") if isinstance(dump, dict) else None
    if not isinstance(entries, list):
        raise SystemExit("not an OpenRouter models dump: no 'data' list")
    models = {}
    for entry in entries:
        converted = convert_model(entry) if isinstance(entry, dict) else None
        if converted is not None:
            models[converted[0]] = converted[1]
    return models


def render_json(models: dict, source_name: str, source_date: str) -> str:
    """pricing.json text: sorted keys, two-space indent, trailing newline."""
    document = {
        "format": 1,
        "generated_by": "build/make_pricing.py",
        "models": models,
        "source": f"{source_name} (saved response of GET {SOURCE_URL})",
        "source_date": source_date,
        "unit": "USD per token",
    }
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


def render_py(models: dict, source_name: str, source_date: str, command: str) -> str:
    """price_data.py text: one model per line as a tuple in COLUMNS order."""
    lines = [
        '"""Bundled price table: USD per token per OpenRouter model id (generated; do not edit)."""',
        "",
        f"# Generated by build/make_pricing.py from {source_name} ({source_date}).",
        f"# Regenerate: {command}",
        "# Columns: see BUNDLED_PRICE_COLUMNS. canonical_slug None = same as the id;",
        "# prices are decimal strings, None = unknown (negative or malformed in the source);",
        "# cache_write_1h None = not listed; internal_reasoning None = billed as completion;",
        "# tiers: (min_prompt_tokens, prompt, completion, cache_read, cache_write, cache_write_1h).",
        "",
        "from __future__ import annotations",
        "",
        '__all__ = ["BUNDLED_PRICES", "BUNDLED_PRICES_DATE", "BUNDLED_PRICE_COLUMNS"]',
        "",
        f"BUNDLED_PRICES_DATE = {source_date!r}",
        f"BUNDLED_PRICE_COLUMNS = {COLUMNS!r}",
        "",
        "BUNDLED_PRICES: dict[str, tuple] = {",
    ]
    for model_id in sorted(models):
        record = models[model_id]
        slug = record["canonical_slug"]
        tiers = tuple(
            (tier["min_prompt_tokens"],) + tuple(tier[field] for field in TIER_FIELDS)
            for tier in record["tiers"]
        )
        row = (
            None if slug == model_id else slug,
            record["context_length"],
            record["prompt"],
            record["completion"],
            record["cache_read"],
            record["cache_write"],
            record["cache_write_1h"],
            record["internal_reasoning"],
            record["varies_by_time"],
            tiers,
        )
        lines.append(f"    {model_id!r}: {row!r},")
    lines.append("}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write (or with --check, compare) pricing.json and price_data.py."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dump", nargs="?", type=Path, default=DEFAULT_DUMP)
    parser.add_argument("--source-date", help="capture date of the dump (YYYY-MM-DD)")
    parser.add_argument("--json-out", type=Path, default=DEFAULT_JSON_OUT)
    parser.add_argument("--py-out", type=Path, default=DEFAULT_PY_OUT)
    parser.add_argument("--check", action="store_true", help="fail when outputs are stale")
    args = parser.parse_args(argv)

    dump = json.loads(args.dump.read_text(encoding="utf-8"))
    models = build_table(dump)
    source_date = args.source_date or default_source_date(args.dump, dump.get("data", []))
    command = "python build/make_pricing.py" + (
        f" --source-date {args.source_date}" if args.source_date else ""
    )
    if args.dump.resolve() != DEFAULT_DUMP.resolve():
        command += f" {args.dump.name}"
    outputs = {
        args.json_out: render_json(models, args.dump.name, source_date),
        args.py_out: render_py(models, args.dump.name, source_date, command),
    }
    stale = [path for path, text in outputs.items()
             if not path.exists() or path.read_text(encoding="utf-8") != text]
    if args.check:
        for path in stale:
            print(f"stale: {path}", file=sys.stderr)
        return 1 if stale else 0
    for path, text in outputs.items():
        path.write_text(text, encoding="utf-8")
    unknown = sum(1 for r in models.values() if r["prompt"] is None or r["completion"] is None)
    tiered = sum(1 for r in models.values() if r["tiers"])
    timed = sum(1 for r in models.values() if r["varies_by_time"])
    print(f"{len(models)} models ({unknown} with unknown prices, {tiered} with prompt-size "
          f"tiers, {timed} time-of-day priced) from {args.dump.name}, dated {source_date}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
