"""Start and stop a real fdserve server (``python launch.py``) for integration tests.

The server runs as a subprocess in its own process group on a free
127.0.0.1 port with a unique instance id, so a failing test can always kill
the whole group and check that nothing of that instance is left in /dev/shm.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

from inter_communicator.shm import sweep_stale

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 240.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def shm_names(instance_id: str) -> list[str]:
    prefix = f"fd.{instance_id}."
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix) or n.startswith("sem." + prefix))


class ServerProcess:
    def __init__(self, *args: str, env: dict[str, str] | None = None, port: int | None = None,
                 instance_id: str | None = None) -> None:
        self.port = port or free_port()
        self.instance_id = instance_id or f"t{uuid.uuid4().hex[:10]}"
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.args = list(args)
        self.env = {**os.environ, "FD_INSTANCE_ID": self.instance_id, **(env or {})}
        self.log_path = Path(f"/tmp/fdserve-test-{self.instance_id}.log")
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ServerProcess":
        self.launch()
        self.wait_healthy()
        return self

    def launch(self) -> "ServerProcess":
        """Start launch.py without waiting for it to become healthy."""
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO_ROOT / "launch.py"), "--port", str(self.port), *self.args],
            cwd=REPO_ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        log.close()
        return self

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n{self.log_tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.5)
        raise TimeoutError(f"server not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def stop(self, sig: int = signal.SIGINT, timeout: float = 15.0) -> float:
        """Send ``sig`` to launch.py; kill the whole group if it has not exited in ``timeout``. Returns seconds."""
        if self.proc is None or self.proc.poll() is not None:
            return 0.0
        started = time.monotonic()
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
        return time.monotonic() - started

    def descendants(self) -> list[int]:
        """Pids of every process below launch.py (engine, workers), from /proc."""
        found, frontier = [], [self.proc.pid]
        while frontier:
            pid = frontier.pop()
            try:
                children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            except FileNotFoundError:
                continue
            found += [int(c) for c in children]
            frontier += [int(c) for c in children]
        return found

    def kill_group(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                return  # already gone

    def close(self) -> None:
        """Stop the server, kill what is left of its group and remove any names it left in /dev/shm."""
        self.stop()
        self.kill_group()
        leftovers = sweep_stale(self.instance_id)
        if leftovers:
            logger.warning("removed shared-memory names the server left behind: %s", leftovers)

    def __enter__(self) -> "ServerProcess":
        try:
            return self.start()
        except BaseException:
            self.close()  # a server that failed to come up may still have children and segments
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()
