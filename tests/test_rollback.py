"""Rolling back a sliding-window cache to every prefix of a verified block leaves it exactly
as if only the kept tokens had been fed, whatever comes next (one token or several)."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import RotatingKVCache

from dflash_mlx.costs import measure_costs
from dflash_mlx.rollback import RotatingKV
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


@pytest.mark.parametrize("family", ["gpt_oss", "gemma4_text"])
def test_sliding_targets_measure_costs_beyond_their_window(family):
    """The cost measurement verifies widths 1..16 on a 128-token context and rolls each back
    entirely: with a window of 8 this once failed with 'Negative dimensions not allowed'."""
    target = tiny_target(family, seed=1)
    cost = measure_costs(target, random_draft(target, layer_ids=(0, 1), block_size=4), context=32, repeats=1)
    assert cost.widths[0] == 1 and all(s > 0 for s in cost.seconds)
