"""tiktoken's encoding files, loaded only from its cache; a missing one is fetched here first.

tiktoken downloads a missing encoding with `requests.get` and no timeout while it holds its
process-wide registry lock: on a network that drops packets, that download never ends, and every
`tiktoken.get_encoding` in the process (Open WebUI's own too) waits on it for good. So
`tiktoken.get_encoding` is called only for an encoding whose file is in tiktoken's cache, checked as
tiktoken checks it (tiktoken/load.py `read_file_cached`: `<cache dir>/<sha1 of the URL>`, whose
sha256 must match). A missing file is fetched with httpx (bounded in time and size, proxies from
the environment as tiktoken's `requests` takes them), checked, and written there first, in the
caller's thread (the counter's background loader), never on the event loop.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
import tiktoken

from .backoff import Backoff
from .netclient import tls_context

__all__ = [
    "ENCODING_URL",
    "ENCODING_SHA256",
    "EncodingUnavailable",
    "tiktoken_cache_path",
    "encoding_cached",
    "load_encoding",
]

files_log = logging.getLogger("contextwarden")

# As tiktoken_ext/openai_public.py names them (tests/test_tokens.py checks the installed tiktoken).
ENCODING_URL = "https://openaipublic.blob.core.windows.net/encodings/{name}.tiktoken"
ENCODING_SHA256 = {
    "cl100k_base": "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
    "o200k_base": "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
}
# A download: 10 s to connect, 30 s without a byte, 120 s in all, 16 MiB at most (o200k_base: 3.6 MiB).
ENCODING_FETCH_TIMEOUT = httpx.Timeout(30.0, connect=10.0)
ENCODING_FETCH_SECONDS = 120.0
MAX_ENCODING_BYTES = 16 * 1024 * 1024
# After a failed download no other is tried for 60 s, doubling while they fail, up to an hour.
ENCODING_FETCH_BACKOFF_SECONDS = (60.0, 3600.0)


class EncodingUnavailable(Exception):
    """An encoding's file is not in tiktoken's cache and could not be put there (the message
    names the kind of failure, never a path)."""


@dataclass(slots=True)
class _Fetches:
    """One encoding's downloads, process-wide: one at a time, resting after failures."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    backoff: Backoff = field(default_factory=Backoff)


_fetches: dict[str, _Fetches] = {name: _Fetches() for name in ENCODING_SHA256}


def tiktoken_cache_path(name: str) -> str | None:
    """Where tiktoken looks for an encoding's file (its rules exactly: `TIKTOKEN_CACHE_DIR`, else
    `DATA_GYM_CACHE_DIR`, else `<tempdir>/data-gym-cache`); None when it would not look (an
    encoding this module does not know, or caching turned off by an empty `TIKTOKEN_CACHE_DIR`)."""
    if name not in ENCODING_SHA256:
        return None
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        directory = os.environ["TIKTOKEN_CACHE_DIR"]
    elif "DATA_GYM_CACHE_DIR" in os.environ:
        directory = os.environ["DATA_GYM_CACHE_DIR"]
    else:
        directory = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    if directory == "":
        return None
    return os.path.join(directory, hashlib.sha1(ENCODING_URL.format(name=name).encode()).hexdigest())


def encoding_cached(name: str) -> bool:
    """Whether tiktoken would load `name` from its cache, without a download: the file is there
    and its sha256 is the expected one (tiktoken deletes and downloads a file that differs)."""
    path = tiktoken_cache_path(name)
    if path is None:
        return False
    try:
        with open(path, "rb", buffering=0) as handle:
            data = handle.read(MAX_ENCODING_BYTES + 1)
    except OSError:
        return False
    return hashlib.sha256(data).hexdigest() == ENCODING_SHA256[name]


def load_encoding(name: str) -> Any:
    """`tiktoken.get_encoding(name)`, which then reads tiktoken's cache and never downloads:
    a missing file is fetched first (see the module's note). Blocking: call it off the loop.

    Raises:
        EncodingUnavailable: not cached, and the download failed (or failed recently: see
            ENCODING_FETCH_BACKOFF_SECONDS), or the cache cannot be written.
        Exception: whatever `tiktoken.get_encoding` raises (a corrupt file, a broken install).
    """
    if encoding_cached(name) or name in tiktoken.registry.ENCODINGS:  # loaded already: no lock, no I/O
        return tiktoken.get_encoding(name)
    fetches = _fetches.get(name)
    if fetches is None:
        raise EncodingUnavailable("not a known encoding")
    with fetches.lock:  # one download at a time; whoever waited finds the file
        if not encoding_cached(name):
            _fetch_when_due(name, fetches.backoff)
    return tiktoken.get_encoding(name)


def _fetch_when_due(name: str, backoff: Backoff) -> None:
    """Fetch `name` into tiktoken's cache unless a recent failure rests it; the first failure of
    a run is one warning (tiktoken's counter then estimates), the ones after it are debug."""
    if backoff.resting(time.monotonic()):
        raise EncodingUnavailable("download failed recently")
    try:
        _fetch_into_cache(name)
    except EncodingUnavailable as exc:
        first = backoff.failures == 0
        pause = backoff.failed(time.monotonic(), *ENCODING_FETCH_BACKOFF_SECONDS)
        files_log.log(
            logging.WARNING if first else logging.DEBUG,
            "contextwarden: tiktoken encoding %s is not in tiktoken's cache and could not be put there (%s); "
            "its counts are estimated, next try in %d s (see Token counts offline in the README)",
            name,
            exc,
            pause,
        )
        raise
    backoff.succeeded()


def _fetch_into_cache(name: str) -> None:
    """Download `name`, check its sha256 and write it where tiktoken looks (tiktoken's way: a
    temporary file renamed into place, so a reader never sees half a file)."""
    path = tiktoken_cache_path(name)
    if path is None:
        raise EncodingUnavailable("TIKTOKEN_CACHE_DIR is empty: tiktoken's cache is turned off")
    data = _download(ENCODING_URL.format(name=name))
    if hashlib.sha256(data).hexdigest() != ENCODING_SHA256[name]:
        raise EncodingUnavailable("the download does not match its sha256")
    partial = f"{path}.{uuid.uuid4().hex}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(partial, "wb") as handle:
            handle.write(data)
        os.replace(partial, path)
    except OSError as exc:
        try:
            os.remove(partial)
        except OSError:
            pass
        raise EncodingUnavailable(f"tiktoken's cache cannot be written: {exc.strerror or type(exc).__name__}") from None


def _download(url: str) -> bytes:
    """The body of a GET, bounded in time (ENCODING_FETCH_TIMEOUT a step, ENCODING_FETCH_SECONDS
    in all) and size (MAX_ENCODING_BYTES); any failure as EncodingUnavailable naming its kind."""
    deadline = time.monotonic() + ENCODING_FETCH_SECONDS
    body = bytearray()
    try:
        client = httpx.Client(timeout=ENCODING_FETCH_TIMEOUT, verify=tls_context())
        with client, client.stream("GET", url) as response:
            if response.status_code != 200:
                raise EncodingUnavailable(f"HTTP {response.status_code}")
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > MAX_ENCODING_BYTES:
                    raise EncodingUnavailable("the download is too large")
                if time.monotonic() > deadline:
                    raise EncodingUnavailable(f"the download took over {ENCODING_FETCH_SECONDS:g} s")
    except EncodingUnavailable:
        raise
    except Exception as exc:  # the network, a proxy setting, TLS: all mean "not now"
        raise EncodingUnavailable(type(exc).__name__) from None
    return bytes(body)
