"""Speculative sampling leaves the target's distribution unchanged."""

import itertools
import math
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import sampling
from dflash_mlx.decode.costs import CostModel
from dflash_mlx.decode.decoder import Decoder, decode
from dflash_mlx.decode.learning import Learning, keep
from dflash_mlx.decode.model import DecodeStats, DFlashModel
from dflash_mlx.decode.plan import Planner
from dflash_mlx.decode.request import Request, check_values
from dflash_mlx.decode.suffix import SuffixStore
from dflash_mlx.sampling import SamplingParams, probabilities
from tiny_models import Clock, Timed, random_dflash2, random_draft, tiny_target

VOCAB = 6
PROMPT = [1, 2, 3, 4]


@pytest.fixture(scope="module")
def pair():
    target = tiny_target("llama", seed=5, vocab_size=VOCAB)
    # a drafter whose proposals are plausible but wrong often: both paths run
    return target, random_draft(target, seed=9, block_size=3)


LENGTH = 4  # t0 from the prefill, then a cycle that drafts t1, t2 (block 3), then t3


def exact_joint(target, params):
    """P(t0..t3 | prompt) under plain sampling from the target."""
    probs = {}
    for prefix_len in range(LENGTH):
        for prefix in itertools.product(range(VOCAB), repeat=prefix_len):
            logits = target.model(mx.array([PROMPT + list(prefix)]))[0, -1]
            probs[prefix] = np.array(probabilities(logits, params))
    joint = np.zeros((VOCAB,) * LENGTH)
    for tokens in itertools.product(range(VOCAB), repeat=LENGTH):
        joint[tokens] = math.prod(probs[tokens[:i]][t] for i, t in enumerate(tokens))
    return joint


def sample_joint(model, params, n, seed, stats=None, rows=1, block_size=3):
    """Counts of n samples of t0..t3, each decoded alone (rows 1) or in batches of `rows`
    (each row draws its own noise: its distribution is what it has alone), at `block_size`
    (None: the planner's widths)."""
    mx.random.seed(seed)
    counts = np.zeros((VOCAB,) * LENGTH)
    if rows == 1:
        for _ in range(n):
            tokens = [
                t
                for step in decode(model, Request(list(PROMPT), LENGTH, params, block_size=block_size), stats=stats)
                for t in step.tokens
            ]
            counts[tuple(tokens)] += 1
        return counts
    for start in range(0, n, rows):
        decoder = Decoder(model, max_batch=rows, clock=getattr(model.target, "clock", None))
        request = Request(list(PROMPT), LENGTH, params, block_size=block_size)
        added = [decoder.add(request, stats) for _ in range(min(rows, n - start))]
        while decoder.busy:
            decoder.step()
        decoder.close()
        for row in added:
            counts[tuple(row.output)] += 1
    return counts


def chi_square_p_value(counts, expected_probs, min_expected=5.0):
    """Pearson chi-square over cells pooled so that each has >= min_expected counts."""
    n = counts.sum()
    order = np.argsort(expected_probs.ravel())
    observed, expected = counts.ravel()[order], expected_probs.ravel()[order] * n
    bins_o, bins_e, acc_o, acc_e = [], [], 0.0, 0.0
    for o, e in zip(observed, expected):
        acc_o, acc_e = acc_o + o, acc_e + e
        if acc_e >= min_expected:
            bins_o.append(acc_o), bins_e.append(acc_e)
            acc_o = acc_e = 0.0
    bins_o[-1] += acc_o
    bins_e[-1] += acc_e
    stat = sum((o - e) ** 2 / e for o, e in zip(bins_o, bins_e))
    dof = len(bins_o) - 1
    # Wilson-Hilferty: (X/k)^(1/3) is about normal
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


FILTERED = SamplingParams(temp=0.7, top_p=0.9, top_k=4)


@pytest.mark.parametrize(
    "params, rows, n",
    [
        pytest.param(SamplingParams(temp=1.0), 1, 1500, id="temp1-alone", marks=pytest.mark.slow),  # decoded alone
        pytest.param(FILTERED, 50, 1000, id="temp0.7-topp-topk-batched"),
        pytest.param(FILTERED, 50, 2500, id="temp0.7-topp-topk-batched-2500", marks=pytest.mark.slow),
    ],
)
def test_dflash_samples_follow_the_target_distribution(pair, params, rows, n):
    """A correct sampler fails this with probability 1e-3 (the threshold) for a given seed.  The
    fast case's 1000 samples still catch an accept-every-draft sampler (the negative control's
    bias) by far: at 300 samples its p-value is 0.0 in float64 (20 subsamples of 2500 of its draws);
    subtler biases are left to the slow cases' 1500 and 2500."""
    target, draft = pair
    joint = exact_joint(target, params)
    counts = sample_joint(DFlashModel(target, draft), params, n=n, seed=0, rows=rows)
    assert chi_square_p_value(counts, joint) > 1e-3


@pytest.mark.slow
def test_dflash2_samples_follow_the_target_distribution(pair):
    """The selector samples among its top-k candidates; the target still decides."""
    target, _ = pair
    params = SamplingParams(temp=1.0)
    stats = DecodeStats()
    model = DFlashModel(target, random_dflash2(target, seed=9, block_size=3))
    counts = sample_joint(model, params, n=2500, seed=2, stats=stats, rows=50)
    assert chi_square_p_value(counts, exact_joint(target, params)) > 1e-3
    assert stats.histogram[1] > 0  # some selector proposals were accepted


@pytest.mark.slow  # 2500 samples; test_lookup's seeded check of the same path stays in the fast subset
def test_copies_without_a_drafter_keep_the_target_distribution(pair):
    """A target alone, served by copies (the prompt lookup, and the answers sampled before:
    suffix.py) where a planner over a flat cost curve takes them, in batches."""
    target, _ = pair
    params = SamplingParams(temp=1.0)
    flat = CostModel([1, 2, 3], [1.0, 1.0, 1.0], 0.0)
    model = DFlashModel(Timed(target, Clock(flat)))
    keep(model, Learning(Planner(flat, 3), SuffixStore()))
    stats = DecodeStats()
    counts = sample_joint(model, params, n=2500, seed=3, stats=stats, rows=50, block_size=None)
    assert chi_square_p_value(counts, exact_joint(target, params)) > 1e-3
    copied = Counter(
        (source, n > 1) for n, source in zip(stats.accepted_lengths, stats.sources) if source in ("lookup", "suffix")
    )
    assert copied["lookup", True] > 0 and copied["suffix", True] > 0  # both sources' tokens were accepted


@pytest.mark.slow  # 2500 samples; the batched DFlash check above stays in the fast subset
def test_plain_decoding_samples_follow_the_target_distribution(pair):
    """The pipelined plain path (the fused sampler, used whenever drafting does not pay)."""
    target, _ = pair
    params = SamplingParams(temp=0.7, top_p=0.9, top_k=4)
    joint = exact_joint(target, params)
    counts = sample_joint(DFlashModel(target), params, n=2500, seed=1, rows=50)
    assert chi_square_p_value(counts, joint) > 1e-3


@pytest.mark.slow  # the check's negative control, 2500 samples
def test_the_check_detects_a_biased_sampler(pair, monkeypatch):
    """Negative control: accepting every draft token must fail the same test."""
    target, draft = pair
    params = SamplingParams(temp=1.0)
    joint = exact_joint(target, params)

    def accept_everything(blocks, chosen, proposed):
        return proposed, mx.take_along_axis(chosen, proposed[:, None], axis=1)[:, 0]

    import dflash_mlx.decode.verify as verify

    monkeypatch.setattr(verify, "accepted_prefix", accept_everything)
    counts = sample_joint(DFlashModel(target, draft), params, n=2500, seed=0, rows=50)
    assert chi_square_p_value(counts, joint) < 1e-6


def test_seeded_runs_are_reproducible(pair):
    target, draft = pair
    params = SamplingParams(temp=1.0)
    runs = [
        [
            t
            for step in decode(DFlashModel(target, draft), Request(list(PROMPT), 30, params, seed=42))
            for t in step.tokens
        ]
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    other = [
        t
        for step in decode(DFlashModel(target, draft), Request(list(PROMPT), 30, params, seed=43))
        for t in step.tokens
    ]
    assert other != runs[0]


def test_seeded_output_does_not_depend_on_the_widths(pair):
    """The noise belongs to the output position: plain decoding, every fixed width
    and a drafter that proposes differently all commit the same tokens."""
    target, draft = pair
    other_draft = random_draft(target, seed=11, block_size=3)
    length = 20  # positions whose noise is checked, in blocks of 2 and 3
    for params in (SamplingParams(temp=1.0), SamplingParams(temp=0.7, top_p=0.9, top_k=4)):
        reference = [
            t
            for step in decode(DFlashModel(target), Request(list(PROMPT), length, params, seed=7))
            for t in step.tokens
        ]
        for model, width in [
            (DFlashModel(target, draft), 2),
            (DFlashModel(target, draft), 3),
            (DFlashModel(target, other_draft), 3),
            (DFlashModel(target, random_dflash2(target, seed=4, block_size=3)), 3),
        ]:
            tokens = [
                t
                for step in decode(model, Request(list(PROMPT), length, params, seed=7, block_size=width))
                for t in step.tokens
            ]
            assert tokens == reference


def test_noise_rows_kept_for_a_verify_again_are_the_rows_drawn_afresh(monkeypatch):
    """A verify that rejects part of its block verifies those positions again: their rows are
    drawn once, equal a fresh draw, and rows before the latest start are let go."""
    drawn = []
    position_key = sampling._position_key
    monkeypatch.setattr(sampling, "_position_key", lambda seed, p: drawn.append(p) or position_key(seed, p))
    noise = sampling.Noise(7, 50)
    noise.at(3, 4)
    again = noise.at(5, 4)
    assert drawn == [3, 4, 5, 6, 7, 8]
    assert mx.array_equal(again, sampling.Noise(7, 50).at(5, 4))
    noise.at(9, 1)
    assert sorted(noise._rows) == [9]


def test_an_unfiltered_choice_is_the_argmax_of_the_normalised_scores():
    """Without top-p / top-k the choice skips normalising, which only shifts each row."""
    logits = mx.random.normal((64, 300), key=mx.random.key(3)) * 4
    noise = mx.random.gumbel((64, 300), key=mx.random.key(4))
    params = SamplingParams(temp=0.7)
    normalised = (logits - mx.logsumexp(logits, axis=-1, keepdims=True)) / params.temp + noise
    assert mx.array_equal(sampling.choose(logits, params, noise), mx.argmax(normalised, axis=-1))


def test_invalid_sampling_parameters_are_refused():
    """Sampling values are checked where a request is built (decode/request.check_values)."""
    for bad in (
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(top_k=-2),
        dict(temperature=float("nan")),
        dict(temperature=float("inf")),
        dict(top_p=float("nan")),
        dict(top_k=1.5),
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            check_values(1, **bad)
    with pytest.raises(TypeError, match="temperature"):
        check_values(1, temperature="hot")
    assert check_values(1, seed=-1).seed == 2**64 - 1 and check_values(1, seed=10**30).seed < 2**64
    with pytest.raises(TypeError, match="seed"):
        check_values(1, seed=1.5)


def test_greedy_accept_counts_the_agreeing_prefix():
    """Each row keeps the prefix of its proposal the target agrees with, never past its own
    proposal (a narrower row's padding agreeing by chance is not accepted)."""
    from dflash_mlx.decode.verify import accepted_prefix

    logits = mx.eye(5)[mx.array([1, 2, 3, 4])] * 5  # target wants 1, 2, 3, 4
    choice = sampling.choose(logits, SamplingParams(), None)
    blocks = mx.array([[0, 1, 2, 0], [0, 1, 2, 3], [0, 1, 2, 3], [0, 4, 2, 3]])
    n, nxt = accepted_prefix(blocks, mx.stack([choice] * 4), mx.array([3, 3, 1, 3]))
    assert n.tolist() == [2, 3, 1, 0] and nxt.tolist() == [3, 4, 2, 1]


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["gpt_oss", "gemma4_text", "deepseek_v3", "qwen3_next"])
def test_samples_follow_the_target_distribution_on_every_new_family(model_type):
    """Sliding windows with sinks, per-layer inputs and soft-capped logits, MLA, GatedDeltaNet:
    rollback and the acceptance rule leave each target's distribution unchanged."""
    # gemma4: a low soft-cap keeps its peaky random logits from making the target deterministic
    extra = {"vocab_size_per_layer_input": VOCAB, "final_logit_softcapping": 2.0} if model_type == "gemma4_text" else {}
    target = tiny_target(model_type, seed=5, vocab_size=VOCAB, **extra)
    params = SamplingParams(temp=1.0)
    stats = DecodeStats()
    counts = sample_joint(
        DFlashModel(target, random_draft(target, seed=9, block_size=3)), params, n=1500, seed=3, stats=stats, rows=50
    )
    assert chi_square_p_value(counts, exact_joint(target, params)) > 1e-3
    assert stats.histogram[1] > 0  # drafts were accepted, so the drafted path was tested too


def test_token_logprobs_rank_the_top_alternatives_like_a_full_sort():
    logits = mx.random.normal((5, 300), key=mx.random.key(3))
    tokens = [0, 17, 299, 5, 150]
    full = np.asarray(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    for entry, row, token in zip(sampling.token_logprobs(logits, tokens, top=7), full, tokens):
        assert entry.token == token and entry.logprob == pytest.approx(float(row[token]), abs=1e-5)
        assert [t for t, _ in entry.top] == list(np.argsort(-row, kind="stable")[:7])
        assert [v for _, v in entry.top] == pytest.approx(sorted(row, reverse=True)[:7], abs=1e-5)
