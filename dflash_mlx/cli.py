"""`dflash-mlx` command line."""

import sys
from typing import Optional

import typer

from . import _blas
from .draft import DraftLoadError

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)

USER_ERRORS = (ValueError, FileNotFoundError, DraftLoadError, KeyError)


def fail(message: str) -> None:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(1)


@app.callback()
def main():
    """DFlash speculative decoding on MLX: same output as the target, faster."""


@app.command()
def generate(
    prompt: str = typer.Option(..., "--prompt", "-p", help="Prompt text ('-' reads stdin)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Short name, HF repo or local dir (default: offline SmolLM2-135M-Instruct)."),
    draft: Optional[str] = typer.Option(None, "--draft", help="Drafter HF repo or local dir (default: the model's published drafter)."),
    quant: Optional[int] = typer.Option(None, "--quant", help="Use the mlx-community 4- or 8-bit target of a short name."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Maximum tokens to generate."),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature (0 = greedy)."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k"),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed for reproducible sampling."),
    block_size: Optional[int] = typer.Option(None, "--block-size", help="Verify width (default: the drafter's block size)."),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt."),
    no_chat_template: bool = typer.Option(False, "--no-chat-template", help="Feed the prompt raw."),
    no_draft: bool = typer.Option(False, "--no-draft", help="Plain target decoding through the same loop."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Print what was loaded and the formatted prompt."),
):
    """Generate text with DFlash speculative decoding, streaming it as it is accepted."""
    from .api import format_prompt, format_stats, load, stream_generate

    if prompt == "-":
        prompt = sys.stdin.read()
    if not prompt.strip():
        fail("the prompt is empty; pass text with --prompt")
    if max_tokens <= 0:
        fail(f"--max-tokens must be > 0, got {max_tokens}")
    if quant not in (None, 4, 8):
        fail(f"--quant must be 4 or 8, got {quant}")
    try:
        pair, tokenizer = load(model, draft, quant=quant, use_draft=not no_draft)
        if pair.draft is None and not no_draft:
            typer.secho(f"note: {pair.draft_note}; running plain target decoding", err=True, fg=typer.colors.YELLOW)
        if verbose:
            typer.echo(f"BLAS: {_blas.status()}", err=True)
            typer.echo(f"target: {pair.target.model_type}, {pair.target.num_layers} layers", err=True)
            if pair.draft is not None:
                typer.echo(f"drafter: {len(pair.draft.layers)} layers, block {pair.draft.block_size}, "
                           f"target layers {pair.draft.target_layer_ids}", err=True)
        tokens = format_prompt(tokenizer, prompt, system, chat_template=not no_chat_template)
        if verbose:
            typer.echo(tokenizer.decode(tokens), err=True)
        last = None
        for last in stream_generate(pair, tokenizer, tokens, max_tokens, temp=temp, top_p=top_p,
                                    top_k=top_k, seed=seed, block_size=block_size, stop=stop):
            typer.echo(last.text, nl=False)
        typer.echo()
        typer.echo(format_stats(last, pair))
    except USER_ERRORS as e:
        fail(str(e).strip("'\""))
