"""Per-model correction of our token counts, learned from the provider's real prompt tokens.

tiktoken counts are exact for OpenAI models only; Claude, Llama or Qwen tokenizers give other
numbers. After each single-call reply the outlet compares what the request hook counted for
what it sent with the real `prompt_tokens` the backend reported in the stream this worker watched
(never the outlet's own usage: Open WebUI reads it from the saved chat, which its user can
write) and updates a smoothed factor (real / counted):
the mean of the first samples, then an exponential moving average, clamped to
[MIN_CALIBRATION, MAX_CALIBRATION], ignoring tiny prompts, and an outlier moving it as one
CALIBRATION_OUTLIER times off would (never ignored: a factor that only ever heard outliers could
never come back). The filter divides the budget by the factor; counts themselves stay pure
(tokens.py never sees it).

One factor serves every user of a model, so only comparable turns teach it: prompts of text
alone (images, tool definitions, calls and results are counted or billed by other rules), and
its effect on a budget is bounded to [MIN_EFFECT, MAX_EFFECT] and never past the window.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from ..core.conversation import reasoning_text
from ..state.store import Store

__all__ = [
    "Calibration",
    "update_calibration",
    "calibrated_budget",
    "comparable_turn",
    "load_calibration",
    "save_calibration",
    "DEFAULT_CALIBRATION_TTL_SECONDS",
]

DEFAULT_CALIBRATION_TTL_SECONDS = 30 * 86_400
MIN_CALIBRATION = 0.5
MAX_CALIBRATION = 2.0
# How far a factor may move a budget (the learned factor itself is kept as it is): at most a
# third smaller (Claude-family tokenizers count up to ~1.4x o200k, so 1.5 still corrects them),
# at most 25% larger, and never past the window less the reserve (calibrated_budget's ceiling).
MIN_EFFECT, MAX_EFFECT = 0.8, 1.5
CALIBRATION_MIN_PROMPT = 64  # below this, per-message overhead guesses dominate the ratio
CALIBRATION_WARMUP = 5  # plain mean of the first samples, then EMA
CALIBRATION_ALPHA = 0.2
# Once warmed up, a ratio farther off the factor than this (either way) counts as this far off:
# one odd reply moves the factor at most ALPHA x (OUTLIER - 1) = 10%, and a real change (or
# honest replies after a run of odd ones) still brings it back, 10% a reply at least.
CALIBRATION_OUTLIER = 1.5
CALIBRATION_SHOWN = 0.01  # factors within 1% of 1 are not applied or shown
CALIBRATION_KEY_PREFIX = "calibration:"


@dataclass(frozen=True, slots=True)
class Calibration:
    """A model's factor (real tokens / our count) and how many samples made it."""

    factor: float = 1.0
    samples: int = 0

    @property
    def effect(self) -> float:
        """The factor as applied: within [MIN_EFFECT, MAX_EFFECT]; 1 when not active."""
        if self.samples <= 0 or abs(self.factor - 1.0) < CALIBRATION_SHOWN:
            return 1.0
        return min(MAX_EFFECT, max(MIN_EFFECT, self.factor))

    @property
    def active(self) -> bool:
        """True when the factor is far enough from 1 to change a budget."""
        return self.effect != 1.0


def update_calibration(current: Calibration, counted: int, real: int) -> Calibration | None:
    """The calibration after one more sample, or None when the sample is ignored.

    Ignored: prompts under CALIBRATION_MIN_PROMPT tokens and ratios outside the clamp range.
    After the warm-up a ratio more than CALIBRATION_OUTLIER times off the current factor counts
    as that far off (ignoring it left a factor learned from odd replies stuck for good).

    Example:
        >>> update_calibration(Calibration(), 1000, 1250)
        Calibration(factor=1.25, samples=1)
        >>> update_calibration(Calibration(2.0, 20), 1000, 1000)  # 1.0 counts as 2.0 / 1.5
        Calibration(factor=1.866667, samples=21)
    """
    if counted < CALIBRATION_MIN_PROMPT or real <= 0:
        return None
    ratio = real / counted
    if not MIN_CALIBRATION <= ratio <= MAX_CALIBRATION:
        return None
    if current.samples < CALIBRATION_WARMUP:
        factor = (current.factor * current.samples + ratio) / (current.samples + 1)
    else:
        ratio = min(current.factor * CALIBRATION_OUTLIER, max(current.factor / CALIBRATION_OUTLIER, ratio))
        factor = current.factor + CALIBRATION_ALPHA * (ratio - current.factor)
    factor = min(MAX_CALIBRATION, max(MIN_CALIBRATION, factor))
    return Calibration(round(factor, 6), current.samples + 1)


def calibrated_budget(budget: int, calibration: Calibration, *, ceiling: int | None = None) -> int:
    """The budget in our counts that fits `budget` real tokens: budget / effect (floor), at
    most `ceiling` (the window less the reserve: a factor under 1 never grows past it).

    Example:
        >>> calibrated_budget(10_000, Calibration(1.25, 3))
        8000
        >>> calibrated_budget(10_000, Calibration(0.5, 3), ceiling=11_000)
        11000
    """
    if not calibration.active:
        return budget
    calibrated = max(1, int(budget / calibration.effect))
    return calibrated if ceiling is None else min(calibrated, max(budget, ceiling))


def comparable_turn(messages: Sequence[Mapping[str, Any]], body: Mapping[str, Any]) -> bool:
    """True when a sent prompt is text alone, so real / counted measures the tokenizer only:
    no tool definitions in the body, no tool calls or results, no image or other non-text part,
    no replayed reasoning (counted, but a chat template may leave an earlier turn's out)."""
    if body.get("tools") or body.get("functions"):
        return False
    for message in messages:
        if message.get("role") not in _TEXT_ROLES or message.get("tool_calls") or message.get("function_call"):
            return False
        if reasoning_text(message):
            return False
        content = message.get("content")
        if isinstance(content, list) and not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            return False
    return True


_TEXT_ROLES = frozenset({"system", "developer", "user", "assistant"})


def _calibration_key(model: str) -> str:
    return CALIBRATION_KEY_PREFIX + quote(model or "-", safe="")


async def load_calibration(store: Store, model: str) -> Calibration:
    """The stored calibration of a model (a fresh one when none or unreadable)."""
    raw = await store.get(_calibration_key(model))
    if not raw:
        return Calibration()
    try:
        data = json.loads(raw)
        factor, samples = float(data["factor"]), int(data["samples"])
    except (ValueError, TypeError, KeyError):
        return Calibration()
    if not MIN_CALIBRATION <= factor <= MAX_CALIBRATION or samples < 0:
        return Calibration()
    return Calibration(factor, samples)


async def save_calibration(
    store: Store, model: str, calibration: Calibration, *, ttl: int = DEFAULT_CALIBRATION_TTL_SECONDS
) -> None:
    """Store a model's calibration (last writer wins: workers racing lose one sample at most)."""
    payload = json.dumps({"factor": calibration.factor, "samples": calibration.samples})
    await store.set(_calibration_key(model), payload.encode(), ttl=ttl)
