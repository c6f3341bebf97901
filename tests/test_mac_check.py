"""bench/mac_check.py, the one command a Mac owner runs: a report whatever dies (each section
named before it runs, so even a process killed outright leaves its name), an --out that cannot be
written refused up front, lossless judged over the full length, and kernel rows for causal and
windowed attention and fp16, with a compile error's own words."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest

from dflash_mlx.kernels import metal as kernels
from msl_emulator import run_emulated
from test_kernel_selfcheck import COMPILE_ERROR

BENCH = Path(__file__).parents[1] / "bench"
SMALL_SHAPES = ({"small": (4, 2, 64)}, {"small": (2, 4, 64, 16)})


@pytest.fixture
def mac_check(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import mac_check

    return mac_check


@pytest.fixture
def checked_here(monkeypatch, tmp_path):
    """The Metal branch taken and timing injected (the kernel 2x faster): the rows' verdicts come
    from the outputs alone."""
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "use_metal", lambda: True)
    monkeypatch.setattr(kernels, "_interleaved_ms", lambda kernel, twin: (1.0, 2.0))


@pytest.mark.slow  # emulated kernel rows
def test_kernel_rows_cover_causal_windowed_and_fp16_through_the_emulator(mac_check, checked_here, monkeypatch):
    monkeypatch.setattr(kernels, "run_metal", run_emulated)
    outcome = mac_check.kernel_self_checks(quick=True, shapes=SMALL_SHAPES)
    classes = [(r["kernel"], r["shape class"]) for r in outcome.rows]
    attention = [c for k, c in classes if k == "block_attention"]
    assert [c.split(" B<=")[0].split("D=64 ")[1] for c in attention] == [
        "bfloat16 bidirectional",
        "bfloat16 causal",
        "bfloat16 bidirectional windowed",
        "bfloat16 causal windowed",
        "float16 bidirectional",
    ]
    tape = [c for k, c in classes if k == "gated_delta_tape"]
    assert ["bfloat16" in tape[0], "float16" in tape[1]] == [True, True] and len(tape) == 2
    assert not outcome.failed and {r["verdict"] for r in outcome.rows} == {"faster"}, outcome.rows
    assert all(r["max rel. error"] <= kernels.tolerance(mx.bfloat16) for r in outcome.rows)
    monkeypatch.setattr(
        kernels, "run_metal", lambda launch: launch.results([mx.zeros(s, d) for s, d in launch.outputs.values()])
    )
    wrong = mac_check.kernel_self_checks(quick=True, shapes=SMALL_SHAPES)
    assert wrong.failed and {r["verdict"] for r in wrong.rows} == {"disagrees"}


def test_a_compile_error_reaches_the_report_in_the_compilers_words(mac_check, checked_here, monkeypatch, tmp_path):
    def compile_error(launch):
        raise RuntimeError(COMPILE_ERROR)

    monkeypatch.setattr(kernels, "run_metal", compile_error)
    outcome = mac_check.kernel_self_checks(quick=True, shapes=SMALL_SHAPES)
    assert outcome.failed and all("error: use of undeclared identifier 'rowz'" in r["why"] for r in outcome.rows)
    report = mac_check.Report(tmp_path / "out", "python bench/mac_check.py")
    report.run("kernel_self_checks", lambda: (_ for _ in ()).throw(RuntimeError(COMPILE_ERROR)))
    (section,) = json.loads((tmp_path / "out" / "report.json").read_text())["sections"]
    assert section["status"].endswith("program_source:57:24: error: use of undeclared identifier 'rowz'")


def test_each_section_is_named_in_the_report_before_it_runs(mac_check, tmp_path):
    report = mac_check.Report(tmp_path, "python bench/mac_check.py")
    seen = []

    def check():
        seen.append(json.loads((tmp_path / "report.json").read_text())["sections"])
        return mac_check.Outcome()

    report.run("environment", check)
    report.run("speed", check)
    assert [[(s["name"], s["status"]) for s in sections] for sections in seen] == [
        [("environment", mac_check.STARTED)],
        [("environment", "ok"), ("speed", mac_check.STARTED)],
    ]
    assert "## speed: ok" in (tmp_path / "report.md").read_text()


def test_a_process_killed_in_a_section_leaves_its_name(tmp_path):
    """A hard abort (a GPU fault aborts the process; no exception to catch)."""
    script = (
        "import os, sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); import mac_check\n"
        "report = mac_check.Report(Path(sys.argv[2]), 'python bench/mac_check.py')\n"
        "report.run('environment', mac_check.Outcome)\n"
        "report.run('kernel_self_checks', os.abort)\n"
    )
    died = subprocess.run([sys.executable, "-c", script, str(BENCH), str(tmp_path)], capture_output=True)
    assert died.returncode != 0
    markdown = (tmp_path / "report.md").read_text()
    assert (
        "## environment: ok" in markdown and f"## kernel_self_checks: {'started (if the report ends here'}" in markdown
    )


def test_an_out_that_cannot_be_written_is_refused_before_anything_runs(mac_check, tmp_path, monkeypatch, capsys):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    ran = []
    monkeypatch.setattr(mac_check, "environment", lambda: ran.append("environment"))
    monkeypatch.setattr(sys, "argv", ["mac_check.py", "--out", str(blocked / "report")])
    with pytest.raises(SystemExit) as refused:
        mac_check.main(
            model=None, quant=None, gdn_model="none", prompts=1, max_tokens=8, quick=True, out=blocked / "report"
        )
    assert refused.value.code == 2 and not ran
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: cannot write the report folder {blocked / 'report'}") and "--out" in line


@pytest.mark.parametrize("on_gpu", [False, True])
def test_a_shorter_dflash_answer_is_different(mac_check, monkeypatch, on_gpu):
    """zip() stops at the shorter list: the comparison runs over the full length, and no near-tie
    explains a missing token."""
    monkeypatch.setattr(mac_check, "plain_tokens", lambda pair, prompt, n: [1, 2, 3])
    monkeypatch.setattr(mac_check, "dflash_tokens", lambda pair, prompt, n, width: ([1, 2], 2.0))
    monkeypatch.setattr(mac_check, "format_prompt", lambda tokenizer, text: [9])
    monkeypatch.setattr(mac_check, "top2_gap", lambda pair, prefix: (1e-6, 0.5))
    if on_gpu:
        monkeypatch.setattr(mac_check.mx, "default_device", lambda: mx.gpu)
    outcome = mac_check.lossless(SimpleNamespace(end_tokens=frozenset({0})), None, ["x"], 3)
    (row,) = outcome.rows
    assert outcome.failed and row["verdict"] == "DIFFERENT" and row["first difference"] == 2
    assert (row["tokens"], row["DFlash tokens"]) == (3, 2)
    assert mac_check.first_difference([1, 2], [1, 2, 3]) == 2 and mac_check.first_difference([1], [1]) is None
    assert mac_check.answer([5, 6, 0, 7], {0}) == [5, 6]  # the reference past EOS is not the answer
