"""bench/agent_session.py's requests and reports, and bench/agent_clis.py's recorder, without a
model or a server (the sessions themselves are benchmark commands)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))

import agent_session as bench  # noqa: E402
from agent_clis import Recorder  # noqa: E402


def test_the_recorded_request_is_claude_codes_first_at_its_real_size():
    recorded = bench.recorded_claude()
    assert len(recorded["tools"]) == 25 and len(json.dumps(recorded["tools"])) > 60_000  # ~18k tokens of tools
    assert recorded["thinking"] == {"type": "adaptive"} and "output_config" in recorded
    assert [m["role"] for m in recorded["messages"]] == ["user", "system"]
    assert recorded["messages"][0]["content"][-1]["text"] == "Say hi"


def test_a_recorded_session_sends_the_recorded_request_around_its_own_ask():
    recorded = bench.recorded_claude()
    session = bench.recorded_sessions(1, 3)[0]
    messages = bench.claude_opening(session)
    body = bench.claude_body(session, messages, 256)
    assert {k: body[k] for k in bench.RECORDED_FIELDS} == {k: recorded[k] for k in bench.RECORDED_FIELDS}
    assert body["max_tokens"] == 256
    ask = messages[0]["content"]
    assert ask[0] == recorded["messages"][0]["content"][0] and ask[1] == {"type": "text", "text": session["turns"][0]}
    assert messages[1] == recorded["messages"][1]  # the system-role message listing agents and skills
    assert [m["role"] for m in messages] == ["user", "system", "assistant", "user"]  # then the Read and its result
    assert "Say hi" not in json.dumps(body["messages"])
    assert body["messages"][-1]["content"][-1]["cache_control"] == bench.EPHEMERAL
    assert "cache_control" not in messages[-1]["content"][-1]  # marked in the request only, not in the history
    shaped = bench.agent_sessions(1, 3)[0]  # the shaped sessions keep their own request
    assert len(bench.claude_body(shaped, bench.claude_opening(shaped), 256)["tools"]) == len(bench.CLAUDE_TOOLS) == 22


def level(theirs_first: float, ours_first: float) -> dict:
    row = dict(session_seconds=10.0, decode_tok_s=5.0, cached=[0.0, 0.99], prompt=[22000, 22400], side=[0.0, 1.0])
    return {
        "speedups": [2.0],
        "equal_answers": True,
        "equal_prompts": False,
        "mlx_lm.server": {**row, "ttft": [theirs_first, 3.0]},
        "dflash-mlx": {**row, "ttft": [ours_first, 1.0]},
    }


def test_the_table_states_each_servers_first_prefill_and_the_checks():
    lines = "\n".join(bench.shape_table("claude-code-recorded", {1: level(150.0, 100.0)}))
    assert "the first turn (a cold prefill of 22000 prompt tokens)" in lines
    assert "mlx_lm.server 150.0 s, dflash-mlx 100.0 s (1.50x)" in lines
    assert "answers equal between the servers: yes; prompts of equal length every turn: no" in lines
    assert "| 0% / 99% |" in lines and "| 22000 / 22400 |" in lines


def test_the_recorder_keeps_each_post_body_and_passes_it_on():
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    async def echo(request):
        return JSONResponse({"got": await request.json()})

    kept: list[dict] = []
    app = Recorder(Starlette(routes=[Route("/v1/messages", echo, methods=["POST"])]), kept)
    client = TestClient(app)
    body = {"messages": [{"role": "user", "content": "x" * 100_000}], "stream": True}
    assert client.post("/v1/messages", json=body).json() == {"got": body}
    assert client.get("/v1/messages").status_code == 405  # not a POST: passed on, not kept
    assert kept == [{"path": "/v1/messages", "body": body}]
