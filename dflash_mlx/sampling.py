"""Greedy decoding and exact speculative sampling by a shared-noise coupling.

The target distribution is mlx-lm's: top-p, then top-k filters on the
log-probabilities (mlx-lm's own functions), then the temperature.

Sampling uses the Gumbel-max trick with noise that belongs to the output
position, not to the decoding step: the token at position t is

    argmax(filtered log p_t / temp + g_t),   g_t = Gumbel noise keyed by (seed, t)

which is an exact sample of p_t.  The drafter proposes with the same g_t on its
own logits, and the target keeps the longest prefix where its own sample equals
the proposal, then its own sample at the first mismatch: the greedy rule applied
to noisy scores.  Every committed token is therefore exactly the token plain
decoding with that seed would sample at that position, whatever the block
widths, the drafter or the timing: seeded output is reproducible across modes
and identical to seeded plain decoding.  Greedy is the same code with no noise.
"""

import hashlib
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p


@dataclass(frozen=True)
class SamplingParams:
    """How a request samples (checked once, where the request is built: decode/request.check_sampling)."""

    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temp == 0


def new_seed() -> int:
    """A seed drawn from MLX's global random state (so mx.random.seed makes it repeatable)."""
    high, low = mx.random.randint(0, 1 << 30, (2,)).tolist()
    return high << 30 | low


def _position_key(seed: int, position: int) -> mx.array:
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return mx.random.key(int.from_bytes(digest, "little"))


class Noise:
    """Gumbel noise per output position, keyed by (seed, position).

    A row is kept until a call starts past its position: a verify that rejects part of its
    block verifies those positions again next, and a row over the whole vocabulary costs
    about as much to draw as the choice it feeds."""

    def __init__(self, seed: int, vocab_size: int):
        self.seed, self.vocab_size = seed, vocab_size
        self._rows: dict[int, mx.array] = {}

    def at(self, start: int, count: int) -> mx.array:
        """(count, vocab) noise for output positions start .. start + count - 1."""
        self._rows = {p: row for p, row in self._rows.items() if p >= start}
        for p in range(start, start + count):
            if p not in self._rows:
                self._rows[p] = mx.random.gumbel((self.vocab_size,), key=_position_key(self.seed, p))
        return mx.stack([self._rows[p] for p in range(start, start + count)])


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


@mx.compile
def _noisy_choice(logits: mx.array, noise: mx.array, inv_temp: mx.array, top_p: float, top_k: int) -> mx.array:
    if top_p == 1.0 and top_k == 0:
        # Unfiltered, normalising only shifts each row, which the argmax ignores; the shift's
        # exponentials over the whole vocabulary cost ~1 ms a row on a CPU.
        return mx.argmax(logits.astype(mx.float32) * inv_temp + noise, axis=-1)
    return mx.argmax(_filtered_logprobs(logits, top_p, top_k) * inv_temp + noise, axis=-1)


def choose(logits: mx.array, params: SamplingParams, noise: Optional[mx.array]) -> mx.array:
    """The token at each row of `logits`: argmax when greedy, else the Gumbel-max
    sample with that row's position noise (one fused graph, as cheap as mlx-lm's sampler)."""
    if params.greedy:
        return mx.argmax(logits, axis=-1)
    return _noisy_choice(logits, noise, mx.array(1.0 / params.temp), params.top_p, params.top_k)


@dataclass
class TokenLogprob:
    """The target's log-probability of a committed token (its own distribution at temperature
    1, before any top-p / top-k filter), and the `top` most likely tokens at that position."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits: mx.array, tokens: list[int], top: int) -> list[TokenLogprob]:
    """TokenLogprob of `tokens[i]` under `logits[i]` (rows of the target's logits)."""
    logprobs = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32), axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, mx.array(tokens, dtype=mx.int32)[:, None], axis=-1)[:, 0]
    if top:
        top_ids = mx.argpartition(-logprobs, kth=top - 1, axis=-1)[:, :top]
        top_logprobs = mx.take_along_axis(logprobs, top_ids, axis=-1)
        order = mx.argsort(-top_logprobs, axis=-1)
        ranked = mx.take_along_axis(top_ids, order, axis=-1)
        ranked_logprobs = mx.take_along_axis(top_logprobs, order, axis=-1)
        ranked, ranked_logprobs = ranked.tolist(), ranked_logprobs.tolist()
    else:
        ranked = ranked_logprobs = [[] for _ in tokens]
    return [
        TokenLogprob(token, logprob, list(zip(ids, values)))
        for token, logprob, ids, values in zip(tokens, chosen.tolist(), ranked, ranked_logprobs)
    ]
