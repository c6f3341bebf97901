"""The plan of each decode step: for every row, what proposes (the drafter, the prompt
lookup, or nothing) and how many tokens the step verifies.

With the cost of a step (costs.py) and an estimate of how often a proposal's k-th token
is accepted, the planner chooses the plans that maximise the tokens the step is expected
to commit per second:

    sum over rows E[committed | L_row] / seconds(rows, L),   E[committed | L] = 1 + sum_{k<L} prod_{j<=k} a_j

where every row is verified at the step's width L (the widest plan's; a narrower plan is
padded with tokens that are never accepted).  One row is the single-stream case: plain
decoding (L = 1), the drafter at L = 2 .. its block, or the prompt lookup's proposal
(lookup.py: no drafter pass) at L = 2 .. its length + 1, judged by the acceptance of
matches of that suffix length (a 1-token match is a weak hint, a 4-token one a strong one),
or the session-wide store's proposal (suffix.py: what earlier answers most often said
next), judged by the acceptance of matches of its length class.  A target without a drafter is
planned the same way, among plain decoding and the copies (up to WIDEST_WITHOUT_DRAFTER
tokens verified).
On a CPU, where a pass is compute-bound, a large batch decodes plain; where the pass cost
is flat in its length (a Mac GPU), drafting pays at small and medium batch sizes.

Acceptance estimates are per row (its generation): each starts from a prior, the long-run
estimate of that kind over everything decoded so far (for a copy, starting from what its match's
agreement says: `copy_prior`), and follows the evidence of its last
cycles (every cycle ages it, so it drifts back to the prior when a kind has not been tried
lately).  The drafter's are per position (its later tokens are guessed from less); a copy's
are two: its first token's (whether the text repeats there at all), then one rate for every
later position (a copy that started right goes wrong where the text was changed, wherever that
falls), so copies accepted whole widen past positions never tried.  (One rate for every
position let a kind's copies accepted whole vouch for its first token: replayed over the
held-out chat prompts' decodings, the first token of an 8- or 16-token match was accepted a
third of the time, its later ones 55-100%.)  A drafter the prior says
never pays is still tried, at width 2, after `first_probe` steps of each generation without it,
then after twice as many each time, up to once every `explore_every` steps (rows due together
probe together): a prompt can be easier than the average, and one probe is one draw (traced: a
prompt whose first drafted tokens were accepted 71% of the time had its first probe rejected,
then decoded plain for 64 steps: tau 1.22, where runs that drafted it made 1.9).  A prompt the
drafter does not suit pays a few probes more (after 8, 16, 32, then every 64 steps).  A prompt
lookup's or the store's proposal is judged by its kind's acceptance estimate, and once a copy of
its kind went wrong in this generation it is never wider than copies of that kind have since
earned (`copy_widths`): cut to just past the accepted run, doubled after each copy accepted
whole.  So a faithful copy is verified at full width from its first cycle, and a run of wrong
copies (a prompt that reformats rather than copies) pays one wide verify per kind, then 2-token
ones.  And a
plain step of a batch size not run for `explore_every` steps is run again, so the figure
it is judged by stays current.
"""

from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Protocol

from .confidence import ConfidenceEvidence, expected_sums
from .costs import CostModel, StepTimes, context_class
from .lookup import MATCH_BUCKETS, Match
from ..sampling import SamplingParams

COPIES = ("lookup", "suffix")  # sources that copy earlier tokens (no drafter pass)
CUT_PAYS = 1.1  # a step's verify must cost this many plain passes before its drafts are read to cut it


@dataclass
class AcceptanceEstimate:
    """Per-position conditional acceptance a_k = P(token k accepted | 1..k-1 accepted),
    as exponentially aged counts on top of a prior (a rate, or one per position).  A
    position with no prior of its own inherits the estimate of the position before
    it, so the width can grow in one step when drafts are being fully accepted."""

    max_width: int
    prior: float | list = 0.5  # one rate, or one per position (None: inherit the position before)
    prior_weight: float = 2.0
    decay: float = 0.98
    trials: list = field(default_factory=list)
    hits: list = field(default_factory=list)
    pooled: bool = False  # a copy's: its first position's rate, then one rate for every later one
    aged: int = 0  # the cycles it has aged through (`age_to`)

    def __post_init__(self):
        self.trials = self.trials or [0.0] * self.max_width
        self.hits = self.hits or [0.0] * self.max_width

    def rates(self) -> list[float]:
        priors = self.prior if isinstance(self.prior, list) else [self.prior]
        if self.pooled:
            # its first token says whether the text repeats here at all; once it does, a copy goes
            # wrong where the text was changed, whatever the position: every later accepted token is
            # evidence for the next (per-position rates never learn positions not yet tried)
            first = (self.hits[0] + priors[0] * self.prior_weight) / (self.trials[0] + self.prior_weight)
            later = priors[1] if len(priors) > 1 and priors[1] is not None else priors[0]
            rest = (sum(self.hits[1:]) + later * self.prior_weight) / (sum(self.trials[1:]) + self.prior_weight)
            return [first] + [rest] * (self.max_width - 1)
        rates, previous = [], priors[0]
        for k, (t, h) in enumerate(zip(self.trials, self.hits)):
            own = priors[k] if k < len(priors) else None
            previous = (h + (previous if own is None else own) * self.prior_weight) / (t + self.prior_weight)
            rates.append(previous)
        return rates

    def informed_rates(self, min_trials: float = 1.0) -> list[Optional[float]]:
        """The first position's rate, then the rates of the positions with evidence behind them
        (None elsewhere): a prior that lets positions never tried inherit the estimate of the
        position before them."""
        rates = self.rates()
        return rates[:1] + [r if t >= min_trials else None for r, t in zip(rates[1:], self.trials[1:])]

    def age(self) -> None:
        """One cycle has passed: older evidence counts for less."""
        self.trials = [t * self.decay for t in self.trials]
        self.hits = [h * self.decay for h in self.hits]

    def age_to(self, cycles: int) -> None:
        """Aged once for every cycle up to the `cycles`-th it has not aged through (one at a time:
        the same figures as ageing after each)."""
        while self.aged < cycles:
            self.age()
            self.aged += 1

    def observe(self, width: int, accepted: int) -> None:
        """A cycle that proposed width-1 tokens and had `accepted` of them accepted."""
        for k in range(min(accepted + 1, width - 1)):  # positions actually tested
            self.trials[k] += 1
            self.hits[k] += k < accepted

    def expected_committed(self) -> list[float]:
        """[L] = E[committed | width L], for L = 0 .. max_width + 1 ([0] unused)."""
        return expected_sums(self.rates())


@dataclass(frozen=True)
class Plan:
    """What one cycle does: verify `width` tokens, the last committed one plus width - 1
    proposed by `source` ("dflash": the drafter; "lookup" or "suffix": copied `tokens`, found
    by a match of `match` tokens, or of that length class; "grammar": `tokens` a grammar
    forces); width 1 is a plain decoding step.  A drafter's plan whose verify was cut by its
    drafted tokens' confidence (`Planner.cut`) keeps the width it `drafted` at."""

    width: int = 1
    source: str = "plain"
    tokens: tuple = ()
    match: int = 0
    drafted: int = 0  # the drafter's width, when the verify was cut narrower (0: its width)

    @property
    def drafter_width(self) -> int:
        """The width of its drafter pass (1: none)."""
        return (self.drafted or self.width) if self.source == "dflash" else 1

    @property
    def kind(self) -> str:
        """Whose acceptance estimate this plan is judged by."""
        return f"{self.source}{self.match}" if self.source in COPIES else self.source


PLAIN = Plan()


def is_copy(kind: str) -> bool:
    return kind.startswith(COPIES)


def copy_prior(kind: str) -> float:
    """What a copy of `kind` is expected to get right before any of its kind was tried: its match
    is n tokens agreeing in a row (n the fewest of its length class), and by Laplace's rule of
    succession the next agrees with probability (n + 1) / (n + 2): 0.67 for a one-token match,
    0.83 for 4, 0.91 for 9-16.  (A flat 0.5 verified even a 16-token agreement 2 tokens at a
    time until its kind had earned more, in every fresh process.)"""
    source = next(source for source in COPIES if kind.startswith(source))
    length = int(kind[len(source) :])  # Plan.kind: the source, then its match's length (class)
    shortest = max((bucket + 1 for bucket in MATCH_BUCKETS if bucket < length), default=length)
    return (shortest + 1) / (shortest + 2)


class Row(Protocol):
    """What the planner reads of a request (request.Row)."""

    adaptive: bool  # its width follows the plan (no fixed block size asked for)
    block: int  # its widest verify
    left: int  # tokens it may still commit
    context_length: int  # tokens its caches hold (prompt + committed)
    params: SamplingParams
    estimates: dict  # kind -> AcceptanceEstimate, this generation's
    since_draft: int  # steps since it last drafted
    learnt: int  # cycles of this generation learnt from (its estimates are aged through them when read)
    probe_gap: int  # steps without drafting before the drafter is tried again
    copy_widths: dict  # copy kind -> the widest verify its next proposal may have

    def matches(self, limit: int) -> list[Match]: ...

    def forced(self, limit: int) -> list[int]: ...


def gap_reached(row: Row, halfway: bool = False) -> bool:
    """Whether this step, the row's (since_draft + 1)-th without drafting, reaches its probe gap
    (or half of it)."""
    return (2 if halfway else 1) * (row.since_draft + 1) >= row.probe_gap


@dataclass
class Planner:
    """Chooses every step's plans (`plan`) and learns from what the steps did (`learn`)."""

    cost: CostModel
    max_width: int
    step_times: StepTimes = field(default_factory=StepTimes)
    prior: float = 0.5
    explore_every: int = 64
    first_probe: int = 8
    apart_gain: float = 1.1  # what two passes must gain over one to be run apart (a cut may reorder the rows)
    long_run_decay: float = 0.999
    long_run: dict = field(default_factory=dict)  # kind -> AcceptanceEstimate over every generation
    steps: int = 0  # steps learnt from
    plain_at: dict = field(default_factory=dict)  # batch size -> the step its plain shape last ran at
    evidence: ConfidenceEvidence = field(default_factory=ConfidenceEvidence)

    def start(self, row: Row) -> None:
        """A new generation: fresh estimates, and an early first probe of the drafter
        (prompts differ more than the long run says)."""
        row.estimates, row.copy_widths = {}, {}
        row.since_draft, row.probe_gap, row.learnt = 0, self.first_probe, 0

    def estimate(self, row: Row, kind: str) -> AcceptanceEstimate:
        """The row's acceptance estimate of `kind` (the long-run rates are its prior), aged through
        the cycles learnt since it was last read: each cycle ages every kind, and a row that copied
        matches of many lengths holds up to 15 kinds, of which a step reads the few on offer."""
        if kind not in row.estimates:
            row.estimates[kind] = AcceptanceEstimate(
                self.max_width, prior=self._long_run(kind).informed_rates(), pooled=is_copy(kind), aged=row.learnt
            )
        estimate = row.estimates[kind]
        estimate.age_to(row.learnt)
        return estimate

    def _long_run(self, kind: str) -> AcceptanceEstimate:
        if kind not in self.long_run:
            prior = copy_prior(kind) if is_copy(kind) else self.prior
            self.long_run[kind] = AcceptanceEstimate(
                self.max_width, prior=prior, decay=self.long_run_decay, pooled=is_copy(kind)
            )
        return self.long_run[kind]

    # ------------------------------------------------------------ planning

    def plan(self, rows: list[Row], drafter: bool = True, lookahead: int = 0) -> list[Plan]:
        """Each row's plan for the next step.  With `lookahead` = 1 the step after that is
        planned before the coming tokens are read (to queue it when it is plain): the rows
        count one token less left, and their copy matches are the current ones."""
        return self._plan(rows, drafter, lookahead)[0]

    def _plan(self, rows: list[Row], drafter: bool, lookahead: int = 0) -> tuple[list[Plan], Optional["Search"]]:
        """plan()'s plans, and its search when it searched (None when it chose without one: no
        adaptive row, or a plain step re-timed)."""
        lefts = [row.left - lookahead for row in rows]
        fixed = [fixed_plan(row.block, left) for row, left in zip(rows, lefts)]
        if not any(row.adaptive for row in rows):
            return fixed, None
        least = max((plan.width for row, plan in zip(rows, fixed) if not row.adaptive), default=1)
        if least == 1 and self.steps - self.plain_at.get(len(rows), 0) >= self.explore_every:
            return [PLAIN] * len(rows), None  # re-time the plain step: its figure may be old, or one bad step
        search = Search(self, rows, lefts, drafter)
        best, _ = self._best(search, list(range(len(rows))), least)
        return self._probes(rows, lefts, best, drafter), search

    def _best(self, search: "Search", indices: list[int], least: int = 1) -> tuple[list[Plan], float]:
        """The plans of the search's rows `indices` at the width that commits most per second,
        and that figure."""
        rows, options = [search.rows[i] for i in indices], [search.options[i] for i in indices]
        context, widest = span(rows), max(len(row_options) for row_options in options) - 1
        best, best_value = [search.fixed[i] for i in indices], -1.0
        # past the widest any row may verify, every width's plans are that width's: never better
        for width in range(least, min(self.max_width, max(least, widest)) + 1):
            chosen = [row_options[min(width, len(row_options) - 1)] for row_options in options]
            plans = [option.plan for option in chosen]
            modelled = self._modelled(plans, [option.sampling for option in chosen])
            seconds = self.step_times.seconds(len(rows), max(plan.width for plan in plans), modelled, context)
            value = sum(option.committed for option in chosen) / seconds
            if value > best_value:
                best, best_value = plans, value
        return best, best_value

    def passes(self, rows: list[Row], drafter: bool = True, apart: bool = False) -> list[tuple[list[int], list[Plan]]]:
        """The next step as target passes: each pass's rows (indices into `rows`) and their plans.

        One pass verifies every row at its widest plan's width.  Where a pass costs what its
        tokens do (a CPU) and the rows want different widths (one copying long runs, another whose
        drafts are short), that width is wasted on the narrow rows: with `apart` (the batch can
        run a pass over some rows alone), the rows ordered by the width each would verify alone
        are cut in two, each part verified at its own width in a pass of its own, when that is
        expected to commit `apart_gain` times the tokens per second (a cut may reorder the batch's
        rows, a copy of their caches).  Where a pass's cost hardly grows with its rows (a GPU),
        two passes never pay, and are not weighed."""
        plans, search = self._plan(rows, drafter)
        whole = [(list(range(len(rows))), plans)]
        width = max(plan.width for plan in plans)
        if not apart or len(rows) < 2 or width == 1 or search is None or not all(row.adaptive for row in rows):
            return whole
        one_pass, context = self.seconds(rows, plans), span(rows)
        cheapest = sum(self.step_times.seconds(1, w, self.cost.verify(w), context) for w in (width, 1))
        if cheapest >= one_pass:  # the cheapest two passes (a row at this width, one plain) cost more
            return whole

        def best(indices: list[int]) -> tuple[list[Plan], float, float]:
            """The part's plans, the tokens they are expected to commit and their seconds."""
            part = [rows[i] for i in indices]
            plans, _ = self._best(search, indices)
            plans = self._probes(part, [search.lefts[i] for i in indices], plans, drafter)
            return plans, sum(search.committed(row, plan) for row, plan in zip(part, plans)), self.seconds(part, plans)

        by_width = sorted(range(len(rows)), key=lambda i: -best([i])[0][0].width)  # each planned alone
        value = sum(search.committed(row, plan) for row, plan in zip(rows, plans)) / one_pass
        chosen = whole
        for cut in range(1, len(rows)):
            first, second = sorted(by_width[:cut]), sorted(by_width[cut:])
            (plans1, tokens1, seconds1), (plans2, tokens2, seconds2) = best(first), best(second)
            drafting = any(plan.width > 1 for plan in plans1 + plans2)
            if drafting and (tokens1 + tokens2) / (seconds1 + seconds2) > self.apart_gain * value:
                chosen, value = [(first, plans1), (second, plans2)], (tokens1 + tokens2) / (seconds1 + seconds2)
        return chosen

    def _probes(self, rows: list[Row], lefts: list[int], plans: list[Plan], drafter: bool) -> list[Plan]:
        """Rows whose drafter has not run for their `probe_gap` steps draft at width 2 (with
        them, every row halfway there: probes of one batch share a step)."""

        def due(row, left, plan, halfway=False):
            return row.adaptive and plan == PLAIN and left >= 2 and gap_reached(row, halfway)

        if not drafter or not any(due(*args) for args in zip(rows, lefts, plans)):
            return plans
        return [Plan(2, "dflash") if due(*args, halfway=True) else args[2] for args in zip(rows, lefts, plans)]

    # ------------------------------------------------------------ cutting a drafted verify

    def cuts(self, rows: list[Row], plans: list[Plan]) -> bool:
        """Whether the step's drafted tokens are worth reading before its verify is built, to cut
        it (`cut`): an adaptive row drafts, and the curve charges the step's verify at its width
        at least `CUT_PAYS` times one at width 1 (where a pass costs about the same at any width,
        a Mac GPU's, the read would only idle it while the verify is built)."""
        width, n = max(plan.width for plan in plans), len(plans)
        drafting = any(row.adaptive and plan.source == "dflash" and plan.width > 1 for row, plan in zip(rows, plans))
        return drafting and self.cost.verify(n * width) >= CUT_PAYS * self.cost.verify(n)

    def cut(self, rows: list[Row], plans: list[Plan], confidences: list[Optional[list[float]]]) -> list[Plan]:
        """The plans with each adaptive drafting row's verify cut to the width at which the step is
        expected to commit most per second, now that its drafted tokens' confidences are known
        (`confidences`: each row's, None where it did not draft): the row's own rates, corrected
        by them (confidence.py).  The drafter's pass is paid whatever the width; the drafting
        rows are cut to one width at most (a narrower one would still pay the step's)."""
        sums = [
            expected_sums(self.evidence.rates(self.estimate(row, "dflash").rates()[: plan.width - 1], confidence))
            if confidence is not None and row.adaptive and plan.source == "dflash" and plan.width > 1
            else None
            for row, plan, confidence in zip(rows, plans, confidences)
        ]
        others = sum(self.committed(row, plan) for row, plan, row_sums in zip(rows, plans, sums) if row_sums is None)
        best, best_value = plans, -1.0
        for width in range(max(plan.width for plan in plans), 0, -1):  # on a tie, the wider
            cut = [plan if row_sums is None else cut_to(plan, width) for plan, row_sums in zip(plans, sums)]
            committed = others + sum(row_sums[c.width] for c, row_sums in zip(cut, sums) if row_sums is not None)
            value = committed / self.seconds(rows, cut)
            if value > best_value:
                best, best_value = cut, value
        return best

    def committed(self, row: Row, plan: Plan) -> float:
        """E[committed] of the row's `plan` (a grammar's forced tokens are all accepted)."""
        if plan.width == 1 or plan.source == "grammar":
            return float(plan.width)
        return self.estimate(row, plan.kind).expected_committed()[plan.width]

    def modelled(self, rows: list[Row], plans: list[Plan]) -> float:
        """One step's time by the cost curve: a target pass over every row at the widest plan's
        width, one drafter pass per width the drafting rows draft at, and each row's sampling
        distributions."""
        return self._modelled(plans, [self.sampling(row, plan) for row, plan in zip(rows, plans)])

    def _modelled(self, plans: list[Plan], sampling: list[float]) -> float:
        """modelled(), given each row's sampling seconds."""
        cost, width = self.cost, max(plan.width for plan in plans)
        drafting: dict[int, int] = {}
        for plan in plans:
            if plan.drafter_width > 1:
                drafting[plan.drafter_width] = drafting.get(plan.drafter_width, 0) + 1
        return (
            cost.verify(len(plans) * width) + sum(cost.drafter_pass(w, n) for w, n in drafting.items()) + sum(sampling)
        )

    def sampling(self, row: Row, plan: Plan) -> float:
        """The seconds of the row's sampling distributions in a step of `plan`."""
        return self.cost.sampling(plan.width, row.params, drafted=plan.source == "dflash")

    def seconds(self, rows: list[Row], plans: list[Plan]) -> float:
        """The expected wall time of a step: the curve, scaled by what steps of its shape took."""
        width = max(plan.width for plan in plans)
        return self.step_times.seconds(len(rows), width, self.modelled(rows, plans), span(rows))

    # ------------------------------------------------------------ learning

    def learn(
        self,
        rows: list[Row],
        plans: list[Plan],
        accepted: list[int],
        seconds: float,
        confidences: Optional[list[Optional[list[float]]]] = None,
    ) -> None:
        """A step just run: each adaptive row's acceptance (where it proposed, and what its drafted
        tokens' `confidences` said, where they were read), and its time."""
        for row, plan, n, confidence in zip(rows, plans, accepted, confidences or [None] * len(rows)):
            if plan.source == "dflash":
                if gap_reached(row, halfway=True):  # tried again after a stretch without it
                    row.probe_gap = min(self.explore_every, 2 * row.probe_gap)
                row.since_draft = 0
            else:
                row.since_draft += 1
            if not row.adaptive:
                continue
            row.learnt += 1  # every estimate ages (when next read: estimate())
            if plan.source in COPIES:
                # once a copy of its kind went wrong, a copy's width follows what copies of its kind
                # just did: cut to just past the accepted run (a wrong copy -> 2), doubled after each
                # copy accepted whole
                if n < plan.width - 1:
                    row.copy_widths[plan.kind] = n + 2
                elif plan.kind in row.copy_widths:  # the cap doubles, even when the plan chose narrower
                    row.copy_widths[plan.kind] = min(self.max_width, 2 * row.copy_widths[plan.kind])
            if plan.width > 1 and plan.source != "grammar":  # forced tokens are certain: nothing to learn
                self.estimate(row, plan.kind).observe(plan.width, n)
                long_run = self._long_run(plan.kind)
                long_run.age()
                long_run.observe(plan.width, n)
                if confidence is not None:
                    self.evidence.observe(confidence, n, min(n + 1, plan.width - 1))
        width = max(plan.width for plan in plans)
        self.step_times.observe(len(rows), width, self.modelled(rows, plans), seconds, span(rows))
        self.steps += 1
        if width == 1:
            self.plain_at[len(rows)] = self.steps


class Option(NamedTuple):
    """A row's plan at one width of a step's search, and what it is judged by."""

    plan: Plan
    committed: float  # the tokens it is expected to commit
    sampling: float  # the seconds of its sampling distributions


class Search:
    """One step's search for its rows' plans, and what every width it tries (and every part of the
    batch `Planner.passes` weighs) shares, worked out once: each row's options, its plan at each
    width with what that plan is judged by, and the E[committed | width] of each row's kinds."""

    def __init__(self, planner: Planner, rows: list[Row], lefts: list[int], drafter: bool):
        self.planner, self.rows, self.lefts, self.drafter = planner, rows, lefts, drafter
        self.fixed = [fixed_plan(row.block, left) for row, left in zip(rows, lefts)]
        self.matches = [
            row.matches(min(planner.max_width, left) - 1) if row.adaptive else [] for row, left in zip(rows, lefts)
        ]
        self._sums: dict[tuple[int, str], list[float]] = {}  # (row, kind) -> E[committed | width] for every width
        self.options = [self._options(i) for i in range(len(rows))]

    def committed(self, row: Row, plan: Plan) -> float:
        """E[committed] of the row's `plan`."""
        return 1.0 if plan.width == 1 else self._expected(row, plan.kind)[plan.width]

    def _expected(self, row: Row, kind: str) -> list[float]:
        if (id(row), kind) not in self._sums:
            self._sums[id(row), kind] = self.planner.estimate(row, kind).expected_committed()
        return self._sums[id(row), kind]

    def _options(self, i: int) -> list[Option]:
        """Row i's option at each width from 0 to the widest it may verify (a wider width's is the
        widest's): its likeliest-accepted proposal of at most that many tokens verified, or its
        fixed plan at every width when it is not adaptive."""
        row, left = self.rows[i], self.lefts[i]
        if not row.adaptive:
            return [self._option(row, self.fixed[i])]
        widest = min(left, row.block, self.planner.max_width)
        proposals = [Plan(widest, "dflash")] if self.drafter else []
        for match in filter(None, self.matches[i]):
            kind = f"{match.source}{match.length}"
            longest = min(len(match.tokens) + 1, widest, row.copy_widths.get(kind, widest))
            proposals.append(Plan(longest, match.source, match.tokens[: longest - 1], match.length))
        options = [self._option(row, PLAIN)] * 2
        if not proposals or widest < 2:
            return options
        judged = [(plan, self._expected(row, plan.kind)) for plan in proposals]  # with E[committed | width]
        for limit in range(2, widest + 1):
            # the likeliest accepted at most `limit` wide (on a tie, the first: the drafter, then the copies)
            likeliest, expected = max(judged, key=lambda candidate: candidate[1][min(candidate[0].width, limit)])
            plan = narrowed(likeliest, limit)
            options.append(Option(plan, expected[plan.width], self.planner.sampling(row, plan)))
        return options

    def _option(self, row: Row, plan: Plan) -> Option:
        return Option(plan, self.committed(row, plan), self.planner.sampling(row, plan))


def cut_to(plan: Plan, width: int) -> Plan:
    """A drafter's `plan` verifying at most `width` of the tokens it drafted (1: none)."""
    return plan if plan.width <= width else Plan(width, "dflash", drafted=plan.drafter_width)


def narrowed(plan: Plan, width: int) -> Plan:
    """`plan` verifying at most `width` tokens."""
    return plan if plan.width <= width else Plan(width, plan.source, plan.tokens[: width - 1], plan.match)


def span(rows: list[Row]) -> int:
    """The context class of a step over `rows` (a batch attends over its longest row's length)."""
    return context_class(max(row.context_length for row in rows))


# The widest verify of copied or forced tokens without a drafter (with one: its block, the widest
# measured).  A copy's acceptance is pooled over its later positions (AcceptanceEstimate.pooled), so a
# faithful copy goes this wide from its first cycles where the cost curve says it pays.
WIDEST_WITHOUT_DRAFTER = 16


def with_forced(rows: list[Row], plans: list[Plan]) -> list[Plan]:
    """The plans with each row whose grammar forces its next tokens verifying those instead
    (every one is accepted: the mask leaves nothing else), plus the target's next choice, where
    they are at least as wide as its plan (a drafter that would run on past a short forced
    stretch keeps its plan: it proposes those tokens too)."""
    out = []
    for row, plan in zip(rows, plans):
        forced = row.forced(min(row.block if row.block > 1 else WIDEST_WITHOUT_DRAFTER, row.left) - 1)
        out.append(
            Plan(len(forced) + 1, "grammar", tuple(forced)) if len(forced) + 1 >= plan.width > 0 and forced else plan
        )
    return out


def fixed_plan(block: int, left: int) -> Plan:
    """A row's plan without a planner: the drafter at its block size (cut to what is left)."""
    width = min(block, left)
    return Plan(width, "dflash") if width > 1 else PLAIN


def step_passes(
    planner: Optional[Planner], rows: list[Row], drafting: bool, splittable: bool
) -> tuple[list[int], list[tuple[int, list[Plan]]]]:
    """A step's target passes over `rows`: the order the rows take (their indices) and, in that
    order, each pass as (its first row, its rows' plans).  One pass, or (a planner's choice, on
    a batch that can run a pass over some rows alone) two over consecutive rows."""
    if planner is None:
        return list(range(len(rows))), [(0, with_forced(rows, [fixed_plan(row.block, row.left) for row in rows]))]
    passes = planner.passes(rows, drafting, apart=len(rows) > 1 and splittable)
    passes = sorted((indices, with_forced([rows[i] for i in indices], plans)) for indices, plans in passes)
    starts = [0]
    for indices, _ in passes[:-1]:
        starts.append(starts[-1] + len(indices))
    return [i for indices, _ in passes for i in indices], [(start, plans) for start, (_, plans) in zip(starts, passes)]
