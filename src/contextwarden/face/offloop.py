"""Where a hook's work runs: on the event loop, or in the process's one contextwarden thread.

A hook that counts, scores or trims a big chat on the loop stalls every other user's request
for as long (bench/loopstall.py); a small one costs less than the hop to the thread. The
thresholds here say which is which, measured (the numbers beside each), and `compute` runs
the work where they say.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import os
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import repeat
from typing import Any

from ..core.conversation import REASONING_KEYS, Message
from ..core.decision import TrimDecision
from ..core.recall import MIN_PASSAGE_TOKENS

__all__ = [
    "compute",
    "take_turn",
    "heavy",
    "heavy_extras",
    "reads_off_loop",
    "many_messages",
    "light_next_turn",
    "OFF_LOOP_MIN_CHARS",
]

# Chats with less text than this are counted and trimmed on the event loop: a cold trim of
# them takes a few ms (bench/loopstall.py: 3 ms, its stall no longer than the machine's own),
# and each hop to the thread costs the loop a GIL hand-over (up to sys.getswitchinterval()).
OFF_LOOP_MIN_CHARS = 25_000
PART_WEIGHT_CHARS = 1_000  # what a non-text part (an image) weighs toward OFF_LOOP_MIN_CHARS
# What a text part, a reasoning detail and a tool call weigh besides their text: each is read,
# counted and fingerprinted whatever its length (~1 µs an empty text part: 100,000 held the loop 120 ms).
ITEM_WEIGHT_CHARS = 10
# What a message weighs besides its text: a trim reads, counts, fingerprints, scores and selects
# each one whatever its length, ~30 µs a message in a new selection against ~0.15 µs a character
# (500 messages of 40 characters, 20,000 in all, held the loop 17-28 ms on its own; 21,000
# characters in 11 messages 3-11 ms). At 10 a message, 2,000 one-letter messages stayed on the
# loop and held it 45 ms; at this weight a chat of more than 125 short messages goes to the thread.
MESSAGE_WEIGHT_CHARS = 200
TOOLS_ON_LOOP_MAX = 64  # tool definitions rendered and counted on the loop (Open WebUI's built-in: 30)
_cpu_worker: tuple[int, ThreadPoolExecutor] | None = None  # (pid, executor): a forked child makes its own
# Reading the flags (and checking each part's type, counting the newest messages) costs ~0.5 µs a
# message or content part whatever their length (0.1 ms for 200 messages, 0.9 ms for 2,000 at
# load 4): up to this many it runs on the loop, where the hop to the thread would cost more
# (0.4 ms idle, 2-3 ms at load 4, the thread waiting for a core).
READS_ON_LOOP_MAX_ITEMS = 2_000
# A next turn that carries the previous selection reads only what is new, but still passes over
# every message a few times (~10 µs each): up to this many it runs on the loop (at most ~10 ms),
# where the hop to the thread costs about what the turn does. When it cannot be carried (a new
# selection, a worker that never read the chat), the trim goes to the thread as before.
NEXT_TURN_ON_LOOP_MAX_MESSAGES = 1_000
# A carried excerpt is checked against each new question, its message cut into chunks again
# (~27 µs per 1,000 characters: a 350k-character document 9 ms): up to this much excerpted text
# (~3 ms) a carried turn stays on the loop.
EXCERPTS_ON_LOOP_MAX_CHARS = 100_000
# A message shorter than this is never quoted by passages (recall.MIN_PASSAGE_TOKENS, 4 characters
# a token): it costs the recall nothing more than its score.
PASSAGE_SOURCE_CHARS = 4 * MIN_PASSAGE_TOKENS


def light_next_turn(messages: Sequence[Message], previous: TrimDecision) -> bool:
    """A next turn that may be carried on the loop: at most NEXT_TURN_ON_LOOP_MAX_MESSAGES
    messages, those new since `previous` with less than OFF_LOOP_MIN_CHARS of text, and the
    long messages its recall may read passages of (excerpted or dropped: each is cut and scored
    for the new question) with less than EXCERPTS_ON_LOOP_MAX_CHARS."""
    if len(messages) > NEXT_TURN_ON_LOOP_MAX_MESSAGES or heavy(messages[previous.seen :]):
        return False
    whole = set(previous.at).difference(at for at, _ in previous.excerpts)
    read = [m for i, m in enumerate(messages[: previous.seen]) if i not in whole and _passage_source(m)]
    return not heavy(read, EXCERPTS_ON_LOOP_MAX_CHARS)


def _passage_source(message: Message) -> bool:
    """A message the recall may quote passages of: not a system prompt, long or in parts."""
    content = message.get("content")
    long = isinstance(content, list) or (isinstance(content, str) and len(content) >= PASSAGE_SOURCE_CHARS)
    return long and message.get("role") != "system"


def many_messages(messages: Sequence[Message]) -> bool:
    """Whether a pass over every message (not into their parts: `!usage` exchanges) runs in the
    thread: more than READS_ON_LOOP_MAX_ITEMS of them (100,000 one-letter messages: 45 ms)."""
    return len(messages) > READS_ON_LOOP_MAX_ITEMS


def reads_off_loop(off: bool, messages: Sequence[Message]) -> bool:
    """Whether a pass whose trim runs off the loop (`off`) also reads its messages there, part by
    part (flags, the calibration's text-only check, the cache's prefix count): only a chat of more
    than READS_ON_LOOP_MAX_ITEMS messages, content parts and tool calls (100,000 empty text parts
    in one message held the loop 85 ms, 300,000 tool calls 120 ms). `messages` are dicts
    (`hookargs.is_chat_body`)."""
    if not off or many_messages(messages):
        return off
    lists = [list(map(dict.get, messages, repeat(key))) for key in ("content", "tool_calls", "reasoning_details")]
    if list not in set().union(*(map(type, values) for values in lists)):  # in C: most chats have no parts
        return False
    # `conversation.part_count` summed, but over the lists only (a call a message: 6x slower).
    parts = sum(len(value) for values in lists for value in values if type(value) is list)
    return len(messages) + parts > READS_ON_LOOP_MAX_ITEMS


def heavy(messages: Sequence[Message], limit: int = OFF_LOOP_MIN_CHARS) -> bool:
    """True when the messages weigh `limit` characters or more (stops counting there): their
    text, reasoning and tool-call arguments, MESSAGE_WEIGHT_CHARS more for each message,
    ITEM_WEIGHT_CHARS for each text part, reasoning detail and tool call, and PART_WEIGHT_CHARS
    for a part that is not text (an image: walking it costs the same).
    """
    size = 0
    for message in messages:
        size += MESSAGE_WEIGHT_CHARS + _weight(message.get("content"), limit - size)
        if not REASONING_KEYS.isdisjoint(message):
            size += _reasoning_weight(message, limit - size)
        calls = message.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            function = call.get("function") if isinstance(call, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            size += ITEM_WEIGHT_CHARS + (len(arguments) if isinstance(arguments, str) else PART_WEIGHT_CHARS)
            if size >= limit:
                return True
        if size >= limit:
            return True
    return False


def _weight(content: object, left: int) -> int:
    """What a message's content weighs toward `heavy`'s limit (counting stops past `left`)."""
    if isinstance(content, str):
        return len(content)
    size = 0
    for part in content if isinstance(content, list) else ():
        text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
        size += (ITEM_WEIGHT_CHARS + len(text)) if isinstance(text, str) else PART_WEIGHT_CHARS
        if size >= left:
            break
    return size


def _reasoning_weight(message: Message, left: int) -> int:
    """What a message's reasoning (`conversation.reasoning_text`'s fields) weighs toward `heavy`'s
    limit: its strings, and each reasoning detail as ITEM_WEIGHT_CHARS and its strings (counting
    stops past `left`)."""
    size = sum(len(value) for key in REASONING_KEYS if type(value := message.get(key)) is str)
    details = message.get("reasoning_details")
    for detail in details if isinstance(details, list) and size < left else ():
        values = detail.values() if isinstance(detail, dict) else ()
        size += ITEM_WEIGHT_CHARS + sum(len(value) for value in values if type(value) is str)
        if size >= left:
            break
    return size


def heavy_extras(body: dict[str, Any]) -> bool:
    """True when a request's tool definitions or response format are worth counting off the loop
    (3,000 tool definitions stalled it 120-180 ms; 64 with 5 MB of schemas 300 ms; a 2 MB
    response format 280-310 ms): more than TOOLS_ON_LOOP_MAX tools, or OFF_LOOP_MIN_CHARS of them."""
    tools = body.get("tools")
    many = isinstance(tools, list) and (len(tools) > TOOLS_ON_LOOP_MAX or _weighs(tools, OFF_LOOP_MIN_CHARS))
    return many or isinstance(body.get("response_format"), dict)


def _weighs(value: object, limit: int) -> bool:
    """Whether JSON-like `value` weighs `limit` or more: its strings' characters and ITEM_WEIGHT_CHARS
    for each value, key and item; walked without recursion (a schema may nest deep), stopping there."""
    size, left = 0, [value]
    while left:
        item = left.pop()
        size += ITEM_WEIGHT_CHARS + (len(item) if isinstance(item, str) else 0)
        if isinstance(item, dict):
            left.extend(item)
            left.extend(item.values())
        elif isinstance(item, list):
            left.extend(item)
        if size >= limit:
            return True
    return False


class _LoopTurns:
    """Hooks take turns on one event loop: a hook's turn lasts until the loop's next iteration
    (one `call_soon` later), then goes to the hook that has waited longest, so the loop polls its
    sockets and timers between one hook's work and the next. Without it, 50 small turns started
    together each ran the whole of its pass in the same iteration, one after another: one stall
    of their sum (50 turns just under OFF_LOOP_MIN_CHARS: 175-253 ms; bench/loopstall.py)."""

    def __init__(self) -> None:
        self._holder: object | None = None  # the task whose turn it is, or _HANDED to one not run yet
        self._waiting: deque[asyncio.Future[None]] = deque()

    async def take(self) -> None:
        """Wait for this task's turn (at once when it has it, or nobody has and nobody waits)."""
        task = asyncio.current_task()
        if task is None or self._holder is task:
            return
        loop = asyncio.get_running_loop()
        if self._holder is not None or self._waiting:
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiting.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():  # handed the turn, then cancelled: pass it on
                    self._hand_over()
                raise
        self._holder = task
        loop.call_soon(self._hand_over)

    def _hand_over(self) -> None:
        """The turn ends: to the longest waiting hook still waiting, or to nobody."""
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self._holder = _HANDED
                return
        self._holder = None


_HANDED = object()  # a turn handed to a waiting hook that has not run yet: nobody else takes it meanwhile
_turns: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopTurns] = weakref.WeakKeyDictionary()


async def take_turn() -> None:
    """Wait for this hook's turn on the running loop (`_LoopTurns`): each hook takes it before it
    reads anything, and `compute` before work on the loop (a turn may have passed on while the
    hook awaited I/O)."""
    loop = asyncio.get_running_loop()
    turns = _turns.get(loop)
    if turns is None:
        turns = _turns[loop] = _LoopTurns()
    await turns.take()


async def compute(off: bool, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)`: with `off`, in the process's one contextwarden thread, so the event
    loop serves other users while a hook counts, scores or trims a big chat (tiktoken releases
    the GIL as it encodes; Python code yields it every `sys.getswitchinterval()`), with the
    garbage collector's own passes paused meanwhile (`_collections_paused`); else on the loop,
    in the hook's turn (`take_turn`). One thread runs the calls one at a time, so the shared
    caches never see two trims at once. What `fn` raises is raised here; if the awaiting request
    is cancelled, the call runs to its end unseen."""
    if not off:
        await take_turn()
        return fn(*args, **kwargs)
    global _cpu_worker
    if _cpu_worker is None or _cpu_worker[0] != os.getpid():
        _cpu_worker = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="contextwarden-cpu"))
    call = functools.partial(_collections_paused, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_cpu_worker[1], call)


def _collections_paused(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` with the garbage collector's automatic passes off until it returns
    (process-wide: `gc.disable`; left alone when something else turned them off). A big chat's
    trim holds hundreds of thousands of objects while it runs and frees them by reference
    counting as it returns, but on the way their number set off full collections, each one
    C call over the whole heap that holds the GIL: 100,000 one-letter messages set off six of
    30-140 ms a trim, each a stall of the event loop (bench/loopstall.py). Garbage in cycles
    made meanwhile waits for the next collection after it.

    What `fn` kept (its result, the chat's view, cache entries: ~100,000 objects for that chat)
    is then put in the oldest generation unscanned (`gc.freeze` then `gc.unfreeze`, each a list
    splice), not left young for one collection that reads it all (20-40 ms), unless the process
    froze objects of its own (a pre-fork server's heap: left frozen)."""
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        return fn(*args, **kwargs)
    finally:
        if paused:
            if not gc.get_freeze_count():
                gc.freeze()
                gc.unfreeze()
            gc.enable()
