"""The real ``Engine`` run in a thread with a scripted worker, for tests that talk to it over its sockets.

The worker process is the boundary: the scripted worker answers each step with token 1000 + the
sequence's output count, so outputs are exact. Everything else is real: scheduler, prefix cache, ZMQ
ipc sockets, shared-memory signals. ``ScriptedEngine`` owns their set-up and clean-up; test modules add
their own ends of the engine's sockets in ``connect``.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import uuid
from pathlib import Path

import zmq

from config.engine_config import EngineArgs, build_engine_config
from engine.engine_process import Engine, EngineAddresses
from inter_communicator.instance_signals import InstanceSignals
from inter_communicator.messages import StepBatch, StepResult
from inter_communicator.shm import sweep_stale

logger = logging.getLogger(__name__)

FIRST_TOKEN = 1000  # the scripted worker's token for a sequence's first output; then +1 per output


class ScriptedEngine:
    """An ``Engine`` (16 device blocks) with the worker's ends of its sockets; ``start`` runs both threads.

    ``threads[0]`` runs the engine; an exception that ends its loop is kept in ``engine_error``.
    """

    def __init__(self, tmp_path: Path, id_prefix: str, **engine_args: object) -> None:
        base = build_engine_config(EngineArgs(num_gpu_blocks_override=16, **engine_args))
        self.config = dataclasses.replace(base, instance_id=f"{id_prefix}-{uuid.uuid4().hex[:10]}")
        self.signals = InstanceSignals(self.config, create=True)
        self.stop_event = threading.Event()
        self.context = zmq.Context()
        self.threads: list[threading.Thread] = []
        self.engine: Engine | None = None
        self.engine_error: BaseException | None = None
        try:
            self.addresses = EngineAddresses.in_dir(str(tmp_path))
            self.engine = Engine(self.config, self.addresses, self.stop_event)
            self.worker_in = self.context.socket(zmq.PULL)
            self.worker_in.connect(self.addresses.batches)
            self.worker_out = self.context.socket(zmq.PUSH)
            self.worker_out.connect(self.addresses.results)
            self.connect()
        except BaseException:
            self.close()
            raise

    def connect(self) -> None:
        """Hook for a subclass to open its own ends of the engine's sockets (closed with the context)."""

    def start(self) -> None:
        for target in (self._run_engine, self._run_worker):
            thread = threading.Thread(target=target, daemon=True)
            thread.start()
            self.threads.append(thread)

    def engine_thread_alive(self) -> bool:
        return self.threads[0].is_alive()

    def _run_engine(self) -> None:
        try:
            self.engine.run()
        except BaseException as exc:  # kept for the test to assert on, and logged so it is never lost
            logger.exception("the engine loop ended with an error")
            self.engine_error = exc

    def _run_worker(self) -> None:
        while not self.stop_event.is_set():
            if not self.worker_in.poll(100):
                continue
            batch: StepBatch = self.worker_in.recv_pyobj()
            tokens = {s.request_id: FIRST_TOKEN + s.num_output_tokens for s in batch.seqs if s.needs_sample}
            self.worker_out.send_pyobj(StepResult(batch.step_id, sampled_token_ids=tokens))

    def close(self) -> None:
        self.stop_event.set()
        for thread in self.threads:
            thread.join(10)
        self.context.destroy(linger=0)
        if self.engine is not None:
            self.engine.close()
        self.signals.close()
        self.signals.unlink()
        sweep_stale(self.config.instance_id)
