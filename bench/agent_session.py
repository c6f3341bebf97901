"""Multi-turn agent sessions replayed against `dflash-mlx serve` and `mlx_lm.server`.

What an agent (Claude Code, OpenCode, Cline, Aider) sends: a long system prompt with tool schemas,
a file read back in a tool result, turns that ask for the whole file rewritten with a small change,
the model's own answers kept in the conversation.  Ours is driven as Claude Code drives it (the
Anthropic Messages API, streamed); mlx_lm.server through the OpenAI API with the same messages,
which both render to the same prompt with the model's chat template.  Each session runs on each
server in turn (theirs, then ours), one session alone and `--together` sessions at once; reported
per server: time to first token per turn (medians over sessions), whole-session time, decode tok/s,
the server's peak RSS, and whether the answers are equal.  With `--reps`, each level runs that many
times on fresh servers, the servers taking turns to go first; medians over the reps.  The sessions are written here (never
benchmark prompts).

    python bench/agent_session.py --turns 5 --together 4 --reps 3 --out bench/results/agent-session

`--think S`: each session waits S seconds after every answer before its next turn (an agent
running its tools; the server is idle meanwhile), not counted in the session time.

`--restart` replays one session against ours with a `--prompt-cache-dir`, stops the server, starts it
again on the folder and asks the session's first turn again (its TTFT against the warm turns').
`--soak N` runs N sessions one after another against ours alone instead, and reports the server's
resident memory after each (memory must stay flat once the prompt cache is full):

    python bench/agent_session.py --soak 50 --turns 3 --max-tokens 64 --out bench/results/agent-soak
"""

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).parent.parent))
sys.path.insert(0, str(Path(__file__).parent))

from serve_batch import start_ours, start_servers, stop  # noqa: E402

from dflash_mlx.bench.harness import report  # noqa: E402

TOOLS = """You are a coding agent working in the user's repository. You can call these tools:
- read_file(path: string): returns the file's text.
- write_file(path: string, content: string): replaces the file with `content`.
- run(command: string): runs a shell command and returns its output.
- search(pattern: string, path: string): lists the lines matching `pattern`.
When you change a file, answer with the whole new file in one ```python block and nothing else."""

SOURCE = '''import json
from pathlib import Path


def load_tasks(path):
    """Read the task list from a JSON file."""
    return json.loads(Path(path).read_text())


def save_tasks(path, tasks):
    Path(path).write_text(json.dumps(tasks, indent=2))


def add_task(tasks, title, priority=1):
    task = {"id": len(tasks) + 1, "title": title, "priority": priority, "done": False}
    tasks.append(task)
    return task


def complete_task(tasks, task_id):
    for task in tasks:
        if task["id"] == task_id:
            task["done"] = True
            return task
    raise KeyError(task_id)


def pending(tasks):
    return [task for task in tasks if not task["done"]]


def by_priority(tasks):
    return sorted(tasks, key=lambda task: task["priority"], reverse=True)
'''

CODING = [
    "Add a docstring to save_tasks. Return the whole file.",
    "Rename the function pending to open_tasks. Return the whole file.",
    "Make add_task refuse an empty title with a ValueError. Return the whole file.",
    "Add a function remove_task(tasks, task_id) after complete_task. Return the whole file.",
    "Sort by_priority by title as well when priorities are equal. Return the whole file.",
    "Add type hints to load_tasks and save_tasks. Return the whole file.",
]

ESSAY = """Working from home has changed how teams communicate. Meetings moved to video calls,
and many quick questions now happen in chat. Some people enjoy the quiet and the time saved on
commuting, while others miss the energy of an office. Managers worry about new hires who learn
less by watching their colleagues. Good habits help: a shared calendar, written decisions, and a
weekly call where everyone can speak."""

WRITING = [
    "Make the first sentence more vivid. Return the whole paragraph.",
    "Add a sentence about time zones after the second sentence. Return the whole paragraph.",
    "Replace 'Managers worry' with a gentler phrase. Return the whole paragraph.",
    "End the paragraph with a one-sentence summary. Return the whole paragraph.",
    "Split the paragraph into two paragraphs where it fits best. Return the text.",
    "Fix any repetition you notice. Return the whole text.",
]


def sessions(count: int, turns: int) -> list[dict]:
    """Coding and writing sessions in turn; each starts with the file or text in a tool result."""
    out = []
    for k in range(count):
        if k % 2 == 0:
            system = TOOLS
            opening = f"read_file('tasks.py') returned:\n```python\n{SOURCE}```\n{CODING[0]}"
            asks = CODING[1:]
        else:
            system = "You are a careful editor. Keep the author's voice and return the whole text each time."
            opening = f"Here is my draft:\n\n{ESSAY}\n\n{WRITING[0]}"
            asks = WRITING[1:]
        out.append({"system": system, "turns": [opening] + asks[k // 2 % len(asks) :][: turns - 1]})
    return out


def replay_ours(port: int, session: dict, max_tokens: int, think: float = 0.0) -> list[dict]:
    import anthropic

    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="none", max_retries=0, timeout=3600)
    messages, turns = [], []
    for ask in session["turns"]:
        time.sleep(think if turns else 0.0)  # the agent acting on the last answer
        messages.append({"role": "user", "content": ask})
        tic, first, text = time.perf_counter(), None, ""
        with client.messages.stream(
            model="local", system=session["system"], messages=messages, max_tokens=max_tokens
        ) as stream:
            for piece in stream.text_stream:
                first = first or time.perf_counter()
                text += piece
            usage = stream.get_final_message().usage
        done = time.perf_counter()
        messages.append({"role": "assistant", "content": text})
        turns.append(dict(ttft=(first or done) - tic, seconds=done - tic, tokens=usage.output_tokens, text=text))
    return turns


def replay_theirs(port: int, session: dict, max_tokens: int, think: float = 0.0) -> list[dict]:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=3600)
    messages, turns = [{"role": "system", "content": session["system"]}], []
    for ask in session["turns"]:
        time.sleep(think if turns else 0.0)  # the agent acting on the last answer
        messages.append({"role": "user", "content": ask})
        tic, first, text, tokens = time.perf_counter(), None, "", 0
        stream = client.chat.completions.create(
            model="default_model",
            messages=messages,
            max_tokens=max_tokens,
            stream=True,
            temperature=0.0,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text += chunk.choices[0].delta.content
        done = time.perf_counter()
        messages.append({"role": "assistant", "content": text})
        turns.append(dict(ttft=(first or done) - tic, seconds=done - tic, tokens=tokens, text=text))
    return turns


def rss_mb(pid: int) -> float:
    """The process's peak resident set (VmHWM), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def current_rss_mb(pid: int) -> float:
    """The process's resident set now (VmRSS), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def prompt_cache_mb(port: int) -> float:
    """What the server's prompt cache holds in memory (its /metrics gauge), in MB."""
    import re
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    return int(re.search(r"^dflash_prefix_cache_bytes (\d+)$", text, re.M).group(1)) / 2**20


def soak(count: int, turns: int, max_tokens: int, out) -> None:
    """`count` sessions in a row against ours: its RSS after each, flat after the fifth?  And
    the prompt cache's part of it (states kept for the sessions' next turns)."""
    from dflash_mlx.bench.harness import machine

    ours, port = start_ours(2)
    rss, cached = [], []
    try:
        for k, session in enumerate(sessions(count, turns)):
            replay_ours(port, session, max_tokens)
            rss.append(current_rss_mb(ours.pid))
            cached.append(prompt_cache_mb(port))
            print(f"session {k + 1}: RSS {rss[-1]:.0f} MB, prompt cache {cached[-1]:.0f} MB", flush=True)
    finally:
        stop(ours)
    base = min(4, len(rss) - 1)
    lines = [
        f"Machine: {machine()}",
        f"Command: python {' '.join(sys.argv)}",
        "",
        f"{count} sessions of {turns} turns in a row: RSS after session 5 {rss[base]:.0f} MB, after session {count} "
        f"{rss[-1]:.0f} MB ({100 * (rss[-1] / rss[base] - 1):+.1f}%), largest after session 5 "
        f"{max(rss[4:] or rss):.0f} MB; the prompt cache held {cached[base]:.0f} MB after session 5, "
        f"{cached[-1]:.0f} MB after session {count}",
        "",
        "| after session | RSS MB | prompt cache MB |",
        "|---|---|---|",
        *(f"| {k + 1} | {r:.0f} | {c:.0f} |" for k, (r, c) in enumerate(zip(rss, cached)) if k < 5 or (k + 1) % 5 == 0),
    ]
    report(lines, out, "results.md", {"rss_mb": rss, "prompt_cache_mb": cached})


def restart(turns: int, max_tokens: int, out) -> None:
    """A session against ours with a prompt-cache folder; the server stopped (SIGTERM) and started
    again on the folder; the session's first turn asked again: its TTFT against the warm turns'."""
    import tempfile

    from dflash_mlx.bench.harness import machine

    session = sessions(1, turns)[0]
    with tempfile.TemporaryDirectory() as folder:
        first = []
        for run in range(2):
            ours, port = start_ours(2, "--prompt-cache-dir", folder)
            try:
                chosen = session if run == 0 else {**session, "turns": session["turns"][:1]}
                first.append([t["ttft"] for t in replay_ours(port, chosen, max_tokens)])
            finally:
                stop(ours, timeout=120)
    warm = median(first[0][1:])
    lines = [
        f"Machine: {machine()}",
        f"Command: python {' '.join(sys.argv)}",
        "",
        f"First turn cold {first[0][0]:.2f} s; later turns (warm) {' / '.join(f'{t:.2f}' for t in first[0][1:])} s; "
        f"the first turn again after a restart on the folder: {first[1][0]:.2f} s "
        f"({first[1][0] / warm:.2f}x the warm median)",
    ]
    report(lines, out, "restart.md")


def run_level(replay, port: int, chosen: list[dict], max_tokens: int, think: float = 0.0) -> dict:
    """The sessions at once; their wall time without the think time between turns (every
    session has as many turns and thinks as long, at the same time)."""
    tic = time.perf_counter()
    with ThreadPoolExecutor(len(chosen)) as pool:
        results = list(pool.map(lambda s: replay(port, s, max_tokens, think), chosen))
    turns = max(len(r) for r in results)
    wall = time.perf_counter() - tic - think * (turns - 1)
    ttft = [[r[t]["ttft"] for r in results if t < len(r)] for t in range(turns)]
    decode = sum(t["tokens"] for r in results for t in r) / sum(t["seconds"] - t["ttft"] for r in results for t in r)
    return dict(session_seconds=wall, ttft=ttft, decode_tok_s=decode, texts=[[t["text"] for t in r] for r in results])


SERVERS = {"mlx_lm.server": replay_theirs, "dflash-mlx": replay_ours}


def run_rep(together: int, turns: int, max_tokens: int, ours_first: bool, think: float = 0.0) -> tuple[dict, dict]:
    """The sessions on fresh servers (no state carried over), one server after the other:
    each server's run and peak RSS."""
    from dflash_mlx.convert.smollm2 import smollm2_path

    (ours, ours_port), (theirs, theirs_port) = start_servers(smollm2_path(None), max(together, 2))
    ports = {"mlx_lm.server": theirs_port, "dflash-mlx": ours_port}
    try:
        chosen = sessions(together, turns)
        runs = {}
        for name in sorted(SERVERS, reverse=not ours_first):  # "dflash-mlx" sorts first
            runs[name] = run_level(SERVERS[name], ports[name], chosen, max_tokens, think)
            print(
                f"{together} session(s), {name}: {runs[name]['session_seconds']:.1f} s, TTFT per turn "
                f"{' '.join(f'{median(t):.2f}' for t in runs[name]['ttft'])} s, decode "
                f"{runs[name]['decode_tok_s']:.1f} tok/s",
                flush=True,
            )
        return runs, {"mlx_lm.server": rss_mb(theirs.pid), "dflash-mlx": rss_mb(ours.pid)}
    finally:
        stop(ours, theirs)


def summary(reps: list[dict]) -> dict:
    """One level's reps: per server the median session time, decode tok/s and each turn's TTFT
    (over sessions and reps); the speedups (theirs / ours session time) of each rep; answers equal in all."""
    out = {"speedups": [r["mlx_lm.server"]["session_seconds"] / r["dflash-mlx"]["session_seconds"] for r in reps]}
    for name in SERVERS:
        runs = [r[name] for r in reps]
        out[name] = dict(
            session_seconds=median(run["session_seconds"] for run in runs),
            decode_tok_s=median(run["decode_tok_s"] for run in runs),
            ttft=[median(t for run in runs for t in run["ttft"][turn]) for turn in range(len(runs[0]["ttft"]))],
        )
    out["equal_answers"] = all(r["dflash-mlx"]["texts"] == r["mlx_lm.server"]["texts"] for r in reps)
    return out


def plot_ttft(levels: dict, out: Path) -> None:
    from dflash_mlx.bench.plots import _pyplot

    plt = _pyplot()
    fig, axes = plt.subplots(1, len(levels), figsize=(5 * len(levels), 3.5), squeeze=False)
    for ax, (together, level) in zip(axes[0], levels.items()):
        for name in SERVERS:
            ax.plot(range(1, len(level[name]["ttft"]) + 1), level[name]["ttft"], marker="o", label=name)
        ax.set(title=f"{together} session(s) at once", xlabel="turn", ylabel="time to first token (s)")
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ttft_per_turn.png", dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--together", type=int, default=4, help="sessions at once in the second level")
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--reps", type=int, default=1, help="runs of each level on fresh servers, in turn first")
    parser.add_argument(
        "--think",
        type=float,
        default=0.0,
        help="seconds each session waits after an answer (an agent running its tools); not in the session time",
    )
    parser.add_argument("--out", default=None, help="folder for results.json, results.md and the TTFT plot")
    parser.add_argument("--soak", type=int, default=0, help="instead: this many sessions in a row against ours")
    parser.add_argument(
        "--restart",
        action="store_true",
        help="instead: a session, a restart on the prompt-cache folder, its first turn",
    )
    args = parser.parse_args()

    import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)

    if args.soak:
        return soak(args.soak, args.turns, args.max_tokens, args.out)
    if args.restart:
        return restart(args.turns, args.max_tokens, args.out)
    from dflash_mlx.bench.harness import machine

    levels, peak, raw = {}, {}, {}
    for together in sorted({1, args.together}):
        reps = [
            run_rep(together, args.turns, args.max_tokens, ours_first=rep % 2 == 1, think=args.think)
            for rep in range(args.reps)
        ]
        raw[together] = [runs for runs, _ in reps]
        levels[together] = summary(raw[together])
        peak[together] = {name: max(rss[name] for _, rss in reps) for name in SERVERS}
    lines = [
        f"Machine: {machine()}",
        f"Command: python {' '.join(sys.argv)}",
        "",
        f"Medians over {args.reps} rep(s), each on fresh servers, the two servers in turn first"
        + (f"; {args.think:g} s of think time after each answer, not counted in session time." if args.think else "."),
        "",
        "| sessions at once | server | session s | speedup (reps) | TTFT per turn (s, median over sessions and reps) | "
        "decode tok/s | answers equal |",
        "|---|---|---|---|---|---|---|",
    ]
    for together, level in levels.items():
        for name in SERVERS:
            row = level[name]
            speedup = (
                f"{median(level['speedups']):.2f}x ({', '.join(f'{x:.2f}' for x in level['speedups'])})"
                if name == "dflash-mlx"
                else "1.00x"
            )
            lines.append(
                f"| {together} | {name} | {row['session_seconds']:.1f} | {speedup} | "
                f"{' / '.join(f'{t:.2f}' for t in row['ttft'])} | {row['decode_tok_s']:.1f} | "
                f"{'yes' if level['equal_answers'] else 'no'} |"
            )
    for together, rss in peak.items():
        lines.append(
            f"\nPeak RSS at {together} session(s): mlx_lm.server {rss['mlx_lm.server']:.0f} MB, "
            f"dflash-mlx {rss['dflash-mlx']:.0f} MB"
        )
    report(lines, args.out, "results.md", {"levels": levels, "reps": raw, "peak_rss_mb": peak})
    if args.out:
        plot_ttft(levels, Path(args.out))


if __name__ == "__main__":
    main()
