"""Who may talk to the server (serve/guard.py), against live servers on loopback: foreign Host
names (DNS rebinding) and web pages' Origins are refused, an API key is required when set
(real openai and anthropic clients), /health stays open."""

import http.client
import json

import pytest

openai = pytest.importorskip("openai", reason="the dev extra installs the openai client")
anthropic = pytest.importorskip("anthropic", reason="the dev extra installs the anthropic client")

from dflash_mlx import load  # noqa: E402
from dflash_mlx.serve import make_app, serve_in_background  # noqa: E402
from dflash_mlx.serve.guard import Guard, host_name, is_loopback  # noqa: E402

pytestmark = pytest.mark.slow  # live servers

KEY = "sk-local-test-key"


@pytest.fixture(scope="module")
def pair(tiny_dirs):
    model_dir, draft_dir = tiny_dirs
    return load(str(model_dir), str(draft_dir), adaptive=False)


def start(pair, **access):
    model, tokenizer = pair
    server = make_app(model, tokenizer, "tiny", access=access)
    http_server, port = serve_in_background(server)
    return http_server, port


def send(port: int, method: str, path: str, headers: dict, body: dict | None = None) -> tuple[int, dict, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json", **headers} if data else headers
    connection.request(method, path, body=data, headers=headers)
    response = connection.getresponse()
    raw = response.read()
    is_json = response.getheader("content-type", "").startswith("application/json")
    return response.status, json.loads(raw) if is_json else {}, {k.lower(): v for k, v in response.getheaders()}


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_foreign_hosts_and_origins_are_refused(pair):
    http_server, port = start(pair)
    try:
        assert send(port, "POST", "/v1/chat/completions", {"Host": f"localhost:{port}"}, CHAT)[0] == 200
        assert send(port, "POST", "/v1/chat/completions", {"Host": f"[::1]:{port}"}, CHAT)[0] == 200
        status, body, _ = send(port, "POST", "/v1/chat/completions", {"Host": "attacker.example"}, CHAT)
        assert (
            status == 403
            and "attacker.example" in body["error"]["message"]
            and "--allow-host" in body["error"]["message"]
        )
        status, body, _ = send(port, "POST", "/v1/messages", {"Host": "attacker.example"}, CHAT)
        assert status == 403 and body["type"] == "error" and body["error"]["type"] == "permission_error"
        status, body, _ = send(port, "GET", "/v1/models", {"Origin": "https://evil.example"})
        assert status == 403 and "--cors-origin" in body["error"]["message"]
        assert send(port, "GET", "/v1/models", {"Origin": f"http://localhost:{port}"})[0] == 200
    finally:
        http_server.should_exit = True


def test_allowed_hosts_and_cors_origins(pair):
    http_server, port = start(pair, allow_hosts=("studio.lan",), cors_origins=("https://app.example",))
    try:
        assert send(port, "GET", "/v1/models", {"Host": "studio.lan:8080"})[0] == 200
        status, _, headers = send(port, "GET", "/v1/models", {"Origin": "https://app.example"})
        assert status == 200 and headers.get("access-control-allow-origin") == "https://app.example"
        preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
        assert send(port, "OPTIONS", "/v1/chat/completions", preflight)[0] == 200
        assert send(port, "GET", "/v1/models", {"Origin": "https://other.example"})[0] == 403
    finally:
        http_server.should_exit = True


def test_an_api_key_is_required_when_set(pair):
    http_server, port = start(pair, api_key=KEY)
    base = f"http://127.0.0.1:{port}"
    try:
        good = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
        assert good.chat.completions.create(model="tiny", **CHAT).choices[0].message.content is not None
        with pytest.raises(openai.AuthenticationError) as refused:
            openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
        assert "API key" in str(refused.value)
        messages = dict(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0).messages.create(**messages).content
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(**messages)
        assert send(port, "GET", "/v1/models", {})[0] == 401  # no key at all
        assert send(port, "GET", "/health", {})[0] == 200  # health checks need no key
        preflight = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"}
        assert send(port, "OPTIONS", "/v1/chat/completions", preflight)[0] != 401  # preflights carry no key
    finally:
        http_server.should_exit = True


def test_host_names_are_read_as_browsers_send_them():
    assert host_name("LOCALHOST:8080") == "localhost" and host_name("[::1]:80") == "::1" and host_name("::1") == "::1"
    assert is_loopback("127.0.0.2") and is_loopback("app.localhost") and not is_loopback("192.168.1.5")
    guard = Guard(None, None, bind_host="0.0.0.0", allow_hosts=("*",))
    assert guard.any_host and "0.0.0.0" not in guard.hosts
