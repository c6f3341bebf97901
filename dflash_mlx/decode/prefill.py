"""One prefill pass: the next chunk of every filling row's prompt through the target together,
right-padded to the longest chunk; the rows whose prompt it ends have their first token chosen."""

import mlx.core as mx

from ..sampling import choose
from .grammar import masked
from .model import DFlashModel
from .prefix import PrefixPolicy
from .request import Row
from .rows import tree_arrays


def fill_chunk(
    model: DFlashModel, rows: list[Row], cache, size: int, prefix: PrefixPolicy, awaited: list
) -> tuple[dict[int, mx.array], mx.array]:
    """The next chunk of each row's prompt (`size` tokens in all, fewer where the prefix policy
    ends a chunk at a snapshot) through the target in one pass on `cache`, its features into
    each row's drafter context, kept along the way where `prefix` says (`awaited`: what waiting
    requests wait for); the first token of each row whose prompt is in (row index -> token),
    and the pass's logits (one row per request, at its chunk's last token), all evaluated."""
    span = max(size // len(rows), 1)
    chunks = [row.unfilled[: prefix.chunk_length(row, span)] for row in rows]
    lengths = [len(chunk) for chunk in chunks]
    tokens = mx.array([chunk + [0] * (max(lengths) - len(chunk)) for chunk in chunks])
    cache.pad_right(lengths)
    logits, features = model.target(tokens, cache, model.feature_layers, logits_at=[n - 1 for n in lengths])
    cache.finalize()
    firsts = {}
    for i, (row, n) in enumerate(zip(rows, lengths)):
        row.context.add(None if features is None else features[i : i + 1, :n])
        row.unfilled = row.unfilled[n:]
        if not row.unfilled:
            firsts[i] = choose(masked(logits[i], row.masks([])), row.params, row.noise_at(0, 1))
        prefix.keep_along(row, cache, i, awaited)
    mx.eval(
        tree_arrays([c.state for c in cache.layers]),
        tree_arrays([c.state for row in rows for c in row.context.flush() or []]),
        list(firsts.values()),
    )
    return firsts, logits
