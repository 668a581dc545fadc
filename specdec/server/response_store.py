"""Stored responses of OpenAI's Responses API (`store`, `previous_response_id`, GET and DELETE /v1/responses/{id} and
its input_items), in this process's memory.

- **Per API key.** A response is found only under the key that made it (guard.py's tenant; without keys, the one
  shared tenant): another key's lookup is the 404 of an id that does not exist. Ids are random, never counted.
- **A chain, not copies.** A response keeps what it added to the conversation (its input's messages and its answer)
  and the id before it; a follow-up walks the chain back to its start, so a long agent loop costs each turn once.
- **Bounded, a share per key.** At most `max_bytes` (their JSON's size) in all, split evenly between the server's
  API keys (`tenants`), so no key's responses push out another's. Within a key's share the least recently used
  response leaves first, and a follow-up marks its whole chain used. A chain whose link has left is a 400 that names
  the missing id.
"""
from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from dataclasses import dataclass, field

from .api_errors import APIError


@dataclass
class Stored:
    id: str
    previous: str | None  # the previous_response_id it continued
    messages: list[dict]  # chat messages it added: its input's, then its answer's (no instructions: not carried on)
    input_items: list[dict]  # its input as items with ids (GET .../input_items)
    response: dict  # the response object as it was returned
    events: object = None  # a background stream's responses_events.EventLog, followed and replayed from here
    size: int = field(default=0)

    def __post_init__(self):
        self.measure()

    def measure(self) -> int:
        """Its bytes: its parts' JSON, and its stream's events so far."""
        self.size = sum(len(json.dumps(part)) for part in (self.messages, self.input_items, self.response)) + (
            self.events.bytes if self.events is not None else 0)
        return self.size


def used(table: dict, key: str, missing: str):
    """table[key], marked most recently used (an OrderedDict's end); a 404 saying `missing` where it is not there."""
    found = table.get(key)
    if found is None:
        raise APIError(404, missing, code="not_found")
    table.move_to_end(key)
    return found


class ResponseStore:
    def __init__(self, max_bytes: int, tenants: int = 1):
        self.max_bytes, self.share = max_bytes, max_bytes // max(1, tenants)
        self._items: dict[bytes, OrderedDict[str, Stored]] = {}  # per tenant, least recently used first
        self._bytes: dict[bytes, int] = {}

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def bytes(self) -> int:
        return sum(self._bytes.values())

    def __len__(self) -> int:
        return sum(map(len, self._items.values()))

    def put(self, tenant: bytes, stored: Stored) -> None:
        if not self.enabled:
            return
        items = self._items.setdefault(tenant, OrderedDict())
        if stored.id in items:
            self._bytes[tenant] -= items.pop(stored.id).size
        stored.measure()  # (again: a stream's log grows after it is first stored)
        items[stored.id] = stored
        self._bytes[tenant] = self._bytes.get(tenant, 0) + stored.size
        while self._bytes[tenant] > self.share and items:  # this key's least recently used first (this one too)
            self._bytes[tenant] -= items.popitem(last=False)[1].size

    def get(self, tenant: bytes, response_id: str) -> Stored:
        """The stored response (marked used), or a 404 as OpenAI's for an id this key never stored."""
        return used(self._items.get(tenant, {}), response_id, f"No response found with id '{response_id[:80]}'.")

    def history(self, tenant: bytes, previous_id: str) -> list[dict]:
        """The chat messages of the conversation up to and including response `previous_id`, oldest first."""
        if not self.enabled:
            raise APIError(400, "previous_response_id: this server stores no responses (serve "
                                "--response-store-mb 0, or replicas behind Ray): send the whole conversation as input")
        items = self._items.get(tenant, {})
        chain, seen, at = [], set(), previous_id
        while at is not None and at not in seen:
            seen.add(at)
            found = items.get(at)
            if found is None:
                which = "" if at == previous_id else f" (a response before '{previous_id[:80]}')"
                raise APIError(400, f"previous_response_id: previous response with id '{at[:80]}'{which} not found: "
                                    "never stored under this key, deleted, or evicted (serve --response-store-mb)",
                               code="previous_response_not_found")
            if found.response.get("status") not in ("completed", "incomplete"):
                raise APIError(400, f"previous_response_id: response '{at[:80]}' is {found.response.get('status')}: "
                                    "only a finished response can be continued")
            chain.append(found)
            at = found.previous
        for s in chain:  # used: the chain stays together in the least-recently-used order
            items.move_to_end(s.id)
        return [m for s in reversed(chain) for m in s.messages]

    def delete(self, tenant: bytes, response_id: str) -> None:
        found = self.get(tenant, response_id)
        del self._items[tenant][found.id]
        self._bytes[tenant] -= found.size


class Background:
    """Responses generated after their request returned (OpenAI's background mode): the job and the task that
    collects it, by (key, id), until it ends or is cancelled."""

    def __init__(self):
        self._running: dict[tuple[bytes, str], tuple] = {}

    def start(self, key: tuple[bytes, str], job, work) -> None:
        task = asyncio.create_task(work)
        self._running[key] = (job, task)
        task.add_done_callback(lambda _: self._running.pop(key, None))

    def cancel(self, key: tuple[bytes, str]) -> bool:
        """Stop it (the job leaves the batch at its next cycle); False if it is not running."""
        running = self._running.pop(key, None)
        if running is None:
            return False
        running[0].cancel()
        running[1].cancel()
        return True
