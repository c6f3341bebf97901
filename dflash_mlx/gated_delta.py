"""GatedDeltaNet (Qwen3.5 linear attention) forward that records a replay tape.

Speculative verification feeds the recurrent layer a whole block, but only a
prefix of it is accepted.  The layer's state after that prefix is not among the
outputs of mlx-lm's module, so the verify pass runs this mirror of
``mlx_lm.models.qwen3_5.GatedDeltaNet.__call__`` (same building blocks, same
numerics) with the recurrence in ``kernels.gated_delta_tape``, which also
returns each step's delta.  Rolling back is then the closed-form state after
the accepted steps (one matmul from the pre-verify state), not a re-run of the
recurrence.  ``tests/test_engine.py`` pins this function to mlx-lm's module.
"""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gated_delta import compute_g, gated_delta_update, normalize_qk

from .kernels import gated_delta_replay, gated_delta_tape


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

    def replay(self, state: Optional[mx.array], steps: int, kernel_size: int):
        """(conv_state, recurrent_state) after the first `steps` tokens of the tape."""
        conv_state = self.conv_input[:, steps : steps + kernel_size - 1]
        return mx.contiguous(conv_state), gated_delta_replay(state, self.k, self.g, self.delta, steps)


def gated_delta_forward(mixer, x: mx.array, mask, cache, record: bool) -> tuple[mx.array, Optional[Tape]]:
    """Run `mixer` (a qwen3_5 GatedDeltaNet) on x, updating `cache`; return (out, tape),
    the tape only when `record` (a verify pass: prefill chunks use mlx-lm's recurrence)."""
    B, S, _ = x.shape
    qkv = mixer.in_proj_qkv(x)
    z = mixer.in_proj_z(x).reshape(B, S, mixer.num_v_heads, mixer.head_v_dim)
    b = mixer.in_proj_b(x)
    a = mixer.in_proj_a(x)

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
    tape = None
    if record:
        g, beta = compute_g(mixer.A_log, a, mixer.dt_bias), mx.sigmoid(b)
        if mask is not None:  # padded steps leave the state alone
            g, beta = mx.where(mask[..., None], g, 1.0), mx.where(mask[..., None], beta, 0.0)
        out, cache[1], delta = gated_delta_tape(q, k, v, g, beta, cache[1])
        tape = Tape(conv_input, k, g, delta)
    else:
        out, cache[1] = gated_delta_update(
            q, k, v, a, b, mixer.A_log, mixer.dt_bias, cache[1], mask,
            use_kernel=not mixer.training,
        )
    cache.advance(S)
    out = mixer.out_proj(mixer.norm(out, z).reshape(B, S, -1))
    return out, tape
