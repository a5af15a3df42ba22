"""Start and stop a real fdserve server (``python launch.py``) for tests and benchmarks.

Owns the one way a test or a benchmark runs a server: a subprocess in its own process group on a free
127.0.0.1 port with a unique instance id, so a failing caller can always kill the whole group and check that
nothing of that instance is left in /dev/shm. ``close()`` stops it (SIGINT, then SIGKILL of the group),
removes what it left in /dev/shm and records those names in ``leftovers``, so a test can assert the server
cleaned up after itself (the sweep would otherwise hide it).
"""
from __future__ import annotations

import ctypes
import glob
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

from inter_communicator.shm import sweep_stale

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 15.0
HEALTH_POLL_S = 0.5
PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago (the caller binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def shm_names(instance_id: str) -> list[str]:
    """The /dev/shm entries (segments and ``sem.`` semaphores) of ``instance_id``."""
    prefix = f"fd.{instance_id}."
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix) or n.startswith("sem." + prefix))


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid``, from /proc (empty if it is gone)."""
    # A child started from any thread is listed under that thread, so read every task's list.
    children = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            children += [int(c) for c in Path(path).read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended while we looked
    return children


def prepare_server_child() -> None:
    """In the server's child between fork and exec (only signal state is touched).

    A shell starts background jobs with SIGINT ignored, and an ignored signal stays ignored across exec:
    launch.py would then never see the SIGINT that stops it. And if the caller dies (even by SIGKILL), the
    kernel sends launch.py SIGTERM, which it handles from its first line on, so no server outlives it.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


class ServerProcess:
    """One ``launch.py``; a context manager that starts it healthy and closes it on every path.

    ``env`` is added to this process's environment (the server reads it through envs.py).
    ``temp_storage`` gives the server a temporary file-backend storage dir (removed by ``close``; the log
    goes beside it unless ``log_path`` says otherwise). ``die_with_parent`` prepares the child with
    ``prepare_server_child`` (benchmarks: a killed benchmark leaves no server behind); it is off by default
    because the parent-death signal follows the *thread* that started the server.
    """

    def __init__(self, *args: str, env: dict[str, str] | None = None, port: int | None = None,
                 instance_id: str | None = None, id_prefix: str = "t", log_path: Path | None = None,
                 temp_storage: bool = False, die_with_parent: bool = False) -> None:
        self.port = port or free_port()
        self.instance_id = instance_id or f"{id_prefix}{uuid.uuid4().hex[:10]}"
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.args = list(args)
        self.env = {**os.environ, "FD_INSTANCE_ID": self.instance_id, **(env or {})}
        self.workdir: Path | None = None
        self.storage_dir: Path | None = None
        if temp_storage:
            self.workdir = Path(tempfile.mkdtemp(prefix=f"fdserve-{self.instance_id}-"))
            self.storage_dir = self.workdir / "storage"
            self.args += ["--kvcache-storage-backend", "file", "--file-backend-storage-dir", str(self.storage_dir)]
        default_log = (self.workdir / "server.log" if self.workdir is not None
                       else Path(tempfile.gettempdir()) / f"fdserve-test-{self.instance_id}.log")
        self.log_path = Path(log_path) if log_path is not None else default_log
        self.die_with_parent = die_with_parent
        self.proc: subprocess.Popen | None = None
        self.graceful: bool | None = None  # whether the last stop() ended launch.py without SIGKILL
        self.leftovers: list[str] = []  # /dev/shm names close() had to remove: the server's own cleanup missed them

    def start(self, timeout: float = START_TIMEOUT_S) -> "ServerProcess":
        self.launch()
        self.wait_healthy(timeout)
        return self

    def launch(self) -> "ServerProcess":
        """Start launch.py without waiting for it to become healthy."""
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(REPO_ROOT / "launch.py"), "--port", str(self.port), *self.args],
                cwd=REPO_ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=prepare_server_child if self.die_with_parent else None,
            )
        logger.info("started launch.py pid %d on port %d (instance %s)", self.proc.pid, self.port, self.instance_id)
        return self

    def exited(self) -> bool:
        return self.proc is None or self.proc.poll() is not None

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        """Block until GET /health answers 200; RuntimeError if launch.py exits, TimeoutError after ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass  # not listening yet, or answering 503 (URLError and HTTPError are OSErrors)
            time.sleep(HEALTH_POLL_S)
        raise TimeoutError(f"server not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def remove_log(self) -> None:
        """Drop the log of a run that went well (a failed run keeps it for whoever reads the report)."""
        self.log_path.unlink(missing_ok=True)

    def stop(self, sig: int = signal.SIGINT, timeout: float = STOP_TIMEOUT_S) -> float:
        """Send ``sig`` to launch.py; kill the whole group if it has not exited in ``timeout``. Returns seconds."""
        if self.proc is None or self.proc.poll() is not None:
            return 0.0
        started = time.monotonic()
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
            self.graceful = True
        except subprocess.TimeoutExpired:
            logger.warning("launch.py did not exit %.0f s after signal %d; killing its process group", timeout, sig)
            self.graceful = False
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
        return time.monotonic() - started

    def descendants(self) -> list[int]:
        """Pids of every process below launch.py (engine, workers), from /proc."""
        found, frontier = [], [self.proc.pid]
        while frontier:
            children = child_pids(frontier.pop())
            found += children
            frontier += children
        return found

    def kill_group(self) -> None:
        """SIGKILL whatever is left of launch.py's process group (its children are in it)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return  # the whole group is gone already: the normal case
        if self.proc.poll() is None:
            self.proc.wait(5)

    def sweep(self) -> list[str]:
        """Remove this instance's names left in /dev/shm; they are recorded in ``leftovers`` and returned."""
        self.leftovers = sweep_stale(self.instance_id)
        if self.leftovers:
            logger.warning("removed shared-memory names the server left behind: %s", self.leftovers)
        return self.leftovers

    def close(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the server, kill what is left of its group, sweep /dev/shm (see ``leftovers``), drop temp dirs."""
        try:
            self.stop(timeout=timeout)
            self.kill_group()
        finally:
            self.sweep()
            if self.workdir is not None:
                shutil.rmtree(self.workdir, ignore_errors=True)

    def openai_client(self, asynchronous: bool = False, timeout: float = 120.0):
        """An ``openai`` client (``AsyncOpenAI`` with ``asynchronous``) for this server (no API key).

        No retries, so a failure shows.
        """
        import openai  # a test/benchmark dependency, not the product's

        client_class = openai.AsyncOpenAI if asynchronous else openai.OpenAI
        return client_class(base_url=self.base_url + "/v1", api_key="unused", max_retries=0,
                            timeout=timeout)

    def __enter__(self) -> "ServerProcess":
        try:
            return self.start()
        except BaseException:
            self.close()  # a server that failed to come up may still have children and segments
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()
