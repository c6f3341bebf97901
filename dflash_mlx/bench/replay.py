"""The planner replayed offline against recorded decodings: for every position of a prompt's
greedy answer, what the drafter would have drafted there at each width and how much of it the
target would have kept, so a planner's choices are judged without decoding again, on the
measured cost curve, with as much timing noise as asked (bench/plan_replay.py records the
default pair's held-out prompts and replays them).

A replayed decoding commits what the recorded one says each plan would have: the drafter's
plan the recorded agreement at its width, a copy of the prompt lookup's the tokens of its copy
that equal the answer's.  Each step is charged the curve's time for its plan (a target pass of
its width, and the drafter's pass when it drafted); the planner learns that time with noise
drawn on top, which only ever adds time, as on a shared machine (a step 1 + |N(0, noise)| times
longer on a log scale, and now and then a stall of half a step again).  The gain is plain
decoding's time over the plan's, both by the curve without noise: what the planner's choices are
worth, apart from the loop's host work and the machine's drift.
"""

import math
import random
from dataclasses import dataclass, field
from typing import Optional

from ..decode.costs import CostModel, StepTimes
from ..decode.lookup import Match, PromptLookup
from ..decode.plan import Plan, Planner, is_copy
from ..sampling import SamplingParams


@dataclass
class Recorded:
    """One prompt's recorded decoding: its answer (plain greedy) and, for each committed count
    c = 1.. (its c-th token the last committed), how many of the drafter's w - 1 tokens drafted
    there agree with the answer (`agreed[c - 1][w]`, w = 2..block) and the drafter's confidence
    in each of them (`confidence[c - 1][w]`, read where the planner cuts a verify)."""

    prompt: list[int]
    answer: list[int]
    agreed: list[dict[int, int]]
    confidence: list[dict[int, list[float]]]


@dataclass
class Cycle:
    """One replayed step: its plan's kind and width, the tokens the planner expected it to commit
    and those it did."""

    kind: str
    width: int
    expected: float
    committed: int


@dataclass
class Replayed:
    """One prompt replayed: its gain over plain decoding (both by the curve) and its steps."""

    gain: float
    cycles: list[Cycle]

    @property
    def tau(self) -> float:
        return sum(c.committed for c in self.cycles) / len(self.cycles)


@dataclass
class ReplayRow:
    """A request as the planner reads it (plan.Row), decoding a recording."""

    adaptive: bool
    block: int
    left: int
    context_length: int
    lookup: Optional[PromptLookup] = None
    params: SamplingParams = field(default_factory=SamplingParams)
    estimates: dict = field(default_factory=dict)
    since_draft: int = 0
    learnt: int = 0
    probe_gap: int = 0
    copy_widths: dict = field(default_factory=dict)

    def matches(self, limit: int) -> list[Match]:
        return [self.lookup.propose(limit)] if self.lookup is not None else []

    def forced(self, limit: int) -> list[int]:
        return []


class Replay:
    """Recorded prompts decoded one after another by one planner (it learns across them, as a
    process's does), each first plain (its plain steps timed too) and then planned."""

    def __init__(self, cost: CostModel, ends: frozenset, block: int, tokens: int, seed: int = 0, noise: float = 0.1):
        self.cost, self.ends, self.block, self.tokens, self.noise = cost, ends, block, tokens, noise
        self.rng = random.Random(seed)
        self.planner = Planner(cost, block, StepTimes(by_context=cost.context_ratio))

    def prompt(self, recorded: Recorded) -> Replayed:
        plain_seconds, _ = self._decode(recorded, adaptive=False)
        seconds, cycles = self._decode(recorded, adaptive=True)
        return Replayed(plain_seconds / seconds, cycles)

    def _decode(self, recorded: Recorded, adaptive: bool) -> tuple[float, list[Cycle]]:
        block = self.block if adaptive else 1
        row = ReplayRow(adaptive, block, self.tokens, len(recorded.prompt))
        if adaptive:
            row.lookup = PromptLookup(recorded.prompt, ends=self.ends)
            row.lookup.extend(recorded.answer[:1])
        self.planner.start(row)
        committed, seconds, cycles = 1, 0.0, []  # the first token is the prefill's
        while committed < self.tokens:
            row.left, row.context_length = self.tokens - committed, len(recorded.prompt) + committed
            plan = self.planner.plan([row], drafter=True)[0]
            confidences = None
            if self.planner.cuts([row], [plan]):
                confidences = [recorded.confidence[committed - 1][plan.width]]
                plan = self.planner.cut([row], [plan], confidences)[0]
            kept = min(self._agreed(recorded, plan, committed), row.left - 1)
            if adaptive:
                expected = (
                    self.planner.estimate(row, plan.kind).expected_committed()[plan.width] if plan.width > 1 else 1
                )
                cycles.append(Cycle(plan.kind, plan.width, expected, kept + 1))
            step = self.planner.modelled([row], [plan])  # a cut verify pays the drafter's pass at its own width
            self.planner.learn([row], [plan], [kept], step * self._noise(), confidences)
            seconds += step
            if row.lookup is not None:
                row.lookup.extend(recorded.answer[committed : committed + kept + 1])
            committed += kept + 1
        return seconds, cycles

    def _agreed(self, recorded: Recorded, plan: Plan, committed: int) -> int:
        """The proposed tokens of `plan` the target would have kept after `committed` tokens."""
        if plan.source == "dflash":
            return min(recorded.agreed[committed - 1][plan.drafter_width], plan.width - 1) if plan.width > 1 else 0
        kept = 0
        for token in plan.tokens:
            if committed + kept >= len(recorded.answer) or token != recorded.answer[committed + kept]:
                break
            kept += 1
        return kept

    def _noise(self) -> float:
        if not self.noise:
            return 1.0
        stall = 1.5 if self.rng.random() < 0.05 else 1.0
        return math.exp(abs(self.rng.gauss(0.0, self.noise))) * stall


def bounds(recorded: Recorded, cost: CostModel, block: int, tokens: int) -> tuple[int, float, float]:
    """What drafting alone could gain on a recording, by the curve: the best fixed width and its
    gain, and the gain of the best width chosen at every step knowing the outcome (a bound no
    planner reaches)."""

    def kept(committed: int, width: int) -> int:
        agreed = recorded.agreed[committed - 1][width] if width > 1 else 0
        return min(agreed, width - 1, tokens - committed - 1)

    plain = (tokens - 1) * cost.cycle(1)
    best = {tokens: 0.0}  # committed -> the least time to the end, knowing every outcome
    for c in range(tokens - 1, 0, -1):
        best[c] = min(cost.cycle(w) + best[c + kept(c, w) + 1] for w in range(1, min(block, tokens - c) + 1))
    fixed = {}
    for width in range(1, block + 1):
        c, seconds = 1, 0.0
        while c < tokens:
            w = min(width, tokens - c)
            seconds, c = seconds + cost.cycle(w), c + kept(c, w) + 1
        fixed[width] = plain / seconds
    widest = max(fixed, key=fixed.get)
    return widest, fixed[widest], plain / best[1]


def cycle_class(kind: str, width: int) -> tuple[str, str]:
    """(proposer, widths) a cycle is reported under: plain, dflash (the drafter; width 1: a verify
    cut to nothing) or copy (any copy's source or kind), and its width's class."""
    widths = next(label for top, label in ((1, "1"), (2, "2"), (4, "3-4"), (8, "5-8"), (1 << 30, "9+")) if width <= top)
    return "copy" if is_copy(kind) else kind, widths


def calibration(replayed: list[Replayed]) -> dict[tuple[str, str], tuple[int, float, float]]:
    """(drafter or copy, widths) -> (cycles, tokens expected per cycle, tokens committed per
    cycle): how well the planner's acceptance estimates foretold what its wider steps committed."""
    groups: dict[tuple[str, str], list[Cycle]] = {}
    for one in replayed:
        for cycle in one.cycles:
            if cycle.width > 1:
                groups.setdefault(cycle_class(cycle.kind, cycle.width), []).append(cycle)
    return {
        key: (
            len(cycles),
            sum(c.expected for c in cycles) / len(cycles),
            sum(c.committed for c in cycles) / len(cycles),
        )
        for key, cycles in sorted(groups.items())
    }
