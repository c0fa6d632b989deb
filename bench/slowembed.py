"""How long a turn waits with a slow embedder: inlet + request of a 200-message chat, six turns.

Open WebUI's embedder here takes 3 s a call (a busy CPU model, or a remote API having a bad
day); each turn ends with its outlet, as Open WebUI runs it, and the next turn starts 0.5 s
later. The first turn of a fresh filter also loads the encodings and trims the chat cold.

    /work/main/.venv/bin/python bench/slowembed.py OLD.py open_webui_filter.py
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import speed  # noqa: E402  (its loader; it sets TIKTOKEN_CACHE_DIR)
import synth  # noqa: E402
from embedders import topic_embed  # noqa: E402

CALL_SECONDS = 3.0


async def slow_embedder(texts: list[str], prefix: object = None, user: object = None) -> list[list[float]]:
    await asyncio.sleep(CALL_SECONDS)
    return topic_embed(texts)


async def turns(path: Path, semantic: bool) -> list[float]:
    module = speed.load_bundle(path)
    f = module.Filter()
    f.valves = f.Valves(openrouter_pricing=False, max_context_tokens=8_000, semantic_relevance=semantic)
    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(EMBEDDING_FUNCTION=slow_embedder)))
    chat, user, waited = synth.make_chat(7, 200), {"id": "u1", "role": "user"}, []
    for turn in range(6):
        metadata = {"chat_id": "c1", "user_id": "u1", "message_id": uuid.uuid4().hex}
        hooks = {"__user__": user, "__metadata__": metadata, "__request__": request}
        started = time.perf_counter()
        body = await f.inlet({"model": "gpt-4o", "messages": chat, "metadata": metadata}, **hooks)
        await f.request(body, **hooks)
        waited.append(time.perf_counter() - started)
        usage = {"prompt_tokens": 5_000, "completion_tokens": 5}
        chat = [*chat, {"role": "assistant", "content": f"Answer {turn}.", "usage": usage}]
        try:
            await f.outlet({"model": "gpt-4o", "messages": chat}, **hooks)
        except TypeError:  # a version whose outlet takes no __request__
            await f.outlet({"model": "gpt-4o", "messages": chat}, __user__=user, __metadata__=metadata)
        chat = [*chat, {"role": "user", "content": f"And what about item {turn}?"}]
        await asyncio.sleep(0.5)
    return waited


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundles", nargs="+", type=Path)
    args = parser.parse_args()
    for path in args.bundles:
        for semantic in (True, False):
            waited = asyncio.run(turns(path, semantic))
            shown = " ".join(f"{w:.2f}" for w in waited)
            print(f"{path.name}, semantic {'on' if semantic else 'off'}: inlet + request per turn (s) {shown}")


if __name__ == "__main__":
    main()
