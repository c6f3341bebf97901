"""Roll a target cache back to a prefix of the block it just verified.

One small class per cache kind, all with the same two calls:

    checkpoint()   before the verify pass
    rollback(keep) after it: keep only the first `keep` tokens fed since

so the decode loop never asks what kind of layer it is talking to.  The batch
handlers (Batch*) take one keep per row: each row of a batched verify keeps its
own accepted prefix.
"""

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache, dynamic_roll

from .gated_delta import Tape


class TrimmableKV:
    """Full-attention KV cache: dropping the tail is an offset change."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self._start = 0

    def checkpoint(self):
        self._start = self.cache.offset

    def rollback(self, keep: int):
        self.cache.trim(self.cache.offset - (self._start + keep))


class RotatingKV:
    """Sliding-window KV cache.

    A multi-token update leaves mlx-lm's RotatingKVCache in temporal order
    (window-1 old entries followed by the block), so rolling back is slicing the
    tail off; its own trim() assumes the ring layout and is only valid before
    the window first fills.  A one-token verify (the only kind that writes the
    ring in place) never has anything to drop.
    """

    def __init__(self, cache: RotatingKVCache):
        self.cache = cache
        self._start = 0

    def checkpoint(self):
        self._start = self.cache.offset

    def rollback(self, keep: int):
        drop = self.cache.offset - (self._start + keep)
        if drop <= 0:
            return
        keys, values, offset, keep_first, max_size, _ = self.cache.state
        keys, values, offset = keys[..., :-drop, :], values[..., :-drop, :], offset - drop
        end = keys.shape[2]
        if end < max_size <= offset:
            # Everything the verify wrote was dropped from a full window: max_size - 1 entries
            # are left, and mlx-lm's one-token update expects a full ring once the offset is past
            # the window (else it asks for a negative-size buffer).  One free slot at the end
            # makes it one: the next token is written there, and a multi-token update puts it
            # first in temporal order and trims it as the oldest entry.
            pad = [(0, 0)] * (keys.ndim - 2) + [(0, max_size - end), (0, 0)]
            keys, values = mx.pad(keys, pad), mx.pad(values, pad)
        self.cache.state = (keys, values, offset, keep_first, max_size, end)


class GatedDeltaState:
    """GatedDeltaNet conv + recurrent state: restore, then replay the accepted steps."""

    def __init__(self, cache: ArraysCache):
        self.cache = cache
        self.tape: Tape | None = None
        self._saved = (None, None)
        # Only a checkpointed (verify) pass records a tape: a prefill chunk's
        # tape would pin its activations in memory for nothing.
        self.recording = False

    def checkpoint(self):
        self._saved = (self.cache[0], self.cache[1])
        self.tape, self.recording = None, True

    def record(self, tape: Tape):
        self.tape = tape

    def rollback(self, keep: int):
        if self.tape is None:
            raise RuntimeError("GatedDeltaNet rollback needs the tape of a checkpointed pass")
        if keep < self.tape.length:
            self.cache[0], self.cache[1] = self.tape.replay(self._saved[1], keep)
        self.tape, self.recording = None, False


class BatchTrimmableKV:
    """Full-attention KV of a batch (mlx-lm's BatchKVCache: rows share one write index, shorter
    rows are left-padded).  The batch is trimmed to its longest kept prefix and every shorter
    row is rolled right by what it keeps less, so all rows end at the shared index again; the
    rejected tokens end up in the row's left padding, which the mask hides (mlx-lm's own
    right-to-left padding step)."""

    def __init__(self, cache: BatchKVCache):
        self.cache = cache
        self._start = 0

    def checkpoint(self):
        self._start = self.cache._idx

    def rollback(self, keep: list[int]):
        longest = max(keep)
        self.cache.trim(self.cache._idx - (self._start + longest))
        if min(keep) < longest:
            self.cache.prepare(right_padding=[longest - k for k in keep])
            self.cache.finalize()


class BatchRotatingKV:
    """Sliding-window KV of a batch (mlx-lm's BatchRotatingKVCache).  A verify pass leaves it in
    temporal order (the window's last max_size - 1 entries, then the block), so, as for one row,
    the batch drops the tail past its longest kept prefix; then each shorter row is rolled right by
    what it keeps less, its rejected tokens becoming masked left padding.  Padding is counted from
    the buffer's start: a full window's left padding is negative (trimmed), so it restarts at 0.
    Every row keeps at least one token, so the window stays full once it has filled."""

    def __init__(self, cache: BatchRotatingKVCache):
        self.cache = cache
        self._start = 0

    def checkpoint(self):
        self._start = self.cache._offset

    def rollback(self, keep: list[int]):
        c, longest = self.cache, max(keep)
        drop = c._offset - (self._start + longest)
        if drop > 0:
            c.keys, c.values = c.keys[..., :-drop, :], c.values[..., :-drop, :]
            c._idx, c._offset, c.offset = c._idx - drop, c._offset - drop, c.offset - drop
        if min(keep) < longest:
            shift = mx.array([longest - k for k in keep])
            c.keys = dynamic_roll(c.keys, shift[:, None], axis=2)
            c.values = dynamic_roll(c.values, shift[:, None], axis=2)
            c.left_padding = mx.maximum(c.left_padding, 0) + shift
            c.offset = c.offset - shift


class BatchGatedDeltaState(GatedDeltaState):
    """GatedDeltaNet states of a batch: each row replays its own number of accepted steps."""

    def rollback(self, keep: list[int]):
        if self.tape is None:
            raise RuntimeError("GatedDeltaNet rollback needs the tape of a checkpointed pass")
        if min(keep) < self.tape.length:
            self.cache[0], self.cache[1] = self.tape.replay_rows(self._saved[1], keep)
        self.tape, self.recording = None, False


class UnsupportedCache(TypeError):
    pass


def checkpointed(cache: Any):
    """Wrap one mlx-lm layer cache in the rollback protocol that fits it.  An
    ArraysCache is taken for a GatedDeltaNet state; the target checks that its
    model has a recording mixer for each (target.py)."""
    if isinstance(cache, RotatingKVCache):
        return RotatingKV(cache)
    if type(cache) is KVCache:  # subclasses (quantized, chunked) store and trim differently
        return TrimmableKV(cache)
    if type(cache) is ArraysCache:
        return GatedDeltaState(cache)
    raise UnsupportedCache(
        f"dflash-mlx cannot roll back a {type(cache).__name__} yet; "
        "supported caches: KVCache, RotatingKVCache, GatedDeltaNet state"
    )


def checkpointed_batch(cache: Any):
    """The batch counterpart of `checkpointed`, for a layer cache merged from rows' caches."""
    if type(cache) is BatchKVCache:
        return BatchTrimmableKV(cache)
    if type(cache) is BatchRotatingKVCache:
        return BatchRotatingKV(cache)
    if type(cache) is ArraysCache:
        return BatchGatedDeltaState(cache)
    raise UnsupportedCache(
        f"dflash-mlx cannot batch a {type(cache).__name__}; "
        "batched caches: KVCache, RotatingKVCache, GatedDeltaNet state"
    )
