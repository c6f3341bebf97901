"""Greedy and exact speculative sampling.

The target distribution is mlx-lm's: top-p, then top-k filters on the
log-probabilities (mlx-lm's own functions), then softmax at the temperature.
The drafter's proposal q is built the same way from its logits, and the
standard rejection rule (accept x with probability min(1, p(x)/q(x)), else
resample from max(0, p - q)) keeps the output distributed exactly as p.
"""

from dataclasses import dataclass
from functools import partial

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p


@dataclass(frozen=True)
class SamplingParams:
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if self.temp < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temp}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temp == 0


def _filtered_logprobs(logits: mx.array, top_p: float, top_k: int) -> mx.array:
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    if top_p < 1.0:
        logprobs = apply_top_p(logprobs, top_p)
    if 0 < top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, top_k)
    return logprobs


def probabilities(logits: mx.array, params: SamplingParams) -> mx.array:
    """Sampling distribution (float32) over the last axis of `logits`."""
    return mx.softmax(_filtered_logprobs(logits, params.top_p, params.top_k) / params.temp, axis=-1)


@partial(mx.compile, inputs=mx.random.state, outputs=mx.random.state)
def _sample_row(logits: mx.array, temp: float, top_p: float, top_k: int) -> mx.array:
    return mx.random.categorical(_filtered_logprobs(logits, top_p, top_k) * (1.0 / temp))


def sample(logits: mx.array, params: SamplingParams) -> mx.array:
    """The next token from the target's logits at one position (plain decoding):
    one fused graph, as cheap as mlx-lm's own sampler."""
    if params.greedy:
        return mx.argmax(logits, axis=-1)
    return _sample_row(logits, params.temp, params.top_p, params.top_k)


def propose(draft_logits: mx.array, params: SamplingParams) -> tuple[mx.array, mx.array | None]:
    """Draft tokens (k,) and, when sampling, their proposal distributions q (k, V)."""
    if params.greedy:
        return mx.argmax(draft_logits, axis=-1), None
    q = probabilities(draft_logits, params)
    return mx.random.categorical(mx.log(q)), q


def accept(
    draft: mx.array, target_logits: mx.array, q: mx.array | None, params: SamplingParams
) -> tuple[mx.array, mx.array]:
    """How many of the k >= 1 draft tokens the target keeps, and the token after them.

    `target_logits` (k+1, V) are the target's logits at [last token] + draft;
    `q` (k, V) the drafter's proposal distributions (None when greedy).
    Returns device scalars (n_accepted, next_token) so the caller syncs once.
    """
    if params.greedy:
        choice = mx.argmax(target_logits, axis=-1)
        n = mx.cumprod((draft == choice[:-1]).astype(mx.int32)).sum()
        return n, choice[n]

    p = probabilities(target_logits, params)
    p_draft = mx.take_along_axis(p[:-1], draft[:, None], axis=-1)[:, 0]
    q_draft = mx.take_along_axis(q, draft[:, None], axis=-1)[:, 0]
    keep = mx.random.uniform(shape=p_draft.shape) * q_draft < p_draft
    n = mx.cumprod(keep.astype(mx.int32)).sum()
    # Row i: where to sample from if draft token i is the first rejected one;
    # the last row (plain p) serves when every draft token is accepted.
    residual = mx.maximum(p[:-1] - q, 0)
    total = residual.sum(axis=-1, keepdims=True)
    residual = mx.where(total > 0, residual / mx.maximum(total, 1e-30), p[:-1])
    rows = mx.concatenate([residual, p[-1:]], axis=0)
    return n, mx.random.categorical(mx.log(rows[n]))
