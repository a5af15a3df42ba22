"""Every KV copy between tiers: what to fill, what to offload, what to write to storage, and its outcome.

Owns the lower tiers' policy and the copies in flight:

- fills: a sequence admitted with host, storage or remote hits gets fresh device blocks,
  filled by SWAP_IN / LOAD tasks (one ``LoadPlan`` per sequence); "remote" blocks are a P/D
  prefill instance's (the sequence's ``remote_prefill`` offer, read by a ``remote_read`` task;
  the offer is handed back through ``take_finished_offers`` once that read reported, so the engine
  releases the prefill side's hold); it is not
  scheduled until every fill reported (``is_loading``), and a fill that runs past
  ``transfer_timeout_s`` is handed to the scheduler to preempt (``expired_loads``);
- offload: when free device blocks fall under the watermark, the coldest cached
  blocks are swapped out to the host pool, or written back to storage without one;
- storage policy: ``write_through`` stores a block when it becomes full,
  ``write_back`` when its last copy leaves the host/device tiers; ``_stored``
  caches the hashes known to be stored: those this engine wrote, and the positive answers
  of the storage lookup (``lookup_storage``: at admission, one batched, time-bounded exists
  call for a request's remaining blocks, so blocks other instances, DP ranks or an earlier
  process stored are found too; negative answers are remembered only for
  ``NEGATIVE_LOOKUP_TTL_S``);
- tasks: ids, deadlines (``overdue_transfers``), completions (``on_transfer_done``)
  and the blocks they quarantine until then (``fail_all_transfers`` after the
  transfer process was restarted).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from cache_manager.block_pool import BlockPool, DeviceBlock
from cache_manager.block_state import BlockState
from cache_manager.cache_sequence import CacheSequence
from cache_manager.host_pool import HostPool
from cache_manager.kv_layout import shard_storage_keys, storage_key
from cache_manager.pd_transfer import RemotePrefill
from cache_manager.prefix_index import PrefixIndex
from cache_manager.storage_lookup import StorageLookup
from config.engine_config import CacheConfig
from inter_communicator.messages import RemoteBlocks, TransferDone, TransferTask

logger = logging.getLogger(__name__)

# A storage miss is remembered this long, so a request that waits for blocks does not ask the store again
# every step, while a block another instance stores meanwhile is found soon after.
NEGATIVE_LOOKUP_TTL_S = 1.0


@dataclass
class LoadPlan:
    """The fills one sequence waits for before it may run."""

    seq: CacheSequence
    block_hashes: list[str]  # hashes of seq.block_table[:len(block_hashes)]
    first_fill: int = 0  # block index of the first filled block (the ones before are device hits)
    fill_sources: dict[int, str] = field(default_factory=dict)  # block index -> "host" | "storage" | "remote"
    cancelled: bool = False  # the sequence was freed or preempted while its fills ran
    pending_tasks: set[int] = field(default_factory=set)
    failed_from: int | None = None  # first block index whose fill failed
    deadline: float = 0.0
    started_tasks: set[int] = field(default_factory=set)


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
    storage_lookups: int = 0  # batched exists calls to the storage tier (one per admission that needed one)
    storage_lookup_hits: int = 0  # blocks those calls found stored
    storage_lookup_misses: int = 0  # blocks they did not find (timeouts included)
    storage_lookup_timeouts: int = 0  # calls that did not answer within FD_STORAGE_LOOKUP_TIMEOUT_S
    storage_lookup_seconds: float = 0.0  # time the engine spent waiting for them
    remote_reads: int = 0  # P/D: remote_read tasks issued (one per request served from a prefill instance)
    remote_hit_tokens: int = 0  # prompt tokens whose KV came from a prefill instance
    remote_failed_blocks: int = 0  # blocks a remote read could not get (recomputed locally instead)


class TransferPlanner:
    def __init__(self, config: CacheConfig, pool: BlockPool, host: HostPool, index: PrefixIndex,
                 submit: Callable[[TransferTask], None] | None, clock: Callable[[], float] = time.monotonic,
                 stats: CacheStats | None = None, storage_lookup: StorageLookup | None = None) -> None:
        self.config = config
        self.block_size = config.block_size
        self._pool = pool
        self._host = host
        self._index = index
        self._submit = submit
        self._clock = clock  # monotonic seconds; tests pass their own to move deadlines
        self.stats = stats if stats is not None else CacheStats()
        self._stored: set[str] = set()  # hashes known to be in storage (written here, or found by a lookup)
        self._lookup = storage_lookup
        self._known_missing: dict[str, float] = {}  # hash -> monotonic time its negative lookup expires
        self._next_task_id = 0
        self._tasks: dict[int, TransferTask] = {}
        self._task_hashes: dict[int, list[str]] = {}
        self._task_deadlines: dict[int, float] = {}  # task id -> monotonic deadline, in issue order
        self._reported_overdue: set[int] = set()
        self._plans: dict[int, LoadPlan] = {}  # task id -> plan waiting for it
        self._plans_by_seq: dict[str, LoadPlan] = {}
        self._num_swapping_out = 0
        self._remote_offers: dict[int, RemotePrefill] = {}  # remote_read task id -> the offer it reads
        self._finished_offers: list[RemotePrefill] = []  # offers read or given up: the engine releases them

    @property
    def num_in_flight(self) -> int:
        return len(self._tasks)

    @property
    def num_stored(self) -> int:
        return len(self._stored)

    # ---- fills ------------------------------------------------------------------------

    def lower_tier_source(self, block_hash: str) -> str | None:
        """Where a block missing on the device could be filled from: "host", "storage" or nowhere."""
        if self._index.has_host(block_hash):
            return "host"
        if self.config.storage_enabled and block_hash in self._stored:
            return "storage"
        return None

    def lookup_storage(self, block_hashes: list[str]) -> None:
        """Ask the store, in one batched call, which of ``block_hashes`` it holds; remember the hits.

        Skipped for hashes already known stored, held by the host tier, or missed within the last
        ``NEGATIVE_LOOKUP_TTL_S``. Without a lookup handle only this engine's own writes are known.
        """
        if self._lookup is None or not self.config.storage_enabled:
            return
        now = self._clock()
        if len(self._known_missing) > 4096:  # bounded: expired entries go when the map grows
            self._known_missing = {h: t for h, t in self._known_missing.items() if t > now}
        unknown = [h for h in block_hashes if h not in self._stored and not self._index.has_host(h)
                   and self._known_missing.get(h, 0.0) <= now]
        if not unknown:
            return
        # A block is stored only if every TP rank's shard is (one object per shard).
        tp = self.config.tp_size
        result = self._lookup.lookup([key for h in unknown for key in shard_storage_keys(self._key(h), tp)])
        self.stats.storage_lookups += 1
        self.stats.storage_lookup_seconds += result.seconds
        if result.timed_out:
            self.stats.storage_lookup_timeouts += 1
        expires = now + NEGATIVE_LOOKUP_TTL_S
        exists = [all(result.exists[i * tp:(i + 1) * tp]) for i in range(len(unknown))]
        for block_hash, found in zip(unknown, exists):
            if found:
                self._stored.add(block_hash)
                self._known_missing.pop(block_hash, None)
                self.stats.storage_lookup_hits += 1
            else:
                self._known_missing[block_hash] = expires
                self.stats.storage_lookup_misses += 1

    def start_fills(self, seq: CacheSequence, fills: list[tuple[str, str]]) -> None:
        """Append fresh blocks for ``fills`` to ``seq`` and issue their copies; ``seq`` waits for them."""
        plan = LoadPlan(seq, block_hashes=list(seq.block_hashes), first_fill=len(seq.block_hashes),
                        deadline=self._clock() + self.config.transfer_timeout_s)
        swap_in: list[tuple[int, int, str]] = []
        prefetch: list[tuple[int, str]] = []
        remote: list[tuple[int, str, int]] = []  # (device block, hash, the prefill instance's block)
        offer: RemotePrefill | None = getattr(seq, "remote_prefill", None)
        for block_hash, source in fills:
            block_id = self._pool.take()
            position = len(seq.block_table)
            plan.fill_sources[position] = source
            if source == "remote":
                if offer is None or position >= len(offer.block_ids):
                    raise KeyError(f"remote fill of block {position} of {seq.request_id}, which has no such offer")
                seq.block_table.append(block_id)
                plan.block_hashes.append(block_hash)
                remote.append((block_id, block_hash, offer.block_ids[position]))
                continue
            seq.block_table.append(block_id)
            plan.block_hashes.append(block_hash)
            if source == "host":
                host_id = self._index.host_block(block_hash)
                if host_id is None:
                    raise KeyError(f"fill from host for {block_hash}, which the host tier does not hold")
                self._host.pin(host_id)
                self._host.touch(host_id)
                swap_in.append((block_id, host_id, block_hash))
            else:
                prefetch.append((block_id, block_hash))
        self._plans_by_seq[seq.request_id] = plan
        seq.block_hashes = list(plan.block_hashes)
        if swap_in:
            task = self._new_task("swap_in", [d for d, _, _ in swap_in], host=[h for _, h, _ in swap_in])
            self._issue(task, [b for _, _, b in swap_in], BlockState.SWAP_IN, plan)
        if prefetch:
            task = self._new_task("prefetch", [d for d, _ in prefetch], keys=[self._key(b) for _, b in prefetch])
            self._issue(task, [b for _, b in prefetch], BlockState.LOAD, plan)
        if remote:
            task = self._new_task("remote_read", [d for d, _, _ in remote])
            task.remote = RemoteBlocks(offer.session, offer.kv_addr, offer.num_blocks, [r for _, _, r in remote],
                                       offer.transfer_id, offer.expires_at)
            self._remote_offers[task.task_id] = offer
            self.stats.remote_reads += 1
            self._issue(task, [b for _, b, _ in remote], BlockState.LOAD, plan)
            seq.remote_prefill = None  # read once: a later admission (after a preemption) recomputes

    def settle_remote_offer(self, seq: CacheSequence) -> None:
        """After admission: an offer no fill used (device hits covered it, no room) is handed back now."""
        offer: RemotePrefill | None = getattr(seq, "remote_prefill", None)
        if offer is not None:
            seq.remote_prefill = None
            self._finished_offers.append(offer)

    def take_finished_offers(self) -> list[RemotePrefill]:
        """Offers whose read reported (or that no fill used): the engine releases the prefill side's hold."""
        offers, self._finished_offers = self._finished_offers, []
        return offers

    def cancel_fills(self, seq: CacheSequence) -> None:
        """``seq`` lets go of its blocks: its fills' blocks stay quarantined until the copies report."""
        plan = self._plans_by_seq.pop(seq.request_id, None)
        if plan is not None:
            plan.cancelled = True

    def is_loading(self, seq: CacheSequence, started_is_enough: bool = False) -> bool:
        """True while the sequence waits for fills. ``started_is_enough`` is the test-only fault mode."""
        plan = self._plans_by_seq.get(seq.request_id)
        if plan is None:
            return False
        if started_is_enough:
            return not plan.pending_tasks <= plan.started_tasks
        return bool(plan.pending_tasks)

    def expired_loads(self) -> list[CacheSequence]:
        """Sequences whose fills exceeded the transfer timeout; marked to recompute at their next admission."""
        now = self._clock()
        expired = [p.seq for p in self._plans_by_seq.values() if p.pending_tasks and now > p.deadline]
        for seq in expired:
            logger.warning("KV fills for %s timed out after %.0f s; recomputing instead", seq.request_id,
                           self.config.transfer_timeout_s)
            self.stats.transfer_timeouts += 1
            seq.skip_cache_once = True
        return expired

    # ---- storage policy and offload ---------------------------------------------------

    def should_write_through(self, block_hash: str) -> bool:
        return (self.config.storage_enabled and self.config.write_policy == "write_through"
                and block_hash not in self._stored)

    def offload(self) -> None:
        """Swap cold cached device blocks out to the host tier (or storage) before they are evicted."""
        target = int(self._pool.num_blocks * self.config.offload_watermark)
        candidates: list[DeviceBlock] = []
        for block in self._pool.evictable_blocks():
            # Blocks already on their way to the host count as free: without this, a slow copy (e.g. one
            # waiting for the KV-cache lock) makes every iteration pick more victims.
            if self._pool.num_never_cached_free + self._num_swapping_out + len(candidates) >= target:
                break
            if block.transfer_id is None:
                candidates.append(block)
        if not candidates:
            return
        if self.config.num_cpu_blocks > 0:
            self._swap_out(candidates)
        elif self.config.storage_enabled and self.config.write_policy == "write_back":
            self.write_back_device([b for b in candidates if b.block_hash not in self._stored])

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
            self._pool.withdraw(block.block_id)
            hashes.append(block.block_hash)
            self._pool.forget_hash(block)  # not matchable while it moves
            self._host.pin(host_id)
        task = self._new_task("swap_out", [b.block_id for b, _ in pairs], host=[h for _, h in pairs])
        self.stats.swap_out_blocks += len(pairs)
        self._num_swapping_out += len(pairs)
        self._issue(task, hashes, BlockState.SWAP_OUT, None)

    def _take_host_block(self) -> int | None:
        """A host block to swap into; None if none is free now (an evicted one may first be written back)."""
        host_id = self._host.take_free()
        if host_id is not None:
            return host_id
        host = self._host.evict_lru()
        if host is None:
            return None
        block_hash, host.block_hash = host.block_hash, None
        if (block_hash is not None and self.config.storage_enabled and self.config.write_policy == "write_back"
                and block_hash not in self._stored):
            # The host copy is the last one: write it out before the host block is reused.
            self._host.pin(host.host_id)
            task = self._new_task("write_back", [], host=[host.host_id], keys=[self._key(block_hash)])
            self.stats.write_back_blocks += 1
            self._issue(task, [block_hash], None, None)
            return None
        return host.host_id

    def write_back_device(self, blocks: list[DeviceBlock]) -> None:
        if not blocks:
            return
        for block in blocks:
            self._pool.withdraw(block.block_id)
        task = self._new_task("write_back", [b.block_id for b in blocks],
                              keys=[self._key(b.block_hash) for b in blocks])
        self.stats.write_back_blocks += len(blocks)
        self._issue(task, [b.block_hash for b in blocks], BlockState.WRITE_BACK, None)

    # ---- tasks ------------------------------------------------------------------------

    def _key(self, block_hash: str) -> str:
        # Rank 0's key; the transfer process derives the other ranks' (kv_layout.shard_storage_keys).
        return storage_key(self.config.model_fingerprint, block_hash, tp_rank=0, tp_size=self.config.tp_size)

    def _new_task(self, kind: str, device: list[int], host: list[int] | None = None,
                  keys: list[str] | None = None) -> TransferTask:
        self._next_task_id += 1
        return TransferTask(self._next_task_id, kind, device_block_ids=device, host_block_ids=host or [],
                            storage_keys=keys or [])

    def _issue(self, task: TransferTask, hashes: list[str], state: BlockState | None, plan: LoadPlan | None) -> None:
        if self._submit is None:
            raise RuntimeError("a KV transfer was needed but no cache transfer process is configured")
        for block_id in task.device_block_ids:
            self._pool.begin_copy(block_id, task.task_id, state)
        self._tasks[task.task_id] = task
        self._task_hashes[task.task_id] = hashes
        self._task_deadlines[task.task_id] = self._clock() + self.config.transfer_timeout_s
        if plan is not None:
            plan.pending_tasks.add(task.task_id)
            self._plans[task.task_id] = plan
        self._submit(task)

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
                   "remote_read": self._fill_done, "write_back": self._write_back_done}[task.kind]
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
            self._host.unpin(host_id)
            if success:
                self._host.store(host_id, block_hash)
            else:
                self._host.put_back(host_id)
            self._pool.end_copy(block_id)

    def _fill_done(self, task: TransferTask, hashes: list[str], ok: list[bool]) -> None:
        for i, block_id in enumerate(task.device_block_ids):
            if task.kind == "swap_in":
                self._host.unpin(task.host_block_ids[i])
            elif task.kind == "remote_read":
                self.stats.remote_failed_blocks += 0 if ok[i] else 1
            elif not ok[i]:
                self.stats.storage_miss_blocks += 1
                # Gone from storage (evicted, corrupt, the store restarted): write it again next time.
                self._stored.discard(hashes[i])
                self._known_missing[hashes[i]] = self._clock() + NEGATIVE_LOOKUP_TTL_S
            self._pool.end_copy(block_id)
        offer = self._remote_offers.pop(task.task_id, None)
        if offer is not None:
            self._finished_offers.append(offer)

    def _write_back_done(self, task: TransferTask, hashes: list[str], ok: list[bool]) -> None:
        for block_hash, success in zip(hashes, ok):
            if success:
                self._stored.add(block_hash)
                self._known_missing.pop(block_hash, None)
            else:
                self.stats.write_back_failed += 1
        for host_id in task.host_block_ids:
            self._host.unpin(host_id)
            self._host.put_back_if_idle(host_id)
        for block_id in task.device_block_ids:
            self._pool.end_copy(block_id)

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
            block_hash = plan.block_hashes[index]
            if not self._index.has_device(block_hash):
                self._pool.register(seq.block_table[index], block_hash)
        sources = [plan.fill_sources.get(i) for i in range(first_fill, loaded)]
        self.stats.host_hit_tokens += sources.count("host") * self.block_size
        self.stats.remote_hit_tokens += sources.count("remote") * self.block_size
        self.stats.storage_hit_tokens += sources.count("storage") * self.block_size
        if plan.failed_from is not None:
            seq.block_hashes = plan.block_hashes[:loaded]
            seq.num_computed_tokens = min(seq.num_computed_tokens, loaded * self.block_size)
            logger.info("%s: %d of %d cached blocks could not be loaded; recomputing from token %d",
                        seq.request_id, len(plan.block_hashes) - loaded, len(plan.block_hashes) - first_fill,
                        seq.num_computed_tokens)
            seq.num_cached_tokens = seq.num_computed_tokens
