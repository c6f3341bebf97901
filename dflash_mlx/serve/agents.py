"""What `dflash-mlx launch` tells each coding agent (Claude Code, Codex CLI, OpenCode), derived
from two numbers: the served model's window and the size of the agent's first request.

An agent's first request (its system prompt and tool definitions) is the floor of every request
it sends.  Each agent compacts (summarises the conversation) when the conversation nears a line
it computes from the window; compacting helps only when the first request, a summary and a reply
fit below that line, otherwise every compaction is followed by another (OpenCode's loop on an 8k
window).  So where the window is that small, compaction is turned off and the session runs until
the window is full, where the agent reports the server's `prompt is too long`.  Where the window
cannot hold the first request and a reply at all, `fit` says which agent flags or models would.

An answer cut at its reply budget is continued by the agent (Claude Code asks three times for
the rest, then reports the cut and ends the turn): a model that never ends its answer (a base
model) would otherwise carry the conversation past the window, where the agent's handling of the
server's refusal (compaction that cannot fit, retries) never ends.  So the reply budget leaves
room in the window for the answer and all its continuations."""

import json
from dataclasses import dataclass
from typing import Callable, Optional

KEY_ENV = "DFLASH_MLX_API_KEY"  # the key a server started from this environment requires, if set
MAX_OUTPUT_TOKENS = 32_000  # the agents' own usual ceiling for a reply
UNKNOWN_CONTEXT_OUTPUT_TOKENS = 8_192  # a 64k window's budget; a fifth of Qwen3's 40,960, the smallest published pair's
MIN_REPLY_TOKENS = 256  # a window leaving less after the first request cannot hold a session
CLAUDE_COMPACT_MARGIN = 13_000  # Claude Code compacts at window - min(reply, 20,000) - 13,000 (read in its code)
CLAUDE_REPLY_CAP = 20_000
# Claude Code continues an answer cut at max_tokens (or at the window) three times with a
# "Output token limit hit. Resume directly ..." message, then reports the cut and ends the turn
# (read in its code, 2.1.197).  Its message (185 characters) and turn markers: 49 tokens with
# Gemma 3's tokenizer, 179 with the tests' tiny one; kept at one token a character and more.
CLAUDE_CONTINUATIONS = 3
RESUME_TOKENS = 256
# A request to a local model takes as long as its prefill and reply do (a 22k-token first request
# is minutes on a small machine, a long reply more): Claude Code's own limits (API_TIMEOUT_MS, 10
# minutes a request; CLAUDE_STREAM_IDLE_TIMEOUT_MS, 5 minutes without a byte, which the server
# sends from the first token on) abandon it and send it again, for ever.  Its idle limit is capped
# at 30 minutes (read in its code, 2.1.197); a request's at a day.
CLAUDE_REQUEST_TIMEOUT_MS = 86_400_000
CLAUDE_IDLE_TIMEOUT_MS = 1_800_000


@dataclass(frozen=True)
class Served:
    """What an agent is told about the server it talks to."""

    url: str  # http://127.0.0.1:PORT, without /v1
    key: str
    model: str  # the id GET /v1/models gives
    context: Optional[int]  # the model's window in tokens; None when it cannot be read on this machine


@dataclass(frozen=True)
class Plan:
    """A session's budget: `reply` tokens per answer, and whether the agent may compact."""

    reply: int
    compact: bool


@dataclass(frozen=True)
class Agent:
    executable: str
    title: str
    install: str
    first_request: int  # tokens of its first request with its default flags (SmolLM2's tokenizer), measured
    lighter: tuple[tuple[str, int], ...]  # (agent flags, tokens of the first request with them), measured
    compaction_line: Callable[[int, int], int]  # (window, reply) -> the conversation size it compacts at
    configure: Callable[[Served, Plan], tuple[list[str], dict[str, str]]]  # its arguments and environment
    continuations: int = 0  # times it asks for the rest of an answer cut at its budget, in one turn

    def first_request_with(self, agent_args: list[str]) -> Optional[int]:
        """The first request's size with the user's agent arguments, None when they change it in a
        way not measured (a --tools list other than the one measured, say)."""
        for flags, tokens in self.lighter:
            if all(flag in agent_args for flag in flags.split()):
                return tokens
        if any(flag in agent_args for flags, _ in self.lighter for flag in flags.split()[:1]):
            return None
        return self.first_request


def plan(agent: Agent, window: Optional[int], first_request: Optional[int]) -> Plan:
    """An eighth of the window for a reply (at most the agents' 32,000; agents keep it free when
    they decide to compact, so their defaults would leave a 40,960 window almost nothing), cut to
    what the window leaves after the first request for an answer and the agent's continuations
    of it; compaction only where the first request, a summary and a reply fit below the agent's
    compaction line."""
    if window is None:
        return Plan(UNKNOWN_CONTEXT_OUTPUT_TOKENS, True)
    reply = max(1, min(MAX_OUTPUT_TOKENS, window // 8))
    if first_request is None:
        return Plan(reply, True)
    answers = 1 + agent.continuations
    left = window - first_request - agent.continuations * RESUME_TOKENS
    reply = max(1, min(reply, left // answers))
    return Plan(reply, first_request + 2 * reply <= agent.compaction_line(window, reply))


def fit(agent: Agent, window: Optional[int], first_request: Optional[int], model: str) -> Optional[str]:
    """Why the window cannot hold the agent's session (with what would), or None when it can or
    when either size is unknown."""
    if window is None or first_request is None or window - first_request >= MIN_REPLY_TOKENS:
        return None
    fitting = [
        f"`{flags}` (~{tokens:,} tokens)" for flags, tokens in agent.lighter if window - tokens >= MIN_REPLY_TOKENS
    ]
    instead = f"pass {agent.title}'s {' or '.join(fitting)} after --, or " if fitting else ""
    return (
        f"{model}'s window ({window:,} tokens) cannot hold {agent.title}'s first request (~{first_request:,} tokens) "
        f"and a reply: {instead}serve a model with a window of at least {first_request + 4 * MIN_REPLY_TOKENS:,} "
        "tokens (--model; docs/agents/)"
    )


def claude_code(served: Served, plan: Plan) -> tuple[list[str], dict[str, str]]:
    """Claude Code speaks the Anthropic Messages API; everything is set by environment variables
    (code.claude.com/docs/en/env-vars).  In its code (2.1.197): CLAUDE_CODE_MAX_CONTEXT_TOKENS is
    the window of a model not named claude-*; it compacts before a request only when a window is
    configured (CLAUDE_CODE_AUTO_COMPACT_WINDOW, floored at 100,000 but capped by that window),
    and refuses to send one past its blocking limit (window - reply - 3,000 unless
    CLAUDE_CODE_BLOCKING_LIMIT_OVERRIDE)."""
    model = served.model
    env = {
        "ANTHROPIC_BASE_URL": served.url,
        "ANTHROPIC_AUTH_TOKEN": served.key,
        "ANTHROPIC_API_KEY": "",  # a real Anthropic key in the shell is neither sent here nor asked about
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,  # the haiku slot's older name, which older versions read
        "CLAUDE_CODE_SUBAGENT_MODEL": model,
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(plan.reply),
        "API_TIMEOUT_MS": str(CLAUDE_REQUEST_TIMEOUT_MS),
        "CLAUDE_STREAM_IDLE_TIMEOUT_MS": str(CLAUDE_IDLE_TIMEOUT_MS),
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
    }
    if served.context:  # else Claude Code assumes 200k
        env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] = str(served.context)
        if plan.compact:
            env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] = str(served.context)
        else:  # no compaction, and requests sent until the window holds no more reply
            env["CLAUDE_CODE_BLOCKING_LIMIT_OVERRIDE"] = str(served.context - plan.reply)
    return [], env


def claude_compaction_line(window: int, reply: int) -> int:
    return window - min(reply, CLAUDE_REPLY_CAP) - CLAUDE_COMPACT_MARGIN


def codex(served: Served, plan: Plan) -> tuple[list[str], dict[str, str]]:
    """Codex reads ~/.codex/config.toml (CODEX_HOME, which also holds its login), so it gets a
    provider of its own through `-c key=value` overrides instead (the Responses API).  It sends no
    reply budget (`model_max_output_tokens` is ignored); it compacts when the last turn's tokens
    reach `model_auto_compact_token_limit`."""
    provider = {"name": "dflash-mlx", "base_url": f"{served.url}/v1", "env_key": KEY_ENV, "wire_api": "responses"}
    overrides = {
        "model_provider": "dflash-mlx",
        "model_providers.dflash-mlx": provider,
        "model": served.model,
        # tools the server accepts but cannot run or that only lengthen the prompt: fewer tokens
        "web_search": "disabled",
        "features.multi_agent": False,
        "analytics.enabled": False,
    }
    if served.context:  # else Codex assumes a window far larger than most local models have
        overrides["model_context_window"] = served.context
        # at the window itself it never compacts: the server's refusal ends the turn instead
        line = codex_compaction_line(served.context, plan.reply) if plan.compact else served.context
        overrides["model_auto_compact_token_limit"] = line
    args = [part for key, value in overrides.items() for part in ("-c", f"{key}={toml_value(value)}")]
    return args, {KEY_ENV: served.key}


def codex_compaction_line(window: int, reply: int) -> int:
    return window - reply


def opencode(served: Served, plan: Plan) -> tuple[list[str], dict[str, str]]:
    """OpenCode merges OPENCODE_CONFIG_CONTENT over its config files (opencode.ai/docs/config):
    a provider of its own, chosen as the model and the small model.  In its code (1.18.33) it
    compacts when a turn's tokens reach `limit.context - limit.output`, and also when the server
    refuses a prompt as too long, unless `compaction.auto` is false (then it reports the error)."""
    model = {"name": served.model, "tool_call": True}
    if served.context:  # else OpenCode takes the window as unknown and never compacts
        model["limit"] = {"context": served.context, "output": plan.reply}
    provider = {
        "npm": "@ai-sdk/openai-compatible",
        "name": "dflash-mlx",
        # no timeouts: a long prompt's prefill on a local machine can outlast OpenCode's 5 minutes
        "options": {"baseURL": f"{served.url}/v1", "apiKey": served.key, "timeout": False, "headerTimeout": False},
        "models": {served.model: model},
    }
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"dflash-mlx": provider},
        "model": f"dflash-mlx/{served.model}",
        "small_model": f"dflash-mlx/{served.model}",
        "share": "disabled",  # sessions stay on this machine
    }
    if not plan.compact:
        config["compaction"] = {"auto": False}
    return [], {"OPENCODE_CONFIG_CONTENT": json.dumps(config)}


def opencode_compaction_line(window: int, reply: int) -> int:
    return window - reply


def toml_value(value) -> str:
    """A `-c` override's value as TOML (a JSON string is a TOML basic string)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key} = {toml_value(item)}" for key, item in value.items()) + "}"
    return json.dumps(value)


# First requests measured with the pinned versions (docs/agents/*.md) in a git repository against a
# scripted server, counted with SmolLM2's tokenizer and chat template (`python bench/agent_clis.py`,
# the largest seen); other tokenizers count within about 10% (Qwen3's: 6% fewer).
AGENTS = {
    "claude": Agent(
        "claude",
        "Claude Code",
        "npm install -g @anthropic-ai/claude-code",
        22_662,
        (("--bare", 1_141), ("--tools Read,Write", 2_278)),
        claude_compaction_line,
        claude_code,
        CLAUDE_CONTINUATIONS,
    ),
    "codex": Agent("codex", "Codex CLI", "npm install -g @openai/codex", 6_472, (), codex_compaction_line, codex),
    "opencode": Agent(
        "opencode", "OpenCode", "npm install -g opencode-ai", 7_600, (), opencode_compaction_line, opencode
    ),
}
