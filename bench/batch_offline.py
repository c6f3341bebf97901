"""Our BatchGenerator against mlx-lm's, offline: the server benchmark without HTTP.

Both generators decode the same chat prompts on the same fp32 weights in this process,
under the same arrival pattern as bench/serve_batch.py: `clients` streams, each sending
`--requests` requests back to back (a stream's next request is inserted as soon as its
last one finishes).  Each level runs `--reps` times, theirs and ours interleaved, so a
drifting machine moves both; each generator lives for the whole run, as a server's does
(what ours learns about its step costs carries over).  Reports aggregate completion tok/s
(medians) and the median of the per-rep ratios; `--plain` adds our loop decoding plainly.

    python bench/batch_offline.py --clients 1,2,4,8 --max-tokens 64,256 --modes greedy,sampled --reps 3 --plain
"""

import argparse
import contextlib
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).parent.parent))

import dflash_mlx  # noqa: E402,F401  (OpenBLAS before mlx)

TEMPERATURE = 0.7


class Theirs:
    """mlx-lm's BatchGenerator on the plain target."""

    def __init__(self, model, tokenizer, max_batch: int):
        from mlx_lm.generate import BatchGenerator
        from mlx_lm.sample_utils import make_sampler

        self.make_sampler, self.net = make_sampler, model.target.model
        self.gen = BatchGenerator(
            self.net, stop_tokens=[[e] for e in tokenizer.eos_token_ids], completion_batch_size=max_batch
        )

    def ops(self):
        from dflash_mlx.kernels.fused_ops import unfused

        return unfused(self.net)  # mlx-lm's own ops, not our compiled norms and RoPEs

    def insert(self, ids: list[int], max_tokens: int, sampled: bool, seed: int) -> int:
        samplers = [self.make_sampler(temp=TEMPERATURE)] if sampled else None
        return self.gen.insert([ids], max_tokens=[max_tokens], samplers=samplers)[0]

    def next(self) -> list[tuple[int, int, bool]]:
        """(uid, tokens committed, finished) of every request that moved."""
        _, responses = self.gen.next()
        return [(r.uid, int(r.finish_reason != "stop"), r.finish_reason is not None) for r in responses]


class Ours:
    """Our BatchGenerator; `plain`: every request with block_size 1 (plain batched decoding in
    our loop, the floor its drafting must beat)."""

    def __init__(self, model, tokenizer, max_batch: int, plain: bool = False):
        from dflash_mlx.api import BatchGenerator

        self.gen = BatchGenerator(model, tokenizer, max_batch=max_batch)
        self.options = {"block_size": 1} if plain else {}

    def ops(self):
        return contextlib.nullcontext()

    def insert(self, ids: list[int], max_tokens: int, sampled: bool, seed: int) -> int:
        import mlx.core as mx

        options = {"temp": TEMPERATURE, "seed": seed} if sampled else {}
        return self.gen.insert(mx.array(ids), max_tokens, **options, **self.options)

    def next(self) -> list[tuple[int, int, bool]]:
        return [(uid, len(r.tokens), r.finish_reason is not None) for uid, r in self.gen.next()]


def run_level(gen, prompts: list[list[int]], clients: int, requests: int, max_tokens: int, sampled: bool) -> float:
    """Aggregate completion tokens per second of `clients` back-to-back streams."""
    owner, sent, tokens = {}, [0] * clients, 0

    def send(client: int) -> None:
        index = client * requests + sent[client]
        owner[gen.insert(prompts[index], max_tokens, sampled, index)] = client
        sent[client] += 1

    with gen.ops():
        tic = time.perf_counter()
        for client in range(clients):
            send(client)
        while owner:
            for uid, committed, finished in gen.next():
                tokens += committed
                if finished:
                    client = owner.pop(uid)
                    if sent[client] < requests:
                        send(client)
    return tokens / (time.perf_counter() - tic)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="1,2,4,8")
    parser.add_argument("--max-tokens", default="64,256")
    parser.add_argument("--modes", default="greedy,sampled")
    parser.add_argument("--requests", type=int, default=2, help="requests per client, back to back")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--plain", action="store_true", help="also our loop with every request plain (block 1)")
    args = parser.parse_args()

    from dflash_mlx.api import format_prompt, load
    from dflash_mlx.bench.harness import machine
    from dflash_mlx.bench.prompt_sets import mixed_prompts

    levels = [int(c) for c in args.clients.split(",")]
    model, tokenizer = load(None)
    texts = mixed_prompts(["mtbench", "gsm8k", "humaneval"], max(levels) * args.requests)
    prompts = [list(format_prompt(tokenizer, text)) for text in texts]
    generators = {"mlx-lm": Theirs(model, tokenizer, args.max_batch), "ours": Ours(model, tokenizer, args.max_batch)}
    if args.plain:
        generators["ours, plain"] = Ours(model, tokenizer, args.max_batch, plain=True)
    for gen in generators.values():  # warm-up: first-call costs are not measured
        run_level(gen, prompts, 1, 1, 8, False)
    names = list(generators)
    print(f"Machine: {machine()}\nCommand: python {' '.join(sys.argv)}\n")
    print(
        "| mode | tokens | clients | "
        + " | ".join(f"{n} tok/s" for n in names)
        + " | "
        + " | ".join(f"{n} / mlx-lm (median of reps)" for n in names[1:])
        + " | ours per rep |"
    )
    print("|---" * (3 + 2 * len(names)) + "|")
    for max_tokens in (int(n) for n in args.max_tokens.split(",")):
        for mode in args.modes.split(","):
            for clients in levels:
                reps = [
                    {
                        name: run_level(gen, prompts, clients, args.requests, max_tokens, mode == "sampled")
                        for name, gen in generators.items()
                    }
                    for _ in range(args.reps)
                ]
                ratios = {name: [rep[name] / rep["mlx-lm"] for rep in reps] for name in names[1:]}
                print(
                    f"| {mode} | {max_tokens} | {clients} | "
                    + " | ".join(f"{median(rep[n] for rep in reps):.1f}" for n in names)
                    + " | "
                    + " | ".join(f"**{median(ratios[n]):.2f}x**" for n in names[1:])
                    + " | "
                    + " ".join(f"{r:.2f}" for r in ratios["ours"])
                    + " |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
