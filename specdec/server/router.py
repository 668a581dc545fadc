"""The Ray Serve router in front of the model replicas (ray_serve.py): every request passes through unchanged but
for a seed given to sampled requests (failover.with_seed); a request whose replica dies is sent again, up to
ATTEMPTS times, and a stream resumes where the client is (failover.Resumer)."""

import asyncio
import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .api_errors import error_body
from .failover import resumed_events, with_seed

ATTEMPTS = 4  # tries per request: a replica that dies and the ones that take over
RETRY_WAIT_S = 0.5  # between tries, while Serve notices the death and routes around it
HOP = {"content-length", "host", "transfer-encoding", "connection"}
log = logging.getLogger("specdec.server")


def router_deployment(serve, timeout_s: float):
    """The router's Serve deployment class (one replica: it holds no model)."""
    app = FastAPI(title="specdec", docs_url=None, redoc_url=None)

    @serve.deployment(name="specdec", num_replicas=1, ray_actor_options={"num_cpus": 0},
                      max_ongoing_requests=100000)
    @serve.ingress(app)
    class Router:
        def __init__(self, replica):
            self.replica = replica
            self.retries = 0

        def attempt(self, request: Request, path: str, body: bytes):
            headers = [(k.encode(), v.encode()) for k, v in request.headers.items() if k.lower() not in HOP]
            headers.append((b"content-length", str(len(body)).encode()))
            return self.replica.options(stream=True).request.remote(request.method, path, request.url.query.encode(),
                                                                    headers, body)

        @app.get("/router")
        async def stats(self):
            """The router's own figures: requests it sent again because their replica died."""
            return {"retries": self.retries}

        @app.api_route("/{rest:path}", methods=["GET", "POST"])
        async def forward(self, rest: str, request: Request):
            path = "/" + rest
            body = with_seed(path, await request.body())
            try:
                streamed = bool(json.loads(body).get("stream")) if body else False
            except (ValueError, AttributeError):
                streamed = False
            for tries in range(ATTEMPTS):
                if tries:
                    self.retries += 1
                    await asyncio.sleep(RETRY_WAIT_S)
                gen = self.attempt(request, path, body)
                try:
                    start = await gen.__anext__()
                    if streamed and start[1] == 200:
                        return StreamingResponse(self.resume(request, path, body, gen, tries),
                                                 status_code=200, headers=_headers(start[2]))
                    chunks = [item async for item in gen]
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001 - the replica went away: another one takes the request
                    log.warning("a replica failed a request (%s); sending it again", type(e).__name__)
                    continue
                return Response(b"".join(chunks), status_code=start[1], headers=_headers(start[2]))
            return JSONResponse(error_body("no replica could serve this request; retry", "server_error",
                                           "worker_down"), 503)

        async def resume(self, request: Request, path: str, body: bytes, gen, tries: int):
            """The stream's events; when its replica dies, the same request again on another, its events from where
            the client is (failover.resumed_events)."""
            current = [gen]  # the attempt under way (this request's own)

            def again():
                self.retries += 1
                current[0] = self.attempt(request, path, body)
                return current[0]
            try:
                async for event in resumed_events(gen, again, ATTEMPTS - tries, RETRY_WAIT_S):
                    yield event
            finally:  # the client hung up, or the stream ended: the replica's work stops with it
                if hasattr(current[0], "cancel"):
                    current[0].cancel()

    return Router


def _headers(pairs: list) -> dict:
    return {k: v for k, v in pairs if k.lower() not in HOP}
