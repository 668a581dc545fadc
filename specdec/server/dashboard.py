"""`GET /dashboard`: a live page of the server's own metrics, over the last minutes. `GET /dashboard/data` is what
it polls: the counters and gauges of /metrics at one instant (`snapshot`); the page turns two successive ones into
rates. `?history=1` also gives the snapshots a thread took every 2 s since the start (the last 10 minutes), so the
page opens on the recent past. Plotly's script is inlined in the page: nothing is fetched from anywhere else, and it works offline.

Behind the API key when one is set. A browser sends a key as HTTP Basic credentials (any user name, the key as
password): the guard asks for them on this page (guard.py), and the page's own requests then carry them.
"""
from __future__ import annotations

import collections
import html
import json
import threading
import time

from .metrics import draft_label

# what the page plots, each from the snapshot's fields (rates: the change between two polls over the seconds between)
FIELDS = {  # snapshot field -> (metric family, sample name)
    "generated": ("specdec_generated_tokens", "specdec_generated_tokens_total"),
    "drafted": ("specdec_draft_tokens", "specdec_draft_tokens_total"),
    "accepted": ("specdec_accepted_tokens", "specdec_accepted_tokens_total"),
    "passes": ("specdec_cycles", "specdec_cycles_total"),
    "rows_sum": ("specdec_batch_rows", "specdec_batch_rows_sum"),
    "rows_count": ("specdec_batch_rows", "specdec_batch_rows_count"),
    "ttft_sum": ("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_sum"),
    "ttft_count": ("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count"),
    "running": ("specdec_requests_running", "specdec_requests_running"),
    "waiting": ("specdec_requests_waiting", "specdec_requests_waiting"),
    "kv_usage": ("specdec_kv_cache_usage", "specdec_kv_cache_usage"),
}


BY_DRAFT = {"specdec_draft_tokens_by_draft_total": 0, "specdec_accepted_tokens_by_draft_total": 1}


def snapshot(registry) -> dict:
    """The FIELDS now (each summed over its labels), and per drafter [proposed, accepted] (`by_draft`), with the time
    they were read."""
    wanted = {sample: field for field, (_, sample) in FIELDS.items()}
    out, by_draft = dict.fromkeys(FIELDS, 0.0), {}
    for family in registry.collect():
        for s in family.samples:
            if s.name in wanted:
                out[wanted[s.name]] += s.value
            elif s.name in BY_DRAFT:
                by_draft.setdefault(s.labels["draft"], [0.0, 0.0])[BY_DRAFT[s.name]] = s.value
    return {"t": time.time(), **out, "by_draft": by_draft}


class History:
    """Snapshots every EVERY_S seconds for the last WINDOW_S, taken by a daemon thread from the server's start: the
    page shows the last minutes as soon as it opens, not only from then on."""
    EVERY_S, WINDOW_S = 2.0, 600.0

    def __init__(self, registry):
        self.registry = registry
        self.snapshots: collections.deque = collections.deque(maxlen=int(self.WINDOW_S / self.EVERY_S))
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="specdec-dashboard").start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.snapshots.append(snapshot(self.registry))
            self._stop.wait(self.EVERY_S)

    def stop(self) -> None:
        self._stop.set()


def page(model: str, draft: str) -> str:
    from plotly.offline import get_plotlyjs

    title = html.escape(f"specdec: {model} (draft: {'+'.join(map(draft_label, draft.split('+')))})")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title><style>{STYLE}</style>"
            f"<script>{get_plotlyjs()}</script></head><body><h1>{title}</h1><p id='status'>waiting for data…</p>"
            f"<div class='grid'>{''.join(f'<div id={json.dumps(k)}></div>' for k in PLOTS)}</div>"
            f"<script>const PLOTS = {json.dumps(PLOTS)};\n{SCRIPT}</script></body></html>")


PLOTS = {  # div id -> (title, y axis)
    "tokens": ["tokens per second", "tokens/s"],
    "acceptance": ["draft acceptance (accepted / proposed), all and by draft", "share"],
    "drafts": ["accepted draft tokens per second, by draft", "tokens/s"],
    "rows": ["rows per target pass", "rows"],
    "queue": ["requests running and waiting", "requests"],
    "kv": ["KV cache in use", "share of the pool"],
    "ttft": ["time to first token (mean over each poll)", "s"],
}
STYLE = ("body{font-family:system-ui,sans-serif;margin:1em;color:#222}h1{font-size:1.2em}"
         ".grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(420px,1fr));gap:.5em}")
SCRIPT = """
const WINDOW_S = 600, POLL_MS = 2000, series = {}, colors = {all: '#444'};
const PALETTE = ['#1f77b4', '#ff7f0e', '#2ca02c', '#d62728', '#9467bd', '#8c564b', '#e377c2', '#17becf'];
for (const id in PLOTS) {
  series[id] = {};
  Plotly.newPlot(id, [], {title: {text: PLOTS[id][0]}, height: 260, margin: {l: 50, r: 10, t: 40, b: 30},
                          yaxis: {title: {text: PLOTS[id][1]}, rangemode: 'tozero'}, xaxis: {type: 'date'}},
                 {displaylogo: false, displayModeBar: false});  // zoom: drag; back: double-click
}
function push(id, name, t, y, drawn_by_draft) {
  // a draft keeps one colour on every chart (its acceptance and its tokens); other lines take Plotly's own
  if (drawn_by_draft) colors[name] = colors[name] || PALETTE[(Object.keys(colors).length - 1) % PALETTE.length];
  const s = series[id][name] = series[id][name] || {x: [], y: [], name: name, mode: 'lines',
                                                    line: drawn_by_draft ? {color: colors[name]} : {}};
  s.x.push(new Date(t * 1000)); s.y.push(y);
  while (s.x.length && s.x[0] < new Date((t - WINDOW_S) * 1000)) { s.x.shift(); s.y.shift(); }
}
function ratio(a, b) { return b > 0 ? a / b : null; }
let last = null;
function add(now) {
    if (last && now.t > last.t) {
      const dt = now.t - last.t, d = k => now[k] - last[k];
      push('tokens', 'tokens/s', now.t, d('generated') / dt);
      push('acceptance', 'all', now.t, ratio(d('accepted'), d('drafted')), true);
      for (const name in now.by_draft) {  // each drafter (a chain's member, or the prediction) on its own line
        const [p, a] = now.by_draft[name], [p0, a0] = (last.by_draft || {})[name] || [0, 0];
        push('acceptance', name, now.t, ratio(a - a0, p - p0), true);
        push('drafts', name, now.t, (a - a0) / dt, true);
      }
      push('rows', 'rows/pass', now.t, ratio(d('rows_sum'), d('rows_count')));
      push('queue', 'running', now.t, now.running);
      push('queue', 'waiting', now.t, now.waiting);
      push('kv', 'in use', now.t, now.kv_usage);
      push('ttft', 'seconds', now.t, ratio(d('ttft_sum'), d('ttft_count')));
    }
    last = now;
}
let first = true;
async function poll() {
  try {
    const r = await fetch('dashboard/data' + (first ? '?history=1' : ''), {credentials: 'same-origin',
                                                                           cache: 'no-store'});
    if (!r.ok) { document.getElementById('status').textContent = 'the server answered ' + r.status; return; }
    const got = await r.json();
    (first ? got.history.concat([got.now]) : [got.now]).forEach(add);
    first = false;
    for (const id in PLOTS) Plotly.react(id, Object.values(series[id]), document.getElementById(id).layout);
    document.getElementById('status').textContent =
      'updated ' + new Date(last.t * 1000).toLocaleTimeString() + ': ' + last.generated + ' tokens served';
  } catch (e) {
    document.getElementById('status').textContent = 'no answer from the server: ' + e;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}
poll();
"""
