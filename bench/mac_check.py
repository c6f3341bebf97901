"""One command for a Mac owner: do dflash-mlx's Metal kernels agree with their MLX twins and
are they faster, what does a verify pass cost on this GPU, and how fast is DFlash against plain
mlx-lm here?

    python bench/mac_check.py [--repeats 20] [--model M] [--prompts 6] [--max-tokens 128]

Prints, as markdown to paste into an issue: kernel parity (max relative error, kernel vs twin,
for the drafter's block attention at head_dim 64/128/256 in fp32/fp16/bf16, widths 1/4/16,
bidirectional and causal, and the GatedDeltaNet tape in fp32/bf16); kernel speed (fused
attention vs concat + SDPA, tape replay vs re-running the recurrence); the verify cost curve of
the 4-bit target (a target pass of 1-16 tokens on a 1k-token cache, and the drafter's pass:
what the adaptive plan decides on); and DFlash against plain mlx-lm on a few prompts (tok/s,
speedup, tau, peak memory).  Exit status 1 if any parity check fails.  Nobody on the project
has run it on Apple hardware yet.
"""

import sys
import tempfile
from typing import Optional

import typer

import dflash_mlx  # noqa: F401  (loads OpenBLAS before mlx)
import mlx.core as mx

from dflash_mlx import load
from dflash_mlx.kernels import metal as kernels
from dflash_mlx.bench.harness import run_bench
from dflash_mlx.decode.costs import measure_costs

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from kernels import attention_rows, rollback_rows  # noqa: E402  (bench/kernels.py, the speed tables)

CONTEXTS = (1024, 4096)
TOLERANCE = {mx.float32: 1e-4, mx.float16: 2e-2, mx.bfloat16: 2e-2}  # GPU exp is not correctly rounded


def relative_error(got: mx.array, want: mx.array) -> float:
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    return float(mx.abs(got - want).max() / mx.maximum(mx.abs(want).max(), 1e-30))


def attention_parity(contexts=CONTEXTS, head_dims=(64, 128, 256), dtypes=tuple(TOLERANCE), widths=(1, 4, 16), run=None):
    """Rows (context, head_dim, dtype, width, causal, error, ok) of the block attention kernel vs its twin."""
    run = run or kernels.run_metal
    rows = []
    for context in contexts:
        for D in head_dims:
            for dtype in dtypes:
                for L in widths:
                    for causal in (False, True):
                        q, k, v = (mx.random.normal((1, h, L, D)).astype(dtype) for h in (8, 2, 2))
                        ck, cv = (mx.random.normal((1, 2, context + 16, D)).astype(dtype) for _ in range(2))
                        span = kernels.ContextSpan(ck, cv, 5, context)
                        want = kernels.block_attention_mlx(q, k, v, span, scale=D**-0.5, causal=causal)
                        got = run(kernels.block_attention_launch(q, k, v, span, scale=D**-0.5, causal=causal))[0]
                        error = relative_error(got, want)
                        rows.append((context, D, dtype, L, causal, error, error < TOLERANCE[dtype]))
    return rows


def tape_parity(dtypes=(mx.float32, mx.bfloat16), widths=(1, 4, 16), run=None):
    """Rows (dtype, width, error, ok) of the GatedDeltaNet tape kernel vs its twin (worst output)."""
    run = run or kernels.run_metal
    rows = []
    for dtype in dtypes:
        for T in widths:
            B, HK, HV, DK, DV = 1, 4, 8, 128, 128
            q, k = ((mx.random.normal((B, T, HK, DK)) * DK**-0.5).astype(dtype) for _ in range(2))
            v = mx.random.normal((B, T, HV, DV)).astype(dtype)
            g, beta = mx.random.uniform(0.3, 1.0, (B, T, HV)), mx.random.uniform(0.0, 1.0, (B, T, HV))
            state = mx.random.normal((B, HV, DV, DK)) * 0.5
            got = run(kernels.gated_delta_tape_launch(q, k, v, g, beta, state))
            want = kernels.gated_delta_tape_mlx(q, k, v, g, beta, state)
            error = max(relative_error(a, b) for a, b in zip(got, want))
            rows.append((dtype, T, error, error < TOLERANCE[dtype]))
    return rows


def verify_curve(pair, context: int = 1024, widths=(1, 2, 4, 8, 16), repeats: int = 5) -> list[tuple]:
    """Rows (width, target pass ms, drafter pass ms at that width) on a `context`-token cache."""
    cost = measure_costs(pair.target, pair.draft, context=context, widths=widths, repeats=repeats)
    return [(w, 1e3 * cost.verify(w), 1e3 * cost.drafter_pass(w) if w > 1 else 0.0) for w in widths]


def end_to_end(pair, tokenizer, prompts: int = 6, max_tokens: int = 128, out: Optional[str] = None) -> list[dict]:
    """The benchmark harness's summary over `prompts` prompts of the mixed sets, greedy and
    sampled, plain mlx-lm and DFlash interleaved: one row per mode (medians; bench/harness.py)."""
    with tempfile.TemporaryDirectory() as scratch:
        sets = ["gsm8k", "humaneval", "mtbench"]
        results = run_bench(
            pair, tokenizer, sets, -(-prompts // len(sets)), max_tokens, ["greedy", "sampled"], out or scratch
        )
    return [row for row in results["summary"] if row["set"] == "all"]


def main(
    repeats: int = 20,
    model: Optional[str] = typer.Option(None, "--model", help="Target (default: the offline SmolLM2, 4-bit)."),
    prompts: int = typer.Option(6, "--prompts"),
    max_tokens: int = typer.Option(128, "--max-tokens"),
):
    if not kernels.use_metal():
        raise SystemExit(
            "bench/mac_check.py needs a Mac with Metal (and the GPU as MLX's default device); "
            "this machine has neither, so only the MLX twins run here"
        )
    print(f"# dflash-mlx Metal kernels on {mx.metal.device_info().get('device_name', 'a Mac')}, mlx {mx.__version__}\n")
    failures = 0
    print("| context | head_dim | dtype | width | causal | max rel. error | ok |\n|---|---|---|---|---|---|---|")
    for context, D, dtype, L, causal, error, ok in attention_parity():
        failures += not ok
        print(f"| {context} | {D} | {dtype} | {L} | {causal} | {error:.2e} | {'yes' if ok else 'NO'} |")
    print("\n| tape dtype | width | max rel. error | ok |\n|---|---|---|---|")
    for dtype, T, error, ok in tape_parity():
        failures += not ok
        print(f"| {dtype} | {T} | {error:.2e} | {'yes' if ok else 'NO'} |")
    print("\n| context | concat + SDPA ms | fused kernel ms | speedup |\n|---|---|---|---|")
    for context, concat, fused in attention_rows(repeats, contexts=CONTEXTS):
        print(f"| {context} | {concat:.3f} | {fused:.3f} | {concat / fused:.2f}x |")
    print("\n| accepted of 16 | re-run recurrence ms | tape replay ms | speedup |\n|---|---|---|---|")
    for keep, rerun, replay in rollback_rows(repeats):
        print(f"| {keep} | {rerun:.3f} | {replay:.3f} | {rerun / replay:.2f}x |")
    pair, tokenizer = load(model, quant=4)
    print(f"\n{model or 'SmolLM2-135M-Instruct'} 4-bit, 1k-token cache\n")
    print("| width | target pass ms | drafter pass ms |\n|---|---|---|")
    for width, verify, draft in verify_curve(pair):
        print(f"| {width} | {verify:.2f} | {draft:.2f} |")
    print("\n| mode | plain mlx-lm tok/s | DFlash tok/s | speedup (median) | tau | peak GB plain / DFlash |")
    print("|---|---|---|---|---|---|")
    for r in end_to_end(pair, tokenizer, prompts, max_tokens):
        print(
            f"| {r['mode']} | {r['plain_tps']:.1f} | {r['dflash_tps']:.1f} | {r['speedup']:.2f}x | {r['tau']:.2f} "
            f"| {r['plain_peak_gb']:.2f} / {r['dflash_peak_gb']:.2f} |"
        )
    print(f"\n{failures} parity failure(s)")
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    typer.run(main)
