"""The engine process: owns the scheduler and drives the worker one step at a time.

Loop: take new requests and aborts from the API server, schedule a step, send
it to the worker, wait for its result (blocking on ZMQ with a timeout that
checks the worker is alive), turn the sampled tokens into ``RequestOutput``s
and send them back to the API server. Idle, it blocks on its input socket.

A request with n > 1 choices becomes one parent sequence holding its unforked choices
(``sequence.make_choices``); every output carries the client's request id and the choice
index, and an abort or a failure reaches every choice of the request (a rejection at admission is
one error output: it ends the whole request).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

import envs
from cache_manager.kv_cache_manager import KVCacheManager
from cache_manager.storage_lookup import StorageLookup, create_storage_lookup
from cache_manager.transfer_client import CacheTransferClient
from config.engine_config import EngineConfig
from config.log import setup_logging
from engine.disaggregation import DecodeSide, PrefillSide, create_disaggregation, pd_stats
from engine.request import (CACHE_STATS, RESET_PREFIX_CACHE, AbortRequest, CacheStatsReply, ControlError,
                            ControlReply, ControlRequest, EngineRequest, RequestOutput, ResetPrefixCacheReply)
from engine.scheduler import Scheduler, choices_of
from engine.sequence import Sequence, SequenceStatus, make_choices
from engine.supervisor import (MAX_RESTARTS_PER_WINDOW, RESTART_WINDOW_S, EngineFailed, RecoveryHooks, WorkerDied,
                               WorkerSupervisor)
from inter_communicator.instance_signals import InstanceSignals
from inter_communicator.messages import StepBatch, StepResult
from inter_communicator.process_utils import ProcessEntry

if TYPE_CHECKING:
    from engine.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)

POLL_MS = 1000
# Re-exported: launch.py's engine restart budget mirrors the supervisor's.
__all__ = ["MAX_RESTARTS_PER_WINDOW", "RESTART_WINDOW_S", "Engine", "EngineAddresses", "EngineFailed", "WorkerDied",
           "run_engine"]
# From a stop request to a forced exit: covers the supervisor's orderly stop of every child
# (SHUTDOWN_GRACE_S each, then SIGTERM and SIGKILL waits) with room to spare.
ENGINE_SHUTDOWN_GRACE_S = 60.0
# Loop iterations in a row that may fail (each failing its requests) before the engine gives up.
MAX_CONSECUTIVE_FAILURES = 10


@dataclass
class EngineAddresses:
    """ZMQ endpoints of one DP rank, all ipc:// files inside the instance's ipc directory."""

    requests: str  # API server -> engine (PUSH -> PULL)
    outputs: str  # engine -> API server
    control_requests: str  # API server -> engine: ControlRequest (PUSH -> PULL)
    control_replies: str  # engine -> API server: one ControlReply per ControlRequest (PUSH -> PULL)
    batches: str  # engine -> worker
    results: str  # worker -> engine
    transfer_tasks: str  # engine -> cache transfer process
    transfer_done: str  # cache transfer process -> engine

    @classmethod
    def in_dir(cls, ipc_dir: str, dp_rank: int = 0) -> "EngineAddresses":
        def addr(name: str) -> str:
            return f"ipc://{os.path.join(ipc_dir, f'{name}.{dp_rank}.sock')}"

        return cls(requests=addr("requests"), outputs=addr("outputs"), control_requests=addr("control_requests"),
                   control_replies=addr("control_replies"), batches=addr("batches"), results=addr("results"),
                   transfer_tasks=addr("transfer_tasks"), transfer_done=addr("transfer_done"))


class StepLog:
    """Periodic throughput line: how much of each step is the worker's forward, how much is overhead."""

    INTERVAL_S = 10.0

    def __init__(self) -> None:
        self._reset(time.monotonic())

    def _reset(self, now: float) -> None:
        self.window_start = now
        self.steps = 0
        self.step_seconds = 0.0
        self.execute_seconds = 0.0
        self.tokens = 0

    def record(self, step_seconds: float, execute_seconds: float, tokens: int, scheduler: Scheduler) -> None:
        self.steps += 1
        self.step_seconds += step_seconds
        self.execute_seconds += execute_seconds
        self.tokens += tokens
        now = time.monotonic()
        if now - self.window_start < self.INTERVAL_S:
            return
        elapsed = now - self.window_start
        logger.info("%.1f gen tok/s | running %d waiting %d | KV blocks %d/%d | step %.1f ms (worker %.1f ms) "
                    "| %d preemptions", self.tokens / elapsed, scheduler.num_running, scheduler.num_waiting,
                    scheduler.kv_cache.num_used_blocks, scheduler.kv_cache.num_blocks,
                    1000 * self.step_seconds / self.steps, 1000 * self.execute_seconds / self.steps,
                    scheduler.num_preemptions)
        self._reset(now)


class Engine:
    def __init__(self, config: EngineConfig, addresses: EngineAddresses, stop_event: threading.Event) -> None:
        self.config = config
        self.addresses = addresses
        self.stop_event = stop_event
        self.signals = InstanceSignals(config, create=False)
        self.context = zmq.Context()
        self.transfer: CacheTransferClient | None = None
        if needs_cache_transfer(config):
            self.transfer = CacheTransferClient(self.context, addresses.transfer_tasks, addresses.transfer_done)
        # The engine's own handle on the storage tier, asked at admission which blocks exist there.
        self.storage_lookup: StorageLookup | None = None
        if config.cache.storage is not None and config.cache.enable_prefix_caching:
            self.storage_lookup = create_storage_lookup(config.cache.storage)
        self.cache = KVCacheManager(config.cache, self.signals.block_states.value,
                                    submit=self.transfer.submit if self.transfer else None,
                                    storage_lookup=self.storage_lookup)
        if self.transfer is not None:
            self.transfer.on_done = self.cache.on_transfer_done
            self.transfer.on_started = self.cache.on_transfer_started
        # P/D disaggregation: this instance's side of a KV handover (None for --splitwise-role mixed).
        self.pd: PrefillSide | DecodeSide | None = create_disaggregation(config, self.cache, self.context)
        self.scheduler = Scheduler(
            self.cache,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            max_model_len=config.scheduler.max_model_len,
            lone_prefill_tokens=config.scheduler.lone_prefill_tokens,
            schedule_on_fill_start=envs.FD_KVCACHE_FAULT_EARLY_SCHEDULE,
            structured_output=make_structured_output(config),
            on_finish=self.pd.on_finish if self.pd is not None else None,
        )
        self.request_socket = self._socket(zmq.PULL, addresses.requests)
        self.output_socket = self._socket(zmq.PUSH, addresses.outputs)
        # Control has its own channel (a request and a reply socket); the loop reads it beside the
        # generation requests, so commands are answered between steps, never while the scheduler or the
        # cache is mid-change.
        self.control_socket = self._socket(zmq.PULL, addresses.control_requests)
        self.control_reply_socket = self._socket(zmq.PUSH, addresses.control_replies)
        self.batch_socket = self._socket(zmq.PUSH, addresses.batches)
        self.result_socket = self._socket(zmq.PULL, addresses.results)
        self.step_log = StepLog()
        self._consecutive_failures = 0
        self._iteration_failed = False
        self._last_failure = ""
        self._fault_update = envs.FD_ENGINE_FAULT_RAISE_IN_UPDATE
        self.supervisor = WorkerSupervisor(
            config, addresses, self.signals, stop_event, self.batch_socket,
            self.transfer.task_socket if self.transfer is not None else None,
            RecoveryHooks(fail_running=self._fail_running, reset_cache_state=self._reset_cache_state,
                          publish_stats=self._publish_stats, overdue_transfers=self.cache.overdue_transfers))

    def _socket(self, kind: int, address: str) -> zmq.Socket:
        sock = self.context.socket(kind)
        sock.bind(address)
        return sock

    # ---- recovery hooks (the supervisor restarts the processes) -------------

    def _fail_running(self, reason: str) -> None:
        self.scheduler.discard_inflight()
        self._fail(list(self.scheduler.running), reason)

    def _fail(self, seqs: list[Sequence], reason: str, request_ids: tuple[str, ...] = ()) -> None:
        """Abort ``seqs`` (each with its unforked choices) and tell the API server each choice (and each of
        ``request_ids``) ended with ``reason``."""
        outputs = []
        for seq in seqs:
            self._release(seq)
            outputs.extend(RequestOutput(choice.client_id, [], finished=True, finish_reason="error",
                                         num_prompt_tokens=choice.num_prompt_tokens, error=reason,
                                         index=choice.index) for choice in choices_of(seq))
        for request_id in request_ids:
            outputs.append(RequestOutput(request_id, [], finished=True, finish_reason="error", error=reason))
        self._send_outputs(outputs)

    def _release(self, seq: Sequence) -> None:
        """Take ``seq`` out of the scheduler, or free its blocks if a failure left it in neither queue."""
        try:
            if self.scheduler.abort(seq.request_id) is None and seq.status is not SequenceStatus.FINISHED:
                self.scheduler.finish_stray(seq)
        except Exception:  # the request is failed either way; its blocks may leak, say so
            logger.exception("could not release the blocks of %s", seq.request_id)

    def _reset_cache_state(self, device_too: bool) -> None:
        """Forget what the dead cache transfer process (and, if ``device_too``, the worker) held."""
        if self.transfer is not None:
            # Unsent tasks belong to the failed transfers: the new process must not run them.
            self.transfer.discard_backlog()
        self.cache.fail_all_transfers()
        self.cache.drop_host_tier()
        if device_too:
            if self.pd is not None:
                self.pd.on_device_reset()
            self.cache.forget_device_contents()

    # ---- main loop -------------------------------------------------------

    def run(self) -> None:
        """Serve until stopped, restarting dead child processes (see ``recover``).

        An exception from one request, step or transfer completion fails the requests it
        concerns and the loop goes on (``_contain``); only ``EngineFailed`` (the same kind of
        failure every iteration, a child that cannot be killed) or a child that cannot be
        restarted ends the process.
        """
        self.signals.engine_ready.value[0] = 1
        logger.info("engine ready: %d KV blocks of %d tokens, max_model_len %d", self.config.cache.num_gpu_blocks,
                    self.config.cache.block_size, self.config.scheduler.max_model_len)
        while not self.stop_event.is_set():
            try:
                self._serve()
            except EngineFailed:
                raise
            except WorkerDied as exc:
                self.supervisor.recover(exc)
            except Exception as exc:  # outside the per-stage containment: nothing precise to fail
                self._contain("serving", exc, [])

    def _serve(self) -> None:
        idle = False
        while not self.stop_event.is_set():
            self._iteration_failed = False
            idle = self._serve_once(idle)
            if not self._iteration_failed:
                self._consecutive_failures = 0

    def _serve_once(self, idle: bool) -> bool:
        """One loop iteration; returns whether the next one should block waiting for input."""
        self.signals.engine_heartbeat.value[0] = time.time()
        self._receive_requests(block=idle)
        self._service_cache()
        self._service_pd()
        batch = self._schedule()
        self._send_outputs(self.scheduler.take_outputs())
        if batch is None:
            # Nothing runnable: wait for a request or (while fills run) a transfer completion.
            return not self._iteration_failed
        step_started = time.perf_counter()
        result = self._run_step(batch)
        outputs = self._update(batch, result)
        if outputs is None:
            return False
        self._send_outputs(outputs)
        self._publish_stats()
        self.step_log.record(time.perf_counter() - step_started, result.execute_seconds,
                             sum(len(o.new_token_ids) for o in outputs), self.scheduler)
        return False

    def _schedule(self) -> StepBatch | None:
        """``scheduler.schedule()``; if it raises, the sequences it was working on fail and None is returned."""
        running_before, waiting_before = list(self.scheduler.running), list(self.scheduler.waiting)
        try:
            return self.scheduler.schedule()
        except Exception as exc:
            # Running ones would have been in the step; admitted ones may be in neither queue now.
            still_waiting = set(map(id, self.scheduler.waiting))
            touched = running_before + [s for s in waiting_before if id(s) not in still_waiting]
            if not touched and self.scheduler.waiting:
                touched = [self.scheduler.waiting[0]]  # the next candidate: fail it so the loop progresses
            self.scheduler.discard_inflight()
            self._contain("scheduling a step", exc, touched)
            return None

    def _update(self, batch: StepBatch, result: StepResult) -> list[RequestOutput] | None:
        """``scheduler.update(result)``; if it raises, the step's sequences fail and None is returned."""
        step_seqs = self.scheduler.inflight_sequences(batch.step_id)
        try:
            if self._fault_update and any(self._fault_update in s.request_id for s in batch.seqs):
                raise RuntimeError(f"injected fault (FD_ENGINE_FAULT_RAISE_IN_UPDATE={self._fault_update!r})")
            return self.scheduler.update(result)
        except Exception as exc:
            self.scheduler.discard_inflight()
            live = {id(s) for s in list(self.scheduler.running) + list(self.scheduler.waiting)}
            held = [s for s in step_seqs if id(s) in live]
            # A sequence that finished inside the failed update lost its output: it gets the error too
            # (released again is a no-op for a finished sequence).
            lost = [s for s in step_seqs if id(s) not in live]
            self._contain(f"processing the results of step {batch.step_id}", exc, held + lost)
            return None

    def _contain(self, what: str, exc: Exception, seqs: list[Sequence], request_ids: tuple[str, ...] = ()) -> None:
        """Fail the requests a failure concerns and let the loop go on; give up if every iteration fails."""
        self._iteration_failed = True
        self._consecutive_failures += 1
        signature = f"{what}: {type(exc).__name__}: {exc}"
        count = len(seqs) + len(request_ids)
        if signature != self._last_failure:
            logger.error("%s failed; failing %d request(s), the engine goes on", what, count, exc_info=exc)
        else:  # the traceback was logged already
            logger.error("%s failed again (%s: %s); failing %d request(s)", what, type(exc).__name__, exc, count)
        self._last_failure = signature
        self._fail(seqs, f"internal server error while {what}: {type(exc).__name__}: {exc}", request_ids)
        self._publish_stats()
        if self._consecutive_failures >= MAX_CONSECUTIVE_FAILURES:
            raise EngineFailed(f"{self._consecutive_failures} loop iterations in a row failed; the last one "
                               f"{signature}") from exc

    def _publish_stats(self) -> None:
        sched, blocks = self.scheduler, self.scheduler.kv_cache
        self.signals.engine_stats.value[:] = (sched.num_running, sched.num_waiting, blocks.num_used_blocks,
                                              blocks.num_blocks, sched.num_preemptions, sched.num_steps,
                                              self.supervisor.stats_restarts["worker_restarts"],
                                              self.supervisor.stats_restarts["cache_transfer_restarts"])

    def _service_cache(self) -> None:
        if self.transfer is None:
            return
        self.supervisor.check_alive(roles=("cache_transfer",))
        stalled = self.supervisor.kill_stalled_cache_transfer()
        if stalled is not None:
            raise WorkerDied(stalled, "cache_transfer")
        try:
            self.transfer.poll()
            # Fills past their deadline are preempted by the scheduler (Scheduler.schedule). Offload stays
            # here: it picks no sequence, only keeps free device blocks above the watermark, and needs a
            # transfer process.
            self.cache.offload()
        except Exception as exc:
            # No request to blame: a bad transfer's blocks stay quarantined until its deadline restarts the process.
            self._contain("servicing KV cache transfers", exc, [])

    def _service_pd(self) -> None:
        """P/D: apply releases and expire holds (prefill side), send the releases of used offers (decode side)."""
        if self.pd is None:
            return
        try:
            self.pd.service()
        except Exception as exc:  # no request to blame; a hold left behind expires with its TTL
            self._contain("servicing P/D holds and releases", exc, [])

    def _receive_requests(self, block: bool) -> None:
        if block and not self._wait_for_input():
            self.supervisor.check_alive()
            return
        outputs: list[RequestOutput] = []
        for sock in (self.control_socket, self.request_socket):
            while True:
                try:
                    message = sock.recv_pyobj(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                except Exception:  # an undecodable message: nobody to answer
                    logger.exception("undecodable message from the API server dropped")
                    continue
                outputs.extend(self._handle_message_contained(message))
        self._send_outputs(outputs)
        self._publish_stats()

    def _handle_message_contained(self, message: object) -> list[RequestOutput]:
        """``_handle_message``; if it raises, only the message's request fails."""
        try:
            return self._handle_message(message)
        except Exception as exc:
            request_id = getattr(message, "request_id", None)
            logger.error("handling a %s message (request %s) failed; failing that request",
                         type(message).__name__, request_id, exc_info=exc)
            error = f"internal server error while handling the request: {type(exc).__name__}: {exc}"
            if not isinstance(request_id, str):
                return []
            if isinstance(message, ControlRequest):
                self.control_reply_socket.send_pyobj(ControlError(request_id, error))
                return []
            held = [s for s in list(self.scheduler.running) + list(self.scheduler.waiting)
                    if s.client_id == request_id]
            for seq in held:
                self._release(seq)
            choices = [choice for seq in held for choice in choices_of(seq)] or [None]
            return [RequestOutput(request_id, [], finished=True, finish_reason="error", error=error,
                                  index=choice.index if choice is not None else 0) for choice in choices]

    def _wait_for_input(self) -> bool:
        """Block up to POLL_MS for an API message or a transfer completion; True if an API message is ready."""
        poller = zmq.Poller()
        poller.register(self.request_socket, zmq.POLLIN)
        poller.register(self.control_socket, zmq.POLLIN)
        if self.transfer is not None:
            poller.register(self.transfer.done_socket, zmq.POLLIN)
        if isinstance(self.pd, PrefillSide):
            poller.register(self.pd.release_socket, zmq.POLLIN)
        ready = dict(poller.poll(POLL_MS))
        return self.request_socket in ready or self.control_socket in ready

    def _handle_message(self, message: object) -> list[RequestOutput]:
        if isinstance(message, EngineRequest):
            seq = make_choices(message.request_id, list(message.prompt_token_ids), message.sampling_params,
                               tuple(message.eos_token_ids), message.arrival_time)
            if self.pd is not None and message.kv_transfer_params:
                self.pd.attach(seq, message.kv_transfer_params)
            rejected = self.scheduler.add(seq)
            if rejected and self.pd is not None:
                self.pd.on_finish(seq, None)  # an offer it carried is released now, not at its TTL
            return [rejected] if rejected else []
        if isinstance(message, AbortRequest):
            # Every choice still waiting or running (forked or not) ends, each with its own output.
            return [RequestOutput(seq.client_id, [], finished=True, finish_reason="abort",
                                  num_prompt_tokens=seq.num_prompt_tokens, index=seq.index)
                    for seq in self.scheduler.abort_request(message.request_id)]
        if isinstance(message, ControlRequest):
            self.control_reply_socket.send_pyobj(self._control(message))
            return []
        logger.error("ignoring unknown message of type %s from the API server", type(message).__name__)
        return []

    def _control(self, request: ControlRequest) -> ControlReply:
        """The reply to one control command (the kvcache lock's counters are read by the API server)."""
        if request.command == RESET_PREFIX_CACHE:
            dropped = self.cache.reset()
            logger.info("prefix cache reset: %d device/host blocks dropped (storage kept)", dropped)
            return ResetPrefixCacheReply(request.request_id, dropped)
        if request.command == CACHE_STATS:
            return CacheStatsReply(request.request_id, {**self.cache.summary(), **pd_stats(self.pd)})
        return ControlError(request.request_id, f"unknown command {request.command!r}")

    def _run_step(self, batch: StepBatch) -> StepResult:
        self.batch_socket.send_pyobj(batch)
        deadline = time.monotonic() + envs.FD_WORKER_STEP_TIMEOUT
        poller = zmq.Poller()
        poller.register(self.result_socket, zmq.POLLIN)
        if self.transfer is not None:
            poller.register(self.transfer.done_socket, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(POLL_MS))
            if self.transfer is not None and self.transfer.done_socket in ready:
                self.transfer.poll()
            if self.result_socket in ready:
                break
            self.signals.engine_heartbeat.value[0] = time.time()
            # A dead or hung cache transfer process is handled once the step is back (_service_cache):
            # restarting it now would schedule a new step while the worker still runs this one.
            self.supervisor.check_alive(roles=("worker",))
            self.supervisor.kill_stalled_cache_transfer()
            if time.monotonic() > deadline:
                raise WorkerDied(f"worker gave no result for step {batch.step_id} within "
                                 f"FD_WORKER_STEP_TIMEOUT={envs.FD_WORKER_STEP_TIMEOUT:.0f} s", "worker")
        result: StepResult = self.result_socket.recv_pyobj()
        if result.step_id != batch.step_id:
            raise WorkerDied(f"worker answered step {result.step_id}, expected {batch.step_id}", "worker")
        return result

    def _send_outputs(self, outputs: list[RequestOutput]) -> None:
        if outputs:
            self.output_socket.send_pyobj(outputs)

    def fail_all(self, reason: str) -> None:
        """Finish every known request with an error (the engine cannot go on)."""
        self._fail_running(reason)
        self._fail(list(self.scheduler.waiting), reason)

    def close(self) -> None:
        self.signals.engine_ready.value[0] = 0
        for sock in (self.request_socket, self.control_socket, self.output_socket, self.control_reply_socket,
                     self.batch_socket, self.result_socket):
            sock.close(linger=0)
        if self.pd is not None:
            self.pd.close()
        if self.transfer is not None:
            self.transfer.close()
        if self.storage_lookup is not None:
            self.storage_lookup.close()
        if self.scheduler.structured_output is not None:
            self.scheduler.structured_output.close()
        self.context.term()
        self.signals.close()


def make_structured_output(config: EngineConfig) -> "StructuredOutputManager | None":
    """The structured-output manager for this model, or None if this build has none (such requests fail).

    Constructing it returns at once: the tokenizer is converted for the grammar library off the loop.
    """
    try:
        from engine.structured_output import StructuredOutputManager
    except ImportError as exc:  # the grammar library is optional: requests carrying a spec get an error
        logger.warning("structured output is not available: %s", exc)
        return None
    return StructuredOutputManager.for_model(config.model.path, config.model.vocab_size)


def needs_cache_transfer(config: EngineConfig) -> bool:
    # A P/D decode instance reads the prefill instance's blocks in its cache transfer process.
    return config.cache.num_cpu_blocks > 0 or config.cache.storage is not None or config.pd.role == "decode"


def run_engine(config: EngineConfig, addresses: EngineAddresses) -> None:
    """Process entry point (multiprocessing spawn target). Exits non-zero if the engine fails."""
    wake_lock = threading.RLock()
    wake: list[zmq.Socket] = []

    def wake_loop() -> None:
        # An idle engine blocks up to POLL_MS on its request socket: a no-op message (the abort of
        # an unknown request) wakes it now. Under a lock: the parent watcher is another thread.
        with wake_lock:
            if wake:
                try:
                    wake[0].send_pyobj(AbortRequest("engine-stop-wake-up"), flags=zmq.NOBLOCK)
                except zmq.ZMQError as exc:
                    logger.debug("could not wake the engine loop: %s", exc)

    def close_wake() -> None:
        with wake_lock:
            wake.pop().close(linger=0)

    with ProcessEntry("engine", config.parallel.dp_rank, grace_s=ENGINE_SHUTDOWN_GRACE_S, setup_logging=setup_logging,
                      on_stop=wake_loop) as entry:
        engine = Engine(config, addresses, entry.stop_event)
        entry.cleanup("close the engine", engine.close)
        with wake_lock:
            wake.append(engine.context.socket(zmq.PUSH))
            wake[0].connect(addresses.requests)
        entry.cleanup("close the wake-up socket", close_wake)
        entry.cleanup("stop the workers", engine.supervisor.stop_workers)
        try:
            engine.supervisor.start_workers()
            engine.run()
        except InterruptedError:
            logger.info("stopped during start-up")
        except (WorkerDied, TimeoutError) as exc:
            logger.error("engine cannot continue: %s", exc)
            engine.fail_all(f"server error: {exc}")
            entry.fail()
