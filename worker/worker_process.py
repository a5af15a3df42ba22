"""The worker process main loop: receive a StepBatch, execute_model, send the StepResult.

The worker blocks on its ZMQ socket (never spins), beats a heartbeat in shared
memory while idle or busy, exits when the engine says so, on SIGINT/SIGTERM, or
when its parent dies.

Expert parallelism (``--enable-expert-parallel`` with ``dp_size > 1``): the workers of all
DP ranks form one EP group and every MoE layer is a collective, so they step in lockstep.
Each round a worker polls its batch socket briefly, then all ranks all_reduce(max)
``[has_batch, stop_requested]``. If any rank has a batch every rank runs a forward (an idle
rank a one-token dummy into a private scratch block, output discarded); if any rank wants to
stop, all exit together, so no rank is left waiting in a collective. Idle rounds back off the
poll from ``EP_IDLE_POLL_MIN_MS`` to ``EP_IDLE_POLL_MAX_MS``: the first step after an idle
period waits up to that long (50 ms) for the slowest rank's poll to end. A rank that just
ran a real step waits up to ``EP_NEXT_BATCH_POLL_MS`` for its engine's next batch, so a busy
rank does not miss a round (and run a dummy) because its engine is a millisecond late. A
collective that fails (a peer died, or hung past gloo's 30 s timeout) ends the worker with
exit code ``EP_FAILURE_EXIT_CODE`` and a log line saying so.

The KV-cache lock stays per DP rank and is held around the forward, also while the forward
waits for other ranks inside a collective: no other rank ever waits for this rank's lock,
and this rank's cache-transfer process waits for nothing across ranks, so there is no cycle.
The dummy forward touches only private memory and does not take the lock.

Tensor parallelism (``tensor_parallel_size`` N > 1): the N workers of a DP rank step in lockstep
(``worker.tensor_parallel.TensorParallelGroup``). Only TP rank 0 is connected to the engine: it
takes the KV-cache lock, forwards the ``StepBatch`` to ranks 1..N-1 over ZMQ, and every rank runs
the same step (``_group_step``); rank 0 alone samples and answers with the ``StepResult``. The lock
covers the whole group's use of the KV cache: it is taken before the batch leaves rank 0, and
rank 0's forward returns only after the last layer's all-reduce, which every peer enters after its
last KV read and write. With FD_KVCACHE_SANITIZER every rank checks the block states and the ranks
agree (one all-reduce of the per-sequence flags), so a sequence refused on one rank is refused on
all. A failure after a rank may have entered a collective ends the worker with
``EP_FAILURE_EXIT_CODE`` (the engine restarts the whole TP group); the all-reduce's waits are
bounded and notice a dead peer.
"""
from __future__ import annotations

import ctypes
import logging
import threading
import time
from typing import Callable

import numpy as np
import zmq
from tqdm import tqdm

import envs
from config.engine_config import EngineConfig
from config.log import setup_logging
from cache_manager.block_state import BlockState
from inter_communicator.instance_signals import InstanceSignals
from inter_communicator.kvcache_lock import kvcache_lock_for
from inter_communicator.messages import StepBatch, StepResult, WorkerShutdown
from inter_communicator.process_utils import EXIT_COLLECTIVE_FAILURE, ProcessEntry

logger = logging.getLogger(__name__)

POLL_MS = 1000
# Lockstep (EP) polling; see the module docstring for the latency each adds.
EP_NEXT_BATCH_POLL_MS = 20
EP_IDLE_POLL_MIN_MS = 1
EP_IDLE_POLL_MAX_MS = 50
EP_FAILURE_EXIT_CODE = EXIT_COLLECTIVE_FAILURE
# Seconds between a stop (signal, dead parent, the engine's shutdown message) and a forced exit.
SHUTDOWN_GRACE_S = 15.0
# Largest TP all-reduce in floats before it is split (16 MiB per rank slot, two buffers).
MAX_TP_ALLREDUCE_CAPACITY = 4 << 20


class Worker:
    def __init__(self, config: EngineConfig, tp_rank: int, batch_addr: str, result_addr: str,
                 stop_event: threading.Event | None = None) -> None:
        # Both import paddle: only after the thread variables are set.
        from worker.expert_parallel import build_expert_parallel, expert_parallel_enabled
        from worker.model_runner import ModelRunner

        self.config = config
        self.tp_rank = tp_rank
        self.stop_event = stop_event if stop_event is not None else threading.Event()
        # Not connected yet: the rendezvous happens in serve(), after every rank loaded its model,
        # so a slow loader never meets a collective's timeout.
        from worker.tensor_parallel import TensorParallelGroup

        self.ep = build_expert_parallel(config) if expert_parallel_enabled(config) else None
        self.zmq_context = zmq.Context()
        self.tp: TensorParallelGroup | None = None
        tp_size = config.parallel.tensor_parallel_size
        if tp_size > 1:
            capacity = min(config.scheduler.max_step_tokens * config.model.hidden_size,
                           MAX_TP_ALLREDUCE_CAPACITY)
            self.tp = TensorParallelGroup(config.instance_id, config.parallel.dp_rank, tp_rank, tp_size, batch_addr,
                                          capacity, self.zmq_context, self.stop_event)
        self.runner = ModelRunner(config, tp_rank, ep=self.ep, all_reduce=self.tp.all_reduce if self.tp else None)
        self.signals = InstanceSignals(config, create=False)
        # Only TP rank 0 takes the lock: the other ranks would otherwise deadlock in collectives.
        self.kvcache_lock = kvcache_lock_for(config.instance_id, config.parallel.dp_rank, role="worker",
                                             enabled=envs.FD_USE_KVCACHE_LOCK and tp_rank == 0)
        self._steps_executed = 0
        self._fault_step = envs.FD_KVCACHE_FAULT_RAISE_IN_STEP
        self.sanitizer = BlockStateSanitizer(self.signals.block_states.value, config.cache.block_size) \
            if envs.FD_KVCACHE_SANITIZER else None
        # Under TP only rank 0 talks to the engine (the others get their steps from it).
        self.batch_socket: zmq.Socket | None = None
        self.result_socket: zmq.Socket | None = None
        if tp_rank == 0:
            self.batch_socket = self.zmq_context.socket(zmq.PULL)
            self.batch_socket.connect(batch_addr)
            self.result_socket = self.zmq_context.socket(zmq.PUSH)
            self.result_socket.connect(result_addr)

    def _sanitize(self, batch: StepBatch) -> tuple[StepBatch, dict[str, str]]:
        """The batch without the sequences the sanitizer refuses, and their error messages."""
        violations: dict[str, str] = {}
        if self.sanitizer is not None:
            violations = self.sanitizer.check(batch)
            if violations:
                batch = StepBatch(batch.step_id, [s for s in batch.seqs if s.request_id not in violations])
        return batch, violations

    def _maybe_inject_fault(self) -> None:
        """Test-only (FD_KVCACHE_FAULT_RAISE_IN_STEP=N): raise inside the lock bracket on the N-th step."""
        self._steps_executed += 1
        if self._steps_executed == self._fault_step:
            raise RuntimeError(f"injected fault in step {self._steps_executed} (FD_KVCACHE_FAULT_RAISE_IN_STEP)")

    def execute_model(self, batch: StepBatch) -> StepResult:
        """One engine step on this rank (the single entry point the engine drives)."""
        batch, violations = self._sanitize(batch)
        try:
            with self.kvcache_lock.hold("execute_model"):
                self._maybe_inject_fault()
                result = self.runner.execute_model(batch) if batch.seqs else StepResult(batch.step_id)
            result.errors.update(violations)
            return result
        except Exception as exc:  # a bad step fails its requests, not the worker
            logger.exception("execute_model failed for step %d", batch.step_id)
            return failed_step_result(batch, exc, violations)

    def serve(self) -> None:
        if self.ep is not None:
            self.ep.group.connect()
        if self.tp is not None:
            self.tp.connect()
        self.signals.worker_ready.value[self.tp_rank] = 1
        logger.info("worker ready")
        if self.ep is not None:
            self._serve_lockstep()
        elif self.tp is not None and self.tp_rank == 0:
            self._serve_tp_leader()
        elif self.tp is not None:
            self._serve_tp_follower()
        else:
            self._serve_single()

    def _serve_single(self) -> None:
        self._serve_engine_batches(self.execute_model)

    def _serve_engine_batches(self, execute: Callable[[StepBatch], StepResult]) -> None:
        """Answer the engine's batches with ``execute`` until it sends ``WorkerShutdown`` or a stop is requested."""
        poller = zmq.Poller()
        poller.register(self.batch_socket, zmq.POLLIN)
        while not self.stop_event.is_set():
            self.signals.worker_heartbeat.value[self.tp_rank] = time.time()
            if not poller.poll(POLL_MS):
                continue
            message = self.batch_socket.recv_pyobj()
            if isinstance(message, WorkerShutdown):
                logger.info("shutdown requested by the engine: %s", message.reason)
                break
            self.result_socket.send_pyobj(execute(message))

    # ---- tensor parallelism: rank 0 leads, every rank runs the step ---------------------

    def _serve_tp_leader(self) -> None:
        """TP rank 0: the engine's batches, forwarded to the peers, run by the whole group."""
        try:
            self._serve_engine_batches(self._execute_tp_leader)
        finally:
            self._stop_followers()

    def _stop_followers(self) -> None:
        from worker.tensor_parallel import STOP_FAN_OUT_TIMEOUT_MS, TPCommunicationError

        try:
            self.tp.fan_out(WorkerShutdown("TP rank 0 is stopping"), timeout_ms=STOP_FAN_OUT_TIMEOUT_MS)
        except TPCommunicationError as exc:  # a peer already gone: the engine stops or restarts it anyway
            logger.warning("could not tell every TP rank to stop: %s", exc)

    def _execute_tp_leader(self, batch: StepBatch) -> StepResult:
        """One step of the group under the lock, which covers every rank's use of the KV cache."""
        from worker.tensor_parallel import TPCommunicationError

        try:
            with self.kvcache_lock.hold("execute_model"):
                # Before the fan-out: a step failed here was never seen by the peers.
                self._maybe_inject_fault()
                self.tp.fan_out(batch)
                result = self._group_step(batch)
            return result
        except TPCommunicationError:
            raise
        except Exception as exc:
            logger.exception("execute_model failed for step %d", batch.step_id)
            return failed_step_result(batch, exc, {})

    def _serve_tp_follower(self) -> None:
        """TP rank > 0: run every step rank 0 forwards until it says stop."""
        while not self.stop_event.is_set():
            self.signals.worker_heartbeat.value[self.tp_rank] = time.time()
            message = self.tp.receive(POLL_MS)
            if message is None:
                continue
            if isinstance(message, WorkerShutdown):
                logger.info("TP rank 0 asked to stop: %s", message.reason)
                break
            self._group_step(message)

    def _group_step(self, batch: StepBatch) -> StepResult | None:
        """The same step on every TP rank: sanitizer agreement, prepare, forward; rank 0 samples.

        Returns rank 0's result (None on the other ranks). Everything before the forward is the
        same on every rank (the batch is the same and the sanitizer's answer is agreed), so a
        failure there fails the step everywhere without a collective; a failure in the forward
        leaves the ranks out of step and raises ``TPCommunicationError``.
        """
        from worker.tensor_parallel import TPCommunicationError

        runnable, violations = self._sanitize_group(batch)
        if not runnable.seqs:
            return StepResult(batch.step_id, errors=violations)
        try:
            step = self.runner.prepare_step(runnable)
        except Exception as exc:
            logger.exception("step %d: could not prepare the batch", batch.step_id)
            return failed_step_result(runnable, exc, violations)
        try:
            hidden = self.runner.forward(step)
        except TPCommunicationError:
            raise
        except Exception as exc:
            raise TPCommunicationError(f"step {batch.step_id}: the forward failed on TP rank {self.tp_rank} "
                                       f"({type(exc).__name__}: {exc}); the TP ranks are out of step") from exc
        if self.tp_rank != 0:
            return None
        try:
            result = self.runner.sample_step(step, hidden)
        except Exception as exc:  # sampling is local to rank 0
            logger.exception("step %d: sampling failed", batch.step_id)
            return failed_step_result(runnable, exc, violations)
        result.errors.update(violations)
        return result

    def _sanitize_group(self, batch: StepBatch) -> tuple[StepBatch, dict[str, str]]:
        """The sanitizer on this rank, then the union over ranks (a collective when the sanitizer is on)."""
        if self.sanitizer is None or not batch.seqs:
            return batch, {}
        violations = self.sanitizer.check(batch)
        flags = np.asarray([1.0 if s.request_id in violations else 0.0 for s in batch.seqs], dtype=np.float32)
        agreed = self.tp.all_reduce_numpy(flags)
        for seq, count in zip(batch.seqs, agreed):
            if count > 0 and seq.request_id not in violations:
                violations[seq.request_id] = (f"KV-cache sanitizer: another TP rank refused request {seq.request_id}: "
                                              "one of its blocks is in a state execute_model must not touch")
        if violations:
            batch = StepBatch(batch.step_id, [s for s in batch.seqs if s.request_id not in violations],
                              batch.block_copies)
        return batch, violations

    # ---- expert parallelism: lockstep stepping ----------------------------------------

    def _serve_lockstep(self) -> None:
        """The EP loop: one agreement collective per round, then a forward on every rank or none."""
        group = self.ep.group
        poller = zmq.Poller()
        poller.register(self.batch_socket, zmq.POLLIN)
        idle_poll_ms = EP_IDLE_POLL_MIN_MS
        ran_batch = False
        while True:
            self.signals.worker_heartbeat.value[self.tp_rank] = time.time()
            message = None
            if poller.poll(EP_NEXT_BATCH_POLL_MS if ran_batch else idle_poll_ms):
                message = self.batch_socket.recv_pyobj()
            shutdown = isinstance(message, WorkerShutdown)
            if shutdown:
                logger.info("shutdown requested by the engine: %s; stopping the EP group", message.reason)
            batch = message if isinstance(message, StepBatch) else None
            runnable, violations = self._sanitize(batch) if batch is not None else (None, {})
            has_batch = runnable is not None and bool(runnable.seqs)
            flags = group.step_flags(has_batch, shutdown or self.stop_event.is_set())
            if flags.any_stop:
                if batch is not None:
                    self._fail_batch(batch, "the worker is stopping (an expert-parallel rank requested shutdown)")
                logger.info("EP group stopping together (requested by %s)",
                            "this rank" if shutdown or self.stop_event.is_set() else "another rank")
                return
            ran_batch = False
            if not flags.any_batch:
                idle_poll_ms = min(2 * idle_poll_ms, EP_IDLE_POLL_MAX_MS)
                if batch is not None:
                    self.result_socket.send_pyobj(StepResult(batch.step_id, errors=violations))
                continue
            idle_poll_ms = EP_IDLE_POLL_MIN_MS
            if has_batch:
                self.result_socket.send_pyobj(self._execute_lockstep(runnable, violations))
                ran_batch = True
            else:
                self.runner.execute_dummy()
                if batch is not None:
                    self.result_socket.send_pyobj(StepResult(batch.step_id, errors=violations))

    def _execute_lockstep(self, batch: StepBatch, violations: dict[str, str]) -> StepResult:
        """One real step in an EP round; joins exactly one forward's collectives whatever fails.

        A bad batch fails its requests and this rank runs the dummy forward instead. A failure
        inside the forward after this rank entered a collective leaves the ranks out of step:
        that is fatal (EPCommunicationError), the whole group restarts.
        """
        from worker.expert_parallel import EPCommunicationError

        try:
            step = self.runner.prepare_step(batch)
        except Exception as exc:
            logger.exception("step %d: could not prepare the batch; running a dummy forward instead", batch.step_id)
            self.runner.execute_dummy()
            return failed_step_result(batch, exc, violations)
        group = self.ep.group
        collectives_before = group.num_collectives
        try:
            with self.kvcache_lock.hold("execute_model"):
                hidden = self.runner.forward(step)
        except EPCommunicationError:
            raise
        except Exception as exc:
            if group.num_collectives != collectives_before:
                raise EPCommunicationError(
                    f"step {batch.step_id}: the forward failed after joining the EP group's collectives "
                    f"({type(exc).__name__}: {exc}); the ranks are out of step") from exc
            logger.exception("step %d: forward failed before any collective; running a dummy forward instead",
                             batch.step_id)
            self.runner.execute_dummy()
            return failed_step_result(batch, exc, violations)
        try:
            result = self.runner.sample_step(step, hidden)
        except Exception as exc:  # sampling is local: a bad step fails its requests, not the worker
            logger.exception("step %d: sampling failed", batch.step_id)
            return failed_step_result(batch, exc, violations)
        result.errors.update(violations)
        return result

    def _fail_batch(self, batch: StepBatch, reason: str) -> None:
        self.result_socket.send_pyobj(StepResult(batch.step_id, errors={s.request_id: reason for s in batch.seqs}))

    def close(self) -> None:
        if self.ep is not None:
            self.ep.group.close()
        if self.tp is not None:
            self.tp.close()
        self.signals.worker_ready.value[self.tp_rank] = 0
        for sock in (self.batch_socket, self.result_socket):
            if sock is not None:
                sock.close(linger=0)
        self.zmq_context.term()
        self.runner.close()
        self.signals.close()


def failed_step_result(batch: StepBatch, exc: Exception, violations: dict[str, str]) -> StepResult:
    """The result of a step that raised: each of its requests fails with the error, the refused ones with theirs."""
    message = f"worker error during execute_model: {type(exc).__name__}: {exc}"
    return StepResult(batch.step_id, errors={**{s.request_id: message for s in batch.seqs}, **violations})


class BlockStateSanitizer:
    """FD_KVCACHE_SANITIZER: refuse to run a sequence whose blocks are not safe to touch.

    Blocks a step writes (the slots of its new tokens) must be IN_USE; blocks it
    only reads may also be WRITE_BACK (a full block being copied out). Anything
    else (being filled, free, cached without a reference) is a scheduling bug.
    """

    READABLE = (BlockState.IN_USE, BlockState.WRITE_BACK)

    def __init__(self, states, block_size: int) -> None:
        self.states = states
        self.block_size = block_size

    def check(self, batch: StepBatch) -> dict[str, str]:
        violations = {}
        for seq in batch.seqs:
            problem = self._check_seq(seq)
            if problem:
                logger.error("KV sanitizer: %s", problem)
                violations[seq.request_id] = f"KV-cache sanitizer: {problem}"
        return violations

    def _check_seq(self, seq) -> str | None:
        first_written = (seq.context_len - len(seq.token_ids)) // self.block_size
        last = (seq.context_len - 1) // self.block_size
        for index in range(last + 1):
            block_id = seq.block_table[index]
            state = BlockState(int(self.states[block_id]))
            allowed = (BlockState.IN_USE,) if index >= first_written else self.READABLE
            if state not in allowed:
                action = "write" if index >= first_written else "read"
                return (f"execute_model would {action} block {block_id} of request {seq.request_id} "
                        f"while it is {state.name}")
        return None


def tune_malloc() -> None:
    """Keep freed activation buffers in the heap instead of returning them to the OS.

    glibc's default trims and unmaps large blocks eagerly, so every step
    page-faults its buffers in again: measured ~5% slower decode and ~12% slower
    prefill at batch 32 on these machines. Same effect as MALLOC_TRIM_THRESHOLD_ /
    MALLOC_MMAP_THRESHOLD_, applied at run time so no variable must be exported.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        logger.debug("not glibc; malloc left as is")
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_trim_threshold, 1 << 30)  # mallopt takes a C int: 4 << 30 would overflow to 0
    libc.mallopt(m_mmap_threshold, 32 << 20)


def run_worker(config: EngineConfig, tp_rank: int, batch_addr: str, result_addr: str) -> None:
    """Process entry point (multiprocessing spawn target); exits with ``EP_FAILURE_EXIT_CODE`` if the EP or TP
    group failed."""
    parallel = config.parallel
    role = "worker" if parallel.data_parallel_size == 1 else f"worker.dp{parallel.dp_rank}"
    with ProcessEntry(role, tp_rank, grace_s=SHUTDOWN_GRACE_S, setup_logging=setup_logging) as entry:
        envs.apply_compute_thread_env(config.num_threads)
        # tqdm's default lock is a multiprocessing (POSIX) semaphore that would outlive a killed worker.
        tqdm.set_lock(threading.RLock())
        tune_malloc()
        from worker.expert_parallel import EPCommunicationError  # imports paddle: after the thread variables
        from worker.tensor_parallel import TPCommunicationError

        worker = Worker(config, tp_rank, batch_addr, result_addr, stop_event=entry.stop_event)
        entry.cleanup("close the worker", worker.close)
        try:
            worker.serve()
        except EPCommunicationError as exc:
            logger.error("expert-parallel group failed, worker exiting with code %d: %s", EP_FAILURE_EXIT_CODE, exc)
            entry.fail(EP_FAILURE_EXIT_CODE)
        except TPCommunicationError as exc:
            logger.error("tensor-parallel group failed, worker exiting with code %d: %s", EP_FAILURE_EXIT_CODE, exc)
            entry.fail(EP_FAILURE_EXIT_CODE)
