"""Time to first token of `dflash-mlx serve` with and without prefix reuse: a chat
whose ~1k-token system prompt is shared by every turn (agents, editors), against
the default SmolLM2 pair, on loopback, streamed through the `openai` client.

    python bench/serve_prefix.py --turns 4
"""

import argparse
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).parent.parent))

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import openai

from dflash_mlx.api import load
from dflash_mlx.bench.prompt_sets import load_prompts
from dflash_mlx.serve import make_app, serve_in_background


def ttft(client, messages) -> tuple[float, int]:
    tic = time.perf_counter()
    cached = 0
    for chunk in client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=messages,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices and chunk.choices[0].delta.content and tic:
            first, tic = time.perf_counter() - tic, 0
        if chunk.usage:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    return first, cached


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--code-prompts", type=int, default=8, help="HumanEval prompts in the system prompt")
    args = parser.parse_args()
    model, tokenizer = load(None)
    system = "You answer questions about this code.\n" + "\n".join(load_prompts("humaneval", args.code_prompts))
    questions = [q for q in load_prompts("mtbench", args.turns)]
    print(f"system prompt: {len(tokenizer.encode(system))} tokens; {args.turns} turns, each a new question")
    for label, cache_bytes in (("prefix reuse off", 0), ("prefix reuse on", 1 << 30)):
        http, port = serve_in_background(
            make_app(model, tokenizer, "SmolLM2-135M-Instruct", prompt_cache_bytes=cache_bytes)
        )
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        times, cached = [], []
        for q in questions:
            t, c = ttft(client, [{"role": "system", "content": system}, {"role": "user", "content": q}])
            times.append(t)
            cached.append(c)
        http.should_exit = True
        print(
            f"{label}: time to first token {' / '.join(f'{t:.2f}' for t in times)} s "
            f"(median after the first {median(times[1:]):.2f} s); cached prompt tokens {cached}"
        )


if __name__ == "__main__":
    main()
