"""Random chats for tests: system prompts, turns, tool groups, images, odd contents.

Imports nothing of contextwarden, so the bundle test can use it beside the single file.
"""

from __future__ import annotations

import json
import random
from typing import Any

WORDS = (
    "budget context token tool call reply model cache prefix system user assistant "
    "garden river Paris 2024 42 ünïcode 日本語 émoji 🙂 <|endoftext|> def return {} [] ;"
).split()
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def random_chat(rng: random.Random, n: int, *, system_words: int | None = None) -> list[dict[str, Any]]:
    """A chat of about `n` messages: system prompt, turns, tool groups (parallel calls too),
    images, `None` and empty content, names, the odd unknown role."""
    chat: list[dict[str, Any]] = []
    if rng.random() < 0.85:
        chat.append(
            {"role": "system", "content": text(rng, system_words if system_words is not None else rng.randint(0, 80))}
        )
    call = 0
    while len(chat) < n:
        roll = rng.random()
        if roll < 0.08:
            chat.append({"role": "user", "content": [{"type": "text", "text": text(rng, rng.randint(1, 40))}, IMAGE]})
        elif roll < 0.12:
            chat.append({"role": "user", "content": None if rng.random() < 0.5 else "", "name": "bob"})
        else:
            chat.append({"role": "user", "content": text(rng, rng.randint(1, 120)), "id": f"u{len(chat)}"})
        for _ in range(rng.randint(0, 2)):
            calls = [
                {
                    "id": f"call_{(call := call + 1)}",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": json.dumps({"q": text(rng, 3)})},
                }
                for _ in range(rng.randint(1, 3))
            ]
            chat.append({"role": "assistant", "content": None, "tool_calls": calls})
            for c in calls:
                chat.append({"role": "tool", "tool_call_id": c["id"], "content": text(rng, rng.randint(1, 200))})
        if rng.random() < 0.03:
            chat.append({"role": "critic", "content": text(rng, 10)})
        chat.append({"role": "assistant", "content": text(rng, rng.randint(1, 150)), "info": {"usage": {}}})
    if chat[-1]["role"] != "user":
        chat.append({"role": "user", "content": text(rng, rng.randint(1, 30))})
    return chat
