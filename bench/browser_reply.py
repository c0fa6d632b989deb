"""Reply time in a real browser: a 200-message chat in Open WebUI 0.12.4, filter off / lexical / semantic.

Run from the repository root with the dev venv (it has selenium and httpx; the e2e harness's
Open WebUI venv is made or reused by `tests/e2e/owui.py: ensure_venv()`):

    .venv/bin/python bench/browser_reply.py                # 7 repetitions: bench/results/browser_reply.{md,json}
    .venv/bin/python bench/browser_reply.py --reps 2 --out /tmp/cwbr   # a smoke run
    .venv/bin/python bench/browser_reply.py --hook-times --setups off lexical lexical_nostatus semantic \
        semantic_nostatus semantic_warm     # also where the time goes (see --hook-times below)

What a person waits for (issue 30, "never slow"): Open WebUI started the e2e harness's way
(`owui.start_open_webui`: loopback only, offline, its default local MiniLM embedder loaded), the
harness's fake OpenAI-compatible backend answering at once, the built single file
`open_webui_filter.py` (or `--build`) installed as a global filter. For every repetition and
set-up a new chat of 200 messages (100 user/assistant pairs of synthetic prose, 100-300 tokens
each) is created through Open WebUI's API, opened in headless Chromium, and two messages are
sent one after the other (the first turn of a chat the filter has not seen, then the next turn).
Each is timed in the page from the click on the send button until the reply is fully shown: its
text complete, its action buttons there and the stop button gone (`shown`: Open WebUI ends the
turn's task after outlet, so this includes the outlet); with the filter on, also until the
filter's usage line is shown above it (`usage line`). A MutationObserver records the moments
(`performance.now()`), so the browser is not polled for them; the fake backend notes when the
request reached it (`at backend`: Open WebUI's work before the provider call, the filter's inlet
and request passes included).

Set-ups, interleaved (the order rotates each repetition), each with the same valves apart from
the one named (`max_context_tokens` 8,192 so the chat is trimmed, `openrouter_pricing` off:
loopback only):

- `off`: the filter installed but switched off (`is_active` false: Open WebUI skips it).
- `lexical`: the filter on, `semantic_relevance` off (word matching only).
- `semantic`: the filter on with its defaults (semantic relevance through Open WebUI's MiniLM).
- `semantic_warm`: the same, on a chat whose texts the filter has already read and embedded
  (API turns of the same messages first, each waiting for its embedding call, until every text
  is embedded), as for a chat this worker served before.
- `lexical_nostatus`, `semantic_nostatus` (only when named in `--setups`): `show_status` off, so
  Open WebUI saves no status line into the chat.

`--hook-times` installs the file with a timer appended around each hook (`HOOK_TIMER`; the
repository's file is not changed): each turn's milliseconds inside inlet, request, stream (all
chunks) and outlet, and how much of it Open WebUI's event emitter took (showing and saving the
status lines).

Between turns and set-ups the script waits until Open WebUI and Chromium are idle (the
background embedding after a reply included), as a person reading the reply would. The
machine's load average is recorded; medians, IQR and per-repetition paired differences against
`off` (same repetition, same turn) are reported. No timing is asserted anywhere.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
E2E = ROOT / "tests" / "e2e"
sys.path[:0] = [str(E2E), str(Path(__file__).resolve().parent)]

import synth  # noqa: E402
from browser import find_browser, start_chromium  # noqa: E402
from fake_backend import FakeBackend  # noqa: E402
from owui import (  # noqa: E402
    OWUI_VERSION,
    OpenWebUI,
    add_user,
    chat,
    ensure_venv,
    install_function,
    set_valves,
    start_open_webui,
)

FID = "contextwarden"
MODEL = "gpt-4o"
SETUPS = ("off", "lexical", "semantic", "semantic_warm")
EXTRA_SETUPS = ("lexical_nostatus", "semantic_nostatus")  # for attribution: no status lines, so Open WebUI saves none
BASE_VALVES: dict[str, Any] = {"max_context_tokens": 8_192, "openrouter_pricing": False}
SETUP_VALVES: dict[str, dict[str, Any]] = {
    "lexical": {**BASE_VALVES, "semantic_relevance": False},
    "semantic": dict(BASE_VALVES),
    "semantic_warm": dict(BASE_VALVES),
    "lexical_nostatus": {**BASE_VALVES, "semantic_relevance": False, "show_status": False},
    "semantic_nostatus": {**BASE_VALVES, "show_status": False},
}
PREWARM_VALVES = {**BASE_VALVES, "embed_max_texts": 256, "embed_timeout_seconds": 30}
PREWARM_QUESTION = "What did we settle on?"
TASKS_OFF = {"ENABLE_TITLE_GENERATION": False, "ENABLE_TAGS_GENERATION": False, "ENABLE_FOLLOW_UP_GENERATION": False}
PAIRS = 100
TOKENS = (100, 300)
TURN_TIMEOUT_S = 120.0
SETTLE_MAX_S = 45.0
SETTLE_CPU_SHARE = 0.08  # of one core, over each SETTLE_WINDOW_S
SETTLE_WINDOW_S = 0.5
PLAIN_WORDS = (
    "river lantern copper meadow signal harbor quartz willow ember falcon orbit cedar prism tundra "
    "velvet anchor basalt citrus dune glacier hollow ivory juniper kelp lagoon marble budget report"
).split()

# Installed in the page right before the click on the send button: records when the new reply
# (the one starting with its unique token) first shows text, is complete, is done (actions shown,
# no stop button) and, when wanted, carries the filter's usage line.
WATCH = r"""
const [token, expected, wantStatus] = arguments;
const norm = s => (s || '').replace(/\s+/g, ' ').trim();
const w = window.__cwWatch = {t0: performance.now(), epoch0: Date.now(), marks: {}, finished: false};
function mark(name) { if (!(name in w.marks)) w.marks[name] = performance.now() - w.t0; }
function check() {
  if (w.finished) return;
  const replies = document.querySelectorAll('.chat-assistant');
  const last = replies[replies.length - 1];
  if (!last) return;
  const content = last.querySelector('#response-content-container');
  const text = norm(content ? content.innerText : '');
  if (!text.startsWith(token)) return;
  mark('first_text');
  if (text !== expected) return;
  mark('text');
  const stop = document.querySelector('path[d*="zm6-2.438c0-.724"]');
  const message = last.closest('[id^="message-"]') || last;
  if (message.querySelector('button[aria-label="Regenerate"]') && !stop) mark('shown');
  const line = message.querySelector('button[aria-label="Toggle status history"] .status-description');
  if (line && /tokens in · /.test(line.innerText)) mark('usage_line');
  if ('shown' in w.marks && (!wantStatus || 'usage_line' in w.marks)) {
    w.finished = true; w.observer.disconnect(); clearInterval(w.timer);
  }
}
w.observer = new MutationObserver(check);
w.observer.observe(document.body, {childList: true, subtree: true, characterData: true});
w.timer = setInterval(check, 10);
document.querySelector('#send-message-button').click();
return w.epoch0;
"""


# Appended to the installed source with --hook-times (the repository's file is not changed): each
# hook's wall time inside the filter, and how long of it Open WebUI's event emitter took (showing a
# status line: Open WebUI saves each one into the chat), one line a call in Open WebUI's log.
HOOK_TIMER = """

import functools as _cw_functools
import time as _cw_time


def _cw_timed(_cw_name):
    hook = getattr(Filter, _cw_name)

    @_cw_functools.wraps(hook)
    async def timed(self, *args, **kwargs):
        emitter, waited = kwargs.get("__event_emitter__"), [0.0, 0]
        if emitter is not None:

            async def timed_emitter(event):
                waited[1] += 1
                started = _cw_time.perf_counter()
                try:
                    return await emitter(event)
                finally:
                    waited[0] += _cw_time.perf_counter() - started

            kwargs["__event_emitter__"] = timed_emitter
        started = _cw_time.perf_counter()
        try:
            return await hook(self, *args, **kwargs)
        finally:
            took = (_cw_time.perf_counter() - started) * 1e3
            print(f"\\ncw-hook {_cw_name} {took:.3f} {waited[0] * 1e3:.3f} {waited[1]}", flush=True)

    return timed


for _cw_hook in ("inlet", "request", "stream", "outlet"):
    setattr(Filter, _cw_hook, _cw_timed(_cw_hook))
"""


def hook_times(log: str) -> dict[str, float]:
    """Milliseconds inside the filter's hooks during one turn (summed per hook; `emit`: the part
    spent in Open WebUI's event emitter), from HOOK_TIMER's lines."""
    out: dict[str, float] = {}
    for hook, took, emitted, events in re.findall(r"cw-hook (\w+) ([\d.]+) ([\d.]+) (\d+)", log):
        out[f"{hook}_ms"] = round(out.get(f"{hook}_ms", 0.0) + float(took), 3)
        out["emit_ms"] = round(out.get("emit_ms", 0.0) + float(emitted), 3)
        out["emits"] = out.get("emits", 0) + int(events)
        out["stream_calls"] = out.get("stream_calls", 0) + (hook == "stream")
    return out


@dataclass
class TimedBackend(FakeBackend):
    """The harness's fake backend, also noting when each chat request arrived (epoch seconds)."""

    arrivals: list[float] = field(default_factory=list)

    def _record(self, body: dict[str, Any], headers: dict[str, str]) -> Any:
        self.arrivals.append(time.time())
        return super()._record(body, headers)


# -- the chat ---------------------------------------------------------------------------------------


def make_messages(seed: int, pairs: int = PAIRS) -> list[dict[str, str]]:
    """`pairs` user/assistant pairs of synthetic prose (markdown, code, numbers), 100-300 tokens each."""
    rng = random.Random(seed)
    return [
        {"role": role, "content": synth.prose(rng, rng.randint(*TOKENS))}
        for _ in range(pairs)
        for role in ("user", "assistant")
    ]


def owui_chat(messages: list[dict[str, str]], title: str) -> dict[str, Any]:
    """The chat as Open WebUI's frontend stores it: a linked history of messages (read off a chat
    the 0.12.4 page made: ids, parent and children, the user's `models`, the reply's `output`)."""
    ids = [str(uuid.uuid4()) for _ in messages]
    start = int(time.time()) - len(messages) * 60
    history: dict[str, Any] = {}
    for i, (mid, message) in enumerate(zip(ids, messages, strict=True)):
        entry: dict[str, Any] = {
            "id": mid,
            "parentId": ids[i - 1] if i else None,
            "childrenIds": [ids[i + 1]] if i + 1 < len(ids) else [],
            "role": message["role"],
            "content": message["content"],
            "timestamp": start + 60 * i,
        }
        if message["role"] == "user":
            entry["models"] = [MODEL]
        else:
            output_text = {"type": "output_text", "text": message["content"]}
            entry |= {
                "model": MODEL,
                "modelIdx": 0,
                "done": True,
                "output": [
                    {
                        "type": "message",
                        "id": f"msg_{uuid.uuid4().hex[:24]}",
                        "status": "completed",
                        "role": "assistant",
                        "content": [output_text],
                    }
                ],
            }
        history[mid] = entry
    return {
        "title": title,
        "models": [MODEL],
        "history": {"messages": history, "currentId": ids[-1]},
        "messages": [history[mid] for mid in ids],
        "files": [],
        "tags": [],
        "params": {},
        "timestamp": int(time.time() * 1000),
    }


def question(rng: random.Random, messages: list[dict[str, str]]) -> str:
    """A question about something said early in the chat (so relevance has work to do)."""
    words = [w for w in messages[rng.randrange(0, 40)]["content"].split() if w.isalpha() and len(w) > 4]
    picked = rng.sample(words, min(3, len(words))) or ["budget"]
    return f"Earlier you mentioned {', '.join(picked)}. Can you remind me what you said about them and why?"


def reply_for(token: str, rng: random.Random) -> str:
    """A plain reply (no markdown), starting with its unique token, ~60 words."""
    return f"{token} noted. " + " ".join(rng.choice(PLAIN_WORDS) for _ in range(60)) + "."


# -- the server and the browser ---------------------------------------------------------------------


def set_active(owui: OpenWebUI, active: bool) -> None:
    state = owui.api("GET", f"/api/v1/functions/id/{FID}")
    if bool(state.get("is_active")) != active:
        state = owui.api("POST", f"/api/v1/functions/id/{FID}/toggle")
    assert bool(state.get("is_active")) == active, state


def configure(owui: OpenWebUI, setup: str) -> None:
    if setup == "off":
        set_active(owui, False)
        return
    set_active(owui, True)
    set_valves(owui, FID, SETUP_VALVES[setup])


def prewarm_turns(messages: list[dict[str, str]]) -> int:
    """API turns enough to embed every text of `messages` (plus the warm-up question): the filter
    asks for its batch (4 after timeouts, doubled after each call that finished, at most
    `embed_max_texts`), so from the worst case, 4, up to PREWARM_VALVES' batch; one more to spare."""
    try:
        from contextwarden.core.semantic import embed_texts

        needed = len(embed_texts([*messages, {"role": "user", "content": PREWARM_QUESTION}]))
    except Exception:  # noqa: BLE001 - the source tree is being edited: assume the most
        needed = 3_000
    turns, done, batch = 1, 0, 4
    while done < needed:
        done += batch
        batch = min(PREWARM_VALVES["embed_max_texts"], 2 * batch)
        turns += 1
    return turns


def prewarm(owui: OpenWebUI, backend: TimedBackend, messages: list[dict[str, str]]) -> list[float]:
    """Let the filter read and embed this chat's texts (API turns, each waiting for its embedding
    call) until all are embedded; the seconds each API turn took."""
    set_valves(owui, FID, PREWARM_VALVES)
    took = []
    try:
        for _ in range(prewarm_turns(messages)):
            backend.reset()
            t0 = time.perf_counter()
            chat(owui, MODEL, [*messages, {"role": "user", "content": PREWARM_QUESTION}])
            took.append(round(time.perf_counter() - t0, 2))
    finally:
        set_valves(owui, FID, SETUP_VALVES["semantic_warm"])
    return took


def _tree(root: int) -> list[int]:
    """`root` and its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes (those still running)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / tick


def settle(roots: list[int]) -> float:
    """Wait until these process trees use under SETTLE_CPU_SHARE of a core for two windows in a
    row (at most SETTLE_MAX_S); the seconds waited."""
    started = time.monotonic()
    quiet = 0
    while quiet < 2 and time.monotonic() - started < SETTLE_MAX_S:
        pids = [pid for root in roots for pid in _tree(root)]
        before = cpu_seconds(pids)
        time.sleep(SETTLE_WINDOW_S)
        quiet = quiet + 1 if cpu_seconds(pids) - before < SETTLE_CPU_SHARE * SETTLE_WINDOW_S else 0
    return time.monotonic() - started


def wait_until(condition: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out: {what}")
        time.sleep(0.05)


def open_in_page(driver: Any, owui: OpenWebUI, chat_id: str, last_id: str) -> None:
    """Open the chat; returns once its last reply (`#message-<id>`) and the message box are shown."""
    driver.get(f"{owui.base_url}/c/{chat_id}")
    wait_until(
        lambda: driver.execute_script(
            "return !!(document.querySelector('#chat-input') && document.getElementById('message-' + arguments[0]));",
            last_id,
        ),
        60,
        "the chat page with its last reply",
    )


def send_timed(
    driver: Any, backend: TimedBackend, text: str, reply: str, token: str, want_status: bool
) -> dict[str, Any]:
    """Paste `text` into the message box, click send, and return the page's marks (ms after the
    click) plus when the backend got the request."""
    box = driver.find_element("css selector", "#chat-input")
    box.click()
    driver.execute_script("arguments[0].focus(); document.execCommand('insertText', false, arguments[1]);", box, text)
    wait_until(
        lambda: driver.find_elements("css selector", "#send-message-button") and text[-30:] in box.text,
        30,
        "the question in the message box",
    )
    backend.reset()
    backend.arrivals.clear()
    backend.push_reply(content=reply)
    epoch0 = driver.execute_script(WATCH, token, " ".join(reply.split()), want_status)
    try:
        watch = wait_until(
            lambda: driver.execute_script("const w = window.__cwWatch; return w && w.finished ? w : null;"),
            TURN_TIMEOUT_S,
            f"reply {token} shown" + (" with its usage line" if want_status else ""),
        )
    except AssertionError as exc:
        shot = Path(tempfile.gettempdir()) / f"browser_reply-failure-{token}"
        driver.save_screenshot(f"{shot}.png")
        Path(f"{shot}.html").write_text(driver.page_source, "utf-8")
        exc.add_note(f"marks: {driver.execute_script('return window.__cwWatch.marks')}; page: {shot}.png/.html")
        raise
    marks = {name: round(ms / 1000, 4) for name, ms in watch["marks"].items()}
    requests = list(backend.requests)
    assert len(requests) == 1, f"{len(requests)} backend requests for one turn"
    marks["backend"] = round(backend.arrivals[0] - epoch0 / 1000, 4)
    marks["sent_messages"] = len(requests[0]["messages"])
    marks["_sent"] = requests[0]["messages"]
    return marks


# -- the run ----------------------------------------------------------------------------------------


def machine(build: Path) -> dict[str, Any]:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "?")
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "open_webui": OWUI_VERSION,
        "commit": git("rev-parse", "--short", "HEAD"),
        "build": str(build),
        "build_sha256": hashlib.sha256(build.read_bytes()).hexdigest()[:16],
        "build_uncommitted_changes": bool(git("status", "--porcelain", str(build))),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "loadavg_start": os.getloadavg(),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    info = machine(args.build)
    info["command"] = "bench/browser_reply.py " + " ".join(sys.argv[1:])
    if args.build_note:
        info["build_note"] = args.build_note
    found = find_browser()
    if isinstance(found, str):
        raise SystemExit(f"no browser: {found}")
    source = args.build.read_text("utf-8") + (HOOK_TIMER if args.hook_times else "")
    venv = ensure_venv()
    backend = TimedBackend().start()
    workdir = Path(tempfile.mkdtemp(prefix="cw-browser-reply-"))
    owui = start_open_webui(venv, backend, workdir)
    driver = None
    rows: list[dict[str, Any]] = []
    try:
        print(f"Open WebUI up in {owui.timings['ready_s']:.0f} s ({workdir})", file=sys.stderr)
        config = owui.api("GET", "/api/v1/tasks/config")
        owui.api("POST", "/api/v1/tasks/config/update", json_body={**config, **TASKS_OFF})
        install_function(owui, FID, source, SETUP_VALVES["semantic"], name="contextwarden")
        user = add_user(owui, "Bench user", f"bench-{uuid.uuid4().hex[:8]}@example.com")
        driver = start_chromium(*found)
        driver.get(f"{owui.base_url}/auth")
        driver.execute_script("localStorage.setItem('token', arguments[0]);", user["token"])
        roots = [owui.process.pid, driver.service.process.pid]
        # untimed: one chat through every set-up, so each path has run once (imports, encodings)
        chosen = tuple(args.setups)
        for rep in range(-1, args.reps):
            for setup in chosen[rep % len(chosen) :] + chosen[: rep % len(chosen)] if rep >= 0 else chosen:
                rng = random.Random(f"{rep}-{setup}")
                messages = make_messages(rng.randrange(1 << 30), args.pairs)
                configure(owui, setup)
                warm = prewarm(owui, backend, messages) if setup == "semantic_warm" else None
                stored = owui_chat(messages, f"bench {rep} {setup}")
                created = owui.api("POST", "/api/v1/chats/new", json_body={"chat": stored}, token=user["token"])
                open_in_page(driver, owui, created["id"], stored["history"]["currentId"])
                for turn in range(1, args.turns + 1):
                    waited = settle(roots)
                    token = f"R{uuid.uuid4().hex[:7]}"
                    reply = reply_for(token, rng)
                    cpu0 = cpu_seconds(_tree(owui.process.pid))
                    since = owui.log_mark()
                    shows_status = setup != "off" and SETUP_VALVES[setup].get("show_status", True)
                    marks = send_timed(driver, backend, question(rng, messages), reply, token, shows_status)
                    if args.hook_times and setup != "off":
                        wait_until(lambda since=since: "cw-hook outlet" in owui.log_text(since), 10, "the outlet")
                        marks |= hook_times(owui.log_text(since))
                    sent = marks.pop("_sent")
                    if setup == "off" and turn == 1:  # the page sends the stored texts (the pre-warm's)
                        marks["texts_as_stored"] = [m.get("content") for m in sent[:-1]] == [
                            m["content"] for m in messages
                        ]
                    row = {
                        "rep": rep,
                        "setup": setup,
                        "turn": turn,
                        **marks,
                        "server_cpu_s": round(cpu_seconds(_tree(owui.process.pid)) - cpu0, 3),
                        "settled_before_s": round(waited, 2),
                        "loadavg_1m": os.getloadavg()[0],
                    }
                    if warm is not None and turn == 1:
                        row["prewarm_api_turns_s"] = warm
                    if rep >= 0:
                        rows.append(row)
                    print(json.dumps(row), file=sys.stderr)
                    if rep == 0 and turn == args.turns and args.shots:
                        args.shots.mkdir(parents=True, exist_ok=True)
                        driver.save_screenshot(str(args.shots / f"browser_reply-{setup}.png"))
        info["loadavg_end"] = os.getloadavg()
        info["filter_warnings"] = [
            line.split(" - ", 1)[-1][:200]
            for line in owui.log_text().splitlines()
            if "contextwarden" in line and ("WARNING" in line or "ERROR" in line)
        ]
    finally:
        if driver is not None:
            driver.quit()
        owui.stop()
        backend.stop()
    return {"machine": info, "valves": SETUP_VALVES, "pairs": args.pairs, "rows": rows}


# -- the report -------------------------------------------------------------------------------------


def _q(values: list[float]) -> tuple[float, float, float]:
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, med, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, med, q3


def _median(values: Any) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(result: dict[str, Any]) -> list[dict[str, Any]]:
    rows = result["rows"]
    by = {(r["setup"], r["turn"], r["rep"]): r for r in rows}
    out = []
    for turn in sorted({r["turn"] for r in rows}):
        for setup in SETUPS + EXTRA_SETUPS:
            mine = [r for r in rows if r["setup"] == setup and r["turn"] == turn]
            if not mine:
                continue
            shown = [r["shown"] for r in mine]
            q1, med, q3 = _q(shown)
            deltas = [r["shown"] - by[("off", turn, r["rep"])]["shown"] for r in mine if ("off", turn, r["rep"]) in by]
            line = {
                "setup": setup,
                "turn": turn,
                "n": len(mine),
                "shown_median_s": med,
                "shown_q1_s": q1,
                "shown_q3_s": q3,
                "shown_min_s": min(shown),
                "shown_max_s": max(shown),
                "paired_delta_vs_off_median_s": statistics.median(deltas) if deltas and setup != "off" else None,
                "paired_delta_vs_off_q": _q(deltas) if deltas and setup != "off" else None,
                "backend_median_s": statistics.median(r["backend"] for r in mine),
                "usage_line_median_s": _median(r.get("usage_line") for r in mine),
                "server_cpu_median_s": statistics.median(r["server_cpu_s"] for r in mine),
                "settled_before_median_s": statistics.median(r["settled_before_s"] for r in mine),
                "sent_messages": sorted({r["sent_messages"] for r in mine}),
            }
            for hook in ("inlet", "request", "stream", "outlet", "emit"):
                line[f"{hook}_median_ms"] = _median(r.get(f"{hook}_ms") for r in mine)
            line["emits_median"] = _median(r.get("emits") for r in mine)
            out.append(line)
    return out


def report(result: dict[str, Any], summary: list[dict[str, Any]]) -> str:
    m = result["machine"]
    off = {s["turn"]: s["shown_median_s"] for s in summary if s["setup"] == "off"}

    def f(x: float | None, digits: int = 2) -> str:
        return "–" if x is None else f"{x:.{digits}f}"

    lines = [
        "# Reply time in a real browser (Open WebUI 0.12.4, 200-message chat)",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores (shared); {m['date']}; Open WebUI {m['open_webui']}; "
        f"commit {m['commit']}"
        + (f", `{Path(m['build']).name}` sha256 {m['build_sha256']}" if m.get("build") else "")
        + (" (uncommitted changes)" if m.get("build_uncommitted_changes") else "")
        + (f" ({m['build_note']})" if m.get("build_note") else "")
        + "; "
        f"load average at start {', '.join(f'{x:.2f}' for x in m['loadavg_start'])}, "
        f"at end {', '.join(f'{x:.2f}' for x in m['loadavg_end'])}.",
        f"Command: `.venv/bin/python {m['command'].strip()}` (method: the docstring of `bench/browser_reply.py`).",
        "",
        "Seconds from the click on send until the reply is fully shown (text complete, actions shown, stop "
        "button gone), median and IQR over the repetitions; *Δ vs off*: the median of per-repetition "
        "differences to `off` (same repetition, same turn), with their IQR; *usage line*: until the filter's "
        "line above the reply is shown (after outlet); *at backend*: until the fake backend got the request "
        "(Open WebUI's work and the filter's inlet and request passes); *server CPU*: Open WebUI's CPU "
        "seconds during the turn; *sent*: messages that reached the backend (201 = the whole chat and "
        "the question).",
        "",
        "| set-up | turn | n | shown (median) | IQR | min-max | Δ vs off (paired) | Δ IQR | Δ of medians "
        "| usage line | at backend | server CPU | sent |",
        "|---|---:|---:|---:|---|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for s in summary:
        dq = s["paired_delta_vs_off_q"]
        lines.append(
            f"| {s['setup']} | {s['turn']} | {s['n']} | {f(s['shown_median_s'], 3)} "
            f"| {f(s['shown_q1_s'])}-{f(s['shown_q3_s'])} | {f(s['shown_min_s'])}-{f(s['shown_max_s'])} "
            f"| {f(s['paired_delta_vs_off_median_s'], 3)} | {f(dq[0]) + ' to ' + f(dq[2]) if dq else '–'} "
            f"| {f(s['shown_median_s'] - off[s['turn']], 3) if s['setup'] != 'off' and s['turn'] in off else '–'} "
            f"| {f(s['usage_line_median_s'])} | {f(s['backend_median_s'])} | {f(s['server_cpu_median_s'])} "
            f"| {', '.join(map(str, s['sent_messages']))} |"
        )
    if any(s["inlet_median_ms"] is not None for s in summary):
        lines += [
            "",
            "Inside the filter (`--hook-times`: a timer around each hook of the installed copy), median "
            "milliseconds a turn: each hook's wall time (the `stream` hook summed over the reply's chunks), "
            "and *emit*: the part of it spent in Open WebUI's event emitter (a status line: Open WebUI "
            "sends it to the page and saves it into the chat).",
            "",
            "| set-up | turn | inlet | request | stream (all chunks) | outlet | of which emit | status events "
            "| shown − off (paired) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for s in summary:
            if s["inlet_median_ms"] is None:
                continue
            delta = s["paired_delta_vs_off_median_s"]
            lines.append(
                f"| {s['setup']} | {s['turn']} | {f(s['inlet_median_ms'], 1)} | {f(s['request_median_ms'], 1)} "
                f"| {f(s['stream_median_ms'], 1)} | {f(s['outlet_median_ms'], 1)} | {f(s['emit_median_ms'], 1)} "
                f"| {f(s['emits_median'], 0)} | {f(None if delta is None else delta * 1e3, 0)} |"
            )
    lines += [
        "",
        "Turn 1: the first message sent in a chat the filter has not seen in this process (just opened "
        "in the page); turn 2: the next message in the same chat, after the page and Open WebUI went idle "
        "(settle medians per set-up in the JSON: the background embedding after a reply shows there).",
        "",
        f"Valves besides the defaults: {json.dumps(BASE_VALVES)}; `lexical` adds "
        '`{"semantic_relevance": false}`, `*_nostatus` `{"show_status": false}`. Title, tag and follow-up '
        "generation off (as in the browser test).",
    ]
    if m.get("filter_warnings"):
        lines += ["", "Filter warnings in Open WebUI's log:", ""] + [f"- `{w}`" for w in m["filter_warnings"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=PAIRS, help="user/assistant pairs in each chat")
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=SETUPS + EXTRA_SETUPS)
    parser.add_argument(
        "--hook-times", action="store_true", help="install the file with a timer around each hook (attribution)"
    )
    parser.add_argument("--build", type=Path, default=ROOT / "open_webui_filter.py")
    parser.add_argument("--build-note", default="", help="what --build is, for the report (e.g. its commit)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--name", default="browser_reply", help="the results' file name (.md, .json)")
    parser.add_argument("--shots", type=Path, default=Path(tempfile.gettempdir()) / "cw-browser-reply")
    parser.add_argument("--from-json", type=Path, help="only write the report again from a results JSON")
    args = parser.parse_args()
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(ROOT / ".cache" / "tiktoken"))
    result = json.loads(args.from_json.read_text()) if args.from_json else run(args)
    summary = summarize(result)
    result["summary"] = summary
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    text = report(result, summary)
    (args.out / f"{args.name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
