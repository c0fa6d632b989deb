"""A pause after failures that doubles while they go on: how long a failing or slow service
(the summary endpoint, the embedder) is left alone before it is tried again."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Backoff"]


@dataclass(slots=True)
class Backoff:
    """Failures in a row, and the time (on the caller's clock) before which the service rests.

    Example:
        >>> b = Backoff()
        >>> [b.failed(0.0, 30.0, 100.0) for _ in range(4)], b.resting(99.0)
        ([30.0, 60.0, 100.0, 100.0], True)
    """

    failures: int = 0
    until: float = 0.0

    def failed(self, now: float, first: float, longest: float) -> float:
        """Note a failure at `now`: rest `first` seconds, doubled for each failure in a row
        before it, at most `longest`; how long."""
        self.failures += 1
        pause = min(longest, first * 2 ** min(self.failures - 1, 32))  # (no float overflow)
        self.until = now + pause
        return pause

    def resting(self, now: float) -> bool:
        """Whether `now` is before the end of the pause."""
        return now < self.until

    def succeeded(self) -> None:
        """A call went well: the next failure rests `first` seconds again."""
        self.failures = 0
