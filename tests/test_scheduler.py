"""Scheduler and block-manager decisions, driven by hand-made step results."""
from __future__ import annotations

import pytest

from cache_manager.kv_cache_manager import BlockAllocationError, KVCacheManager
from config.engine_config import CacheConfig
from config.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from inter_communicator.messages import StepBatch, StepResult

EOS = 2


def make_seq(rid: str, prompt_len: int, max_tokens: int = 8, **params) -> Sequence:
    return Sequence(rid, list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens, **params),
                    eos_token_ids=(EOS,))


def kv_cache_manager(num_blocks: int, block_size: int, prefix_caching: bool = False) -> KVCacheManager:
    return KVCacheManager(CacheConfig(num_blocks, block_size, "fp", enable_prefix_caching=prefix_caching))


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8, budget: int = 32,
                   max_model_len: int = 128, prefix_caching: bool = False) -> Scheduler:
    return Scheduler(kv_cache_manager(num_blocks, block_size, prefix_caching), max_num_seqs, budget, max_model_len)


def answer(batch: StepBatch, token: int = 7) -> StepResult:
    """The worker's reply: one token for every sequence that asked to sample."""
    return StepResult(batch.step_id, sampled_token_ids={s.request_id: token for s in batch.seqs if s.needs_sample})


def test_chunked_prefill_respects_token_budget_and_samples_only_at_the_end():
    sched = make_scheduler(budget=8)
    sched.add(make_seq("a", prompt_len=20))
    chunks = []
    while True:
        batch = sched.schedule()
        seq = batch.seqs[0]
        chunks.append((len(seq.token_ids), seq.context_len, seq.needs_sample))
        sched.update(answer(batch))
        if seq.needs_sample:
            break
    assert chunks == [(8, 8, False), (8, 16, False), (4, 20, True)]
    decode = sched.schedule().seqs[0]
    assert decode.token_ids == [7] and decode.context_len == 21 and decode.needs_sample


def test_new_requests_join_running_decodes_and_decodes_come_first():
    sched = make_scheduler(budget=16)
    sched.add(make_seq("a", prompt_len=4))
    sched.update(answer(sched.schedule()))
    sched.add(make_seq("b", prompt_len=10))
    batch = sched.schedule()
    assert [(s.request_id, len(s.token_ids)) for s in batch.seqs] == [("a", 1), ("b", 10)]


def test_max_num_seqs_limits_running():
    sched = make_scheduler(max_num_seqs=2, budget=100)
    for rid in "abc":
        sched.add(make_seq(rid, prompt_len=3))
    batch = sched.schedule()
    assert {s.request_id for s in batch.seqs} == {"a", "b"}
    assert sched.num_waiting == 1


def test_finish_on_eos_excludes_eos_and_frees_blocks():
    sched = make_scheduler()
    sched.add(make_seq("a", prompt_len=5))
    outputs = sched.update(answer(sched.schedule(), token=11))
    assert outputs[0].new_token_ids == [11] and not outputs[0].finished
    outputs = sched.update(answer(sched.schedule(), token=EOS))
    assert outputs[0].finished and outputs[0].finish_reason == "stop" and outputs[0].new_token_ids == []
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks
    assert not sched.has_work()


def test_ignore_eos_and_max_tokens_give_length():
    sched = make_scheduler()
    sched.add(make_seq("a", prompt_len=5, max_tokens=3, ignore_eos=True))
    tokens, reason = [], None
    while sched.has_work():
        for out in sched.update(answer(sched.schedule(), token=EOS)):
            tokens += out.new_token_ids
            reason = out.finish_reason
    assert tokens == [EOS, EOS, EOS] and reason == "length"


def test_stop_token_ids_finish_with_stop():
    sched = make_scheduler()
    sched.add(make_seq("a", prompt_len=5, stop_token_ids=[9]))
    out = sched.update(answer(sched.schedule(), token=9))[0]
    assert out.finished and out.finish_reason == "stop"


def test_preemption_frees_blocks_and_recomputes_with_outputs():
    # 4 blocks of 4 tokens: two 8-token prompts fill 2 blocks each; the first decode needs a third block.
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64)
    sched.add(make_seq("a", prompt_len=8))
    sched.add(make_seq("b", prompt_len=8))
    sched.update(answer(sched.schedule(), token=20))
    batch = sched.schedule()  # each decode needs a 3rd block: b (last admitted) is preempted for a
    assert [s.request_id for s in batch.seqs] == ["a"]
    b = sched.waiting[0]
    assert b.request_id == "b" and b.status is SequenceStatus.WAITING and b.block_table == []
    assert b.num_computed_tokens == 0 and b.output_token_ids == [20] and sched.num_preemptions == 1
    sched.update(answer(batch, token=21))
    sched.abort("a")
    batch = sched.schedule()
    recompute = batch.seqs[0]
    # Recompute covers the prompt and the token generated before preemption, then samples the next one.
    assert recompute.request_id == "b" and recompute.token_ids == list(range(10, 18)) + [20]
    assert recompute.needs_sample and recompute.num_output_tokens == 1


def test_abort_removes_and_frees():
    sched = make_scheduler()
    sched.add(make_seq("a", prompt_len=9))
    batch = sched.schedule()
    assert sched.abort("a") is not None
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks
    assert sched.update(answer(batch)) == []  # the in-flight result of an aborted request is dropped
    assert sched.abort("a") is None


def test_prompt_too_long_is_rejected_with_an_error_output():
    sched = make_scheduler(max_model_len=16)
    out = sched.add(make_seq("a", prompt_len=16))
    assert out.finished and out.finish_reason == "error" and "maximum model length" in out.error
    assert not sched.has_work()


def test_max_model_len_ends_generation_with_length():
    sched = make_scheduler(max_model_len=8)
    sched.add(make_seq("a", prompt_len=6, max_tokens=100))
    reasons = []
    while sched.has_work():
        reasons += [o.finish_reason for o in sched.update(answer(sched.schedule()))]
    assert reasons[-1] == "length"


def test_kv_cache_allocation_is_all_or_nothing():
    kv = kv_cache_manager(num_blocks=3, block_size=4)
    seq = make_seq("a", prompt_len=1)
    kv.allocate(seq, 8)
    assert len(seq.block_table) == 2
    with pytest.raises(BlockAllocationError):
        kv.allocate(seq, 16)
    assert len(seq.block_table) == 2 and kv.num_free_blocks == 1
    kv.free(seq)
    assert kv.num_free_blocks == 3


def test_waiting_request_whose_prefix_match_leaves_too_few_blocks_keeps_waiting():
    # Issue 10: the next turn of a chat hits 3 cached blocks, which were counted as free, and its first
    # 4-token chunk after them needs a 4th block. It must wait for blocks, not crash the engine.
    sched = make_scheduler(num_blocks=6, block_size=4, budget=4, prefix_caching=True)
    sched.add(make_seq("a", prompt_len=13, max_tokens=1))
    while sched.has_work():
        sched.update(answer(sched.schedule()))
    sched.add(Sequence("hog", list(range(100, 111)), SamplingParams(max_tokens=3), eos_token_ids=(EOS,)))
    for _ in range(3):
        sched.update(answer(sched.schedule()))  # hog takes the 3 never-used blocks
    assert sched.kv_cache.num_free_blocks == 3 and sched.kv_cache.summary()["kv_blocks_cached"] == 3
    turn = make_seq("b", prompt_len=17, max_tokens=1)  # a's prompt + 4 more tokens
    sched.add(turn)
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["hog"] and turn.block_table == []
    sched.update(answer(batch, token=EOS))  # hog ends: its blocks are free again
    batch = sched.schedule()
    assert [(s.request_id, s.context_len) for s in batch.seqs] == [("b", 16)]
    assert turn.num_cached_tokens == 12


def test_prompt_that_can_never_fit_the_pool_is_rejected():
    sched = make_scheduler(num_blocks=2, block_size=4)
    out = sched.add(make_seq("a", prompt_len=9))
    assert out.finished and out.finish_reason == "error" and "needs 3 KV blocks" in out.error
    assert "the pool has 2" in out.error and not sched.has_work()


def test_lone_sequence_that_outgrows_the_pool_ends_with_an_error_instead_of_looping():
    sched = make_scheduler(num_blocks=2, block_size=4, budget=4)
    sched.add(make_seq("a", prompt_len=6, max_tokens=100, ignore_eos=True))
    outputs = []
    for _ in range(20):
        batch = sched.schedule()
        if batch is None:
            break
        outputs += sched.update(answer(batch))
    # 8 tokens fill both blocks; the 9th would need a third.
    assert outputs[-1].finished and outputs[-1].finish_reason == "error"
    assert "needs 3 KV blocks" in outputs[-1].error and "the pool has 2" in outputs[-1].error
    assert sum(len(o.new_token_ids) for o in outputs) == 3 and sched.num_preemptions == 0
    assert not sched.has_work() and sched.kv_cache.num_free_blocks == 2
