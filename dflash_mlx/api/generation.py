"""Generating text: prompts checked and encoded, requests decoded alone or together
(decode/decoder.py), their tokens streamed back as text, cut at EOS, a stop string or max_tokens."""

import numbers
from dataclasses import dataclass, replace
from typing import Iterator, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..decode.decoder import BatchStep, Decoder, StepFailed, decode, warm_up
from ..decode.grammar import Grammar
from ..io.progress import add_task, progress
from ..decode.model import DecodeStats, DFlashModel, Step
from ..cache.prompt_cache import PromptCache
from ..decode.request import Bounds, Request, build_request
from ..sampling import TokenLogprob
from .loading import context_limit


@dataclass
class GenerationResponse:
    """One decode cycle's output, in the spirit of mlx-lm's GenerationResponse."""

    text: str  # new text segment (may be empty)
    tokens: list[int]  # tokens committed this cycle
    accepted: int  # how many of them were accepted draft tokens
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float  # GB
    # None, "stop", "length" (max_tokens) or "context" (the context's end, where a server cut max_tokens to it)
    finish_reason: Optional[str]
    tau: float  # mean tokens committed per target pass so far
    acceptance_histogram: list[int]  # [k-1] = cycles that committed k tokens
    block_size: int
    widths: list[int]  # verify width of each cycle so far (1 = plain decoding)
    sources: list[str]  # what proposed each cycle: "plain", "dflash", "lookup" (prompt lookup), "suffix", "grammar"
    adaptive: bool = False  # the width was chosen per cycle
    cached_tokens: int = 0  # prompt tokens restored from the prompt cache
    logprobs: Optional[list[TokenLogprob]] = None  # of `tokens`, when stream_generate was asked for them
    stop_sequence: Optional[str] = None  # the stop string that ended the text, if one did


def format_prompt(
    tokenizer: TokenizerWrapper, prompt: str, system: Optional[str] = None, chat_template: bool = True
) -> list[int]:
    """Token ids for `prompt`, wrapped in the tokenizer's chat template if it has one."""
    for text, what in ((prompt, "prompt"), (system, "system prompt")):
        if text is not None and not isinstance(text, str):
            raise TypeError(f"the {what} must be a string, got {type(text).__name__}")
        if text is not None and not _is_utf8(text):
            raise ValueError(f"the {what} is not valid UTF-8 text")
    if chat_template and tokenizer.has_chat_template:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return _chat_ids(tokenizer, messages)
    return tokenizer.encode(prompt)


class _StopText:
    """Holds back just enough text that a stop string split across cycles is caught."""

    def __init__(self, stop: Sequence[str]):
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.pending = ""

    def push(self, text: str) -> tuple[str, Optional[str]]:
        """The text safe to show, and the stop string found (the earliest), if any."""
        self.pending += text
        hits = sorted((i, s) for s in self.stop if (i := self.pending.find(s)) >= 0)
        if hits:
            at, found = hits[0]
            out, self.pending = self.pending[:at], ""
            return out, found
        cut = max(0, len(self.pending) - self.hold)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, None

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: undecodable bytes from argv or a file
        return False
    return True


def prompt_ids(tokenizer: TokenizerWrapper, prompt) -> list[int]:
    """The prompt as token ids: text is encoded, chat messages rendered (build_request checks the
    ids against the vocabulary)."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("the prompt is empty; give some text to continue")
        if not _is_utf8(prompt):
            raise ValueError("the prompt is not valid UTF-8 text; pass text or a list of token ids")
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, mx.array):
        if prompt.dtype not in (mx.int32, mx.int64, mx.uint32, mx.uint64, mx.int16, mx.uint16, mx.int8, mx.uint8):
            raise TypeError(f"a prompt array must hold integer token ids, got {prompt.dtype}")
        ids = prompt.reshape(-1).tolist()
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        ids = _chat_ids(tokenizer, list(prompt))
    elif isinstance(prompt, (list, tuple)):
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt):
            raise TypeError("a prompt list must hold integer token ids")
        ids = [int(t) for t in prompt]
    else:
        raise TypeError(f"prompt must be a string, chat messages or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise ValueError("the prompt is empty; give some text to continue")
    return ids


def _chat_ids(tokenizer: TokenizerWrapper, messages: list[dict]) -> list[int]:
    """Chat messages ([{"role": ..., "content": ...}]) through the tokenizer's chat template,
    ready for the assistant's turn."""
    bad = next(
        (m for m in messages if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str)), None
    )
    if bad is not None:
        raise ValueError(f"a chat message needs a string 'role' and 'content', got {bad!r}")
    if not tokenizer.has_chat_template:
        raise ValueError("this tokenizer has no chat template: pass text or token ids instead of chat messages")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def bounds_of(model: DFlashModel) -> Bounds:
    """What a request may ask of `model`: its vocabulary, its widest verify, its context."""
    widest = model.draft.block_size if model.draft is not None else 1
    return Bounds(model.target.vocab_size, widest, context_limit(model.target))


def make_request(
    model: DFlashModel,
    tokenizer: TokenizerWrapper,
    prompt,
    max_tokens: int = 256,
    *,
    temp: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: Optional[int] = None,
    block_size: Optional[int] = None,
    stop: Union[str, Sequence[str]] = (),
    logprobs: Optional[int] = None,
    grammar: Optional[Grammar] = None,
) -> Request:
    """A Request (its stop strings included), or a ValueError / TypeError naming what is wrong
    (decode/request.build_request: the one place a request is checked)."""
    ids = prompt_ids(tokenizer, prompt)
    options = dict(temperature=temp, top_p=top_p, top_k=top_k, seed=seed, block_size=block_size, stop=stop)
    return build_request(ids, max_tokens, bounds_of(model), **options, logprobs=logprobs, grammar=grammar)


class Responses:
    """A request's Steps as GenerationResponses: detokenized, cut at EOS, a stop string or
    max_tokens (the response that ends it has a finish_reason)."""

    def __init__(self, tokenizer: TokenizerWrapper, request: Request, stats: DecodeStats):
        self.request, self.stats = request, stats
        self.detokenizer = tokenizer.detokenizer
        self.detokenizer.reset()
        self.stop_text = _StopText(request.stop)
        self.eos = set(tokenizer.eos_token_ids)
        self.generated = 0
        self.last: Optional[GenerationResponse] = None

    def push(self, step: Step) -> GenerationResponse:
        tokens, finish = step.tokens, None
        for i, token in enumerate(tokens):
            if token in self.eos:
                if self.generated:  # a decode cycle's (the first token is the prompt pass's)
                    self.stats.keep_of_last_cycle(i)
                tokens, finish = tokens[:i], "stop"
                break
        token_logprobs = None if step.logprobs is None else step.logprobs[: len(tokens)]
        for token in tokens:
            self.detokenizer.add_token(token)
        self.generated += len(tokens)
        text, stop_found = self.stop_text.push(self.detokenizer.last_segment)
        if stop_found:
            finish = "stop"
        elif finish is None and step.spent:
            finish = "context" if self.request.ends_at_context else "length"
        if finish and not stop_found:
            self.detokenizer.finalize()
            more, stop_found = self.stop_text.push(self.detokenizer.last_segment)
            text += more if stop_found else more + self.stop_text.flush()
            finish = "stop" if stop_found else finish
        accepted = min(step.accepted, len(tokens))
        self.last = self._response(text, tokens, accepted, finish, token_logprobs, stop_found)
        return self.last

    def cut(self) -> Optional[GenerationResponse]:
        """Its ending now, as if at its max_tokens (a server draining past its deadline): no new
        text, finish_reason "length"; None before any response (nothing to end)."""
        if self.last is None:
            return None
        return replace(
            self.last, text="", tokens=[], accepted=0, logprobs=None, stop_sequence=None, finish_reason="length"
        )

    def _response(self, text, tokens, accepted, finish, token_logprobs, stop_sequence) -> GenerationResponse:
        stats = self.stats
        return GenerationResponse(
            text=text,
            tokens=tokens,
            accepted=accepted,
            prompt_tokens=len(self.request.prompt),
            prompt_tps=len(self.request.prompt) / max(stats.prompt_seconds, 1e-9),
            generation_tokens=self.generated,
            # the first token ends the prompt's time, the rest are decoding's
            generation_tps=max(self.generated - 1, 0) / max(stats.decode_seconds, 1e-9),
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=finish,
            tau=stats.tau,
            acceptance_histogram=stats.histogram,
            block_size=stats.block_size,
            widths=list(stats.widths),
            sources=list(stats.sources),
            adaptive=stats.adaptive,
            cached_tokens=stats.cached_tokens,
            logprobs=token_logprobs,
            stop_sequence=stop_sequence,
        )


def stream_generate(
    model: DFlashModel,
    tokenizer: TokenizerWrapper,
    prompt: Union[str, list[dict], list[int], mx.array],
    max_tokens: int = 256,
    *,
    prompt_cache: Optional[PromptCache] = None,
    **options,
) -> Iterator[GenerationResponse]:
    """Yield a GenerationResponse per decode cycle; the last has a finish_reason.

    Options: temp, top_p, top_k, seed, block_size, stop, logprobs, grammar (make_request).
    A seeded sampled run gives the same text whatever the verify widths (and the
    same text as `use_draft=False` with that seed): see sampling.py.  With `logprobs`
    (0-20: how many top alternatives), each response carries the target's log-probabilities
    of its tokens.  A `grammar` (grammar.Grammar, e.g. Grammar.json(tokenizer, vocab, schema))
    constrains the output."""
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    request = make_request(model, tokenizer, prompt, max_tokens, **options)
    mx.reset_peak_memory()
    stats = DecodeStats()
    steps = decode(model, request, prompt_cache, stats=stats)
    responses = Responses(tokenizer, request, stats)
    for step in steps:
        response = responses.push(step)
        if response.finish_reason:
            steps.close()
            yield response
            return
        yield response


class BatchGenerator:
    """Requests decoded together (decode.decoder.Decoder), each streamed as stream_generate streams it.

        gen = BatchGenerator(model, tokenizer, max_batch=8)
        uid = gen.insert("Hello", max_tokens=64, temp=0.7, seed=1)
        while gen.busy:
            for uid, response in gen.next():   # one batch step
                ...

    A request that finishes leaves the batch by itself; `remove(uid)` drops one early.
    `max_batch_tokens` bounds the batch's caches (rows x the longest row's prompt + max_tokens)."""

    def __init__(
        self,
        model: DFlashModel,
        tokenizer: TokenizerWrapper,
        max_batch: int = 8,
        prompt_cache: Optional[PromptCache] = None,
        max_batch_tokens: Optional[int] = None,
    ):
        for name, value in (("max_batch", max_batch), ("max_batch_tokens", max_batch_tokens)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.model = model
        self.tokenizer = tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)
        self.decoder = Decoder(model, prompt_cache, max_batch, max_batch_tokens)
        self.responses: dict[int, Responses] = {}
        self.last_step: Optional[BatchStep] = None
        self.failed: dict[int, Exception] = {}  # the last step's

    @property
    def busy(self) -> bool:
        return self.decoder.busy

    def insert(self, prompt, max_tokens: int = 256, **options) -> int:
        """Queue a request (stream_generate's arguments); its uid.  Bad arguments raise here."""
        return self.add(make_request(self.model, self.tokenizer, prompt, max_tokens, **options))

    def add(self, request: Request) -> int:
        """Queue a request built and checked already (make_request, decode/request.build_request); its uid."""
        row = self.decoder.add(request)
        self.responses[row.uid] = Responses(self.tokenizer, request, row.stats)  # a detokenizer of its own
        return row.uid

    @property
    def waiting(self) -> list[int]:
        """The uids of the requests waiting for room (not yet prefilling)."""
        return [row.uid for row in self.decoder.waiting]

    def prefill_when_idle(self, prompt: list[int]) -> None:
        """Prefill `prompt` (token ids) into the prompt cache once no request waits (a
        conversation as its next request will begin); one too long for the context is not."""
        limit = context_limit(self.model.target)
        if limit is None or len(prompt) < limit:
            self.decoder.prefill_when_idle(list(prompt))

    def remove(self, uid: int) -> None:
        self.decoder.remove(uid)
        self.responses.pop(uid, None)

    def cut(self, uid: int) -> Optional[GenerationResponse]:
        """End a request now (Responses.cut: as if at its max_tokens), keeping what it decoded;
        None when nothing of it came out yet."""
        responses = self.responses.get(uid)
        self.remove(uid)
        return None if responses is None else responses.cut()

    def close(self) -> None:
        """Done with it: the wired memory limit as it was (Decoder.close)."""
        self.decoder.close()

    def warm_up(self) -> None:
        """A throw-away request through the model, so that the first real one does not pay for
        first calls (decoder.warm_up); nothing of it is kept."""
        warm_up(self.model, self.decoder.max_batch)

    def next(self) -> list[tuple[int, GenerationResponse]]:
        """One batch step: (uid, response) of every request that committed tokens.  Requests that
        failed in it are dropped, nothing of them kept, and named in `failed` (uid -> error);
        the others go on as they would alone."""
        self.failed = {}
        try:
            self.last_step = self.decoder.step()
        except StepFailed as failure:
            self.last_step, self.failed = None, dict.fromkeys(failure.uids, failure.error)
        else:
            self.failed.update(self.last_step.failed)
        out = []
        for uid, step in self.last_step.steps.items() if self.last_step else ():
            try:
                response = self.responses[uid].push(step)
            except Exception as error:  # its text cannot be made: it fails alone
                self.decoder.discard(uid)
                self.failed[uid] = error
                continue
            out.append((uid, response))
            if response.finish_reason:
                self.remove(uid)
        for uid in self.failed:
            self.responses.pop(uid, None)
        return out

    def discard(self, uid: int) -> None:
        """Drop a request keeping nothing of it (it failed)."""
        self.decoder.discard(uid)
        self.responses.pop(uid, None)


@dataclass
class BatchResponse:
    texts: list[str]
    responses: list[GenerationResponse]  # the last of each prompt: finish_reason and statistics


def batch_generate(
    model: DFlashModel,
    tokenizer: TokenizerWrapper,
    prompts: Sequence,
    max_tokens: int = 256,
    max_batch: int = 8,
    verbose: bool = False,
    max_batch_tokens: Optional[int] = None,
    **options,
) -> BatchResponse:
    """Every prompt's generated text, decoded in batches of up to `max_batch` (in the style of
    mlx-lm's batch_generate); options as stream_generate's, for every prompt."""
    gen = BatchGenerator(model, tokenizer, max_batch, max_batch_tokens=max_batch_tokens)
    uids = [gen.insert(prompt, max_tokens, **options) for prompt in prompts]
    texts, last = {uid: "" for uid in uids}, {}
    with progress(enabled=verbose) as bar:
        task = add_task(bar, "batch", len(uids))
        try:
            while gen.busy:
                for uid, response in gen.next():
                    texts[uid] += response.text
                    last[uid] = response
                    if response.finish_reason:
                        bar.advance(task)
                if gen.failed:
                    raise next(iter(gen.failed.values()))
        finally:
            gen.close()
    return BatchResponse([texts[uid] for uid in uids], [last[uid] for uid in uids])


def generate(
    model: DFlashModel,
    tokenizer: TokenizerWrapper,
    prompt: Union[str, list[dict], list[int], mx.array],
    max_tokens: int = 256,
    verbose: bool = False,
    **kwargs,
) -> str:
    """The generated text; with verbose=True, streams it and prints statistics."""
    text = ""
    last = None
    for last in stream_generate(model, tokenizer, prompt, max_tokens, **kwargs):
        text += last.text
        if verbose:
            print(last.text, end="", flush=True)
    if verbose and last is not None:
        print()
        print(format_stats(last, model))
    return text


def format_stats(r: GenerationResponse, model: DFlashModel) -> str:
    lines = [
        "=" * 10,
        f"Prompt: {r.prompt_tokens} tokens, {r.prompt_tps:.3f} tokens-per-sec",
        f"Generation: {r.generation_tokens} tokens, {r.generation_tps:.3f} tokens-per-sec",
        f"Peak memory: {r.peak_memory:.3f} GB",
    ]
    hist = " ".join(f"{k + 1}:{n}" for k, n in enumerate(r.acceptance_histogram) if n)
    verified = f"tau {r.tau:.2f} tokens/cycle, accepted lengths {hist}"
    if model.draft is not None:
        lines.append(f"DFlash: block {r.block_size}, {verified}")
    else:
        copies = f"copies verified, {verified}" if r.adaptive else "plain target decoding"
        lines.append(f"DFlash: off ({model.draft_note or 'no drafter'}), {copies}")
    if r.adaptive and r.widths:
        kinds = {s: r.sources.count(s) for s in ("dflash", "lookup", "suffix", "grammar", "plain")}
        forced = f"{kinds['grammar']} forced by the grammar, " if kinds["grammar"] else ""
        lines.append(
            f"Adaptive: mean width {sum(r.widths) / len(r.widths):.1f}; cycles: {kinds['dflash']} drafted, "
            f"{kinds['lookup']} prompt lookup, {kinds['suffix']} copied from earlier answers, {forced}"
            f"{kinds['plain']} plain (predicted fastest there)"
        )
    return "\n".join(lines)
