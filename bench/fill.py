"""How much of the budget a trim fills (issue 15, item 6): fresh cuts with the defaults, with
low_watermark 1.0, and on estimated counts, over generated chats. Prints quartiles of
tokens_after / budget. Run: PYTHONPATH=src:tests python bench/fill.py"""

from __future__ import annotations

import random
import statistics

from contextwarden.core.tokens import TokenCounter
from contextwarden.core.trim import trim_messages

from chatgen import random_chat

MODEL = "gpt-4o"


class Estimating(TokenCounter):
    """A counter whose encodings never load (a fresh worker's estimate)."""

    def _pick(self, model):
        return "estimate", None


def fills(counter: TokenCounter, **options) -> list[float]:
    shares = []
    for seed in range(40):
        rng = random.Random(seed)
        chat = random_chat(rng, rng.choice([60, 200, 700]), system_words=rng.choice([20, 300]))
        for budget in (2_976, 8_000, 32_000):
            result = trim_messages(chat, max_tokens=budget, model=MODEL, token_counter=counter, **options)
            if result.dropped and not result.over_budget:
                shares.append(result.tokens_after / budget)
    return shares


def main() -> None:
    exact = TokenCounter(block=True)
    for name, counter, options in (
        ("defaults (0.8, 2 turns)", exact, {}),
        ("growth_turns=0", exact, {"growth_turns": 0}),
        ("low_watermark=1.0", exact, {"low_watermark": 1.0}),
        ("estimated counts", Estimating(), {}),
    ):
        shares = fills(counter, **options)
        q = statistics.quantiles(shares, n=4)
        print(
            f"{name:<26} n={len(shares):>3}  min {min(shares):.0%}  q1 {q[0]:.0%}  median {q[1]:.0%}  q3 {q[2]:.0%}  "
            f"max {max(shares):.0%}"
        )


if __name__ == "__main__":
    main()
