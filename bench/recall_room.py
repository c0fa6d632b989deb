"""The recall block alone: how much of a question's evidence it quotes in a given room.

A carried turn (bench/multiturn.py) holds a new question's evidence almost only in its recall
block, so the block's ranking at equal tokens is what a carried turn can gain from. Per QA item of
a set (as bench/quality.py reads it: the whole chat, the question last), the block
`recall._new_recall` makes with nothing else sent, in each room, against the BM25 and hybrid
(BM25 + MiniLM, reciprocal-rank fused) baselines filling the same room; all evidence kept, shares
of the answerable questions.

    PYTHONPATH=src python bench/recall_room.py [--set locomo|realtalk] [DATA] [--rooms 400,500,800,1600]
        [--embed-model DIR|none]

Prints a table (markdown); writes nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(ROOT / ".cache" / "tiktoken"))

from contextwarden.core.chatview import ChatView  # noqa: E402
from contextwarden.core.recall import _new_recall, _Pools  # noqa: E402
from contextwarden.core.tokens import TokenCounter  # noqa: E402
from contextwarden.tools.offline import seed_tiktoken_cache  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality import (  # noqa: E402
    ANSWERABLE,
    HYBRID,
    MODEL,
    _plain_terms,
    add_set_arguments,
    bm25_scores,
    cosine_table,
    data_set,
    embed_model_arg,
    fill_by_rank,
    load_cases,
    rank,
    rrf_order,
    sentence_embedder,
)

ROOMS = (400, 500, 800, 1_600)  # about what a carried turn's block gets at 1k, 1k, 2k and 4k-8k


def run(path: Path, rooms: tuple[int, ...], embed_model: str | None) -> tuple[dict[tuple[int, str], float], list[str]]:
    """Share of answerable questions whose evidence all lies in what each method quotes or keeps."""
    counter = TokenCounter(block=True)
    assert counter.wait_ready(MODEL)
    cases = [c for c in load_cases(path) if c["category"] in ANSWERABLE]
    embed = None
    if embed_model:
        chats = list({id(c["chat"]): c["chat"] for c in cases}.values())
        questions = sorted({c["question"] for c in cases})
        embed = sentence_embedder(embed_model, chats, questions, [m["content"] for c in chats for m in c] + questions)
    methods = ["recall block", "BM25"] + ([HYBRID] if embed else [])
    hits: Counter[tuple[int, str]] = Counter()
    plain: dict[int, tuple] = {}
    for case in cases:
        chat = case["chat"] + [{"role": "user", "content": case["question"]}]
        question = len(chat) - 1
        view = ChatView(chat)
        pool = _Pools(view, counter, MODEL, 0, embed).of(question, ())
        if id(case["chat"]) not in plain:
            contents = [m["content"] for m in case["chat"]]
            plain[id(case["chat"])] = (
                [Counter(_plain_terms(t)) for t in contents],
                [counter.count_message(m, MODEL) for m in case["chat"]],
                cosine_table(embed, contents) if embed else None,
            )
        terms, costs, vectors = plain[id(case["chat"])]
        bm25 = bm25_scores(terms, _plain_terms(case["question"]))
        orders = {"BM25": rank(bm25)}
        if vectors is not None:
            orders[HYBRID] = rrf_order(bm25, (vectors @ cosine_table(embed, [case["question"]])[0]).tolist())
        for room in rooms:
            block = _new_recall(view, {question}, question, room, counter, MODEL, pool)
            picks = {"recall block": set(block.indices) if block else set()}
            picks |= {name: fill_by_rank(order, costs, room) for name, order in orders.items()}
            for name, kept in picks.items():
                hits[(room, name)] += all(e in kept for e in case["evidence"])
    return {key: count / len(cases) for key, count in hits.items()}, methods


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_set_arguments(parser)
    parser.add_argument("--rooms", default=",".join(map(str, ROOMS)), help="tokens, comma-separated")
    args = parser.parse_args()
    embed_model = embed_model_arg(args.embed_model)
    seed_tiktoken_cache()
    rooms = tuple(int(r) for r in args.rooms.split(","))
    shares, methods = run(data_set(args.set, args.data)[1], rooms, embed_model)
    print(f"| room ({args.set}{', MiniLM' if embed_model else ', lexical'}) | " + " | ".join(methods) + " |")
    print("|---:|" + "---:|" * len(methods))
    for room in rooms:
        print(f"| {room:,} | " + " | ".join(f"{shares[(room, m)]:.3f}" for m in methods) + " |")


if __name__ == "__main__":
    main()
