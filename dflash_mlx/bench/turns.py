"""Decodings of one prompt timed in turns, so that a slower stretch of the machine falls on all.

A shared machine's speed drifts by 10-20% over seconds, so two decodings timed one after the
other differ by that much even when they run the same code.  Here they take turns of a few
tokens each.  Each has its own clock, stopped while another runs, which times its decode and
the steps its planner learns from; a turn ends once everything it queued is computed (a plain
decoding queues its next pass), so no work is billed to another's clock.
"""

import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import mlx.core as mx
from mlx_lm.generate import generation_stream

from ..decode.decoder import decode
from ..decode.model import DecodeStats, DFlashModel, Step
from ..decode.request import Request


class TurnClock:
    """perf_counter's seconds, less those spent while stopped (it starts stopped)."""

    def __init__(self):
        self._stopped_at: Optional[float] = time.perf_counter()
        self._stopped = 0.0

    def __call__(self) -> float:
        now = time.perf_counter() if self._stopped_at is None else self._stopped_at
        return now - self._stopped

    def start(self) -> None:
        self._stopped += time.perf_counter() - self._stopped_at
        self._stopped_at = None

    def stop(self) -> None:
        mx.synchronize(generation_stream)  # what this turn queued (decodings run there) is computed on this clock
        self._stopped_at = time.perf_counter()


@dataclass
class Turns:
    """One decoding, advanced a turn at a time."""

    steps: Iterator[Step]
    clock: TurnClock  # the one its decoding is timed by
    stats: DecodeStats
    tokens: list = field(default_factory=list)
    finished: bool = False
    first_at: float = 0.0  # its clock when its first step (the prefill's) was out
    first_tokens: int = 0  # the tokens that step gave
    last_at: float = 0.0  # its clock when its last token was out
    last_turn: int = -1  # the number of the turn it last had

    def begin(self, turn: int) -> None:
        """Its first step, in the turn numbered `turn`: its timing starts after it."""
        self.take(1, turn)
        self.first_at, self.first_tokens = self.last_at, len(self.tokens)

    def take(self, tokens: int, turn: int) -> None:
        """Decode until `tokens` more are out (or the end), in the turn numbered `turn`."""
        self.last_turn = turn
        goal = len(self.tokens) + tokens
        self.clock.start()
        while len(self.tokens) < goal:
            step = next(self.steps, None)
            if step is None:
                self.finished = True
                break
            self.tokens += step.tokens
        self.clock.stop()
        self.last_at = self.clock()

    @property
    def tokens_per_second(self) -> float:
        """After its first step, by its own clock."""
        return (len(self.tokens) - self.first_tokens) / (self.last_at - self.first_at)


def decode_in_turns(
    decodings: list[tuple[DFlashModel, Optional[int]]],
    prompt: list[int],
    max_tokens: int,
    turn: int = 8,
    first: int = 0,
) -> list[Turns]:
    """A greedy decoding of `prompt` for each (model, block size as a Request takes it: 1 plain,
    None the adaptive default) of `decodings`, returned in that order.  Each decodes its first
    token, from `decodings[first]` on round the list; then they take turns of `turn` tokens, the
    one with the fewest tokens out next (of those, the one that waited longest)."""
    sides = []
    for model, block_size in decodings:
        clock, stats = TurnClock(), DecodeStats()
        request = Request(prompt, max_tokens, block_size=block_size)
        sides.append(Turns(decode(model, request, clock=clock, stats=stats), clock, stats))
    turns = 0
    for side in sides[first:] + sides[:first]:
        side.begin(turns)
        turns += 1
    while not all(side.finished for side in sides):
        behind = min((side for side in sides if not side.finished), key=lambda side: (len(side.tokens), side.last_turn))
        behind.take(turn, turns)
        turns += 1
    return sides
