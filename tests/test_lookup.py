"""Prompt-lookup proposals: what they propose, and that decoding with them stays lossless, with a
drafter beside them or without one (the copies then propose alone)."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from dflash_mlx.decode.costs import CostModel
from dflash_mlx.decode.learning import Learning, keep
from dflash_mlx.decode.plan import Planner
from dflash_mlx.decode.decoder import Decoder, decode
from dflash_mlx.decode.request import Request
from dflash_mlx.decode.model import DecodeStats, DFlashModel
from dflash_mlx.decode.lookup import NO_MATCH, Match, PromptLookup
from dflash_mlx.decode.suffix import SuffixStore
from dflash_mlx.sampling import SamplingParams
from tiny_models import Clock, Timed, by_family, random_draft, tiny_target

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def test_proposes_what_followed_the_latest_longest_match():
    lookup = PromptLookup([1, 2, 3, 4, 5, 9, 2, 3, 7, 8])
    assert lookup.propose(4) == NO_MATCH and not lookup.propose(4)  # 8 never occurred before
    lookup.extend([1, 2])
    assert lookup.propose(3) == Match((3, 4, 5), 2)  # (1, 2) was followed by 3 4 5
    lookup.extend([3])
    # (2, 3) occurred twice; (1, 2, 3) once: the longest match wins
    assert lookup.propose(2) == Match((4, 5), 3)
    lookup.extend([7])
    # (2, 3, 7) followed by 8 ...; past the end, the copy repeats its own period
    assert lookup.propose(6) == Match((8, 1, 2, 3, 7, 8), 3)
    assert lookup.propose(0) == NO_MATCH
    assert PromptLookup([5, 5, 5]).propose(4) == Match((5, 5, 5, 5), 2)  # a repeating text keeps repeating


def test_the_occurrence_agreeing_longest_is_copied_and_its_length_class_said():
    """A file written back: its lines share openings (`9 9 9 9` twice), so the latest occurrence
    of the last four tokens is the wrong line; the one whose preceding text agrees longest is
    copied, and the match's length class travels with it."""
    first_line, second_line = [1, 2, 3, 4, 5, 6, 9, 9, 9, 9, 20, 21], [7, 8, 9, 9, 9, 9, 30, 31]
    lookup = PromptLookup(first_line + second_line + [0])
    lookup.extend([1, 2, 3, 4, 5, 6, 9, 9, 9, 9])  # the first line again
    assert lookup.propose(2) == Match((20, 21), 16)  # 10 tokens agree: the class of 9-16
    lookup.extend([20, 21, 7, 8, 9, 9, 9, 9])
    assert lookup.propose(2).tokens == (30, 31)
    assert PromptLookup([5, 6, 7, 8, 1, 5, 6, 7, 8]).propose(1) == Match((1,), 4)  # four tokens: class 4


def test_after_an_edit_the_copy_resumes_where_it_left_off():
    """A rename: the copy runs until the new name, whose tokens never occurred; the next short match
    is looked for near where the copy had got to, not at its latest occurrence anywhere."""
    source = [10, 11, 12, 13, 5, 14, 15, 16, 17, 18, 19, 5, 20, 21]  # `5` (a comma) twice
    lookup = PromptLookup(source + [0, 99] + [5, 30, 31])  # a later comma elsewhere
    lookup.extend([10, 11, 12, 13])
    assert lookup.propose(3).tokens == (5, 14, 15)
    lookup.extend([77, 5])  # an edit: 77 where the source had nothing, then the comma
    assert lookup.propose(3) == Match((14, 15, 16), 1)  # the comma near the copy, not the latest
    assert PromptLookup(source + [0, 99] + [5, 30, 31, 77, 5]).propose(2).tokens == (30, 31)  # no copy yet: the latest


def test_nothing_is_copied_from_an_end_of_turn_on():
    """A chat prompt: the user's code block opens (`FENCE 7`) and closes (`FENCE END`), and the
    template's turn change follows the close.  An answer opening with a fence is offered what
    followed the opening one, not the turn change; a copy running into an end of turn stops there."""
    FENCE, END = 60, 99
    prompt = [1, 2, FENCE, 7, 8, 9, 3, FENCE, END, 50, 51] + [FENCE]
    assert PromptLookup(prompt, ends=frozenset({END})).propose(4) == Match((7, 8, 9, 3), 1)
    assert PromptLookup(prompt).propose(4).tokens == (END, 50, 51, FENCE)  # what it was before
    lookup = PromptLookup([4, 5, 6, END, 4, 5], ends=frozenset({END}))
    assert lookup.propose(4) == Match((6, END), 2)


def test_a_single_token_match_says_so():
    lookup = PromptLookup([1, 2, 3, 1])
    assert lookup.propose(3) == Match((2, 3, 1), 1)  # a weak hint: the plan judges it by its own record
    assert PromptLookup([1, 2, 3, 1], min_ngram=2).propose(3) == NO_MATCH


COST = CostModel([1, 2, 4, 8], [0.010, 0.011, 0.013, 0.017], 0.004, 0.0005)


def decoded(model, params=SamplingParams(), seed=None, max_tokens=48, block_size=None):
    stats, clock = DecodeStats(), getattr(model.target, "clock", None)
    request = Request(list(PROMPT), max_tokens, params, seed=seed, block_size=block_size)
    steps = decode(model, request, clock=clock, stats=stats)
    return [t for s in steps for t in s.tokens], stats


def lookup_model(target):
    """The drafter's drafts are rejected: only the lookup can pay here.  Its passes take what
    the cost curve says, on an injected clock."""
    model = DFlashModel(Timed(target, Clock(COST)), random_draft(target, block_size=8))
    keep(model, Learning(Planner(COST, 8)))  # what its decode() calls learn with
    return model


def test_greedy_lookup_decoding_equals_plain_greedy():
    target = tiny_target("qwen3", seed=1)  # its greedy text settles into repeating itself
    reference = [int(t) for t, _ in generate_step(mx.array(PROMPT), target.model, max_tokens=48)]
    tokens, stats = decoded(lookup_model(target))
    assert tokens == reference
    lookups = [n for n, s in zip(stats.accepted_lengths, stats.sources) if s == "lookup"]
    assert lookups and max(lookups) >= 4  # long runs committed in one target pass


# ------------------------------------------------------------ a target without a drafter


def copying(target, widest: int = 8):
    """`target` alone (no drafter), served by copies from the prompt and earlier answers, chosen
    by a planner over COST; its passes take what COST says, on an injected clock."""
    model = DFlashModel(Timed(target, Clock(COST)))
    keep(model, Learning(Planner(COST, widest), SuffixStore()))
    return model


def copied(stats: DecodeStats) -> list[int]:
    """The tokens each copying cycle committed."""
    return [n for n, source in zip(stats.accepted_lengths, stats.sources) if source in ("lookup", "suffix")]


def test_a_target_without_a_drafter_is_served_by_the_prompt_lookup():
    target = tiny_target("qwen3", seed=1)  # its greedy text settles into repeating itself
    reference = [int(t) for t, _ in generate_step(mx.array(PROMPT), target.model, max_tokens=48)]
    tokens, stats = decoded(copying(target))
    assert tokens == reference
    assert "dflash" not in stats.sources and max(copied(stats)) >= 4  # long runs accepted in one pass
    assert stats.adaptive and stats.block_size == 8


def test_without_a_planner_a_target_alone_decodes_plainly():
    """Nothing judges when a copy's wider verify pays: one token a pass, as asked."""
    target = tiny_target("qwen3", seed=1)
    model = DFlashModel(target)
    keep(model, Learning())
    _, stats = decoded(model)
    assert set(stats.sources) == {"plain"} and not stats.adaptive
    _, fixed = decoded(copying(target), max_tokens=16, block_size=1)  # a fixed width of 1: plain too
    assert set(fixed.sources) == {"plain"}


@pytest.mark.parametrize("model_type", by_family(["llama", "qwen3_5", "gpt_oss", "gemma3_text"]))
def test_a_target_without_a_drafter_copies_its_earlier_answer(model_type):
    """The same prompt again (an agent's retried turn): the store of earlier answers proposes the
    first answer, accepted whole, on every kind of cache state rolled back (sliding windows,
    recurrent layers), and the output is still plain greedy's."""
    target = tiny_target(model_type, seed=1)
    prompt = [5, 17, 33, 2, 41, 8, 60, 12]
    reference = [int(t) for t, _ in generate_step(mx.array(prompt), target.model, max_tokens=32)]
    model = copying(target)
    answers = []
    for _ in range(2):
        stats = DecodeStats()
        steps = decode(model, Request(list(prompt), 32), clock=model.target.clock, stats=stats)
        answers.append(([t for s in steps for t in s.tokens], stats))
    assert [tokens for tokens, _ in answers] == [reference, reference]
    second = answers[1][1]
    assert "suffix" in second.sources and max(copied(second)) >= 4


def test_batched_beside_other_requests_each_row_is_plain_greedy():
    target = tiny_target("qwen3", seed=1)
    model = copying(target)
    prompts = [PROMPT, [1, 5, 9, 13, 2, 7, 40, 3], [60, 61, 62]]
    decoder = Decoder(model, max_batch=3, clock=model.target.clock)
    stats = [DecodeStats() for _ in prompts]
    uids = [decoder.add(Request(list(p), 40), s).uid for p, s in zip(prompts, stats)]
    out = {}
    while decoder.busy:
        for uid, step in decoder.step().steps.items():
            out.setdefault(uid, []).extend(step.tokens)
    decoder.close()
    for uid, prompt in zip(uids, prompts):
        assert out[uid] == [int(t) for t, _ in generate_step(mx.array(prompt), target.model, max_tokens=40)]
    assert max(copied(stats[0])) >= 4


@pytest.mark.parametrize("copier", [lookup_model, copying], ids=["beside-a-drafter", "without-a-drafter"])
def test_seeded_sampling_with_copies_equals_plain_sampling(copier):
    target = tiny_target("qwen3", seed=1)
    params = SamplingParams(temp=0.3)
    plain, _ = decoded(DFlashModel(target), params, seed=7)
    tokens, stats = decoded(copier(target), params, seed=7)
    assert tokens == plain
    assert max(copied(stats)) >= 2  # a copied token was accepted, not only proposed
