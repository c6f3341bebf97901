"""Kernels that prove themselves (kernels/metal.py): with the "Metal available" branch forced and
failures injected into the launch (run_metal raising, returning wrong values, or slow), each case
falls back to the MLX twin with exactly one log line, returns exactly the twin's output, and the
decision is remembered, in memory and on disk for a later process."""

import json
import logging
import time

import mlx.core as mx
import pytest

from dflash_mlx.kernels import metal as kernels
from test_engine import dflash_greedy, plain_greedy
from tiny_models import oracle_draft, tiny_target

LOGGER = "dflash_mlx.kernels"
REAL_USE_METAL = kernels.use_metal  # before any test forces the Metal branch


@pytest.fixture
def metal_here(monkeypatch, tmp_path, caplog):
    """The Metal branch taken, the decisions kept in a fresh cache, every kernel log line caught,
    and the launches counted (a test replaces `launch` to inject a fault)."""
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path))
    monkeypatch.delenv("DFLASH_MLX_KERNELS", raising=False)
    monkeypatch.setattr(kernels, "use_metal", lambda: True)
    monkeypatch.setattr(kernels, "choices", kernels.KernelChoices())
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    launches = []

    def inject(fault):
        def run(launch):
            launches.append(launch.kernel)
            return fault(launch)

        monkeypatch.setattr(kernels, "run_metal", run)

    inject.launches = launches
    return inject


def log_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def attention(L=4, context=40, seed=0):
    mx.random.seed(seed)
    q, k, v = (mx.random.normal((1, h, L, 64)) for h in (4, 2, 2))
    ck, cv = (mx.random.normal((1, 2, context + 8, 64)) for _ in range(2))
    return q, k, v, kernels.ContextSpan(ck, cv, 3, context)


def tape(T=8, seed=0):
    mx.random.seed(seed)
    q, k = (mx.random.normal((1, T, 2, 64)) * 0.125 for _ in range(2))
    v = mx.random.normal((1, T, 4, 32))
    g, beta = mx.random.uniform(0.3, 1.0, (1, T, 4)), mx.random.uniform(0.0, 1.0, (1, T, 4))
    return q, k, v, g, beta, mx.random.normal((1, 4, 32, 64))


def attend(inputs):
    q, k, v, span = inputs
    return kernels.block_attention(q, k, v, span, scale=0.125)


def twin_attention(inputs):
    q, k, v, span = inputs
    return kernels.block_attention_mlx(q, k, v, span, scale=0.125)


def equal(a, b) -> bool:
    return all(mx.array_equal(x, y).item() for x, y in zip(a, b))


def raising(launch):
    raise RuntimeError("[metal_kernel] No Metal back-end.\nmore detail")


def zeros(launch):
    return launch.results([mx.zeros(shape, dtype) for shape, dtype in launch.outputs.values()])


def sleeping_then(outputs, seconds=0.02):
    def run(launch):
        time.sleep(seconds)
        return outputs

    return run


def test_a_kernel_that_fails_hands_over_to_its_twin_for_the_process(metal_here, caplog):
    metal_here(raising)
    first = attention()
    assert mx.array_equal(attend(first), twin_attention(first)).item()
    other = attention(L=16, context=900, seed=1)  # another shape class: not tried again
    assert mx.array_equal(attend(other), twin_attention(other)).item()
    assert metal_here.launches == ["block_attention"]
    (line,) = log_lines(caplog)
    assert line == (
        "dflash-mlx: block_attention: the MLX twin runs for the rest of this process: "
        "the kernel failed (RuntimeError: [metal_kernel] No Metal back-end.)"
    )
    assert caplog.records[0].levelno == logging.WARNING
    assert "block_attention" in kernels.choices.failed


def test_the_real_launch_here_fails_and_is_caught(monkeypatch, tmp_path, caplog):
    """No injection: on this machine mx.fast.metal_kernel has no Metal back-end to run on."""
    if mx.metal.is_available():
        pytest.skip("Metal is here: the real kernel runs")
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path))
    monkeypatch.delenv("DFLASH_MLX_KERNELS", raising=False)
    monkeypatch.setattr(kernels, "use_metal", lambda: True)
    monkeypatch.setattr(kernels, "choices", kernels.KernelChoices())
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    inputs = tape()
    assert equal(kernels.gated_delta_tape(*inputs), kernels.gated_delta_tape_mlx(*inputs))
    assert equal(kernels.gated_delta_tape(*inputs), kernels.gated_delta_tape_mlx(*inputs))
    (line,) = log_lines(caplog)
    assert "gated_delta_tape: the MLX twin runs for the rest of this process: the kernel failed" in line


def test_a_kernel_that_disagrees_is_not_used_and_says_by_how_much(metal_here, caplog):
    metal_here(zeros)
    inputs = attention()
    out = attend(inputs)
    assert mx.array_equal(out, twin_attention(inputs)).item()
    (line,) = log_lines(caplog)
    shape_class = "HQ=4 HKV=2 D=64 float32 bidirectional B<=1 L<=4 context<=256"
    assert line.startswith(
        f"dflash-mlx: block_attention [{shape_class}]: the MLX twin runs: its out (float32) disagrees"
    )
    assert "max rel. error 1.0e+00 > 1.0e-04" in line and caplog.records[0].levelno == logging.WARNING
    attend(attention(L=3, context=100, seed=2))  # same class: decided, not run again
    assert metal_here.launches == ["block_attention"]
    assert kernels.choices.get("block_attention", shape_class).verdict == "disagrees"


def test_a_slower_kernel_is_not_used_and_both_times_are_said(metal_here, caplog):
    inputs = tape()
    want = kernels.gated_delta_tape_mlx(*inputs)
    metal_here(sleeping_then(list(want)))
    assert equal(kernels.gated_delta_tape(*inputs), want)
    (line,) = log_lines(caplog)
    assert "[HK=2 HV=4 DK=64 DV=32 float32 B<=1 T<=8]: the MLX twin runs: it is not 5% faster (" in line
    assert " ms vs " in line and " ms for the twin, 8 calls an evaluation)" in line
    assert caplog.records[0].levelno == logging.INFO
    decision = kernels.choices.get("gated_delta_tape", kernels.tape_class(*inputs[:3]))
    assert decision.kernel_ms > decision.twin_ms and decision.kernel_ms >= 20
    timed = kernels.SELF_CHECK_REPEATS * kernels.CALLS_PER_TIMING
    assert len(metal_here.launches) == 1 + timed  # warm-up, then timed
    kernels.gated_delta_tape(*tape(T=5, seed=3))  # same class (T<=8): the twin, no timing again
    assert len(metal_here.launches) == 1 + timed and len(log_lines(caplog)) == 1


def test_a_kernel_that_agrees_and_is_faster_is_used(metal_here, caplog, monkeypatch):
    inputs = tape()
    want = [mx.array(x) for x in kernels.gated_delta_tape_mlx(*inputs)]
    mx.eval(want)
    metal_here(lambda launch: want)  # instant and right
    out = kernels.gated_delta_tape(*inputs)
    assert equal(out, want)
    assert kernels.choices.get("gated_delta_tape", kernels.tape_class(*inputs[:3])).use_kernel
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]  # nothing to say at INFO and above
    twins = []
    monkeypatch.setattr(kernels, "gated_delta_tape_mlx", lambda *a: twins.append(1))
    kernels.gated_delta_tape(*inputs)  # proven: the kernel alone, once
    assert not twins and len(metal_here.launches) == 2 + kernels.SELF_CHECK_REPEATS * kernels.CALLS_PER_TIMING


def test_a_proven_kernel_that_fails_later_hands_over_once(metal_here, caplog):
    inputs = tape()
    want = list(kernels.gated_delta_tape_mlx(*inputs))
    mx.eval(want)
    metal_here(lambda launch: want)
    kernels.gated_delta_tape(*inputs)
    metal_here(raising)
    assert equal(kernels.gated_delta_tape(*inputs), want)
    assert equal(kernels.gated_delta_tape(*inputs), want)
    failures = [line for line in log_lines(caplog) if "the kernel failed" in line]
    assert len(failures) == 1 and "rest of this process" in failures[0]


def test_a_later_process_skips_the_timing(metal_here, caplog, tmp_path):
    """The decisions are kept beside the cost curves, in a file named by chip, MLX version and
    kernel sources: a new process (a new KernelChoices) takes them without running anything."""
    metal_here(zeros)
    inputs = attention()
    attend(inputs)
    path = kernels.choices.path
    assert path.parent == tmp_path / "costs" and path.is_file()
    assert mx.__version__ in path.name and kernels.sources_hash() in path.name and kernels.os_version() in path.name
    stored = json.loads(path.read_text())["decisions"]["block_attention"]
    assert [d["verdict"] for d in stored.values()] == ["disagrees"]
    later = kernels.KernelChoices()
    kernels.choices = later  # the monkeypatched attribute: restored after the test
    caplog.clear()
    assert mx.array_equal(attend(inputs), twin_attention(inputs)).item()
    assert metal_here.launches == ["block_attention"] and not log_lines(caplog)
    assert later.get("block_attention", next(iter(stored))).verdict == "disagrees"


def test_a_garbled_decisions_file_is_checked_again(metal_here, caplog):
    kernels.choices.path.parent.mkdir(parents=True)
    kernels.choices.path.write_text('{"decisions": {"block_attention": ')
    metal_here(zeros)
    attend(attention())
    assert len(log_lines(caplog)) == 1 and "disagrees" in log_lines(caplog)[0]
    assert json.loads(kernels.choices.path.read_text())["decisions"]["block_attention"]


def test_a_cache_that_cannot_be_written_costs_one_line(metal_here, caplog, monkeypatch, tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(blocked))
    monkeypatch.setattr(kernels, "choices", kernels.KernelChoices())
    kernels._say_once.cache_clear()
    metal_here(zeros)
    attend(attention())
    attend(attention(L=16, context=700, seed=1))
    notes = [line for line in log_lines(caplog) if "could not keep the kernel self-checks" in line]
    assert len(notes) == 1
    assert len([line for line in log_lines(caplog) if "disagrees" in line]) == 2  # one per class


def test_shape_classes(metal_here):
    """Widths and contexts share a decision within a power of two; heads, dims, dtype and masking
    never do; a window caps the context a row sees."""
    q, k, v, span = attention(L=5, context=600)
    assert kernels.attention_class(q, k, span, False, None).endswith("L<=8 context<=1024")
    assert kernels.attention_class(q, k, span, True, 100).endswith("causal windowed B<=1 L<=8 context<=256")
    assert kernels.attention_class(q, k, None, False, None).endswith("context<=256")
    assert [kernels.size_class(n) for n in (1, 2, 3, 4, 5, 16, 17)] == [1, 2, 4, 4, 8, 16, 32]


def test_the_environment_escapes_stay(metal_here, monkeypatch):
    """DFLASH_MLX_KERNELS=metal runs the kernel unchecked (no twin, no timing); =mlx the twin."""
    metal_here(zeros)
    monkeypatch.setenv("DFLASH_MLX_KERNELS", "metal")
    inputs = attention()
    assert mx.array_equal(attend(inputs), mx.zeros_like(inputs[0])).item()
    assert metal_here.launches == ["block_attention"] and not kernels.choices.decided()
    monkeypatch.setattr(kernels, "use_metal", REAL_USE_METAL)
    monkeypatch.setenv("DFLASH_MLX_KERNELS", "mlx")
    assert kernels.use_metal() is False and mx.array_equal(attend(inputs), twin_attention(inputs)).item()
    assert metal_here.launches == ["block_attention"]
    assert "DFLASH_MLX_KERNELS=mlx" in kernels.kernel_plan()["block_attention"]


def test_kernel_plan_says_what_runs(metal_here, monkeypatch):
    assert "none decided yet" in kernels.kernel_plan()["block_attention"]
    metal_here(zeros)
    attend(attention())
    assert "1 decided on this machine: 0 kernel, 1 twin" in kernels.kernel_plan()["block_attention"]
    metal_here(raising)
    kernels.gated_delta_tape(*tape())
    assert kernels.kernel_plan()["gated_delta_tape"].startswith("the MLX twin for the rest of this process")


def test_decoding_through_failing_kernels_is_lossless_and_says_so_once_per_kernel(metal_here, caplog):
    """A first Mac run whose kernels do not compile: greedy output equal to plain decoding, one
    line per kernel, each kernel tried once."""
    metal_here(raising)
    target = tiny_target("qwen3_5", seed=2, linear_key_head_dim=32)
    prompt = [1, 5, 9, 13, 2, 7, 40, 3]
    reference = plain_greedy(target, prompt, 16)
    draft = oracle_draft(target, prompt + reference, wrong={11, 14}, block_size=6, head_dim=64)
    out, _ = dflash_greedy(target, draft, prompt, max_tokens=16)
    assert out == reference
    assert sorted(metal_here.launches) == ["block_attention", "gated_delta_tape"]
    assert len(log_lines(caplog)) == 2


COMPILE_ERROR = (
    "[metal::Device] Unable to build metal library from source\n"
    "program_source:41:9: warning: unused variable 'spare'\n"
    "program_source:57:24: error: use of undeclared identifier 'rowz'\n"
    "      s[r][e] *= rowz;\n"
    "                 ^\n"
)


def test_a_compile_error_keeps_the_compilers_first_error(metal_here, caplog):
    """MLX puts "Unable to build metal library from source" first and the diagnostics after it:
    the log line, the decisions file and `doctor` keep the first `error:` line."""

    def compile_error(launch):
        raise RuntimeError(COMPILE_ERROR)

    metal_here(compile_error)
    attend(attention())
    (line,) = log_lines(caplog)
    why = (
        "the kernel failed (RuntimeError: [metal::Device] Unable to build metal library from source: "
        "program_source:57:24: error: use of undeclared identifier 'rowz')"
    )
    assert line.endswith(why)
    stored = json.loads(kernels.choices.path.read_text())["decisions"]["block_attention"]
    assert [d["reason"] for d in stored.values()] == [why]
    assert "error: use of undeclared identifier 'rowz'" in kernels.kernel_plan()["block_attention"]


def bf16_tape(seed=0):
    q, k, v, g, beta, state = tape(seed=seed)
    return q.astype(mx.bfloat16), k.astype(mx.bfloat16), v.astype(mx.bfloat16), g, beta, state


def test_each_output_is_judged_at_its_own_precision(metal_here):
    """bf16 inputs: y is bf16 (a few of its ulps pass), the state and delta float32 (1e-4). A
    state off by 1e-3 compounds over every later token: refused, where the bf16 tolerance of one
    number per input dtype let it through."""
    inputs = bf16_tape()
    y, state, delta = want = kernels.gated_delta_tape_mlx(*inputs)
    ulp = mx.abs(y.astype(mx.float32)).max() * 2.0**-7
    close = [(y.astype(mx.float32) + ulp).astype(mx.bfloat16), state * (1 + 1e-6), delta]
    off = [y, state * (1 + 1e-3), delta]
    mx.eval(close, off)
    metal_here(lambda launch: close)
    kernels.gated_delta_tape(*inputs)
    assert kernels.choices.get("gated_delta_tape", kernels.tape_class(*inputs[:3])).use_kernel
    kernels.choices = kernels.KernelChoices(kernels.choices.path.with_name("other.json"))
    metal_here(lambda launch: off)
    assert equal(kernels.gated_delta_tape(*inputs), want)
    decision = kernels.choices.get("gated_delta_tape", kernels.tape_class(*inputs[:3]))
    assert decision.verdict == "disagrees"
    assert decision.reason == "its state_out (float32) disagrees with the twin (max rel. error 1.0e-03 > 1.0e-04)"
    assert kernels.tolerance(mx.bfloat16) > 1e-3  # what the state was judged at before


def test_a_win_under_five_percent_keeps_the_twin(metal_here, monkeypatch):
    metal_here(twin_of)
    monkeypatch.setattr(kernels, "_interleaved_ms", lambda kernel, twin: (0.97, 1.0))
    inputs = tape()
    kernels.gated_delta_tape(*inputs)
    assert kernels.choices.get("gated_delta_tape", kernels.tape_class(*inputs[:3])).verdict == "slower"
    monkeypatch.setattr(kernels, "_interleaved_ms", lambda kernel, twin: (0.94, 1.0))
    wider = tape(T=16)
    kernels.gated_delta_tape(*wider)
    assert kernels.choices.get("gated_delta_tape", kernels.tape_class(*wider[:3])).verdict == "faster"


def test_timing_evaluates_several_calls_at_once(monkeypatch):
    evaluated = []
    monkeypatch.setattr(kernels.mx, "eval", lambda outputs: evaluated.append(len(outputs)))
    kernels._interleaved_ms(lambda: [1], lambda: [2])
    assert evaluated == [kernels.CALLS_PER_TIMING] * 2 * kernels.SELF_CHECK_REPEATS


OUT_OF_MEMORY = "[METAL] Command buffer execution failed: Insufficient Memory (00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)"


@pytest.mark.parametrize(
    "message", [OUT_OF_MEMORY, "[METAL] Command buffer execution failed: Caused GPU Timeout Error"]
)
def test_a_passing_failure_is_not_kept(metal_here, caplog, message):
    """Out of memory or a GPU timeout during the check says nothing of the kernel: the twin runs
    for that class in this process, and the next process checks again."""

    def passing(launch):
        raise RuntimeError(message)

    metal_here(passing)
    inputs = tape()
    assert equal(kernels.gated_delta_tape(*inputs), kernels.gated_delta_tape_mlx(*inputs))
    kernels.gated_delta_tape(*inputs)  # this process: the twin, nothing said again
    (line,) = log_lines(caplog)
    assert "the MLX twin runs in this process (the next one checks again)" in line and message[:40] in line
    assert "gated_delta_tape" not in kernels.choices.failed
    assert not kernels.KernelChoices().decided()  # nothing on disk
    want = list(kernels.gated_delta_tape_mlx(*inputs))
    mx.eval(want)
    metal_here(lambda launch: want)
    kernels.choices = later = kernels.KernelChoices()  # the next process
    kernels.gated_delta_tape(*inputs)
    assert later.get("gated_delta_tape", kernels.tape_class(*inputs[:3])).use_kernel


def test_the_decisions_key_names_the_os(monkeypatch):
    here = kernels.decisions_path()
    monkeypatch.setattr(kernels, "os_version", lambda: "macOS26.1")
    assert kernels.decisions_path() != here and "macOS26.1" in kernels.decisions_path().name


def failing_when_evaluated(launch, folder):
    """The launch's results, as arrays whose evaluation raises (as a kernel whose compile or run
    fails does only when the step is evaluated): read lazily from a file that is gone by then."""
    path = folder / "gone.safetensors"
    mx.save_safetensors(str(path), {"x": mx.zeros((1024,))})
    lazy = mx.load(str(path))["x"][0]
    path.write_bytes(b"")
    return launch.results([mx.zeros(shape, dtype) + lazy.astype(dtype) for shape, dtype in launch.outputs.values()])


def test_a_proven_kernel_failing_in_a_fresh_process_hands_over(metal_here, caplog, tmp_path):
    """A kernel proven by an earlier process (kept on disk) that raises at its next use in a new
    one, only when evaluated (a new Metal compiler refusing it): that first use is evaluated in a
    `try`, so the twin answers, one line says why, and it is kept as failed."""
    inputs = tape()
    want = list(kernels.gated_delta_tape_mlx(*inputs))
    mx.eval(want)
    metal_here(lambda launch: want)
    kernels.gated_delta_tape(*inputs)
    assert kernels.choices.get("gated_delta_tape", kernels.tape_class(*inputs[:3])).use_kernel
    caplog.clear()
    kernels.choices = kernels.KernelChoices()  # a fresh process
    metal_here(lambda launch: failing_when_evaluated(launch, tmp_path))
    assert equal(kernels.gated_delta_tape(*inputs), want)
    assert equal(kernels.gated_delta_tape(*inputs), want)
    (line,) = log_lines(caplog)
    assert "the MLX twin runs for the rest of this process" in line and "Unable to read from file" in line
    assert kernels.KernelChoices().get("gated_delta_tape", kernels.tape_class(*inputs[:3])).verdict == "failed"


def test_missing_kernel_sources_mean_the_twins_and_one_line(metal_here, caplog, monkeypatch):
    def gone(folder):
        raise FileNotFoundError(f"kernel sources ({folder}/) not found next to the package; reinstall the package")

    monkeypatch.setattr(kernels, "shipped", gone)
    kernels.missing_sources.cache_clear()
    kernels._say_once.cache_clear()
    try:
        metal_here(zeros)
        a, t = attention(), tape()
        assert mx.array_equal(attend(a), twin_attention(a)).item()
        assert equal(kernels.gated_delta_tape(*t), kernels.gated_delta_tape_mlx(*t))
        (line,) = log_lines(caplog)
        assert "the Metal kernels' sources cannot be read (kernel sources (metal/) not found" in line
        assert line.endswith("the MLX twins run") and not metal_here.launches
        assert "cannot be read" in kernels.kernel_plan()["gated_delta_tape"]
        assert kernels.decisions_path().name.startswith("kernels-")  # no source read, no raise
    finally:
        kernels.missing_sources.cache_clear()


def test_decoding_through_a_kernel_proven_earlier_and_failing_now_is_lossless(
    metal_here, caplog, monkeypatch, tmp_path
):
    """A first process proves both kernels (right answers, timing injected); the next one finds
    them failing when evaluated: greedy output equal to plain decoding, one line per kernel."""
    monkeypatch.setattr(kernels, "_interleaved_ms", lambda kernel, twin: (1.0, 2.0))
    metal_here(twin_of)
    target = tiny_target("qwen3_5", seed=2, linear_key_head_dim=32)
    prompt = [1, 5, 9, 13, 2, 7, 40, 3]
    reference = plain_greedy(target, prompt, 16)
    draft = oracle_draft(target, prompt + reference, wrong={11, 14}, block_size=6, head_dim=64)
    assert dflash_greedy(target, draft, prompt, max_tokens=16)[0] == reference
    proven = kernels.choices.decided()
    assert {"block_attention", "gated_delta_tape"} <= set(proven)
    assert all(d.use_kernel for classes in proven.values() for d in classes.values())
    caplog.clear()
    kernels.choices = kernels.KernelChoices()  # a fresh process
    metal_here(lambda launch: failing_when_evaluated(launch, tmp_path))
    assert dflash_greedy(target, draft, prompt, max_tokens=16)[0] == reference
    assert sorted(line.split(":")[1].strip() for line in log_lines(caplog)) == ["block_attention", "gated_delta_tape"]


def twin_of(launch):
    """What the launch's twin computes, from the launch alone: a kernel that is right."""
    i = launch.inputs
    if launch.kernel == "gated_delta_tape":
        return list(kernels.gated_delta_tape_mlx(i["q"], i["k"], i["v"], i["g"], i["beta"], i["state_in"]))
    _, start, length, window, *_ = i["geometry"].tolist()
    span = kernels.ContextSpan(i["ctx_keys"], i["ctx_values"], start, length)
    causal = dict(launch.template)["CAUSAL"]
    out = kernels.block_attention_mlx(
        i["queries"], i["keys"], i["values"], span, scale=i["scale"], causal=causal, window=window or None
    )
    return [out]
