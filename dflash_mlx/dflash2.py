"""The two pieces DFlash 2 drafters add (architecture "DFlash2DraftModel"):

  GroupedCausalConv  around each sublayer of every drafter layer: a causal
                     convolution along the block, per group of channels, whose
                     kernel is a learned base plus a part predicted from the
                     input (`prepare` before the sublayer, `finish` after it)
  CandidateSelector  picks the drafted path through the top-k candidates of each
                     block position: a candidate's score is its logit plus a
                     low-rank edge term between the previous token, the
                     position's hidden state and the candidate

Weight names and shapes are z-lab's (`base_kernel` [2, K, H],
`kernel_projection`, `hidden_projection`, `predecessor_codebook`,
`successor_codebook`); the codebooks are stored without a `.weight` suffix.
"""

from typing import Optional

import mlx.core as mx
import mlx.nn as nn


def grouped_causal_conv(x: mx.array, dynamic: mx.array, base: mx.array, group_size: int) -> mx.array:
    """out[t] = sum_k (base[k] + dynamic[t, k]) * x[t - k] per channel group (zero before the block).

    x (B, L, H); dynamic (B, L, K, H / group_size); base (K, H)."""
    B, L, H = x.shape
    groups = H // group_size
    blocks = x.reshape(B, L, groups, group_size)
    out = mx.zeros_like(blocks)
    for k in range(base.shape[0]):
        shifted = blocks if k == 0 else mx.pad(blocks[:, : max(L - k, 0)], [(0, 0), (min(k, L), 0), (0, 0), (0, 0)])
        out = out + base[k].reshape(groups, group_size).astype(x.dtype) * shifted
        out = out + dynamic[:, :, k, :, None] * shifted
    return out.reshape(B, L, H)


class GroupedCausalConv(nn.Module):
    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"conv_group_size {group_size} does not divide hidden_size {hidden_size}")
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = mx.zeros((2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * (hidden_size // group_size), bias=False)

    def prepare(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(x convolved with the first kernel, the second kernel's dynamic part for `finish`)."""
        dynamic = self.kernel_projection(x).reshape(*x.shape[:-1], 2, self.kernel_size, -1)
        return grouped_causal_conv(x, dynamic[..., 0, :, :], self.base_kernel[0], self.group_size), dynamic[..., 1, :, :]

    def finish(self, y: mx.array, dynamic: mx.array) -> mx.array:
        return grouped_causal_conv(y, dynamic, self.base_kernel[1], self.group_size)


class CandidateSelector(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Embedding(vocab_size, rank)
        self.successor_codebook = nn.Embedding(vocab_size, rank)

    def walk(self, hidden: mx.array, logits: mx.array, anchor: mx.array, vocab_ids: Optional[mx.array],
             temp: float, noise: Optional[mx.array]) -> mx.array:
        """The drafted tokens (P,) for P block positions, starting after `anchor`.

        hidden (P, H) and logits (P, V') of those positions, V' over `vocab_ids` when the
        drafter drafts from a subset.  Greedy (temp 0) takes each position's best score;
        sampling takes the Gumbel-max sample of softmax(score / temp) over the k
        candidates with the position's noise (P, full vocab), an exact sample of the
        distribution the selector proposes from."""
        k = min(self.top_k, logits.shape[-1])
        picks = mx.argpartition(logits, -k, axis=-1)[:, -k:]
        unary = mx.take_along_axis(logits, picks, axis=-1)
        candidates = picks if vocab_ids is None else vocab_ids[picks]
        successors = self.successor_codebook(candidates)  # (P, k, rank)
        queries = self.hidden_projection(hidden)  # (P, rank)
        token, path = anchor.reshape(()), []
        for p in range(hidden.shape[0]):
            scores = unary[p] + ((self.predecessor_codebook(token) * queries[p])[None] * successors[p]).sum(-1)
            if temp > 0:
                scores = scores.astype(mx.float32) / temp + noise[p][candidates[p]]
            token = candidates[p][mx.argmax(scores)]
            path.append(token)
        return mx.stack(path)
