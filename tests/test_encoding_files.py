"""tiktoken's encoding files: loaded only from its cache, a missing one fetched with a timeout.

tiktoken downloads a missing encoding with no timeout while holding its process-wide lock; on a
network that drops packets every `get_encoding` of the process (Open WebUI's own) then waits for
good. Here tiktoken's own download is replaced by one that fails the test if it is ever called,
the cache is an empty temporary directory, and the blob URL is mocked (respx) with the real file.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import re
import threading
from pathlib import Path

import httpx
import pytest
import respx
import tiktoken
import tiktoken.load
import tiktoken.registry
import tiktoken_ext.openai_public

import contextwarden.encoding_files as files
import contextwarden.tools.offline as offline
from contextwarden.core.tokens import TokenCounter, preload_encodings
from contextwarden.encoding_files import (
    ENCODING_SHA256,
    ENCODING_URL,
    EncodingUnavailable,
    load_encoding,
    tiktoken_cache_path,
)

CL100K_URL = ENCODING_URL.format(name="cl100k_base")
O200K_URL = ENCODING_URL.format(name="o200k_base")


class Fresh:
    """A process as if tiktoken had loaded nothing, with an empty cache and no network for tiktoken."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
        self.real = {name: Path(tiktoken_cache_path(name) or "").read_bytes() for name in ENCODING_SHA256}
        self.cache = cache
        self.tiktoken_downloads: list[str] = []
        monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
        monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
        monkeypatch.setattr(files, "_fetches", {name: files._Fetches() for name in ENCODING_SHA256})

        def tiktoken_download(blobpath: str) -> bytes:  # requests.get, no timeout, under tiktoken's lock
            self.tiktoken_downloads.append(blobpath)
            raise OSError("tiktoken's own download was called")

        monkeypatch.setattr(tiktoken.load, "read_file", tiktoken_download)

    def cached(self, name: str) -> bytes | None:
        path = Path(tiktoken_cache_path(name) or "")
        return path.read_bytes() if path.is_file() else None

    def seed(self, name: str) -> None:
        self.cache.mkdir(parents=True, exist_ok=True)
        Path(tiktoken_cache_path(name) or "").write_bytes(self.real[name])


@pytest.fixture
def fresh(monkeypatch, tmp_path) -> Fresh:
    return Fresh(monkeypatch, tmp_path / "tiktoken-cache")


def tiktoken_lock_free() -> bool:
    """Whether another thread could take tiktoken's registry lock right now."""
    free: list[bool] = []

    def probe() -> None:
        taken = tiktoken.registry._lock.acquire(blocking=False)
        if taken:
            tiktoken.registry._lock.release()
        free.append(taken)

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return free[0]


def loud(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_missing_encoding_is_fetched_checked_and_cached_never_downloaded_by_tiktoken(fresh):
    # Before: tiktoken.get_encoding downloaded it itself (no timeout, under its lock).
    with respx.mock(assert_all_called=False) as mock:
        route = mock.get(CL100K_URL).respond(200, content=fresh.real["cl100k_base"])
        counter = TokenCounter(block=True)
        assert counter.wait_ready("gpt-4")
    assert fresh.tiktoken_downloads == [] and route.call_count == 1
    assert fresh.cached("cl100k_base") == fresh.real["cl100k_base"]  # where tiktoken looks, for every worker
    assert counter.mode("gpt-4") == "exact"
    assert list(fresh.cache.iterdir()) == [Path(tiktoken_cache_path("cl100k_base") or "")]  # no partial file left


def test_a_download_that_hangs_holds_no_lock_warns_once_and_is_retried_later(fresh, caplog):
    caplog.set_level(logging.DEBUG, logger="contextwarden")
    lock_free_while_fetching: list[bool] = []

    def hangs(request: httpx.Request) -> httpx.Response:
        lock_free_while_fetching.append(tiktoken_lock_free())
        raise httpx.ReadTimeout("no answer", request=request)

    with respx.mock(assert_all_called=False) as mock:
        route = mock.get(CL100K_URL).mock(side_effect=hangs)
        counter = TokenCounter(block=True)
        assert not counter.wait_ready("gpt-4")
        assert counter.mode("gpt-4") == "estimate" and counter.count_text("hello world", "gpt-4") > 0
        other = TokenCounter(block=True)  # another counter, at once: the download rests
        assert not other.wait_ready("gpt-4")
        assert route.call_count == 1 and lock_free_while_fetching == [True]
        assert fresh.tiktoken_downloads == []
        [warning] = loud(caplog)
        assert "cl100k_base is not in tiktoken's cache and could not be put there (ReadTimeout)" in warning
        assert "next try in 60 s" in warning and str(fresh.cache) not in warning

        # the pauses pass (60 s, doubling): the next load fetches again, and this time it arrives
        files._fetches["cl100k_base"].backoff.until = 0.0
        counter._loading["cl100k_base"].backoff.until = 0.0
        route.mock(side_effect=None, return_value=httpx.Response(200, content=fresh.real["cl100k_base"]))
        assert counter.wait_ready("gpt-4") and counter.mode("gpt-4") == "exact"
    assert route.call_count == 2 and fresh.tiktoken_downloads == [] and len(loud(caplog)) == 1


@pytest.mark.parametrize(
    ("reply", "reason"),
    [
        (httpx.Response(200, content=b"not the encoding"), "sha256"),
        (httpx.Response(404, content=b"<Error/>"), "HTTP 404"),
        (httpx.ConnectError("refused"), "ConnectError"),
    ],
)
def test_a_bad_download_is_not_cached_and_the_counter_estimates(fresh, caplog, reply, reason):
    with respx.mock(assert_all_called=False) as mock:
        mock.get(CL100K_URL).mock(side_effect=[reply])
        counter = TokenCounter(block=True)
        assert not counter.wait_ready("gpt-4") and counter.mode("gpt-4") == "estimate"
    assert fresh.cached("cl100k_base") is None and fresh.tiktoken_downloads == []
    [warning] = loud(caplog)
    assert reason in warning


def test_the_preload_loads_cached_encodings_before_it_fetches_a_missing_one(fresh):
    fresh.seed("cl100k_base")
    loaded_before_fetch: list[bool] = []

    def unreachable(request: httpx.Request) -> httpx.Response:
        loaded_before_fetch.append("cl100k_base" in tiktoken.registry.ENCODINGS)
        raise httpx.ConnectTimeout("dropped", request=request)

    with respx.mock(assert_all_called=False) as mock:
        mock.get(O200K_URL).mock(side_effect=unreachable)
        preload_encodings().join(60)
    assert loaded_before_fetch == [True] and fresh.tiktoken_downloads == []
    assert "o200k_base" not in tiktoken.registry.ENCODINGS


@pytest.mark.parametrize("variables", ["TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR", "neither"])
def test_the_cache_path_is_where_tiktoken_looks(fresh, monkeypatch, tmp_path, variables):
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR")
    monkeypatch.delenv("DATA_GYM_CACHE_DIR", raising=False)
    if variables == "neither":
        monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    else:
        monkeypatch.setenv(variables, str(tmp_path / "dir"))
    path = Path(tiktoken_cache_path("cl100k_base") or "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(fresh.real["cl100k_base"])
    found = tiktoken.load.read_file_cached(CL100K_URL, ENCODING_SHA256["cl100k_base"])
    assert found == fresh.real["cl100k_base"] and fresh.tiktoken_downloads == []


def test_with_tiktokens_cache_off_nothing_is_downloaded(fresh, monkeypatch, caplog):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # tiktoken would download on every load
    assert tiktoken_cache_path("cl100k_base") is None
    with respx.mock(assert_all_called=False) as mock, pytest.raises(EncodingUnavailable, match="cache is turned off"):
        mock.get(CL100K_URL).respond(200, content=fresh.real["cl100k_base"])
        load_encoding("cl100k_base")
    assert fresh.tiktoken_downloads == []
    said = [r.getMessage() for r in caplog.records if "cl100k_base" in r.getMessage()]
    assert said and "downloaded" not in said[0] and "((" not in said[0] and "))" not in said[0]  # nothing was tried


def test_the_encoding_table_is_tiktokens():
    source = inspect.getsource(tiktoken_ext.openai_public)
    for name, digest in ENCODING_SHA256.items():
        body = re.search(rf"def {name}\(\).*?(?=\ndef )", source, re.S)
        assert body is not None, name
        assert f'"{ENCODING_URL.format(name=name)}"' in body.group(0)
        assert f'expected_hash="{digest}"' in body.group(0)
    assert hashlib.sha1(CL100K_URL.encode()).hexdigest() == "9b5ad71b2ce5302211f9c61530b329a4922fc6a4"
    assert (offline.ENCODING_URL, offline.ENCODING_SHA256) == (ENCODING_URL, ENCODING_SHA256)  # its own copy
