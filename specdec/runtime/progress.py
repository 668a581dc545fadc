"""A first start's one-time work (a q8 layout, a draft's 4-bit copy), said on stderr: what, where, and a bar with
the time left."""
from __future__ import annotations

import sys
import time
from pathlib import Path


class Progress:
    def __init__(self, what: str, verb: str, total: int, where: Path):
        self.what, self.verb, self.total, self.where = what, verb, total, where
        self.t0 = time.monotonic()

    def __enter__(self):
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, TextColumn, TimeRemainingColumn
        from rich.progress import Progress as Bar
        print(f"specdec: preparing {self.what} ({self.total / 1e6:.0f} MB; once, cached in {self.where})",
              file=sys.stderr)
        self.bar = Bar(TextColumn(f"  {self.verb}"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                       console=Console(stderr=True), transient=True)
        self.task = self.bar.add_task(self.verb, total=self.total)
        self.bar.start()
        return self

    def advance(self, n: int) -> None:
        self.bar.advance(self.task, n)

    def __exit__(self, *exc):
        self.bar.stop()
        if exc[0] is None:
            print(f"specdec: {self.what} ready in {time.monotonic() - self.t0:.1f} s", file=sys.stderr)
