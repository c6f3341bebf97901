"""What dflash-mlx reads of mlx-lm beyond its public API, named one by one: an mlx-lm release
that renames any of them fails here, not in a user's batch (pyproject pins mlx-lm < 0.33 until
then)."""

import mlx.core as mx
import pytest
from mlx_lm.models import cache

PRIVATE_FIELDS = {
    cache.BatchKVCache: ["_idx"],  # rollback.RaggedBatchKVCache (extend, filter), target.BatchTargetCache.width
    cache.BatchRotatingKVCache: ["_idx", "_offset"],  # rollback.BatchRotatingKV
}
BATCH_CALLS = ["merge", "extend", "extract", "filter", "prepare", "finalize", "trim"]


@pytest.mark.parametrize("kind", list(PRIVATE_FIELDS), ids=lambda kind: kind.__name__)
def test_batch_caches_keep_the_private_fields_rollback_reads(kind):
    rows = cache.KVCache.merge if kind is cache.BatchKVCache else cache.RotatingKVCache.merge
    singles = [cache.KVCache() if kind is cache.BatchKVCache else cache.RotatingKVCache(max_size=8) for _ in range(2)]
    for single, length in zip(singles, (3, 5)):
        single.update_and_fetch(mx.zeros((1, 2, length, 4)), mx.zeros((1, 2, length, 4)))
    batch = rows(singles)
    assert type(batch) is kind
    for name in PRIVATE_FIELDS[kind]:
        assert isinstance(getattr(batch, name, None), int), f"mlx-lm's {kind.__name__} has no int {name} any more"
    assert batch._idx == 5  # the shared write index: the longest row's length
    for call in BATCH_CALLS:
        assert callable(getattr(batch, call, None)), f"mlx-lm's {kind.__name__} has no {call}()"


def test_dynamic_roll_is_still_exported():
    assert callable(cache.dynamic_roll)
