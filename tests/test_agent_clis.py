"""The real agent CLIs (Claude Code, Codex CLI, OpenCode at the versions bench/agent_clis.py pins,
installed by npm into the cache folder) through `dflash-mlx launch`, each completing a tool loop
against the real server whose engine answers by script (tiny test model's tokenizer): the agent
calls its file-writing tool, the file is written, the result goes back, the model answers, and
the agent exits 0.  The sessions run in a network namespace with only loopback where the system
can make one (bench/agent_clis.py --loopback-only), else on the host's network.  Skipped, with the
reason, where npm cannot provide the CLIs."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("uvicorn", reason="the serve extra installs the server")
pytest.importorskip("anthropic", reason="the dev extra installs the clients live_server makes")
pytestmark = pytest.mark.slow  # npm (once), then three agents' sessions

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))

from agent_clis import ENDLESS, installed_clis, loopback_only, run_session  # noqa: E402

AGENTS = ["claude", "codex", "opencode"]

# the route each agent's API is served on, and a status it must get there
ROUTES = {
    "claude": "POST /v1/messages 200",
    "codex": "POST /v1/responses 200",
    "opencode": "POST /v1/chat/completions 200",
}


@pytest.fixture(scope="module")
def clis():
    bin_dir, why = installed_clis()
    if bin_dir is None:
        pytest.skip(why)
    return bin_dir


@pytest.fixture(scope="module")
def sessions(clis, wide_dirs, tmp_path_factory):
    """The three agents' sessions on the tiny model (its tokenizer writes many tokens per word:
    Claude Code's first request needs the wide window), loopback only where possible."""
    bench = Path(__file__).parent.parent / "bench" / "agent_clis.py"
    out = tmp_path_factory.mktemp("agent-clis")
    command = [sys.executable, str(bench), "--model", str(wide_dirs[0]), "--out", str(out)]
    if loopback_only(["true"]) is not None:
        done = subprocess.run([*command, "--loopback-only"], capture_output=True, text=True, timeout=1200)
        assert done.returncode == 0, done.stderr[-3000:]
        return {r["agent"]: r for r in json.loads((out / "results.json").read_text())}
    from dflash_mlx import load

    model, tokenizer = load(str(wide_dirs[0]), use_draft=False, adaptive=False)
    return {agent: {**run_session(agent, model, tokenizer, clis), "network": "host"} for agent in AGENTS}


@pytest.mark.parametrize("agent", AGENTS)
def test_the_agent_completes_a_tool_loop_through_launch(agent, sessions):
    session = sessions[agent]
    assert session["exit"] == 0, session
    assert session["file_written"], session  # the call's content, by the agent's own tool
    assert "tool call" in session["answers"], session
    # the result went back: a request after the call saw it, and was answered in text
    assert session["answers"][-1] == "text" and session["answers"].index("tool call") < len(session["answers"]) - 1
    assert session["requests"].count(ROUTES[agent]) >= 2, session["requests"]
    assert all(r.endswith(" 200") for r in session["requests"]), session["requests"]  # Claude Code's HEAD / too


NEVER_ENDING_WINDOW = 12_288  # holds the tiny tokenizer's first request below and four answers, not eight
TINY_FIRST_REQUEST = 7_700  # Claude Code's with --tools Read,Write in the tiny tokenizer: 7,554 measured


@pytest.fixture(scope="module")
def never_ending(clis, tiny_dirs, tmp_path_factory):
    """Claude Code on a model that never ends its answers (a base model's way), its reply budget
    the one `launch` plans for this window: each answer runs to the budget, and Claude Code asks
    for the rest as often as it does."""
    from dflash_mlx import load

    model_dir = tmp_path_factory.mktemp("never-ending") / "model"
    shutil.copytree(tiny_dirs[0], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": NEVER_ENDING_WINDOW}))
    model, tokenizer = load(str(model_dir), use_draft=False, adaptive=False)
    assert len(tokenizer.encode(ENDLESS * 100)) == 100  # an answer's tokens come back as many
    arguments = ["-p", "Write a Python function that reverses a string.", "--tools", "Read,Write"]
    return run_session(
        "claude", model, tokenizer, clis, arguments=arguments, endless=str(model_dir), first_request=TINY_FIRST_REQUEST
    )


def test_a_never_ending_answer_ends_claude_codes_turn_inside_the_window(never_ending):
    """Claude Code (2.1.197) continues an answer cut at max_tokens three times, then reports the
    cut and exits: with the planned budget every continuation fits the window, so no request is
    refused as too long (after which its compaction and retries never end)."""
    from dflash_mlx.serve.agents import AGENTS, plan

    reply = plan(AGENTS["claude"], NEVER_ENDING_WINDOW, TINY_FIRST_REQUEST).reply
    assert reply < NEVER_ENDING_WINDOW // 8  # the continuations bound it, not the window's eighth
    session = never_ending
    assert session["exit"] == 1 and f"exceeded the {reply} output token maximum" in session["stdout"], session
    assert all(r.endswith(" 200") for r in session["requests"]), session  # nothing refused as too long
    long = [(prompt, generated) for prompt, generated in session["answered"] if prompt >= TINY_FIRST_REQUEST - 500]
    assert len(long) == 1 + 3 and all(generated == reply for _, generated in long), session
    assert all(prompt + generated <= NEVER_ENDING_WINDOW for prompt, generated in long), session
