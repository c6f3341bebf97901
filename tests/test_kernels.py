"""The Metal kernels in metal/, checked on this CPU through the C++ emulation
of the MSL features they use, against their pure-MLX twins; plus Mac-only
parity/speed tests (skipped elsewhere, with the reason)."""

import hashlib
import json
import logging
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx_lm.models.gated_delta import gated_delta_ops

import msl_emulator
from dflash_mlx.kernels import metal as kernels
from msl_emulator import build, emulate, generated, run_emulated
from test_engine import dflash_greedy, plain_greedy
from tiny_models import oracle_draft, tiny_target

TOLERANCE = {mx.float32: 1e-5, mx.float16: 1e-2, mx.bfloat16: 1e-2}
on_mac = pytest.mark.skipif(
    not mx.metal.is_available(),
    reason="needs Apple Metal, which this machine lacks; the emulated tests cover the kernel logic",
)


@pytest.fixture(scope="module")
def emulator():
    """The C++ emulation builds here, or (on a Mac only) the tests that need it are skipped:
    there the kernels themselves run, in the tests marked metal."""
    try:
        build('#include "metal_emulation.h"\nint main() { return 0; }\n', "probe")
    except RuntimeError as error:
        if sys.platform == "darwin":
            pytest.skip(
                f"the C++ Metal emulation does not build on this Mac ({str(error).splitlines()[-1]}); "
                "the real kernels run in the tests marked metal"
            )
        raise


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
def test_emulated_block_attention_matches_mlx(B, HQ, HKV, L, D, context, causal, window, emulator):
    q, k, v, span = attention_inputs(B, HQ, HKV, L, D, context, mx.float32)
    scale = D**-0.5
    want = kernels.block_attention_mlx(q, k, v, span, scale=scale, causal=causal, window=window)
    launch = kernels.block_attention_launch(q, k, v, span, scale=scale, causal=causal, window=window)
    got = run_emulated(launch)[0]
    assert got.shape == want.shape and got.dtype == want.dtype
    assert relative_error(got, want) < TOLERANCE[mx.float32]


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_emulated_block_attention_half_precision(dtype, emulator):
    q, k, v, span = attention_inputs(1, 4, 2, 9, 64, 70, dtype)
    want = kernels.block_attention_mlx(q, k, v, span, scale=0.125)
    got = run_emulated(kernels.block_attention_launch(q, k, v, span, scale=0.125))[0]
    assert got.dtype == dtype
    assert relative_error(got, want) < TOLERANCE[dtype]


def test_emulated_block_attention_reads_only_the_live_span(emulator):
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
def test_emulated_gated_delta_tape_matches_mlx(B, T, HK, HV, DK, DV, emulator):
    inputs = tape_inputs(B, T, HK, HV, DK, DV)
    want = kernels.gated_delta_tape_mlx(*inputs)
    got = run_emulated(kernels.gated_delta_tape_launch(*inputs))
    for name, g, w in zip(("y", "state", "delta"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert relative_error(g, w) < TOLERANCE[mx.float32], name


@pytest.mark.parametrize("HK,HV,DV", [(2, 4, 16), (1, 2, 40), (2, 2, 128)])
def test_tape_reads_each_input_once_per_value_head(emulator, HK, HV, DV):
    """One threadgroup per value head takes each step's q, k, v, g and beta into threadgroup
    memory once for all of the head's value rows (the previous kernel, a simdgroup per row,
    read q and k once per row: DV times); 40 rows leave some simdgroups a row short."""
    inputs = tape_inputs(1, 6, HK, HV, 64, DV)
    q, k, v, g, beta, state = inputs
    run = emulate(kernels.gated_delta_tape_launch(*inputs))
    for name, got, want in zip(("y", "state", "delta"), run.outputs, kernels.gated_delta_tape_mlx(*inputs)):
        assert relative_error(got, want) < TOLERANCE[mx.float32], name
    assert run.bytes_read["q"] == run.bytes_read["k"] == q.nbytes * (HV // HK)
    assert run.bytes_read["v"] == v.nbytes and run.bytes_read["state_in"] == state.nbytes
    assert run.bytes_read["g"] == g.nbytes and run.bytes_read["beta"] == beta.nbytes


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_emulated_gated_delta_tape_half_precision(dtype, emulator):
    inputs = tape_inputs(1, 8, 2, 4, 64, 16, dtype)
    want = kernels.gated_delta_tape_mlx(*inputs)
    got = run_emulated(kernels.gated_delta_tape_launch(*inputs))
    for g, w in zip(got, want):
        assert relative_error(g, w) < TOLERANCE[dtype]


def test_the_tape_launch_stays_within_the_threadgroup_ceiling(emulator, monkeypatch):
    """A compiled pipeline's maxTotalThreadsPerThreadgroup falls below the device's 1024 when the
    kernel uses many registers, and MLX does not expose it: the tape launches at most
    THREADGROUP_CEILING threads (256, what Metal guarantees) and is right under any ceiling, here
    an emulated GPU allowing 64 (128 value rows over 2 simdgroups)."""
    inputs = tape_inputs(1, 3, 2, 2, 64, 128)
    assert kernels.gated_delta_tape_launch(*inputs).threadgroup == (kernels.THREADGROUP_CEILING, 1, 1) == (256, 1, 1)
    monkeypatch.setattr(msl_emulator, "MAX_THREADS_PER_THREADGROUP", 64)
    with pytest.raises(ValueError, match="exceeds 64 threads"):  # the emulated ceiling bites
        emulate(kernels.gated_delta_tape_launch(*inputs))
    monkeypatch.setattr(kernels, "THREADGROUP_CEILING", 64)
    launch = kernels.gated_delta_tape_launch(*inputs)
    assert launch.threadgroup == (64, 1, 1)
    for name, got, want in zip(("y", "state", "delta"), run_emulated(launch), kernels.gated_delta_tape_mlx(*inputs)):
        assert relative_error(got, want) < TOLERANCE[mx.float32], name


def test_tape_twin_is_mlx_lm_recurrence():
    q, k, v, g, beta, state = tape_inputs(1, 9, 2, 4, 32, 16)
    y, final, _ = kernels.gated_delta_tape_mlx(q, k, v, g, beta, state)
    want_y, want_state = gated_delta_ops(q, k, v, g, beta, state)
    assert relative_error(y, want_y) < 1e-6 and relative_error(final, want_state) < 1e-6


def test_replay_is_the_state_after_each_prefix():
    q, k, v, g, beta, state = tape_inputs(1, 16, 2, 4, 32, 16)
    _, _, delta = kernels.gated_delta_tape_mlx(q, k, v, g, beta, state)
    for steps in range(17):
        _, want = (
            gated_delta_ops(q[:, :steps], k[:, :steps], v[:, :steps], g[:, :steps], beta[:, :steps], state)
            if steps
            else (None, state)
        )
        assert relative_error(kernels.gated_delta_replay(state, k, g, delta, steps), want) < 1e-5, steps


@pytest.fixture
def scratch_kernel(tmp_path, monkeypatch, emulator):
    """Emulate a throwaway kernel body over x (all ones, `threads` of them): out[i]."""
    monkeypatch.setattr(kernels, "_metal_dir", lambda: tmp_path)

    def run(body: str, threads: int, threadgroup: int = 0, x=None):
        name = "scratch_" + hashlib.sha1(body.encode()).hexdigest()[:12]  # run_metal caches kernels by name
        (tmp_path / f"{name}.metal").write_text(body)
        launch = kernels.Launch(
            kernel=name,
            inputs=dict(x=mx.ones((threads,)) if x is None else x),
            outputs=dict(out=((threads,), mx.float32)),
            template=[],
            grid=(threads, 1, 1),
            threadgroup=(threadgroup or threads, 1, 1),
        )
        return emulate(launch)

    return run


def test_emulator_enforces_synchronisation_rules(scratch_kernel):
    """Negative controls: the emulator checks barriers and simd operations, not just arithmetic."""
    summed = scratch_kernel("out[thread_position_in_grid.x] = simd_sum(x[thread_position_in_grid.x]);\n", 64)
    assert summed.outputs[0].tolist() == [32.0] * 64  # one sum per simdgroup of 32
    with pytest.raises(RuntimeError, match="barrier reached after some threads"):
        scratch_kernel(
            "if (thread_index_in_threadgroup == 0) { return; }\n"
            "threadgroup_barrier(mem_flags::mem_threadgroup);\n"
            "out[thread_position_in_grid.x] = 1.0f;\n",
            64,
        )
    with pytest.raises(RuntimeError, match="divergence"):
        scratch_kernel(
            "float s = x[thread_position_in_grid.x];\n"
            "if (thread_index_in_simdgroup < 16) { s = simd_sum(s); }\n"
            "else { threadgroup_barrier(mem_flags::mem_threadgroup); }\n"
            "out[thread_position_in_grid.x] = s;\n",
            32,
        )
    with pytest.raises(RuntimeError, match=r"out-of-bounds access x\[64\]"):
        scratch_kernel("out[thread_position_in_grid.x] = x[thread_position_in_grid.x + 1];\n", 64)


def test_emulator_dispatches_like_metal(scratch_kernel):
    """dispatchThreads: a grid that is not a multiple of the threadgroup gets a smaller last
    group (its last simdgroup partial), and a threadgroup larger than the grid shrinks to it."""
    sizes = scratch_kernel("out[thread_position_in_grid.x] = threads_per_threadgroup.x;\n", 100, 64)
    assert sizes.outputs[0].tolist() == [64.0] * 64 + [36.0] * 36
    sums = scratch_kernel("out[thread_position_in_grid.x] = simd_sum(x[thread_position_in_grid.x]);\n", 100, 64)
    assert sums.outputs[0].tolist() == [32.0] * 96 + [4.0] * 4
    shrunk = scratch_kernel("out[thread_position_in_grid.x] = threads_per_threadgroup.x;\n", 20, 256)
    assert shrunk.outputs[0].tolist() == [20.0] * 20


def test_small_inputs_are_constant_space_as_in_mlx(scratch_kernel):
    """MLX passes inputs of fewer than 8 elements in the constant address space: the emulated
    signature is MLX's own, so they are not device traffic there either."""
    body = "out[thread_position_in_grid.x] = x[thread_position_in_grid.x % 4];\n"
    small = scratch_kernel(body, 32, x=mx.arange(4, dtype=mx.float32))
    assert small.outputs[0].tolist() == [float(i % 4) for i in range(32)]
    assert small.bytes_read["x"] == 0
    large = scratch_kernel(body, 32, x=mx.arange(8, dtype=mx.float32))
    assert large.bytes_read["x"] == 32 * 4


def layout_of(launch: kernels.Launch) -> tuple[int, int]:
    """(splits, key slots) a block attention launch runs with, as its geometry tells the kernel."""
    geometry = launch.inputs["geometry"].tolist()
    return geometry[5], geometry[6]


# L, G, window, context, and the layout expected: 14-24 rows per KV head leave a threadgroup's
# 8 simdgroups (8 rows each) to share rows (key slots); a context past 2 x 256 keys is split
@pytest.mark.parametrize(
    "L,G,window,context,splits,key_slots",
    [
        (16, 4, None, 150, 1, 1),
        (7, 2, None, 150, 1, 4),
        (16, 1, 24, 150, 1, 4),
        (3, 8, None, 150, 1, 2),
        (4, 4, None, 1100, 4, 4),
        (16, 2, 700, 1500, 2, 2),
    ],
)
def test_block_attention_reads_each_kv_element_once(emulator, L, G, window, context, splits, key_slots):
    """The splits of a tile stream disjoint ranges of its keys through threadgroup memory:
    device reads of the context and block K/V are the live bytes, once per call (a kernel per
    query row would read them G * L times).  Each split, and each simdgroup sharing a row, loads
    that row's query into registers: the queries are read splits x key_slots times."""
    HKV, D = 2, 64
    q, k, v, span = attention_inputs(1, G * HKV, HKV, L, D, context, mx.float32)
    launch = kernels.block_attention_launch(q, k, v, span, scale=0.125, window=window)
    assert layout_of(launch) == (splits, key_slots)
    run = emulate(launch)
    want = kernels.block_attention_mlx(q, k, v, span, scale=0.125, window=window)
    assert relative_error(run.outputs[0], want) < TOLERANCE[mx.float32]
    visible_context = min(context, window - 1) if window else context  # block row 0 reaches furthest back
    assert run.bytes_read["ctx_keys"] == run.bytes_read["ctx_values"] == HKV * visible_context * D * 4
    assert run.bytes_read["keys"] == run.bytes_read["values"] == k.nbytes
    assert run.bytes_read["queries"] == q.nbytes * splits * key_slots
    assert launch.grid[1] == splits  # one tile covers every query row of a KV head at these sizes


@pytest.mark.slow  # a 4k-key emulated launch
def test_long_context_is_spread_over_many_threadgroups(emulator):
    """A 16-token block over a 4k context on 8 KV heads (the Qwen3 drafters' count; one query
    head each keeps the emulation short): each head's keys are split across threadgroups, 64
    busy ones in all (unsplit, 8: one per KV head), with equal shares, and the work in total is
    one score per (query row, key it sees): splitting computes nothing twice."""
    HQ = HKV = 8
    L, D, context = 16, 64, 4096
    q, k, v, span = attention_inputs(1, HQ, HKV, L, D, context, mx.float32)
    run = emulate(kernels.block_attention_launch(q, k, v, span, scale=0.125))
    assert relative_error(run.outputs[0], kernels.block_attention_mlx(q, k, v, span, scale=0.125)) < 1e-5
    work = [sum(simdgroups) for simdgroups in run.simd_operations]
    assert sum(count > 0 for count in work) >= 64
    assert max(work) <= 1.05 * min(work)
    assert sum(work) == HQ * L * (context + L)
    for L in (4, 8, 16):  # the drafters' real heads, not emulated: the launch alone
        drafter = attention_inputs(1, 32, 8, L, 128, context, mx.bfloat16)
        launch = kernels.block_attention_launch(*drafter, scale=128**-0.5)
        assert launch.grid[1] * launch.grid[2] >= 64, L


@pytest.mark.parametrize("L", [1, 4, pytest.param(8, marks=pytest.mark.slow), pytest.param(16, marks=pytest.mark.slow)])
def test_every_simdgroup_has_work_at_narrow_widths(emulator, L):
    """The drafters' heads (32 query, 8 KV, head_dim 128): a KV head's rows number 4 L, and a
    threadgroup has 8 simdgroups of 8 rows; below width 16 simdgroups share rows, taking every
    other (every 4th, 8th) key, so each scores keys, about equally many (rows alone shared out
    would keep 2 of 8 simdgroups busy at width 4), and no score is computed twice."""
    HQ, context = 32, 200
    q, k, v, span = attention_inputs(1, HQ, 8, L, 128, context, mx.float32)
    run = emulate(kernels.block_attention_launch(q, k, v, span, scale=128**-0.5))
    assert relative_error(run.outputs[0], kernels.block_attention_mlx(q, k, v, span, scale=128**-0.5)) < 1e-5
    assert len(run.simd_operations) == 8
    for simdgroups in run.simd_operations:
        assert len(simdgroups) == 8 and min(simdgroups) > 0.9 * max(simdgroups), simdgroups
    assert sum(map(sum, run.simd_operations)) == HQ * L * (context + L)


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, 6), (True, 5)])
def test_block_attention_at_any_split_count(emulator, monkeypatch, causal, window):
    """Splits of one key each (a split per key the tile sees, or more): rows that see none of
    a split's keys, and splits with no keys at all, weigh nothing in the combination, and every
    partial is written (the emulator's outputs start as NaN)."""
    monkeypatch.setattr(kernels, "SPLIT_KEYS", 1)
    monkeypatch.setattr(kernels, "ATTENTION_THREADGROUPS", 10**4)
    q, k, v, span = attention_inputs(1, 4, 2, 5, 64, 20, mx.float32)
    launch = kernels.block_attention_launch(q, k, v, span, scale=0.125, causal=causal, window=window)
    assert layout_of(launch)[0] == (min(20, window) if window else 20) + 5
    want = kernels.block_attention_mlx(q, k, v, span, scale=0.125, causal=causal, window=window)
    assert relative_error(run_emulated(launch)[0], want) < TOLERANCE[mx.float32]


REAL_HEAD_DIMS = (64, 128, 256)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("D", REAL_HEAD_DIMS)
def test_one_compiled_attention_kernel_serves_every_width(monkeypatch, D, dtype):
    """The launch the drafter makes, recorded by mx.export_function (MLX builds the kernel source
    without a Metal device): real head sizes and dtypes, widths 1-16 over a short and a 4k
    context, one Metal library for all of them (the width, the splits and the key slots are
    run-time values), threadgroups within Metal's limits."""
    monkeypatch.setattr(kernels, "use_metal", lambda: True)
    monkeypatch.setenv("DFLASH_MLX_KERNELS", "metal")  # unchecked: a self-check cannot run inside a recording
    names, layouts = set(), set()
    for L in range(1, 17):
        q, k, v, span = attention_inputs(1, 16, 4, L, D, 4096 if L % 4 == 0 else 40, dtype)
        layouts.add(layout_of(kernels.block_attention_launch(q, k, v, span, scale=D**-0.5)))
        recorded = []

        def record(node):
            if node.get("name") == "CustomKernel":
                recorded.append(node["arguments"])

        mx.export_function(record, lambda: kernels.block_attention(q, k, v, span, scale=D**-0.5, causal=L % 2 == 0))
        assert len(recorded) == 1, "the decoder's block attention did not take the Metal kernel"
        name, source, *dims = recorded[0][:8]
        names.add((name, source))
        assert dims[3] * dims[4] * dims[5] <= kernels.THREADGROUP_CEILING
    rows, chunk = kernels.attention_tiling(D, dtype)
    # a chunk of keys and of values, and a float32 row (D accumulators, max, sum) per simdgroup
    assert 2 * chunk * D * dtype.size + 8 * (D + 2) * 4 <= kernels.THREADGROUP_MEMORY
    assert len({splits for splits, _ in layouts}) > 1 and len({slots for _, slots in layouts}) > 1
    assert len(names) == 2  # causal and bidirectional: nothing else varies with the width or context


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("DK", REAL_HEAD_DIMS[:2])
def test_one_compiled_tape_kernel_serves_every_width(DK, dtype):
    """Real GatedDeltaNet heads (Qwen3.5 / Qwen3-Next have 16-32 value heads; with fewer than 8
    elements g and beta would go to constant space, a second kernel, as MLX does)."""
    launches = {
        generated(kernels.gated_delta_tape_launch(*tape_inputs(1, T, 8, 16, DK, 128, dtype))).name for T in range(1, 17)
    }
    assert len(launches) == 1


def test_head_dims_beyond_threadgroup_memory_use_the_twin(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "use_metal", lambda: True)
    assert kernels.attention_tiling(384, mx.float32) is None and kernels.attention_tiling(384, mx.bfloat16)
    q, k, v, span = attention_inputs(1, 2, 1, 2, 384, 3, mx.float32)
    kernels._say_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="dflash_mlx.kernels"):
        out = kernels.block_attention(q, k, v, span, scale=0.05)
        kernels.block_attention(q, k, v, span, scale=0.05)
    assert len(caplog.records) == 1 and "threadgroup memory" in caplog.records[0].getMessage()  # said once
    assert relative_error(out, kernels.block_attention_mlx(q, k, v, span, scale=0.05)) == 0


@pytest.mark.parametrize(
    "D,dtype,L,context",
    [(256, mx.bfloat16, 16, 61), (128, mx.float16, 1, 61), (256, mx.float32, 5, 61), (64, mx.bfloat16, 4, 1100)],
)
def test_emulated_block_attention_at_real_head_sizes(emulator, D, dtype, L, context):
    q, k, v, span = attention_inputs(1, 8, 2, L, D, context, dtype)
    want = kernels.block_attention_mlx(q, k, v, span, scale=D**-0.5, causal=True)
    got = run_emulated(kernels.block_attention_launch(q, k, v, span, scale=D**-0.5, causal=True))[0]
    assert relative_error(got, want) < TOLERANCE[dtype]


@pytest.fixture
def emulated_kernels(monkeypatch, emulator):
    """Route every kernel call of the engine through the emulated Metal kernels."""
    calls = []

    def run(launch):
        calls.append(launch.kernel)
        return run_emulated(launch)

    monkeypatch.setattr(kernels, "use_metal", lambda: True)
    monkeypatch.setenv("DFLASH_MLX_KERNELS", "metal")  # unchecked: the emulator is far slower than the twins
    monkeypatch.setattr(kernels, "run_metal", run)
    return calls


def assert_lossless_through_kernels(calls: list):
    """Greedy decoding of a hybrid target, drafter attention and GatedDeltaNet verify through the
    kernels (head sizes that qualify), equals plain decoding; `calls` lists the kernels run."""
    target = tiny_target("qwen3_5", seed=2, linear_key_head_dim=32)
    prompt = [1, 5, 9, 13, 2, 7, 40, 3]
    reference = plain_greedy(target, prompt, 24)
    # wrong drafts at scattered positions: every accepted length and rollback depth occurs
    draft = oracle_draft(target, prompt + reference, wrong={11, 14, 15, 22, 27}, block_size=6, head_dim=64)
    out, stats = dflash_greedy(target, draft, prompt, max_tokens=24)
    assert out == reference
    assert {"block_attention", "gated_delta_tape"} <= set(calls)
    assert len(set(stats.accepted_lengths)) > 2


def test_decoding_with_emulated_kernels_is_lossless(emulated_kernels):
    assert_lossless_through_kernels(emulated_kernels)


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


def test_unsupported_head_dim_uses_the_twin_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "use_metal", lambda: True)
    q, k, v, span = attention_inputs(1, 2, 2, 3, 48, 5, mx.float32)
    kernels._say_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="dflash_mlx.kernels"):
        out = kernels.block_attention(q, k, v, span, scale=0.1)
    assert len(caplog.records) == 1 and "head_dim % 32" in caplog.records[0].getMessage()
    assert relative_error(out, kernels.block_attention_mlx(q, k, v, span, scale=0.1)) == 0


@pytest.fixture
def mac_check(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "bench"))
    import mac_check

    return mac_check


@pytest.mark.slow  # every section of the Mac check, emulated
def test_mac_check_without_metal_reports_every_section(mac_check, tmp_path, monkeypatch):
    """On this Linux machine the check runs end to end on the default SmolLM2 pair (quick): every
    section is in the report, the Metal ones skipped with the reason, the others done."""
    if mx.metal.is_available():
        pytest.skip("this machine has Metal: python bench/mac_check.py runs every section here")
    monkeypatch.setattr(sys, "argv", ["mac_check.py", "--quick"])
    with pytest.raises(SystemExit) as done:
        mac_check.main(
            model=None, quant=None, gdn_model="Qwen3.5-4B", prompts=4, max_tokens=128, quick=True, out=tmp_path
        )
    sections = {s["name"]: s for s in json.loads((tmp_path / "report.json").read_text())["sections"]}
    assert list(sections) == [
        "environment",
        "kernel_self_checks",
        "lossless_greedy",
        "speed",
        "cost_curve",
        "gated_delta_target",
        "kernel_decisions",
    ]
    metal_only = {"kernel_self_checks", "gated_delta_target", "kernel_decisions"}
    assert all(sections[name]["status"] == "skipped: no Metal" for name in metal_only)
    assert all(sections[name]["status"] == "ok" for name in set(sections) - metal_only), sections
    assert [r["width"] for r in sections["speed"]["rows"]] == [4, 8, 16, "adaptive"]
    assert sections["lossless_greedy"]["rows"][0]["verdict"] == "identical"
    markdown = (tmp_path / "report.md").read_text()
    assert all(f"## {name}: " in markdown for name in sections)
    assert done.value.code == 0


def test_mac_check_reports_a_failing_section_and_goes_on(mac_check, tmp_path):
    """An error is that section's result, in one line, and the report is written all the same."""
    report = mac_check.Report(tmp_path, "python bench/mac_check.py")

    def broken():
        raise RuntimeError("the GPU fell over\nwith a traceback")

    report.run("first", broken)
    report.run("second", lambda: mac_check.Outcome([{"a": 1.5}]))
    sections = json.loads((tmp_path / "report.json").read_text())["sections"]
    assert [s["status"] for s in sections] == ["error: RuntimeError: the GPU fell over", "ok"]
    assert report.failed and "| 1.5 |" in (tmp_path / "report.md").read_text()


def test_mac_check_judges_a_first_difference_by_the_top2_gap(mac_check, monkeypatch):
    """Lossless on a CPU is token for token; on a GPU a first difference at a near-tie passes."""
    monkeypatch.setattr(mac_check, "plain_tokens", lambda pair, prompt, n: [1, 2, 3])
    monkeypatch.setattr(mac_check, "dflash_tokens", lambda pair, prompt, n, width: ([1, 2, 4], 2.0))
    monkeypatch.setattr(mac_check, "format_prompt", lambda tokenizer, text: [9])
    monkeypatch.setattr(mac_check, "top2_gap", lambda pair, prefix: (1e-6, 2.0))
    pair = SimpleNamespace(end_tokens=frozenset())
    on_cpu = mac_check.lossless(pair, None, ["x"], 3)
    assert on_cpu.failed and on_cpu.rows[0]["verdict"] == "DIFFERENT" and on_cpu.rows[0]["first difference"] == 2
    monkeypatch.setattr(mac_check.mx, "default_device", lambda: mx.gpu)
    on_gpu = mac_check.lossless(pair, None, ["x"], 3)
    assert not on_gpu.failed and on_gpu.rows[0]["verdict"] == "near-tie"


@on_mac
@pytest.mark.metal
@pytest.mark.parametrize("case", ATTENTION_CASES)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_metal_block_attention_matches_mlx(case, dtype):
    B, HQ, HKV, L, D, context, causal, window = case
    q, k, v, span = attention_inputs(B, HQ, HKV, L, D, context, dtype)
    want = kernels.block_attention_mlx(q, k, v, span, scale=D**-0.5, causal=causal, window=window)
    got = kernels.run_metal(kernels.block_attention_launch(q, k, v, span, scale=D**-0.5, causal=causal, window=window))[
        0
    ]
    assert relative_error(got, want) < 10 * TOLERANCE[dtype]  # GPU exp is not correctly rounded


@on_mac
@pytest.mark.metal
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("case", TAPE_CASES)
def test_metal_gated_delta_tape_matches_mlx(case, dtype):
    inputs = tape_inputs(*case, dtype=dtype)
    for got, want in zip(
        kernels.run_metal(kernels.gated_delta_tape_launch(*inputs)), kernels.gated_delta_tape_mlx(*inputs)
    ):
        assert relative_error(got, want) < kernels.tolerance(want.dtype)  # each output at its own dtype


@on_mac
@pytest.mark.metal
def test_decoding_through_metal_kernels_is_lossless(monkeypatch):
    monkeypatch.setenv("DFLASH_MLX_KERNELS", "metal")
    calls = []
    real = kernels.run_metal

    def counted(launch):
        calls.append(launch.kernel)
        return real(launch)

    monkeypatch.setattr(kernels, "run_metal", counted)
    assert_lossless_through_kernels(calls)


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


def test_mac_check_measures_speed_and_the_cost_curve(mac_check, tiny_dirs):
    """The Mac check's model tables, on a tiny pair here: DFlash against plain mlx-lm at the
    widths the drafter allows and adaptive, and the cost curve the plan decides on (a wider
    pass is never cheaper)."""
    from dflash_mlx import load

    pair, tokenizer = load(str(tiny_dirs[0]), str(tiny_dirs[1]))
    speed = mac_check.speed(pair, tokenizer, ["Count to five.", "Say hi."], max_tokens=6, warm_up=False)
    assert [r["width"] for r in speed.rows] == [4, "adaptive"]  # the tiny drafter's block is 4
    assert all(r["plain tok/s"] > 0 and r["DFlash tok/s"] > 0 and r["tau"] >= 1 for r in speed.rows)
    curve = mac_check.cost_curve(pair).rows
    assert all(a["target pass ms"] <= b["target pass ms"] for a, b in zip(curve, curve[1:]))
