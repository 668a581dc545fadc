"""The server's errors as OpenAI sends them: an HTTP status with {"error": {message, type, param, code}}; the
worker's exceptions mapped to theirs (429 busy, 504 timeout, 503 worker down, 400 bad input, 500 this request's
own failure)."""
from __future__ import annotations

from ..errors import SpecDecError
from .worker import Busy, JobTimeout, WorkerDown


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict | None = None):
        self.status, self.message, self.type, self.code, self.headers = status, message, type_, code, headers


def error_body(message: str, type_: str = "invalid_request_error", code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def as_api_error(exc) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, JobTimeout):
        return APIError(504, str(exc), "timeout_error", "timeout")
    if isinstance(exc, Busy):
        return APIError(429, str(exc), "rate_limit_error", exc.code, {"Retry-After": str(exc.retry_after)})
    if isinstance(exc, SpecDecError):
        return APIError(400, str(exc))
    if isinstance(exc, WorkerDown):
        return APIError(503, str(exc), "server_error", "worker_down")
    # this request's own failure (the others go on): named, without internals
    return APIError(500, f"internal error in this request: {type(exc).__name__}", "server_error", "internal_error")
