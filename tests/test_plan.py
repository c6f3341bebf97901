"""The plan (plan.py): picks each row's source (drafter or prompt lookup) and the step's width
from the cost curve (costs.py), the steps' measured times and acceptance estimates, falls
back to plain decoding when proposing cannot pay, and keeps decoding lossless."""

import copy
import random
from dataclasses import dataclass, field

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from dflash_mlx.decode import costs
from dflash_mlx.decode.costs import CostModel, StepTimes, measure_costs, monotone
from dflash_mlx.decode.decoder import Decoder, decode
from dflash_mlx.decode.learning import Learning
from dflash_mlx.decode.lookup import NO_MATCH, Match
from dflash_mlx.decode.model import DecodeStats, DFlashModel
from dflash_mlx.decode.plan import PLAIN, AcceptanceEstimate, Plan, Planner, copy_prior
from dflash_mlx.decode.request import Request
from dflash_mlx.sampling import SamplingParams
from tiny_models import Clock, Timed, oracle_draft, random_draft, tiny_target


@dataclass
class Row:
    """A request as the planner sees it (plan.Row)."""

    left: int = 1000
    context_length: int = 100
    lookup: Match = NO_MATCH
    suffix: Match = NO_MATCH  # the session-wide store's proposal
    adaptive: bool = True
    block: int = 16
    params: SamplingParams = SamplingParams()
    estimates: dict = field(default_factory=dict)
    since_draft: int = 0
    probe_gap: int = 64
    learnt: int = 0
    copy_widths: dict = field(default_factory=dict)

    def matches(self, limit: int) -> list[Match]:
        return [Match(m.tokens[:limit], m.length, m.source) for m in (self.lookup, self.suffix) if m]

    def forced(self, limit: int) -> list[int]:
        return []


def planner_with(rates, cost, max_width=16, kind="dflash", **kwargs) -> tuple[Planner, Row]:
    planner, row = Planner(cost, max_width, **kwargs), Row(block=max_width)
    planner.start(row)
    # a long history with exactly these conditional acceptance rates
    planner.estimate(row, kind).trials = [1e6] * max_width
    planner.estimate(row, kind).hits = [r * 1e6 for r in rates]
    return planner, row


def best(planner: Planner, row: Row, **changes) -> Plan:
    for name, value in changes.items():
        setattr(row, name, value)
    return planner.plan([row])[0]


def run(planner: Planner, row: Row, plan: Plan, accepted: int, factor: float = 1.0) -> None:
    """The planner learns of one step of `plan` that took `factor` times its modelled time."""
    planner.learn([row], [plan], [accepted], factor * planner.modelled([row], [plan]))


def cpu_like(base=0.1, slope=0.11, draft=0.012):
    widths = [1, 2, 4, 8, 16]
    return CostModel(widths, [base * (1 + slope * (w - 1)) for w in widths], draft)


def test_cost_model_interpolates_and_extrapolates():
    cost = CostModel([1, 2, 4], [1.0, 2.0, 3.0], 0.5)
    assert cost.verify(3) == pytest.approx(2.5)
    assert cost.verify(6) == pytest.approx(4.0)
    assert cost.cycle(1) == pytest.approx(1.0) and cost.cycle(2) == pytest.approx(2.5)
    assert cost.cycle(2, drafted=False) == pytest.approx(2.0)  # a lookup proposal costs no drafter pass
    assert cost.describe().startswith("verify 1/2/4 tokens = 1000/2000/3000 ms; drafter 500.0 ms")


def test_cheap_verification_and_good_drafts_use_the_whole_block():
    flat = CostModel([1, 16], [0.1, 0.1], 0.01)
    assert best(*planner_with([0.9] * 16, flat)) == Plan(16, "dflash")


def test_one_row_matches_brute_force_on_random_profiles():
    rng = random.Random(0)
    for _ in range(200):
        rates = [rng.random() for _ in range(16)]
        widths = [1, 2, 4, 8, 16]
        seconds = sorted(rng.uniform(0.05, 1.0) for _ in widths)
        cost = CostModel(widths, seconds, rng.uniform(0, 0.2))

        def value(L):
            expected, run = 1.0, 1.0
            for a in rates[: L - 1]:
                run *= a
                expected += run
            return expected / cost.cycle(L)

        assert best(*planner_with(rates, cost)).width == max(range(1, 17), key=value)


def test_falls_back_to_plain_decoding_and_explores_now_and_then():
    planner, row = planner_with([0.05] * 16, cpu_like(), explore_every=64, first_probe=8)
    plans = []
    for _ in range(64 * 3):
        plans.append(best(planner, row))
        planner.learn([row], plans[-1:], [0], planner.modelled([row], plans[-1:]))
    # a drafter that does not pay is still tried at width 2: early in a generation, then after
    # twice as many steps each time (one probe is one draw), up to once every 64 steps (the
    # plain step is re-timed every 64 steps too)
    assert [i + 1 for i, p in enumerate(plans) if p != PLAIN] == [8, 24, 56, 120, 184]
    assert {p for p in plans if p != PLAIN} == {Plan(2, "dflash")}
    # a moderately good drafter on the same machine gets a middle width
    assert 2 < best(*planner_with([0.7] * 16, cpu_like())).width < 16
    # the number of tokens left caps the width, explorations included (the server load test
    # once got 9 tokens for max_tokens 8 from a probe of 2 with one token left)
    assert best(*planner_with([0.99] * 16, cpu_like()), left=3).width == 3
    planner, row = planner_with([0.05] * 16, cpu_like(), explore_every=4)
    row.left = 1
    assert all(best(planner, row) == PLAIN for _ in range(50))
    row.since_draft, row.left = 100, 2
    assert best(planner, row) == Plan(2, "dflash")


def test_probes_of_a_batch_share_a_step():
    """Rows due for a probe of the drafter probe together with every row halfway there."""
    planner = Planner(cpu_like(), 16, explore_every=64)
    rows = [Row(since_draft=n) for n in (64, 40, 10)]
    for row in rows:
        planner.estimate(row, "dflash").trials = [1e6] * 16  # a drafter that never pays
    assert [p.width for p in planner.plan(rows)] == [2, 2, 1]
    rows[0].since_draft = 62
    assert planner.plan(rows) == [PLAIN] * 3


def test_evidence_decides_per_generation_from_a_long_run_prior():
    """Each generation starts from what the drafter did so far; within it, the last
    cycles' evidence moves the estimate, and old evidence fades back to the prior."""
    cost = cpu_like()
    planner, row = Planner(cost, 16, prior=0.5), Row()
    planner.start(row)
    for i in range(300):  # a long history of a drafter right 70% of the time at position 1
        run(planner, row, Plan(2, "dflash"), 1 if i % 10 < 7 else 0)
    fresh = Row()
    planner.start(fresh)
    assert best(planner, fresh) == PLAIN  # no plain step for 300 steps: it is timed again first
    run(planner, fresh, PLAIN, 0)
    assert planner.estimate(fresh, "dflash").rates()[0] == pytest.approx(0.7, abs=0.03)
    assert best(planner, fresh).source == "dflash"
    for _ in range(8):  # this prompt: every draft rejected
        run(planner, fresh, Plan(2, "dflash"), 0)
    assert best(planner, fresh, since_draft=0) == PLAIN
    for _ in range(200):  # plain cycles: the evidence fades, the prior says try again
        run(planner, fresh, PLAIN, 0)
    assert best(planner, fresh, since_draft=0).source == "dflash"


def test_prompt_lookup_is_chosen_when_it_pays():
    cost = cpu_like()
    planner, row = planner_with([0.05] * 16, cost)  # a drafter that never pays
    plan = best(planner, row, lookup=Match((7, 8, 9), 3))  # prior 0.5, no drafter pass
    assert plan.source == "lookup" and plan.tokens == (7, 8, 9)[: plan.width - 1] and plan.match == 3
    planner.estimate(row, "lookup3").trials = [1e6] * 16
    planner.estimate(row, "lookup3").hits = [0.01e6] * 16
    assert best(planner, row) == PLAIN  # this text does not repeat what came before
    assert best(planner, row, lookup=Match((7, 8, 9), 4)).source == "lookup"  # longer matches keep their own record
    fluent, row = planner_with([0.99] * 16, cost, kind="lookup2")
    assert best(fluent, row, lookup=Match(tuple(range(30)), 2)) == Plan(16, "lookup", tuple(range(15)), 2)
    assert best(fluent, row, left=5).width == 5
    row.copy_widths["lookup2"] = 4  # a copy of this kind went wrong earlier in this generation
    assert best(fluent, row, left=100) == Plan(4, "lookup", tuple(range(3)), 2)


def test_a_wrong_copy_is_paid_once_and_a_faithful_one_never_held_back():
    """A copy kind's proposals are as wide as its estimate says from the first; once one goes
    wrong they drop to just past the accepted run (a wrong copy is then paid at width 2) and
    double with each copy accepted whole, a shorter one too (the plan may choose narrower than
    the bound for its cost: traced, 40 copies of 4 tokens accepted whole behind a bound of 10)."""
    planner, row = planner_with([0.99] * 16, cpu_like(), kind="lookup3")
    row.lookup = Match(tuple(range(40)), 3)
    widths = []
    for accepted in ("whole", "whole", "none", "none", "whole", "whole", "whole", "2"):
        plan = best(planner, row)
        widths.append(plan.width)
        run(planner, row, plan, {"whole": plan.width - 1, "none": 0, "2": 2}[accepted])
    assert widths == [16, 16, 16, 2, 2, 4, 8, 16]
    assert best(planner, row).width == 4
    row.lookup = Match((1, 2), 3)  # a short copy accepted whole
    run(planner, row, best(planner, row), 2)
    row.lookup = Match(tuple(range(40)), 3)
    assert best(planner, row).width == 8


def test_copies_accepted_whole_widen_past_positions_never_tried():
    """A copy goes wrong where the text was changed, not at a position: its kind has one rate
    for every position.  Copies whose long run failed wide (a first answer that reformatted) and
    that are now accepted whole at width 5 widen to the block within a few steps (per-position
    rates kept positions 6+ at the old long run: traced, 40 whole 5-token copies in a row)."""
    planner, row = planner_with([0.99] * 16, cpu_like(), kind="dflash")
    row.lookup = Match(tuple(range(40)), 8)
    for _ in range(30):  # the long run: wide copies of this kind wrong at their 7th token
        run(planner, row, Plan(16, "lookup", tuple(range(15)), 8), 6)
    planner.start(row)
    row.lookup = Match(tuple(range(40)), 8)
    widths = []
    for _ in range(16):
        plan = Plan(5, "lookup", tuple(range(4)), 8) if len(widths) < 6 else best(planner, row)
        widths.append(plan.width)
        run(planner, row, plan, plan.width - 1)
    assert widths[-1] == 16, widths
    assert planner.estimate(row, "lookup8").pooled and not planner.estimate(row, "dflash").pooled


def test_measured_step_times_correct_the_cost_model():
    """A drafting step that really takes 1.5x what the curve says (a sync, rollback, a broken
    pipeline) stops paying; plain steps slower than modelled make drafting look better."""
    planner, row = planner_with([0.45] * 16, cpu_like())
    assert best(planner, row).width > 1
    for width in range(2, 17):
        for _ in range(7):
            run(planner, row, Plan(width, "dflash"), 1, factor=1.5)
    assert planner.step_times.ratio(1, 4) == pytest.approx(1.5)
    assert best(planner, row) == PLAIN
    planner, row = planner_with([0.15] * 16, cpu_like())
    assert best(planner, row) == PLAIN
    for _ in range(7):
        run(planner, row, PLAIN, 0, factor=1.3)
    assert best(planner, row).width > 1


def test_a_stall_moves_a_shape_only_when_it_lasts():
    """Step times are the lower median of a shape's last 7 steps: one step stalled 100x (a GC
    pause, swapping, a benchmark beside it) changes nothing; a lasting slowdown does."""
    planner, row = planner_with([0.6] * 16, cpu_like())
    plan = best(planner, row)
    assert plan.source == "dflash"
    for factor in (1.0, 1.0, 100.0, 1.0):
        run(planner, row, plan, 2, factor)
    assert best(planner, row) == plan
    for _ in range(7):
        run(planner, row, plan, 2, factor=8.0)
    assert best(planner, row).width < plan.width


def test_sampling_cost_counts_every_verified_and_drafted_position():
    """Top-p sorts the vocabulary once per position (2L-1 positions per cycle of width L):
    a width that pays when greedy may not when sampling."""
    cost = cpu_like()
    cost.filtered_row, cost.sample_row = 0.02, 0.001
    top_p, temp_only = SamplingParams(temp=0.7, top_p=0.95), SamplingParams(temp=0.7)
    assert cost.cycle(4, top_p) == pytest.approx(cost.cycle(4) + 7 * 0.02)
    assert cost.cycle(1, temp_only) == pytest.approx(cost.cycle(1) + 0.001)
    assert cost.cycle(8, SamplingParams()) == cost.cycle(8)
    planner, row = planner_with([0.5] * 16, cost)
    assert best(planner, row).width > 1 and best(planner, row, params=top_p) == PLAIN


def test_acceptance_estimate_learns_conditional_rates():
    true = [0.9, 0.8, 0.5, 0.3] + [0.2] * 4
    estimate = AcceptanceEstimate(8, decay=0.999)
    rng = random.Random(1)
    for _ in range(4000):
        accepted = 0
        while accepted < 7 and rng.random() < true[accepted]:
            accepted += 1
        estimate.age()
        estimate.observe(8, accepted)
    for got, want in zip(estimate.rates()[:4], true[:4]):
        assert got == pytest.approx(want, abs=0.05)


def test_estimates_are_aged_when_read_as_if_after_every_cycle():
    """A cycle ages every kind a row holds (up to 15: the drafter and copies of each match length);
    the planner ages one when it is next read, a cycle at a time: the very figures of ageing every
    kind after every cycle."""
    rng = random.Random(3)
    planner, row = Planner(cpu_like(), 16), Row()
    planner.start(row)
    proposals = [Plan(2, "dflash"), Plan(2, "lookup", (1,), 1), Plan(2, "lookup", (1,), 4), Plan(2, "suffix", (1,), 8)]
    every_cycle = {plan.kind: copy.deepcopy(planner.estimate(row, plan.kind)) for plan in proposals}
    for _ in range(300):
        plan = rng.choice(proposals + [PLAIN])
        plan = Plan(rng.randint(2, 16), plan.source, plan.tokens, plan.match) if plan != PLAIN else plan
        accepted = rng.randint(0, plan.width - 1)
        for estimate in every_cycle.values():
            estimate.age()
        if plan != PLAIN:
            every_cycle[plan.kind].observe(plan.width, accepted)
        run(planner, row, plan, accepted)
        if rng.random() < 0.1:
            kind = rng.choice(list(every_cycle))
            read = planner.estimate(row, kind)
            assert (read.trials, read.hits) == (every_cycle[kind].trials, every_cycle[kind].hits)
    for kind, estimate in every_cycle.items():
        assert planner.estimate(row, kind).rates() == estimate.rates()


def test_adaptive_decoding_is_lossless_and_adapts():
    target = tiny_target("llama", seed=5)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    reference = [int(t) for t, _ in generate_step(mx.array(prompt), target.model, max_tokens=60)]
    cost = cpu_like(base=0.01, draft=0.0012)
    for drafter, wide in [
        (random_draft(target, block_size=16), False),
        (oracle_draft(target, prompt + reference + [0] * 16, block_size=16), True),
    ]:
        clock = Clock(cost)
        model = DFlashModel(Timed(target, clock), drafter)
        decoder = Decoder(model, max_batch=1, clock=clock, learning=Learning(Planner(cost, 16)))
        row = decoder.add(Request(prompt, 40))
        out = []
        while decoder.busy:
            out += [t for step in decoder.step().steps.values() for t in step.tokens]
        assert out == reference[:40]
        if wide:
            assert max(row.stats.widths) >= 8 and row.stats.tau > 4
        else:
            sources = row.stats.sources  # a drafter that never pays is tried less and less
            assert sources[20:].count("dflash") < sources[:20].count("dflash") and sources[-10:].count("dflash") <= 2


class SetUpOnce(Timed):
    """A target whose first verify (a pass over more than one token that is not a prefill) also
    pays a one-off set-up: `factor` times its curve's cost."""

    def __init__(self, target, clock: Clock, factor: float):
        super().__init__(target, clock)
        self.factor, self.set_up = factor, False

    def __call__(self, tokens, *args, **kwargs):
        if not self.set_up and tokens.shape[1] > 1 and kwargs.get("logits_at") is None:
            self.set_up = True
            self.clock.now += self.factor * self.clock.cost.verify(tokens.size)
        return super().__call__(tokens, *args, **kwargs)


def test_a_first_verify_paying_set_up_does_not_stop_drafting():
    """Recorded on a fresh machine: the first verify took 6x the curve (compiled functions built),
    every verify was judged that dear, the probes were cut to plain by that judgement, and every
    prompt decoded plain (tau 1.00).  One step is no judgement of a shape."""
    target = tiny_target("llama", seed=5)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    reference = [int(t) for t, _ in generate_step(mx.array(prompt), target.model, max_tokens=40)]
    cost = cpu_like(base=0.01, draft=0.0012)
    clock = Clock(cost)
    model = DFlashModel(SetUpOnce(target, clock, factor=5.0), oracle_draft(target, prompt + reference + [0] * 16))
    decoder = Decoder(model, max_batch=1, clock=clock, learning=Learning(Planner(cost, 16)))
    row = decoder.add(Request(prompt, 40))
    out = []
    while decoder.busy:
        out += [t for step in decoder.step().steps.values() for t in step.tokens]
    assert out == reference[:40] and model.target.set_up
    assert row.stats.tau > 4


def test_decode_without_a_planner_is_lossless_at_every_fixed_width():
    target = tiny_target("llama", seed=5)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    reference = [int(t) for t, _ in generate_step(mx.array(prompt), target.model, max_tokens=30)]
    drafter = oracle_draft(target, prompt + reference + [0] * 16, block_size=8)
    for block in (1, 3, 8):
        stats = DecodeStats()
        out = [
            t
            for s in decode(
                DFlashModel(target, drafter), Request(list(prompt), 30, SamplingParams(), block_size=block), stats=stats
            )
            for t in s.tokens
        ]
        assert out == reference[:30] and max(stats.widths) == block


def test_measure_costs_gives_a_rising_curve():
    target = tiny_target("qwen3", seed=1, num_hidden_layers=2)
    cost = measure_costs(target, random_draft(target, layer_ids=(0, 1), block_size=16), context=32, repeats=2)
    assert cost.widths[0] == 1 and cost.widths[-1] == 16
    assert all(s > 0 for s in cost.seconds) and cost.draft_per_token >= 0
    assert cost.seconds == sorted(cost.seconds)
    assert cost.cycle(2) > cost.verify(2) and cost.cycle(16) - cost.verify(16) >= (cost.cycle(2) - cost.verify(2)) * (
        1 - 1e-9
    )
    assert cost.filtered_row > 0 and cost.sample_row > 0


class BusyAtFirst(Timed):
    """A target timed by `clock`'s curve, its passes of 4 tokens or more three times as long
    for their first `busy` calls: a burst of other load while the curve is measured."""

    def __init__(self, target, clock: Clock, busy: int):
        super().__init__(target, clock)
        self.busy, self.calls = busy, {}

    def __call__(self, tokens, *args, **kwargs):
        width = tokens.shape[1]
        self.calls[width] = self.calls.get(width, 0) + 1
        if width >= 4 and self.calls[width] <= self.busy:
            self.clock.now += 2 * self.clock.cost.verify(width)
        return super().__call__(tokens, *args, **kwargs)


def test_a_busy_moment_does_not_shape_the_measured_curve(monkeypatch):
    """The curve is measured once and kept: a burst of load over its first rounds (every
    pass of 4+ tokens 3x as long for a third of them) must not make the wide verifies look as
    cheap as the narrow ones (traced: widths 4-16 measured at one price, the medians of 5
    rounds all disturbed)."""
    quiet = CostModel([1, 2, 4, 8, 16], [0.010, 0.012, 0.016, 0.024, 0.040], 0.0)
    clock = Clock(quiet)
    monkeypatch.setattr(costs.time, "perf_counter", clock)
    target = tiny_target("qwen3", seed=1, num_hidden_layers=2)
    draft = random_draft(target, layer_ids=(0, 1), block_size=16)
    busy = BusyAtFirst(target, clock, busy=6)  # the warm-up round and 5 more: a third of 15
    cost = measure_costs(busy, draft, context=32)
    assert cost.seconds == pytest.approx([quiet.verify(w) for w in cost.widths])
    busy.calls.clear()
    assert measure_costs(busy, draft, context=32, repeats=5).seconds[-1] > 2 * quiet.verify(16)  # all 5 disturbed


def test_drafter_cost_grows_with_the_block():
    """A short draft is cheaper than a full one: charging every width the full block's
    drafter cost would hide the narrow widths that pay."""
    per_token = CostModel([1, 16], [1.0, 1.0], draft_seconds=0.05, draft_per_token=0.1)
    flat = CostModel([1, 16], [1.0, 1.0], draft_seconds=0.05 + 0.1 * 15)
    assert best(Planner(per_token, 16, prior=0.5), Row()).width in (2, 3, 4)  # 3: 1.75 tokens / 1.25 s
    assert best(Planner(flat, 16, prior=0.5), Row()) == PLAIN


def test_monotone_fit_removes_noise_spikes():
    assert monotone([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    # a noisy dip at width 12 (measured under load) is pooled with its neighbours, not believed
    fitted = monotone([0.108, 0.102, 0.172, 0.245, 0.300, 0.245, 0.170, 0.267])
    assert fitted == sorted(fitted)
    assert fitted[0] == fitted[1] == (0.108 + 0.102) / 2


def test_step_times_start_from_the_curve():
    assert StepTimes().ratio(1, 4) == 1.0


def test_one_step_is_no_judgement_of_a_shape():
    """Until a shape has run three times the curve counts as one of its runs: a shape's first step
    pays the process's set-up for it (compiled functions traced, on a new machine their kernels
    built), and a fresh machine's first verify, at 6x the curve and the only one run, judged every
    verify that dear."""
    times = StepTimes()
    times.observe(1, 7, modelled=0.1, seconds=0.6)
    assert times.ratio(1, 4) == 1.0 and times.ratio(1, 7) == 1.0
    times.observe(1, 7, modelled=0.1, seconds=0.12)
    assert times.ratio(1, 4) == pytest.approx(1.2)
    for _ in range(2):
        times.observe(2, 7, modelled=0.1, seconds=0.6)  # two steps that dear are a judgement
    assert times.ratio(2, 4) == pytest.approx(6.0)


def test_a_shape_judged_dear_is_forgotten_after_a_while():
    times = StepTimes(forget_after=20)
    for _ in range(2):
        times.observe(1, 8, modelled=0.1, seconds=0.5)  # a bad day: width 8 at 5x the curve
    for _ in range(20):
        times.observe(1, 1, modelled=0.1, seconds=0.1)
    assert times.ratio(1, 8) == pytest.approx(5.0)
    times.observe(1, 1, modelled=0.1, seconds=0.1)
    assert (1, 8) not in times.ratios and times.ratio(1, 8) == pytest.approx(1.0)  # judged by its neighbours


def test_shapes_read_back_are_trusted_for_a_while_only(tmp_path):
    """A shape learnt dear by an earlier process (a busy machine) is forgotten after the new
    process's first `trust_stored_for` steps unless it runs again; one that runs stays."""
    store = tmp_path / "steps.json"
    busy = StepTimes(store=store, basis=[1.0])
    for _ in range(2):
        busy.observe(1, 16, modelled=0.1, seconds=0.5)  # width 16 at 5x the curve
    busy.observe(1, 1, modelled=0.1, seconds=0.3)
    busy.save()
    fresh = StepTimes.stored(store, basis=[1.0])
    assert fresh.ratio(1, 16) == pytest.approx(5.0)
    for _ in range(fresh.trust_stored_for):
        fresh.observe(1, 1, modelled=0.1, seconds=0.1)
    assert fresh.ratio(1, 16) == pytest.approx(5.0)  # within the trusted steps
    fresh.observe(1, 1, modelled=0.1, seconds=0.1)
    assert fresh.ratio(1, 16) == pytest.approx(1.0) and len(fresh.ratios) == 1  # forgotten: judged by the plain step


def test_a_long_agreement_is_copied_wide_from_its_first_try():
    """Before any copy of its kind was tried, a copy is judged by how many tokens its match
    agrees on (Laplace's rule of succession): a 16-token agreement is verified wide from the
    first try, a one-token match narrow, and a kind that then goes wrong loses its width."""
    planner = Planner(cpu_like(), 16)
    row = Row()
    planner.start(row)
    wide = best(planner, row, lookup=Match(tuple(range(40)), 16))
    narrow = best(planner, row, lookup=Match(tuple(range(40)), 1))
    assert wide.source == "lookup" and wide.width >= 8 and narrow.width < wide.width / 2
    for _ in range(3):  # three wide copies of its kind wrong at their first token
        plan = best(planner, row, lookup=Match(tuple(range(40)), 16))
        run(planner, row, plan, 0)
    assert best(planner, row).width <= 2


def test_rows_wanting_different_widths_are_verified_apart_only_where_a_pass_costs_its_tokens():
    """Two rows whose drafts are nearly always right and one whose drafts never are: on a CPU-like
    curve (and a batch that can run a pass over some rows) the good rows verify wide in one pass and
    the other plain in another, the good ones first (consecutive: the batch reorders its rows); on a
    flat curve (a GPU), or a batch that cannot, one pass for all."""

    def rows_and_planner(cost):
        planner, rows = Planner(cost, 16), [Row(), Row(), Row()]
        for row, rate in zip(rows, (0.99, 0.02, 0.99)):
            planner.start(row)
            row.since_draft = 0
            planner.estimate(row, "dflash").trials = [1e6] * 16
            planner.estimate(row, "dflash").hits = [rate * 1e6] * 16
        return planner, rows

    planner, rows = rows_and_planner(cpu_like())
    whole = planner.plan(rows)
    assert len({plan.width for plan in whole}) == 1  # one pass: every row at one width
    (first, wide), (second, narrow) = planner.passes(rows, apart=True)
    assert (first, second) == ([0, 2], [1])
    assert [plan.width for plan in wide] == [16, 16] and narrow == [PLAIN]
    assert planner.passes(rows, apart=False) == [([0, 1, 2], whole)]
    planner, rows = rows_and_planner(CostModel([1, 16], [0.1, 0.1], 0.01))
    assert planner.passes(rows, apart=True) == [([0, 1, 2], planner.plan(rows))]


def test_a_verify_timed_lucky_once_is_judged_with_its_neighbours():
    """The planner picks the best of many widths: one width-3 verify timed at 0.8x the curve
    (noise) must not make width 3 look cheap next to the width-2 verifies timed at the curve, nor
    draft a prompt whose drafts are rejected 85% of the time."""
    planner, row = planner_with([0.15] + [0.9] * 15, cpu_like())
    assert best(planner, row) == PLAIN
    for _ in range(7):
        planner.step_times.observe(1, 2, modelled=1.0, seconds=1.0)
    planner.step_times.observe(1, 3, modelled=1.0, seconds=0.8)
    assert planner.step_times.ratio(1, 3) == pytest.approx(1.0)
    assert best(planner, row) == PLAIN


class BruteForce(Planner):
    """The planner with its search written as the formula in plan.py's docstring, nothing worked
    out once: every width tried, each adaptive row's candidates built afresh at it and the likeliest
    accepted kept, the step judged by its expected committed tokens over its seconds."""

    def _best(self, search, indices, least=1):
        rows = [search.rows[i] for i in indices]
        best, best_value = [search.fixed[i] for i in indices], -1.0
        for width in range(least, self.max_width + 1):
            plans = [
                self.likeliest(row, min(width, search.lefts[i], row.block), search.matches[i], search.drafter)
                if row.adaptive
                else search.fixed[i]
                for i, row in zip(indices, rows)
            ]
            value = sum(self.committed(row, plan) for row, plan in zip(rows, plans)) / self.seconds(rows, plans)
            if value > best_value:
                best, best_value = plans, value
        return best, best_value

    def likeliest(self, row, limit, matches, drafter) -> Plan:
        if limit < 2:
            return PLAIN
        candidates = [Plan(limit, "dflash")] if drafter else []
        for match in filter(None, matches):
            longest = min(len(match.tokens) + 1, limit, row.copy_widths.get(f"{match.source}{match.length}", limit))
            candidates.append(Plan(longest, match.source, match.tokens[: longest - 1], match.length))
        return max(candidates, key=lambda plan: self.committed(row, plan), default=PLAIN)

    def committed(self, row, plan: Plan) -> float:
        return 1.0 if plan.width == 1 else self.estimate(row, plan.kind).expected_committed()[plan.width]


def random_copy(rng: random.Random, source: str) -> Match:
    if rng.random() < 0.4:
        return NO_MATCH
    return Match(tuple(rng.randrange(100) for _ in range(rng.randint(1, 24))), rng.choice((1, 2, 3, 4, 8, 16)), source)


def random_row(rng: random.Random) -> Row:
    return Row(
        left=rng.randint(1, 300),
        context_length=rng.randint(50, 3000),
        lookup=random_copy(rng, "lookup"),
        suffix=random_copy(rng, "suffix"),
        adaptive=rng.random() < 0.9,
        block=rng.choice((16, 16, 4, 1)),
        params=rng.choice((SamplingParams(), SamplingParams(), SamplingParams(temp=0.7, top_p=0.9))),
    )


@pytest.mark.parametrize("seed", range(12))
def test_every_decision_is_the_brute_force_searchs(seed):
    """Over random steps (batches of 1-8 rows, with and without a drafter, passes apart or not,
    random acceptances, copies and step times), every plan and every split into passes is the one
    a search of every width with nothing worked out once makes: what the planner shares between
    widths and between the parts of a batch never changes a decision."""
    rng = random.Random(seed)
    widths = [1, 2, 4, 8, 16]
    short = sorted(rng.uniform(0.02, 0.2) for _ in widths)
    cost = CostModel(
        widths,
        short,
        rng.uniform(0, 0.02),
        rng.uniform(0, 0.002),
        0.001,
        rng.uniform(0, 0.01),
        context=128,
        long_context=2048,
        long_widths=widths,
        long_seconds=[s * rng.uniform(1.0, 1.8) for s in short],
    )
    drafter, apart, count, explore_every = (
        rng.random() < 0.7,
        rng.random() < 0.6,
        rng.randint(1, 8),
        rng.choice((8, 64)),
    )
    planners = [
        kind(cost, 16, StepTimes(by_context=cost.context_ratio), explore_every=explore_every)
        for kind in (Planner, BruteForce)
    ]
    rows = [[random_row(rng) for _ in range(count)]]
    rows.append(copy.deepcopy(rows[0]))
    skill = [rng.random() for _ in range(count)]  # how often each row's proposals are right
    for planner, batch in zip(planners, rows):
        for row in batch:
            planner.start(row)
    for _ in range(30):
        passes = [planner.passes(batch, drafter, apart) for planner, batch in zip(planners, rows)]
        assert passes[0] == passes[1]
        ahead = [planner.plan(batch, drafter, lookahead=1) for planner, batch in zip(planners, rows)]
        assert ahead[0] == ahead[1]
        for indices, plans in passes[0]:
            accepted = []
            for i, plan in zip(indices, plans):
                n = 0
                while n < plan.width - 1 and rng.random() < skill[i]:
                    n += 1
                accepted.append(n)
            factor = rng.uniform(0.7, 1.6)
            for planner, batch in zip(planners, rows):
                part = [batch[i] for i in indices]
                planner.learn(part, plans, accepted, factor * planner.modelled(part, plans))
                for row, n in zip(part, accepted):
                    row.left, row.context_length = row.left - n - 1, row.context_length + n + 1
        for i in range(count):
            new, copies = (
                (random_row(rng) if rows[0][i].left < 1 else None),
                (random_copy(rng, "lookup"), random_copy(rng, "suffix")),
            )
            for planner, batch in zip(planners, rows):
                if new is not None:
                    batch[i] = copy.deepcopy(new)
                    planner.start(batch[i])
                else:
                    batch[i].lookup, batch[i].suffix = copies


def test_a_copy_is_judged_by_its_first_token_apart_from_the_run_after_it():
    """A copy's first token says whether the text repeats there at all, the tokens after it how
    far it does: a kind whose copies are wrong at their first token half the time and accepted
    whole otherwise commits 1.5 tokens at width 2 and 8.5 at width 16, which is what it is
    expected to (one rate for every position, 15 hits in 16 trials: 1.94 and 10.3)."""
    estimate = AcceptanceEstimate(16, prior=copy_prior("lookup8"), pooled=True, decay=1.0)
    for _ in range(200):
        estimate.observe(16, 0)
        estimate.observe(16, 15)
    expected = estimate.expected_committed()
    assert expected[2] == pytest.approx(1.5, abs=0.01)
    assert expected[16] == pytest.approx(8.5, abs=0.1)
