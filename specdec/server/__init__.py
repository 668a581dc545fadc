"""`specdec serve`: the OpenAI-compatible server."""
import sys

from .app import create_app

__all__ = ["create_app", "register"]


def cmd_serve(args) -> int:
    import uvicorn

    from ..api import SpecDecoder
    from ..errors import InvalidRequest
    from ..prompts import read_chat_template
    from ..sampling import seed_from_os

    seed_from_os()  # unseeded answers differ across restarts

    if not 0 < args.port < 65536 or args.max_queue < 1 or args.timeout <= 0 or args.max_tau < 0 or (
            args.kv_memory is not None and not args.kv_memory > 0) or not args.response_store_mb >= 0 or \
            args.max_tokens < 0:
        raise InvalidRequest("--port must be 1-65535, --max-queue >= 1, --timeout > 0, --max-tau >= 0, "
                             "--kv-memory > 0, --response-store-mb >= 0 and --max-tokens >= 0")
    if args.ray:
        from .ray_serve import run
        run(dict(target=args.target, draft=args.draft, tau=args.tau, policy=args.policy, backend=args.backend,
                 numerics=args.numerics, kv_memory=args.kv_memory, threads=args.threads,
                 chat_template=None if args.chat_template is None else read_chat_template(args.chat_template),
                 chat_template_kwargs=args.chat_template_kwargs,
                 model_name=args.model_name, api_key=args.api_key, max_queue=args.max_queue, timeout=args.timeout,
                 max_tokens=args.max_tokens,
                 trace_dir=args.trace_dir, batch=not args.no_batch, max_batch_rows=args.max_batch_rows,
                 prefill_chunk=args.prefill_chunk, max_tau=args.max_tau, replicas=args.replicas,
                 reasoning_format=args.reasoning_format,
                 autoscaling=args.ray_autoscaling, cpus_per_replica=args.cpus_per_replica),
            args.host, args.port, args.ray_address)
        return 0

    def decoder():  # built on the model worker's thread (server/worker.py says why)
        return SpecDecoder(target=args.target, draft=args.draft, tau=args.tau, policy=args.policy,
                           backend=args.backend, numerics=args.numerics, kv_memory=args.kv_memory,
                           chat_template=args.chat_template, chat_template_kwargs=args.chat_template_kwargs)
    app = create_app(decoder, model_name=args.model_name, api_key=args.api_key, max_queue=args.max_queue,
                     timeout_s=args.timeout, trace_dir=args.trace_dir, batch=not args.no_batch,
                     max_batch_rows=args.max_batch_rows, prefill_chunk=args.prefill_chunk, max_tau=args.max_tau,
                     reasoning_format=args.reasoning_format, response_store_mb=args.response_store_mb,
                     max_tokens_default=args.max_tokens, pass_log=args.pass_log)
    print(describe_kv(app.state.decoder.model), file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def describe_kv(model) -> str:
    """The line `serve` prints at start: the KV budget and what it holds."""
    from .. import models
    if not models.is_runtime(model):
        return "specdec: KV cache: transformers' (no budget)"
    per, budget = model.kv_bytes_per_position, model.kv_budget
    dtype = str(model.kv_dtype).removeprefix("torch.")
    return (f"specdec: KV cache {budget / 2**30:.2f} GiB: {budget // per:,} positions at {per:,} bytes ({dtype}), "
            f"{budget // per / model.max_len:.1f} whole contexts of {model.max_len}")


def register(sub, model_args, sampling_args):
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server with Prometheus metrics")
    model_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' (all but /health); repeatable: each key is a tenant "
                        "whose prompts are cached apart from the others'")
    s.add_argument("--model-name", default="specdec", help="the model id clients send and /v1/models lists")
    s.add_argument("--max-queue", type=int, default=16, help="requests waiting or running; beyond: 429")
    s.add_argument("--timeout", type=float, default=300.0, help="seconds per request before it is stopped")
    s.add_argument("--max-tokens", type=int, default=256,
                   help="the answer's length for a request that sets none (max_tokens, max_output_tokens, n_predict "
                        "-1); 0: until the context window (agents such as Codex send none)")
    s.add_argument("--trace-dir", default=None, help="write one per-cycle JSONL trace per request here")
    s.add_argument("--pass-log", default=None, metavar="FILE",
                   help="append one JSON line per target pass here: its rows, drafts, accepted tokens and time "
                        "against the curve's price (batch/pass_log.py; `python benchmarks/serve.py pass-log FILE`)")
    s.add_argument("--max-batch-rows", type=int, default=None,
                   help="rows per target pass, all requests together (default: from the pass curve measured at start)")
    s.add_argument("--prefill-chunk", type=int, default=32, help="prompt rows per pass for a joining request")
    s.add_argument("--max-tau", type=int, default=8,
                   help="the most draft tokens the scheduler gives a request per cycle (a request's own tau, or "
                        "policy=fixed with tau, overrides it)")
    s.add_argument("--kv-memory", type=float, default=None, metavar="GIB",
                   help="GiB for every request's K/V together (default: half the available memory, at most 64 "
                        "whole contexts); requests wait, or are preempted, when it is full")
    s.add_argument("--no-batch", action="store_true", help="serve one request at a time (no continuous batching)")
    s.add_argument("--reasoning-format", default="auto", choices=["auto", "deepseek", "none"],
                   help="a thinking model's <think> text: in the message's reasoning_content (auto, deepseek: where "
                        "the chat template writes the tags) or left in the content (none)")
    s.add_argument("--response-store-mb", type=float, default=64.0, metavar="MB",
                   help="memory for stored Responses API responses (previous_response_id, GET /v1/responses/{id}), "
                        "per process, an even share per --api-key, least recently used out first; 0 stores none "
                        "(as behind --ray)")
    r = s.add_argument_group("scale-out on Ray Serve (pip install 'specdec[ray]')")
    r.add_argument("--ray", action="store_true", help="serve N replicas behind Ray Serve's HTTP proxy")
    r.add_argument("--replicas", type=int, default=1, help="replicas, each with its own model")
    r.add_argument("--ray-autoscaling", default=None,
                   help="Ray Serve autoscaling_config as JSON (replaces --replicas), e.g. "
                        "'{\"min_replicas\": 1, \"max_replicas\": 4}'")
    r.add_argument("--cpus-per-replica", type=float, default=1.0, help="CPUs Ray reserves for each replica")
    r.add_argument("--ray-address", default=None, help="join this Ray cluster instead of starting a local one")
    s.set_defaults(func=cmd_serve)
