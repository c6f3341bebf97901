"""`dflash-mlx launch` (serve/launch.py) with stand-in agents: small Python scripts named claude,
codex and opencode, first on PATH, that record the arguments and environment they were given and
call the server the way the real agent would be told to.  The server is the real one, on the
tiny test model."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import tomllib
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

pytest.importorskip("uvicorn", reason="the serve extra installs the server")

from dflash_mlx.serve.agents import AGENTS, Plan, Served, codex, fit, plan, toml_value  # noqa: E402
from dflash_mlx.serve.launch import ModelOptions, context_window  # noqa: E402
from conftest import WIDE  # noqa: E402

HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))

# One script for the three stand-ins: it finds its settings where its agent would, calls the
# server once (each agent's own API), and writes what it saw to $STANDIN_RECORD.
STANDIN = textwrap.dedent(
    """
    import json, os, signal, sys, time, tomllib, urllib.request

    if os.environ.get("STANDIN_WAIT"):  # Ctrl-C ends it, as it ends a program that does not catch it
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    http = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    name, args = os.path.basename(sys.argv[0]), sys.argv[1:]

    def call(url, key, body=None):
        request = urllib.request.Request(url, json.dumps(body).encode() if body else None)
        request.add_header("Authorization", f"Bearer {key}")
        request.add_header("Content-Type", "application/json")
        with http.open(request, timeout=120) as reply:
            return reply.status, json.load(reply)

    if name == "claude":
        base, key, model = (os.environ[k] for k in ("ANTHROPIC_BASE_URL", "ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_MODEL"))
        base, config = base + "/v1", None
        body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        path = "/messages"
    elif name == "codex":
        overrides = dict(args[i + 1].split("=", 1) for i, a in enumerate(args) if a == "-c")
        config = {k: tomllib.loads(f"v = {v}")["v"] for k, v in overrides.items()}
        provider = config["model_providers.dflash-mlx"]
        base, key, model = provider["base_url"], os.environ[provider["env_key"]], config["model"]
        body, path = {"model": model, "input": "hi", "max_output_tokens": 4}, "/responses"
    else:
        config = json.loads(os.environ["OPENCODE_CONFIG_CONTENT"])
        options = config["provider"]["dflash-mlx"]["options"]
        base, key, model = options["baseURL"], options["apiKey"], config["model"].split("/", 1)[1]
        body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        path = "/chat/completions"
    listed = call(base + "/models", key)
    answered = call(base + path, key, body)
    record = {"argv": args, "env": dict(os.environ), "config": config, "base": base, "listed": listed,
              "answered": answered}
    with open(os.environ["STANDIN_RECORD"] + ".part", "w") as out:
        json.dump(record, out)
    os.replace(os.environ["STANDIN_RECORD"] + ".part", os.environ["STANDIN_RECORD"])  # seen whole or not at all
    if os.environ.get("STANDIN_WAIT"):
        time.sleep(600)
    sys.exit(int(os.environ.get("STANDIN_EXIT", "0")))
    """
)


@pytest.fixture
def agents_on_path(tmp_path):
    """A folder holding the three stand-ins, and an environment that puts it first on PATH."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for name in ("claude", "codex", "opencode"):
        script = folder / name
        script.write_text(f"#!{sys.executable}\n{STANDIN}")
        script.chmod(0o755)
    env = {**os.environ, "PATH": f"{folder}{os.pathsep}{os.environ['PATH']}", "STANDIN_RECORD": str(tmp_path / "rec")}
    # where the started servers' logs and prompt caches go; the compiled CPU kernels are shared
    from dflash_mlx.io.storage import cache_dir

    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "cpu-kernels").symlink_to(cache_dir() / "cpu-kernels", target_is_directory=True)
    env["DFLASH_MLX_CACHE"] = str(tmp_path / "cache")
    env.pop("DFLASH_MLX_API_KEY", None)
    return env


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(port: int) -> bool:
    try:
        with HTTP.open(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


def tiny_model_options(tiny_dirs) -> list[str]:
    model_dir, draft_dir = tiny_dirs
    return ["--model", str(model_dir), "--draft", str(draft_dir), "--no-adaptive"]


def launch(env, *args, timeout=300) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "dflash_mlx.cli", "launch", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


def refused(env, *args) -> tuple[int, str]:
    """`dflash-mlx launch` run in this process, with `env` as its environment: the exit status
    and stderr.  For the refusals, which start nothing (the tests that start a server and an
    agent run the command as a process of its own, as a user does)."""
    from typer.testing import CliRunner

    from dflash_mlx.cli import app

    result = CliRunner().invoke(app, ["launch", *args], env=env)
    return result.exit_code, result.stderr


def recorded(env) -> dict:
    with open(env["STANDIN_RECORD"]) as f:
        return json.load(f)


def assert_configured(agent: str, record: dict, model_id: str, port: int) -> None:
    """The agent was pointed at the server, its model and window, and it was answered."""
    assert record["listed"][0] == 200 and record["listed"][1]["data"][0]["id"] == model_id
    assert record["answered"][0] == 200
    assert record["argv"][-2:] == ["--extra", "arg"]  # after the launcher's own
    assert record["base"] == f"http://127.0.0.1:{port}/v1"
    budget = str(WIDE // 8)
    if agent == "claude":
        env = record["env"]
        assert env["ANTHROPIC_MODEL"] == env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == model_id
        assert env["ANTHROPIC_AUTH_TOKEN"] and env["ANTHROPIC_API_KEY"] == ""
        assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == budget and env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == str(WIDE)
        assert env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] == str(WIDE)  # room to compact: first request, summary, reply
        assert env["DISABLE_TELEMETRY"] == env["DISABLE_ERROR_REPORTING"] == "1"
        # a long prefill or reply is waited for, not abandoned and sent again after Claude Code's 10 minutes
        assert int(env["API_TIMEOUT_MS"]) >= 3_600_000 and int(env["CLAUDE_STREAM_IDLE_TIMEOUT_MS"]) == 1_800_000
        assert record["answered"][1]["type"] == "message"
    elif agent == "codex":
        config = record["config"]
        assert config["model_provider"] == "dflash-mlx" and config["model"] == model_id
        assert config["model_providers.dflash-mlx"]["wire_api"] == "responses"
        assert config["model_context_window"] == WIDE and config["analytics.enabled"] is False
        assert config["model_auto_compact_token_limit"] == WIDE - WIDE // 8
        assert record["answered"][1]["object"] == "response"
    else:
        limit = record["config"]["provider"]["dflash-mlx"]["models"][model_id]["limit"]
        assert limit == {"context": WIDE, "output": int(budget)}
        assert "compaction" not in record["config"]  # compaction has room
        assert record["config"]["share"] == "disabled"
        assert record["config"]["provider"]["dflash-mlx"]["options"]["timeout"] is False
        assert record["answered"][1]["object"] == "chat.completion"


@pytest.mark.slow
def test_a_started_server_serves_the_agent_and_is_gone_after_it(agents_on_path, wide_dirs):
    port = free_port()
    env = {**agents_on_path, "STANDIN_EXIT": "3"}
    options = [*tiny_model_options(wide_dirs), "--port", str(port), "--log-level", "debug"]
    done = launch(env, "claude", *options, "--", "--extra", "arg")
    assert done.returncode == 3, done.stderr[-2000:]  # the agent's own exit status
    first = done.stderr.splitlines()[0]  # names the server's log, kept in the cache folder
    assert "--log-level debug" in first and f"--prompt-cache-dir {env['DFLASH_MLX_CACHE']}/prompt-cache" in first
    log = first.rsplit("(log: ", 1)[1].rstrip(")")
    assert log.startswith(f"{env['DFLASH_MLX_CACHE']}/logs/") and "GET /v1/models" in open(log).read()
    assert_configured("claude", recorded(env), str(wide_dirs[0]), port)
    assert not answers(port)  # stopped when the agent exited


@pytest.mark.slow
def test_a_running_server_is_reused_and_left_running(agents_on_path, wide_dirs):
    port = free_port()
    command = [sys.executable, "-m", "dflash_mlx.cli", "serve", *tiny_model_options(wide_dirs), "--port", str(port)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            if answers(port) or server.poll() is not None:
                break
            threading.Event().wait(0.1)
        for agent in ("claude", "codex", "opencode"):  # one server for the three agents' settings
            done = launch(agents_on_path, agent, "--port", str(port), "--", "--extra", "arg")
            assert done.returncode == 0, done.stderr[-2000:]
            assert "reusing the dflash-mlx server" in done.stderr
            assert_configured(agent, recorded(agents_on_path), str(wide_dirs[0]), port)
            assert answers(port)  # not the launcher's to stop
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)


@pytest.mark.slow
def test_ctrl_c_ends_the_agent_then_the_server(agents_on_path, wide_dirs):
    """Ctrl-C in a terminal reaches its foreground process group: the launcher and the agent.  The
    agent decides what it does (here: it dies); the launcher then stops the server it started,
    which is in a session of its own, and exits with the agent's status."""
    port = free_port()
    env = {**agents_on_path, "STANDIN_WAIT": "1"}
    command = [sys.executable, "-m", "dflash_mlx.cli", "launch", "claude", *tiny_model_options(wide_dirs)]
    launcher = subprocess.Popen([*command, "--port", str(port)], env=env, start_new_session=True)
    try:
        for _ in range(3000):
            if os.path.exists(env["STANDIN_RECORD"]) or launcher.poll() is not None:
                break
            threading.Event().wait(0.1)
        assert answers(port)
        os.killpg(launcher.pid, signal.SIGINT)
        assert launcher.wait(120) == 128 + signal.SIGINT
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert not answers(port)


def test_a_missing_agent_says_how_to_install_it(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}  # no agent on it
    status, stderr = refused(env, "codex")
    assert status == 1
    assert "Codex CLI is not installed" in stderr and "npm install -g @openai/codex" in stderr


def test_an_unknown_agent_is_refused_by_name(agents_on_path):
    status, stderr = refused(agents_on_path, "cursor")
    assert status == 1 and "unknown agent 'cursor'" in stderr and "claude, codex, opencode" in stderr


def test_a_given_port_taken_by_another_program_is_an_error(agents_on_path):
    class NotDflash(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_error(404)

        def log_message(self, *args):
            pass

    other = HTTPServer(("127.0.0.1", 0), NotDflash)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        status, stderr = refused(agents_on_path, "opencode", "--port", str(other.server_port))
    finally:
        other.shutdown()
    assert status == 1 and "is taken by a server that is not dflash-mlx" in stderr
    assert not os.path.exists(agents_on_path["STANDIN_RECORD"])  # the agent never ran


def test_model_options_pass_through_to_serve():
    options = ModelOptions(model="Qwen3-4B", draft="d", quant=4, no_draft=True, no_adaptive=True)
    assert options.serve_arguments() == [
        "--model",
        "Qwen3-4B",
        "--draft",
        "d",
        "--quant",
        "4",
        "--no-draft",
        "--no-adaptive",
    ]
    assert ModelOptions().serve_arguments() == []


def test_the_reply_budget_leaves_the_window_to_the_conversation():
    codex_agent = AGENTS["codex"]
    assert plan(codex_agent, 40960, 6000).reply == 5120 and plan(codex_agent, 262144, 6000).reply == 32000
    assert plan(codex_agent, None, 6000) == Plan(
        8192, True
    )  # a window not known here: what every published target holds
    assert plan(codex_agent, 8192, 7587).reply == 605  # what the window leaves after the first request


@pytest.mark.parametrize(
    "agent, window, first, compacts",
    [
        ("opencode", 8192, 7587, False),  # a summary on top of the first request would overflow again
        ("opencode", 40960, 7587, True),
        ("codex", 8192, 6472, False),
        ("codex", 40960, 6472, True),
        ("claude", 8192, 1076, False),  # Claude Code's own 13,000-token margin exceeds the window
        ("claude", 40960, 22643, False),  # its line, 22,840, is just above the first request
        ("claude", 131072, 22643, True),
    ],
)
def test_compaction_only_where_a_summary_fits_below_the_agents_line(agent, window, first, compacts):
    session = plan(AGENTS[agent], window, first)
    assert session.compact is compacts
    if compacts:  # after compacting: the first request, a summary and a reply below the line
        assert first + 2 * session.reply <= AGENTS[agent].compaction_line(window, session.reply)


def test_each_agent_is_told_whether_it_may_compact():
    served = Served("http://127.0.0.1:9", "k", "m", 8192)
    _, env = AGENTS["opencode"].configure(served, Plan(605, False))
    config = json.loads(env["OPENCODE_CONFIG_CONTENT"])
    assert config["compaction"] == {"auto": False}  # it also compacts on the server's refusal unless told not to
    assert config["provider"]["dflash-mlx"]["models"]["m"]["limit"] == {"context": 8192, "output": 605}
    _, env = AGENTS["claude"].configure(served, Plan(1024, False))
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "8192" and env["CLAUDE_CODE_BLOCKING_LIMIT_OVERRIDE"] == "7168"
    assert "CLAUDE_CODE_AUTO_COMPACT_WINDOW" not in env
    _, env = AGENTS["claude"].configure(Served("u", "k", "m", 131072), Plan(16384, True))
    assert env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] == "131072" and "CLAUDE_CODE_BLOCKING_LIMIT_OVERRIDE" not in env
    args, _ = AGENTS["codex"].configure(served, Plan(1024, False))
    assert "model_auto_compact_token_limit=8192" in args  # at the window: never before the server's refusal


def test_a_window_too_small_for_the_first_request_names_what_fits():
    claude = AGENTS["claude"]
    assert claude.first_request_with([]) == 22662 and claude.first_request_with(["--bare", "-p", "hi"]) == 1141
    assert claude.first_request_with(["--tools", "Read,Write"]) == 2278
    assert claude.first_request_with(["--tools", "Bash"]) is None  # not measured: not refused
    message = fit(claude, 8192, 22662, "SmolLM2-135M-Instruct")
    assert "cannot hold Claude Code's first request (~22,662 tokens)" in message
    assert "`--bare`" in message and "`--tools Read,Write`" in message
    assert fit(claude, 8192, 1076, "m") is None and fit(claude, 8192, None, "m") is None
    assert "`--bare`" not in fit(claude, 1200, 22643, "m")  # nothing the agent can pass fits: a model


def test_codex_overrides_are_toml_and_leave_the_window_room_for_a_reply():
    args, env = codex(Served("http://127.0.0.1:9", "k", 'a "quoted"/model', 40960), plan(AGENTS["codex"], 40960, 6472))
    config = {k: tomllib.loads(f"v = {v}")["v"] for k, v in (a.split("=", 1) for a in args[1::2])}
    assert args[::2] == ["-c"] * len(config)
    assert config["model"] == 'a "quoted"/model' and config["model_providers.dflash-mlx"]["env_key"] in env
    assert config["model_auto_compact_token_limit"] == 40960 - 5120
    assert toml_value({"a": 1, "b": "x"}) == '{a = 1, b = "x"}'


@pytest.mark.slow
def test_a_window_too_small_is_refused_before_the_agent_starts(agents_on_path, tiny_dirs):
    port = free_port()
    done = launch(agents_on_path, "opencode", *tiny_model_options(tiny_dirs), "--port", str(port))
    assert done.returncode == 1
    assert "window (4,096 tokens) cannot hold OpenCode's first request" in done.stderr
    assert not os.path.exists(agents_on_path["STANDIN_RECORD"])  # the agent never ran
    assert "starting dflash-mlx serve" not in done.stderr and not answers(port)  # nor a server for it


def test_the_default_models_window_is_read_from_its_converted_folder_without_converting(tmp_path, monkeypatch):
    from dflash_mlx.api import registry

    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path))
    monkeypatch.setattr(registry, "smollm2_path", lambda *a, **k: pytest.fail("launch must not convert the model"))
    assert context_window(registry.DEFAULT_MODEL, None) is None  # not converted yet: the window is read later
    folder = tmp_path / "models" / f"{registry.DEFAULT_MODEL}-float32"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    assert context_window(registry.DEFAULT_MODEL, None) == 8192


def test_a_short_names_window_is_read_from_whichever_variant_is_cached(tmp_path, monkeypatch):
    """The server may load any variant of a short name (the one that fits the machine); all share
    the window, found in a config's text_config too (multimodal targets)."""
    import huggingface_hub.constants

    repo = tmp_path / "models--mlx-community--Qwen3-8B-4bit"
    (repo / "snapshots" / "abc").mkdir(parents=True)
    (repo / "snapshots" / "abc" / "config.json").write_text(
        json.dumps({"text_config": {"max_position_embeddings": 40960}})
    )
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert context_window("Qwen3-8B", None) == 40960
    assert context_window("Qwen3-4B", None) is None  # not on this machine: the agents' defaults apply
