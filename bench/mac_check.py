"""One command for a Mac owner, that always ends with a report: what this machine is, whether
dflash-mlx's Metal kernels agree with their MLX twins and beat them at the published models'
real shapes, whether greedy DFlash equals plain decoding, and how fast DFlash is against plain
mlx-lm here.

    python bench/mac_check.py [--quick] [--model M] [--gdn-model Qwen3.5-4B] [--prompts 4]
        [--max-tokens 128] [--out bench/results/mac-check]

Each section runs on its own: an error becomes that section's result (its one-line text, with a
Metal compiler's first `error:` line) and the next section runs.  report.md (to paste into an
issue) and report.json are rewritten in --out before each section (which it then names as
started) and after it, so a process that dies outright (a GPU fault, the OS killing it) leaves the
name of the section it died in.  An --out that cannot be written is refused before anything runs.
Sections:

    environment         doctor's facts: chip, memory, versions, Metal, kernels, BLAS, caches
    kernel_self_checks  each kernel against its twin at the published pairs' real shapes
                        (verdict, max rel. error, kernel and twin ms), bidirectional, causal and
                        windowed attention, bf16 and fp16: Metal only
    lossless_greedy     greedy DFlash vs plain mlx-lm, token for token over the full length; on
                        a GPU a first difference at a near-tie (top-2 logits within a few ulps)
                        is allowed
    speed               tok/s of plain mlx-lm and of DFlash at widths 4, 8, 16 and adaptive
    cost_curve          the verify cost curve the adaptive plan decides on (target and drafter)
    gated_delta_target  lossless and speed on a GatedDeltaNet target (--gdn-model, 4-bit) when
                        memory allows: Metal only
    kernel_decisions    what the self-check decided for every kernel call the decoding made

Without Metal the Metal-only sections say "skipped: no Metal".  Exit status 1 if a section
failed or raised.
"""

import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import typer
from huggingface_hub import try_to_load_from_cache

import dflash_mlx  # noqa: F401  (loads OpenBLAS before mlx)
import mlx.core as mx

from dflash_mlx import load
from dflash_mlx.api import doctor, format_prompt
from dflash_mlx.api.registry import DEFAULT_DRAFT, PUBLISHED
from dflash_mlx.bench.harness import run_dflash, run_plain
from dflash_mlx.bench.prompt_sets import mixed_prompts
from dflash_mlx.decode.learning import kept
from dflash_mlx.io.storage import writable
from dflash_mlx.kernels import metal as kernels
from dflash_mlx.kernels.fused_ops import unfused

sys.path.insert(0, str(Path(__file__).parent))
from lossless_real import PROMPT_SETS, dflash_tokens, plain_tokens  # noqa: E402  (bench/lossless_real.py)

# real shapes where the published configs are known without a download; a pair whose configs are
# in the local Hugging Face cache adds its own (cached_shapes)
ATTENTION_SHAPES = {"Qwen3-4B / Qwen3-8B drafters": (32, 8, 128)}  # (query heads, kv heads, head dim)
TAPE_SHAPES = {"Qwen3.5-9B": (16, 32, 128, 128)}  # GatedDeltaNet (key heads, value heads, key dim, value dim)
WIDTHS = (4, 8, 16)
CONTEXTS = (1024, 4096)
WINDOW = 512  # the sliding window of the windowed attention rows
STARTED = "started (if the report ends here, the process died in this section)"
NEAR_TIE_ULPS = 4  # a first difference within this many ulps of the top logit is a near-tie
MANTISSA_BITS = {mx.float32: 23, mx.float16: 10, mx.bfloat16: 7}


class Skipped(Exception):
    """A section that does not apply here; its message says why."""


@dataclass
class Outcome:
    rows: list[dict] = field(default_factory=list)
    failed: bool = False
    note: str = ""


@dataclass
class Section:
    name: str
    status: str  # ok, failed, skipped: <why>, error: <exception>
    rows: list[dict] = field(default_factory=list)
    note: str = ""
    seconds: float = 0.0


# ------------------------------------------------------------------ the report


class Report:
    """Sections run one by one, each in its own try; the files are rewritten after each."""

    def __init__(self, out: Path, command: str):
        self.out, self.command = out, command
        self.sections: list[Section] = []

    def run(self, name: str, check: Callable[[], Outcome]) -> Section:
        self.sections.append(Section(name, STARTED))
        self.write()  # what a hard abort of the process leaves
        self.sections.pop()
        tic = time.perf_counter()
        try:
            outcome = check()
            section = Section(name, "failed" if outcome.failed else "ok", outcome.rows, outcome.note)
        except Skipped as why:
            section = Section(name, f"skipped: {why}")
        except Exception as e:  # the section's result, and the next section runs
            section = Section(name, f"error: {kernels.one_line(e)}")
        section.seconds = round(time.perf_counter() - tic, 1)
        self.sections.append(section)
        self.write()
        return section

    @property
    def failed(self) -> bool:
        return any(s.status == "failed" or s.status.startswith("error") for s in self.sections)

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        data = {"command": self.command, "sections": [asdict(s) for s in self.sections]}
        (self.out / "report.json").write_text(json.dumps(data, indent=1, default=str))
        (self.out / "report.md").write_text(self.markdown())

    def markdown(self) -> str:
        lines = [f"# dflash-mlx Mac check\n\n`{self.command}`"]
        for s in self.sections:
            lines.append(f"\n## {s.name}: {s.status} ({s.seconds} s)\n")
            if s.note:
                lines.append(f"{s.note}\n")
            if s.rows:
                lines.append(table(s.rows))
        return "\n".join(lines) + "\n"


def table(rows: list[dict]) -> str:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value).replace("|", "\\|")


def needs_metal() -> None:
    if kernels.use_metal():
        return
    if mx.metal.is_available():
        raise Skipped("the Metal kernels are off here (DFLASH_MLX_KERNELS=mlx, or the CPU is MLX's default device)")
    raise Skipped("no Metal")


# ------------------------------------------------------------------ sections


def environment() -> Outcome:
    return Outcome([{"item": key, "value": value} for key, value in flat(doctor.report()).items()])


def flat(facts: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in facts.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = ", ".join(map(str, value)) if isinstance(value, list) else value
    return out


def real_shapes() -> tuple[dict, dict]:
    """(attention shapes, GatedDeltaNet shapes) by model: the built-in ones, the shipped
    default drafter's, and those of every published pair whose configs are cached here."""
    attention, tape = dict(ATTENTION_SHAPES), dict(TAPE_SHAPES)
    default = json.loads((DEFAULT_DRAFT / "config.json").read_text())
    attention["SmolLM2-135M drafter"] = attention_shape(default)
    for name, pair in PUBLISHED.items():
        draft, target = cached_config(pair.draft), cached_config(pair.target)
        if draft and attention_shape(draft):
            attention[f"{name} drafter"] = attention_shape(draft)
        if target and tape_shape(target):
            tape[name] = tape_shape(target)
    return attention, tape


def cached_config(repo: str) -> Optional[dict]:
    """A repo's config where the Hugging Face cache holds it already (never a download)."""
    path = try_to_load_from_cache(repo, "config.json")
    if not isinstance(path, str):
        return None
    config = json.loads(Path(path).read_text())
    return config.get("text_config", config)  # Qwen3.5's configs nest the language model's


def attention_shape(config: dict) -> Optional[tuple]:
    heads = config.get("num_attention_heads")
    if not heads:
        return None
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return heads, config.get("num_key_value_heads", heads), head_dim


def tape_shape(config: dict) -> Optional[tuple]:
    keys = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
    return tuple(config[k] for k in keys) if all(k in config for k in keys) else None


def kernel_self_checks(quick: bool, shapes: Optional[tuple[dict, dict]] = None) -> Outcome:
    """Each kernel against its twin (kernels.prove, what decoding runs at a shape class's first
    use) on random inputs of the real shapes: bidirectional attention and the tape in bf16 (what a
    Mac runs) at every width and context; then, at the widest block and the first context, causal
    and windowed attention and both kernels in fp16."""
    needs_metal()
    attention, tape = shapes or real_shapes()
    widths, contexts = ((16,), (1024,)) if quick else (WIDTHS, CONTEXTS)
    widest, first = widths[-1], contexts[0]
    rows = []
    for model, (HQ, HKV, D) in attention.items():
        for context in contexts:
            for L in widths:
                rows.append(guarded(model, "block_attention", lambda: attention_check(model, HQ, HKV, D, L, context)))
        masks = [dict(causal=True), dict(window=WINDOW), dict(causal=True, window=WINDOW), dict(dtype=mx.float16)]
        for mask in masks:
            rows.append(
                guarded(model, "block_attention", lambda: attention_check(model, HQ, HKV, D, widest, first, **mask))
            )
    for model, (HK, HV, DK, DV) in tape.items():
        for T in widths:
            rows.append(guarded(model, "gated_delta_tape", lambda: tape_check(model, HK, HV, DK, DV, T)))
        rows.append(guarded(model, "gated_delta_tape", lambda: tape_check(model, HK, HV, DK, DV, widest, mx.float16)))
    return Outcome(rows, failed=any(r["verdict"] in ("disagrees", "failed") for r in rows))


def guarded(model: str, kernel: str, check: Callable[[], dict]) -> dict:
    """One shape's row; an error there (a shape the launch refuses, the twin out of memory) is
    that row's result, and the other shapes are still checked."""
    try:
        return check()
    except Exception as e:
        return {"model": model, "kernel": kernel, "verdict": "failed", "why": kernels.one_line(e)}


def attention_check(
    model: str,
    HQ: int,
    HKV: int,
    D: int,
    L: int,
    context: int,
    dtype=mx.bfloat16,
    causal: bool = False,
    window: Optional[int] = None,
) -> dict:
    q, k, v = (mx.random.normal((1, h, L, D)).astype(dtype) for h in (HQ, HKV, HKV))
    ck, cv = (mx.random.normal((1, HKV, context + 64, D)).astype(dtype) for _ in range(2))
    span = kernels.ContextSpan(ck, cv, 0, context)
    masking = dict(scale=D**-0.5, causal=causal, window=window)
    launch = kernels.block_attention_launch(q, k, v, span, **masking)
    decision, _ = kernels.prove(launch, lambda: [kernels.block_attention_mlx(q, k, v, span, **masking)])
    return check_row(model, "block_attention", kernels.attention_class(q, k, span, causal, window), decision)


def tape_check(model: str, HK: int, HV: int, DK: int, DV: int, T: int, dtype=mx.bfloat16) -> dict:
    q, k = ((mx.random.normal((1, T, HK, DK)) * DK**-0.5).astype(dtype) for _ in range(2))
    v = mx.random.normal((1, T, HV, DV)).astype(dtype)
    g, beta = mx.random.uniform(0.3, 1.0, (1, T, HV)), mx.random.uniform(0.0, 1.0, (1, T, HV))
    state = mx.random.normal((1, HV, DV, DK)) * 0.5
    launch = kernels.gated_delta_tape_launch(q, k, v, g, beta, state)
    decision, _ = kernels.prove(launch, lambda: kernels.gated_delta_tape_mlx(q, k, v, g, beta, state))
    return check_row(model, "gated_delta_tape", kernels.tape_class(q, k, v), decision)


def check_row(model: str, kernel: str, shape_class: str, decision: kernels.Decision) -> dict:
    return {
        "model": model,
        "kernel": kernel,
        "shape class": shape_class,
        "verdict": decision.verdict,
        "max rel. error": decision.max_error,
        "kernel ms": decision.kernel_ms,
        "twin ms": decision.twin_ms,
        "why": decision.reason,
    }


def lossless(pair, tokenizer, prompts: list[str], max_tokens: int) -> Outcome:
    """Greedy DFlash (the adaptive plan) against plain mlx-lm.  On a CPU the claim is token for
    token; on a GPU a verify pass runs other kernels and wider matmuls than a plain step, so a
    first difference is allowed where the reference's top-2 logits are a near-tie."""
    on_gpu = mx.default_device() == mx.gpu
    rows = []
    for i, text in enumerate(prompts):
        prompt = format_prompt(tokenizer, text)
        reference = answer(plain_tokens(pair, prompt, max_tokens), pair.end_tokens)
        ours, tau = dflash_tokens(pair, prompt, max_tokens, None)
        first = first_difference(reference, answer(ours, pair.end_tokens))
        row = {"prompt": i, "tokens": len(reference), "DFlash tokens": len(ours), "tau": tau, "first difference": first}
        if first is None:
            row["verdict"] = "identical"
        elif first == min(len(reference), len(ours)):
            row["verdict"] = "DIFFERENT"  # one stopped early: no near-tie explains a missing token
        else:
            gap, ulps = top2_gap(pair, prompt + reference[:first])
            row.update({"top-2 gap": gap, "gap in ulps": ulps})
            row["verdict"] = "near-tie" if on_gpu and ulps <= NEAR_TIE_ULPS else "DIFFERENT"
        rows.append(row)
    claim = f"a first difference only at a near-tie (<= {NEAR_TIE_ULPS} ulps)" if on_gpu else "token for token"
    return Outcome(rows, any(r["verdict"] == "DIFFERENT" for r in rows), f"claim here: {claim}")


def answer(tokens: list[int], ends) -> list[int]:
    """The tokens before the first end-of-sequence token (mlx-lm's generate_step yields it and goes
    on; DFlash stops there)."""
    return next((tokens[:i] for i, t in enumerate(tokens) if t in ends), tokens)


def first_difference(reference: list[int], ours: list[int]) -> Optional[int]:
    """The first position where the two differ, counting the end of the shorter one; None when equal."""
    if reference == ours:
        return None
    return next((j for j, (a, b) in enumerate(zip(reference, ours)) if a != b), min(len(reference), len(ours)))


def top2_gap(pair, prefix: list[int]) -> tuple[float, float]:
    """The reference's top-2 logit gap after `prefix`, and that gap in ulps of the top logit (in
    the dtype the logits are computed in)."""
    with unfused(pair.target.model):
        logits = pair.target.model(mx.array(prefix)[None])[0, -1]
    second, first = (float(x) for x in mx.sort(logits.astype(mx.float32))[-2:])
    ulp = 2.0 ** (math.floor(math.log2(abs(first) or 1.0)) - MANTISSA_BITS.get(logits.dtype, 23))
    return first - second, (first - second) / ulp


def speed(pair, tokenizer, prompts: list[str], max_tokens: int, warm_up: bool = True) -> Outcome:
    """Greedy tok/s of plain mlx-lm (stream_generate) and of DFlash at each fixed width and
    adaptive, on the same prompts (medians over prompts); after a warm-up of each, where each
    width's shapes are traced and its kernels self-checked, unless told otherwise (--quick)."""
    widths = [w for w in WIDTHS if w <= pair.draft.block_size] + [None]
    if warm_up:
        warm = format_prompt(tokenizer, "Hello!")
        run_plain(pair, tokenizer, warm, 8, "greedy", 0)
        for w in widths:
            run_dflash(pair, tokenizer, warm, 8, "greedy", 0, w)
    runs = {w: [] for w in widths}
    for i, text in enumerate(prompts):
        prompt = format_prompt(tokenizer, text)
        plain = run_plain(pair, tokenizer, prompt, max_tokens, "greedy", i)
        for w in widths:
            runs[w].append((plain, run_dflash(pair, tokenizer, prompt, max_tokens, "greedy", i, w)))
    rows = []
    for w, pairs in runs.items():
        median = statistics.median
        rows.append(
            {
                "width": w or "adaptive",
                "plain tok/s": median(p.generation_tps for p, _ in pairs),
                "DFlash tok/s": median(d.generation_tps for _, d in pairs),
                "speedup": median(d.generation_tps / max(p.generation_tps, 1e-9) for p, d in pairs),
                "tau": median(d.tau for _, d in pairs),
                "peak GB plain / DFlash": f"{max(p.peak_memory_gb for p, _ in pairs):.2f} / "
                f"{max(d.peak_memory_gb for _, d in pairs):.2f}",
            }
        )
    note = f"{len(prompts)} prompt(s), {max_tokens} tokens, greedy" + ("" if warm_up else ", no warm-up (rough)")
    return Outcome(rows, note=note)


def cost_curve(pair) -> Outcome:
    planner = kept(pair).planner
    if planner is None:
        raise Skipped("no adaptive plan (no drafter)")
    cost = planner.cost
    rows = [
        {"width": w, "target pass ms": 1e3 * cost.verify(w), "drafter pass ms": 1e3 * cost.drafter_pass(w)}
        for w in (1, 2, 4, 8, 16)
    ]
    return Outcome(rows, note=cost.describe())


def gated_delta_target(model: str, prompts: list[str], max_tokens: int) -> Outcome:
    """Lossless and speed on a GatedDeltaNet target, 4-bit, where this Mac's memory allows."""
    needs_metal()
    if model.lower() == "none":
        raise Skipped("--gdn-model none")
    plan = doctor.model_plan(model, 4)
    if plan["fits"] == "no":
        raise Skipped(f"{model} 4-bit needs ~{plan['footprint_gib']} GiB, {plan['usable_gib']} GiB usable here")
    pair, tokenizer = load(model, quant=4)
    if pair.target.model_type not in ("qwen3_5", "qwen3_next"):
        raise Skipped(f"{model} is a {pair.target.model_type} model, not a GatedDeltaNet one")
    checked = lossless(pair, tokenizer, prompts, max_tokens)
    timed = speed(pair, tokenizer, prompts, max_tokens)
    rows = [{"check": "lossless", **r} for r in checked.rows] + [{"check": "speed", **r} for r in timed.rows]
    return Outcome(rows, checked.failed, f"{model} 4-bit; {checked.note}")


def kernel_decisions() -> Outcome:
    """What the self-check decided for the kernel calls this run's decoding made (and earlier
    runs on this machine), as kept in the decisions file."""
    needs_metal()
    rows = [
        {"kernel": kernel, "shape class": shape_class, "verdict": d.verdict, "why": d.reason}
        for kernel, classes in kernels.choices.decided().items()
        for shape_class, d in classes.items()
    ]
    failing = any(r["verdict"] in ("disagrees", "failed") for r in rows)
    return Outcome(rows, failing, f"kept in {kernels.choices.path}")


# ------------------------------------------------------------------ the command


class Once:
    """A value made at first use, or the error making it raised, which each later use raises
    again (a model that fails to load fails every section that needs it, loaded once)."""

    def __init__(self, make: Callable):
        self.make, self.value, self.error = make, None, None

    def __call__(self):
        if self.error is not None:
            raise self.error
        if self.value is None:
            try:
                self.value = self.make()
            except Exception as e:
                self.error = e
                raise
        return self.value


def main(
    model: Optional[str] = typer.Option(None, "--model", help="Target (default: the offline SmolLM2 + its drafter)."),
    quant: Optional[int] = typer.Option(
        None, "--quant", help="A short name's target: 16 (bf16), 8 or 4 (default: 8-bit where it fits, else 4-bit)."
    ),
    gdn_model: str = typer.Option("Qwen3.5-4B", "--gdn-model", help="GatedDeltaNet target, 4-bit ('none': skip)."),
    prompts: int = typer.Option(4, "--prompts"),
    max_tokens: int = typer.Option(128, "--max-tokens"),
    quick: bool = typer.Option(
        False, "--quick", help="1 prompt, 8 tokens, fewer shapes and warm-ups: a rough report, fast."
    ),
    out: Path = typer.Option(Path("bench/results/mac-check"), "--out"),
):
    if quick:
        prompts, max_tokens = 1, 8
    try:
        writable(out, "report")
    except PermissionError as e:
        print(f"error: {e}; pass --out <a folder you can write>", file=sys.stderr)
        raise SystemExit(2) from None
    report = Report(out, " ".join(["python bench/mac_check.py", *sys.argv[1:]]))
    pair = Once(lambda: load(model, quant=quant))
    texts = Once(lambda: mixed_prompts(PROMPT_SETS, prompts))
    report.run("environment", environment)
    report.run("kernel_self_checks", lambda: kernel_self_checks(quick))
    report.run("lossless_greedy", lambda: lossless(*pair(), texts(), max_tokens))
    report.run("speed", lambda: speed(*pair(), texts(), max_tokens, warm_up=not quick))
    report.run("cost_curve", lambda: cost_curve(pair()[0]))
    report.run("gated_delta_target", lambda: gated_delta_target(gdn_model, texts(), max_tokens))
    report.run("kernel_decisions", kernel_decisions)
    print(report.markdown())
    print(f"report in {out / 'report.md'} and {out / 'report.json'}: please paste report.md into an issue")
    raise SystemExit(1 if report.failed else 0)


if __name__ == "__main__":
    typer.run(main)
