"""The target pipelined over 2 and 3 ranks (mlx.launch, ring backend, loopback):
token-for-token equal to one process, and a lost rank ends the run with one line."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # several ranks under mlx.launch

HERE = Path(__file__).parent
BIN = Path(sys.executable).parent


def launch(ranks: int, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    command = [str(BIN / "mlx.launch"), "--backend", "ring", "-n", str(ranks), "--python", sys.executable, "--", *args]
    # several ranks share this machine's cores: one BLAS thread each, or they fight over them
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=HERE.parent,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
    )


@pytest.mark.parametrize(
    "model_type, split",
    [
        ("llama", "2,2"),
        ("qwen3_moe", "1,3"),
        ("qwen3_5", "2,2"),  # qwen3_5: features and GatedDeltaNet on both
        ("llama", "1,1,2"),
        ("qwen3_5", "1,2,1"),  # rank 0 holds neither feature nor GatedDeltaNet layers
    ],
)
def test_pipelined_greedy_equals_one_process(model_type, split):
    result = launch(len(split.split(",")), str(HERE / "pipeline_ranks.py"), model_type, split, "lossless")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("ok ") == 6, result.stdout


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.mark.parametrize("mode", ["kill", "stall"])
def test_a_lost_rank_ends_the_run_with_one_line(mode, tmp_path):
    """Ranks started as on separate machines (no mlx.launch to end the others when one dies)."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in free_ports(2)]))
    tic = time.monotonic()
    ranks = [
        subprocess.Popen(
            [sys.executable, str(HERE / "pipeline_ranks.py"), "llama", "2,2", mode],
            env={**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        out, err = ranks[0].communicate(timeout=60)
    finally:
        ranks[1].kill()
    output = out + err
    errors = [line for line in output.splitlines() if line.startswith("error: rank 0")]
    assert ranks[0].returncode != 0 and len(errors) == 1, output
    # the ring backend reports a closed peer where it can; a silent one meets the watchdog
    assert "connection to a peer was lost" in errors[0] or "no answer from the other ranks in 5 s" in errors[0]
    assert "Traceback" not in output
    assert time.monotonic() - tic < 45


def test_smollm2_pair_over_two_ranks_matches_one_process():
    args = ["generate", "--prompt", "Write a Python function that reverses a string.", "--max-tokens", "48"]
    alone = subprocess.run(
        [str(BIN / "dflash-mlx"), *args, "--no-draft", "--no-adaptive"], capture_output=True, text=True, timeout=300
    )
    assert alone.returncode == 0, alone.stderr
    piped = launch(2, str(BIN / "dflash-mlx"), *args, "--block-size", "8", "--distributed", "pipeline", "--verbose")
    assert piped.returncode == 0, piped.stderr
    text = alone.stdout.split("==========")[0]
    assert piped.stdout.startswith(text) and len(text) > 40, (alone.stdout, piped.stdout)
    assert "rank 1:" in piped.stderr and "KiB sent per token" in piped.stderr, piped.stderr


def test_serve_over_two_ranks_answers_as_one_process(tiny_dirs):
    openai = pytest.importorskip("openai", reason="the dev extra installs the openai client")
    from dflash_mlx import generate, load
    from dflash_mlx.api import format_prompt

    model_dir, draft_dir = tiny_dirs
    port = free_ports(1)[0]
    command = [
        str(BIN / "mlx.launch"),
        "--backend",
        "ring",
        "-n",
        "2",
        "--python",
        sys.executable,
        "--",
        str(BIN / "dflash-mlx"),
        "serve",
        "--model",
        str(model_dir),
        "--draft",
        str(draft_dir),
        "--no-adaptive",
        "--port",
        str(port),
        "--distributed",
        "pipeline",
        "--split",
        "1,1",
    ]
    server = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
        start_new_session=True,
    )
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
    try:
        for _ in range(600):
            try:
                models = client.models.list()
                break
            except openai.APIConnectionError:
                time.sleep(0.1)
        assert models.data[0].model_extra["dflash"]["pipeline_ranks"] == 2
        model, tokenizer = load(str(model_dir), str(draft_dir), adaptive=False)
        for prompt in ("hello world", "the quick brown fox"):
            reply = client.chat.completions.create(
                model=models.data[0].id, max_tokens=20, messages=[{"role": "user", "content": prompt}]
            )
            offline = generate(model, tokenizer, format_prompt(tokenizer, prompt), max_tokens=20)
            assert reply.choices[0].message.content == offline
            assert reply.usage.model_extra["dflash"]["draft_cycles"] > 0
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            output, _ = server.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            output, _ = server.communicate()
    assert "/dflash_mlx/" not in output, output  # no traceback from our ranks (mlx.launch may print its own)


def test_an_unreachable_rank_ends_the_start_with_one_line(tmp_path):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in free_ports(2)]))
    tic = time.monotonic()
    alone = subprocess.run(
        [str(BIN / "dflash-mlx"), "generate", "--prompt", "hi", "--distributed", "pipeline", "--timeout", "3"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "MLX_RANK": "0", "MLX_HOSTFILE": str(hostfile)},
    )
    assert alone.returncode != 0 and time.monotonic() - tic < 30
    assert alone.stderr.strip().startswith("error: rank 0: connecting to the other ranks"), alone.stderr
    assert len(alone.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("model_type", ["gpt_oss", "gemma4_text"])
def test_models_whose_layers_differ_are_refused_for_our_own_split(model_type):
    import mlx.core as mx

    from dflash_mlx.distributed.pipeline import PipelineTarget
    from tiny_models import tiny_model

    with pytest.raises(ValueError, match="no pipeline\\(\\) and its layers are not all alike"):
        PipelineTarget(tiny_model(model_type), mx.distributed.init())
