"""Schema-driven fuzzing (Schemathesis): requests generated from the server's own OpenAPI schema for every route,
valid ones and ones that break it (wrong types, missing fields, odd strings and numbers, bodies that are not JSON),
sent over real HTTP to a live server. No answer is a 5xx, and every 4xx is JSON naming its error. The hand-written
fuzzers (test_fuzz.py) add what a schema cannot say: NaN and Infinity, lone surrogates, deep nesting. A longer run:
`SPECDEC_SCHEMA_EXAMPLES=200 python -m pytest tests/test_schema_fuzz.py` (docs/operations.md)."""
from __future__ import annotations

import os

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable

from test_fuzz import srv  # noqa: F401 - the fixture

EXAMPLES = int(os.environ.get("SPECDEC_SCHEMA_EXAMPLES", "8"))  # per route and mode
LIMITS = ("max_tokens", "max_completion_tokens", "n_predict", "max_output_tokens", "n")


def test_no_generated_request_gets_a_5xx(srv):  # noqa: F811 - test_fuzz's live server
    live = srv
    schema = schemathesis.openapi.from_url(live.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 29  # every route the server has (a new one is fuzzed without a change here)
    sent = {}

    def send(case):
        if isinstance(case.body, dict):
            for limit in LIMITS:  # long answers are only slow
                if isinstance(case.body.get(limit), int) and case.body[limit] > 16:
                    case.body[limit] = 16
        r = case.call(base_url=live.url, timeout=60)
        sent[case.operation.label] = sent.get(case.operation.label, 0) + 1
        assert r.status_code < 500, (case.method, case.path, case.query, str(case.body)[:300], r.text[:300])
        if r.status_code >= 400:  # JSON naming its error
            assert "error" in r.json(), r.text[:300]

    each = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                    derandomize="SPECDEC_SCHEMA_EXAMPLES" not in os.environ)  # the tests' run: the same each time
    for op in operations:
        for mode in schemathesis.GenerationMode:
            try:
                each(given(case=op.as_strategy(generation_mode=mode))(lambda case: send(case)))()
            except Unsatisfiable:  # nothing of this route's input can be wrong (GET /health; a string id)
                assert mode is schemathesis.GenerationMode.NEGATIVE
    assert set(sent) == {op.label for op in operations}
    print(f"\nschema fuzzing: {sum(sent.values())} requests over {len(sent)} routes, none a 5xx")
