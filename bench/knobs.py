"""Why the selection loses to plain BM25 on REALTALK at small budgets (issue 28): a ladder from
plain BM25 to contextwarden, and the public knobs, on REALTALK and LoCoMo dev together.

No change to src/: every variant is made from public pieces. `RelevanceWeights` through
`dataclasses.replace` (as bench/quality.py's ablations), `choose_indices(scores=...)`,
`relevance_terms`, `score_messages`, `turn_values`, `mandatory_indices` and `select_by_value`
(its `cost_exponent`). `rebuilt` below re-makes `choose_indices` from those pieces (checked to
give the very same selection with the defaults) so that one rule at a time can be changed: the
unit (whole turns or single messages), the latest turn kept first or not, the cost exponent.

The ladder, one step at a time from the BM25 baseline (single messages, best first while they
fit) to contextwarden (whole turns, value per cost ** 0.25, the latest turn first):

1. BM25 (`\\w+` tokens): bench/quality.py's baseline;
2. the same over `relevance_terms(fold=False)`: stop words and one-letter words out;
3. over `relevance_terms()`: suffixes folded too (contextwarden's terms);
4. contextwarden's own scores (`score_messages`: BM25 with its k1/b, the question's context,
   Q&A pairing, neighbours, date headers, recency), still single messages best first;
5. value per cost ** 0.25 (`select_by_value`) instead of best first;
6. whole turns (a kept question takes its answer; turn neighbours), as `choose_indices`;
7. the latest turn kept first: contextwarden.

Measure: all evidence kept, categories 1-4, one fresh selection per question, cl100k counts,
the budget less the question and reply priming, as bench/quality.py.

With MiniLM (by default, found as bench/quality.py finds it; `--embed-model none` to skip) a
last table does the same for `trim_messages(embed=)`: the cosine's share, and reciprocal-rank
fusion (the hybrid baseline's rule) in place of contextwarden's centred-cosine fusion, over whole
turns or single messages (through `choose_indices(scores=)` and `semantic.similarities`).

    PYTHONPATH=src python bench/knobs.py [--quick] [--embed-model DIR|none]   # bench/results/knobs.{md,json}
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(ROOT / ".cache" / "tiktoken"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from contextwarden.core.chatview import ChatView  # noqa: E402
from contextwarden.core.relevance import DEFAULT_RELEVANCE_WEIGHTS, RelevanceWeights, relevance_terms  # noqa: E402
from contextwarden.core.relevance import score_messages as _score_messages  # noqa: E402
from contextwarden.core.selection import (  # noqa: E402
    DEFAULT_COST_EXPONENT,
    choose_indices,
    mandatory_indices,
    select_by_value,
    turn_values,
)
from contextwarden.core.semantic import VECTORS, similarities  # noqa: E402
from contextwarden.core.tokens import TOKENS_PER_REPLY, TokenCounter  # noqa: E402
from contextwarden.tools.offline import seed_tiktoken_cache  # noqa: E402

from quality import (  # noqa: E402
    ABLATIONS,
    ANSWERABLE,
    BUDGETS,
    MODEL,
    SETS,
    _plain_terms,
    bm25_scores,
    cosine_table,
    cpu_model,
    embed_model_arg,
    fill_by_rank,
    load_cases,
    rank,
    rrf_order,
    sentence_embedder,
    source_id,
)

W = DEFAULT_RELEVANCE_WEIGHTS
R = dataclasses.replace


class Case:
    """One question of a set: the chat with the question last, its counts and evidence; scores
    made once per weights and kept for every budget."""

    def __init__(self, case: dict, counter: TokenCounter, plain: dict) -> None:
        self.chat = case["chat"] + [{"role": "user", "content": case["question"]}]
        self.q = len(self.chat) - 1
        self.evidence = case["evidence"]
        self.category = case["category"]
        self.half = case["half"]
        key = id(case["chat"])
        if key not in plain:
            plain[key] = {
                "costs": [counter.count_message(m, MODEL) for m in case["chat"]],
                "terms": {},
            }
        self.shared = plain[key]
        self.costs = self.shared["costs"] + [counter.count_message(self.chat[-1], MODEL)]
        self.conversation: ChatView = ChatView(self.chat)
        self._scores: dict[object, list[float]] = {}
        self.embed = None  # set by main() when the MiniLM rows run

    def similarity(self) -> list[float]:
        """contextwarden's cosines (`semantic.similarities`: pieces, one-liners' windows), as
        `trim_messages(embed=)` computes them."""
        if "similarity" not in self._scores:
            self._scores["similarity"] = similarities(self.chat, self.q, VECTORS, self.embed)
        return self._scores["similarity"]

    def semantic(self, weights: RelevanceWeights = W) -> list[float]:
        """contextwarden's scores with the cosine fused in (`trim_messages(embed=)`)."""
        key = ("semantic", weights)
        if key not in self._scores:
            self._scores[key] = _score_messages(
                self.chat, question=self.q, weights=weights, similarity=self.similarity()
            )
        return self._scores[key]

    def whole_cosines(self) -> list[float]:
        """The baselines' cosines: each history message's whole text to the question."""
        if "whole" not in self._scores:
            vectors = cosine_table(self.embed, [m["content"] for m in self.chat])
            self._scores["whole"] = (vectors[:-1] @ vectors[-1]).tolist()
        return self._scores["whole"]

    def forget(self) -> None:
        self._scores.clear()

    def scores(self, weights: RelevanceWeights) -> list[float]:
        if weights not in self._scores:
            self._scores[weights] = _score_messages(self.chat, question=self.q, weights=weights)
        return self._scores[weights]

    def plain_bm25(self, terms: Callable[[str], list[str]], name: str) -> list[float]:
        """BM25 (k1 1.2, b 0.75) of every history message against the question, over `terms`."""
        if name not in self._scores:
            table = self.shared["terms"]
            if name not in table:
                table[name] = [Counter(terms(m["content"])) for m in self.chat[:-1]]
            self._scores[name] = bm25_scores(table[name], terms(self.chat[-1]["content"]))
        return self._scores[name]


# -- contextwarden's selection, re-made from public pieces so that one rule can change --------


def rebuilt(
    case: Case,
    budget: int,
    scores: Sequence[float],
    *,
    weights: RelevanceWeights = W,
    unit: str = "turn",
    latest_first: bool = True,
    exponent: float = DEFAULT_COST_EXPONENT,
    split_over: float | None = None,
) -> set[int]:
    """`choose_indices` with the defaults (checked equal), or with one rule changed.

    unit: "turn" (whole turns, valued as `turn_values` does), "message" (single messages valued
    by their own score), or "turn" with `split_over`: a turn costing more than this share of the
    room goes as single messages. latest_first: the turn before the question is kept first
    while it fits. exponent: value per cost ** exponent (0: best first, as BM25's baseline).
    """
    conversation, costs = case.conversation, case.costs
    keep = set(mandatory_indices(conversation))
    left = budget - sum(costs[i] for i in keep)
    current = conversation.current
    turns = {t: [i for i in turn.indices if i not in keep] for t, turn in enumerate(conversation.turns)}
    turns = {t: ids for t, ids in turns.items() if ids}
    latest = current - 1 if current else None
    if latest_first and latest in turns:
        cost = sum(costs[i] for i in turns[latest])
        if cost <= left:
            keep.update(turns.pop(latest))
            left -= cost
    values = turn_values(conversation, costs, scores, weights)
    units: list[list[int]] = []
    worth: list[float] = []
    for t, ids in turns.items():
        cost = sum(costs[i] for i in ids)
        if unit == "message" or (split_over is not None and cost > split_over * left):
            units += [[i] for i in ids]
            worth += [scores[i] for i in ids]
        else:
            units.append(ids)
            worth.append(values[t])
    chosen = select_by_value([sum(costs[i] for i in u) for u in units], worth, left, cost_exponent=exponent)
    for k in chosen:
        keep.update(units[k])
        left -= sum(costs[i] for i in units[k])
    return repair_start(case, keep, left)


def repair_start(case: Case, keep: set[int], left: int) -> set[int]:
    """The history does not begin with an assistant message: give it its turn's user message
    (when it fits) or let it go, as `choose_indices` does."""
    chat, costs = case.chat, case.costs
    while True:
        first = min(keep)
        if chat[first]["role"] != "assistant" or first == 0:
            return keep
        user = next((i for i in range(first - 1, -1, -1) if chat[i]["role"] == "user"), None)
        if user is not None and costs[user] <= left:
            keep.add(user)
            left -= costs[user]
        else:
            keep.discard(first)
            left += costs[first]


def history_fill(case: Case, budget: int, order: Sequence[int]) -> set[int]:
    """bench/quality.py's baselines: the question, then history messages best first while they fit."""
    room = budget - case.costs[case.q]
    return fill_by_rank(order, case.costs[:-1], room) | {case.q}


def by_value(case: Case, budget: int, scores: Sequence[float], exponent: float) -> set[int]:
    """Single history messages by value per cost ** exponent (no turn rule, no start repair)."""
    room = budget - case.costs[case.q]
    costs = case.costs[:-1]
    picked = select_by_value(costs, list(scores[: len(costs)]), room, cost_exponent=exponent)
    zero = [i for i in rank([0.0] * len(costs)) if i not in set(picked)]  # the rest newest first, as BM25 fills
    left = room - sum(costs[i] for i in picked)
    return set(picked) | fill_by_rank(zero, costs, left) | {case.q}


def words(text: str) -> list[str]:
    return relevance_terms(text, fold=False)


def terms(text: str) -> list[str]:
    return relevance_terms(text)


def plain_rank(case: Case, budget: int) -> set[int]:
    return history_fill(case, budget, rank(case.plain_bm25(_plain_terms, "plain")))


LADDER: dict[str, Callable[[Case, int], set[int]]] = {
    "1 BM25 (baseline, \\w+ tokens)": plain_rank,
    "2 BM25, stop words out": lambda c, b: history_fill(c, b, rank(c.plain_bm25(words, "words"))),
    "3 BM25, stop words out, suffixes folded": lambda c, b: history_fill(c, b, rank(c.plain_bm25(terms, "terms"))),
    "4 contextwarden's scores, single messages best first": lambda c, b: history_fill(c, b, rank(c.scores(W)[:-1])),
    "5 ... value per cost ** 0.25": lambda c, b: by_value(c, b, c.scores(W), DEFAULT_COST_EXPONENT),
    "6 ... whole turns (turn neighbours)": lambda c, b: rebuilt(c, b, c.scores(W), latest_first=False),
    "7 ... latest turn first = contextwarden": lambda c, b: choose_indices(c.conversation, c.costs, b),
}

BM25_ONLY = ABLATIONS["BM25 only (our tokens)"]


SIGNALS = {
    "context turns": {"context_weight": W.context_weight},
    "Q&A pairing": {"pair_share": W.pair_share, "pair_back": W.pair_back},
    "neighbours": {"neighbour_share": W.neighbour_share},
    "date headers": {"header_share": W.header_share},
    "recency": {"recency": W.recency},
}
SIGNALS_OFF = {name: dict.fromkeys(on, 0.0) for name, on in SIGNALS.items()}


def best_first(weights: RelevanceWeights) -> Callable[[Case, int], set[int]]:
    return lambda c, b: history_fill(c, b, rank(c.scores(weights)[:-1]))


# Step 4 apart: contextwarden's scores with one signal added to its BM25 (or taken away from
# all of them), single messages best first (turn neighbours act only on whole turns).
SCORES: dict[str, Callable[[Case, int], set[int]]] = {
    "contextwarden's BM25 alone (our terms, its k1 and b)": best_first(BM25_ONLY),
    **{f"+ {name} only": best_first(R(BM25_ONLY, **on)) for name, on in SIGNALS.items()},
    "all signals (= step 4)": best_first(W),
    **{f"all but {name}": best_first(R(W, **off)) for name, off in SIGNALS_OFF.items()},
}


def weighted(weights: RelevanceWeights) -> Callable[[Case, int], set[int]]:
    return lambda c, b: choose_indices(c.conversation, c.costs, b, scores=c.scores(weights), weights=weights)


def rule(**change) -> Callable[[Case, int], set[int]]:
    weights = change.pop("weights", W)
    return lambda c, b: rebuilt(c, b, c.scores(weights), weights=weights, **change)


KNOBS: dict[str, Callable[[Case, int], set[int]]] = {
    "contextwarden (defaults)": lambda c, b: choose_indices(c.conversation, c.costs, b),
    "rebuilt from public pieces (check: equal)": rule(),
    # the weights, one at a time (RelevanceWeights via dataclasses.replace)
    "context_weight 0 (no context turns)": weighted(R(W, context_weight=0.0)),
    "context_weight 0.05": weighted(R(W, context_weight=0.05)),
    "context_messages 1 (the message before the question only)": weighted(R(W, context_messages=1)),
    "pair_share, pair_back 0 (no Q&A pairing)": weighted(R(W, pair_share=0.0, pair_back=0.0)),
    "neighbour_share 0": weighted(R(W, neighbour_share=0.0)),
    "turn_share 0 (no turn neighbours)": weighted(R(W, turn_share=0.0)),
    "turn_reach 32": weighted(R(W, turn_reach=32)),
    "turn_reach 128": weighted(R(W, turn_reach=128)),
    "header_share 0": weighted(R(W, header_share=0.0)),
    "recency 0": weighted(R(W, recency=0.0)),
    "fold_suffixes off": weighted(R(W, fold_suffixes=False)),
    "b 0.5 (less length normalisation)": weighted(R(W, b=0.5)),
    "b 0.9": weighted(R(W, b=0.9)),
    "k1 0.9": weighted(R(W, k1=0.9)),
    "k1 2.0": weighted(R(W, k1=2.0)),
    "BM25 only (our tokens), whole turns": weighted(BM25_ONLY),
    # the selection's rules (rebuilt)
    "latest turn not kept first": rule(latest_first=False),
    "cost exponent 0 (best first)": rule(exponent=0.0),
    "cost exponent 0.5": rule(exponent=0.5),
    "single messages (no turn rule)": rule(unit="message"),
    "single messages, latest turn not first": rule(unit="message", latest_first=False),
    "a turn over 1/8 of the room as messages": rule(split_over=1 / 8),
    "a turn over 1/4 of the room as messages": rule(split_over=1 / 4),
    # two changes together: the one knob that moves REALTALK without a loss on LoCoMo, with others
    "context_weight 0 + b 0.5": weighted(R(W, context_weight=0.0, b=0.5)),
    "context_weight 0 + turn_reach 128": weighted(R(W, context_weight=0.0, turn_reach=128)),
    "context_weight 0 + single messages": rule(weights=R(W, context_weight=0.0), unit="message"),
    "whole turns valued by plain BM25 (\\w+)": lambda c, b: choose_indices(
        c.conversation, c.costs, b, scores=c.plain_bm25(_plain_terms, "plain") + [0.0], weights=BM25_ONLY
    ),
}


def rrf_scores(first: Sequence[float], second: Sequence[float]) -> list[float]:
    """Reciprocal-rank fusion (k 60) as a score per message: `first` ranks what it scores above 0,
    `second` every message (the hybrid baseline's rule, bench/quality.py `rrf_order`)."""
    fused = [0.0] * len(first)
    for order in ([i for i in rank(first) if first[i] > 0], rank(second)):
        for place, i in enumerate(order, 1):
            fused[i] += 1.0 / (60 + place)
    return fused


def turns_by(scores: Callable[[Case], list[float]]) -> Callable[[Case, int], set[int]]:
    """contextwarden's selection (whole turns, latest first, value per cost ** 0.25, turn
    neighbours) over other per-message scores (`choose_indices(scores=)`)."""
    return lambda c, b: choose_indices(c.conversation, c.costs, b, scores=scores(c))


EMBEDDED: dict[str, Callable[[Case, int], set[int]]] = {
    "contextwarden + embedder (defaults)": turns_by(lambda c: c.semantic()),
    "hybrid baseline (BM25 + whole-text cosine, RRF, single messages)": lambda c, b: history_fill(
        c, b, rrf_order(c.plain_bm25(_plain_terms, "plain"), c.whole_cosines())
    ),
    "dense baseline (whole-text cosine, single messages)": lambda c, b: history_fill(c, b, rank(c.whole_cosines())),
    "semantic_share 0.2": turns_by(lambda c: c.semantic(R(W, semantic_share=0.2))),
    "semantic_share 0.5": turns_by(lambda c: c.semantic(R(W, semantic_share=0.5))),
    "semantic_share 0.7": turns_by(lambda c: c.semantic(R(W, semantic_share=0.7))),
    "context_weight 0": lambda c, b: choose_indices(
        c.conversation, c.costs, b, scores=c.semantic(R(W, context_weight=0.0)), weights=R(W, context_weight=0.0)
    ),
    "its fused scores, single messages best first": lambda c, b: history_fill(c, b, rank(c.semantic()[:-1])),
    "RRF of its lexical scores and its cosine, whole turns": turns_by(
        lambda c: rrf_scores(c.scores(W)[:-1], c.similarity()[:-1]) + [0.0]
    ),
    "RRF of its lexical scores and its cosine, single messages": lambda c, b: history_fill(
        c, b, rank(rrf_scores(c.scores(W)[:-1], c.similarity()[:-1]))
    ),
    "RRF of plain BM25 and whole-text cosine (the hybrid's), whole turns": turns_by(
        lambda c: rrf_scores(c.plain_bm25(_plain_terms, "plain"), c.whole_cosines()) + [0.0]
    ),
    "RRF of its BM25 alone and its cosine, single messages": lambda c, b: history_fill(
        c, b, rank(rrf_scores(c.scores(BM25_ONLY)[:-1], c.similarity()[:-1]))
    ),
}


def measure(
    cases: list[Case], variants: dict[str, Callable[[Case, int], set[int]]]
) -> dict[str, dict[int, dict[str, float]]]:
    """All evidence kept and recall (categories 1-4) per variant and budget, and all kept in
    conversations 1-2 and 3- apart (bench/quality.py's split halves)."""
    kept_all: Counter = Counter()
    recall: Counter = Counter()
    halves = Counter(case.half for case in cases)
    for case in cases:
        for name, pick in variants.items():
            for budget in BUDGETS:
                kept = pick(case, budget - TOKENS_PER_REPLY)
                got = sum(1 for e in case.evidence if e in kept)
                kept_all[name, budget] += got == len(case.evidence)
                kept_all[name, budget, case.half] += got == len(case.evidence)
                recall[name, budget] += got / len(case.evidence)
        case.forget()
    return {
        name: {
            b: {
                "all_kept": round(kept_all[name, b] / len(cases), 3),
                "recall": round(recall[name, b] / len(cases), 3),
                **{f"all_kept conv {h}": round(kept_all[name, b, h] / n, 3) for h, n in sorted(halves.items())},
            }
            for b in BUDGETS
        }
        for name in variants
    }


def turn_check(cases: list[Case]) -> dict[int, dict[str, float]]:
    """Are whole turns too big for the budget? Per budget: questions BM25 keeps all evidence of
    and contextwarden does not; of those, how many have evidence messages that fit the room while
    the turns holding them do not; and what whole turns cost against their evidence messages."""
    out = {}
    for budget in BUDGETS[:3]:
        room = budget - TOKENS_PER_REPLY
        lost = too_big = 0
        turn_tokens = evidence_tokens = 0
        for case in cases:
            conversation, costs = case.conversation, case.costs
            turn_of = {i: t for t, turn in enumerate(conversation.turns) for i in turn.indices}
            held = {turn_of[e] for e in case.evidence}
            alone = sum(costs[e] for e in case.evidence)
            whole = sum(costs[i] for t in held for i in conversation.turns[t].indices)
            turn_tokens += whole
            evidence_tokens += alone
            ours = choose_indices(conversation, costs, room)
            if all(e in plain_rank(case, room) for e in case.evidence) and not all(e in ours for e in case.evidence):
                lost += 1
                too_big += alone <= room - costs[case.q] < whole
        out[budget] = {
            "bm25_only": lost,
            "turns_too_big": too_big,
            "turn_cost_ratio": round(turn_tokens / evidence_tokens, 2),
        }
    return out


def halves_table(results: dict[str, dict], names: Sequence[str], base: str) -> list[str]:
    """Change from `base` in all kept at 1k and 2k, conversations 1-2 and 3- apart."""
    keys = [k for k in results["realtalk"][base][BUDGETS[0]] if k.startswith("all_kept conv")]
    head = " | ".join(f"{s} {b // 1000}k {k[14:]}" for s in ("REALTALK", "LoCoMo") for b in BUDGETS[:2] for k in keys)
    lines = [f"| variant | {head} |", "|---|" + "---:|" * (4 * len(keys))]
    for name in names:
        cells = []
        for s in ("realtalk", "locomo"):
            for b in BUDGETS[:2]:
                for k in keys:
                    v = results[s][name][b][k]
                    cells.append(f"{v:.3f}" if name == base else f"{v - results[s][base][b][k]:+.3f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def table(results: dict[str, dict], names: Sequence[str], base: str) -> list[str]:
    """All kept per set and budget, with the change from `base` in brackets."""
    head = " | ".join(f"{s} {b // 1000}k" for s in ("REALTALK", "LoCoMo") for b in BUDGETS)
    lines = [f"| variant | {head} |", "|---|" + "---:|" * (2 * len(BUDGETS))]
    for name in names:
        cells = []
        for s in ("realtalk", "locomo"):
            for b in BUDGETS:
                v = results[s][name][b]["all_kept"]
                d = v - results[s][base][b]["all_kept"]
                cells.append(f"{v:.3f}" if name == base else f"{v:.3f} ({d:+.3f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="every third case, no files written")
    parser.add_argument(
        "--embed-model",
        default="auto",
        metavar="DIR",
        help="MiniLM for the embedder table (auto: as bench/quality.py finds it; none: lexical tables only)",
    )
    args = parser.parse_args()
    embed_model = embed_model_arg(args.embed_model)
    seed_tiktoken_cache()
    counter = TokenCounter(block=True)
    assert counter.wait_ready(MODEL)
    load_start = round(os.getloadavg()[0], 2)
    started = time.perf_counter()
    results: dict[str, dict] = {}
    counts = {}
    checks: dict[str, dict] = {}
    for name in ("realtalk", "locomo"):
        plain: dict = {}
        every = load_cases(SETS[name].path)
        cases = [Case(c, counter, plain) for c in every if c["category"] in ANSWERABLE]
        if args.quick:
            cases = cases[::3]
        counts[name] = len(cases)
        variants = {**LADDER, **SCORES, **KNOBS}
        if embed_model:
            chats = {id(c["chat"]): c["chat"] for c in every}.values()  # as bench/quality.py: same vector cache
            questions = sorted({c["question"] for c in every})
            embed = sentence_embedder(
                embed_model, chats, questions, [m["content"] for c in chats for m in c] + questions
            )
            for case in cases:
                case.embed = embed
            variants |= EMBEDDED
        results[name] = measure(cases, variants)
        checks[name] = turn_check(cases)
        print(f"{name} done ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    meta = {
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, {cpu_model()}",
        "python": platform.python_version(),
        "seconds": round(time.perf_counter() - started),
        "load_start": load_start,
        "load_end": round(os.getloadavg()[0], 2),
        "cases": counts,
        "source": source_id(),
    }
    lines = [
        "# Why REALTALK loses to BM25 at small budgets: a ladder and the knobs",
        "",
        "Generated by `bench/knobs.py` (see its docstring). REALTALK dev (chats 1-5) and LoCoMo dev, "
        "as bench/quality.py reads them;",
        "all evidence kept, categories 1-4, one fresh selection per question; in brackets the change from the "
        "first row of each table.",
        "",
        f"- {meta['machine']}, Python {meta['python']}; {meta['seconds']} s, load average {meta['load_start']} "
        f"at start, {meta['load_end']} at end",
        f"- cases: REALTALK {counts['realtalk']}, LoCoMo {counts['locomo']}; source: {meta['source']}",
        "",
        "## From BM25 to contextwarden, one rule at a time (change from BM25)",
        "",
        *table(results, list(LADDER), next(iter(LADDER))),
        "",
        "## Step 4 apart: which of contextwarden's signals, on single messages best first (change from its BM25 alone)",
        "",
        *table(results, list(SCORES), next(iter(SCORES))),
        "",
        "## The knobs, one at a time (change from contextwarden's defaults)",
        "",
        *table(results, list(KNOBS), next(iter(KNOBS))),
        "",
        *(
            [
                f"## With the embedder ({Path(embed_model).name}): rules and knobs (change from contextwarden + "
                "embedder)",
                "",
                *table(results, list(EMBEDDED), next(iter(EMBEDDED))),
                "",
            ]
            if embed_model
            else []
        ),
        "## Whole turns too big for the budget? (questions BM25 keeps all evidence of, contextwarden not)",
        "",
        "| set | budget | such questions | evidence fits the room, its turns do not | turns / evidence, tokens |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {SETS[s].title} | {b // 1000}k | {c['bm25_only']} | {c['turns_too_big']} | {c['turn_cost_ratio']}x |"
            for s in ("realtalk", "locomo")
            for b, c in checks[s].items()
        ),
        "",
        "## The knobs by conversations 1-2 and 3- apart, 1k and 2k (all kept; change from the defaults)",
        "",
        *halves_table(results, list(KNOBS), next(iter(KNOBS))),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.quick:
        out = ROOT / "bench" / "results"
        (out / "knobs.md").write_text(text)
        (out / "knobs.json").write_text(
            json.dumps({"meta": meta, "results": results, "turn_check": checks}, indent=1) + "\n"
        )


if __name__ == "__main__":
    main()
