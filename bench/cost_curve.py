"""How steady the measured cost curve is: the default pair's target passes of each width timed as
`measure_costs` times them (round-robin over the widths, on a 128-token cache), several times
over, quiet or with `--busy` (another process loading one core in bursts of 0.2-2 s, as a busy
machine would), and each measurement's curve worked out from the same timings two ways: the
median of its first 5 rounds (how the curve was judged before) and the lower quartile of 15
(`least_disturbed`, how it is judged now).  The curve is measured once per model and machine
and kept, so its shape must not depend on the moment: printed per measurement, each width's
cost over a 1-token pass's, and the largest distance of any width from the quiet shape.

    nice -n 5 python bench/cost_curve.py [--measurements 5] [--busy]
"""

import multiprocessing
import random
import sys
import time
from datetime import date
from pathlib import Path
from statistics import median

import typer

sys.path.insert(0, str(Path(__file__).parent.parent))

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)

from dflash_mlx.api import load
from dflash_mlx.bench.harness import machine
from dflash_mlx.decode.costs import PROBE_CONTEXT, PROBE_WIDTHS, verify_timer, least_disturbed, monotone
from dflash_mlx.kernels.metal import chip_name

ROUNDS, BEFORE = 15, 5


def bursts() -> None:
    """One core busy for 0.2-2 s, then idle for 0.2-2 s, until killed."""
    while True:
        end = time.monotonic() + random.uniform(0.2, 2.0)
        while time.monotonic() < end:
            pass
        time.sleep(random.uniform(0.2, 2.0))


def shape(seconds: list[float]) -> list[float]:
    return [s / seconds[0] for s in seconds]


def main(measurements: int = 5, busy: bool = False):
    model, _ = load()
    widths = [w for w in PROBE_WIDTHS if w <= model.draft.block_size]
    _, verify_seconds = verify_timer(model.target, model.draft.target_layer_ids, PROBE_CONTEXT)
    quiet_shape = None
    load_process = multiprocessing.Process(target=bursts, daemon=True) if busy else None
    print(f"{machine()}, {chip_name()}, {date.today()}; `{' '.join(['python', *sys.argv])}`\n")
    print(f"each width's cost over a 1-token pass ({', '.join(map(str, widths))} tokens)\n")
    print("| measurement | judged by | shape | 1 token, ms | farthest from the quiet shape |\n|---|---|---|---|---|")
    for m in range(measurements + 1):  # the first is quiet: the shape the others are held to
        if m == 1 and load_process is not None:
            load_process.start()
        times = {w: [] for w in widths}
        for attempt in range(ROUNDS + 1):  # the first round warms up
            for w in widths:
                seconds = verify_seconds(w)
                if attempt:
                    times[w].append(seconds)
        now = monotone([least_disturbed(times[w]) for w in widths])
        before = monotone([median(times[w][:BEFORE]) for w in widths])
        if quiet_shape is None:
            quiet_shape = shape(now)
            print(
                f"| quiet | lower quartile of {ROUNDS} | {' '.join(f'{r:.2f}' for r in quiet_shape)} | "
                f"{1e3 * now[0]:.1f} | |"
            )
            continue
        for name, curve in ((f"median of {BEFORE}", before), (f"lower quartile of {ROUNDS}", now)):
            farthest = max(abs(r / q - 1) for r, q in zip(shape(curve), quiet_shape))
            print(
                f"| {m}{' (busy)' if busy else ''} | {name} | {' '.join(f'{r:.2f}' for r in shape(curve))} | "
                f"{1e3 * curve[0]:.1f} | {100 * farthest:.0f}% |"
            )
    if load_process is not None:
        load_process.kill()


if __name__ == "__main__":
    typer.run(main)
