"""One model worker thread behind a bounded queue. The model is not thread-safe, so exactly one thread touches it;
request handlers talk to it through Jobs. A full queue refuses at once; a cancelled or timed-out job stops at the
next cycle boundary and frees the worker."""
from __future__ import annotations

import asyncio
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
    def __init__(self, decoder, metrics, max_queue: int, timeout_s: float, trace_dir: str | None = None):
        self.decoder, self.metrics = decoder, metrics
        self.max_queue, self.timeout_s = max_queue, timeout_s
        self.trace_dir = Path(trace_dir) if trace_dir else None
        self._jobs: queue.Queue = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="specdec-model-worker", daemon=True)
        self._thread.start()

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
        chunks = self.decoder.stream_chunks(**job.kwargs)
        try:
            for chunk in chunks:
                self.metrics.observe_cycle(chunk.record)
                job.put("chunk", chunk)
                if chunk.result is not None:
                    self.metrics.prompt_tokens.inc(chunk.result.prompt_tokens)
                    if self.trace_dir:
                        self.trace_dir.mkdir(parents=True, exist_ok=True)
                        write_jsonl(chunk.result.records, self.trace_dir / f"{job.id}.jsonl")
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
