"""Driving whole turns through a `Filter` the way Open WebUI does, and capturing every log line.

`run_turn` calls inlet -> request -> outlet with one shared `__metadata__` dict (as Open WebUI
passes it), a reply appended for the outlet, and an emitter that yields to the event loop so
concurrent turns interleave. Reliability tests (faults, concurrency, privacy) build on it;
when the ledger, flags and summaries land, they extend `TurnRun` rather than copy the calls.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from helpers import Events


class YieldingEvents(Events):
    """An emitter that collects events and yields to the loop, so concurrent turns interleave."""

    async def __call__(self, event: dict) -> None:
        await asyncio.sleep(0)
        await super().__call__(event)


@dataclass
class TurnRun:
    """What one turn did: the body after each hook, the shared metadata and the events."""

    sent_in: dict
    after_inlet: Any
    after_request: Any
    after_outlet: Any
    metadata: dict
    events: Events
    outlet_body: dict = field(default_factory=dict)


def reply_of(text: str = "The answer.", usage: dict | None = None) -> dict:
    """An assistant reply as Open WebUI's outlet shows it; `usage` as the backend reported it."""
    reply: dict[str, Any] = {"role": "assistant", "content": text}
    if usage is not None:
        reply["usage"] = usage
    return reply


async def run_turn(
    f,
    chat: list[dict],
    *,
    user: dict | None = None,
    chat_id: str = "c1",
    model: str = "gpt-4o",
    reply: dict | None = None,
    model_info: dict | None = None,
    events: Events | None = None,
) -> TurnRun:
    """One full turn: inlet, request on what inlet returned, outlet on the sent history plus a reply.

    Example:
        run = await run_turn(f, chat, user={"id": "u1"}, chat_id="c9")
        run.after_request["messages"]   # what the provider would get
    """
    user = user if user is not None else {"id": "u1"}
    events = events if events is not None else YieldingEvents()
    metadata = {"chat_id": chat_id, "user_id": user.get("id") if isinstance(user, dict) else None, "message_id": "m1"}
    body = {"model": model, "messages": chat, "stream": True, "metadata": metadata}
    hooks = {"__user__": user, "__metadata__": metadata, "__model__": model_info, "__event_emitter__": events}
    after_inlet = await f.inlet(body, **hooks)
    after_request = await f.request(after_inlet, **hooks)
    sent = after_request.get("messages") if isinstance(after_request, dict) else None
    history = list(sent) if isinstance(sent, list) else list(chat)
    outlet_body = {"model": model, "messages": history + [reply or reply_of()], "chat_id": chat_id, "id": "m1"}
    after_outlet = await f.outlet(outlet_body, **hooks)
    return TurnRun(body, after_inlet, after_request, after_outlet, metadata, events, outlet_body)


def usage_lines(records: list[logging.LogRecord]) -> list[dict]:
    """The `usage {json}` records among captured log records, parsed."""
    prefix = "usage "
    return [json.loads(r.getMessage()[len(prefix) :]) for r in records if r.getMessage().startswith(prefix)]


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def all_logs():
    """Every log record of every logger (root at DEBUG) while the block runs.

    Yields the handler; `handler.records` are the records, formatted text via `rendered()`.
    """
    root = logging.getLogger()
    handler = _ListHandler()
    old_level = root.level
    # Loggers with their own level (ours, asyncio, redis) would hide DEBUG records: open them all.
    overridden = {
        name: logger.level
        for name, logger in logging.Logger.manager.loggerDict.items()
        if isinstance(logger, logging.Logger) and logger.level not in (logging.NOTSET, logging.DEBUG)
    }
    for name in overridden:
        logging.getLogger(name).setLevel(logging.DEBUG)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
        for name, level in overridden.items():
            logging.getLogger(name).setLevel(level)


def rendered(record: logging.LogRecord) -> str:
    """All the text a handler could write for a record: message, arguments, exception, stack."""
    formatter = logging.Formatter("%(name)s %(levelname)s %(message)s")
    parts = [formatter.format(record), repr(record.args)]
    if record.exc_info and record.exc_info[1] is not None:
        parts.append(repr(record.exc_info[1]))
    return "\n".join(parts)


# -- a redis-server of our own, to kill and restart -------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def redis_answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


class OwnRedis:
    """A throwaway `redis-server` on a given port that a test may stop and start again."""

    def __init__(self, binary: str, port: int | None = None, *, password: str = "", data_dir: str = "") -> None:
        self.binary = binary
        self.port = port or free_port()
        self.password = password
        self.data_dir = data_dir  # given: every write is on disk there, and a restart keeps it
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> OwnRedis:
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
            + (["--dir", self.data_dir, "--appendonly", "yes", "--appendfsync", "always"] if self.data_dir else [])
            + ([] if self.data_dir else ["--appendonly", "no"])
            + (["--requirepass", self.password] if self.password else []),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(200):
            if redis_answers(self.port):
                return self
            time.sleep(0.025)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(10)
            self.process = None


async def raw_get(url: str, key: str) -> bytes | None:
    """What Redis itself holds under a store key (not what the store answers: during an outage,
    the worker's copy)."""
    import redis.asyncio as aioredis

    from contextwarden.state.store import KEY_PREFIX

    raw = aioredis.Redis.from_url(url)
    try:
        return await raw.get(KEY_PREFIX + key)
    finally:
        await raw.aclose()
