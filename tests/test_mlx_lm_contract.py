"""What dflash-mlx reads of mlx-lm beyond its public API, named one by one: an mlx-lm release
that renames any of them fails here, not in a user's batch.  All of it is read or written in
target/mlx_lm_compat.py alone (checked below)."""

import re
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models import cache

from dflash_mlx.target import mlx_lm_compat

PRIVATE_FIELDS = {
    cache.BatchKVCache: ["_idx"],  # rollback.RaggedBatchKVCache (extend, filter), target.BatchTargetCache.width
    cache.BatchRotatingKVCache: ["_idx", "_offset"],  # rollback.BatchRotatingKV
}
PRIVATE_NAMES = re.compile(
    r"\._idx\b|\._offset\b|\._temporal_order\b|_get_classes|\.state\s*=\s*\(|= [a-z_.]*cache\.state$"
)
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


def test_a_batch_of_windows_is_put_in_temporal_order_still():
    """After a one-token step rotated the ring, in_temporal_order leaves it unrotated, the oldest
    entry first (rollback.BatchRotatingKV.checkpoint)."""
    singles = [cache.RotatingKVCache(max_size=4) for _ in range(2)]
    for single in singles:
        single.update_and_fetch(mx.arange(4.0).reshape(1, 1, 4, 1), mx.zeros((1, 1, 4, 1)))
    batch = cache.RotatingKVCache.merge(singles)
    batch.update_and_fetch(mx.full((2, 1, 1, 1), 4.0), mx.zeros((2, 1, 1, 1)))
    assert batch.rotated
    mlx_lm_compat.in_temporal_order(batch)
    assert not batch.rotated and batch._idx == 4 and batch.keys[0, 0, :, 0].tolist() == [1.0, 2.0, 3.0, 4.0]


def test_dynamic_roll_is_still_exported():
    assert callable(cache.dynamic_roll)


def test_a_window_state_is_still_its_six_tuple():
    window = cache.RotatingKVCache(max_size=8)
    window.update_and_fetch(mx.zeros((1, 2, 3, 4)), mx.zeros((1, 2, 3, 4)))
    keys, values, offset, keep, max_size, idx = mlx_lm_compat.rotating_state(window)
    assert (keys.shape[2], offset, max_size, idx) == (3, 3, 8, 3)
    mlx_lm_compat.set_rotating_state(window, keys[..., :2, :], values[..., :2, :], 2, keep, max_size, 2)
    assert window.offset == 2 and mlx_lm_compat.rotating_state(window)[5] == 2


def test_a_configs_model_classes_are_still_found():
    model_class, args_class = mlx_lm_compat.model_classes({"model_type": "llama"})
    assert model_class.__module__ == "mlx_lm.models.llama" and args_class.__name__ == "ModelArgs"


def test_no_other_module_touches_mlx_lms_private_names():
    package = Path(mlx_lm_compat.__file__).parent.parent
    touching = [
        f"{path.relative_to(package)}:{n}: {line.strip()}"
        for path in package.rglob("*.py")
        if path.name != "mlx_lm_compat.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if PRIVATE_NAMES.search(line)
    ]
    assert not touching, "read mlx-lm's private names through target/mlx_lm_compat.py:\n" + "\n".join(touching)
