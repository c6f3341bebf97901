"""Session-wide suffix drafts (suffix.py): the store of earlier answers proposes what they most
often said after the longest match of the current text, stops where they disagree, stays
bounded, and a request that repeats an earlier answer copies it, losslessly."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from dflash_mlx.decode.decoder import Decoder
from dflash_mlx.decode.learning import Learning
from dflash_mlx.decode.lookup import NO_MATCH
from dflash_mlx.decode.model import DFlashModel
from dflash_mlx.decode.plan import Planner
from dflash_mlx.decode.request import Request
from dflash_mlx.decode.lookup import match_bucket
from dflash_mlx.decode.suffix import SuffixStore
from tiny_models import Clock, Timed, random_draft, tiny_target
from test_plan import cpu_like


def test_the_most_frequent_continuation_of_the_longest_match():
    store = SuffixStore(min_match=2, min_share=0.0)
    store.add([], [1, 2, 3, 9, 9])
    store.add([], [1, 2, 3, 7, 7])
    store.add([], [5, 2, 3, 8, 8])
    store.add([], [5, 2, 3, 8, 6])
    # (2, 3) was followed by 9, 7, 8, 8: a 2-token match goes with the majority...
    assert store.propose([4, 2, 3], 1).tokens == (8,)
    # ...but a longer match (1, 2, 3) only with what followed it: 7 (latest) or 9, once each
    found = store.propose([1, 2, 3], 2)
    assert found.tokens == (7, 7) and found.source == "suffix" and found.length == match_bucket(3)


def test_a_proposal_stops_where_earlier_answers_disagree():
    store = SuffixStore(min_match=2, min_share=0.5)
    for tail in ([4, 5, 6], [4, 5, 6], [4, 5, 1], [4, 2, 2]):
        store.add([], [1, 2, 3, *tail])
    # after (2, 3): 4 always (share 1), then 5 in 3 of 4 (0.75), then 6 in 2 of 3 (0.5): stop below
    assert store.propose([2, 3], 8).tokens == (4, 5, 6)
    assert SuffixStore(min_match=2, min_share=0.6).propose([2, 3], 8) is NO_MATCH  # empty store
    strict = SuffixStore(min_match=2, min_share=0.6)
    for tail in ([4, 5, 6], [4, 5, 6], [4, 5, 1], [4, 2, 2]):
        strict.add([], [1, 2, 3, *tail])
    assert strict.propose([2, 3], 8).tokens == (4, 5)


def test_no_match_runs_across_answers_or_past_the_last_token():
    store = SuffixStore(min_match=2, min_share=0.0, context=2)
    store.add([8, 9, 10], [1, 2])
    store.add([8, 9, 11], [3, 4, 5])
    assert store.propose([1, 2], 4) is NO_MATCH  # (1, 2) ends an answer: nothing came after it
    assert store.propose([9, 11], 5).tokens == (3, 4, 5)  # the prompt's last tokens lead into the answer
    assert store.propose([6, 7], 3) is NO_MATCH and store.propose([1], 3) is NO_MATCH
    assert store.propose([9, 11], 0) is NO_MATCH


def test_the_store_stays_bounded_and_keeps_its_latest_answers():
    store = SuffixStore(capacity=400, min_match=3)
    for k in range(100):
        store.add([], [1000 + k, 1, 2, 3, 500 + k, 6, 7, 8])
        assert len(store) <= 400
    assert store.propose([1099, 1, 2, 3], 2).tokens == (599, 6)  # the latest answer, exactly
    assert store.propose([1000, 1, 2, 3], 2).tokens != (500, 6)  # the first one was dropped
    assert all(len(positions) <= 2 * store.max_positions for positions in store._ends.values())


@pytest.mark.parametrize("max_batch", [1, 2])
def test_a_request_copies_an_earlier_answer_losslessly(max_batch):
    """The second request for the same prompt copies the first one's answer from the store
    (its own prompt has no such text): the same tokens, in far fewer target passes; alone, and
    beside another request in a batch."""
    target = tiny_target("llama", seed=5)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    reference = [int(t) for t, _ in generate_step(mx.array(prompt), target.model, max_tokens=40)]
    cost = cpu_like(base=0.01, draft=0.0012)
    clock = Clock(cost)
    model = DFlashModel(Timed(target, clock), random_draft(target, block_size=16))
    learning, passes = Learning(Planner(cost, 16), SuffixStore()), []
    for _ in range(2):
        decoder = Decoder(model, max_batch=max_batch, clock=clock, learning=learning)
        row = decoder.add(Request(prompt, 40))
        if max_batch > 1:
            decoder.add(Request([9, 8, 7, 6], 40))
        while decoder.busy:
            decoder.step()
        assert row.output == reference
        passes.append(row.stats.cycles)
    assert "suffix" in row.stats.sources and passes[1] < passes[0] / 2
