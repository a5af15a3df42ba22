"""Scheduler and block-manager decisions, driven by hand-made step results."""
from __future__ import annotations

import pytest

from cache_manager.kv_cache_manager import BlockAllocationError, KVCacheManager
from config.engine_config import CacheConfig
from config.sampling_params import SamplingParams
from engine.scheduler import STRUCTURED_OUTPUT_UNAVAILABLE, Scheduler
from engine.sequence import Sequence, SequenceStatus, make_choices
from inter_communicator.messages import StepBatch, StepResult, TokenLogprobs

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


def test_a_lone_prompt_takes_the_lone_budget_until_another_request_arrives():
    sched = Scheduler(kv_cache_manager(64, 4), 8, 8, 128, lone_prefill_tokens=32)
    sched.add(make_seq("a", prompt_len=70))
    batch = sched.schedule()
    assert [len(s.token_ids) for s in batch.seqs] == [32]  # alone: the larger budget
    sched.update(answer(batch))
    sched.add(make_seq("b", prompt_len=5))
    batch = sched.schedule()  # two requests: back to 8 tokens in all
    assert sum(len(s.token_ids) for s in batch.seqs) == 8 and batch.seqs[0].request_id == "a"
    sched.update(answer(batch))
    sched.abort("b")
    batch = sched.schedule()  # alone again
    assert [(s.request_id, len(s.token_ids)) for s in batch.seqs] == [("a", 30)]


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


def test_finish_on_eos_keeps_eos_as_the_last_token_and_frees_blocks():
    sched = make_scheduler()
    sched.add(make_seq("a", prompt_len=5))
    outputs = sched.update(answer(sched.schedule(), token=11))
    assert outputs[0].new_token_ids == [11] and not outputs[0].finished
    outputs = sched.update(answer(sched.schedule(), token=EOS))
    # vLLM's rule: the stopping token is the output's last token (the API shows no text for it).
    assert outputs[0].finished and outputs[0].finish_reason == "stop" and outputs[0].new_token_ids == [EOS]
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
    assert out.finished and out.finish_reason == "stop" and out.new_token_ids == [9]


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


# ---- sampling context, logprobs, min_tokens --------------------------------------------------------


def test_sampling_context_is_sent_only_when_the_request_uses_it():
    sched = make_scheduler()
    sched.add(make_seq("plain", prompt_len=3))
    sched.add(make_seq("rep", prompt_len=3, repetition_penalty=1.2))
    sched.add(make_seq("freq", prompt_len=3, frequency_penalty=0.5))
    sched.add(make_seq("bad", prompt_len=3, bad_words_token_ids=[[5, 6]]))
    sched.add(make_seq("min", prompt_len=3, min_tokens=2, stop_token_ids=[9]))
    sched.add(make_seq("min_ignore_eos", prompt_len=3, min_tokens=1, ignore_eos=True))
    msgs = {s.request_id: s for s in sched.schedule().seqs}
    assert (msgs["plain"].prompt_token_ids, msgs["plain"].output_token_ids, msgs["plain"].banned_token_ids) == \
        (None, None, None)
    assert msgs["rep"].prompt_token_ids == [10, 11, 12] and msgs["rep"].output_token_ids == []
    assert msgs["freq"].prompt_token_ids is None and msgs["freq"].output_token_ids == []
    assert msgs["bad"].output_token_ids == [] and msgs["bad"].banned_token_ids is None
    assert msgs["min"].banned_token_ids == [EOS, 9]
    assert msgs["min_ignore_eos"].banned_token_ids is None  # eos does not stop it: nothing to ban
    sched.update(StepResult(sched.num_steps, sampled_token_ids={r: 30 for r in msgs}))
    msgs = {s.request_id: s for s in sched.schedule().seqs}
    assert msgs["rep"].output_token_ids == [30] and msgs["freq"].output_token_ids == [30]
    assert msgs["min"].banned_token_ids == [EOS, 9]  # 1 token < min_tokens 2
    assert msgs["plain"].output_token_ids is None
    sched.update(StepResult(sched.num_steps, sampled_token_ids={r: 31 for r in msgs}))
    msgs = {s.request_id: s for s in sched.schedule().seqs}
    assert msgs["min"].banned_token_ids is None and msgs["rep"].output_token_ids == [30, 31]


def test_min_tokens_makes_eos_an_ordinary_token_until_reached():
    sched = make_scheduler()
    sched.add(make_seq("a", prompt_len=3, min_tokens=2, max_tokens=5))
    first = sched.update(answer(sched.schedule(), token=EOS))[0]
    assert first.new_token_ids == [EOS] and not first.finished
    second = sched.update(answer(sched.schedule(), token=EOS))[0]
    assert second.new_token_ids == [EOS] and not second.finished
    third = sched.update(answer(sched.schedule(), token=EOS))[0]
    assert third.finished and third.finish_reason == "stop" and third.new_token_ids == [EOS]


def lp(token: int, logprob: float = -1.0) -> TokenLogprobs:
    return TokenLogprobs(token, logprob, 1)


def test_sampled_token_logprobs_follow_the_emitted_tokens_including_the_stop_token():
    sched = make_scheduler()
    sched.add(make_seq("a", prompt_len=3, logprobs=2))
    sched.add(make_seq("off", prompt_len=3))
    batch = sched.schedule()
    outs = {o.request_id: o for o in sched.update(StepResult(
        batch.step_id, sampled_token_ids={"a": 20, "off": 20}, logprobs={"a": lp(20, -0.25), "off": lp(20)}))}
    assert outs["a"].logprobs == [lp(20, -0.25)] and outs["off"].logprobs is None
    batch = sched.schedule()
    outs = {o.request_id: o for o in sched.update(StepResult(
        batch.step_id, sampled_token_ids={"a": EOS, "off": 21}, logprobs={"a": lp(EOS)}))}
    assert outs["a"].finish_reason == "stop" and outs["a"].new_token_ids == [EOS] and outs["a"].logprobs == [lp(EOS)]


def prompt_lp_answer(batch: StepBatch, prompts: dict[str, list[int]], token: int = 7) -> StepResult:
    """A worker that also returns prompt logprobs: one entry per prompt position each chunk predicts."""
    result = answer(batch, token)
    for s in batch.seqs:
        if s.prompt_logprobs is None:
            continue
        start = s.context_len - len(s.token_ids)
        count = len(s.token_ids) - (0 if s.next_prompt_token_id is not None else 1)
        result.prompt_logprobs[s.request_id] = [lp(prompts[s.request_id][start + 1 + j], -0.1 * (start + 1 + j))
                                                for j in range(count)]
    return result


def test_prompt_logprobs_skip_the_prefix_cache_and_are_sent_once_with_the_first_token():
    sched = make_scheduler(block_size=4, budget=5, prefix_caching=True)
    prompt = list(range(10, 22))  # 12 tokens: 3 full blocks
    sched.add(make_seq("warm", prompt_len=12, max_tokens=1))
    while sched.has_work():
        sched.update(answer(sched.schedule()))
    seq = make_seq("a", prompt_len=12, max_tokens=2, prompt_logprobs=3)
    sched.add(seq)
    chunks, outputs = [], []
    while sched.has_work():
        batch = sched.schedule()
        s = batch.seqs[0]
        chunks.append((s.context_len - len(s.token_ids), s.context_len, s.next_prompt_token_id, s.prompt_logprobs))
        outputs += sched.update(prompt_lp_answer(batch, {"a": prompt}))
    # Every prompt position computed although 2 blocks were cached; each chunk names the token after it.
    assert chunks[:3] == [(0, 5, 15, 3), (5, 10, 20, 3), (10, 12, None, 3)]
    assert chunks[3][3] is None  # decode steps ask for nothing
    assert seq.num_cached_tokens == 0
    assert outputs[0].prompt_logprobs[0] is None
    assert [(e.token_id, round(e.logprob, 6)) for e in outputs[0].prompt_logprobs[1:]] == \
        [(prompt[i], round(-0.1 * i, 6)) for i in range(1, 12)]
    assert outputs[1].prompt_logprobs is None


# ---- n > 1: one prefill, forked choices ------------------------------------------------------------


def add_choices(sched: Scheduler, rid: str, prompt_len: int, n: int, **params) -> Sequence:
    parent = make_choices(rid, list(range(10, 10 + prompt_len)), SamplingParams(n=n, **params), (EOS,))
    assert sched.add(parent) is None
    return parent


def test_n_choices_prefill_once_share_full_blocks_and_copy_the_partial_one():
    sched = make_scheduler(block_size=4, budget=64)
    parent = add_choices(sched, "req", prompt_len=10, n=3, max_tokens=2, seed=7)
    prefill = sched.schedule()
    # The parent alone computes the prompt but its last token: 9 tokens, 3 blocks (2 full + 1 partial).
    assert [(s.request_id, len(s.token_ids), s.needs_sample) for s in prefill.seqs] == [("req", 9, False)]
    assert sched.update(answer(prefill)) == []
    fork = sched.schedule()
    assert [(s.request_id, s.token_ids, s.context_len, s.needs_sample) for s in fork.seqs] == \
        [(rid, [19], 10, True) for rid in ("req", "req#1", "req#2")]
    tables = {s.request_id: s.block_table for s in fork.seqs}
    full = parent.block_table[:2]
    assert tables["req#1"][:2] == full and tables["req#2"][:2] == full
    assert [b.ref_count for b in (sched.kv_cache.pool.blocks[i] for i in full)] == [3, 3]
    partial = parent.block_table[2]
    assert fork.block_copies == [(partial, tables["req#1"][2]), (partial, tables["req#2"][2])]
    assert len({tables["req"][2], tables["req#1"][2], tables["req#2"][2]}) == 3
    assert sched.kv_cache.num_used_blocks == 5  # 3 separate requests would hold 9
    # Each choice samples with its own seed stream.
    assert [s.sampling_params.seed for s in fork.seqs] == [7, 8, 9]
    outs = sched.update(StepResult(fork.step_id, sampled_token_ids={"req": 30, "req#1": 31, "req#2": EOS}))
    assert [(o.request_id, o.index, o.new_token_ids, o.finish_reason) for o in outs] == \
        [("req", 0, [30], None), ("req", 1, [31], None), ("req", 2, [EOS], "stop")]
    outs = sched.update(answer(sched.schedule(), token=40))
    assert sorted((o.index, o.new_token_ids, o.finish_reason) for o in outs) == \
        [(0, [40], "length"), (1, [40], "length")]
    assert not sched.has_work() and sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks


def test_n_choices_of_a_block_aligned_prompt_need_no_copy():
    sched = make_scheduler(block_size=4, budget=64)
    add_choices(sched, "req", prompt_len=9, n=2, max_tokens=1)
    sched.update(answer(sched.schedule()))
    fork = sched.schedule()
    assert fork.block_copies == [] and [s.context_len for s in fork.seqs] == [9, 9]
    assert fork.seqs[0].block_table[:2] == fork.seqs[1].block_table[:2]
    assert fork.seqs[0].block_table[2] != fork.seqs[1].block_table[2]


def test_n_choices_of_a_one_token_prompt_start_at_once():
    sched = make_scheduler(block_size=4)
    add_choices(sched, "req", prompt_len=1, n=3, max_tokens=1)
    batch = sched.schedule()
    assert [(s.request_id, s.token_ids, s.needs_sample) for s in batch.seqs] == \
        [("req", [10], True), ("req#1", [10], True), ("req#2", [10], True)]
    assert batch.block_copies == []
    outs = sched.update(answer(batch))
    assert [(o.index, o.finish_reason) for o in outs] == [(0, "length"), (1, "length"), (2, "length")]


def test_max_num_seqs_counts_choices_and_n_above_it_is_rejected():
    sched = make_scheduler(max_num_seqs=4, budget=64)
    rejected = sched.add(make_choices("big", [10, 11], SamplingParams(n=5), (EOS,)))
    assert rejected.finish_reason == "error" and "max-num-seqs" in rejected.error
    add_choices(sched, "a", prompt_len=5, n=3)
    sched.add(make_seq("b", prompt_len=5))
    sched.add(make_seq("c", prompt_len=5))
    batch = sched.schedule()
    # a holds 3 of the 4 slots before it forked: only b joins.
    assert [s.request_id for s in batch.seqs] == ["a", "b"] and sched.num_waiting == 1


def test_prompt_logprobs_with_n_choices_are_computed_once_and_sent_to_every_choice():
    sched = make_scheduler(block_size=4, budget=64)
    prompt = list(range(10, 16))
    add_choices(sched, "req", prompt_len=6, n=2, max_tokens=1, prompt_logprobs=0)
    prefill = sched.schedule()
    assert prefill.seqs[0].next_prompt_token_id == 15  # the chunk stops before the last prompt token
    sched.update(prompt_lp_answer(prefill, {"req": prompt}))
    fork = sched.schedule()
    assert [s.prompt_logprobs for s in fork.seqs] == [None, None]
    outs = sched.update(answer(fork))
    assert [o.index for o in outs] == [0, 1]
    for out in outs:
        assert out.prompt_logprobs[0] is None and [e.token_id for e in out.prompt_logprobs[1:]] == prompt[1:]


def test_abort_of_the_client_id_ends_every_choice_forked_or_not():
    sched = make_scheduler(block_size=4, budget=64)
    parent = add_choices(sched, "req", prompt_len=6, n=3)
    sched.update(answer(sched.schedule()))  # req's prefill; it forks next step
    unforked = add_choices(sched, "other", prompt_len=6, n=2)
    aborted = sched.abort_request("other")
    assert [(s.request_id, s.index, s.status) for s in aborted] == \
        [("other", 0, SequenceStatus.FINISHED), ("other#1", 1, SequenceStatus.FINISHED)]
    assert unforked.pending_children[0].status is SequenceStatus.FINISHED
    sched.update(answer(sched.schedule()))  # req forked and sampled once
    aborted = sched.abort_request("req")
    assert sorted(s.request_id for s in aborted) == ["req", "req#1", "req#2"]
    assert parent.status is SequenceStatus.FINISHED and not sched.has_work()
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks


def test_fork_waits_for_copy_blocks_and_preempts_like_the_running_pass():
    # 6 blocks of 4: req's prefill of 9 tokens takes 3, hog takes 3; the fork needs 2 copies.
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64)
    add_choices(sched, "req", prompt_len=10, n=3, max_tokens=1)
    sched.add(make_seq("hog", prompt_len=11, max_tokens=4))
    sched.update(answer(sched.schedule()))
    assert sched.kv_cache.num_free_blocks == 0
    batch = sched.schedule()
    # hog (behind req) is preempted so that the children get their copy blocks.
    assert [s.request_id for s in batch.seqs] == ["req", "req#1", "req#2"] and len(batch.block_copies) == 2
    assert sched.waiting[0].request_id == "hog" and sched.num_preemptions == 1
    outs = sched.update(answer(batch))
    assert [(o.index, o.finish_reason) for o in outs] == [(0, "length"), (1, "length"), (2, "length")]
    outs = []
    while sched.has_work():
        outs += sched.update(answer(sched.schedule()))
    assert outs[-1].request_id == "hog" and outs[-1].finish_reason == "length"


def test_structured_output_without_a_manager_fails_the_request():
    from config.structured_output import JSON_OBJECT, StructuredOutputSpec
    sched = make_scheduler()
    out = sched.add(make_seq("a", prompt_len=3, structured_output=StructuredOutputSpec(JSON_OBJECT)))
    assert out.finish_reason == "error" and out.error == STRUCTURED_OUTPUT_UNAVAILABLE and not sched.has_work()


# ---- structured output: the real grammar manager (llguidance) on the real tokenizer -------------------


@pytest.fixture(scope="module")
def tokenizer():
    from config.model_config import default_model_path
    from engine.tokenizer import load_tokenizer
    return load_tokenizer(default_model_path())


def grammar_manager(tokenizer, ready: bool = True):
    """A StructuredOutputManager; with ``ready=False`` its tokenizer arrives only when the test sets it."""
    from concurrent.futures import Future
    from engine.structured_output import StructuredOutputManager, ll_tokenizer_from
    ll = ll_tokenizer_from(tokenizer.backend, tokenizer.eos_token_ids, 49152)
    source: Future = Future()
    if ready:
        source.set_result(ll)
    return StructuredOutputManager(source, 49152, tokenizer_vocab_size=tokenizer.vocab_size), source, ll


def allowed(mask) -> set[int]:
    import numpy as np
    return set(np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")).tolist())


def test_structured_output_choices_are_masked_forked_and_finish_with_the_grammar(tokenizer):
    import json
    from config.structured_output import CHOICE, REGEX, StructuredOutputSpec
    manager, source, ll = grammar_manager(tokenizer, ready=False)
    try:
        sched = Scheduler(kv_cache_manager(64, 4), 8, 64, 128, structured_output=manager)
        spec = StructuredOutputSpec(CHOICE, json.dumps(["yes", "no"]))
        parent = add_choices(sched, "req", prompt_len=6, n=2, max_tokens=10, structured_output=spec)
        sched.add(make_seq("plain", prompt_len=3))
        batch = sched.schedule()
        # req's grammar cannot compile yet (no tokenizer): it waits, plain behind it does not.
        assert [s.request_id for s in batch.seqs] == ["plain"] and batch.seqs[0].allowed_token_bitmask is None
        sched.update(answer(batch, token=EOS))
        source.set_result(ll)
        assert manager.wait_ready("req", 30)
        sched.update(answer(sched.schedule()))  # the parent's prefill
        fork = sched.schedule()
        assert [s.request_id for s in fork.seqs] == ["req", "req#1"] and "req#1" in manager
        yes, no = tokenizer.encode("yes"), tokenizer.encode("no")
        for msg in fork.seqs:
            assert {yes[0], no[0]} <= allowed(msg.allowed_token_bitmask)
            assert tokenizer.encode("maybe")[0] not in allowed(msg.allowed_token_bitmask)
        letter_x = tokenizer.encode("x")[0]
        outs = sched.update(StepResult(fork.step_id, sampled_token_ids={"req": yes[0], "req#1": letter_x}))
        by_index = {o.index: o for o in outs}
        assert by_index[1].finish_reason == "error" and "not allowed by the grammar" in by_index[1].error
        while parent.status is SequenceStatus.RUNNING:
            position = len(parent.output_token_ids)
            by_index = {o.index: o for o in sched.update(answer(sched.schedule(), token=yes[position]))}
        assert parent.output_token_ids == yes and by_index[0].finish_reason == "stop"
        assert len(manager) == 0  # every finished choice removed its grammar state

        # A grammar that fails to compile fails every choice, without a step.
        add_choices(sched, "bad", prompt_len=3, n=2, structured_output=StructuredOutputSpec(REGEX, "(unclosed"))
        assert manager.wait_ready("bad", 30)
        assert sched.schedule() is None
        outs = sched.take_outputs()
        assert [(o.request_id, o.index, o.finish_reason) for o in outs] == [("bad", 0, "error"), ("bad", 1, "error")]
        assert "structured output" in outs[0].error and not sched.has_work() and len(manager) == 0
    finally:
        manager.close()
