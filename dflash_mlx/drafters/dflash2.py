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

from .config import DraftArgs
from .dflash import DraftLayer, per_position


def grouped_causal_conv(
    x: mx.array, dynamic: mx.array, base: mx.array, group_size: int, block_index: Optional[mx.array] = None
) -> mx.array:
    """out[t] = sum_k (base[k] + dynamic[t, k]) * x[t - k] per channel group (zero before the block).

    x (B, L, H); dynamic (B, L, K, H / group_size); base (K, H).  `block_index` (B, L):
    each position's index inside its own block, when several blocks are packed along L
    (training): x[t - k] then counts only if it lies in the same block.  The K shifted copies
    are slices of one padded copy, weighted and summed together: a dozen ops whatever K (a
    CPU pays for every op it schedules)."""
    B, L, H = x.shape
    K, groups = base.shape[0], H // group_size
    padded = mx.pad(x.reshape(B, L, groups, group_size), [(0, 0), (K - 1, 0), (0, 0), (0, 0)])
    shifted = mx.stack([padded[:, K - 1 - k : K - 1 - k + L] for k in range(K)], axis=2)  # (B, L, K, groups, size)
    if block_index is not None:
        shifted = shifted * (block_index[:, :, None] >= mx.arange(K))[..., None, None].astype(x.dtype)
    weights = base.reshape(K, groups, group_size).astype(x.dtype) + dynamic[..., None]
    return (weights * shifted).sum(axis=2).reshape(B, L, H)


# Decoding runs the same few block widths over and over: compiled, the convolution's elementwise
# ops are fused (one kernel instead of several).  Packed training batches (block_index) change
# shape every step and stay eager.
_decode_conv = mx.compile(grouped_causal_conv)


def _conv(x, dynamic, base, group_size, block_index):
    if block_index is None:
        return _decode_conv(x, dynamic, base, group_size)
    return grouped_causal_conv(x, dynamic, base, group_size, block_index)


class GroupedCausalConv(nn.Module):
    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"conv_group_size {group_size} does not divide hidden_size {hidden_size}")
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = mx.zeros((2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * (hidden_size // group_size), bias=False)

    def prepare(self, x: mx.array, block_index: Optional[mx.array] = None) -> tuple[mx.array, mx.array]:
        """(x convolved with the first kernel, the second kernel's dynamic part for `finish`)."""
        dynamic = per_position(self.kernel_projection, x).reshape(*x.shape[:-1], 2, self.kernel_size, -1)
        first = _conv(x, dynamic[..., 0, :, :], self.base_kernel[0], self.group_size, block_index)
        return first, dynamic[..., 1, :, :]

    def finish(self, y: mx.array, dynamic: mx.array, block_index: Optional[mx.array] = None) -> mx.array:
        return _conv(y, dynamic, self.base_kernel[1], self.group_size, block_index)

    def make_identity(self):
        """Pass-through (tap 0 = 1, no dynamic part): a new convolution that starts
        by changing nothing, so a DFlash 1 drafter can grow into a DFlash 2 one."""
        base = mx.zeros_like(self.base_kernel)
        base[:, 0] = 1.0
        self.base_kernel = base
        self.kernel_projection.weight = mx.zeros_like(self.kernel_projection.weight)


class CandidateSelector(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Embedding(vocab_size, rank)
        self.successor_codebook = nn.Embedding(vocab_size, rank)

    def score(self, predecessors: mx.array, hidden: mx.array, unary: mx.array, candidates: mx.array) -> mx.array:
        """Scores (P, k) of `candidates` (P, k) after `predecessors` (P,): the drafter's
        logit of each candidate plus the low-rank edge term."""
        queries = self.hidden_projection(hidden)  # (P, rank)
        edge = (self.predecessor_codebook(predecessors) * queries)[:, None] * self.successor_codebook(candidates)
        return unary + edge.sum(-1)

    def make_neutral(self, scale: float = 0.02):
        """Edge term zero (scores = logits, DFlash 1's choice) but trainable: a zero
        successor codebook gets gradients through the small random other two."""
        self.hidden_projection.weight = scale * mx.random.normal(self.hidden_projection.weight.shape)
        self.predecessor_codebook.weight = scale * mx.random.normal(self.predecessor_codebook.weight.shape)
        self.successor_codebook.weight = mx.zeros_like(self.successor_codebook.weight)

    def candidates(self, logits: mx.array, vocab_ids: Optional[mx.array]) -> tuple[mx.array, mx.array]:
        """(token ids (..., P, k), their logits (..., P, k)): each position's top-k."""
        k = min(self.top_k, logits.shape[-1])
        picks = mx.stop_gradient(mx.argpartition(logits, -k, axis=-1)[..., -k:])  # a choice, not a function
        unary = mx.take_along_axis(logits, picks, axis=-1)
        return (picks if vocab_ids is None else vocab_ids[picks]), unary

    def walk(
        self,
        hidden: mx.array,
        logits: mx.array,
        anchor: mx.array,
        vocab_ids: Optional[mx.array],
        temp: float,
        noise: Optional[mx.array],
    ) -> mx.array:
        """The drafted tokens (..., P) for P block positions, starting after `anchor` (...,).

        hidden (..., P, H) and logits (..., P, V') of those positions, V' over `vocab_ids` when
        the drafter drafts from a subset; leading axes are rows drafted alike.  Greedy (temp 0)
        takes each position's best score; sampling (one row) takes the Gumbel-max sample of
        softmax(score / temp) over the k candidates with the position's noise (P, full vocab),
        an exact sample of the distribution the selector proposes from.

        A position's scores depend on the token chosen before it, one of the k candidates there
        (the anchor before the first): every position's k x k scores are computed at once, each
        predecessor's best successor taken, and the path followed through those choices
        (`follow`), in a few whole-block ops rather than a few per position."""
        candidates, unary = self.candidates(logits, vocab_ids)  # (..., P, k)
        k = candidates.shape[-1]
        first = mx.broadcast_to(anchor[..., None, None], (*anchor.shape, 1, k)).astype(candidates.dtype)
        before = mx.concatenate([first, candidates[..., :-1, :]], axis=-2)  # (..., P, k) each position's predecessors
        queries = self.hidden_projection(hidden)[..., None, :]  # (..., P, 1, rank)
        edge = (self.predecessor_codebook(before) * queries)[..., None, :] * self.successor_codebook(candidates)[
            ..., None, :, :
        ]
        scores = unary[..., None, :] + edge.sum(-1)  # (..., P, predecessor, candidate)
        if temp > 0:
            scores = scores.astype(mx.float32) / temp + mx.take_along_axis(noise, candidates, axis=-1)[..., None, :]
        best = mx.argmax(scores, axis=-1)  # (..., P, k): the candidate chosen after each predecessor
        return mx.take_along_axis(candidates, follow(best)[..., None], axis=-1)[..., 0]


def follow(best: mx.array) -> mx.array:
    """(..., P) the path through `best` (..., P, k): position 0's choice is best[0][any] (every
    predecessor there is the anchor), position p's best[p][its choice at p - 1].

    Following choices is composing maps of k indices, which is associative: a prefix scan
    composes them in log2(P) steps (after the step of shift s, row p composes the maps of
    positions p - 2s + 1 .. p), each one gather for every position; at the end row p composes
    those of 0 .. p, a constant map (position 0's is) whose value is the choice at p."""
    maps, shift, positions = best, 1, best.shape[-2]
    while shift < positions:
        later = maps[..., shift:, :]
        composed = mx.take_along_axis(later, maps[..., :-shift, :], axis=-1)  # later ∘ earlier
        maps = mx.concatenate([maps[..., :shift, :], composed], axis=-2)
        shift *= 2
    return maps[..., 0]


class DFlash2Layer(DraftLayer):
    """Each sublayer wrapped in a grouped dynamic causal convolution along the block."""

    def __init__(self, args: DraftArgs, layer_type: str):
        super().__init__(args, layer_type)
        self.attention_conv = GroupedCausalConv(args.hidden_size, args.conv_kernel_size, args.conv_group_size)
        self.mlp_conv = GroupedCausalConv(args.hidden_size, args.conv_kernel_size, args.conv_group_size)

    def __call__(self, x: mx.array, context) -> mx.array:
        index = context.block_index  # packed training blocks; None: one block a row
        y, kernel = self.attention_conv.prepare(self.input_layernorm(x), index)
        h = x + self.attention_conv.finish(self.self_attn(y, context), kernel, index)
        y, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(h), index)
        return h + self.mlp_conv.finish(per_position(self.mlp, y), kernel, index)
