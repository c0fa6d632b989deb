"""Cost per turn of semantic relevance: a trim with the real MiniLM embedder, cold and warm.

Run under Open WebUI's python (it has sentence-transformers), with the model folder unpacked
as for bench/quality.py:

    PYTHONPATH=src ~/.cache/contextwarden/owui-0.12.4/bin/python bench/embedcost.py \\
        --embed-model ~/.cache/contextwarden/owui-0.12.4-all-MiniLM-L6-v2

Chats are bench/synth.py's, 200 and 1,000 messages, each turn a new selection (no
`previous`: the worst case): about 500 o200k tokens a message with tool groups, budget 8,000
tokens; and chats of one-liners (`synth.make_dialogue`: each also embedded with the one before
it), budget 2,000.

- **cold**: a chat never seen, no vectors cached: every message and the question embedded.
- **warm**: the same chat plus a new reply and a new question, every other vector cached:
  two texts embedded (and their context windows), the rest looked up.
- **lexical**: the same warm turn without an embedder (what the embedder adds is the gap).
- **filter core, cold**: what the filter does on a chat it has never seen: `OpenWebUIEmbedder.prefetch`
  (at most `DEFAULT_EMBED_TEXTS` texts, newest first, within `DEFAULT_EMBED_TIMEOUT`) through an
  async wrapper around the same model, then the trim, which stays lexical while vectors are missing;
  its "texts embedded" are the vectors ready when the turn went on (0 after a timeout).

Writes bench/results/embedcost.md and embedcost.json: median wall-clock ms and texts embedded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(ROOT / ".cache" / "tiktoken"))
sys.path.insert(0, str(ROOT / "bench"))

from contextwarden.core.semantic import VECTORS  # noqa: E402
from contextwarden.core.tokens import TokenCounter  # noqa: E402
from contextwarden.core.trim import trim_messages  # noqa: E402
from contextwarden.face.embedder import DEFAULT_EMBED_TEXTS, DEFAULT_EMBED_TIMEOUT, OpenWebUIEmbedder  # noqa: E402
from contextwarden.tools.offline import seed_tiktoken_cache  # noqa: E402

import synth  # noqa: E402

BUDGET = 8_000
MODEL = "gpt-4o"
SIZES = (200, 1_000)
# synth's chats of ~540-token messages (a long one embedded in pieces) and of one-liners (each
# embedded alone and again with the one before it, semantic.context_window): chat, next turn.
# One-liners get a quarter of the budget: 200 of them (~6k tokens) would fit in 8,000 whole.
SHAPES = {
    "~540 tokens": (synth.make_chat, synth.next_turn, BUDGET),
    "one-liners": (synth.make_dialogue, synth.next_dialogue_turn, BUDGET // 4),
}


class CountingEmbedder:
    """The model's `encode` as an `embed` function, counting the texts it is asked for."""

    def __init__(self, model) -> None:
        self.model = model
        self.texts = 0

    def __call__(self, texts: list[str]) -> list[list[float]]:
        self.texts += len(texts)
        return self.model.encode(texts, batch_size=32, normalize_embeddings=True, show_progress_bar=False).tolist()

    async def owui(self, texts: list[str], prefix=None, user=None) -> list[list[float]]:
        """Open WebUI's async EMBEDDING_FUNCTION shape (it runs the model in a thread)."""
        return await asyncio.to_thread(self, texts)


def timed(call) -> float:
    started = time.perf_counter()
    call()
    return (time.perf_counter() - started) * 1000


def _trim(chat: list[dict], fn, counter: TokenCounter, budget: int = BUDGET):
    return trim_messages(chat, max_tokens=budget, model=MODEL, token_counter=counter, embed=fn)


def _filter_core(chat: list[dict], embed: CountingEmbedder, counter: TokenCounter, budget: int) -> tuple[float, int]:
    """The filter's cold turn: prefetch within the timeout, then the trim; ms and vectors ready in time.

    A prefetch that times out leaves its thread running (Open WebUI's embedder cannot be
    cancelled): the turn goes on without it, and asyncio.run waits for it outside the timing.
    """
    adapter = OpenWebUIEmbedder(embed.owui)

    async def turn() -> tuple[float, int]:
        started = time.perf_counter()
        try:
            await adapter.prefetch(chat, timeout=DEFAULT_EMBED_TIMEOUT, max_texts=DEFAULT_EMBED_TEXTS)
        except TimeoutError:
            pass  # the filter logs it and trims lexically
        ready = len(VECTORS)
        _trim(chat, adapter, counter, budget)
        return (time.perf_counter() - started) * 1000, ready

    return asyncio.run(turn())


def run_size(n: int, embed: CountingEmbedder, counter: TokenCounter, reps: int, shape: str) -> dict:
    """Cold, warm, lexical and filter-core turns on chats of `n` messages of a `SHAPES` shape."""
    make_chat, next_turn, budget = SHAPES[shape]
    rows: dict[str, list[tuple[float, float]]] = {"cold": [], "warm": [], "lexical": [], "filter core, cold": []}
    for rep in range(reps):
        chat = make_chat(n * 1_000 + rep, n)
        counter.count_each_as(chat, MODEL)  # token counts warm in every row: the embedder is what differs
        VECTORS._vectors.clear()  # cold: no vector of any chat cached
        before = embed.texts
        ms = timed(lambda chat=chat: _trim(chat, embed, counter, budget))
        rows["cold"].append((ms, embed.texts - before))
        for k in range(3):  # warm: a new reply and question each, every other vector cached
            grown = chat + next_turn(n * 1_000 + rep * 10 + k)
            counter.count_each_as(grown[:-2], MODEL)
            before = embed.texts
            ms = timed(lambda grown=grown: _trim(grown, embed, counter, budget))
            rows["warm"].append((ms, embed.texts - before))
            rows["lexical"].append((timed(lambda grown=grown: _trim(grown, None, counter, budget)), 0))
        VECTORS._vectors.clear()
        rows["filter core, cold"].append(_filter_core(chat, embed, counter, budget))
    return {
        name: {
            "median_ms": round(statistics.median(v[0] for v in values), 1),
            "min_ms": round(min(v[0] for v in values), 1),
            "max_ms": round(max(v[0] for v in values), 1),
            "texts_embedded": statistics.median(v[1] for v in values),
            "runs": len(values),
        }
        for name, values in rows.items()
    }


def markdown(results: dict, meta: dict) -> str:
    lines = [
        "# Cost per turn of semantic relevance (real all-MiniLM-L6-v2, CPU)",
        "",
        "Generated by `bench/embedcost.py`: `trim_messages(..., embed=fn)` on bench/synth.py chats (tool groups;",
        "messages of ~540 o200k tokens, embedded in pieces, or one-liners, also embedded with the one before),",
        f"budget {BUDGET:,} tokens ({BUDGET // 4:,} for one-liners), a new selection every turn (no `previous`).",
        "cold = no vector cached (every message and the question embedded); warm = the same chat plus a new",
        "reply and question, the rest cached; lexical = that warm turn without an embedder; filter core, cold =",
        f"the filter's prefetch (at most {DEFAULT_EMBED_TEXTS} texts, newest first, {DEFAULT_EMBED_TIMEOUT:g} s) "
        "then the trim, lexical while vectors are missing.",
        "",
        f"- {meta['machine']}, Python {meta['python']}, torch threads {meta['torch_threads']}, "
        f"sentence-transformers {meta['st']}",
        f"- load average before / after: {meta['load_before']} / {meta['load_after']} (shared machine: other jobs ran)",
        "- token counts cached in every row (counted before the turn): what differs is the embedder",
        f"- the model alone: {meta['texts_per_s']:g} texts/s on these messages (cut to 2,000 characters; MiniLM reads"
        " 256 word pieces): cold cost is that rate, not the trim",
        f"- model load {meta['model_load_s']:.1f} s (once per process, not in the turns); "
        f"run took {meta['seconds']:.0f} s",
        "",
        "| messages | of | turn | median ms | min-max ms | texts embedded | runs |",
        "|---|---|---|---|---|---|---|",
    ]
    for shape, sizes in results.items():
        for n, rows in sizes.items():
            for name, r in rows.items():
                spread = f"{r['min_ms']:,.0f}-{r['max_ms']:,.0f}"
                lines.append(
                    f"| {int(n):,} | {shape} | {name} | {r['median_ms']:,.1f} | {spread} | "
                    f"{r['texts_embedded']:g} | {r['runs']} |"
                )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--embed-model", required=True, metavar="DIR", help="a sentence-transformers model folder")
    parser.add_argument("--reps", type=int, default=3, help="200-message chats (3 warm turns each)")
    parser.add_argument("--reps-1000", type=int, default=1, help="1,000-message chats (a cold one takes minutes)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steady on a shared machine)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    import sentence_transformers
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(args.threads)
    seed_tiktoken_cache()
    started = time.perf_counter()
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    counter = TokenCounter(block=True)
    assert counter.wait_ready(MODEL)
    t = time.perf_counter()
    model = SentenceTransformer(args.embed_model, device="cpu")
    model_load = time.perf_counter() - t
    embed = CountingEmbedder(model)
    embed(["warm up the model"])
    probe = [t for t in (m.get("content") for m in synth.make_chat(7, 40)) if t][:16]
    t = time.perf_counter()
    model.encode(probe, batch_size=16)
    speed = len(probe) / (time.perf_counter() - t)
    results = {
        shape: {str(n): run_size(n, embed, counter, args.reps if n < 1_000 else args.reps_1000, shape) for n in SIZES}
        for shape in SHAPES
    }
    meta = {
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "st": sentence_transformers.__version__,
        "load_before": load_before,
        "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "model_load_s": model_load,
        "texts_per_s": round(speed, 1),
        "seconds": time.perf_counter() - started,
    }
    text = markdown(results, meta)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "embedcost.md").write_text(text)
    (out / "embedcost.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
