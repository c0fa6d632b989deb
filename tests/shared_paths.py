"""Where the test fixtures live: `tests/fixtures/`, copied into the repository.

The fixtures are real OpenRouter `/api/v1/models` responses (see `tests/fixtures/SOURCE.md` for
where each came from), so a clone anywhere can run the pricing tests without `../shared`.
"""

from __future__ import annotations

import json
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES = REPO_ROOT / "tests" / "fixtures"


def fixture_path(name: str) -> Path:
    """Path of one file in tests/fixtures."""
    return FIXTURES / name


def load_fixture(name: str) -> dict:
    """Parsed JSON of one file in tests/fixtures."""
    return json.loads(fixture_path(name).read_text(encoding="utf-8"))
