"""The target's pass over training sequences, and which block positions it labels."""

from typing import Optional

import mlx.core as mx
import numpy as np

from ..target.wrapper import Target


def target_pass(
    target: Target, seqs: list, layer_ids: list[int], teacher_ids: Optional[mx.array] = None
) -> tuple[mx.array, np.ndarray, Optional[mx.array]]:
    """The target over each of `seqs`: their features (S, L, n_layers * hidden), the
    target's greedy choice at every position (S, L), zero-padded to the longest, and
    with `teacher_ids` its logits over those ids (S, L, len(teacher_ids)), else None.
    One sequence per pass: padding a batch cost more here than it saved (measured)."""
    length = max(len(s.tokens) for s in seqs)
    features, teacher, greedy = [], [], np.zeros((len(seqs), length), dtype=np.int64)
    for row, s in zip(greedy, seqs):
        logits, f = target(mx.array(s.tokens, dtype=mx.int32)[None], target.make_cache(), layer_ids)
        choice = mx.argmax(logits[0], axis=-1)
        pad = [(0, 0), (0, length - f.shape[1]), (0, 0)]
        if teacher_ids is not None:
            teacher.append(mx.pad(logits[:, :, teacher_ids].astype(mx.float32), pad))
        mx.eval(f, choice, *teacher[-1:])
        row[: len(s.tokens)] = np.array(choice)
        features.append(mx.pad(f, pad))
    return mx.concatenate(features, axis=0), greedy, mx.concatenate(teacher, axis=0) if teacher else None


def label_counts(tokens: list[int], greedy: np.ndarray, block_size: int) -> np.ndarray:
    """For an anchor at each position a: how many block positions have an exact greedy label.

    Position k of the block after anchor a is labelled greedy[a+k-1] when the
    tokens a+1..a+k-1 are the target's own greedy choices (always for k = 1;
    always in a self-distilled response; where the text agreed, in other text)."""
    n = len(tokens)
    agree = np.asarray(tokens[1:]) == greedy[: n - 1]
    run = np.zeros(n + 1, dtype=np.int64)  # run[i]: consecutive agreements from i on
    for i in range(n - 2, -1, -1):
        run[i] = run[i + 1] + 1 if agree[i] else 0
    return np.minimum.reduce([np.full(n, block_size - 1), n - np.arange(n), 1 + run[:n]])
