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
from .mlx_lm_compat import (
    drop_window_tail,
    in_temporal_order,
    rotating_state,
    set_rotating_state,
    set_write_index,
    window_seen,
    write_index,
)


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
        keys, values, offset, keep_first, max_size, _ = rotating_state(self.cache)
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
        set_rotating_state(self.cache, keys, values, offset, keep_first, max_size, end)


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


class RaggedBatchKVCache(BatchKVCache):
    """mlx-lm's BatchKVCache whose rows end where each row ends: a row writes after its own last
    token and attends up to it.  In mlx-lm's batch every row ends at one shared index, so a row
    that keeps fewer tokens of a verify than another must be rolled right over its whole length,
    a copy of every row's keys and values per step; here rolling a row back is moving its end.
    Between a row's end and the longest row's lie tokens it dropped, hidden by its mask as
    its left padding is.  Its write index (mlx_lm_compat) is the longest row's end.

    Rows need not end together, so a row joining is written from position 0 into a row the
    arrays hold spare (one left by a request that ended, kept for the next: an agent's next
    turn), and the rows already there are not copied; the arrays are copied only when they
    have no row spare or are too short for it."""

    def __init__(self, left_padding: list[int]):
        super().__init__(left_padding)
        self.ends = [0] * len(left_padding)  # where each row's next token goes
        self._prefill_ends = None

    def end_rows_at(self, ends: list[int]):
        self.ends = list(ends)
        self.offset = mx.array(self.ends) - self.left_padding
        set_write_index(self, max(self.ends))

    def update_and_fetch(self, keys, values, rows: slice = slice(None)):
        """Write a pass's keys and values after each of `rows`' ends (every row by default); those
        rows' keys and values up to the longest of them."""
        rows = slice(*rows.indices(len(self.ends)))  # the rows held (the arrays may hold spare ones)
        n, ends = keys.shape[2], self.ends[rows]
        self._reserve(keys, values, max(ends) + n)
        if len(set(ends)) == 1:
            self.keys[rows, :, ends[0] : ends[0] + n] = keys
            self.values[rows, :, ends[0] : ends[0] + n] = values
        else:  # one scatter for all rows (a write per row is a graph node per row and layer)
            index = mx.arange(len(self.ends))[rows][:, None]
            positions = mx.array(ends)[:, None] + mx.arange(n)
            self.keys[index, :, positions] = keys.transpose(0, 2, 1, 3)
            self.values[index, :, positions] = values.transpose(0, 2, 1, 3)
        moved = list(self.ends)
        moved[rows] = [end + n for end in ends]
        self.end_rows_at(moved)
        longest = max(ends) + n
        return self.keys[rows, :, :longest], self.values[rows, :, :longest]

    def key_spans(self, rows: slice = slice(None)) -> list[tuple[int, int]]:
        """Where each of `rows`' keys in use lie after the last write, from its left padding to
        its end: of the keys update_and_fetch returned, all its attention sees (fused_ops)."""
        return list(zip(self.left_padding[rows].tolist(), self.ends[rows]))

    def _reserve(self, keys, values, size: int):
        """Room for `size` tokens a row, grown by mlx-lm's step."""
        held = 0 if self.keys is None else self.keys.shape[2]
        if size <= held:
            return
        more = (size - held + self.step - 1) // self.step * self.step
        batch = len(self.ends) if self.keys is None else self.keys.shape[0]
        heads = keys.shape[1]
        new_keys = mx.zeros((batch, heads, more, keys.shape[3]), keys.dtype)
        new_values = mx.zeros((batch, heads, more, values.shape[3]), values.dtype)
        if self.keys is None:
            self.keys, self.values = new_keys, new_values
        else:
            self.keys = mx.concatenate([self.keys, new_keys], axis=2)
            self.values = mx.concatenate([self.values, new_values], axis=2)

    def make_mask(self, N: int, return_array: bool = False, window_size=None, rows: slice = slice(None), **kwargs):
        """Row r's query i (at ends[r] + i) sees its own tokens up to itself (of `rows`' alone when given)."""
        ends = self.ends[rows]
        queries = mx.array(ends)[:, None, None, None] + mx.arange(N)[:, None]
        keys = mx.arange(max(ends) + N)
        mask = (keys <= queries) & (keys >= self.left_padding[rows][:, None, None, None])
        if window_size is not None:
            mask = mask & (keys > queries - window_size)
        return mask

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        """A right-padded pass (a batched prefill chunk) ends each row after its `lengths`."""
        super().prepare(left_padding=left_padding)
        if lengths is not None:
            self._prefill_ends = [end + n for end, n in zip(self.ends, lengths)]

    def finalize(self):
        if self._prefill_ends is not None:
            self.end_rows_at(self._prefill_ends)
            self._prefill_ends = None

    def trim(self, n: int) -> int:
        n = min(min(self.ends), n)
        self.end_rows_at([end - n for end in self.ends])
        return n

    def filter(self, batch_indices):
        """The rows of `batch_indices`, in that order, and one row of those dropped as spare.  Where
        each stays in its place or comes from past the rows kept (the last rows moved into the
        places of those dropped: rows.tail_into_holes), at most one other was held and they have
        no left padding in common, only the rows moving are copied; else all are gathered
        (without that padding)."""
        kept = batch_indices.tolist() if isinstance(batch_indices, mx.array) else list(batch_indices)
        if self.keys is None or not kept:
            ends, longest = [self.ends[i] for i in kept], write_index(self)
            super().filter(batch_indices)  # drops the padding every kept row has on its left
            self.end_rows_at([end - (longest - write_index(self)) for end in ends])
            return
        padding = self.left_padding.tolist()
        shift = min(padding[i] for i in kept)
        moves = [(place, row) for place, row in enumerate(kept) if row != place]
        if all(row >= len(kept) for _, row in moves) and self.keys.shape[0] <= len(kept) + 1 and not shift:
            self._move_rows(moves)
        else:
            spare = [i for i in range(self.keys.shape[0]) if i not in kept][:1]
            order = mx.array(kept + spare)
            self.keys, self.values = self.keys[order, :, shift:], self.values[order, :, shift:]
        self.left_padding = mx.array([padding[i] - shift for i in kept])
        self.end_rows_at([self.ends[i] - shift for i in kept])

    def _move_rows(self, moves: list[tuple[int, int]]):
        """Each (place, row): row `row`'s keys and values written over row `place`'s, in place (the
        rows moving are copied out first: a write reading the arrays it writes would copy them)."""
        if not moves:
            return
        rows = mx.array([row for _, row in moves])
        keys, values = self.keys[rows], self.values[rows]
        mx.eval(keys, values)
        for j, (place, _) in enumerate(moves):
            self.keys[place : place + 1] = keys[j : j + 1]
            self.values[place : place + 1] = values[j : j + 1]

    def extend(self, other: "RaggedBatchKVCache"):
        """Append `other`'s rows, each where it is in `other` (from position 0), into this batch's
        spare rows (new arrays with room for them when it has too few or they are too short)."""
        if self.keys is None or other.keys is None:
            longest = max(write_index(self), write_index(other))  # mlx-lm right-justifies both at the longest
            ends = [end + longest - write_index(self) for end in self.ends]
            ends += [end + longest - write_index(other) for end in other.ends]
            super().extend(other)
            self.end_rows_at(ends)
            return
        held, joining, length = len(self.ends), len(other.ends), write_index(other)
        if self.keys.shape[0] < held + joining or self.keys.shape[2] < length:
            self._regrow(held + joining, length)
        self.keys[held : held + joining, :, :length] = other.keys[:joining, :, :length]
        self.values[held : held + joining, :, :length] = other.values[:joining, :, :length]
        self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
        self.end_rows_at(self.ends + other.ends)

    def _regrow(self, rows: int, length: int):
        """New arrays of `rows` rows and room for `length` tokens a row, this batch's rows copied in."""
        held, (_, heads, room, dim), value_dim = len(self.ends), self.keys.shape, self.values.shape[3]
        room = max(room, (length + self.step - 1) // self.step * self.step)
        keys = mx.zeros((rows, heads, room, dim), self.keys.dtype)
        values = mx.zeros((rows, heads, room, value_dim), self.values.dtype)
        keys[:held, :, : self.keys.shape[2]] = self.keys[:held]
        values[:held, :, : self.values.shape[2]] = self.values[:held]
        self.keys, self.values = keys, values

    def extract(self, idx: int) -> KVCache:
        cache = KVCache()
        padding = self.left_padding[idx].item()
        cache.keys = mx.contiguous(self.keys[idx : idx + 1, :, padding : self.ends[idx]])
        cache.values = mx.contiguous(self.values[idx : idx + 1, :, padding : self.ends[idx]])
        cache.offset = cache.keys.shape[2]
        return cache

    @classmethod
    def merge(cls, caches: list[KVCache]) -> "RaggedBatchKVCache":
        batch = super().merge(caches)
        if not isinstance(batch, cls):  # every row empty: mlx-lm returns its own class
            return cls([0] * len(caches))
        batch.ends = [write_index(batch)] * len(caches)
        return batch


class RaggedRows:
    """Some consecutive rows of a RaggedBatchKVCache, as the cache of a pass over them alone:
    what the pass writes goes into the batch's arrays, and its attention reads these rows only,
    up to the longest of them (BatchTargetCache.rows)."""

    def __init__(self, batch: RaggedBatchKVCache, rows: slice):
        self.batch, self.rows = batch, rows

    @property
    def offset(self) -> mx.array:
        return self.batch.offset[self.rows]

    def update_and_fetch(self, keys, values):
        return self.batch.update_and_fetch(keys, values, self.rows)

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        return self.batch.make_mask(N, window_size=window_size, rows=self.rows)

    def key_spans(self) -> list[tuple[int, int]]:
        return self.batch.key_spans(self.rows)


class BatchTrimmableKV:
    """Full-attention KV of a batch (RaggedBatchKVCache): each row ends after its own kept prefix."""

    def __init__(self, cache: RaggedBatchKVCache):
        self.cache = cache
        self._starts = []

    def checkpoint(self):
        self._starts = list(self.cache.ends)

    def rollback(self, keep: list[int]):
        self.cache.end_rows_at([start + k for start, k in zip(self._starts, keep)])


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
        # mlx-lm's mask for a multi-token pass reads the ring's write index as it is, while the
        # update it masks first puts the ring in temporal order: after a one-token step rotated
        # the ring, the mask cut one entry more from each row's left padding than the update did,
        # and a padded row lost the oldest token of its window (its verify chose another token)
        in_temporal_order(self.cache)
        self._start = window_seen(self.cache)

    def rollback(self, keep: list[int]):
        c, longest = self.cache, max(keep)
        drop = window_seen(c) - (self._start + longest)
        if drop > 0:
            drop_window_tail(c, drop)
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
    model has a recording mixer for each (wrapper.py)."""
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


def merged(caches: list) -> Any:
    """One layer's batch cache holding the rows' `caches` (full-attention rows in a
    RaggedBatchKVCache, every other kind in mlx-lm's own batch cache)."""
    if type(caches[0]) is KVCache:
        return RaggedBatchKVCache.merge(caches)
    return type(caches[0]).merge(caches)


def checkpointed_batch(cache: Any):
    """The batch counterpart of `checkpointed`, for a layer cache merged from rows' caches."""
    if type(cache) is RaggedBatchKVCache:
        return BatchTrimmableKV(cache)
    if type(cache) is BatchRotatingKVCache:
        return BatchRotatingKV(cache)
    if type(cache) is ArraysCache:
        return BatchGatedDeltaState(cache)
    raise UnsupportedCache(
        f"dflash-mlx cannot batch a {type(cache).__name__}; "
        "batched caches: KVCache, RotatingKVCache, GatedDeltaNet state"
    )
