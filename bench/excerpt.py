"""Pasted documents: how often a fact in an old, pasted document reaches the prompt (issue 15, item 4).

Data: LoCoMo dev (see bench/quality.py for its source and licence; read from a path, never
copied). Each answerable QA item (categories 1-4) whose evidence lies within one stretch of
`DOC_TOKENS` tokens becomes a case: that stretch of the conversation's transcript ("Name: text"
lines, session headers as their own lines, the evidence at a seeded place in it) pasted into a
chat as one user message, a short reply, then the question. The fact is *sent* when every
evidence line reaches the trimmed prompt verbatim (in place or in a recall block).

Two flows, at each budget: `library` trims the chat once (no previous decision); `filter` is
what the Open WebUI filter does: the paste is trimmed as its own turn, its decision passed on
(through JSON) to the question's turn, then a third turn ("Thanks!") whose needs are the same:
`stable` is the share of cases whose third prompt starts with the second one's stable prefix
(`TrimResult.stable_prefix`: all but its recall block and question), and that prefix holds more
than the system prompt (with an excerpt: the excerpt bytes again; the provider's cache hits).

"before" runs the same cases with another source tree (`--baseline-src`, e.g. main before this
change, `git archive <commit> src | tar -x -C /tmp/base`) in a child process; "after" with this
tree's `src`. Both in one run, side by side.

    git archive 64ca62c src | tar -x -C /tmp/base
    PYTHONPATH=src python bench/excerpt.py --baseline-src /tmp/base/src --baseline-name 64ca62c [--limit N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(ROOT / ".cache" / "tiktoken"))
DEFAULT_DATA = ROOT.parent / "shared" / "bench" / "locomo-dev" / "locomo_dev.json"
BUDGETS = (2_000, 4_000)
DOC_TOKENS = 6_000
MODEL = "gpt-4o"
ANSWERABLE = (1, 2, 3, 4)
SEED = 15


def transcript(sample: dict) -> tuple[list[str], dict[str, int]]:
    """The conversation as lines ("[Session N - date]" headers, "Name: text"), and dia_id -> line."""
    conv = sample["conversation"]
    sessions = sorted(int(k.split("_")[1]) for k in conv if k.startswith("session_") and k.count("_") == 1 and conv[k])
    lines: list[str] = []
    where: dict[str, int] = {}
    for number in sessions:
        lines.append(f"[Session {number} - {conv.get(f'session_{number}_date_time', '')}]")
        for turn in conv[f"session_{number}"]:
            text = f"{turn['speaker']}: {turn['text']}"
            if turn.get("blip_caption"):
                text += f" [shares an image: {turn['blip_caption']}]"
            where[turn["dia_id"]] = len(lines)
            lines.append(text)
    return lines, where


def cases(path: Path, counter, limit: int | None) -> list[dict]:
    """One case per answerable QA item whose evidence fits one `DOC_TOKENS` stretch."""
    rng = random.Random(SEED)
    out = []
    for sample in json.loads(path.read_text("utf-8")):
        lines, where = transcript(sample)
        costs = [counter.count_text(line + "\n", MODEL) for line in lines]
        for qa in sample["qa"]:
            evidence = [where[e] for e in qa.get("evidence", []) if e in where]
            if qa.get("category") not in ANSWERABLE or not evidence:
                continue
            first, last = min(evidence), max(evidence)
            if sum(costs[first : last + 1]) > DOC_TOKENS * 0.9:
                continue
            start = _start(costs, first, last, rng)
            stop = start
            total = 0
            while stop < len(lines) and total < DOC_TOKENS:
                total += costs[stop]
                stop += 1
            if stop <= last or total < DOC_TOKENS * 0.8:
                continue
            out.append(
                {
                    "document": "\n".join(lines[start:stop]),
                    "question": qa["question"],
                    "evidence": [lines[i] for i in sorted(set(evidence))],
                    "category": qa["category"],
                }
            )
    rng.shuffle(out)
    return out[:limit] if limit else out


def _start(costs: list[int], first: int, last: int, rng: random.Random) -> int:
    """A seeded first line such that the stretch holds `first..last` with the evidence anywhere in it."""
    earliest = first
    total = sum(costs[first : last + 1])
    while earliest > 0 and total + costs[earliest - 1] <= DOC_TOKENS * 0.9:
        earliest -= 1
        total += costs[earliest]
    return rng.randint(earliest, first)


def chat_of(case: dict) -> list[dict]:
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Here is the transcript of our chats:\n\n" + case["document"]},
        {"role": "assistant", "content": "I have read the transcript. What would you like to know?"},
        {"role": "user", "content": case["question"]},
    ]


def sentence_embedder(model_dir: str):
    """An `embed` for `trim_messages` from a local sentence-transformers model (embeds on demand;
    the trim's own vector cache keeps each text's vector)."""
    from sentence_transformers import SentenceTransformer  # the Open WebUI venv has it

    model = SentenceTransformer(model_dir, device="cpu")
    return lambda texts: model.encode(texts, batch_size=64, normalize_embeddings=True).tolist()


def measure(path: Path, limit: int | None, embed_model: str | None = None) -> dict:
    """Run every case in both flows at each budget with whichever contextwarden is importable."""
    from contextwarden import TrimDecision, trim_messages
    from contextwarden.core.tokens import TokenCounter

    counter = TokenCounter(block=True)
    all_cases = cases(path, counter, limit)
    result: dict = {"cases": len(all_cases)}
    embed = sentence_embedder(embed_model) if embed_model else None
    started = time.perf_counter()
    for budget in BUDGETS:
        options = {"max_tokens": budget, "model": MODEL, "token_counter": counter, "embed": embed}
        library = filter_flow = stable = excerpts = excerpt_tokens = 0
        for case in all_cases:
            chat = chat_of(case)
            library += _sent(trim_messages(chat, **options).messages, case)
            first = trim_messages(chat[:2], **options)
            previous = TrimDecision.from_json(first.decision.to_json()) if first.decision else None
            second = trim_messages(chat, previous=previous, **options)
            filter_flow += _sent(second.messages, case)
            if 1 in getattr(second, "excerpted", ()):
                excerpts += 1
                excerpt_tokens += counter.count_message(second.messages[1], MODEL)
            grown = chat + [{"role": "assistant", "content": "Glad to help."}, {"role": "user", "content": "Thanks!"}]
            decision = TrimDecision.from_json(second.decision.to_json()) if second.decision else None
            third = trim_messages(grown, previous=decision, **options)
            keep = second.stable_prefix  # what the design promises the next turn sends again
            stable += keep >= 2 and third.messages[:keep] == second.messages[:keep]
        result[str(budget)] = {
            "library": library,
            "filter": filter_flow,
            "stable": stable,
            "excerpt_tokens": round(excerpt_tokens / excerpts) if excerpts else 0,
        }
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def _sent(messages: list[dict], case: dict) -> bool:
    text = "\n".join(str(m.get("content")) for m in messages)
    return all(line in text for line in case["evidence"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--baseline-src", type=Path, required=True)
    parser.add_argument("--baseline-name", default=None, help="what the baseline is, for the report (e.g. a commit)")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--embed-model", default=None, help="a sentence-transformers folder: adds runs with embed=")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "excerpt.md")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.data, args.limit, args.embed_model)))
        return
    runs = {}
    modes = [""] + (["embed"] if args.embed_model else [])
    for mode in modes:
        for label, src in (("before", args.baseline_src), ("after", ROOT / "src")):
            command = [sys.executable, __file__, "--child", "--data", str(args.data), "--baseline-src", str(src)]
            command += ["--limit", str(args.limit)] if args.limit else []
            command += ["--embed-model", args.embed_model] if mode else []
            env = {**os.environ, "PYTHONPATH": str(src)}
            run = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
            runs[label + mode] = json.loads(run.stdout.splitlines()[-1])
    report = render(runs, args)
    args.output.write_text(report, "utf-8")
    print(report)


def render(runs: dict, args: argparse.Namespace) -> str:
    n = runs["after"]["cases"]
    rows = []
    for mode, budget in [(m, b) for m in ("", "embed") if "after" + m in runs for b in BUDGETS]:
        b, a = runs["before" + mode][str(budget)], runs["after" + mode][str(budget)]
        name = f"{Path(args.embed_model).name}, " if mode else ""
        rows.append(
            f"| {name}{budget:,} | {b['library'] / n:.3f} | {a['library'] / n:.3f} | {b['filter'] / n:.3f} "
            f"| {a['filter'] / n:.3f} | {b['stable'] / n:.3f} | {a['stable'] / n:.3f} | {a['excerpt_tokens']:,} |"
        )
    load = os.getloadavg()
    return "\n".join(
        [
            "# Pasted documents: the fact sent (bench/excerpt.py)",
            "",
            f"{n} cases from LoCoMo dev (categories 1-4, evidence within one stretch): a ~{DOC_TOKENS:,}-token",
            "transcript stretch pasted as one user message, a short reply, then the question; model "
            f"{MODEL} (o200k). Share of cases whose evidence lines all reach the prompt; `stable`: the",
            'next turn ("Thanks!") starts with this prompt\'s stable prefix, longer than the system prompt',
            "(filter flow). `excerpt tokens`: the mean size of the excerpt sent (filter flow, after): a",
            f"blind cut of that size would hold a given line about that share of {DOC_TOKENS:,} tokens.",
            "",
            "| budget | library before | library after | filter before | filter after | stable before | stable after "
            "| excerpt tokens |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
            f"before: {args.baseline_name or args.baseline_src}; after: this tree. "
            "Run time (s): " + ", ".join(f"{k or 'lexical'} {v['seconds']}" for k, v in runs.items()) + "; "
            f"load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} (2 cores, shared).",
            "",
        ]
    )


if __name__ == "__main__":
    main()
