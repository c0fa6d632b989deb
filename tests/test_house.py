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
    for path in sorted(root.glob("*.py")):
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
