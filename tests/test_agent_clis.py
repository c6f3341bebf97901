"""The real agent CLIs (Claude Code, Codex CLI, OpenCode at the versions bench/agent_clis.py pins,
installed by npm into the cache folder) through `dflash-mlx launch`, each completing a tool loop
against the real server whose engine answers by script (tiny test model's tokenizer): the agent
calls its file-writing tool, the file is written, the result goes back, the model answers, and
the agent exits 0.  Skipped, with the reason, where npm cannot provide the CLIs."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("uvicorn", reason="the serve extra installs the server")
pytest.importorskip("anthropic", reason="the dev extra installs the clients live_server makes")
pytestmark = pytest.mark.slow  # npm (once), then three agents' sessions

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))

from agent_clis import installed_clis, run_session  # noqa: E402

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
def tiny(wide_dirs):
    """The tiny model's tokenizer writes many tokens per word: Claude Code's first request needs
    the wide window."""
    from dflash_mlx import load

    return load(str(wide_dirs[0]), use_draft=False)


@pytest.mark.parametrize("agent", ["claude", "codex", "opencode"])
def test_the_agent_completes_a_tool_loop_through_launch(agent, clis, tiny):
    model, tokenizer = tiny
    session = run_session(agent, model, tokenizer, clis)
    assert session["exit"] == 0, session
    assert session["file_written"], session  # the call's content, by the agent's own tool
    assert "tool call" in session["answers"], session
    # the result went back: a request after the call saw it, and was answered in text
    assert session["answers"][-1] == "text" and session["answers"].index("tool call") < len(session["answers"]) - 1
    assert session["requests"].count(ROUTES[agent]) >= 2, session["requests"]
    assert all(r.endswith(" 200") for r in session["requests"]), session["requests"]  # Claude Code's HEAD / too
