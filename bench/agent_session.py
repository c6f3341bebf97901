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

`--shape claude-code` / `--shape codex` replays coding sessions as those agents send them, scaled to
SmolLM2's 8k window (system prompt + tools about 3.5k tokens), each picked up after its first tool
call (a scripted read of the file, in a tool result), the whole history every turn, tool calls the
model makes answered with canned outputs.  Claude Code: Anthropic Messages, streamed, the
billing-header system block first (a new cch every request), 22 tools, thinking, metadata,
anthropic-beta headers, max_tokens 32000 (the server cuts it to the context), a count_tokens
before each turn and a title request (max_tokens 32) between turns.  Codex: the Responses API,
streamed, instructions, input items, a custom apply_patch tool and function tools, reasoning,
include, store false, prompt_cache_key.  mlx_lm.server speaks neither API (nor count_tokens): it
gets the OpenAI chat messages our endpoint renders the request to (the same prompt, checked by
its length every turn; the parsing of its answers into tool calls is ours).  Reported besides:
the share of each turn's prompt read from the cache, each turn's prompt tokens and side-request
seconds, and whether the answers are equal.

    python bench/agent_session.py --shape claude-code --turns 4 --together 1 --reps 1 \\
        --out bench/results/agent-session/claude-code

`--think S`: each session waits S seconds after every answer before its next turn (an agent
running its tools; the server is idle meanwhile), not counted in the session time.

`--restart` replays one session against ours with a `--prompt-cache-dir`, stops the server, starts it
again on the folder and asks the session's first turn again (its TTFT against the warm turns').
`--soak N` runs N sessions one after another against ours alone instead, and reports the server's
resident memory after each (memory must stay flat once the prompt cache is full):

    python bench/agent_session.py --soak 50 --turns 3 --max-tokens 64 --out bench/results/agent-soak
"""

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache, partial
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


# ---------------------------------------------------------------- agent shapes (--shape claude-code | codex)
# Written here in the agents' request shapes (not their own prompts), scaled to SmolLM2's 8k window:
# system + tools about 3.5k tokens.

CLAUDE_VERSION = "2.1.12"
CLAUDE_BETAS = [
    "claude-code-20250219",
    "interleaved-thinking-2025-05-14",
    "fine-grained-tool-streaming-2025-05-14",
    "context-management-2025-06-27",
]
CLAUDE_HEADERS = {
    "x-app": "cli",
    "user-agent": f"claude-cli/{CLAUDE_VERSION} (external, cli)",
    "anthropic-dangerous-direct-browser-access": "true",
}
EPHEMERAL = {"type": "ephemeral"}

CLAUDE_SYSTEM = """You are an interactive command-line tool that helps users with software engineering tasks. Use the \
instructions below and the tools available to you to assist the user.

IMPORTANT: Assist with defensive security tasks only. Refuse to create, modify, or improve code that may be used \
maliciously. Never guess or invent URLs unless you are confident they help the user with programming.

# Tone and style
Be concise, direct, and to the point. Your output is shown in a terminal, rendered as GitHub-flavored markdown in a \
monospace font. Answer in fewer than four lines of text (tool calls and code excluded) unless the user asks for \
detail. Do not add a preamble or a postamble such as "Here is what I did" unless asked. Only use emojis if the user \
asks for them. Communicate with the user through your text only; never use tools such as Bash or code comments to \
talk to the user.

# Proactiveness
Be proactive only when the user asks you to do something: do the right thing, including follow-up actions, but do not \
surprise the user with actions they did not ask for. If the user asks how to approach something, answer the question \
first before you change anything.

# Following conventions
When you change a file, first understand its code conventions. Mimic the code style, use the existing libraries and \
utilities, and follow the existing patterns.
- Never assume that a library is available, even a well-known one. Check that the codebase already uses it (look at \
neighbouring files, or at package.json, pyproject.toml, cargo.toml and so on) before you write code that uses it.
- When you create a new component, look at the existing components first: their framework, naming, typing and other \
conventions.
- When you edit code, look at its surrounding context, especially its imports, to understand the frameworks and \
libraries it uses, and make the change in the most idiomatic way.
- Follow security best practices. Never write code that exposes or logs secrets and keys, and never commit them.

# Code style
- Do not add comments to the code you write unless the user asks for them or the code is complex and needs context.

# Task management
You have the TodoWrite tool to plan and track your tasks. Use it very frequently: it keeps you on track and shows the \
user your progress. It is also very helpful for breaking a larger task into smaller steps. Mark each todo as \
completed as soon as you are done with it; do not batch several tasks before marking them as completed.

# Doing tasks
The user will mostly ask you to do software engineering tasks: fix bugs, add functionality, refactor code, explain \
code, and more. For these tasks:
- Use the TodoWrite tool to plan the task if it needs planning.
- Use the search tools to understand the codebase and the user's query. Use them extensively, in parallel and one \
after the other.
- Implement the solution with all the tools available to you.
- Verify the solution with tests if you can. Never assume a particular test framework or test script: check the \
README or search the codebase for the testing approach.
- When you have completed a task, run the lint and typecheck commands (npm run lint, ruff, and so on) if they were \
given to you, to make sure that your code is correct.
- Never commit changes unless the user asks you to explicitly.

Tool results and user messages may include <system-reminder> tags. They carry useful information and reminders; \
they are added by the system and bear no direct relation to the tool results or user messages they appear in.

# Tool usage policy
- When you search files, prefer the Task tool to reduce context usage.
- Use the Task tool with specialized agents when the task at hand matches the agent's description.
- When WebFetch returns a message about a redirect to a different host, immediately make a new WebFetch request with \
the redirect URL it gives.
- You can call several tools in one answer. When you request several independent pieces of information, batch your \
tool calls together. When calls depend on each other, make them one after the other.
- Use specialized tools instead of bash commands when possible: Read to read files instead of cat, head or tail; \
Edit to edit instead of sed or awk; Write to create files instead of cat with a heredoc or echo.
- When exploring the codebase for context rather than a needle query for a specific file, use the Task tool with \
the Explore agent instead of running search commands directly.

You can use the following tools without asking the user for approval: Bash(pytest:*), Bash(ruff check:*), \
Bash(git status:*), Bash(git diff:*).

IMPORTANT: Always use the TodoWrite tool to plan and track tasks throughout the conversation.

# Code References
When you refer to specific functions or pieces of code, include the pattern `file_path:line_number` so that the user \
can navigate to the source easily.

Here is useful information about the environment you are running in:
<env>
Working directory: /home/user/app
Is directory a git repo: Yes
Platform: linux
OS Version: Linux 6.8.0-49-generic
Today's date: 2026-11-28
</env>
You are powered by the model named Sonnet 4.6. The exact model ID is claude-sonnet-4-6.

gitStatus: This is the git status at the start of the conversation. It is a snapshot in time and will not update \
during the conversation.
Current branch: main

Main branch (you will usually use this for PRs): main

Status:
M tasks.py

Recent commits:
3f2a9c1 Tasks have priorities
8be01d7 Save tasks as indented JSON
1c44e02 First version of the task list"""

CLAUDE_MD = """<system-reminder>
As you answer the user's questions, you can use the following context:
# claudeMd
Codebase and user instructions are shown below. Be sure to adhere to these instructions. IMPORTANT: These \
instructions OVERRIDE any default behavior and you MUST follow them exactly as written.

Contents of /home/user/app/CLAUDE.md (project instructions, checked into the codebase):

# tasks
- Python 3.11, standard library only.
- Run the tests with `pytest -q`; lint with `ruff check`.
- Keep functions small; no comments unless the code needs them.

      IMPORTANT: this context may or may not be relevant to your tasks. You should not respond to this context \
unless it is highly relevant to your task.
</system-reminder>
"""

TITLE_SYSTEM = """Decide whether this message starts a new conversation topic. If it does, give the topic a title \
of two or three words. Answer with a JSON object with two fields: "isNewTopic" (a boolean) and "title" (a string, \
or null when isNewTopic is false). Write nothing else."""


def _schema(required: list[str], /, **properties) -> dict:
    """A tool's input schema as Claude Code writes it (JSON Schema draft 7); a property given as a
    (type, description) pair or as its whole schema."""
    return {
        "type": "object",
        "properties": {
            name: {"type": spec[0], "description": spec[1]} if isinstance(spec, tuple) else spec
            for name, spec in properties.items()
        },
        "required": required,
        "additionalProperties": False,
        "$schema": "http://json-schema.org/draft-07/schema#",
    }


def _tool(name: str, description: str, required: list[str], /, **properties) -> dict:
    return {"name": name, "description": description, "input_schema": _schema(required, **properties)}


PATH = ("string", "The absolute path to the file")
CLAUDE_TOOLS = [
    _tool(
        "Task",
        "Launch an agent that handles a complex, multi-step task on its own.",
        ["description", "prompt", "subagent_type"],
        description=("string", "A short (3-5 word) description of the task"),
        prompt=("string", "The task for the agent to perform"),
        subagent_type=("string", "The type of specialized agent to use"),
    ),
    _tool(
        "Bash",
        "Run a bash command in a persistent shell session, with an optional timeout.",
        ["command"],
        command=("string", "The command to execute"),
        timeout=("number", "Optional timeout in milliseconds (max 600000)"),
        description=("string", "What this command does, in 5-10 words"),
        run_in_background=("boolean", "Run the command in the background"),
    ),
    _tool(
        "Glob",
        "Find files by name with a glob pattern such as **/*.py; sorted by modification time.",
        ["pattern"],
        pattern=("string", "The glob pattern to match files against"),
        path=("string", "The directory to search in"),
    ),
    _tool(
        "Grep",
        "Search file contents with a regular expression (ripgrep).",
        ["pattern"],
        pattern=("string", "The regular expression to search for"),
        path=("string", "File or directory to search in"),
        glob=("string", "Glob pattern to filter files"),
        output_mode={"type": "string", "enum": ["content", "files_with_matches", "count"]},
    ),
    _tool(
        "ExitPlanMode",
        "Present your plan to the user for approval and leave plan mode.",
        ["plan"],
        plan=("string", "The plan, concise, in markdown"),
    ),
    _tool(
        "Read",
        "Read a file from the local filesystem, with line numbers.",
        ["file_path"],
        file_path=PATH,
        offset=("number", "The line number to start reading from"),
        limit=("number", "The number of lines to read"),
    ),
    _tool(
        "Edit",
        "Replace an exact string in a file. Read the file first.",
        ["file_path", "old_string", "new_string"],
        file_path=PATH,
        old_string=("string", "The text to replace"),
        new_string=("string", "The text to replace it with"),
        replace_all=("boolean", "Replace all occurrences"),
    ),
    _tool(
        "Write",
        "Write a file to the local filesystem, replacing it if it exists.",
        ["file_path", "content"],
        file_path=PATH,
        content=("string", "The content to write to the file"),
    ),
    _tool(
        "NotebookEdit",
        "Replace, insert or delete a cell of a Jupyter notebook.",
        ["notebook_path", "new_source"],
        notebook_path=PATH,
        cell_id=("string", "The ID of the cell to edit"),
        new_source=("string", "The new source for the cell"),
    ),
    _tool(
        "WebFetch",
        "Fetch a URL and answer a prompt about its content.",
        ["url", "prompt"],
        url=("string", "The URL to fetch"),
        prompt=("string", "What to extract from the page"),
    ),
    _tool(
        "TodoWrite",
        "Create and update the structured task list of this session.",
        ["todos"],
        todos={
            "type": "array",
            "items": _schema(
                ["content", "status"],
                content=("string", "The task"),
                status={"type": "string", "enum": ["pending", "in_progress", "completed"]},
            ),
        },
    ),
    _tool(
        "WebSearch",
        "Search the web and use the results to inform answers.",
        ["query"],
        query=("string", "The search query to use"),
    ),
    _tool(
        "BashOutput",
        "Retrieve output from a running or completed background bash shell.",
        ["bash_id"],
        bash_id=("string", "The ID of the background shell"),
    ),
    _tool(
        "KillShell",
        "Kill a running background bash shell by its ID.",
        ["shell_id"],
        shell_id=("string", "The ID of the background shell to kill"),
    ),
    _tool(
        "Skill",
        "Execute a skill within the main conversation.",
        ["skill"],
        skill=("string", "The skill name"),
    ),
    _tool(
        "SlashCommand",
        "Execute a slash command within the main conversation.",
        ["command"],
        command=("string", "The slash command with its arguments"),
    ),
    _tool(
        "AskUserQuestion",
        "Ask the user a question with a few options to choose from.",
        ["question", "options"],
        question=("string", "The question to ask"),
        options={"type": "array", "items": {"type": "string"}},
    ),
    _tool("EnterPlanMode", "Enter plan mode to explore and design an approach before coding.", []),
    _tool(
        "ListMcpResourcesTool",
        "List the resources of the configured MCP servers.",
        [],
        server=("string", "Optional server name to filter by"),
    ),
    _tool(
        "ReadMcpResourceTool",
        "Read a resource from an MCP server.",
        ["server", "uri"],
        server=("string", "The MCP server name"),
        uri=("string", "The resource URI to read"),
    ),
    _tool(
        "mcp__ide__getDiagnostics",
        "Get language diagnostics from the editor.",
        [],
        uri=("string", "Optional file URI"),
    ),
    _tool(
        "mcp__ide__executeCode",
        "Execute Python code in the Jupyter kernel of the current notebook.",
        ["code"],
        code=("string", "The code to execute"),
    ),
]

CODEX_INSTRUCTIONS = """You are a coding agent running in the Codex CLI, a terminal-based coding assistant. You \
are expected to be precise, safe, and helpful.

Your capabilities:
- Receive user prompts and other context provided by the harness, such as files in the workspace.
- Communicate with the user by streaming thinking and responses, and by making and updating plans.
- Emit function calls to run terminal commands and apply patches. Depending on how this run is configured, you can \
request that these function calls be escalated to the user for approval before running.

# How you work

## Personality
Your default personality and tone is concise, direct, and friendly. You communicate efficiently, always keeping the \
user clearly informed about ongoing actions without unnecessary detail. Unless explicitly asked, you avoid excessively \
verbose explanations about your work.

## AGENTS.md spec
- Repos often contain AGENTS.md files. They can appear anywhere in the repository and give you instructions or tips \
for working in the container: coding conventions, how the code is organized, how to run or test it.
- The scope of an AGENTS.md file is the entire directory tree rooted at the folder that contains it. For every file \
you touch in the final patch, obey the instructions of every AGENTS.md file whose scope includes that file.
- More deeply nested AGENTS.md files take precedence when they conflict; direct instructions of the user take \
precedence over AGENTS.md instructions.

## Responsiveness
Before making tool calls, send a brief preamble to the user explaining what you are about to do: one or two \
sentences, focused on immediate, tangible next steps. Group related actions together rather than sending a note for \
every command. Build on prior context to create a sense of momentum.

## Planning
You have access to an `update_plan` tool which tracks steps and progress and renders them to the user. Use a plan \
when the task is non-trivial and will require multiple actions over a long time horizon, when there are logical \
phases or dependencies where sequencing matters, or when the user asked you to use the plan tool. Do not make plans \
for the simplest tasks. Do not repeat the full contents of the plan after an `update_plan` call.

## Task execution
Keep going until the query is completely resolved before ending your turn and yielding back to the user. Only \
terminate your turn when you are sure that the problem is solved. Autonomously resolve the query to the best of your \
ability, using the tools available to you, before coming back to the user. Do NOT guess or make up an answer.

You MUST adhere to the following criteria when solving queries:
- Working on the repos in the current environment is allowed, even if they are proprietary.
- Analyzing code for vulnerabilities is allowed.
- Showing user code and tool call details is allowed.
- Use the `apply_patch` tool to edit files (NEVER try `applypatch` or `apply-patch`, only `apply_patch`).

If completing the user's task requires writing or modifying files, your code and final answer should follow these \
coding guidelines, though user instructions (for example in AGENTS.md) may override them:
- Fix the problem at the root cause rather than applying surface-level patches, when possible.
- Avoid unneeded complexity in your solution.
- Do not attempt to fix unrelated bugs or broken tests. It is not your responsibility to fix them.
- Update documentation as necessary.
- Keep changes consistent with the style of the existing codebase. Changes should be minimal and focused on the task.
- Use `git log` and `git blame` to search the history of the codebase if additional context is required.
- NEVER add copyright or license headers unless specifically requested.
- Do not `git commit` your changes or create new git branches unless explicitly requested.
- Do not add inline comments within code unless explicitly requested.
- Do not use one-letter variable names unless explicitly requested.

## Sandbox and approvals
The Codex CLI harness supports several configurations for sandboxing and escalation approvals. Filesystem \
sandboxing prevents you from editing files without user approval: read-only, workspace-write or \
danger-full-access. Network sandboxing prevents you from accessing the network without approval. When you need to \
run a command that requires escalated permissions (writing outside the workspace, the network), ask for them with \
the `with_escalated_permissions` parameter of the shell tool and a one-sentence justification.

## Validating your work
If the codebase has tests or the ability to build or run, consider using them to verify that your work is complete. \
Start as specific as possible to the code you changed so that you catch issues efficiently, then make your way to \
broader tests as you build confidence. Once you are confident in correctness, you can run formatting commands to \
ensure that your code is well formatted.

## Presenting your work and final message
Your final message should read naturally, like an update from a concise teammate. For casual conversation, \
brainstorming tasks, or quick questions from the user, respond in a friendly, conversational tone. You can skip heavy \
formatting for single, simple actions or confirmations. The user is working on the same computer as you and has \
access to your work: there is no need to show the full contents of large files you have already written unless the \
user explicitly asks for them. Reference the paths of the files you changed.

## Shell commands
When using the shell, you must adhere to the following guidelines:
- When searching for text or files, prefer using `rg` or `rg --files` respectively, because `rg` is much faster \
than alternatives like `grep`.
- Read files in chunks with a max chunk size of 250 lines. Do not use python scripts to attempt to output larger \
chunks of a file. Command line output will be truncated after 10 kilobytes or 256 lines of output, regardless of \
the command used."""

CODEX_PERMISSIONS = """<permissions instructions>Filesystem sandboxing defines which files can be read or written. \
`sandbox_mode` is `workspace-write`: the sandbox permits reading files, and editing files in `cwd` and \
`writable_roots`. Editing files in other directories requires approval. Network access is restricted. Approval \
policy is currently on-request: commands run in the sandbox, and you can ask for escalated permissions when a \
command needs them.</permissions instructions>"""

CODEX_AGENTS_MD = """# AGENTS.md instructions for /home/user/app

<INSTRUCTIONS>
- Python 3.11, standard library only.
- Run the tests with `pytest -q`; lint with `ruff check`.
- Keep functions small; no comments unless the code needs them.
</INSTRUCTIONS>"""

CODEX_ENVIRONMENT = """<environment_context>
  <cwd>/home/user/app</cwd>
  <approval_policy>on-request</approval_policy>
  <sandbox_mode>workspace-write</sandbox_mode>
  <network_access>restricted</network_access>
  <shell>bash</shell>
</environment_context>"""

APPLY_PATCH_GRAMMAR = r"""start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?
hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?
filename: /(.+)/
add_line: "+" /(.*)/ LF -> line
change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF
%import common.LF"""


def _function(name: str, description: str, required: list[str], /, **properties) -> dict:
    """A Responses API function tool as Codex sends it."""
    schema = _schema(required, **properties)
    del schema["$schema"]
    return {"type": "function", "name": name, "description": description, "strict": False, "parameters": schema}


CODEX_TOOLS = [
    _function(
        "shell",
        "Runs a shell command and returns its output.",
        ["command"],
        command={"type": "array", "items": {"type": "string"}, "description": "The command to execute"},
        workdir=("string", "The working directory to execute the command in"),
        timeout_ms=("number", "The timeout for the command in milliseconds"),
        with_escalated_permissions=("boolean", "Whether to request escalated permissions"),
        justification=("string", "Why escalated permissions are needed, in one sentence"),
    ),
    {
        "type": "custom",
        "name": "apply_patch",
        "description": "Use the `apply_patch` tool to edit files. This is a FREEFORM tool, so do not wrap the patch "
        "in JSON.",
        "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH_GRAMMAR},
    },
    _function(
        "update_plan",
        "Updates the task plan. Give an optional explanation and a list of steps, each with a status; at most one "
        "step can be in_progress at a time.",
        ["plan"],
        explanation=("string", "Why the plan changed"),
        plan={
            "type": "array",
            "items": _schema(
                ["step", "status"],
                step=("string", "The step"),
                status=("string", "One of: pending, in_progress, completed"),
            ),
        },
    ),
    _function(
        "view_image",
        "Attach a local image (by filesystem path) to the conversation context for this turn.",
        ["path"],
        path=("string", "Local filesystem path to an image file"),
    ),
    _function(
        "list_mcp_resources",
        "Lists the resources provided by MCP servers.",
        [],
        server=("string", "Optional MCP server name"),
        cursor=("string", "Opaque cursor from a previous call"),
    ),
    _function(
        "list_mcp_resource_templates",
        "Lists the resource templates provided by MCP servers.",
        [],
        server=("string", "Optional MCP server name"),
        cursor=("string", "Opaque cursor from a previous call"),
    ),
    _function(
        "read_mcp_resource",
        "Reads a specific resource from an MCP server, given its server name and resource URI.",
        ["server", "uri"],
        server=("string", "MCP server name"),
        uri=("string", "Resource URI to read"),
    ),
]


def numbered(text: str) -> str:
    """A file as Claude Code's Read tool returns it (cat -n)."""
    return "\n".join(f"{k:6d}\t{line}" for k, line in enumerate(text.splitlines(), 1))


TOOL_OUTPUTS = {  # what the agent's tools return to a call the model makes (the same on both servers)
    "Read": numbered(SOURCE),
    "Bash": "........\n8 passed in 0.04s",
    "shell": "Exit code: 0\nWall time: 0.2 seconds\nOutput:\n........\n8 passed in 0.04s",
    "Grep": "tasks.py:27:def pending(tasks):",
    "Glob": "/home/user/app/tasks.py\n/home/user/app/test_tasks.py",
    "apply_patch": "Success. Updated the following files:\nM tasks.py",
}


def agent_sessions(count: int, turns: int) -> list[dict]:
    """Coding sessions (the default shape's asks, each session from its own starting ask), with the
    ids an agent sends along."""
    import uuid

    out = []
    for k in range(count):
        asks = CODING[k % len(CODING) :] + CODING[: k % len(CODING)]
        user = uuid.UUID(int=k).hex * 2
        out.append(
            {"turns": asks[:turns], "user_id": f"user_{user}_account__session_{uuid.uuid4()}", "id": str(uuid.uuid4())}
        )
    return out


def recorded_sessions(count: int, turns: int) -> list[dict]:
    """Coding sessions on Claude Code's recorded first request (claude_opening, claude_body)."""
    return [{**session, "recorded": True} for session in agent_sessions(count, turns)]


def canonical(parts: list[tuple]) -> str:
    """An answer as (text or tool name, tool input) pairs: what is compared between servers (call ids differ)."""
    return json.dumps(parts, ensure_ascii=False)


def parse_calls(text: str, tools: list[dict]) -> tuple[str, list[dict]]:
    """A raw chat answer split as ours splits it (its parser, on the model's tokenizer): its text,
    and its tool calls (OpenAI shape)."""
    try:
        from dflash_mlx.serve.answer import ToolCalls
    except ImportError:  # before answer.py
        from dflash_mlx.serve.tools import ToolCalls

    calls = ToolCalls(tokenizer(), tools)
    shown = calls.push(text)
    rest, parsed = calls.finish()
    return shown + rest, parsed


def as_chat(messages: list[dict], tools: list[dict]) -> list[dict]:
    """Our conversation (OpenAI chat messages and tools, as our API modules make them) as the chat
    messages whose rendering is our prompt: developer turns as system turns, and for a template
    without tools (SmolLM2's) the tools, calls and results written out as ours writes them."""
    from dflash_mlx.serve.protocol import _with_tool_text

    messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    return _with_tool_text(messages, tools) if tools else messages


MODEL = {"name": None}  # --model: the served model's short name or folder (None: SmolLM2-135M-Instruct)


@lru_cache(maxsize=1)
def model_dir() -> Path:
    """The served model's mlx-lm folder (a short name converted on first use): what mlx_lm.server
    loads, and whose tokenizer and window the bench reads."""
    from dflash_mlx.api.registry import resolve

    return Path(resolve(MODEL["name"]).target)


@lru_cache(maxsize=1)
def tokenizer():
    from mlx_lm.tokenizer_utils import load

    return load(model_dir())


def room(chat: list[dict]) -> int:
    """What the context leaves after the chat's prompt (mlx_lm.server does not cut max_tokens to
    it; ours does): sent to mlx_lm.server as its cut, so the answers end at the same place."""
    context = json.loads((model_dir() / "config.json").read_text())["max_position_embeddings"]
    return context - len(tokenizer().apply_chat_template(chat, add_generation_prompt=True, tokenize=True))


def ours_options() -> list[str]:
    """`dflash-mlx serve`'s model option for the served model (none for the default)."""
    return ["--model", MODEL["name"]] if MODEL["name"] else []


class ContextFull(Exception):
    """The conversation no longer fits the context (ours refuses it; an agent would compact it now)."""


def chat_turn(client, chat: list[dict], max_tokens: int) -> dict:
    """One chat request to mlx_lm.server: its raw text, TTFT, time, tokens and cache share."""
    if room(chat) < 1:
        raise ContextFull
    tic, first, text, usage = time.perf_counter(), None, "", None
    options = dict(model="default_model", messages=chat, max_tokens=min(max_tokens, room(chat)), temperature=0.0)
    for chunk in client.chat.completions.create(**options, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text += chunk.choices[0].delta.content
    done = time.perf_counter()
    details = usage.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details else 0
    return dict(
        ttft=(first or done) - tic,
        seconds=done - tic,
        tokens=usage.completion_tokens,
        prompt=usage.prompt_tokens,
        cached=cached / usage.prompt_tokens,
        raw=text,
    )


# ---- Claude Code: Anthropic Messages


def billing_block() -> dict:
    import secrets

    header = f"x-anthropic-billing-header: cc_version={CLAUDE_VERSION}; cc_entrypoint=cli; cch={secrets.token_hex(3)};"
    return {"type": "text", "text": header}


def claude_system(text: str, marked: bool = True) -> list[dict]:
    """The billing-header block first (a new hash each request), then the system prompt, the last block marked."""
    last = {"type": "text", "text": text, **({"cache_control": EPHEMERAL} if marked else {})}
    return [
        billing_block(),
        {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
        last,
    ]


def claude_opening(session: dict) -> list[dict]:
    """The session picked up after its first tool call (scripted, as the agent's model would make it):
    the ask with the CLAUDE.md reminder (a recorded session: Claude Code's recorded first messages,
    the session's ask in place of their prompt), a Read of the file, its result."""
    call = {"type": "tool_use", "id": "toolu_01", "name": "Read", "input": {"file_path": "/home/user/app/tasks.py"}}
    if session.get("recorded"):
        recorded = recorded_claude()["messages"]  # the prompt after a reminder, then a system-role message
        first = [
            {"role": "user", "content": [recorded[0]["content"][0], {"type": "text", "text": session["turns"][0]}]},
            *recorded[1:],
        ]
    else:
        first = [
            {
                "role": "user",
                "content": [{"type": "text", "text": CLAUDE_MD}, {"type": "text", "text": session["turns"][0]}],
            }
        ]
    return [
        *first,
        {"role": "assistant", "content": [{"type": "text", "text": "I'll read tasks.py first."}, call]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": numbered(SOURCE)}]},
    ]


CLAUDE_RECORDED = Path(__file__).parent.parent / "tests" / "fixtures" / "claude-code-2.1.197-request.json"
RECORDED_FIELDS = ("model", "system", "tools", "metadata", "thinking", "context_management", "output_config")


@lru_cache(maxsize=1)
def recorded_claude() -> dict:
    """Claude Code 2.1.197's first request (`claude -p "Say hi"`), as it reached a server."""
    return json.loads(CLAUDE_RECORDED.read_text())


def claude_body(session: dict, messages: list[dict], max_tokens: int) -> dict:
    """A main-loop request as Claude Code sends it (the last message's last block marked for the
    cache); a recorded session's with the recorded request's system blocks, 25 tools and options."""
    last = {
        **messages[-1],
        "content": [*messages[-1]["content"][:-1], {**messages[-1]["content"][-1], "cache_control": EPHEMERAL}],
    }
    if session.get("recorded"):
        fields = {k: recorded_claude()[k] for k in RECORDED_FIELDS}
    else:
        fields = dict(
            model="claude-sonnet-4-6",
            system=claude_system(CLAUDE_SYSTEM),
            tools=CLAUDE_TOOLS,
            thinking={"type": "enabled", "budget_tokens": 1024},
            metadata={"user_id": session["user_id"]},
        )
    return dict(fields, messages=[*messages[:-1], last], max_tokens=max_tokens)


def title_body(session: dict, ask: str) -> dict:
    """Claude Code's side request on a new user message: a short title, a small system prompt of its own."""
    return dict(
        model="claude-haiku-4-5-20251001",
        system=claude_system(TITLE_SYSTEM, marked=False),
        messages=[{"role": "user", "content": ask}],
        metadata={"user_id": session["user_id"]},
        max_tokens=32,
    )


def claude_next(answer: list[dict], ask: str) -> dict:
    """The user turn after an answer: its tool calls' results, else the next ask."""
    calls = [block for block in answer if block["type"] == "tool_use"]
    if not calls:
        return {"role": "user", "content": [{"type": "text", "text": ask}]}
    results = [
        {"type": "tool_result", "tool_use_id": call["id"], "content": TOOL_OUTPUTS.get(call["name"], "Done.")}
        for call in calls
    ]
    return {"role": "user", "content": results}


def claude_parts(answer: list[dict]) -> list[tuple]:
    """An answer's blocks as (text, None) / (tool name, input) / ("thinking", text)."""
    kinds = {"text": lambda b: (b["text"], None), "tool_use": lambda b: (b["name"], b["input"])}
    return [kinds.get(b["type"], lambda b: (b["type"], b.get("thinking")))(b) for b in answer]


class ClaudeOurs:
    """Claude Code's requests to ours, through the `anthropic` SDK's beta client (betas as the header)."""

    def __init__(self, port: int):
        import anthropic

        self.client = anthropic.Anthropic(
            base_url=f"http://127.0.0.1:{port}",
            api_key="none",
            max_retries=0,
            timeout=3600,
            default_headers=CLAUDE_HEADERS,
        ).beta.messages

    def count(self, body: dict) -> float:
        tic = time.perf_counter()
        fields = ("model", "system", "messages", "tools", "thinking")
        self.client.count_tokens(**{k: body[k] for k in fields}, betas=CLAUDE_BETAS)
        return time.perf_counter() - tic

    def title(self, body: dict) -> tuple[float, str]:
        tic = time.perf_counter()
        reply = self.client.create(**body, betas=CLAUDE_BETAS)
        return time.perf_counter() - tic, canonical(claude_parts([b.model_dump() for b in reply.content]))

    def turn(self, body: dict) -> tuple[list[dict], dict]:
        import anthropic

        tic, first = time.perf_counter(), None
        try:
            with self.client.stream(**body, betas=CLAUDE_BETAS) as stream:
                for event in stream:
                    if event.type in ("content_block_start", "content_block_delta"):
                        first = first or time.perf_counter()
                message = stream.get_final_message()
        except anthropic.BadRequestError as e:
            if "prompt is too long" not in str(e):
                raise
            raise ContextFull from e
        done = time.perf_counter()
        usage = message.usage
        read, created = usage.cache_read_input_tokens or 0, usage.cache_creation_input_tokens or 0
        prompt = usage.input_tokens + read + created
        answer = [
            b.model_dump(include={"type", "text", "id", "name", "input", "thinking", "signature"})
            for b in message.content
        ]
        stats = dict(ttft=(first or done) - tic, seconds=done - tic, tokens=usage.output_tokens, prompt=prompt)
        return answer, {**stats, "cached": read / prompt}


class ClaudeTheirs:
    """The same requests to mlx_lm.server as the OpenAI chat messages ours renders them from
    (count_tokens left out: mlx_lm.server has no such endpoint)."""

    def __init__(self, port: int):
        import openai

        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=3600)

    def count(self, body: dict) -> float:
        return 0.0

    def title(self, body: dict) -> tuple[float, str]:
        from dflash_mlx.serve.anthropic_api import conversation

        messages, tools = conversation(body)
        reply = chat_turn(self.client, as_chat(messages, tools), body["max_tokens"])
        return reply["seconds"], canonical([(reply["raw"], None)])

    def turn(self, body: dict) -> tuple[list[dict], dict]:
        import uuid

        from dflash_mlx.serve.anthropic_api import conversation

        messages, tools = conversation(body)
        reply = chat_turn(self.client, as_chat(messages, tools), body["max_tokens"])
        text, calls = parse_calls(reply.pop("raw"), tools)
        answer = [{"type": "text", "text": text}] if text or not calls else []
        for call in calls:
            function = call["function"]
            answer.append(
                {
                    "type": "tool_use",
                    "id": f"toolu_{uuid.uuid4().hex[:24]}",
                    "name": function["name"],
                    "input": json.loads(function["arguments"]),
                }
            )
        return answer, reply


def replay_claude(server, port: int, session: dict, max_tokens: int, think: float = 0.0) -> list[dict]:
    """A session as Claude Code drives it: before each turn a count_tokens of the conversation,
    between turns a title request on the new ask; the whole history every turn."""
    agent = server(port)
    messages, turns = claude_opening(session), []
    for k, ask in enumerate(session["turns"]):
        side, title = 0.0, None
        if k:
            time.sleep(think)  # the agent acting on the last answer
            messages.append(claude_next(messages[-1]["content"], ask))  # after the last answer
            if messages[-1]["content"][0]["type"] == "text":
                side, title = agent.title(title_body(session, ask))
        body = claude_body(session, messages, max_tokens)
        side += agent.count(body)
        try:
            answer, stats = agent.turn(body)
        except ContextFull:
            break  # the session ends here (reported with fewer turns)
        messages.append({"role": "assistant", "content": answer})
        turns.append({**stats, "side": side, "text": canonical(claude_parts(answer)), "title": title})
    return turns


# ---- Codex: the Responses API


def codex_opening(session: dict) -> list[dict]:
    """Codex's first input items, picked up after its first tool call (scripted): the permissions,
    AGENTS.md, the environment, the ask, a shell call that shows the file, its output."""
    call = {
        "type": "function_call",
        "name": "shell",
        "arguments": json.dumps({"command": ["bash", "-lc", "sed -n '1,200p' tasks.py"], "workdir": "/home/user/app"}),
        "call_id": "call_01",
    }
    output = f"Exit code: 0\nWall time: 0.1 seconds\nOutput:\n{SOURCE}"
    return [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": CODEX_PERMISSIONS}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": CODEX_AGENTS_MD}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": CODEX_ENVIRONMENT}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": session["turns"][0]}]},
        call,
        {"type": "function_call_output", "call_id": "call_01", "output": output},
    ]


def codex_body(session: dict, items: list[dict], max_tokens) -> dict:
    """A turn as Codex sends it (no max_output_tokens unless the run caps answers)."""
    body = dict(
        model="gpt-5-codex",
        instructions=CODEX_INSTRUCTIONS,
        input=items,
        tools=CODEX_TOOLS,
        tool_choice="auto",
        parallel_tool_calls=False,
        reasoning={"effort": "medium", "summary": "auto"},
        store=False,
        stream=True,
        include=["reasoning.encrypted_content"],
        prompt_cache_key=session["id"],
    )
    return {**body, "max_output_tokens": max_tokens} if max_tokens else body


def codex_next(output: list[dict], ask: str) -> list[dict]:
    """The items after an answer: its calls' outputs, else the next ask."""
    calls = [item for item in output if item["type"] in ("function_call", "custom_tool_call")]
    if not calls:
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": ask}]}]
    return [
        {
            "type": f"{call['type']}_output",
            "call_id": call["call_id"],
            "output": TOOL_OUTPUTS.get(call["name"], "Done."),
        }
        for call in calls
    ]


def codex_parts(output: list[dict]) -> list[tuple]:
    parts = []
    for item in output:
        if item["type"] == "message":
            parts.append(("".join(c["text"] for c in item["content"]), None))
        else:
            parts.append((item.get("name", item["type"]), item.get("arguments", item.get("input"))))
    return parts


def sent_back(item: dict) -> dict:
    """An output item as Codex sends it back as input (store false: no ids)."""
    if item["type"] == "message":
        content = [{"type": "output_text", "text": c["text"]} for c in item["content"]]
        return {"type": "message", "role": "assistant", "content": content}
    kept = ("type", "name", "call_id", "arguments", "input", "summary", "encrypted_content")
    return {k: item[k] for k in kept if k in item}


class CodexOurs:
    def __init__(self, port: int, session: dict):
        import openai

        headers = {"originator": "codex_cli_rs", "session_id": session["id"], "version": "0.63.0"}
        self.client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=3600, default_headers=headers
        )

    def turn(self, body: dict) -> tuple[list[dict], dict]:
        import openai

        tic, first, final = time.perf_counter(), None, None
        try:
            for event in self.client.responses.create(**body):
                if event.type == "response.output_item.added":
                    first = first or time.perf_counter()
                elif event.type in ("response.completed", "response.incomplete"):
                    final = event.response
        except openai.BadRequestError as e:
            if "prompt is too long" not in str(e):
                raise
            raise ContextFull from e
        done = time.perf_counter()
        usage = final.usage
        output = [sent_back(item.model_dump()) for item in final.output]
        stats = dict(
            ttft=(first or done) - tic, seconds=done - tic, tokens=usage.output_tokens, prompt=usage.input_tokens
        )
        return output, {**stats, "cached": usage.input_tokens_details.cached_tokens / usage.input_tokens}


class CodexTheirs:
    """The same turns to mlx_lm.server (it has no Responses API) as the chat messages ours renders them from."""

    def __init__(self, port: int, session: dict):
        import openai

        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=3600)

    def turn(self, body: dict) -> tuple[list[dict], dict]:
        import uuid

        from dflash_mlx.serve.responses_api import custom_input, function_tools, input_messages

        tools, custom = function_tools(body["tools"])
        messages = [{"role": "system", "content": body["instructions"]}] + input_messages(body["input"])
        unbounded = 1 << 30  # no max_output_tokens: to the end of the context, as ours answers then
        reply = chat_turn(self.client, as_chat(messages, tools), body.get("max_output_tokens") or unbounded)
        text, calls = parse_calls(reply.pop("raw"), tools)
        output = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}]
        output = output if text or not calls else []
        for call in calls:
            name, arguments, call_id = (
                call["function"]["name"],
                call["function"]["arguments"],
                f"call_{uuid.uuid4().hex}",
            )
            if name in custom:
                output.append(
                    {"type": "custom_tool_call", "name": name, "call_id": call_id, "input": custom_input(arguments)}
                )
            else:
                output.append({"type": "function_call", "name": name, "call_id": call_id, "arguments": arguments})
        return output, reply


def replay_codex(server, port: int, session: dict, max_tokens, think: float = 0.0) -> list[dict]:
    """A session as Codex drives it: every turn streamed, the whole history as input items."""
    agent = server(port, session)
    items, turns, output = codex_opening(session), [], []
    for k, ask in enumerate(session["turns"]):
        if k:
            time.sleep(think)  # the agent acting on the last answer
            items += codex_next(output, ask)
        try:
            output, stats = agent.turn(codex_body(session, items, max_tokens))
        except ContextFull:
            break  # the session ends here (reported with fewer turns)
        items += output
        turns.append({**stats, "side": 0.0, "text": canonical(codex_parts(output))})
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


def metric(port: int, name: str) -> float:
    """One of the server's /metrics values."""
    import re
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def prompt_cache_mb(port: int) -> float:
    """What the server's prompt cache holds in memory, in MB."""
    return metric(port, "dflash_prefix_cache_bytes") / 2**20


def soak(count: int, turns: int, max_tokens: int, out) -> None:
    """`count` sessions in a row against ours: its RSS after each, flat after the fifth?  And
    the prompt cache's part of it (states kept for the sessions' next turns)."""
    from dflash_mlx.bench.harness import machine

    ours, port = start_ours(2, *ours_options())
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


def restart(turns: int, max_tokens, out, shape: str = "default") -> None:
    """A session against ours alone with a prompt-cache folder; the server stopped (SIGTERM) and a
    new one started on the folder; the session's first turn asked again (`reopened`): its TTFT
    against the warm turns'."""
    import tempfile

    from dflash_mlx.bench.harness import machine

    make_sessions, servers = SHAPES[shape]
    session = make_sessions(1, turns)[0]
    with tempfile.TemporaryDirectory() as folder:
        ours, port = start_ours(2, "--prompt-cache-dir", folder, *ours_options())
        try:
            first = servers["dflash-mlx"](port, session, max_tokens)
            held = dict(ram_mb=prompt_cache_mb(port), ram_entries=int(metric(port, "dflash_prefix_cache_entries")))
        finally:
            tic = time.perf_counter()
            stop(ours, timeout=900)  # the prompt cache written to the folder on the way out
        again = reopened(folder, held, time.perf_counter() - tic, session, servers["dflash-mlx"], max_tokens)
    warm = [t["ttft"] for t in first[1:]]
    lines = [
        f"Machine: {machine()}",
        f"Command: python {' '.join(sys.argv)}",
        "",
        f"First turn cold {first[0]['ttft']:.2f} s; later turns (warm) "
        f"{' / '.join(f'{t:.2f}' for t in warm)} s; the first turn again after a restart on the "
        f"folder: {again['ttft']:.2f} s ({again['ttft'] / median(warm):.2f}x the warm median)",
        reopened_line({"reopened": again, "dflash-mlx": {"ttft": [[first[0]["ttft"]]]}}),
    ]
    report(lines, out, "restart.md", {"first_run": first, "reopened": again})


def run_level(replay, port: int, chosen: list[dict], max_tokens: int, think: float = 0.0) -> dict:
    """The sessions at once; their wall time without the think time between turns (every
    session has as many turns and thinks as long, at the same time).  An agent shape's turns also
    carry the cache-read share, prompt tokens and side-request seconds, kept per turn."""
    tic = time.perf_counter()
    with ThreadPoolExecutor(len(chosen)) as pool:
        results = list(pool.map(lambda s: replay(port, s, max_tokens, think), chosen))
    turns = max(len(r) for r in results)
    wall = time.perf_counter() - tic - think * (turns - 1)

    def per_turn(key: str) -> list[list]:
        return [[r[t][key] for r in results if t < len(r)] for t in range(turns)]

    decode = sum(t["tokens"] for r in results for t in r) / sum(t["seconds"] - t["ttft"] for r in results for t in r)
    run = dict(
        session_seconds=wall,
        ttft=per_turn("ttft"),
        decode_tok_s=decode,
        texts=[[t["text"] for t in r] for r in results],
    )
    for key in ("cached", "prompt", "side", "title"):
        if key in results[0][0]:
            run[key] = per_turn(key)
    return run


SERVERS = {"mlx_lm.server": replay_theirs, "dflash-mlx": replay_ours}
SHAPES = {  # --shape: its sessions, and each server's replay
    "default": (sessions, SERVERS),
    "claude-code": (
        agent_sessions,
        {"mlx_lm.server": partial(replay_claude, ClaudeTheirs), "dflash-mlx": partial(replay_claude, ClaudeOurs)},
    ),
    "claude-code-recorded": (
        recorded_sessions,
        {"mlx_lm.server": partial(replay_claude, ClaudeTheirs), "dflash-mlx": partial(replay_claude, ClaudeOurs)},
    ),
    "codex": (
        agent_sessions,
        {"mlx_lm.server": partial(replay_codex, CodexTheirs), "dflash-mlx": partial(replay_codex, CodexOurs)},
    ),
}
CLAUDE_API = {"dflash-mlx": "Anthropic Messages (streamed)", "mlx_lm.server": "OpenAI chat (streamed), same prompt"}
API = {  # what each server is driven with, per shape
    "claude-code": CLAUDE_API,
    "claude-code-recorded": CLAUDE_API,
    "codex": {"dflash-mlx": "Responses (streamed)", "mlx_lm.server": "OpenAI chat (streamed), same prompt"},
}


def run_rep(
    together: int,
    turns: int,
    max_tokens,
    ours_first: bool,
    think: float = 0.0,
    shape: str = "default",
    reopen: bool = False,
) -> tuple[dict, dict]:
    """The sessions on fresh servers (no state carried over), one server after the other:
    each server's run, and its resident memory once loaded and at its peak during its sessions.
    `reopen`: ours keeps its prompt cache in a folder, and once both are stopped a new process of
    ours on that folder answers the first session's first turn again (runs["reopened"])."""
    import shutil
    import tempfile

    make_sessions, servers = SHAPES[shape]
    folder = tempfile.mkdtemp(prefix="agent-session-cache-") if reopen else None
    options = [*ours_options(), *(["--prompt-cache-dir", folder] if folder else [])]
    (ours, ours_port), (theirs, theirs_port) = start_servers(model_dir(), max(together, 2), *options)
    ports = {"mlx_lm.server": theirs_port, "dflash-mlx": ours_port}
    pids = {"mlx_lm.server": theirs.pid, "dflash-mlx": ours.pid}
    try:
        chosen = make_sessions(together, turns)
        runs, rss = {}, {}
        for name in sorted(servers, reverse=not ours_first):  # "dflash-mlx" sorts first
            loaded = current_rss_mb(pids[name])
            reset_peak(pids[name])
            runs[name] = run_level(servers[name], ports[name], chosen, max_tokens, think)
            rss[name] = dict(loaded=loaded, peak=rss_mb(pids[name]))
            cached = runs[name].get("cached")
            print(
                f"{together} session(s), {name}: {runs[name]['session_seconds']:.1f} s, TTFT per turn "
                f"{' '.join(f'{median(t):.2f}' for t in runs[name]['ttft'])} s, decode "
                f"{runs[name]['decode_tok_s']:.1f} tok/s"
                + (f", cache read {' '.join(f'{median(c):.0%}' for c in cached)}" if cached else "")
                + f", RSS {loaded:.0f} MB loaded, {rss[name]['peak']:.0f} MB at its peak",
                flush=True,
            )
        if folder:
            held = dict(
                ram_mb=prompt_cache_mb(ours_port), ram_entries=int(metric(ours_port, "dflash_prefix_cache_entries"))
            )
    finally:
        tic = time.perf_counter()
        stop(ours, theirs, timeout=900)  # ours writes its prompt cache to the folder on the way out
    if folder:
        try:
            runs["reopened"] = reopened(
                folder, held, time.perf_counter() - tic, chosen[0], servers["dflash-mlx"], max_tokens
            )
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    return runs, rss


def reset_peak(pid: int) -> None:
    """The process's peak resident set (VmHWM) reset to its current one (Linux's clear_refs)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def reopened(folder: str, held: dict, stop_seconds: float, session: dict, replay, max_tokens) -> dict:
    """What ours' prompt cache held (`held`: in memory before the stop) and its folder holds now;
    a new process of ours on the folder answering the session's first turn again: its TTFT and
    cache read."""
    files = list(Path(folder).glob("*.safetensors"))
    ours, port = start_ours(2, "--prompt-cache-dir", folder, *ours_options())
    try:
        again = replay(port, {**session, "turns": session["turns"][:1]}, max_tokens)[0]
    finally:
        stop(ours, timeout=900)
    disk = dict(disk_entries=len(files), disk_mb=sum(f.stat().st_size for f in files) / 2**20)
    print(f"reopened on the folder: TTFT {again['ttft']:.2f} s, cache read {again.get('cached', 0):.0%}", flush=True)
    return {**held, **disk, "stop_seconds": stop_seconds, "ttft": again["ttft"], "cached": again.get("cached")}


def summary(reps: list[dict]) -> dict:
    """One level's reps: per server the median session time, decode tok/s and each turn's TTFT
    (over sessions and reps), and for an agent shape each turn's cache-read share and prompt tokens
    and the side requests' seconds; the speedups (theirs / ours session time) of each rep; answers
    (and title answers) equal in all; prompts of equal length in all."""
    out = {"speedups": [r["mlx_lm.server"]["session_seconds"] / r["dflash-mlx"]["session_seconds"] for r in reps]}
    for name in SERVERS:
        runs = [r[name] for r in reps]
        turns = range(max(len(run["ttft"]) for run in runs))  # fewer where a session outgrew the context

        def per_turn(key: str) -> list[float]:
            return [median(x for run in runs if turn < len(run[key]) for x in run[key][turn]) for turn in turns]

        out[name] = dict(
            session_seconds=median(run["session_seconds"] for run in runs),
            decode_tok_s=median(run["decode_tok_s"] for run in runs),
            ttft=per_turn("ttft"),
        )
        for key in ("cached", "prompt", "side"):
            if key in runs[0]:
                out[name][key] = per_turn(key)
    same = [
        (r["dflash-mlx"]["texts"], r["dflash-mlx"].get("title"))
        == (r["mlx_lm.server"]["texts"], r["mlx_lm.server"].get("title"))
        for r in reps
    ]
    out["equal_answers"] = all(same)
    if "prompt" in reps[0]["dflash-mlx"]:
        out["equal_prompts"] = all(r["dflash-mlx"]["prompt"] == r["mlx_lm.server"]["prompt"] for r in reps)
    return out


def reopened_line(runs: dict) -> str:
    r, cold = runs["reopened"], runs["dflash-mlx"]["ttft"][0][0]
    return (
        f"\nOurs' prompt cache after the session: {r['ram_entries']} entries, {r['ram_mb']:.0f} MB in memory; "
        f"stopped (SIGTERM, both servers in {r['stop_seconds']:.1f} s), its folder held {r['disk_entries']} entries, "
        f"{r['disk_mb']:.0f} MB. A new process of ours on the folder, the first turn again: time to first token "
        f"{r['ttft']:.2f} s (cold {cold:.2f} s)"
        + (f", cache read {r['cached']:.0%}." if r["cached"] is not None else ".")
    )


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


def speedup(level: dict) -> str:
    return f"{median(level['speedups']):.2f}x ({', '.join(f'{x:.2f}' for x in level['speedups'])})"


def default_table(levels: dict) -> list[str]:
    lines = [
        "| sessions at once | server | session s | speedup (reps) | TTFT per turn (s, median over sessions and reps) | "
        "decode tok/s | answers equal |",
        "|---|---|---|---|---|---|---|",
    ]
    for together, level in levels.items():
        for name in SERVERS:
            row = level[name]
            lines.append(
                f"| {together} | {name} | {row['session_seconds']:.1f} | "
                f"{speedup(level) if name == 'dflash-mlx' else '1.00x'} | "
                f"{' / '.join(f'{t:.2f}' for t in row['ttft'])} | {row['decode_tok_s']:.1f} | "
                f"{'yes' if level['equal_answers'] else 'no'} |"
            )
    return lines


SHAPE_NOTES = {
    "claude-code-recorded": (
        'Claude Code\'s recorded first request (2.1.197, `claude -p "Say hi"` in a git repository, '
        "tests/fixtures/claude-code-2.1.197-request.json): its system blocks, 25 tools, thinking adaptive, "
        "context_management, output_config and metadata as recorded; its first messages (a reminder, the prompt, a "
        "system-role message listing agents and skills) with the session's first ask as the prompt, then a scripted "
        "Read of the file and its result; the whole history every turn, the last block marked for the cache. "
        "count_tokens before each turn and a title request between turns as in the claude-code shape (Claude Code "
        "sent neither in -p mode). mlx_lm.server gets the OpenAI chat messages our Anthropic endpoint renders, as in "
        "the claude-code shape. Cache read as there."
    ),
    "claude-code": (
        "Claude Code's shape: Anthropic Messages, streamed; system = billing-header block (a new cch each request), "
        "identity block, the system prompt (cache_control ephemeral); 22 tools with input_schema; thinking enabled "
        "(budget 1024); metadata.user_id; anthropic-beta headers; the last message's last block marked for the cache; "
        "before each turn a count_tokens of the conversation (ours only: mlx_lm.server has no such endpoint), between "
        "turns a title request (its own small system prompt, max_tokens 32; on both servers). mlx_lm.server speaks "
        "neither Anthropic Messages nor count_tokens: it gets the OpenAI chat messages our Anthropic endpoint renders "
        "(billing-header block dropped, the tools, tool calls and tool results written out as ours writes them for a "
        "template without tools), so both render the same prompt; its max_tokens is cut to the room the context leaves "
        "(ours cuts it so). Cache read = cache_read_input_tokens / (input_tokens + cache_read_input_tokens + "
        "cache_creation_input_tokens) on ours, prompt_tokens_details.cached_tokens / prompt_tokens on mlx_lm.server."
    ),
    "codex": (
        "Codex's shape: the Responses API, streamed; instructions; input items (developer permissions, AGENTS.md, "
        "environment context, message, function_call, function_call_output and their answers sent back without ids); "
        "tools: shell, the custom apply_patch (lark grammar), update_plan, view_image and 3 MCP functions; reasoning "
        "effort medium, summary auto; include reasoning.encrypted_content; store false; parallel_tool_calls false; "
        "prompt_cache_key the session id; no max_output_tokens unless the run caps answers (without it, an answer "
        "may run to the end of the context on both servers). mlx_lm.server has no Responses API (mlx-lm 0.32.2: "
        "/v1/completions and /v1/chat/completions only): it gets the OpenAI chat messages our Responses endpoint "
        "renders (developer turns as system turns, tools written out as ours writes them), so both render the same "
        "prompt. Cache read = usage.input_tokens_details.cached_tokens / input_tokens on ours, "
        "prompt_tokens_details.cached_tokens / prompt_tokens on mlx_lm.server."
    ),
}


def shape_table(shape: str, levels: dict) -> list[str]:
    """An agent shape's table: per server, its API, session time, TTFT, cache-read share and prompt
    tokens per turn; the side requests' seconds per turn; whether answers and prompts are equal."""
    lines = [
        SHAPE_NOTES[shape],
        "",
        "| sessions at once | server | API | session s | speedup (reps) | TTFT per turn (s) | cache read per turn | "
        "prompt tokens per turn | side requests per turn (s) | decode tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for together, level in levels.items():
        for name in SERVERS:
            row = level[name]
            lines.append(
                f"| {together} | {name} | {API[shape][name]} | {row['session_seconds']:.1f} | "
                f"{speedup(level) if name == 'dflash-mlx' else '1.00x'} | "
                f"{' / '.join(f'{t:.2f}' for t in row['ttft'])} | {' / '.join(f'{c:.0%}' for c in row['cached'])} | "
                f"{' / '.join(f'{p:.0f}' for p in row['prompt'])} | {' / '.join(f'{x:.2f}' for x in row['side'])} | "
                f"{row['decode_tok_s']:.1f} |"
            )
    lines.append("")
    for together, level in levels.items():
        theirs, ours = (level[name]["ttft"][0] for name in SERVERS)
        lines.append(
            f"{together} session(s) at once: the first turn (a cold prefill of "
            f"{level['dflash-mlx']['prompt'][0]:.0f} prompt tokens) to its first token: mlx_lm.server {theirs:.1f} s, "
            f"dflash-mlx {ours:.1f} s ({theirs / ours:.2f}x)."
        )
        lines.append(
            f"{together} session(s) at once: answers equal between the servers: "
            f"{'yes' if level['equal_answers'] else 'no'}; prompts of equal length every turn: "
            f"{'yes' if level['equal_prompts'] else 'no'}. Medians over sessions and reps."
        )
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--together", type=int, default=4, help="sessions at once in the second level")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="answer cap (default: 400; with --shape, what the agent sends: claude-code 32000, claude-code-recorded 8192, codex none)",
    )
    parser.add_argument(
        "--shape",
        choices=list(SHAPES),
        default="default",
        help="the sessions' request shape: the default one, or as Claude Code / Codex send them",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="the served model: a short name (gemma-3-270m) or an mlx-lm folder; both servers load the same "
        "weights (default: SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--reps", type=int, default=1, help="runs of each level on fresh servers, in turn first")
    parser.add_argument(
        "--think",
        type=float,
        default=0.0,
        help="seconds each session waits after an answer (an agent running its tools); not in the session time",
    )
    parser.add_argument("--out", default=None, help="folder for results.json, results.md and the TTFT plot")
    parser.add_argument(
        "--reopen",
        action="store_true",
        help="ours keeps its prompt cache in a folder; after each rep a new process of ours on that folder "
        "answers the first turn again (a second launch in the same folder)",
    )
    parser.add_argument("--soak", type=int, default=0, help="instead: this many sessions in a row against ours")
    parser.add_argument(
        "--restart",
        action="store_true",
        help="instead: a session, a restart on the prompt-cache folder, its first turn",
    )
    args = parser.parse_args()

    import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)

    MODEL["name"] = args.model

    if args.max_tokens is None:
        args.max_tokens = {"default": 400, "claude-code": 32000, "claude-code-recorded": 8192, "codex": None}[
            args.shape
        ]
    if args.soak:
        return soak(args.soak, args.turns, args.max_tokens, args.out)
    if args.restart:
        return restart(args.turns, args.max_tokens, args.out, args.shape)
    from dflash_mlx.bench.harness import machine

    levels, peak, raw = {}, {}, {}
    for together in sorted({1, args.together}):
        reps = [
            run_rep(
                together,
                args.turns,
                args.max_tokens,
                ours_first=rep % 2 == 1,
                think=args.think,
                shape=args.shape,
                reopen=args.reopen,
            )
            for rep in range(args.reps)
        ]
        raw[together] = [runs for runs, _ in reps]
        levels[together] = summary(raw[together])
        peak[together] = {
            name: {k: max(rss[name][k] for _, rss in reps) for k in ("loaded", "peak")} for name in SERVERS
        }
    lines = [
        f"Machine: {machine()}",
        f"Command: python {' '.join(sys.argv)}",
        f"Model: {model_dir()} (both servers)",
        "",
        f"Medians over {args.reps} rep(s), each on fresh servers, the two servers in turn first"
        + (f"; {args.think:g} s of think time after each answer, not counted in session time." if args.think else "."),
        "",
    ]
    lines += (default_table if args.shape == "default" else partial(shape_table, args.shape))(levels)
    for together, rss in peak.items():
        lines.append(
            f"\nResident memory at {together} session(s) (the largest over reps), once loaded / at its peak during "
            f"the sessions: mlx_lm.server {rss['mlx_lm.server']['loaded']:.0f} / {rss['mlx_lm.server']['peak']:.0f} MB, "
            f"dflash-mlx {rss['dflash-mlx']['loaded']:.0f} / {rss['dflash-mlx']['peak']:.0f} MB"
        )
    lines += [reopened_line(runs) for level in raw.values() for runs in level if "reopened" in runs]
    report(lines, args.out, "results.md", {"levels": levels, "reps": raw, "peak_rss_mb": peak})
    if args.out:
        plot_ttft(levels, Path(args.out))


if __name__ == "__main__":
    main()
