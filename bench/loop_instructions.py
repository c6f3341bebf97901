"""What a plain step and a DFlash cycle cost in CPU instructions, split between the host's work
(Python, graph building, scheduling: the main thread) and the kernels' (MLX's stream thread),
on bench/loop_overhead.py's tiny pair: counts that a loaded machine does not move, where its
timings move by 2x (valgrind's callgrind counts the instructions, around the cycles only).

    nice -n 5 python bench/loop_instructions.py [--context 128] [--widths 1,4,16] [--cycles 16]

Needs valgrind (apt install valgrind); each width runs ~1 min under it.  A width of 1 is our
plain step; the others are DFlash cycles at that fixed width (random drafter: one token a
cycle).  On a Mac the kernels run on the GPU: the host's share is what transfers.  valgrind runs
no AVX-512 code, so on a CPU that has it our softmax kernel is built for AVX2 (x86-64-v3) here:
the kernels' counts are an AVX2 machine's, the host's are unchanged.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # loop_overhead, imported where it is used (it loads MLX)

KERNEL_THREAD = "StreamThread::thread_fn"  # MLX's CPU stream: every kernel runs under it


def run_inside(context: int, width: int, cycles: int) -> None:
    """Under callgrind: `cycles` cycles at `width` after the same request was decoded once
    (every shape traced), instrumentation on around them only."""
    import resource

    resource.setrlimit = lambda *args: None  # mlx-lm raises the open-files limit, which valgrind keeps
    from itertools import islice

    import loop_overhead as lo
    import mlx.core as mx

    from dflash_mlx.decode.model import DFlashModel
    from dflash_mlx.target.wrapper import Target

    target = Target(lo.tiny_qwen3())
    model = DFlashModel(target, lo.tiny_drafter(target))
    prompt = mx.random.randint(0, lo.VOCAB - 1, (context,))
    for _ in islice(lo.full_width(model, prompt, cycles + 1, width), cycles + 1):
        pass
    steps = lo.full_width(model, prompt, cycles + 1, width)
    next(steps)
    subprocess.run(["callgrind_control", "-i", "on", str(os.getpid())], capture_output=True, check=True)
    for _ in islice(steps, cycles):
        pass
    subprocess.run(["callgrind_control", "-i", "off", str(os.getpid())], capture_output=True, check=True)
    steps.close()


def valgrind_runnable_build() -> dict:
    """Where the CPU has AVX-512 (which valgrind cannot run), the flags that build our softmax
    kernel for AVX2 instead (kept apart from the machine's own build)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    return {"CXXFLAGS": "-march=x86-64-v3"} if " avx512f" in flags else {}


def counted(context: int, width: int, cycles: int) -> tuple[int, int]:
    """(instructions in all, in MLX's stream thread) of `cycles` cycles at `width`."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "callgrind.out"
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]
        inside = [
            sys.executable,
            __file__,
            "--inside",
            f"--context={context}",
            f"--widths={width}",
            f"--cycles={cycles}",
        ]
        # one BLAS thread: its threads' spinning would be counted, by how busy the machine is
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", **valgrind_runnable_build()}
        done = subprocess.run(command + inside, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            lines = [line for line in done.stderr.splitlines() if line.strip()] or ["no output"]
            sys.exit(f"loop_instructions: the run under valgrind failed (exit {done.returncode}): {lines[-1].strip()}")
        report = subprocess.run(
            ["callgrind_annotate", "--inclusive=yes", str(out)], capture_output=True, text=True
        ).stdout
    total = int(re.search(r"([\d,]+) +\(100\.0%\) +PROGRAM TOTALS", report).group(1).replace(",", ""))
    kernels = next(line for line in report.splitlines() if KERNEL_THREAD in line)
    return total, int(kernels.split()[0].replace(",", ""))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--widths", default="1,4,16")
    parser.add_argument("--cycles", type=int, default=16)
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    if args.inside:
        return run_inside(args.context, widths[0], args.cycles)
    print(f"Instructions per plain step (width 1) or DFlash cycle, {args.context} tokens of context, millions\n")
    first = "plain" if widths[0] == 1 else f"width {widths[0]}"
    print(f"| width | all | host (main thread) | kernels (stream thread) | host / {first} | kernels / {first} |")
    print("|---|---|---|---|---|---|")
    base = None
    for width in widths:
        total, kernels = (n / args.cycles / 1e6 for n in counted(args.context, width, args.cycles))
        base = base or (total - kernels, kernels)
        print(
            f"| {width} | {total:.2f} | {total - kernels:.2f} | {kernels:.2f} | "
            f"{(total - kernels) / base[0]:.2f}x | {kernels / base[1]:.2f}x |",
            flush=True,
        )
    from loop_overhead import DRAFT_LAYERS, LAYERS

    print(
        f"\nA cycle builds the graphs of {LAYERS + DRAFT_LAYERS} layers (the drafter's {DRAFT_LAYERS} and the"
        f" target's {LAYERS}) where a plain step builds {LAYERS}: {(LAYERS + DRAFT_LAYERS) / LAYERS:.2f}x its host work"
        " if a layer's ops cost the same"
    )


if __name__ == "__main__":
    main()
