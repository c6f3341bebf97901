"""GatedDeltaNet (Qwen3.5 / Qwen3-Next linear attention) forward that records a replay tape.

Speculative verification feeds the recurrent layer a whole block, but only a
prefix of it is accepted.  The layer's state after that prefix is not among the
outputs of mlx-lm's module, so the verify pass runs this mirror of
``mlx_lm.models.qwen3_5.GatedDeltaNet.__call__`` (same building blocks, same
numerics; the mixer kinds differ only in their input projections) with the
recurrence in ``kernels.gated_delta_tape``, which also returns each step's
delta.  Rolling back is then the closed-form state after the accepted steps
(one matmul from the pre-verify state), not a re-run of the recurrence.
``tests/test_engine.py`` pins this function to mlx-lm's modules.
"""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5, qwen3_next
from mlx_lm.models.gated_delta import compute_g, normalize_qk

from ..kernels.metal import gated_delta_replay, gated_delta_tape


@dataclass
class Tape:
    """What one forward over S tokens needs to rebuild the state after any prefix."""

    conv_input: mx.array  # (B, K-1+S, conv_dim): previous conv window + this block
    k: mx.array  # (B, S, Hk, Dk) normalized keys
    g: mx.array  # (B, S, Hv) decays
    delta: mx.array  # (B, S, Hv, Dv) state writes

    @property
    def length(self) -> int:
        return self.k.shape[1]

    def replay(self, state: Optional[mx.array], steps: int):
        """(conv_state, recurrent_state) after the first `steps` tokens of the tape."""
        window = self.conv_input.shape[1] - self.length  # kernel size - 1
        conv_state = self.conv_input[:, steps : steps + window]
        return mx.contiguous(conv_state), gated_delta_replay(state, self.k, self.g, self.delta, steps)

    def replay_rows(self, state: Optional[mx.array], steps: list[int]):
        """`replay` with each row of the batch taking its own number of steps: the steps past a
        row's count decay by exactly 1 and write exactly 0, as mlx-lm's padded steps do."""
        window = self.conv_input.shape[1] - self.length
        counts = mx.array(steps)[:, None]
        conv_state = mx.take_along_axis(self.conv_input, (counts + mx.arange(window))[..., None], axis=1)
        live = mx.arange(self.length)[None] < counts  # (B, S)
        g = mx.where(live[..., None], self.g, 1.0)
        delta = mx.where(live[..., None, None], self.delta, 0.0)
        return mx.contiguous(conv_state), gated_delta_replay(state, self.k, g, delta, max(steps))


def _project_qwen3_5(mixer, x):
    B, S, _ = x.shape
    z = mixer.in_proj_z(x).reshape(B, S, mixer.num_v_heads, mixer.head_v_dim)
    return mixer.in_proj_qkv(x), z, mixer.in_proj_b(x), mixer.in_proj_a(x)


def _project_qwen3_next(mixer, x):
    B, S, _ = x.shape
    q, k, v, z, b, a = mixer.fix_query_key_value_ordering(mixer.in_proj_qkvz(x), mixer.in_proj_ba(x))
    return mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1), z, b, a


# mixer class -> (x -> conv input qkv, gate z, beta logits b, decay logits a); the rest is shared
MIXER_PROJECTIONS = {
    qwen3_5.GatedDeltaNet: _project_qwen3_5,
    qwen3_next.Qwen3NextGatedDeltaNet: _project_qwen3_next,
}


def gated_delta_forward(mixer, x: mx.array, mask, cache) -> tuple[mx.array, Tape]:
    """Run `mixer` (a GatedDeltaNet of a kind in MIXER_PROJECTIONS) on x, updating
    `cache`, with the recurrence that also returns the replay tape."""
    B, S, _ = x.shape
    qkv, z, b, a = MIXER_PROJECTIONS[type(mixer)](mixer, x)

    conv_state = cache[0]
    if conv_state is None:
        conv_state = mx.zeros((B, mixer.conv_kernel_size - 1, mixer.conv_dim), dtype=x.dtype)
    if mask is not None:
        qkv = mx.where(mask[..., None], qkv, 0)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    cache[0] = mx.contiguous(conv_input[:, -(mixer.conv_kernel_size - 1) :, :])
    conv_out = nn.silu(mixer.conv1d(conv_input))

    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [mixer.key_dim, 2 * mixer.key_dim], -1),
            [mixer.num_k_heads, mixer.num_k_heads, mixer.num_v_heads],
            [mixer.head_k_dim, mixer.head_k_dim, mixer.head_v_dim],
        )
    ]
    q, k = normalize_qk(q, k, inv_scale=mixer.head_k_dim**-0.5, eps=1e-6)
    g, beta = compute_g(mixer.A_log, a, mixer.dt_bias), mx.sigmoid(b)
    if mask is not None:  # padded steps leave the state alone
        g, beta = mx.where(mask[..., None], g, 1.0), mx.where(mask[..., None], beta, 0.0)
    out, cache[1], delta = gated_delta_tape(q, k, v, g, beta, cache[1])
    cache.advance(S)
    out = mixer.out_proj(mixer.norm(out, z).reshape(B, S, -1))
    return out, Tape(conv_input, k, g, delta)
