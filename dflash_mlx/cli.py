"""`dflash-mlx` command line."""

import dataclasses
import functools
import sys
from pathlib import Path
from typing import Optional

import typer

from .io import blas
from .distributed import DistributedError
from .drafters import DraftLoadError
from .drafters.precision import AUTO_DRAFT_BITS, DRAFT_QUANTS

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
train_app = typer.Typer(no_args_is_help=True, help="Train DFlash drafters: make-data, then fit.")
app.add_typer(train_app, name="train")
convert_app = typer.Typer(no_args_is_help=True, help="Convert and quantize drafters and targets for MLX.")
app.add_typer(convert_app, name="convert")

# generate's flags as its errors name them (decode/request.check_values)
GENERATE_FLAGS = {
    "max_tokens": "--max-tokens",
    "temperature": "--temp",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "seed": "--seed",
    "block_size": "--block-size",
    "stop": "--stop",
}
USER_ERRORS = (ValueError, TypeError, OSError, DraftLoadError, KeyError, UnicodeError, DistributedError)


def fail(message: str) -> None:
    """One line on stderr, exit status 1."""
    line = " ".join(message.split())
    typer.secho(f"error: {line}", err=True, fg=typer.colors.RED)
    raise typer.Exit(1)


def explain(error: BaseException) -> str:
    if isinstance(error, KeyError) and error.args:
        return f"missing {error.args[0]}"  # str(KeyError) is the repr of its key
    if isinstance(error, OSError) and error.filename and error.strerror:
        return f"{error.strerror}: {error.filename}"
    return str(error) or type(error).__name__


def user_errors(command):
    """Bad input, missing or unwritable files: one line and exit 1, never a traceback."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except USER_ERRORS as e:
            fail(explain(e))
        except KeyboardInterrupt:
            fail("interrupted")

    return run


DISTRIBUTED = typer.Option(
    None, "--distributed", help="'pipeline': split the target's layers over the ranks of mlx.launch."
)
SPLIT = typer.Option(
    None, "--split", help="With --distributed: layers per rank, rank 0 (the last layers) first, e.g. 10,20."
)
TIMEOUT = typer.Option(
    60.0, "--timeout", help="With --distributed: seconds a rank waits for the others before giving up."
)
DRAFT_QUANT = typer.Option(
    None,
    "--draft-quant",
    help="Drafter precision: 8 or 4 quantizes it on loading (group 64), 16 keeps float weights. "
    f"Default: on a GPU a float drafter is quantized to {AUTO_DRAFT_BITS} bits, a quantized one kept; on a CPU quantized "
    "matmuls are slower, so quantized weights are expanded to float (8 or 4 there gives their drafts "
    "at float's speed). The output is the same either way.",
)
# the model options of the commands that serve it (serve, launch)
SERVED_MODEL = typer.Option(
    None, "--model", "-m", help="Short name, HF repo or local dir (default: offline SmolLM2-135M-Instruct)."
)
SERVED_DRAFT = typer.Option(None, "--draft", help="Drafter HF repo or local dir.")
QUANT_HELP = (
    "A short name's target: 16 as published (bf16), 8 or 4 mlx-community's conversion. "
    "Default: 8-bit where it fits this machine, else 4-bit (dflash-mlx doctor -m NAME says which and why)."
)
SERVED_QUANT = typer.Option(None, "--quant", help=QUANT_HELP)
SERVED_PLAIN = typer.Option(
    False, "--no-draft", help="Serve without the drafter (copies still propose; with --no-adaptive: plain decoding)."
)
SERVED_FULL_BLOCKS = typer.Option(
    False, "--no-adaptive", help="Always verify full drafter blocks, no copies (without a drafter: plain decoding)."
)


def check_draft_quant(draft_quant: Optional[int]) -> None:
    if draft_quant not in (None, *DRAFT_QUANTS):
        fail(f"--draft-quant must be 16 (float), 8 or 4, got {draft_quant}")


def pipeline_options(distributed: Optional[str], split: Optional[str], timeout: float) -> dict:
    """load()'s keyword arguments for --distributed / --split / --timeout, checked."""
    from .distributed.pipeline import parse_split

    if (split is not None or timeout != 60.0) and distributed is None:
        fail("--split and --timeout go with --distributed pipeline")
    if not timeout > 0:
        fail(f"--timeout must be > 0 seconds, got {timeout}")
    return {"distributed": distributed, "split": parse_split(split) if split else None, "timeout": timeout}


def read_prompt(prompt: str) -> str:
    """--prompt text, or stdin for '-'; invalid UTF-8 is an error, not a traceback."""
    raw = sys.stdin.buffer.read() if prompt == "-" else prompt.encode("utf-8", "surrogateescape")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"the prompt is not valid UTF-8 (byte {e.start}); pass UTF-8 text") from None
    if not text.strip():
        raise ValueError("the prompt is empty; pass text with --prompt")
    return text


@app.callback()
def main():
    """DFlash speculative decoding on MLX: same output as the target, faster."""


@app.command()
@user_errors
def generate(
    prompt: str = typer.Option(..., "--prompt", "-p", help="Prompt text ('-' reads stdin)."),
    model: Optional[str] = typer.Option(
        None, "--model", "-m", help="Short name, HF repo or local dir (default: offline SmolLM2-135M-Instruct)."
    ),
    draft: Optional[str] = typer.Option(
        None, "--draft", help="Drafter HF repo or local dir (default: the model's published drafter)."
    ),
    quant: Optional[int] = typer.Option(None, "--quant", help=QUANT_HELP),
    draft_quant: Optional[int] = DRAFT_QUANT,
    max_tokens: int = typer.Option(256, "--max-tokens", help="Maximum tokens to generate."),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature (0 = greedy)."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k"),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed for reproducible sampling."),
    block_size: Optional[int] = typer.Option(
        None, "--block-size", help="Fixed verify width (default: adaptive, up to the drafter's block size)."
    ),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt."),
    no_chat_template: bool = typer.Option(False, "--no-chat-template", help="Feed the prompt raw."),
    no_draft: bool = typer.Option(
        False,
        "--no-draft",
        help="Decode without the drafter: copies from the prompt and earlier answers still propose "
        "(with --no-adaptive: plain target decoding, the same loop).",
    ),
    no_adaptive: bool = typer.Option(
        False,
        "--no-adaptive",
        help="Always verify full drafter blocks, no copies (default: pick the width and source per cycle; "
        "without a drafter: plain decoding).",
    ),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Print what was loaded and the formatted prompt."),
    distributed: Optional[str] = DISTRIBUTED,
    split: Optional[str] = SPLIT,
    timeout: float = TIMEOUT,
):
    """Generate text with DFlash speculative decoding, streaming it as it is accepted."""
    from .api import format_prompt, format_stats, load, stream_generate
    from .decode.learning import kept
    from .decode.request import check_values

    prompt = read_prompt(prompt)
    if quant not in (None, 16, 8, 4):
        fail(f"--quant must be 16 (bf16), 8 or 4, got {quant}")
    check_draft_quant(draft_quant)
    pipeline = pipeline_options(distributed, split, timeout)
    # checked before the model loads, as the request will check them (decode/request.check_values)
    check_values(max_tokens, temp, top_p, top_k, seed, block_size, stop=stop, names=GENERATE_FLAGS)
    # a fixed width needs no cost curve
    pair, tokenizer = load(
        model,
        draft,
        quant=quant,
        draft_quant=draft_quant,
        use_draft=not no_draft,
        adaptive=not no_adaptive and block_size is None,
        **pipeline,
    )
    if distributed is not None and not pair.target.is_driver:
        pair.target.follow()  # rank 0 prints
        return
    if pair.draft is None and not no_draft:
        serving = "copies from the prompt and earlier answers" if kept(pair).planner else "plain target decoding"
        typer.secho(f"note: {pair.draft_note}; decoding with {serving}", err=True, fg=typer.colors.YELLOW)
    if verbose:
        typer.echo(f"BLAS: {blas.status()}", err=True)
        typer.echo(f"target: {pair.target.model_type}, {pair.target.num_layers} layers", err=True)
        if pair.draft is not None:
            typer.echo(
                f"drafter: {len(pair.draft.layers)} layers, block {pair.draft.block_size}, "
                f"target layers {pair.draft.target_layer_ids}",
                err=True,
            )
        planner = kept(pair).planner
        if planner is not None:
            typer.echo(f"adaptive width, this machine: {planner.cost.describe()}", err=True)
    tokens = format_prompt(tokenizer, prompt, system, chat_template=not no_chat_template)
    if verbose:
        typer.echo(tokenizer.decode(tokens), err=True)
    last, ranks = None, None
    try:
        for last in stream_generate(
            pair,
            tokenizer,
            tokens,
            max_tokens,
            temp=temp,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            block_size=block_size,
            stop=stop,
        ):
            typer.echo(last.text, nl=False)
    except DistributedError:
        raise  # the other ranks are gone or stuck: nothing to release
    except BaseException:
        if distributed is not None:
            pair.target.finish()  # release the following ranks before failing
        raise
    if distributed is not None:
        ranks = pair.target.finish()
    typer.echo()
    typer.echo(format_stats(last, pair))
    if ranks and verbose:
        from .distributed.pipeline import describe_ranks

        typer.echo(describe_ranks(ranks, last), err=True)


@app.command()
@user_errors
def serve(
    model: Optional[str] = SERVED_MODEL,
    draft: Optional[str] = SERVED_DRAFT,
    quant: Optional[int] = SERVED_QUANT,
    draft_quant: Optional[int] = DRAFT_QUANT,
    no_draft: bool = SERVED_PLAIN,
    no_adaptive: bool = SERVED_FULL_BLOCKS,
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8080, "--port"),
    max_queue: int = typer.Option(16, "--max-queue", help="Requests that may wait; more get 429."),
    max_batch: int = typer.Option(8, "--max-batch", help="Requests decoded together (1: one at a time)."),
    max_batch_tokens: Optional[int] = typer.Option(
        None,
        "--max-batch-tokens",
        help="Tokens a batch's caches may hold, rows x the longest row (default 32768); a longer request runs alone.",
    ),
    prompt_cache_bytes: Optional[int] = typer.Option(
        None,
        "--prompt-cache-bytes",
        help="Memory for reusable prompt prefixes (default: a quarter of the memory left after the weights, "
        "at least 1 GiB; 0: off).",
    ),
    prompt_cache_dir: Optional[str] = typer.Option(
        None,
        "--prompt-cache-dir",
        help="A folder that keeps reusable prefixes across restarts (what memory evicts, and all at shutdown).",
    ),
    prompt_cache_disk_bytes: int = typer.Option(
        8 << 30, "--prompt-cache-disk-bytes", help="Bytes the --prompt-cache-dir folder may hold."
    ),
    api_key: Optional[str] = typer.Option(
        None,
        "--api-key",
        envvar="DFLASH_MLX_API_KEY",
        show_envvar=True,
        help="Require this key (Authorization: Bearer KEY or x-api-key: KEY) on every route but /health.",
    ),
    allow_host: list[str] = typer.Option(
        [], "--allow-host", help="Also answer requests for this Host name (repeatable; '*': any)."
    ),
    cors_origin: list[str] = typer.Option(
        [], "--cors-origin", help="Let web pages from this origin call the server (repeatable)."
    ),
    no_next_turn_prefill: bool = typer.Option(
        False,
        "--no-next-turn-prefill",
        help="Do not prefill, while idle, each chat's conversation as its next request will send it back.",
    ),
    no_suffix_drafts: bool = typer.Option(
        False,
        "--no-suffix-drafts",
        help="Do not copy drafts from earlier answers (when clients must not share even timing).",
    ),
    drain_seconds: float = typer.Option(
        10.0,
        "--drain-seconds",
        help="On SIGTERM or Ctrl-C, let running requests finish for this long (new ones get 503), then stop.",
    ),
    log_level: str = typer.Option(
        "info",
        "--log-level",
        help="debug, info (an access line per request), warning or error (5xx with their tracebacks).",
    ),
    distributed: Optional[str] = DISTRIBUTED,
    split: Optional[str] = SPLIT,
    timeout: float = TIMEOUT,
):
    """Serve the model over the OpenAI API (chat, text completions, Responses) and the Anthropic Messages API."""
    serving = _server_module()
    _start_logging(serving, log_level)
    options = serving.ServerOptions(
        max_queue=max_queue,
        prompt_cache_bytes=prompt_cache_bytes,
        max_batch=max_batch,
        max_batch_tokens=max_batch_tokens,
        prompt_cache_dir=prompt_cache_dir,
        prompt_cache_disk_bytes=prompt_cache_disk_bytes,
        access=dict(bind_host=host, allow_hosts=tuple(allow_host), cors_origins=tuple(cors_origin), api_key=api_key),
        next_turn_prefill=not no_next_turn_prefill,
        warm_up=distributed is None,  # not tried across pipeline ranks
    )
    _check_serve_flags(options, quant, port, drain_seconds)
    check_draft_quant(draft_quant)
    from .api import load
    from .decode.learning import kept

    pipeline = pipeline_options(distributed, split, timeout)
    pair, tokenizer = load(
        model,
        draft,
        quant=quant,
        draft_quant=draft_quant,
        use_draft=not no_draft,
        adaptive=not no_adaptive,
        batch_tokens=options.max_batch_tokens,  # the caches the variant chosen must leave room for
        **pipeline,
    )
    if no_suffix_drafts:
        kept(pair).suffixes = None
    if distributed is not None and not pair.target.is_driver:
        _follow_rank_zero(pair.target)
        return
    if distributed is not None:
        options = _without_prompt_cache(options)
    name = model or "SmolLM2-135M-Instruct"
    server = serving.Server(pair, tokenizer, name, options)
    _say_how_it_serves(server, name, host, port, api_key)
    try:
        serving.run(server, host, port, drain_seconds, log_level.lower())
    finally:
        if distributed is not None:
            _stop_other_ranks(pair.target)


def _server_module():
    """dflash_mlx.serve.app, or exit saying how to install the server's extra."""
    try:
        from .serve import app as serving
    except ImportError as e:
        fail(
            f"the server needs its extra: pip install -e '.[serve]' in the repository, or pip install starlette uvicorn llguidance ({e.name} is missing)"
        )
    return serving


def _start_logging(serving, log_level: str) -> None:
    if log_level.lower() not in serving.LOG_LEVELS:
        fail(f"--log-level must be one of {', '.join(serving.LOG_LEVELS)}, got {log_level}")
    serving.configure_logging(log_level.lower())


def _check_serve_flags(options, quant: Optional[int], port: int, drain_seconds: float) -> None:
    """The serve flags' values checked before the model loads (its errors name the flags)."""
    if quant not in (None, 16, 8, 4):
        fail(f"--quant must be 16 (bf16), 8 or 4, got {quant}")
    if (
        options.max_queue < 1
        or options.max_batch < 1
        or (options.max_batch_tokens is not None and options.max_batch_tokens < 1)
        or not 0 < port < 65536
    ):
        fail("--max-queue, --max-batch and --max-batch-tokens must be >= 1 and --port in 1..65535")
    if not 0 <= drain_seconds <= 3600:
        fail(f"--drain-seconds must be between 0 and 3600, got {drain_seconds}")
    if options.prompt_cache_bytes is not None and options.prompt_cache_bytes < 0:
        fail(f"--prompt-cache-bytes must be >= 0, got {options.prompt_cache_bytes}")
    api_key = options.access["api_key"]
    if api_key is not None and not api_key.strip():
        fail("--api-key is empty; give a key, or leave the option out")
    if options.prompt_cache_disk_bytes < 1:
        fail(f"--prompt-cache-disk-bytes must be >= 1, got {options.prompt_cache_disk_bytes}")
    if options.prompt_cache_dir is not None:
        from .io.storage import writable

        if options.prompt_cache_bytes == 0:
            fail("--prompt-cache-dir needs the prompt cache: drop --prompt-cache-bytes 0")
        writable(Path(options.prompt_cache_dir), "prompt cache")


def _follow_rank_zero(target) -> None:
    """A pipeline rank other than 0 computes its layers for rank 0, which serves, until it stops."""
    try:
        target.follow(wait_forever=True)  # an idle server is not a lost rank
    except KeyboardInterrupt:  # Ctrl-C reaches every rank of mlx.launch; rank 0 reports
        pass


def _stop_other_ranks(target) -> None:
    try:
        target.finish()  # the other ranks end with the server
    except DistributedError:
        pass  # they stopped first (Ctrl-C reaches them too)


def _without_prompt_cache(options):
    """The options of a pipeline's server: no prefix reuse (said when it was asked for)."""
    if options.prompt_cache_bytes != 0:
        typer.secho(
            "note: prefix reuse is off with --distributed (the other ranks' caches are not snapshotted yet)",
            err=True,
            fg=typer.colors.YELLOW,
        )
    return dataclasses.replace(options, prompt_cache_bytes=0)


def _say_how_it_serves(server, name: str, host: str, port: int, api_key: Optional[str]) -> None:
    """The start-up lines on stderr: who can reach it, how it batches, what it keeps."""
    from .decode.learning import kept
    from .serve.guard import host_name, is_loopback

    if api_key is None and not is_loopback(host_name(host)):
        typer.secho(
            f"warning: serving beyond this machine ({host}) with no --api-key: anyone who can reach it can use it",
            err=True,
            fg=typer.colors.YELLOW,
        )
    if server.batch_refusal:
        typer.secho(
            f"note: requests are decoded one at a time ({server.batch_refusal})", err=True, fg=typer.colors.YELLOW
        )
    reuse = (
        f"prompt cache {server.prompt_cache.max_bytes / 2**30:.1f} GiB" if server.prompt_cache else "no prompt cache"
    )
    drafter = "on" if server.model.draft is not None else "off"
    copies = "on" if kept(server.model).planner is not None else "off"
    typer.secho(
        f"serving {name} on http://{host}:{port}/v1 (drafter: {drafter}; copies: {copies}; "
        f"batches of up to {server.max_batch}; {reuse}); Ctrl-C drains and stops",
        err=True,
    )


@app.command()
@user_errors
def launch(
    agent: str = typer.Argument(..., help="claude (Claude Code), codex (Codex CLI) or opencode (OpenCode)."),
    agent_args: Optional[list[str]] = typer.Argument(None, help="After --: arguments for the agent."),
    model: Optional[str] = SERVED_MODEL,
    draft: Optional[str] = SERVED_DRAFT,
    quant: Optional[int] = SERVED_QUANT,
    draft_quant: Optional[int] = DRAFT_QUANT,
    no_draft: bool = SERVED_PLAIN,
    no_adaptive: bool = SERVED_FULL_BLOCKS,
    port: Optional[int] = typer.Option(
        None,
        "--port",
        help="Reuse the dflash-mlx server on this port, else start one there (default: 8080's, else a free port).",
    ),
    wait: float = typer.Option(600.0, "--wait", help="Seconds a started server may take to load the model."),
    log_level: str = typer.Option(
        "info", "--log-level", help="A started server's --log-level (its log file is named on the first line)."
    ),
):
    """Run a coding agent on a local server: started for it and stopped after it, or reused if one is running."""
    from .serve import launch as launcher

    check_draft_quant(draft_quant)
    levels = _server_module().LOG_LEVELS
    if log_level.lower() not in levels:
        fail(f"--log-level must be one of {', '.join(levels)}, got {log_level}")
    options = launcher.ModelOptions(model, draft, quant, draft_quant, no_draft, no_adaptive)
    try:
        status = launcher.launch(agent, options, port, wait, agent_args or [], log_level.lower())
    except launcher.LaunchError as e:
        fail(str(e))
    raise typer.Exit(status)


@train_app.command("make-data")
@user_errors
def make_data(
    out: str = typer.Option(..., "--out", "-o", help="Data directory (resumes if it exists)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Target: short name, HF repo or local dir."),
    prompts: Optional[str] = typer.Option(
        None,
        "--prompts",
        help="'builtin' (default), 'edits' (whole functions rewritten with one change) or 'revisions' (prose paragraphs revised; :SEED for another draw), a .txt (one per line) or .jsonl ({\"prompt\": ...}) file.",
    ),
    text: Optional[str] = typer.Option(
        None,
        "--text",
        help="For a base model: plain continuations cut from these text files (comma-separated globs, quoted) instead of generated responses; --max-tokens is then each response's length.",
    ),
    prompt_tokens: Optional[int] = typer.Option(
        None, "--prompt-tokens", help="With --text: tokens per prompt, BOS included (default 192)."
    ),
    stride: Optional[int] = typer.Option(
        None,
        "--stride",
        help="With --text: tokens from one cut to the next (default: prompt + response, back to back).",
    ),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Longest response per prompt."),
    budget: Optional[int] = typer.Option(None, "--budget", help="Stop after about this many response tokens."),
    batch_size: int = typer.Option(64, "--batch-size", help="Prompts generated together (batched decoding)."),
    temp: float = typer.Option(
        0.0,
        "--temp",
        help="0: greedy responses; > 0: sampled ones (more varied text; labelled where the target's greedy choice agrees).",
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of sampled responses."),
):
    """Generate the target's own responses (self-distillation data), or with --text cut plain
    continuations from text files (for a base model)."""
    from .api import load
    from .train.data import make_data as run
    from .train.prompts import read_prompts

    from .io.storage import writable

    if max_tokens <= 0 or batch_size <= 0:
        fail("--max-tokens and --batch-size must be > 0")
    if budget is not None and budget <= 0:
        fail(f"--budget must be > 0, got {budget}")
    if not temp >= 0:
        fail(f"--temp must be >= 0, got {temp}")
    if text is not None:
        if prompts is not None or temp or budget is not None:
            fail("--text cuts responses from the files: --prompts, --temp and --budget apply to generated ones")
        _make_text_data(out, model, text, 192 if prompt_tokens is None else prompt_tokens, max_tokens, stride)
        return
    if prompt_tokens is not None or stride is not None:
        fail("--prompt-tokens and --stride apply to --text only")
    texts = read_prompts(prompts or "builtin")
    writable(Path(out), "data")
    pair, tokenizer = load(model, use_draft=False, adaptive=False)
    path = run(pair.target, tokenizer, texts, out, max_tokens, budget, batch_size, temp=temp, seed=seed)
    typer.echo(f"data in {path}")


def _make_text_data(out: str, model: Optional[str], globs: str, prompt_tokens: int, max_tokens: int, stride):
    from .api import load
    from .io.storage import writable
    from .train.continuations import continuations, text_files, write_continuations
    from .train.data import target_fingerprint

    stride = prompt_tokens + max_tokens if stride is None else stride
    files = text_files(globs)
    writable(Path(out), "data")
    pair, tokenizer = load(model, use_draft=False, adaptive=False)
    examples = continuations(tokenizer, files, prompt_tokens, max_tokens, stride)
    source = (
        f"plain continuations of {globs}: {prompt_tokens}-token prompts + the next {max_tokens} tokens, "
        f"every {stride} tokens"
    )
    path = write_continuations(out, target_fingerprint(pair.target, tokenizer), examples, source)
    typer.echo(f"{len(examples)} continuations of {len(files)} files in {path}")


@train_app.command("make-prompts")
@user_errors
def make_prompts(
    out: str = typer.Option(..., "--out", "-o", help="A .jsonl file of prompts (appended to; resumes)."),
    count: int = typer.Option(1000, "--count", "-n", help="Prompts the file should hold."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Target: short name, HF repo or local dir."),
    temp: float = typer.Option(1.0, "--temp", help="Sampling temperature of the user turns."),
    top_p: float = typer.Option(0.95, "--top-p"),
    seed: int = typer.Option(0, "--seed"),
    batch_size: int = typer.Option(64, "--batch-size", help="User turns sampled together (batched decoding)."),
):
    """Let a chat target write user prompts itself (Magpie-style), for `train make-data --prompts FILE`."""
    from .api import load
    from .io.progress import console
    from .io.storage import writable
    from .train.corpus import benchmark_shingles
    from .train.self_prompts import make_prompts as run

    if count <= 0 or batch_size <= 0:
        fail("--count and --batch-size must be > 0")
    if not temp > 0 or not 0 < top_p <= 1:
        fail(f"--temp must be > 0 and --top-p in (0, 1], got {temp} and {top_p}")
    if not out.endswith(".jsonl"):
        fail(f"--out must be a .jsonl file (what make-data --prompts reads), got {out}")
    writable(Path(out).parent, "output")
    pair, tokenizer = load(model, use_draft=False, adaptive=False)
    console.print("Reading the benchmark prompt sets (no prompt may share an 8-word span with them)", style="dim")
    path = run(pair.target.model, tokenizer, out, count, benchmark_shingles(), temp, top_p, seed, batch_size)
    typer.echo(f"prompts in {path}")


def _width_list(text: str) -> list[int]:
    """'2,3,4' or '2-16' (or a mix) as a list of widths; a one-line error otherwise."""
    widths = []
    try:
        for part in text.split(","):
            low, _, high = part.strip().partition("-")
            widths += range(int(low), int(high or low) + 1)
    except ValueError:
        fail(f"--block-widths takes widths like 2,3,4 or 2-16, got {text!r}")
    return widths


@train_app.command("fit")
@user_errors
def fit(
    data: str = typer.Option(
        ...,
        "--data",
        "-d",
        help="Data dir from `train make-data` (comma-separated for several; the held-out examples are the first dir's last).",
    ),
    out: str = typer.Option(..., "--out", "-o", help="Drafter dir to write (resumes from its checkpoint)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Target: short name, HF repo or local dir."),
    block_size: int = typer.Option(16, "--block-size"),
    layers: int = typer.Option(1, "--layers", help="Drafter layers."),
    arch: str = typer.Option(
        "dflash",
        "--arch",
        help="dflash, or dflash2 (block convolutions + candidate selector; from a DFlash 1 --init-from it grows into one).",
    ),
    target_layers: int = typer.Option(5, "--target-layers", help="How many target layers feed the drafter."),
    target_layer_ids: Optional[str] = typer.Option(
        None, "--target-layer-ids", help="Comma-separated; default: stratified."
    ),
    gamma: float = typer.Option(4.0, "--gamma", help="Loss weight decay along the block."),
    epochs: int = typer.Option(10, "--epochs", help="Passes over the self-distilled data (unless --steps)."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Optimizer steps (overrides --epochs)."),
    lr: float = typer.Option(1e-3, "--lr"),
    sequences_per_step: int = typer.Option(8, "--sequences-per-step"),
    text_fraction: float = typer.Option(
        0.0, "--text-fraction", help="Share of each step's sequences taken from teacher-forced standard-library text."
    ),
    text_window: int = typer.Option(256, "--text-window", help="Tokens per text window."),
    block_positions: int = typer.Option(
        256, "--block-positions", help="Block positions per sequence and step (random anchors)."
    ),
    block_widths: Optional[str] = typer.Option(
        None,
        "--block-widths",
        help="Cut each training block to a verify width drawn from these (e.g. 2,3,4 or 2-16): the widths the loop drafts at; default: blocks as long as their labels.",
    ),
    head_size: int = typer.Option(
        8192, "--head-size", help="Token ids in the training loss's output vocabulary (most frequent)."
    ),
    distill: float = typer.Option(
        0.0,
        "--distill",
        help="Weight in [0, 1] of KL(target || drafter) in the loss (the rest: the hard greedy label).",
    ),
    eval_every: int = typer.Option(0, "--eval-every", help="Steps between held-out tau checks (0: end only)."),
    checkpoint_every: int = typer.Option(
        200, "--checkpoint-every", help="Steps between checkpoints (a stopped run resumes from the last)."
    ),
    no_init_from_target: bool = typer.Option(False, "--no-init-from-target"),
    init_from: Optional[str] = typer.Option(None, "--init-from", help="Warm-start from an existing drafter dir."),
    fresh: bool = typer.Option(False, "--fresh", help="Ignore an existing checkpoint."),
    seed: int = typer.Option(0, "--seed"),
):
    """Train a drafter on self-distillation data (the target stays frozen)."""
    from .api import load
    from .train.corpus import benchmark_shingles, text_windows
    from .train.data import read_datasets, target_fingerprint
    from .io.progress import console
    from .io.storage import writable
    from .train.config import TrainConfig
    from .train.checkpoint import checkpoint_config
    from .train.fit import fit as run

    try:
        ids = [int(i) for i in target_layer_ids.split(",")] if target_layer_ids else None
    except ValueError:
        fail(f"--target-layer-ids must be comma-separated integers, got {target_layer_ids!r}")
    if text_window < 2:
        fail(f"--text-window must be >= 2, got {text_window}")
    widths = _width_list(block_widths) if block_widths else None
    cfg = TrainConfig(
        block_size=block_size,
        num_layers=layers,
        architecture=arch,
        num_target_layers=len(ids) if ids else target_layers,
        target_layer_ids=ids,
        gamma=gamma,
        epochs=epochs,
        steps=steps,
        lr=lr,
        sequences_per_step=sequences_per_step,
        text_fraction=text_fraction,
        text_window=text_window,
        block_positions=block_positions,
        block_widths=widths,
        head_size=head_size,
        distill=distill,
        eval_every=eval_every,
        checkpoint_every=checkpoint_every,
        init_from_target=not no_init_from_target,
        init_from=init_from,
        seed=seed,
    )
    writable(Path(out))  # before the long work, not at its first checkpoint
    pair, tokenizer = load(model, use_draft=False, adaptive=False)
    examples = read_datasets(data, target_fingerprint(pair.target, tokenizer))
    text = []
    resumed = None if fresh else checkpoint_config(out)  # a resumed run keeps its own recipe
    if (resumed or {}).get("text_fraction", text_fraction) > 0:
        console.print("Cutting standard-library text into windows (no benchmark overlap)", style="dim")
        text = text_windows(
            tokenizer,
            (resumed or {}).get("text_window", text_window),
            seed=(resumed or {}).get("seed", seed),
            exclude=benchmark_shingles(),
        )
    run(pair.target, tokenizer, examples, out, cfg, text=text, resume=not fresh, log=console.print)
    typer.echo(f"drafter in {out}")


@train_app.command("eval")
@user_errors
def evaluate(
    draft: str = typer.Option(..., "--draft", help="Drafter dir to evaluate."),
    data: Optional[str] = typer.Option(
        None,
        "--data",
        "-d",
        help="Data dir(s), as in fit: the first dir's last --prompts examples are the held-out set.",
    ),
    sets: Optional[str] = typer.Option(
        None, "--sets", help="Benchmark prompt sets instead (comma-separated: gsm8k, humaneval, mtbench, ...)."
    ),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Target: short name, HF repo or local dir."),
    prompts: int = typer.Option(8, "--prompts", help="Held-out examples (as in fit), or prompts per set."),
    max_tokens: int = typer.Option(96, "--max-tokens"),
    block_size: Optional[int] = typer.Option(None, "--block-size", help="Fixed width (default: the drafter's block)."),
):
    """Tau of a drafter (greedy, the real decode loop, fixed width) and the acceptance
    rate of each block position, on held-out data or benchmark prompts."""
    from .api import format_prompt, load
    from .train.data import read_datasets, target_fingerprint
    from .train.evaluate import committed_lengths, position_acceptance, split_held_out

    if prompts <= 0 or max_tokens <= 0:
        fail("--prompts and --max-tokens must be > 0")
    if (data is None) == (sets is None):
        fail("pass either --data (held-out examples) or --sets (benchmark prompts)")
    pair, tokenizer = load(model, draft, adaptive=False)
    width = block_size or pair.draft.block_size
    if sets is not None:
        from .bench.prompt_sets import load_prompts

        groups = {
            name: [format_prompt(tokenizer, p) for p in load_prompts(name.strip(), prompts)]
            for name in sets.split(",")
            if name.strip()
        }
    else:
        held_out, _ = split_held_out(read_datasets(data, target_fingerprint(pair.target, tokenizer)), prompts)
        groups = {"held-out": [e.prompt_ids for e in held_out]}
    for name, group in groups.items():
        lengths = committed_lengths(pair.target, pair.draft, group, max_tokens, width)
        rates = " ".join(f"{r:.2f}" for r in position_acceptance(lengths, width))
        typer.echo(
            f"{name}: tau {sum(lengths) / max(len(lengths), 1):.3f} ({len(group)} prompts, block {width}, "
            f"greedy, {max_tokens} tokens); acceptance by position: {rates}"
        )


@app.command()
@user_errors
def bench(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Target (default: offline SmolLM2 + its drafter)."),
    draft: Optional[str] = typer.Option(None, "--draft", help="Drafter repo or dir."),
    sets: str = typer.Option(
        "gsm8k,humaneval,mtbench,math500",
        "--sets",
        help="Comma-separated: gsm8k, humaneval, mtbench, math500, aime, long (~1.5k-token prompts).",
    ),
    prompts_per_set: int = typer.Option(10, "--prompts-per-set", "-n"),
    max_tokens: int = typer.Option(128, "--max-tokens"),
    modes: str = typer.Option("greedy", "--modes", help="greedy, sampled, or both comma-separated."),
    block_size: Optional[int] = typer.Option(None, "--block-size", help="Fixed width (default: adaptive)."),
    no_adaptive: bool = typer.Option(False, "--no-adaptive"),
    out: str = typer.Option("bench/results/latest", "--out", "-o", help="Where results.json/.md and plots go."),
):
    """Plain mlx-lm decoding vs DFlash on benchmark prompts, interleaved; JSON, markdown and plots."""
    from .api import load
    from .bench.harness import run_bench

    chosen_modes = [m.strip() for m in modes.split(",") if m.strip()]
    if not chosen_modes or set(chosen_modes) - {"greedy", "sampled"}:
        fail(f"--modes must be greedy and/or sampled, got {modes!r}")
    if prompts_per_set <= 0 or max_tokens <= 0:
        fail("--prompts-per-set and --max-tokens must be > 0")
    from .io.storage import writable

    writable(Path(out), "results")
    pair, tokenizer = load(model, draft, adaptive=not no_adaptive)
    results = run_bench(
        pair,
        tokenizer,
        [s.strip() for s in sets.split(",")],
        prompts_per_set,
        max_tokens,
        chosen_modes,
        out,
        block_size,
        label=model or "SmolLM2-135M-Instruct",
    )
    from .bench.harness import markdown

    typer.echo(markdown(results))
    typer.echo(f"results in {out}")


@convert_app.command("draft")
@user_errors
def convert_draft(
    source: str = typer.Argument(..., help="z-lab drafter: HF repo id or local dir."),
    out: str = typer.Argument(..., help="Output drafter dir."),
    q_bits: Optional[int] = typer.Option(None, "--q-bits", help="Quantize linear layers to 4 or 8 bits."),
    q_group_size: int = typer.Option(64, "--q-group-size", help="32, 64 or 128."),
    quantize_fc: bool = typer.Option(
        True, "--quantize-fc/--no-quantize-fc", help="Quantize the feature projection too."
    ),
    dtype: str = typer.Option("bfloat16", "--dtype", help="bfloat16 or float32 (never float16: it overflows)."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing output dir."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print what would be written and stop."),
):
    """Convert a DFlash drafter, optionally quantized; `load` reads the result."""
    from .convert.models import convert_draft as run, draft_size_mb

    result = run(source, out, q_bits, q_group_size, quantize_fc, dtype, force, dry_run)
    typer.echo(result if dry_run else f"drafter in {result} ({draft_size_mb(result):.1f} MB)")


@convert_app.command("target")
@user_errors
def convert_target(
    source: str = typer.Argument(..., help="HF repo id / dir, or a .gguf file (llama, qwen2, qwen3, gemma3)."),
    out: str = typer.Argument(..., help="Output mlx-lm model dir."),
    q_bits: Optional[int] = typer.Option(
        None,
        "--q-bits",
        help="Quantize to 4 or 8 bits (mlx-lm): an HF target, or a GGUF that MLX cannot keep quantized.",
    ),
    q_group_size: int = typer.Option(64, "--q-group-size"),
    dtype: Optional[str] = typer.Option(
        None,
        "--dtype",
        help="HF: float16/bfloat16/float32. GGUF: native (keep Q4_0/Q4_1/Q8_0) or a float dtype "
        "(default: native where MLX keeps the file's types, else float32).",
    ),
    force: bool = typer.Option(False, "--force"),
    dry_run: bool = typer.Option(False, "--dry-run"),
):
    """Convert a target model into an mlx-lm directory."""
    from .convert.models import convert_target as run

    result = run(source, out, q_bits, q_group_size, dtype, force, dry_run)
    typer.echo(result if dry_run else f"model in {result}")


@app.command()
@user_errors
def doctor(
    model: Optional[str] = typer.Option(
        None, "--model", "-m", help="Also say what loading this model would take (offline: nothing is downloaded)."
    ),
    quant: Optional[int] = typer.Option(None, "--quant", help=QUANT_HELP),
    draft_quant: Optional[int] = DRAFT_QUANT,
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
):
    """What dflash-mlx would run on this machine and why: platform, memory, versions, kernels, BLAS, caches."""
    import json

    from .api.doctor import describe, report

    check_draft_quant(draft_quant)
    facts = report(model, quant, draft_quant)
    typer.echo(json.dumps(facts, indent=1) if as_json else describe(facts))


if __name__ == "__main__":
    app()
