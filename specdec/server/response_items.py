"""The Responses API's items (input and output messages, function calls and their outputs, reasoning) as chat
messages, and as the typed items with ids that stored responses and conversations list."""
from __future__ import annotations

import secrets

from .api_errors import APIError


def _text(content, where: str) -> str:
    """A message's content: a string, or text parts (input_text / output_text) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: content must be a string or a list of text parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}: content part type {str(kind)[:40]!r} is not supported (text parts only)")
        texts.append(part["text"])
    return "\n".join(texts)


def as_messages(items: list, where: str) -> list[dict]:
    """Items (an input's, or a stored response's output) as chat messages, earlier calls as an assistant's
    tool_calls."""
    out = []
    for k, item in enumerate(items):
        at = f"{where}[{k}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind is not None and not isinstance(item.get("id", ""), str):
            raise APIError(400, f"{at}: an item's id must be a string")
        if kind == "message":
            if item.get("role") not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{at}: role must be user, system, developer or assistant")
            out.append({"role": item["role"], "content": _text(item.get("content"), at)})
        elif kind == "function_call":
            if not all(isinstance(item.get(f), str) for f in ("call_id", "name", "arguments")):
                raise APIError(400, f"{at}: a function_call needs call_id, name and arguments (strings)")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError(400, f"{at}: a function_call_output needs its call_id")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item.get("output"), at)})
        elif kind == "reasoning":
            continue  # another model's reasoning: nothing here reads it
        else:
            raise APIError(400, f"{at}: input items of type {str(kind)[:40]!r} are not supported (message, "
                                "function_call, function_call_output)")
    return out


ID_PREFIX = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_", "reasoning": "rs_"}


def as_items(items: list) -> list[dict]:
    """Items as they are listed: typed, with ids, a message's text as parts (as_messages has checked them)."""
    out = []
    for item in items:
        item = {"type": "message", **item}
        if item["type"] == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        item.setdefault("id", ID_PREFIX.get(item["type"], "item_") + secrets.token_hex(12))
        item.setdefault("status", "completed")
        out.append(item)
    return out


def page(items: list[dict], limit: int, order: str, after: str | None) -> dict:
    """OpenAI's cursor page of items: oldest first for order "asc", else newest first; those after the id `after`."""
    items = items if order == "asc" else items[::-1]
    if after is not None:
        at = [k for k, item in enumerate(items) if item["id"] == after]
        if not at:
            raise APIError(400, f"after: no item {after[:80]!r} here")
        items = items[at[0] + 1:]
    shown = items[:limit]
    return {"object": "list", "data": shown, "first_id": shown[0]["id"] if shown else None,
            "last_id": shown[-1]["id"] if shown else None, "has_more": len(items) > limit}
