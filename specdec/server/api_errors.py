"""The server's errors as OpenAI sends them: an HTTP status with {"error": {message, type, param, code}}; the
worker's exceptions mapped to theirs (429 busy, 504 timeout, 503 worker down, 400 bad input, 500 this request's
own failure)."""
from __future__ import annotations

import logging

from ..errors import SpecDecError
from .worker import Busy, JobTimeout, WorkerDown


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict | None = None):
        self.status, self.message, self.type, self.code, self.headers = status, message, type_, code, headers


def validated(kind, /, **fields):
    """A request model built by a route from another API's request (llama-server's, the Responses API's,
    Anthropic's): what it refuses is a 400 naming the field, as a client's own body would be."""
    from pydantic import ValidationError
    try:
        return kind(**fields)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()))
        raise APIError(400, f"{where + ': ' if where else ''}{str(err.get('msg')).removeprefix('Value error, ')}")


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


def job_failure(exc: BaseException) -> APIError:
    """A request the worker ended with an error (busy, timed out, its worker down, its own bad input) as sent, and
    logged in one line: a stream that answered 200 first shows it nowhere else."""
    err = as_api_error(exc)
    logging.getLogger("specdec.server").warning("a request ended with %d: %s", err.status, err.message)
    return err


def stream_failure(exc: BaseException) -> APIError:
    """What ends a stream that raised: its error as sent (a bug, anything but an APIError, is logged with its
    traceback and sent as this request's own 500), so a stream ends with an error event, never broken off."""
    if not isinstance(exc, APIError):
        logging.getLogger("specdec.server").exception("a stream failed", exc_info=exc)
    return as_api_error(exc)
