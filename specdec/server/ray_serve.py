"""Scale-out on Ray Serve (`pip install specdec[ray]`): N replicas of the same FastAPI app, each a process with its
own model and batching worker, behind a router (failover.py) behind Ray Serve's HTTP proxy. Ray balances requests
over the replicas, replaces a replica that dies and autoscales; the router seeds every sampled request before a
replica sees it and, when the replica serving a request dies, sends it to another and resumes its stream where the
client is (one unbroken stream, equal to the request served alone).

    specdec serve --ray --replicas 2                                   # a local Ray instance, port 8000
    specdec serve --ray --ray-autoscaling '{"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8}'
    serve run specdec.server.ray_serve:build replicas=2 target=default   # Ray's own CLI, the same application
"""
from __future__ import annotations

import json

from ..errors import InvalidRequest

DEFAULTS = dict(target="default", draft=None, tau=None, policy=None, backend="auto", numerics="auto", kv_memory=None,
                threads=None, chat_template=None, chat_template_kwargs=None, model_name="specdec",
                api_key=None, max_queue=16, timeout=300.0, max_tokens=256, trace_dir=None, batch=True, max_batch_rows=None,
                prefill_chunk=32, max_tau=8, reasoning_format="auto", replicas=1, autoscaling=None,
                cpus_per_replica=1.0)


def _ray():
    try:
        from ray import serve
    except ImportError:
        raise InvalidRequest("Ray Serve is not installed: pip install 'specdec[ray]'") from None
    return serve


def build(args: dict | None = None):
    """The Ray Serve application (also an application builder for `serve run`, which passes key=value strings)."""
    serve = _ray()
    opts = {**DEFAULTS, **(args or {})}
    autoscaling = opts["autoscaling"]
    if isinstance(autoscaling, str):
        try:
            autoscaling = json.loads(autoscaling)
        except ValueError:
            raise InvalidRequest(f"--ray-autoscaling must be a JSON object, got {autoscaling!r}") from None
    variables = opts["chat_template_kwargs"]
    if isinstance(variables, str):  # `serve run` passes strings
        try:
            variables = json.loads(variables)
        except ValueError:
            raise InvalidRequest(f"chat_template_kwargs must be a JSON object, got {variables!r}") from None
    replicas = int(opts["replicas"])
    if replicas < 1 and not autoscaling:
        raise InvalidRequest("--replicas must be >= 1")

    def make_app():  # runs in each replica process
        from ..api import DEFAULT_POLICY, DEFAULT_TAU, SpecDecoder
        from ..sampling import seed_from_os
        from .app import create_app

        seed_from_os()  # replicas do not repeat each other's unseeded answers
        if opts["threads"]:
            import torch
            torch.set_num_threads(int(opts["threads"]))

        def decoder():
            return SpecDecoder(target=opts["target"], draft=opts["draft"], tau=int(opts["tau"] or DEFAULT_TAU),
                               policy=opts["policy"] or DEFAULT_POLICY, backend=opts["backend"],
                               numerics=opts["numerics"],
                               kv_memory=float(opts["kv_memory"]) if opts["kv_memory"] else None,
                               chat_template=opts["chat_template"], chat_template_kwargs=variables)
        return create_app(decoder, model_name=opts["model_name"], api_key=opts["api_key"],
                          max_tokens_default=int(opts["max_tokens"]),
                          max_queue=int(opts["max_queue"]), timeout_s=float(opts["timeout"]),
                          trace_dir=opts["trace_dir"], batch=str(opts["batch"]).lower() not in ("0", "false", "no"),
                          max_batch_rows=int(opts["max_batch_rows"]) if opts["max_batch_rows"] else None,
                          prefill_chunk=int(opts["prefill_chunk"]), max_tau=int(opts["max_tau"]),
                          reasoning_format=opts["reasoning_format"],
                          response_store_mb=0)  # a follow-up may reach another replica: no replica stores

    scaling = {"autoscaling_config": autoscaling} if autoscaling else {"num_replicas": replicas}

    # each replica reserves its CPUs; Ray sets OMP_NUM_THREADS to them, so replicas do not oversubscribe the cores
    @serve.deployment(name="specdec-model", max_ongoing_requests=int(opts["max_queue"]),
                      ray_actor_options={"num_cpus": float(opts["cpus_per_replica"])}, **scaling)
    class Replica:
        def __init__(self):
            self.app = make_app()

        async def request(self, method: str, path: str, query: bytes, headers: list, body: bytes):
            from .failover import asgi_stream
            async for item in asgi_stream(self.app, method, path, query, headers, body):
                yield item

    from .router import router_deployment
    return router_deployment(serve, float(opts["timeout"])).bind(Replica.bind())


def run(args, host: str, port: int, address: str | None = None) -> None:
    """`specdec serve --ray`: start (or join) Ray, put the application behind Serve's proxy on host:port, block."""
    serve = _ray()
    import ray
    app = build(args)  # bad options fail here, before any Ray process starts
    ray.init(address=address, ignore_reinit_error=True, include_dashboard=False)
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name="specdec", route_prefix="/", blocking=True)
