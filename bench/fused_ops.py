"""One target forward in our CPU forms (fused_ops.py: norms and RoPEs compiled, matmul
weights column-major) against mlx-lm's own ops on row-major weights; or, with `--attention`,
one layer's attention alone (SmolLM2's 9 query heads on 3 kv heads of 64), ours (in parts,
with the C++ row softmax where it is built) against `mx.fast.scaled_dot_product_attention`.

    python bench/fused_ops.py [--shapes 1x1,1x2,1x4,1x8,4x1,8x1] [--context 300] [--repeats 40]
    python bench/fused_ops.py --attention [--shapes 1x16x2500,4x16x2100,1x128x2048,1x16x8000]

For each shape rows x tokens: the forward over `tokens` new tokens per row on top of a
`context`-token cache (trimmed back after each pass), the fused and the unfused model
interleaved in rounds of 10 passes (leaving and re-entering the CPU forms re-stores the
weights); medians in ms, the primitives of each graph, and whether the logits are bitwise equal.
"""

import re
import statistics
import tempfile
import time

import typer

import dflash_mlx  # noqa: F401  (loads OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from dflash_mlx import load
from dflash_mlx.bench.harness import machine
from dflash_mlx.kernels.fused_ops import scaled_dot_product_attention, unfused


def primitives(*outputs) -> int:
    """Primitives in the graph that computes `outputs` (already evaluated inputs excluded)."""
    with tempfile.NamedTemporaryFile("w+", suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs)
        return len(re.findall(r"shape=rectangle", open(f.name).read()))


def attention(shapes: str, repeats: int) -> None:
    """One layer's causal attention per shape rows x queries x keys, MLX's and ours in turn."""
    print(f"Machine: {machine()}; medians of {repeats} calls, in turn\n")
    print("| rows x queries x keys | mlx ms | ours ms | speedup | largest difference |")
    print("|---|---|---|---|---|")
    for shape in shapes.split(","):
        rows, queries, keys = map(int, shape.split("x"))
        q = mx.random.normal((rows, 9, queries, 64))
        k, v = mx.random.normal((2, rows, 3, keys, 64))
        mx.eval(q, k, v)
        ways = {
            "mlx": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal"),
            "ours": lambda: scaled_dot_product_attention(q, k, v, None, scale=0.125, mask="causal"),
        }
        times = {name: [] for name in ways}
        for _ in range(repeats):
            for name, way in ways.items():
                tic = time.perf_counter()
                mx.eval(way())
                times[name].append(1e3 * (time.perf_counter() - tic))
        a, b = (statistics.median(times[name]) for name in ways)
        difference = mx.abs(ways["ours"]() - ways["mlx"]()).max().item()
        print(f"| {rows} x {queries} x {keys} | {a:.2f} | {b:.2f} | {a / b:.2f}x | {difference:.1e} |", flush=True)


def main(
    shapes: str = typer.Option("", help="rows x tokens (forward) or rows x queries x keys (--attention)"),
    context: int = 300,
    repeats: int = 40,
    attention_only: bool = typer.Option(False, "--attention", help="one layer's attention alone"),
):
    if attention_only:
        return attention(shapes or "1x16x2500,4x16x2100,1x128x2048,1x16x8000", repeats)
    shapes = shapes or "1x1,1x2,1x4,1x8,4x1,8x1"
    model, _ = load(use_draft=False, adaptive=False)
    net = model.target.model
    print(f"Machine: {machine()}; context {context} tokens; medians of {repeats} interleaved passes\n")
    print("| rows x tokens | mlx-lm ops ms | compiled ms | speedup | primitives (mlx-lm / compiled) | bitwise equal |")
    print("|---|---|---|---|---|---|")
    for shape in shapes.split(","):
        rows, tokens = map(int, shape.split("x"))
        cache = make_prompt_cache(net)
        mx.eval(net(mx.array([list(range(100, 100 + context))] * rows), cache=cache))
        block = mx.array([[500 + i for i in range(tokens)]] * rows)

        def forward(timed: list):
            tic = time.perf_counter()
            logits = net(block, cache=cache)
            count = primitives(logits) if timed is None else 0
            mx.eval(logits)
            if timed is not None:
                timed.append(1e3 * (time.perf_counter() - tic))
            for layer_cache in cache:
                layer_cache.trim(tokens)
            return logits, count

        fused, fused_count = forward(None)  # warm-up (tracing) and the graph's size
        with unfused(net):
            theirs, theirs_count = forward(None)
        ours_ms, theirs_ms = [], []
        for _ in range(max(1, repeats // 10)):
            with unfused(net):
                for _ in range(10):
                    forward(theirs_ms)
            for _ in range(10):
                forward(ours_ms)
        a, b = statistics.median(theirs_ms), statistics.median(ours_ms)
        print(
            f"| {rows} x {tokens} | {a:.1f} | {b:.1f} | {a / b:.3f}x | {theirs_count} / {fused_count} | "
            f"{mx.array_equal(fused, theirs).item()} |",
            flush=True,
        )


if __name__ == "__main__":
    typer.run(main)
