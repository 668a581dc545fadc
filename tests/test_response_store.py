"""The stored responses' bound and order (server/response_store.py) under random schedules of stores, reads,
follow-ups and deletes, against a plain model of it: each key within its share of the bytes, its least recently used
out first, a chain read whole or refused, nothing of one key visible to or pushed out by another."""
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.server.api_errors import APIError
from specdec.server.response_store import ResponseStore, Stored

TENANTS = [b"", b"a", b"b"]
steps = st.lists(st.tuples(st.sampled_from(["put", "get", "history", "delete"]), st.sampled_from(TENANTS),
                           st.integers(0, 11), st.integers(0, 11), st.integers(0, 300)), max_size=60)


def stored(n: int, previous: int | None, size: int) -> Stored:
    return Stored(f"resp_{n}", None if previous is None else f"resp_{previous}",
                  [{"role": "user", "content": f"q{n}" + "x" * size}, {"role": "assistant", "content": f"a{n}"}],
                  [], {"id": f"resp_{n}", "status": "completed"})


@settings(max_examples=300, deadline=None)
@given(steps=steps, limit=st.sampled_from([1800, 4500, 12000]))
def test_each_key_keeps_its_share_and_its_least_recently_used_leaves_first(steps, limit):
    store = ResponseStore(limit, tenants=len(TENANTS))
    share = limit // len(TENANTS)
    model: dict = {t: {} for t in TENANTS}  # per tenant: id -> Stored, in use order
    for op, tenant, n, prev, size in steps:
        mine, rid = model[tenant], f"resp_{n}"
        if op == "put":
            s = stored(n, prev if prev < n else None, size)
            store.put(tenant, s)
            mine.pop(rid, None)
            mine[rid] = s
            while sum(v.size for v in mine.values()) > share:
                del mine[next(iter(mine))]
        elif op in ("get", "delete"):
            try:
                (store.get if op == "get" else store.delete)(tenant, rid)
                assert rid in mine
                found = mine.pop(rid)
                if op == "get":
                    mine[rid] = found
            except APIError as e:
                assert e.status == 404 and rid not in mine
        else:
            chain, at = [], rid
            while at is not None and at in mine:
                chain.append(mine[at])
                at = chain[-1].previous
            try:
                messages = store.history(tenant, rid)
                assert at is None and messages == [m for s in reversed(chain) for m in s.messages]
                for s in chain:
                    mine[s.id] = mine.pop(s.id)
            except APIError as e:
                assert e.status == 400 and at is not None and at in e.message
        for t in TENANTS:  # the same entries in the same use order, each key within its share
            assert list(store._items.get(t, {})) == list(model[t])
            assert store._bytes.get(t, 0) == sum(v.size for v in model[t].values()) <= share


def test_a_chain_is_read_oldest_first_and_a_cycle_ends():
    store = ResponseStore(1 << 20)
    store.put(b"", stored(1, None, 0))
    store.put(b"", stored(2, 1, 0))
    store.put(b"", stored(3, 2, 0))
    assert [m["content"] for m in store.history(b"", "resp_3")] == ["q1", "a1", "q2", "a2", "q3", "a3"]
    store.put(b"", stored(1, 3, 0))  # re-stored under an id already in its chain: the walk stops, no loop
    assert [m["content"] for m in store.history(b"", "resp_3")] == ["q1", "a1", "q2", "a2", "q3", "a3"]
    assert ResponseStore(0).enabled is False


def test_a_turn_is_a_user_message_and_all_that_answers_it():
    from types import SimpleNamespace as M

    from specdec.server.responses_api import turns
    roles = ["system", "developer", "user", "assistant", "tool", "tool", "assistant", "user", "assistant", "user"]
    assert turns([M(role=r) for r in roles]) == [2, 7, 9]
    assert turns([M(role=r) for r in ["system", "assistant", "user"]]) == [1, 2]
    assert turns([M(role="system")]) == []


conversation_steps = st.lists(st.tuples(st.sampled_from(["create", "add", "get", "delete", "delete_item", "update"]),
                                        st.sampled_from(TENANTS), st.integers(0, 5), st.integers(0, 400)),
                              max_size=60)


@settings(max_examples=200, deadline=None)
@given(steps=conversation_steps)
def test_conversations_keep_each_keys_share_under_any_schedule(steps):
    """Conversations (server/conversations.py) against a plain model: each key within its share, its least recently
    used conversation out first (the one that grew too, if it alone is over), items in order, keys apart."""
    import json
    import time

    from specdec.server.conversations import ENTRY_BYTES, Conversations
    from specdec.server.response_items import as_items
    store, share = Conversations(3600, tenants=len(TENANTS)), 3600 // len(TENANTS)
    model = {t: {} for t in TENANTS}  # per key: conversation id -> {"items": [(role, text)], "meta": {}}, use order
    ids = {t: [] for t in TENANTS}  # every id a key was given, in the order it was made

    def size(conv):  # the measure the store documents: items' JSON, its own object's, and ENTRY_BYTES
        items = sum(len(json.dumps(as_items([{"role": r, "content": x}])[0])) for r, x in conv["items"])
        own = {"id": "conv_" + "0" * 48, "object": "conversation", "created_at": int(time.time()),
               "metadata": conv["meta"]}
        return items + len(json.dumps(own)) + ENTRY_BYTES

    def trim(t):
        while sum(size(c) for c in model[t].values()) > share:
            del model[t][next(iter(model[t]))]

    def touch(t, cid):
        model[t][cid] = model[t].pop(cid)
    for op, t, n, length in steps:
        cid = ids[t][n % len(ids[t])] if ids[t] else "conv_none"
        text = "x" * length
        try:
            if op == "create":
                made = store.create(t, None, [{"role": "user", "content": text}])
                ids[t].append(made.id)
                model[t][made.id] = {"items": [("user", text)], "meta": {}}
                trim(t)
            elif op == "add":
                store.add(t, cid, [{"role": "assistant", "content": text}])
                touch(t, cid)
                model[t][cid]["items"].append(("assistant", text))
                trim(t)
            elif op == "get":
                got = [i["content"][0]["text"] for i in store.get(t, cid).items.values()]
                assert got == [x for _, x in model[t][cid]["items"]]
                touch(t, cid)
            elif op == "delete":
                store.delete(t, cid)
                del model[t][cid]
            elif op == "delete_item":
                held = store._by_tenant.get(t, {}).get(cid)
                store.delete_item(t, cid, next(iter(held.items)) if held is not None and held.items else "msg_x")
                touch(t, cid)
                model[t][cid]["items"].pop(0)
            else:
                store.update(t, cid, {"k": text[:500]})
                touch(t, cid)
                model[t][cid]["meta"] = {"k": text[:500]}
                trim(t)
        except APIError as e:
            assert e.status == 404 and (cid not in model[t] or op == "delete_item"), (op, e.message)
            if op == "delete_item" and cid in model[t]:
                touch(t, cid)  # found, then its item was not: the conversation was used
        for k in TENANTS:
            assert list(store._by_tenant.get(k, {})) == list(model[k])
            assert [c.size for c in store._by_tenant.get(k, {}).values()] == [size(c) for c in model[k].values()]
            assert sum(size(c) for c in model[k].values()) <= share
        # the running totals equal the sizes summed afresh (they replaced a sum at every create and scrape)
        assert store.bytes == sum(c.size for mine in store._by_tenant.values() for c in mine.values())


def test_an_event_log_is_followed_from_any_point_by_any_number_of_clients_and_counted_in_the_share():
    """responses_events.EventLog: followers that join before, during and after the stream each get the events after
    their sequence number, in order, and end when it closes; its bytes count in its response's size."""
    import asyncio

    from specdec.server.responses_events import EventLog

    async def run():
        log = EventLog()
        early = asyncio.create_task(_drain(log.follow()))
        log.append("e0")
        await asyncio.sleep(0)
        middle = asyncio.create_task(_drain(log.follow(0)))
        for e in ("e1", "e2"):
            await asyncio.sleep(0)
            log.append(e)
        log.close()
        late = await _drain(log.follow(1))
        return await early, await middle, late, log
    early, middle, late, log = asyncio.run(run())
    assert early == ["e0", "e1", "e2"] and middle == ["e1", "e2"] and late == ["e2"]
    store = ResponseStore(40, tenants=1)
    kept = Stored("resp_1", None, [], [], {}, log)
    store.put(b"", kept)
    assert kept.size == len("[]") * 2 + len("{}") + 6 and store.bytes == kept.size
    log.events.append("x" * 40)  # a log that grows past the share: measured again, it leaves
    store.put(b"", kept)
    assert len(store) == 0 and store.bytes == 0


async def _drain(events) -> list[str]:
    return [e async for e in events]
