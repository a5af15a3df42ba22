"""Tensor-parallel sharding of the dense decoder, in one process.

N rank-models are built from the same weights, each with its shard and its own KV cache (its KV
heads only); they run the same steps in N threads and their ``all_reduce`` is emulated by a barrier
that sums the ranks' tensors in rank order (the order the shared-memory all-reduce uses). Their
logits must equal TP=1's within float32 rounding, with the same greedy token wherever the top-2
margin is at least 0.01. The default model (SmolLM2-135M: 9 query, 3 KV heads) runs at TP=3 on the
reference prompts and is refused at TP=2; tiny dense checkpoints run at TP=2 and 4.
"""
from __future__ import annotations

import dataclasses
import threading

import envs

envs.apply_compute_thread_env(2)

import numpy as np  # noqa: E402
import paddle  # noqa: E402
import pytest  # noqa: E402

from cache_manager.kv_layout import device_cache_shape  # noqa: E402
from config.model_config import ModelConfig, default_model_path, load_model_config  # noqa: E402
from harness.reference import load_reference  # noqa: E402
from scripts.make_tiny_dense import make_tiny_dense  # noqa: E402
from tests.model_utils import TWO_SEQUENCE_SCHEDULE, run_schedule  # noqa: E402
from worker.attention import kv_cache_views  # noqa: E402
from worker.loader import load_weights  # noqa: E402
from worker.models.llama import LlamaForCausalLM  # noqa: E402
from worker.tensor_parallel import (  # noqa: E402
    TensorParallelError, check_tensor_parallel, shard_plan, shard_weights,
)

BLOCK_SIZE = 16
BLOCKS_PER_SEQ = 8
MARGIN = 0.01
DECODE_STEPS = 12
REFERENCE_PROMPTS = 3
BARRIER_TIMEOUT_S = 120.0


class RankOrderSum:
    """An all-reduce among N threads: each rank's tensor, summed in rank order (float32 numpy adds)."""

    def __init__(self, world_size: int) -> None:
        self._slots: list[np.ndarray | None] = [None] * world_size
        self._barrier = threading.Barrier(world_size, timeout=BARRIER_TIMEOUT_S)
        self.calls = 0

    def for_rank(self, rank: int):
        def all_reduce(tensor: paddle.Tensor) -> paddle.Tensor:
            self._slots[rank] = tensor.numpy()
            self._barrier.wait()
            total = self._slots[0].copy()
            for part in self._slots[1:]:
                total += part
            if rank == 0:
                self.calls += 1
            self._barrier.wait()  # nobody overwrites a slot before every rank has summed
            return paddle.to_tensor(total)

        return all_reduce


def new_cache(config: ModelConfig, kv_heads: int, num_blocks: int) -> list:
    shape = device_cache_shape(dataclasses.replace(config, num_key_value_heads=kv_heads), num_blocks, BLOCK_SIZE)
    return kv_cache_views(np.zeros(shape, dtype=np.float32))


def run_tp(config: ModelConfig, weights: dict[str, np.ndarray], tp_size: int, seqs: dict[str, list[int]],
           schedule: list[list[tuple[str, int]]]) -> tuple[list[dict[str, np.ndarray]], int]:
    """Every rank's logits per sequence after ``schedule``, and the number of all-reduce calls."""
    tables = {name: list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ)) for i, name in enumerate(seqs)}
    num_blocks = BLOCKS_PER_SEQ * len(seqs)
    if tp_size == 1:
        model = LlamaForCausalLM(config)
        model.load_weights(weights)
        caches = new_cache(config, config.num_key_value_heads, num_blocks)
        return [run_schedule(model, caches, seqs, tables, schedule, BLOCK_SIZE)], 0
    reducer = RankOrderSum(tp_size)
    models = []
    for rank in range(tp_size):
        model = LlamaForCausalLM(config, tp_rank=rank, tp_size=tp_size, all_reduce=reducer.for_rank(rank))
        model.load_weights(weights)
        models.append(model)
    results: list[dict[str, np.ndarray] | BaseException | None] = [None] * tp_size

    def rank_main(rank: int) -> None:
        try:
            caches = new_cache(config, models[rank].num_kv_heads, num_blocks)
            with paddle.no_grad():
                results[rank] = run_schedule(models[rank], caches, seqs, tables, schedule, BLOCK_SIZE)
        except BaseException as exc:  # reported to the main thread below
            results[rank] = exc
            reducer._barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(tp_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results, reducer.calls  # type: ignore[return-value]


def top2_margin(logits: np.ndarray) -> np.ndarray:
    top = np.sort(logits, axis=-1)[:, -2:]
    return top[:, 1] - top[:, 0]


def assert_close_to_tp1(reference: dict[str, np.ndarray], ranks: list[dict[str, np.ndarray]],
                        max_delta: float) -> None:
    for name, expected in reference.items():
        for rank, logits in enumerate(ranks):
            # The LM head is replicated and fed the same all-reduced hidden states: every rank agrees exactly.
            assert logits[name].tobytes() == ranks[0][name].tobytes(), f"rank {rank} logits differ from rank 0"
        got = ranks[0][name]
        assert got.shape == expected.shape
        delta = float(np.max(np.abs(got - expected)))
        assert delta < max_delta, f"{name}: max |logit delta| {delta} vs TP=1"
        decided = top2_margin(expected) >= MARGIN
        assert decided.any()
        np.testing.assert_array_equal(got.argmax(-1)[decided], expected.argmax(-1)[decided])


# ----------------------------------------------------------------------------------------- checks


@pytest.fixture(scope="module")
def smollm2_config() -> ModelConfig:
    return load_model_config(default_model_path())


def test_smollm2_divides_by_three_not_two(smollm2_config: ModelConfig) -> None:
    assert (smollm2_config.num_attention_heads, smollm2_config.num_key_value_heads) == (9, 3)
    check_tensor_parallel(smollm2_config, 1)
    check_tensor_parallel(smollm2_config, 3)
    with pytest.raises(TensorParallelError, match=r"size 2 does not divide the model's 9 query heads and 3 KV heads"):
        check_tensor_parallel(smollm2_config, 2)
    with pytest.raises(TensorParallelError, match="size 9 .* 3 KV heads"):
        check_tensor_parallel(smollm2_config, 9)
    with pytest.raises(TensorParallelError, match="positive int"):
        check_tensor_parallel(smollm2_config, 0)
    with pytest.raises(TensorParallelError, match=r"rank must be in 0\.\.2"):
        shard_plan(smollm2_config, 3, 3)


def test_model_refuses_bad_tp_arguments(smollm2_config: ModelConfig) -> None:
    with pytest.raises(TensorParallelError, match="9 query heads"):
        LlamaForCausalLM(smollm2_config, tp_rank=0, tp_size=2, all_reduce=lambda t: t)
    with pytest.raises(ValueError, match="needs an all_reduce callable"):
        LlamaForCausalLM(smollm2_config, tp_rank=0, tp_size=3)


def test_moe_models_are_refused(smollm2_config: ModelConfig) -> None:
    moe = dataclasses.replace(smollm2_config, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
                              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)
    with pytest.raises(TensorParallelError, match="MoE models .8 experts. is not supported"):
        check_tensor_parallel(moe, 2)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_shards_partition_every_split_weight(tmp_path, model_type: str) -> None:
    path = make_tiny_dense(str(tmp_path), seed=1, with_tokenizer=False, model_type=model_type)
    config = load_model_config(path)
    weights = load_weights(config)
    tp_size = 4
    shards = [shard_weights(weights, shard_plan(config, rank, tp_size)) for rank in range(tp_size)]
    split = 0
    for name, full in weights.items():
        parts = [shard[name] for shard in shards]
        if all(part.shape == full.shape for part in parts):
            continue  # replicated: norms, embedding
        split += 1
        axis = 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0
        np.testing.assert_array_equal(np.concatenate(parts, axis=axis), full, err_msg=name)
        assert all(part.shape[axis] * tp_size == full.shape[axis] for part in parts)
    # q, k, v, o, gate, up, down per layer, plus q/k/v biases for qwen2
    assert split == config.num_hidden_layers * (10 if model_type == "qwen2" else 7)


@pytest.mark.parametrize("model_type,tp_size", [("llama", 2), ("llama", 4), ("qwen2", 2), ("qwen3", 4)])
def test_tiny_dense_tp_logits_equal_tp1(tmp_path, model_type: str, tp_size: int) -> None:
    path = make_tiny_dense(str(tmp_path), seed=3, with_tokenizer=False, model_type=model_type)
    config = load_model_config(path)
    weights = load_weights(config)
    rng = np.random.default_rng(7)
    seqs = {"a": rng.integers(3, config.vocab_size, 16).tolist(), "b": rng.integers(3, config.vocab_size, 12).tolist()}
    (expected,), _ = run_tp(config, weights, 1, seqs, TWO_SEQUENCE_SCHEDULE)
    ranks, calls = run_tp(config, weights, tp_size, seqs, TWO_SEQUENCE_SCHEDULE)
    assert calls == 2 * config.num_hidden_layers * len(TWO_SEQUENCE_SCHEDULE)
    assert_close_to_tp1(expected, ranks, max_delta=2e-5)


def test_smollm2_tp3_matches_tp1_and_the_reference(smollm2_config: ModelConfig) -> None:
    config = smollm2_config
    weights = load_weights(config)
    entries = [e for e in load_reference() if len(e["output_ids"]) > DECODE_STEPS][:REFERENCE_PROMPTS]
    assert len(entries) == REFERENCE_PROMPTS
    seqs = {f"p{i}": list(e["prompt_ids"]) + list(e["output_ids"][:DECODE_STEPS]) for i, e in enumerate(entries)}
    # One batched prefill of every prompt, then batched one-token decodes over the reference outputs.
    schedule = [[(f"p{i}", len(e["prompt_ids"])) for i, e in enumerate(entries)]]
    schedule += [[(f"p{i}", 1) for i in range(len(entries))] for _ in range(DECODE_STEPS)]
    (expected,), _ = run_tp(config, weights, 1, seqs, schedule)
    ranks, _calls = run_tp(config, weights, 3, seqs, schedule)
    assert_close_to_tp1(expected, ranks, max_delta=5e-4)
    for i, entry in enumerate(entries):
        first = len(entry["prompt_ids"]) - 1
        greedy = ranks[0][f"p{i}"][first:first + DECODE_STEPS + 1].argmax(-1)
        for step, (token, margin) in enumerate(zip(entry["output_ids"][:DECODE_STEPS + 1],
                                                   entry["top2_margins"][:DECODE_STEPS + 1])):
            if margin >= MARGIN:
                assert greedy[step] == token, f"prompt {i} step {step}: TP=3 picks {greedy[step]}, reference {token}"


# ------------------------------------------------------------------- real processes, shm all-reduce


def _tp_rank_process(path: str, instance: str, rank: int, tp_size: int, seqs: dict[str, list[int]],
                     results) -> None:
    """One TP rank in its own process: its shard, its KV cache, the shared-memory all-reduce."""
    from inter_communicator.allreduce import ShmAllReduce
    from worker.tensor_parallel import paddle_all_reduce

    config = load_model_config(path)
    with ShmAllReduce(instance, rank, tp_size, capacity=64 * config.hidden_size, timeout_s=60.0) as group:
        model = LlamaForCausalLM(config, tp_rank=rank, tp_size=tp_size,
                                 all_reduce=paddle_all_reduce(group.all_reduce))
        model.load_weights(load_weights(config))
        tables = {name: list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ)) for i, name in enumerate(seqs)}
        caches = new_cache(config, model.num_kv_heads, BLOCKS_PER_SEQ * len(seqs))
        logits = run_schedule(model, caches, seqs, tables, TWO_SEQUENCE_SCHEDULE, BLOCK_SIZE)
        results.put((rank, {name: value.tobytes() for name, value in logits.items()}, group.generation))


@pytest.mark.integration  # spawns one process per TP rank
def test_tp2_processes_with_shm_allreduce_equal_the_in_process_ranks(tmp_path) -> None:
    import multiprocessing
    import os
    import uuid

    from inter_communicator.allreduce import ShmAllReduceGroup

    path = make_tiny_dense(str(tmp_path), seed=5, with_tokenizer=False, model_type="qwen2")
    config = load_model_config(path)
    rng = np.random.default_rng(11)
    seqs = {"a": rng.integers(3, config.vocab_size, 16).tolist(), "b": rng.integers(3, config.vocab_size, 12).tolist()}
    tp_size, instance = 2, "ttp" + uuid.uuid4().hex[:8]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with ShmAllReduceGroup(instance, tp_size, capacity=64 * config.hidden_size):
        procs = [ctx.Process(target=_tp_rank_process, args=(path, instance, rank, tp_size, seqs, results))
                 for rank in range(tp_size)]
        for proc in procs:
            proc.start()
        try:
            by_rank = {rank: (logits, calls) for rank, logits, calls in
                       (results.get(timeout=BARRIER_TIMEOUT_S) for _ in procs)}
        finally:
            for proc in procs:
                proc.join(timeout=60)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
    assert [proc.exitcode for proc in procs] == [0, 0]
    assert not [entry for entry in os.listdir("/dev/shm") if f"fd.{instance}." in entry]
    weights = load_weights(config)
    emulated, calls = run_tp(config, weights, tp_size, seqs, TWO_SEQUENCE_SCHEDULE)
    (expected,), _ = run_tp(config, weights, 1, seqs, TWO_SEQUENCE_SCHEDULE)
    for rank in range(tp_size):
        logits, generation = by_rank[rank]
        assert generation == calls  # one shm call per all-reduce (every tensor fits the buffer)
        for name in seqs:
            # The shm all-reduce adds in rank order exactly like the emulation: the same bits.
            assert logits[name] == emulated[rank][name].tobytes(), f"rank {rank} {name}"
    assert_close_to_tp1(expected, emulated, max_delta=2e-5)
