"""`dflash-mlx serve` against `mlx_lm.server --decode-concurrency` under concurrent clients.

Both servers run on the same fp32 weights (the offline SmolLM2-135M-Instruct), mlx_lm.server
with OpenBLAS loaded the way our set-up loads it (LD_PRELOAD of Debian's libblas.so.3).  For
each level (clients x answer length x greedy / sampled), both servers get the same chat
requests, one after the other (theirs first, then ours), each client sending `--requests`
requests back to back, or more at few clients so that a level sends `--min-requests` in all
(one or two clients' few requests measure little but the prompts they happened to get); with
`--reps`, each level runs that many times, theirs and ours in turn, so that a spell of the
machine running slow moves one rep of both rather than one server's only measurement.
Reports aggregate completion tokens per second (medians of the reps) and p50 / p95 request
latency (over every rep's requests), the ratio ours / theirs (the median of the reps' ratios),
how many of our batch steps drafted (from our /metrics), and checks every answer of ours
against offline `generate()` (greedy, and
sampled with the request's seed; mlx_lm.server turns batching off for seeded requests, so its
sampled requests carry no seed).

    python bench/serve_batch.py --clients 1,2,4,8,16 --max-tokens 64,256 --modes greedy,sampled \\
        --out bench/results/serve-batch
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import median, quantiles
from typing import Optional

sys.path.insert(0, str(Path(__file__).parent.parent))

from dflash_mlx.io.blas import _find as openblas_path  # noqa: E402

TEMPERATURE = 0.7


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port: int, process: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"a server exited during start-up (code {process.returncode})")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise SystemExit("a server did not start within 10 minutes")


def start_ours(max_batch: int, *options: str) -> tuple[subprocess.Popen, int]:
    """`dflash-mlx serve` on a free port (with more `options`), once it answers."""
    port = free_port()
    command = [sys.executable, "-m", "dflash_mlx.cli", "serve", "--port", str(port), "--max-batch", str(max_batch)]
    process = subprocess.Popen([*command, *options], stderr=subprocess.DEVNULL)
    wait_ready(port, process)
    return process, port


def stop(*servers: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM each server (ours drains) and wait until it has exited."""
    for process in servers:
        process.terminate()
        process.wait(timeout=timeout)


def start_servers(model_dir: Path, max_batch: int, *ours_options: str):
    python = sys.executable
    theirs_port = free_port()
    env = dict(os.environ)
    blas = openblas_path()
    if blas:
        env.update(LD_PRELOAD=blas, LD_LIBRARY_PATH=str(Path(blas).parent))
    env.setdefault("HF_HUB_CACHE", str(Path.home() / ".cache" / "huggingface" / "hub"))
    Path(env["HF_HUB_CACHE"]).mkdir(parents=True, exist_ok=True)
    theirs = subprocess.Popen(
        [
            python,
            "-m",
            "mlx_lm.server",
            "--model",
            str(model_dir),
            "--port",
            str(theirs_port),
            "--decode-concurrency",
            str(max_batch),
        ],
        env=env,
        stderr=subprocess.DEVNULL,
    )
    wait_ready(theirs_port, theirs)
    return start_ours(max_batch, *ours_options), (theirs, theirs_port)


def drive(
    port: int,
    model: str,
    prompts: list[str],
    clients: int,
    requests: int,
    max_tokens: int,
    sampled: bool,
    seed: Optional[int],
) -> dict:
    """`clients` threads, each sending `requests` chat requests back to back (sampled ones with
    seed `seed` + their index, unless `seed` is None)."""
    import openai

    answers, latencies, tokens, errors = {}, [], [0], []
    lock = threading.Lock()

    def client(k: int):
        local = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=3600)
        for r in range(requests):
            index = k * requests + r
            extra = {}
            if sampled:
                extra["temperature"] = TEMPERATURE
                if seed is not None:
                    extra["seed"] = seed + index
            tic = time.perf_counter()
            try:
                reply = local.chat.completions.create(
                    model=model, max_tokens=max_tokens, messages=[{"role": "user", "content": prompts[index]}], **extra
                )
            except openai.APIError as e:
                with lock:
                    errors.append(repr(e))
                continue
            with lock:
                latencies.append(time.perf_counter() - tic)
                tokens[0] += reply.usage.completion_tokens
                answers[index] = reply.choices[0].message.content
        local.close()

    tic = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    seconds = time.perf_counter() - tic
    return {
        "tok_s": tokens[0] / seconds,
        "tokens": tokens[0],
        "latencies": latencies,
        "errors": errors,
        "answers": answers,
        "requests": clients * requests,
    }


def percentiles(latencies: list[float]) -> tuple[float, float]:
    """p50, p95 (0 when nothing came back)."""
    if len(latencies) < 2:
        return max(latencies, default=0), max(latencies, default=0)
    return median(latencies), quantiles(latencies, n=20)[-1]


def batch_steps(port: int) -> Counter:
    """Our server's batch steps so far, by mode ("plain" / "draft"), read from its /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    counts = Counter()
    for line in text.splitlines():
        if line.startswith("dflash_batch_steps_total{"):
            labels, value = line.rsplit(" ", 1)
            counts[labels.split('mode="')[1].split('"')[0]] += int(float(value))
    return counts


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="1,2,4,8,16")
    parser.add_argument("--max-tokens", default="64,256")
    parser.add_argument("--modes", default="greedy,sampled")
    parser.add_argument("--requests", type=int, default=2, help="requests per client, back to back")
    parser.add_argument(
        "--min-requests",
        type=int,
        default=16,
        help="requests per level at least (clients send ceil(this / clients) if that is more)",
    )
    parser.add_argument("--reps", type=int, default=1, help="runs of each level, theirs and ours in turn")
    parser.add_argument("--max-batch", type=int, default=16, help="ours --max-batch = theirs --decode-concurrency")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="ours' sampled request i carries seed SEED + i (their lengths, fixed by it, set how long "
        "the slowest client runs; theirs are unseeded and vary per run)",
    )
    parser.add_argument(
        "--check", type=int, default=3, help="answers of ours per level compared with offline generate() (-1: all)"
    )
    parser.add_argument(
        "--prompts",
        default="mtbench,gsm8k,humaneval",
        help="prompt sets taken in turn (bench.prompt_sets; 'chat' = one-line questions as people type them)",
    )
    parser.add_argument("--out", default=None, help="folder for results.json, results.md and a plot")
    args = parser.parse_args()

    import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
    from dflash_mlx.api import format_prompt, generate, load
    from dflash_mlx.bench.prompt_sets import load_prompts, mixed_prompts
    from dflash_mlx.convert.smollm2 import smollm2_path

    levels = [int(c) for c in args.clients.split(",")]
    lengths = [int(n) for n in args.max_tokens.split(",")]
    modes = args.modes.split(",")
    per_client = {c: max(args.requests, -(-args.min_requests // c)) for c in levels}
    most = max(c * per_client[c] for c in levels)
    names = args.prompts.split(",")
    pool = mixed_prompts(names, sum(len(load_prompts(name)) for name in names))
    prompts = [pool[i % len(pool)] for i in range(most)]  # a small set is sent again, in the same order
    model, tokenizer = load(None)
    # every level and rep sends the same prompts again: ours must not copy its own earlier answers
    (ours, ours_port), (theirs, theirs_port) = start_servers(smollm2_path(None), args.max_batch, "--no-suffix-drafts")
    rows = []
    try:
        for port, name in ((theirs_port, "default_model"), (ours_port, "SmolLM2-135M-Instruct")):
            drive(port, name, prompts, 1, 1, 8, False, False)  # warm-up: first-request costs are not measured
        for max_tokens in lengths:
            for mode in modes:
                sampled = mode == "sampled"
                for clients in levels:
                    requests = per_client[clients]
                    n = clients * requests
                    theirs_runs, ours_runs, steps = [], [], Counter()
                    for _ in range(args.reps):
                        theirs_runs.append(
                            drive(
                                theirs_port, "default_model", prompts, clients, requests, max_tokens, sampled, seed=None
                            )
                        )
                        before = batch_steps(ours_port)
                        ours_runs.append(
                            drive(
                                ours_port,
                                "SmolLM2-135M-Instruct",
                                prompts,
                                clients,
                                requests,
                                max_tokens,
                                sampled,
                                seed=args.seed,
                            )
                        )
                        steps += batch_steps(ours_port) - before
                    answered = sorted({index for run in ours_runs for index in run["answers"]})
                    checked = answered if args.check < 0 else answered[: args.check]
                    wrong = 0
                    for index in checked:
                        options = {"temp": TEMPERATURE, "seed": args.seed + index} if sampled else {}
                        prompt = format_prompt(tokenizer, prompts[index])
                        expected = generate(model, tokenizer, prompt, max_tokens=max_tokens, **options)
                        wrong += sum(run["answers"][index] != expected for run in ours_runs if index in run["answers"])
                    lost = sum(n - len(run["answers"]) for run in ours_runs)
                    (theirs_p50, theirs_p95), (ours_p50, ours_p95) = (
                        percentiles([t for run in runs for t in run["latencies"]]) for runs in (theirs_runs, ours_runs)
                    )
                    ratios = [o["tok_s"] / max(t["tok_s"], 1e-9) for t, o in zip(theirs_runs, ours_runs)]
                    row = {
                        "clients": clients,
                        "max_tokens": max_tokens,
                        "mode": mode,
                        "reps": args.reps,
                        "theirs_tok_s": median(run["tok_s"] for run in theirs_runs),
                        "ours_tok_s": median(run["tok_s"] for run in ours_runs),
                        "theirs_tokens": sum(run["tokens"] for run in theirs_runs),
                        "ours_tokens": sum(run["tokens"] for run in ours_runs),
                        "ratio": median(ratios),
                        "ratios": ratios,
                        "theirs_p50": theirs_p50,
                        "theirs_p95": theirs_p95,
                        "ours_p50": ours_p50,
                        "ours_p95": ours_p95,
                        "ours_lost": lost,
                        "ours_wrong": wrong,
                        "checked": len(checked),
                        "ours_steps": sum(steps.values()),
                        "ours_draft_steps": steps["draft"],
                        "theirs_lost": sum(n - len(run["answers"]) for run in theirs_runs),
                    }
                    rows.append(row)
                    print(
                        f"{mode:7s} {max_tokens:3d} tok, {clients:2d} clients: mlx_lm.server {row['theirs_tok_s']:6.1f} "
                        f"tok/s (p50 {theirs_p50:.1f} s, p95 {theirs_p95:.1f} s) | ours "
                        f"{row['ours_tok_s']:6.1f} tok/s (p50 {ours_p50:.1f} s, p95 {ours_p95:.1f} s) "
                        f"| {row['ratio']:.2f}x (reps: {', '.join(f'{r:.2f}' for r in ratios)}) "
                        f"| tokens {row['theirs_tokens']} / {row['ours_tokens']} | ours drafted {steps['draft']} of "
                        f"{row['ours_steps']} steps, lost {lost}, not equal to generate() {wrong}",
                        flush=True,
                    )
                    if args.out:  # after every level: a stopped run keeps what it measured
                        save(rows, Path(args.out), args)
    finally:
        stop(ours, theirs)


def save(rows: list[dict], out: Path, args) -> None:
    from dflash_mlx.bench.harness import machine

    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps({"machine": machine(), "command": " ".join(sys.argv), "rows": rows}, indent=1)
    )
    lines = [
        f"Machine: {machine()}",
        f"Command: `python {' '.join(sys.argv)}`",
        "",
        "| mode | tokens | clients | mlx_lm.server tok/s | p50 / p95 s | ours tok/s | p50 / p95 s | ours / theirs "
        "| ours steps drafted | ours lost / not exact |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['max_tokens']} | {r['clients']} | {r['theirs_tok_s']:.1f} | "
            f"{r['theirs_p50']:.1f} / {r['theirs_p95']:.1f} | {r['ours_tok_s']:.1f} | "
            f"{r['ours_p50']:.1f} / {r['ours_p95']:.1f} | **{r['ratio']:.2f}x** | "
            f"{r['ours_draft_steps']} / {r['ours_steps']} | {r['ours_lost']} / {r['ours_wrong']} |"
        )
    (out / "results.md").write_text("\n".join(lines) + "\n")
    try:
        from dflash_mlx.bench.plots import _pyplot

        plt = _pyplot()
    except Exception:  # matplotlib is an extra: the table is the result
        return
    groups = sorted({(r["mode"], r["max_tokens"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 3.2), squeeze=False)
    for ax, (mode, tokens) in zip(axes[0], groups):
        part = [r for r in rows if (r["mode"], r["max_tokens"]) == (mode, tokens)]
        ax.plot([r["clients"] for r in part], [r["theirs_tok_s"] for r in part], "o-", label="mlx_lm.server")
        ax.plot([r["clients"] for r in part], [r["ours_tok_s"] for r in part], "o-", label="dflash-mlx serve")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{mode}, {tokens} tokens")
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("aggregate tok/s")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=120)


if __name__ == "__main__":
    main()
