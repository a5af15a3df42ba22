"""Shared-memory all-reduce (float32 sum) among the tensor-parallel ranks of one node.

This module owns the objects of one TP group's all-reduce and the protocol over them:

- ``fd.<I>.tp_ar_data.<dp>`` -- float32 ``[2, N, capacity]``: two buffers (by call parity), one
  slot per rank. A rank writes its input into its slot of buffer ``gen % 2``.
- ``fd.<I>.tp_ar_head.<dp>`` -- int64 ``[2, N, 2]``: per slot the generation it holds and its
  element count, plus ``[N]`` pids in a third segment ``fd.<I>.tp_ar_pids.<dp>``.
- ``fd.<I>.tp_ar_s<src>_<dst>.<dp>`` -- one POSIX semaphore per ordered pair of ranks (initial 0):
  ``src`` posts it once per call when its slot is written; ``dst`` waits on it once per call.

Why one semaphore per pair and not per rank: with a single semaphore per receiver a fast rank
could post its next call's arrival before a slow rank had posted this call's, and the receiver
would count the wrong post. Per pair, a post is always matched with the same sender's next wait.

Why two buffers and one barrier per call: a rank can only enter call ``g + 2`` (and overwrite
buffer ``g % 2``) after every rank arrived at call ``g + 1``, i.e. after every rank finished
reading call ``g``. ``sem_post``/``sem_wait`` are full memory barriers, so the slot data written
before a post is visible after the matching wait.

Determinism: every rank sums the slots in rank order (rank 0 + rank 1 + ...) with the same numpy
float32 adds, so all ranks get bit-identical results. Inputs larger than ``capacity`` are reduced
in ``capacity``-sized pieces, each a call of its own.

Failure: each wait is bounded (``timeout_s``) and wakes every ``_LIVENESS_PERIOD_S`` to check the
awaited peer's pid; a dead peer or an expired wait raises ``AllReduceError`` naming the rank, and
the handle is then broken (every later call is refused: the group must be restarted as one).
Generations and sizes are checked after each wait, so mixed calls raise instead of summing junk.

The multi-node fallback is gloo through paddle (``GlooAllReduce``), set up like the EP group.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable

import numpy as np
import posix_ipc

from inter_communicator.process_utils import process_alive
from inter_communicator.shm import SharedArray, ipc_name, register_created_semaphore, unlink_segment

logger = logging.getLogger(__name__)

# A blocked wait wakes this often to see whether the peer it waits for is still alive.
_LIVENESS_PERIOD_S = 0.5
DEFAULT_TIMEOUT_S = 30.0
_BUFFERS = 2


class AllReduceError(RuntimeError):
    """A peer died, timed out, or called with a different generation or size."""


def _data_name(instance_id: str, dp_rank: int) -> str:
    return ipc_name(instance_id, "tp_ar_data", dp_rank)


def _head_name(instance_id: str, dp_rank: int) -> str:
    return ipc_name(instance_id, "tp_ar_head", dp_rank)


def _pids_name(instance_id: str, dp_rank: int) -> str:
    return ipc_name(instance_id, "tp_ar_pids", dp_rank)


def _sem_name(instance_id: str, dp_rank: int, src: int, dst: int) -> str:
    return "/" + ipc_name(instance_id, f"tp_ar_s{src}_{dst}", dp_rank)


class ShmAllReduceGroup:
    """Creates (and on ``close`` unlinks) the shared objects of one TP group's all-reduce.

    Held by the process that spawns the TP workers (or by TP rank 0); the ranks attach with
    ``ShmAllReduce``. Names live under the instance prefix, so ``sweep_stale`` removes them.
    """

    def __init__(self, instance_id: str, world_size: int, capacity: int, dp_rank: int = 0) -> None:
        if world_size < 2:
            raise ValueError(f"an all-reduce group needs world_size >= 2, got {world_size}")
        if capacity <= 0:
            raise ValueError(f"all-reduce capacity must be positive, got {capacity}")
        self.instance_id, self.world_size, self.capacity, self.dp_rank = instance_id, world_size, capacity, dp_rank
        self._arrays: list[SharedArray] = []
        self._sems: list[posix_ipc.Semaphore] = []
        try:
            self._arrays.append(SharedArray(_data_name(instance_id, dp_rank), (_BUFFERS, world_size, capacity),
                                            np.float32, create=True))
            self._arrays.append(SharedArray(_head_name(instance_id, dp_rank), (_BUFFERS, world_size, 2),
                                            np.int64, create=True))
            self._arrays.append(SharedArray(_pids_name(instance_id, dp_rank), (world_size,), np.int64, create=True))
            for src in range(world_size):
                for dst in range(world_size):
                    if src == dst:
                        continue
                    name = _sem_name(instance_id, dp_rank, src, dst)
                    sem = posix_ipc.Semaphore(name, flags=posix_ipc.O_CREX, mode=0o600, initial_value=0)
                    register_created_semaphore(name)
                    self._sems.append(sem)
        except BaseException:
            self.close()
            raise
        # Generation -1 everywhere: no slot holds a call yet.
        self._arrays[1].array[...] = -1

    def close(self) -> None:
        """Unlink every object (ranks' existing mappings stay valid until they close)."""
        for sem in self._sems:
            try:
                sem.unlink()
            except posix_ipc.ExistentialError:
                logger.debug("all-reduce semaphore %s already unlinked", sem.name)
            sem.close()
        self._sems = []
        for array in self._arrays:
            array.close()
            array.unlink()
        self._arrays = []

    def __enter__(self) -> "ShmAllReduceGroup":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def unlink_group_objects(instance_id: str, world_size: int, dp_rank: int = 0) -> list[str]:
    """Unlink a group's segments and semaphores left by a killed creator; returns the names removed.

    The creator of a new group calls it first: whatever exists under these names belongs to a dead
    predecessor (its ranks were all reaped before the group was restarted).
    """
    removed = []
    for name in (_data_name(instance_id, dp_rank), _head_name(instance_id, dp_rank), _pids_name(instance_id, dp_rank)):
        if unlink_segment(name):
            removed.append(name)
    for src in range(world_size):
        for dst in range(world_size):
            if src == dst:
                continue
            name = _sem_name(instance_id, dp_rank, src, dst)
            try:
                posix_ipc.unlink_semaphore(name)
                removed.append(name)
            except posix_ipc.ExistentialError:
                continue  # absent: nothing stale under this name
    return removed


class ShmAllReduce:
    """One TP rank's handle: ``all_reduce(x)`` returns the float32 sum of every rank's ``x``.

    Every rank must call with the same shape in the same order (the lockstep of TP workers).
    Attaching waits up to ``timeout_s`` for the group's creator.
    """

    def __init__(self, instance_id: str, rank: int, world_size: int, capacity: int, dp_rank: int = 0,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """``timeout_s`` bounds the attach (creator not there yet) and every later wait for a peer."""
        if not 0 <= rank < world_size or world_size < 2:
            raise ValueError(f"rank must be in 0..world_size-1 with world_size >= 2, got {rank} of {world_size}")
        self.rank, self.world_size, self.capacity, self.timeout_s = rank, world_size, capacity, timeout_s
        self.generation = 0
        self._broken: str | None = None
        self._arrays: list[SharedArray] = []
        self._send: list[posix_ipc.Semaphore] = []
        self._recv: dict[int, posix_ipc.Semaphore] = {}
        try:
            self._attach(instance_id, dp_rank)
        except BaseException:
            self.close()
            raise
        self._data, self._head, self._pids = (array.array for array in self._arrays)
        self._pids[rank] = os.getpid()

    def _attach(self, instance_id: str, dp_rank: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        shapes = [(_data_name, (_BUFFERS, self.world_size, self.capacity), np.float32),
                  (_head_name, (_BUFFERS, self.world_size, 2), np.int64),
                  (_pids_name, (self.world_size,), np.int64)]
        for name_of, shape, dtype in shapes:
            while True:
                try:
                    self._arrays.append(SharedArray(name_of(instance_id, dp_rank), shape, dtype, create=False))
                    break
                except FileNotFoundError:
                    if time.monotonic() > deadline:
                        raise
                    # Creator not there yet (start-up race only); a short sleep, not a spin.
                    time.sleep(0.05)
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            self._send.append(posix_ipc.Semaphore(_sem_name(instance_id, dp_rank, self.rank, peer)))
            self._recv[peer] = posix_ipc.Semaphore(_sem_name(instance_id, dp_rank, peer, self.rank))

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        """A new float32 array shaped like ``x``: the sum over ranks, added in rank order."""
        flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        out = np.empty_like(flat)
        for start in range(0, max(flat.size, 1), self.capacity):
            piece = flat[start:start + self.capacity]
            self._reduce_piece(piece, out[start:start + piece.size])
        return out.reshape(np.shape(x))

    def _reduce_piece(self, piece: np.ndarray, out: np.ndarray) -> None:
        """Sum every rank's ``piece`` into ``out`` (same size)."""
        if self._broken is not None:
            raise AllReduceError(f"TP rank {self.rank}: all-reduce group is broken ({self._broken}); "
                                 "the TP group must be restarted")
        gen, count = self.generation, piece.size
        buffer = gen % _BUFFERS
        self._data[buffer, self.rank, :count] = piece
        self._head[buffer, self.rank] = (gen, count)
        for sem in self._send:
            sem.release()
        for peer, sem in self._recv.items():
            self._wait(peer, sem, gen)
            peer_gen, peer_count = (int(v) for v in self._head[buffer, peer])
            if peer_gen != gen or peer_count != count:
                self._fail(f"rank {peer} is at call {peer_gen} with {peer_count} floats, "
                           f"this rank at call {gen} with {count} (calls out of lockstep)")
        slots = self._data[buffer, :, :count]
        np.copyto(out, slots[0])
        for rank in range(1, self.world_size):
            out += slots[rank]
        self.generation = gen + 1

    def _wait(self, peer: int, sem: posix_ipc.Semaphore, gen: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._fail(f"rank {peer} did not arrive at call {gen} within {self.timeout_s:.1f} s")
            try:
                sem.acquire(min(remaining, _LIVENESS_PERIOD_S))
                return
            except posix_ipc.BusyError:
                pid = int(self._pids[peer])
                if pid > 0 and not process_alive(pid, None):
                    self._fail(f"rank {peer} (pid {pid}) died before arriving at call {gen}")

    def _fail(self, why: str) -> None:
        self._broken = why
        raise AllReduceError(f"TP rank {self.rank}: {why}")

    def close(self) -> None:
        """Detach (the group's creator unlinks)."""
        for sem in [*self._send, *self._recv.values()]:
            sem.close()
        self._send, self._recv = [], {}
        for array in self._arrays:
            array.close()
        self._arrays = []

    def __enter__(self) -> "ShmAllReduce":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class GlooAllReduce:
    """The multi-node fallback: float32 sum over a paddle gloo process group (TCP store rendezvous).

    Rank 0 hosts the store at ``master_addr:master_port``. Summation order is gloo's, so results
    are equal across ranks but may differ from the rank-order sum in the last bits.
    """

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int,
                 timeout_s: int = 60) -> None:
        from paddle.base import core

        self.rank, self.world_size = rank, world_size
        # Paddle's ProcessGroup reads the global rank from these (as in worker/expert_parallel.py).
        os.environ["PADDLE_TRAINER_ID"] = str(rank)
        os.environ["PADDLE_TRAINERS_NUM"] = str(world_size)
        self._store = core.TCPStore(master_addr, master_port, rank == 0, world_size, timeout_s)
        self._pg = core.ProcessGroupGloo.create(self._store, rank, world_size, 0)

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        import paddle
        from paddle.base import core

        tensor = paddle.to_tensor(np.ascontiguousarray(x, dtype=np.float32))
        self._pg.all_reduce(tensor, core.ReduceOp.SUM, True).wait()
        return tensor.numpy()

    def close(self) -> None:
        self._pg = None
        self._store = None


AllReduceFn = Callable[[np.ndarray], np.ndarray]
