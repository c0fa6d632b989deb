"""Optional summaries of what a trim dropped: one bounded, cached call to an OpenAI-compatible API.

The summary goes in as a labelled user-role note where the dropped history was: right after
the system prompt(s), before the first message kept (see `insert_summary` for why there and
why not a system message). It is counted against the budget: the chat is trimmed again with
room for it, and when it still does not fit, or the call fails or times out, the trim goes on
without it. Each call the provider may bill (one it answered, or one that failed after its
request was sent, the turn's cancellation included) is handed to `SummaryConfig.spent`, which
counts what it cost (usage line, ledger, the user's spend) in a task the turn's cancellation
does not reach. The API key never reaches a log line, a status or an exception message.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from ..backoff import Backoff
from ..core.chatview import ChatView
from ..core.conversation import (
    SUMMARY_ACK,
    SUMMARY_ACK_MESSAGE,
    SYSTEM_ROLES,
    Message,
    is_acknowledgement,
    is_recall_message,
    message_text,
)
from ..core.decision import message_fingerprint
from ..core.tokens import TokenCounter
from ..core.trim import TrimResult
from ..netclient import async_client
from ..state.store import Store
from .offloop import compute

__all__ = [
    "SUMMARY_LABEL",
    "SUMMARY_ACK",
    "SUMMARY_ACK_MESSAGE",
    "LEGACY_SUMMARY_LABEL",
    "SummaryConfig",
    "SummaryCall",
    "Summarized",
    "summarize_messages",
    "summarize_trim",
    "summary_note",
    "own_messages",
    "find_summary",
    "take_summary",
    "ChatRead",
    "read_chat",
    "insert_summary",
    "summary_tokens",
    "endpoint_problem",
    "key_problem",
]

summarize_log = logging.getLogger("contextwarden")

SUMMARY_LABEL = "[contextwarden] Summary of earlier messages in this chat (no longer sent in full):"
LEGACY_SUMMARY_LABEL = "Summary of earlier conversation (by contextwarden):"  # earlier versions' system note
DEFAULT_SUMMARY_INPUT_CHARS = 24_000  # what one call may send, newest dropped messages first
DEFAULT_SUMMARY_MESSAGE_CHARS = 4_000  # one message's share of it (middle cut)
SUMMARY_CHARS_PER_TOKEN = 8  # the reply is cut to max_tokens * this many characters at most
SUMMARY_RETRY_SECONDS = 60  # after a failure, the same content is not tried again this long
# After an endpoint fails, no trim asks it again for 15 s, doubling with each failure in a row
# up to 10 minutes (per endpoint, per process): a dead endpoint does not make every new trim
# wait for the whole timeout.
SUMMARY_BACKOFF_SECONDS = (15.0, 600.0)
# While a call to an endpoint has been in flight this long, or this many are, no trim starts
# another (per endpoint, per process): it goes on without a summary at once, as after a failure.
# Before, 50 turns against a hanging endpoint made 50 calls and each waited the 10 s timeout.
# "This long" is the endpoint's own pace once it has answered: SUMMARY_PACE_FACTOR times the
# slowest of its last SUMMARY_PACE_CALLS answers, when that is more (a model that takes 5 s a
# summary is slow, not hung: with 3 s alone, one user's call in flight cost every other user
# theirs).
SUMMARY_SLOW_SECONDS = 3.0
SUMMARY_PACE_FACTOR = 1.5
SUMMARY_PACE_CALLS = 8
MAX_SUMMARY_CALLS = 4
MAX_BACKOFF_ENDPOINTS = 64
MAX_SUMMARY_REPLY_BYTES = 256 * 1024  # a reply is at most 4,000 tokens * 8 characters, in JSON
# A call's charge (usage line, ledger, spend: `SummaryConfig.spent`) runs in a task of its own,
# so a turn cancelled meanwhile (the user stopped it) still pays for a call the provider bills;
# it is given up after this long (the store answers or gives up well before: a pooled connection
# is waited for 60 s at most, then each command twice a couple of seconds).
SUMMARY_CHARGE_SECONDS = 90.0
# A reply is asked for uncompressed and one compressed anyway is refused: httpx inflates each
# read whole, and a 64 KiB read of a gzip of zeros is 67 MB.
SUMMARY_PROMPT_VERSION = "1"  # part of the cache key: a new prompt means new summaries
SUMMARY_PROMPT = (
    "Below is the earlier part of a conversation that no longer fits in the model's context. "
    "Summarize it for the assistant who continues the conversation: the facts, names, numbers, "
    "decisions, preferences and open questions it holds, briefly, in the conversation's language. "
    "Reply with the summary only."
)
_CACHED, _FAILED = b"ok:", b"failed"
# Failures that happen only before the request is written whole, or while it is: the provider ran
# nothing and bills nothing (a partial body is no request). Other failures of a request written
# whole (a read timeout, a dropped connection, a 200 that cannot be used) are billed; an
# answer with another status is the provider saying it failed, which it does not bill.
_NOT_SENT = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
    httpx.ProxyError,
    httpx.UnsupportedProtocol,
    httpx.LocalProtocolError,
    httpx.WriteError,
    httpx.WriteTimeout,
)


@dataclass(frozen=True, slots=True)
class SummaryCall:
    """One call the provider may bill (never a summary served from the cache), to be counted as
    the turn's user's cost: what was sent, the reply's text as received (None: no summary came
    back, the call failed after its request was sent), its `usage` as the JSON held it (None:
    none), and the `max_tokens` asked for (the most a reply that never came can cost). Text,
    never to be logged."""

    model: str
    sent: tuple[Message, ...]
    reply: str | None
    usage: object
    max_tokens: int


@dataclass(frozen=True, slots=True)
class SummaryConfig:
    """Where and how to summarize; `ttl` is how long a summary stays cached (seconds); `spent`
    is told of each call the provider may bill (the bookkeeping counts its cost; `_count_call` guards it)."""

    base_url: str
    model: str
    api_key: str = field(default="", repr=False)
    timeout: float = 10.0
    max_tokens: int = 400
    ttl: int = 72 * 3600
    spent: Callable[[SummaryCall], Awaitable[None]] | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class Summarized:
    """A trim with its summary: `result` dropped exactly what `note` covers; `messages` is
    `result.messages` with the note (and its acknowledgement) inserted, costing `tokens` in all."""

    result: TrimResult
    note: Message
    messages: list[Message]
    tokens: int


def summary_note(text: str) -> Message:
    """The user-role note that carries a summary (never a system one: see `insert_summary`)."""
    return {"role": "user", "content": f"{SUMMARY_LABEL}\n{text}"}


def _is_note(message: Message) -> bool:
    content = message.get("content")
    return message.get("role") == "user" and type(content) is str and content.startswith(SUMMARY_LABEL)


def _is_legacy_note(message: Message) -> bool:
    content = message.get("content")
    return message.get("role") in SYSTEM_ROLES and type(content) is str and content.startswith(LEGACY_SUMMARY_LABEL)


def own_messages(messages: Sequence[Message], fingerprints: Collection[str]) -> list[int]:
    """Positions of what an earlier pass of this turn added (its summary note and recall blocks,
    each with the acknowledgement right after it), as that pass's note recorded them: by
    `message_fingerprint`. A user's message that merely starts like one is the user's.

    Example:
        >>> from contextwarden.core.conversation import recall_message
        >>> block = recall_message([{"role": "user", "content": "Miso"}], [0])
        >>> lookalike = {"role": "user", "content": block["content"] + "?"}
        >>> chat = [block, dict(SUMMARY_ACK_MESSAGE), lookalike]
        >>> own_messages(chat, {message_fingerprint(block)})
        [0, 1]
    """
    if not fingerprints:
        return []
    own: list[int] = []
    for index, message in enumerate(messages):
        labelled = is_recall_message(message) or _is_note(message)  # only these can be: hash no other
        if labelled and message_fingerprint(message) in fingerprints:
            own.append(index)
            if index + 1 < len(messages) and is_acknowledgement(messages[index + 1]):
                own.append(index + 1)
    return own


def find_summary(messages: Sequence[Message] | ChatView, own: Collection[int] = ()) -> tuple[int | None, bool]:
    """Where contextwarden's own note is: the index of a standalone note (today's user note at
    one of the `own` positions, see `own_messages`; or an older version's system note), and
    whether the chat holds one at all (also merged into a system message: Open WebUI merges
    system messages after `request`). `messages` may be the pass's `ChatView` of them."""
    view = messages if isinstance(messages, ChatView) else ChatView(messages)
    chat = view.messages
    for index in sorted(own):
        if 0 <= index < len(chat) and _is_note(chat[index]):
            return index, True
    present = False
    for index in view.system_positions:
        if _is_legacy_note(chat[index]):
            return index, True
        present = present or LEGACY_SUMMARY_LABEL in view.text(index)
    return None, present


def take_summary(messages: Sequence[Message], at: int) -> tuple[list[Message], Message, Message | None]:
    """`messages` without the note at `at` and the acknowledgement after it; that note as today's
    user note (an older version's system note keeps its text and leaves the system part); the
    acknowledgement found, to be sent again as the same dict."""
    note = messages[at]
    ack = messages[at + 1] if at + 1 < len(messages) and is_acknowledgement(messages[at + 1]) else None
    if _is_legacy_note(note):
        note = summary_note(note["content"][len(LEGACY_SUMMARY_LABEL) :].lstrip("\n"))
    return [*messages[:at], *messages[at + (1 if ack is None else 2) :]], note, ack


@dataclass(frozen=True, slots=True)
class ChatRead:
    """What a pass reads of the chat before it trims (`read_chat`)."""

    view: ChatView  # the chat without the summary note: read once for the shortcut and every trim
    base: list[Message]  # its messages
    summary: Message | None  # the note an earlier pass (or version) sent, as today's note
    ack: Message | None  # the acknowledgement sent after it
    merged: bool  # a note merged into a system message (Open WebUI merges them after `request`)
    pinned: list[int]  # the pins' positions in `base`
    added: list[int]  # what earlier passes of the turn added to `base` (their recall blocks)


def read_chat(messages: list[Message], own: Collection[str], pinned: Callable[[ChatView], list[int]]) -> ChatRead:
    """The chat a pass trims: the summary note found and taken out (`find_summary`,
    `take_summary`), what earlier passes added (`own`: their fingerprints, `own_messages`) and
    the pins (`pinned` of the view) found. Each is a pass over every message (100,000 one-letter
    messages held the loop ~10 ms; with pins every user message is hashed), so a chat of very
    many messages is read in the thread (`offloop.reads_off_loop`)."""
    view = ChatView(messages)
    at, merged = find_summary(view, own_messages(messages, own))
    base, summary, ack = take_summary(messages, at) if at is not None else (messages, None, None)
    if at is not None:  # the chat without the note: another list, another view
        view = ChatView(base)
    return ChatRead(view, base, summary, ack, merged, pinned(view), own_messages(base, own))


def _note_position(messages: Sequence[Message]) -> int:
    """Where `insert_summary` puts the note: after the leading system message(s)."""
    at = 0
    while at < len(messages) and messages[at].get("role") in SYSTEM_ROLES:
        at += 1
    return at


def insert_summary(messages: Sequence[Message], note: Message, ack: Message | None = None) -> list[Message]:
    """`messages` with `note` where the dropped history was: before the first non-system message,
    followed by an assistant `SUMMARY_ACK` (`ack`, or a new one) when that message is a user's.

    Why there, and as a user message: Open WebUI merges every system message into the system
    prompt after `request`, so a system note would rewrite the prompt's first message and the
    provider's cache would miss from its first token. Before the first kept message, the note
    is part of the stable prefix: the next turn sends the same selection, hence the same
    (cached) summary, at the same place, and only a new selection, a cache miss anyway, changes
    it. The ack keeps user and assistant turns alternating and the history starting with a user
    message, as some providers and chat templates require; a tool-call group is never split,
    since the note goes before it whole.
    """
    at = _note_position(messages)
    added = [note]
    if at < len(messages) and messages[at].get("role") == "user":
        added.append(ack if ack is not None else dict(SUMMARY_ACK_MESSAGE))
    return [*messages[:at], *added, *messages[at:]]


def _transcript(messages: Sequence[Message]) -> str:
    """The dropped messages as `role: text` lines, bounded: each message cut in the middle,
    and the newest messages kept when all of them are too long."""
    lines: list[str] = []
    room = DEFAULT_SUMMARY_INPUT_CHARS
    for message in reversed(messages):
        text = " ".join(message_text(message).split())
        if not text:
            continue
        if len(text) > DEFAULT_SUMMARY_MESSAGE_CHARS:
            half = DEFAULT_SUMMARY_MESSAGE_CHARS // 2
            text = f"{text[:half]} […] {text[-half:]}"
        line = f"{message.get('role')}: {text}"
        if len(line) > room:
            break
        lines.append(line)
        room -= len(line) + 1
    return "\n".join(reversed(lines))


def _cache_key(config: SummaryConfig, transcript: str) -> str:
    data = json.dumps([SUMMARY_PROMPT_VERSION, config.model, config.max_tokens, transcript])
    return "summary:" + hashlib.blake2b(data.encode("utf-8", "surrogatepass"), digest_size=20).hexdigest()


def endpoint_problem(base_url: str) -> str | None:
    """What is wrong with a summary endpoint URL (None when it can be called); never the URL itself.

    A user name or password, a query or a fragment are refused: httpx logs every request's URL
    at INFO (a key in it would be in Open WebUI's log on every call), and `/chat/completions`
    is appended to the base, after any query. The key goes in `summary_api_key`.
    """
    if not base_url.startswith(("http://", "https://")):
        return "must start with http:// or https://"
    if any(ch.isspace() or not ch.isprintable() or not ch.isascii() for ch in base_url):
        return "holds a space, a control or a non-ASCII character"
    try:
        parts = urlsplit(base_url)
        port = parts.port  # raises when out of range
        httpx.URL(base_url)
    except (ValueError, httpx.InvalidURL):
        return "is not a valid URL (check the host, and the port: 1 to 65535)"
    if "@" in parts.netloc:
        return (
            "holds a user name or password (user:password@host), which would be logged; put the key in summary_api_key"
        )
    if "?" in base_url or "#" in base_url:
        return (
            "holds a query (?...) or a fragment (#...): give the API base only, /chat/completions is added to it; "
            "put a key in summary_api_key"
        )
    if not parts.hostname:
        return "has no host"
    if port == 0:
        return "is not a valid URL (check the host, and the port: 1 to 65535)"
    return None


def key_problem(api_key: str) -> str | None:
    """What is wrong with an API key as an HTTP header value (None when fine); never the key itself."""
    if all("!" <= ch <= "~" for ch in api_key):
        return None
    return (
        "holds a character an HTTP header cannot carry (a space, a zero-width or other non-ASCII or control character)"
    )


_backoff: dict[str, Backoff] = {}  # by endpoint, shared by every trim of the process


def _backing_off(endpoint: str) -> bool:
    state = _backoff.get(endpoint)
    return state is not None and state.resting(time.monotonic())


def _endpoint_failed(endpoint: str) -> float:
    """Note a failure of the endpoint; how long it is now skipped (seconds)."""
    if endpoint not in _backoff and len(_backoff) >= MAX_BACKOFF_ENDPOINTS:
        _backoff.clear()
    return _backoff.setdefault(endpoint, Backoff()).failed(time.monotonic(), *SUMMARY_BACKOFF_SECONDS)


_pending: dict[str, list[float]] = {}  # by endpoint: when each call in flight started (time.monotonic)
_paces: dict[str, deque[float]] = {}  # by endpoint: how long its last answers took (seconds)


def _busy(endpoint: str) -> bool:
    """Whether a trim must not call `endpoint` now: `MAX_SUMMARY_CALLS` calls to it are in flight,
    or one has been for longer than the endpoint takes (`_slow_mark`: hung, or slower than it
    answers: a new call would wait as long)."""
    started = _pending.get(endpoint)
    if not started:
        return False
    return len(started) >= MAX_SUMMARY_CALLS or time.monotonic() - min(started) >= _slow_mark(endpoint)


def _slow_mark(endpoint: str) -> float:
    """How long a call to `endpoint` may be in flight before no other starts: `SUMMARY_SLOW_SECONDS`,
    or `SUMMARY_PACE_FACTOR` times the slowest of its recent answers when that is more."""
    paces = _paces.get(endpoint)
    return max(SUMMARY_SLOW_SECONDS, SUMMARY_PACE_FACTOR * max(paces)) if paces else SUMMARY_SLOW_SECONDS


def _answered(endpoint: str, seconds: float) -> None:
    """Note how long an answer of `endpoint` took (the last `SUMMARY_PACE_CALLS`, per endpoint)."""
    if endpoint not in _paces and len(_paces) >= MAX_BACKOFF_ENDPOINTS:
        _paces.clear()
    _paces.setdefault(endpoint, deque(maxlen=SUMMARY_PACE_CALLS)).append(seconds)


async def _in_flight(config: SummaryConfig, request: _Request) -> SummaryCall:
    """`_ask` within `config.timeout`, counted among the endpoint's calls in flight meanwhile;
    the time an answer took is noted as the endpoint's pace."""
    started = _pending.setdefault(config.base_url, [])
    at = time.monotonic()
    started.append(at)
    try:
        call = await asyncio.wait_for(_ask(config, request), timeout=config.timeout)
        _answered(config.base_url, time.monotonic() - at)
        return call
    finally:
        started.remove(at)
        if not started and _pending.get(config.base_url) is started:
            del _pending[config.base_url]


class _SummaryFailed(Exception):
    """The endpoint answered, but not with a summary (the message names only the kind): `refused`
    when it said it failed (any status but 200: nothing billed), `usage` what a 200 reply held of it."""

    def __init__(self, kind: str, *, refused: bool = False, usage: object = None) -> None:
        super().__init__(kind)
        self.refused = refused
        self.usage = usage


class _Request:
    """One call's request: the messages sent and their JSON, handed to httpx as a stream so that
    `sent` says whether all of it was written (httpcore asks for more only after a write)."""

    __slots__ = ("messages", "data", "sent")

    def __init__(self, config: SummaryConfig, transcript: str) -> None:
        self.messages: tuple[Message, ...] = (
            {"role": "system", "content": SUMMARY_PROMPT},
            {"role": "user", "content": transcript},
        )
        payload = {
            "model": config.model,
            "messages": list(self.messages),
            "max_tokens": config.max_tokens,
            "temperature": 0,
            "stream": False,
        }
        # as httpx's `json=` writes it (raises on a lone surrogate, before anything is sent)
        self.data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
        self.sent = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.data
        self.sent = True

    def billed(self, config: SummaryConfig, exc: BaseException) -> SummaryCall | None:
        """The call a failure `exc` may still be billed for: the request was written whole and
        the provider did not answer that it failed (a timeout, a dropped connection, a 200 that
        cannot be used, the turn cancelled while it waited); None when it billed nothing (not
        sent, or answered with another status)."""
        if not self.sent or isinstance(exc, _NOT_SENT) or (isinstance(exc, _SummaryFailed) and exc.refused):
            return None
        usage = exc.usage if isinstance(exc, _SummaryFailed) else None
        return SummaryCall(config.model, self.messages, None, usage, config.max_tokens)


async def _ask(config: SummaryConfig, request: _Request) -> SummaryCall:
    """One chat completion; raises on any failure (callers log its kind, never its text)."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    headers["Accept-Encoding"] = "identity"  # the reply is read as sent, within the cap (`_read`)
    headers |= {"Content-Type": "application/json", "Content-Length": str(len(request.data))}
    async with await async_client(timeout=config.timeout) as client:  # its TLS context made off the loop
        url = config.base_url.rstrip("/") + "/chat/completions"
        async with client.stream("POST", url, content=request, headers=headers) as response:
            status = response.status_code
            if status != 200:
                raise _SummaryFailed(f"HTTP {status}", refused=True)
            body = await _read(response)
    try:
        reply = json.loads(body)
    except ValueError:
        raise _SummaryFailed("unreadable reply") from None
    usage = reply.get("usage") if isinstance(reply, dict) else None
    try:
        text = reply["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise _SummaryFailed("unreadable reply", usage=usage) from None
    if not isinstance(text, str) or not text.strip():
        raise _SummaryFailed("empty reply", usage=usage)  # a reasoning model's whole max_tokens thinking
    return SummaryCall(config.model, request.messages, text, usage, config.max_tokens)


async def _read(response: httpx.Response) -> bytes:
    """The reply's body as sent, at most MAX_SUMMARY_REPLY_BYTES (raises past it, or when it is
    compressed: it was asked for plain, and inflating is where a small body grows past any cap)."""
    if int(response.headers.get("content-length") or 0) > MAX_SUMMARY_REPLY_BYTES:
        raise _SummaryFailed("reply too large")
    if response.headers.get("content-encoding", "identity").strip().lower() not in ("", "identity"):
        raise _SummaryFailed("reply in an encoding not asked for")
    body = bytearray()
    async for chunk in response.aiter_raw():
        body += chunk
        if len(body) > MAX_SUMMARY_REPLY_BYTES:
            raise _SummaryFailed("reply too large")
    return bytes(body)


async def summarize_messages(messages: Sequence[Message], *, config: SummaryConfig, store: Store) -> str | None:
    """A summary of `messages`, from the store's cache or one call; None on any failure.

    Cached under a hash of exactly what is sent (and the model, size and prompt version), so
    workers sharing a Redis store share summaries. Never waits longer than `config.timeout`;
    a failure is logged as one warning naming its kind and is not retried for a minute. No call
    starts while the endpoint is busy (`MAX_SUMMARY_CALLS` in flight, or one for longer than its
    pace: `_slow_mark`): None at once. A call the provider may bill is told to `config.spent`
    (its cost is the turn's user's): one it answered, and one that failed after its request was
    written whole without an answer (or with a 200 that cannot be used, or the turn cancelled
    while it waited); a summary from the cache, a call never sent or one answered with an error
    status costs nothing.

    Args:
        messages: the messages to condense (what a trim dropped).
        config: endpoint, model, key, timeout, output size, cache lifetime.
        store: where summaries are cached.

    Example:
        >>> config = SummaryConfig("http://llm/v1", "gpt-4o-mini")
        >>> text = await summarize_messages(dropped, config=config, store=store)  # doctest: +SKIP
    """
    transcript = _transcript(messages)
    if not transcript:
        return None
    key = _cache_key(config, transcript)
    cached = await store.get(key)
    if cached is not None:
        return cached[len(_CACHED) :].decode() if cached.startswith(_CACHED) else None
    if _backing_off(config.base_url):
        summarize_log.debug("contextwarden: summary endpoint failed recently; trimmed without a summary")
        return None
    if _busy(config.base_url):
        summarize_log.debug("contextwarden: summary endpoint busy with slow calls; trimmed without a summary")
        return None
    call = await _call(config, transcript, key, store)
    if call is None:
        return None
    _backoff.pop(config.base_url, None)
    text = (call.reply or "").strip()[: config.max_tokens * SUMMARY_CHARS_PER_TOKEN]
    charge = _charge(config, call)  # before anything else is awaited: a cancellation from here on still counts it
    await store.set(key, _CACHED + text.encode(), ttl=config.ttl)
    await _counted(charge)
    return text


async def _call(config: SummaryConfig, transcript: str, key: str, store: Store) -> SummaryCall | None:
    """One call for `transcript` (`_in_flight`); None when it failed: logged, the endpoint backed
    off, the content not asked again for a while (`key`), and a call the provider may bill
    charged all the same. A turn cancelled while the call waits is charged for it too, when its
    request was written whole (the provider runs it to the end), in a task of its own: the
    cancellation goes on at once, never held up by the charge."""
    request: _Request | None = None
    try:
        request = _Request(config, transcript)
        return await _in_flight(config, request)
    except asyncio.CancelledError as exc:
        if request is not None and (billed := request.billed(config, exc)) is not None:
            _charge(config, billed)  # not awaited: nothing may hold the cancellation up
        raise
    except Exception as exc:  # whatever the endpoint or the network did: the trim goes on without
        billed = request.billed(config, exc) if request is not None else None
        charge = _charge(config, billed) if billed is not None else None
        reason = str(exc) if isinstance(exc, _SummaryFailed) else type(exc).__name__
        _endpoint_failed(config.base_url)
        summarize_log.warning("contextwarden: summary skipped (%s); trimmed without one", reason)
        await store.set(key, _FAILED, ttl=SUMMARY_RETRY_SECONDS)
        await _counted(charge)
        return None


_charging: set[asyncio.Task[None]] = set()  # charges under way, held until done (the loop keeps weak references)


def _charge(config: SummaryConfig, call: SummaryCall) -> asyncio.Task[None] | None:
    """Start counting `call` (`_count_call`) in a task of its own, which the turn's cancellation
    does not reach (None: nothing counts calls)."""
    if config.spent is None:
        return None
    task = asyncio.ensure_future(_count_call(config.spent, call))
    _charging.add(task)
    task.add_done_callback(_charging.discard)
    return task


async def _counted(charge: asyncio.Task[None] | None) -> None:
    """Wait for a charge `_charge` started (a turn charged for its summary before it goes on:
    limits read it); cancelled meanwhile, the turn stops waiting and the charge goes on."""
    if charge is not None:
        await asyncio.shield(charge)


async def _count_call(spent: Callable[[SummaryCall], Awaitable[None]], call: SummaryCall) -> None:
    """Tell `spent` (`SummaryConfig.spent`) of a call the provider may bill, within
    `SUMMARY_CHARGE_SECONDS`; a failure there never costs the summary."""
    try:
        await asyncio.wait_for(spent(call), SUMMARY_CHARGE_SECONDS)
    except Exception as exc:
        summarize_log.warning("contextwarden: summary call not counted (%s)", type(exc).__name__)


async def summarize_trim(
    messages: Sequence[Message],
    first: TrimResult,
    *,
    retrim: Callable[[int], TrimResult],
    config: SummaryConfig,
    store: Store,
    counter: TokenCounter,
    model: str | None,
    off: bool = False,
) -> Summarized | None:
    """Make room for a summary of what a trim drops, and write it; None to go on without one.

    `first` is the trim at the full budget; `retrim(n)` trims the same chat to `n` tokens (with
    `off`, in the contextwarden thread: `offloop.compute`, as the first trim of a big chat).
    The chat is trimmed again with room for the note, the messages that trim drops are
    summarized, and the note is cut to `config.max_tokens` by the filter's counter. The
    result fits `first.budget`, or None is returned and `first` stands.
    """
    note_cost = counter.count_message(summary_note(""), model) + counter.count_message(SUMMARY_ACK_MESSAGE, model)
    reserve = config.max_tokens + note_cost
    if not first.dropped or first.budget - reserve <= 0:
        return None
    second = await compute(off, retrim, first.budget - reserve)
    if second.over_budget or not second.dropped:
        return None
    text = await summarize_messages([messages[i] for i in second.dropped], config=config, store=store)
    if text is None:
        return None
    head, _ = counter.keep_ends(text, config.max_tokens, 0, model)
    note = summary_note(head)
    sent = insert_summary(second.messages, note)
    tokens = second.tokens_after + summary_tokens(sent, second.messages, counter, model)
    if tokens > first.budget:
        return None
    return Summarized(second, note, sent, tokens)


def summary_tokens(
    sent: Sequence[Message], trimmed: Sequence[Message], counter: TokenCounter, model: str | None
) -> int:
    """What the note (and its acknowledgement) that `insert_summary` added to `trimmed` cost."""
    at = _note_position(trimmed)
    return sum(counter.count_message(m, model) for m in sent[at : at + len(sent) - len(trimmed)])
