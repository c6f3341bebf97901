"""Custom Metal kernels and their pure-MLX twins.

Two operations of the decode loop have kernels in metal/ (shipped as package
data as ``dflash_mlx/metal``):

    block_attention    drafter block queries over [context buffer, block] in
                       one pass, reading the context in place (no concat copy)
    gated_delta_tape   GatedDeltaNet recurrence over a verify block that also
                       records delta_t, so rollback is a closed-form matmul

Each has a twin written with MLX ops, same signature and semantics.  The Metal
kernel runs when Metal is available (and the default device is the GPU), the
twin otherwise; DFLASH_MLX_KERNELS=metal|mlx forces one.  A kernel call is
described by a ``Launch`` (source, inputs, template, grid, outputs), which is
what both mx.fast.metal_kernel and the C++ emulation in tests/ execute.
"""

import os
import warnings
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Optional, Union

import mlx.core as mx

from .fused_ops import fusing, scaled_dot_product_attention
from ..io.storage import shipped

BACKENDS = ("auto", "metal", "mlx")
ATTENTION_SIMDGROUPS = 8
TAPE_SIMDGROUPS = 16  # a value head's rows over 512 threads (Qwen3.5 / Qwen3-Next: 128 rows, 8 each)
KERNEL_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
THREADGROUP_MEMORY = 32 * 1024  # bytes per threadgroup on Apple GPUs


# ----------------------------------------------------------------- dispatch


def use_metal() -> bool:
    choice = os.environ.get("DFLASH_MLX_KERNELS", "auto").lower()
    if choice not in BACKENDS:
        raise ValueError(f"DFLASH_MLX_KERNELS={choice!r} is not one of {', '.join(BACKENDS)}")
    if choice == "mlx":
        return False
    available = mx.metal.is_available() and mx.default_device() == mx.gpu
    if choice == "metal" and not available:
        raise RuntimeError(
            "DFLASH_MLX_KERNELS=metal but Metal is not available here (needs a Mac GPU); unset it or set it to mlx"
        )
    return available


@cache
def _warn_once(message: str):
    warnings.warn(message, stacklevel=3)


def _metal_fits(name: str, head_dim: int, dtype: mx.Dtype) -> bool:
    if head_dim % 32 == 0 and dtype in KERNEL_DTYPES:
        if name != "block_attention" or attention_tiling(head_dim, dtype) is not None:
            return True
        _warn_once(
            f"dflash-mlx: block_attention Metal kernel: head_dim {head_dim} in {dtype} needs more than "
            f"{THREADGROUP_MEMORY // 1024} KiB of threadgroup memory; using the slower MLX twin"
        )
        return False
    _warn_once(
        f"dflash-mlx: {name} Metal kernel needs head_dim % 32 == 0 and a float dtype "
        f"(got {head_dim}, {dtype}); using the slower MLX twin"
    )
    return False


@dataclass
class Launch:
    """One kernel call: everything mx.fast.metal_kernel (or an emulator) needs."""

    kernel: str  # metal/<kernel>.metal
    inputs: dict[str, Union[mx.array, float, int]]
    outputs: dict[str, tuple[tuple[int, ...], mx.Dtype]]
    template: list[tuple[str, Union[int, bool, mx.Dtype]]]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]


def source(kernel: str) -> str:
    return (_metal_dir() / f"{kernel}.metal").read_text()


@cache
def _metal_dir() -> Path:
    try:
        return shipped("metal")
    except FileNotFoundError as e:
        raise FileNotFoundError(f"dflash-mlx: {e}") from None


@cache
def _metal_kernel(kernel: str, input_names: tuple, output_names: tuple):
    return mx.fast.metal_kernel(
        name=f"dflash_{kernel}", input_names=list(input_names), output_names=list(output_names), source=source(kernel)
    )


def run_metal(launch: Launch) -> list[mx.array]:
    fn = _metal_kernel(launch.kernel, tuple(launch.inputs), tuple(launch.outputs))
    return fn(
        inputs=list(launch.inputs.values()),
        template=launch.template,
        grid=launch.grid,
        threadgroup=launch.threadgroup,
        output_shapes=[shape for shape, _ in launch.outputs.values()],
        output_dtypes=[dtype for _, dtype in launch.outputs.values()],
    )


# ---------------------------------------------------------- block attention


@dataclass
class ContextSpan:
    """The live entries [start, start + length) of a preallocated context buffer (B, Hkv, capacity, D)."""

    keys: mx.array
    values: mx.array
    start: int
    length: int


def block_visibility(L: int, context_length: int, causal: bool, window: Optional[int]) -> Optional[mx.array]:
    """(L, context_length + L) bool mask of the keys each block row sees, or None for all."""
    if not causal and not window:
        return None
    ahead = mx.arange(context_length + L)[None] - context_length - mx.arange(L)[:, None]
    visible = mx.ones(ahead.shape, dtype=mx.bool_)
    if causal:
        visible = visible & (ahead <= 0)
    if window:
        visible = visible & (mx.abs(ahead) < window)
    return visible


def block_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    context: Optional[ContextSpan],
    *,
    scale: float,
    causal: bool = False,
    window: Optional[int] = None,
) -> mx.array:
    """Attention of block queries (B, Hq, L, D) over the context span then the block's own
    keys/values (B, Hkv, L, D); bidirectional inside the block unless `causal`."""
    if use_metal() and _metal_fits("block_attention", queries.shape[-1], queries.dtype):
        return run_metal(
            block_attention_launch(queries, keys, values, context, scale=scale, causal=causal, window=window)
        )[0]
    return block_attention_mlx(queries, keys, values, context, scale=scale, causal=causal, window=window)


def block_attention_mlx(queries, keys, values, context: Optional[ContextSpan], *, scale, causal=False, window=None):
    length = context.length if context is not None else 0
    if length:
        span = slice(context.start, context.start + length)
        keys = mx.concatenate([context.keys[..., span, :], keys], axis=2)
        values = mx.concatenate([context.values[..., span, :], values], axis=2)
    mask = block_visibility(queries.shape[2], length, causal, window)
    if fusing():  # our softmax (fused_ops.py)
        return scaled_dot_product_attention(queries, keys, values, None, scale=scale, mask=mask)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def attention_tiling(head_dim: int, dtype: mx.Dtype) -> Optional[tuple[int, int]]:
    """(query rows per simdgroup, keys per chunk) of the block attention kernel, or None when
    even the smallest chunk of keys and values would overflow threadgroup memory.  The largest
    chunk that leaves room for a second resident threadgroup is preferred."""
    rows = 8 if head_dim <= 128 else 4  # q and the accumulator stay in registers
    fitting = [chunk for chunk in (32, 16, 8) if 2 * chunk * head_dim * dtype.size <= THREADGROUP_MEMORY]
    roomy = [chunk for chunk in fitting if 2 * chunk * head_dim * dtype.size <= THREADGROUP_MEMORY // 2]
    if not fitting:
        return None
    return rows, (roomy or fitting)[0]


def block_attention_launch(
    queries, keys, values, context: Optional[ContextSpan], *, scale, causal=False, window=None
) -> Launch:
    B, HQ, L, D = queries.shape
    HKV = keys.shape[1]
    tiling = attention_tiling(D, queries.dtype)
    if tiling is None:
        raise ValueError(f"block_attention: head_dim {D} in {queries.dtype} does not fit in threadgroup memory")
    rows, chunk = tiling
    tiles = -(-(HQ // HKV) * L // (ATTENTION_SIMDGROUPS * rows))
    if context is None:  # nothing to read: any buffer of the right layout will do
        context = ContextSpan(keys, values, 0, 0)
    geometry = mx.array([context.keys.shape[2], context.start, context.length, window or 0, L], dtype=mx.int32)
    return Launch(
        kernel="block_attention",
        inputs=dict(
            queries=queries,
            keys=keys,
            values=values,
            ctx_keys=context.keys,
            ctx_values=context.values,
            geometry=geometry,
            scale=float(scale),
        ),
        outputs=dict(out=(queries.shape, queries.dtype)),
        template=[
            ("T", queries.dtype),
            ("D", D),
            ("HQ", HQ),
            ("HKV", HKV),
            ("SIMDGROUPS", ATTENTION_SIMDGROUPS),
            ("ROWS", rows),
            ("CHUNK", chunk),
            ("CAUSAL", bool(causal)),
        ],
        grid=(32 * ATTENTION_SIMDGROUPS, tiles, B * HKV),
        threadgroup=(32 * ATTENTION_SIMDGROUPS, 1, 1),
    )


# ------------------------------------------------------- GatedDeltaNet tape


def initial_state(state: Optional[mx.array], k: mx.array, v: mx.array) -> mx.array:
    """`state`, or the zero state (B, Hv, Dv, Dk) float32 a layer starts from."""
    if state is not None:
        return state
    return mx.zeros((k.shape[0], v.shape[2], v.shape[3], k.shape[3]), dtype=mx.float32)


def gated_delta_tape(q, k, v, g, beta, state: Optional[mx.array]) -> tuple[mx.array, mx.array, mx.array]:
    """The gated delta rule over T steps, also returning delta (B, T, Hv, Dv) float32.

    q, k (B, T, Hk, Dk); v (B, T, Hv, Dv); g, beta (B, T, Hv); state (B, Hv, Dv, Dk) float32
    or None (zeros).  Returns (y (B, T, Hv, Dv) in q's dtype, final state, delta)."""
    state = initial_state(state, k, v)
    if use_metal() and _metal_fits("gated_delta_tape", k.shape[-1], q.dtype):
        return tuple(run_metal(gated_delta_tape_launch(q, k, v, g, beta, state)))
    return gated_delta_tape_mlx(q, k, v, g, beta, state)


@mx.compile
def _tape_step(q, k, v, g, beta, state):
    state = state * g[..., None, None]
    delta = (v - (state * k[..., None, :]).sum(-1)) * beta[..., None]
    state = state + k[..., None, :] * delta[..., None]
    return (state * q[..., None, :]).sum(-1), state, delta


def gated_delta_tape_mlx(q, k, v, g, beta, state):
    heads = v.shape[2] // k.shape[2]
    q32 = mx.repeat(q.astype(mx.float32), heads, axis=2)
    k32 = mx.repeat(k.astype(mx.float32), heads, axis=2)
    v32, g, beta = v.astype(mx.float32), g.astype(mx.float32), beta.astype(mx.float32)
    ys, deltas = [], []
    for t in range(q.shape[1]):
        y, state, delta = _tape_step(q32[:, t], k32[:, t], v32[:, t], g[:, t], beta[:, t], state)
        ys.append(y)
        deltas.append(delta)
    return mx.stack(ys, axis=1).astype(q.dtype), state, mx.stack(deltas, axis=1)


def gated_delta_tape_launch(q, k, v, g, beta, state) -> Launch:
    B, T, HK, DK = k.shape
    HV, DV = v.shape[2:]
    simdgroups = min(DV, TAPE_SIMDGROUPS)  # one threadgroup per value head
    return Launch(
        kernel="gated_delta_tape",
        inputs=dict(
            q=q,
            k=k,
            v=v,
            g=g.astype(mx.float32),
            beta=beta.astype(mx.float32),
            state_in=state.astype(mx.float32),
            steps=T,
        ),
        outputs=dict(
            y=((B, T, HV, DV), q.dtype), state_out=((B, HV, DV, DK), mx.float32), delta=((B, T, HV, DV), mx.float32)
        ),
        template=[
            ("T_IN", q.dtype),
            ("DK", DK),
            ("DV", DV),
            ("HK", HK),
            ("HV", HV),
            ("SIMDGROUPS", simdgroups),
            ("ROWS", -(-DV // simdgroups)),
        ],
        grid=(32 * simdgroups, 1, B * HV),
        threadgroup=(32 * simdgroups, 1, 1),
    )


def gated_delta_replay(state: Optional[mx.array], k: mx.array, g: mx.array, delta: mx.array, steps: int) -> mx.array:
    """The state after the first `steps` tape steps from `state` (None: zeros), in closed form:
    S_n = (g_1..g_n) S_0 + sum_t (g_{t+1}..g_n) delta_t k_t^T  -- one matmul, no recurrence."""
    state = initial_state(state, k, delta)
    if steps == 0:
        return state
    k = mx.repeat(k[:, :steps].astype(mx.float32), delta.shape[2] // k.shape[2], axis=2)
    g, delta = g[:, :steps], delta[:, :steps]
    later = mx.cumprod(g, axis=1, reverse=True, inclusive=False)  # g_{t+1} ... g_n
    update = mx.einsum("bthv,bthk->bhvk", delta * later[..., None], k)
    return mx.cumprod(g, axis=1)[:, -1, :, None, None] * state + update
