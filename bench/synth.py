"""Synthetic chats for the speed benchmark: varied, realistic text with tool groups.

Every call with a new seed yields new texts (so a chat "never seen" really is new to every
cache). Messages average about 500 o200k tokens: prose with markdown, code blocks, numbers,
the odd non-ASCII word; assistant tool calls with JSON arguments answered by tool results.
No special-token text (`<|endoftext|>`), because lethes counts with `encode()`, which rejects it.
"""

from __future__ import annotations

import json
import math
import random
from typing import Any

_WORDS = """
the of and to in a is that for it as was with be by on not he this are or his from at which
but have an they you were her she there been one all we their has would when if so what
about up out them some could into other then its only more time these two may first any my
now such like our over man me even most made after also did many before must through back
years where much your way well down should because each just those people how too little
state good very make world still own see men work long get here between both life being
under never day same another know while last might us great old year off come since against
go came right used take three system data model context token budget request response
server cache memory latency throughput queue worker thread process file directory config
value error warning function method class module package version release deploy database
index query table column schema migration backup restore network socket timeout retry
policy user account session password permission report summary analysis result estimate
revenue margin forecast quarter customer invoice contract supplier shipment warehouse
inventory price discount tax payment refund budget meeting schedule deadline milestone
project team manager engineer designer review feedback proposal draft document chapter
recipe garden river mountain weather city train flight hotel museum history language
""".split()
_NAMES = ["Alice", "Bob", "Zürich", "São Paulo", "Kraków", "naïve", "café", "Müller", "Đorđe", "Ōsaka"]
_CJK = ["日本語のテキスト", "数据库迁移", "서울 날씨", "Привет, мир", "مرحبا"]
_IDENTS = ["user_id", "budget", "tokens", "cache", "result", "items", "config", "session", "total", "rows"]
_TOOLS = ["web_search", "read_file", "run_sql", "get_weather", "calculator", "list_orders"]


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 22))]
    if rng.random() < 0.25:
        words.insert(
            rng.randrange(len(words)),
            str(rng.choice([rng.randint(2, 99), rng.randint(100, 99_999), round(rng.uniform(0, 100), 2)])),
        )
    if rng.random() < 0.08:
        words.insert(rng.randrange(len(words)), rng.choice(_NAMES))
    if rng.random() < 0.02:
        words.append(rng.choice(_CJK))
    if rng.random() < 0.15:
        k = rng.randrange(len(words))
        words[k] = f"`{rng.choice(_IDENTS)}`"
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice([".", ".", ".", "?", "!", ":"])


def _code(rng: random.Random) -> str:
    name, arg = rng.choice(_IDENTS), rng.choice(_IDENTS)
    lines = [f"def {name}_{rng.randint(1, 999)}({arg}, limit={rng.randint(1, 500)}):"]
    for _ in range(rng.randint(3, 12)):
        a, b = rng.choice(_IDENTS), rng.choice(_IDENTS)
        lines.append(
            rng.choice(
                [
                    f"    {a} = [{b}[i] * {rng.randint(2, 9)} for i in range(limit)]",
                    f"    if {a} > {rng.randint(0, 1000)}:\n        return {b}",
                    f"    {a}.update({{'{b}': {rng.randint(0, 10**6)}}})",
                    f'    logger.info("{a}=%s", {b})',
                ]
            )
        )
    lines.append(f"    return {arg}")
    return "```python\n" + "\n".join(lines) + "\n```"


def prose(rng: random.Random, tokens: int) -> str:
    """About `tokens` o200k tokens of paragraphs, lists and code."""
    parts: list[str] = []
    size = 0
    while size < tokens:
        roll = rng.random()
        if roll < 0.10:
            block = _code(rng)
        elif roll < 0.22:
            block = "\n".join(f"- {_sentence(rng)}" for _ in range(rng.randint(2, 5)))
        elif roll < 0.26:
            block = f"## {_sentence(rng)[:-1]}"
        else:
            block = " ".join(_sentence(rng) for _ in range(rng.randint(2, 6)))
        parts.append(block)
        size += len(block) // 5
    return "\n\n".join(parts)


def _length(rng: random.Random, mean: int) -> int:
    """A skewed (log-normal) length with the given mean, as real chats have."""
    sigma = 0.8
    return max(8, min(mean * 8, int(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma))))


def turn(rng: random.Random, serial: int, *, mean_tokens: int = 540, tools: bool = True) -> list[dict[str, Any]]:
    """One turn: a user message, maybe a tool group (1-2 parallel calls), an assistant reply."""
    out: list[dict[str, Any]] = [
        {"role": "user", "content": prose(rng, _length(rng, mean_tokens * 6 // 10)), "id": f"u{serial}"}
    ]
    if tools and rng.random() < 0.3:
        calls = [
            {
                "id": f"call_{serial}_{k}_{rng.getrandbits(32):08x}",
                "type": "function",
                "function": {
                    "name": rng.choice(_TOOLS),
                    "arguments": json.dumps({"query": _sentence(rng), "limit": rng.randint(1, 50)}),
                },
            }
            for k in range(rng.choice([1, 1, 2]))
        ]
        out.append({"role": "assistant", "content": None, "tool_calls": calls})
        for call in calls:
            rows = [
                {"title": _sentence(rng), "score": round(rng.random(), 3), "snippet": prose(rng, 60)}
                for _ in range(rng.randint(1, 6))
            ]
            out.append({"role": "tool", "tool_call_id": call["id"], "content": json.dumps(rows, ensure_ascii=False)})
    out.append(
        {"role": "assistant", "content": prose(rng, _length(rng, mean_tokens * 14 // 10)), "info": {"usage": {}}}
    )
    return out


def make_chat(seed: int, messages: int, *, mean_tokens: int = 540) -> list[dict[str, Any]]:
    """A chat of exactly `messages` messages (system prompt first, ending with a user message)."""
    rng = random.Random(seed)
    chat: list[dict[str, Any]] = [{"role": "system", "content": prose(rng, 300)}]
    serial = 0
    while len(chat) < messages - 1:
        serial += 1
        chat.extend(turn(rng, serial, mean_tokens=mean_tokens))
    del chat[messages - 1 :]
    while chat[-1]["role"] == "tool" or chat[-1].get("tool_calls"):
        chat.pop()  # never cut a tool group in half
    while len(chat) < messages - 1:
        role = "assistant" if chat[-1]["role"] == "user" else "user"
        chat.append({"role": role, "content": prose(rng, _length(rng, mean_tokens))})
    if chat[-1]["role"] == "user":
        chat[-1] = {**chat[-1], "role": "assistant"}
    chat.append({"role": "user", "content": prose(rng, _length(rng, mean_tokens * 6 // 10))})
    return chat


def next_turn(seed: int, *, mean_tokens: int = 540) -> list[dict[str, Any]]:
    """The two messages a next turn adds: the assistant's reply and the user's new question."""
    rng = random.Random(seed)
    return [
        {"role": "assistant", "content": prose(rng, _length(rng, mean_tokens * 14 // 10))},
        {"role": "user", "content": prose(rng, _length(rng, mean_tokens * 6 // 10))},
    ]


def make_dialogue(seed: int, messages: int) -> list[dict[str, Any]]:
    """A chat of one-liners (a sentence or two each, as in chit-chat), system prompt first, ending
    with a user message: each one is embedded alone and with the one before it."""
    rng = random.Random(seed)
    chat: list[dict[str, Any]] = [{"role": "system", "content": prose(rng, 300)}]
    while len(chat) < messages:
        role = "user" if len(chat) % 2 else "assistant"
        chat.append({"role": role, "content": " ".join(_sentence(rng) for _ in range(rng.randint(1, 2)))})
    if chat[-1]["role"] != "user":
        chat[-1] = {**chat[-1], "role": "user"}
    return chat


def next_dialogue_turn(seed: int) -> list[dict[str, Any]]:
    """A reply and a new question for a chat of one-liners."""
    rng = random.Random(seed)
    return [{"role": role, "content": _sentence(rng)} for role in ("assistant", "user")]
