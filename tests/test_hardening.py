"""The edge of the product: every bad input is one clear line (CLI) or a ValueError /
TypeError naming the argument (API); files are written all-or-nothing; seeded
sampling does not depend on timing."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from typer.testing import CliRunner

from dflash_mlx import generate, load, stream_generate
from dflash_mlx.cli import app
from dflash_mlx.convert.models import convert_target
from dflash_mlx.io.storage import staged

runner = CliRunner()
REPO = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def tiny_pair(tiny_dirs):
    model_dir, draft_dir = tiny_dirs
    return load(str(model_dir), str(draft_dir), adaptive=False)


def one_error_line(result) -> str:
    assert result.exit_code != 0, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    assert "Traceback" not in result.output + result.stderr
    return errors[0]


def cli_cases(tiny_dirs, tmp_path):
    model, draft = map(str, tiny_dirs)
    readonly = tmp_path / "not-a-folder"  # a file: nothing can be written under it, not even as root
    readonly.write_text("")
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in Path(model).iterdir():
        (broken / f.name).write_bytes(f.read_bytes()[:100] if f.suffix == ".safetensors" else f.read_bytes())
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    for f in Path(model).iterdir():
        if not f.name.startswith("tokenizer"):
            (no_tokenizer / f.name).write_bytes(f.read_bytes())
    short_config = tmp_path / "short-config"
    short_config.mkdir()
    for f in Path(model).iterdir():
        data = f.read_bytes()
        if f.name == "config.json":
            config = json.loads(data)
            del config["hidden_size"]
            data = json.dumps(config).encode()
        (short_config / f.name).write_bytes(data)
    gen = ["generate", "--model", model, "--draft", draft, "--prompt", "hi"]
    data = str(REPO / "data" / "smollm2-135m")
    return [
        # generate: numbers
        (gen + ["--temp", "nan"], "temp must be finite"),
        (gen + ["--temp", "-1"], "--temp must be >= 0"),
        (gen + ["--top-p", "0"], "top-p"),
        (gen + ["--top-k", "-3"], "top-k"),
        (gen + ["--max-tokens", "0"], "--max-tokens"),
        (gen + ["--block-size", "9"], "between 1 and 4"),
        (gen + ["--block-size", "0"], "--block-size"),
        (["generate", "--model", "Qwen9-Imaginary", "--prompt", "hi"], "unknown model 'Qwen9-Imaginary'"),
        (gen + ["--max-tokens", "100000"], "context"),
        (gen + ["--distributed", "pipeline"], "start it with mlx.launch"),
        (gen + ["--distributed", "ring"], "--distributed must be 'pipeline'"),
        (gen + ["--split", "1,1"], "--split and --timeout go with --distributed"),
        (gen + ["--distributed", "pipeline", "--timeout", "0"], "--timeout must be > 0"),
        (["serve", "--model", model, "--distributed", "pipeline"], "start it with mlx.launch"),
        (["serve", "--model", model, "--max-batch-tokens", "0"], "--max-batch-tokens must be >= 1"),
        # generate: text and paths
        (["generate", "--model", model, "--prompt", "  "], "prompt is empty"),
        (["generate", "--model", model, "--prompt", b"caf\xe9".decode("utf-8", "surrogateescape")], "UTF-8"),
        (["generate", "--model", model, "--draft", "./nowhere", "--prompt", "hi"], "no directory at ./nowhere"),
        (["generate", "--model", str(broken), "--prompt", "hi"], "re-download or re-convert"),
        (["generate", "--model", str(no_tokenizer), "--prompt", "hi"], "no tokenizer (tokenizer.json)"),
        (["generate", "--model", str(short_config), "--prompt", "hi"], "cannot load the model"),
        # convert
        (["convert", "draft", draft, str(readonly / "out")], "cannot write the output folder"),
        (["convert", "draft", draft, str(tmp_path / "q"), "--q-bits", "3"], "--q-bits"),
        (["convert", "target", str(tmp_path / "missing.gguf"), str(tmp_path / "t")], "missing.gguf"),
        # train
        (
            ["train", "make-data", "--model", model, "--out", str(readonly / "d"), "--prompts", "builtin"],
            "cannot write the data folder",
        ),
        (["train", "make-data", "--model", model, "--out", str(tmp_path / "d"), "--budget", "-5"], "--budget"),
        (["train", "fit", "--model", model, "--data", data, "--out", str(tmp_path / "f"), "--lr", "-1"], "lr must be"),
        (["train", "fit", "--model", model, "--data", data, "--out", str(tmp_path / "f"), "--lr", "nan"], "lr must be"),
        (
            [
                "train",
                "fit",
                "--model",
                model,
                "--data",
                data,
                "--out",
                str(tmp_path / "f"),
                "--sequences-per-step",
                "0",
            ],
            "sequences per step",
        ),
        (["train", "fit", "--model", model, "--data", data, "--out", str(readonly / "f")], "cannot write"),
        (
            [
                "train",
                "fit",
                "--model",
                model,
                "--data",
                data,
                "--out",
                str(tmp_path / "f"),
                "--target-layer-ids",
                "1,x",
            ],
            "comma-separated integers",
        ),
        (
            [
                "train",
                "fit",
                "--model",
                model,
                "--data",
                data,
                "--out",
                str(tmp_path / "f"),
                "--block-widths",
                "2,four",
            ],
            "--block-widths takes widths like",
        ),
        (
            ["train", "fit", "--model", model, "--data", data, "--out", str(tmp_path / "f"), "--block-widths", "1-4"],
            "block widths must be in 2..16",
        ),
        (["train", "fit", "--model", model, "--data", data, "--out", str(tmp_path / "f")], "different target"),
        # bench
        (["bench", "--model", model, "--draft", draft, "--out", str(readonly / "b")], "cannot write the results"),
        (["bench", "--model", model, "--draft", draft, "--modes", "fast"], "--modes"),
        (["bench", "--model", model, "--draft", draft, "-n", "0"], "--prompts-per-set"),
    ]


def test_every_bad_cli_input_is_one_line_and_leaves_nothing(tiny_dirs, tmp_path):
    before = set(tmp_path.rglob("*"))
    cases = cli_cases(tiny_dirs, tmp_path)
    made = set(tmp_path.rglob("*")) - before
    for args, message in cases:
        line = one_error_line(runner.invoke(app, args))
        assert message in line, (args, line)
    left = set(tmp_path.rglob("*")) - before - made
    assert not left, sorted(map(str, left))[:5]


def test_an_unwritable_cache_and_bad_stdin_are_one_line(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(blocked / "cache"))
    line = one_error_line(runner.invoke(app, ["generate", "--prompt", "hi"]))
    assert "cannot write the cache folder" in line and "DFLASH_MLX_CACHE" in line
    monkeypatch.delenv("DFLASH_MLX_CACHE")
    line = one_error_line(runner.invoke(app, ["generate", "--prompt", "-"], input=b"caf\xe9 \xff"))
    assert "not valid UTF-8" in line


def test_every_bad_api_argument_names_itself(tiny_pair):
    model, tokenizer = tiny_pair
    vocab = model.target.vocab_size
    cases = [
        (dict(prompt=[1, vocab + 5]), ValueError, "outside the vocabulary"),
        (dict(prompt=[-1, 2]), ValueError, "outside the vocabulary"),
        (dict(prompt=12), TypeError, "prompt must be"),
        (dict(prompt=b"hello"), TypeError, "prompt must be"),
        (dict(prompt=[1.5, 2.0]), TypeError, "token ids"),
        (dict(prompt=mx.array([0.5])), TypeError, "integer token ids"),
        (dict(prompt=[]), ValueError, "prompt is empty"),
        (dict(prompt="caf\udce9"), ValueError, "UTF-8"),
        (dict(prompt="hi", temp=float("nan")), ValueError, "temp"),
        (dict(prompt="hi", top_p=float("inf")), ValueError, "top_p"),
        (dict(prompt="hi", temp="0.5"), TypeError, "temp"),
        (dict(prompt="hi", seed=1.5), TypeError, "seed"),
        (dict(prompt="hi", max_tokens=0), ValueError, "max_tokens"),
        (dict(prompt="hi", max_tokens=2.5), TypeError, "max_tokens"),
        (dict(prompt="hi", block_size=5), ValueError, "block_size"),
        (dict(prompt="hi", stop=[1]), TypeError, "stop"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            generate(model, tokenizer, max_tokens=kwargs.pop("max_tokens", 4), **kwargs)


def test_other_api_entry_points_name_their_bad_arguments(tiny_pair, tmp_path):
    from dflash_mlx.bench.harness import run_bench
    from dflash_mlx.convert.models import convert_draft
    from dflash_mlx.train.config import TrainConfig

    model, tokenizer = tiny_pair
    cases = [
        (lambda: convert_draft("x", tmp_path / "o", q_bits=3), ValueError, "q-bits"),
        (lambda: convert_draft("x", tmp_path / "o", dtype="float16"), ValueError, "dtype"),
        (lambda: convert_target(str(tmp_path / "m.gguf"), tmp_path / "o", q_group_size=7), ValueError, "group"),
        (lambda: TrainConfig(lr=float("nan")), ValueError, "lr"),
        (lambda: TrainConfig(sequences_per_step=0), ValueError, "sequences per step"),
        (lambda: TrainConfig(text_fraction=1.5), ValueError, "text_fraction|text fraction"),
        (lambda: run_bench(model, tokenizer, ["nope"], 2, 8, ["greedy"], tmp_path / "b"), ValueError, "nope"),
        (
            lambda: run_bench(model, tokenizer, ["gsm8k"], 0, 8, ["greedy"], tmp_path / "b"),
            ValueError,
            "prompts_per_set",
        ),
        (lambda: run_bench(model, tokenizer, ["gsm8k"], 2, 8, ["fast"], tmp_path / "b"), ValueError, "modes"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
    assert list(tmp_path.iterdir()) == []


def test_fixed_width_stats_do_not_claim_adaptivity(tiny_dirs):
    from dflash_mlx.api import format_stats
    from dflash_mlx.decode.learning import kept

    model_dir, draft_dir = tiny_dirs
    model, tokenizer = load(str(model_dir), str(draft_dir))
    assert kept(model).planner is not None
    fixed = list(stream_generate(model, tokenizer, "hello", max_tokens=10, block_size=3))[-1]
    assert "Adaptive:" not in format_stats(fixed, model)
    adaptive = list(stream_generate(model, tokenizer, "hello", max_tokens=10))[-1]
    assert "Adaptive:" in format_stats(adaptive, model)


def test_stop_may_be_a_single_string(tiny_pair):
    model, tokenizer = tiny_pair
    full = generate(model, tokenizer, "hello world", max_tokens=24)
    assert len(full) > 4
    stop = full[3:5]
    cut = generate(model, tokenizer, "hello world", max_tokens=24, stop=stop)
    assert cut == full[: full.find(stop)]


def test_seeds_of_any_size_are_reproducible(tiny_pair):
    model, tokenizer = tiny_pair
    for seed in (0, -7, 2**70):
        runs = [generate(model, tokenizer, "hello", max_tokens=12, temp=0.9, seed=seed) for _ in range(2)]
        assert runs[0] == runs[1]


def test_seeded_sampling_ignores_timing_in_the_adaptive_mode(tiny_dirs, monkeypatch):
    """Same seed, default adaptive width, the cycle clock perturbed differently on each
    run (so the planner picks different widths): the same text."""
    from dflash_mlx.decode import decoder as engine
    from dflash_mlx.decode.costs import CostModel
    from dflash_mlx.decode.learning import Learning, keep
    from dflash_mlx.decode.plan import Planner

    model_dir, draft_dir = tiny_dirs
    model, tokenizer = load(str(model_dir), str(draft_dir), adaptive=False)
    real = time.perf_counter
    texts, widths = [], []
    for run in range(4):
        rng = random.Random(run)
        monkeypatch.setattr(engine.time, "perf_counter", lambda: real() + rng.random() * 0.05)
        # a cost curve on which drafting and plain decoding are close, so timing noise moves the choice
        keep(model, Learning(Planner(CostModel([1, 2, 4], [0.010, 0.012, 0.016], 0.003, 0.0005, 0.0002, 0.0004), 4)))
        last = None
        text = ""
        for last in stream_generate(model, tokenizer, "tell me a story", max_tokens=40, temp=0.8, top_p=0.95, seed=3):
            text += last.text
        texts.append(text)
        widths.append(tuple(last.widths))
    assert len(set(texts)) == 1
    assert len(set(widths)) > 1  # the perturbation did change the widths
    plain, _ = load(str(model_dir), use_draft=False, adaptive=False)
    assert generate(plain, tokenizer, "tell me a story", max_tokens=40, temp=0.8, top_p=0.95, seed=3) == texts[0]


def test_prompt_fuzz_never_crashes(tiny_pair):
    model, tokenizer = tiny_pair
    rng = random.Random(0)
    vocab = model.target.vocab_size
    for i in range(40):
        kind = i % 4
        if kind == 0:
            prompt = bytes(rng.randrange(256) for _ in range(rng.randint(0, 40))).decode("utf-8", "surrogateescape")
        elif kind == 1:
            prompt = [rng.randrange(-5, vocab + 5) for _ in range(rng.randint(0, 12))]
        elif kind == 2:
            prompt = "".join(chr(rng.randrange(0x20, 0x2FFF)) for _ in range(rng.randint(1, 30)))
        else:
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        try:
            out = generate(model, tokenizer, prompt, max_tokens=6, temp=rng.choice([0.0, 1.0]), seed=i)
            assert isinstance(out, str)
        except (ValueError, TypeError) as e:
            assert "\n" not in str(e) and str(e)


def test_corrupt_cost_cache_is_measured_again(tiny_dirs, tmp_path, monkeypatch, capsys):
    from dflash_mlx.decode.costs import cached_costs

    calls = []

    def measure():
        calls.append(1)
        from dflash_mlx.decode.costs import CostModel

        return CostModel([1, 2], [0.01, 0.02], 0.001)

    first = cached_costs("k", measure, tmp_path)
    stored = next((tmp_path / "costs").glob("*.json"))
    for junk in ('{"widths": [1, 2], "sec', '{"foo": 1}', '{"widths": "x", "seconds": [], "draft_seconds": 1}'):
        stored.write_text(junk)
        again = cached_costs("k", measure, tmp_path)
        assert again == first
        assert json.loads(stored.read_text())["widths"] == [1, 2]
    assert len(calls) == 4
    assert "measuring again" in " ".join(capsys.readouterr().err.split())


def test_empty_cache_variable_means_the_default(monkeypatch):
    from dflash_mlx.io.storage import cache_dir

    monkeypatch.setenv("DFLASH_MLX_CACHE", "")
    assert cache_dir() == Path.home() / ".cache" / "dflash-mlx"


def test_a_failed_staged_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with staged(tmp_path / "out", force=False) as staging:
            (staging / "half").write_text("x")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


WRITER = """
import sys, time
sys.path.insert(0, {tests!r})
import dflash_mlx
from pathlib import Path
from dflash_mlx.io.storage import staged
with staged(Path({out!r}), force=False) as staging:
    (staging / "big").write_bytes(b"x" * 1000)
    print("staging", flush=True)
    time.sleep(60)
"""


def test_sigterm_during_a_staged_write_leaves_nothing(tmp_path):
    script = WRITER.format(tests=str(Path(__file__).parent), out=str(tmp_path / "out"))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "staging"
    assert any(tmp_path.iterdir())
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert list(tmp_path.iterdir()) == []


def test_stale_staging_dirs_of_dead_writers_are_swept(tmp_path):
    script = WRITER.format(tests=str(Path(__file__).parent), out=str(tmp_path / "out"))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "staging"
    proc.kill()  # SIGKILL: no cleanup possible
    proc.wait(timeout=30)
    assert any(p.name.startswith(".out.") for p in tmp_path.iterdir())
    with staged(tmp_path / "out", force=False) as staging:
        (staging / "done").write_text("ok")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


FIRST_USE = """
import sys
import dflash_mlx
from dflash_mlx.convert.smollm2 import smollm2_path
print(smollm2_path(show_progress=False))
"""


@pytest.mark.slow
def test_two_first_uses_of_the_default_model_at_once(tmp_path, smollm2_dir):
    """Two processes on an empty cache: both succeed, one waits for the other's conversion."""
    gguf = Path(smollm2_dir).parent.parent / "gguf"
    env = {**os.environ, "DFLASH_MLX_CACHE": str(tmp_path)}
    (tmp_path / "gguf").mkdir()
    for f in gguf.glob("*.gguf"):  # the download is cached; the conversion is what races
        (tmp_path / "gguf" / f.name).symlink_to(f)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", FIRST_USE], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-500:] for o in outs]
    model_dir = Path(outs[0][0].strip().splitlines()[-1])
    assert (model_dir / "config.json").is_file()
    assert not [p for p in model_dir.parent.iterdir() if p.name.startswith(f".{model_dir.name}.") and p.is_dir()]
    model, _ = load(str(model_dir), use_draft=False, adaptive=False)
    assert model.target.num_layers == 30


def test_import_order_is_reported():
    """mlx imported before dflash_mlx: the slow BLAS is named, with the fix, once."""
    script = (
        "import mlx.core\nimport warnings\nwarnings.simplefilter('always')\nimport dflash_mlx\n"
        "from dflash_mlx.io import blas\nprint(blas.status())"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0
    if not Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3").exists():
        pytest.skip("no OpenBLAS on this machine: nothing to report")
    assert "import dflash_mlx before mlx" in result.stderr
    assert "mlx was imported before dflash_mlx" in result.stdout


def test_missing_openblas_is_said_once_in_one_line(tiny_dirs, monkeypatch, capsys):
    """A plain `pip install` on Linux runs fp32 on the reference BLAS: say so, once, with the fix."""
    from dflash_mlx.api import loading as api
    from dflash_mlx.io import blas

    model_dir, _ = tiny_dirs
    monkeypatch.setattr(blas, "_status", "not found (apt install libopenblas0-pthread for ~10x faster fp32)")
    monkeypatch.setattr(api, "_said", set())
    load(str(model_dir), use_draft=False, adaptive=False)
    load(str(model_dir), use_draft=False, adaptive=False)
    lines = [line for line in capsys.readouterr().err.splitlines() if "reference BLAS" in line]
    assert len(lines) == 1 and "apt install libopenblas0-pthread" in lines[0]
    monkeypatch.setattr(blas, "_status", "OpenBLAS (/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3)")
    monkeypatch.setattr(api, "_said", set())
    load(str(model_dir), use_draft=False, adaptive=False)
    assert "reference BLAS" not in capsys.readouterr().err


def test_the_acceptance_histogram_counts_only_the_answers_tokens(tiny_dirs):
    """A cycle that committed a block with EOS inside counts the tokens before EOS only (and a
    cycle that committed EOS first not at all): the histogram adds up to the answer's length."""
    from dflash_mlx import load
    from dflash_mlx.api.generation import Responses
    from dflash_mlx.decode.model import DecodeStats, Step
    from dflash_mlx.decode.request import Request

    _, tokenizer = load(str(tiny_dirs[0]), use_draft=False, adaptive=False)
    eos = next(iter(tokenizer.eos_token_ids))
    word = next(t for t in range(100, 1000) if t not in tokenizer.eos_token_ids)
    for block, eos_at, histogram in (([word] * 16, 11, [0] * 10 + [1] + [0] * 5), ([word] * 4, 0, [0] * 16)):
        stats = DecodeStats(block_size=16)
        responses = Responses(tokenizer, Request([1, 2, 3], 100), stats)
        responses.push(Step([word], 0))  # the prompt's pass: not a cycle
        stats.accepted_lengths.append(len(block))
        stats.widths.append(16)
        stats.sources.append("dflash")
        stats.drafter_widths.append(16)
        block[eos_at] = eos
        last = responses.push(Step(block, len(block) - 1))
        assert last.finish_reason == "stop" and last.generation_tokens == 1 + eos_at
        assert last.acceptance_histogram == histogram
        assert 1 + sum(k * n for k, n in enumerate(last.acceptance_histogram, start=1)) == last.generation_tokens
        assert stats.cycles == len(stats.widths) == len(stats.sources) == len(stats.drafter_widths)
