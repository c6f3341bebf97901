"""Batched DFlash decoding: every request's output equals what it gets alone, on every family."""

import itertools
import random
from types import SimpleNamespace
from collections import Counter

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchRotatingKVCache

from dflash_mlx.decode import decoder as engine, verify
from dflash_mlx.decode.costs import CostModel, StepTimes, context_class
from dflash_mlx.api import BatchGenerator, batch_generate, generate, load, stream_generate
from dflash_mlx.decode.decoder import Decoder
from dflash_mlx.decode.rows import run_ahead
from dflash_mlx.kernels.fused_ops import fusing
from dflash_mlx.decode.plan import PLAIN, Plan, Planner, fixed_plan
from dflash_mlx.decode.request import Context, Request
from dflash_mlx.drafters.dflash import ContextRows
from dflash_mlx.decode.decoder import decode
from dflash_mlx.decode.learning import Learning
from dflash_mlx.decode.model import DecodeStats, DFlashModel
from dflash_mlx.cache.prompt_cache import PromptCache
from dflash_mlx.sampling import SamplingParams
from dflash_mlx.target.wrapper import BatchTargetCache
from test_engine import MODEL_TYPES, PROMPTS, family_target, plain_greedy
from tiny_models import Clock, by_family, Recording, random_dflash2, random_draft, rows_oracle_draft, tiny_target

BATCH_FAMILIES = ["llama", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_next", "gpt_oss", "gemma4_text", "deepseek_v3"]


def run(decoder: Decoder, until_done=True) -> dict:
    out = {}
    while decoder.busy:
        for uid, step in decoder.step().steps.items():
            out.setdefault(uid, []).extend(step.tokens)
        if not until_done:
            break
    return out


def oracle_for(target, prompts, max_tokens, seed=0):
    """A drafter proposing each prompt's greedy continuation, wrong at different places per
    prompt (so the rows of a batch keep different lengths in most steps)."""
    rng = random.Random(seed)
    references = [p + plain_greedy(target, p, max_tokens + 16) for p in prompts]
    wrong = [{rng.randrange(len(p), len(p) + max_tokens) for _ in range(6 + 3 * i)} for i, p in enumerate(prompts)]
    return rows_oracle_draft(target, references, wrong, block_size=6), references


def prefilled_batch(target, prompts: list) -> BatchTargetCache:
    """One batch cache of `prompts`, each prefilled alone."""
    rows = []
    for prompt in prompts:
        cache = target.make_cache()
        target(mx.array([prompt]), cache)
        rows.append(cache)
    return BatchTargetCache(rows)


@pytest.mark.parametrize("model_type", by_family(BATCH_FAMILIES))
def test_each_row_rolls_back_to_its_own_prefix(model_type):
    """After a batched verify of 6 tokens with a different keep per row, each row's cache is the
    cache of its prompt + its kept tokens alone (logits of a probe token compared)."""
    target = tiny_target(model_type, seed=2)
    block = mx.array([[9, 8, 7, 6, 5, 4], [3, 4, 5, 6, 7, 8], [10, 11, 12, 13, 14, 15]])
    for keeps in ([1, 4, 6], [6, 6, 1], [3, 3, 3], [2, 5, 1]):
        batch = prefilled_batch(target, PROMPTS)
        batch.checkpoint()
        target(block, batch)
        batch.rollback(keeps)
        assert batch.offsets == [len(p) + k for p, k in zip(PROMPTS, keeps)]
        got, _ = target(mx.array([[11], [12], [13]]), batch)
        for i, (prompt, keep) in enumerate(zip(PROMPTS, keeps)):
            alone = target.make_cache()
            target(mx.array([prompt + block[i, :keep].tolist()]), alone)
            want, _ = target(mx.array([[11 + i]]), alone)
            assert mx.allclose(got[i], want[0], atol=1e-4, rtol=1e-4), (keeps, i)


@pytest.mark.parametrize("model_type", by_family(["gpt_oss", "gemma3_text"]))
def test_a_verify_after_a_plain_step_sees_each_rows_whole_window(model_type):
    """Rows of different lengths (one shorter than the window, one past it), a plain step that
    rotates the batch's sliding windows, then a verify of 4 tokens: each row's logits are its
    own alone (the mask of a multi-token pass once cut a padded row's oldest entry)."""
    target = tiny_target(model_type, seed=2)
    prompts = [PROMPTS[1], list(range(20, 60))]
    batch = prefilled_batch(target, prompts)
    target(mx.array([[11], [12]]), batch)
    batch.checkpoint()
    block = mx.array([[21, 22, 23, 24], [31, 32, 33, 34]])
    got, _ = target(block, batch)
    for i, (prompt, last) in enumerate(zip(prompts, (11, 12))):
        alone = target.make_cache()
        target(mx.array([prompt + [last]]), alone)
        want, _ = target(block[i : i + 1], alone)
        assert mx.allclose(got[i], want[0], atol=1e-4, rtol=1e-4), (model_type, i)


@pytest.mark.parametrize("kind", ["dflash", "dflash2", "restricted"])
def test_rows_drafted_together_draft_what_each_drafts_alone(kind):
    """One drafter pass over several rows (contexts of different lengths, greedy and sampled
    rows mixed) proposes, row by row, what each row's own pass proposes."""
    target = tiny_target("llama", seed=2)
    draft = random_dflash2(target, block_size=6) if kind == "dflash2" else random_draft(target, block_size=6)
    if kind == "restricted":
        draft.restrict_vocab(list(range(0, target.vocab_size, 3)))
    model = DFlashModel(target, draft)
    contexts, lasts = [], []
    for prompt in PROMPTS + [PROMPTS[0][:3]]:
        context = Context(model)
        _, features = target(mx.array([prompt]), target.make_cache(), draft.target_layer_ids)
        context.add(features)
        contexts.append(context)
        lasts.append(prompt[-1])
    mixed = [SamplingParams(), SamplingParams(temp=0.8), SamplingParams(temp=1.3), SamplingParams()]
    for params, width in itertools.product((mixed, [SamplingParams()] * 4), (2, 6)):  # all greedy: one walk
        noises = [
            None if p.greedy else mx.random.gumbel((width, target.vocab_size), key=mx.random.key(i))
            for i, p in enumerate(params)
        ]
        together = verify.draft_rows(model, lasts, contexts, width, params, noises).tokens
        alone = [
            verify.draft_rows(model, [last], [context], width, [p], [noise]).tokens[0]
            for last, context, p, noise in zip(lasts, contexts, params, noises)
        ]
        assert [t.tolist() for t in together] == [a.tolist() for a in alone], (kind, width, params)
        assert all(t.size == width - 1 for t in together)
    hidden_together = draft.run_layers(
        mx.array([[1, 5], [2, 5], [3, 5], [4, 5]]),
        [ContextRows([c.cache[i] for c in contexts], 2) for i in range(len(draft.layers))],
    )
    for row, context in enumerate(contexts):
        alone = draft.run_layers(mx.array([[row + 1, 5]]), context.cache)
        assert mx.allclose(hidden_together[row], alone[0], atol=1e-5, rtol=1e-5)


# DFlash 2's own proposals (its selector) are the same whatever the target: the fast subset
# decodes them on llama, the full run on every family
@pytest.mark.parametrize(
    "model_type, drafter",
    by_family(
        [(family, drafter) for family in MODEL_TYPES for drafter in ("oracle", "dflash", "dflash2")],
        fast=lambda family, drafter: family == "llama" or drafter != "dflash2",
    ),
)
def test_batched_greedy_is_lossless(model_type, drafter):
    target = family_target(model_type)  # one per family: the references are computed once
    oracle, references = oracle_for(target, PROMPTS, 40)
    draft = {
        "oracle": lambda: oracle,
        "dflash": lambda: random_draft(target, block_size=5),
        "dflash2": lambda: random_dflash2(target, block_size=4),
    }[drafter]()
    decoder = Decoder(DFlashModel(target, draft))
    uids = [decoder.add(Request(list(p), 40, SamplingParams())).uid for p in PROMPTS]
    out = run(decoder)
    for uid, prompt, reference in zip(uids, PROMPTS, references):
        assert out[uid] == reference[len(prompt) : len(prompt) + 40], (model_type, drafter)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_5", "gpt_oss"])
def test_computing_ahead_after_drafting_steps_is_lossless(model_type, monkeypatch):
    """On a GPU, after a drafting step the rolled-back caches and the drafting rows' new context
    are computed while the next step's graph is built (run_ahead): here on the CPU, the answers
    are still the plain ones, alone and batched, and it ran after every drafting step."""
    ran = []
    monkeypatch.setattr(engine, "fusing", lambda: False)
    monkeypatch.setattr(verify, "fusing", lambda: False)
    monkeypatch.setattr(verify, "run_ahead", lambda rows, cache: ran.append(len(rows)) or run_ahead(rows, cache))
    target = tiny_target(model_type, seed=2)
    oracle, references = oracle_for(target, PROMPTS, 24)
    for max_batch in (1, 8):
        ran.clear()
        decoder = Decoder(DFlashModel(target, oracle), max_batch=max_batch)
        uids = [decoder.add(Request(list(p), 24, SamplingParams())).uid for p in PROMPTS]
        drafting = 0
        out = {}
        while decoder.busy:
            step = decoder.step()
            drafting += step.width > 1
            for uid, s in step.steps.items():
                out.setdefault(uid, []).extend(s.tokens)
        assert drafting > 0 and len(ran) == drafting
        for uid, prompt, reference in zip(uids, PROMPTS, references):
            assert out[uid] == reference[len(prompt) : len(prompt) + 24], (model_type, max_batch)


class Alternating(Planner):
    """Plain and drafting steps in turn (by the steps learnt), every row at once."""

    def plan(self, rows, drafter=True, lookahead=0):
        if (self.steps + lookahead) % 2 == 0:
            return [PLAIN] * len(rows)
        return [Plan(min(4, row.left - lookahead), "dflash") if row.left - lookahead >= 2 else PLAIN for row in rows]

    def passes(self, rows, drafter=True, apart=False):
        return [(list(range(len(rows))), self.plan(rows, drafter))]


def widths_until_done(decoder: Decoder) -> tuple[dict, list[int]]:
    """Each request's tokens, and the width of every decode step."""
    out, widths = {}, []
    while decoder.busy:
        step = decoder.step()
        widths += [step.width] if step.size else []
        for uid, s in step.steps.items():
            out.setdefault(uid, []).extend(s.tokens)
    return out, widths


def widths_of_lossless_runs(target, alone: Planner, batched: Planner, sampled: Planner) -> list[list[int]]:
    """PROMPTS decoded greedy with an oracle drafter by `alone`'s planner one at a time and by
    `batched`'s together, then seeded sampling with a random drafter by `sampled`'s: each output
    the plain one.  Each run's step widths."""
    oracle, references = oracle_for(target, PROMPTS, 24)
    runs = []
    for max_batch, planner in ((1, alone), (8, batched)):
        decoder = Decoder(DFlashModel(target, oracle), max_batch=max_batch, learning=Learning(planner))
        uids = [decoder.add(Request(list(p), 24, SamplingParams())).uid for p in PROMPTS]
        out, widths = widths_until_done(decoder)
        runs.append(widths)
        for uid, prompt, reference in zip(uids, PROMPTS, references):
            assert out[uid] == reference[len(prompt) : len(prompt) + 24], (target.model_type, max_batch)
    model = DFlashModel(target, random_draft(target, block_size=4))
    params = [SamplingParams(temp=0.8), SamplingParams(temp=1.0, top_p=0.9), SamplingParams(temp=0.6, top_k=5)]
    plain = [
        [t for s in decode(model, Request(list(p), 16, sp, seed=7 + i, block_size=1)) for t in s.tokens]
        for i, (p, sp) in enumerate(zip(PROMPTS, params))
    ]
    decoder = Decoder(model, learning=Learning(sampled))
    uids = [decoder.add(Request(list(p), 16, sp, seed=7 + i)).uid for i, (p, sp) in enumerate(zip(PROMPTS, params))]
    out, widths = widths_until_done(decoder)
    assert [out[u] for u in uids] == plain
    return runs + [widths]


@pytest.mark.parametrize("model_type", by_family(["llama", "qwen3_5", "gpt_oss", "gemma3_text"]))
def test_plain_and_drafting_steps_in_turn_are_lossless(model_type):
    """Every drafting step right after a plain one (a sliding window a one-token step rotated,
    then a verify; a GatedDeltaNet state stepped once, then checkpointed): the outputs are the
    plain ones, alone and batched, greedy and seeded sampling (the same noise per position)."""
    cpu = cost_model(0.1)
    alone, batched, sampled = widths_of_lossless_runs(
        tiny_target(model_type, seed=2), Alternating(cpu, 4), Alternating(cpu, 4), Alternating(cpu, 4)
    )
    for widths in (alone, batched):
        assert sum(a == 1 and b > 1 for a, b in zip(widths, widths[1:])) >= 6, widths
    assert 1 in sampled and max(sampled) > 1


class Cutting(Alternating):
    """Alternating's steps, every drafting step's verify cut after its drafts are read: each row
    to a width drawn at random (1: nothing it drafted verified), most often to one for them all."""

    def __init__(self, *args, seed: int = 0):
        super().__init__(*args)
        self.rng, self.cut_widths = random.Random(seed), []

    def cuts(self, rows, plans):
        return True

    def cut(self, rows, plans, confidences):
        assert [c is not None for c in confidences] == [p.source == "dflash" and p.width > 1 for p in plans]
        assert all(0 <= c <= 1 for row in confidences if row for c in row)
        shared = self.rng.randint(1, max(p.width for p in plans))
        widths = [shared if self.rng.random() < 0.6 else self.rng.randint(1, p.width) for p in plans]
        cut = [
            Plan(min(w, p.width), "dflash", drafted=p.width) if c else p for w, p, c in zip(widths, plans, confidences)
        ]
        self.cut_widths.append(max(p.width for p in cut))
        return cut


@pytest.mark.parametrize("model_type", by_family(["llama", "qwen3_5", "gpt_oss", "gemma3_text"]))
def test_verifies_cut_after_their_drafts_are_read_are_lossless(model_type):
    """Drafted verifies cut to any width after the drafts are read (to 1 after the caches were
    checkpointed: nothing to roll back), rows of a batch to different ones: the outputs are the
    plain ones, alone and batched, greedy and seeded sampling."""
    cpu = cost_model(0.1)
    alone, batched, sampled = Cutting(cpu, 6, seed=1), Cutting(cpu, 6, seed=8), Cutting(cpu, 4, seed=3)
    widths_of_lossless_runs(tiny_target(model_type, seed=2), alone, batched, sampled)
    for planner in (alone, batched):
        assert 1 in planner.cut_widths and max(planner.cut_widths) > 2, planner.cut_widths
    assert sampled.cut_widths


def test_a_cut_verify_is_recorded_with_the_width_it_drafted_at():
    """A cycle's statistics keep its drafter pass's width beside its verify's (the benchmarks
    charge each cycle the drafter pass it paid): wider where the verify was cut, 1 where none ran."""
    target = tiny_target("llama", seed=2)
    oracle, _ = oracle_for(target, PROMPTS, 24)
    decoder = Decoder(DFlashModel(target, oracle), max_batch=1, learning=Learning(Cutting(cost_model(0.1), 6, seed=1)))
    stats = [DecodeStats() for _ in PROMPTS]
    for prompt, s in zip(PROMPTS, stats):
        decoder.add(Request(list(prompt), 24, SamplingParams()), stats=s)
    widths_until_done(decoder)
    cycles = [c for s in stats for c in zip(s.widths, s.sources, s.drafter_widths)]
    assert all(len(s.drafter_widths) == s.cycles for s in stats)
    assert all(d == 1 for w, source, d in cycles if source != "dflash")
    assert all(d >= w for w, source, d in cycles if source == "dflash")
    assert any(d > w for w, source, d in cycles if source == "dflash")  # cut


def test_the_planner_cuts_drafted_verifies_on_a_steep_curve_and_stays_lossless():
    """The planner itself, on a compute-bound curve: it reads the drafts of its drafting steps,
    learns what their confidence says, and the outputs are the plain ones."""
    target = tiny_target("llama", seed=2)
    oracle, references = oracle_for(target, PROMPTS, 30)
    planner = Planner(cost_model(0.1), 6)
    decoder = Decoder(DFlashModel(target, oracle), max_batch=1, learning=Learning(planner))
    uids = [decoder.add(Request(list(p), 30, SamplingParams())).uid for p in PROMPTS]
    out, _ = widths_until_done(decoder)
    assert sum(planner.evidence.accepted) > 0 and sum(planner.evidence.refused) > 0
    for uid, prompt, reference in zip(uids, PROMPTS, references):
        assert out[uid] == reference[len(prompt) : len(prompt) + 30]


def test_rows_keep_different_lengths_in_one_step():
    """The oracle's misses differ per row: most steps keep different lengths per row (what the
    per-row rollback is for), and long runs are accepted."""
    target = tiny_target("llama", seed=2)
    oracle, _ = oracle_for(target, PROMPTS, 40)
    decoder = Decoder(DFlashModel(target, oracle))
    stats = [DecodeStats() for _ in PROMPTS]
    for prompt, s in zip(PROMPTS, stats):
        decoder.add(Request(list(prompt), 40, SamplingParams()), stats=s)
    mixed = 0
    while decoder.busy:
        step = decoder.step()
        mixed += len({len(s.tokens) for s in step.steps.values()}) > 1
    assert mixed >= 3 and all(s.tau > 2 for s in stats)
    assert all(len(s.cycle_seconds) == s.cycles and min(s.cycle_seconds) > 0 for s in stats)  # each its step's time


def test_a_dropped_cycle_takes_its_time_with_it():
    """A last cycle that committed none of the answer (an EOS first) is not counted, nor its time."""
    stats = DecodeStats(
        accepted_lengths=[2, 3], widths=[4, 4], sources=["dflash"] * 2, drafter_widths=[8, 4], cycle_seconds=[0.1, 0.2]
    )
    stats.keep_of_last_cycle(2)
    assert stats.accepted_lengths == [2, 2] and stats.cycle_seconds == [0.1, 0.2]
    stats.keep_of_last_cycle(0)
    assert stats.cycles == 1 and stats.cycle_seconds == [0.1] and stats.drafter_widths == [8]


def test_rows_join_and_leave_mid_decode(monkeypatch):
    """Prompts prefilled in chunks while others decode; rows leave at max_tokens 1 / 7, one is
    cancelled, one joins late; every output stays exact and the padding goes with the rows."""
    monkeypatch.setattr(engine, "PREFILL_STEP", 8)  # 8 tokens a pass: with 2 prompts filling, 4 each
    target = tiny_target("qwen3_5", seed=2)
    prompts = PROMPTS + [list(range(70, 83))]
    oracle, references = oracle_for(target, prompts, 40)
    decoder = Decoder(DFlashModel(target, oracle))
    limits = [1, 7, 40]
    uids = [decoder.add(Request(list(p), n, SamplingParams())).uid for p, n in zip(PROMPTS, limits)]
    out, late, cancel, cancelled_at, sizes = {}, None, None, None, []
    for steps in range(1000):
        if not decoder.busy:
            break
        step = decoder.step()
        sizes.append(step.size)
        for uid, s in step.steps.items():
            out.setdefault(uid, []).extend(s.tokens)
        if steps == 6:
            late = decoder.add(Request(list(prompts[3]), 30, SamplingParams())).uid
            cancel = decoder.add(Request(list(PROMPTS[0]), 40, SamplingParams())).uid
        if cancelled_at is None and len(out.get(cancel, [])) >= 5:
            decoder.remove(cancel)
            cancelled_at = len(out[cancel])
    for uid, prompt, reference, limit in zip(uids, PROMPTS, references, limits):
        assert out[uid] == reference[len(prompt) : len(prompt) + limit]
    assert out[late] == references[3][len(prompts[3]) : len(prompts[3]) + 30]
    assert out[cancel] == references[0][len(PROMPTS[0]) : len(PROMPTS[0]) + cancelled_at]
    assert max(sizes) >= 3
    assert not decoder.busy and decoder.cache is None


def test_a_request_filling_alone_decodes_on_the_cache_it_was_prefilled_into(monkeypatch):
    """A warm turn's time to first token went mostly to copying its context from the prefill's
    batch into the decoding one: the rows that finish their prefill together take their
    batch along when nobody decodes, and are appended to the decoding batch otherwise; the
    outputs stay exact either way."""
    monkeypatch.setattr(engine, "PREFILL_STEP", 8)
    target = tiny_target("llama", seed=2)
    oracle, references = oracle_for(target, PROMPTS, 20)
    decoder = Decoder(DFlashModel(target, oracle), max_batch=3)
    first = decoder.add(Request(list(PROMPTS[2]), 20)).uid
    filled_into = []
    while decoder.cache is None:
        filled_into.append(decoder.fill_cache)
        decoder.step()
    assert decoder.cache is filled_into[-1]  # handed over, not copied
    out = {first: decoder.rows[0].output[:]}
    late = decoder.add(Request(list(PROMPTS[0]), 20)).uid
    decoding = decoder.cache
    while decoder.busy:
        for uid, step in decoder.step().steps.items():
            out.setdefault(uid, []).extend(step.tokens)
        assert decoder.cache in (decoding, None)  # the late row was appended to it
    assert out[first] == references[2][len(PROMPTS[2]) :][:20]
    assert out[late] == references[0][len(PROMPTS[0]) :][:20]


@pytest.mark.parametrize(
    "model_type, overrides",
    by_family(
        [(family, {}) for family in BATCH_FAMILIES]
        + [("llama", {"sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"] * 2})]
    ),
)
def test_waiting_prompts_are_prefilled_together(model_type, overrides, monkeypatch):
    """Prompts waiting at once are prefilled in one pass per chunk (40 tokens a pass, shared by
    the rows filling, right-padded to the longest); each has its first token from the pass that
    ends its prompt and joins the decoding batch, while the longer ones fill beside it.  Every
    output exact."""
    monkeypatch.setattr(engine, "PREFILL_STEP", 40)
    target = tiny_target(model_type, seed=2, **overrides)
    prompts = PROMPTS + [[77], [(7 * i) % 90 + 1 for i in range(40)]]  # 8, 3, 30, 1 and 40 tokens
    recording, steps, outputs, references = run_recorded(target, prompts, 12)
    assert recording.prefills == [(5, 8), (2, 20), (2, 12)]  # 5 rows x 8, the 30 and 40 ones x 20, then 2 and 12
    assert [step.size for step, _ in steps[:4]] == [
        0,
        3,
        0,
        5,
    ]  # a step that ends prompts sends their first tokens at once
    for output, prompt, reference in zip(outputs, prompts, references):
        assert output == reference[len(prompt) : len(prompt) + 12], (model_type, len(prompt))


def test_a_step_prefills_in_passes_of_the_pass_size_until_a_prompt_ends(monkeypatch):
    """On a CPU a step prefills PREFILL_STEP tokens in passes of CPU_PREFILL_PASS (attention
    there computes a pass's masked scores too); the pass that ends a prompt ends the step, so its
    first token goes out at once.  Outputs exact."""
    monkeypatch.setattr(engine, "PREFILL_STEP", 40)
    monkeypatch.setattr(engine, "CPU_PREFILL_PASS", 16)
    assert engine.prefill_pass() == (16 if fusing() else 40)
    prompts = [[(7 * i) % 90 + 1 for i in range(60)], [(3 * i) % 90 + 1 for i in range(20)]]
    recording, steps, outputs, references = run_recorded(tiny_target("llama", seed=2), prompts, 8)
    if fusing():
        # 8 + 8 a pass: the 20-token prompt ends in step 2's first pass (4 + 8), and that step ends;
        # then the 60-token one alone, 16 a pass (36 left)
        assert recording.prefills == [(2, 8), (2, 8), (2, 8), (1, 16), (1, 16), (1, 4)]
        firsts = [(passes, uid) for step, passes in steps for uid in step.steps if step.size == 0]
        assert firsts == [(1, 1), (1, 0)]  # (prefill passes in the step that sent it, request)
    for output, prompt, reference in zip(outputs, prompts, references):
        assert output == reference[len(prompt) : len(prompt) + 8]


def run_recorded(target, prompts: list, max_tokens: int):
    """`prompts` decoded together on `target`, its passes recorded: the recording, each step with
    the prefill passes it ran, each prompt's output and the oracle's references."""
    oracle, references = oracle_for(target, prompts, max_tokens)
    recording = Recording(target)
    decoder = Decoder(DFlashModel(recording, oracle))
    uids = [decoder.add(Request(list(p), max_tokens, SamplingParams())).uid for p in prompts]
    out, steps = {}, []
    while decoder.busy:
        passes = len(recording.prefills)
        step = decoder.step()
        steps.append((step, len(recording.prefills) - passes))
        for uid, s in step.steps.items():
            out.setdefault(uid, []).extend(s.tokens)
    return recording, steps, [out[uid] for uid in uids], references


@pytest.mark.parametrize(
    "model_type, overrides",
    [
        ("llama", {}),
        ("llama", {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"] * 2}),
        ("qwen3_5", {}),
    ],
)
def test_prefixes_are_reused_by_requests_filling_together(model_type, overrides):
    """Prompts prefilled together store their prefixes; the next wave restores them (one in full,
    joining at once) beside a prompt filling from scratch, and decode() alone restores what the
    batch stored: every output as cold."""
    target = tiny_target(model_type, seed=2, **overrides)
    model = DFlashModel(target, random_draft(target, block_size=4))
    kv_only = model_type == "llama" and not overrides
    system = list(range(30, 70))
    first, second = [system + [5, 6, 7], system + [1, 2]], [system + [5, 6, 7, 8, 9], system + [1, 2], [3, 4, 5, 6]]
    cache = PromptCache(piece_tokens=8)  # prompts cut into shared pieces
    for wave, hits in ((first, [0, 0]), (second, [len(first[0]) - 1, len(first[1]) - 1, 0])):
        decoder = Decoder(model, prompt_cache=cache)
        stats = [DecodeStats() for _ in wave]
        uids = [decoder.add(Request(list(p), 16, SamplingParams()), stats=s).uid for p, s in zip(wave, stats)]
        out = run(decoder)
        for uid, prompt in zip(uids, wave):
            assert out[uid] == [t for s in decode(model, Request(list(prompt), 16, SamplingParams())) for t in s.tokens]
        # cuttable caches may reuse an earlier answer's state one token further than its prompt's
        assert all(h <= s.cached_tokens <= h + (1 if h and kv_only else 0) for s, h in zip(stats, hits))
    alone = DecodeStats()
    warm = [
        t
        for s in decode(model, Request(list(second[0] + [11]), 16, SamplingParams()), prompt_cache=cache, stats=alone)
        for t in s.tokens
    ]
    assert alone.cached_tokens in (len(second[0]) - 1, len(second[0]) if kv_only else -1)
    assert warm == [t for s in decode(model, Request(list(second[0] + [11]), 16, SamplingParams())) for t in s.tokens]


def test_padding_is_dropped_when_rows_leave():
    target = tiny_target("llama", seed=2)
    decoder = Decoder(DFlashModel(target, random_draft(target, block_size=4)))
    short = decoder.add(Request(list(PROMPTS[1]), 30, SamplingParams())).uid
    long = decoder.add(Request(list(PROMPTS[2]), 6, SamplingParams())).uid
    sizes = []
    while any(row.uid == long for row in decoder.rows + decoder.filling + decoder.waiting):
        sizes.append(decoder.step().size)
    assert max(sizes) == 2 and [row.uid for row in decoder.rows] == [short]
    layer = decoder.cache.layers[0]
    assert layer.left_padding.tolist() == [0] and layer._idx == decoder.cache.offsets[0]


def test_sliding_window_smaller_than_the_context():
    target = tiny_target("llama", seed=3, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=6)
    oracle, references = oracle_for(target, PROMPTS, 40, seed=1)
    decoder = Decoder(DFlashModel(target, oracle))
    uids = [decoder.add(Request(list(p), 40, SamplingParams())).uid for p in PROMPTS]
    out, windows = {}, []
    while decoder.busy:
        step = decoder.step()
        for uid, s in step.steps.items():
            out.setdefault(uid, []).extend(s.tokens)
        if decoder.cache is not None and step.size == len(decoder.rows):  # a decode step, no prefill just in
            # the sliding layers hold a window per row, not the context
            windows += [c.keys.shape[2] for c in decoder.cache.layers if isinstance(c, BatchRotatingKVCache)]
    for uid, prompt, reference in zip(uids, PROMPTS, references):
        assert out[uid] == reference[len(prompt) : len(prompt) + 40]
    assert windows and max(windows) <= 6 - 1 + 6  # the window's last max_size - 1 + a verify block


@pytest.mark.parametrize("model_type", ["llama", "qwen3_5"])
def test_seeded_sampling_equals_the_same_seed_alone(model_type):
    target = tiny_target(model_type, seed=2)
    model = DFlashModel(target, random_draft(target, block_size=4))
    params = [SamplingParams(temp=0.8), SamplingParams(temp=1.0, top_p=0.9), SamplingParams(temp=0.6, top_k=5)]
    alone = [
        [t for s in decode(model, Request(list(p), 16, sp, seed=7 + i)) for t in s.tokens]
        for i, (p, sp) in enumerate(zip(PROMPTS, params))
    ]
    decoder = Decoder(model)
    uids = [decoder.add(Request(list(p), 16, sp, seed=7 + i)).uid for i, (p, sp) in enumerate(zip(PROMPTS, params))]
    out = run(decoder)
    assert [out[u] for u in uids] == alone


def cost_model(per_token: float) -> CostModel:
    """A target pass of L tokens costs 1 + per_token * (L - 1) units: 0 is a flat curve (a GPU),
    1 a compute-bound one."""
    widths = [1, 2, 4, 8, 16]
    return CostModel(widths, [1.0 + per_token * (w - 1) for w in widths], draft_seconds=0.05)


def decode_all(decoder: Decoder, references: list, max_tokens: int = 30) -> list:
    """Decode PROMPTS in one batch; each step's (size, width).  Asserts every output exact."""
    uids = [decoder.add(Request(list(p), max_tokens, SamplingParams())).uid for p in PROMPTS]
    shapes, out = [], {}
    while decoder.busy:
        step = decoder.step()
        if step.size:
            shapes.append((step.size, step.width))
        for uid, s in step.steps.items():
            out.setdefault(uid, []).extend(s.tokens)
    for uid, prompt, reference in zip(uids, PROMPTS, references):
        assert out[uid] == reference[len(prompt) : len(prompt) + max_tokens]
    return shapes


def assert_settles_plain(shapes: list) -> None:
    """Mostly plain steps, and verify shapes run only until their cost was seen (two steps: one
    is no judgement; a step whose rows were verified apart, in passes of other batch sizes, counts
    under its own) but the drafter's probes (width 2, tried again at doubling gaps)."""
    wide = Counter(shape for shape in shapes if shape[1] > 2)
    probes = sum(width == 2 for _, width in shapes)
    assert max(wide.values(), default=1) <= 3 and len(wide) + probes <= len(shapes) // 4


class WideIsSlow:
    """A target whose verify passes take 10 ms plus 20 ms per token past each row's first on
    `clock` (what a CPU does to a batch), whatever the cost curve says; the decoder reads that
    clock, so the test runs at the tiny target's own speed."""

    def __init__(self, target, clock: Clock):
        self.target, self.clock = target, clock

    def __getattr__(self, name):
        return getattr(self.target, name)

    def __call__(self, tokens, *args, **kwargs):
        if kwargs.get("logits_at") is None:  # prefill passes are not what is judged
            self.clock.now += 0.01 + 0.02 * (tokens.shape[1] - 1)
        return self.target(tokens, *args, **kwargs)


def slow_wide(target) -> tuple[WideIsSlow, Clock]:
    clock = Clock(None)
    return WideIsSlow(target, clock), clock


@pytest.mark.parametrize("per_token, drafts", [(0.0, True), (1.0, False)])
def test_the_batch_width_follows_the_cost_curve(per_token, drafts):
    """With a flat cost curve (and a tiny target, whose passes are that flat) the batch drafts;
    when every verified token costs a full pass (and really does), it decodes plain; the output
    is exact either way."""
    target = tiny_target("llama", seed=2)
    oracle, references = oracle_for(target, PROMPTS, 30)
    slow, clock = slow_wide(target)
    model = DFlashModel(target if drafts else slow, oracle)
    learning = Learning(Planner(cost_model(per_token), 6, prior=0.8))
    shapes = decode_all(Decoder(model, clock=None if drafts else clock, learning=learning), references)
    if drafts:
        assert any(width > 1 for _, width in shapes)
    else:
        assert_settles_plain(shapes)


class Apart(Planner):
    """A planner that verifies the first and last of three rows at the drafter's block in one
    pass and the middle one plain in another, whenever the batch allows it."""

    def passes(self, rows, drafter=True, apart=False):
        if not apart or len(rows) != 3:
            return super().passes(rows, drafter, apart)
        wide = [fixed_plan(rows[i].block, rows[i].left) for i in (0, 2)]
        return [([0, 2], wide), ([1], [PLAIN])]


@pytest.mark.parametrize("model_type", by_family(BATCH_FAMILIES))
def test_passes_over_some_rows_of_a_batch_are_exact(model_type):
    """Rows verified apart (the first and last in a pass of their own: the batch's rows reordered
    to make them consecutive; the middle one plain in another pass) decode exactly what they
    decode alone, on every family whose batch allows it (full attention); the others never run
    a pass over some rows."""
    target = tiny_target(model_type, seed=2)
    oracle, references = oracle_for(target, PROMPTS, 30)
    recorded = Recording(target)
    decoder = Decoder(DFlashModel(recorded, oracle), learning=Learning(Apart(cost_model(0.1), 6)))
    uids = [decoder.add(Request(list(p), 30, SamplingParams())).uid for p in PROMPTS]
    out, apart = {}, 0
    while decoder.busy:
        passes, prefills = len(recorded.passes), len(recorded.prefills)
        step = decoder.step()
        for uid, row in step.steps.items():
            out.setdefault(uid, []).extend(row.tokens)
        verifies = [shape for shape in recorded.passes[passes:] if shape not in recorded.prefills[prefills:]]
        apart += any(rows < step.size for rows, _ in verifies)
    assert [out[uid] for uid in uids] == [r[len(p) : len(p) + 30] for p, r in zip(PROMPTS, references)]
    assert (apart > 5) == BatchTargetCache([target.make_cache()]).splittable


def test_sampled_rows_verified_apart_draw_what_they_draw_alone():
    """Seeded sampling (temperature, top-p, top-k) of rows verified apart equals the same seeds alone."""
    target = tiny_target("llama", seed=2)
    draft = random_draft(target, block_size=4)
    params = [SamplingParams(temp=0.8), SamplingParams(temp=1.0, top_p=0.9), SamplingParams(temp=0.6, top_k=5)]
    alone = [
        [t for s in decode(DFlashModel(target, draft), Request(list(p), 30, sp, seed=7 + i)) for t in s.tokens]
        for i, (p, sp) in enumerate(zip(PROMPTS, params))
    ]
    decoder = Decoder(DFlashModel(target, draft), learning=Learning(Apart(cost_model(0.1), 4)))
    uids = [decoder.add(Request(list(p), 30, sp, seed=7 + i)).uid for i, (p, sp) in enumerate(zip(PROMPTS, params))]
    out, apart = {}, 0
    while decoder.busy:
        step = decoder.step()
        apart += step.passes > 1
        for uid, row in step.steps.items():
            out.setdefault(uid, []).extend(row.tokens)
    assert [out[u] for u in uids] == alone and apart > 5


def test_step_times_learn_each_shape_and_guess_the_others():
    times = StepTimes()
    assert times.ratio(4, 2) == 1.0  # nothing run yet: the cost curve
    times.observe(4, 8, modelled=0.2, seconds=0.5)
    assert times.ratio(4, 8) == 1.0  # one step is no judgement: the curve counts as one of a few runs
    times.observe(4, 8, modelled=0.2, seconds=0.5)
    assert times.ratio(4, 8) == pytest.approx(2.5) and times.ratio(2, 2) == pytest.approx(2.5)
    assert times.ratio(4, 1) == 1.0  # plain steps are judged by plain steps only
    for _ in range(2):
        times.observe(4, 1, modelled=0.1, seconds=0.13)
    assert times.ratio(4, 1) == pytest.approx(1.3) and times.ratio(8, 1) == pytest.approx(1.3)
    assert times.ratio(2, 2) == pytest.approx(1.3)  # as many tokens as a run shape
    assert times.ratio(1, 2) == pytest.approx(1.3)  # below every run shape: the nearest
    assert times.ratio(4, 4) == pytest.approx(2.5)  # the verifies of its batch size, whatever their widths
    assert 1.3 < times.ratio(3, 4) < 2.5  # a batch size with none: between two run shapes
    assert times.ratio(8, 8) == pytest.approx(2.5)  # past them: the nearest
    times.observe(2, 1, modelled=0.1, seconds=2.0)  # one stalled step
    assert times.ratio(2, 1) == 1.0
    assert times.ratio(8, 1) == 1.0  # a plain size not run: the cheapest plain one run
    times.observe(2, 1, modelled=0.1, seconds=0.12)
    assert times.ratio(2, 1) == pytest.approx(1.2)  # stalls only add time: the lower median
    for _ in range(2):
        times.observe(4, 1, modelled=0.1, seconds=0.11)
    times.observe(4, 1, modelled=0.1, seconds=10.0)  # a stall moves the median one rank, not 100x
    assert times.ratio(4, 1) == pytest.approx(1.2)  # plain steps: pairs' means (1.3 + 1.1) / 2
    for _ in range(7):  # the last 7 steps count
        times.observe(4, 1, modelled=0.1, seconds=0.2)
    assert times.ratio(4, 1) == pytest.approx(2.0)


def test_step_times_learnt_over_long_contexts_do_not_judge_short_ones():
    """Attention over a long context costs what the curve (timed at a short one) does not see:
    ratios learnt over 2k-token sessions judge 2k-token steps, not the next 300-token prompt's."""
    times = StepTimes()
    for _ in range(7):
        times.observe(1, 8, modelled=0.1, seconds=0.2, span=context_class(2000))
    assert context_class(300) == 512 and context_class(2000) == 2048 and context_class(2049) == 4096
    assert times.ratio(1, 8, context_class(2000)) == pytest.approx(2.0)
    assert times.ratio(1, 4, context_class(1800)) == pytest.approx(2.0)  # its class: guessed from it
    assert times.ratio(1, 8, context_class(300)) == 1.0  # the curve, until a short step has run
    planner = Planner(cost_model(0.1), 8, step_times=times)
    # what the planner reads of a row here: its context and sampling (plan.Row)
    long_row, short_row = (SimpleNamespace(context_length=n, params=SamplingParams()) for n in (2000, 300))
    assert planner.seconds([long_row], [Plan(8, "dflash")]) == pytest.approx(
        2 * planner.seconds([short_row], [Plan(8, "dflash")])
    )


def test_step_times_are_kept_for_the_next_process(tmp_path, capsys):
    """What the steps taught is saved every `save_every` steps and when the batch empties, read
    back for the same curve, ignored for a re-measured one, and a broken file is a note."""
    store = tmp_path / "costs" / "pair-steps.json"
    times = StepTimes.stored(store, basis=[0.1, 0.2])
    times.save_every = 6
    times.observe(4, 1, modelled=0.1, seconds=0.13)
    for _ in range(2):
        times.observe(4, 2, modelled=0.2, seconds=0.5)
        times.observe(4, 2, modelled=0.2, seconds=0.6, span=4096)
    assert not store.exists()
    times.observe(4, 1, modelled=0.1, seconds=0.13)
    again = StepTimes.stored(store, basis=[0.1, 0.2])
    assert again.ratios == times.ratios and again.ratio(2, 4) == pytest.approx(2.5)
    assert again.ratio(4, 2, span=4096) == pytest.approx(3.0)
    assert StepTimes.stored(store, basis=[0.1, 0.3]).ratios == {}  # another curve
    for junk in ('{"basis": [0.1, 0.2], "shapes": [[4, 1, 512, ["x"]]]}', '{"basis": [0.1, 0.2], "sha'):
        store.write_text(junk)
        assert StepTimes.stored(store, basis=[0.1, 0.2]).ratios == {}
        assert "unreadable" in capsys.readouterr().err

    target = tiny_target("llama", seed=2)
    oracle, references = oracle_for(target, PROMPTS, 12)
    planner = Planner(cost_model(0.1), 6, StepTimes.stored(store, basis=[1.0]))
    decoder = Decoder(DFlashModel(target, oracle), learning=Learning(planner))
    decode_all(decoder, references, max_tokens=12)  # fewer steps than save_every: kept once idle
    kept = StepTimes.stored(store, basis=[1.0])
    assert kept.ratios == planner.step_times.ratios and len(kept.ratios) >= 2


def test_the_batch_learns_what_its_steps_really_cost():
    """The curve says verifying is free; the steps say otherwise: after trying, the batch
    decodes plain, and the output stays exact."""
    target = tiny_target("llama", seed=2)
    oracle, references = oracle_for(target, PROMPTS, 30)
    flat = CostModel([1, 2, 4, 8, 16], [0.01] * 5, draft_seconds=0.0005)
    slow, clock = slow_wide(target)
    learning = Learning(Planner(flat, 6, prior=0.8))
    shapes = decode_all(Decoder(DFlashModel(slow, oracle), clock=clock, learning=learning), references)
    assert any(width > 1 for _, width in shapes[:4])
    assert_settles_plain(shapes)


def test_a_plain_step_judged_too_dear_is_timed_again():
    """Step times kept from a bad day say the plain step is dear (10x the curve, two steps) and
    verifying cheap; the target says otherwise (WideIsSlow).  The batch re-times its plain step
    every `explore_every` steps, finds it cheap (two re-timings outweigh the two dear steps), and
    settles plain; the output stays exact."""
    target = tiny_target("llama", seed=2)
    oracle, references = oracle_for(target, PROMPTS, 40)
    times = StepTimes()
    for rows in (1, 2, 3):
        for _ in range(2):
            times.observe(rows, 1, modelled=1.0, seconds=10.0)
        for width in range(2, 7):
            times.observe(rows, width, modelled=1.0, seconds=0.01)
    planner = Planner(cost_model(1.0), 6, prior=0.8, explore_every=8, step_times=times)
    slow, clock = slow_wide(target)
    shapes = decode_all(Decoder(DFlashModel(slow, oracle), clock=clock, learning=Learning(planner)), references, 40)
    three = [width for size, width in shapes if size == 3]
    retimed = [i for i, width in enumerate(three) if width == 1 and (i == 0 or three[i - 1] > 1)]
    assert retimed[0] <= 8 and len(retimed) <= 2
    assert three[retimed[-1] :].count(1) >= 0.8 * len(three[retimed[-1] :])


def test_rows_drafting_together_pay_for_one_drafter_pass():
    """A drafter pass as dear as 30% of a flat target pass: alone a row gains by drafting
    (1.5 tokens for 1.3 passes), three rows would not if each paid its own pass (4.5 tokens
    for 1.9), but they draft in one pass (4.5 for 1.3 + the per-token share), so they draft."""
    target = tiny_target("llama", seed=2)
    oracle, _ = oracle_for(target, PROMPTS, 30)
    cost = CostModel([1, 2, 4, 8, 16], [1.0] * 5, draft_seconds=0.3, draft_per_token=0.01)
    assert cost.drafter_pass(2, rows=3) == pytest.approx(0.33)
    decoder = Decoder(DFlashModel(target, oracle), learning=Learning(Planner(cost, 2, prior=0.5)))
    for prompt in PROMPTS:
        decoder.add(Request(list(prompt), 30, SamplingParams()))
    while decoder.filling or decoder.waiting:
        decoder.step()
    planner = decoder.learning.planner
    planner.step_times = StepTimes()  # judged by the curve alone
    plans = planner.plan(decoder.rows)
    assert len(plans) == 3 and all(plan.width == 2 and plan.source == "dflash" for plan in plans)
    assert planner.modelled(decoder.rows, plans) == pytest.approx(1.0 + 0.33)


def test_a_token_bound_keeps_long_requests_apart():
    """Rows join only while rows x the longest row's prompt + max_tokens fits the bound; a
    request over it alone still runs, once the batch is empty.  Output exact either way."""
    target = tiny_target("llama", seed=2)
    oracle, references = oracle_for(target, PROMPTS, 20)
    model = DFlashModel(target, oracle)
    longest = max(len(p) for p in PROMPTS) + 20
    for bound, most_rows in ((2 * longest, 2), (longest - 1, 1), (10 * longest, 3)):
        decoder = Decoder(model, max_batch_tokens=bound)
        uids = [decoder.add(Request(list(p), 20, SamplingParams())).uid for p in PROMPTS]
        sizes, out = [], {}
        while decoder.busy:
            step = decoder.step()
            sizes.append(step.size)
            for uid, s in step.steps.items():
                out.setdefault(uid, []).extend(s.tokens)
        assert max(sizes) == most_rows
        for uid, prompt, reference in zip(uids, PROMPTS, references):
            assert out[uid] == reference[len(prompt) : len(prompt) + 20]


def test_batch_generate_equals_generate_alone(tiny_dirs):
    model_dir, draft_dir = tiny_dirs
    model, tokenizer = load(str(model_dir), str(draft_dir), adaptive=False)
    prompts = ["the cat sat", "one two three four", "hello"]
    result = batch_generate(model, tokenizer, prompts, max_tokens=12, max_batch=2)
    assert result.texts == [generate(model, tokenizer, p, max_tokens=12) for p in prompts]
    assert all(r.finish_reason in ("length", "stop") for r in result.responses)

    gen = BatchGenerator(model, tokenizer)
    uid = gen.insert("the cat sat", max_tokens=8, stop=["zzz"], logprobs=2, seed=3, temp=0.7)
    streamed = []
    while gen.busy:
        streamed += [r for u, r in gen.next() if u == uid]
    alone = list(stream_generate(model, tokenizer, "the cat sat", 8, stop=["zzz"], logprobs=2, seed=3, temp=0.7))
    assert "".join(r.text for r in streamed) == "".join(r.text for r in alone)
    assert [lp.token for r in streamed for lp in r.logprobs] == [lp.token for r in alone for lp in r.logprobs]
    with pytest.raises(ValueError, match="max_tokens"):
        gen.insert("hi", max_tokens=0)


def test_a_stop_string_ends_one_row_and_the_others_go_on(tiny_dirs):
    model_dir, draft_dir = tiny_dirs
    model, tokenizer = load(str(model_dir), str(draft_dir), adaptive=False)
    prompts = ["the cat sat", "one two three four", "hello"]
    alone = [generate(model, tokenizer, p, max_tokens=24) for p in prompts]
    stop = alone[0][len(alone[0]) // 3 :][:3]  # met a third of the way into the first answer
    assert stop.strip(), alone[0]
    gen = BatchGenerator(model, tokenizer)
    uids = [gen.insert(prompts[0], max_tokens=24, stop=[stop])] + [gen.insert(p, max_tokens=24) for p in prompts[1:]]
    texts, finish, after = {uid: "" for uid in uids}, {}, 0
    while gen.busy:
        for uid, response in gen.next():
            texts[uid] += response.text
            after += uids[0] in finish
            if response.finish_reason:
                finish[uid] = response.finish_reason
    assert finish[uids[0]] == "stop" and texts[uids[0]] == generate(model, tokenizer, prompts[0], 24, stop=[stop])
    assert [texts[u] for u in uids[1:]] == alone[1:] and after > 0  # the others decoded on after it left


def test_memory_returns_to_its_baseline_after_a_load(monkeypatch):
    """Three waves of requests joining, filling together, one cancelled mid-prefill and one
    mid-decode: once the batch is empty, the memory in use is back where it was."""
    monkeypatch.setattr(engine, "PREFILL_STEP", 16)  # 4 rows filling: 4 tokens each a step
    target = tiny_target("qwen3_5", seed=2)
    model = DFlashModel(target, random_draft(target, block_size=4))
    decoder = Decoder(model, max_batch=4)

    def wave(k: int) -> None:
        uids = [decoder.add(Request(list(p * (k + 1)), 24, SamplingParams())).uid for p in PROMPTS + PROMPTS]
        decoder.step()
        assert uids[2] in [row.uid for row in decoder.filling]  # 30 x (k + 1) prompt tokens
        decoder.remove(uids[2])
        while uids[0] not in [row.uid for row in decoder.rows]:
            decoder.step()
        decoder.remove(uids[0])  # decoding
        run(decoder)

    wave(0)  # first-call allocations are not a leak
    mx.clear_cache()
    baseline = mx.get_active_memory()
    for k in range(3):
        wave(k)
    assert not decoder.busy and decoder.cache is None and decoder.fill_cache is None
    mx.clear_cache()
    assert mx.get_active_memory() <= baseline + 64 * 1024


@pytest.mark.parametrize("model_type", by_family(BATCH_FAMILIES))
def test_answers_decoded_together_serve_their_next_turns(model_type):
    """Two sessions decoded in one batch: the state after each answer is kept when its row
    leaves, and each next turn (prompt + answer + a message) prefills only what is new, exactly."""
    target = tiny_target(model_type, seed=2)
    model = DFlashModel(target, random_draft(target, block_size=4))
    cache = PromptCache(piece_tokens=8)
    prompts = [PROMPTS[0], PROMPTS[2]]
    for turn in range(2):
        decoder = Decoder(model, prompt_cache=cache, max_batch=4)
        requests = [Request(list(p), 12 + 4 * i) for i, p in enumerate(prompts)]
        rows = [decoder.add(r) for r in requests]
        uids = [row.uid for row in rows]
        out = run(decoder)
        for row, prompt, request in zip(rows, prompts, requests):
            alone = [t for s in decode(model, request) for t in s.tokens]
            assert out[row.uid] == alone
            if turn:
                assert row.stats.cached_tokens >= len(prompt) - 4, (model_type, row.stats.cached_tokens)
        prompts = [p + out[uid] + [7, 8, 9] for p, uid in zip(prompts, uids)]
