"""MLX primitives per committed token: our drafting and plain cycles against mlx-lm's step.

    python bench/cycle_graph.py [--widths 2,4,16] [--prompts 2]

On a Mac every primitive of the graph a cycle builds is (at least) one kernel launch, so
this counts them from the lazy graph itself (mx.export_to_dot, before evaluation):
  mlx-lm   one generate_step step (model forward + argmax), per token
  plain    our plain step (the same forward, through our layer taps), per token
  w=L      one drafting cycle (drafter pass + selector, verify, accept), divided by the
           tokens it committed on these prompts with the shipped drafter (greedy)
Host synchronisations per cycle are counted in the loop's code, not here: one per cycle
(ours: the mx.eval of accept's outputs; a plain step: reading its token, with the next
step already queued, as mlx-lm does).
"""

import re
import statistics
import tempfile

import typer

import dflash_mlx  # noqa: F401  (loads OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from dflash_mlx import format_prompt, load
from dflash_mlx.bench.prompt_sets import load_prompts
from dflash_mlx.engine import Context, draft, plain_step, prefill, verify
from dflash_mlx.fused_ops import unfused
from dflash_mlx.sampling import SamplingParams, accept, choose


def primitives(*outputs) -> int:
    """Primitives in the graph that computes `outputs` (already evaluated inputs excluded)."""
    with tempfile.NamedTemporaryFile("w+", suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs)
        return len(re.findall(r"shape=rectangle", open(f.name).read()))


def states(caches) -> list:
    return [x for c in caches for x in (c.state if isinstance(c.state, (list, tuple)) else [c.state])
            if isinstance(x, mx.array)]


def mlx_lm_step(model, prompt: mx.array) -> int:
    with unfused(model.target.model) as net:  # mlx-lm's own ops
        cache = make_prompt_cache(net)
        mx.eval(net(prompt[None, :-1], cache=cache))
        logits = net(prompt[None, -1:], cache=cache)
    return primitives(mx.argmax(logits[:, -1], axis=-1), *states(cache))


def our_cycles(model, prompt: mx.array, width: int, cycles: int = 8) -> tuple[float, float]:
    """(primitives per cycle, tokens committed per cycle) at a fixed width (1 = plain)."""
    params = SamplingParams()
    tcache, context = model.target.make_cache(), Context(model)
    token = choose(prefill(model, prompt, tcache, context), params, None)
    counts, committed = [], []
    for _ in range(cycles):
        if width == 1:
            nxt, _ = plain_step(model, token, tcache, context, params, None)
            counts.append(primitives(nxt, *states(tcache.layers)))
            mx.eval(nxt)
            token, n = nxt, 0
        else:
            proposal = draft(model, token, context, width, params, None)
            logits, features = verify(model, token, proposal, tcache)
            n, nxt = accept(proposal, choose(logits, params, None))
            counts.append(primitives(n, nxt, proposal, features, *states(tcache.layers),
                                     *states(context.cache)))
            mx.eval(n, nxt, proposal)
            n = n.item()
            tcache.rollback(n + 1)
            context.add(features[:, : n + 1])
            token = nxt
        committed.append(n + 1)
    return statistics.mean(counts), statistics.mean(committed)


def main(widths: str = "2,4,16", prompts: int = 2):
    model, tokenizer = load(adaptive=False)
    encoded = [mx.array(format_prompt(tokenizer, t)) for t in load_prompts("gsm8k", prompts)]
    print("| decoder | primitives per cycle | tokens per cycle | primitives per committed token |")
    print("|---|---|---|---|")
    theirs = statistics.mean(mlx_lm_step(model, p) for p in encoded)
    print(f"| mlx-lm generate_step | {theirs:.0f} | 1.00 | {theirs:.0f} |")
    for width in [1] + [int(w) for w in widths.split(",")]:
        rows = [our_cycles(model, p, width) for p in encoded]
        per_cycle, tokens = statistics.mean(r[0] for r in rows), statistics.mean(r[1] for r in rows)
        name = "ours, plain step" if width == 1 else f"ours, drafting width {width}"
        print(f"| {name} | {per_cycle:.0f} | {tokens:.2f} | {per_cycle / tokens:.0f} |")


if __name__ == "__main__":
    typer.run(main)
