"""Prefix stability across turns, and warm trimming time of a LoCoMo-size chat.

Stability: a simulated 200-turn chat (user and assistant texts taken in order from a LoCoMo
conversation, see bench/quality.py for the data's origin and licence) is trimmed every turn
at a budget of a fifth of the final chat, passing last turn's decision through JSON as the
filter does. Reported: the share of turns whose sent messages begin with the previous turn's
sent messages (so a provider's prompt cache can hit), for each strategy, with and without
`previous`.

Timing: a whole LoCoMo conversation (~600 messages) plus a question, trimmed warm (counts
and term statistics cached), median of repeated runs; also the reuse path and a chat that
fits.

    PYTHONPATH=src python bench/stability.py [path/to/locomo_dev.json] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(ROOT / ".cache" / "tiktoken"))

import contextwarden  # noqa: E402
from contextwarden import TrimDecision, trim_messages  # noqa: E402
from contextwarden.core.tokens import TokenCounter  # noqa: E402
from contextwarden.core.trim import DEFAULT_GROWTH_TURNS  # noqa: E402
from contextwarden.tools.offline import seed_tiktoken_cache  # noqa: E402

import synth  # noqa: E402
from quality import DEFAULT_DATA, conversation_chat  # noqa: E402

MODEL = "gpt-4o"
TURNS = 200
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer briefly and kindly."}


def simulated_turns(samples: list[dict], turns: int) -> list[tuple[str, str]]:
    """(user text, assistant text) pairs: consecutive LoCoMo messages, conversation after conversation."""
    texts = [m["content"] for sample in samples for m in conversation_chat(sample)[0]]
    return [(texts[2 * k], texts[2 * k + 1]) for k in range(turns)]


def stability(
    pairs: list[tuple[str, str]],
    counter: TokenCounter,
    strategy: str,
    use_previous: bool,
    *,
    budget: int | None = None,
    growth_turns: int = DEFAULT_GROWTH_TURNS,
) -> dict:
    final = [SYSTEM] + [{"role": r, "content": t} for u, a in pairs for r, t in (("user", u), ("assistant", a))]
    budget = budget or counter.count_messages(final, MODEL) // 5
    chat = [SYSTEM]
    stored: str | None = None
    last_sent: list[dict] | None = None
    stable = trimmed = reselected = 0
    sent_tokens: list[int] = []
    for user, assistant in pairs:
        chat.append({"role": "user", "content": user})
        previous = TrimDecision.from_json(stored) if stored else None
        result = trim_messages(
            chat,
            max_tokens=budget,
            model=MODEL,
            token_counter=counter,
            strategy=strategy,
            previous=previous if use_previous else None,
            growth_turns=growth_turns,
        )
        if result.changed:
            sent_tokens.append(result.tokens_after)
        sent = copy.deepcopy(result.messages)  # what went over the wire
        if last_sent is not None and sent[: len(last_sent)] == last_sent:
            stable += 1
        trimmed += result.changed
        reselected += result.changed and not result.reused
        stored = result.decision.to_json() if result.decision else None
        last_sent = sent
        chat.append({"role": "assistant", "content": assistant})
    return {
        "strategy": strategy,
        "previous": use_previous,
        "budget": budget,
        "growth_turns": growth_turns,
        "final_tokens": counter.count_messages(final, MODEL),
        "turns": len(pairs),
        "stable_share": round(stable / (len(pairs) - 1), 3),
        "trimmed_turns": trimmed,
        "reselections": reselected,
        "mean_sent_share": round(statistics.fmean(sent_tokens) / budget, 3) if sent_tokens else None,
    }


def long_turns(turns: int) -> list[tuple[str, str]]:
    """(user, assistant) pairs of the speed benchmark's synthetic chat: ~540 tokens a message."""
    chat = [
        m
        for m in synth.make_chat(7, 2 * turns + 1)
        if m["role"] in ("user", "assistant") and isinstance(m.get("content"), str)
    ]
    users = [m["content"] for m in chat if m["role"] == "user"]
    replies = [m["content"] for m in chat if m["role"] == "assistant" and m["content"]]
    return list(zip(users, replies, strict=False))[:turns]  # the chat ends with a question: one user more


def _median_ms(call, repeat: int) -> str:
    """Median wall and CPU milliseconds (CPU time is what the call costs on a busy machine)."""
    wall, cpu = [], []
    for _ in range(repeat):
        started, started_cpu = time.perf_counter(), time.process_time()
        call()
        wall.append((time.perf_counter() - started) * 1000)
        cpu.append((time.process_time() - started_cpu) * 1000)
    return f"{statistics.median(wall):.2f} ms wall, {statistics.median(cpu):.2f} ms CPU"


def timing(samples: list[dict], counter: TokenCounter, repeat: int) -> dict:
    biggest = max((conversation_chat(s)[0] for s in samples), key=len)
    chat = [SYSTEM] + biggest + [{"role": "user", "content": "What did they say about the painting class?"}]
    tokens = counter.count_messages(chat, MODEL)
    budget = 8_000
    first = trim_messages(chat, max_tokens=budget, model=MODEL, token_counter=counter)
    fresh = json.loads(json.dumps(chat))  # new dicts and strings, as each request brings
    grown = fresh + [{"role": "assistant", "content": "Adoption agencies."}, {"role": "user", "content": "And when?"}]
    small = fresh[:200]
    return {
        "messages": len(chat),
        "tokens": tokens,
        "budget": budget,
        "warm_trim_ms": _median_ms(
            lambda: trim_messages(fresh, max_tokens=budget, model=MODEL, token_counter=counter), repeat
        ),
        "warm_reuse_ms": _median_ms(
            lambda: trim_messages(
                grown, max_tokens=budget, model=MODEL, token_counter=counter, previous=first.decision
            ),
            repeat,
        ),
        "warm_recent_ms": _median_ms(
            lambda: trim_messages(fresh, max_tokens=budget, model=MODEL, token_counter=counter, strategy="recent"),
            repeat,
        ),
        "fits_200_messages_ms": _median_ms(
            lambda: trim_messages(small, max_tokens=100_000, model=MODEL, token_counter=counter), repeat
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("data", nargs="?", default=str(DEFAULT_DATA))
    parser.add_argument("--quick", action="store_true", help="no files written")
    args = parser.parse_args()
    seed_tiktoken_cache()
    counter = TokenCounter(block=True)
    assert counter.wait_ready(MODEL)
    samples = json.loads(Path(args.data).read_text())
    pairs = simulated_turns(samples, TURNS)
    runs = [stability(pairs, counter, s, p) for s in ("relevance", "recent") for p in (True, False)]
    runs += [stability(pairs, counter, "relevance", True, growth_turns=0)]
    long_pairs = long_turns(100)
    long_runs = [
        stability(long_pairs, counter, "relevance", True, budget=8_000, growth_turns=g)
        for g in (DEFAULT_GROWTH_TURNS, 0)
    ]
    times = timing(samples, counter, 20 if args.quick else 100)
    meta = {
        "contextwarden": contextwarden.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
    }
    lines = [
        "# Prefix stability and warm trim time",
        "",
        "Generated by `bench/stability.py`. Chat text: LoCoMo (Maharana et al., ACL 2024,",
        "snap-research/locomo, CC BY-NC 4.0); numbers under the same terms.",
        "",
        f"- {meta['machine']}, Python {meta['python']}, contextwarden {meta['contextwarden']}, model {MODEL}",
        f"- {TURNS}-turn chat, {runs[0]['final_tokens']} tokens at the end, budget {runs[0]['budget']} (a fifth), "
        "low_watermark 0.8",
        "",
        "| strategy | previous decision | growth turns | turns whose sent prefix is last turn's | trimmed turns | "
        "re-selections | mean sent / budget |",
        "|---|---|---|---|---|---|---|",
    ]
    row = "| {strategy} | {prev} | {growth_turns} | {stable_share:.1%} | {trimmed_turns} | {reselections} | {fill} |"
    lines += [row.format(**r, prev="yes" if r["previous"] else "no", fill=f"{r['mean_sent_share']:.0%}") for r in runs]
    lines += [
        "",
        f"Long turns: the speed benchmark's synthetic chat ({len(long_pairs)} turns, ~540 tokens a message, "
        f"{long_runs[0]['final_tokens']:,} tokens at the end), budget {long_runs[0]['budget']:,}, low_watermark 0.8:",
        "",
        "| strategy | previous decision | growth turns | turns whose sent prefix is last turn's | trimmed turns | "
        "re-selections | mean sent / budget |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        row.format(**r, prev="yes" if r["previous"] else "no", fill=f"{r['mean_sent_share']:.0%}") for r in long_runs
    ]
    lines += [
        "",
        f"Warm timing (median of repeated runs), {times['messages']} messages / {times['tokens']} tokens, budget "
        f"{times['budget']}:",
        "",
        f"- relevance trim: {times['warm_trim_ms']}",
        f"- reuse of the previous decision (+2 messages): {times['warm_reuse_ms']}",
        f"- recent trim: {times['warm_recent_ms']}",
        f"- a 200-message chat that fits (no scoring): {times['fits_200_messages_ms']}",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.quick:
        out = ROOT / "bench" / "results"
        out.mkdir(parents=True, exist_ok=True)
        (out / "stability.md").write_text(text)
        (out / "stability.json").write_text(
            json.dumps({"meta": meta, "runs": runs, "long_turns": long_runs, "timing": times}, indent=1) + "\n"
        )


if __name__ == "__main__":
    main()
