"""Adaptive verify width: pick the block size that commits the most tokens per second.

Verifying L tokens is not free when compute is the limit (on a CPU, or a big
model on a small Mac): a 16-token target pass can cost several 1-token passes.
With the measured cost curve T(L) of the target (plus one drafter pass) and an
online estimate of how often the drafter's k-th token is accepted, each cycle
uses the width L maximising

    E[committed | L] / T(L),   E[committed | L] = 1 + sum_{k<L} prod_{j<=k} a_j

The curve is measured in isolation; a real drafting cycle also syncs, rolls
back and breaks the plain-step pipeline.  So the engine reports each cycle's
wall time and the chooser scales drafting costs by how much more (relative to
plain cycles) they really take than the curve says.

L = 1 is plain decoding.  When it wins, the engine decodes plainly but still
drafts now and then so the estimate can recover; probes that keep failing are
spaced further apart (16, 32, ... up to 128 cycles), as each costs more than a
plain step.  When sampling, every verified and drafted position also costs a
sampling distribution (a sort over the vocabulary for top-p), measured too.
"""

import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Optional, Sequence

import mlx.core as mx

from .io.progress import console
from .sampling import Noise, SamplingParams, choose
from .io.storage import atomic_write

PROBE_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
SAMPLE_ROWS = 8
SAMPLING_PROBES = (SamplingParams(temp=1.0), SamplingParams(temp=1.0, top_p=0.9))  # unfiltered, filtered


@dataclass
class CostModel:
    """Seconds for one target pass over L tokens (interpolated), for one drafter pass
    over a block of L (draft_seconds + draft_per_token * (L - 1): its lm_head runs per
    token), and for one position's sampling distribution (temperature only, or
    filtered by top-p / top-k)."""

    widths: list[int]
    seconds: list[float]
    draft_seconds: float
    draft_per_token: float = 0.0
    sample_row: float = 0.0
    filtered_row: float = 0.0

    @classmethod
    def from_dict(cls, stored: dict) -> "CostModel":
        """A stored cost model, checked (a cache file may be truncated or foreign)."""
        cost = cls(**stored)
        numbers = [cost.draft_seconds, cost.draft_per_token, cost.sample_row, cost.filtered_row, *cost.seconds]
        if not (isinstance(cost.widths, list) and cost.widths and len(cost.widths) == len(cost.seconds)
                and all(isinstance(w, int) and w > 0 for w in cost.widths)
                and all(isinstance(x, (int, float)) and 0 <= x < 1e4 for x in numbers)):
            raise ValueError("not a cost model")
        return cost

    def verify(self, L: int) -> float:
        for (w0, s0), (w1, s1) in zip(zip(self.widths, self.seconds), zip(self.widths[1:], self.seconds[1:])):
            if w0 <= L <= w1:
                return s0 + (s1 - s0) * (L - w0) / (w1 - w0)
        if L <= self.widths[0]:
            return self.seconds[0]
        w0, w1, s0, s1 = self.widths[-2], self.widths[-1], self.seconds[-2], self.seconds[-1]
        return s1 + (s1 - s0) * (L - w1) / (w1 - w0)

    def describe(self) -> str:
        shown = [w for w in self.widths if w & (w - 1) == 0]  # powers of two
        return (f"verify {'/'.join(map(str, shown))} tokens = "
                f"{'/'.join(f'{1e3 * self.verify(w):.0f}' for w in shown)} ms; "
                f"drafter {1e3 * self.draft_seconds:.1f} ms + {1e3 * self.draft_per_token:.2f} ms/token; "
                f"sampling {1e3 * self.sample_row:.1f} ms/position ({1e3 * self.filtered_row:.1f} with top-p/top-k)")

    def row(self, params: Optional[SamplingParams]) -> float:
        if params is None or params.greedy:
            return 0.0
        return self.filtered_row if params.top_p < 1.0 or params.top_k > 0 else self.sample_row

    def cycle(self, L: int, params: Optional[SamplingParams] = None) -> float:
        """One cycle of width L: verify, draft, and a distribution per target and drafter position."""
        drafting = self.draft_seconds + self.draft_per_token * (L - 1) if L > 1 else 0.0
        return self.verify(L) + drafting + (2 * L - 1) * self.row(params)


@dataclass
class AcceptanceEstimate:
    """Per-position conditional acceptance a_k = P(token k accepted | 1..k-1 accepted),
    as exponentially decayed counts.  Each position's prior is the estimate of the
    position before it, so positions not drafted lately inherit what was seen last
    (the width can grow in one step when drafts are being fully accepted)."""

    max_width: int
    prior: float = 0.5
    prior_weight: float = 2.0
    decay: float = 0.98
    trials: list = field(default_factory=list)
    hits: list = field(default_factory=list)

    def __post_init__(self):
        self.trials = self.trials or [0.0] * self.max_width
        self.hits = self.hits or [0.0] * self.max_width

    def rates(self) -> list[float]:
        rates, previous = [], self.prior
        for t, h in zip(self.trials, self.hits):
            previous = (h + previous * self.prior_weight) / (t + self.prior_weight)
            rates.append(previous)
        return rates

    def observe(self, width: int, accepted: int) -> None:
        """A cycle that drafted width-1 tokens and had `accepted` of them accepted."""
        if width < 2:
            return
        self.trials = [t * self.decay for t in self.trials]
        self.hits = [h * self.decay for h in self.hits]
        for k in range(min(accepted + 1, width - 1)):  # positions actually tested
            self.trials[k] += 1
            self.hits[k] += k < accepted

    def expected_committed(self, L: int) -> float:
        total, run = 1.0, 1.0
        for a in self.rates()[: L - 1]:
            run *= a
            total += run
        return total


class WidthChooser:
    def __init__(self, cost: CostModel, max_width: int, probe_every: int = 16, prior: float = 0.5,
                 max_probe_every: int = 128):
        self.cost = cost
        self.max_width = max_width
        self.acceptance = AcceptanceEstimate(max_width, prior=prior)
        self.probe_every = probe_every
        self.max_probe_every = max_probe_every
        self._plain_run = 0
        self._probe_interval = probe_every
        self._time_ratio = {False: 1.0, True: 1.0}  # measured / modelled cycle time: plain, drafting

    @property
    def drafting_penalty(self) -> float:
        """How much costlier drafting cycles really are, relative to plain ones, than modelled."""
        return self._time_ratio[True] / self._time_ratio[False]

    def throughput(self, L: int, params: Optional[SamplingParams] = None) -> float:
        seconds = self.cost.cycle(L, params) * (self.drafting_penalty if L > 1 else 1.0)
        return self.acceptance.expected_committed(L) / seconds

    def best(self, limit: Optional[int] = None, params: Optional[SamplingParams] = None) -> int:
        widths = range(1, min(self.max_width, limit or self.max_width) + 1)
        return max(widths, key=lambda L: self.throughput(L, params))

    def choose(self, limit: Optional[int] = None, params: Optional[SamplingParams] = None) -> int:
        """The width for the next cycle (1 = plain); `limit` caps it (tokens left)."""
        width = self.best(limit, params)
        if width > 1:
            self._plain_run, self._probe_interval = 0, self.probe_every
            return width
        self._plain_run += 1
        if self._plain_run < self._probe_interval or (limit is not None and limit < 2):
            return 1  # not yet, or no room: a probe of 2 would commit past the last token
        # look again, the text may have become predictable; if it has not, wait longer next time
        self._plain_run = 0
        self._probe_interval = min(2 * self._probe_interval, self.max_probe_every)
        return min(self.max_width, limit or self.max_width, 4)

    def observe(self, width: int, accepted: int) -> None:
        self.acceptance.observe(width, accepted)

    def observe_seconds(self, width: int, seconds: float, params: Optional[SamplingParams] = None,
                        weight: float = 0.1) -> None:
        """The wall time of a cycle just run (an exponential average per kind of cycle)."""
        drafting = width > 1
        ratio = seconds / self.cost.cycle(width, params)
        self._time_ratio[drafting] += weight * (ratio - self._time_ratio[drafting])


# ---------------------------------------------------------------- measuring the cost curve


def machine_key() -> str:
    return f"{platform.system()}-{platform.machine()}-{platform.processor() or 'cpu'}-metal{int(mx.metal.is_available())}"


def measure_costs(target, draft, context: int = 128, widths: Sequence[int] = PROBE_WIDTHS,
                  repeats: int = 5) -> CostModel:
    """Time target passes of width L on top of a `context`-token cache, and one drafter pass.

    Widths are timed round-robin, so a burst of other load hits them all alike,
    and the medians are fitted to a non-decreasing curve (a wider pass is never cheaper)."""
    widths = [w for w in widths if w <= max(draft.block_size, 2)] if draft is not None else [1]
    tokens = mx.arange(context, dtype=mx.int32)[None] % target.vocab_size
    layers = draft.target_layer_ids if draft is not None else []
    cache = target.make_cache()
    _, features = target(tokens, cache, layers, logits_for_last_only=True)
    mx.eval(features)
    dcache = None
    draft_widths = sorted({2, draft.block_size}) if draft is not None else []
    if draft is not None:
        dcache = draft.make_cache()
        draft.add_context(features, dcache)

    def verify_seconds(w: int) -> float:
        cache.checkpoint()
        tic = time.perf_counter()
        mx.eval(target(mx.zeros((1, w), dtype=mx.int32), cache, layers))
        cache.rollback(0)
        return time.perf_counter() - tic

    def draft_seconds(w: int) -> float:
        tic = time.perf_counter()
        mx.eval(draft(mx.full((1, w), draft.mask_token_id, dtype=mx.int32), dcache))
        return time.perf_counter() - tic

    rows = mx.random.normal((SAMPLE_ROWS, target.vocab_size))
    mx.eval(rows)
    noise = Noise(0, target.vocab_size)

    def row_seconds(params: SamplingParams) -> float:
        tic = time.perf_counter()
        mx.eval(choose(rows, params, noise.at(0, SAMPLE_ROWS)))
        return (time.perf_counter() - tic) / SAMPLE_ROWS

    times = {w: [] for w in widths}
    drafts = {w: [] for w in draft_widths}
    sampling = {p: [] for p in SAMPLING_PROBES}
    for attempt in range(repeats + 1):  # the first round warms up
        for w in widths:
            seconds = verify_seconds(w)
            if attempt:
                times[w].append(seconds)
        for w in draft_widths:
            seconds = draft_seconds(w)
            if attempt:
                drafts[w].append(seconds)
        for p in SAMPLING_PROBES:
            seconds = row_seconds(p)
            if attempt:
                sampling[p].append(seconds)
    verify = monotone([median(times[w]) for w in widths])
    sample_row, filtered_row = (median(sampling[p]) for p in SAMPLING_PROBES)
    if not drafts:
        return CostModel(list(widths), verify, 0.0, 0.0, sample_row, filtered_row)
    short, full = median(drafts[draft_widths[0]]), median(drafts[draft_widths[-1]])
    per_token = max(0.0, (full - short) / max(1, draft_widths[-1] - 2))
    return CostModel(list(widths), verify, short - per_token, per_token, sample_row, filtered_row)



def monotone(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators)."""
    blocks = []  # [mean, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(n)]


def cached_costs(key: str, measure, cache_root: Path) -> CostModel:
    """The cost model stored for (`key`, this machine), measured and stored on first use."""
    name = f"{key}-{machine_key()}-v4".replace("/", "_").replace(" ", "_")  # v4: sampling = position noise + argmax
    path = cache_root / "costs" / f"{name}.json"
    if path.is_file():
        try:
            return CostModel.from_dict(json.loads(path.read_text()))
        except (ValueError, TypeError, OSError) as e:  # truncated, foreign or from another version
            console.print(f"note: the cost cache {path} is unreadable ({type(e).__name__}); measuring again",
                          style="yellow")
    cost = measure()
    try:
        atomic_write(path, json.dumps(cost.__dict__))
    except OSError as e:
        console.print(f"note: could not store the measured costs in {path} ({e.strerror}); "
                      "they will be measured again next time", style="yellow")
    return cost
