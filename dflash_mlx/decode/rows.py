"""The rows of a batch and their cache: rows appended, rows dropped (the last ones moved into
their places), and the batch's arrays settled before a step is timed."""

import mlx.core as mx
from mlx.utils import tree_flatten

from ..target.wrapper import BatchTargetCache, TargetCache
from .request import Row


def tree_arrays(tree) -> list[mx.array]:
    return [x for _, x in tree_flatten(tree) if isinstance(x, mx.array)]


def tail_into_holes(count: int, dropped: set[int]) -> list[int]:
    """The order of `count` rows without those of `dropped`: each row stays where it is but for
    the last ones, which fill the places left below."""
    size = count - len(dropped)
    tail = [i for i in range(size, count) if i not in dropped]
    order = list(range(size))
    for hole, last in zip([i for i in range(size) if i in dropped], tail):
        order[hole] = last
    return order


def joined(batch, caches: list[TargetCache], batched: bool):
    """`batch` with rows holding `caches` appended (a new batch when there is none; not
    `batched`: the one cache itself)."""
    if not batched:
        return caches[0]
    rows = BatchTargetCache(caches)
    if batch is None:
        return rows
    batch.extend(rows)
    return batch


def without(rows: list[Row], batch, uids) -> tuple[list[Row], object]:
    """`rows` and their cache with the rows of `uids` dropped, the last rows moved into their
    places (a batch cache then moves those rows alone, not every row after them)."""
    dropped = {i for i, row in enumerate(rows) if row.uid in uids}
    if not dropped:
        return rows, batch
    if len(dropped) == len(rows):
        return [], None
    kept = tail_into_holes(len(rows), dropped)
    batch.keep_rows(kept)
    return [rows[i] for i in kept], settled(batch)


def settled(batch):
    """`batch` with its rows' merge or filter computed now, not in the next decode step, whose
    time teaches the planner what a step of its shape costs (traced: a plain step after a
    join timed at 8x the curve, and its shape then judged too dear to run again)."""
    mx.eval(tree_arrays([c.state for c in batch.layers]))
    return batch


def run_ahead(rows: list, cache) -> None:
    """After a drafting step: the rolled-back caches, and the new features in the drafter
    contexts of the rows that drafted (they likely draft next), computed while the next step's
    graph is built, which needs them (a GPU computes as the CPU builds)."""
    drafted = [row for row in rows if row.stats.sources and row.stats.sources[-1] == "dflash"]
    mx.async_eval(
        tree_arrays([c.state for c in cache.layers]),
        tree_arrays([c.state for row in drafted for c in row.context.flush() or []]),
    )
