"""One model worker thread behind a bounded queue. The model is not thread-safe, so exactly one thread touches it;
request handlers talk to it through Jobs. A full queue refuses at once; a cancelled or timed-out job stops at the
next cycle boundary and frees its place.

Worker runs one request at a time (the transformers backend); BatchWorker runs every admitted request in each
target pass (batch.BatchEngine, on specdec's runtime).

Failure is confined to the request that caused it: a request whose preparation, drafting, verification or text
raises gets that error alone (400 for bad input, else a 500 naming it), and the batch goes on for everyone else. The
worker thread runs under a supervisor: should its loop itself die, the jobs it held get a 500, the loop restarts,
and `alive` (what /health reports) is false only while it cannot serve."""
from __future__ import annotations

import asyncio
import collections
import itertools
import queue
import sys
import threading
import time
import traceback
from pathlib import Path

from ..batch.load import Work, finish_ms
from ..errors import SpecDecError
from ..trace import write_jsonl


class JobTimeout(Exception):
    pass


class WorkerDown(Exception):
    """The model worker stopped while this job was in it."""


class Busy(Exception):
    """The server cannot start this request in time (HTTP 429); retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float, code: str = "server_busy"):
        super().__init__(message)
        self.retry_after, self.code = max(1, int(retry_after + 0.999)), code


START_SHARE = 0.5  # with no prediction: a request that cannot start within this share of its timeout gets 429
SAFETY = 1.2  # predicted finishing times are stretched by this much before they are held against a deadline


STEP_FAILURES = 3  # whole steps failing in a row, or CLEANUP_FAILURES of leaving requests' cleanups within
CLEANUP_FAILURES = 5  # RESTART_WINDOW_S: the worker's failure (the supervisor resets the engine and restarts the
# loop; /health is 503 meanwhile), not the requests'
MAX_RESTARTS = 5  # loop crashes within RESTART_WINDOW_S before the supervisor gives up (health: 503 for good)
RESTART_WINDOW_S = 60.0
PROBE_QUIET_S = 1.0  # a pass-size probe (batch/admission.py) runs only once nothing ran for this long: the gap
# between one client's requests is not idle time (probes there held the next request's first token back: at 1 stream
# on the pair, time to first token 145 ms at p50 against 65 ms on a server with nothing to probe)


class Job:
    """One request's place in the worker: the worker thread puts its events (chunk, error, end); the request handler,
    on the event loop, awaits them with next()."""
    _ids = itertools.count()

    def __init__(self, kwargs: dict, loop: asyncio.AbstractEventLoop, timeout_s: float):
        self.id = f"{int(time.time())}-{next(self._ids)}"
        self.kwargs, self.loop = kwargs, loop
        self._events: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None
        self.cancelled = threading.Event()
        self.queued = time.monotonic()
        self.deadline = self.queued + timeout_s
        self.start_by = self.queued + START_SHARE * timeout_s
        self.first_token_at: float | None = None  # (monotonic) when its first token was emitted
        self.ended = False

    def put(self, kind: str, payload=None) -> None:
        deliver([(self, (kind, payload))])

    def _push(self, event) -> None:  # on the event loop
        self._events.append(event)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next(self, timeout: float):
        """The next event (kind, payload), or None after `timeout` s without one. A future and a timer: cheaper than
        wait_for's task per event, which a stream awaits once per chunk."""
        if not self._events:
            self._waiter = self.loop.create_future()
            timer = self.loop.call_later(timeout, _wake, self._waiter)
            try:
                await self._waiter
            finally:
                timer.cancel()
                self._waiter = None
        return self._events.popleft() if self._events else None

    def cancel(self) -> None:
        self.cancelled.set()


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


def deliver(events: list) -> None:
    """(job, event) pairs, in order, in one wakeup of each event loop they go to: a batch step's chunks for every
    stream cost the loop one callback, not one each (on 2 cores the loop's work competes with the pass's threads)."""
    by_loop: dict = {}
    for job, event in events:
        by_loop.setdefault(job.loop, []).append((job, event))
    for loop, group in by_loop.items():
        if not loop.is_closed():
            try:
                loop.call_soon_threadsafe(_push_all, group)
            except RuntimeError:  # the loop closed meanwhile (shutdown)
                pass


def _push_all(group: list) -> None:
    for job, event in group:
        job._push(event)


class Worker:
    """`decoder`: a SpecDecoder, or a function that makes one. Given a function, the decoder is built on the worker
    thread itself, so that one thread runs every OpenMP region of the process: libgomp throttles its spin-waiting
    once more threads are parked in OpenMP pools than there are CPUs, and a pass's ~270 barriers (9 a layer) then
    each wait on a futex (a pass on a second thread took 2.3x as long, measured on this 2-core machine)."""

    def __init__(self, decoder, metrics, max_queue: int, timeout_s: float, trace_dir: str | None = None):
        self.decoder, self.metrics = decoder, metrics
        self.max_queue, self.timeout_s = max_queue, timeout_s
        self.trace_dir = Path(trace_dir) if trace_dir else None
        self._jobs: queue.Queue = queue.Queue()
        self._pending = 0
        self.keys = 1  # API keys (tenants) the server has: every other key's first request keeps a place
        self._by_key: collections.Counter = collections.Counter()  # pending requests per key
        self._lock = threading.Lock()
        self._held: set[Job] = set()  # jobs the loop has taken and not ended (the supervisor fails them on a crash)
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.restarts, self._crashes = 0, collections.deque()
        self.serving = False  # the loop is running (false while it restarts, and for good once it gives up)
        self._thread = threading.Thread(target=self._main, name="specdec-model-worker", daemon=True)
        self._thread.start()

    def wait_ready(self) -> None:
        """Block until the decoder (and anything _setup builds) exists; re-raise what building it raised."""
        self.ready.wait()
        if self.error is not None:
            raise self.error

    @property
    def alive(self) -> bool:
        """Whether the worker can serve: its thread runs its loop."""
        return self.serving and self._thread.is_alive()

    def _main(self) -> None:
        try:
            if callable(self.decoder) and not hasattr(self.decoder, "prepare"):
                self.decoder = self.decoder()
            self._setup()
            self.serving = True  # before ready: /health is truthful from the first request on
        except BaseException as e:  # reported by wait_ready in the thread that creates the app
            self.error = e
            return
        finally:
            self.ready.set()
        self._supervise()

    def _supervise(self) -> None:
        """Run the loop; should it die, fail the jobs it held, and restart it (up to MAX_RESTARTS a minute)."""
        while True:
            self.serving = True
            try:
                self._loop()
                return  # stopped
            except BaseException as e:  # noqa: BLE001 - the supervisor's whole point
                self.serving = False
                traceback.print_exc(file=sys.stderr)
                for job in list(self._held):
                    self._end(job, "error", WorkerDown(f"the model worker failed ({type(e).__name__}); retry"))
                self._recover()
                now = time.monotonic()
                self._crashes.append(now)
                while self._crashes and now - self._crashes[0] > RESTART_WINDOW_S:
                    self._crashes.popleft()
                if len(self._crashes) > MAX_RESTARTS:
                    print("specdec: the model worker failed too often; giving up", file=sys.stderr)
                    self._fail_queue()
                    return
                self.restarts += 1

    def _recover(self) -> None:
        """Undo what a crashed loop left behind (BatchWorker: the engine's running requests)."""

    def _fail_queue(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                self._held.add(job)
                self._end(job, "error", WorkerDown("the model worker is down"))

    def _setup(self) -> None:
        pass

    @property
    def pending(self) -> int:
        return self._pending

    def predict(self, kwargs: dict, salt: bytes = b"") -> tuple | None:
        """(ms of work this request adds, seconds until it would finish if queued now, what the work is made of),
        or None where the worker cannot tell."""
        return None

    def submit(self, kwargs: dict, salt: bytes = b"", key: bytes = b"") -> Job:
        """Queue a generation; raises Busy at once when the queue is full or the request is predicted to finish
        past its timeout (429 now, not a 504 after it spent the cores). `salt`: the request's tenant (its prompt is
        cached and found only among that tenant's: batch.PrefixCache.lookup). `key`: its API key's tenant: a key
        never takes the places the other keys with nothing queued would need for a first request each."""
        work = self.predict(kwargs, salt)
        if work is not None and work[1] > self.timeout_s:
            self.metrics.refused.inc()
            raise Busy(f"server busy: a request queued now would finish in ~{work[1]:.0f} s, past the "
                       f"{self.timeout_s:g} s timeout; retry later", work[1] - self.timeout_s)
        with self._lock:
            if self._pending >= self.max_queue:
                self.metrics.refused.inc()
                raise Busy("server busy: request queue is full, retry later", 1, "queue_full")
            waiting_keys = self.keys - 1 - sum(1 for k, n in self._by_key.items() if n and k != key)
            if self._pending + min(max(0, waiting_keys), self.max_queue - 1) >= self.max_queue:
                self.metrics.refused.inc()
                raise Busy("server busy: the queue's last places are kept for other API keys' first requests, "
                           "retry later", 1, "queue_full")
            self._pending += 1
            self._by_key[key] += 1
            self.metrics.queue_depth.set(self._pending)
        job = Job(kwargs, asyncio.get_running_loop(), self.timeout_s)
        job.plan = work[2] if work is not None else None  # (prefill start, prompt length, max new tokens)
        job.salt, job.key = salt, key
        self._jobs.put(job)
        return job

    def stop(self) -> None:
        self._jobs.put(None)

    def _end(self, job: Job, kind: str | None = None, payload=None) -> None:
        """The job's last event(s), once: an optional error, then 'end'; its place in the queue is freed."""
        if job.ended:
            return
        job.ended = True
        self._held.discard(job)
        if kind:
            job.put(kind, payload)
        with self._lock:
            self._pending -= 1
            self._by_key[getattr(job, "key", b"")] -= 1
            self.metrics.queue_depth.set(self._pending)
        job.put("end")

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._held.add(job)
            try:
                self._run(job)
            finally:
                self._end(job)

    def _run(self, job: Job) -> None:
        if job.cancelled.is_set():
            return
        self.metrics.set_load(1, self._pending - 1)
        chunks = None
        try:
            chunks = self.decoder.stream_chunks(**job.kwargs)
            for chunk in chunks:
                self.metrics.observe_cycle(chunk.record)
                self.metrics.first_token(job, chunk.record)
                self.metrics.observe_pass(chunk.record.verify_ms)
                job.put("chunk", chunk)
                if chunk.result is not None:
                    self._finished(job, chunk.result)
                elif job.cancelled.is_set():
                    return
                elif time.monotonic() > job.deadline:
                    self._end(job, "error", JobTimeout(f"request exceeded the {self.timeout_s:g} s timeout"))
                    return
        except Exception as e:  # noqa: BLE001 - this request's failure is reported to it alone
            self._report(job, e)
        finally:
            if chunks is not None:
                chunks.close()
            self.metrics.set_load(0, self._pending - 1)

    def _report(self, job: Job, e: BaseException) -> None:
        """End a job with its own failure: bad input as itself, anything else with the traceback for the operator."""
        if not isinstance(e, SpecDecError):  # its own traceback (a batch failure is reported after its except)
            traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
        self._end(job, "error", e)

    def _finished(self, job: Job, result) -> None:
        """Bookkeeping after a result was delivered; its failure (an unwritable trace) is the operator's, not the
        client's, and never the worker's."""
        self.metrics.prompt_tokens.inc(result.prompt_tokens)
        if self.trace_dir:
            try:
                self.trace_dir.mkdir(parents=True, exist_ok=True)
                write_jsonl(result.records, self.trace_dir / f"{job.id}.jsonl", self.trace_meta())
            except Exception as e:  # noqa: BLE001
                print(f"specdec: trace of request {job.id} not written: {type(e).__name__}: {e}", file=sys.stderr)

    def trace_meta(self) -> dict:
        """What every trace carries for the analyzer: the target's verify ms by tokens, measured once."""
        if getattr(self, "_curve", None) is None:
            from ..costs import measure_verify_curve
            from ..runtime.measured import remembered_curve
            model = self.decoder.model
            self._curve = remembered_curve(model, "verify_curve", {"context": 32, "max_n": 9},
                                           lambda: measure_verify_curve(model, model.config.vocab_size,
                                                                        list(range(1, 33)), 9, reps=3))
        return {"verify_curve": {str(k): round(v, 3) for k, v in self._curve.items()}}


class BatchWorker(Worker):
    """Continuous batching: requests join the running batch at cycle boundaries (up to the engine's row budget,
    the rest wait in order) and leave when they finish, fail, are cancelled or time out."""

    def __init__(self, decoder, metrics, max_queue: int, timeout_s: float, trace_dir: str | None, make_engine,
                 max_tau: int = 8):
        """`make_engine(decoder)` -> the BatchEngine, built on the worker thread (it measures the pass curve)."""
        self.make_engine, self.max_tau, self.engine = make_engine, max_tau, None
        self.waiting: collections.deque[Job] = collections.deque()
        self.active: dict[int, tuple] = {}  # sequence id -> (job, request, sequence)
        self.load = None  # the engine's batch/load.Load, published by the worker thread: what other threads read
        self._failures = 0  # whole steps failed in a row
        self._cleanups_seen = 0  # the engine's cleanup_failures already counted
        self._cleanup_times: collections.deque = collections.deque()  # when recent cleanups failed
        self._last_busy = time.monotonic()  # when a request last ran or waited (PROBE_QUIET_S)
        super().__init__(decoder, metrics, max_queue, timeout_s, trace_dir)

    def _setup(self) -> None:
        self.engine = self.make_engine(self.decoder)
        self._publish()

    def _publish(self) -> None:
        """The snapshot other threads predict with: the engine itself is this thread's alone (runtime/owner.py)."""
        if self.engine is not None:
            self.load = self.engine.load(tuple(self._work(j) for j in self.waiting))

    def trace_meta(self) -> dict:
        if self.engine is None:
            return super().trace_meta()
        return {"verify_curve": {str(n): round(self.engine.pass_ms(n), 3) for n in range(1, 10)}}

    def _recover(self) -> None:
        if self.engine is not None:
            self.engine.reset()
        self.active.clear()
        self.waiting.clear()
        self._failures = self._cleanups_seen = 0
        self._cleanup_times.clear()
        self._publish()

    def _loop(self) -> None:
        if self.engine is None:  # a model the runtime does not run: one request at a time
            return super()._loop()
        while True:
            if not self._take_jobs():
                return
            self._expire()
            self._admit()
            self.metrics.set_load(len(self.active), len(self.waiting))
            if self.active or self.waiting:
                self._last_busy = time.monotonic()
            if self.active:
                self._step()
            elif not self.waiting and self.engine.probe_due() and not self._quiet_left():
                self.engine.probe()  # a pass size the stored curve guessed, timed here: a new job waits one pass
            elif not self.waiting and self.engine.idle_work():
                self.engine.idle()  # a draft's put-off catch-up, a chunk at a time: a new job waits one chunk at most
            self.metrics.set_load(len(self.active), len(self.waiting))
            self.metrics.observe_engine(self.engine)
            if self.engine.cleanup_failures > self._cleanups_seen:  # a leaving request's cleanup raised
                now = time.monotonic()
                self._cleanup_times.extend([now] * (self.engine.cleanup_failures - self._cleanups_seen))
                self._cleanups_seen = self.engine.cleanup_failures
                while now - self._cleanup_times[0] > RESTART_WINDOW_S:
                    self._cleanup_times.popleft()
                if len(self._cleanup_times) >= CLEANUP_FAILURES:  # good steps between do not excuse them
                    raise WorkerDown(f"{len(self._cleanup_times)} cleanups failed within {RESTART_WINDOW_S:g} s")
            self._publish()

    def _take_jobs(self) -> bool:
        """Move new jobs to the waiting line, blocking only when there is nothing to run -> False on stop."""
        try:
            while True:
                busy = self.active or self.waiting or self.engine.idle_work()
                probe = self.engine.probe_wait()  # (a probe: once it may run, and it is quiet)
                wait = None if probe is None else max(probe, self._quiet_left())
                job = self._jobs.get(block=not busy and wait != 0.0, timeout=wait or None)
                if job is None:
                    for j in [*self.waiting, *(a[0] for a in self.active.values())]:
                        self._end(j, "error", JobTimeout("the server is shutting down"))
                    self.engine.close()
                    return False
                self._held.add(job)
                self.waiting.append(job)
        except queue.Empty:
            return True

    def _quiet_left(self) -> float:
        """Seconds until nothing has run for PROBE_QUIET_S (0: it is quiet now)."""
        return max(0.0, self._last_busy + PROBE_QUIET_S - time.monotonic())

    def predict(self, kwargs: dict, salt: bytes = b"") -> tuple[float, float] | None:
        """The engine's work model (batch/load.py finish_ms): the running requests' prefill backlog, then the waiting
        and queued requests' prompts and this one's, its decode, and the decode of those ahead where they fill the
        batch, stretched by SAFETY."""
        load = self.load  # (on the caller's thread: only the worker's published snapshot is read)
        if load is None or "prompt_ids" not in kwargs:
            return None
        ids, new = kwargs["prompt_ids"], kwargs.get("max_new_tokens") or 0
        plan = (load.uncached(ids, salt), len(ids), new)  # where its prefill starts is looked up once
        own = load.work(*plan)
        with self._jobs.mutex:
            queued = [j for j in self._jobs.queue if j is not None and getattr(j, "plan", None)]
        ahead = [*load.waiting, *(load.work(*j.plan) for j in queued)]
        return sum(own), SAFETY * finish_ms(ahead, own, load.backlog_ms, load.running, load.slots) / 1e3, plan

    def _work(self, job: Job) -> Work:
        plan = getattr(job, "plan", None)
        return self.engine.work(*plan) if plan is not None else (0.0, 0.0)

    def _expire(self) -> None:
        """Cancelled or timed-out requests leave; a waiting one predicted to finish past its deadline, or (with no
        prediction) still waiting at half its timeout, gets 429."""
        now = time.monotonic()
        timeout = JobTimeout(f"request exceeded the {self.timeout_s:g} s timeout")
        ahead, backlog, running = [], self.engine.backlog_ms(), len(self.engine.running)
        for job in list(self.waiting):
            work = self._work(job)  # (no margin for one already waiting: only a sure miss is refused)
            finish = now + finish_ms(ahead, work, backlog, running, self.engine.max_batch_rows) / 1e3
            late = finish > job.deadline if getattr(job, "plan", None) else now > job.start_by
            if job.cancelled.is_set() or late:
                self.waiting.remove(job)
                if not job.cancelled.is_set():
                    self.metrics.refused.inc()
                self._end(job, None if job.cancelled.is_set() else "error",
                          Busy(f"server busy: the request cannot finish within the {self.timeout_s:g} s timeout "
                               f"(waited {now - job.queued:.0f} s); retry later", finish - job.deadline))
            else:
                ahead.append(work)
        for job, req, seq in list(self.active.values()):
            if job.cancelled.is_set() or now > job.deadline:
                self._drop(seq)
                self._end(job, None if job.cancelled.is_set() else "error", timeout)

    def _admit(self) -> None:
        """Waiting requests join in order while there are rows, a prompt chunk and KV memory for them."""
        from ..batch import Sequence
        from ..runtime.blocks import OutOfBlocks
        while self.waiting and self.engine.free_rows > 0 and not self.engine.prefill_full:
            job = self.waiting.popleft()
            try:
                req = job.req if hasattr(job, "req") else self.decoder.prepare(**job.kwargs)
                job.req = req
                self.engine.check_fits(req.prompt_ids)
                scoring = req.prompt_logprobs is not None
                if not self.engine.can_start(req.prompt_ids, getattr(job, "salt", b""), scoring):
                    self.waiting.appendleft(job)  # first in line: it starts when blocks free up
                    return
                policy = job.kwargs.get("policy")
                if policy not in (None, "fixed", "adaptive"):
                    from ..errors import InvalidRequest
                    raise InvalidRequest(f"policy {policy!r} is not available with continuous batching: the "
                                         "scheduler chooses tau (policy 'adaptive', the default) or policy 'fixed' "
                                         "keeps the request's tau")
                fixed = policy == "fixed"
                cap = req.tau if fixed or job.kwargs.get("tau") is not None else self.max_tau
                seq = self.engine.add(Sequence(req.prompt_ids, req.max_new_tokens, req.params, req.stop_check,
                                               max_tau=cap, fixed_tau=fixed, constraint=req.constraint,
                                               logprobs=req.logprobs, prompt_logprobs=req.prompt_logprobs,
                                               prediction=req.prediction, prediction_prior=req.prediction_prior,
                                               cache_salt=getattr(job, "salt", b"")))
            except OutOfBlocks:
                self.waiting.appendleft(job)
                return
            except Exception as e:  # noqa: BLE001 - bad input or a failed admission: this request alone
                self._report(job, e)
                continue
            self.metrics.queue_time.observe(time.monotonic() - job.queued)
            req.start = time.perf_counter()
            self.active[seq.id] = (job, req, seq)

    def _drop(self, seq) -> None:
        self.engine.remove(seq)
        self.active.pop(seq.id, None)

    def _failed(self, n: int) -> None:
        """Count whole steps that failed; once STEP_FAILURES of them come without a good step between, the loop
        itself has failed (the supervisor resets the engine and restarts it)."""
        self._failures += n
        if self._failures >= STEP_FAILURES:
            raise WorkerDown(f"{self._failures} steps failed in a row")

    def _step(self) -> None:
        try:
            results = self.engine.step()
        except Exception as e:  # noqa: BLE001 - a pass no single request can be blamed for: all in it fail
            traceback.print_exc(file=sys.stderr)
            for job, _, seq in list(self.active.values()):
                self._drop(seq)
                self._end(job, "error", e)
            self._failed(1)
            return
        self._failures = 0
        for seq, e in self.engine.failed:  # requests that failed on their own; the engine already removed them
            if seq.id in self.active:
                job = self.active.pop(seq.id)[0]
                self._report(job, e)
        if self.engine.last:
            self.metrics.batch_rows.observe(self.engine.last["rows"])
            self.metrics.observe_pass(self.engine.last["verify_ms"])
        outbox, done = [], []
        for seq, rec in results:
            if seq.id not in self.active:
                continue
            job, req, _ = self.active[seq.id]
            self.metrics.observe_cycle(rec)
            self.metrics.first_token(job, rec)
            try:
                chunk = req.chunk(rec)
            except Exception as e:  # noqa: BLE001
                self._drop(seq)
                self._report(job, e)
                continue
            outbox.append((job, ("chunk", chunk)))
            if chunk.result is not None:
                del self.active[seq.id]
                done.append((job, chunk.result))
        deliver(outbox)  # every stream's chunk of this step at once; the ends after them
        for job, result in done:
            self._finished(job, result)
            self._end(job)
