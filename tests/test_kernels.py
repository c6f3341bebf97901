"""The Metal kernels in metal/, checked on this CPU through the C++ emulation
of the MSL features they use, against their pure-MLX twins; plus Mac-only
parity/speed tests (skipped elsewhere, with the reason)."""

import time

import mlx.core as mx
import pytest
from mlx_lm.models.gated_delta import gated_delta_ops

from dflash_mlx import kernels
from msl_emulator import run_emulated
from test_engine import dflash_greedy, plain_greedy
from tiny_models import oracle_draft, tiny_target

TOLERANCE = {mx.float32: 1e-5, mx.float16: 1e-2, mx.bfloat16: 1e-2}
on_mac = pytest.mark.skipif(not mx.metal.is_available(),
                            reason="needs Apple Metal, which this machine lacks; the emulated tests cover the kernel logic")


def relative_error(got: mx.array, want: mx.array) -> float:
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    return float(mx.abs(got - want).max() / mx.maximum(mx.abs(want).max(), 1e-30))


def attention_inputs(B, HQ, HKV, L, D, context, dtype, capacity_extra=7, start=3, seed=0):
    mx.random.seed(seed)
    q, k, v = (mx.random.normal((B, h, L, D)).astype(dtype) for h in (HQ, HKV, HKV))
    span = None
    if context is not None:  # context=0 is an empty but allocated buffer
        capacity = start + context + capacity_extra
        ck, cv = (mx.random.normal((B, HKV, capacity, D)).astype(dtype) for _ in range(2))
        span = kernels.ContextSpan(ck, cv, start, context)
    return q, k, v, span


# B, HQ, HKV, L, D, context, causal, window: block of 1, no context, empty context,
# lengths that are not multiples of 32, GQA 1x/2x/4x, head_dim 64 and 128.
ATTENTION_CASES = [
    (1, 4, 2, 16, 64, 37, False, None),
    (1, 2, 2, 1, 64, None, False, None),
    (1, 4, 1, 5, 128, 0, False, None),
    (2, 4, 2, 7, 64, 300, True, None),
    (1, 8, 2, 16, 128, 45, False, 20),
    (1, 4, 4, 3, 64, 33, True, 8),
]


@pytest.mark.parametrize("B,HQ,HKV,L,D,context,causal,window", ATTENTION_CASES)
def test_emulated_block_attention_matches_mlx(B, HQ, HKV, L, D, context, causal, window):
    q, k, v, span = attention_inputs(B, HQ, HKV, L, D, context, mx.float32)
    scale = D**-0.5
    want = kernels.block_attention_mlx(q, k, v, span, scale=scale, causal=causal, window=window)
    launch = kernels.block_attention_launch(q, k, v, span, scale=scale, causal=causal, window=window)
    got = run_emulated(launch)[0]
    assert got.shape == want.shape and got.dtype == want.dtype
    assert relative_error(got, want) < TOLERANCE[mx.float32]


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_emulated_block_attention_half_precision(dtype):
    q, k, v, span = attention_inputs(1, 4, 2, 9, 64, 70, dtype)
    want = kernels.block_attention_mlx(q, k, v, span, scale=0.125)
    got = run_emulated(kernels.block_attention_launch(q, k, v, span, scale=0.125))[0]
    assert got.dtype == dtype
    assert relative_error(got, want) < TOLERANCE[dtype]


def test_emulated_block_attention_reads_only_the_live_span():
    """Garbage outside [start, start + length) of the buffer must not leak in."""
    q, k, v, span = attention_inputs(1, 4, 2, 4, 64, 20, mx.float32)
    poisoned = mx.full(span.keys.shape, 1e4)
    live = slice(span.start, span.start + span.length)
    poisoned[..., live, :] = span.keys[..., live, :]
    dirty = kernels.ContextSpan(poisoned, span.values, span.start, span.length)
    want = kernels.block_attention_mlx(q, k, v, span, scale=0.125)
    got = run_emulated(kernels.block_attention_launch(q, k, v, dirty, scale=0.125))[0]
    assert relative_error(got, want) < TOLERANCE[mx.float32]


def tape_inputs(B, T, HK, HV, DK, DV, dtype=mx.float32, seed=0):
    mx.random.seed(seed)
    q = (mx.random.normal((B, T, HK, DK)) * DK**-0.5).astype(dtype)
    k = (mx.random.normal((B, T, HK, DK)) * DK**-0.5).astype(dtype)
    v = mx.random.normal((B, T, HV, DV)).astype(dtype)
    g = mx.random.uniform(0.3, 1.0, (B, T, HV))
    beta = mx.random.uniform(0.0, 1.0, (B, T, HV))
    state = mx.random.normal((B, HV, DV, DK)) * 0.5
    return q, k, v, g, beta, state


TAPE_CASES = [(1, 1, 1, 1, 32, 8), (1, 16, 2, 4, 64, 16), (2, 5, 1, 2, 128, 12), (1, 16, 2, 2, 128, 128)]


@pytest.mark.parametrize("B,T,HK,HV,DK,DV", TAPE_CASES)
def test_emulated_gated_delta_tape_matches_mlx(B, T, HK, HV, DK, DV):
    inputs = tape_inputs(B, T, HK, HV, DK, DV)
    want = kernels.gated_delta_tape_mlx(*inputs)
    got = run_emulated(kernels.gated_delta_tape_launch(*inputs))
    for name, g, w in zip(("y", "state", "delta"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert relative_error(g, w) < TOLERANCE[mx.float32], name


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_emulated_gated_delta_tape_half_precision(dtype):
    inputs = tape_inputs(1, 8, 2, 4, 64, 16, dtype)
    want = kernels.gated_delta_tape_mlx(*inputs)
    got = run_emulated(kernels.gated_delta_tape_launch(*inputs))
    for g, w in zip(got, want):
        assert relative_error(g, w) < TOLERANCE[dtype]


def test_tape_twin_is_mlx_lm_recurrence():
    q, k, v, g, beta, state = tape_inputs(1, 9, 2, 4, 32, 16)
    y, final, _ = kernels.gated_delta_tape_mlx(q, k, v, g, beta, state)
    want_y, want_state = gated_delta_ops(q, k, v, g, beta, state)
    assert relative_error(y, want_y) < 1e-6 and relative_error(final, want_state) < 1e-6


def test_replay_is_the_state_after_each_prefix():
    q, k, v, g, beta, state = tape_inputs(1, 16, 2, 4, 32, 16)
    _, _, delta = kernels.gated_delta_tape_mlx(q, k, v, g, beta, state)
    for steps in range(17):
        _, want = gated_delta_ops(q[:, :steps], k[:, :steps], v[:, :steps], g[:, :steps], beta[:, :steps], state) \
            if steps else (None, state)
        assert relative_error(kernels.gated_delta_replay(state, k, g, delta, steps), want) < 1e-5, steps


def run_scratch_kernel(directory, body: str, threads: int):
    """Emulate a throwaway kernel body: out[i] from x[i] (all ones), one threadgroup."""
    (directory / "scratch.metal").write_text(body)
    launch = kernels.Launch(kernel="scratch", inputs=dict(x=mx.ones((threads,))),
                            outputs=dict(out=((threads,), mx.float32)), template=[], grid=(threads, 1, 1),
                            threadgroup=(threads, 1, 1))
    return run_emulated(launch, source_dir=directory)[0]


def test_emulator_enforces_synchronisation_rules(tmp_path):
    """Negative controls: the emulator checks barriers and simd operations, not just arithmetic."""
    summed = run_scratch_kernel(tmp_path, "out[thread_position_in_grid.x] = simd_sum(x[thread_position_in_grid.x]);\n", 64)
    assert summed.tolist() == [32.0] * 64  # one sum per simdgroup of 32
    with pytest.raises(RuntimeError, match="barrier reached after some threads"):
        run_scratch_kernel(tmp_path, "if (thread_index_in_threadgroup == 0) { return; }\n"
                                     "threadgroup_barrier(mem_flags::mem_threadgroup);\n"
                                     "out[thread_position_in_grid.x] = 1.0f;\n", 64)
    with pytest.raises(RuntimeError, match="divergence"):
        run_scratch_kernel(tmp_path, "float s = x[thread_position_in_grid.x];\n"
                                     "if (thread_index_in_simdgroup < 16) { s = simd_sum(s); }\n"
                                     "else { threadgroup_barrier(mem_flags::mem_threadgroup); }\n"
                                     "out[thread_position_in_grid.x] = s;\n", 32)


@pytest.fixture
def emulated_kernels(monkeypatch):
    """Route every kernel call of the engine through the emulated Metal kernels."""
    calls = []

    def run(launch):
        calls.append(launch.kernel)
        return run_emulated(launch)

    monkeypatch.setattr(kernels, "use_metal", lambda: True)
    monkeypatch.setattr(kernels, "run_metal", run)
    return calls


def test_decoding_with_emulated_kernels_is_lossless(emulated_kernels):
    target = tiny_target("qwen3_5", seed=2, linear_key_head_dim=32)
    prompt = [1, 5, 9, 13, 2, 7, 40, 3]
    reference = plain_greedy(target, prompt, 24)
    # wrong drafts at scattered positions: every accepted length and rollback depth occurs
    draft = oracle_draft(target, prompt + reference, wrong={11, 14, 15, 22, 27}, block_size=6, head_dim=64)
    out, stats = dflash_greedy(target, draft, prompt, max_tokens=24)
    assert out == reference
    assert {"block_attention", "gated_delta_tape"} <= set(emulated_kernels)
    assert len(set(stats.accepted_lengths)) > 2


def test_backend_flag(monkeypatch):
    monkeypatch.setenv("DFLASH_MLX_KERNELS", "mlx")
    assert kernels.use_metal() is False
    monkeypatch.setenv("DFLASH_MLX_KERNELS", "cuda")
    with pytest.raises(ValueError, match="not one of auto, metal, mlx"):
        kernels.use_metal()
    if not mx.metal.is_available():
        monkeypatch.setenv("DFLASH_MLX_KERNELS", "metal")
        with pytest.raises(RuntimeError, match="Metal is not available"):
            kernels.use_metal()
        monkeypatch.setenv("DFLASH_MLX_KERNELS", "auto")
        assert kernels.use_metal() is False


def test_unsupported_head_dim_uses_the_twin_and_says_so(monkeypatch):
    monkeypatch.setattr(kernels, "use_metal", lambda: True)
    q, k, v, span = attention_inputs(1, 2, 2, 3, 48, 5, mx.float32)
    kernels._warn_once.cache_clear()
    with pytest.warns(UserWarning, match="head_dim % 32"):
        out = kernels.block_attention(q, k, v, span, scale=0.1)
    assert relative_error(out, kernels.block_attention_mlx(q, k, v, span, scale=0.1)) == 0


@on_mac
@pytest.mark.metal
@pytest.mark.parametrize("case", ATTENTION_CASES)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_metal_block_attention_matches_mlx(case, dtype):
    B, HQ, HKV, L, D, context, causal, window = case
    q, k, v, span = attention_inputs(B, HQ, HKV, L, D, context, dtype)
    want = kernels.block_attention_mlx(q, k, v, span, scale=D**-0.5, causal=causal, window=window)
    got = kernels.run_metal(kernels.block_attention_launch(q, k, v, span, scale=D**-0.5, causal=causal,
                                                           window=window))[0]
    assert relative_error(got, want) < 10 * TOLERANCE[dtype]  # GPU exp is not correctly rounded


@on_mac
@pytest.mark.metal
@pytest.mark.parametrize("case", TAPE_CASES)
def test_metal_gated_delta_tape_matches_mlx(case):
    inputs = tape_inputs(*case)
    for got, want in zip(kernels.run_metal(kernels.gated_delta_tape_launch(*inputs)),
                         kernels.gated_delta_tape_mlx(*inputs)):
        assert relative_error(got, want) < 1e-4


@on_mac
@pytest.mark.metal
def test_metal_fused_attention_beats_concat_at_4k():
    q, k, v, span = attention_inputs(1, 32, 8, 16, 128, 4096, mx.bfloat16)

    def timed(fn, n=50):
        mx.eval(fn())
        start = time.perf_counter()
        for _ in range(n):
            mx.eval(fn())
        return (time.perf_counter() - start) / n

    fused = timed(lambda: kernels.run_metal(kernels.block_attention_launch(q, k, v, span, scale=0.088))[0])
    concat = timed(lambda: kernels.block_attention_mlx(q, k, v, span, scale=0.088))
    assert fused < concat, f"fused {fused * 1e3:.3f} ms vs concat+SDPA {concat * 1e3:.3f} ms"
