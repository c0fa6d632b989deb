"""One Open WebUI worker as contextwarden sees it, for tests/test_workers.py.

Loads the built ``open_webui_filter.py`` the way Open WebUI 0.12 loads a function
(``types.ModuleType`` + ``sys.modules`` + ``exec``), makes ONE ``Filter`` instance and sets its
valves as Open WebUI does (``Valves(**stored)``), then answers commands: one JSON object per
line on stdin, one JSON reply per line on stdout. Logs (the ``usage`` lines) go to stderr.

    python tests/worker_proc.py <built file> <redis key prefix or "">

Commands (``op``): ``valves``, ``inlet``, ``request``, ``stream`` (its ``events``, one by one, as
the chunks of a streamed reply), ``outlet``, ``outlets`` (n concurrent, after an
optional Redis barrier so two workers write at the same time), ``inlets`` (the same for turns
starting, refusals reported), ``ledger``, ``store``, ``quit``.
Nothing here imports the contextwarden package: only the built file runs.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import sys
import time
import types
from typing import Any

import redis


def load_function(path: str, function_id: str) -> types.ModuleType:
    """Open WebUI's load_function_module_by_id, minus the database."""
    with open(path, encoding="utf-8") as handle:
        content = handle.read()
    name = f"function_{function_id}"
    module = types.ModuleType(name)
    sys.modules[name] = module
    exec(compile(content, path, "exec"), module.__dict__)
    return module


class Worker:
    """One Filter instance driven by commands; per-request values are built per call."""

    def __init__(self, module: types.ModuleType) -> None:
        self.module = module
        self.filter = module.Filter()
        self.redis_url = ""

    def _user(self, command: dict[str, Any]) -> dict[str, Any]:
        user = {"id": command.get("user_id", "u-test"), "role": "user", "name": "Test"}
        user["valves"] = self.filter.UserValves(**command.get("user_valves", {}))
        return user

    async def _hook(
        self, hook: str, command: dict[str, Any], body: dict[str, Any], metadata: dict[str, Any]
    ) -> dict[str, Any]:
        statuses: list[str] = []

        async def emit(event: dict[str, Any]) -> None:
            statuses.append(event["data"]["description"])

        model = command.get("model") or {
            "id": body.get("model"),
            "owned_by": "openai",
            "openai": {"id": body.get("model")},
        }
        result = await getattr(self.filter, hook)(
            body, __user__=self._user(command), __metadata__=metadata, __model__=model, __event_emitter__=emit
        )
        return {"body": result, "metadata": metadata, "status": statuses}

    async def handle(self, command: dict[str, Any]) -> Any:
        op = command["op"]
        if op == "valves":
            self.filter.valves = self.filter.Valves(**command["valves"])
            self.redis_url = command["valves"].get("redis_url", "")
            if command.get("wait_encodings"):
                self.filter.counter.wait_ready(command.get("model_id", "gpt-4o"))
            return {"ok": True}
        if op in ("inlet", "request", "outlet"):
            metadata = copy.deepcopy(command.get("metadata") or {})
            return await self._hook(op, command, copy.deepcopy(command["body"]), metadata)
        if op == "stream":
            metadata = copy.deepcopy(command.get("metadata") or {})
            for event in command["events"]:
                await self.filter.stream(copy.deepcopy(event), __metadata__=metadata)
            return {"ok": True}
        if op == "outlets":
            barrier = command.get("barrier")
            if barrier:
                self._barrier(barrier["key"], barrier["parties"])
            calls = [
                self._hook(
                    "outlet", command, copy.deepcopy(command["body"]), copy.deepcopy(command.get("metadata") or {})
                )
                for _ in range(command["n"])
            ]
            results = await asyncio.gather(*calls)
            return {"status": [r["status"] for r in results]}
        if op == "inlets":  # n concurrent turns; a refusal (an exception Open WebUI shows) is reported
            barrier = command.get("barrier")
            if barrier:
                self._barrier(barrier["key"], barrier["parties"])
            calls = [
                self._hook(
                    "inlet", command, copy.deepcopy(command["body"]), copy.deepcopy(command.get("metadata") or {})
                )
                for _ in range(command["n"])
            ]
            results = await asyncio.gather(*calls, return_exceptions=True)
            return {
                "allowed": [r["metadata"] for r in results if not isinstance(r, BaseException)],
                "refused": [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)],
            }
        if op == "ledger":
            if not hasattr(self.module, "read_ledger"):
                return {"missing": True}
            entries = await self.module.read_ledger(self.filter.store)
            rows = [
                {"user": e.user, "model": e.model, "counters": e.counters, "cost_usd": format(e.cost_usd, "f")}
                for e in entries
                if e.user == command["user_id"]
            ]
            return {"rows": rows}
        if op == "store":
            return {"type": type(self.filter.store).__name__, "shared": self.filter.store.shared}
        raise ValueError(f"unknown op {op!r}")

    def _barrier(self, key: str, parties: int, timeout: float = 30.0) -> None:
        """Wait until ``parties`` workers reached this point (a counter in the test Redis)."""
        client = redis.Redis.from_url(self.redis_url)
        client.incr(key)
        client.expire(key, 120)
        deadline = time.monotonic() + timeout
        while int(client.get(key) or 0) < parties:
            if time.monotonic() > deadline:
                raise TimeoutError(f"barrier {key}: {client.get(key)} of {parties}")
            time.sleep(0.005)
        client.close()


def main() -> None:
    path, key_prefix = sys.argv[1], sys.argv[2]
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
    module = load_function(path, "contextwarden")
    if key_prefix:
        module.KEY_PREFIX = key_prefix  # one test's keys, apart from everything else on this Redis
    worker = Worker(module)
    loop = asyncio.new_event_loop()  # one loop for the worker's life, as in uvicorn
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "quit":
            break
        try:
            reply = {"ok": loop.run_until_complete(worker.handle(command))}
        except Exception as exc:  # report to the test, keep serving
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(reply, default=str) + "\n")
        sys.stdout.flush()
    loop.close()


if __name__ == "__main__":
    main()
