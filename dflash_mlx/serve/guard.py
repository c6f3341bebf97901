"""Who may talk to the server: checked before any route, answered in the called API's format.

Host     a loopback name or address, the address the server binds, or one allowed with
         --allow-host: a page that rebinds its own name to 127.0.0.1 (DNS rebinding) sends
         its own name as the Host, and is refused
Origin   a browser's request from a page not on loopback (nor allowed with --cors-origin)
         is refused: any web page the user opens can send requests to 127.0.0.1.  Pages that
         are let through get CORS answers (BrowserAccess): a page on http://localhost:3000
         calls the server with no flag
API key  with --api-key, every route but /health needs `Authorization: Bearer KEY` (OpenAI
         clients) or `x-api-key: KEY` (Anthropic clients), compared in constant time
"""

import hmac
from ipaddress import ip_address
from typing import Callable, Optional
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware

from .protocol import RequestError

LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


def host_name(value: str) -> str:
    """The name of a Host header or an origin's netloc, without its port ('[::1]:8080' -> '::1')."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def is_loopback(name: str) -> bool:
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        return ip_address(name).is_loopback
    except ValueError:
        return False


class Guard:
    """ASGI middleware in front of the server's routes; `error(path, RequestError)` makes the
    refusal in the format of the API the path belongs to."""

    def __init__(
        self,
        app,
        error: Callable,
        bind_host: str = "127.0.0.1",
        allow_hosts: tuple = (),
        cors_origins: tuple = (),
        api_key: Optional[str] = None,
    ):
        self.app, self.error, self.api_key = app, error, api_key
        self.hosts = {host_name(h) for h in (bind_host, *allow_hosts)} - {"0.0.0.0", "::", ""}
        self.any_host = "*" in allow_hosts
        self.origins = {origin.rstrip("/").lower() for origin in cors_origins}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self.refusal(scope["path"], Headers(scope=scope), scope["method"])
        if refusal is not None:
            return await self.error(scope["path"], refusal)(scope, receive, send)
        return await self.app(scope, receive, send)

    def refusal(self, path: str, headers: Headers, method: str = "GET") -> Optional[RequestError]:
        host = host_name(headers.get("host", ""))
        if not (self.any_host or is_loopback(host) or host in self.hosts):
            return RequestError(
                f"Host {host!r} is not served here; start the server with --allow-host {host} to serve it",
                403,
                code="host_not_allowed",
            )
        origin = headers.get("origin")
        if origin is not None and not self.origin_allowed(origin):
            return RequestError(
                f"requests from the web page at {origin} are not allowed (pages on localhost are); "
                f"start the server with --cors-origin {origin} to allow them",
                403,
                code="origin_not_allowed",
            )
        preflight = method == "OPTIONS" and "access-control-request-method" in headers  # carries no key
        if self.api_key is not None and path != "/health" and not preflight and not self.key_matches(headers):
            return RequestError(
                "a valid API key is required: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                401,
                code="invalid_api_key",
            )
        return None

    def origin_allowed(self, origin: str) -> bool:
        if origin.rstrip("/").lower() in self.origins or "*" in self.origins:
            return True
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and is_loopback((parts.hostname or "").lower())

    def key_matches(self, headers: Headers) -> bool:
        bearer = headers.get("authorization", "")
        given = bearer[7:].strip() if bearer[:7].lower() == "bearer " else headers.get("x-api-key", "")
        return hmac.compare_digest(given.encode(), self.api_key.encode())


class BrowserAccess(CORSMiddleware):
    """CORS answers (preflights, Access-Control-Allow-Origin) for the pages `origin_allowed`
    lets through: loopback pages and the --cors-origin ones, with the Guard's own rule.  It
    sits in front of the Guard, so its refusals (a missing API key, say) reach such a page
    readable; a request from any other page goes on to the Guard, whose refusal names the flag."""

    def __init__(self, app, origin_allowed: Callable[[str], bool], cors_origins: tuple = ()):
        super().__init__(
            app,
            allow_origins=list(cors_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            allow_private_network=True,  # Chrome asks before a public page it was allowed reaches a local server
            expose_headers=["x-dflash-ignored-fields"],
        )
        self.origin_allowed = origin_allowed

    def is_allowed_origin(self, origin: str) -> bool:
        return self.origin_allowed(origin)

    async def __call__(self, scope, receive, send):
        origin = Headers(scope=scope).get("origin") if scope["type"] == "http" else None
        if origin is not None and not self.origin_allowed(origin):
            return await self.app(scope, receive, send)
        await super().__call__(scope, receive, send)
