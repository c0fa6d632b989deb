"""The longest event-loop stall while contextwarden handles a request, per chat size.

One Open WebUI worker serves every user from one event loop: while a hook computes on it,
no other user's request moves. A ticker task asks to wake every millisecond and records the
longest gap between its wake-ups while a scenario runs (inlet then request, as Open WebUI
calls them, or outlet); the gap is how long every other user waited.

Run from the repository root (the dev venv has everything; no network):

    /work/main/.venv/bin/python bench/loopstall.py                      # the tree's open_webui_filter.py
    /work/main/.venv/bin/python bench/loopstall.py --bundle OLD.py --bundle open_webui_filter.py
    /work/main/.venv/bin/python bench/loopstall.py --reps 3 --markdown bench/results/loopstall.md

Several bundles run in one process, interleaved within each repetition (the order rotates),
so machine load hits each alike. Every call gets fresh texts (a new seed), so nothing is
cached from an earlier repetition: these are cold trims, the worst case.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import gc
import json
import os
import random
import statistics
import sys
import threading
import time
import types
import uuid
from collections.abc import Awaitable, Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiktoken  # noqa: E402  (reads TIKTOKEN_CACHE_DIR when it loads an encoding, not here)

import speed  # noqa: E402  (its loader and machine notes; it sets TIKTOKEN_CACHE_DIR)
import synth  # noqa: E402

MODEL = "gpt-4o"
TICK_SECONDS = 0.001
MEGABYTE = 1_000_000
CONCURRENT = 8
SMALL_CONCURRENT = 50  # turns each small enough to stay on the loop, started at once


class Ticker:
    """The longest gap between the wake-ups of a task that sleeps TICK_SECONDS at a time."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(TICK_SECONDS)
            now = time.perf_counter()
            self.longest = max(self.longest, now - last)
            last = now

    async def __aenter__(self) -> Ticker:
        self._task = asyncio.create_task(self._run())
        await asyncio.sleep(TICK_SECONDS * 3)  # running before the scenario starts
        self.longest = 0.0
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.sleep(TICK_SECONDS * 3)  # a stall at the very end is counted too
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass


def make_filter(module: Any) -> Any:
    f = module.Filter()
    f.valves = f.Valves(max_context_tokens=8_000, reserve_output_tokens=1_024, openrouter_pricing=False)
    assert f._counter.wait_ready(MODEL), "tiktoken encoding not available"
    return f


async def _emit(event: dict) -> None:
    return None


def _hooks(module: Any, chat_id: str) -> dict[str, Any]:
    metadata = {"chat_id": chat_id, "message_id": uuid.uuid4().hex, "user_id": "bench-user"}
    user = {"id": "bench-user", "role": "user", "valves": module.Filter.UserValves()}
    return {"__user__": user, "__metadata__": metadata, "__model__": {"id": MODEL}, "__event_emitter__": _emit}


async def trim_turn(f: Any, module: Any, chat: list[dict]) -> None:
    """inlet then request on what inlet returned, one shared metadata dict (as Open WebUI)."""
    hooks = _hooks(module, uuid.uuid4().hex)
    body = {"model": MODEL, "messages": chat, "stream": True, "metadata": hooks["__metadata__"]}
    body = await f.inlet(body, **hooks)
    await f.request(body, **hooks)


async def body_turn(f: Any, module: Any, extra: dict) -> None:
    """`trim_turn` of a request that carries more than messages (tools, a response format)."""
    hooks = _hooks(module, uuid.uuid4().hex)
    body = {"model": MODEL, "stream": True, "metadata": hooks["__metadata__"], **extra}
    body = await f.inlet(body, **hooks)
    await f.request(body, **hooks)


def many_tools(seed: int, n: int = 3_000) -> list[dict]:
    """`n` tool definitions, each with a description and three typed parameters."""
    rng = random.Random(seed)
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{seed}_{i}",
                "description": synth.prose(rng, 12)[:120],
                "parameters": {
                    "type": "object",
                    "properties": {
                        p: {"type": t, "description": synth.prose(rng, 4)[:40]}
                        for p, t in (("query", "string"), ("limit", "integer"), ("exact", "boolean"))
                    },
                    "required": ["query"],
                },
            },
        }
        for i in range(n)
    ]


def big_response_format(seed: int, size: int = 2 * MEGABYTE) -> dict:
    """A JSON-schema response format of about `size` bytes (many described properties)."""
    rng = random.Random(seed)
    properties: dict[str, Any] = {}
    while len(json.dumps(properties)) < size:
        for _ in range(500):
            properties[f"field_{len(properties)}"] = {"type": "string", "description": synth.prose(rng, 20)[:150]}
    schema = {"type": "object", "properties": properties}
    return {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}


def many_images(seed: int, n: int = 10_000) -> list[dict]:
    """A chat whose last message carries `n` image parts (small data URLs) and a question."""
    chat = synth.make_chat(seed, 6)
    parts: list[dict] = [{"type": "text", "text": f"What do these show? {seed}"}]
    parts += [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{i:08d}"}} for i in range(n)]
    chat[-1] = {"role": "user", "content": parts}
    return chat


def big_schemas(seed: int, size: int = 5 * MEGABYTE, n: int = 64) -> list[dict]:
    """`n` tool definitions (no more than are counted on the loop by number) with `size` of schemas."""
    rng = random.Random(seed)
    each = size // n // 600
    properties = {f"p{k}": {"type": "string", "description": synth.prose(rng, 120)[:550]} for k in range(each)}
    schema = {"type": "object", "properties": properties}
    return [{"type": "function", "function": {"name": f"tool_{seed}_{i}", "parameters": schema}} for i in range(n)]


def many_tool_calls(seed: int, n: int = 300_000) -> list[dict]:
    """A chat whose newest reply carries `n` tool calls (their results left out: orphans), then a question."""
    chat = synth.make_chat(seed, 6)
    call = {"id": f"c{seed}", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    return [*chat[:-1], {"role": "assistant", "content": "", "tool_calls": [call] * n}, chat[-1]]


async def running_usage(f: Any, module: Any, chunks: int) -> None:
    """A turn of a user with a limit whose backend reports its running usage on every chunk."""
    hooks = _hooks(module, uuid.uuid4().hex)
    body = {"model": MODEL, "messages": synth.make_chat(chunks, 6), "stream": True, "metadata": hooks["__metadata__"]}
    await f.inlet(body, **hooks)
    for k in range(1, chunks + 1):
        chunk = {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"content": "word "}}]}
        await f.stream({**chunk, "usage": {"prompt_tokens": 1_000, "completion_tokens": k}}, **_stream_args(hooks))
        await asyncio.sleep(0)  # chunks come from the network: the loop runs between them


def _stream_args(hooks: dict[str, Any]) -> dict[str, Any]:
    return {"__metadata__": hooks["__metadata__"]}


def empty_parts(seed: int, n: int = 100_000) -> list[dict]:
    """A chat whose last message is `n` empty text parts and a question: light in text, long to read."""
    chat = synth.make_chat(seed, 6)
    parts: list[dict] = [{"type": "text", "text": ""} for _ in range(n)]
    chat[-1] = {"role": "user", "content": [*parts, {"type": "text", "text": f"And this? {seed}"}]}
    return chat


async def outlet_turn(f: Any, module: Any, chat: list[dict]) -> None:
    """outlet of a reply (the chat's last message) that carries no usage: everything is counted."""
    hooks = _hooks(module, uuid.uuid4().hex)
    await f.outlet({"model": MODEL, "messages": chat, "chat_id": hooks["__metadata__"]["chat_id"]}, **hooks)


class _Completions(BaseHTTPRequestHandler):
    """A summary endpoint on this machine: every POST gets one short chat completion."""

    def do_POST(self) -> None:  # noqa: N802  (http.server's name)
        self.rfile.read(int(self.headers.get("content-length") or 0))
        message = {"role": "assistant", "content": "Summary."}
        reply = {"object": "chat.completion", "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}
        body = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        return None


_endpoint: list[str] = []


def summary_endpoint() -> str:
    """The base URL of `_Completions`, serving in a thread of this process (started once)."""
    if not _endpoint:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Completions)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        _endpoint.append(f"http://127.0.0.1:{server.server_address[1]}/v1")
    return _endpoint[0]


async def summary_turn(f: Any, module: Any, chat: list[dict]) -> None:
    """`trim_turn` with summaries on: a trim that drops messages calls the summary endpoint
    (new texts every run: no cached summary), as an admin who turned summaries on would have it."""
    valves = f.valves
    on = {"summary_enabled": True, "summary_base_url": summary_endpoint(), "summary_model": "bench"}
    f.valves = f.Valves(**{**valves.model_dump(), **on, "max_context_tokens": 1_500, "reserve_output_tokens": 0})
    try:
        await trim_turn(f, module, chat)
    finally:
        f.valves = valves


def under_threshold(seed: int, limit: int = 24_000) -> list[dict]:
    """A chat just under the 25,000 characters of text from which the filter trims off the loop."""
    chat = synth.make_chat(seed, 60)
    size = lambda: sum(len(m["content"]) for m in chat if isinstance(m.get("content"), str))  # noqa: E731
    while size() > limit and len(chat) > 3:
        del chat[1]
    while chat[1]["role"] != "user":  # start the history with a user message, no orphan tool result
        del chat[1]
    return chat


def one_letter_messages(seed: int, n: int = 100_000) -> list[dict]:
    """A chat of `n` one-letter messages, users and replies taking turns: little text, many messages."""
    rng = random.Random(seed)
    chat = [{"role": "user" if k % 2 == 0 else "assistant", "content": rng.choice("abcdefghij")} for k in range(n - 1)]
    return [*chat, {"role": "user", "content": f"And now? {seed}"}]


def _code(path: str) -> Any:
    """The single file at `path` compiled, once: compiling is Open WebUI's, whatever the file does."""
    code = _compiled.get(path)
    if code is None:
        code = _compiled[path] = compile(Path(path).read_text(), path, "exec")
    return code


_compiled: dict[str, Any] = {}


def _executed(path: str) -> Any:
    """The single file at `path` executed anew, as Open WebUI loads a function (a fresh module in
    `sys.modules`), from its code object (`_code`)."""
    module = types.ModuleType(f"function_contextwarden_{uuid.uuid4().hex}")
    module.__dict__["__file__"] = path
    sys.modules[module.__name__] = module
    exec(_code(path), module.__dict__)
    return module


async def execute_file(f: Any, module: Any, arg: Any) -> None:
    """Open WebUI's load of the function: the file's module body run on the loop (the encodings
    are built already: that is the next scenario; the file was compiled before the window)."""
    _executed(module.__file__)


def _compile_first(f: Any, module: Any, arg: Any) -> Any:
    _code(module.__file__)
    return arg


execute_file.prepare = _compile_first  # type: ignore[attr-defined]


async def first_encoding(f: Any, module: Any, arg: tuple[Any, Any, list[dict]]) -> None:
    """A fresh worker's first turn while tiktoken builds the encodings the file preloads (each in
    one C call that holds the GIL). `first_encoding.prepare`, before the ticker, executed the file
    with tiktoken's registry emptied and its lock held, so the build starts here."""
    fresh, g, chat = arg
    tiktoken.registry._lock.release()  # the preload thread, waiting since the file ran, builds now
    await trim_turn(g, fresh, chat)
    loading = [t for t in threading.enumerate() if t.name.startswith("contextwarden-") and "cpu" not in t.name]
    await asyncio.to_thread(lambda: [t.join() for t in loading])
    assert {"o200k_base", "cl100k_base"} <= set(tiktoken.registry.ENCODINGS), "encodings not built"


def _prepare_first_encoding(f: Any, module: Any, chat: list[dict]) -> tuple[Any, Any, list[dict]]:
    tiktoken.registry.ENCODINGS.clear()  # built anew, as in a fresh worker (the file is cached)
    tiktoken.registry._lock.acquire()
    fresh = _executed(module.__file__)
    g = fresh.Filter()
    g.valves = g.Valves(max_context_tokens=8_000, reserve_output_tokens=1_024, openrouter_pricing=False)
    return fresh, g, chat


first_encoding.prepare = _prepare_first_encoding  # type: ignore[attr-defined]


def big_text(seed: int, shape: str) -> str:
    rng = random.Random(seed)
    if shape == "prose":
        return synth.prose(rng, MEGABYTE // 4)[:MEGABYTE]
    if shape in ("emoji", "lone surrogates"):  # no ASCII space: one 'word' of a megabyte
        first, width = (0x1F600, 4) if shape == "emoji" else (0xD800, 3)  # UTF-8 bytes a character
        return "".join(chr(first + rng.randrange(64)) for _ in range(MEGABYTE // width))
    return base64.b64encode(rng.randbytes(MEGABYTE * 3 // 4)).decode()  # a pasted blob: few long pieces


def scenarios() -> dict[str, Callable[[int], tuple[Callable[..., Awaitable[None]], Any]]]:
    """name -> (seed -> (hook runner, its argument)); every seed makes new texts."""
    out: dict[str, Callable[[int], tuple[Callable[..., Awaitable[None]], Any]]] = {}
    out["idle loop, 0.5 s (the machine's own share)"] = lambda seed: ("idle", None)
    out["cold trim, just under 25,000 characters (stays on the loop)"] = lambda seed: (trim_turn, under_threshold(seed))
    for n in (200, 1_000, 2_000):
        out[f"cold trim, {n:,} messages"] = lambda seed, n=n: (trim_turn, synth.make_chat(seed, n))
    for shape in ("prose", "base64", "emoji", "lone surrogates"):

        def with_big(seed: int, shape: str = shape) -> tuple:
            chat = synth.make_chat(seed, 20)
            chat[-1] = {"role": "user", "content": big_text(seed, shape)}
            return trim_turn, chat

        out[f"1 MB {shape} message, 20 messages"] = with_big

        def big_reply(seed: int, shape: str = shape) -> tuple:
            return outlet_turn, synth.make_chat(seed, 20) + [{"role": "assistant", "content": big_text(seed, shape)}]

        out[f"outlet, 1 MB {shape} reply"] = big_reply
    question = [{"role": "user", "content": "Which tool fits?"}]
    out["3,000 tool definitions"] = lambda seed: (body_turn, {"messages": question, "tools": many_tools(seed)})
    out["2 MB response format"] = lambda seed: (
        body_turn,
        {"messages": question, "response_format": big_response_format(seed)},
    )
    out["100,000 one-letter messages"] = lambda seed: (trim_turn, one_letter_messages(seed))
    out["2,000 one-letter messages"] = lambda seed: (trim_turn, one_letter_messages(seed, 2_000))
    out["5,000 short messages"] = lambda seed: (trim_turn, synth.make_chat(seed, 5_000, mean_tokens=12))
    out["10,000 image parts"] = lambda seed: (trim_turn, many_images(seed))
    out["100,000 empty text parts"] = lambda seed: (trim_turn, empty_parts(seed))
    out["64 tools, 5 MB of schemas"] = lambda seed: (body_turn, {"messages": question, "tools": big_schemas(seed)})
    out["300,000 tool calls in the newest reply"] = lambda seed: (trim_turn, many_tool_calls(seed))
    out["1,000 chunks reporting running usage"] = lambda seed: (running_usage, 1_000)
    out["trim that calls the summary endpoint, 40 messages"] = lambda seed: (summary_turn, synth.make_chat(seed, 40))
    out[f"{CONCURRENT} concurrent cold trims, 1,000 messages"] = lambda seed: (
        "concurrent",
        [synth.make_chat(seed * 100 + k, 1_000) for k in range(CONCURRENT)],
    )
    out[f"{SMALL_CONCURRENT} concurrent turns, each just under 25,000 characters"] = lambda seed: (
        "concurrent",
        [under_threshold(seed * 100 + k) for k in range(SMALL_CONCURRENT)],
    )
    out["the single file executed (Open WebUI's load, compiled before)"] = lambda seed: (execute_file, None)
    out["a fresh worker's first turn: tiktoken builds its encodings"] = lambda seed: (
        first_encoding,
        synth.make_chat(seed, 20),
    )
    return out


async def run_one(f: Any, module: Any, runner: Any, arg: Any, *, tick: bool = True) -> tuple[float, float]:
    """(longest stall, wall time) in milliseconds for one scenario run (no stall without `tick`)."""
    if (prepare := getattr(runner, "prepare", None)) is not None:  # set-up outside the window
        arg = prepare(f, module, arg)
    gc.collect()
    ticker = Ticker()
    if tick:
        await ticker.__aenter__()
    t0 = time.perf_counter()
    if runner == "idle":
        await asyncio.sleep(0.5)
    elif runner == "concurrent":
        await asyncio.gather(*(trim_turn(f, module, chat) for chat in arg))
    else:
        await runner(f, module, arg)
    wall = time.perf_counter() - t0
    if tick:
        await ticker.__aexit__()
    return ticker.longest * 1e3, wall * 1e3


async def measure(
    bundles: list[Path], reps: int, only: str | None, tick: bool
) -> dict[str, dict[str, list[tuple[float, float]]]]:
    modules = {str(path): speed.load_bundle(path) for path in bundles}
    filters = {name: make_filter(module) for name, module in modules.items()}
    for name, f in filters.items():  # warm-up: imports, regexes, encodings, price book
        await trim_turn(f, modules[name], synth.make_chat(1, 50))
    results: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for index, (title, make) in enumerate(scenarios().items()):
        if only and only not in title:
            continue
        results[title] = {name: [] for name in modules}
        for rep in range(reps):
            runner, arg = make(10_000 * (index + 1) + rep)  # texts no earlier run has counted
            names = list(modules)
            names = names[rep % len(names) :] + names[: rep % len(names)]
            for name in names:
                fresh_arg = json.loads(json.dumps(arg))  # each its own objects, as Open WebUI parses every request anew
                results[title][name].append(await run_one(filters[name], modules[name], runner, fresh_arg, tick=tick))
        line = "  ".join(
            f"{Path(n).name}: max stall {max(s for s, _ in v):.0f} ms, wall {statistics.median(w for _, w in v):.0f} ms"
            for n, v in results[title].items()
        )
        print(f"{title}: {line}", flush=True)
    return results


def markdown(results: dict, bundles: list[Path], reps: int, notes: dict[str, Any]) -> str:
    names = [str(b) for b in bundles]
    head = "| scenario | " + " | ".join(f"{Path(n).name}: longest stall (median) / wall" for n in names) + " |"
    rows = [head, "|---|" + "---|" * len(names)]
    for title, per in results.items():
        cells = []
        for n in names:
            stalls = [s for s, _ in per[n]]
            cells.append(
                f"{max(stalls):.0f} ms ({statistics.median(stalls):.0f}) / "
                f"{statistics.median(w for _, w in per[n]):.0f} ms"
            )
        rows.append(f"| {title} | " + " | ".join(cells) + " |")
    meta = ", ".join(f"{k} {v}" for k, v in notes.items())
    return "\n".join(rows) + f"\n\n{reps} repetitions each; {meta}.\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", action="append", type=Path, help="a built single file (repeat to compare)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--only", help="run the scenarios whose title holds this text")
    parser.add_argument("--markdown", type=Path, help="append the table to this file")
    parser.add_argument(
        "--no-ticker", action="store_true", help="wall times only (the ticker itself costs the hooks time)"
    )
    args = parser.parse_args()
    bundles = args.bundle or [speed.BUNDLE]
    speed.seed_encodings()
    load_start = os.getloadavg()
    results = asyncio.run(measure(bundles, args.reps, args.only, not args.no_ticker))
    info = speed.machine()
    notes = {
        "cpu": f"{info['cpu']} x{info['nproc']}",
        "python": info["python"],
        "tiktoken": info["tiktoken"],
        "load average (1, 5, 15 min) at start": tuple(round(x, 1) for x in load_start),
        "at end": tuple(round(x, 1) for x in os.getloadavg()),
        "sys.getswitchinterval()": sys.getswitchinterval(),
        "ticker": "off (stalls not measured)" if args.no_ticker else f"every {TICK_SECONDS * 1e3:g} ms",
    }
    table = markdown(results, bundles, args.reps, notes)
    print(table)
    if args.markdown:
        with args.markdown.open("a") as out:
            out.write(table + "\n")


if __name__ == "__main__":
    main()
