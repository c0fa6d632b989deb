"""Selection quality: evidence recall at a token budget on LoCoMo (dev half).

Data: LoCoMo by Maharana et al., "Evaluating Very Long-Term Conversational Memory of LLM
Agents", ACL 2024, snap-research/locomo; licence CC BY-NC 4.0 (non-commercial). It is read
from a path (default `../shared/bench/locomo-dev/locomo_dev.json` beside the repository) and
never copied here; the numbers written to bench/results/ are under the same terms.

Each conversation becomes one chat (speaker A = user, speaker B = assistant, one message
"Name: text" per turn, an image turn gets its caption, each session opens with a
"[Session N - date]" header). Each QA item is a case: that chat plus the question as the last
user message; its evidence dia_ids map to message indices. For budgets 1k/2k/4k/8k it reports,
per category, evidence recall and the share of cases with all evidence kept, for
contextwarden (`trim_messages`, relevance strategy), the "most recent" and plain BM25
baselines, and ablations (one signal off at a time).

    PYTHONPATH=src python bench/quality.py [path/to/locomo_dev.json] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import platform
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(ROOT / ".cache" / "tiktoken"))

import tiktoken  # noqa: E402

import contextwarden  # noqa: E402
from contextwarden.conversation import read_conversation  # noqa: E402
from contextwarden.offline import seed_tiktoken_cache  # noqa: E402
from contextwarden.relevance import DEFAULT_RELEVANCE_WEIGHTS, score_messages  # noqa: E402
from contextwarden.selection import choose_indices  # noqa: E402
from contextwarden.tokens import TOKENS_PER_REPLY, TokenCounter  # noqa: E402
from contextwarden.trim import trim_messages  # noqa: E402

DEFAULT_DATA = ROOT.parent / "shared" / "bench" / "locomo-dev" / "locomo_dev.json"
BUDGETS = (1_000, 2_000, 4_000, 8_000)
MODEL = "gpt-4"  # cl100k_base, as the dataset's reference numbers use
CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial"}
ANSWERABLE = (1, 2, 3, 4)
W = DEFAULT_RELEVANCE_WEIGHTS
ABLATIONS = {
    "no context turns": dataclasses.replace(W, context_weight=0.0),
    "no Q&A pairing": dataclasses.replace(W, pair_share=0.0, pair_back=0.0),
    "no neighbours": dataclasses.replace(W, neighbour_share=0.0),
    "no turn neighbours": dataclasses.replace(W, turn_share=0.0),
    "no date headers": dataclasses.replace(W, header_share=0.0),
    "no recency": dataclasses.replace(W, recency=0.0),
    "no suffix folding": dataclasses.replace(W, fold_suffixes=False),
    "BM25 only (our tokens)": dataclasses.replace(
        W,
        context_weight=0.0,
        pair_share=0.0,
        pair_back=0.0,
        neighbour_share=0.0,
        header_share=0.0,
        recency=0.0,
        turn_share=0.0,
    ),
}


# -- the data ------------------------------------------------------------------------------


def conversation_chat(sample: dict) -> tuple[list[dict], dict[str, int]]:
    """The chat for one LoCoMo conversation, and dia_id -> message index."""
    conv = sample["conversation"]
    roles = {conv["speaker_a"]: "user", conv["speaker_b"]: "assistant"}
    sessions = sorted(
        (int(k.split("_")[1]) for k in conv if re.fullmatch(r"session_\d+", k) and conv[k]),
    )
    chat: list[dict] = []
    where: dict[str, int] = {}
    for number in sessions:
        header = f"[Session {number} - {conv.get(f'session_{number}_date_time', '')}]"
        for k, turn in enumerate(conv[f"session_{number}"]):
            role = roles.get(turn["speaker"], "assistant")
            text = f"{turn['speaker']}: {turn['text']}"
            if turn.get("blip_caption"):
                text += f" [shares an image: {turn['blip_caption']}]"
            if k == 0:
                if chat and chat[-1]["role"] == role:
                    chat.append({"role": "assistant" if role == "user" else "user", "content": header})
                else:
                    text = f"{header} {text}"
            where[turn["dia_id"]] = len(chat)
            chat.append({"role": role, "content": text})
    return chat, where


# Split halves reported apart (conversations 1-2 and 3 on), to show a change is no fit to a few chats.
SPLIT_AT = 2

# Exchanges merged into one block of the reshaped chats: mostly short, some long.
RESHAPE_BLOCK_SIZES = (1, 1, 2, 3, 5)


def reshaped_chat(sample: dict) -> tuple[list[dict], dict[str, int]]:
    """The same conversation shaped like chats people type, and dia_id -> message index.

    No session headers and no "Name:" prefixes; runs of 1-5 consecutive exchanges (seeded by
    the sample id) merged into one multi-line message per speaker, so messages vary from one
    line to ten and evidence often sits inside a long message. A second dev set for rules
    that must hold on conversations unlike LoCoMo's one-line turns.
    """
    conv = sample["conversation"]
    roles = {conv["speaker_a"]: "user", conv["speaker_b"]: "assistant"}
    sessions = sorted(int(k.split("_")[1]) for k in conv if re.fullmatch(r"session_\d+", k) and conv[k])
    turns = [turn for number in sessions for turn in conv[f"session_{number}"]]
    rng = random.Random(sample.get("sample_id", ""))
    chat: list[dict] = []
    where: dict[str, int] = {}
    start = 0
    while start < len(turns):
        block = turns[start : start + 2 * rng.choice(RESHAPE_BLOCK_SIZES)]
        start += len(block)
        lines: dict[str, list[str]] = {}
        ids: dict[str, list[str]] = {}
        for turn in block:
            role = roles.get(turn["speaker"], "assistant")
            caption = f" [shares an image: {turn['blip_caption']}]" if turn.get("blip_caption") else ""
            lines.setdefault(role, []).append(turn["text"] + caption)
            ids.setdefault(role, []).append(turn["dia_id"])
        for role, text in lines.items():  # in the order the speakers first spoke
            where.update(dict.fromkeys(ids[role], len(chat)))
            chat.append({"role": role, "content": "\n".join(text)})
    return chat, where


SHAPES = {"locomo": conversation_chat, "reshaped": reshaped_chat}


def load_cases(path: Path, shape: str = "locomo") -> list[dict]:
    """One case per QA item with resolvable evidence: chat, question, evidence indices."""
    cases = []
    for number, sample in enumerate(json.loads(path.read_text())):
        chat, where = SHAPES[shape](sample)
        for qa in sample["qa"]:
            ids = [d for e in qa.get("evidence", []) for d in re.split(r"[;,\s]+", str(e)) if d]
            evidence = sorted({where[d] for d in ids if d in where})
            if not evidence:
                continue
            cases.append(
                {
                    "chat": chat,
                    "question": qa["question"],
                    "evidence": evidence,
                    "category": qa["category"],
                    "half": "1-2" if number < SPLIT_AT else f"{SPLIT_AT + 1}-",
                }
            )
    return cases


# -- baselines -----------------------------------------------------------------------------


def recent_baseline(costs: list[int], budget: int) -> set[int]:
    kept, left = set(), budget
    for i in range(len(costs) - 1, -1, -1):
        if costs[i] > left:
            break
        kept.add(i)
        left -= costs[i]
    return kept


def _plain_terms(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def bm25_baseline(counts: list[Counter], question: list[str], costs: list[int], budget: int) -> set[int]:
    """Plain Okapi BM25 (k1 1.2, b 0.75) against the question, best first while it fits."""
    n = len(counts)
    texts = [sum(c.values()) for c in counts]
    avg = sum(texts) / max(n, 1)
    df = {q: sum(1 for c in counts if q in c) for q in set(question)}
    scores = []
    for c, t in zip(counts, texts, strict=True):
        s = 0.0
        for q in set(question):
            if c.get(q):
                idf = math.log(1 + (n - df[q] + 0.5) / (df[q] + 0.5))
                s += idf * c[q] * 2.2 / (c[q] + 1.2 * (0.25 + 0.75 * t / avg))
        scores.append(s)
    kept, left = set(), budget
    for i in sorted(range(n), key=lambda i: (-scores[i], -i)):
        if costs[i] <= left:
            kept.add(i)
            left -= costs[i]
    return kept


# -- the run -------------------------------------------------------------------------------


def sentence_embedder(model_dir: str, chats: Iterable[Sequence[dict]], texts: Iterable[str] = ()):
    """An `embed` function for `trim_messages` from a local sentence-transformers model.

    Every text the chats' messages are embedded as (`semantic.embed_texts`: pieces and context
    windows) and every one of `texts` (in its pieces) is embedded once, up front, in batches;
    vectors are kept in bench/.cache by the texts' hash, so later runs skip it. The function
    then looks vectors up, and embeds on the spot what it was not given up front.
    """
    import numpy as np  # the Open WebUI venv has numpy, torch and sentence-transformers
    from sentence_transformers import SentenceTransformer

    from contextwarden.semantic import embed_pieces, embed_texts

    wanted = sorted(
        {piece for t in texts for piece in embed_pieces({"content": t})}.union(*(embed_texts(c) for c in chats))
    )
    digest = hashlib.sha256(("\x00".join(wanted) + model_dir).encode()).hexdigest()[:16]
    cache = ROOT / "bench" / ".cache" / f"vectors-{digest}.npy"
    model = functools.cache(lambda: SentenceTransformer(model_dir, device="cpu"))  # loaded on first need

    def encode(batch: list[str]):
        return model().encode(batch, batch_size=64, normalize_embeddings=True, show_progress_bar=False)

    if cache.exists():
        matrix = np.load(cache)
    else:
        matrix = encode(wanted)
        cache.parent.mkdir(parents=True, exist_ok=True)
        np.save(cache, matrix)
    table = {text: row.tolist() for text, row in zip(wanted, matrix, strict=True)}

    def embed(batch: list[str]) -> list[list[float]]:
        missing = [text for text in dict.fromkeys(batch) if text not in table]
        if missing:
            table.update((text, row.tolist()) for text, row in zip(missing, encode(missing), strict=True))
        return [table[text] for text in batch]

    return embed


def run(path: Path, quick: bool, shape: str = "locomo", embed_model: str | None = None) -> dict:
    counter = TokenCounter(block=True)
    assert counter.wait_ready(MODEL)
    cases = load_cases(path, shape)
    if quick:
        cases = cases[::3]
    methods = ["contextwarden", "most recent", "BM25", *ABLATIONS]
    embed = None
    if embed_model:
        chats = {id(c["chat"]): c["chat"] for c in cases}.values()
        embed = sentence_embedder(embed_model, chats, sorted({c["question"] for c in cases}))
        methods.insert(1, "contextwarden + embedder")
    hits: dict[tuple[str, int, int], list[tuple[float, bool]]] = {}
    plain_cache: dict[int, tuple[list[list[str]], list[int]]] = {}
    mismatches = 0
    for case in cases:
        chat = case["chat"] + [{"role": "user", "content": case["question"]}]
        q = len(chat) - 1
        if id(case["chat"]) not in plain_cache:
            plain_cache[id(case["chat"])] = (
                [Counter(_plain_terms(m["content"])) for m in case["chat"]],
                [counter.count_message(m, MODEL) for m in case["chat"]],
            )
        texts, history_costs = plain_cache[id(case["chat"])]
        costs = history_costs + [counter.count_message(chat[q], MODEL)]
        conversation = read_conversation(chat)
        scores = {name: score_messages(chat, question=q, weights=w) for name, w in ABLATIONS.items()}
        for budget in BUDGETS:
            room = budget - TOKENS_PER_REPLY - costs[q]
            result = trim_messages(chat, max_tokens=budget, model=MODEL, token_counter=counter, low_watermark=1.0)
            if embed is not None:
                semantic = trim_messages(
                    chat, max_tokens=budget, model=MODEL, token_counter=counter, low_watermark=1.0, embed=embed
                )
                assert not semantic.notes, semantic.notes
            picks = {
                "contextwarden": set(result.kept),
                **({"contextwarden + embedder": set(semantic.kept)} if embed is not None else {}),
                "most recent": recent_baseline(history_costs, room),
                "BM25": bm25_baseline(texts, _plain_terms(case["question"]), history_costs, room),
            }
            if quick and budget == BUDGETS[0]:
                same = choose_indices(conversation, costs, budget - TOKENS_PER_REPLY)
                mismatches += same != set(result.kept)
            for name in ABLATIONS:
                picks[name] = choose_indices(
                    conversation, costs, budget - TOKENS_PER_REPLY, scores=scores[name], weights=ABLATIONS[name]
                )
            for name in methods:
                kept = picks[name]
                got = sum(1 for e in case["evidence"] if e in kept)
                hit = (got / len(case["evidence"]), got == len(case["evidence"]))
                hits.setdefault((name, budget, case["category"]), []).append(hit)
                if case["category"] in ANSWERABLE:
                    hits.setdefault((name, budget, case["half"]), []).append(hit)
    return {"cases": len(cases), "hits": hits, "methods": methods, "mismatches": mismatches}


def summarize(hits: dict, methods: list[str]) -> dict:
    table: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for name in methods:
        for budget in BUDGETS:
            row = table.setdefault(name, {}).setdefault(str(budget), {})
            halves = sorted({k[2] for k in hits if isinstance(k[2], str)})
            groups = {str(c): [c] for c in CATEGORIES} | {"1-4": list(ANSWERABLE)} | {f"conv {h}": [h] for h in halves}
            for label, cats in groups.items():
                values = [v for c in cats for v in hits.get((name, budget, c), [])]
                if values:
                    row[label] = {
                        "n": len(values),
                        "recall": round(sum(v[0] for v in values) / len(values), 3),
                        "all_kept": round(sum(v[1] for v in values) / len(values), 3),
                    }
    return table


def markdown(table: dict, meta: dict) -> str:
    lines = [
        f"# Selection quality on LoCoMo (dev half){' reshaped' if meta['shape'] == 'reshaped' else ''}",
        "",
        *(
            [
                "Chats reshaped by `reshaped_chat`: no session headers or speaker names, runs of 1-5 exchanges",
                "merged into one multi-line message per speaker (a second dev set unlike LoCoMo's one-line turns).",
                "",
            ]
            if meta["shape"] == "reshaped"
            else []
        ),
        "Generated by `bench/quality.py`. Data: LoCoMo by Maharana et al., ACL 2024,",
        "snap-research/locomo, CC BY-NC 4.0 (non-commercial); these numbers are under the same terms.",
        "",
        f"- cases: {meta['cases']} ({meta['answerable']} answerable, categories 1-4); data sha256 "
        f"`{meta['sha256'][:16]}…`",
        f"- contextwarden {meta['version']}, tiktoken {meta['tiktoken']}, Python {meta['python']}, {meta['machine']}",
        f"- token counts: cl100k_base + 4 per message; the budget includes the question and reply priming; "
        f"contextwarden runs with `low_watermark=1.0` (fill the budget); run took {meta['seconds']:.0f} s",
        *(
            [f"- embedder: {meta['embedder']} (sentence-transformers, CPU), fused into relevance's base signal"]
            if meta.get("embedder")
            else []
        ),
        "",
        "## All evidence kept, categories 1-4 (recall in brackets)",
        "",
        "| method | " + " | ".join(f"{b // 1000}k" for b in BUDGETS) + " |",
        "|---|" + "---|" * len(BUDGETS),
    ]
    for name, rows in table.items():
        cells = [f"{rows[str(b)]['1-4']['all_kept']:.3f} ({rows[str(b)]['1-4']['recall']:.3f})" for b in BUDGETS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    halves = [k for k in table["contextwarden"][str(BUDGETS[0])] if k.startswith("conv ")]
    lines += [
        "",
        "## Split halves: all evidence kept by conversations, categories 1-4",
        "",
        "| method | " + " | ".join(f"{b // 1000}k {h}" for b in (2_000, 8_000) for h in halves) + " |",
        "|---|" + "---|" * (2 * len(halves)),
    ]
    for name, rows in table.items():
        cells = [
            f"{rows[str(b)][h]['all_kept']:.3f} (n={rows[str(b)][h]['n']})" for b in (2_000, 8_000) for h in halves
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "## Per category: all evidence kept / recall", ""]
    for budget in BUDGETS:
        lines += [
            f"### {budget // 1000}k tokens",
            "",
            "| method | " + " | ".join(f"{c} {CATEGORIES[c]}" for c in CATEGORIES) + " |",
            "|---|" + "---|" * len(CATEGORIES),
        ]
        for name in ("contextwarden", "most recent", "BM25"):
            row = table[name][str(budget)]
            cells = [
                f"{row[str(c)]['all_kept']:.3f} / {row[str(c)]['recall']:.3f} (n={row[str(c)]['n']})"
                if str(c) in row
                else "-"
                for c in CATEGORIES
            ]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    lines.append(
        "Category 5 (adversarial: the question asks about something that was not said) is reported apart, not in 1-4."
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("data", nargs="?", default=str(DEFAULT_DATA), help="locomo_dev.json")
    parser.add_argument("--quick", action="store_true", help="every third case, no files written")
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="locomo",
        help="locomo: one message a turn with session headers (default); reshaped: see reshaped_chat",
    )
    parser.add_argument(
        "--embed-model",
        metavar="DIR",
        help="a sentence-transformers model folder (e.g. all-MiniLM-L6-v2): adds 'contextwarden + embedder'",
    )
    args = parser.parse_args()
    seed_tiktoken_cache()
    path = Path(args.data)
    started = time.perf_counter()
    out = run(path, args.quick, args.shape, args.embed_model)
    table = summarize(out["hits"], out["methods"])
    meta = {
        "cases": out["cases"],
        "answerable": table["contextwarden"]["1000"]["1-4"]["n"],
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "version": contextwarden.__version__,
        "tiktoken": tiktoken.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
        "seconds": time.perf_counter() - started,
        "shape": args.shape,
        "embedder": Path(args.embed_model).name if args.embed_model else None,
    }
    text = markdown(table, meta)
    print(text)
    if args.quick:
        print(f"path check mismatches: {out['mismatches']}", file=sys.stderr)
        return
    results = ROOT / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    name = "quality" if args.shape == "locomo" else f"quality-{args.shape}"
    (results / f"{name}.md").write_text(text)
    (results / f"{name}.json").write_text(json.dumps({"meta": meta, "table": table}, indent=1) + "\n")


if __name__ == "__main__":
    main()
