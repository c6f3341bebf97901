"""PNG plots for training curves and benchmark results (needs matplotlib: the `plots` extra)."""

import json
from pathlib import Path


class MissingMatplotlib(ImportError):
    pass


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingMatplotlib(
            "plots need matplotlib: pip install matplotlib (or pip install -e '.[plots]' in the repository)"
        ) from None
    return plt


def _log_rows(log_file) -> list[dict]:
    return [json.loads(line) for line in Path(log_file).read_text().splitlines() if line.strip()]


def training_curve(log_file, png, smooth: int = 20) -> Path:
    """Loss and block accuracy per step, with held-out tau where it was measured."""
    plt = _pyplot()
    rows = _log_rows(log_file)
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
    return _save(fig, Path(png))


def held_out_taus(log_file, tokens_before: int = 0) -> list[tuple[int, float]]:
    """(target tokens seen, held-out tau) of a training log, its tokens counted from `tokens_before`
    (a warm restart's log counts from 0)."""
    return [(tokens_before + r["tokens_seen"], r["tau"]) for r in _log_rows(log_file) if "tau" in r]


def tau_curves(curves: dict, png, title: str = "held-out tau") -> Path:
    """Held-out tau against target tokens seen, one line per recipe: {label: [(tokens, tau), ...]}."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, points in curves.items():
        ax.plot([t for t, _ in points], [tau for _, tau in points], "o-", label=label)
    ax.set(xlabel="target tokens seen", ylabel="tau (tokens / cycle)", title=title)
    ax.legend()
    return _save(fig, Path(png))


def bench_plots(results: dict, out_dir) -> list[Path]:
    """speedup.png (per set and mode), acceptance.png (accepted-length histogram),
    tps_vs_length.png (tok/s against output length, both decoders)."""
    plt = _pyplot()
    out_dir = Path(out_dir)
    rows = [r for r in results["summary"] if r["set"] != "all"]
    modes = sorted({r["mode"] for r in rows})
    sets = list(dict.fromkeys(r["set"] for r in rows))
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(len(modes), 1)
    for j, mode in enumerate(modes):
        values = [next((r["speedup"] for r in rows if r["set"] == s and r["mode"] == mode), 0) for s in sets]
        ax.bar([i + j * width for i in range(len(sets))], values, width, label=mode)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(sets))], sets)
    ax.set(ylabel="speedup over plain mlx-lm (median)", title=results.get("label") or "DFlash speedup")
    ax.legend()
    paths.append(_save(fig, out_dir / "speedup.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode in modes:
        total = next((r["histogram"] for r in results["summary"] if r["set"] == "all" and r["mode"] == mode), [])
        if total and sum(total):
            ax.plot(range(1, len(total) + 1), [n / sum(total) for n in total], "o-", label=mode)
    ax.set(xlabel="tokens committed per cycle", ylabel="share of cycles", title="acceptance histogram (all sets)")
    ax.legend()
    paths.append(_save(fig, out_dir / "acceptance.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for decoder, marker in (("plain", "x"), ("dflash", "o")):
        runs = [r for r in results["runs"] if r["decoder"] == decoder]
        ax.scatter([r["tokens"] for r in runs], [r["generation_tps"] for r in runs], marker=marker, label=decoder)
    ax.set(xlabel="output tokens", ylabel="tokens / s", title="decode speed vs output length")
    ax.legend()
    paths.append(_save(fig, out_dir / "tps_vs_length.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
