"""PNG plots for training curves and benchmark results (needs matplotlib: `pip install dflash-mlx[plots]`)."""

import json
from pathlib import Path


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'dflash-mlx[plots]'") from None
    return plt


def training_curve(log_file, png, smooth: int = 20) -> Path:
    """Loss and block accuracy per step, with held-out tau where it was measured."""
    plt = _pyplot()
    rows = [json.loads(line) for line in Path(log_file).read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "loss" in r]
    taus = [r for r in rows if "tau" in r]

    def smoothed(values):
        out = []
        for i in range(len(values)):
            window = values[max(0, i - smooth + 1) : i + 1]
            out.append(sum(window) / len(window))
        return out

    x = [r["step"] for r in steps]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(x, smoothed([r["loss"] for r in steps]))
    ax_loss.set(xlabel="step", ylabel="weighted block loss", title="training loss")
    ax_acc.plot(x, smoothed([r["acc"] for r in steps]), label="block accuracy (all positions)")
    ax_acc.plot(x, smoothed([r["acc_pos1"] or 0 for r in steps]), label="accuracy at block position 1")
    ax_acc.set(xlabel="step", ylabel="accuracy", title="drafter accuracy (train batches)")
    if taus:
        ax_tau = ax_acc.twinx()
        ax_tau.plot([r["step"] for r in taus], [r["tau"] for r in taus], "o-", color="tab:red", label="held-out tau")
        ax_tau.set_ylabel("tau (tokens / cycle)")
        ax_tau.legend(loc="lower right")
    ax_acc.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)
