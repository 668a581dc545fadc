"""OpenAI's Conversations API (/v1/conversations and its items) and a response's `conversation`: a conversation is a
list of items kept in this process's memory; a response made in it reads its items before its own input, then adds
its input and its output to them.

As stored responses (response_store.py): per API key (another key's id is a 404), random ids, and each key's share
of `max_bytes` (the items' JSON), whose least recently used conversations leave first, a conversation that alone
outgrows the share included.
"""
from __future__ import annotations

import json
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

from fastapi import Query, Request
from pydantic import BaseModel, ConfigDict, Field

from .api_errors import APIError
from .response_items import as_items, as_messages, page
from .response_store import used

MAX_ITEMS_A_CALL = 20  # items a create or an add takes at once (OpenAI's limit)
ENTRY_BYTES = 256  # a conversation's own bookkeeping, counted beside its JSON


def checked_metadata(metadata: dict | None) -> dict:
    """OpenAI's metadata: at most 16 pairs, keys up to 64 characters, string values up to 512."""
    metadata = metadata or {}
    if len(metadata) > 16 or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                                     for k, v in metadata.items()):
        raise APIError(400, "metadata: at most 16 pairs of a key (up to 64 characters) and a string (up to 512)")
    return metadata


@dataclass
class Conversation:
    id: str
    created_at: int
    metadata: dict
    items: OrderedDict = field(default_factory=OrderedDict)  # id -> item, oldest first
    items_size: int = 0  # the items' JSON
    counted: int = 0  # its size as its tenant's running total has it (Conversations._recount)

    def body(self) -> dict:
        return {"id": self.id, "object": "conversation", "created_at": self.created_at, "metadata": self.metadata}

    @property
    def size(self) -> int:
        """What it holds: its items and its own object (so that empty conversations too count against the share)."""
        return self.items_size + len(json.dumps(self.body())) + ENTRY_BYTES


class Conversations:
    def __init__(self, max_bytes: int, tenants: int = 1):
        self.max_bytes, self.share = max_bytes, max_bytes // max(1, tenants)
        self._by_tenant: dict[bytes, OrderedDict[str, Conversation]] = {}  # least recently used first
        self._total: dict[bytes, int] = {}  # bytes by tenant, kept as they change (a sum over 20,000 conversations
        # at every create and scrape cost ~55 ms of the event loop)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def bytes(self) -> int:
        return sum(self._total.values())

    def _recount(self, tenant: bytes, conversation: Conversation) -> None:
        """After a conversation's items or metadata changed: its tenant's total follows."""
        size = conversation.size
        self._total[tenant] = self._total.get(tenant, 0) + size - conversation.counted
        conversation.counted = size

    def _forget(self, tenant: bytes, conversation_id: str) -> None:
        gone = self._by_tenant[tenant].pop(conversation_id)
        self._total[tenant] -= gone.counted

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise APIError(400, "this server keeps no conversations (serve --response-store-mb 0, or replicas behind "
                                "Ray): send the whole conversation as input")

    def create(self, tenant: bytes, metadata: dict | None, items: list) -> Conversation:
        self._check_enabled()
        conversation = Conversation("conv_" + secrets.token_hex(24), int(time.time()), checked_metadata(metadata))
        _checked(items, MAX_ITEMS_A_CALL)
        self._by_tenant.setdefault(tenant, OrderedDict())[conversation.id] = conversation
        self._recount(tenant, conversation)
        try:
            self.add(tenant, conversation.id, items)
        except APIError:  # (two items of one id): no conversation is left behind
            if conversation.id in self._by_tenant[tenant]:
                self._forget(tenant, conversation.id)
            raise
        return conversation

    def get(self, tenant: bytes, conversation_id: str) -> Conversation:
        """The conversation (marked used), or a 404 as OpenAI's for an id this key does not have."""
        return used(self._by_tenant.get(tenant, {}), conversation_id,
                    f"Conversation with id '{conversation_id[:80]}' not found.")

    def delete(self, tenant: bytes, conversation_id: str) -> None:
        found = self.get(tenant, conversation_id)  # (a 404 before the key's table is looked at)
        self._forget(tenant, found.id)

    def add(self, tenant: bytes, conversation_id: str, items: list, limit: int | None = MAX_ITEMS_A_CALL,
            fresh_ids: bool = False) -> list:
        """Append items (checked as a response's input is, then given ids; with `fresh_ids` an id already there is
        replaced, else refused); the key's share is kept by dropping its least recently used conversations. -> the
        items as added."""
        _checked(items, limit)
        conversation, added = self.get(tenant, conversation_id), as_items(items)
        for k, item in enumerate(added):
            if item["id"] in conversation.items or item["id"] in [a["id"] for a in added[:k]]:
                if not fresh_ids:
                    raise APIError(400, f"items: an item with id {item['id'][:80]!r} is already in the conversation")
                added[k] = as_items([{key: v for key, v in item.items() if key != "id"}])[0]
        for item in added:
            conversation.items[item["id"]] = item
        conversation.items_size += sum(len(json.dumps(item)) for item in added)
        self._recount(tenant, conversation)
        self._trim(tenant)
        return added

    def update(self, tenant: bytes, conversation_id: str, metadata: dict) -> Conversation:
        conversation = self.get(tenant, conversation_id)
        conversation.metadata = checked_metadata(metadata)
        self._recount(tenant, conversation)
        self._trim(tenant)
        return conversation

    def _trim(self, tenant: bytes) -> None:
        """Within the key's share: its least recently used conversations leave first."""
        mine = self._by_tenant[tenant]
        while self._total[tenant] > self.share and mine:
            self._forget(tenant, next(iter(mine)))

    def item(self, tenant: bytes, conversation_id: str, item_id: str) -> dict:
        found = self.get(tenant, conversation_id).items.get(item_id)
        if found is None:
            raise APIError(404, f"Item with id '{item_id[:80]}' not found.", code="not_found")
        return found

    def delete_item(self, tenant: bytes, conversation_id: str, item_id: str) -> Conversation:
        conversation, item = self.get(tenant, conversation_id), self.item(tenant, conversation_id, item_id)
        del conversation.items[item_id]
        conversation.items_size -= len(json.dumps(item))
        self._recount(tenant, conversation)
        return conversation

    def messages(self, tenant: bytes, conversation_id: str) -> list[dict]:
        """The conversation as chat messages, oldest first (what a response in it reads before its input)."""
        self._check_enabled()
        return as_messages(list(self.get(tenant, conversation_id).items.values()), "conversation")


def _checked(items: list, limit: int | None) -> None:
    if limit is not None and len(items) > limit:
        raise APIError(400, f"items: at most {limit} at a time")
    as_messages(items, "items")  # what a prompt could not be made of is refused now, not at its next response


class CreateConversation(BaseModel):
    model_config = ConfigDict(extra="forbid")
    items: list[dict] = Field(default_factory=list)
    metadata: dict | None = None


class UpdateConversation(BaseModel):
    model_config = ConfigDict(extra="forbid")
    metadata: dict


class AddItems(BaseModel):
    model_config = ConfigDict(extra="forbid")
    items: list[dict] = Field(min_length=1)


def conversation_id(value) -> str | None:
    """A response's `conversation`: an id, or {"id": ...}."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("id"), str) and set(value) == {"id"}:
        return value["id"]
    raise APIError(400, 'conversation must be a conversation id or {"id": ...}')


def add_routes(app, conversations: Conversations) -> None:
    def tenant(request: Request) -> bytes:
        return getattr(request.state, "tenant", b"")  # the API key's (guard.py)

    @app.post("/v1/conversations")
    async def create(req: CreateConversation, request: Request):
        return conversations.create(tenant(request), req.metadata, req.items).body()

    @app.get("/v1/conversations/{conversation_id}")
    async def retrieve(conversation_id: str, request: Request):
        return conversations.get(tenant(request), conversation_id).body()

    @app.post("/v1/conversations/{conversation_id}")
    async def update(conversation_id: str, req: UpdateConversation, request: Request):
        return conversations.update(tenant(request), conversation_id, req.metadata).body()

    @app.delete("/v1/conversations/{conversation_id}")
    async def delete(conversation_id: str, request: Request):
        conversations.delete(tenant(request), conversation_id)
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    @app.get("/v1/conversations/{conversation_id}/items")
    async def list_items(conversation_id: str, request: Request, limit: int = Query(20, ge=1, le=100),
                         order: Literal["asc", "desc"] = "desc", after: str | None = None):
        return page(list(conversations.get(tenant(request), conversation_id).items.values()), limit, order, after)

    @app.post("/v1/conversations/{conversation_id}/items")
    async def add_items(conversation_id: str, req: AddItems, request: Request):
        added = conversations.add(tenant(request), conversation_id, req.items)
        return {"object": "list", "data": added, "first_id": added[0]["id"], "last_id": added[-1]["id"],
                "has_more": False}

    @app.get("/v1/conversations/{conversation_id}/items/{item_id}")
    async def get_item(conversation_id: str, item_id: str, request: Request):
        return conversations.item(tenant(request), conversation_id, item_id)

    @app.delete("/v1/conversations/{conversation_id}/items/{item_id}")
    async def delete_item(conversation_id: str, item_id: str, request: Request):
        return conversations.delete_item(tenant(request), conversation_id, item_id).body()
