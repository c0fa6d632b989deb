"""What many test modules share: a filter as the tests make it, Open WebUI-shaped bodies and
events, the usage lines it logs, and synthetic chats (so no test module imports another)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from contextwarden import Filter
from contextwarden.core.conversation import is_recall_message
from contextwarden.core.tokens import TokenCounter
from contextwarden.state.store import Store, open_store

__all__ = [
    "BUILT_FILE",
    "Events",
    "make_filter",
    "store_of",
    "body_of",
    "usage_records",
    "turn",
    "chat_of",
    "grow",
    "send",
    "shown",
]

BUILT_FILE = Path(
    os.environ.get("CONTEXTWARDEN_BUILT_FILE") or Path(__file__).resolve().parents[1] / "open_webui_filter.py"
)
"""The single file under test: the repository's, or ``$CONTEXTWARDEN_BUILT_FILE`` (another build)."""


class Events:
    """Collects what the filter emits."""

    def __init__(self) -> None:
        self.items: list[dict] = []

    async def __call__(self, event: dict) -> None:
        self.items.append(event)

    @property
    def statuses(self) -> list[str]:
        return [e["data"]["description"] for e in self.items if e["type"] == "status"]


def make_filter(
    counter: TokenCounter, *, store: Any = None, clock: Any = None, prices: Any = None, **valves: Any
) -> Filter:
    """A Filter counting with the session's counter (and this store, clock and price source: see
    `Filter.__init__`), with these admin valves."""
    f = Filter(store=store, counter=counter, clock=clock, prices=prices)
    f.valves = f.Valves(**valves)
    return f


def store_of(valves: dict) -> Store:
    """The store a filter with these valves opens (their `redis_url`, else in-process): given to
    `make_filter(store=...)`, the test holds it from the start, before any turn."""
    return open_store(valves.get("redis_url", ""))


def quoted_whole(chat: list[dict], sent: list[dict]) -> int:
    """The chat's messages not sent in place that a recall block quotes whole: the model reads
    them, and the user's status line counts them as sent."""
    blocks = [m["content"] for m in sent if is_recall_message(m)]
    texts = [c["content"] for c in chat if c not in sent and isinstance(c.get("content"), str) and c["content"]]
    return sum(1 for text in texts if any(text in b for b in blocks))


def sent_count(chat: list[dict], sent: list[dict]) -> int:
    """The messages the status line counts as sent: those sent in place (not a recall block or
    its acknowledgement) and the chat's messages a block quotes whole (`quoted_whole`)."""
    blocks = sum(1 for m in sent if is_recall_message(m))
    return len(sent) - 2 * blocks + quoted_whole(chat, sent)


def body_of(chat: list[dict], model: str = "gpt-4o", **metadata: Any) -> dict:
    return {
        "model": model,
        "messages": chat,
        "stream": False,
        "metadata": {"chat_id": "c1", "user_id": "u1", **metadata},
    }


def usage_records(caplog: Any) -> list[dict]:
    """The `usage {json}` lines the filter logged, parsed."""
    return [json.loads(r.getMessage()[len("usage ") :]) for r in caplog.records if r.getMessage().startswith("usage ")]


def turn(i: int, words: int = 60) -> list[dict]:
    return [
        {"role": "user", "content": f"question {i} " + "lorem ipsum " * words},
        {"role": "assistant", "content": f"answer {i} " + "dolor sit " * words},
    ]


def chat_of(turns: int, *, system: str = "You are helpful.", last: str = "What now?") -> list[dict]:
    chat = [{"role": "system", "content": system}]
    for i in range(turns):
        chat += turn(i)
    return chat + [{"role": "user", "content": last}]


def grow(chat: list[dict], i: int, words: int = 60) -> list[dict]:
    """The chat one turn later: the reply to its last question and a new question."""
    reply, question = turn(i, words)[1], {"role": "user", "content": f"question {i}? " + "lorem " * words}
    return chat + [reply, question]


def _chat_body(chat: list[dict], user_id: str, chat_id: str) -> dict:
    return {"model": "gpt-4o", "messages": chat, "stream": False, "metadata": {"chat_id": chat_id, "user_id": user_id}}


async def send(f: Filter, chat: list[dict], user_id: str, chat_id: str, *, events: Any = None) -> dict:
    """One inlet of a user's chat, as Open WebUI calls it."""
    body = _chat_body(chat, user_id, chat_id)
    return await f.inlet(body, __user__={"id": user_id}, __metadata__=body["metadata"], __event_emitter__=events)


async def shown(f: Filter, chat: list[dict], user_id: str, chat_id: str, events: Any) -> dict:
    """A turn's `request` pass, then its outlet (with a short reply), which shows the turn's one
    status line: returns what `request` sent."""
    body = _chat_body(chat, user_id, chat_id)
    hooks = {"__user__": {"id": user_id}, "__metadata__": body["metadata"], "__event_emitter__": events}
    sent = await f.request(body, **hooks)
    reply = {"role": "assistant", "content": "Noted, thanks."}
    await f.outlet({"model": body["model"], "messages": [*sent["messages"], reply], "chat_id": chat_id}, **hooks)
    return sent
