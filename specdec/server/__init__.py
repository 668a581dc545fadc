"""`specdec serve`: the OpenAI-compatible server."""
from .app import create_app

__all__ = ["create_app", "register"]


def cmd_serve(args) -> int:
    import uvicorn

    from ..api import SpecDecoder
    from ..errors import InvalidRequest

    if not 0 < args.port < 65536 or args.max_queue < 1 or args.timeout <= 0:
        raise InvalidRequest("--port must be 1-65535, --max-queue >= 1 and --timeout > 0")
    decoder = SpecDecoder(target=args.target, draft=args.draft, tau=args.tau, policy=args.policy,
                          backend=args.backend)
    app = create_app(decoder, model_name=args.model_name, api_key=args.api_key, max_queue=args.max_queue,
                     timeout_s=args.timeout, trace_dir=args.trace_dir)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def register(sub, model_args, sampling_args):
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server with Prometheus metrics")
    model_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all but /health)")
    s.add_argument("--model-name", default="specdec", help="the model id clients send and /v1/models lists")
    s.add_argument("--max-queue", type=int, default=16, help="requests waiting or running; beyond: 429")
    s.add_argument("--timeout", type=float, default=300.0, help="seconds per request before it is stopped")
    s.add_argument("--trace-dir", default=None, help="write one per-cycle JSONL trace per request here")
    s.set_defaults(func=cmd_serve)
