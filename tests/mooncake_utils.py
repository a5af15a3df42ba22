"""Start and stop a real Mooncake master for tests.

The master runs as a subprocess in its own process group on free 127.0.0.1 ports (RPC and
metrics), so tests never collide with each other or with a master someone else runs. It is
stopped by pid (SIGTERM, then SIGKILL) on every exit path, including a failing test.
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

from harness.server import free_port

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 5.0


def mooncake_importable() -> bool:
    """Whether the Mooncake Python client can be imported (tests skip otherwise)."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError:
        return False
    return True


def master_binary() -> Path:
    """The mooncake_master binary shipped inside the installed mooncake package."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the mooncake package is not installed (bash .ci/install_system_deps.sh)")
    binary = Path(list(spec.submodule_search_locations)[0]) / "mooncake_master"
    if not os.access(binary, os.X_OK):
        raise RuntimeError(f"{binary} is missing or not executable")
    return binary


def _accepts_connections(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class MooncakeMaster:
    """One mooncake_master process; ``start``/``stop`` may be repeated on the same ports."""

    def __init__(self, rpc_port: int | None = None, log_path: Path | None = None) -> None:
        self.rpc_port = rpc_port or free_port()
        self.metrics_port = free_port()
        self.log_path = log_path or Path(f"/tmp/fdserve-mooncake-master-{self.rpc_port}.log")
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    def start(self) -> "MooncakeMaster":
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"master on {self.address} is already running (pid {self.proc.pid})")
        command = [
            str(master_binary()),
            "-rpc_address=127.0.0.1",
            f"-rpc_port={self.rpc_port}",
            "-metrics_host=127.0.0.1",
            f"-metrics_port={self.metrics_port}",
            "-enable_metric_reporting=false",
            "-rpc_thread_num=2",
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode} during start-up; "
                                   f"log {self.log_path}:\n{self._log_tail()}")
            if _accepts_connections(self.rpc_port):
                return
            time.sleep(0.05)
        raise RuntimeError(f"mooncake_master not accepting on {self.address} after {READY_TIMEOUT_S} s; "
                           f"log {self.log_path}:\n{self._log_tail()}")

    def stop(self) -> None:
        """SIGTERM the master's process group, SIGKILL it if it lingers; safe to call twice."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        self._signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
            return
        except subprocess.TimeoutExpired:
            logger.warning("mooncake_master pid %d ignored SIGTERM; killing it", proc.pid)
        self._signal_group(proc, signal.SIGKILL)
        proc.wait(timeout=STOP_TIMEOUT_S)

    @staticmethod
    def _signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
        try:
            os.killpg(proc.pid, sig)  # start_new_session made pid == pgid
        except ProcessLookupError:
            pass  # already gone between poll() and here

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(log unreadable: {exc})"

    def remove_log(self) -> None:
        self.log_path.unlink(missing_ok=True)


@contextlib.contextmanager
def mooncake_master(rpc_port: int | None = None) -> Iterator[MooncakeMaster]:
    """A running master for the duration of the block; stopped afterwards.

    Its log is removed when the block succeeds and kept (path logged) when it raised.
    """
    master = MooncakeMaster(rpc_port)
    try:
        master.start()
        yield master
    except BaseException:
        master.stop()
        logger.error("mooncake_master log kept at %s", master.log_path)
        raise
    master.stop()
    master.remove_log()
