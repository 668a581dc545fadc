"""The pass curve and row cost a server measures at start (remembered per model file: runtime/measured.py),
and the verification budget they give."""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from contextlib import contextmanager
from statistics import median
from time import monotonic, perf_counter

import torch

from ..costs import interpolate
from ..policy import Ema
from ..runtime.blocks import BLOCK
from ..runtime.model import Llama
from ..runtime.q8cache import q8_weights


def server_curve(context_window: int, max_batch_rows: int | None = None) -> tuple[list[int], int, dict]:
    """The sizes and context a server measures its pass curve at, and the parameters it is stored under (what
    `specdec serve` and `specdec calibrate` both read and write)."""
    sizes = sorted({1, 2, 4, 5, 8, 9, 16, 17, 32, 64, max_batch_rows or 1})  # (5, 9, 17: a row past a full q8 tile
    # runs a tile of its own, a step the grid's interpolation hid: Qwen2.5-1.5B's 9-row pass took 36 ms beside 30 ms
    # for 8, priced at 31.5, and its times, booked on the 8-row size, made 9-16 rows look cheap at 8 streams)
    context = min(64, context_window // 2)
    return sizes, context, {"sizes": sizes, "context": context}


SPREAD = 1.5  # a size whose repetitions' median is this many times its fastest was measured on a busy machine (the
# median, not the slowest: one slow repetition of three is a virtual machine's hiccup, and the median ignores it)
NOISE_MS = 1.0  # ... by more than this: a timer's and a scheduler's jitter on sub-millisecond passes is no disturbance
INVERTED = 1.25  # ... and a size this many times slower than a larger one is taken again (more rows cost less only where
# a one-row tile runs its own kernel: an inversion the second measurement shows again is kept)
SLOW_READ = 6.0  # ... and a q8 one-row pass this many times slower than reading its weights once at the bandwidth
READ_MIN_MS = 2.0  # measured beside it (a q8 pass reads at 40-70% of it: docs/pair.md); checked where that read
INVERSION = "inverted: "  # (how disturbance names an inversion)
READ_MB = 256  # takes READ_MIN_MS or more (a tiny model's pass is its overhead); the read: READ_MB of floats


class Disturbed(RuntimeError):
    """The machine was busy while the pass curve was measured, twice over: `curve` serves this run, and is not
    stored for the next start (runtime/measured.py)."""

    def __init__(self, curve: dict[int, float], why: str):
        super().__init__(why)
        self.curve = curve


def measure_pass_curve(model: Llama, sizes=(1, 2, 4, 8, 16, 32, 64), context: int = 64, reps: int = 3,
                       check: bool = False, step=None) -> dict[int, float]:
    """Median ms of one pass over n rows, one row per slot up to the largest size (as a batch of decoding
    requests), each slot holding `context` positions; slots the KV budget cannot hold share, a row each at the next
    positions. Sizes are interleaved so machine drift hits all alike. With `check`, a measurement whose repetitions
    spread widely or whose sizes invert (`disturbance`) is taken again, and raises Disturbed if it is still so.
    `step` (runtime/progress.Step) is told the time left after the warm-up round."""
    curve, why = _measure(model, sizes, context, reps, step)
    if check and why:
        if step is not None:
            step.say(f"taken again, to tell a busy machine from the kernels ({why})")
        again, why_again = _measure(model, sizes, context, reps, step)
        if why_again and not why_again.startswith(INVERSION):
            raise Disturbed(again, why_again)
        curve = again  # (an inversion alone is the kernels': a one-row tile is its own kernel; lower_envelope)
    return curve


def disturbance(times: dict[int, list[float]], read_ms: float | None = None) -> str | None:
    """Why repetitions of each size (warm-up dropped) say the machine was busy, or None; `read_ms`: the time to
    read one pass's weights at the bandwidth measured beside them."""
    if read_ms and 1 in times and read_ms >= READ_MIN_MS and median(times[1]) > SLOW_READ * read_ms:
        return f"a one-row pass took {median(times[1]):.1f} ms, {median(times[1]) / read_ms:.0f}x the " \
               f"{read_ms:.1f} ms its weights take to read"
    for n, t in times.items():
        if min(t) > 0 and median(t) / min(t) > SPREAD and median(t) - min(t) > NOISE_MS:
            return f"{n} rows took {min(t):.1f} to {max(t):.1f} ms"
    med = {n: median(t) for n, t in times.items()}
    for a in med:
        for b in med:
            if a < b and med[a] > INVERTED * med[b] and med[a] - med[b] > NOISE_MS:
                return f"{INVERSION}{a} rows took {med[a]:.1f} ms, {b} rows {med[b]:.1f} ms"
    return None


def _measure(model: Llama, sizes, context: int, reps: int, step=None) -> tuple[dict[int, float], str | None]:
    per_slot = -(-(context + max(sizes)) // BLOCK)
    slots = [model.acquire_slot() for _ in range(max(1, min(max(sizes), model.pool.blocks // per_slot)))]
    k = len(slots)
    try:
        with torch.inference_mode():
            _fill(model, slots, context)
            times = {n: [] for n in sizes}
            weights = pass_bytes(model) if model.numerics == "q8" else 0
            buf = torch.ones(READ_MB << 18) if weights >= READ_MB << 18 else None  # a real model: its bandwidth
            reads, t0 = [], perf_counter()
            for r in range(reps + 1):  # the first round warms up
                if r == 1 and step is not None:
                    step.expect((perf_counter() - t0) * reps)
                if buf is not None:  # a read beside each round: the fastest is the machine's bandwidth now
                    t = perf_counter()
                    buf.sum()
                    reads.append((perf_counter() - t) * 1e3 / buf.nbytes)
                for n in sizes:
                    t = perf_counter()
                    model.forward([1] * n, [slots[j % k] for j in range(n)], [context + j // k for j in range(n)])
                    times[n].append((perf_counter() - t) * 1e3)
        kept = {n: t[1:] for n, t in times.items()}
        read_ms = min(reads) * weights if reads else None
        return lower_envelope({n: median(t) for n, t in kept.items()}), disturbance(kept, read_ms)
    finally:
        for s in slots:
            model.release_slot(s)
        model.trim()


def _fill(model: Llama, slots: list[int], context: int) -> None:
    """`context` positions in every slot: the first slot's prompt, its whole blocks shared into the others (a
    64-slot curve of a 1.5B model spent 12 s prefilling 64 copies of one prompt), the rest in one pass."""
    model.forward(list(range(1, context + 1)), [slots[0]] * context, list(range(context)), [])
    shared = context // BLOCK * BLOCK
    for s in slots[1:]:
        model.share(s, model.blocks_of(slots[0])[:shared // BLOCK])
    rest = [(s, p) for s in slots[1:] for p in range(shared, context)]
    if rest:
        model.forward([p + 1 for _, p in rest], [s for s, _ in rest], [p for _, p in rest], [])


def pass_bytes(model: Llama) -> int:
    """The weight bytes one q8 pass reads: every linear's repacked blocks (float ones as they are)."""
    return sum(w.repacked_bytes() or w.data.numel() * w.data.element_size() for w in q8_weights(model))


class PassTimer:
    """Times passes of a given size as measure_pass_curve does (rows after `context` positions), on one slot that
    keeps its context between passes (a prompt's prefill per probe cost more than the probe); `close` frees it."""

    def __init__(self, model: Llama, context: int = 64):
        self.model, self.context, self.slot = model, context, None
        self.warm: set[int] = set()  # sizes run once untimed

    def __call__(self, rows: int) -> float | None:
        """ms of one pass over `rows` rows; None when the KV budget has no room for it now."""
        model = self.model
        if self.slot is None:
            if model.pool.available < -(-(self.context + rows) // BLOCK) + 1:
                return None
            self.slot = model.acquire_slot()
            with torch.inference_mode():
                model.forward(list(range(1, self.context + 1)), [self.slot] * self.context, list(range(self.context)),
                              [])
        if model.pool.available < -(-(self.context + rows) // BLOCK) - -(-self.context // BLOCK) + 1:
            return None
        try:
            with torch.inference_mode():
                if rows not in self.warm:  # a first pass of a size is a cold one (OnlineCurve.observe)
                    model.forward([1] * rows, [self.slot] * rows, list(range(self.context, self.context + rows)))
                    self.warm.add(rows)
                t = perf_counter()
                model.forward([1] * rows, [self.slot] * rows, list(range(self.context, self.context + rows)))
                return (perf_counter() - t) * 1e3
        finally:
            model.truncate(self.slot, self.context)

    def close(self) -> None:
        if self.slot is not None:
            self.model.release_slot(self.slot)
            self.slot = None


def lower_envelope(curve: dict[int, float]) -> dict[int, float]:
    """Each size's time at most any larger size's: noise (another process, pages being written back) only ever
    adds time, and a pass over more rows never costs less, so a size slower than a larger one was disturbed."""
    out, best = {}, float("inf")
    for n in sorted(curve, reverse=True):
        best = min(best, curve[n])
        out[n] = best
    return dict(sorted(out.items()))


def measure_row_cost(model: Llama, rows: int = 32, depths=(64, 1024), reps: int = 3) -> tuple[float, float]:
    """(row_ms, key_ms): a prompt row at position p costs about row_ms + key_ms·p, from the median time of a chunk
    of `rows` prompt rows of one sequence at two depths (attention reads every earlier key)."""
    deep = max(2, min(depths[1], model.max_len - rows - 1))
    shallow = max(1, min(depths[0], deep // 4))
    slot = model.acquire_slot()
    try:
        with torch.inference_mode():
            for start in range(0, deep, 256):
                end = min(deep, start + 256)
                model.forward([1] * (end - start), [slot] * (end - start), list(range(start, end)), [])
            per_row = []
            for at in (shallow, deep):
                times = []
                for _ in range(reps + 1):
                    t = perf_counter()
                    model.forward([1] * rows, [slot] * rows, list(range(at, at + rows)), [])
                    times.append((perf_counter() - t) * 1e3 / rows)
                per_row.append(median(times[1:]))
    finally:
        model.release_slot(slot)
    key_ms = max(0.0, (per_row[1] - per_row[0]) / (deep - shallow))
    return max(1e-6, per_row[0] - key_ms * (shallow + rows / 2)), key_ms


def default_budget(curve: dict[int, float], share: float = 0.5) -> int:
    """--max-batch-rows when not given: the largest measured size up to which each added row costs at most `share`
    of a one-row pass (beyond it, a row costs too much to spend on a draft that may be rejected)."""
    sizes = sorted(curve)
    best = sizes[0]
    for a, b in zip(sizes, sizes[1:]):
        if (curve[b] - curve[a]) / (b - a) > share * curve[sizes[0]]:
            break
        best = b
    return max(best, max((n for n in sizes if n <= MIN_BUDGET), default=best))


MIN_BUDGET = 8  # never fewer rows a pass (where measured): a budget of one row, read off one wrong curve, stopped
# batching and drafting for good, and with them the passes that would have corrected it
REPROBE_S = 300.0  # a size no pass has timed for this long is timed again in idle time (BatchEngine.probe)


_beside = [0]  # this process's own work running beside its passes (background_work), and its lock
_beside_lock = threading.Lock()


@contextmanager
def background_work():
    """Marks this process's own work on another thread (the server's read of the vocabulary for structured outputs,
    3 s on the pair's 151,936 tokens, right after it says it is ready). Passes timed meanwhile shared the cores with
    it: they price nothing (OnlineCurve), and no idle probe runs. Two such passes, a lone request's 8-row trees at
    65-70 ms beside 29 ms quiet ones, priced 8 rows at 50 ms for the server's life: at 8 streams a drafted row per
    request then looked all but free (16 rows at 58 ms), and the feature draft served 0.90x target-only."""
    with _beside_lock:
        _beside[0] += 1
    try:
        yield
    finally:
        with _beside_lock:
            _beside[0] -= 1


def run_beside(target, *args) -> threading.Thread:
    """target(*args) on a daemon thread, as background_work from the moment it is started (the next pass already
    sees it), at the lowest priority where threads have their own (Linux): the passes beside it keep the cores."""
    marked = background_work()
    marked.__enter__()  # (here, not on the thread: it may start after the next pass)

    def run():
        try:
            if sys.platform.startswith("linux"):
                with contextlib.suppress(OSError):
                    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            target(*args)
        finally:
            marked.__exit__(None, None, None)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def work_beside() -> bool:
    """Whether background_work is running now."""
    return _beside[0] > 0


REFINED_AFTER = 20  # passes of a size before a server's refinement of its time is stored (OnlineCurve.refined)
# A pass of n rows never costs more than n one-row passes (it could run its rows one at a time): a price above
# ROWS_SLACK·n·T(1) is a wrong stored guess, and a time above it was taken while something else had the cores (a
# neighbour's load: a 4-row probe timed at 450 ms beside 21 ms one-row passes, stored, priced 4+ rows out for good)
ROWS_SLACK = 1.5
# One traffic pass moves a timed size's price by a bounded step: a time above SPIKE x its price (a neighbour's busy
# moment, still plausible) enters as SPIKE x the price. The first traffic times weigh up to a third, and at one stream
# a size priced out is never bought, so never timed again here (REPROBE_S): one such pass priced the 0.5B's rows out
# for minutes. A lasting change still moves the price, pass by pass; a quiet idle probe's time enters as it is.
SPIKE = 1.25


class OnlineCurve:
    """The pass curve refined by the passes a server runs, on the grid of sizes it was measured at: a pass between
    two sizes scales the nearer one by measured / predicted, and the curve read is nondecreasing (a size is at
    least any smaller one's time). Each row count kept apart made a noisy curve whose dips the scheduler bought:
    on Qwen2.5-1.5B at 16 streams it granted rows where two more rows "cost" -0.8 ms."""

    def __init__(self, curve: dict[int, float], prior: bool = False):
        """`prior`: the curve was read from the store (runtime/measured.py), not measured by this process: each size
        is only a guess until a pass of that size is timed here (`unconfirmed`; the worker times them in idle time,
        BatchEngine.probe), and the first such time replaces it. A stored curve wrong by any factor, either way,
        is corrected once per size instead of kept for good (a 2-row pass stored at 29 one-row passes was never
        bought, so never timed)."""
        self.measured = dict(sorted(curve.items()))
        self.grid = {n: Ema(ms, weight=2.0, decay=0.9) for n, ms in self.measured.items()}
        self.prior = prior
        self.confirmed: set[int] = set() if prior else set(self.measured)  # sizes timed by this process
        self.implausible = 0  # passes timed above ROWS_SLACK·rows one-row passes, left out
        self.probed: set[int] = set()  # sizes timed by a quiet idle probe (Admission.probe): stored as timed
        self.doubted = False  # the one-row price was replaced by a time judged busy (replace): probes stored no more
        self.timed_at: dict[int, float] = dict.fromkeys(self.confirmed, monotonic())  # when each size was last timed

    def values(self) -> dict[int, float]:
        """The curve priced now: each size at most any larger size timed here (a pass of more rows never costs less,
        and a time can only be too high: a one-row probe taken while 8 clients' requests were parsed priced 1-16 rows
        at 55 ms where 8-row passes took 30), at most its cap, then nondecreasing."""
        out, most, cap, least = {}, 0.0, self._cap(), float("inf")
        grid = dict(self.grid)  # (a copy: the event loop reads while the worker writes)
        for n in sorted(grid, reverse=True):
            out[n] = min(grid[n].value, least)
            if n in self.confirmed:
                least = out[n]
        for n in sorted(out):
            most = out[n] = max(most, min(out[n], cap(n)))
        return out

    def raw(self) -> dict[int, float]:
        """Each size's own time (timed here, or as it started), nondecreasing: values() before larger sizes bound it."""
        out, most = {}, 0.0
        for n, e in sorted(dict(self.grid).items()):
            most = out[n] = max(most, e.value)
        return out

    def _cap(self):
        """rows -> the most a pass of them can cost: ROWS_SLACK·n one-row passes, once one-row passes are timed."""
        one = self.grid.get(1)
        if 1 not in self.confirmed or one is None:
            return lambda rows: float("inf")
        return lambda rows: ROWS_SLACK * rows * one.value + NOISE_MS

    def plausible(self, rows: int, ms: float) -> bool:
        return ms <= self._cap()(rows)

    def __call__(self, rows: int) -> float:
        return interpolate(self.values(), rows)

    def refined(self) -> dict[int, float]:
        """The measured sizes' times to keep for the next start: each size the server ran at least REFINED_AFTER
        passes of (or scaled from near sizes) at what it saw lately, and each stored guess it timed, the others as
        they were; none above a larger size timed here (as values()), then nondecreasing. What traffic timed only
        ever lowers a size (a busy run's passes are slow, never fast); a quiet idle probe's time is stored as it is.
        (A model draft's server runs few one-row passes, most of them a request's first, which touch its fresh KV
        pages: they averaged 32 ms beside 18 ms two-row passes, and the stored one-row time raised 1-8 rows to it.)"""
        own = {}
        for n, ms in self.measured.items():
            e = self.grid[n]
            seen = e.n >= REFINED_AFTER or (self.prior and n in self.confirmed)  # (a stored guess, timed here)
            value = e.value if seen else ms
            if seen and n not in self.probed:  # traffic's times never raise what is stored: noise only adds time
                value = min(value, ms)  # (a run's one-row passes stored at 57 ms where quiet ones take 19)
            own[n] = value
        out, least, most, cap = {}, float("inf"), 0.0, self._cap()
        for n in sorted(own, reverse=True):
            out[n] = min(own[n], least)
            if n in self.confirmed:  # (its time here, as values() bounds by it)
                least = min(least, self.grid[n].value)
        for n in sorted(out):
            most = out[n] = max(most, min(out[n], cap(n)))
        return out

    def report(self) -> list[tuple[int, float, float, int]]:
        """(rows, the time it started from, the time priced now, passes of this size timed here) per size."""
        priced = self.values()
        return [(n, ms, priced[n], self.grid[n].n) for n, ms in self.measured.items()]

    def unconfirmed(self, most: int) -> list[int]:
        """The sizes up to `most` rows that only the stored curve prices, smallest first."""
        return [n for n in sorted(self.grid) if n <= most and n not in self.confirmed]

    def due(self, most: int, now: float) -> list[int]:
        """The sizes up to `most` rows to time in idle time: those only the stored curve prices, then those no pass
        has timed for REPROBE_S (a size the policy avoids for its price is timed now and then: a time taken while a
        neighbour had the cores does not price it out for good)."""
        return self.unconfirmed(most) or [n for n in sorted(self.grid) if n <= most
                                          and now - self.timed_at.get(n, now) > REPROBE_S]

    def next_due(self, most: int, now: float) -> float | None:
        """Seconds until a size up to `most` rows falls due (0: one is due now), None when none is on the grid."""
        if self.due(most, now):
            return 0.0
        times = [self.timed_at.get(n, now) + REPROBE_S - now for n in self.grid if n <= most]
        return max(0.0, min(times)) if times else None

    def replace(self, rows: int, ms: float) -> None:
        """A size's price replaced by a time believed over it (a machine slower than when the size was timed)."""
        self.grid[rows] = Ema(ms, weight=0.0, decay=0.9)
        self.grid[rows].update(ms)
        self.confirmed.add(rows)
        self.timed_at[rows] = monotonic()
        self.doubted = True  # probes judged beside it price this run only: a busy time may have replaced the price

    def observe(self, rows: int, ms: float, quiet: bool = False) -> None:
        """A pass of `rows` timed at `ms`: in traffic, or by a quiet idle probe (`quiet`: believed as it is)."""
        if not self.plausible(rows, ms):  # timed while something else had the cores: it says nothing of the curve
            self.implausible += 1
            return
        sizes = sorted(self.grid)
        self.timed_at[rows] = monotonic()
        if rows in self.grid and rows not in self.confirmed:  # the first time of it here: the stored one was a guess
            self.grid[rows] = Ema(ms, weight=0.0, decay=0.9)
        if rows in self.grid or rows > sizes[-1]:
            e = self.grid.setdefault(rows, Ema(ms, weight=0.0, decay=0.9))
            e.update(ms if quiet or rows not in self.confirmed else min(ms, SPIKE * e.value))
            self.confirmed.add(rows)
            return
        lo = max((n for n in sizes if n < rows), default=None)
        hi = min(n for n in sizes if n > rows)
        near = hi if lo is None or hi - rows <= rows - lo else lo
        if near not in self.confirmed:  # a guess is not scaled by a neighbour: it waits for its own time
            return
        predicted = self(rows)
        if predicted > 0:
            self.grid[near].update(self.grid[near].value * (ms / predicted if quiet else min(ms / predicted, SPIKE)))
