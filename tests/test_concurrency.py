"""Concurrency: one `Filter` instance serving hundreds of simultaneous turns, as in Open WebUI.

Every chat carries a unique marker in every message and every user a distinct budget (user
valves); the emitters yield to the event loop so the hooks of different turns interleave.
Nothing of one chat or user may show up in another's output, metadata or usage line.
"""

from __future__ import annotations

import asyncio
import logging
import random
import sys
import threading
from decimal import Decimal

import pytest

from contextwarden import trim_messages
from contextwarden.core.conversation import SUMMARY_ACK_MESSAGE, is_recall_message
from contextwarden.core.tokens import TokenCounter
from contextwarden.money.ledger import ledger_totals, read_ledger, usd_to_picodollars

from chats import check_contract
from helpers import make_filter, quoted_whole
from turns import YieldingEvents, reply_of, run_turn, usage_lines

MODEL = "gpt-4o"
USERS = 60
CHATS_PER_USER = 5  # 300 simultaneous turns


def marked_chat(marker: str, rng: random.Random) -> list[dict]:
    """A chat whose every message names its chat, of random length (some need trimming)."""
    chat = [{"role": "system", "content": f"{marker} system prompt"}]
    for i in range(rng.randint(0, 25)):
        chat.append({"role": "user", "content": f"{marker} question {i} " + "lorem ipsum " * rng.randint(5, 60)})
        if rng.random() < 0.2:
            chat.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": f"{marker}-call{i}",
                            "type": "function",
                            "function": {"name": "f", "arguments": f'{{"m": "{marker}"}}'},
                        }
                    ],
                }
            )
            chat.append(
                {"role": "tool", "tool_call_id": f"{marker}-call{i}", "content": f"{marker} result " + "data " * 30}
            )
        chat.append({"role": "assistant", "content": f"{marker} answer {i} " + "dolor sit " * rng.randint(5, 60)})
    chat.append({"role": "user", "content": f"{marker} latest question"})
    return chat


def user_budget(u: int) -> int:
    return 300 + 37 * u  # distinct per user, all below the admin's budget


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_hundreds_of_simultaneous_turns_stay_apart(counter, caplog, store, request, unique):
    caplog.set_level(logging.INFO, logger="contextwarden")
    valves = {"max_context_tokens": 20_000, "reserve_output_tokens": 1_000}
    if store == "redis":
        valves["redis_url"] = request.getfixturevalue("redis_url")
    f = make_filter(counter, **valves)
    rng = random.Random(7)
    turns = []
    for u in range(USERS):
        user_valves = f.UserValves(max_context_tokens=user_budget(u), show_status=u % 7 != 0)
        for c in range(CHATS_PER_USER):
            chat_id = f"chat-{u}-{c}"
            marker = f"MARK[{chat_id}]"
            # a prompt above the worker's own count: a lower one is booked as counted (`OpenTurn.seen`)
            usage = {"prompt_tokens": 1_000 * (u + 1) + c, "completion_tokens": c + 1} if c % 2 else None
            turns.append((u, chat_id, marker, marked_chat(marker, rng), user_valves, usage))
    user_id = {u: f"user-{unique}-{u}" for u in range(USERS)}  # unique: the shared Redis keeps other runs' ledgers
    rng.shuffle(turns)

    runs = await asyncio.gather(
        *(
            run_turn(
                f,
                chat,
                user={"id": user_id[u], "email": f"user{u}@example.com", "valves": valves_},
                chat_id=chat_id,
                reply=reply_of(f"{marker} reply", usage),
                events=YieldingEvents(),
            )
            for u, chat_id, marker, chat, valves_, usage in turns
        )
    )

    records = usage_lines(caplog.records)
    assert len(records) == len(turns)  # exactly one usage line per outlet
    by_chat = {r["chat_id"]: r for r in records}
    assert len(by_chat) == len(turns)
    trimmed = 0
    for (u, chat_id, marker, chat, _, usage), run in zip(turns, runs, strict=True):
        sent = run.after_request["messages"]
        # only this chat's messages, each the very dict of this chat's input, or a recall block
        # quoting them (a small room picks single messages) with its acknowledgement
        blocks = [k for k, m in enumerate(sent) if is_recall_message(m)]
        acks = {k + 1 for k in blocks}
        assert all(any(m is n for n in chat) for k, m in enumerate(sent) if k not in {*blocks, *acks})
        assert all(sent[k] == SUMMARY_ACK_MESSAGE for k in acks)
        assert all(marker in str(m) for k, m in enumerate(sent) if k not in acks)
        note = run.metadata["contextwarden"]
        assert note["budget"] == user_budget(u)
        assert note["estimated_prompt_tokens"] == counter.count_messages(sent, MODEL) <= user_budget(u)
        check_contract(
            chat, trim_messages(chat, max_tokens=user_budget(u), model=MODEL, token_counter=counter), counter, MODEL
        )
        trimmed += len(sent) < len(chat)
        # its own status lines only (or none when this user hid them)
        if u % 7 == 0:
            assert run.events.items == []
        else:
            # one line a turn, after the reply: what its own trim did, then its own usage
            assert len(run.events.statuses) == 1 and all(e["data"]["done"] is True for e in run.events.items)
            line = run.events.statuses[0]
            if len(sent) < len(chat):  # what its own trim did: in place, or quoted whole
                read = len(sent) - 2 * len(blocks) + quoted_whole(chat, sent)
                assert line.startswith(f"Sent {read:,} of {len(chat):,} messages · "), line
            else:  # its own budget
                assert line.startswith("Whole chat sent · "), line
                assert note["line"].endswith(f"(fits {user_budget(u):,})"), note["line"]  # the admin's detail
        record = by_chat[chat_id]
        assert record["user_id"] == user_id[u]
        assert record["estimated_prompt_tokens"] == note["estimated_prompt_tokens"]
        if usage:
            assert (record["prompt_tokens"], record["completion_tokens"], record["estimated"]) == (
                1_000 * (u + 1) + int(chat_id[-1]),
                usage["completion_tokens"],
                False,
            )
        else:
            assert record["estimated"] is True and record["prompt_tokens"] == note["estimated_prompt_tokens"]
    assert trimmed > len(turns) // 3  # the budgets really bit

    # a healthy Redis under load is not an outage: no fallback, no warnings
    assert [r.getMessage() for r in caplog.records if "Redis" in r.getMessage() and r.levelno >= logging.WARNING] == []
    # the ledger adds up exactly what the usage lines said, per user, in memory and in Redis
    entries = [e for e in await read_ledger(f.store) if e.user.startswith(f"user-{unique}-")]
    rows = {row.key: row.counters for row in ledger_totals(entries, "user")}
    assert set(rows) == set(user_id.values())
    for uid in user_id.values():
        mine = [r for r in records if r["user_id"] == uid]
        assert rows[uid]["requests"] == CHATS_PER_USER == len(mine)
        assert rows[uid]["prompt_tokens"] == sum(r["prompt_tokens"] for r in mine)
        assert rows[uid]["completion_tokens"] == sum(r["completion_tokens"] for r in mine)
        assert rows[uid]["estimated"] == sum(r["estimated"] for r in mine)
        assert rows[uid]["cost_picousd"] == sum(
            usd_to_picodollars(Decimal(r["cost_usd"])) for r in mine if r["cost_usd"]
        )


async def test_concurrent_turns_of_one_chat_are_identical(counter):
    """`request` runs again inside tool loops and retries: the same chat trimmed concurrently gives one answer."""
    f = make_filter(counter, max_context_tokens=1_200, reserve_output_tokens=200)
    chat = marked_chat("SAME", random.Random(3))
    runs = await asyncio.gather(*(run_turn(f, chat, chat_id="same", user={"id": "u"}) for _ in range(100)))
    first = runs[0].after_request["messages"]
    assert len(first) < len(chat)
    for run in runs:  # the very dicts of the chat, and equal recall blocks
        assert run.after_request["messages"] == first
        assert all(
            a is b
            for a, b in zip(run.after_request["messages"], first, strict=True)
            if not is_recall_message(b) and b != SUMMARY_ACK_MESSAGE
        )


def test_one_counter_shared_by_threads():
    """Library callers share `default_counter()` across threads: counting must not race."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    shared = TokenCounter(block=True, cache_size=50)
    assert shared.wait_ready(MODEL)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(15_000):
                shared.count_text(f"text {rng.randint(0, 120)}", MODEL)
            chat = marked_chat(f"T{seed}", rng)
            result = trim_messages(chat, max_tokens=500, model=MODEL, token_counter=shared)
            assert result.tokens_after <= 500
        except BaseException as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(8)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(old)
    assert errors == []
    assert len(shared._cache) <= 50 + len(threads)
