"""Function calling with `tool_choice: "auto"`: how often a model calls the right tool with its required arguments
where a tool answers the request, and calls none where none does, with the tools described by its own chat template
(server/tools.py, `native`) against the same tools in a system message (the format for templates without one).
Greedy, in process, both arms on the same prompts.

    python benchmarks/serve.py tool-calls --target ~/.cache/specdec/pair/coder15.gguf [--json docs/tool_calls_pair.json]
"""
from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Current local time in an IANA timezone",
                                      "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}},
                                                     "required": ["timezone"]}}},
    {"type": "function", "function": {"name": "convert_currency", "description": "Convert an amount of money",
                                      "parameters": {"type": "object", "properties": {
                                          "amount": {"type": "number"}, "from": {"type": "string"},
                                          "to": {"type": "string"}}, "required": ["amount", "from", "to"]}}},
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the user's project",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                     "required": ["path"]}}},
]
# (request, the tool that answers it or None)
CASES = [
    ("What's the weather like in Lisbon right now?", "get_weather"),
    ("Is it raining in Tokyo?", "get_weather"),
    ("What time is it in Sydney?", "get_time"),
    ("Tell me the current time in New York.", "get_time"),
    ("How much is 250 US dollars in euros?", "convert_currency"),
    ("Convert 1000 yen to pounds.", "convert_currency"),
    ("Show me what's in src/main.py.", "read_file"),
    ("Open README.md and tell me what it says.", "read_file"),
    ("Write a haiku about autumn.", None),
    ("What is 17 times 23?", None),
    ("Explain what a Python decorator is in two sentences.", None),
    ("Reverse the string 'hello' in Python.", None),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from specdec import SpecDecoder
    from specdec.server import tools
    sd = SpecDecoder(target=args.target, draft="none")
    if tools.native(sd.tokenizer) is None:
        raise SystemExit("this target's chat template has no tool format of its own: nothing to compare")
    required = {t["function"]["name"]: set(t["function"]["parameters"]["required"]) for t in TOOLS}
    rows, score = [], {"native": [0, 0], "system message": [0, 0]}  # [right calls, right no-calls]
    for request, wanted in CASES:
        messages = [{"role": "user", "content": request}]
        for arm in ("native", "system message"):
            if arm == "native":
                ids = sd.encode(messages, True, TOOLS)
            else:
                ids = sd.encode(tools.with_tools(messages, TOOLS), True)
            out = sd.generate("", prompt_ids=ids, max_new_tokens=args.max_tokens)
            calls = tools.parse_call(out.text, TOOLS) or []
            names = [c["function"]["name"] for c in calls]
            right = (not calls) if wanted is None else (
                names == [wanted] and required[wanted] <= set(json.loads(calls[0]["function"]["arguments"])))
            score[arm][wanted is None] += right
            rows.append({"request": request, "wanted": wanted, "arm": arm, "right": right, "calls": names,
                         "text": out.text[:200]})
            print(f"{arm:15s} {'ok ' if right else 'BAD'} {request[:48]:48s} -> {names or out.text[:60]!r}",
                  flush=True)
    calls_wanted = sum(w is not None for _, w in CASES)
    summary = {arm: {"right calls": f"{s[0]}/{calls_wanted}", "right answers without a call":
                     f"{s[1]}/{len(CASES) - calls_wanted}"} for arm, s in score.items()}
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": os.path.basename(args.target), "max_tokens": args.max_tokens, "summary": summary,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
