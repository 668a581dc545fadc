"""Function calling (OpenAI `tools`) on any chat model: the tools are described to the model in a system message,
and a call is a JSON object {"name": ..., "arguments": {...}}. With `tool_choice` "required" or a named function the
output is constrained to such an object by a JSON-schema grammar (constraints.py), so it always parses; with "auto"
the model answers freely and an answer that is exactly such an object for a known tool becomes the call.
"""
from __future__ import annotations

import json
import uuid

PREAMBLE = ("You can call these tools:\n{tools}\nTo call one, reply with only a JSON object of the form "
            '{{"name": <tool name>, "arguments": {{<its arguments>}}}} and nothing else.')


MAX_DEPTH = 64  # levels of nesting a tool's parameter schema may have (deeper ones overflowed the stack: a 500)


def depth(value) -> int:
    """How deeply dicts and lists nest in `value`, counted without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def check(tools, tool_choice) -> None:
    """ValueError for tools or a tool_choice this server cannot serve as OpenAI defines them."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools must be a non-empty list")
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError("each tool must be {\"type\": \"function\", \"function\": {\"name\": ..., "
                             "\"parameters\": {...}}}")
        if not isinstance(fn.get("parameters", {}), dict):
            raise ValueError(f"tool {fn['name'][:40]!r}: parameters must be a JSON schema object")
        if depth(fn.get("parameters", {})) > MAX_DEPTH:
            raise ValueError(f"tool {fn['name'][:40]!r}: parameters nest deeper than {MAX_DEPTH} levels")
    names = [t["function"]["name"] for t in tools]
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if name not in names:
            raise ValueError(f"tool_choice names {str(name)[:40]!r}, which is not among the tools")
    elif tool_choice not in (None, "none", "auto", "required"):
        raise ValueError("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                         "{\"name\": ...}}")


def with_tools(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The messages with the tools described in the system message (appended to the first one, or a new one)."""
    spec = json.dumps([{k: v for k, v in t["function"].items() if k in ("name", "description", "parameters")}
                       for t in tools], ensure_ascii=False)
    text = PREAMBLE.format(tools=spec)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def call_format(tools: list[dict], tool_choice) -> dict | None:
    """The response_format that forces a call ("required" or a named function), else None."""
    if tool_choice != "required" and not isinstance(tool_choice, dict):
        return None
    chosen = [t for t in tools if not isinstance(tool_choice, dict)
              or t["function"]["name"] == tool_choice["function"]["name"]]
    options = [{"type": "object", "properties": {
        "name": {"const": t["function"]["name"]},
        "arguments": closed(t["function"].get("parameters") or {"type": "object", "properties": {}})},
        "required": ["name", "arguments"], "additionalProperties": False} for t in chosen]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {"type": "json_schema", "json_schema": {"name": "tool_call", "schema": schema}}


def closed(schema):
    """The schema with every object that does not say otherwise closed to its declared properties (as OpenAI's
    strict mode requires): a small model given an open object keeps inventing keys until max_tokens."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if out.get("type") == "object" and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def parse_call(text: str, tools: list[dict]) -> list[dict] | None:
    """OpenAI tool_calls for an answer that is exactly a call of a known tool, else None."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    names = {t["function"]["name"] for t in tools}
    if not isinstance(obj, dict) or obj.get("name") not in names or not isinstance(obj.get("arguments", {}), dict):
        return None
    return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
             "function": {"name": obj["name"], "arguments": json.dumps(obj.get("arguments", {}), ensure_ascii=False)}}]
