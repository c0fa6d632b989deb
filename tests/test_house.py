"""House rules the code keeps (issue 19): short functions in `src/`."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "contextwarden"
MAX_FUNCTION_LINES = 60


def _code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's lines from `def` to its end, less its docstring (the guarantees and examples
    a public function documents are not steps to follow)."""
    lines = (node.end_lineno or node.lineno) - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        lines -= (first.end_lineno or first.lineno) - first.lineno + 1
    return lines


def long_functions(root: Path = SRC, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """`file:line name (n lines)` for every function or method over `limit` code lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _code_lines(node) > limit:
                found.append(f"{path.name}:{node.lineno} {node.name} ({_code_lines(node)} lines)")
    return found


def test_no_function_in_src_is_over_60_lines():
    assert long_functions() == []


def test_the_length_check_can_fail(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    (tmp_path / "long.py").write_text(f'def f():\n    """Doc.\n\n    More.\n    """\n{body}\n')
    (tmp_path / "short.py").write_text('def g():\n    """' + "doc\n" * 80 + '"""\n    return 1\n')
    assert long_functions(tmp_path) == ["long.py:1 f (62 lines)"]


# The trim options whose defaults are named once (selection.py, trim_types.py, recall.py) and used by name
# everywhere else: trim_messages, TrimOptions, explain_trim, the CLI, the valves.
TRIM_OPTION_NAMES = {"strategy", "keep_last_turns", "low_watermark", "growth_turns", "recall_share"}


def retyped_defaults(root: Path = SRC) -> list[str]:
    """`file:line name` for every parameter, class field or `default=` keyword giving a trim
    option a literal default instead of its `DEFAULT_...` constant."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            pairs: list[tuple[str, ast.expr | None]] = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                positional = args.posonlyargs + args.args
                pairs += zip(
                    [a.arg for a in positional[len(positional) - len(args.defaults) :]], args.defaults, strict=True
                )
                pairs += [(a.arg, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)]
            elif isinstance(node, ast.ClassDef):
                for s in node.body:
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name):
                        value = s.value
                        if isinstance(value, ast.Call):  # a pydantic `Field(default=...)`
                            value = next((k.value for k in value.keywords if k.arg == "default"), None)
                        pairs.append((s.target.id, value))
            elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                name = str(node.args[0].value).lstrip("-").replace("-", "_")
                pairs += [(name, k.value) for k in node.keywords if k.arg == "default"]
            for name, default in pairs:
                if name in TRIM_OPTION_NAMES and isinstance(default, ast.Constant):
                    found.append(f"{path.name}:{default.lineno} {name}")
    return found


def test_trim_option_defaults_are_named_once():
    assert retyped_defaults() == []


def test_the_default_check_can_fail(tmp_path):
    (tmp_path / "a.py").write_text(
        "def f(*, strategy='recent', growth_turns=GROWTH):\n    pass\n"
        "class C:\n    keep_last_turns: int = 1\n    strategy: str = Field(default='recent')\n"
        "parser.add_argument('--low-watermark', type=float, default=0.8)\n"
    )
    assert retyped_defaults(tmp_path) == [
        "a.py:1 strategy",
        "a.py:4 keep_last_turns",
        "a.py:5 strategy",
        "a.py:6 low_watermark",
    ]
