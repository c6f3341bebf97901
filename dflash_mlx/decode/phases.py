"""Per-phase timers of a decode step, for the loop-overhead benchmark (bench/loop_overhead.py).

Off, a `lap` is one attribute test.  On, it evaluates what the phase built, so the time of
the computation lands in the phase that asked for it, and adds the seconds since the last
lap to that phase: the breakdown of a step is then the graph building and the computing of
each phase, at the price of the evaluations the timers add (a step's own total is measured
with them off)."""

import time
from collections import defaultdict
from contextlib import contextmanager

import mlx.core as mx


class Phases:
    def __init__(self):
        self.on = False
        self.seconds: dict[str, float] = defaultdict(float)
        self.evaluations = 0  # evaluations the loop itself asked for while on
        self._last = 0.0

    def start(self) -> None:
        if self.on:
            self._last = time.perf_counter()

    def lap(self, name: str, *arrays) -> None:
        """The phase `name` ends here (its `arrays` computed first)."""
        if not self.on:
            return
        if arrays:
            mx.eval(*arrays)
        now = time.perf_counter()
        self.seconds[name] += now - self._last
        self._last = now

    def evaluated(self) -> None:
        """The loop evaluates (counted, to say how many evaluations a cycle takes)."""
        if self.on:
            self.evaluations += 1

    @contextmanager
    def timing(self):
        """Timers on for a while, from zero."""
        self.seconds.clear()
        self.on, self.evaluations = True, 0
        try:
            yield self
        finally:
            self.on = False


PHASES = Phases()
