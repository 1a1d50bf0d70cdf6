"""Headless Debian Chromium (through its chromedriver, with Selenium) and a ``miles dashboard``
subprocess, for the dashboard's browser tests and ``bench/dashboard_load.py``.

Chromium starts only headless, with everything that would reach the network turned off (the
machine has none: without these flags it floods refused connections), in a fresh profile.
"""

from __future__ import annotations

import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1400,1000")
URL_PREFIX = "dashboard: "


def missing_browser() -> str | None:
    """Why the browser tests cannot run here (``None``: they can)."""
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not os.access(path, os.X_OK):
            return f"{path} not found (apt-get install {package}; ./dev.sh test installs it)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (the dev extra)"
    return None


def start_chromium(profile_dir: Path, *, page_load_timeout_s: float = 60) -> Any:
    """A headless Chromium driven through /usr/bin/chromedriver (no driver or browser download)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={profile_dir}")
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(page_load_timeout_s)
    driver.set_script_timeout(30)
    return driver


def wait_for(check: Any, timeout_s: float, what: str, interval_s: float = 0.1) -> Any:
    """Polls ``check()`` until it returns something truthy; fails after ``timeout_s`` naming ``what``."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval_s)
    raise TimeoutError(f"{what}: not within {timeout_s:g}s (last: {last!r})")


class DashboardProcess:
    """``miles dashboard RUN_DIR... --port 0`` in a subprocess; ``url`` once it listens."""

    def __init__(self, run_dirs: Sequence[Path], *, follow: bool = False, extra: Sequence[str] = (),
                 start_timeout_s: float = 60) -> None:
        args = [sys.executable, "-m", "miles_engine.cli.main", "dashboard", *map(str, run_dirs), "--port", "0",
                *(["--follow"] if follow else []), *extra]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.output: list[str] = []
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(lines,), daemon=True).start()
        deadline = time.monotonic() + start_timeout_s
        self.url = ""
        while not self.url:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.stop()
                raise TimeoutError(f"miles dashboard did not print its URL within {start_timeout_s:g}s: "
                                   f"{''.join(self.output)}") from None
            if line is None:
                raise RuntimeError(f"miles dashboard exited ({self.proc.wait()}): {''.join(self.output)}")
            if line.startswith(URL_PREFIX):
                self.url = line[len(URL_PREFIX):].split()[0].rstrip("/")

    def _pump(self, lines: queue.Queue[str | None]) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            lines.put(line)
        lines.put(None)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def fresh_profile(root: Path) -> Path:
    path = root / "chromium-profile"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path
