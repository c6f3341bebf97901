"""A graceful stop (serve/worker.py drain, serve/app.py run): new requests get 503, running ones
finish or, past the deadline, end as if at their max_tokens; SIGTERM ends `dflash-mlx serve`
with exit 0, no traceback and a prompt-cache folder holding only whole entries."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from dflash_mlx.decode.request import Request
from dflash_mlx.serve import worker
from dflash_mlx.serve.worker import DONE, Draining, Job, Worker
from scripted_engine import slow_batch

LOCAL = "http://127.0.0.1:8080"


def events_of(job: Job, timeout: float = 10.0) -> list:
    out = []
    while (event := job.events.get(timeout=timeout)) is not DONE:
        out.append(event)
    return out


def test_a_drain_lets_running_jobs_finish_and_refuses_waiting_ones(monkeypatch):
    monkeypatch.setattr(worker, "BatchGenerator", slow_batch(pieces=5, seconds_per_step=0.02))
    engine = Worker(None, None, max_batch=1)
    running, waiting = Job(Request([1], 5)), Job(Request([2], 5))
    engine.submit(running)
    first = running.events.get(timeout=10)
    engine.submit(waiting)  # queued behind the one running (batches of one)
    tic = time.monotonic()
    engine.drain(10.0)
    assert time.monotonic() - tic < 5  # returns when the running job is done, not at the deadline
    out = [first] + events_of(running)
    assert len(out) == 5 and out[-1].finish_reason == "stop"
    assert not engine.alive
    assert isinstance(waiting.events.get(timeout=1), Draining) and waiting.events.get(timeout=1) is DONE


def test_past_the_deadline_running_jobs_end_as_if_at_max_tokens(monkeypatch):
    monkeypatch.setattr(worker, "BatchGenerator", slow_batch(pieces=10_000, seconds_per_step=0.01))
    engine = Worker(None, None, max_batch=2)
    job = engine.submit(Job(Request([1], 10_000)))
    out = [job.events.get(timeout=10)]
    tic = time.monotonic()
    threading.Thread(target=engine.drain, args=(0.3,), daemon=True).start()
    out += events_of(job)
    assert 0.2 < time.monotonic() - tic < 5
    assert out[-1].finish_reason == "length" and out[-1].text == ""
    assert all(e.finish_reason is None for e in out[:-1]) and len(out) < 10_000
    engine._thread.join(5)
    assert not engine.alive


def test_a_draining_server_answers_503(tiny_dirs, monkeypatch):
    pytest.importorskip("uvicorn", reason="the serve extra installs the server")
    from starlette.testclient import TestClient

    from dflash_mlx import load
    from dflash_mlx.serve import make_app

    monkeypatch.setattr(worker, "BatchGenerator", slow_batch(pieces=3, seconds_per_step=0.0))
    model, tokenizer = load(str(tiny_dirs[0]), use_draft=False, adaptive=False)
    server = make_app(model, tokenizer, "tiny", prompt_cache_bytes=0)
    with TestClient(server.app, base_url=LOCAL) as http:
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3}).status_code == 200
        server.drain(5.0)
        for path, body in [
            ("/v1/completions", {"prompt": "hi", "max_tokens": 3}),
            ("/v1/messages", {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}),
        ]:
            reply = http.post(path, json=body)
            assert reply.status_code == 503 and "shutting down" in json.dumps(reply.json())
        assert http.get("/health").status_code == 503 and http.get("/health").json() == {"status": "draining"}


@pytest.mark.slow
@pytest.mark.parametrize("drain", ["0", "30"])
def test_sigterm_drains_and_exits_cleanly(tiny_dirs, tmp_path, drain):
    """SIGTERM during a streamed answer: with no time to drain, the stream ends at once with
    finish_reason "length"; with time, it ends whole.  Exit 0 either way, and the prompt-cache
    folder holds whole entries only."""
    openai = pytest.importorskip("openai", reason="the dev extra installs the openai client")
    from test_serve import free_port, wait_healthy

    from dflash_mlx import generate, load

    model_dir, draft_dir = tiny_dirs
    port, folder = free_port(), tmp_path / "cache"
    command = [sys.executable, "-m", "dflash_mlx.cli", "serve", "--model", str(model_dir), "--draft", str(draft_dir)]
    command += ["--port", str(port), "--no-adaptive", "--prompt-cache-dir", str(folder), "--drain-seconds", drain]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    try:
        wait_healthy(port)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        asked = 3000 if drain == "0" else 200
        stream = client.completions.create(model="tiny", prompt="the cat", max_tokens=asked, stream=True)
        chunks = [next(iter(stream))]
        proc.send_signal(signal.SIGTERM)
        tic = time.monotonic()
        chunks += list(stream)
        ended_after = time.monotonic() - tic
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err, err[-800:]
    assert re.search(r"serving .*; prompt cache \d+\.\d GiB\)", err), err[-800:]  # the bound, said at start
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    model, tokenizer = load(str(model_dir), use_draft=False, adaptive=False)
    whole = generate(model, tokenizer, "the cat", max_tokens=200)
    if drain == "30":  # the whole answer, as a server that was not stopped gives it
        assert text == whole and reasons[-1:] in (["length"], ["stop"])
    else:  # cut at once, a prefix of the answer, ending as if at max_tokens
        assert reasons == ["length"] and ended_after < 10
        assert text[: len(whole)] == whole[: len(text)]
    names = sorted(p.name for p in folder.iterdir())
    assert names and all(not n.startswith(".") and n.endswith(".safetensors") for n in names)


def test_max_queue_bounds_the_jobs_not_yet_started_and_offers_do_not_count(monkeypatch):
    """Jobs past `max_queue` waiting (beyond the ones decoding) are refused; offers of idle
    prefills and their wake-ups are not jobs, and a job that starts frees its place."""
    monkeypatch.setattr(worker, "BatchGenerator", slow_batch(pieces=40, seconds_per_step=0.01))
    engine = Worker(None, None, max_queue=2, max_batch=1)
    try:
        running = engine.submit(Job(Request([1], 40)))
        running.events.get(timeout=10)  # decoding: no longer waiting
        for _ in range(50):
            engine.prefill_when_idle([7, 7, 7])
        waiting = [engine.submit(Job(Request([2 + k], 40))) for k in range(2)]
        with pytest.raises(worker.QueueFull):
            engine.submit(Job(Request([9], 40)))
        assert engine.depth == 3
        assert len(events_of(running)) == 39
        for job in waiting:
            assert events_of(job)[-1].finish_reason == "stop"
        assert engine.batch.offered == [[7, 7, 7]] * 50  # handed over, the decoder's to judge
    finally:
        engine.stop()
