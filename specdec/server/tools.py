"""Function calling (OpenAI `tools`) on any chat model. A chat template with a tool format of its own (Qwen's and
Hermes': tools listed in <tools></tools>, each call a JSON object {"name": ..., "arguments": {...}} inside
<tool_call></tool_call>) gets the tools and renders them as its model was trained to read them; any other model
gets them described in a system message, a call being such a JSON object alone. With `tool_choice` "required" or a
named function the output is constrained to a call by a grammar (constraints.py), so it always parses; with "auto"
the model answers freely and an answer that holds calls of known tools (in its format) becomes the calls.
"""
from __future__ import annotations

import json
import re
import uuid

HERMES = "hermes"  # the <tool_call> format (vLLM's parser of the same name)
CALL_TAGS = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
FENCED = re.compile(r"```(?:json)?\s*\n(.*?)\n?```", re.S)  # a small model's call in a Markdown code block

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


def native(tokenizer) -> str | None:
    """The tool format of the tokenizer's chat template (HERMES), or None: tools then go in a system message."""
    template = getattr(tokenizer, "chat_template", None)
    return HERMES if isinstance(template, str) and "<tool_call>" in template and "tools" in template else None


def described(tokenizer, messages: list[dict], tools: list[dict]) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools for the chat template): the template's own tool format where it has one, else the tools
    described in a system message."""
    return (messages, tools) if native(tokenizer) else (with_tools(messages, tools), None)


def chat_prompt(tokenizer, chat) -> tuple[list[dict], list[dict] | None]:
    """A ChatRequest's messages as the template gets them, and the tools it renders itself (None: none, or described
    in the messages): what the chat path encodes, for the routes that only count it."""
    messages = [m.for_template() for m in chat.messages]
    if chat.tools and chat.tool_choice != "none":
        return described(tokenizer, messages, chat.tools)
    return messages, None


def with_tools(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The messages with the tools described in the system message (appended to the first one, or a new one)."""
    spec = json.dumps([{k: v for k, v in t["function"].items() if k in ("name", "description", "parameters")}
                       for t in tools], ensure_ascii=False)
    text = PREAMBLE.format(tools=spec)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def call_format(tools: list[dict], tool_choice, fmt: str | None = None) -> dict | None:
    """The response_format that forces a call ("required" or a named function), else None; in the HERMES format,
    one call inside its tags, its JSON spaced as the template writes it."""
    if tool_choice != "required" and not isinstance(tool_choice, dict):
        return None
    chosen = [t for t in tools if not isinstance(tool_choice, dict)
              or t["function"]["name"] == tool_choice["function"]["name"]]
    options = [{"type": "object", "properties": {
        "name": {"const": t["function"]["name"]},
        "arguments": closed(t["function"].get("parameters") or {"type": "object", "properties": {}})},
        "required": ["name", "arguments"], "additionalProperties": False} for t in chosen]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    if fmt == HERMES:
        spaced = {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
                  **schema}
        return {"type": "lark", "grammar": 'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json '
                + json.dumps(spaced)}
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
    """OpenAI tool_calls for an answer that holds calls of known tools in <tool_call> tags (every one of them must
    parse), or that is exactly one such call, bare or as the only thing in a ```json block (as small models, Qwen's
    Coder among them, write calls whatever their template asks for), else None."""
    names = {t["function"]["name"] for t in tools}
    tagged = CALL_TAGS.findall(text)
    fenced = FENCED.fullmatch(text.strip())
    calls = [_call(body, names) for body in tagged] if tagged else [_call(fenced.group(1) if fenced else text, names)]
    if not calls or any(c is None for c in calls):
        return None
    return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
             "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}} for name, args in calls]


def _call(text: str, names: set) -> tuple[str, dict] | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names or not isinstance(obj.get("arguments", {}), dict):
        return None
    return obj["name"], obj.get("arguments", {})
