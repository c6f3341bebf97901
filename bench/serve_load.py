"""A bounded load test of `dflash-mlx serve`: N clients x M requests, mixed streamed and
not, some streams dropped after their first chunk, repeated for R rounds.  Every greedy
response that runs to the end must equal its offline `generate()` result; the server's
memory must come back near where it started and its resident size must stop growing
from round to round (a leak would sink a long-running server).  Prints throughput,
latency, errors and memory per round.

    python bench/serve_load.py --clients 8 --requests 25 --max-tokens 8 --rounds 4
"""

import argparse
import random
import resource
import sys
import threading
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).parent.parent))

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import openai

from dflash_mlx.api import format_prompt, generate, load
from dflash_mlx.serve import make_app, serve_in_background

PROMPTS = ["Name three colours.", "What is 12 + 30?", "Say hello in French.", "Give me a word that rhymes with cat."]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=25)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--drop", type=float, default=0.1, help="share of streams dropped after one chunk")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the load; RSS is printed after each")
    args = parser.parse_args()

    model, tokenizer = load(None)
    expected = {p: generate(model, tokenizer, format_prompt(tokenizer, p), max_tokens=args.max_tokens) for p in PROMPTS}
    server = make_app(model, tokenizer, "SmolLM2-135M-Instruct", max_queue=64)
    http, port = serve_in_background(server)
    mx.clear_cache()
    active_before, rss_before = mx.get_active_memory() / 1e6, resident_mb()
    failed, resident = False, []
    # one client per simulated user for the whole run: a client made per round would grow this
    # process's memory by itself (each builds its own TLS context and connection pool)
    clients = [
        openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=3)
        for _ in range(args.clients)
    ]
    for round_ in range(1, args.rounds + 1):
        failed |= load_round(args, clients, server, expected, round_)
        resident.append(resident_mb())
        print(
            f"round {round_}: MLX active memory {active_before:.0f} MB before, "
            f"{mx.get_active_memory() / 1e6:.0f} MB after; resident {rss_before:.0f} MB before, "
            f"{resident[-1]:.0f} MB after"
        )
    if len(resident) > 2:
        growth = (resident[-1] - resident[1]) / resident[1]
        print(
            f"resident size from round 2 to {len(resident)}: {100 * growth:+.1f}% "
            f"({'plateau' if growth < 0.05 else 'STILL GROWING'})"
        )
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3:.0f} MB")
    http.should_exit = True
    sys.exit(1 if failed else 0)


def resident_mb() -> float:
    """Current resident set size (Linux /proc; elsewhere the peak, which is what getrusage has)."""
    statm = Path("/proc/self/statm")
    if statm.exists():
        return int(statm.read_text().split()[1]) * resource.getpagesize() / 1e6
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1e6 if sys.platform == "darwin" else 1e3)


def load_round(args, clients: list, server, expected: dict, round_: int) -> bool:
    """One round of the load; prints its figures; True if a response was wrong or failed."""
    latencies, wrong, errors, dropped = [], [], [], [0]
    lock = threading.Lock()

    def client(seed: int):
        rng = random.Random(seed + 1000 * round_)
        local = clients[seed]
        for _ in range(args.requests):
            prompt = rng.choice(PROMPTS)
            messages = [{"role": "user", "content": prompt}]
            tic = time.perf_counter()
            try:
                if rng.random() < 0.5:
                    stream = local.chat.completions.create(
                        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=args.max_tokens, stream=True
                    )
                    if rng.random() < args.drop:
                        next(iter(stream))
                        stream.close()
                        with lock:
                            dropped[0] += 1
                        continue
                    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
                else:
                    text = (
                        local.chat.completions.create(
                            model="SmolLM2-135M-Instruct", messages=messages, max_tokens=args.max_tokens
                        )
                        .choices[0]
                        .message.content
                    )
            except openai.APIError as e:
                with lock:
                    errors.append(repr(e))
                continue
            with lock:
                latencies.append(time.perf_counter() - tic)
                if text != expected[prompt]:
                    wrong.append((prompt, text))

    tic = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - tic
    while server.worker.depth:
        time.sleep(0.1)
    server.prompt_cache.entries.clear()
    mx.clear_cache()
    done = len(latencies)
    print(
        f"round {round_}: {args.clients} clients x {args.requests} requests ({args.max_tokens} tokens each): "
        f"{done} completed, {dropped[0]} dropped by the client, {len(errors)} errors, {len(wrong)} wrong outputs"
    )
    print(
        f"  {seconds:.1f} s, {done / seconds:.2f} requests/s, {done * args.max_tokens / seconds:.1f} tokens/s; "
        f"latency median {median(latencies):.2f} s, max {max(latencies):.2f} s"
    )
    if wrong or errors:
        print("  FAILED:", (wrong + errors)[:3])
    return bool(wrong or errors)


if __name__ == "__main__":
    main()
