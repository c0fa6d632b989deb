"""What the admin reads and gets in the valves form: the window valve's warning about Open WebUI's
built-in tool definitions (issue 31)."""

from __future__ import annotations

import re
from pathlib import Path

from contextwarden.valves import Valves

ROOT = Path(__file__).resolve().parents[1]
# Measured in Open WebUI 0.12.4's browser chats (tests/e2e/README.md): its 30 built-in tools'
# definitions, as the budget counts them, for a plain user and for an admin.
USER_TOOLS, ADMIN_TOOLS = 3_214, 3_923


def test_the_window_valve_says_the_built_in_tools_count_against_it():
    """A 3,000 window sent only the system prompt and the question every turn, and the form gave
    no hint. The description names the tools' size, the smallest window that works with them on,
    and both fixes; the README's row says the same with the exact numbers."""
    text = Valves.model_json_schema()["properties"]["max_context_tokens"]["description"]
    assert "built-in tool definitions count against it" in text
    assert f"about {USER_TOOLS / 1000:.1f}k" in text and f"{ADMIN_TOOLS / 1000:.1f}k an admin's" in text
    # the admin's tools, the default reply reserve and a turn or two of chat: about 6k
    smallest = ADMIN_TOOLS + Valves().reserve_output_tokens + 1_000
    assert f"under about {round(smallest / 1000)}k" in text
    assert "larger window" in text and "Builtin Tools" in text  # Open WebUI's name for the capability
    readme = " ".join((ROOT / "README.md").read_text("utf-8").split())
    row = re.search(r"\| `max_context_tokens` \|[^\n]*?\|([^|]*)\|", readme)
    assert row and f"{USER_TOOLS:,} tokens" in row[1] and f"{ADMIN_TOOLS:,}" in row[1]
    assert f"under about {round(smallest / 1000):,},000" in row[1] and "*Builtin Tools*" in row[1]
