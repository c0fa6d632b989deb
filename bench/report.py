"""Markdown for bench/results/speed.md from the JSON that bench/speed.py measured."""

from __future__ import annotations

from typing import Any

LABELS = {
    "cw_cold": "contextwarden cold",
    "cw_recent_cold": "contextwarden cold, strategy valve = recent (no scoring)",
    "cw_warm": "contextwarden warm, re-selecting (same history, another new question each rep)",
    "cw_next": "contextwarden next turn (the chat goes on; previous decision applies; the reply went through outlet)",
    "lethes_cold": "lethes 1.0.2 (cold chat)",
    "lethes_warm": "lethes 1.0.2 (warm chat)",
    "naive_cold": "naive recent-fit (cold chat)",
    "naive_warm": "naive recent-fit (warm chat)",
    "floor_cold": "floor: encode all text",
    "floor_warm": "floor: encode 2 new msgs",
}


def _ms(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}" if value >= 1 else f"{value:.3f}"


def _cell(stats: dict[str, float] | None) -> str:
    if not stats:
        return "—"
    return f"{_ms(stats['median_ms'])} ({_ms(stats['q1_ms'])}–{_ms(stats['q3_ms'])})"


def targets(result: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    sizes = result["timing"]["sizes"]
    rows: list[tuple[str, str, bool | None]] = []
    s200 = sizes.get("200")
    if s200:
        warm = s200["systems"]["cw_next"]["median_ms"]
        rows.append(
            (
                "next turn of a 200-message chat <= 5 ms median (issue 14: the relevance check and recall every turn)",
                f"{warm:.2f} ms",
                warm <= 5.0,
            )
        )
        rows.append(("info: the target before the per-turn recall was < 2 ms", f"{warm:.2f} ms", None))
        for kind, label in (("reused", "the previous selection sent again"), ("reselected", "a new selection made")):
            part = s200.get("next_by_kind", {}).get(kind)
            if part:
                rows.append(
                    (
                        f"info: next turns where {label}",
                        f"{part['turns']} of {s200['reps']} turns, median {part['median_ms']:.2f} ms",
                        None,
                    )
                )
        for kind, label in (
            ("whole", "whose question reads as one about the documents as a whole (never carried)"),
            ("other", "whose question does not"),
        ):
            part = s200.get("next_by_question", {}).get(kind)
            if part:
                rows.append(
                    (
                        f"info: next turns {label}",
                        f"{part['turns']} of {s200['reps']} turns ({part['reused']} sent the previous selection "
                        f"again), median {part['median_ms']:.2f} ms",
                        None,
                    )
                )
        rows.append(
            (
                "info: outlet before it (logs usage, counts the reply the next turn sends back)",
                f"{s200['outlet_median_ms']:.2f} ms",
                None,
            )
        )
        reselect = s200["systems"]["cw_warm"]["median_ms"]
        rows.append(("info: warm 200 when the selection must be redone for a new question", f"{reselect:.2f} ms", None))
        lr = s200["ratios"].get("lethes_warm/cw_next")
        if lr:
            rows.append(
                (
                    "warm 200 ≥ 20x faster than lethes (paired median)",
                    f"{lr['median']:.0f}x (IQR {lr['q1']:.0f}–{lr['q3']:.0f})",
                    lr["median"] >= 20,
                )
            )
        else:
            rows.append(("warm 200 ≥ 20x faster than lethes", "lethes did not run", None))
    for n, s in sizes.items():
        r = s["ratios"]["cw_cold/floor_cold"]
        rows.append(
            (
                f"cold {n} messages within 1.5x of the tokenizer floor",
                f"{r['median']:.2f}x (IQR {r['q1']:.2f}–{r['q3']:.2f})",
                r["median"] <= 1.5,
            )
        )
    recent = [
        (n, s["ratios"]["cw_recent_cold/floor_cold"])
        for n, s in sizes.items()
        if "cw_recent_cold/floor_cold" in s["ratios"]
    ]
    if recent:
        rows.append(
            (
                "info: cold with the strategy valve set to recent (no scoring), × the floor",
                "; ".join(f"{int(n):,} messages {r['median']:.2f}x" for n, r in recent),
                None,
            )
        )
    if "200" in sizes and "1000" in sizes:
        per = {
            n: sizes[n]["systems"]["cw_cold"]["median_ms"] / sizes[n]["tokens_cold_median"] * 1000
            for n in ("200", "1000")
        }
        floor = {
            n: sizes[n]["systems"]["floor_cold"]["median_ms"] / sizes[n]["tokens_cold_median"] * 1000
            for n in ("200", "1000")
        }
        growth, floor_growth = per["1000"] / per["200"], floor["1000"] / floor["200"]
        # The tokenizer is linear; its own per-token drift between the two sizes is the machine's.
        rows.append(
            (
                "1,000 messages: cold cost per new token no worse than at 200 (linear), "
                "against the tokenizer's own drift",
                f"{per['200']:.3f} → {per['1000']:.3f} ms per 1k new tokens ({growth:.2f}x; the floor's "
                f"{floor_growth:.2f}x: {growth / floor_growth:.2f}x relative)",
                growth / floor_growth <= 1.15,
            )
        )
        c200, c1000 = (
            sizes["200"]["systems"]["cw_warm"]["cpu_median_ms"],
            sizes["1000"]["systems"]["cw_warm"]["cpu_median_ms"],
        )
        rows.append(
            (
                "info: warm turn vs history size (same 2 new messages; re-keys every message), thread CPU",
                f"{c200:.2f} → {c1000:.2f} ms ({c1000 / c200:.1f}x for 5x the history)",
                None,
            )
        )
    traced = next((m for m in result["memory"] if m["traced"]), None)
    if traced and len(traced["points"]) >= 2:
        cap = sum(traced["limits"]["counter_cache_size"])
        full = [p for p in traced["points"] if p["counter_entries"] >= cap]
        last = traced["points"][-1]
        if full:
            low, high = min(p["retained_kib"] for p in full), max(p["retained_kib"] for p in full)
            value = (
                f"counter full ({cap:,}) from {full[0]['chats']:,} chats on: retained "
                f"{low / 1024:.1f}–{high / 1024:.1f} MiB "
                f"up to {last['chats']:,} chats ({last['messages_seen']:,} messages)"
            )
            ok = len(full) >= 3 and full[-1]["retained_kib"] <= high and (high - low) / high < 0.35
        else:
            value, ok = f"cache not full yet ({last['counter_entries']:,} of {cap:,})", None
        rows.append(("retained memory bounded by cache limits", value, ok))
    return rows


def write_report(result: dict[str, Any]) -> str:
    m = result["machine"]
    sizes = result["timing"]["sizes"]
    lines = [
        "# contextwarden speed and memory",
        "",
        f"Generated by `bench/speed.py`. Budget {result['budget']:,} tokens, "
        f"model `{result['model']}` (o200k_base, exact).",
        f"Machine: {m['nproc']} cores (`nproc`), {m['cpu']}, Python {m['python']}, tiktoken {m['tiktoken']}, "
        f"lethes {m['lethes']}, pydantic {m['pydantic']}; {m['platform']}.",
        f"Tree: {m['branch']} @ {m['commit']}, {m.get('bundle', 'open_webui_filter.py')} sha256 {m['bundle_sha256']}"
        f"{' (uncommitted changes)' if m['bundle_uncommitted_changes'] else ''}. "
        f"Load average {m['loadavg_start'][0]:.2f} at start, {m['loadavg_end'][0]:.2f} at end (shared machine); "
        f"{m['seconds']:,} s.",
        "",
        "All systems ran in one process, round-robin inside each repetition (order rotated), each on its own",
        "fresh JSON copy of the body. Times are wall-clock milliseconds: median (IQR). *Cold* = a chat the",
        "filter has never seen (new texts, same warmed-up Filter instance); *warm* = the chat it saw last turn",
        "plus two new messages (assistant reply + new question). Floors encode exactly that new text once",
        "with tiktoken `encode_ordinary`. lethes has no cross-turn cache, so its warm chat is as cold as any.",
        "*Next turn*: chats that go on turn after turn (same chat id; each turn adds the reply and a new question),",
        "each seen once before its first timed turn and run for a few turns around the nominal size ("
        + ", ".join(
            f"{int(n):,}: {s['next_messages'][0]:,}–{s['next_messages'][1]:,} messages"
            for n, s in sizes.items()
            if "next_messages" in s
        )
        + "). As in Open WebUI, each reply first goes through `outlet` (timed apart), which counts the reply text,",
        "so the next request encodes only the new question.",
        "",
        "## Summary",
        "",
        "| messages | tokens | contextwarden cold | contextwarden next turn | contextwarden re-select | lethes | "
        "naive recent-fit | floor cold | floor warm |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, s in sizes.items():
        sy = s["systems"]
        lethes = sy.get("lethes_warm")
        lines.append(
            f"| {int(n):,} | {s['tokens_cold_median']:,.0f} | {_ms(sy['cw_cold']['median_ms'])} | "
            f"{_ms(sy['cw_next']['median_ms'])} | {_ms(sy['cw_warm']['median_ms'])} | "
            f"{_ms(lethes['median_ms']) if lethes else '—'} | {_ms(sy['naive_warm']['median_ms'])} | "
            f"{_ms(sy['floor_cold']['median_ms'])} | {_ms(sy['floor_warm']['median_ms'])} |"
        )
    lines += ["", "## Targets", "", "| target | measured | met |", "|---|---|:-:|"]
    for name, value, ok in targets(result):
        lines.append(f"| {name} | {value} | {'yes' if ok else 'n/a' if ok is None else '**no**'} |")
    lines += ["", "## All timings (ms, median and IQR)", ""]
    header = "| system | " + " | ".join(f"{int(n):,} msgs ({s['reps']} reps)" for n, s in sizes.items()) + " |"
    lines += [header, "|---|" + "---:|" * len(sizes)]
    for system, label in LABELS.items():
        lines.append(f"| {label} | " + " | ".join(_cell(s["systems"].get(system)) for s in sizes.values()) + " |")
    lines += [
        "",
        "Paired ratios (per repetition, then median):",
        "",
        "| ratio | " + " | ".join(f"{int(n):,}" for n in sizes) + " |",
        "|---|" + "---:|" * len(sizes),
    ]
    for label in next(iter(sizes.values()))["ratios"]:
        lines.append(
            f"| {label} | "
            + " | ".join(f"{s['ratios'][label]['median']:.2f}" if label in s["ratios"] else "—" for s in sizes.values())
            + " |"
        )
    lines += ["", "Next turns by what they did (turns, median ms):", ""]
    lines += ["| messages | previous selection again | new selection or whole chat |", "|---:|---:|---:|"]
    for n, s in sizes.items():
        kinds = s.get("next_by_kind", {})
        cells = [
            f"{k['turns']} turns, {_ms(k['median_ms'])}" if k else "—"
            for k in (kinds.get("reused"), kinds.get("reselected"))
        ]
        lines.append(f"| {int(n):,} | {cells[0]} | {cells[1]} |")
    lines += [
        "",
        "contextwarden thread CPU time, median (fastest), ms: "
        + "; ".join(
            f"{int(n):,} msgs: warm {s['systems']['cw_warm']['cpu_median_ms']:.2f} "
            f"({s['systems']['cw_warm']['cpu_min_ms']:.2f}), "
            f"cold {s['systems']['cw_cold']['cpu_median_ms']:.1f} ({s['systems']['cw_cold']['cpu_min_ms']:.1f})"
            for n, s in sizes.items()
        )
        + ". Wall time on a loaded shared machine includes waiting for a core; the"
        " fastest repetitions show the cost without that wait.",
    ]
    lines += [
        "",
        "## What each sent (first repetition)",
        "",
        "| messages | system | kept of | last user kept | tokens sent (o200k + 4/msg) |",
        "|---:|---|---:|:-:|---:|",
    ]
    for n, s in sizes.items():
        for system, c in s["checks"].items():
            if system.startswith(("cw", "lethes", "naive")):
                lines.append(
                    f"| {int(n):,} | {LABELS[system]} | {c['messages_out']} / {c['messages_in']} | "
                    f"{'yes' if c['last_user_kept'] else 'no'} | {c['sent_tokens_o200k']:,} |"
                )
    if result["memory"]:
        lines += ["", "## Memory: one Filter instance, distinct chats of 20/40/60 messages (~120 tokens each)", ""]
        traced = next((x for x in result["memory"] if x["traced"]), None)
        plain = next((x for x in result["memory"] if not x["traced"]), None)
        if traced:
            lim = traced["limits"]
            lines.append(
                f"Limits: TokenCounter cache_size = {', '.join(f'{c:,}' for c in lim['counter_cache_size'])} entries; "
                f"MemoryStore max_keys = {', '.join(f'{c:,}' for c in lim['memory_store_max_keys']) or 'none'}"
                + (f"; relevance term cache {lim['term_cache_size']:,} messages" if "term_cache_size" in lim else "")
                + (
                    f" and {lim['term_cache_max_terms']:,} (message, term) entries"
                    if "term_cache_max_terms" in lim
                    else ""
                )
                + (
                    f"; fingerprint cache {lim['fingerprint_cache_size']:,} messages"
                    if "fingerprint_cache_size" in lim
                    else ""
                )
                + "."
            )
            lines += [
                "",
                "| chats | messages seen | counter entries | store keys | term cache (messages / entries) | "
                "retained (tracemalloc) | RSS growth (separate run, no tracemalloc) |",
                "|---:|---:|---:|---:|---:|---:|---:|",
            ]
            rss = {p["chats"]: p["rss_delta_kib"] for p in (plain["points"] if plain else [])}
            for p in traced["points"]:
                r = rss.get(p["chats"])
                lines.append(
                    f"| {p['chats']:,} | {p['messages_seen']:,} | {p['counter_entries']:,} | {p['store_keys']:,} | "
                    f"{p.get('term_cache_entries', 0):,} / {p.get('term_cache_terms', 0):,} | "
                    f"{p['retained_kib'] / 1024:.1f} MiB | {f'{r / 1024:.1f} MiB' if r is not None else '—'} |"
                )
            lines += [
                "",
                f"Peak traced allocation during the run: {traced['peak_during_run_kib'] / 1024:.1f} MiB "
                "above the loaded baseline. One cold 1,000-message request "
                f"(body {traced['that_request_body_json_kib'] / 1024:.1f} MiB as JSON) peaks at "
                f"{traced['peak_one_1000_message_cold_request_kib'] / 1024:.1f} MiB of transient allocation.",
            ]
            lines += [
                "",
                "Retained memory steps up once after the counter's cache is full: under constant churn (insert",
                "one, evict the oldest) CPython's dict keeps deleted slots until it resizes, so the LRU table grows",
                "one size and then stays. A bare OrderedDict with the same keys shows the same step (12.6 →",
                "16.1 MiB for 50,000 entries) and no growth after it over 200,000 inserts.",
            ]
        if plain:
            lines.append(
                f"RSS run: baseline {plain['base_rss_kib'] / 1024:.0f} MiB after loading (encodings included); "
                f"high-water mark {plain['hwm_delta_kib'] / 1024:.1f} MiB above it."
            )
    return "\n".join(lines) + "\n"
