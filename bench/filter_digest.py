"""A digest of what a built single file sends, notes and logs over speed.py-like turns.

Loads the file as speed.py does (as Open WebUI loads a function) and runs bench/synth.py chats
of 20 and 200 messages through inlet and request (cold, and the same body again) and a chat
that goes on for 8 turns with each reply through outlet, for four set-ups (enforce, shadow,
a Claude model with prompt-cache breakpoints, the recent strategy). Records the messages sent,
the turn note, every status line and every usage line (each without its version key "v"),
prints one sha256 over them and writes them to OUT:

    bench/.venv/bin/python bench/filter_digest.py /tmp/before_open_webui_filter.py /tmp/before.txt
    bench/.venv/bin/python bench/filter_digest.py open_webui_filter.py /tmp/after.txt
    cmp /tmp/before.txt /tmp/after.txt
"""

import asyncio
import hashlib
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import speed  # noqa: E402
import synth  # noqa: E402


class Grab(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, r):
        m = r.getMessage()
        if m.startswith("usage "):
            d = json.loads(m[6:])
            d.pop("v", None)
            self.lines.append(d)


async def main(path, out):
    speed.seed_encodings()
    module = speed.load_bundle(Path(path))
    grab = Grab()
    logging.getLogger("contextwarden").addHandler(grab)
    logging.getLogger("contextwarden").setLevel(logging.INFO)
    rec = []
    statuses = []
    for valves, model in (
        ({}, "gpt-4o"),
        ({"mode": "shadow"}, "gpt-4o"),
        ({}, "anthropic/claude-sonnet-4.5"),
        ({"strategy": "recent"}, "gpt-4o"),
    ):
        speed.MODEL = model
        f = await speed.make_filter(module, **valves)
        await run(f, module, rec, statuses, model)
    text = (
        "\n".join(json.dumps(r, sort_keys=True) for r in rec)
        + "\n"
        + json.dumps(grab.lines, sort_keys=True)
        + "\n"
        + json.dumps(statuses)
    )
    open(out, "w").write(text)
    print(
        json.dumps(
            {
                "turns": len(rec),
                "usage_lines": len(grab.lines),
                "statuses": len(statuses),
                "sha256": hashlib.sha256(text.encode()).hexdigest(),
            }
        )
    )


async def run(f, module, rec, statuses, model):
    async def emit(e):
        statuses.append(e["data"]["description"])

    user = {"id": "bench-user", "role": "user", "valves": module.Filter.UserValves()}

    async def inlet(body):
        return await f.inlet(
            body, __user__=user, __metadata__=body["metadata"], __model__={"id": speed.MODEL}, __event_emitter__=emit
        )

    for n in (20, 200):
        for rep in range(6):
            chat = synth.make_chat(n * 100_000 + rep, n)
            for kind, cid in (("cold", f"c-{model}-{n}-{rep}"), ("again", f"c-{model}-{n}-{rep}")):
                body = speed.request_body(speed.fresh(chat), cid)
                body["metadata"]["message_id"] = "m"
                o = await inlet(body)
                o = await f.request(
                    o,
                    __user__=user,
                    __metadata__=body["metadata"],
                    __model__={"id": speed.MODEL, "owned_by": "openai"},
                    __event_emitter__=emit,
                )
                note = {k: v for k, v in body["metadata"].get("contextwarden", {}).items() if k != "v"}
                rec.append([n, rep, kind, o["messages"], note])
        nxt = synth.make_chat(10_000_000 + n, n)
        cid = f"next-{model}-{n}"
        for t in range(8):
            nxt = nxt + synth.next_turn(n * 100_000 + 50_000 + t)
            body = speed.request_body(speed.fresh(nxt), cid)
            body["metadata"]["message_id"] = "m"
            o = await inlet(body)
            note = {k: v for k, v in body["metadata"].get("contextwarden", {}).items() if k != "v"}
            rec.append([n, t, "next", o["messages"], note])
            reply = {
                "model": speed.MODEL,
                "messages": speed.fresh(nxt)
                + [
                    {
                        "role": "assistant",
                        "content": f"reply {t}",
                        "usage": {
                            "prompt_tokens": 7000 + t,
                            "completion_tokens": 50,
                            "prompt_tokens_details": {"cached_tokens": 1024 * t},
                        },
                    }
                ],
                "chat_id": cid,
            }
            await f.outlet(
                reply,
                __user__=user,
                __metadata__=body["metadata"],
                __model__={"id": speed.MODEL},
                __event_emitter__=emit,
            )


asyncio.run(main(sys.argv[1], sys.argv[2]))
