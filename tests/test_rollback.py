"""Rolling back a sliding-window cache to every prefix of a verified block leaves it exactly
as if only the kept tokens had been fed, whatever comes next (one token or several); a batch's
rows roll back to their own prefixes without moving their keys."""

import mlx.core as mx
import pytest
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache

from dflash_mlx.decode.costs import measure_costs
from dflash_mlx.decode.rows import tail_into_holes
from dflash_mlx.target.rollback import BatchTrimmableKV, RaggedBatchKVCache, RotatingKV
from tiny_models import random_draft, tiny_target

H, D = 2, 4


def tokens(start: int, count: int) -> tuple[mx.array, mx.array]:
    """Keys/values of `count` positions, position p holding the value p everywhere."""
    positions = mx.arange(start, start + count, dtype=mx.float32)[None, None, :, None]
    return mx.broadcast_to(positions, (1, H, count, D)), mx.broadcast_to(-positions, (1, H, count, D))


def feed(cache, start: int, count: int, one_by_one: bool = False):
    if one_by_one:
        for p in range(start, start + count):
            out = cache.update_and_fetch(*tokens(p, 1))
        return out
    return cache.update_and_fetch(*tokens(start, count))


def visible(cache_output) -> list[float]:
    """The positions a query would attend to next, in the cache's layout, as a sorted list."""
    keys, _ = cache_output
    return sorted(keys[0, 0, :, 0].tolist())


@pytest.mark.parametrize("window", [4, 8, 64])
@pytest.mark.parametrize("context", [3, 8, 12, 30])
@pytest.mark.parametrize("next_tokens", [1, 3])
def test_rollback_to_every_keep_matches_a_fresh_cache(window, context, next_tokens):
    block = 5
    for keep in range(0, block + 1):
        ours, fresh = RotatingKVCache(max_size=window), RotatingKVCache(max_size=window)
        feed(ours, 0, context)
        handler = RotatingKV(ours)
        handler.checkpoint()
        feed(ours, context, block)  # the verify pass
        handler.rollback(keep)
        feed(fresh, 0, context)
        if keep:
            feed(fresh, context, keep)
        assert ours.offset == fresh.offset
        # then decoding goes on: one plain step, or a multi-token verify
        got = feed(ours, context + keep, next_tokens, one_by_one=next_tokens == 1)
        want = feed(fresh, context + keep, next_tokens, one_by_one=next_tokens == 1)
        assert visible(got)[-window:] == visible(want)[-window:], (keep, window, context)
        assert max(visible(got)) == context + keep + next_tokens - 1
        # and again, after a second plain step (the ring wraps)
        assert (
            visible(feed(ours, context + keep + next_tokens, 1))[-window:]
            == visible(feed(fresh, context + keep + next_tokens, 1))[-window:]
        )


@pytest.mark.parametrize("family", ["gpt_oss", "gemma3_text", "gemma4_text"])
def test_sliding_targets_measure_costs_beyond_their_window(family):
    """The cost measurement verifies widths 1..16 on a 128-token context and rolls each back
    entirely: with a window of 8 this once failed with 'Negative dimensions not allowed'."""
    target = tiny_target(family, seed=1)
    cost = measure_costs(target, random_draft(target, layer_ids=(0, 1), block_size=4), context=32, repeats=1)
    assert cost.widths[0] == 1 and all(s > 0 for s in cost.seconds)


def ragged_batch(*lengths: int) -> RaggedBatchKVCache:
    """Rows of `lengths` positions (position p holding p), merged into one batch."""
    rows = [KVCache() for _ in lengths]
    for row, length in zip(rows, lengths):
        row.update_and_fetch(*tokens(0, length))
    return RaggedBatchKVCache.merge(rows)


def test_a_batch_verify_rolls_rows_back_without_moving_their_keys():
    """Rows keeping different prefixes of a verify end where each ends: the keys stay where they
    were written (mlx-lm's batch would roll each shorter row over its whole length), and each row
    then sees exactly its own tokens, in order."""
    batch = ragged_batch(3, 6)
    handler = BatchTrimmableKV(batch)
    handler.checkpoint()
    batch.update_and_fetch(*(mx.concatenate([x, x]) for x in tokens(100, 4)))
    written = batch.keys
    handler.rollback([1, 3])
    assert batch.keys is written and batch.ends == [7, 9] and batch.offset.tolist() == [4, 9]
    mask = batch.make_mask(2)  # the next pass: two tokens a row
    keys, _ = batch.update_and_fetch(*(mx.concatenate([x, x]) for x in tokens(200, 2)))
    for row, want in enumerate([[0, 1, 2, 100, 200, 201], [0, 1, 2, 3, 4, 5, 100, 101, 102, 200, 201]]):
        seen = [keys[row, 0, j, 0].item() for j in range(keys.shape[2]) if mask[row, 0, 1, j].item()]
        assert seen == want, row


def seen_by_rows(batch: RaggedBatchKVCache, start: int) -> list[list[float]]:
    """What each row's query sees at a pass of one token each (position `start` + row) written now."""
    rows = len(batch.ends)
    mask = batch.make_mask(1)
    written = [tokens(start + r, 1) for r in range(rows)]
    keys, _ = batch.update_and_fetch(*(mx.concatenate(part) for part in zip(*written)))
    return [[keys[r, 0, j, 0].item() for j in range(keys.shape[2]) if mask[r, 0, 0, j].item()] for r in range(rows)]


@pytest.mark.parametrize("joining", [2, 9, 300])
def test_a_row_joins_into_the_row_one_left_without_copying_the_others(joining):
    """A request ending leaves its row spare (the first rows kept as they are, not copied); a row
    joining is written into it from position 0, the rows there untouched, unless it is longer
    than the arrays hold (then new arrays); every row sees exactly its own tokens."""
    batch = ragged_batch(3, 6, 5)
    batch.update_and_fetch(*(mx.concatenate([x, x, x]) for x in tokens(100, 2)))
    arrays = batch.keys
    batch.filter(mx.array([0, 1]))
    assert batch.keys is arrays and batch.keys.shape[0] == 3 and batch.ends == [8, 8]
    batch.extend(ragged_batch(joining))
    assert (batch.keys.shape[0], batch.ends) == (3, [8, 8, joining])
    assert (batch.keys is arrays) == (joining <= arrays.shape[2])
    assert seen_by_rows(batch, 200) == [
        [0, 1, 2, 100, 101, 200],
        [0, 1, 2, 3, 4, 5, 100, 101, 201],
        list(range(joining)) + [202],
    ]
    batch.filter(mx.array([2, 0]))  # row 0 not in its place nor from past the rows kept: gathered, one spare
    assert batch.keys.shape[0] == 3 and batch.ends == [joining + 1, 9]
    assert seen_by_rows(batch, 300) == [list(range(joining)) + [202, 300], [0, 1, 2, 100, 101, 200, 301]]


def test_a_row_leaving_takes_the_last_row_into_its_place():
    """The decoder moves the last rows into the places of those leaving (rows.tail_into_holes):
    the batch then copies those rows alone, in its own arrays, and every row sees its own tokens."""
    assert tail_into_holes(4, {0}) == [3, 1, 2] and tail_into_holes(4, {1, 3}) == [0, 2]
    assert tail_into_holes(5, {0, 1}) == [3, 4, 2] and tail_into_holes(3, {2}) == [0, 1]
    batch = ragged_batch(3, 6, 5)
    arrays = batch.keys
    batch.filter(mx.array(tail_into_holes(3, {0})))
    assert batch.keys is arrays and batch.ends == [6, 6] and batch.left_padding.tolist() == [1, 0]
    assert seen_by_rows(batch, 100) == [[0, 1, 2, 3, 4, 100], [0, 1, 2, 3, 4, 5, 101]]


@pytest.mark.parametrize("window", [None, 3])
def test_an_aligned_batch_masks_as_mlx_lm_does(window):
    batch = ragged_batch(2, 5)
    want = create_causal_mask(3, offset=5, window_size=window, left_padding=batch.left_padding)
    assert mx.array_equal(batch.make_mask(3, window_size=window), mx.broadcast_to(want, (2, 1, 3, 8)))
