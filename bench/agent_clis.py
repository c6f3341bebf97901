"""The real coding-agent CLIs through `dflash-mlx launch`, their tool loops with a scripted model.

Claude Code, Codex CLI and OpenCode (the versions in PINNED, installed by npm into the cache
folder on first use) are each launched on a server whose engine is replaced by a script
(tests/scripted_engine.py): asked to create a file, the "model" answers with a call of the agent's
own file-writing tool in the served family's format; the agent runs it and sends its result back;
the model then answers in text, and the agent exits.  Every request is answered by the real HTTP
server (the Anthropic Messages API for Claude Code, Responses for Codex, chat completions for
OpenCode); only the tokens are scripted.  Reported per agent: exit status, whether the file holds
what the call wrote, its requests (route and status), its first request's prompt tokens with the
served tokenizer, and seconds.

    python bench/agent_clis.py --loopback-only --out bench/results/agent-clis   # SmolLM2's tokenizer
    python bench/agent_clis.py --agents codex --model path/to/model             # another tokenizer

`--loopback-only` runs the sessions in a network namespace of their own with only loopback up
(`unshare -rn`), so nothing reaches beyond the machine: the CLIs are installed first, and
OpenCode's provider package must already be in its cache (~/.cache/opencode, from one run with
the network).

tests/test_agent_clis.py runs the same sessions on the tiny test model (slow tests).
"""

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).parent.parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

from dflash_mlx.io.storage import cache_dir  # noqa: E402

PINNED = {
    "claude": "@anthropic-ai/claude-code@2.1.197",
    "codex": "@openai/codex@0.171.0",
    "opencode": "opencode-ai@1.18.33",
}
FILE = "hello.txt"
CONTENT = "written by the scripted model\n"  # in the prompt only once the agent has run the call
ASK = f"Create the file {FILE}."
TIMEOUT = 300.0  # seconds an agent's session may take (the scripted model answers at once)
ENDLESS = "a"  # the never-ending model's every token
TOO_LONG = re.compile(r"prompt is too long: (\d+) tokens")
ANSWERED = re.compile(r"prompt=(\d+) cached=\d+ generated=(\d+)")
PATCH = f"*** Begin Patch\n*** Add File: {FILE}\n+{CONTENT.rstrip()}\n*** End Patch\n"


def installed_clis(folder: Optional[Path] = None) -> tuple[Optional[Path], str]:
    """The folder holding the pinned CLIs' executables (installed by npm into `folder` if they are
    not there yet), or None and why not."""
    folder = folder or cache_dir() / "agent-clis"
    bin_dir = folder / "node_modules" / ".bin"
    if all(installed_version(folder, spec) for spec in PINNED.values()):
        return bin_dir, ""
    npm = shutil.which("npm")
    if npm is None:
        return None, "npm is not installed (the agent CLIs come from npm: apt-get install npm, or nodejs.org)"
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [npm, "install", "--prefix", str(folder), "--no-audit", "--no-fund", *PINNED.values()],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0 or not all(installed_version(folder, spec) for spec in PINNED.values()):
        return None, f"npm could not install {' '.join(PINNED.values())}: {done.stderr.strip()[-300:]}"
    return bin_dir, ""


def installed_version(folder: Path, spec: str) -> bool:
    name, version = spec.rsplit("@", 1)
    package = folder / "node_modules" / name / "package.json"
    return package.is_file() and json.loads(package.read_text()).get("version") == version


def agent_arguments(agent: str) -> list[str]:
    """The agent's arguments after `launch AGENT --`: one prompt, no questions asked."""
    if agent == "claude":  # Read and Write only: its first request fits a small window
        return ["-p", ASK, "--tools", "Read,Write", "--permission-mode", "acceptEdits"]
    if agent == "codex":
        return ["exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", ASK]
    return ["run", ASK]


def tool_call(agent: str, folder: Path, prompt: str) -> Optional[dict]:
    """The call of the agent's file-writing tool, if this request offers it (a title request does not)."""
    if agent == "claude" and '"name": "Write"' in prompt:
        return {"name": "Write", "arguments": {"file_path": str(folder / FILE), "content": CONTENT}}
    if agent == "opencode" and '"name": "write"' in prompt:
        return {"name": "write", "arguments": {"filePath": str(folder / FILE), "content": CONTENT}}
    if agent == "codex" and '"name": "apply_patch"' in prompt:
        return {"name": "apply_patch", "arguments": {"input": PATCH}}
    if agent == "codex" and '"name": "exec_command"' in prompt:  # its tools for a model it has no metadata for
        return {"name": "exec_command", "arguments": {"cmd": f"apply_patch <<'EOF'\n{PATCH}EOF\n"}}
    return None


def scripted_reply(agent: str, folder: Path, tokenizer, seen: list[dict]):
    """The script: a call of the file-writing tool where one is offered and none was made yet,
    else a short answer; each request's prompt tokens and what it got are kept in `seen`."""

    def reply(prompt: list[int]) -> list[str]:
        text = tokenizer.decode(prompt)
        call = None if CONTENT.rstrip() in text else tool_call(agent, folder, text)
        answered = CONTENT.rstrip() in text
        seen.append({"prompt_tokens": len(prompt), "answer": "tool call" if call else "text", "after_result": answered})
        if call is None:
            return ["Done: ", f"{FILE} ", "is written."] if answered else ["Hello ", "file"]
        body = call_text(tokenizer, call)
        return [body[:12], body[12:]]

    return reply


def call_text(tokenizer, call: dict) -> str:
    """`call` as the served family writes it: `<tool_call>{json}</tool_call>` (Qwen3's, and the
    convention of templates without tools, SmolLM2's and the tiny test model's)."""
    from dflash_mlx.serve.tools import call_syntax

    syntax = call_syntax(tokenizer)
    if syntax.format != "json_tools":
        raise ValueError(f"the script writes json_tools calls; this tokenizer's are {syntax.format}")
    return syntax.start + json.dumps(call) + syntax.end


class Recorder:
    """ASGI middleware keeping every POST's path and JSON body, in order, before the app reads it."""

    def __init__(self, app, kept: list[dict]):
        self.app, self.kept = app, kept

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        messages, body = [], b""
        while True:
            message = await receive()
            messages.append(message)
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.kept.append({"path": scope["path"], "body": json.loads(body or b"null")})

        async def replay():
            return messages.pop(0) if messages else await receive()

        return await self.app(scope, replay, send)


@contextmanager
def scripted_server(model, tokenizer, engine, model_id: str = "scripted", record: Optional[list] = None):
    """The real server on a free loopback port, its engine replaced by `engine` (a scripted
    batch: tests/scripted_engine.py; model_id: a name `launch` cannot find a window for, so every
    agent is run with its own defaults, or a model folder whose window it reads); each POST's
    path and body appended to `record` where one is given."""
    from live_server import live_server

    from dflash_mlx.serve import worker

    original = worker.BatchGenerator
    worker.BatchGenerator = engine
    try:
        wrap = None if record is None else partial(Recorder, kept=record)
        with live_server(model, tokenizer, model_id, wrap=wrap, prompt_cache_bytes=0) as served:
            yield served
    finally:
        worker.BatchGenerator = original


def run_session(
    agent: str,
    model,
    tokenizer,
    bin_dir: Path,
    timeout: float = TIMEOUT,
    arguments: Optional[list[str]] = None,
    record: Optional[list] = None,
    endless: Optional[str] = None,
    first_request: Optional[int] = None,
) -> dict:
    """One agent's scripted session through `dflash-mlx launch --port` (with `arguments` after
    --, else agent_arguments'); what happened.  Its POST bodies are appended to `record` where one
    is given.  `endless`: the path of the served model's folder, whose window `launch` then reads,
    and a model that never ends its answers instead of the tool script.  `first_request`: the
    agent run without `launch` but told what `launch` would tell it were its first request that
    many tokens (the served tokenizer's count, where launch's measured sizes are SmolLM2's)."""
    import logging

    from scripted_engine import endless_batch, scripted_batch

    seen: list[dict] = []
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    keep = Keep()
    access = logging.getLogger("dflash_mlx.serve")  # its access lines, and refusals with their reason
    access.addHandler(keep)
    previous_level = access.level
    access.setLevel(logging.INFO)
    with tempfile.TemporaryDirectory(prefix=f"agent-{agent}-") as work:
        folder = Path(work) / "project"
        folder.mkdir()
        # a repository, as a project is (OpenCode asks before writing outside its worktree, and a
        # folder that is none has none)
        subprocess.run(["git", "init", "-q", str(folder)], check=True)
        home = Path(work) / "home"  # the agent's own settings and sessions: none of the user's
        home.mkdir()
        env = {
            **os.environ,
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "HOME": str(home),
            "CODEX_HOME": str(home / ".codex"),
            "XDG_CONFIG_HOME": str(home / ".config"),
            "XDG_DATA_HOME": str(home / ".local" / "share"),
            "XDG_CACHE_HOME": os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache")),  # OpenCode's npm packages
            "XDG_STATE_HOME": str(home / ".local" / "state"),
            "PWD": str(folder),  # OpenCode takes its project folder from it
        }
        env.pop("DFLASH_MLX_API_KEY", None)
        (home / ".codex").mkdir()
        if endless:
            engine, model_id = endless_batch(ENDLESS), endless
        else:
            engine, model_id = scripted_batch(scripted_reply(agent, folder, tokenizer, seen)), "scripted"
        try:
            with scripted_server(model, tokenizer, engine, model_id, record=record) as served:
                launch = [sys.executable, "-m", "dflash_mlx.cli", "launch", agent, "--port", str(served.port), "--"]
                if first_request is not None:
                    launch, told = told_directly(bin_dir / agent, served, model_id, first_request)
                    env.update(told)
                started = time.monotonic()
                try:
                    done = subprocess.run(
                        [*launch, *(arguments or agent_arguments(agent))],
                        cwd=folder,
                        stdin=subprocess.DEVNULL,
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=timeout,
                    )
                    status, out, err = done.returncode, done.stdout, done.stderr
                except subprocess.TimeoutExpired as e:
                    status, out, err = "timeout", str(e.stdout or ""), str(e.stderr or "")
                seconds = time.monotonic() - started
        finally:
            access.removeHandler(keep)
            access.setLevel(previous_level)
        written = (folder / FILE).read_text() if (folder / FILE).is_file() else None
    requests = [request_of(line) for line in lines if not line.startswith("refused ")]
    answered = [tuple(map(int, m.groups())) for m in map(ANSWERED.search, lines) if m]
    refusals = [line for line in lines if line.startswith("refused ")]
    too_long = [int(m.group(1)) for m in map(TOO_LONG.search, refusals) if m]
    return {
        "agent": agent,
        "version": PINNED[agent].rsplit("@", 1)[1],
        "exit": status,
        "file_written": written == CONTENT,
        "answers": [s["answer"] for s in seen],
        # the agent's first request: the largest before a tool result came back (a title request's is smaller)
        "first_prompt_tokens": max((s["prompt_tokens"] for s in seen if not s["after_result"]), default=None)
        or max(too_long, default=None),  # refused as longer than the window: its size is in the refusal
        "refusals": refusals,
        "prompt_tokens": [s["prompt_tokens"] for s in seen],
        "requests": [r for r in requests if r],
        "answered": answered,  # (prompt tokens, tokens generated) of each answer, in the order they ended
        "seconds": round(seconds, 1),
        "stdout": out[-1500:],
        "stderr": err[-1500:],
    }


def told_directly(executable: Path, served, model_id: str, first_request: int) -> tuple[list[str], dict[str, str]]:
    """The agent's command and environment as `launch` would make them for `served` with a
    first request of `first_request` tokens."""
    from dflash_mlx.serve.agents import AGENTS, Served, plan
    from dflash_mlx.serve.launch import context_window

    agent, window = AGENTS[executable.name], context_window(model_id, None)
    args, env = agent.configure(Served(served.base, "none", model_id, window), plan(agent, window, first_request))
    return [str(executable), *args], env


def request_of(line: str) -> Optional[str]:
    """An access line's `METHOD /path STATUS`."""
    try:
        request, rest = line.split('"', 2)[1:]
    except ValueError:
        return None
    method, path = request.split(" ")[:2]
    return f"{method} {path.split('?')[0]} {rest.split()[0]}"


def table(results: list[dict]) -> list[str]:
    lines = [
        "| agent | version | exit | file written | requests (status) | first request tokens | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        counts: dict[str, int] = {}
        for request in r["requests"]:
            counts[request] = counts.get(request, 0) + 1
        listed = ", ".join(f"{n}x {request}" for request, n in counts.items())
        lines.append(
            f"| {r['agent']} | {r['version']} | {r['exit']} | {'yes' if r['file_written'] else 'no'} | {listed} "
            f"| {r['first_prompt_tokens']} | {r['seconds']} |"
        )
    return lines


ISOLATED_ENV = "DFLASH_MLX_AGENT_CLIS_ISOLATED"  # set inside the loopback-only namespace


def loopback_only(argv: list[str]) -> Optional[list[str]]:
    """`argv` run in a network namespace of its own with only loopback up (no way out of the
    machine), or None where this system cannot make one (no unshare, no user namespaces)."""
    unshare, ip = shutil.which("unshare"), shutil.which("ip")
    if unshare is None or ip is None or subprocess.run([unshare, "-rn", "true"], capture_output=True).returncode:
        return None
    return [unshare, "-rn", "sh", "-c", f'{ip} link set lo up && exec "$@"', "sh", *argv]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", default="claude,codex,opencode")
    parser.add_argument(
        "--model", default=None, help="Whose tokenizer and chat template (default: SmolLM2-135M-Instruct)."
    )
    parser.add_argument("--out", default=None, help="Folder for results.json and table.md.")
    parser.add_argument(
        "--args", default=None, help="The agent's arguments instead of the tool task (one agent), e.g. '-p hi --bare'."
    )
    parser.add_argument(
        "--record",
        default=None,
        help="Write every POST the agents sent (path and JSON body, in order) to this JSON file.",
    )
    parser.add_argument(
        "--loopback-only",
        action="store_true",
        help="Run the sessions in a network namespace with only loopback (the CLIs installed first).",
    )
    args = parser.parse_args()
    bin_dir, why = installed_clis()
    if bin_dir is None:
        sys.exit(f"skipped: {why}")
    if args.loopback_only and not os.environ.get(ISOLATED_ENV):
        isolated = loopback_only([sys.executable, *sys.argv])
        if isolated is None:
            sys.exit("--loopback-only: this system cannot make a network namespace (unshare -rn)")
        os.execve(isolated[0], isolated, {**os.environ, ISOLATED_ENV: "1"})
    from dflash_mlx import load

    model, tokenizer = load(args.model, use_draft=False, adaptive=False)
    results, recorded = [], []
    for agent in args.agents.split(","):  # one at a time: the machine is shared
        arguments = shlex.split(args.args) if args.args else None
        session = run_session(agent, model, tokenizer, bin_dir, arguments=arguments, record=recorded)
        results.append({**session, "network": "loopback only" if os.environ.get(ISOLATED_ENV) else "host"})
        print(json.dumps({k: v for k, v in results[-1].items() if k not in ("stdout", "stderr")}), flush=True)
    lines = table(results)
    print("\n".join(lines))
    if args.record:
        Path(args.record).write_text(json.dumps(recorded, indent=1, ensure_ascii=False) + "\n")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results, indent=2))
        (out / "table.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
