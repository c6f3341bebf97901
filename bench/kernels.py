"""Speed of the custom kernels against what they replace (run it on a Mac).

    python bench/kernels.py [--repeats 50]

1. Drafter block attention (16 queries, Qwen3-8B-like heads 32/8 x 128, bf16):
   the fused kernel reading the context buffer in place vs slicing + concatenating
   context and block, then mx.fast.scaled_dot_product_attention.
2. GatedDeltaNet rollback after a 16-token verify (Qwen3-Next-like heads 16/32 x
   128): the closed-form replay from the tape vs re-running the recurrence on the
   accepted steps.

Without Metal both columns of (1) are the MLX path and the script says so.
Medians over --repeats timed calls after a warm-up.
"""

import statistics
import time

import typer

import dflash_mlx  # noqa: F401  (loads OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.models.gated_delta import compute_g, gated_delta_update

from dflash_mlx.kernels import metal as kernels
from dflash_mlx.io.progress import add_task, progress


def median_ms(fn, repeats: int) -> float:
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def attention_rows(repeats: int, contexts=(512, 1024, 2048, 4096, 8192)):
    B, HQ, HKV, L, D = 1, 32, 8, 16, 128
    fused = kernels.run_metal if kernels.use_metal() else None
    rows = []
    with progress() as bar:
        task = add_task(bar, "block attention", total=len(contexts))
        for context in contexts:
            q, k, v = (mx.random.normal((B, h, L, D)).astype(mx.bfloat16) for h in (HQ, HKV, HKV))
            ck, cv = (mx.random.normal((B, HKV, context + 256, D)).astype(mx.bfloat16) for _ in range(2))
            span = kernels.ContextSpan(ck, cv, 0, context)
            concat = median_ms(lambda: kernels.block_attention_mlx(q, k, v, span, scale=D**-0.5), repeats)
            launch = kernels.block_attention_launch(q, k, v, span, scale=D**-0.5)
            fused_ms = median_ms(lambda: fused(launch)[0], repeats) if fused else float("nan")
            rows.append((context, concat, fused_ms))
            bar.advance(task)
    return rows


def rollback_rows(repeats: int, keeps=(1, 4, 8, 15)):
    B, T, HK, HV, DK, DV = 1, 16, 16, 32, 128, 128
    q, k = ((mx.random.normal((B, T, HK, DK)) * DK**-0.5) for _ in range(2))
    v = mx.random.normal((B, T, HV, DV))
    a, b = mx.random.normal((B, T, HV)), mx.random.normal((B, T, HV))
    A_log, dt_bias = mx.zeros((HV,)), mx.zeros((HV,))
    state = mx.random.normal((B, HV, DV, DK)) * 0.1
    g, beta = compute_g(A_log, a, dt_bias), mx.sigmoid(b)
    _, _, delta = kernels.gated_delta_tape(q, k, v, g, beta, state)
    mx.eval(delta)
    rows = []
    for keep in keeps:
        replay = median_ms(lambda: kernels.gated_delta_replay(state, k, g, delta, keep), repeats)
        rerun = median_ms(
            lambda: gated_delta_update(
                q[:, :keep], k[:, :keep], v[:, :keep], a[:, :keep], b[:, :keep], A_log, dt_bias, state
            )[1],
            repeats,
        )
        rows.append((keep, rerun, replay))
    return rows


def main(repeats: int = 50):
    device = "Metal GPU" if kernels.use_metal() else "no Metal: MLX twins only"
    print(f"# dflash-mlx kernels ({device}, mlx {mx.__version__})\n")
    print("| context | concat + SDPA ms | fused kernel ms | speedup |\n|---|---|---|---|")
    for context, concat, fused in attention_rows(repeats):
        fused_cells = f"{fused:.3f} | {concat / fused:.2f}x" if fused == fused else "n/a (needs Metal) | -"
        print(f"| {context} | {concat:.3f} | {fused_cells} |")
    print("\n| accepted of 16 | re-run recurrence ms | tape replay ms | speedup |\n|---|---|---|---|")
    for keep, rerun, replay in rollback_rows(repeats):
        print(f"| {keep} | {rerun:.3f} | {replay:.3f} | {rerun / replay:.2f}x |")


if __name__ == "__main__":
    typer.run(main)
