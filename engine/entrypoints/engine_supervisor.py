"""Supervision of the engine processes by the API server: one engine per DP rank, restarted when it dies.

Owns: ``EngineReplica`` (one DP rank: its instance signals, KV-cache lock and engine process; start,
restart, stop, and the clean-up after a dead engine), ``EngineSupervisor`` (notices an engine's exit on
the event loop, fails its requests in flight, restarts it within the budget or leaves the rank down),
``RestartBudget`` (at most N restarts in a window), orphan reaping (``become_subreaper``,
``reap_orphan``: the children of a dead engine are adopted and reaped by the API server), the sweep of a
rank's shared-memory names, and ``LaunchError`` (an engine could not start or restart).
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import multiprocessing
import os
import select
import signal
import sys
import threading
import time
from typing import Callable

import envs
from config.engine_config import EngineConfig

logger = logging.getLogger(__name__)

ENGINE_STOP_TIMEOUT_S = 7.0
# Children of a dead engine get its parent-death signal and stop by themselves (a worker
# within ~1 s); after this long they are killed, before the rank's new engine starts.
ORPHAN_EXIT_TIMEOUT_S = 5.0
# How long a restarted engine may take to load the model and report ready.
ENGINE_RESTART_READY_TIMEOUT_S = 900.0
_PR_SET_CHILD_SUBREAPER = 36
_ENGINE_DIED_MESSAGE = "the engine process died during this request; please retry"


class LaunchError(RuntimeError):
    """The instance cannot start: a bad port, or an engine that exits during its start-up."""


def become_subreaper() -> bool:
    """Make this process adopt its orphaned descendants (Linux prctl).

    Why: the workers of a dead engine are re-parented to us instead of init, so their pids
    (published in the instance signals) stay ours until we reap them: we can wait for them,
    kill them, and never signal an unrelated process that reused a pid.
    """
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        logger.warning("prctl(PR_SET_CHILD_SUBREAPER) failed: %s", os.strerror(ctypes.get_errno()))
        return False
    return True


def _parent_pid_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    # Fields after the command name (which may contain ')'): state, ppid, ...
    return int(raw[raw.rindex(")") + 1:].split()[1])


def reap_orphan(pid: int, timeout: float) -> None:
    """Wait up to ``timeout`` for our adopted child ``pid`` to exit, kill it if it does not, reap it."""
    if pid <= 0 or _parent_pid_of(pid) != os.getpid():
        return  # gone already, or not ours: never signal a process we cannot vouch for
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, ProcessLookupError, OSError):
        pidfd = None
    exited = False
    if pidfd is not None:
        try:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            exited = bool(poller.poll(timeout * 1000))  # a pidfd is readable once the process exits
        finally:
            os.close(pidfd)
    if not exited:
        logger.warning("process %d of the dead engine did not exit in %.0f s; killing it", pid, timeout)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            logger.debug("process %d exited just now", pid)
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        logger.debug("process %d was already reaped", pid)


class RestartBudget:
    """At most ``max_restarts`` restarts within any ``window_s`` seconds (the engine's worker budget)."""

    def __init__(self, max_restarts: int, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if max_restarts < 0 or window_s <= 0:
            raise ValueError(f"invalid restart budget: {max_restarts} in {window_s} s")
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._clock = clock
        self._times: list[float] = []

    def record(self) -> bool:
        """Count a restart now; False if it exceeds the budget."""
        now = self._clock()
        self._times = [t for t in self._times if now - t < self.window_s] + [now]
        return len(self._times) <= self.max_restarts


def _rank_ipc_names(instance_id: str, dp_rank: int) -> set[str]:
    """The /dev/shm entries of one DP rank of an instance (segments and ``sem.`` semaphores)."""
    suffix = f".{dp_rank}"
    prefixes = (f"fd.{instance_id}.", f"sem.fd.{instance_id}.")
    try:
        entries = os.listdir("/dev/shm")
    except FileNotFoundError:
        return set()
    return {e for e in entries if e.startswith(prefixes) and e.endswith(suffix)}


class EngineReplica:
    """One data-parallel rank: its signals, KV-cache lock and (supervised) engine process.

    Also the ``EngineProcessView`` its ``EngineClient`` reads: ``state``, ``pid``, ``restarts``.
    """

    def __init__(self, config: EngineConfig) -> None:
        from engine.entrypoints.engine_client import STATE_STARTING
        from engine.engine_process import EngineAddresses
        from inter_communicator.instance_signals import InstanceSignals

        self.config = config
        self.addresses = EngineAddresses.in_dir(config.ipc_dir, config.parallel.dp_rank)
        self.signals = InstanceSignals(config, create=True)
        self.kvcache_lock = None
        if envs.FD_USE_KVCACHE_LOCK:
            from inter_communicator.kvcache_lock import KVCacheLock

            self.kvcache_lock = KVCacheLock.create(config.instance_id, config.parallel.dp_rank, role="launch")
        # What this process created for the rank: kept across engine restarts, everything else
        # of the rank in /dev/shm belongs to the engine's children and is swept when they die.
        self._own_ipc_names = _rank_ipc_names(config.instance_id, config.parallel.dp_rank)
        self.proc: multiprocessing.process.BaseProcess | None = None
        self._terminated = False
        self._released = False
        self._lifecycle = threading.Lock()
        self.state = STATE_STARTING
        self.restarts = 0
        from engine.engine_process import MAX_RESTARTS_PER_WINDOW, RESTART_WINDOW_S

        self._budget = RestartBudget(MAX_RESTARTS_PER_WINDOW, RESTART_WINDOW_S)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        from engine.engine_process import run_engine

        spawn = multiprocessing.get_context("spawn")
        self._terminated = False
        self.proc = spawn.Process(target=run_engine, name=f"fdserve-engine-{self.config.parallel.dp_rank}",
                                  args=(self.config, self.addresses))
        self.proc.start()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def ready(self) -> bool:
        if not self.alive():
            code = self.proc.exitcode if self.proc is not None else None
            raise LaunchError(f"engine of DP rank {self.config.parallel.dp_rank} exited during start-up "
                              f"(code {code}); "
                              "see the log above")
        return bool(self.signals.engine_ready.value[0])

    def count_restart(self) -> bool:
        """Record a restart now; False if that exceeds the budget (the engine's own worker budget)."""
        return self._budget.record()

    def restart(self, stop: threading.Event) -> bool:
        """Replace the dead engine process (blocking). True once the new one is ready, False if stopped.

        Raises ``LaunchError`` if the new engine dies during start-up.
        """
        if self.proc is not None:
            self.proc.join(ENGINE_STOP_TIMEOUT_S)
        # Each step under the lock ``stop`` takes, after checking ``stop``: a shutdown either
        # sees the new process and stops it, or keeps it from starting; never a half-cleaned rank.
        with self._lifecycle:
            if stop.is_set():
                return False
            self._clean_up_after_engine()
            self.restarts += 1
            self.start()
            logger.info("engine of DP rank %d restarted as pid %d (restart %d); loading the model",
                        self.config.parallel.dp_rank, self.proc.pid, self.restarts)
        deadline = time.monotonic() + ENGINE_RESTART_READY_TIMEOUT_S
        while True:
            with self._lifecycle:
                if stop.is_set():
                    return False
                if self.ready():
                    return True
            if time.monotonic() > deadline:
                raise LaunchError(f"the restarted engine of DP rank {self.config.parallel.dp_rank} was not ready "
                                  f"after {ENGINE_RESTART_READY_TIMEOUT_S:.0f} s")
            stop.wait(0.1)

    def _clean_up_after_engine(self) -> None:
        """Reap the dead engine's children, sweep their shared memory, reset the rank's signals."""
        sig = self.signals
        for pid in list(sig.worker_pid.value) + list(sig.cache_transfer_pid.value):
            reap_orphan(int(pid), ORPHAN_EXIT_TIMEOUT_S)
        from inter_communicator.shm import unlink_segment

        import posix_ipc

        rank_names = _rank_ipc_names(self.config.instance_id, self.config.parallel.dp_rank)
        for entry in sorted(rank_names - self._own_ipc_names):
            if entry.startswith("sem."):
                try:
                    posix_ipc.unlink_semaphore("/" + entry[len("sem."):])
                except posix_ipc.ExistentialError:
                    logger.debug("semaphore %s was already gone", entry)
            elif unlink_segment(entry):
                logger.info("removed %s left by the dead engine's processes", entry)
        # A KV-cache lock held by a dead worker is not reset here: its owner recovery (dead pid in
        # the owner record) frees it for the next acquirer.
        sig.engine_ready.value[0] = 0
        sig.engine_heartbeat.value[0] = 0.0
        sig.worker_ready.value[:] = 0
        sig.worker_heartbeat.value[:] = 0.0
        sig.cache_transfer_ready.value[:] = 0
        sig.cache_transfer_heartbeat.value[:] = 0.0
        sig.worker_pid.value[:] = 0
        sig.cache_transfer_pid.value[:] = 0
        sig.block_states.value[:] = 0

    def terminate(self) -> None:
        """Ask the engine to stop (SIGTERM: it stops its workers, then exits); ``stop`` waits for it.

        Sent once: the engine's handler restores the default action, so a second SIGTERM would
        kill it in the middle of stopping its workers.
        """
        with self._lifecycle:
            self._terminate_locked()

    def _terminate_locked(self) -> None:
        proc = self.proc
        if proc is not None and proc.exitcode is None and not self._terminated:
            self._terminated = True
            proc.terminate()

    def stop(self) -> None:
        with self._lifecycle:
            self._stop_locked()

    def _stop_locked(self) -> None:
        proc = self.proc
        if proc is not None and proc.exitcode is None:
            self._terminate_locked()
            proc.join(ENGINE_STOP_TIMEOUT_S)
            if proc.is_alive():
                logger.warning("engine %s did not stop in %.0f s; killing it", proc.name, ENGINE_STOP_TIMEOUT_S)
                proc.kill()
                proc.join(2.0)
            elif proc.exitcode != 0:
                logger.warning("engine %s exited with code %s while stopping", proc.name, proc.exitcode)
        # Children the engine could not stop (or left when it was killed) were adopted by us.
        if self._released:
            return
        for pid in list(self.signals.worker_pid.value) + list(self.signals.cache_transfer_pid.value):
            reap_orphan(int(pid), 1.0)
        self._released = True
        self.signals.close()
        self.signals.unlink()
        if self.kvcache_lock is not None:
            self.kvcache_lock.close()
            self.kvcache_lock.unlink()


class EngineSupervisor:
    """Restarts the engine process of a rank when it dies (runs on the API server's event loop).

    An engine's exit is noticed through its process sentinel (a file descriptor that becomes
    readable when the process ends), so there is no polling. Its requests in flight end with
    an error at once; the rank takes no requests (503, or the router's other ranks) until the
    new engine is ready. Beyond ``MAX_RESTARTS_PER_WINDOW`` restarts in ``RESTART_WINDOW_S``
    the rank stays down.
    """

    def __init__(self, replicas: list[EngineReplica], clients: list) -> None:
        self.replicas = replicas
        self.clients = clients
        self._stop = threading.Event()
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watched: dict[int, int] = {}  # rank index -> sentinel fd

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for index in range(len(self.replicas)):
            self._watch(index)

    def _watch(self, index: int) -> None:
        proc = self.replicas[index].proc
        if proc is None:
            raise LaunchError(f"engine of DP rank {self.replicas[index].config.parallel.dp_rank} was never started")
        self._watched[index] = proc.sentinel
        self._loop.add_reader(proc.sentinel, self._on_exit, index)

    def _unwatch(self, index: int) -> None:
        fd = self._watched.pop(index, None)
        if fd is not None:
            self._loop.remove_reader(fd)

    def _on_exit(self, index: int) -> None:
        from engine.entrypoints.engine_client import STATE_RESTARTING

        self._unwatch(index)
        if self._stop.is_set():
            return
        replica, client = self.replicas[index], self.clients[index]
        replica.proc.join(1.0)
        failed = client.fail_all(_ENGINE_DIED_MESSAGE)
        logger.error("engine of DP rank %d (pid %d) exited with code %s; %d request(s) failed; restarting it",
                     replica.config.parallel.dp_rank, replica.proc.pid, replica.proc.exitcode, failed)
        replica.state = STATE_RESTARTING
        task = asyncio.ensure_future(self._restart(index))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _restart(self, index: int) -> None:
        from engine.entrypoints.engine_client import STATE_DOWN, STATE_RUNNING
        from engine.engine_process import MAX_RESTARTS_PER_WINDOW, RESTART_WINDOW_S

        replica = self.replicas[index]
        rank = replica.config.parallel.dp_rank
        while not self._stop.is_set():
            if not replica.count_restart():
                replica.state = STATE_DOWN
                logger.error("engine of DP rank %d died more than %d times within %.0f s; it stays down (its "
                             "requests get 503)", rank, MAX_RESTARTS_PER_WINDOW, RESTART_WINDOW_S)
                return
            try:
                ready = await asyncio.to_thread(replica.restart, self._stop)
            except LaunchError as exc:
                logger.error("restarting the engine of DP rank %d failed: %s", rank, exc)
                continue
            if not ready:
                return
            replica.state = STATE_RUNNING
            self._watch(index)
            logger.info("engine of DP rank %d is serving again", rank)
            return

    def stop(self) -> None:
        """No more restarts (shutdown); a restart in progress gives up."""
        self._stop.set()
        for index in list(self._watched):
            self._unwatch(index)
        for task in self._tasks:
            task.cancel()
