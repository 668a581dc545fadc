"""`specdec calibrate --target FILE`: the pass curve this machine has stored for a target (what `specdec serve`
prices verify rows by) beside one measured now, and `--store` to replace it. A stored curve is only a prior (a
server times each stored size once in idle time: batch/calibration.OnlineCurve); this shows it and fixes it at once.
A measurement taken while the machine was busy (repetitions that spread, sizes that invert) says so and is not
stored unless `--force`."""
from __future__ import annotations

import json

from . import charts, models
from .batch.calibration import Disturbed, measure_pass_curve, server_curve
from .errors import InvalidRequest
from .runtime import measured


def calibrate(target: str, numerics: str = "auto", max_batch_rows: int | None = None, store: bool = False,
              force: bool = False) -> dict:
    """{"stored": {rows: ms} or None, "fresh": {rows: ms}, "disturbed": why or None, "stored_now": bool}."""
    model, _ = models.load(target, backend="runtime", numerics=numerics)
    if not getattr(model, "fingerprint", None):
        raise InvalidRequest(f"{target} is not one model file: its pass curve is measured at every start, never "
                             "stored")
    sizes, context, params = server_curve(models.context_window(model), max_batch_rows)
    old = measured.stored(model, "pass_curve", params)
    try:
        fresh, why = measure_pass_curve(model, sizes, context=context, check=True), None
    except Disturbed as e:
        fresh, why = e.curve, str(e)
    if store and why and not force:
        raise InvalidRequest(f"the machine was busy while measuring ({why}): not stored; run again on a quiet "
                             "machine, or --force")
    if store:
        measured.store_curve(model, "pass_curve", params, fresh)
    return {"target": target, "numerics": model.numerics, "context": context,
            "stored": {int(n): float(ms) for n, ms in old} if old else None, "fresh": fresh, "disturbed": why,
            "stored_now": store}


def print_table(rep: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    table = Table(title=f"pass curve of {rep['target']} ({rep['numerics']}, after {rep['context']} positions)")
    for col in ("rows", "stored ms", "x one row", "now ms", "x one row", "stored / now"):
        table.add_column(col, justify="right")
    old, new = rep["stored"] or {}, rep["fresh"]
    for n in sorted(new):
        s = old.get(n)
        table.add_row(str(n), f"{s:.2f}" if s else "-", f"{s / old[min(old)]:.2f}" if s else "-", f"{new[n]:.2f}",
                      f"{new[n] / new[min(new)]:.2f}", f"{s / new[n]:.2f}" if s else "-")
    con = Console()
    con.print(table)
    if rep["disturbed"]:
        con.print(f"[yellow]the machine was busy while measuring: {rep['disturbed']}[/]")
    con.print("stored: the measurement above replaced it" if rep["stored_now"] else
              "nothing stored (--store replaces the stored curve with the measurement above)")


def cmd_calibrate(args) -> int:
    rep = calibrate(args.target, args.numerics, args.max_batch_rows, args.store, args.force)
    if args.plot:
        lines = {"stored": rep["stored"], "now": rep["fresh"]} if rep["stored"] else {"now": rep["fresh"]}
        try:
            charts.curves(lines, args.plot, f"pass curve of {rep['target']} ({rep['numerics']})")
        except OSError as e:
            raise InvalidRequest(f"cannot write {args.plot}: {e.strerror}")
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        print_table(rep)
    return 0


def register(sub, model_args, sampling_args):
    p = sub.add_parser("calibrate", help="the stored pass curve beside one measured now (--store replaces it)")
    p.add_argument("--target", default="default", help="a .gguf file or 'default'")
    p.add_argument("--numerics", default="auto", choices=["auto", "exact", "q8"])
    p.add_argument("--max-batch-rows", type=int, default=None, help="as given to `specdec serve`, if it was")
    p.add_argument("--store", action="store_true", help="replace the stored curve with the one measured now")
    p.add_argument("--force", action="store_true", help="store it even if the machine was busy while measuring")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", metavar="FILE", help="draw the stored and fresh curves (a PNG)")
    p.set_defaults(func=cmd_calibrate)
