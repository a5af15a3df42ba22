"""Tensor-parallel sharding plan: which slice of each checkpoint weight a TP rank holds.

This module owns the Megatron-style split of a dense Llama-family decoder over ``tp_size`` ranks
and the divisibility checks that refuse a model the split cannot serve:

- attention: rank ``r`` holds query heads ``[r*H/N, (r+1)*H/N)`` and KV heads
  ``[r*K/N, (r+1)*K/N)``, i.e. rows of ``q_proj``/``k_proj``/``v_proj`` (and their biases) and the
  matching input columns of ``o_proj``. Contiguous head ranges keep GQA groups whole: query head
  ``h`` reads KV head ``h // (H/K)``, and both ranges scale by the same N.
- MLP: rows ``[r*I/N, (r+1)*I/N)`` of ``gate_proj``/``up_proj`` and those input columns of
  ``down_proj``.
- ``o_proj`` and ``down_proj`` then give partial sums; the model adds them over ranks with an
  all-reduce (rank order, so every rank holds the same bits).
- Embedding, norms and the LM head stay replicated in this increment (every rank computes the
  full logits; splitting the vocabulary and gathering logits is left for later).

``TensorParallelGroup`` is the running group of one DP rank's TP workers: the start-up rendezvous,
rank 0's fan-out of every step to its peers, and the shared-memory all-reduce the model calls.

Weights are taken in Hugging Face ``[out, in]`` layout; ``shard_getter`` wraps a getter so the
model's ordinary loading code receives the rank's slices.
"""
from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import paddle

from config.engine_config import tensor_parallel_problem
from config.model_config import ModelConfig

logger = logging.getLogger(__name__)

WeightGetter = Callable[[str], np.ndarray]

_LAYER = r"model\.layers\.\d+\."
# name pattern -> (axis of the HF [out, in] array to split, which dimension it follows)
_SPLITS: list[tuple[re.Pattern[str], int, str]] = [
    (re.compile(_LAYER + r"self_attn\.q_proj\.(weight|bias)$"), 0, "q"),
    (re.compile(_LAYER + r"self_attn\.[kv]_proj\.(weight|bias)$"), 0, "kv"),
    (re.compile(_LAYER + r"self_attn\.o_proj\.weight$"), 1, "q"),
    (re.compile(_LAYER + r"mlp\.(gate|up)_proj\.weight$"), 0, "mlp"),
    (re.compile(_LAYER + r"mlp\.down_proj\.weight$"), 1, "mlp"),
]


class TensorParallelError(ValueError):
    """The model cannot be split over the requested number of TP ranks."""


@dataclass(frozen=True)
class ShardPlan:
    """One TP rank's share of a dense decoder."""

    tp_rank: int
    tp_size: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    head_dim: int
    intermediate: int  # MLP intermediate columns on this rank

    def rows(self, what: str) -> slice:
        """This rank's slice of the output dimension ``what`` ("q", "kv" or "mlp")."""
        width = {"q": self.num_heads * self.head_dim, "kv": self.num_kv_heads * self.head_dim,
                 "mlp": self.intermediate}[what]
        return slice(self.tp_rank * width, (self.tp_rank + 1) * width)

    def shard(self, name: str, array: np.ndarray) -> np.ndarray:
        """The part of checkpoint weight ``name`` this rank holds (the whole array if replicated)."""
        for pattern, axis, what in _SPLITS:
            if pattern.search(name):
                part = self.rows(what)
                return array[part] if axis == 0 or array.ndim == 1 else array[:, part]
        return array

    def shard_getter(self, get: WeightGetter) -> WeightGetter:
        """``get`` returning this rank's slices (contiguous copies) instead of full weights."""

        def sharded(name: str) -> np.ndarray:
            return np.ascontiguousarray(self.shard(name, get(name)))

        return sharded


def check_tensor_parallel(config: ModelConfig, tp_size: int) -> None:
    """Raise ``TensorParallelError`` naming the counts when ``config`` does not split over ``tp_size``."""
    problem = tensor_parallel_problem(config, tp_size)
    if problem is not None:
        raise TensorParallelError(problem)


def shard_plan(config: ModelConfig, tp_rank: int, tp_size: int) -> ShardPlan:
    """The checked plan of rank ``tp_rank`` of ``tp_size``."""
    check_tensor_parallel(config, tp_size)
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise TensorParallelError(f"tensor parallel rank must be in 0..{tp_size - 1}, got {tp_rank!r}")
    return ShardPlan(
        tp_rank=tp_rank,
        tp_size=tp_size,
        num_heads=config.num_attention_heads // tp_size,
        num_kv_heads=config.num_key_value_heads // tp_size,
        head_dim=config.head_dim,
        intermediate=config.intermediate_size // tp_size,
    )


def shard_weights(weights: dict[str, np.ndarray], plan: ShardPlan) -> dict[str, np.ndarray]:
    """Every checkpoint weight reduced to this rank's slice (views; replicated ones unchanged)."""
    return {name: plan.shard(name, array) for name, array in weights.items()}


def paddle_all_reduce(reduce: Callable[[np.ndarray], np.ndarray]) -> Callable[[paddle.Tensor], paddle.Tensor]:
    """Adapt a numpy all-reduce (``ShmAllReduce.all_reduce``) to the model's tensor -> tensor callable."""

    def all_reduce(tensor: paddle.Tensor) -> paddle.Tensor:
        return paddle.to_tensor(reduce(tensor.numpy()))

    return all_reduce


# ---- the running group: rendezvous, rank 0's batch fan-out, the all-reduce ---------------------

# How long the ranks wait for each other at start-up (model loading on a busy machine included).
RENDEZVOUS_TIMEOUT_S = 600.0
# How long rank 0 may block handing a step to a peer (a live peer takes it at once: ZMQ queues it).
FAN_OUT_TIMEOUT_MS = 10_000
# The stop message: a peer that already stopped (a signal reached the whole group) is not waited for.
STOP_FAN_OUT_TIMEOUT_MS = 200
_RENDEZVOUS_POLL_MS = 200


class TPCommunicationError(RuntimeError):
    """The TP group is out of step (a peer died, a collective failed or timed out): restart it as one."""


@dataclass(frozen=True)
class TPHello:
    """Rank 0 -> every peer once at start-up: the all-reduce group exists, attach to it."""

    capacity: int


def tp_fan_out_address(batch_addr: str, tp_rank: int) -> str:
    """Where rank 0 sends TP rank ``tp_rank`` its copy of each step: beside the engine's batch socket."""
    base = batch_addr[: -len(".sock")] if batch_addr.endswith(".sock") else batch_addr
    return f"{base}.tp{tp_rank}.sock"


class TensorParallelGroup:
    """One worker's membership of its DP rank's TP group.

    Rank 0 alone talks to the engine; it binds one PUSH socket per peer and forwards every
    ``StepBatch`` (and the ``WorkerShutdown``) to each, so all ranks run the same steps in the same
    order. The shared-memory all-reduce group is created by rank 0 in ``connect``, after its model
    loaded; a peer attaches when rank 0's ``TPHello`` arrives (also after its own load), so nobody
    meets a collective's timeout while another rank is still loading, and a restarted group never
    attaches to a dead predecessor's objects. ``connect`` ends with one all-reduce as a barrier.
    """

    def __init__(self, instance_id: str, dp_rank: int, tp_rank: int, tp_size: int, batch_addr: str,
                 capacity: int, context, stop_event) -> None:
        import zmq

        if tp_size < 2:
            raise TensorParallelError(f"a TP group needs at least 2 ranks, got {tp_size}")
        self.instance_id, self.dp_rank, self.tp_rank, self.tp_size = instance_id, dp_rank, tp_rank, tp_size
        self.capacity = capacity
        self._stop_event = stop_event
        self._group = None  # rank 0: the ShmAllReduceGroup it created
        self._handle = None  # every rank: its ShmAllReduce
        if tp_rank == 0:
            self._peers = []
            for rank in range(1, tp_size):
                sock = context.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.bind(tp_fan_out_address(batch_addr, rank))
                self._peers.append(sock)
            self._inbox = None
        else:
            self._peers = []
            self._inbox = context.socket(zmq.PULL)
            self._inbox.setsockopt(zmq.LINGER, 0)
            self._inbox.connect(tp_fan_out_address(batch_addr, tp_rank))

    @property
    def connected(self) -> bool:
        return self._handle is not None

    def connect(self) -> None:
        """The start-up rendezvous (see the class docstring); raises ``TPCommunicationError`` on timeout."""
        from inter_communicator.allreduce import ShmAllReduce, ShmAllReduceGroup, unlink_group_objects

        deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S
        if self.tp_rank == 0:
            stale = unlink_group_objects(self.instance_id, self.tp_size, self.dp_rank)
            if stale:
                logger.info("removed a dead TP group's all-reduce objects: %s", ", ".join(stale))
            self._group = ShmAllReduceGroup(self.instance_id, self.tp_size, self.capacity, self.dp_rank)
            for sock in self._peers:
                self._send_until(sock, TPHello(self.capacity), deadline)
        else:
            hello = self._receive_until(deadline)
            if not isinstance(hello, TPHello):
                raise TPCommunicationError(f"TP rank {self.tp_rank} expected rank 0's hello, got {hello!r}")
        self._handle = ShmAllReduce(self.instance_id, self.tp_rank, self.tp_size, self.capacity, self.dp_rank)
        total = self.all_reduce_numpy(np.ones(1, dtype=np.float32))
        if int(total[0]) != self.tp_size:
            raise TPCommunicationError(f"TP barrier summed {total[0]} ranks, expected {self.tp_size}")
        logger.info("TP group ready: rank %d of %d (shared-memory all-reduce, %d floats per call)",
                    self.tp_rank, self.tp_size, self.capacity)

    def _send_until(self, sock, message: object, deadline: float) -> None:
        import zmq

        while True:
            if self._stop_event.is_set():
                raise InterruptedError("stopped during the TP rendezvous")
            if sock.poll(_RENDEZVOUS_POLL_MS, zmq.POLLOUT):
                sock.send_pyobj(message)
                return
            if time.monotonic() > deadline:
                raise TPCommunicationError(f"a TP peer did not connect within {RENDEZVOUS_TIMEOUT_S:.0f} s")

    def _receive_until(self, deadline: float) -> object:
        while True:
            if self._stop_event.is_set():
                raise InterruptedError("stopped during the TP rendezvous")
            message = self.receive(_RENDEZVOUS_POLL_MS)
            if message is not None:
                return message
            if time.monotonic() > deadline:
                raise TPCommunicationError(f"TP rank {self.tp_rank}: no hello from rank 0 within "
                                           f"{RENDEZVOUS_TIMEOUT_S:.0f} s")

    def fan_out(self, message: object, timeout_ms: int = FAN_OUT_TIMEOUT_MS) -> None:
        """Rank 0: hand ``message`` to every peer (pickled once); a peer that takes nothing within
        ``timeout_ms`` (gone: ZMQ has no pipe to queue into) raises ``TPCommunicationError``."""
        import pickle

        import zmq

        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, sock in enumerate(self._peers, start=1):
            if not sock.poll(timeout_ms, zmq.POLLOUT):
                raise TPCommunicationError(f"TP rank {rank} took no message for {timeout_ms} ms (dead or stuck)")
            try:
                sock.send(payload, zmq.NOBLOCK)
            except zmq.Again as exc:
                raise TPCommunicationError(f"TP rank {rank} refused a message (dead or stuck)") from exc

    def receive(self, timeout_ms: int) -> object | None:
        """A peer: the next message from rank 0, or None after ``timeout_ms``."""
        if self._inbox.poll(timeout_ms):
            return self._inbox.recv_pyobj()
        return None

    def all_reduce_numpy(self, array: np.ndarray) -> np.ndarray:
        if self._handle is None:
            raise TPCommunicationError("the TP group is not connected yet (all-reduce before the rendezvous)")
        from inter_communicator.allreduce import AllReduceError

        try:
            return self._handle.all_reduce(array)
        except AllReduceError as exc:
            raise TPCommunicationError(str(exc)) from exc

    def all_reduce(self, tensor: paddle.Tensor) -> paddle.Tensor:
        """The model's hook: every rank's ``tensor`` summed (rank order, the same bits on every rank)."""
        return paddle.to_tensor(self.all_reduce_numpy(tensor.numpy()))

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        if self._group is not None:
            self._group.close()
            self._group = None
        for sock in self._peers:
            sock.close(linger=0)
        self._peers = []
        if self._inbox is not None:
            self._inbox.close(linger=0)
            self._inbox = None
