"""One model worker thread behind a bounded queue. The model is not thread-safe, so exactly one thread touches it;
request handlers talk to it through Jobs. A full queue refuses at once; a cancelled or timed-out job stops at the
next cycle boundary and frees its place.

Worker runs one request at a time (the transformers backend); BatchWorker runs every admitted request in each
target pass (batch.BatchEngine, on specdec's runtime)."""
from __future__ import annotations

import asyncio
import collections
import itertools
import queue
import sys
import threading
import traceback
import time
from pathlib import Path

from ..errors import SpecDecError
from ..trace import write_jsonl


class JobTimeout(Exception):
    pass


class Job:
    _ids = itertools.count()

    def __init__(self, kwargs: dict, loop: asyncio.AbstractEventLoop, timeout_s: float):
        self.id = f"{int(time.time())}-{next(self._ids)}"
        self.kwargs, self.loop = kwargs, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.deadline = time.monotonic() + timeout_s

    def put(self, kind: str, payload=None) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))

    def cancel(self) -> None:
        self.cancelled.set()


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
        self._lock = threading.Lock()
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="specdec-model-worker", daemon=True)
        self._thread.start()

    def wait_ready(self) -> None:
        """Block until the decoder (and anything _setup builds) exists; re-raise what building it raised."""
        self.ready.wait()
        if self.error is not None:
            raise self.error

    def _main(self) -> None:
        try:
            if callable(self.decoder) and not hasattr(self.decoder, "prepare"):
                self.decoder = self.decoder()
            self._setup()
        except BaseException as e:  # reported by wait_ready in the thread that creates the app
            self.error = e
            return
        finally:
            self.ready.set()
        self._loop()

    def _setup(self) -> None:
        pass

    @property
    def pending(self) -> int:
        return self._pending

    def submit(self, kwargs: dict) -> Job | None:
        """Queue a generation, or return None at once when the queue is full."""
        with self._lock:
            if self._pending >= self.max_queue:
                return None
            self._pending += 1
            self.metrics.queue_depth.set(self._pending)
        job = Job(kwargs, asyncio.get_running_loop(), self.timeout_s)
        self._jobs.put(job)
        return job

    def stop(self) -> None:
        self._jobs.put(None)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._run(job)
            finally:
                with self._lock:
                    self._pending -= 1
                    self.metrics.queue_depth.set(self._pending)
                job.put("end")

    def _run(self, job: Job) -> None:
        if job.cancelled.is_set():
            return
        self.metrics.set_load(1, self._pending - 1)
        chunks = self.decoder.stream_chunks(**job.kwargs)
        try:
            for chunk in chunks:
                self.metrics.observe_cycle(chunk.record)
                job.put("chunk", chunk)
                if chunk.result is not None:
                    self._finished(job, chunk.result)
                elif job.cancelled.is_set():
                    return
                elif time.monotonic() > job.deadline:
                    job.put("error", JobTimeout(f"request exceeded the {self.timeout_s:g} s timeout"))
                    return
        except SpecDecError as e:
            job.put("error", e)
        except Exception as e:  # never leave a client waiting on a dead job; the operator gets the traceback
            traceback.print_exc(file=sys.stderr)
            job.put("error", e)
        finally:
            chunks.close()
            self.metrics.set_load(0, self._pending - 1)

    def _finished(self, job: Job, result) -> None:
        self.metrics.prompt_tokens.inc(result.prompt_tokens)
        if self.trace_dir:
            self.trace_dir.mkdir(parents=True, exist_ok=True)
            write_jsonl(result.records, self.trace_dir / f"{job.id}.jsonl", self.trace_meta())

    def trace_meta(self) -> dict:
        """What every trace carries for the analyzer: the target's verify ms by tokens, measured once."""
        if getattr(self, "_curve", None) is None:
            from ..costs import measure_verify_curve
            model = self.decoder.model
            self._curve = measure_verify_curve(model, model.config.vocab_size, list(range(1, 33)), 9, reps=3)
        return {"verify_curve": {str(k): round(v, 3) for k, v in self._curve.items()}}


class BatchWorker(Worker):
    """Continuous batching: requests join the running batch at cycle boundaries (up to the engine's row budget,
    the rest wait in order) and leave when they finish, are cancelled or time out."""

    def __init__(self, decoder, metrics, max_queue: int, timeout_s: float, trace_dir: str | None, make_engine,
                 max_tau: int = 8):
        """`make_engine(decoder)` -> the BatchEngine, built on the worker thread (it measures the pass curve)."""
        self.make_engine, self.max_tau, self.engine = make_engine, max_tau, None
        super().__init__(decoder, metrics, max_queue, timeout_s, trace_dir)

    def _setup(self) -> None:
        self.engine = self.make_engine(self.decoder)

    def trace_meta(self) -> dict:
        if self.engine is None:
            return super().trace_meta()
        return {"verify_curve": {str(n): round(self.engine.pass_ms(n), 3) for n in range(1, 10)}}

    def _loop(self) -> None:
        if self.engine is None:  # a model the runtime does not run: one request at a time
            return super()._loop()
        from ..batch import Sequence
        waiting: collections.deque[Job] = collections.deque()
        active: dict[int, tuple] = {}  # sequence id -> (job, request, sequence)

        def done(job: Job, kind: str | None = None, payload=None) -> None:
            if kind:
                job.put(kind, payload)
            with self._lock:
                self._pending -= 1
                self.metrics.queue_depth.set(self._pending)
            job.put("end")

        while True:
            try:  # new jobs; block only when there is nothing to run
                while True:
                    job = self._jobs.get(block=not (active or waiting))
                    if job is None:
                        for j in [*waiting, *(a[0] for a in active.values())]:
                            done(j, "error", JobTimeout("the server is shutting down"))
                        self.engine.close()
                        return
                    waiting.append(job)
            except queue.Empty:
                pass
            now = time.monotonic()
            for job in [j for j in waiting if j.cancelled.is_set() or now > j.deadline]:
                waiting.remove(job)
                done(job, None if job.cancelled.is_set() else "error",
                     JobTimeout(f"request exceeded the {self.timeout_s:g} s timeout"))
            while waiting and self.engine.free_rows > 0:
                job = waiting.popleft()
                try:
                    req = self.decoder.prepare(**job.kwargs)
                except SpecDecError as e:
                    done(job, "error", e)
                    continue
                fixed = job.kwargs.get("policy") == "fixed"
                cap = req.tau if fixed or job.kwargs.get("tau") is not None else self.max_tau
                seq = self.engine.add(Sequence(req.prompt_ids, req.max_new_tokens, req.params, req.stop_check,
                                               max_tau=cap, fixed_tau=fixed))
                req.start = time.perf_counter()
                active[seq.id] = (job, req, seq)
            for job, req, seq in list(active.values()):
                if job.cancelled.is_set() or now > job.deadline:
                    self.engine.remove(seq)
                    del active[seq.id]
                    done(job, None if job.cancelled.is_set() else "error",
                         JobTimeout(f"request exceeded the {self.timeout_s:g} s timeout"))
            self.metrics.set_load(len(active), len(waiting))
            if not active:
                continue
            try:
                results = self.engine.step()
            except Exception as e:  # never leave clients waiting on a dead batch; the operator gets the traceback
                traceback.print_exc(file=sys.stderr)
                for job, _, seq in list(active.values()):
                    self.engine.remove(seq)
                    done(job, "error", e)
                active.clear()
                continue
            if self.engine.last:
                self.metrics.batch_rows.observe(self.engine.last["rows"])
            for seq, rec in results:
                job, req, _ = active[seq.id]
                self.metrics.observe_cycle(rec)
                try:
                    chunk = req.chunk(rec)
                except Exception as e:
                    traceback.print_exc(file=sys.stderr)
                    self.engine.remove(seq)
                    del active[seq.id]
                    done(job, "error", e)
                    continue
                job.put("chunk", chunk)
                if chunk.result is not None:
                    del active[seq.id]
                    self._finished(job, chunk.result)
                    done(job)
            self.metrics.set_load(len(active), len(waiting))
