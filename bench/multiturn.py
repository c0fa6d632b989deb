"""A chat that goes on: what each turn sends for its question, and what a prompt cache can serve.

Data: LoCoMo (Maharana et al., ACL 2024, snap-research/locomo, CC BY-NC 4.0), the dev half read
from `../shared/bench/locomo-dev/locomo_dev.json`, or with `--set realtalk` REALTALK's dev half
(chats 1-5, `../shared/bench/realtalk-dev/realtalk_dev.json`), or any LoCoMo-format file given as
DATA (see bench/quality.py; never copied here). Each conversation becomes one chat (as in
bench/quality.py, after a system prompt); then its answerable questions (categories 1-4, with
evidence) are asked in order in that ONE chat, each followed by its gold answer. Per budget
(1k, 2k, 4k, 8k) and method, every turn records:

- evidence sent: every evidence message's text is present verbatim in what is sent;
- cacheable: the sent tokens that repeat the previous turn's sent prompt from its start
  (whole leading messages equal; a provider caches only prompts of 1,024 tokens or more,
  which the costs below apply, the share does not);
- re-selections: trimmed turns that did not send the previous selection again;
- fill: sent tokens / budget;
- cost of the prompts per 100 turns at the bundled prices (pricing.json), (i) cache warm:
  the cacheable prefix at the cache-read price (when >= 1,024 tokens), for models that charge
  cache writes (Anthropic) the part the next turn reads again at the write price, the rest at
  the input price; (ii) no cache: everything at the input price. Replies are not counted
  (the same gold answers for every method).

Methods: `carried` (the decision passed on exactly as the filter does: through JSON, kept when a
turn has none), `carried, no recall` (the same with `recall_share=0`: before issue 14),
`fresh` (no previous decision: a new selection every turn), `everything` (no trim), and the
baselines of bench/quality.py made afresh every turn over the whole chat so far (earlier
questions and answers included): `BM25`, `dense` (MiniLM cosine alone) and `hybrid` (BM25 +
MiniLM, reciprocal-rank fused), each sending the system prompt, the messages it keeps in their
order and the question. With the embedder (MiniLM by default, as bench/quality.py gets it;
`--embed-model none` for the lexical rows only) `carried + embedder` and `fresh + embedder` pass
it as `embed=`: new selections and the recall fuse the cosine in.
Tokens are counted with o200k_base (gpt-4o) for all models.

    PYTHONPATH=src python bench/multiturn.py [--set locomo|realtalk] [DATA] [--quick] [--recall-share X]
        [--keep-share X]

`--keep-share` sets `carry.RECALL_KEEP_SHARE` (when a carried turn gives its selection up): with
`--quick` or `--out` elsewhere it maps what evidence a lower cacheable share buys.

Results: bench/results/multiturn.{md,json} (LoCoMo), multiturn-realtalk.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from collections import Counter
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(ROOT / ".cache" / "tiktoken"))

import contextwarden  # noqa: E402
from contextwarden import TrimDecision, trim_messages  # noqa: E402
from contextwarden.core import carry as carry_module  # noqa: E402
from contextwarden.core.tokens import TOKENS_PER_REPLY, TokenCounter  # noqa: E402
from contextwarden.core.trim import DEFAULT_RECALL_SHARE  # noqa: E402
from contextwarden.tools.offline import seed_tiktoken_cache  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality import (  # noqa: E402
    ANSWERABLE,
    DENSE,
    HYBRID,
    SETS,
    _plain_terms,
    add_set_arguments,
    bm25_scores,
    conversation_chat,
    cosine_table,
    cpu_model,
    data_set,
    embed_model_arg,
    fill_by_rank,
    rank,
    results_name,
    rrf_order,
    sentence_embedder,
    source_id,
)

MODEL = "gpt-4o"
BUDGETS = (1_000, 2_000, 4_000, 8_000)
PRICED = ("openai/gpt-5", "openai/gpt-4.1", "anthropic/claude-sonnet-4.5")
MIN_CACHED_PROMPT = 1_024  # OpenAI and Anthropic (Sonnet) cache only prompts of at least this many tokens
SYSTEM = {
    "role": "system",
    "content": "You are a helpful assistant. Answer briefly and kindly, using the conversation.",
}
LEXICAL = ("carried", "carried, no recall", "fresh", "BM25", "everything")
WITH_EMBEDDER = (
    "carried",
    "carried + embedder",
    "carried, no recall",
    "fresh",
    "fresh + embedder",
    "BM25",
    DENSE,
    HYBRID,
    "everything",
)
BASELINE_METHODS = ("BM25", DENSE, HYBRID)
TUNE = (0, 1)  # conversations the recall rules were looked at on; the others are reported apart


def questions(sample: dict, where: dict[str, int]) -> list[tuple[str, str, list[int]]]:
    """(question, gold answer, evidence message indices) of the answerable items, in order."""
    found = []
    for qa in sample["qa"]:
        if qa.get("category") not in ANSWERABLE:
            continue
        ids = [d for e in qa.get("evidence", []) for d in re.split(r"[;,\s]+", str(e)) if d]
        evidence = sorted({where[d] for d in ids if d in where})
        if evidence:
            found.append((qa["question"], str(qa.get("answer", "")), evidence))
    return found


def _text(message: dict) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else ""


def common_prefix(a: list[dict], b: list[dict]) -> int:
    """How many leading messages of `a` and `b` are equal."""
    n = 0
    for x, y in zip(a, b, strict=False):  # a prefix of the shorter one at most
        if x != y:
            break
        n += 1
    return n


class Baselines:
    """The baselines' rankings of a chat's history before each question (best first, indices into
    the chat without its system prompt), made once and kept for every budget."""

    def __init__(self, embed=None) -> None:
        self.embed = embed
        self.terms: dict[str, Counter] = {}
        self.vectors: dict[str, object] = {}
        self.orders: dict[tuple[int, int], dict[str, list[int]]] = {}

    def vector_rows(self, texts: list[str]):
        import numpy as np

        missing = [t for t in dict.fromkeys(texts) if t not in self.vectors]
        if missing:
            self.vectors.update(zip(missing, cosine_table(self.embed, missing), strict=True))
        return np.stack([self.vectors[t] for t in texts])

    def order(self, key: int, chat: list[dict], method: str) -> list[int]:
        if (key, len(chat)) not in self.orders:
            history = [_text(m) for m in chat[1:-1]]
            for text in history:
                if text not in self.terms:
                    self.terms[text] = Counter(_plain_terms(text))
            bm25 = bm25_scores([self.terms[t] for t in history], _plain_terms(_text(chat[-1])))
            orders = {"BM25": rank(bm25)}
            if self.embed is not None:
                cosines = (self.vector_rows(history) @ self.vector_rows([_text(chat[-1])])[0]).tolist()
                orders |= {DENSE: rank(cosines), HYBRID: rrf_order(bm25, cosines)}
            self.orders[(key, len(chat))] = orders
        return self.orders[(key, len(chat))][method]


def run_chat(
    history: list[dict],
    asked: list[tuple[str, str, list[int]]],
    budget: int,
    method: str,
    counter: TokenCounter,
    recall_share: float,
    embed=None,
    baselines: Baselines | None = None,
) -> list[dict]:
    """Every turn of one chat under one method: what it sent and how that compares to the turn before."""
    chat = [SYSTEM] + history
    offset = 1
    stored: str | None = None
    last: list[dict] | None = None
    turns = []
    for question, answer, evidence in asked:
        chat.append({"role": "user", "content": question})
        own = (False, 0)
        if method == "everything":
            sent, changed, reused = list(chat), False, False
        elif method in BASELINE_METHODS:
            assert baselines is not None
            costs = [counter.count_message(m, MODEL) for m in chat[1:-1]]
            room = budget - TOKENS_PER_REPLY - sum(counter.count_message(chat[i], MODEL) for i in (0, -1))
            kept = fill_by_rank(baselines.order(id(history), chat, method), costs, room)
            sent = [chat[0], *(chat[1 + i] for i in sorted(kept)), chat[-1]]
            changed, reused = len(kept) < len(costs), False
        else:
            previous = TrimDecision.from_json(stored) if stored and method.startswith("carried") else None
            share = 0.0 if method == "carried, no recall" else recall_share
            result = trim_messages(
                chat,
                max_tokens=budget,
                model=MODEL,
                token_counter=counter,
                previous=previous,
                recall_share=share,
                embed=embed if method.endswith("+ embedder") else None,
            )
            if result.decision is not None:  # the filter keeps the stored decision when a turn makes none
                stored = result.decision.to_json()
            sent, changed, reused = result.messages, result.changed, result.reused
            own = own_block(result, len(chat) - 1, [e + offset for e in evidence], counter)
        costs = [counter.count_message(m, MODEL) for m in sent]
        tokens = TOKENS_PER_REPLY + sum(costs)
        texts = [_text(m) for m in sent]
        hit = all(any(_text(chat[e + offset]) in t for t in texts) for e in evidence)
        shared = common_prefix(last, sent) if last is not None else 0
        turns.append(
            {
                "tokens": tokens,
                "cacheable": sum(costs[:shared]),
                "evidence": hit,
                "reselected": changed and not reused,
                "own_block": own[0] and hit,
                "own_tokens": own[1],
                "costs": costs,
                "sent": sent,
            }
        )
        last = [dict(m) for m in sent]
        chat.append({"role": "assistant", "content": answer})
    for k, turn in enumerate(turns):  # what the next turn reads again: written to a cache this turn
        nxt = turns[k + 1] if k + 1 < len(turns) else None
        turn["read_next"] = sum(turn["costs"][: common_prefix(turn["sent"], nxt["sent"])]) if nxt else 0
        del turn["sent"], turn["costs"]
    return turns


def own_block(result, question: int, evidence: list[int], counter: TokenCounter) -> tuple[bool, int]:
    """Whether this question's own recall block (the one anchored at it) quotes some of its
    evidence, and what that block and its acknowledgement cost: the part of a carried prompt
    made for this question, against what it carried from earlier turns."""
    recalls = result.decision.recalls if result.decision is not None else ()
    mine = [r for r in recalls if r.anchor == question]
    quoted = any(e in r.at for r in mine for e in evidence)
    n, added = len(result.messages), set(result.added)
    block = [p for p in (n - 3, n - 2) if p in added] if mine else []
    return quoted, sum(counter.count_message(result.messages[p], MODEL) for p in block)


def prices() -> dict[str, dict[str, Decimal]]:
    table = json.loads((ROOT / "pricing.json").read_text())["models"]
    out = {}
    for model in PRICED:
        row = table[model]
        out[model] = {k: Decimal(row[k] or "0") for k in ("prompt", "cache_read", "cache_write")}
    return out


def turn_cost(turn: dict, price: dict[str, Decimal], warm: bool) -> Decimal:
    if not warm:
        return turn["tokens"] * price["prompt"]
    cached = turn["cacheable"] if turn["cacheable"] >= MIN_CACHED_PROMPT else 0
    rest = turn["tokens"] - cached
    written = 0
    if price["cache_write"] > 0 and turn["read_next"] >= MIN_CACHED_PROMPT:
        written = max(0, turn["read_next"] - cached)
    return cached * price["cache_read"] + written * price["cache_write"] + (rest - written) * price["prompt"]


def summarize(turns: list[dict], budget: int, priced: dict) -> dict:
    n = len(turns)
    sent = sum(t["tokens"] for t in turns)
    row = {
        "turns": n,
        "evidence_sent": round(sum(t["evidence"] for t in turns) / n, 3),
        "cacheable_share": round(sum(t["cacheable"] for t in turns) / sent, 3),
        "reselections_per_100": round(100 * sum(t["reselected"] for t in turns) / n, 1),
        "mean_fill": round(statistics.fmean(t["tokens"] / budget for t in turns), 3),
        "mean_tokens": round(sent / n),
        "evidence_own_block": round(sum(t.get("own_block", False) for t in turns) / n, 3),
        "own_block_share": round(sum(t.get("own_tokens", 0) for t in turns) / sent, 3),
    }
    for model, price in priced.items():
        for warm in (True, False):
            total = sum((turn_cost(t, price, warm) for t in turns), Decimal(0))
            row[f"{model} {'warm' if warm else 'nocache'}"] = float(round(total * 100 / n, 4))
    return row


def run(path: Path, quick: bool, recall_share: float, embed_model: str | None = None) -> dict:
    """Every budget and method over every chat of `path`: summaries of all chats, of chats 1-2
    (`tuned`) and of the rest (`held`)."""
    counter = TokenCounter(block=True)
    assert counter.wait_ready(MODEL)
    samples = json.loads(path.read_text())
    priced = prices()
    chats = []
    for k, sample in enumerate(samples):
        history, where = conversation_chat(sample)
        asked = questions(sample, where)
        chats.append((k, history, asked[::3] if quick else asked))
    embed = None
    if embed_model:
        texts = {SYSTEM["content"]}
        texts |= {text for _, _, asked in chats for question, answer, _ in asked for text in (question, answer)}
        whole = texts | {m["content"] for _, history, _ in chats for m in history}
        embed = sentence_embedder(embed_model, [history for _, history, _ in chats], sorted(texts), sorted(whole))
    baselines = Baselines(embed)
    results: dict = {}
    for budget in BUDGETS:
        for method in WITH_EMBEDDER if embed is not None else LEXICAL:
            per_chat = {
                k: run_chat(history, asked, budget, method, counter, recall_share, embed, baselines)
                for k, history, asked in chats
            }
            every = [t for k in per_chat for t in per_chat[k]]
            results[f"{budget}|{method}"] = {
                "all": summarize(every, budget, priced),
                "tuned": summarize([t for k in TUNE for t in per_chat[k]], budget, priced),
                "held": summarize([t for k in per_chat if k not in TUNE for t in per_chat[k]], budget, priced),
            }
        print(f"budget {budget} done", file=sys.stderr)
    return results


def markdown(results: dict, meta: dict) -> str:
    data = SETS[meta.get("set", "locomo")]
    title = meta.get("title", data.title)
    locomo = title == SETS["locomo"].title
    lines = [
        f"# A chat that goes on: evidence sent and prompt cache ({title.replace(' (', ', ').rstrip(')')})"
        if not locomo
        else "# A chat that goes on: evidence sent and prompt cache (LoCoMo dev half)",
        "",
        f"Generated by `bench/multiturn.py`. {data.credit[0]}",
        *data.credit[1:],
        "",
        f"- {meta['machine']}, Python {meta['python']}, contextwarden {meta['version']}; load average "
        f"{meta['load_start']} at start, {meta['load_end']} at end; {meta['seconds']:.0f} s",
        *([f"- source: {meta['source']}"] if meta.get("source") else []),
        f"- {meta['conversations']} conversations, {meta['turns']} questions (categories 1-4) asked in order, "
        "each in its "
        f"conversation's one chat and followed by its gold answer; recall_share {meta['recall_share']}, "
        f"keep share {meta.get('keep_share', 0.5)}; "
        f"counts o200k_base + 4 per message",
        *(
            [
                f"- embedder: {meta['embedder']} (sentence-transformers, CPU), fused into the `+ embedder` rows' "
                "selections and recall",
                f"- BM25, {DENSE} and {HYBRID}: bench/quality.py's baselines, a new selection every turn over the "
                "chat so far (single messages, best first while they fit), sent as system prompt, kept messages in "
                "order, question",
            ]
            if meta.get("embedder")
            else ["- BM25: bench/quality.py's baseline, a new selection every turn over the chat so far"]
        ),
        "",
        "## Evidence sent, cacheable share, re-selections, fill",
        "",
        "| budget | method | evidence sent | cacheable share | re-selections / 100 turns | mean fill |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for key, row in results.items():
        budget, method = key.split("|")
        r = row["all"]
        lines.append(
            f"| {int(budget):,} | {method} | {r['evidence_sent']:.3f} | {r['cacheable_share']:.1%} | "
            f"{r['reselections_per_100']:.1f} | {r['mean_fill']:.0%} |"
        )
    lines += ["", "## Targets (issue 14)", "", "| target | measured | met |", "|---|---|:-:|"]
    for budget, share in ((2_000, 0.55), (8_000, 0.65)):
        carried, fresh = results[f"{budget}|carried"]["all"], results[f"{budget}|fresh"]["all"]
        ratio = carried["evidence_sent"] / fresh["evidence_sent"]
        lines.append(
            f"| {budget // 1000}k: evidence carried >= 0.9 x fresh | {carried['evidence_sent']:.3f} / "
            f"{fresh['evidence_sent']:.3f} = {ratio:.2f} | {'yes' if ratio >= 0.9 else '**no**'} |"
        )
        lines.append(
            f"| {budget // 1000}k: cacheable share >= {share:.0%} | {carried['cacheable_share']:.1%} | "
            f"{'yes' if carried['cacheable_share'] >= share else '**no**'} |"
        )
    lines += [
        "",
        "## Carried against fresh at every budget (issue 28: carried >= 0.9 x fresh)",
        "",
        "| budget | rows | evidence carried / fresh | cacheable share, carried |",
        "|---:|---|---:|---:|",
    ]
    for budget in BUDGETS:
        for suffix in ("", " + embedder"):
            if f"{budget}|carried{suffix}" not in results:
                continue
            carried, fresh = results[f"{budget}|carried{suffix}"]["all"], results[f"{budget}|fresh{suffix}"]["all"]
            ratio = carried["evidence_sent"] / fresh["evidence_sent"]
            lines.append(
                f"| {budget:,} | carried{suffix} / fresh{suffix} | {carried['evidence_sent']:.3f} / "
                f"{fresh['evidence_sent']:.3f} = {ratio:.2f}{'' if ratio >= 0.9 else ' **below 0.9**'} | "
                f"{carried['cacheable_share']:.1%} |"
            )
    lines += sources_table(results)
    lines += [
        "",
        "## Tuned on conversations 1-2, held out 3-5 (evidence sent / cacheable share)"
        if locomo
        else "## Conversations 1-2 and 3- apart (evidence sent / cacheable share)",
        "",
        "| budget | method | conversations 1-2 | conversations 3-5 |"
        if locomo
        else "| budget | method | conversations 1-2 | conversations 3- |",
        "|---:|---|---:|---:|",
    ]
    for key, row in results.items():
        budget, method = key.split("|")
        t, h = row["tuned"], row["held"]
        lines.append(
            f"| {int(budget):,} | {method} | {t['evidence_sent']:.3f} / {t['cacheable_share']:.1%} | "
            f"{h['evidence_sent']:.3f} / {h['cacheable_share']:.1%} |"
        )
    lines += [
        "",
        "## Prompt cost per 100 turns, USD: cache warm / no cache",
        "",
        "| budget | method | " + " | ".join(PRICED) + " |",
        "|---:|---|" + "---:|" * len(PRICED),
    ]
    for key, row in results.items():
        budget, method = key.split("|")
        r = row["all"]
        cells = [f"{r[f'{m} warm']:.4f} / {r[f'{m} nocache']:.4f}" for m in PRICED]
        lines.append(f"| {int(budget):,} | {method} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Cache warm: the prefix equal to the previous turn's prompt at the cache-read price when it is at least "
        "1,024 tokens; for Anthropic also the cache-write price (1.25x input) on the part the next turn reads "
        "again; the rest at the input price. `everything` is the same under every budget.",
    ]
    return "\n".join(lines) + "\n"


def sources_table(results: dict) -> list[str]:
    """Where the evidence sent comes from: the question's own recall block (made for it this
    turn) or the rest of the prompt (in place, a selection's quotes, earlier turns' blocks),
    beside what the own block costs: a carried prompt's rest is what the cache serves."""
    lines = [
        "",
        "## Where the evidence sent comes from (carried and fresh rows)",
        "",
        "Evidence sent with some of it quoted in the question's own recall block, the rest sent otherwise; the "
        "own block's share of the tokens sent.",
        "",
        "| budget | method | evidence sent | own block | otherwise | own block's tokens | cacheable share |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for key, row in results.items():
        budget, method = key.split("|")
        r = row["all"]
        if not method.startswith(("carried", "fresh")) or "own_block_share" not in r:
            continue
        own, sent = r["evidence_own_block"], r["evidence_sent"]
        lines.append(
            f"| {int(budget):,} | {method} | {sent:.3f} | {own:.3f} | {sent - own:.3f} | "
            f"{r['own_block_share']:.1%} | {r['cacheable_share']:.1%} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_set_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="every third question, no files written")
    parser.add_argument("--recall-share", type=float, default=DEFAULT_RECALL_SHARE)
    parser.add_argument(
        "--remake", action="store_true", help="re-make the recall block every turn (earlier blocks not sent again)"
    )
    parser.add_argument(
        "--keep-share",
        type=float,
        default=carry_module.RECALL_KEEP_SHARE,
        help="carry.RECALL_KEEP_SHARE: a carried turn selects anew when the block that fits holds less of "
        "what the question wants recalled",
    )
    args = parser.parse_args()
    embed_model = embed_model_arg(args.embed_model)
    carry_module.RECALL_KEEP_SHARE = args.keep_share
    if args.remake:
        carry_module._CARRY_RECALLS = False
    seed_tiktoken_cache()
    data, path = data_set(args.set, args.data)
    load_start = round(os.getloadavg()[0], 2)
    started = time.perf_counter()
    results = run(path, args.quick, args.recall_share, embed_model)
    any_row = next(iter(results.values()))["all"]
    meta = {
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, {cpu_model()}",
        "python": platform.python_version(),
        "version": contextwarden.__version__,
        "load_start": load_start,
        "load_end": round(os.getloadavg()[0], 2),
        "seconds": time.perf_counter() - started,
        "conversations": len(json.loads(path.read_text())),
        "turns": any_row["turns"],
        "recall_share": args.recall_share,
        "keep_share": args.keep_share,
        "quick": args.quick,
        "remake": args.remake,
        "embedder": Path(embed_model).name if embed_model else None,
        "set": args.set,
        "title": data.title,
        "data": path.name,
        "source": source_id(),
    }
    text = markdown(results, meta)
    print(text)
    if not args.quick:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = results_name("multiturn", args.set)
        (out / f"{name}.md").write_text(text)
        (out / f"{name}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
