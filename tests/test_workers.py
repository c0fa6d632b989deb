"""Several workers, one Redis: the built file in separate processes sharing one real Redis.

Each worker is a Python process that execs ``open_webui_filter.py`` as Open WebUI loads a
function and drives ONE ``Filter`` instance (``tests/worker_proc.py``), as each uvicorn worker or
replica of Open WebUI does. Every test gets its own Redis key prefix, so it sees only its keys.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import redis

from contextwarden.core.conversation import is_recall_message
from contextwarden.core.tokens import TokenCounter
from contextwarden.money.pricing import PriceBook, resolve_model
from contextwarden.money.usage import Usage, compute_cost

from helpers import BUILT_FILE

pytestmark = pytest.mark.redis

WORKER_SCRIPT = Path(__file__).with_name("worker_proc.py")
MODEL = "gpt-4o"
WINDOW, RESERVE = 3_000, 500
BUDGET = WINDOW - RESERVE
REPLY_TIMEOUT_S = 120.0
PROMPT, COMPLETION = 1_000, 200
WORDS = "amber basin cobalt delta ember fjord granite harbor indigo jasper kestrel lumen mosaic nectar".split()


class WorkerProcess:
    """A running tests/worker_proc.py: send a command, read its JSON reply, read its log."""

    def __init__(self, log_path: Path, key_prefix: str) -> None:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only the built file runs
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, str(WORKER_SCRIPT), str(BUILT_FILE), key_prefix],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )

    def send(self, op: str, **fields: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.process.stdin.flush()

    def receive(self) -> Any:
        assert self.process.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            if not selector.select(REPLY_TIMEOUT_S):
                raise AssertionError(f"worker did not answer in {REPLY_TIMEOUT_S:.0f} s; log:\n{self.log()}")
        line = self.process.stdout.readline()
        if not line:
            raise AssertionError(f"worker exited ({self.process.poll()}); log:\n{self.log()}")
        reply = json.loads(line)
        if "error" in reply:
            raise AssertionError(f"worker: {reply['error']}; log:\n{self.log()}")
        return reply["ok"]

    def call(self, op: str, **fields: Any) -> Any:
        self.send(op, **fields)
        return self.receive()

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text("utf-8", "replace")

    def usage_records(self) -> list[dict[str, Any]]:
        return [json.loads(line.split("usage ", 1)[1]) for line in self.log().splitlines() if " usage {" in line]

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.send("quit")
                self.process.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait(timeout=30)
        self._log.close()


def valves(redis_url: str = "", **extra: Any) -> dict[str, Any]:
    """The admin valves of a worker (no live price fetch once that valve exists)."""
    result: dict[str, Any] = {"max_context_tokens": WINDOW, "reserve_output_tokens": RESERVE, "redis_url": redis_url}
    if "openrouter_pricing" in BUILT_FILE.read_text("utf-8"):
        result["openrouter_pricing"] = False
    return {**result, **extra}


@pytest.fixture
def spawn(redis_url: str, tmp_path: Path, unique: str) -> Iterator[Callable[..., WorkerProcess]]:
    """Start workers: ``spawn(shared=True)`` uses the test Redis under this test's key prefix,
    ``spawn(shared=False)`` has no redis_url. All are stopped and the keys deleted afterwards."""
    prefix = f"cwtest:{unique}:"
    started: list[WorkerProcess] = []

    def start(shared: bool = True, **extra: Any) -> WorkerProcess:
        worker = WorkerProcess(tmp_path / f"worker{len(started)}.log", prefix)
        started.append(worker)
        worker.call("valves", valves=valves(redis_url if shared else "", **extra), wait_encodings=True, model_id=MODEL)
        return worker

    yield start
    for worker in started:
        worker.close()
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=prefix + "*", count=500))
    if keys:
        client.delete(*keys)
    client.close()


def _filler(seed: int, words: int = 55) -> str:
    return f"[{seed}] " + " ".join(WORDS[(seed * 5 + i * 3) % len(WORDS)] for i in range(words))


def long_chat(turns: int, first_user: str | None = None) -> list[dict[str, Any]]:
    chat: list[dict[str, Any]] = [{"role": "system", "content": "Be helpful."}]
    for turn in range(turns):
        chat.append(
            {"role": "user", "content": first_user if turn == 0 and first_user else f"Q{turn} " + _filler(turn)}
        )
        chat.append({"role": "assistant", "content": f"A{turn} " + _filler(turn + 100)})
    chat.append({"role": "user", "content": "Last question?"})
    return chat


def outlet_body(prompt: int = PROMPT, completion: int = COMPLETION) -> dict[str, Any]:
    """An outlet body as Open WebUI 0.12.4 passes it for an API caller (see tests/e2e/README.md)."""
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    reply = {
        "id": "r1",
        "role": "assistant",
        "content": "An answer.",
        "usage": usage,
        "finish_reason": "stop",
        "info": None,
        "timestamp": None,
    }
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}, reply],
        "filter_ids": ["contextwarden"],
        "chat_id": "",
        "session_id": None,
        "id": "r1",
    }


def concurrent_outlets(workers: list[WorkerProcess], n: int, user_id: str) -> None:
    """Every worker runs ``n`` outlets at once, all workers together (a Redis barrier lines them up)."""
    barrier = {"key": f"barrier:{uuid.uuid4().hex}", "parties": len(workers)} if len(workers) > 1 else None
    for worker in workers:
        worker.send("outlets", n=n, body=outlet_body(), user_id=user_id, barrier=barrier)
    for worker in workers:
        assert len(worker.receive()["status"]) == n


def cost_per_reply() -> Decimal:
    price = resolve_model(MODEL, PriceBook.from_bundled()).price
    cost = compute_cost(Usage(PROMPT, COMPLETION), price).cost_usd
    assert cost is not None and cost > 0
    return cost


def first_history_text(body: dict[str, Any]) -> str:
    return next(m["content"] for m in body["messages"] if m["role"] != "system")


# --- usage from several workers ------------------------------------------------------------------


N = 25


def test_concurrent_outlets_each_log_once(spawn: Callable[..., WorkerProcess], unique: str) -> None:
    """Two workers on one Redis, N replies each at once: every reply logs one line with its real usage."""
    workers = [spawn(), spawn()]
    concurrent_outlets(workers, N, f"user-{unique}")
    for worker in workers:
        assert worker.call("store") == {"type": "RedisStore", "shared": True}  # opened by the first hook
        records = worker.usage_records()
        assert len(records) == N
        assert {(r["prompt_tokens"], r["completion_tokens"], r["estimated"], r["user_id"]) for r in records} == {
            (PROMPT, COMPLETION, False, f"user-{unique}")
        }


def test_ledger_totals_are_exact_across_workers(spawn: Callable[..., WorkerProcess], unique: str) -> None:
    """After 2 x N concurrent replies, both workers read the same, exact totals (cost to the picodollar)."""
    workers = [spawn(), spawn()]
    user = f"user-{unique}"
    concurrent_outlets(workers, N, user)
    views = [worker.call("ledger", user_id=user) for worker in workers]
    assert views[0] == views[1]
    rows = views[0]["rows"]
    assert len(rows) == 1 and rows[0]["model"] == "openai/gpt-4o"
    counters = rows[0]["counters"]
    total = 2 * N
    assert counters["requests"] == total
    assert counters["prompt_tokens"] == total * PROMPT and counters["completion_tokens"] == total * COMPLETION
    assert counters.get("estimated", 0) == 0 and counters.get("unpriced", 0) == 0
    assert Decimal(rows[0]["cost_usd"]) == total * cost_per_reply()


# --- chat state written by one worker, read by the other ----------------------------------------


def test_trim_decision_is_shared(spawn: Callable[..., WorkerProcess], unique: str, counter: TokenCounter) -> None:
    """Worker A trims a chat; the next turn lands on worker B, which reuses A's decision: what A
    sent is the start of what B sends (the provider's prompt cache still hits). A worker without
    Redis knows no decision and selects afresh, to the low watermark."""
    a, b, alone = spawn(), spawn(), spawn(shared=False)
    meta = {"chat_id": f"chat-{unique}", "user_id": f"user-{unique}", "message_id": "m1"}
    chat = long_chat(30)
    first = a.call("inlet", body={"model": MODEL, "messages": chat}, metadata=meta, user_id=meta["user_id"])["body"]
    assert len(first["messages"]) < len(chat)
    # A second turn on A: a chat's first cut leaves no room for a recall block, so this one may
    # select anew (with room for one); the turn after it is the one to hand over.
    chat = chat + [
        {"role": "assistant", "content": "A-1 " + _filler(498, 110)},
        {"role": "user", "content": "Q-1 " + _filler(499, 110)},
    ]
    first = a.call(
        "inlet",
        body={"model": MODEL, "messages": chat},
        metadata={**meta, "message_id": "m1b"},
        user_id=meta["user_id"],
    )["body"]
    following = chat + [
        {"role": "assistant", "content": "A-next " + _filler(500, 110)},
        {"role": "user", "content": "Q-next " + _filler(501, 110)},
    ]
    meta2 = {**meta, "message_id": "m2"}
    body = {"model": MODEL, "messages": following}
    seen_b = b.call("inlet", body=body, metadata=meta2, user_id=meta["user_id"])
    on_b = seen_b["body"]
    fresh = alone.call("inlet", body=body, metadata=meta2, user_id=meta["user_id"])["body"]
    sent_a = first["messages"]
    stable = len(sent_a) - 3 if is_recall_message(sent_a[-3]) else len(sent_a)  # all but A's block, ack, question
    assert on_b["messages"][:stable] == sent_a[:stable]
    assert fresh["messages"][:stable] != sent_a[:stable]
    # B counted only what it sent and the new messages; the dropped ones' size came with A's
    # decision, and the chat's size it reports is still exact.
    note = seen_b["metadata"]["contextwarden"]
    assert note["reused"] is True
    assert note["savings"]["removed"] == counter.count_messages(following, MODEL) - counter.count_messages(
        on_b["messages"], MODEL
    )


def test_pin_is_shared(spawn: Callable[..., WorkerProcess], unique: str) -> None:
    """A message pinned with !pin on worker A survives trimming on worker B (not on a worker
    without Redis, where the old message goes as any other)."""
    a, b, alone = spawn(), spawn(), spawn(shared=False)
    meta = {"chat_id": f"chat-{unique}", "user_id": f"user-{unique}", "message_id": "m1"}
    # Long and unrelated to the last question, so only the pin can keep it.
    pinned = "PINNED-FACT: the vault code is 4711 !pin " + _filler(7, words=400)
    a.call(
        "inlet",
        body={"model": MODEL, "messages": [{"role": "user", "content": pinned}]},
        metadata=meta,
        user_id=meta["user_id"],
    )
    later = {"model": MODEL, "messages": long_chat(30, first_user=pinned)}
    meta2 = {**meta, "message_id": "m9"}
    on_b = b.call("inlet", body=later, metadata=meta2, user_id=meta["user_id"])["body"]
    fresh = alone.call("inlet", body=later, metadata=meta2, user_id=meta["user_id"])["body"]
    assert len(on_b["messages"]) < len(later["messages"])
    assert any("PINNED-FACT" in str(m.get("content")) for m in on_b["messages"])
    assert not any("PINNED-FACT" in str(m.get("content")) for m in fresh["messages"])


def test_calibration_is_shared(spawn: Callable[..., WorkerProcess], unique: str, counter: TokenCounter) -> None:
    """Worker A learns that the provider counts 30% more than we do; worker B trims with that."""
    # low_watermark 1.0: trims fill the budget, so only calibration can explain a smaller prompt.
    a, b, alone = spawn(low_watermark=1.0), spawn(low_watermark=1.0), spawn(shared=False, low_watermark=1.0)
    for turn in range(8):
        meta = {"chat_id": f"chat-{unique}-{turn}", "user_id": f"user-{unique}", "message_id": "m1"}
        chat = long_chat(4)
        seen = a.call("inlet", body={"model": MODEL, "messages": chat}, metadata=meta, user_id=meta["user_id"])
        counted = seen["metadata"]["contextwarden"]["estimated_prompt_tokens"]  # the filter's own count
        body = outlet_body(prompt=round(counted * 1.3))
        body["messages"] = [*seen["body"]["messages"], body["messages"][-1]]
        usage = {"id": "chatcmpl-1", "choices": [], "usage": body["messages"][-1]["usage"]}  # the backend's report
        a.call("stream", events=[usage], metadata=seen["metadata"])
        a.call("outlet", body=body, metadata=seen["metadata"], user_id=meta["user_id"])
    meta = {"chat_id": f"chat-{unique}-b", "user_id": f"user-{unique}", "message_id": "m1"}
    request = {"model": MODEL, "messages": long_chat(30)}
    on_b = b.call("request", body=request, metadata=meta, user_id=meta["user_id"])
    fresh = alone.call("request", body=request, metadata=meta, user_id=meta["user_id"])
    # The turn's note (the admin's detail, logged after the reply; no status line before it).
    assert on_b["metadata"]["contextwarden"]["calibration"] == pytest.approx(1.3, abs=0.02), on_b["metadata"]
    assert fresh["metadata"]["contextwarden"]["calibration"] == 1.0
    assert counter.count_messages(on_b["body"]["messages"], MODEL) <= BUDGET / 1.25
    assert counter.count_messages(fresh["body"]["messages"], MODEL) > BUDGET / 1.25


# --- a worker without Redis ------------------------------------------------------------------------


def test_worker_without_redis_works_alone(
    spawn: Callable[..., WorkerProcess], unique: str, counter: TokenCounter
) -> None:
    """No redis_url: in-process state, trims within budget, logs usage, no warnings."""
    alone = spawn(shared=False)
    chat = long_chat(30)
    sent = alone.call("inlet", body={"model": MODEL, "messages": chat}, metadata={"chat_id": "c"}, user_id="u")["body"]
    assert alone.call("store") == {"type": "MemoryStore", "shared": False}
    assert len(sent["messages"]) < len(chat)
    assert sent["messages"][-1] == chat[-1] and sent["messages"][0] == chat[0]
    assert counter.count_messages(sent["messages"], MODEL) <= BUDGET
    concurrent_outlets([alone], 5, f"user-{unique}")
    assert len(alone.usage_records()) == 5
    assert "WARNING" not in alone.log()


def test_worker_without_redis_keeps_its_own_ledger(spawn: Callable[..., WorkerProcess], unique: str) -> None:
    """The alone worker counts its own replies and none of the shared ones (and vice versa)."""
    shared, alone = spawn(), spawn(shared=False)
    user = f"user-{unique}"
    concurrent_outlets([shared], 7, user)
    concurrent_outlets([alone], 3, user)
    assert [r["counters"]["requests"] for r in shared.call("ledger", user_id=user)["rows"]] == [7]
    assert [r["counters"]["requests"] for r in alone.call("ledger", user_id=user)["rows"]] == [3]


# --- spending limits across workers ---------------------------------------------------------------


def concurrent_inlets(workers: list[WorkerProcess], n: int, user_id: str, **params: Any) -> list[dict[str, Any]]:
    """Every worker starts ``n`` turns of one user at once, all workers together (`params` go in the body)."""
    barrier = {"key": f"barrier:{uuid.uuid4().hex}", "parties": len(workers)} if len(workers) > 1 else None
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Last question?"}], **params}
    for worker in workers:
        worker.send(
            "inlets", n=n, body=body, metadata={"chat_id": "", "user_id": user_id}, user_id=user_id, barrier=barrier
        )
    return [worker.receive() for worker in workers]


def test_turns_started_at_once_on_two_workers_are_charged_as_on_one(
    spawn: Callable[..., WorkerProcess], unique: str
) -> None:
    """Two workers, one Redis, a $0.05 daily limit: 8 turns of one user started at once on each,
    each charged ~$0.02 when it starts (2,000 tokens out at gpt-4o's $10 a million): three go on
    in all, as on one worker, the rest are refused naming the limit. Their outlets, each on the
    worker that started the turn, settle them at what they cost: the user may go on."""
    workers = [spawn(daily_limit_usd=0.05), spawn(daily_limit_usd=0.05)]
    user = f"user-{unique}"
    views = concurrent_inlets(workers, 8, user, max_tokens=2_000)
    assert sum(len(v["allowed"]) for v in views) == 3, workers[0].log()[-3000:]
    texts = {text.split(" It resets")[0] for v in views for text in v["refused"]}
    assert texts and all(
        t.startswith("TurnRefused: contextwarden: your daily limit of $0.05 is reached ($0.06") for t in texts
    ), texts
    for worker, view in zip(workers, views, strict=True):
        for metadata in view["allowed"]:
            worker.call("outlet", body=outlet_body(), metadata=metadata, user_id=user)
    assert 3 * cost_per_reply() + 2 * Decimal("0.011") < Decimal("0.05")  # settled, and two more estimates
    views = concurrent_inlets(workers, 1, user)
    assert [len(v["allowed"]) for v in views] == [1, 1]
