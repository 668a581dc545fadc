"""Headless Chromium for the benchmarks' pictures: a report page or a live dashboard as a person sees it (their charts
are Plotly's, drawn by the browser's JavaScript)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


def chromium() -> str | None:
    return next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)


def screenshot(url_or_page, png: Path, height: int = 1300, wait_ms: int = 8000) -> bool:
    """Draw a URL (or a local page) and write it as a PNG -> whether it was written (no Chromium: no picture)."""
    browser = chromium()
    if browser is None:
        print("no Chromium installed: no screenshot", file=sys.stderr)
        return False
    url = url_or_page if isinstance(url_or_page, str) else Path(url_or_page).resolve().as_uri()
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--window-size=1400,{height}", f"--virtual-time-budget={wait_ms}", f"--screenshot={png}", url],
                   check=True, capture_output=True, timeout=180)
    return True
