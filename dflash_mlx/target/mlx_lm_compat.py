"""Everything dflash-mlx reads or writes of mlx-lm beyond its public API, in one place.

An mlx-lm release that renames or reshapes any of these fails tests/test_mlx_lm_contract.py,
which names each one, instead of a user's batch; the rest of the package uses mlx-lm's
public API only (the contract test also checks that no other module touches these names).

- `BatchKVCache._idx`, `BatchRotatingKVCache._idx`: a batch's shared write index, the
  longest row's end (rollback.RaggedBatchKVCache moves it; the batch's width reads it)
- `BatchRotatingKVCache._offset`: tokens the batch's windows have seen
- `BatchRotatingKVCache._temporal_order()`: its ring put in temporal order (before a verify)
- `RotatingKVCache.state`: its 6-tuple layout (keys, values, offset, keep, max_size, idx)
- `mlx_lm.utils._get_classes`: a config's model and arguments classes (the GGUF converter)
"""

from mlx_lm.models.cache import RotatingKVCache


def write_index(cache) -> int:
    """A batch cache's shared write index: the longest row's end."""
    return cache._idx


def set_write_index(cache, index: int) -> None:
    cache._idx = index


def window_seen(cache) -> int:
    """Tokens a batch of sliding windows has seen (BatchRotatingKVCache)."""
    return cache._offset


def in_temporal_order(cache) -> None:
    """A batch of sliding windows' ring put in temporal order (BatchRotatingKVCache), as its
    multi-token update does first."""
    cache._temporal_order()


def drop_window_tail(cache, drop: int) -> None:
    """A batch of sliding windows without its last `drop` positions (in temporal order)."""
    cache.keys, cache.values = cache.keys[..., :-drop, :], cache.values[..., :-drop, :]
    cache._idx, cache._offset, cache.offset = cache._idx - drop, cache._offset - drop, cache.offset - drop


def rotating_state(cache: RotatingKVCache) -> tuple:
    """(keys, values, offset, keep, max_size, idx) of one sliding window."""
    keys, values, offset, keep, max_size, idx = cache.state
    return keys, values, offset, keep, max_size, idx


def set_rotating_state(cache: RotatingKVCache, keys, values, offset: int, keep: int, max_size: int, idx: int) -> None:
    cache.state = (keys, values, offset, keep, max_size, idx)


def model_classes(config: dict) -> tuple:
    """The mlx-lm model class and its arguments class for a model config."""
    from mlx_lm.utils import _get_classes

    return _get_classes(config)
