"""DFlash 2's candidate selector walks a block's positions in whole-block ops: the path it
takes is the one a walk position by position takes (the next token chosen from the scores
after the token chosen before it), greedy and sampled, one row or several."""

import mlx.core as mx
import pytest
from mlx.utils import tree_map

from dflash_mlx.drafters.dflash2 import CandidateSelector, follow


def walk_position_by_position(selector, hidden, logits, anchor, vocab_ids, temp, noise) -> list[int]:
    """The reference: each position scored after the token chosen at the one before."""
    candidates, unary = selector.candidates(logits, vocab_ids)
    token, path = anchor.reshape(1), []
    for p in range(hidden.shape[0]):
        scores = selector.score(token, hidden[p : p + 1], unary[p : p + 1], candidates[p : p + 1])[0]
        if temp > 0:
            scores = scores.astype(mx.float32) / temp + noise[p][candidates[p]]
        token = candidates[p][mx.argmax(scores)].reshape(1)
        path.append(token.item())
    return path


def random_selector(seed: int, hidden: int = 16, vocab: int = 64) -> CandidateSelector:
    mx.random.seed(seed)
    selector = CandidateSelector(hidden, vocab, rank=8, top_k=4)
    # codebooks large enough that the edge term overrules the logits' order
    selector.update(tree_map(lambda p: p * 8, selector.parameters()))
    return selector


@pytest.mark.parametrize("positions", [1, 2, 5, 15])
@pytest.mark.parametrize("restricted", [False, True])
def test_the_whole_block_walk_is_the_walk_position_by_position(positions, restricted):
    overruled = 0
    for seed in range(6):
        selector = random_selector(seed)
        vocab_ids = mx.array(list(range(0, 64, 2))) if restricted else None
        width = 32 if restricted else 64
        hidden = mx.random.normal((3, positions, 16), key=mx.random.key(seed))
        logits = mx.random.normal((3, positions, width), key=mx.random.key(seed + 100))
        anchors = mx.array([5, 17, 42])
        together = selector.walk(hidden, logits, anchors, vocab_ids, 0.0, None).tolist()
        for row in range(3):
            expected = walk_position_by_position(selector, hidden[row], logits[row], anchors[row], vocab_ids, 0.0, None)
            assert together[row] == expected, (seed, row)
            alone = selector.walk(hidden[row], logits[row], anchors[row], vocab_ids, 0.0, None).tolist()
            assert alone == expected
            best_logits = mx.argmax(logits[row], axis=-1)
            overruled += expected != (best_logits if vocab_ids is None else vocab_ids[best_logits]).tolist()
            noise = mx.random.gumbel((positions, 64), key=mx.random.key(seed + 200 + row))
            sampled = selector.walk(hidden[row], logits[row], anchors[row], vocab_ids, 0.7, noise).tolist()
            assert sampled == walk_position_by_position(
                selector, hidden[row], logits[row], anchors[row], vocab_ids, 0.7, noise
            )
    assert overruled  # paths that are not simply each position's first candidate: the comparison could fail


def test_follow_composes_the_choices_in_order():
    best = mx.array([[2, 2, 2], [1, 0, 2], [2, 2, 0], [0, 1, 1], [1, 2, 0]])
    expected, choice = [], 0
    for row in best.tolist():
        choice = row[choice]
        expected.append(choice)
    assert follow(best).tolist() == expected == [2, 2, 0, 0, 1]
