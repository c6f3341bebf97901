"""What a decode step costs on this machine: the measured cost curve of the target and the
drafter (`CostModel`, measured once per model and machine, then cached) and the one
correction of it by what steps really took (`StepTimes`).

Verifying L tokens is not free when compute is the limit (on a CPU, or a big model on a
small Mac): a 16-token target pass can cost several 1-token passes.  The curve times one
row at a short context in isolation (and again at a long one: the anchor of the longer
context classes); a real step attends over contexts of any length, may verify several rows,
syncs, rolls back and breaks the plain-step pipeline, so every step's wall time teaches the
ratio of its shape (rows, width) to the curve.
"""

import json
import math
import platform
import time
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field, fields
from functools import partial
from pathlib import Path
from statistics import median_low
from typing import Callable, Optional, Sequence

import mlx.core as mx

from ..io.progress import add_task, console, progress
from ..io.storage import atomic_write
from ..kernels.metal import chip_name, use_metal
from ..sampling import Noise, SamplingParams, choose

PROBE_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
PROBE_CONTEXT = 128  # the context the curve is timed at
PREFILL_CHUNK = 512  # tokens per pass while the timed caches are filled
LONG_CONTEXT = 2048  # and the second one (its power-of-two widths only): the longer context classes' anchor
SHORTEST_SPAN = 512
SAMPLE_ROWS = 8
FEW_STEPS = 3  # until a shape (a batch size's verifies) has run this often, the curve counts as one of its runs
SAMPLING_PROBES = (SamplingParams(temp=1.0), SamplingParams(temp=1.0, top_p=0.9))  # unfiltered, filtered


@dataclass
class CostModel:
    """Seconds for one target pass over L tokens (interpolated), for one drafter pass
    over a block of L (draft_seconds + draft_per_token * (L - 1): its lm_head runs per
    token), and for one position's sampling distribution (temperature only, or
    filtered by top-p / top-k).  The target's passes are timed on top of `context` tokens
    and, where `long_seconds` were measured, of `long_context` ones too (`context_ratio`)."""

    widths: list[int]
    seconds: list[float]
    draft_seconds: float
    draft_per_token: float = 0.0
    sample_row: float = 0.0
    filtered_row: float = 0.0
    context: int = 0
    long_context: int = 0
    long_widths: list[int] = field(default_factory=list)
    long_seconds: list[float] = field(default_factory=list)

    @classmethod
    def from_dict(cls, stored: dict) -> "CostModel":
        """A stored cost model, checked (a cache file may be truncated, foreign, or of an older
        format: one without the long-context curve is measured again, not read as one)."""
        if not isinstance(stored, dict) or set(stored) != {f.name for f in fields(cls)}:
            raise ValueError("not a cost model of this format")
        cost = cls(**stored)
        numbers = [
            cost.draft_seconds,
            cost.draft_per_token,
            cost.sample_row,
            cost.filtered_row,
            *cost.seconds,
            *cost.long_seconds,
        ]
        if not (
            _curve(cost.widths, cost.seconds)
            and (not cost.long_widths or _curve(cost.long_widths, cost.long_seconds))
            and all(isinstance(n, int) and n >= 0 for n in (cost.context, cost.long_context))
            and (not cost.long_widths or cost.long_context > cost.context)
            and all(isinstance(x, (int, float)) and 0 <= x < 1e4 for x in numbers)
        ):
            raise ValueError("not a cost model")
        return cost

    def verify(self, L: int) -> float:
        return interpolate(self.widths, self.seconds, L)

    def context_ratio(self, tokens: int, span: int) -> float:
        """How much dearer a target pass over `tokens` is in the context class `span` than the
        curve says: 1 in the shortest class (the curve's own) and without a long-context curve;
        else the two curves' ratio, moved linearly in context (attention reads every cached
        token) to the class's middle (its contexts run from span / 2 to span), at least 1."""
        short = self.verify(tokens)
        if not self.long_seconds or span <= SHORTEST_SPAN or short <= 0:
            return 1.0
        long = interpolate(self.long_widths, self.long_seconds, tokens)
        moved = (0.75 * span - self.context) / (self.long_context - self.context)
        return max(1.0, (short + (long - short) * moved) / short)

    def describe(self) -> str:
        shown = [w for w in self.widths if w & (w - 1) == 0]  # powers of two
        long = (
            f" ({'/'.join(f'{1e3 * s:.0f}' for s in self.long_seconds)} ms over {self.long_context} tokens of context)"
            if self.long_seconds
            else ""
        )
        drafter = (
            f"drafter {1e3 * self.draft_seconds:.1f} ms + {1e3 * self.draft_per_token:.2f} ms/token"
            if self.draft_seconds
            else "no drafter"
        )
        return (
            f"verify {'/'.join(map(str, shown))} tokens = "
            f"{'/'.join(f'{1e3 * self.verify(w):.0f}' for w in shown)} ms{long}; {drafter}; "
            f"sampling {1e3 * self.sample_row:.1f} ms/position ({1e3 * self.filtered_row:.1f} with top-p/top-k)"
        )

    def row(self, params: Optional[SamplingParams]) -> float:
        if params is None or params.greedy:
            return 0.0
        return self.filtered_row if params.top_p < 1.0 or params.top_k > 0 else self.sample_row

    def cycle(self, L: int, params: Optional[SamplingParams] = None, drafted: bool = True) -> float:
        """One cycle of width L: verify, and what comes with it (`beside_verify`)."""
        return self.verify(L) + self.beside_verify(L, params, drafted)

    def beside_verify(self, L: int, params: Optional[SamplingParams] = None, drafted: bool = True) -> float:
        """What a cycle of width L costs besides the target pass: a distribution per verified
        position and, when the drafter proposed (`drafted`), its pass and a distribution per
        drafted position."""
        return (self.drafter_pass(L) if drafted and L > 1 else 0.0) + self.sampling(L, params, drafted)

    def drafter_pass(self, L: int, rows: int = 1) -> float:
        """One drafter pass over `rows` blocks of L at once: its weights are read once for all
        rows, its lm_head runs per drafted position."""
        return self.draft_seconds + self.draft_per_token * (L - 1) * rows

    def sampling(self, L: int, params: Optional[SamplingParams] = None, drafted: bool = True) -> float:
        """The distributions of a cycle of width L: one per verified position, and one per
        drafted position when the drafter proposed."""
        return (2 * L - 1 if drafted and L > 1 else L) * self.row(params)


def interpolate(widths: list[int], seconds: list[float], L: int) -> float:
    """A curve's seconds at width L: linear between its probes, extended past its widest."""
    if L <= widths[0] or len(widths) == 1:
        return seconds[0]
    if L > widths[-1]:
        w0, w1, s0, s1 = widths[-2], widths[-1], seconds[-2], seconds[-1]
        return s1 + (s1 - s0) * (L - w1) / (w1 - w0)
    above = bisect_left(widths, L)  # the first probe at or above L (the planner asks for every width: no scan)
    w0, w1, s0, s1 = widths[above - 1], widths[above], seconds[above - 1], seconds[above]
    return s0 + (s1 - s0) * (L - w0) / (w1 - w0)


def _curve(widths, seconds) -> bool:
    """Whether a stored curve is widths (ascending, positive) with a time each."""
    return (
        isinstance(widths, list)
        and isinstance(seconds, list)
        and bool(widths)
        and len(widths) == len(seconds)
        and all(isinstance(w, int) and w > 0 for w in widths)
        and widths == sorted(set(widths))
    )


def context_class(tokens: int) -> int:
    """The class of a step's context (its longest row's tokens): the power of two at or above it, 512 at least."""
    return max(SHORTEST_SPAN, 1 << (max(tokens, 1) - 1).bit_length())


class StepTimes:
    """How much longer a batch step really takes than the cost curve says, per shape (rows, width)
    and class of context (context_class: attention over a long context costs what the curve, timed
    at a short one, does not see; traced: ratios learnt over 2k-token agent sessions kept widths
    4-14 judged 1.4-2x dear on 300-token prompts, whose copies then decoded plainly).

    The curve times one row at a short context and is extrapolated past its widest probe; a
    batch step attends over B contexts of any length and verifies B x w tokens (measured here:
    8 rows x 9 tokens took 2.5x the extrapolated curve, 8 rows x 1 token 1.3x).  Each step's wall
    time teaches the ratio of its shape: the lower median of its last `window` steps (timing
    noise is one-sided: a stall, a collection or another process only ever adds time).  A verify
    is judged by the last steps of every verify of its batch size, whatever their widths (the
    curve says what a width costs, the steps what this machine adds to it): the planner picks the
    best of many widths, so widths judged by their own few steps each are picked when timed lucky
    and left, never timed again, when timed unlucky (traced on the real pair under load: one
    run's width-2 and width-4 verifies at 1.95x and 3.6x the curve; replayed over its recorded
    acceptances with 10-20% timing noise, width 3 judged cheaper than width 2, a prompt whose
    drafts were rejected 4 times in 5 drafting at width 3, its gain over plain 0.95-1.01x from the
    noise alone).  A verify of a batch size with none run takes the ratio of a run shape of as
    many tokens (rows x width), else is interpolated in log tokens between the run shapes around
    it, else takes the nearest one's.
    A plain step (width 1) is judged only by plain steps run, and one of a batch size not run
    yet by the cheapest of them (the curve, ratio 1, until one has): the plain step is the floor
    the batch falls back to, and judged dear before it ran it would never run and never be
    corrected (traced: 8 rows x 1 token never tried, 8 x 2 run instead at 0.7x its tokens/s).

    Shapes are judged only by shapes of their context class; a class not run yet, by the curve
    moved to that context (`by_context(tokens, span)`: the measured cost curve's `context_ratio`;
    1, the curve as timed, without one).
    A shape not run for `forget_after` steps is forgotten (judged by the shapes around it again).
    Until a shape (for a verify, its batch size's verifies) has run `FEW_STEPS` times, the curve
    counts as one of its runs: one step is no judgement of a shape, and the first step of a shape
    in a process pays that process's one-off set-up for it (compiled functions traced; on a machine
    that never ran them, their kernels built).  Traced on a fresh machine: the first verify took 6x
    the curve, every verify was then judged that dear (the only one run), the drafter's probes were
    cut to plain by that judgement, never timed again, and every prompt decoded plain: tau 1.00.

    With a `store` (a file beside the machine's cost curve), what the steps taught is kept every
    `save_every` steps and read back by the next process, so a fresh server does not pay again
    to learn which shapes are dear; it holds for the curve it was learnt against (`basis`).  A
    shape read back is forgotten after the process's first `trust_stored_for` steps unless it
    runs again by then: what was learnt on a busy machine (another job on the cores) would
    otherwise keep the wide verifies it made dear off for the next process's first
    `forget_after` steps (traced: copies verified 2 tokens at a time for a whole prompt)."""

    def __init__(
        self,
        window: int = 15,
        store: Optional[Path] = None,
        basis: Sequence[float] = (),
        save_every: int = 50,
        forget_after: int = 500,
        trust_stored_for: int = 64,
        by_context: Optional[Callable[[int, int], float]] = None,
    ):
        self.window, self.forget_after, self.trust_stored_for = window, forget_after, trust_stored_for
        self.by_context = by_context or (lambda tokens, span: 1.0)
        self.seen: dict[tuple[int, int, int], deque] = {}  # (rows, width, span) -> its last `window` ratios
        self.ratios: dict[tuple[int, int, int], float] = {}
        self.seen_at: dict[tuple[int, int, int], int] = {}  # (rows, width, span) -> the step it last ran at
        # what the planner asks for every width, worked out once per step:
        # (rows, span) -> the pooled verify ratio (None: too few runs to judge without the curve), its runs
        self._verify_ratios: dict[tuple[int, int], tuple[Optional[float], list[float]]] = {}
        self._of_span: dict[int, dict[tuple[int, int], float]] = {}  # span -> (rows, width) -> ratio
        self.steps = 0
        self.store, self.basis, self.save_every = store, list(basis), save_every
        self._unsaved = 0

    @classmethod
    def stored(
        cls,
        store: Path,
        basis: Sequence[float],
        window: int = 15,
        by_context: Optional[Callable[[int, int], float]] = None,
    ) -> "StepTimes":
        """The step times kept in `store` for the curve `basis` (none yet, or for another curve:
        fresh ones, kept there from now on)."""
        times = cls(window, store, basis, by_context=by_context)
        if not store.is_file():
            return times
        try:
            kept = json.loads(store.read_text())
            if kept["basis"] != times.basis:
                return times  # learnt against a curve measured since replaced
            for rows, width, span, ratios in kept["shapes"]:
                if not (
                    all(isinstance(n, int) and n > 0 for n in (rows, width, span))
                    and ratios
                    and all(isinstance(r, (int, float)) and 0 < r < 1e4 for r in ratios)
                ):
                    raise ValueError("not a step time")
                times.seen[rows, width, span] = deque(ratios[-window:], maxlen=window)
                times.ratios[rows, width, span] = times._typical(times.seen[rows, width, span], rows, width, span)
                times.seen_at[rows, width, span] = times.trust_stored_for - times.forget_after
        except (ValueError, TypeError, KeyError, OSError) as e:  # truncated, foreign or from another version
            console.print(
                f"note: the step times in {store} are unreadable ({type(e).__name__}); learning them again",
                style="yellow",
            )
            times.seen, times.ratios, times.seen_at = {}, {}, {}
        return times

    def _typical(self, seen, rows: int, width: int, span: int) -> float:
        """The lower median of a shape's ratios (stalls only add time), the curve's (moved to the
        context class `span`) among them while they are few.  For plain steps, of the means of
        consecutive pairs: a pipelined plain step's pass runs beside the step before, and which of
        the two the wait lands in varies (traced: 2.0 and 0.14 in turn), so one step says little
        and two say what a step costs."""
        seen = list(seen)
        if len(seen) < FEW_STEPS:
            seen.append(self.by_context(rows * width, span))
        elif width == 1:
            seen = [(a + b) / 2 for a, b in zip(seen, seen[1:])]
        return median_low(seen)

    def ratio(self, rows: int, width: int, span: int = SHORTEST_SPAN) -> float:
        pooled = self._verify_ratio(rows, width, span) if width > 1 else None
        if pooled is not None:
            return pooled
        ratios = self._ratios_of_span(span)
        if (rows, width) in ratios:
            return ratios[rows, width]
        if width == 1:
            plain = [ratio for (_, w), ratio in ratios.items() if w == 1]
            return min(plain) if plain else self.by_context(rows, span)
        tokens = rows * width
        run = [(r * w, -abs(r - rows), ratios[r, w]) for r, w in ratios]
        if not run:
            return self.by_context(tokens, span)
        same = [shape for shape in run if shape[0] == tokens]
        if same:
            return max(same)[2]  # the one closest in rows
        below = max((shape for shape in run if shape[0] < tokens), default=None)
        above = min(
            (shape for shape in run if shape[0] > tokens), key=lambda shape: (shape[0], -shape[1]), default=None
        )
        if below is None or above is None:
            return (below or above)[2]
        t = math.log(tokens / below[0]) / math.log(above[0] / below[0])
        return below[2] + t * (above[2] - below[2])

    def _ratios_of_span(self, span: int) -> dict[tuple[int, int], float]:
        """The ratios of the shapes run in the context class `span`, by (rows, width)."""
        if span not in self._of_span:
            self._of_span[span] = {(r, w): ratio for (r, w, s), ratio in self.ratios.items() if s == span}
        return self._of_span[span]

    def _verify_ratio(self, rows: int, width: int, span: int) -> Optional[float]:
        """The lower median of the last ratios of every verify run over `rows` rows in the context
        class `span` (with the curve's at `width` while they are few; None: none run), worked out
        once per step: the planner asks for every width."""
        if (rows, span) not in self._verify_ratios:
            seen = [
                ratio for (r, w, s), last in self.seen.items() if (r, s) == (rows, span) and w > 1 for ratio in last
            ]
            self._verify_ratios[rows, span] = (median_low(seen) if len(seen) >= FEW_STEPS else None, seen)
        judged, seen = self._verify_ratios[rows, span]
        if judged is not None or not seen:
            return judged
        return self._typical(seen, rows, width, span)

    def seconds(self, rows: int, width: int, modelled: float, span: int = SHORTEST_SPAN) -> float:
        return modelled * self.ratio(rows, width, span)

    def observe(self, rows: int, width: int, modelled: float, seconds: float, span: int = SHORTEST_SPAN) -> None:
        shape = (rows, width, span)
        seen = self.seen.setdefault(shape, deque(maxlen=self.window))
        seen.append(max(seconds / modelled, 0.05))  # an injected clock may see a step as free
        self.ratios[shape] = self._typical(seen, rows, width, span)
        self._verify_ratios.clear()
        self._of_span.clear()
        self.steps += 1
        self.seen_at[shape] = self.steps
        # a shape judged dear is not run again, so never corrected: after a while it is forgotten,
        # and judged by the shapes around it again (traced: ratios learnt on a bad day kept every
        # verify wider than 2 off for good)
        for shape in [s for s in self.seen if self.steps - self.seen_at.get(s, 0) > self.forget_after]:
            del self.seen[shape], self.ratios[shape]
            self.seen_at.pop(shape, None)
        self._unsaved += 1
        if self.store is not None and self._unsaved >= self.save_every:
            self.save()

    def flush(self) -> None:
        """Keep what was learnt since the last save (a batch that just emptied calls it)."""
        if self.store is not None and self._unsaved:
            self.save()

    def save(self) -> None:
        self._unsaved = 0
        shapes = [[*shape, list(seen)] for shape, seen in sorted(self.seen.items())]
        try:
            atomic_write(self.store, json.dumps({"basis": self.basis, "shapes": shapes}))
        except OSError as e:
            console.print(
                f"note: could not keep the step times in {self.store} ({e.strerror}); a new process learns them again",
                style="yellow",
            )
            self.store = None


# ---------------------------------------------------------------- measuring the cost curve


def measure_costs(
    target,
    draft,
    context: int = PROBE_CONTEXT,
    widths: Sequence[int] = PROBE_WIDTHS,
    repeats: int = 15,
    long_context: Optional[int] = None,
    widest: Optional[int] = None,
    show_progress: bool = False,
) -> CostModel:
    """Time target passes of width L up to `widest` (by default the drafter's block) on top of
    a `context`-token cache, and one drafter pass (none without a drafter: copies alone
    propose); with `long_context`, also the power-of-two widths on top of a cache that long
    (the anchor of the planner's longer context classes: CostModel.context_ratio).

    Every probe is timed round-robin, `repeats` times, so a burst of other load hits them all
    alike; each is judged by its least disturbed runs (`least_disturbed`), fitted to a
    non-decreasing curve (a wider pass is never cheaper).  The curve is kept for good, so it must
    survive a busy moment: with another process loading one core in bursts (`bench/cost_curve.py
    --busy`), the medians of 5 rounds put some width 2-87% off a quiet machine's shape in six
    measurements (once a 2-token verify priced as every width up to 8), the lower quartiles of 15
    of the same timings 3-4%."""
    widest = widest or (max(draft.block_size, 2) if draft is not None else 1)
    widths = [w for w in widths if w <= widest]
    # powers of four and the widest: the long curve is interpolated between them, and each of
    # its passes reads the whole long cache (the first load times them all)
    long_widths = sorted({w for w in widths if w & (w - 1) == 0 and w.bit_length() % 2 == 1} | {widths[-1]})
    long_widths = long_widths if long_context and long_context > context else []
    layers = draft.target_layer_ids if draft is not None else []
    features, verify_seconds = verify_timer(target, layers, context)
    long_verify_seconds = verify_timer(target, layers, long_context)[1] if long_widths else None
    dcache = None
    draft_widths = sorted({2, draft.block_size}) if draft is not None else []
    if draft is not None:
        dcache = draft.make_cache()
        draft.add_context(features, dcache)

    def draft_seconds(w: int) -> float:
        tic = time.perf_counter()
        mx.eval(draft(mx.full((1, w), draft.mask_token_id, dtype=mx.int32), dcache))
        return time.perf_counter() - tic

    rows = mx.random.normal((SAMPLE_ROWS, target.vocab_size))
    # Each position's noise is drawn once whatever the widths (sampling.Noise keeps it), so a
    # row of a verify costs its choice alone.
    noise = Noise(0, target.vocab_size).at(0, SAMPLE_ROWS)
    mx.eval(rows, noise)

    def row_seconds(params: SamplingParams) -> float:
        tic = time.perf_counter()
        mx.eval(choose(rows, params, noise))
        return (time.perf_counter() - tic) / SAMPLE_ROWS

    times = {w: [] for w in widths}
    long_times = {w: [] for w in long_widths}
    drafts = {w: [] for w in draft_widths}
    sampling = {p: [] for p in SAMPLING_PROBES}
    probes = (
        [(times[w], partial(verify_seconds, w)) for w in widths]
        + [(long_times[w], partial(long_verify_seconds, w)) for w in long_widths]
        + [(drafts[w], partial(draft_seconds, w)) for w in draft_widths]
        + [(sampling[p], partial(row_seconds, p)) for p in SAMPLING_PROBES]
    )
    with progress(show_progress, transient=True) as bar:
        rounds = add_task(bar, "measuring the cost curve", repeats + 1)
        for attempt in range(repeats + 1):  # the first round warms up
            for samples, probe in probes:
                seconds = probe()
                if attempt:
                    samples.append(seconds)
            bar.advance(rounds)
    verify = monotone([least_disturbed(times[w]) for w in widths])
    sample_row, filtered_row = (least_disturbed(sampling[p]) for p in SAMPLING_PROBES)
    long = dict(
        context=context,
        long_context=long_context if long_widths else 0,
        long_widths=long_widths,
        long_seconds=monotone([least_disturbed(long_times[w]) for w in long_widths]),
    )
    if not drafts:
        return CostModel(list(widths), verify, 0.0, 0.0, sample_row, filtered_row, **long)
    short, full = least_disturbed(drafts[draft_widths[0]]), least_disturbed(drafts[draft_widths[-1]])
    per_token = max(0.0, (full - short) / max(1, draft_widths[-1] - 2))
    return CostModel(list(widths), verify, short - per_token, per_token, sample_row, filtered_row, **long)


def least_disturbed(samples: list[float]) -> float:
    """The lower quartile of a probe's timings: other load only ever adds time, so the least
    disturbed runs say what the probe costs, and a quarter of them (not the single luckiest)
    is robust to a lucky one as well."""
    return sorted(samples)[(len(samples) - 1) // 4]


def verify_timer(target, layers: list[int], context: int) -> tuple[mx.array, Callable[[int], float]]:
    """A cache prefilled with `context` tokens: the features of its prompt, and the seconds of a
    target pass of width w on top of it (rolled back after, so every pass sees `context` tokens)."""
    tokens = mx.arange(context, dtype=mx.int32)[None] % target.vocab_size
    cache = target.make_cache()
    parts = []
    for start in range(0, context, PREFILL_CHUNK):  # a long context's scores in chunks, as a prefill's
        end = min(start + PREFILL_CHUNK, context)
        _, part = target(tokens[:, start:end], cache, layers, logits_at=[end - start - 1])
        mx.eval(part, [c.state for c in cache.layers])
        parts.append(part)
    features = None if parts[0] is None else mx.concatenate(parts, axis=1)

    def seconds(w: int) -> float:
        cache.checkpoint()
        tic = time.perf_counter()
        mx.eval(target(mx.zeros((1, w), dtype=mx.int32), cache, layers))
        cache.rollback(0)
        return time.perf_counter() - tic

    return features, seconds


def monotone(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators)."""
    blocks = []  # [mean, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(n)]


def curve_key(pair: str, dtype: mx.Dtype) -> str:
    """The key a measured cost curve is kept under: all it depends on.  The model pair (`pair`:
    its names and its weights' fingerprints), the dtype it computes in, and this machine: the OS
    and the chip (kernels.metal.chip_name: a Mac's brand string, a Linux CPU's model name), the
    MLX version, the device MLX computes on, and whether dflash-mlx's own Metal kernels may run
    (kernels.metal.use_metal)."""
    device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    kernels = "metal-kernels" if use_metal() else "mlx-kernels"
    dtype_name = str(dtype).rsplit(".", 1)[-1]
    return "-".join([pair, dtype_name, platform.system(), chip_name(), f"mlx{mx.__version__}", device, kernels])


def costs_path(key: str, cache_root: Path) -> Path:
    """Where the cost model of `key` (curve_key) is stored."""
    # v11: each probe judged by its least disturbed runs (an older file, maybe shaped by a busy
    # moment, is measured again)
    name = f"{key}-v11".replace("/", "_").replace(" ", "_")
    return cache_root / "costs" / f"{name}.json"


def step_times_path(key: str, cache_root: Path) -> Path:
    """Where the batch step times learnt against that cost model are kept (StepTimes.stored)."""
    path = costs_path(key, cache_root)
    return path.with_name(f"{path.stem}-steps2.json")  # 2: per context class


def cached_costs(key: str, measure, cache_root: Path) -> CostModel:
    """The cost model stored for `key` (curve_key), measured and stored on first use (and again
    when the stored one is unreadable or of an older format)."""
    path = costs_path(key, cache_root)
    if path.is_file():
        try:
            return CostModel.from_dict(json.loads(path.read_text()))
        except (ValueError, TypeError, OSError) as e:  # truncated, foreign or from another version
            console.print(
                f"note: the cost cache {path} is unreadable ({type(e).__name__}); measuring again", style="yellow"
            )
    cost = measure()
    try:
        atomic_write(path, json.dumps(cost.__dict__))
    except OSError as e:
        console.print(
            f"note: could not store the measured costs in {path} ({e.strerror}); they will be measured again next time",
            style="yellow",
        )
    return cost
