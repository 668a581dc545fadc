"""The ASGI middleware in front of every route: API key, body size (however the body is sent), request counts."""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json

from fastapi.responses import JSONResponse

from .api_errors import error_body
from .metrics import Metrics

KNOWN_PATHS = {"/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/responses",
               "/v1/responses/input_tokens",
               "/v1/messages", "/v1/messages/count_tokens", "/infill", "/completion", "/completions", "/tokenize",
               "/detokenize", "/apply-template", "/props"}


def as_json(scope: dict) -> dict:
    """The request with its body's type said to be JSON (the routes parse nothing else)."""
    headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
    return {**scope, "headers": headers + [(b"content-type", b"application/json")]}


class _BodyTooLarge(Exception):
    pass


class _NotJson(Exception):
    pass


def _refuse(constant: str):
    raise ValueError(constant)


def not_json(body: bytes) -> bool:
    """Whether the body holds NaN or Infinity, which Python's JSON reads and no JSON has (and no answer could carry
    back): a 400 before any route parses it. (A cheap search first: only such bodies are read twice.)"""
    if b"NaN" not in body and b"Infinity" not in body:
        return False
    try:
        json.loads(body, parse_constant=_refuse)
    except ValueError as e:
        return str(e) in ("NaN", "Infinity", "-Infinity")
    return False


class Guard:
    """Pure ASGI middleware (BaseHTTPMiddleware would hide client disconnects from the endpoints): API key and
    body-size checks before any parsing, and a request counter by endpoint and status."""

    def __init__(self, app, api_key: str | list[str] | None, max_body_bytes: int, metrics: Metrics):
        self.app, self.max_body, self.metrics = app, max_body_bytes, metrics
        self.keys = [api_key] if isinstance(api_key, str) else list(api_key or [])

    def tenant(self, headers: dict) -> bytes | None:
        """The tenant of a request's key (each key is one: its prompts are cached apart from every other key's), b""
        when no keys are set, None for a missing or wrong key. Every key is compared in constant time."""
        if not self.keys:
            return b""
        sent = headers.get(b"authorization") or b"Bearer " + headers.get(b"x-api-key", b"")  # Anthropic's clients
        if sent[:6].lower() == b"basic ":  # a browser's (the dashboard): the key is the password, any user name
            try:
                sent = b"Bearer " + base64.b64decode(sent[6:].strip(), validate=True).partition(b":")[2]
            except binascii.Error:
                return None
        match = [hmac.compare_digest(sent, f"Bearer {k}".encode()) for k in self.keys]  # all of them: no timing
        return hashlib.blake2b(b"key:" + self.keys[match.index(True)].encode(), digest_size=16).digest() \
            if any(match) else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, headers = scope["path"], dict(scope["headers"])
        status = {"code": 500}

        async def send_counted(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        async def read_body() -> bytes:
            """The whole body, refused past max_body however it is sent (Content-Length or chunked): the size is
            checked here, before the app parses anything."""
            parts, size, more = [], 0, True
            while more:
                message = await receive()
                if message["type"] != "http.request":
                    break
                parts.append(message.get("body", b""))
                size += len(parts[-1])
                if size > self.max_body:
                    raise _BodyTooLarge
                more = message.get("more_body", False)
            return b"".join(parts)

        try:
            tenant = self.tenant(headers)
            scope.setdefault("state", {})["tenant"] = tenant or b""  # the routes salt the prefix cache with it
            if tenant is None and path != "/health":  # (a browser asks for the key on the dashboard's page)
                ask = {"www-authenticate": 'Basic realm="specdec"'} if path.startswith("/dashboard") else None
                await JSONResponse(error_body("missing or invalid API key", "authentication_error",
                                              "invalid_api_key"), 401, headers=ask)(scope, receive, send_counted)
            elif int(headers.get(b"content-length", b"0") or 0) > self.max_body:
                raise _BodyTooLarge
            else:
                body, replayed = await read_body(), False
                if not_json(body):
                    raise _NotJson
                # `curl -d` says its body is a form: every body here is JSON, and read as such (as llama-server does)
                if scope["method"] == "POST" and not headers.get(b"content-type", b"").split(b";")[0].endswith(b"json"):
                    scope = as_json(scope)

                async def replay():  # the body once, then the real channel (disconnect detection)
                    nonlocal replayed
                    if replayed:
                        return await receive()
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                await self.app(scope, replay, send_counted)
        except _NotJson:
            await JSONResponse(error_body("the body holds NaN or Infinity, which JSON does not have"), 400)(
                scope, receive, send_counted)
        except _BodyTooLarge:
            await JSONResponse(error_body(f"request body larger than {self.max_body} bytes"), 413)(
                scope, receive, send_counted)
        finally:
            self.metrics.requests.labels(endpoint=path if path in KNOWN_PATHS else "/v1/models/{id}"
                                         if path.startswith("/v1/models/") else "other",
                                         status=str(status["code"])).inc()
