"""A clock that only moves when a test says so, for testing code that times things.

A timing measured on a shared machine varies with its load; what the code *does* with
the times (the median, the shortest sample, the slowest rank, half a round trip) does
not. Put a :class:`FakeClock` where the code reads ``time`` and advance it from the
timed function: every duration is then exact, and a test can assert it to the last bit.
"""

from __future__ import annotations


class FakeClock:
    """Stands in for the ``time`` module of the code under test: ``perf_counter()``
    returns the seconds that :meth:`advance` added up."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
