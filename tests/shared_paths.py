"""Where the shared fixtures live, for tests in the main checkout or in a git worktree.

CONTEXTWARDEN_SHARED wins; else `<repo>/../shared` (true for /work/main and /work/wt-*);
else /work/shared.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def shared_dir() -> Path:
    """The shared/ directory holding fixtures/ and notes/."""
    candidates = [os.environ.get("CONTEXTWARDEN_SHARED"), REPO_ROOT / ".." / "shared", "/work/shared"]
    for candidate in candidates:
        if candidate and (Path(candidate) / "fixtures").is_dir():
            return Path(candidate).resolve()
    raise FileNotFoundError(f"shared fixtures not found (tried {candidates}); "
                            "set CONTEXTWARDEN_SHARED to the shared/ directory")


def fixture_path(name: str) -> Path:
    """Path of one file in shared/fixtures."""
    return shared_dir() / "fixtures" / name


def load_fixture(name: str) -> dict:
    """Parsed JSON of one file in shared/fixtures."""
    return json.loads(fixture_path(name).read_text(encoding="utf-8"))
