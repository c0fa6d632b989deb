"""Build `open_webui_filter.py`, the single file an admin pastes into Open WebUI.

Concatenates the modules of `src/contextwarden/` part by part (the package's own, then its
folders core, state, money, face) in a fixed order, each part under a header and each module
framed by banners.
Standard-library and allowed third-party imports are hoisted into one block at the top and
stay as comments where they were, as do intra-package imports. An audit map at the top gives
the line of the Filter class and of every place that reaches outside the process (network,
files); the build fails when such a place is not in the map. The output depends only on the
sources (no timestamps), so `--check` can tell a stale committed file.

    python build/bundle.py            # write open_webui_filter.py
    python build/bundle.py --check    # exit 1 when the committed file is stale

Stdlib only: this runs before anything is installed.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import hashlib
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# In a source tree this file is build/bundle.py; in a wheel it is contextwarden/_bundle.py.
INSTALLED = (HERE / "face" / "filter.py").exists()
PACKAGE = HERE if INSTALLED else HERE.parent / "src" / "contextwarden"
OUTPUT = Path("open_webui_filter.py") if INSTALLED else HERE.parent / "open_webui_filter.py"

# The modules by their path under src/contextwarden/, part by part (the package's own, core,
# state, money, face: PARTS), each part in dependency order: a module imports only modules
# listed before it, so a part imports only the parts before it.
MODULES = [
    "errors",
    "caches",
    "backoff",
    "netclient",
    "encoding_files",
    "core/conversation",
    "core/tokens",
    "core/semantic",
    "core/relevance",
    "core/recall_index",
    "core/decision",
    "core/chatview",
    "core/alternation",
    "core/selection",
    "core/excerpt",
    "core/sources",
    "core/recall",
    "core/shorten",
    "core/trim_types",
    "core/carry",
    "core/fresh",
    "core/trim",
    "core/flags",
    "state/chatstate",
    "state/store",
    "money/dollars",
    "money/price_data",
    "money/pricing",
    "money/live_prices",
    "money/price_sources",
    "money/usage",
    "money/cache_hints",
    "money/records",
    "money/savings",
    "money/ledger",
    "money/limits",
    "money/spendbook",
    "money/calibration",
    "money/openturns",
    "money/cache_stats",
    "money/accounting",
    "face/offloop",
    "face/embedder",
    "face/summarize",
    "face/status",
    "face/adminview",
    "face/usergroups",
    "face/settings",
    "face/valves",
    "face/budget",
    "face/hookargs",
    "face/turnsources",
    "face/trimpass",
    "face/bookkeeping",
    "face/faults",
    "face/filter",
]
# The parts in the file's order and the header of each; a part's title is the first line of
# its __init__.py docstring.
PARTS = ["", "core", "state", "money", "face"]
SHARED_TITLE = (
    "The package's own: exceptions, the cache inventory, back-off, HTTP clients and tiktoken's files, for every part."
)
# Python's builtins: one module's top-level `filter` or `open` would be every module's here.
BUILTIN_NAMES = frozenset(name for name in dir(builtins) if not name.startswith("_"))
# What Open WebUI itself ships besides the standard library.
ALLOWED_THIRD_PARTY = {"pydantic", "httpx", "tiktoken", "redis"}

# The audit map at the top of the file: where to read first, and every place that reaches
# outside the process. Each entry is (what, "module.qualname"). The bundler fails when a
# network or file access appears outside the places listed here, so the map stays true.
AUDIT = [
    ("the Filter class Open WebUI instantiates (inlet, request, outlet)", "filter.Filter"),
    ("fail open: any error returns the body, one log line, admins told once", "filter.Filter._failed"),
    ("network: OpenRouter's public price list (GET, background refresh)", "live_prices.fetch_openrouter_prices"),
    ("network: OpenRouter fetch client (the only place it is opened)", "live_prices.LivePrices.refresh"),
    ("network: the optional summary model (POST, admin's summary_base_url)", "summarize._ask"),
    ("network: Redis (only when the redis_url valve is set)", "store.redis_client"),
    ("network: every outbound async HTTP client (TLS context made once, off the loop)", "netclient.async_client"),
    ("network: a tiktoken encoding not in its cache (GET, background thread)", "encoding_files._download"),
    ("file: tiktoken's cache, an encoding file checked", "encoding_files.encoding_cached"),
    ("file: tiktoken's cache, a downloaded encoding file written", "encoding_files._fetch_into_cache"),
    ("file: the admin's pricing_file valve (read only, checked first)", "pricing._read_price_file"),
    ("model: Open WebUI's own embedder (app.state.EMBEDDING_FUNCTION)", "embedder.OpenWebUIEmbedder._fetch"),
]
# What counts as reaching outside: opening an HTTP client or a Redis connection, reading a file.
OUTSIDE = re.compile(
    r"httpx\.(?:Async)?Client\(|aioredis\.\w+\(|\.from_url\(|\bopen\(|\.read_(?:text|bytes)\(|self\._function\("
)

# What an admin reads first, under the frontmatter: what the file is, everything it sends over
# the network and to whom, everything it stores and for how long, and the valves to set first.
# tests/test_bundle.py holds each URL, key and time to live here to the code's constants.
ABOUT = """\
contextwarden {version}: an Open WebUI filter (Admin Panel > Functions: paste, save, switch on,
make Global). Before each model call it trims the chat to the model's context window; after
each reply it prices the reply's usage, logs one `usage {{json}}` line (user id, chat id, model,
token counts, cost; never message text) and shows one status line above the reply. An error of
its own lets the chat through unchanged.

What it sends over the network, and to whom (nothing else: the build fails when code outside
the places in the audit map below opens a connection or a file):
  openrouter.ai         GET https://openrouter.ai/api/v1/models, the public price list (no key,
                        no chat data), in the background at most once per pricing_ttl_hours
                        (24 h) a worker, again after 10 min when it fails. Valve
                        openrouter_pricing (on): off, the bundled prices are used.
  summary_base_url      only with summary_enabled (off): POST <summary_base_url>/chat/completions
                        with the text of the messages a trim drops; summary_api_key as Bearer.
  openaipublic.blob.core.windows.net
                        GET tiktoken's o200k_base and cl100k_base encodings when they are not in
                        tiktoken's cache (TIKTOKEN_CACHE_DIR, else DATA_GYM_CACHE_DIR, else
                        <tmp>/data-gym-cache), from a background thread started when this file is
                        loaded, and written there; offline, token counts are estimated and say so
                        (a failed fetch is tried again after 1 min,
                        doubling up to 1 h).
  redis_url             only when set: the keys below.
  Open WebUI's embedder with semantic_relevance (on): message text goes to the embedding model
                        Open WebUI uses for RAG (local, or the remote engine configured there).
Files: it reads tiktoken's cache (each encoding's file, its sha256 checked) and the pricing_file
valve's path when set, and writes only tiktoken's cache.

What it stores: in Redis under "contextwarden:" when redis_url is set, else in each worker's
memory (gone on restart). No message text except summaries. Every key expires:
  chat:v1:<hash>               a chat's last trim decision and pins      state_ttl_hours (72 h)
                               (positions and digests of messages)
  summary:<hash>               a summary's text (summary_enabled only)   state_ttl_hours (72 h)
  ledger:<day>:<user>:<model>  usage totals per user id, model and day   ledger_retention_days (400)
  ledger-month:<YYYY-MM>       the month's totals by user, model, day    the same, at least 40 days
  spend:<YYYY-MM>:<user>       a user's spend this month and day         40 days
  calibration:<model>          how far token counts are from the model's 30 days
  cachestats:<model>           how often the model's prompt cache hit    30 days
  prices:openrouter[:lock]     the fetched price list (Redis only)       pricing_ttl_hours (24 h)
  once:<YYYYMMDDHH>            usage increments applied (Redis only)     1 day

Valves to set first: max_context_tokens (0 = the model's own window, else the bundled price
table's, else 8,192); mode (enforce; shadow sends chats unchanged and records what a trim would
have saved; off); redis_url with several workers or replicas; openrouter_pricing off on a
server without internet. README.md, "Valves", describes every valve."""

# Open WebUI 0.12.4 rewrites these texts wherever they occur in a function's source before it
# runs it (`utils/plugin.py` `replace_imports`: plain `str.replace`, in strings and comments
# too), e.g. "from configparser" into "from open_webui.configparser". The file holds none.
OPEN_WEBUI_REWRITES = ("from utils", "from apps", "from main", "from config")

FRONTMATTER = {
    "title": "contextwarden",
    "author": "contextwarden developers",
    "license": "MIT",
    "description": (
        "Keeps every chat inside a token budget (tool-call pairs, system prompt and last question kept) "
        "and logs what each reply really cost."
    ),
    "required_open_webui_version": "0.10.0",
}


class BundleError(Exception):
    """The sources cannot be bundled as they are."""


def _version() -> str:
    match = re.search(r'^__version__ = "([^"]+)"', (PACKAGE / "__init__.py").read_text(), re.M)
    if not match:
        raise BundleError("src/contextwarden/__init__.py has no __version__")
    return match.group(1)


def _top_level_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    names.discard("__all__")
    return names


def _imported(name: str, node: ast.ImportFrom) -> str:
    """The path (as in MODULES) a relative import in module `name` reads, e.g. `core/tokens`."""
    package = name.split("/")[:-1]
    if node.level - 1 > len(package):
        return "<above the package>"
    base = package[: len(package) - (node.level - 1)]
    return "/".join(base + (node.module.split(".") if node.module else []))


def _part(name: str) -> str:
    """The part a module of MODULES belongs to ("" for the package's own)."""
    return name.rpartition("/")[0]


def _part_header(part: str) -> str:
    """The banner above a part's modules: its folder and its title."""
    if not part:
        folder, title = "contextwarden/", SHARED_TITLE
    else:
        doc = ast.get_docstring(ast.parse((PACKAGE / part / "__init__.py").read_text(encoding="utf-8")))
        if not doc:
            raise BundleError(f"contextwarden/{part}/__init__.py has no docstring to title its part")
        folder, title = f"contextwarden/{part}/", doc.splitlines()[0]
    rule = "#" * 100
    return f"{rule}\n# {folder}  {title}\n{rule}"


def _bundle_module(
    name: str, source: str, seen: list[str], hoisted: dict[tuple[str, str], set]
) -> tuple[str, set[str]]:
    """One module's text for the bundle, and its top-level names; collects its imports."""
    tree = ast.parse(source, filename=f"{name}.py")
    lines = source.splitlines()
    replace: dict[int, list[str]] = {}  # first line (0-based) -> replacement lines
    skip: set[int] = set()

    def take(node: ast.stmt, replacement: list[str]) -> None:
        first, last = node.lineno - 1, node.end_lineno - 1
        replace[first] = replacement
        skip.update(range(first + 1, last + 1))

    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level:
            target = _imported(name, node)
            if target not in MODULES:
                raise BundleError(f"{name}.py: unsupported relative import {ast.unparse(node)!r}")
            if target not in seen:
                raise BundleError(f"{name}.py imports {target}, which comes later in MODULES")
            renamed = [f"{a.name} as {a.asname}" for a in node.names if a.asname and a.asname != a.name]
            if renamed:  # the import becomes a comment: nothing would bind the new name
                raise BundleError(f"{name}.py renames {', '.join(renamed)} in a relative import; use the name itself")
            take(node, [f"# {ast.unparse(node)}  (bundled above)"])
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            roots = (
                [a.name.split(".")[0] for a in node.names]
                if isinstance(node, ast.Import)
                else [(node.module or "").split(".")[0]]
            )
            for root in roots:
                if root != "__future__" and root not in sys.stdlib_module_names and root not in ALLOWED_THIRD_PARTY:
                    raise BundleError(f"{name}.py imports {root!r}, which Open WebUI does not ship")
            if isinstance(node, ast.Import):
                for alias in node.names:
                    hoisted.setdefault(("import", alias.name), set()).add(alias.asname)
            elif node.module != "__future__":
                names = hoisted.setdefault(("from", node.module), set())
                names.update(f"{a.name} as {a.asname}" if a.asname else a.name for a in node.names)
            take(node, [f"# {ast.unparse(node)}  (hoisted to the top)"])
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            exported = ", ".join(ast.literal_eval(node.value))
            take(node, [f"# exports: {exported}"])
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and node not in tree.body:
            raise BundleError(f"{name}.py:{node.lineno}: imports must be at module level")

    out: list[str] = []
    for index, line in enumerate(lines):
        if index in replace:
            out.extend(replace[index])
        elif index not in skip:
            out.append(line)
    text = "\n".join(out).strip("\n")
    text = re.sub(r"\n{3,}", "\n\n\n", text)
    return text, _top_level_names(tree)


def _import_block(hoisted: dict[tuple[str, str], set]) -> tuple[str, str]:
    """The hoisted imports as two sorted blocks of statements: standard library, third party."""
    blocks: dict[bool, list[str]] = {True: [], False: []}
    for (kind, module), names in sorted(hoisted.items()):
        is_stdlib = module.split(".")[0] in sys.stdlib_module_names
        if kind == "import":
            blocks[is_stdlib].extend(f"import {module}" + (f" as {a}" if a else "") for a in sorted(names, key=str))
        else:
            blocks[is_stdlib].append(f"from {module} import {', '.join(sorted(names))}")
    return "\n".join(blocks[True]), "\n".join(blocks[False])


def _import_bindings(hoisted: dict[tuple[str, str], set]) -> dict[str, str]:
    """Each name the hoisted imports bind at the top, mapped to the import that binds it."""
    bound: dict[str, str] = {}
    for (kind, module), names in sorted(hoisted.items(), key=str):
        for entry in sorted(names, key=str):
            if kind == "import":
                name, statement = entry or module.split(".")[0], f"import {module}" + (f" as {entry}" if entry else "")
            else:
                name, statement = entry.split(" as ")[-1], f"from {module} import {entry}"
            if bound.get(name, statement) != statement:
                raise BundleError(f"name collision: {name!r} is bound by {bound[name]!r} and {statement!r}")
            bound[name] = statement
    return bound


def _spans(tree: ast.Module) -> dict[str, tuple[int, int]]:
    """(first, last) line of each top-level function and class and of each method, by qualname."""
    spans: dict[str, tuple[int, int]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            spans[node.name] = (node.lineno, node.end_lineno or node.lineno)
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        spans[f"{node.name}.{item.name}"] = (item.lineno, item.end_lineno or item.lineno)
    return spans


def _audit_map(text: str) -> list[str]:
    """The map's lines for this text; raises when a listed place is gone or an unlisted one reaches out."""
    spans = _spans(ast.parse(text))
    lines = ["# Audit map (line numbers in this file):"]
    for what, target in AUDIT:
        qualname = target.split(".", 1)[1]
        if qualname not in spans:
            raise BundleError(f"audit map: {target} is not defined (update AUDIT in build/bundle.py)")
        lines.append(f"#   line {spans[qualname][0]:>5}  {what}: {qualname}")
    listed = [spans[t.split(".", 1)[1]] for _w, t in AUDIT]
    for number, line in enumerate(text.splitlines(), 1):
        code = line.split("#", 1)[0]
        if OUTSIDE.search(code) and not any(first <= number <= last for first, last in listed):
            raise BundleError(
                f"audit map: line {number} reaches outside the process but is not listed in AUDIT: {line.strip()}"
            )
    return lines


def build() -> str:
    """The bundle's full text."""
    parts = [_part(name) for name in MODULES]
    if any(p not in PARTS for p in parts) or parts != sorted(parts, key=PARTS.index):
        raise BundleError("MODULES must list the parts in the order of PARTS, each part's modules together")
    sources = {name: (PACKAGE / f"{name}.py").read_text(encoding="utf-8") for name in MODULES}
    digest = hashlib.sha256("".join(sources[n] for n in MODULES).encode()).hexdigest()[:12]
    hoisted: dict[tuple[str, str], set] = {}
    owners: dict[str, str] = {}
    bodies: list[str] = []
    seen: list[str] = []
    for name in MODULES:
        body, names = _bundle_module(name, sources[name], seen, hoisted)
        if not seen or _part(seen[-1]) != _part(name):
            bodies.append(_part_header(_part(name)))
        for defined in sorted(names):
            if defined in BUILTIN_NAMES:  # in a package it would shadow it in its own module only
                raise BundleError(f"name collision: {name}.py defines {defined!r}, the builtin every module uses")
            if defined in owners:
                raise BundleError(f"name collision: {defined!r} is defined in {owners[defined]}.py and {name}.py")
            owners[defined] = name
        bodies.append(f"# ---- begin contextwarden/{name}.py ----\n\n{body}\n\n# ---- end contextwarden/{name}.py ----")
        seen.append(name)
    if "class Filter" not in bodies[-1] or not MODULES[-1].endswith("/filter"):
        raise BundleError("the last module must define class Filter")
    for name, statement in _import_bindings(hoisted).items():
        if name in BUILTIN_NAMES:
            raise BundleError(f"name collision: {statement!r} binds {name!r}, the builtin every module uses")
        if name in owners:
            raise BundleError(f"name collision: {name!r} is defined in {owners[name]}.py and bound by {statement!r}")

    front = {"title": FRONTMATTER["title"], "author": FRONTMATTER["author"], "version": _version()}
    front.update({k: v for k, v in FRONTMATTER.items() if k not in front})
    stdlib, third = _import_block(hoisted)

    def assemble(audit: list[str]) -> str:
        parts = [
            '"""\n' + "\n".join(f"{k}: {v}" for k, v in front.items()) + '\n"""',
            "\n".join(f"# {line}".rstrip() for line in ABOUT.format(version=_version()).splitlines()),
            "# Generated by build/bundle.py from src/contextwarden/ "
            f"(contextwarden {_version()}, source sha256 {digest}).\n"
            "# Do not edit: change src/contextwarden/ and run `python build/bundle.py`.\n"
            "# Modules, in order: " + ", ".join(MODULES) + ".",
            "\n".join(audit),
            "from __future__ import annotations",
            stdlib + "\n\n" + third,
            *bodies,
        ]
        return "\n\n\n".join(parts) + "\n"

    # The map has one line per entry whatever its numbers, so numbering a draft is exact.
    draft = assemble(["#"] * (len(AUDIT) + 1))
    text = assemble(_audit_map(draft))
    if re.search(r"^\s*from \.", text, re.M):
        raise BundleError("a relative import survived bundling")
    for rewritten in OPEN_WEBUI_REWRITES:
        if rewritten in text:
            number = text[: text.index(rewritten)].count("\n") + 1
            raise BundleError(f"line {number} holds {rewritten!r}, which Open WebUI rewrites before it runs the file")
    compile(text, str(OUTPUT), "exec")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the output file is not up to date")
    parser.add_argument("--output", type=Path, default=OUTPUT, help="where to write (default: open_webui_filter.py)")
    args = parser.parse_args(argv)
    try:
        text = build()
    except BundleError as exc:
        print(f"bundle: {exc}", file=sys.stderr)
        return 2
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else ""
        if current != text:
            print(f"bundle: {args.output.name} is stale; run `python build/bundle.py` and commit it", file=sys.stderr)
            return 1
        print(f"bundle: {args.output.name} is up to date")
        return 0
    args.output.write_text(text, encoding="utf-8")
    print(f"bundle: wrote {args.output} ({len(text.splitlines()):,} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
