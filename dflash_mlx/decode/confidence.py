"""What a drafted token's confidence says of its acceptance, learnt as the decoder goes.

The drafter's top probability at a position (drafters/model.py: `Drafts.confidence`) foretells
whether the target agrees there: replayed over the held-out chat prompts' decodings, a drafted
token was accepted 10-26% of the time below confidence 0.1 and 98% above 0.9.  But the same
confidence means more on one prompt than on another (below 0.2: 3% on one prompt, 56% on
another) and at a later position than at the first (a draft that started right stays right
more often).  The planner's per-row, per-position rates know the prompt and the position;
the confidence is evidence on top of them, weighed by how often each confidence was seen at
accepted and at refused tokens over everything verified (naive Bayes: the rate's odds times
the likelihood ratio of its token's confidence).
"""

import math
from dataclasses import dataclass, field

BINS = 10  # confidences 0-0.1, .., 0.9-1


@dataclass
class ConfidenceEvidence:
    """Exponentially aged counts of the confidence (by bin) of accepted and of refused drafted
    tokens, and the acceptance rates they correct."""

    decay: float = 0.999
    accepted: list = field(default_factory=lambda: [0.0] * BINS)
    refused: list = field(default_factory=lambda: [0.0] * BINS)

    def shift(self, confidence: float) -> float:
        """log P(confidence | accepted) / P(confidence | refused), each smoothed by one count a
        bin (0 before anything was seen)."""
        b = bin_of(confidence)
        seen_accepted, seen_refused = sum(self.accepted) + BINS, sum(self.refused) + BINS
        return math.log(((self.accepted[b] + 1) / seen_accepted) / ((self.refused[b] + 1) / seen_refused))

    def rates(self, rates: list[float], confidences: list[float]) -> list[float]:
        """Each position's acceptance rate given its drafted token's confidence."""
        return [odds_shifted(rate, self.shift(confidence)) for rate, confidence in zip(rates, confidences)]

    def observe(self, confidences: list[float], accepted: int, tested: int) -> None:
        """A verify that tested the first `tested` drafted tokens and accepted `accepted`."""
        self.accepted = [n * self.decay for n in self.accepted]
        self.refused = [n * self.decay for n in self.refused]
        for k, confidence in enumerate(confidences[:tested]):
            (self.accepted if k < accepted else self.refused)[bin_of(confidence)] += 1


def bin_of(confidence: float) -> int:
    return min(max(int(confidence * BINS), 0), BINS - 1)


def odds_shifted(rate: float, shift: float) -> float:
    """The probability whose log-odds are `rate`'s plus `shift`."""
    rate = min(max(rate, 1e-4), 1 - 1e-4)
    return 1.0 / (1.0 + math.exp(-(math.log(rate / (1 - rate)) + shift)))


def expected_sums(rates: list[float]) -> list[float]:
    """[L] = E[committed | width L] for L = 0 .. len(rates) + 1 ([0] unused), given the
    acceptance rate of each proposed position."""
    run, sums = 1.0, [1.0, 1.0]
    for rate in rates:
        run *= rate
        sums.append(sums[-1] + run)
    return sums
