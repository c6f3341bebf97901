"""Packed batches: many blocks of many sequences in one drafter pass, each block seeing
only its own sequence's context before its anchor (and, in DFlash 2, only its own block)."""

import math
import random
from dataclasses import dataclass, field
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from ..drafters.dflash import AttentionContext


@dataclass
class PackedBatch:
    """Blocks of S sequences for one drafter pass, grouped by sequence.

    Sequence s contributes Q (padded) block positions that attend to its own
    context positions 0..L-1 and to block positions; `visible[s, 0, q, k]` says
    which keys (L context, then Q block) query q of sequence s sees."""

    features: mx.array  # (S, L, n_layers * hidden)
    block_tokens: mx.array  # (1, S * Q)
    block_positions: mx.array  # (S * Q,)
    visible: mx.array  # (S, 1, Q, L + Q) bool
    label_index: mx.array  # (M,) which of the S * Q positions are predicted
    labels: mx.array  # (M,) target token ids
    weights: mx.array  # (M,) loss weights
    block_offsets: np.ndarray = field(repr=False, default=None)  # (M,) k-1, for per-position metrics
    teacher: Optional[mx.array] = None  # (M, V) the target's logits over the restricted head, for distill
    block_index: Optional[mx.array] = None  # (1, S * Q) each position's index inside its block
    predecessors: Optional[mx.array] = None  # (M,) the token before each label (anchor or previous label)

    @property
    def groups(self) -> int:
        return self.visible.shape[0]


class PackedContext(AttentionContext):
    """The drafter's attention context for packed training blocks:
    each sequence's blocks attend to that sequence's context, in one batched call."""

    def __init__(self, batch: PackedBatch, context: mx.array):
        self.position = batch.block_positions
        self.block_index = batch.block_index  # DFlash 2's convolutions stay inside each block
        self._context = context  # (S, L, hidden)
        self._visible = batch.visible

    def attend(self, attn, queries, keys, values):
        groups = self._visible.shape[0]

        def grouped(x):  # (1, H, S * Q, D) -> (S, H, Q, D)
            _, H, SQ, D = x.shape
            return x.reshape(H, groups, SQ // groups, D).transpose(1, 0, 2, 3)

        ctx_keys, ctx_values = attn.keys_values(self._context, 0)
        keys = mx.concatenate([ctx_keys, grouped(keys)], axis=2)
        values = mx.concatenate([ctx_values, grouped(values)], axis=2)
        out = mx.fast.scaled_dot_product_attention(grouped(queries), keys, values, scale=attn.scale, mask=self._visible)
        S, H, Q, D = out.shape
        return out.transpose(1, 0, 2, 3).reshape(1, H, S * Q, D)


def sample_blocks(
    seq, counts: np.ndarray, budget: int, rng: random.Random, widths: Optional[Sequence[int]] = None
) -> list[tuple[int, int]]:
    """Random (anchor, labelled positions) pairs whose blocks fill at most `budget` positions.
    With `widths`, each block is cut to a verify width drawn from them (the block [anchor,
    MASK x (w-1)] the loop drafts at width w), so the budget holds more, shorter blocks."""
    anchors = list(range(seq.first_anchor, len(seq.tokens)))
    rng.shuffle(anchors)
    blocks, used = [], 0
    for a in anchors:
        labels = int(counts[a]) if widths is None else min(int(counts[a]), rng.choice(widths) - 1)
        if used + 1 + labels > budget:
            continue
        blocks.append((a, labels))
        used += 1 + labels
    return sorted(blocks)


def pack(
    seqs: list,
    features: mx.array,
    greedy: np.ndarray,
    blocks: list[list[tuple[int, int]]],
    mask_token_id: int,
    gamma: float,
    vocab: Optional[set] = None,
    teacher: Optional[mx.array] = None,
) -> PackedBatch:
    """Blocks [token at a, MASK x n] at positions a..a+n, labelled greedy[a+k-1]
    at block position k (labels outside `vocab` are not predicted); `teacher`
    (S, L, V): the target's logits, gathered at the same positions as the labels."""
    S, L = len(seqs), features.shape[1]
    Q = max(sum(1 + n for _, n in b) for b in blocks)
    visible = np.zeros((S, 1, Q, L + Q), dtype=bool)
    block_tokens = np.full((S, Q), mask_token_id, dtype=np.int32)
    block_positions = np.zeros((S, Q), dtype=np.int32)
    block_index = np.zeros((S, Q), dtype=np.int32)
    label_index, labels, weights, offsets, sources, predecessors = [], [], [], [], [], []
    for s, (seq, seq_blocks) in enumerate(zip(seqs, blocks)):
        q = 0
        for a, n in seq_blocks:
            rows = slice(q, q + n + 1)
            visible[s, 0, rows, :a] = True  # own sequence, strictly before the anchor
            visible[s, 0, rows, L + q : L + q + n + 1] = True  # own block, both directions
            block_tokens[s, q] = seq.tokens[a]
            block_positions[s, rows] = np.arange(a, a + n + 1)
            block_index[s, rows] = np.arange(n + 1)
            for k in range(1, n + 1):
                label = int(greedy[s, a + k - 1])
                if vocab is None or label in vocab:
                    label_index.append(s * Q + q + k)
                    labels.append(label)
                    weights.append(math.exp(-(k - 1) / gamma))
                    offsets.append(k - 1)
                    sources.append(s * L + a + k - 1)
                    predecessors.append(seq.tokens[a] if k == 1 else int(greedy[s, a + k - 2]))
            q += n + 1
        for pad in range(q, Q):  # padding sees only itself (a fully masked row would be NaN)
            visible[s, 0, pad, L + pad] = True
    return PackedBatch(
        features=features,
        block_tokens=mx.array(block_tokens.reshape(1, -1)),
        block_positions=mx.array(block_positions.reshape(-1)),
        visible=mx.array(visible),
        label_index=mx.array(label_index, dtype=mx.int32),
        labels=mx.array(labels, dtype=mx.int32),
        weights=mx.array(weights, dtype=mx.float32),
        block_offsets=np.array(offsets),
        teacher=None if teacher is None else teacher.reshape(S * L, -1)[mx.array(sources, dtype=mx.int32)],
        block_index=mx.array(block_index.reshape(1, -1)),
        predecessors=mx.array(predecessors, dtype=mx.int32),
    )
