"""Status lines: what they say matches the numbers, and never contradicts itself."""

from __future__ import annotations

import pytest

from contextwarden.flags import Flags
from contextwarden.savings import Savings
from contextwarden.status import TurnChoice, shadow_status_line, status_line

from test_filter import make_filter
from turns import run_turn


def lines(choice: TurnChoice) -> list[str]:
    return [status_line(choice, Flags()), shadow_status_line(choice, Flags(), Savings(0, 0, None), True)]


@pytest.mark.parametrize(("tokens", "over"), [(900, True), (900, False), (400, True)])
def test_an_untouched_chat_over_its_budget_never_fits(tokens, over):
    # Before: "Context 3 messages · 900 tokens (fits 500) · still over budget".
    choice = TurnChoice([{}] * 3, 3, tokens, tokens, 500, "exact", over_budget=over)
    for line in lines(choice):
        assert "fits" not in line and "(budget 500)" in line and line.endswith("· still over budget"), line


def test_an_untouched_chat_within_its_budget_fits():
    for line in lines(TurnChoice([{}] * 3, 3, 400, 400, 500, "exact")):
        assert "(fits 500)" in line and "over budget" not in line, line


async def test_a_mandatory_part_over_the_budget_is_told_once(counter):
    # The current question holds an image (765 tokens, never cut) over a 100-token budget.
    f = make_filter(counter, max_context_tokens=100, reserve_output_tokens=0)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    run = await run_turn(f, [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}])
    context = [s for s in run.events.statuses if s.startswith("Context")]
    assert len(context) == 2  # inlet and request
    for line in context:
        assert line.count("over budget") == 1 and "fits" not in line, line
