"""Outbound HTTP clients made without stalling the event loop.

httpx makes a new TLS context for every client (`httpx.create_ssl_context`: the CA bundle read and
parsed, 20-100 ms of one core), on the event loop when the client is made there: every summary
call and every price refresh stalled all of a worker's chats that long. The context is made once
a process, in a worker thread, with httpx's own rules (`SSL_CERT_FILE`, `SSL_CERT_DIR`, else
certifi's bundle), and every client is made with it; proxies still come from the environment.
"""

from __future__ import annotations

import asyncio
import ssl
import threading
from typing import Any

import httpx

__all__ = ["tls_context", "async_client"]

_tls_lock = threading.Lock()
_tls: list[ssl.SSLContext] = []  # the one context, once made


def tls_context() -> ssl.SSLContext:
    """The process's TLS context for outbound clients, made on first use. Blocking the first
    time: on the event loop, call `async_client` instead."""
    with _tls_lock:
        if not _tls:
            _tls.append(httpx.create_ssl_context())
        return _tls[0]


async def async_client(**options: Any) -> httpx.AsyncClient:
    """An `httpx.AsyncClient(**options)` with the shared TLS context (made in a worker thread the
    first time); the caller closes it (`async with await async_client() as client`)."""
    context = _tls[0] if _tls else await asyncio.to_thread(tls_context)
    return httpx.AsyncClient(verify=context, **options)
