"""`dflash-mlx launch AGENT`: a coding agent (Claude Code, Codex or OpenCode) run on a local
`dflash-mlx serve`.  The server is started for the agent and stopped after it, unless a
dflash-mlx server already answers on the port: that one is reused and left running.  The agent
is configured by environment variables and command-line overrides only, so the user's own
settings files and logins are never written."""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..io.storage import cache_dir
from .agents import AGENTS, KEY_ENV, Plan, Served, fit, plan

HOST = "127.0.0.1"
SERVE_PORT = 8080  # `dflash-mlx serve`'s default: a server the user runs there is reused
DUMMY_KEY = "dflash-mlx"  # agents refuse to start without some key; a server without --api-key takes any
DRAIN_SECONDS = 10.0  # `dflash-mlx serve --drain-seconds`' default
HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback never goes through a proxy


class LaunchError(Exception):
    """Why the agent could not be launched, in one line for the user."""


@dataclass(frozen=True)
class ModelOptions:
    """The model options of `dflash-mlx serve`, passed through to a server started here."""

    model: Optional[str] = None
    draft: Optional[str] = None
    quant: Optional[int] = None
    draft_quant: Optional[int] = None
    no_draft: bool = False
    no_adaptive: bool = False

    def serve_arguments(self) -> list[str]:
        args = []
        for flag, value in (
            ("--model", self.model),
            ("--draft", self.draft),
            ("--quant", self.quant),
            ("--draft-quant", self.draft_quant),
        ):
            if value is not None:
                args += [flag, str(value)]
        return args + ["--no-draft"] * self.no_draft + ["--no-adaptive"] * self.no_adaptive


def launch(
    name: str, options: ModelOptions, port: Optional[int], wait: float, agent_args: list[str], log_level: str = "info"
) -> int:
    """Run agent `name` on a dflash-mlx server at `port` (reused if one answers there, else
    started; no port: a server on 8080 is reused, else one is started on a free port), with
    `agent_args` after the launcher's own; returns the agent's exit status."""
    agent = AGENTS.get(name)
    if agent is None:
        raise LaunchError(f"unknown agent {name!r}; launch one of {', '.join(AGENTS)}")
    executable = shutil.which(agent.executable)
    if executable is None:
        raise LaunchError(f"{agent.title} is not installed ({agent.executable} is not on PATH): {agent.install}")
    key = os.environ.get(KEY_ENV) or DUMMY_KEY
    url, model = reusable_server(port, key)
    first_request = agent.first_request_with(agent_args)
    if model is None:  # a window that cannot hold the agent: said before a server is started for it
        from ..api.registry import DEFAULT_MODEL

        name = options.model or DEFAULT_MODEL
        refusal = fit(agent, context_window(name, options.quant), first_request, name)
        if refusal:
            raise LaunchError(refusal)
    server = None
    with stop_signals_raise():
        try:
            if model is None:
                url = f"http://{HOST}:{port or free_port()}"
                server = start_server(options, url, wait, log_level)
                model = dflash_model(url, key)
                if model is None:
                    raise LaunchError(f"dflash-mlx serve at {url} stopped answering once ready (see its log)")
            else:
                say_reused(url, model["id"], options)
            served = Served(url, key, model["id"], context_window(model["id"], options.quant))
            refusal = fit(agent, served.context, first_request, served.model)
            if refusal:
                raise LaunchError(refusal)
            session = plan(agent, served.context, first_request)
            args, env = agent.configure(served, session)
            say(f"{agent.title} on {served.model} at {url} ({describe(served.context, first_request, session)})")
            return run_agent([executable, *args, *agent_args], {**os.environ, **env})
        finally:
            if server is not None:
                stop_server(server)


def describe(window: Optional[int], first_request: Optional[int], session: Plan) -> str:
    if window is None:
        return f"window unknown; replies of {session.reply:,} tokens"
    first = f"first request ~{first_request:,} tokens; " if first_request else ""
    compaction = "" if session.compact else "; no compaction: the window holds no summary besides the first request"
    return f"window {window:,} tokens; {first}replies up to {session.reply:,}{compaction}"


def reusable_server(port: Optional[int], key: str) -> tuple[Optional[str], Optional[dict]]:
    """(url, model entry) of the dflash-mlx server to reuse, or (None, None).  A given port
    taken by another program is an error; serve's default port taken by one is passed over."""
    url = f"http://{HOST}:{port or SERVE_PORT}"
    try:
        model = dflash_model(url, key)
    except LaunchError:
        if port is not None:
            raise
        return None, None
    return (url, model) if model is not None else (None, None)


def dflash_model(url: str, key: str) -> Optional[dict]:
    """The model entry of the dflash-mlx server at `url`, None when nothing listens there;
    LaunchError when something else answers."""
    try:
        with HTTP.open(authorized(f"{url}/v1/models", key), timeout=10) as reply:
            body = json.load(reply)
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise LaunchError(f"the dflash-mlx server at {url} wants an API key: set {KEY_ENV} to it") from None
        raise LaunchError(f"{url} is taken by a server that is not dflash-mlx (GET /v1/models: {e.code})") from None
    except (urllib.error.URLError, OSError):
        return None
    except ValueError:  # not JSON
        raise LaunchError(f"{url} is taken by a server that is not dflash-mlx") from None
    entries = body.get("data") if isinstance(body, dict) else None
    ours = [m for m in entries or [] if isinstance(m, dict) and m.get("owned_by") == "dflash-mlx" and m.get("id")]
    if not ours:
        raise LaunchError(f"{url} is taken by a server that is not dflash-mlx")
    return ours[0]


def authorized(url: str, key: str) -> urllib.request.Request:
    return urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})


def healthy(url: str) -> bool:
    try:
        with HTTP.open(f"{url}/health", timeout=5) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def start_server(options: ModelOptions, url: str, wait: float, log_level: str) -> subprocess.Popen:
    """`dflash-mlx serve` on `url`'s port, answering /health within `wait` seconds, with its
    prompt cache kept on disk across launches (an agent's long system prompt is read back
    instead of prefilled again); its output goes to a log file beside that cache (on the
    terminal it would tear through the agent's screen)."""
    port = url.rsplit(":", 1)[1]
    prompt_cache = cache_dir() / "prompt-cache"
    serve = ["serve", *options.serve_arguments(), "--host", HOST, "--port", port, "--log-level", log_level]
    serve += ["--prompt-cache-dir", str(prompt_cache)]
    log = cache_dir() / "logs" / f"serve-{time.strftime('%Y%m%d-%H%M%S')}-{port}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    prompt_cache.mkdir(parents=True, exist_ok=True)
    say(f"starting dflash-mlx {' '.join(serve)} (log: {log})")
    with open(log, "ab") as out:
        # a session of its own: Ctrl-C typed into the agent (which interrupts a turn there) reaches
        # the terminal's whole process group, and must not stop the server under it
        server = subprocess.Popen(
            [sys.executable, "-m", "dflash_mlx.cli", *serve],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    try:
        wait_until_healthy(server, url, wait, log)
    except BaseException:
        stop_server(server)
        raise
    return server


def wait_until_healthy(server: subprocess.Popen, url: str, wait: float, log: Path) -> None:
    deadline = time.monotonic() + wait
    while not healthy(url):
        if server.poll() is not None:
            raise LaunchError(f"dflash-mlx serve stopped before it was ready: {last_line(log)} (log: {log})")
        if time.monotonic() > deadline:
            raise LaunchError(
                f"dflash-mlx serve did not answer {url}/health within {wait:.0f} s (still downloading or "
                f"loading the model? see {log}; --wait gives it longer)"
            )
        time.sleep(0.25)


def last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def stop_server(server: subprocess.Popen) -> None:
    """SIGTERM, which drains the server (running requests finish, the prompt cache is written);
    killed if it has not stopped long after the drain's deadline, or at a second Ctrl-C."""
    if server.poll() is not None:
        return
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=DRAIN_SECONDS + 30)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        server.kill()
        server.wait()


def run_agent(argv: list[str], env: dict[str, str]) -> int:
    """The agent in the foreground, until it exits; its exit status (128 + N when killed by signal N)."""
    agent = subprocess.Popen(argv, env=env)
    # Ctrl-C reaches the agent too, whose own keys say what it does; here it must not interrupt
    # the wait, which could then reap the agent without keeping its exit status
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        status = agent.wait()
        return status if status >= 0 else 128 - status
    finally:
        signal.signal(signal.SIGINT, previous)
        if agent.poll() is None:  # the launcher itself was stopped (SIGTERM, SIGHUP)
            agent.terminate()
            try:
                agent.wait(timeout=10)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()


@contextlib.contextmanager
def stop_signals_raise():
    """SIGTERM and SIGHUP (a closed terminal) raise SystemExit inside the block instead of
    ending the launcher at once, so its `finally` stops the server it started."""

    def raise_exit(signum, frame):
        raise SystemExit(128 + signum)

    previous = {s: signal.signal(s, raise_exit) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def context_window(model_id: str, quant: Optional[int]) -> Optional[int]:
    """The served model's window (`max_position_embeddings`, what the server checks requests
    against) from its config.json on this machine; None when that cannot be found.  GET
    /v1/models does not say it, so the config is found from the served name as the server did."""
    try:
        paths = [config_file(target) for target in model_sources(model_id, quant)]
        path = next((p for p in paths if p is not None), None)
        config = json.loads(path.read_text()) if path else {}
    except (ValueError, OSError):
        return None
    window = config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")
    return window if isinstance(window, int) and window > 0 else None


def model_sources(model_id: str, quant: Optional[int]) -> list[str]:
    """The folders or repos the server may have loaded `model_id` from: without --quant it loads
    the variant of a short name that fits the machine, and every variant has the same window."""
    from ..api.registry import DEFAULT_MODEL, PUBLISHED, VARIANTS, resolve, variant_repo

    if model_id in PUBLISHED:
        return [variant_repo(PUBLISHED[model_id], q) for q in dict.fromkeys((quant, *VARIANTS))]
    if model_id == DEFAULT_MODEL:  # its converted folders, whichever dtype (never converted here)
        return [
            str(config.parent) for config in sorted((cache_dir() / "models").glob(f"{DEFAULT_MODEL}-*/config.json"))
        ]
    return [resolve(model_id, quant=quant).target]


def config_file(target: str) -> Optional[Path]:
    """A local model dir's config.json, or a Hugging Face repo's from the local cache (never fetched)."""
    local = Path(target).expanduser() / "config.json"
    if local.is_file():
        return local
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(target, "config.json")
    return Path(cached) if isinstance(cached, str) else None


def say_reused(url: str, served_model: str, options: ModelOptions) -> None:
    say(f"reusing the dflash-mlx server at {url} (serving {served_model}; it stays running)")
    if options.serve_arguments():
        say("note: the model options apply to a server started here, not to the one reused")


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
