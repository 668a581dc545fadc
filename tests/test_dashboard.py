"""`GET /dashboard` (server/dashboard.py): its data is /metrics' at one instant, behind the API key (a browser's Basic
credentials too), and a real browser draws every chart without a console error (skipped without Chromium)."""
import base64
import subprocess

import httpx
import pytest
from test_report import chromium
from test_server import LiveServer, chat_completion

from specdec import SpecDecoder
from specdec.drafters import ChainDrafter, ModelDrafter, NgramDrafter
from specdec.server import create_app
from specdec.server.metrics import draft_label


@pytest.fixture(scope="module")
def decoder(tok, target, draft_close):
    return SpecDecoder.from_models(target, tok, draft=draft_close, tau=3)


def test_the_data_is_the_metrics_and_the_page_is_behind_the_key(decoder):
    srv = LiveServer(create_app(decoder, model_name="tiny", api_key="sekret"))
    bearer = {"authorization": "Bearer sekret"}
    try:
        denied = httpx.get(srv.url + "/dashboard")
        assert denied.status_code == 401 and denied.headers["www-authenticate"].startswith("Basic")
        assert httpx.get(srv.url + "/dashboard/data").status_code == 401
        bad = httpx.get(srv.url + "/dashboard/data?history=maybe", headers={"authorization": "Bearer sekret"})
        assert bad.status_code == 400 and "error" in bad.json()  # bad input: a 4xx JSON error
        wrong = base64.b64encode(b"me:wrong").decode()
        assert httpx.get(srv.url + "/dashboard", headers={"authorization": f"Basic {wrong}"}).status_code == 401
        assert httpx.get(srv.url + "/dashboard", headers={"authorization": "Basic !!"}).status_code == 401
        page = httpx.get(srv.url + "/dashboard", headers=bearer)
        assert page.status_code == 200 and "Plotly" in page.text and "<script src=" not in page.text
        basic = base64.b64encode(b"anyone:sekret").decode()
        assert httpx.get(srv.url + "/dashboard", auth=("anyone", "sekret")).status_code == 200
        srv.auth = bearer
        got = httpx.get(srv.url + "/dashboard/data?history=1", headers={"authorization": f"Basic {basic}"}).json()
        before = got["now"]
        assert got["history"] and all(a["t"] < b["t"] for a, b in zip(got["history"], got["history"][1:] + [before]))
        r = httpx.post(srv.url + "/v1/chat/completions", headers=bearer, timeout=60,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6})
        assert r.status_code == 200
        after = httpx.get(srv.url + "/dashboard/data", headers=bearer).json()["now"]
        m = srv.metrics()
        assert after["generated"] - before["generated"] == r.json()["usage"]["completion_tokens"]
        assert after["generated"] == m[("specdec_generated_tokens_total", ())]
        assert after["drafted"] == m[("specdec_draft_tokens_total", ())]
        assert after["ttft_count"] == before["ttft_count"] + 1 == m[("vllm:time_to_first_token_seconds_count", ())]
        assert after["rows_count"] == m[("specdec_batch_rows_count", ())] and after["t"] > before["t"]
    finally:
        srv.stop()


def test_acceptance_is_counted_per_draft_of_a_chain(tok, target, draft_close):
    """A chain's proposals are booked to the member that made them (`by`): the per-draft counters add up to the
    totals, both members show, and each member's acceptance is its own (the copy's differs from the model's)."""
    chain = ChainDrafter([NgramDrafter(), ModelDrafter(draft_close, target.config.vocab_size, name="/x/close.gguf")])
    srv = LiveServer(create_app(SpecDecoder.from_models(target, tok, draft=chain, tau=3), model_name="tiny"))
    try:
        for text in ("the cat sat on the mat. the cat sat on the", "abcabcabcabcabcabcabc"):  # ngram continues these
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": text, "max_tokens": 40}, timeout=60)
            assert r.status_code == 200
        now = httpx.get(srv.url + "/dashboard/data").json()["now"]
        m = srv.metrics()
        by = now["by_draft"]
        assert set(by) == {"ngram", "close"}  # a model draft's file by its stem
        assert sum(p for p, _ in by.values()) == now["drafted"] == m[("specdec_draft_tokens_total", ())] > 0
        assert sum(a for _, a in by.values()) == now["accepted"] == m[("specdec_accepted_tokens_total", ())]
        for name, (proposed, accepted) in by.items():
            assert m[("specdec_draft_tokens_by_draft_total", (("draft", name),))] == proposed > 0
            assert m[("specdec_accepted_tokens_by_draft_total", (("draft", name),))] == accepted <= proposed
    finally:
        srv.stop()


def test_a_drafters_name_is_a_short_label():
    assert draft_label("keep:/root/.cache/specdec/pair/coder05.gguf") == "coder05"
    assert draft_label("/models/feature.safetensors") == "feature"
    assert draft_label("ngram") == "ngram" and draft_label("prediction") == "prediction"


@pytest.mark.skipif(chromium() is None, reason="no Chromium installed (CI installs one)")
def test_the_page_draws_every_chart_in_a_browser(decoder):
    srv = LiveServer(create_app(decoder, model_name="tiny"))
    try:
        chat_completion(srv, [{"role": "user", "content": "hello"}], max_tokens=4)
        run = subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
                              "--v=0", "--virtual-time-budget=6000", "--dump-dom", srv.url + "/dashboard"],
                             capture_output=True, text=True, timeout=120)
        errors = [line for line in run.stderr.splitlines() if "CONSOLE" in line and "rror" in line]
        assert not errors, errors
        assert run.stdout.count('class="main-svg"') >= 6 and "tokens served" in run.stdout
    finally:
        srv.stop()


def test_the_grafana_dashboard_queries_only_metrics_the_server_exports(decoder):
    """docs/grafana_dashboard.json: every series its queries read is one /metrics serves (vLLM's names included)."""
    import json
    import re
    from pathlib import Path

    from prometheus_client import generate_latest

    from specdec.server.metrics import Metrics

    m = Metrics()  # (a labelled series appears once a label is set)
    m.accepted_pos.labels(position="1").inc()
    for c in (m.drafted_by, m.accepted_by):
        c.labels(draft="ngram").inc()
    for g in (m.pass_priced, m.pass_start):
        g.labels(rows="1").set(1.0)
    served = {line.split("{")[0].split(" ")[0] for line in generate_latest(m.registry).decode().splitlines()
              if line and not line.startswith("#")}
    board = json.loads((Path(__file__).parent.parent / "docs" / "grafana_dashboard.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    names = {n for e in exprs for n in re.findall(r"[a-z_]+:?[a-z_]+(?=[\[{)\s]|$)", e)} - {
        "sum", "rate", "by", "le", "position", "draft", "histogram_quantile"}
    assert names and not names - served, names - served
