"""A drafted verify cut by its drafts' confidence (confidence.py, Planner.cuts / Planner.cut): the
evidence it learns, the width it cuts to, where it is not worth reading the drafts for."""

import pytest

from dflash_mlx.decode.confidence import ConfidenceEvidence
from dflash_mlx.decode.plan import PLAIN, Plan, Planner
from dflash_mlx.sampling import SamplingParams
from test_plan import Row, cpu_like, planner_with


def trained(evidence: ConfidenceEvidence, cycles: int = 200) -> ConfidenceEvidence:
    """Evidence of drafts whose confident tokens (0.95) were accepted and whose doubtful ones
    (0.15) refused, 4 in 5 times."""
    for i in range(cycles):
        evidence.observe([0.95, 0.95, 0.15], accepted=2 if i % 5 else 3, tested=3)
    return evidence


def test_a_rate_moves_by_the_odds_its_tokens_confidence_was_seen_at():
    evidence = ConfidenceEvidence()
    assert evidence.rates([0.6, 0.3], [0.95, 0.15]) == pytest.approx([0.6, 0.3])  # nothing seen: no shift
    trained(evidence)
    confident, doubtful = evidence.rates([0.6, 0.6], [0.95, 0.15])
    assert confident > 0.95 and doubtful < 0.35
    # a prompt whose drafts are accepted more often keeps more of its doubtful tokens: the row's rate counts
    assert evidence.rates([0.9], [0.15])[0] > doubtful + 0.2


def test_a_drafted_verify_is_cut_where_its_confidence_falls():
    planner, row = planner_with([0.7] * 16, cpu_like(slope=0.11), max_width=8)
    trained(planner.evidence)
    drafted = Plan(8, "dflash")
    assert planner.cut([row], [drafted], [[0.95] * 7]) == [drafted]
    assert planner.cut([row], [drafted], [[0.95, 0.95, 0.95, 0.15, 0.15, 0.15, 0.15]]) == [Plan(4, "dflash", drafted=8)]
    assert planner.cut([row], [drafted], [[0.15] * 7]) == [Plan(2, "dflash", drafted=8)]  # 1 in 5 pays at 2
    doubtful, row = planner_with([0.3] * 16, cpu_like(slope=0.11), max_width=8)  # a prompt it does not suit
    doubtful.evidence = planner.evidence
    assert doubtful.cut([row], [drafted], [[0.15] * 7]) == [Plan(1, "dflash", drafted=8)]
    # the drafter's pass is paid at the width it drafted at, whatever the verify's
    cut = Plan(1, "dflash", drafted=8)
    assert planner.modelled([row], [cut]) == pytest.approx(
        planner.modelled([row], [PLAIN]) + planner.cost.drafter_pass(8)
    )


def test_the_rows_of_a_step_are_cut_to_one_width():
    """A batch's verify is as wide as its widest row: a row cut narrower than that would save
    nothing, so every drafting row is cut to the step's width; a copy's plan is left as it is."""
    planner, row = planner_with([0.7] * 16, cpu_like(slope=0.11), max_width=8)
    trained(planner.evidence)
    doubtful, copying = Row(block=8), Row(block=8)
    for other in (doubtful, copying):
        planner.start(other)
    plans = [Plan(8, "dflash"), Plan(8, "dflash"), Plan(3, "lookup", (5, 6), 4)]
    alone = planner.cut([row], plans[:1], [[0.95] * 7])[0]
    cut = planner.cut([row, doubtful, copying], plans, [[0.95] * 7, [0.15] * 7, None])
    assert cut[0].width == cut[1].width and cut[0].drafted == cut[1].drafted == 8 and cut[2] == plans[2]
    assert alone == plans[0] and cut[0].width < 8  # three rows 8 wide cost too much for the doubtful ones


def test_drafts_are_read_to_cut_a_verify_only_where_a_narrower_one_is_cheaper():
    steep, flat = cpu_like(slope=0.11), cpu_like(slope=0.005)  # a CPU's curve; a Mac GPU's
    for cost, cuts in ((steep, True), (flat, False)):
        planner = Planner(cost, 8)
        row = Row(block=8)
        planner.start(row)
        assert planner.cuts([row], [Plan(8, "dflash")]) is cuts
    planner = Planner(steep, 8)
    fixed, copying = Row(block=8, adaptive=False), Row(block=8)
    for row in (fixed, copying):
        planner.start(row)
    assert not planner.cuts([fixed], [Plan(8, "dflash")])  # a fixed block size asked for is kept
    assert not planner.cuts([copying], [Plan(8, "lookup", tuple(range(7)), 8)])  # nothing drafted


def test_the_planner_learns_the_confidence_of_the_tokens_it_verified():
    planner, row = planner_with([0.7] * 16, cpu_like(), max_width=8)
    plan = Plan(5, "dflash", drafted=8)
    planner.learn([row], [plan], [2], 0.1, [[0.92, 0.81, 0.13, 0.55, 0.6, 0.2, 0.1]])
    # tested: the 2 accepted and the one refused after them, of the 4 verified; not the 3 cut off
    assert [round(n) for n in planner.evidence.accepted] == [0, 0, 0, 0, 0, 0, 0, 0, 1, 1]
    assert [round(n) for n in planner.evidence.refused] == [0, 1, 0, 0, 0, 0, 0, 0, 0, 0]
    planner.learn([row], [Plan(3, "dflash")], [1], 0.1, None)  # not read: nothing to learn of it
    assert sum(planner.evidence.accepted) + sum(planner.evidence.refused) == pytest.approx(3)


def test_a_sampled_rows_confidence_is_its_distributions_at_its_temperature():
    import mlx.core as mx

    from dflash_mlx.drafters.model import top_probability

    logits = mx.array([[[2.0, 0.0, 0.0]], [[2.0, 0.0, 0.0]]])
    greedy, hot = top_probability(logits, [SamplingParams(), SamplingParams(temp=2.0)]).tolist()
    assert greedy[0] == pytest.approx(mx.softmax(logits[0, 0]).max().item(), rel=1e-5)
    assert hot[0] == pytest.approx(mx.softmax(logits[0, 0] / 2.0).max().item(), rel=1e-5) and hot[0] < greedy[0]
