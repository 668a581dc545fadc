"""`specdec analyze`: the analysis (analyze.py) as text, as JSON, or as one page a person reads in seconds
(`--html report.html`; `--compare A B` for two traces side by side). Self-contained: Plotly's script is inlined, so it opens offline, in any browser, years later.

What it shows, top to bottom (the numbers are `analyze --json`'s, embedded in the page as JSON under
`#specdec-report`; `report_data` builds them and the tests check them against `analyze`):
1. the verdict: the bottleneck in one sentence, measured and predicted speed-up, the fix;
2. a timeline of cycles: draft, verify and other time of each, one lane per request (a server's trace directory),
   zoomable; the accepted tokens per cycle under it;
3. acceptance by draft position, with the share of cycles the drafter proposed in;
4. the pass curve the policy priced (the trace's meta) against the passes the trace measured, and the operating
   point (the mean rows a decode pass verified);
5. the counterfactuals: the speed-up if each cause were fixed, at the best τ, with no draft (1.0), as bars.
"""
from __future__ import annotations

import html
import json
import sys
from pathlib import Path

from .analyze import EXPLAIN_MARGIN, _decode, analyze, analyze_many, load_traces, position_groups
from .errors import SpecDecError
from .trace import step_curve

LANES = 24  # requests drawn on the timeline (a server trace directory holds hundreds): the longest ones
COLORS = {"draft": "#e4572e", "verify": "#4c78a8", "other": "#bab0ac"}
LABELS = {"rare_proposals": "drafter proposes every cycle", "draft_cost": "drafting free",
          "verify_cost": "a pass costs one step", "overhead": "no overhead", "tau_too_large": "best tau",
          "tau_too_small": "best tau"}


def analysis(traces: dict) -> dict:
    """`traces`: name -> (records, meta) (analyze.load_traces) -> analyze's report (one trace, or all together)."""
    if len(traces) == 1:
        records, meta = next(iter(traces.values()))
        return analyze(records, target_curve=step_curve(meta))
    return analyze_many(traces)


def report_data(traces: dict) -> dict:
    """`traces`: name -> (records, meta) -> what the page draws."""
    rep = analysis(traces)
    sp, s = rep["speedup"], rep["summary"]
    top = next((f for f in rep["findings"] if f["kind"] == rep["bottleneck"]), None)
    bars = [{"what": "measured", "speedup": sp["measured"]}, {"what": "cost model", "speedup": sp["predicted"]},
            {"what": "no draft", "speedup": 1.0}]
    bars += [{"what": LABELS[f["kind"]] + (f" ({sp['best_tau']})" if f["kind"].startswith("tau") else ""),
              "speedup": f["speedup_if_fixed"]} for f in rep["findings"] if f["speedup_if_fixed"] is not None]
    priced = next((c for _, meta in traces.values() if (c := step_curve(meta))), None)
    return {
        "verdict": {"bottleneck": rep["bottleneck"], "measured": sp["measured"], "predicted": sp["predicted"],
                    "ceiling": sp["ceiling"], "finding": top["finding"] if top else "no cause would add more "
                    "than a few percent", "fix": top["recommendation"] if top else "nothing to fix"},
        "summary": s,
        "acceptance_by_position": rep["acceptance_by_position"],
        "proposal_rate": s.get("proposal_rate"),
        "lanes": _lanes(traces),
        "curve": {"priced": {str(k): v for k, v in sorted(priced.items())} if priced else None,
                  "measured": rep["costs"]["verify_ms_by_tokens"],
                  "operating_rows": round(1 + s["mean_proposed"], 3)},
        "counterfactuals": bars,
        "time_split": rep["time_split"],
    }


def _lanes(traces: dict) -> list[dict]:
    """Each request's decode cycles laid end to end from its first (a trace has no wall clock: its cycles' ms)."""
    longest = sorted(traces.items(), key=lambda kv: -sum(r.cycle_ms for r in kv[1][0]))[:LANES]
    lanes = []
    for name, (records, _) in longest:
        t, cycles = 0.0, []
        for r in _decode(records):
            other = max(0.0, r.cycle_ms - r.draft_ms - r.verify_ms)
            cycles.append({"cycle": r.cycle, "start_ms": round(t, 3), "draft_ms": r.draft_ms,
                           "verify_ms": r.verify_ms, "other_ms": round(other, 3), "rows": len(r.proposed) + 1,
                           "accepted": r.accepted, "emitted": len(r.emitted)})
            t += r.cycle_ms
        lanes.append({"name": Path(name).stem, "cycles": cycles})
    return lanes


# ---- the page ------------------------------------------------------------------------------------------------------
def render(datas: dict[str, dict]) -> str:
    """One report (a single entry) or two side by side (`--compare`) as a complete HTML page."""
    from plotly.offline import get_plotlyjs

    names = list(datas)
    columns = "".join(f"<section><h2>{html.escape(n)}</h2>{_verdict(d)}</section>" for n, d in datas.items())
    figures = [_timeline(d, n) for n, d in datas.items()] + [_accepted(d, n) for n, d in datas.items()]
    shared = [_acceptance(datas), _curve(datas), _counterfactuals(datas)]
    body = (f'<div class="cols">{columns}</div>'
            + "".join(_div(f) for f in figures) + '<div class="cols">' + "".join(_div(f) for f in shared) + "</div>")
    data = json.dumps(datas if len(datas) > 1 else datas[names[0]]).replace("</", "<\\/")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>specdec report: {html.escape(' vs '.join(names))}"
            f"</title><style>{STYLE}</style><script>{get_plotlyjs()}</script></head><body>"
            f"<h1>specdec analyze: {html.escape(' vs '.join(names))}</h1>{body}"
            f'<script type="application/json" id="specdec-report">{data}</script></body></html>')


STYLE = ("body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}h1{font-size:1.3em}h2{font-size:1.1em}"
         ".cols{display:flex;gap:1.5em;flex-wrap:wrap}.cols>*{flex:1;min-width:420px}"
         ".verdict{font-size:1.05em;border-left:4px solid #e4572e;padding:.4em .8em;background:#faf6f2}"
         ".num{font-size:1.6em;font-weight:600}")


def _verdict(d: dict) -> str:
    v, s = d["verdict"], d["summary"]
    e = html.escape
    rate = "" if d["proposal_rate"] is None else f", proposed in {100 * d['proposal_rate']:.0f}% of cycles asked"
    return (f'<div class="verdict"><p><span class="num">{v["measured"]:.2f}x</span> measured, '
            f'{v["predicted"]:.2f}x by the cost model, ceiling {v["ceiling"]:.2f} tokens a pass</p>'
            f'<p><b>bottleneck: {e(v["bottleneck"])}</b>: {e(v["finding"])}</p><p>fix: {e(v["fix"])}</p>'
            f'<p>{s["new_tokens"]} tokens in {s["cycles"]} decode cycles; acceptance {s["acceptance_rate"]}{rate}'
            "</p></div>")


def _div(fig) -> str:  # (zoom: drag over a chart; back: double-click. No tool bar over the titles)
    return f"<div>{fig.to_html(full_html=False, include_plotlyjs=False, config={'displayModeBar': False})}</div>"


def _timeline(d: dict, name: str):
    import plotly.graph_objects as go

    fig = go.Figure()
    for part in ("draft", "verify", "other"):
        xs, base, ys, text = [], [], [], []
        for lane in d["lanes"]:
            for c in lane["cycles"]:
                start = c["start_ms"] + (c["draft_ms"] if part != "draft" else 0.0) + (
                    c["verify_ms"] if part == "other" else 0.0)
                xs.append(c[f"{part}_ms"])
                base.append(start)
                ys.append(lane["name"])
                text.append(f"cycle {c['cycle']}: {c['rows']} rows, {c['accepted']} accepted, {c['emitted']} emitted")
        fig.add_bar(x=xs, base=base, y=ys, orientation="h", name=part, marker_color=COLORS[part],
                    hovertext=text, hoverinfo="text+x+name")
    fig.update_layout(barmode="overlay", title=f"cycles of {name} (ms from each request's first decode cycle)",
                      height=140 + 22 * len(d["lanes"]), xaxis_title="ms", margin={"l": 10, "r": 10, "t": 40})
    return fig


def _accepted(d: dict, name: str):
    import plotly.graph_objects as go

    fig = go.Figure()
    for lane in d["lanes"]:
        fig.add_scatter(x=[c["start_ms"] for c in lane["cycles"]], y=[c["accepted"] for c in lane["cycles"]],
                        mode="markers", name=lane["name"], marker={"size": 5})
    fig.update_layout(title=f"accepted drafts per cycle, {name}", height=260, xaxis_title="ms",
                      yaxis_title="accepted", showlegend=False, margin={"l": 10, "r": 10, "t": 40})
    return fig


def _acceptance(datas: dict):
    import plotly.graph_objects as go

    fig = go.Figure()
    for name, d in datas.items():
        a = d["acceptance_by_position"]
        fig.add_bar(x=list(range(1, len(a) + 1)), y=a, name=name)
    longest = max(len(d["acceptance_by_position"]) for d in datas.values())
    fig.update_layout(title="acceptance by draft position (α_k)", yaxis_range=[0, 1], height=320,
                      xaxis={"title": {"text": "position"}, "dtick": 1, "range": [0.4, longest + 0.6]},
                      margin={"l": 10, "r": 10, "t": 40})
    return fig


def _curve(datas: dict):
    import plotly.graph_objects as go

    fig = go.Figure()
    for name, d in datas.items():
        c = d["curve"]
        if c["priced"]:
            fig.add_scatter(x=[int(k) for k in c["priced"]], y=list(c["priced"].values()), name=f"{name}: priced",
                            mode="lines+markers")
        fig.add_scatter(x=[int(k) for k in c["measured"]], y=list(c["measured"].values()),
                        name=f"{name}: measured", mode="markers", marker={"size": 9, "symbol": "x"})
        fig.add_vline(x=c["operating_rows"], line_dash="dot", annotation_text=f"{name}: {c['operating_rows']} rows")
    fig.update_layout(title="pass curve: priced against measured (ms by rows)", xaxis_title="rows",
                      yaxis_title="ms", height=320, margin={"l": 10, "r": 10, "t": 40})
    return fig


def _counterfactuals(datas: dict):
    import plotly.graph_objects as go

    fig = go.Figure()
    for name, d in datas.items():
        fig.add_bar(x=[b["what"] for b in d["counterfactuals"]], y=[b["speedup"] for b in d["counterfactuals"]],
                    name=name)
    fig.add_hline(y=1.0, line_dash="dot")
    fig.update_layout(title="speed-up over target-only: measured, modelled, and with each cause fixed",
                      yaxis_title="x target-only", height=320, margin={"l": 10, "r": 10, "t": 40})
    return fig


def check_page(report: dict) -> str:
    """`specdec check --html`: the verdict, then each prompt whose speculative output differs from the target alone,
    token by token from a few tokens before the first divergence (the column where they part is marked)."""
    e = html.escape
    bad = [r for r in report["greedy"] if not r["ok"]]
    rows = report.get("row_invariance")
    parts = [f"<h1>specdec check: {'PASSED' if report['passed'] else 'FAILED'}</h1>",
             f"<p>draft {e(str(report['draft']))}, τ {report['tau']}, {e(str(report['numerics']))}; greedy: "
             f"{len(report['greedy']) - len(bad)}/{len(report['greedy'])} prompts token-identical to the target alone"
             + ("" if rows is None else f"; a {rows['rows']}-row pass "
                + ("equals the one-token steps bitwise" if rows["bitwise"] else "DIFFERS from the one-token steps"))
             + "</p>"]
    for r in report.get("sampling", []):
        parts.append(f"<p>sampling, draft {e(str(r['draft']))}: {e(r['prompt'])}: "
                     f"{e(r['verdict'].upper()) if 'verdict' in r else 'inconclusive'}"
                     + (f", p = {r['p_value']:.4g}" if "p_value" in r else "") + "</p>")
    for r in bad:
        t = r["tokens"]
        start = r["first_divergence"] - len(t["before"])
        width = len(t["before"]) + max(len(t["speculative"]), len(t["target"]))
        head = "".join(f"<th>{start + k}</th>" for k in range(width))

        def cells(after, t=t):
            out = [f"<td>{e(repr(p)[1:-1])}</td>" for p in t["before"]]
            out += [f"<td class='{'first' if k == 0 else 'after'}'>{e(repr(p)[1:-1])}</td>" for k, p in enumerate(after)]
            return "".join(out)
        parts.append(f"<h2>{e(r['prompt'])}: differs at token {r['first_divergence']}</h2>"
                     f"<table><tr><th></th>{head}</tr><tr><th>speculative</th>{cells(t['speculative'])}</tr>"
                     f"<tr><th>target alone</th>{cells(t['target'])}</tr></table>")
    style = ("body{font-family:system-ui,sans-serif;margin:1.5em}table{border-collapse:collapse;font-family:monospace}"
             "td,th{border:1px solid #ccc;padding:2px 5px;white-space:pre}.first{background:#e4572e;color:#fff}"
             ".after{background:#fbe3dc}")
    data = json.dumps(report).replace("</", "<\\/")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>specdec check</title><style>{style}</style>"
            f"</head><body>{''.join(parts)}<script type='application/json' id='specdec-check'>{data}</script>"
            "</body></html>")


def write_report(traces_by_name: dict[str, dict], out: str) -> None:
    """`traces_by_name`: a label -> load_traces(...) result; one label, or two for a comparison."""
    Path(out).write_text(render({name: report_data(t) for name, t in traces_by_name.items()}))


# ---- text ---------------------------------------------------------------------------------------------------------
def print_report(rep: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=110)
    s, t, c, sp = rep["summary"], rep["time_split"], rep["costs"], rep["speedup"]
    con.print(f"[bold]{s['new_tokens']} tokens in {s['cycles']} decode cycles[/]  tau {s['tau']}  proposed "
              f"{s['mean_proposed']}/cycle  acceptance {s['acceptance_rate']}  mean accepted {s['mean_accepted_len']}"
              f"  {s['tokens_per_s']} tok/s")
    if s.get("proposal_rate") is not None:
        short = ", ".join(f"{k} {v}" for k, v in s["shortfalls"].items()) or "none"
        con.print(f"the drafter was asked in {s['asked_cycles']} cycles and proposed in "
                  f"{100 * s['proposal_rate']:.0f}% of them; cycles verifying fewer than tau: {short}")
    pos = Table(title="acceptance by draft position (alpha_k)")
    for label, a in position_groups(rep["acceptance_by_position"]):
        pos.add_column(label, justify="right")
    pos.add_row(*["-" if a is None else f"{a:.2f}" for _, a in position_groups(rep["acceptance_by_position"])])
    con.print(pos)
    con.print(f"time: draft {100 * t['draft_frac']:.0f}%  verify {100 * t['verify_frac']:.0f}%  "
              f"other {100 * t['other_frac']:.0f}%   target step {c['target_step_ms']} ms, verify ms by tokens "
              f"{c['verify_ms_by_tokens']}")
    con.print(f"speedup over target-only: measured {sp['measured']}x, cost model {sp['predicted']}x; "
              f"ceiling (tokens per pass) {sp['ceiling']}x")
    if sp.get("unexplained"):
        con.print(f"  the cost model misses by more than {100 * EXPLAIN_MARGIN:.0f}%: {sp['unexplained']['finding']}")
    words = {"rare_proposals": "if the drafter proposed in every cycle it was asked", "draft_cost": "if drafting were free", "verify_cost": "if a pass over n tokens cost one step",
             "overhead": "without the overhead", "tau_too_large": f"at the best tau ({sp['best_tau']})",
             "tau_too_small": f"at the best tau ({sp['best_tau']})"}
    for f in rep["findings"]:
        if f["speedup_if_fixed"] is not None:
            con.print(f"  {words[f['kind']]}: {f['speedup_if_fixed']:.2f}x")
    tr = rep.get("trees")
    if tr:
        con.print(f"trees: {tr['tree_passes']} passes, {tr['nodes_per_pass']} nodes per pass, accepted depth "
                  f"{tr['accepted_depth']}; acceptance by depth {tr['acceptance_by_depth']}, by sibling rank "
                  f"{tr['acceptance_by_rank']}")
        if "speedup_with_nodes" in tr:
            con.print(f"  with trees cut to n nodes: {tr['speedup_with_nodes']} (best: {tr['best_nodes']})")
    con.print(f"[bold]bottleneck: {rep['bottleneck']}[/]")
    for f in rep["findings"]:
        if f["kind"] == rep["bottleneck"]:
            con.print(f"  {f['finding']}\n  -> {f['recommendation']}")
    if "traces" in rep:
        con.print(f"{len(rep['traces'])} traces; outliers:")
        for r in rep["outliers"]:
            con.print(f"  {r['trace']}: measured {r['measured']}x, bottleneck {r['bottleneck']}")


def cmd_analyze(args) -> int:
    if bool(args.trace) == bool(args.compare):
        raise SpecDecError("name the traces to analyze, or two with --compare A B (not both)")
    sets = {p: load_traces([p]) for p in args.compare} if args.compare else {" ".join(args.trace): load_traces(args.trace)}
    if args.html:
        try:
            write_report(sets, args.html)
        except OSError as e:
            raise SpecDecError(f"cannot write {args.html}: {e.strerror}")
        print(f"specdec: wrote {args.html}", file=sys.stderr)
    reps = {name: analysis(traces) for name, traces in sets.items()}
    if args.json:
        print(json.dumps(reps if args.compare else next(iter(reps.values())), indent=2))
    elif not args.html:
        for name, rep in reps.items():
            if args.compare:
                print(f"== {name}")
            print_report(rep)
    return 0


def register(sub, model_args, sampling_args):
    a = sub.add_parser("analyze", help="diagnose traces written by generate --trace or the server's --trace-dir")
    a.add_argument("trace", nargs="*", help="trace files (.jsonl) or directories of them")
    a.add_argument("--json", action="store_true")
    a.add_argument("--html", metavar="FILE", help="write the report as one self-contained page (Plotly inlined)")
    a.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two traces (files or directories) side by side")
    a.set_defaults(func=cmd_analyze)
