"""Start and stop a real router (``python -m router``) for tests and benchmarks.

Owns ``RouterProcess``: the router in its own process group on a free 127.0.0.1 port, healthy when
``GET /health`` answers 200; ``close()`` stops it with SIGINT (SIGKILL of the group after a timeout) on every
path. The backends are ``harness.server.ServerProcess`` instances the caller starts and closes.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from harness.server import REPO_ROOT, free_port, prepare_server_child

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0
HEALTH_POLL_S = 0.2


class RouterProcess:
    """One ``python -m router``; a context manager that starts it healthy and stops it on every path.

    ``prefill``/``decode``/``mixed``: backend base URLs. ``args``: more router flags.
    """

    def __init__(self, prefill: list[str] = (), decode: list[str] = (), mixed: list[str] = (),
                 args: list[str] = (), port: int | None = None, die_with_parent: bool = False) -> None:
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, "-m", "router", "--port", str(self.port), *args]
        for flag, urls in (("--prefill", prefill), ("--decode", decode), ("--mixed", mixed)):
            if urls:
                self.argv += [flag, *urls]
        self.log_path = Path(tempfile.gettempdir()) / f"fdserve-router-{self.port}.log"
        self.die_with_parent = die_with_parent
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None

    def start(self, timeout: float = START_TIMEOUT_S, require_healthy: bool = True) -> "RouterProcess":
        """Start it and wait until ``GET /health`` answers 200 (any status without ``require_healthy``)."""
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True,
                                         preexec_fn=prepare_server_child if self.die_with_parent else None)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode} during start-up:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except urllib.error.HTTPError as exc:
                if not require_healthy:
                    logger.info("router listening, /health answers %d", exc.code)
                    return self
            except OSError:
                pass  # not listening yet
            time.sleep(HEALTH_POLL_S)
        raise TimeoutError(f"router not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def close(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGINT, then SIGKILL of the group if it has not exited in ``timeout``; ``returncode`` is kept."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("router did not exit %.0f s after SIGINT; killing its group", timeout)
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.returncode = self.proc.returncode

    def __enter__(self) -> "RouterProcess":
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()
