"""The cache transfer process: moves KV blocks between the device pool, the host pool and storage.

One process per DP rank, spawned by the engine (``run_cache_transfer``); with tensor parallelism it maps
every TP rank's device segment and moves all shards of a block as one unit (one task, one lock hold, one
``TransferDone``; a block is stored or loaded only if every shard is). It owns:
- the host KV pool segments, one per TP rank's shard (created here, unlinked on every exit path);
- the storage backend client (``--kvcache-storage-backend``) and its reusable staging buffers;
- the execution of ``TransferTask`` messages (swap_out, swap_in, write_back, prefetch, and P/D's
  remote_read: another instance's blocks read into ours with the Mooncake transfer engine,
  cache_manager/pd_transfer.py) and ``ClearStorage``, answered with ``TransferStarted`` /
  ``TransferDone`` over ZMQ;
- its readiness flag and heartbeat in ``InstanceSignals``.

The device pool belongs to the worker; this process only maps it. Every copy that touches it runs
under the KV-cache lock (when enabled); storage I/O does not, except the reads of a prefetch's
chunks after its first (one hold covers a whole fill, see ``_prefetch``); a remote_read's network
reads are staged the same way (``_remote_read``). Correctness rests on
block states (the engine never lets execute_model touch a block in transfer); with
FD_KVCACHE_SANITIZER=1 this process checks them before touching a device block.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Iterator, Sequence

import numpy as np
import zmq

import envs
from cache_manager.block_copy import (
    check_block_ids,
    device_to_host,
    device_to_staging,
    host_to_device,
    staging_to_device,
)
from cache_manager.block_state import TRANSFER_REQUIRED_STATE, BlockState, KVCacheSanitizerError
from cache_manager.kv_layout import (
    block_shape,
    device_cache_segment,
    device_cache_shape,
    host_cache_segment,
    host_cache_shape,
    shard_storage_keys,
)
from cache_manager.pd_transfer import PD_EXPIRY_MARGIN_S, KVTransferEngine, PDTransferError, block_segments
from cache_manager.transfer_factory.base import KVStorageBackend
from cache_manager.transfer_factory.factory import create_storage_backend
from config.engine_config import EngineConfig
from config.log import setup_logging
from inter_communicator.instance_signals import InstanceSignals
from inter_communicator.kvcache_lock import KVCacheLock, NullKVCacheLock, kvcache_lock_for
from inter_communicator.messages import (
    TRANSFER_KINDS,
    ClearStorage,
    TransferDone,
    TransferStarted,
    TransferTask,
    WorkerShutdown,
)
from inter_communicator.process_utils import ProcessEntry
from inter_communicator.shm import SharedArray

logger = logging.getLogger(__name__)

POLL_MS = 500
HEARTBEAT_INTERVAL_S = 0.5
# Blocks staged per storage round trip. Staging memory is allocated once (np.empty: pages are only
# touched when used); larger tasks run in chunks of this many blocks. 16 SmolLM2 blocks of 64
# tokens are 47 MB.
STAGING_BLOCKS = 16
# P/D: blocks one remote_read stages per network round (device layout, registered with the transfer engine).
PD_STAGING_BLOCKS = 16
# Give the engine time to receive the last TransferDone before the socket is dropped at exit.
DONE_LINGER_MS = 500
# Seconds between a stop request (signal, dead parent) and a forced exit if clean-up blocks.
SHUTDOWN_GRACE_S = 15.0


class TransferTaskError(ValueError):
    """A task that cannot run as described (wrong kind, mismatched id lists, missing tier)."""


class _Heartbeat(threading.Thread):
    """Stamps ``cache_transfer_heartbeat[tp_rank]`` every HEARTBEAT_INTERVAL_S while the serve loop is idle.

    While a task runs (``busy``) the stamp stays at the time the task started, so the engine sees
    "no progress since" and kills the process once one task (or a stopped process) exceeds
    FD_CACHE_TRANSFER_TIMEOUT. A thread stamps while idle because the serve loop sleeps in poll.
    """

    def __init__(self, heartbeat: np.ndarray, tp_rank: int) -> None:
        super().__init__(name="cache-transfer-heartbeat", daemon=True)
        self._heartbeat = heartbeat
        self._tp_rank = tp_rank
        self._stopped = threading.Event()
        self._busy = False

    def run(self) -> None:
        while True:
            if not self._busy:
                self._heartbeat[self._tp_rank] = time.time()
            if self._stopped.wait(HEARTBEAT_INTERVAL_S):
                return

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Freeze the stamp at "now" for the duration of one task."""
        self._heartbeat[self._tp_rank] = time.time()
        self._busy = True
        try:
            yield
        finally:
            self._busy = False
            self._heartbeat[self._tp_rank] = time.time()

    def stop(self) -> None:
        self._stopped.set()
        self.join(timeout=5.0)


def _block_count(task: TransferTask) -> int:
    """Number of per-block results a task answers with (also for malformed tasks)."""
    return max(len(task.device_block_ids), len(task.host_block_ids), len(task.storage_keys))


def _state_name(value: int) -> str:
    try:
        return BlockState(value).name
    except ValueError:
        return f"unknown({value})"


class CacheTransferManager:
    """Executes the transfer tasks of one DP rank (all TP shards); ``serve`` runs until ``stop_event`` is set.

    ``tp_rank`` is only this process's slot in the per-rank signals (the engine starts one, slot 0).
    """

    def __init__(self, config: EngineConfig, tp_rank: int, task_addr: str, done_addr: str,
                 stop_event: threading.Event | None = None) -> None:
        self.config = config
        self.tp_rank = tp_rank
        self.tp_size = config.parallel.tensor_parallel_size
        self.stop_event = stop_event or threading.Event()
        self.sanitizer = bool(envs.FD_KVCACHE_SANITIZER)  # read once: a process-wide mode, fixed at start
        self.fault_slow_fill_s = envs.FD_KVCACHE_FAULT_SLOW_FILL_S
        self.signals: InstanceSignals | None = None
        self.device_segments: list[SharedArray] = []  # per TP rank
        self.host_segments: list[SharedArray] = []  # per TP rank
        self.backend: KVStorageBackend | None = None
        self.lock: KVCacheLock | NullKVCacheLock | None = None
        self.stagings: list[np.ndarray] = []  # per TP rank
        self.zmq_context: zmq.Context | None = None
        self.task_socket: zmq.Socket | None = None
        self.done_socket: zmq.Socket | None = None
        self._heartbeat: _Heartbeat | None = None
        self.pd_engine: KVTransferEngine | None = None  # started by the first remote_read (P/D decode side)
        self.pd_staging: np.ndarray | None = None  # registered with pd_engine: where remote blocks land first
        try:
            self._open(task_addr, done_addr)
        except BaseException:
            # A half-built manager must still drop the host segment and sockets it made.
            self.close()
            raise

    # ---- set-up / tear-down ----------------------------------------------------------------

    def _open(self, task_addr: str, done_addr: str) -> None:
        config, model, tp = self.config, self.config.model, self.tp_size
        dp_rank, block_size = config.parallel.dp_rank, config.cache.block_size
        self.signals = InstanceSignals(config, create=False)
        for rank in range(tp):
            self.device_segments.append(SharedArray(
                device_cache_segment(config.instance_id, dp_rank, rank),
                device_cache_shape(model, config.cache.num_gpu_blocks, block_size, tp), np.float32, create=False))
        if config.cache.num_cpu_blocks > 0:
            for rank in range(tp):
                self.host_segments.append(SharedArray(
                    host_cache_segment(config.instance_id, dp_rank, rank),
                    host_cache_shape(model, config.cache.num_cpu_blocks, block_size, tp), np.float32, create=True))
        if config.cache.storage is not None:
            self.backend = create_storage_backend(config.cache.storage)
            staging_blocks = min(STAGING_BLOCKS, config.cache.num_gpu_blocks)
            self.stagings = [np.empty((staging_blocks, *block_shape(model, block_size, tp)), dtype=np.float32)
                             for _ in range(tp)]
        self.lock = kvcache_lock_for(config.instance_id, config.parallel.dp_rank, role="cache_transfer")
        self.zmq_context = zmq.Context()
        self.task_socket = self.zmq_context.socket(zmq.PULL)
        self.task_socket.connect(task_addr)
        self.done_socket = self.zmq_context.socket(zmq.PUSH)
        self.done_socket.setsockopt(zmq.LINGER, DONE_LINGER_MS)
        self.done_socket.connect(done_addr)
        logger.info("cache transfer ready: device pool %d blocks x %d TP shard(s), host pool %d blocks%s, storage %s, "
                    "lock %s, sanitizer %s", config.cache.num_gpu_blocks, tp, config.cache.num_cpu_blocks,
                    f" ({', '.join(h.name for h in self.host_segments)})" if self.host_segments else "",
                    config.cache.storage.backend if config.cache.storage else "none",
                    "on" if self.lock.enabled else "off",
                    "on" if self.sanitizer else "off")

    @property
    def devices(self) -> list[np.ndarray]:
        """Every TP rank's device pool, rank order."""
        return [segment.array for segment in self.device_segments]

    def close(self) -> None:
        """Release everything; safe on a partly opened manager and on repeated calls."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        if self.pd_engine is not None:
            self.pd_engine.close()  # unregister before the staging pool is dropped
            self.pd_engine = None
            self.pd_staging = None
        if self.signals is not None:
            self.signals.cache_transfer_ready.value[self.tp_rank] = 0
            self.signals.close()
            self.signals = None
        for sock in (self.task_socket, self.done_socket):
            if sock is not None:
                sock.close()
        self.task_socket = self.done_socket = None
        if self.zmq_context is not None:
            self.zmq_context.term()
            self.zmq_context = None
        if self.lock is not None:
            self.lock.close()
            self.lock = None
        if self.backend is not None:
            try:
                self.backend.close()
            except Exception:  # shutting down anyway: report, then keep releasing the rest
                logger.exception("closing the storage backend failed")
            self.backend = None
        for segment in self.host_segments:
            segment.close()
            segment.unlink()
        self.host_segments = []
        for segment in self.device_segments:
            segment.close()
        self.device_segments = []
        self.stagings = []

    # ---- serving ---------------------------------------------------------------------------

    def serve(self) -> None:
        self._heartbeat = _Heartbeat(self.signals.cache_transfer_heartbeat.value, self.tp_rank)
        self._heartbeat.start()
        self.signals.cache_transfer_ready.value[self.tp_rank] = 1
        poller = zmq.Poller()
        poller.register(self.task_socket, zmq.POLLIN)
        while not self.stop_event.is_set():
            if not poller.poll(POLL_MS):
                continue
            try:
                message = self.task_socket.recv_pyobj()
            except Exception:  # a message this process cannot even unpickle: drop it, keep serving
                logger.exception("undecodable message on the task socket dropped")
                continue
            if isinstance(message, WorkerShutdown):
                logger.info("shutdown requested by the engine: %s", message.reason)
                break
            with self._heartbeat.busy():
                self.handle(message)

    def handle(self, message: object) -> None:
        """Execute one message from the engine (anything but WorkerShutdown)."""
        if isinstance(message, TransferTask):
            self.done_socket.send_pyobj(self.run_task(message))
        elif isinstance(message, ClearStorage):
            self._clear_storage()
        else:
            logger.error("unknown message type %s ignored: %r", type(message).__name__, message)

    def _clear_storage(self) -> None:
        if self.backend is None:
            logger.error("ClearStorage ignored: no storage backend is configured")
            return
        try:
            self.backend.clear()
        except Exception:  # an admin request must not take the process down
            logger.exception("clearing the storage backend failed")
            return
        logger.info("storage cleared")

    def run_task(self, task: TransferTask) -> TransferDone:
        """Run one task; never raises: failures become ok all False plus ``error``."""
        started = time.perf_counter()
        try:
            ok = self._run(task)
            error = None
        except KVCacheSanitizerError as exc:
            logger.error("%s", exc)
            ok, error = [False] * _block_count(task), str(exc)
        except Exception as exc:  # one bad task fails its blocks, the process keeps serving
            logger.exception("transfer task %s (%s) failed", task.task_id, task.kind)
            ok, error = [False] * _block_count(task), f"{type(exc).__name__}: {exc}"
        seconds = time.perf_counter() - started
        logger.debug("task %s %s: %d/%d blocks in %.1f ms", task.task_id, task.kind, sum(ok), len(ok),
                     seconds * 1e3)
        return TransferDone(task_id=task.task_id, kind=task.kind, ok=ok, seconds=seconds, error=error)

    def _run(self, task: TransferTask) -> list[bool]:
        if task.kind == "swap_out":
            return self._swap_out(task)
        if task.kind == "swap_in":
            return self._swap_in(task)
        if task.kind == "write_back":
            return self._write_back(task)
        if task.kind == "prefetch":
            return self._prefetch(task)
        if task.kind == "remote_read":
            return self._remote_read(task)
        raise TransferTaskError(f"unknown transfer kind {task.kind!r} (expected one of {TRANSFER_KINDS})")

    # ---- the four kinds ----------------------------------------------------------------------

    def _swap_out(self, task: TransferTask) -> list[bool]:
        host = self._host_pool(task)
        device_ids = self._device_ids(task)
        _require_pairs(task, len(task.host_block_ids), "host_block_ids")
        with self.lock.hold("swap_out"):
            self._check_states(task, device_ids)
            for device, host_shard in zip(self.devices, host):
                device_to_host(device, host_shard, device_ids, task.host_block_ids)
        return [True] * len(device_ids)

    def _swap_in(self, task: TransferTask) -> list[bool]:
        host = self._host_pool(task)
        device_ids = self._device_ids(task)
        _require_pairs(task, len(task.host_block_ids), "host_block_ids")
        check_block_ids(task.host_block_ids, host[0].shape[0], "host")
        self._check_states(task, device_ids)
        with self.lock.hold("swap_in"):
            self._send_started(task)
            self._fault_slow_fill()
            self._check_states(task, device_ids)
            for device, host_shard in zip(self.devices, host):
                host_to_device(host_shard, device, task.host_block_ids, device_ids)
        return [True] * len(device_ids)

    def _write_back(self, task: TransferTask) -> list[bool]:
        backend = self._storage(task)
        if not task.device_block_ids:
            return self._write_back_from_host(task, backend)
        device_ids = self._device_ids(task)
        _require_pairs(task, len(task.storage_keys), "storage_keys")
        self._check_states(task, device_ids)
        ok: list[bool] = []
        for chunk in self._chunks(len(device_ids)):
            chunk_ids = device_ids[chunk]
            with self.lock.hold("write_back"):
                self._check_states(task, chunk_ids)
                for device, staging in zip(self.devices, self.stagings):
                    device_to_staging(device, staging, chunk_ids)
            rows = range(len(chunk_ids))
            ok.extend(self._put_shards(backend, task.storage_keys[chunk],
                                       [[staging[row] for row in rows] for staging in self.stagings]))
        return ok

    def _put_shards(self, backend: KVStorageBackend, rank0_keys: Sequence[str],
                    buffers: list[list[np.ndarray]]) -> list[bool]:
        """One batch_put of every TP shard of each block (``buffers[rank][i]``); a block is stored if all are."""
        keys = self._shard_keys(rank0_keys)
        flat = [buffer for shard in buffers for buffer in shard]
        return self._all_shards(_results(backend.batch_put(keys, flat), len(keys), "batch_put"), len(rank0_keys))

    def _shard_keys(self, rank0_keys: Sequence[str]) -> list[str]:
        """Every rank's key, rank-major: rank 0's keys of all blocks, then rank 1's, ..."""
        if self.tp_size == 1:
            return list(rank0_keys)
        per_block = [shard_storage_keys(key, self.tp_size) for key in rank0_keys]
        return [keys[rank] for rank in range(self.tp_size) for keys in per_block]

    def _all_shards(self, results: list[bool], count: int) -> list[bool]:
        """Per block: True only if every rank's shard (rank-major ``results``) succeeded."""
        return [all(results[rank * count + i] for rank in range(self.tp_size)) for i in range(count)]

    def _write_back_from_host(self, task: TransferTask, backend: KVStorageBackend) -> list[bool]:
        """Host blocks are contiguous storage objects already and only this process writes them:
        hand them to the backend directly, with no staging copy and no lock (the device is not touched)."""
        host = self._host_pool(task)
        if len(task.host_block_ids) != len(task.storage_keys):
            raise TransferTaskError(f"write_back task {task.task_id}: {len(task.host_block_ids)} host blocks "
                                    f"but {len(task.storage_keys)} storage keys")
        host_ids = check_block_ids(task.host_block_ids, host[0].shape[0], "host")
        return self._put_shards(backend, task.storage_keys, [[shard[h] for h in host_ids] for shard in host])

    def _prefetch(self, task: TransferTask) -> list[bool]:
        """Storage -> device in staging-sized chunks, under one lock hold from TransferStarted on.

        TransferStarted says the fill's device writes are under way, and (lock on) that whoever
        takes the lock after it sees them finished: so the lock is taken before it is sent and
        kept until the last chunk is copied. Releasing it between chunks would let execute_model
        in while later chunks are not copied yet. The price: the storage reads of the chunks after
        the first run under the lock (the first one is read before it is taken).
        """
        backend = self._storage(task)
        device_ids = self._device_ids(task)
        _require_pairs(task, len(task.storage_keys), "storage_keys")
        self._check_states(task, device_ids)
        chunks = self._chunks(len(device_ids))
        if not chunks:
            self._send_started(task)
            return []
        ok: list[bool] = []
        got = self._read_chunk(task, backend, chunks[0])
        with self.lock.hold("prefetch"):
            self._send_started(task)
            for index, chunk in enumerate(chunks):
                if index:
                    got = self._read_chunk(task, backend, chunk)
                self._fault_slow_fill()
                chunk_ids = device_ids[chunk]
                self._check_states(task, chunk_ids)
                hit_rows = [row for row, hit in enumerate(got) if hit]
                for device, staging in zip(self.devices, self.stagings):
                    staging_to_device(staging, device, hit_rows, [chunk_ids[row] for row in hit_rows])
                ok.extend(got)
        return ok

    def _read_chunk(self, task: TransferTask, backend: KVStorageBackend, chunk: slice) -> list[bool]:
        """One chunk of a prefetch from storage into the staging rows 0.. of every shard; per-block hits
        (a block whose shards are not all there is a miss: nothing of it is copied)."""
        count = chunk.stop - chunk.start
        keys = self._shard_keys(task.storage_keys[chunk])
        buffers = [staging[row] for staging in self.stagings for row in range(count)]
        return self._all_shards(_results(backend.batch_get(keys, buffers), len(keys), "batch_get"), count)

    def _remote_read(self, task: TransferTask) -> list[bool]:
        """P/D: another instance's blocks -> our LOAD blocks, staged like a prefetch's storage reads.

        The network read lands in a registered staging pool (device layout, ``PD_STAGING_BLOCKS``
        blocks), outside the lock: a slow or hung peer (the transfer engine gives up after 30 s
        without progress) then stalls only this process, never execute_model. The copy into the
        device pool runs under the lock, which, as in ``_prefetch``, is taken before TransferStarted
        and kept until the last chunk is copied, so the reads of chunks after the first run under it.
        The peer pinned its blocks until we release them (the engine does once this task reported),
        so they do not change while we read. A failed chunk fails it and every later block: the
        sequence recomputes from there.
        """
        remote = task.remote
        if remote is None:
            raise TransferTaskError(f"remote_read task {task.task_id} names no remote blocks")
        if len(self.devices) != 1:  # P/D refuses TP > 1 at start-up: the offer describes one unsharded pool
            raise TransferTaskError(f"remote_read task {task.task_id}: P/D needs one KV shard, "
                                    f"this instance has {len(self.devices)}")
        device = self.devices[0]
        device_ids = self._device_ids(task)
        _require_pairs(task, len(remote.block_ids), "remote block ids")
        self._check_states(task, device_ids)
        count = len(device_ids)
        try:
            engine, staging = self._pd_transfer_engine()
        except PDTransferError as exc:
            logger.error("remote_read task %s: %s", task.task_id, exc)
            return [False] * count
        rows = staging.shape[2]
        chunks = [slice(start, min(start + rows, count)) for start in range(0, count, rows)]
        if not chunks or not self._read_remote_chunk(task, engine, staging, chunks[0]):
            return [False] * count
        ok: list[bool] = []
        with self.lock.hold("remote_read"):
            self._send_started(task)
            for index, chunk in enumerate(chunks):
                if index and not self._read_remote_chunk(task, engine, staging, chunk):
                    break
                self._fault_slow_fill()
                chunk_ids = device_ids[chunk]
                self._check_states(task, chunk_ids)
                device[:, :, chunk_ids] = staging[:, :, :len(chunk_ids)]
                ok.extend([True] * len(chunk_ids))
        return ok + [False] * (count - len(ok))

    def _read_remote_chunk(self, task: TransferTask, engine: KVTransferEngine, staging: np.ndarray,
                           chunk: slice) -> bool:
        """The peer's blocks ``remote.block_ids[chunk]`` into staging rows 0..; False (logged) on failure."""
        remote = task.remote
        remaining = remote.expires_at - time.time()
        if remaining < PD_EXPIRY_MARGIN_S:
            logger.error("remote_read task %s: the hold on %s ends in %.1f s; blocks %d-%d not read (recomputed)",
                         task.task_id, remote.session, remaining, chunk.start, chunk.stop - 1)
            return False
        peer_ids = remote.block_ids[chunk]
        pieces = block_segments(self.config.model.num_hidden_layers * 2, staging[0, 0, 0].nbytes,
                                int(staging.ctypes.data), staging.shape[2], remote.kv_addr, remote.num_blocks,
                                list(zip(range(len(peer_ids)), peer_ids)))
        try:
            engine.read(remote.session, *pieces)
        except PDTransferError as exc:
            logger.error("remote_read task %s (blocks %d-%d of %d from %s) failed: %s", task.task_id, chunk.start,
                         chunk.stop - 1, len(remote.block_ids), remote.session, exc)
            return False
        return True

    def _pd_transfer_engine(self) -> tuple[KVTransferEngine, np.ndarray]:
        """The transfer engine and its registered staging pool, made on first use (P/D decode instances only)."""
        if self.pd_engine is None:
            model, block_size = self.config.model, self.config.cache.block_size
            rows = min(PD_STAGING_BLOCKS, self.config.cache.num_gpu_blocks)
            staging = np.empty(device_cache_shape(model, rows, block_size), dtype=np.float32)
            engine = KVTransferEngine(self.config.pd.host)
            try:
                engine.register(staging)
            except PDTransferError:
                engine.close()
                raise
            self.pd_engine, self.pd_staging = engine, staging
            logger.info("P/D transfer engine up at %s (%d staging blocks registered)", engine.session, rows)
        return self.pd_engine, self.pd_staging

    # ---- helpers -----------------------------------------------------------------------------

    def _send_started(self, task: TransferTask) -> None:
        self.done_socket.send_pyobj(TransferStarted(task_id=task.task_id))

    def _fault_slow_fill(self) -> None:
        """Test-only (FD_KVCACHE_FAULT_SLOW_FILL_S): sleep before every device copy of a fill.

        Before each chunk, not only the first, so with the early-schedule fault execute_model
        races every chunk of a long prefetch (the lock must close all of them, the sanitizer must
        see it whichever chunk it hits).
        """
        if self.fault_slow_fill_s > 0:
            time.sleep(self.fault_slow_fill_s)

    def _chunks(self, count: int) -> list[slice]:
        size = self.stagings[0].shape[0]
        return [slice(start, min(start + size, count)) for start in range(0, count, size)]

    def _device_ids(self, task: TransferTask) -> list[int]:
        return check_block_ids(task.device_block_ids, self.config.cache.num_gpu_blocks, "device", unique=True)

    def _host_pool(self, task: TransferTask) -> list[np.ndarray]:
        """Every TP rank's host pool, rank order."""
        if not self.host_segments:
            raise TransferTaskError(f"{task.kind} task {task.task_id} needs the host pool, but this server "
                                    "runs without one (--swap-space 0)")
        return [segment.array for segment in self.host_segments]

    def _storage(self, task: TransferTask) -> KVStorageBackend:
        if self.backend is None:
            raise TransferTaskError(f"{task.kind} task {task.task_id} needs a storage backend, but none is "
                                    "configured (--kvcache-storage-backend)")
        return self.backend

    def _check_states(self, task: TransferTask, device_ids: Sequence[int]) -> None:
        """Sanitizer: every device block of the task must be in the state its kind requires."""
        if not self.sanitizer:
            return
        required = TRANSFER_REQUIRED_STATE[task.kind]
        states = self.signals.block_states.value
        for block in device_ids:
            state = int(states[block])
            if state != required:
                raise KVCacheSanitizerError(
                    f"KV cache sanitizer: {task.kind} task {task.task_id} refused to touch device block {block}: "
                    f"its state is {_state_name(state)}, {task.kind} requires {required.name}; the block was not copied")


def _require_pairs(task: TransferTask, count: int, field_name: str) -> None:
    if count != len(task.device_block_ids):
        raise TransferTaskError(f"{task.kind} task {task.task_id}: {len(task.device_block_ids)} device blocks but "
                                f"{count} {field_name}")


def _results(values: Sequence[bool], expected: int, call: str) -> list[bool]:
    results = [bool(v) for v in values]
    if len(results) != expected:
        raise TransferTaskError(f"storage backend {call} answered {len(results)} results for {expected} blocks")
    return results


def run_cache_transfer(config: EngineConfig, tp_rank: int, task_addr: str, done_addr: str) -> None:
    """Process entry point (multiprocessing spawn target)."""
    with ProcessEntry("cache_transfer", tp_rank, grace_s=SHUTDOWN_GRACE_S, setup_logging=setup_logging) as entry:
        manager = CacheTransferManager(config, tp_rank, task_addr, done_addr, entry.stop_event)
        entry.cleanup("close the cache transfer manager", manager.close)
        manager.serve()
