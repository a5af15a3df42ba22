"""Engine-side owner of every KV block: device pool, host pool, prefix cache, block states.

The worker and the cache transfer process own the memory; this class owns the
bookkeeping and decides every copy. Correctness rests on block states, not on
the KV-cache lock:

- a block being filled (SWAP_IN from host, LOAD from storage) belongs to one
  sequence that is not scheduled until every fill has completed;
- a block being copied out (SWAP_OUT to host, WRITE_BACK to storage) is never
  handed to another sequence until its copy completed; the worker may still
  read a WRITE_BACK block (a full block, never written again);
- a block whose transfer timed out or whose sequence went away stays
  quarantined until the transfer process reports on it, or until the engine
  restarted that process and called ``fail_all_transfers``. Every task has a
  deadline (``transfer_timeout_s``); ``overdue_transfers`` lists the late ones.

Tiers: device blocks with a hash are a prefix cache (refcounts, LRU eviction of
unreferenced blocks, only full blocks shared). With a host pool, least recently
used cached device blocks are swapped out when free device blocks run low;
with a storage backend, blocks are written through when they become full
(``write_through``) or when they leave the host/device tier (``write_back``).
Every state change is mirrored into a shared-memory array (``state_array``)
that the worker and the transfer process check under the sanitizer.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from cache_manager.block_hash import ROOT_HASH, hash_block
from cache_manager.block_state import BlockState
from cache_manager.kv_layout import storage_key
from cache_manager.cache_sequence import CacheSequence
from config.engine_config import CacheConfig
from inter_communicator.messages import TransferDone, TransferTask

logger = logging.getLogger(__name__)


class BlockAllocationError(RuntimeError):
    pass


@dataclass
class DeviceBlock:
    block_id: int
    ref_count: int = 0
    block_hash: str | None = None
    state: BlockState = BlockState.FREE
    transfer_id: int | None = None  # a copy in flight on this block


@dataclass
class HostBlock:
    host_id: int
    block_hash: str | None = None
    pinned: int = 0  # copies in flight reading or writing it


@dataclass
class LoadPlan:
    """The fills one sequence waits for before it may run."""

    seq: CacheSequence
    block_hashes: list[str]  # hashes of seq.block_table[:len(block_hashes)]
    first_fill: int = 0  # block index of the first filled block (the ones before are device hits)
    fill_sources: dict[int, str] = field(default_factory=dict)  # block index -> "host" | "storage"
    cancelled: bool = False  # the sequence was freed or preempted while its fills ran
    pending_tasks: set[int] = field(default_factory=set)
    failed_from: int | None = None  # first block index whose fill failed
    deadline: float = 0.0
    started_tasks: set[int] = field(default_factory=set)


@dataclass
class PrefixMatch:
    """What admitting a sequence would take from the cache, computed without changing anything."""

    hit_block_ids: list[int] = field(default_factory=list)  # device blocks shared as they are
    hit_hashes: list[str] = field(default_factory=list)
    fills: list[tuple[str, str]] = field(default_factory=list)  # (hash, "host" | "storage"), after the hits
    num_evictable_hits: int = 0  # hits that are unreferenced cached blocks: sharing takes them off the free count
    clears_skip_cache: bool = False

    @property
    def num_blocks(self) -> int:
        return len(self.hit_block_ids) + len(self.fills)


@dataclass
class CacheStats:
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    storage_miss_blocks: int = 0
    swap_out_blocks: int = 0
    write_back_blocks: int = 0
    write_back_failed: int = 0
    transfer_timeouts: int = 0
    transfers_overdue: int = 0  # in-flight transfers of any kind seen past their deadline (each counted once)


class PrefixCacheManager:
    def __init__(self, config: CacheConfig, state_array: np.ndarray | None = None,
                 submit: Callable[[TransferTask], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if config.num_gpu_blocks < 1 or config.block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got "
                             f"{config.num_gpu_blocks} x {config.block_size}")
        if config.write_policy not in ("write_through", "write_back"):
            raise ValueError(f"unknown write policy {config.write_policy!r}")
        self.config = config
        self.block_size = config.block_size
        self.num_blocks = config.num_gpu_blocks
        self.blocks = [DeviceBlock(i) for i in range(config.num_gpu_blocks)]
        self.state_array = state_array if state_array is not None else np.zeros(config.num_gpu_blocks, np.int8)
        self.state_array[:] = BlockState.FREE
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(config.num_gpu_blocks))
        self._cached_lru: OrderedDict[int, None] = OrderedDict()  # ref 0, hashed, evictable; oldest first
        self._device_index: dict[str, int] = {}
        self.host_blocks = [HostBlock(i) for i in range(config.num_cpu_blocks)]
        self._host_free: list[int] = list(range(config.num_cpu_blocks))[::-1]
        self._host_lru: OrderedDict[int, None] = OrderedDict()
        self._host_index: dict[str, int] = {}
        self._stored: set[str] = set()  # hashes this engine wrote to storage successfully
        self._submit = submit
        self._clock = clock  # monotonic seconds; tests pass their own to move deadlines
        self._next_task_id = 0
        self._tasks: dict[int, TransferTask] = {}
        self._task_hashes: dict[int, list[str]] = {}
        self._task_deadlines: dict[int, float] = {}  # task id -> monotonic deadline, in issue order
        self._reported_overdue: set[int] = set()
        self._plans: dict[int, LoadPlan] = {}  # task id -> plan waiting for it
        self._plans_by_seq: dict[str, LoadPlan] = {}
        self._num_swapping_out = 0
        self.stats = CacheStats()

    # ---- capacity -----------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free ones plus unreferenced cached ones."""
        return len(self._free) + len(self._cached_lru)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._device_index)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: CacheSequence, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(seq.block_table) <= self.num_free_blocks

    def try_allocate(self, seq: CacheSequence, num_tokens: int) -> bool:
        """Grow ``seq.block_table`` to hold ``num_tokens`` tokens if the blocks are there; False changes nothing."""
        if not self.can_allocate(seq, num_tokens):
            return False
        self.allocate(seq, num_tokens)
        return True

    def allocate(self, seq: CacheSequence, num_tokens: int) -> None:
        """Grow ``seq.block_table`` to hold ``num_tokens`` tokens (all or nothing)."""
        missing = self.blocks_needed(num_tokens) - len(seq.block_table)
        if missing > self.num_free_blocks:
            raise BlockAllocationError(f"{seq.request_id}: needs {missing} more blocks, {self.num_free_blocks} free")
        for _ in range(missing):
            seq.block_table.append(self._take_block())

    def _take_block(self) -> int:
        if self._free:
            block_id, _ = self._free.popitem(last=False)
        else:
            block_id, _ = self._cached_lru.popitem(last=False)
            self._forget_device_hash(self.blocks[block_id])
        self._set_state(self.blocks[block_id], BlockState.IN_USE)
        self.blocks[block_id].ref_count = 1
        return block_id

    def free(self, seq: CacheSequence) -> None:
        """Drop the sequence's references; its full hashed blocks stay cached."""
        plan = self._plans_by_seq.pop(seq.request_id, None)
        if plan is not None:
            plan.cancelled = True  # its blocks stay quarantined until their copies report
        for block_id in reversed(seq.block_table):  # tail blocks are evicted first
            self._release(self.blocks[block_id])
        seq.block_table = []
        seq.block_hashes = []

    def _release(self, block: DeviceBlock) -> None:
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        if block.transfer_id is not None:
            return  # quarantined: _finish_transfer parks it when the copy completes
        self._park(block)

    def _park(self, block: DeviceBlock) -> None:
        """An unreferenced, idle block: cached if it holds a registered prefix, else free."""
        if block.block_hash is not None and self._device_index.get(block.block_hash) == block.block_id:
            self._set_state(block, BlockState.CACHED)
            self._cached_lru[block.block_id] = None
        else:
            block.block_hash = None
            self._set_state(block, BlockState.FREE)
            self._free[block.block_id] = None

    def _forget_device_hash(self, block: DeviceBlock) -> None:
        if block.block_hash is not None and self._device_index.get(block.block_hash) == block.block_id:
            del self._device_index[block.block_hash]
        block.block_hash = None

    def _set_state(self, block: DeviceBlock, state: BlockState) -> None:
        block.state = state
        self.state_array[block.block_id] = state

    # ---- admission: prefix match and fills ---------------------------------------

    def match(self, seq: CacheSequence) -> PrefixMatch:
        """The cached prefix ``seq`` would get: device hits, then host/storage fills. Changes nothing.

        At least one prompt token is always left to compute, so the first step has a
        position to sample from. Fills are limited to the blocks that are free after
        the hits were shared, so committing the match can never run out of blocks.
        """
        result = PrefixMatch(clears_skip_cache=seq.skip_cache_once)
        if not self.config.enable_prefix_caching:
            return result
        use_lower_tiers = not seq.skip_cache_once
        tokens = seq.token_ids_slice(0, seq.num_tokens)
        matchable = (len(tokens) - 1) // self.block_size
        parent = ROOT_HASH
        for index in range(matchable):
            block_hash = hash_block(parent, tokens[index * self.block_size:(index + 1) * self.block_size],
                                    self.config.model_fingerprint)
            parent = block_hash
            if not result.fills and block_hash in self._device_index:
                block_id = self._device_index[block_hash]
                result.hit_block_ids.append(block_id)
                result.hit_hashes.append(block_hash)
                if block_id in self._cached_lru:
                    result.num_evictable_hits += 1
                continue
            source = self._lower_tier_source(block_hash) if use_lower_tiers else None
            if source is None or self.num_free_blocks - result.num_evictable_hits <= len(result.fills):
                break
            result.fills.append((block_hash, source))
        return result

    def admission_cost(self, seq: CacheSequence, found: PrefixMatch, max_new_tokens: int) -> int:
        """Blocks taken from the free count by committing ``found`` and allocating the first chunk."""
        computed = found.num_blocks * self.block_size
        first_chunk = min(seq.num_tokens - computed, max_new_tokens)
        beyond = max(0, self.blocks_needed(computed + first_chunk) - found.num_blocks)
        return found.num_evictable_hits + len(found.fills) + beyond

    def try_admit(self, seq: CacheSequence, max_new_tokens: int) -> bool:
        """Admit ``seq`` if its cached prefix and its first chunk (up to ``max_new_tokens``) fit now.

        The check runs on the need after the prefix match, so the allocation that
        follows for ``min(seq.num_uncomputed_tokens, max_new_tokens)`` tokens cannot
        fail. If even the match without lower-tier fills does not fit, nothing changes
        and False is returned: the sequence keeps waiting.
        """
        if seq.block_table:
            raise ValueError(f"{seq.request_id} is admitted while it still holds blocks {seq.block_table}")
        found = self.match(seq)
        free = self.num_free_blocks
        # Fills draw fresh blocks and push the first chunk further out: drop them from the end until it fits.
        while found.fills and self.admission_cost(seq, found, max_new_tokens) > free:
            found.fills.pop()
        if self.admission_cost(seq, found, max_new_tokens) > free:
            return False
        self.commit_admission(seq, found)
        return True

    def admit(self, seq: CacheSequence) -> None:
        """Give a sequence entering the running set its cached prefix (no capacity check for a first chunk).

        Device hits are shared at once; host and storage hits get fresh blocks
        filled by the transfer process, and the sequence waits (``is_loading``)
        until they complete.
        """
        self.commit_admission(seq, self.match(seq))

    def commit_admission(self, seq: CacheSequence, found: PrefixMatch) -> None:
        """Apply a ``match`` made in this same state (nothing may have changed the cache in between)."""
        seq.block_hashes = []
        seq.num_computed_tokens = 0
        if found.clears_skip_cache:
            seq.skip_cache_once = False
        for block_id, block_hash in zip(found.hit_block_ids, found.hit_hashes):
            self._share_device_block(seq, block_id)
            seq.block_hashes.append(block_hash)
        self.stats.device_hit_tokens += len(found.hit_block_ids) * self.block_size
        if found.fills:
            self._start_fills(seq, found.fills)
        # Counted as computed now; the scheduler does not run the sequence until the fills landed,
        # and a failed fill lowers it again (_finish_plan).
        seq.num_computed_tokens = len(seq.block_hashes) * self.block_size
        if seq.num_cached_tokens == 0:
            seq.num_cached_tokens = seq.num_computed_tokens

    def _share_device_block(self, seq: CacheSequence, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._cached_lru.pop(block_id, None)
            if block.transfer_id is None:
                self._set_state(block, BlockState.IN_USE)
        block.ref_count += 1
        seq.block_table.append(block_id)

    def _lower_tier_source(self, block_hash: str) -> str | None:
        host_id = self._host_index.get(block_hash)
        if host_id is not None:
            return "host"
        if self.config.storage_enabled and block_hash in self._stored:
            return "storage"
        return None

    def _start_fills(self, seq: CacheSequence, fills: list[tuple[str, str]]) -> None:
        plan = LoadPlan(seq, block_hashes=list(seq.block_hashes), first_fill=len(seq.block_hashes),
                        deadline=self._clock() + self.config.transfer_timeout_s)
        swap_in: list[tuple[int, int, str]] = []
        prefetch: list[tuple[int, str]] = []
        for block_hash, source in fills:
            block_id = self._take_block()
            plan.fill_sources[len(seq.block_table)] = source
            seq.block_table.append(block_id)
            plan.block_hashes.append(block_hash)
            if source == "host":
                host_id = self._host_index[block_hash]
                self.host_blocks[host_id].pinned += 1
                self._host_lru.move_to_end(host_id)
                swap_in.append((block_id, host_id, block_hash))
            else:
                prefetch.append((block_id, block_hash))
        self._plans_by_seq[seq.request_id] = plan
        seq.block_hashes = list(plan.block_hashes)
        if swap_in:
            task = self._new_task("swap_in", [d for d, _, _ in swap_in], host=[h for _, h, _ in swap_in])
            self._issue(task, [b for _, _, b in swap_in], BlockState.SWAP_IN, plan)
        if prefetch:
            keys = [self._key(b) for _, b in prefetch]
            task = self._new_task("prefetch", [d for d, _ in prefetch], keys=keys)
            self._issue(task, [b for _, b in prefetch], BlockState.LOAD, plan)

    def is_loading(self, seq: CacheSequence, started_is_enough: bool = False) -> bool:
        """True while the sequence waits for fills. ``started_is_enough`` is the test-only fault mode."""
        plan = self._plans_by_seq.get(seq.request_id)
        if plan is None:
            return False
        if started_is_enough:
            return not plan.pending_tasks <= plan.started_tasks
        return bool(plan.pending_tasks)

    def expired_loads(self) -> list[CacheSequence]:
        """Sequences whose fills exceeded the transfer timeout: the caller preempts them (cache miss)."""
        now = self._clock()
        expired = [p.seq for p in self._plans_by_seq.values() if p.pending_tasks and now > p.deadline]
        for seq in expired:
            logger.warning("KV fills for %s timed out after %.0f s; recomputing instead", seq.request_id,
                           self.config.transfer_timeout_s)
            self.stats.transfer_timeouts += 1
            seq.skip_cache_once = True
        return expired

    # ---- after each step: register full blocks -------------------------------------

    def on_tokens_computed(self, seq: CacheSequence) -> None:
        """Register blocks that became full so later requests can share them."""
        if not self.config.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        to_store: list[DeviceBlock] = []
        while len(seq.block_hashes) < full:
            index = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_HASH
            block_hash = hash_block(parent, seq.token_ids_slice(index * self.block_size, (index + 1) * self.block_size),
                                    self.config.model_fingerprint)
            seq.block_hashes.append(block_hash)
            block = self.blocks[seq.block_table[index]]
            if block_hash in self._device_index or block.block_hash is not None:
                continue  # an identical block is already cached; this copy stays private
            block.block_hash = block_hash
            self._device_index[block_hash] = block.block_id
            if self._should_write_through(block_hash):
                to_store.append(block)
        self._write_back_device(to_store)

    def _should_write_through(self, block_hash: str) -> bool:
        return (self.config.storage_enabled and self.config.write_policy == "write_through"
                and block_hash not in self._stored)

    # ---- offload: keep free device blocks above the watermark ------------------------

    def offload(self) -> None:
        """Swap cold cached device blocks out to the host tier (or storage) before they are evicted."""
        target = int(self.num_blocks * self.config.offload_watermark)
        candidates: list[DeviceBlock] = []
        for block_id in self._cached_lru:
            # Blocks already on their way to the host count as free: without this, a slow copy (e.g. one
            # waiting for the KV-cache lock) makes every iteration pick more victims.
            if len(self._free) + self._num_swapping_out + len(candidates) >= target:
                break
            block = self.blocks[block_id]
            if block.transfer_id is None:
                candidates.append(block)
        if not candidates:
            return
        if self.config.num_cpu_blocks > 0:
            self._swap_out(candidates)
        elif self.config.storage_enabled and self.config.write_policy == "write_back":
            self._write_back_device([b for b in candidates if b.block_hash not in self._stored])

    def _swap_out(self, blocks: list[DeviceBlock]) -> None:
        pairs = []
        for block in blocks:
            host_id = self._take_host_block()
            if host_id is None:
                break
            pairs.append((block, host_id))
        if not pairs:
            return
        hashes = []
        for block, host_id in pairs:
            self._cached_lru.pop(block.block_id, None)
            hashes.append(block.block_hash)
            self._forget_device_hash(block)  # not matchable while it moves
            self.host_blocks[host_id].pinned += 1
        task = self._new_task("swap_out", [b.block_id for b, _ in pairs], host=[h for _, h in pairs])
        self.stats.swap_out_blocks += len(pairs)
        self._num_swapping_out += len(pairs)
        self._issue(task, hashes, BlockState.SWAP_OUT, None)

    def _take_host_block(self) -> int | None:
        if self._host_free:
            return self._host_free.pop()
        for host_id in self._host_lru:
            host = self.host_blocks[host_id]
            if host.pinned:
                continue
            del self._host_lru[host_id]
            self._evict_host(host)
            return host_id if not host.pinned else None
        return None

    def _evict_host(self, host: HostBlock) -> None:
        block_hash = host.block_hash
        if block_hash is not None and self._host_index.get(block_hash) == host.host_id:
            del self._host_index[block_hash]
        host.block_hash = None
        if (block_hash is not None and self.config.storage_enabled and self.config.write_policy == "write_back"
                and block_hash not in self._stored):
            # The host copy is the last one: write it out before the host block is reused.
            host.pinned += 1
            task = self._new_task("write_back", [], host=[host.host_id], keys=[self._key(block_hash)])
            self.stats.write_back_blocks += 1
            self._issue(task, [block_hash], None, None)

    def _write_back_device(self, blocks: list[DeviceBlock]) -> None:
        if not blocks:
            return
        for block in blocks:
            self._cached_lru.pop(block.block_id, None)
        task = self._new_task("write_back", [b.block_id for b in blocks],
                              keys=[self._key(b.block_hash) for b in blocks])
        self.stats.write_back_blocks += len(blocks)
        self._issue(task, [b.block_hash for b in blocks], BlockState.WRITE_BACK, None)

    # ---- transfers --------------------------------------------------------------------

    def _key(self, block_hash: str) -> str:
        # Tensor parallelism is not implemented, so every object is rank 0's whole block.
        return storage_key(self.config.model_fingerprint, block_hash, tp_rank=0)

    def _new_task(self, kind: str, device: list[int], host: list[int] | None = None,
                  keys: list[str] | None = None) -> TransferTask:
        self._next_task_id += 1
        return TransferTask(self._next_task_id, kind, device_block_ids=device, host_block_ids=host or [],
                            storage_keys=keys or [])

    def _issue(self, task: TransferTask, hashes: list[str], state: BlockState | None, plan: LoadPlan | None) -> None:
        if self._submit is None:
            raise RuntimeError("a KV transfer was needed but no cache transfer process is configured")
        for block_id in task.device_block_ids:
            block = self.blocks[block_id]
            block.transfer_id = task.task_id
            if state is not None:
                self._set_state(block, state)
        self._tasks[task.task_id] = task
        self._task_hashes[task.task_id] = hashes
        self._task_deadlines[task.task_id] = self._clock() + self.config.transfer_timeout_s
        if plan is not None:
            plan.pending_tasks.add(task.task_id)
            self._plans[task.task_id] = plan
        self._submit(task)

    @property
    def num_pending_transfers(self) -> int:
        return len(self._tasks)

    def overdue_transfers(self) -> list[TransferTask]:
        """In-flight tasks of any kind past their deadline, oldest first.

        Their blocks stay quarantined: the copy may still be running. The caller
        restarts the transfer process and then calls ``fail_all_transfers``.
        """
        now = self._clock()
        overdue = []
        for task_id, deadline in self._task_deadlines.items():  # insertion order = issue order
            if now <= deadline:
                continue
            task = self._tasks[task_id]
            overdue.append(task)
            if task_id not in self._reported_overdue:
                self._reported_overdue.add(task_id)
                self.stats.transfers_overdue += 1
                logger.warning("KV transfer %d (%s, %d blocks) is past its %.0f s deadline", task_id, task.kind,
                               len(self._task_hashes[task_id]), self.config.transfer_timeout_s)
        return overdue

    def on_transfer_started(self, task_id: int) -> None:
        plan = self._plans.get(task_id)
        if plan is not None:
            plan.started_tasks.add(task_id)

    def on_transfer_done(self, done: TransferDone) -> None:
        task = self._tasks.pop(done.task_id, None)
        if task is None:
            logger.warning("completion for unknown transfer %d (%s)", done.task_id, done.kind)
            return
        hashes = self._task_hashes.pop(done.task_id)
        self._task_deadlines.pop(done.task_id, None)
        self._reported_overdue.discard(done.task_id)
        ok = list(done.ok) + [False] * (len(hashes) - len(done.ok))
        if done.error:
            logger.error("transfer %d (%s) failed: %s", done.task_id, task.kind, done.error)
        handler = {"swap_out": self._swap_out_done, "swap_in": self._fill_done, "prefetch": self._fill_done,
                   "write_back": self._write_back_done}[task.kind]
        handler(task, hashes, ok)
        plan = self._plans.pop(done.task_id, None)
        if plan is not None:
            self._plan_task_done(plan, task, ok)

    def fail_all_transfers(self) -> None:
        """The transfer process died: nothing is copying any more, so every in-flight block is released."""
        for task_id in list(self._tasks):
            task = self._tasks[task_id]
            self.on_transfer_done(TransferDone(task_id, task.kind, ok=[False] * len(self._task_hashes[task_id]),
                                               error="cache transfer process died"))

    def _swap_out_done(self, task: TransferTask, hashes: list[str], ok: list[bool]) -> None:
        self._num_swapping_out -= len(task.device_block_ids)
        for block_id, host_id, block_hash, success in zip(task.device_block_ids, task.host_block_ids, hashes, ok):
            host = self.host_blocks[host_id]
            host.pinned -= 1
            if success and block_hash not in self._host_index:
                host.block_hash = block_hash
                self._host_index[block_hash] = host_id
                self._host_lru[host_id] = None
            else:
                self._host_free.append(host_id)
            block = self.blocks[block_id]
            block.transfer_id = None
            self._settle(block)

    def _fill_done(self, task: TransferTask, hashes: list[str], ok: list[bool]) -> None:
        for i, block_id in enumerate(task.device_block_ids):
            if task.kind == "swap_in":
                self.host_blocks[task.host_block_ids[i]].pinned -= 1
            elif not ok[i]:
                self.stats.storage_miss_blocks += 1
                # Gone from storage (evicted, corrupt, the store restarted): write it again next time.
                self._stored.discard(hashes[i])
            block = self.blocks[block_id]
            block.transfer_id = None
            self._settle(block)

    def _write_back_done(self, task: TransferTask, hashes: list[str], ok: list[bool]) -> None:
        for block_hash, success in zip(hashes, ok):
            if success:
                self._stored.add(block_hash)
            else:
                self.stats.write_back_failed += 1
        for host_id in task.host_block_ids:
            host = self.host_blocks[host_id]
            host.pinned -= 1
            if host.block_hash is None and not host.pinned and host_id not in self._host_free:
                self._host_free.append(host_id)
        for block_id in task.device_block_ids:
            block = self.blocks[block_id]
            block.transfer_id = None
            self._settle(block)

    def _settle(self, block: DeviceBlock) -> None:
        """A copy on ``block`` completed: back to the state its references say."""
        if block.ref_count > 0:
            self._set_state(block, BlockState.IN_USE)
        else:
            self._park(block)

    def _plan_task_done(self, plan: LoadPlan, task: TransferTask, ok: list[bool]) -> None:
        plan.pending_tasks.discard(task.task_id)
        plan.started_tasks.discard(task.task_id)
        if plan.cancelled:
            return
        table_index = {block_id: i for i, block_id in enumerate(plan.seq.block_table)}
        for block_id, success in zip(task.device_block_ids, ok):
            if not success:
                index = table_index[block_id]
                plan.failed_from = index if plan.failed_from is None else min(plan.failed_from, index)
        if not plan.pending_tasks:
            self._finish_plan(plan)

    def _finish_plan(self, plan: LoadPlan) -> None:
        seq = plan.seq
        self._plans_by_seq.pop(seq.request_id, None)
        loaded = len(plan.block_hashes) if plan.failed_from is None else plan.failed_from
        first_fill = plan.first_fill
        for index in range(first_fill, loaded):
            block = self.blocks[seq.block_table[index]]
            block_hash = plan.block_hashes[index]
            if block_hash not in self._device_index:
                block.block_hash = block_hash
                self._device_index[block_hash] = block.block_id
        host_hits = sum(1 for i in range(first_fill, loaded) if plan.fill_sources.get(i) == "host")
        self.stats.host_hit_tokens += host_hits * self.block_size
        self.stats.storage_hit_tokens += (loaded - first_fill - host_hits) * self.block_size
        if plan.failed_from is not None:
            seq.block_hashes = plan.block_hashes[:loaded]
            seq.num_computed_tokens = min(seq.num_computed_tokens, loaded * self.block_size)
            logger.info("%s: %d of %d cached blocks could not be loaded; recomputing from token %d",
                        seq.request_id, len(plan.block_hashes) - loaded, len(plan.block_hashes) - first_fill,
                        seq.num_computed_tokens)
            seq.num_cached_tokens = seq.num_computed_tokens

    # ---- reset ------------------------------------------------------------------------

    def reset(self) -> int:
        """Forget the device and host tiers' cached prefixes (storage is kept). Returns blocks dropped."""
        dropped = 0
        for block_id in list(self._cached_lru):
            block = self.blocks[block_id]
            if block.transfer_id is not None:
                continue
            del self._cached_lru[block_id]
            self._forget_device_hash(block)
            self._park(block)
            dropped += 1
        for host_id in list(self._host_lru):
            host = self.host_blocks[host_id]
            if host.pinned:
                continue
            del self._host_lru[host_id]
            if host.block_hash is not None:
                self._host_index.pop(host.block_hash, None)
            host.block_hash = None
            self._host_free.append(host_id)
            dropped += 1
        return dropped

    def drop_host_tier(self) -> None:
        """The host pool's memory is gone (its process died): forget every host block."""
        self._host_index.clear()
        self._host_lru.clear()
        for host in self.host_blocks:
            host.block_hash = None
            host.pinned = 0
        self._host_free = list(range(len(self.host_blocks)))[::-1]

    def forget_device_contents(self) -> None:
        """The device pool's memory was recreated (worker restart): no cached prefix is valid any more.

        Call after every sequence holding blocks was freed and every transfer failed.
        """
        self._device_index.clear()
        self._cached_lru.clear()
        self._free.clear()
        for block in self.blocks:
            block.ref_count = 0
            block.block_hash = None
            block.transfer_id = None
            self._set_state(block, BlockState.FREE)
            self._free[block.block_id] = None

    def summary(self) -> dict[str, int]:
        return {
            "kv_blocks_free": len(self._free),
            "kv_blocks_cached": len(self._cached_lru),
            "host_blocks_used": len(self.host_blocks) - len(self._host_free),
            "storage_blocks_known": len(self._stored),
            "transfers_in_flight": len(self._tasks),
            **self.stats.__dict__,
        }
