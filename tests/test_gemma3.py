"""The real Gemma 3 270M (base model, sliding-window attention on five layers of six): its
tokenizer against the GGUF's vocabulary, its 8-bit variant against float32, greedy DFlash equal
to plain mlx-lm greedy decoding with prompts shorter and far longer than the window, and the
prompt lookup serving it alone (it ships no drafter)."""

import sysconfig
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

from dflash_mlx.convert.gemma3 import GEMMA3
from dflash_mlx.decode.costs import CostModel
from dflash_mlx.decode.decoder import decode
from dflash_mlx.decode.learning import Learning, keep
from dflash_mlx.decode.model import DecodeStats, DFlashModel
from dflash_mlx.decode.plan import Planner
from dflash_mlx.decode.request import Request
from dflash_mlx.decode.suffix import SuffixStore
from dflash_mlx.sampling import SamplingParams
from dflash_mlx.target.wrapper import Target
from tiny_models import Clock, Timed, oracle_draft, random_draft

pytestmark = pytest.mark.slow  # a 270M model, prompts up to 24k tokens

LAYERS = (1, 5, 9, 13, 16)
MAX_TOKENS = 24
MIXED = "def f(x):\n    return x  +  1   # spaces\n\n\tTabs, ünïcödé, 世界, emoji 🙂, <b>html</b> 3.14159"


@pytest.fixture(scope="module")
def gemma3(gemma3_dir):
    return mlx_lm.load(str(gemma3_dir))


@pytest.fixture(scope="module")
def target(gemma3):
    return Target(gemma3[0])


def stdlib_text(tokenizer, tokens: int) -> list[int]:
    """`tokens` ids of Python standard-library source (a BOS first): a long, deterministic prompt."""
    root = Path(sysconfig.get_paths()["stdlib"])
    text = ""
    for name in ("argparse.py", "textwrap.py", "difflib.py", "inspect.py", "typing.py", "pathlib.py"):
        text += (root / name).read_text()
        ids = tokenizer.encode(text)
        if len(ids) >= tokens:
            return ids[:tokens]
    raise AssertionError("not enough standard-library text")


def test_tokenizer_round_trips_and_matches_the_gguf_vocabulary(gemma3):
    import gguf

    _, tokenizer = gemma3
    ids = tokenizer.encode(MIXED)
    assert ids[0] == tokenizer.bos_token_id == 2 and ids.count(2) == 1
    assert tokenizer.decode(ids[1:]) == MIXED
    reader = gguf.GGUFReader(str(GEMMA3.gguf(show_progress=False)))
    vocab = reader.fields["tokenizer.ggml.tokens"].contents()
    for text, pieces in [
        ("Hello world", ["Hello", "▁world"]),
        ("<start_of_turn>user\n", ["<start_of_turn>", "user", "\n"]),
        ("x<end_of_turn>", ["x", "<end_of_turn>"]),
    ]:
        assert [vocab[i] for i in tokenizer.encode(text, add_special_tokens=False)] == pieces
    spaces = tokenizer.encode("a    b", add_special_tokens=False)
    assert len(spaces) == 3 and vocab[spaces[1]] in ("▁▁▁▁", "    ")  # a run of spaces is one token


@pytest.mark.long  # converts and runs the 8-bit variant: MLX's quantized matmuls are slow on a CPU
def test_answers_sensibly_and_8bit_agrees(gemma3, tmp_path):
    model, tokenizer = gemma3
    prompt = tokenizer.encode("def fibonacci(n):\n   ")
    greedy = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=16)]
    assert "return" in tokenizer.decode(greedy)  # a base model: it continues the code
    q8, _ = mlx_lm.load(str(GEMMA3.path("q8", show_progress=False)))
    ids = mx.array([stdlib_text(tokenizer, 600)])  # past the 512-token window

    def last_logits(m):  # the 262k-row head only at the last 64 positions: quantized matmuls are slow here
        return m.model.embed_tokens.as_linear(m.model(ids)[:, -64:])[0].astype(mx.float32)

    # 0.89 measured (57 of 64): the 8-bit variant also computes in bfloat16; a broken one agrees nowhere
    agree = (last_logits(model).argmax(-1) == last_logits(q8).argmax(-1)).mean().item()
    assert agree > 0.8, agree


def plain(target, prompt, max_tokens):
    return [int(t) for t, _ in generate_step(mx.array(prompt), target.model, max_tokens=max_tokens)]


def dflash(target, draft, prompt, max_tokens=MAX_TOKENS):
    stats = DecodeStats()
    request = Request(list(prompt), max_tokens, SamplingParams())
    out = [t for s in decode(DFlashModel(target, draft), request, stats=stats) for t in s.tokens]
    return out, stats


@pytest.mark.parametrize("length", [1024, 8192, pytest.param(24576, marks=pytest.mark.long)])
def test_dflash_equals_plain_greedy_at_long_context(gemma3, target, length):
    """An oracle drafter right except at chosen positions (full and partial acceptance: the
    sliding-window layers' rotating caches are rolled back after they wrapped), and at 1k a
    random one (nearly every draft rejected)."""
    prompt = stdlib_text(gemma3[1], length)
    reference = plain(target, prompt, MAX_TOKENS + 16)
    wrong = {length + 3, length + 4, length + 11}
    oracle = oracle_draft(target, prompt + reference, wrong=wrong, layer_ids=LAYERS, block_size=8)
    out, stats = dflash(target, oracle, prompt)
    assert out == reference[:MAX_TOKENS]
    assert stats.tau > 2
    if length == 1024:
        assert dflash(target, random_draft(target, layer_ids=LAYERS, block_size=4), prompt)[0] == reference[:MAX_TOKENS]


def test_the_prompt_lookup_serves_it_without_a_drafter(gemma3, target):
    """It ships no drafter: copies from the prompt (and earlier answers) propose alone, planned
    over a cost curve on which they pay (an injected clock, so the plan does not depend on this
    machine's load).  A code file whose opening is written again past the 512-token window: the
    base model copies the file on, the copies are accepted, and the output is plain greedy's."""
    cost = CostModel([1, 2, 4, 8, 16], [0.05, 0.055, 0.06, 0.07, 0.09], 0.0)
    text = stdlib_text(gemma3[1], 700)
    prompt = text + text[1:48]  # the file's opening again (no second BOS)
    reference = plain(target, prompt, 64)
    model = DFlashModel(Timed(target, Clock(cost)))
    keep(model, Learning(Planner(cost, 16), SuffixStore()))
    stats = DecodeStats()
    out = [t for s in decode(model, Request(prompt, 64), clock=model.target.clock, stats=stats) for t in s.tokens]
    assert out == reference
    lookups = [n for n, source in zip(stats.accepted_lengths, stats.sources) if source == "lookup"]
    assert "dflash" not in stats.sources and sum(n - 1 for n in lookups) >= 16  # copied tokens accepted
