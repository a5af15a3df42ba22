"""The KV cache as the scheduler sees it: admit with the cached prefix, grow, free, register full blocks.

``KVCacheManager`` is a facade over four parts, one concept each:

- ``BlockPool`` (block_pool.py): device blocks, ref counts, states, free queue, evictable LRU;
- ``PrefixIndex`` (prefix_index.py): hash -> device block and hash -> host block;
- ``HostPool`` (host_pool.py): host blocks, their LRU and pins;
- ``TransferPlanner`` (transfer_planner.py): fills, offload, storage policy, tasks and deadlines;
  with a ``StorageLookup`` (storage_lookup.py) it asks the store at admission which blocks exist,
  so blocks other instances, DP ranks or earlier processes stored are prefetched too.

P/D disaggregation uses it on both sides: a decode instance's sequence may carry a prefill
instance's offer (``remote_prefill``): its blocks are one more fill source ("remote", between host
and storage), read by the transfer process; a prefill instance ``hold``s a finished request's full
blocks (one extra reference each) until the decode side released them (``release_held``).

It decides admission (the prefix match and what committing it costs) and
registers blocks that became full. Correctness rests on block states, not on
the KV-cache lock: a block being filled belongs to one sequence that is not
scheduled until its fills completed; a block being copied out is never handed
to another sequence until its copy completed; a block whose copy timed out or
whose sequence went away stays quarantined until the transfer process reports
on it, or until the engine restarted that process and called ``fail_all_transfers``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from cache_manager.block_hash import ROOT_HASH, hash_block
from cache_manager.block_pool import BlockAllocationError, BlockPool, DeviceBlock
from cache_manager.cache_sequence import CacheSequence
from cache_manager.host_pool import HostPool
from cache_manager.pd_transfer import RemotePrefill
from cache_manager.prefix_index import PrefixIndex
from cache_manager.storage_lookup import StorageLookup
from cache_manager.transfer_planner import CacheStats, TransferPlanner
from config.engine_config import CacheConfig
from inter_communicator.messages import TransferDone, TransferTask

__all__ = ["BlockAllocationError", "CacheStats", "KVCacheManager", "PrefixMatch"]


@dataclass
class PrefixMatch:
    """What admitting a sequence would take from the cache, computed without changing anything."""

    hit_block_ids: list[int] = field(default_factory=list)  # device blocks shared as they are
    hit_hashes: list[str] = field(default_factory=list)
    fills: list[tuple[str, str]] = field(default_factory=list)  # (hash, "host" | "remote" | "storage"), after the hits
    num_evictable_hits: int = 0  # hits that are unreferenced cached blocks: sharing takes them off the free count
    clears_skip_cache: bool = False

    @property
    def num_blocks(self) -> int:
        return len(self.hit_block_ids) + len(self.fills)


class KVCacheManager:
    def __init__(self, config: CacheConfig, state_array: np.ndarray | None = None,
                 submit: Callable[[TransferTask], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, storage_lookup: StorageLookup | None = None) -> None:
        if config.num_gpu_blocks < 1 or config.block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got "
                             f"{config.num_gpu_blocks} x {config.block_size}")
        if config.write_policy not in ("write_through", "write_back"):
            raise ValueError(f"unknown write policy {config.write_policy!r}")
        self.config = config
        self.block_size = config.block_size
        self.num_blocks = config.num_gpu_blocks
        self.index = PrefixIndex()
        self.pool = BlockPool(config.num_gpu_blocks, self.index, state_array)
        self.host = HostPool(config.num_cpu_blocks, self.index)
        # storage_lookup: the engine's handle asking the store which blocks exist (None: only own writes count).
        self.transfers = TransferPlanner(config, self.pool, self.host, self.index, submit, clock,
                                         storage_lookup=storage_lookup)
        self.stats: CacheStats = self.transfers.stats
        # n > 1: blocks a forked choice shared instead of computing them, and partial blocks it copied.
        self.num_fork_shared_blocks = 0
        self.num_fork_copied_blocks = 0

    # ---- capacity ---------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free ones plus unreferenced cached ones."""
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.index.num_device

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
            seq.block_table.append(self.pool.take())

    # ---- n > 1: a choice forks off its parent's prefilled prompt ------------------------

    def fork_cost(self, parent: CacheSequence) -> int:
        """Fresh blocks one child takes at ``fork``: a copy of the parent's partial last block, if it has one."""
        return 1 if parent.num_computed_tokens % self.block_size else 0

    def fork(self, parent: CacheSequence, child: CacheSequence) -> tuple[int, int] | None:
        """Give ``child`` the parent's computed tokens: full blocks shared by reference, the partial one copied.

        Returns the device copy (src, dst) the worker must run before the child's first step
        writes into its own copy of the partial block (copy-on-write), or None if the parent's
        computed tokens end on a block boundary. The caller checked ``fork_cost`` blocks are free.
        """
        if child.block_table:
            raise ValueError(f"{child.request_id} forks while it still holds blocks {child.block_table}")
        computed = parent.num_computed_tokens
        full = computed // self.block_size
        for block_id in parent.block_table[:full]:
            self.pool.share(block_id)
            child.block_table.append(block_id)
        child.block_hashes = list(parent.block_hashes[:full])
        child.num_computed_tokens = computed
        self.num_fork_shared_blocks += full
        if computed % self.block_size == 0:
            return None
        if self.num_free_blocks < 1:
            raise BlockAllocationError(f"{child.request_id}: no block for the copy of the shared partial block")
        fresh = self.pool.take()
        child.block_table.append(fresh)
        self.num_fork_copied_blocks += 1
        return parent.block_table[full], fresh

    def free(self, seq: CacheSequence) -> None:
        """Drop the sequence's references; its full hashed blocks stay cached."""
        self.transfers.cancel_fills(seq)
        for block_id in reversed(seq.block_table):  # tail blocks are evicted first
            self.pool.release(block_id)
        seq.block_table = []
        seq.block_hashes = []

    # ---- admission: prefix match and fills ----------------------------------------------

    def match(self, seq: CacheSequence, max_hit_tokens: int | None = None) -> PrefixMatch:
        """The cached prefix ``seq`` would get: device hits, then host/storage fills. Changes nothing.

        At least one prompt token is always left to compute, so the first step has a
        position to sample from. Fills are limited to the blocks that are free after
        the hits were shared, so committing the match can never run out of blocks.
        ``max_hit_tokens`` caps the match (prompt logprobs: the positions still to be scored must be
        computed, so only blocks before them may come from the cache; 0 matches nothing).
        """
        result = PrefixMatch(clears_skip_cache=seq.skip_cache_once)
        if not self.config.enable_prefix_caching:
            return result
        use_lower_tiers = not seq.skip_cache_once
        tokens = seq.token_ids_slice(0, seq.num_tokens)
        matchable = (len(tokens) - 1) // self.block_size
        if max_hit_tokens is not None:
            matchable = min(matchable, max_hit_tokens // self.block_size)
        hashes = []
        parent = ROOT_HASH
        for index in range(matchable):
            parent = hash_block(parent, tokens[index * self.block_size:(index + 1) * self.block_size],
                                self.config.model_fingerprint)
            hashes.append(parent)
        if use_lower_tiers:
            # One batched lookup for the blocks after the device hits: what other instances stored counts too.
            device_hits = 0
            while device_hits < len(hashes) and self.index.has_device(hashes[device_hits]):
                device_hits += 1
            self.transfers.lookup_storage(hashes[device_hits:])
        remote = getattr(seq, "remote_prefill", None) if use_lower_tiers else None
        for position, block_hash in enumerate(hashes):
            block_id = None if result.fills else self.index.device_block(block_hash)
            if block_id is not None:
                result.hit_block_ids.append(block_id)
                result.hit_hashes.append(block_hash)
                if self.pool.is_evictable(block_id):
                    result.num_evictable_hits += 1
                continue
            source = self.transfers.lower_tier_source(block_hash) if use_lower_tiers else None
            if source != "host" and remote is not None and position < len(remote.block_hashes) \
                    and remote.block_hashes[position] == block_hash:
                source = "remote"  # a P/D prefill instance holds it: fresher and nearer than storage
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

    def try_admit(self, seq: CacheSequence, max_new_tokens: int, max_hit_tokens: int | None = None) -> bool:
        """Admit ``seq`` if its cached prefix and its first chunk (up to ``max_new_tokens``) fit now.

        The check runs on the need after the prefix match, so the allocation that
        follows for ``min(seq.num_uncomputed_tokens, max_new_tokens)`` tokens cannot
        fail. If even the match without lower-tier fills does not fit, nothing changes
        and False is returned: the sequence keeps waiting. ``max_hit_tokens`` caps what is taken
        from the cache (see ``match``); the sequence's full blocks are still registered for others.
        """
        if seq.block_table:
            raise ValueError(f"{seq.request_id} is admitted while it still holds blocks {seq.block_table}")
        found = self.match(seq, max_hit_tokens)
        free = self.num_free_blocks
        # Fills draw fresh blocks and push the first chunk further out: drop them from the end until it fits.
        while found.fills and self.admission_cost(seq, found, max_new_tokens) > free:
            found.fills.pop()
        if self.admission_cost(seq, found, max_new_tokens) > free:
            return False
        self.commit_admission(seq, found)
        return True

    def admit(self, seq: CacheSequence) -> None:
        """Give a sequence its cached prefix without a capacity check for a first chunk.

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
            self.pool.share(block_id)
            seq.block_table.append(block_id)
            seq.block_hashes.append(block_hash)
        self.stats.device_hit_tokens += len(found.hit_block_ids) * self.block_size
        if found.fills:
            self.transfers.start_fills(seq, found.fills)
        self.transfers.settle_remote_offer(seq)
        # Counted as computed now; the scheduler does not run the sequence until the fills landed,
        # and a failed fill lowers it again (TransferPlanner._finish_plan).
        seq.num_computed_tokens = len(seq.block_hashes) * self.block_size
        if seq.num_cached_tokens == 0:
            seq.num_cached_tokens = seq.num_computed_tokens

    # ---- P/D: a prefill instance holds a finished request's blocks for a decode instance --------

    def hold(self, seq: CacheSequence, num_blocks: int) -> list[int]:
        """One extra reference on ``seq``'s first ``num_blocks`` blocks, so freeing ``seq`` keeps them.

        A held block is IN_USE: never evicted, offloaded or handed to another sequence, and (full and
        shared) never written; so a peer may read it until ``release_held``.
        """
        if not 0 <= num_blocks <= len(seq.block_table):
            raise ValueError(f"{seq.request_id}: cannot hold {num_blocks} of its {len(seq.block_table)} blocks")
        held = list(seq.block_table[:num_blocks])
        for block_id in held:
            self.pool.share(block_id)
        return held

    def release_held(self, block_ids: list[int]) -> None:
        """Drop the references ``hold`` took."""
        for block_id in block_ids:
            self.pool.release(block_id)

    def take_finished_offers(self) -> list[RemotePrefill]:
        """P/D decode side: prefill offers read or not needed; the engine releases them."""
        return self.transfers.take_finished_offers()

    def is_loading(self, seq: CacheSequence, started_is_enough: bool = False) -> bool:
        """True while the sequence waits for fills. ``started_is_enough`` is the test-only fault mode."""
        return self.transfers.is_loading(seq, started_is_enough)

    def expired_loads(self) -> list[CacheSequence]:
        """Sequences whose fills exceeded the transfer timeout: the scheduler preempts them (cache miss)."""
        return self.transfers.expired_loads()

    # ---- after each step: register full blocks ------------------------------------------

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
            block = self.pool.blocks[seq.block_table[index]]
            if self.index.has_device(block_hash) or block.block_hash is not None:
                continue  # an identical block is already cached; this copy stays private
            self.pool.register(block.block_id, block_hash)
            if self.transfers.should_write_through(block_hash):
                to_store.append(block)
        self.transfers.write_back_device(to_store)

    # ---- transfers (TransferPlanner) ----------------------------------------------------

    def offload(self) -> None:
        """Swap cold cached device blocks out to the host tier (or storage) before they are evicted."""
        self.transfers.offload()

    def overdue_transfers(self) -> list[TransferTask]:
        """In-flight tasks past their deadline, oldest first; the caller restarts the transfer process."""
        return self.transfers.overdue_transfers()

    def on_transfer_started(self, task_id: int) -> None:
        self.transfers.on_transfer_started(task_id)

    def on_transfer_done(self, done: TransferDone) -> None:
        self.transfers.on_transfer_done(done)

    def fail_all_transfers(self) -> None:
        """The transfer process died: nothing is copying any more, so every in-flight block is released."""
        self.transfers.fail_all_transfers()

    # ---- resets -----------------------------------------------------------------------

    def reset(self) -> int:
        """Forget the device and host tiers' cached prefixes (storage is kept). Returns blocks dropped."""
        return self.pool.drop_cached() + self.host.drop_cached()

    def drop_host_tier(self) -> None:
        """The host pool's memory is gone (its process died): forget every host block."""
        self.host.forget_all()

    def forget_device_contents(self) -> None:
        """The device pool's memory was recreated (worker restart): no cached prefix is valid any more.

        Call after every sequence holding blocks was freed and every transfer failed.
        """
        self.index.clear_device()
        self.pool.forget_all()

    def summary(self) -> dict[str, int | float]:
        return {
            "kv_blocks_free": self.pool.num_never_cached_free,
            "kv_blocks_cached": self.pool.num_evictable,
            "host_blocks_used": self.host.num_used,
            "storage_blocks_known": self.transfers.num_stored,
            "transfers_in_flight": self.transfers.num_in_flight,
            "fork_shared_blocks": self.num_fork_shared_blocks,
            "fork_copied_blocks": self.num_fork_copied_blocks,
            **self.stats.__dict__,
        }
