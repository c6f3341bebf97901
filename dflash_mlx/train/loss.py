"""The training loss: weighted cross-entropy over a restricted output head, optional
distillation from the target's distribution, and DFlash 2's candidate-selector term."""

from collections import Counter

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..drafters import DFlashDraftModel
from .packing import PackedBatch, PackedContext


class RestrictedHead:
    """Frozen output embeddings of the `size` token ids most frequent in the data."""

    def __init__(self, weight: mx.array, token_counts: Counter, size: int):
        self.token_ids = sorted(t for t, _ in token_counts.most_common(size))
        self.vocab = set(self.token_ids)
        self.weight = weight[mx.array(self.token_ids)]
        lookup = np.full(weight.shape[0], -1, dtype=np.int32)
        lookup[self.token_ids] = np.arange(len(self.token_ids))
        self.lookup = mx.array(lookup)


def block_hidden(draft: DFlashDraftModel, batch: PackedBatch) -> mx.array:
    """Final-normed hidden states (M, hidden) of the labelled block positions."""
    context = PackedContext(batch, draft.context(batch.features))
    return draft.run_layers(batch.block_tokens, [context] * len(draft.layers))[0][batch.label_index]


def selector_loss(
    draft: DFlashDraftModel, batch: PackedBatch, head: RestrictedHead, hidden: mx.array, logits: mx.array
) -> mx.array:
    """Per labelled position: cross-entropy of the selector's scores over the top-k
    candidates against the label, after the teacher-forced predecessor; zero where
    the label is not among the candidates (the token loss must first bring it there)."""
    selector = draft.candidate_selector
    candidates, unary = selector.candidates(logits, mx.array(head.token_ids))
    scores = selector.score(batch.predecessors, hidden, unary, candidates).astype(mx.float32)
    hit = candidates == batch.labels[:, None]
    per_position = nn.losses.cross_entropy(scores, hit.argmax(axis=-1), reduction="none")
    return per_position * hit.any(axis=-1)


def loss_fn(draft: DFlashDraftModel, batch: PackedBatch, head: RestrictedHead, distill: float = 0.0):
    hidden = block_hidden(draft, batch)
    logits = (hidden @ head.weight.T).astype(mx.float32)
    targets = head.lookup[batch.labels]
    per_position = nn.losses.cross_entropy(logits, targets, reduction="none")
    if distill > 0:
        teacher = mx.softmax(batch.teacher, axis=-1)
        kl = (teacher * (mx.log(teacher + 1e-30) - nn.log_softmax(logits, axis=-1))).sum(axis=-1)
        per_position = (1 - distill) * per_position + distill * kl
    if draft.args.dflash2:
        per_position = per_position + selector_loss(draft, batch, head, hidden, logits)
    loss = (per_position * batch.weights).sum() / batch.weights.sum()
    correct = logits.argmax(axis=-1) == targets
    return loss, correct
