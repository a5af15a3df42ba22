"""KVCacheManager decisions: sharing, eviction, tiers, block states, quarantine.

The cache transfer process is the boundary here: tasks the manager submits are
collected, and the test answers them the way the real process does (its own
tests in test_cache_transfer.py and the server tests cover the real copies).
"""
from __future__ import annotations

import numpy as np
import pytest

from cache_manager.block_hash import hash_full_blocks
from cache_manager.block_pool import BlockAllocationError, BlockPool
from cache_manager.block_state import BlockState
from cache_manager.kv_cache_manager import KVCacheManager
from cache_manager.prefix_index import PrefixIndex
from config.engine_config import CacheConfig
from config.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from inter_communicator.messages import StepResult, TransferDone, TransferTask

BS = 4


class TransferLog:
    def __init__(self) -> None:
        self.tasks: list[TransferTask] = []

    def __call__(self, task: TransferTask) -> None:
        self.tasks.append(task)

    def pop(self, kind: str) -> TransferTask:
        for i, task in enumerate(self.tasks):
            if task.kind == kind:
                return self.tasks.pop(i)
        raise AssertionError(f"no {kind} task in {[t.kind for t in self.tasks]}")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def manager(num_blocks: int = 16, num_cpu_blocks: int = 0, storage: bool = False, policy: str = "write_through",
            watermark: float = 0.0, clock: Clock | None = None) -> tuple[KVCacheManager, TransferLog, np.ndarray]:
    log = TransferLog()
    states = np.zeros(num_blocks, np.int8)
    config = CacheConfig(num_blocks, BS, "fp", num_cpu_blocks=num_cpu_blocks, storage_enabled=storage,
                         write_policy=policy, offload_watermark=watermark, transfer_timeout_s=10.0)
    return KVCacheManager(config, states, submit=log, clock=clock or Clock()), log, states


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=4), eos_token_ids=(2,))


def run_prefill(cache: KVCacheManager, s: Sequence) -> None:
    """Admit, allocate and 'compute' the whole prompt, as scheduler + worker would."""
    cache.admit(s)
    cache.allocate(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    cache.on_tokens_computed(s)


PROMPT = list(range(100, 114))  # 14 tokens: 3 full blocks + 2


def stored_then_reset(cache: KVCacheManager, log: TransferLog) -> int:
    """PROMPT prefilled, its 3 full blocks written to storage, freed, then the device cache reset: the next
    PROMPT is a storage hit. Returns what ``reset`` dropped."""
    a = seq("a", PROMPT)
    run_prefill(cache, a)
    cache.on_transfer_done(TransferDone(log.pop("write_back").task_id, "write_back", ok=[True] * 3))
    cache.free(a)
    return cache.reset()


def test_chained_hash_depends_on_prefix_and_model():
    a = hash_full_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4, "m1")
    b = hash_full_blocks([9, 2, 3, 4, 5, 6, 7, 8], 4, "m1")
    c = hash_full_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4, "m2")
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # the second block differs through its parent
    assert a[0] != c[0]


def test_block_pool_keeps_a_block_with_a_copy_in_flight_until_the_copy_ends():
    index, states = PrefixIndex(), np.zeros(2, np.int8)
    pool = BlockPool(2, index, states)
    a = pool.take()
    pool.register(a, "h")
    pool.begin_copy(a, task_id=1, state=BlockState.WRITE_BACK)
    pool.release(a)  # no reference left, but the copy still reads it
    assert states[a] == BlockState.WRITE_BACK and pool.num_free == 1
    pool.take()
    with pytest.raises(BlockAllocationError):
        pool.take()
    pool.end_copy(a)
    assert states[a] == BlockState.CACHED and pool.num_free == 1 and index.device_block("h") == a
    assert pool.take() == a and index.device_block("h") is None  # evicted: no longer matchable
    assert states[a] == BlockState.IN_USE


def test_second_request_shares_full_prompt_blocks():
    cache, _, states = manager()
    first = seq("a", PROMPT)
    run_prefill(cache, first)
    second = seq("b", PROMPT + [7, 7])
    cache.admit(second)
    assert second.num_computed_tokens == 3 * BS and second.num_cached_tokens == 3 * BS
    assert second.block_table[:3] == first.block_table[:3]
    assert all(states[b] == BlockState.IN_USE for b in second.block_table)


def test_at_least_one_prompt_token_is_recomputed():
    cache, _, _ = manager()
    run_prefill(cache, seq("a", PROMPT[:12]))
    again = seq("b", PROMPT[:12])  # exactly 3 full blocks
    cache.admit(again)
    assert again.num_computed_tokens == 2 * BS


def test_freed_blocks_stay_cached_and_lru_evicts_oldest_first():
    cache, _, states = manager(num_blocks=8)
    a = seq("a", PROMPT[:9])
    run_prefill(cache, a)
    cache.free(a)
    assert [states[b] for b in range(8)].count(BlockState.CACHED) == 2
    assert cache.num_free_blocks == 8 and cache.num_cached_blocks == 2
    hog = seq("hog", list(range(500, 524)))  # needs 6 blocks: the 6 never-used ones first
    cache.allocate(hog, 24)
    assert cache.num_cached_blocks == 2
    cache.allocate(hog, 28)  # one more: evicts the least recently used cached block
    assert cache.num_cached_blocks == 1


def test_write_through_writes_each_new_full_block_once():
    cache, log, states = manager(storage=True)
    a = seq("a", PROMPT)
    run_prefill(cache, a)
    task = log.pop("write_back")
    assert task.device_block_ids == a.block_table[:3] and len(task.storage_keys) == 3
    assert all(states[b] == BlockState.WRITE_BACK for b in task.device_block_ids)
    cache.free(a)
    # Still being copied out: not reusable, not cached-evictable.
    assert cache.num_free_blocks == 16 - 3
    cache.on_transfer_done(TransferDone(task.task_id, "write_back", ok=[True] * 3))
    assert all(states[b] == BlockState.CACHED for b in task.device_block_ids)
    run_prefill(cache, seq("b", PROMPT + [1]))
    assert not log.tasks  # already stored: no second write


def test_storage_hit_after_reset_is_prefetched_before_scheduling():
    cache, log, states = manager(storage=True)
    assert stored_then_reset(cache, log) == 3
    b = seq("b", PROMPT)
    cache.admit(b)
    task = log.pop("prefetch")
    assert len(task.device_block_ids) == 3 and cache.is_loading(b)
    assert all(states[d] == BlockState.LOAD for d in task.device_block_ids)
    cache.on_transfer_started(task.task_id)
    assert cache.is_loading(b) and not cache.is_loading(b, started_is_enough=True)
    cache.on_transfer_done(TransferDone(task.task_id, "prefetch", ok=[True] * 3))
    assert not cache.is_loading(b)
    assert b.num_computed_tokens == 3 * BS and b.num_cached_tokens == 3 * BS
    assert cache.stats.storage_hit_tokens == 3 * BS
    assert all(states[d] == BlockState.IN_USE for d in task.device_block_ids)


def test_failed_prefetch_recomputes_from_the_first_missing_block():
    cache, log, _ = manager(storage=True)
    stored_then_reset(cache, log)
    b = seq("b", PROMPT)
    cache.admit(b)
    task = log.pop("prefetch")
    cache.on_transfer_done(TransferDone(task.task_id, "prefetch", ok=[True, False, True]))
    assert b.num_computed_tokens == BS and b.num_cached_tokens == BS
    assert cache.stats.storage_miss_blocks == 1
    # Only the verified prefix is shared; the missing block is no longer believed stored,
    # so nothing after it is fetched and it is written again once recomputed.
    c = seq("c", PROMPT)
    cache.admit(c)
    assert c.block_table == b.block_table[:1] and c.num_computed_tokens == BS
    assert not cache.is_loading(c)


def test_fill_of_an_aborted_request_keeps_its_blocks_quarantined():
    cache, log, states = manager(num_blocks=6, storage=True)
    stored_then_reset(cache, log)
    b = seq("b", PROMPT)
    cache.admit(b)
    task = log.pop("prefetch")
    cache.free(b)  # aborted while its blocks are being filled
    assert cache.num_free_blocks == 6 - 3
    assert all(states[d] == BlockState.LOAD for d in task.device_block_ids)
    cache.on_transfer_done(TransferDone(task.task_id, "prefetch", ok=[True] * 3))
    assert cache.num_free_blocks == 6
    assert all(states[d] == BlockState.FREE for d in task.device_block_ids)


def test_host_tier_swap_out_then_swap_in():
    cache, log, states = manager(num_blocks=8, num_cpu_blocks=4, watermark=1.0)
    a = seq("a", PROMPT)
    run_prefill(cache, a)
    cache.free(a)
    cache.offload()  # watermark 100%: every cold cached block goes to the host
    out = log.pop("swap_out")
    assert len(out.device_block_ids) == 3 and len(set(out.host_block_ids)) == 3
    assert all(states[d] == BlockState.SWAP_OUT for d in out.device_block_ids)
    b = seq("b", PROMPT)
    cache.admit(b)
    assert b.num_computed_tokens == 0 and not log.tasks  # moving blocks are not matchable
    cache.free(b)
    cache.on_transfer_done(TransferDone(out.task_id, "swap_out", ok=[True] * 3))
    assert all(states[d] == BlockState.FREE for d in out.device_block_ids)
    c = seq("c", PROMPT)
    cache.admit(c)
    back = log.pop("swap_in")
    assert sorted(back.host_block_ids) == sorted(out.host_block_ids)
    cache.on_transfer_done(TransferDone(back.task_id, "swap_in", ok=[True] * 3))
    assert c.num_computed_tokens == 3 * BS and cache.stats.host_hit_tokens == 3 * BS


def test_write_back_policy_stores_blocks_evicted_from_the_host():
    cache, log, _ = manager(num_blocks=8, num_cpu_blocks=1, storage=True, policy="write_back", watermark=1.0)
    a = seq("a", PROMPT[:5])  # one full block
    run_prefill(cache, a)
    assert not log.tasks  # write_back: nothing stored while the block is in use
    cache.free(a)
    cache.offload()
    first = log.pop("swap_out")
    cache.on_transfer_done(TransferDone(first.task_id, "swap_out", ok=[True]))
    b = seq("b", list(range(300, 305)))
    run_prefill(cache, b)
    cache.free(b)
    cache.offload()  # the single host block is reused: its old content goes to storage first
    write = log.pop("write_back")
    assert write.host_block_ids == first.host_block_ids and write.device_block_ids == []


def test_scheduler_does_not_run_a_request_while_its_blocks_load():
    cache, log, _ = manager(storage=True)
    sched = Scheduler(cache, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    sched.add(seq("a", PROMPT))
    batch = sched.schedule()
    sched.update(StepResult(batch.step_id, sampled_token_ids={"a": 5}))
    cache.on_transfer_done(TransferDone(log.pop("write_back").task_id, "write_back", ok=[True] * 3))
    sched.abort("a")
    cache.reset()
    sched.add(seq("b", PROMPT))
    assert sched.schedule() is None  # b's prefix is loading
    task = log.pop("prefetch")
    cache.on_transfer_done(TransferDone(task.task_id, "prefetch", ok=[True] * 3))
    batch = sched.schedule()
    assert batch.seqs[0].token_ids == PROMPT[12:] and batch.seqs[0].context_len == 14
    out = sched.update(StepResult(batch.step_id, sampled_token_ids={"b": 9}))[0]
    assert out.num_cached_tokens == 12


def test_offload_counts_blocks_already_moving_to_the_host():
    cache, log, _ = manager(num_blocks=8, num_cpu_blocks=8, watermark=0.5)  # keep 4 blocks free
    hog = seq("hog", list(range(600, 624)))  # 6 blocks, all cached once freed
    run_prefill(cache, hog)
    cache.free(hog)
    filler = seq("filler", list(range(700, 708)))
    cache.allocate(filler, 8)  # takes the 2 never-used blocks: 0 free, 5 cached (+1 private)
    cache.offload()
    first = log.pop("swap_out")
    assert len(first.device_block_ids) == 4
    cache.offload()  # the 4 in flight already cover the watermark: no second victim set
    assert not [t for t in log.tasks if t.kind == "swap_out"]


def test_admission_counts_evictable_hits_and_the_first_chunk_after_the_prefix():
    # Issue 10: 3 cached blocks are "free" until shared; a 4-token first chunk after the 12 cached tokens
    # then needs a 4th block. Checking the prompt's first chunk before the match said 1 block, 3 free.
    cache, _, states = manager(num_blocks=6)
    a = seq("a", PROMPT)
    run_prefill(cache, a)
    cached = a.block_table[:3]
    cache.free(a)
    hog = seq("hog", list(range(500, 512)))
    cache.allocate(hog, 12)  # 3 never-used blocks: what is left is the 3 cached ones
    assert cache.num_free_blocks == 3 and cache.num_cached_blocks == 3
    b = seq("b", PROMPT + [7, 7, 7])  # 17 tokens: 3 blocks hit, 5 tokens to compute
    before = states.copy()
    assert not cache.try_admit(b, max_new_tokens=4)
    # Nothing happened: no block shared, nothing counted, the cached blocks still evictable.
    assert b.block_table == [] and b.num_computed_tokens == 0 and cache.stats.device_hit_tokens == 0
    assert (states == before).all() and cache.num_free_blocks == 3
    cache.free(hog)
    assert cache.try_admit(b, max_new_tokens=4)
    assert b.num_computed_tokens == 12 and b.block_table == cached
    assert cache.try_allocate(b, 12 + 4) and len(b.block_table) == 4


def test_admission_drops_lower_tier_fills_that_do_not_fit_with_the_first_chunk():
    cache, log, _ = manager(num_blocks=4, storage=True)
    stored_then_reset(cache, log)
    hog = seq("hog", list(range(500, 504)))
    cache.allocate(hog, 4)  # 3 of 4 blocks left
    b = seq("b", PROMPT + [7, 7, 7])
    # 3 prefetched blocks + a 4th for the chunk after them do not fit; 2 fills + the chunk's block do.
    assert cache.try_admit(b, max_new_tokens=4)
    task = log.pop("prefetch")
    assert len(task.device_block_ids) == 2 and b.num_computed_tokens == 2 * BS
    cache.on_transfer_done(TransferDone(task.task_id, "prefetch", ok=[True, True]))
    assert cache.try_allocate(b, 2 * BS + 4) and cache.num_free_blocks == 0


def test_swaps_and_write_backs_get_a_deadline_and_overdue_ones_stay_quarantined():
    clock = Clock()
    cache, log, states = manager(num_blocks=12, num_cpu_blocks=8, storage=True, watermark=1.0, clock=clock)
    a = seq("a", PROMPT)
    run_prefill(cache, a)  # write_through of its 3 full blocks
    cache.on_transfer_done(TransferDone(log.pop("write_back").task_id, "write_back", ok=[True] * 3))
    cache.free(a)
    cache.offload()
    out = log.pop("swap_out")
    cache.on_transfer_done(TransferDone(out.task_id, "swap_out", ok=[True] * 3))
    clock.now += 1
    b = seq("b", PROMPT)
    cache.admit(b)
    swap_in = log.pop("swap_in")
    clock.now += 1
    c = seq("c", list(range(300, 309)))
    run_prefill(cache, c)
    write = log.pop("write_back")
    clock.now += 1
    d = seq("d", list(range(400, 405)))
    run_prefill(cache, d)
    cache.on_transfer_done(TransferDone(log.pop("write_back").task_id, "write_back", ok=[True]))
    cache.free(d)
    cache.offload()
    out2 = log.pop("swap_out")
    assert cache.overdue_transfers() == []
    clock.now += 9.5  # swap_in and write were issued more than 10 s ago, out2 not yet
    assert [t.task_id for t in cache.overdue_transfers()] == [swap_in.task_id, write.task_id]
    clock.now += 5
    overdue = cache.overdue_transfers()
    assert [t.task_id for t in overdue] == [swap_in.task_id, write.task_id, out2.task_id]
    assert cache.stats.transfers_overdue == 3  # each task counted once however often it is seen
    assert cache.summary()["transfers_overdue"] == 3
    # Still quarantined: the copy may still be running in the transfer process.
    assert all(states[i] == BlockState.SWAP_IN for i in swap_in.device_block_ids)
    assert all(states[i] == BlockState.WRITE_BACK for i in write.device_block_ids)
    assert all(states[i] == BlockState.SWAP_OUT for i in out2.device_block_ids)
    assert cache.is_loading(b)
    cache.free(b)
    cache.free(c)
    cache.fail_all_transfers()  # what the engine does after restarting the transfer process
    assert cache.summary()["transfers_in_flight"] == 0 and cache.overdue_transfers() == []
    assert cache.num_free_blocks == 12 and all(h.pinned == 0 for h in cache.host.blocks)
    host_free = sorted(cache.host._free)
    assert len(set(host_free)) == len(host_free)
    # The old process's completions arrive after all: unknown ids, ignored, nothing released twice.
    for task in (swap_in, write, out2):
        cache.on_transfer_done(TransferDone(task.task_id, task.kind, ok=[True] * 3))
    assert cache.num_free_blocks == 12 and sorted(cache.host._free) == host_free
    assert all(states[i] in (BlockState.FREE, BlockState.CACHED) for i in range(12))


def test_late_fill_completion_after_a_timeout_releases_the_blocks():
    clock = Clock()
    cache, log, states = manager(num_blocks=7, storage=True, clock=clock)
    sched = Scheduler(cache, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    stored_then_reset(cache, log)
    b = seq("b", PROMPT)
    sched.add(b)
    assert sched.schedule() is None
    task = log.pop("prefetch")
    clock.now += 11
    assert cache.overdue_transfers() == [task]
    # The scheduler preempts b for its expired fills, then recomputes it without the storage tier in the
    # 4 other blocks: the 3 blocks being filled stay quarantined.
    batch = sched.schedule()
    assert cache.stats.transfer_timeouts == 1 and b.num_preemptions == 1 and cache.num_free_blocks == 0
    assert batch.seqs[0].context_len == 14 and not log.tasks
    cache.on_transfer_done(TransferDone(task.task_id, "prefetch", ok=[True] * 3))
    assert all(states[d] == BlockState.FREE for d in task.device_block_ids)
    assert cache.num_free_blocks == 3  # b holds 4 blocks
