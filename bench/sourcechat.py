"""Chats about a document Open WebUI retrieves from, turn by turn through the built single file.

Data: the dev documents `../shared/bench/docs-dev/squad_docs_dev.json` (15 SQuAD articles, CC BY-SA
4.0; see its SOURCE.md), read from that path, never copied here; questions, replies and answer
sentences as `bench/docchat.py` makes them (`docchat.article`).

One chat an article: a system prompt, then its questions one after another (80, shuffled with a
fixed seed), each answered with its answer text and the first 3 sentences of its paragraph (an
assistant's reply of ~100 tokens: 80 turns hold more history than an 8k window). The document
is never pasted: as Open WebUI does with a file attached or a knowledge base, each question gets
sources put before it between `inlet` and `request` (`apply_source_context_to_messages`: 0.12.4's
default RAG template, one `<source id="1" name=...>` block a passage, a newline, the question),
and the chat as stored keeps the question bare. Sources per question, `--sources`:

- `top3`, `top10`: the article's 3 or 10 paragraphs most relevant to the question by BM25, each
  its own block (what a knowledge base's retrieval sends, a paragraph a chunk; Open WebUI's
  default top k is 3, admins raise it);
- `whole`: the whole article in one block every turn (a file attached in full-context mode).

Every turn goes through the built file (`--bundle`, default the repository's
`open_webui_filter.py`; `git:REV` a commit's; repeat to compare side by side): `inlet`, the sources
put in, `request`, `outlet` on the stored chat plus the reply. Valves: the window
`max_context_tokens` (4k, 8k, 16k), everything else the defaults, no live prices, lexical.

Per window and sources, over the turns after the first: answer's sentence sent (in the sources as
sent or anywhere else in the prompt); cacheable: the share of sent tokens in leading messages
equal to the previous turn's (bench/multiturn.py's rule); its ceiling: what the previous prompt
held but its last message (the sources go with the question: no prompt can repeat them); repeated:
turns whose prompt repeats the previous one up to its question; tokens a turn, and of them not
cached (what a provider bills at the full input price).

    .venv/bin/python bench/sourcechat.py [--quick] [--bundle A|git:REV ...] [--sources top3 ...]

Results: bench/results/sourcechat.{md,json} (not written by --quick).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import re
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from docchat import (
    DEFAULT_DATA,
    MODEL,
    ROOT,
    SYSTEM,
    WINDOWS,
    Runner,
    _quiet,
    article,
    bundle_file,
    common_prefix,
    load_bundle,
    run_meta,
    seed_encodings,
    sentences,
)

SOURCES = ("top3", "top10", "whole")
QUESTIONS = 80  # a chat's questions: with replies of a few sentences, more history than 8k holds
REPLY_SENTENCES = 3  # a reply: the answer, then this many sentences of the paragraph it is in
# Open WebUI 0.12.4's DEFAULT_RAG_TEMPLATE (config.py), whole.
RAG_TEMPLATE = """### Task:
Respond to the user query using the provided context, incorporating inline citations in the format [id] **only when the <source> tag includes an explicit id attribute** (e.g., <source id="1">).

### Guidelines:
- If you don't know the answer, clearly state that.
- If uncertain, ask the user for clarification.
- Respond in the same language as the user's query.
- If the context is unreadable or of poor quality, inform the user and provide the best possible answer.
- If the answer isn't present in the context but you possess the knowledge, explain this to the user and provide the answer using your own understanding.
- **Only include inline citations using [id] (e.g., [1], [2]) when the <source> tag includes an id attribute.**
- Do not cite if the <source> tag does not contain an id attribute.
- Do not use XML tags in your response.
- Ensure citations are concise and directly related to the information provided.

### Example of Citation:
If the user asks about a specific topic and the information is found in a source with a provided id attribute, the response should include the citation like in the following example:
* "According to the study, the proposed method increases efficiency by 20% [1]."

### Output:
Provide a clear and direct response to the user's query, including inline citations in the format [id] only when the <source> tag with id attribute is present in the context.

<context>
{{CONTEXT}}
</context>
"""  # noqa: E501
TERMS = re.compile(r"\w+")


class ParagraphBM25:
    """BM25 over an article's paragraphs (k1 1.2, b 0.75): a knowledge base's retrieval, one chunk a paragraph."""

    def __init__(self, paragraphs: list[str]) -> None:
        self.paragraphs = paragraphs
        self.counts = [Counter(TERMS.findall(p.lower())) for p in paragraphs]
        self.mean = sum(sum(c.values()) for c in self.counts) / len(self.counts)
        df = Counter(t for c in self.counts for t in c)
        n = len(paragraphs)
        self.idf = {t: math.log(1 + (n - d + 0.5) / (d + 0.5)) for t, d in df.items()}

    def best(self, question: str, k: int) -> list[str]:
        terms = set(TERMS.findall(question.lower()))

        def score(i: int) -> float:
            c, length = self.counts[i], sum(self.counts[i].values())
            norm = 1.2 * (0.25 + 0.75 * length / self.mean)
            return sum(self.idf.get(t, 0.0) * c[t] * 2.2 / (c[t] + norm) for t in terms if t in c)

        order = sorted(range(len(self.paragraphs)), key=lambda i: (-score(i), i))[:k]
        return [self.paragraphs[i] for i in sorted(order)]


def with_sources(question: str, passages: list[str], name: str) -> str:
    """The question as Open WebUI sends it with sources: the template, a `<source>` block a passage, a newline."""
    context = "".join(f'<source id="1" name="{name}">{p}</source>\n' for p in passages).strip()
    return RAG_TEMPLATE.replace("{{CONTEXT}}", context) + "\n" + question


async def turn(runner: Runner, f: Any, chat: list[dict], chat_id: str, sources: str, reply: str) -> list[dict]:
    """inlet, the sources put before the question (as Open WebUI does), request, outlet: what went out."""
    metadata = {"chat_id": chat_id, "message_id": uuid.uuid4().hex, "session_id": "s", "user_id": "bench-user"}
    body = {"model": MODEL, "messages": json.loads(json.dumps(chat)), "stream": True, "metadata": metadata}
    hooks = {
        "__user__": runner.user,
        "__metadata__": metadata,
        "__model__": {"id": MODEL, "name": MODEL, "owned_by": "openai"},
        "__event_emitter__": _quiet,
    }
    out = await f.inlet(body, **hooks)
    last = out["messages"][-1]
    out["messages"][-1] = {**last, "content": sources + "\n" + last["content"]}
    out = await f.request(out, **hooks)
    stored = json.loads(json.dumps(chat)) + [{"role": "assistant", "content": reply}]
    await f.outlet({"model": MODEL, "messages": stored, "chat_id": chat_id, "session_id": "s", "id": "m"}, **hooks)
    return out["messages"]


async def run_chat(runner: Runner, counter: Any, entry: dict, window: int, kind: str) -> list[dict]:
    """One article's chat at one window with one kind of sources: a row a turn."""
    text, asked = article(entry)
    paragraphs = text.split("\n\n")
    retrieval = ParagraphBM25(paragraphs)
    f = await runner.filter_for(window)
    chat, rows, last = [SYSTEM], [], None
    chat_id = f"{kind}-{window}-{uuid.uuid4().hex[:8]}"
    for q in asked[:QUESTIONS]:
        paragraph = next(p for p in paragraphs if q["sentence"] in p)
        reply = " ".join([q["reply"], *(paragraph[a:b] for a, b in sentences(paragraph)[:REPLY_SENTENCES])])
        passages = [text] if kind == "whole" else retrieval.best(q["question"], int(kind[3:]))
        chat.append({"role": "user", "content": q["question"]})
        sources = with_sources("", passages, entry["title"]).rstrip("\n")
        sent = await turn(runner, f, chat, chat_id, sources, reply)
        costs = [counter.count_message(m, MODEL) for m in sent]
        row = {"tokens": 3 + sum(costs), "found": any(q["sentence"] in str(m.get("content")) for m in sent)}
        if last is not None:
            shared = common_prefix(last[0], sent)
            row |= {"cacheable": sum(costs[:shared]), "ceiling": min(row["tokens"], sum(last[1][:-1]))}
            row["repeated"] = shared >= len(last[0]) - 1
        rows.append(row)
        last = (sent, costs)
        chat.append({"role": "assistant", "content": reply})
    return rows


def summarize(rows: list[dict]) -> dict:
    later = [r for r in rows if "cacheable" in r]
    sent = sum(r["tokens"] for r in later)
    return {
        "turns": len(rows),
        "answer_sent": round(sum(r["found"] for r in rows) / len(rows), 3),
        "cacheable": round(sum(r["cacheable"] for r in later) / sent, 3),
        "ceiling": round(sum(r["ceiling"] for r in later) / sent, 3),
        "repeated": round(sum(r["repeated"] for r in later) / len(later), 3),
        "mean_tokens": round(sent / len(later)),
        "mean_uncached": round((sent - sum(r["cacheable"] for r in later)) / len(later)),
    }


async def run(args: argparse.Namespace) -> dict:
    entries = json.loads(Path(args.data).read_text())["data"]
    if args.quick:
        entries = entries[::3]
    windows = args.windows or ((4_096, 8_192) if args.quick else WINDOWS)
    results: dict[str, dict] = {}
    for path, info in args.bundles:
        runner = Runner(load_bundle(path))
        counter = (await runner.filter_for(windows[0])).counter
        for window in windows:
            for kind in args.sources:
                rows = [r for entry in entries for r in await run_chat(runner, counter, entry, window, kind)]
                key = f"{info['bundle']}|{window}|{kind}"
                results[key] = summarize(rows)
                print(f"{key}: {json.dumps(results[key])}", file=sys.stderr)
    return {"results": results, "articles": len(entries), "windows": windows}


def markdown(out: dict, meta: dict) -> str:
    bundles = list(dict.fromkeys(k.split("|")[0] for k in out["results"]))
    lines = [
        "# Chats about a document Open WebUI retrieves from, turn by turn through the built file",
        "",
        "Generated by `bench/sourcechat.py` (its docstring says what each column is).",
        "",
        f"- {meta['cpu']}, {meta['cores']} CPUs, Python {meta['python']}; load average {meta['load_start']} at"
        f" start, {meta['load_end']} at end; {meta['seconds']:.0f} s; {meta['date']}",
        f"- {out['articles']} articles (data sha256 `{meta['data_sha256'][:16]}…`), one chat each a window and"
        " kind of sources; lexical",
        *[f"- bundle `{b['bundle']}`: {b.get('commit', '?')} (sha256 `{b['sha256']}`)" for b in meta["bundles"]],
        "",
        "| window | sources | bundle | answer sent | cacheable | ceiling | repeated | tokens a turn | not cached |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for window in out["windows"]:
        for kind in meta["sources"]:
            for b in bundles:
                r = out["results"][f"{b}|{window}|{kind}"]
                lines.append(
                    f"| {window:,} | {kind} | `{b}` | {r['answer_sent']:.3f} | {r['cacheable']:.1%} |"
                    f" {r['ceiling']:.1%} | {r['repeated']:.1%} | {r['mean_tokens']:,} | {r['mean_uncached']:,} |"
                )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", action="append", help="a built open_webui_filter.py, or git:REV (repeat)")
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--quick", action="store_true", help="every third article, 4k and 8k, no files written")
    parser.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES))
    parser.add_argument("--windows", type=int, nargs="+", help=f"windows (default {', '.join(map(str, WINDOWS))})")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    spare = Path(tempfile.mkdtemp(prefix="sourcechat-"))
    args.bundles = [bundle_file(b, spare) for b in args.bundle or [str(ROOT / "open_webui_filter.py")]]
    seed_encodings()
    load_start, started = round(os.getloadavg()[0], 2), time.perf_counter()
    out = asyncio.run(run(args))
    meta = {
        **run_meta(load_start, started, args.bundles),
        "sources": args.sources,
        "data_sha256": hashlib.sha256(Path(args.data).read_bytes()).hexdigest(),
    }
    text = markdown(out, meta)
    print(text)
    if not args.quick:
        target = Path(args.out)
        target.mkdir(parents=True, exist_ok=True)
        (target / "sourcechat.md").write_text(text)
        (target / "sourcechat.json").write_text(json.dumps({"meta": meta, "results": out["results"]}, indent=1) + "\n")


if __name__ == "__main__":
    main()
