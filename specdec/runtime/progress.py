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


class Step:
    """One step of a first start, said on stderr: what it does and about how long it takes, then how long it took.
    `expect(seconds)` says the estimate once it is known (after a warm-up); `quiet` says nothing."""

    def __init__(self, what: str, expected_s: float | None = None, quiet: bool = False):
        self.what, self.quiet = what, quiet
        self.t0 = time.monotonic()
        if expected_s is not None:
            self.expect(expected_s)

    def expect(self, seconds: float) -> None:
        if not self.quiet:
            print(f"specdec: {self.what} (about {max(0.1, seconds):.1f} s more)", file=sys.stderr)

    def say(self, what: str) -> None:
        if not self.quiet:
            print(f"specdec: {self.what}: {what}", file=sys.stderr)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None and not self.quiet:
            print(f"specdec: {self.what}: done in {time.monotonic() - self.t0:.1f} s", file=sys.stderr)
