"""A bounded load test of `dflash-mlx serve`: N clients x M requests, mixed streamed and
not, some streams dropped after their first chunk.  Every greedy response that runs
to the end must equal its offline `generate()` result; the server's memory must come
back near where it started.  Prints throughput, latency and errors.

    python bench/serve_load.py --clients 8 --requests 25 --max-tokens 8
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
    args = parser.parse_args()

    model, tokenizer = load(None)
    expected = {p: generate(model, tokenizer, format_prompt(tokenizer, p), max_tokens=args.max_tokens) for p in PROMPTS}
    server = make_app(model, tokenizer, "SmolLM2-135M-Instruct", max_queue=64)
    http, port = serve_in_background(server)
    mx.clear_cache()
    active_before = mx.get_active_memory() / 1e6
    latencies, wrong, errors, dropped = [], [], [], [0]
    lock = threading.Lock()

    def client(seed: int):
        rng = random.Random(seed)
        local = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=3)
        for _ in range(args.requests):
            prompt = rng.choice(PROMPTS)
            messages = [{"role": "user", "content": prompt}]
            tic = time.perf_counter()
            try:
                if rng.random() < 0.5:
                    stream = local.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                                           max_tokens=args.max_tokens, stream=True)
                    if rng.random() < args.drop:
                        next(iter(stream))
                        stream.close()
                        with lock:
                            dropped[0] += 1
                        continue
                    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
                else:
                    text = local.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                                         max_tokens=args.max_tokens).choices[0].message.content
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
    active_after = mx.get_active_memory() / 1e6
    done = len(latencies)
    print(f"{args.clients} clients x {args.requests} requests ({args.max_tokens} tokens each): {done} completed, "
          f"{dropped[0]} dropped by the client, {len(errors)} errors, {len(wrong)} wrong outputs")
    print(f"{seconds:.1f} s, {done / seconds:.2f} requests/s, {done * args.max_tokens / seconds:.1f} tokens/s; "
          f"latency median {median(latencies):.2f} s, max {max(latencies):.2f} s")
    print(f"MLX active memory {active_before:.0f} MB before, {active_after:.0f} MB after; "
          f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3:.0f} MB")
    http.should_exit = True
    if wrong or errors:
        print("FAILED:", (wrong + errors)[:3])
        sys.exit(1)


if __name__ == "__main__":
    main()
