"""Bodies that once got a 500 (some only after the answer was generated and stored), each now a JSON 4xx, and the
server's own state (stored responses, conversations) unchanged by the refused request."""
from __future__ import annotations

import httpx
import pytest

CASES = [
    ("/v1/responses", '{"input": "hi", "max_output_tokens": 4, "text": {"format": "json"}}'),
    ("/v1/responses/input_tokens", '{"input": "hi", "text": {"format": "json"}}'),
    ("/v1/messages", '{"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], '
                     '"output_config": {"format": "json"}}'),
    ("/v1/responses", '{"input": "hi", "max_output_tokens": 4, "metadata": {"a": NaN}}'),
    ("/v1/responses", '{"input": "hi", "max_output_tokens": 4, "tools": [{"type": "function", "name": "f", '
                      '"parameters": {"type": "object", "maximum": Infinity}}]}'),
    ("/v1/responses", '{"input": "hi", "max_output_tokens": 4, "text": {"verbosity": -Infinity}}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": NaN}'),
    ("/v1/conversations", '{"items": [{"type": "message", "role": "user", "content": "hi", "id": {"a": 1}}]}'),
    ("/v1/conversations", '{"items": [{"type": "message", "role": "user", "content": "hi", "id": [1, 2]}]}'),
    ("/infill", '{"input_prefix": "def f(\\ud800", "input_suffix": "\\n", "n_predict": 4}'),
    ("/infill", '{"input_prefix": "x", "input_extra": [{"filename": "\\udfff", "text": "y"}], "n_predict": 4}'),
]


@pytest.mark.parametrize("path,body", CASES)
def test_a_body_that_once_got_a_500_is_a_json_4xx(rt_live, path, body):
    before = httpx.get(rt_live.url + "/v1/conversations", timeout=30)
    r = httpx.post(rt_live.url + path, content=body.encode(), headers={"content-type": "application/json"},
                   timeout=60)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    assert r.json()["error"]["message"]
    assert httpx.get(rt_live.url + "/v1/conversations", timeout=30).text == before.text  # nothing left behind


def test_a_response_whose_conversation_item_has_an_odd_id_stores_nothing(rt_live):
    conv = httpx.post(rt_live.url + "/v1/conversations", json={}, timeout=30).json()["id"]
    r = httpx.post(rt_live.url + "/v1/responses", timeout=60, json={
        "input": [{"type": "message", "role": "user", "content": "hi", "id": {"x": 1}}], "conversation": conv,
        "max_output_tokens": 4})
    assert 400 <= r.status_code < 500, r.text[:300]
    items = httpx.get(f"{rt_live.url}/v1/conversations/{conv}/items", timeout=30).json()["data"]
    assert items == []
