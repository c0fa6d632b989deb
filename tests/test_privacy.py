"""Privacy: no message text, email or secret in any log line or status; Redis keys namespaced, expiring.

One full run captures every log record of every logger (root at DEBUG): turns that trim,
turns that fail inside (errors carrying message text), a broken emitter, bad valves, a
password-protected Redis that works, then dies, then a `redis_url` typed with a password
that breaks URL parsing. Chats, the user and the valves carry distinctive secrets.
"""

from __future__ import annotations

import json
import logging

import pytest
import redis.asyncio as aioredis

import contextwarden.face.bookkeeping as bookkeeping_module
import contextwarden.face.trimpass as trimpass_module
import contextwarden.state.store as store_module
from contextwarden.state.store import KEY_PREFIX, RedisStore

from helpers import Events, chat_of, make_filter
from turns import OwnRedis, all_logs, rendered, reply_of, run_turn, usage_lines

SECRET_TEXT = "zebra-quartz-7731"
EMAIL = "ann.secretname@example.org"
USER_NAME = "Annabel Secretname"
API_KEY = "sk-FAKE0123456789abcdefKEYBODY"
# What may never appear: the text, the email and its local part, the key and any 8 characters of it.
FORBIDDEN = [SECRET_TEXT, EMAIL, "ann.secretname", "Secretname"] + [API_KEY[i : i + 8] for i in range(len(API_KEY) - 7)]


def secret_chat(n: int) -> list[dict]:
    chat = chat_of(n, system=f"System prompt with {SECRET_TEXT}.", last=f"Tell me about {SECRET_TEXT} and mail {EMAIL}")
    chat[1] = {**chat[1], "name": "annabel", "content": chat[1]["content"] + SECRET_TEXT}
    return chat + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": json.dumps({"q": SECRET_TEXT})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": f"{SECRET_TEXT} " * 400},
    ]


def leaks(text: str) -> list[str]:
    return [s for s in FORBIDDEN if s in text]


@pytest.mark.redis
async def test_a_full_run_logs_no_text_email_or_key(counter, caplog, monkeypatch, redis_binary):  # noqa: F811
    monkeypatch.setattr(store_module, "REDIS_RETRY_SECONDS", 0.0)
    server = OwnRedis(redis_binary, password=API_KEY).start()
    user = {"id": "user-1", "email": EMAIL, "name": USER_NAME, "role": "user"}
    statuses: list[str] = []
    caplog.set_level(logging.DEBUG)
    with all_logs() as captured:
        f = make_filter(counter, redis_url=server.url, max_context_tokens=1_200, reserve_output_tokens=200)
        try:
            # 1. ordinary turns, trimmed and shortened, with real and missing usage
            for i in range(6):
                usage = {"prompt_tokens": 900, "completion_tokens": 40} if i % 2 else None
                run = await run_turn(
                    f,
                    secret_chat(12 + i),
                    user=user,
                    chat_id=f"c{i}",
                    reply=reply_of(f"Reply about {SECRET_TEXT}", usage),
                )
                statuses += run.events.statuses
            assert isinstance(f.store, RedisStore) and f.store.shared
            for i in range(5):  # what the ledger and chat state will write
                await f.store.incr(f"usage:user-1:c{i}", {"prompt_tokens": 900}, ttl=3_600)
                await f.store.set(f"chat:c{i}", b"state", ttl=3_600)
                await f.store.add(f"lock:c{i}", b"1", ttl=30)

            # 2. every key in this Redis is ours, namespaced and expiring
            raw = aioredis.Redis.from_url(server.url)
            keys = [k.decode() async for k in raw.scan_iter(match="*")]
            assert len(keys) >= 15 and all(k.startswith(KEY_PREFIX) for k in keys)
            assert any(k.startswith(KEY_PREFIX + "ledger:") for k in keys)  # the filter's own usage ledger
            for key in keys:
                assert await raw.ttl(key) > 0  # expires (the ledger keeps 400 days)
            await raw.aclose()

            # 3. errors inside, carrying message text
            def broken_trim(messages, **kwargs):
                raise ValueError(f"cannot handle {messages[-1]['content']}")

            def broken_usage(message):
                raise KeyError(str(message))

            with monkeypatch.context() as patch:
                patch.setattr(trimpass_module, "trim_messages", broken_trim)
                patch.setattr(bookkeeping_module, "read_usage", broken_usage)
                run = await run_turn(f, secret_chat(4), user=user, chat_id="err")
                statuses += run.events.statuses
                assert run.after_inlet is run.sent_in

            async def leaky_emitter(event):
                raise ConnectionError(f"client of {EMAIL} went away")

            await run_turn(f, secret_chat(4), user=user, chat_id="emit", events=leaky_emitter)

            # 4. Redis dies mid-run, then comes back
            server.stop()
            for i in range(3):
                await run_turn(f, secret_chat(8), user=user, chat_id=f"down{i}")
                await f.store.incr("usage:user-1:down", {"n": 1}, ttl=60)
            server.start()
            await f.store.incr("usage:user-1:back", {"n": 1}, ttl=60)
            assert f.store.shared

            # 5. bad valves, among them the key in invalid JSON and a password that breaks the URL
            events = Events()
            for valves in (
                f.Valves.model_construct(max_context_tokens="lots", model_aliases='{"' + API_KEY + '": '),
                f.Valves.model_construct(redis_url=f"redis://:{API_KEY[:12]}/{API_KEY[12:]}@127.0.0.1:6379/0"),
                f.Valves.model_construct(redis_url=f"redis://default:{API_KEY}"),
                f.Valves.model_construct(redis_url=f"redis://:{API_KEY}@127.0.0.1:6379/0?socket_timeout={API_KEY}"),
                f.Valves.model_construct(redis_url=API_KEY),
            ):
                f.valves = valves
                admin = {
                    **user,
                    "role": "admin",
                    "valves": f.UserValves.model_construct(show_status=EMAIL),
                }  # who can fix valves
                run = await run_turn(f, secret_chat(6), user=admin, chat_id="valves", events=events)
                assert isinstance(run.after_request["messages"], list)
            statuses += events.statuses
        finally:
            server.stop()

    records = captured.records
    assert len(usage_lines(records)) >= 10
    loud = [(r.levelname, leaks(rendered(r))) for r in records if r.levelno >= logging.INFO and leaks(rendered(r))]
    assert loud == [], loud
    quiet = [(r.name, r.levelname, leaks(rendered(r))) for r in records if leaks(rendered(r))]
    assert quiet == [], quiet  # not even at DEBUG, from any library
    assert leaks(caplog.text) == []
    assert leaks("\n".join(statuses)) == [], [s for s in statuses if leaks(s)]
    assert any("redis_url" in s for s in statuses)  # the admin is told which valve is wrong


@pytest.mark.parametrize(
    "url",
    [
        f"redis://:{API_KEY[:12]}/{API_KEY[12:]}@127.0.0.1:6379/0",  # "/" in the password
        f"redis://:{API_KEY[:12]}#{API_KEY[12:]}@127.0.0.1:6379/0",  # "#" in the password
        f"redis://default:{API_KEY}",  # host forgotten: the password is read as the port
        f"redis://:{API_KEY}@127.0.0.1:99999/0",
    ],
)
def test_a_bad_redis_url_is_named_without_echoing_it(url):
    from contextwarden.errors import ConfigError
    from contextwarden.state.store import open_store

    with pytest.raises(ConfigError) as info:
        open_store(url)
    assert info.value.valve == "redis_url" and leaks(str(info.value)) == []
