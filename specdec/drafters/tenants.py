"""Stores that outlive a request (suffix decoding's earlier outputs, recycle's successor table, anything later) are
kept per tenant: the request's cache salt (server/schemas.py tenant_salt: its API key and its cache_salt or
prompt_cache_key), as the prefix cache's blocks are. What one tenant's requests taught a store never shapes
another tenant's drafts, so no draft statistic can tell a tenant what another one asked or was told. This is the one
way a drafter keeps such a store; tests/test_isolation.py runs every registered drafter through two tenants.

A drafter holds a PerTenant and reads `stores(self.cache_salt)` (drafters.base.for_request sets the salt before a
request's first proposal). Stores are named by a digest of the salt (the default tenant, b"", by ""), which is what
a file that keeps them between runs records: never the salt itself."""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Callable

TENANTS = 16  # tenants whose stores are kept, least recently used out first (the default tenant always stays)


def tenant_name(salt: bytes) -> str:
    return "" if not salt else hashlib.blake2b(salt, digest_size=12).hexdigest()


class PerTenant:
    def __init__(self, make: Callable[[], object], stores: dict[str, object] | None = None, limit: int = TENANTS):
        """`make()` -> an empty store; `stores`: by tenant name (tenant_name), as a file kept them."""
        self.make, self.limit = make, limit
        self.stores: OrderedDict[str, object] = OrderedDict(stores or {})

    def __call__(self, salt: bytes):
        """The store of the tenant `salt`, made empty on its first use."""
        name = tenant_name(salt)
        store = self.stores.get(name)
        if store is None:
            store = self.stores[name] = self.make()
            for old in [n for n in self.stores if n and n != name][: max(0, len(self.stores) - self.limit)]:
                del self.stores[old]
        else:
            self.stores.move_to_end(name)
        return store

    @property
    def default(self):
        """The store of requests that name no tenant (the CLI's, the API's, a server without keys)."""
        return self(b"")

    def items(self) -> list[tuple[str, object]]:
        return list(self.stores.items())
