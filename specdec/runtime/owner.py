"""Which thread owns a structure. Serving state has one owner, the model worker's thread: the batch engine, its block
pool and prefix cache, and the drafters' stores that outlive a request (drafters/tenants.py). Other threads (HTTP
handlers) send it messages and read the snapshots it publishes (batch/load.py). An Owner is bound to the first
thread that uses its structure (a drafter's cache may be built on the main thread and then used by the worker alone);
with SPECDEC_CHECK_OWNER=1 (the tests set it) a touch from any other thread raises at once instead of racing later."""
from __future__ import annotations

import os
import threading

CHECK = os.environ.get("SPECDEC_CHECK_OWNER") == "1"


class NotOwner(RuntimeError):
    """A thread touched a structure another thread owns."""


class Owner:
    def __init__(self, what: str):
        self.what, self.thread = what, None

    def claim(self) -> None:
        """Hand the structure to the calling thread (a server's engine is built on its worker thread anyway)."""
        self.thread = threading.get_ident()

    def check(self) -> None:
        if self.thread is None:
            self.thread = threading.get_ident()
        elif CHECK and threading.get_ident() != self.thread:
            raise NotOwner(f"{self.what} belongs to one thread; {threading.current_thread().name} touched it")
