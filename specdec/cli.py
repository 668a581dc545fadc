"""Command line: `specdec generate PROMPT ...` (more subcommands register themselves in COMMANDS)."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
import sys

from .errors import SpecDecError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one readable line, exit 2 (argparse prints usage too; keep it short)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _model_args(p):
    p.add_argument("--target", default="default", help="HF model dir, .gguf file, or 'default' (SmolLM2-135M)")
    p.add_argument("--draft", default=None,
                   help="'datastore+ngram' (the default target's default), 'shipped', 'ngram', 'none' (target only), "
                        "'target', a draft dir/.gguf, or A+B (A first, B when A proposes nothing)")
    p.add_argument("--tau", type=int, default=3, help="draft block size (tokens proposed per cycle; default 3)")
    p.add_argument("--policy", default="fixed", help="how tau is chosen each cycle: fixed (default), adaptive, heuristic")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template (a file, or the template's text) in place of the model's own")
    p.add_argument("--chat-template-kwargs", default=None, type=_json_object, metavar="JSON",
                   help="variables for the chat template, e.g. '{\"enable_thinking\": false}'")
    backend_arg(p)


def backend_arg(p):
    from .api import DEFAULT_NUMERICS
    p.add_argument("--backend", default="auto", choices=["auto", "runtime", "transformers"],
                   help="what runs the models: specdec's runtime (auto: where it supports the model) or transformers")
    p.add_argument("--numerics", default=DEFAULT_NUMERICS, choices=["auto", "exact", "q8"],
                   help="the runtime's arithmetic: exact (bitwise transformers' fp32 on the dequantized weights), q8 "
                        "(int8 activations, close to exact, faster), or auto (default: q8 where the runtime's kernels "
                        "run, else exact)")
    threads_arg(p)


def threads_arg(p):
    p.add_argument("--threads", type=_threads, default=None,
                   help="threads the models run on (default: torch's, one per core); outputs are the same whatever "
                        "the count")


def _threads(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return int(text)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text[:60]!r}")
    return value


def _sampling_args(p):
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-chat", action="store_true", help="feed the prompt as raw text (no chat template)")


def cmd_generate(args) -> int:
    from .api import SpecDecoder
    from .policy import make_policy
    from .sampling import SamplingParams, seed_from_os
    from .trace import write_jsonl

    seed_from_os()  # an unseeded sampled answer differs from one run to the next

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    make_policy(args.policy, 1)  # validate before loading models
    SamplingParams(args.temperature, args.top_p, args.top_k, args.seed, args.min_p)
    prediction = _read_text(args.prediction, "prediction")
    bias = _logit_bias(args.logit_bias)
    from .penalties import penalties
    penalties(None, args.presence_penalty, args.frequency_penalty, bias, args.repetition_penalty)  # before loading
    sd = SpecDecoder(target=args.target, draft=args.draft, tau=args.tau, policy=args.policy, backend=args.backend,
                     numerics=args.numerics, chat_template=args.chat_template,
                     chat_template_kwargs=args.chat_template_kwargs)
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                  top_k=args.top_k, seed=args.seed, min_p=args.min_p, chat=not args.no_chat, stop=args.stop,
                  response_format=_response_format(args.schema), prediction=prediction,
                  presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty, logit_bias=bias,
                  repetition_penalty=args.repetition_penalty)
    if args.suffix is not None:  # the FIM prompt, as token ids (its special tokens are not text)
        from .fim import fim_prompt
        kwargs.update(prompt_ids=fim_prompt(sd.tokenizer, prompt, args.suffix), chat=False)
    for chunk in sd.stream_chunks(prompt, **kwargs):
        if not args.json:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    result = chunk.result
    if args.trace:  # with the target's measured verify curve: the analyzer's reference for one target step
        from .costs import measure_verify_curve
        ids = sd.encode(prompt, not args.no_chat)
        curve = measure_verify_curve(sd.model, sd.model.config.vocab_size, ids, max(sd.tau + 1, 9), reps=5)
        try:
            write_jsonl(result.records, args.trace, {"verify_curve": {str(k): round(v, 3) for k, v in curve.items()},
                                                     "numerics": sd.numerics})
        except OSError as e:
            raise SpecDecError(f"cannot write trace {args.trace}: {e.strerror}")
    s = result.stats
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "stats": s}))
    else:
        print()
        rate = "n/a" if s["acceptance_rate"] is None else f"{s['acceptance_rate']:.2f}"
        print(f"[{s['new_tokens']} tokens in {s['wall_s']:.2f}s = {s['tokens_per_s']} tok/s | draft "
              f"{sd.draft_name} tau={sd.tau} policy={sd.policy} | acceptance {rate}, mean accepted {s['mean_accepted_len']}, "
              f"{s['target_passes']} target passes]", file=sys.stderr)
    return 0


def _read_text(path: str | None, what: str) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise SpecDecError(f"cannot read the {what} file {path}: {e.strerror}")
    except UnicodeDecodeError:
        raise SpecDecError(f"the {what} file {path} is not UTF-8 text")


def _response_format(schema: str | None) -> dict | None:
    """--schema: 'json' (any JSON object) or a JSON schema file -> OpenAI's response_format."""
    if schema is None:
        return None
    if schema == "json":
        return {"type": "json_object"}
    try:
        loaded = json.loads(Path(schema).read_text())
    except OSError as e:
        raise SpecDecError(f"cannot read schema {schema}: {e.strerror}")
    except ValueError as e:
        raise SpecDecError(f"{schema} is not JSON: {e}")
    return {"type": "json_schema", "json_schema": {"name": Path(schema).stem, "schema": loaded}}


def _logit_bias(text: str | None) -> dict | None:
    """--logit-bias '{"1234": -100}' -> OpenAI's logit_bias (its ranges checked by penalties.penalties)."""
    if text is None:
        return None
    try:
        bias = json.loads(text)
    except ValueError:
        raise SpecDecError('--logit-bias must be a JSON object of token ids to biases, e.g. \'{"1234": -100}\'')
    return bias


def build_parser(argv=None) -> argparse.ArgumentParser:
    parser = _Parser(prog="specdec", description="Lossless speculative decoding for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    g = sub.add_parser("generate", help="generate text for one prompt, streaming it to stdout")
    g.add_argument("prompt", help="the prompt text, or - to read it from stdin")
    _model_args(g)
    _sampling_args(g)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--trace", default=None, help="write one JSON record per cycle to this JSONL file")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, stats)")
    g.add_argument("--prediction", default=None, metavar="FILE",
                   help="text the output is expected to mostly be (the file being edited): drafted beside the output; "
                        "the output is the same without it")
    g.add_argument("--suffix", default=None, metavar="TEXT",
                   help="fill in the middle: the prompt is the code before the gap, this the code after it (models "
                        "with FIM tokens: Qwen2.5-Coder, StarCoder)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="sampling: keep the tokens at least this fraction as likely as the likeliest (0 = off)")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="OpenAI's presence_penalty in [-2, 2]: lowers every token already generated by this much")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="OpenAI's frequency_penalty in [-2, 2]: lowers a generated token by this much per time it came")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="vLLM's repetition_penalty in (0, 2]: a token seen in the prompt or output has its score "
                        "divided by this when positive, multiplied when not (1 = off)")
    g.add_argument("--logit-bias", default=None, metavar="JSON",
                   help='OpenAI\'s logit_bias: \'{"TOKEN_ID": BIAS}\' with BIAS in [-100, 100] (-100 bans a token)')
    g.add_argument("--schema", default=None,
                   help="structured output: 'json' (any JSON object) or a JSON schema file the output follows")
    g.set_defaults(func=cmd_generate)
    for register in _extra_commands(argv):
        register(sub, _model_args, _sampling_args)
    return parser


# subcommand -> the module that registers it; only the one asked for is imported (a cold `specdec generate` does
# not pay for transformers' generation utilities or the server's web stack)
COMMANDS = {"bench": "bench", "tune": "tune", "analyze": "report", "check": "check", "distill": "distill",
            "serve": "server", "perplexity": "perplexity", "datastore": "datastore", "calibrate": "calibrate",
            "vocab": "vocab"}


def _extra_commands(argv=None):
    import importlib
    args = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in args if not a.startswith("-")), None)
    if command == "generate":
        return []
    names = [COMMANDS[command]] if command in COMMANDS else list(COMMANDS.values())
    out = []
    for name in names:
        try:
            out.append(importlib.import_module(f".{name}", __package__).register)
        except ImportError:  # the server extra is not installed
            if name != "server":
                raise
    return out



def main(argv=None) -> int:
    args = build_parser(argv).parse_args(argv)
    if getattr(args, "threads", None) is not None:
        import torch
        torch.set_num_threads(args.threads)  # the kernels split their work over torch's thread count
    try:
        return args.func(args)
    except SpecDecError as e:
        print(f"specdec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specdec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


def entry() -> None:
    """The `specdec` command: main(), then the process ends without Python's teardown. A cold `generate` on the
    1.5B spent 0.55 s of its 3.2 s tearing torch down after its last token (CHANGELOG.md: docs/pair.md's start-up, 2026-12-02). Every command
    has closed its files by then; only the standard streams need flushing."""
    rc = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, OSError, ValueError):
            pass
    os._exit(0 if rc is None else rc if isinstance(rc, int) else 1)


if __name__ == "__main__":
    entry()
