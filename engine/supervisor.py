"""Supervision of one engine's child processes: its workers and its cache transfer processes.

Owns: spawning them and waiting for their readiness flags, telling a dead or hung one (exit code,
a cache transfer heartbeat standing still, KV transfers past their deadline), the restart budget,
killing and reaping, removing the shared-memory segments a dead one left behind, and the orderly
stop. The engine's step loop (``engine_process.Engine``) calls it; what a death means for the
requests and the prefix cache stays the engine's, reached through ``RecoveryHooks``.

Tensor parallelism: one worker per TP rank (rank 0 talks to the engine and leads the others, see
``worker.worker_process``) and one cache transfer process for all of them (it moves every rank's
shard of a block as one unit). A dead worker of any rank takes the whole TP group down: every rank
is killed and the group restarted together, since the survivors' collectives cannot be re-joined.
"""
from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import zmq

import envs
from cache_manager.cache_transfer_manager import run_cache_transfer
from cache_manager.kv_layout import device_cache_segment, host_cache_segment
from config.engine_config import EngineConfig
from inter_communicator.instance_signals import InstanceSignals
from inter_communicator.messages import WorkerShutdown
from inter_communicator.shm import unlink_segment
from worker.worker_process import run_worker

if TYPE_CHECKING:  # engine_process imports this module
    from engine.engine_process import EngineAddresses

logger = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 900.0
RESTART_WINDOW_S = 300.0
MAX_RESTARTS_PER_WINDOW = 5
# How long an orderly stop waits for each child before SIGTERM (then SIGKILL).
SHUTDOWN_GRACE_S = 4.0
# SIGTERM to SIGKILL, and SIGKILL to "cannot be killed".
TERMINATE_WAIT_S = 2.0
KILL_WAIT_S = 5.0


class WorkerDied(RuntimeError):
    def __init__(self, message: str, role: str) -> None:
        super().__init__(message)
        self.role = role  # "worker" | "cache_transfer" | "engine"


class EngineFailed(WorkerDied):
    """The engine's own state is broken (every iteration fails): the process must exit non-zero."""

    def __init__(self, message: str) -> None:
        super().__init__(message, role="engine")


@dataclass
class RecoveryHooks:
    """What the engine does when a child dies; the supervisor calls these from ``recover``."""

    # Fail the requests in flight with this reason (a dead worker took their KV cache with it).
    fail_running: Callable[[str], None]
    # Forget cached state held by the dead processes: the host tier, and the device cache if True.
    reset_cache_state: Callable[[bool], None]
    # Publish the engine's counters (the restart counts are read from ``WorkerSupervisor.stats_restarts``).
    publish_stats: Callable[[], None]
    # KV transfers past their deadline, oldest first (objects with ``kind`` and ``task_id``).
    overdue_transfers: Callable[[], Sequence]


class WorkerSupervisor:
    """Starts, watches, restarts and stops the workers (one per TP rank) and cache transfer processes.

    ``transfer_socket`` is the engine's task socket to the cache transfer processes, None when this
    engine runs without them; ``batch_socket`` its step socket to the workers. Both carry the
    ``WorkerShutdown`` of an orderly stop.
    """

    def __init__(self, config: EngineConfig, addresses: "EngineAddresses", signals: InstanceSignals,
                 stop_event: threading.Event, batch_socket: zmq.Socket, transfer_socket: zmq.Socket | None,
                 hooks: RecoveryHooks) -> None:
        self.config = config
        self._worker_args = (addresses.batches, addresses.results)
        self._transfer_args = (addresses.transfer_tasks, addresses.transfer_done)
        self.signals = signals
        self.stop_event = stop_event
        self.batch_socket = batch_socket
        self.transfer_socket = transfer_socket
        self.hooks = hooks
        self.workers: list[multiprocessing.process.BaseProcess] = []
        self.cache_transfers: list[multiprocessing.process.BaseProcess] = []
        self.stats_restarts = {"worker_restarts": 0, "cache_transfer_restarts": 0}
        self._restart_times: list[float] = []
        self._transfer_timeout = envs.FD_CACHE_TRANSFER_TIMEOUT
        self._spawn = multiprocessing.get_context("spawn")

    @property
    def tp_size(self) -> int:
        return self.config.parallel.tensor_parallel_size

    # ---- start -------------------------------------------------------------------------

    def start_workers(self) -> None:
        """Start the workers, wait for them, then the cache transfer processes (they map the workers' memory)."""
        self._start_ranks(run_worker, "worker", self._worker_args, self.workers, self.signals.worker_pid.value,
                          self.signals.worker_ready.value, "workers")
        if self.transfer_socket is not None:
            self._start_cache_transfers()

    def _start_cache_transfers(self) -> None:
        # One process serves every TP rank's shard (slot 0 of the per-rank signals).
        self._start_ranks(run_cache_transfer, "cache-transfer", self._transfer_args, self.cache_transfers,
                          self.signals.cache_transfer_pid.value, self.signals.cache_transfer_ready.value,
                          "cache transfer process", count=1)

    def _start_ranks(self, target: Callable[..., None], role: str, args: tuple, procs: list, pids: np.ndarray,
                     ready: np.ndarray, what: str, count: int | None = None) -> None:
        """One process of ``target`` per TP rank (the first ``count``), its pid published, then wait until
        every one is ready."""
        count = self.tp_size if count is None else count
        for tp_rank in range(count):
            proc = self._spawn.Process(target=target, name=f"fdserve-{role}-{tp_rank}",
                                       args=(self.config, tp_rank, *args))
            proc.start()
            pids[tp_rank] = proc.pid
            procs.append(proc)
        self._wait_ready(ready[:count], what)

    def _wait_ready(self, flags, what: str) -> None:
        deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        while not all(flags):
            self.check_alive()
            if self.stop_event.is_set():
                raise InterruptedError("stopped while waiting for workers")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not ready after {WORKER_START_TIMEOUT_S:.0f} s")
            self.stop_event.wait(0.1)
        logger.info("%s ready", what)

    # ---- liveness ----------------------------------------------------------------------

    def check_alive(self, roles: tuple[str, ...] = ("worker", "cache_transfer")) -> None:
        """Raise ``WorkerDied`` for the first child of ``roles`` that exited."""
        for role, procs in (("worker", self.workers), ("cache_transfer", self.cache_transfers)):
            if role not in roles:
                continue
            for proc in procs:
                if not proc.is_alive():
                    raise WorkerDied(f"{proc.name} (pid {proc.pid}) exited with code {proc.exitcode}", role)

    def stalled_cache_transfer(self) -> str | None:
        """Why the cache transfer process counts as hung (alive, making no progress), or None.

        Its heartbeat stands still while it runs a task (see ``cache_transfer_manager._Heartbeat``)
        and while it is stopped; ``overdue_transfers`` covers every task kind, not only fills.
        """
        now = time.time()
        beats, ready = self.signals.cache_transfer_heartbeat.value, self.signals.cache_transfer_ready.value
        for rank, proc in enumerate(self.cache_transfers):
            age = now - float(beats[rank])
            if ready[rank] and age > self._transfer_timeout and proc.is_alive():
                return (f"{proc.name} (pid {proc.pid}) made no progress for {age:.0f} s "
                        f"(FD_CACHE_TRANSFER_TIMEOUT={self._transfer_timeout:g} s)")
        overdue = self.hooks.overdue_transfers()
        if overdue:
            return (f"{len(overdue)} KV transfer(s) are past their deadline (the oldest: {overdue[0].kind} task "
                    f"{overdue[0].task_id})")
        return None

    def kill_stalled_cache_transfer(self) -> str | None:
        """SIGKILL a hung cache transfer process now; returns why, or None if it is progressing.

        Killed at once, even mid-step, because it may hold the KV-cache lock the worker waits
        for. Its blocks are released later by ``recover``, after the process is reaped.
        """
        if not self.cache_transfers:
            return None
        reason = self.stalled_cache_transfer()
        if reason is None:
            return None
        for proc in self.cache_transfers:
            if proc.is_alive():
                logger.error("%s; killing %s (pid %d)", reason, proc.name, proc.pid)
                proc.kill()
        return reason

    # ---- recovery ----------------------------------------------------------------------

    def recover(self, exc: WorkerDied) -> None:
        """Restart a dead worker or cache transfer process, failing only what it took down with it.

        A dead worker takes the KV cache memory with it: running requests fail with an
        error, cached prefixes are forgotten, and the cache transfer process is restarted
        too (it mapped the old memory). A dead cache transfer process takes the host tier
        with it: its in-flight copies become cache misses. Raises when restarting is not
        possible (expert parallelism: the other ranks' collectives cannot be re-joined) or
        keeps failing.
        """
        now = time.monotonic()
        self._restart_times = [t for t in self._restart_times if now - t < RESTART_WINDOW_S] + [now]
        if len(self._restart_times) > MAX_RESTARTS_PER_WINDOW:
            raise WorkerDied(f"{exc} ({len(self._restart_times)} restarts within {RESTART_WINDOW_S:.0f} s; "
                             "giving up)", exc.role)
        if self.config.parallel.enable_expert_parallel and exc.role == "worker":
            raise WorkerDied(f"{exc}; an expert-parallel worker cannot be restarted alone", exc.role)
        logger.error("%s; restarting %s", exc, "the TP group (every rank)" if exc.role == "worker" and self.tp_size > 1
                     else "it")
        if exc.role == "worker":
            self.hooks.fail_running("the worker process died during this request; please retry")
            self._stop_processes(self.cache_transfers)
            self._stop_processes(self.workers)
            self._forget_dead(device_too=True)
            counter, start = "worker_restarts", self.start_workers
        else:
            self._stop_processes(self.cache_transfers)
            self._forget_dead(device_too=False)
            counter, start = "cache_transfer_restarts", self._start_cache_transfers
        self.stats_restarts[counter] += 1
        # Published before the new process starts: once /health shows it, the count already includes it.
        self.hooks.publish_stats()
        start()

    def _forget_dead(self, device_too: bool) -> None:
        """After the cache transfer processes (and, if ``device_too``, the workers) were reaped: drop
        the engine's cache state they held, clear their readiness, remove the segments they left."""
        self.hooks.reset_cache_state(device_too)
        dp_rank, instance_id = self.config.parallel.dp_rank, self.config.instance_id
        stale = [host_cache_segment(instance_id, dp_rank, r) for r in range(self.tp_size)]
        self.signals.cache_transfer_ready.value[:] = 0
        if device_too:
            stale += [device_cache_segment(instance_id, dp_rank, r) for r in range(self.tp_size)]
            self.signals.worker_ready.value[:] = 0
        for name in stale:
            if unlink_segment(name):
                logger.info("removed %s left by the dead process", name)

    def _stop_processes(self, procs: list) -> None:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(KILL_WAIT_S)
            if proc.is_alive():
                # Its copies may still land: releasing its blocks now could corrupt reused ones.
                raise EngineFailed(f"{proc.name} (pid {proc.pid}) survived SIGKILL for {KILL_WAIT_S:.0f} s")
        procs.clear()

    # ---- orderly stop ------------------------------------------------------------------

    def stop_workers(self) -> None:
        """Ask every child to stop, then terminate (and kill) the ones that do not within the grace."""
        sockets = [self.batch_socket] * len(self.workers)
        if self.transfer_socket is not None:
            sockets += [self.transfer_socket] * len(self.cache_transfers)
        for sock in sockets:
            try:
                sock.send_pyobj(WorkerShutdown("engine stopping"), flags=zmq.NOBLOCK)
            except zmq.Again:
                logger.warning("could not queue a shutdown message; the process will be terminated")
        for proc in self.workers + self.cache_transfers:
            proc.join(SHUTDOWN_GRACE_S)
            if proc.is_alive():
                logger.warning("worker %s did not stop in %.0f s; terminating", proc.name, SHUTDOWN_GRACE_S)
                proc.terminate()
                proc.join(TERMINATE_WAIT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
