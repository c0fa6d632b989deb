"""The docs hold together: the README's test command is the one `.ci/run` runs, and every
relative link in the docs points at a file of the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "CONTRIBUTING.md", "DESIGN.md", "tests/README.md", "tests/e2e/README.md", "bench/README.md"]


def test_the_readmes_test_command_is_the_one_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text("utf-8").splitlines()
    step = next(i for i, line in enumerate(ci) if line.startswith('step "tests (the README'))
    command = ci[step + 1].strip()
    assert command == ".venv/bin/python -m pytest"
    readme = (ROOT / "README.md").read_text("utf-8")
    try_it = readme[readme.index("## Try it") :].split("```")[1]
    assert command in try_it.splitlines()


@pytest.mark.parametrize("doc", DOCS)
def test_every_relative_link_resolves(doc):
    path = ROOT / doc
    text = path.read_text("utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    missing = [t for t in targets if "://" not in t and not (path.parent / t).exists()]
    assert not missing, missing
