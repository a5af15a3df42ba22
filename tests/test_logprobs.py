"""Log-probabilities: ``worker.logprobs`` against a float64 numpy log_softmax, and the sampled-token
and prompt logprobs a real ``ModelRunner`` (SmolLM2-135M) returns in its ``StepResult``, against a
direct float32 full-sequence forward of the same model computed here (|delta| < 1e-4), with the
prompt split into chunks that carry ``next_prompt_token_id``."""
from __future__ import annotations

import envs

envs.apply_compute_thread_env(2)

import os  # noqa: E402

import numpy as np  # noqa: E402
import paddle  # noqa: E402
import pytest  # noqa: E402

from cache_manager.kv_layout import device_cache_shape  # noqa: E402
from config.engine_config import EngineArgs, build_engine_config  # noqa: E402
from config.sampling_params import SamplingParams  # noqa: E402
from harness.reference import load_reference  # noqa: E402
from inter_communicator.messages import ScheduledSeq, StepBatch, TokenLogprobs  # noqa: E402
from worker import model_runner as model_runner_module  # noqa: E402
from worker.attention import build_attention_metadata, kv_cache_views  # noqa: E402
from worker.logprobs import log_softmax, token_logprobs  # noqa: E402
from worker.model_runner import ModelRunner  # noqa: E402

BLOCK_SIZE = 16
NUM_BLOCKS = 24
TOLERANCE = 1e-4


def reference_log_softmax(x: np.ndarray) -> np.ndarray:
    x64 = x.astype(np.float64)
    m = x64.max(axis=-1, keepdims=True)
    return x64 - (m + np.log(np.exp(x64 - m).sum(axis=-1, keepdims=True)))


def reference_entry(row_logprobs: np.ndarray, token: int, k: int) -> tuple[float, int, list[int], list[float]]:
    """(logprob, rank as vLLM counts it, top-k ids by (-logprob, id), their logprobs), one token at a time."""
    order = sorted(range(row_logprobs.size), key=lambda t: (-row_logprobs[t], t))[:k]
    rank = int(np.count_nonzero(row_logprobs >= row_logprobs[token]))
    return float(row_logprobs[token]), rank, order, [float(row_logprobs[t]) for t in order]


# ---- worker.logprobs on its own ----------------------------------------------------------------------

def test_token_logprobs_match_numpy() -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6, 5000)) * 4).astype(np.float32)
    tokens = rng.integers(0, 5000, 6)
    tokens[0] = int(x[0].argmax())
    ks = [0, 1, 5, 20, 3, 20]
    ours = token_logprobs(x, tokens, ks)
    expected = reference_log_softmax(x)
    for i, lp in enumerate(ours):
        logprob, rank, top_ids, top_values = reference_entry(expected[i], int(tokens[i]), ks[i])
        assert lp.token_id == int(tokens[i])
        assert abs(lp.logprob - logprob) < 1e-6
        assert lp.rank == rank
        assert lp.top_token_ids == top_ids
        np.testing.assert_allclose(lp.top_logprobs, top_values, atol=1e-6)
    assert ours[0].rank == 1 and ours[0].top_token_ids == [] and ours[3].top_token_ids[0] == int(x[3].argmax())


def test_ties_rank_as_vllm_and_list_by_token_id() -> None:
    x = np.zeros((1, 10), dtype=np.float32)
    x[0, [2, 5, 7]] = 3.0  # a three-way tie at the top
    x[0, 9] = 1.0
    (tied,) = token_logprobs(x, [5], [4])
    assert tied.rank == 3  # >= counts every tied token
    assert tied.top_token_ids == [2, 5, 7, 9]
    assert tied.top_logprobs[0] == tied.top_logprobs[1] == tied.top_logprobs[2] == pytest.approx(tied.logprob)
    (lowest,) = token_logprobs(x, [0], [0])
    assert lowest.rank == 10


def test_log_softmax_is_stable_for_huge_logits() -> None:
    x = np.array([[1e4, 1e4 - 1.0, -1e4, 0.0]], dtype=np.float32)
    ours = log_softmax(x)
    assert np.isfinite(ours).all()
    np.testing.assert_allclose(ours, reference_log_softmax(x), atol=1e-9)
    (lp,) = token_logprobs(x, [1], [2])
    assert lp.logprob == pytest.approx(-1.0 - np.log1p(np.exp(-1.0)), abs=1e-6)


# ---- through a real ModelRunner ------------------------------------------------------------------

@pytest.fixture(scope="module")
def runner():
    config = build_engine_config(EngineArgs(num_gpu_blocks_override=NUM_BLOCKS, block_size=BLOCK_SIZE))
    config.instance_id = f"test-logprobs-{os.getpid()}"  # a shared-memory name of its own
    instance = ModelRunner(config)
    yield instance
    instance.close()


@pytest.fixture(scope="module")
def text_tokens() -> list[int]:
    """Natural text (a reference prompt and its greedy answer), so the distributions are realistic."""
    entry = max(load_reference(), key=lambda e: len(e["prompt_ids"]) + len(e["output_ids"]))
    return (list(entry["prompt_ids"]) + list(entry["output_ids"]))[:60]


def full_sequence_logprobs(runner: ModelRunner, tokens: list[int]) -> np.ndarray:
    """One float32 forward over the whole sequence into a private cache: float64 logprobs per position."""
    cache = np.zeros(device_cache_shape(runner.config.model, NUM_BLOCKS, BLOCK_SIZE), dtype=np.float32)
    table = list(range(-(-len(tokens) // BLOCK_SIZE)))
    meta = build_attention_metadata([len(tokens)], [len(tokens)], [table], BLOCK_SIZE)
    with paddle.no_grad():
        hidden = runner.model(paddle.to_tensor(tokens, dtype="int64"), meta.positions, kv_cache_views(cache), meta)
        logits = runner.model.compute_logits(hidden).numpy()
    return reference_log_softmax(logits)


def assert_close_to(lp: TokenLogprobs, row: np.ndarray, token: int, k: int) -> None:
    logprob, rank, top_ids, top_values = reference_entry(row, token, k)
    assert lp.token_id == token
    assert abs(lp.logprob - logprob) < TOLERANCE
    np.testing.assert_allclose(lp.top_logprobs, top_values, atol=TOLERANCE)
    # Ids and rank may only differ where the reference has near-ties (within the tolerance).
    for ours, theirs in zip(lp.top_token_ids, top_ids):
        assert ours == theirs or abs(row[ours] - row[theirs]) < 2 * TOLERANCE
    near = np.count_nonzero(np.abs(row - row[token]) < 2 * TOLERANCE)
    assert abs(lp.rank - rank) < near


def seq(request_id: str, tokens: list[int], context_len: int, table: list[int], needs_sample: bool,
        **fields) -> ScheduledSeq:
    return ScheduledSeq(request_id, tokens, context_len, table, needs_sample, **fields)


@pytest.mark.parametrize("slice_rows", [256, 7], ids=["one-slice", "slices-of-7"])
def test_chunked_prompt_logprobs_match_a_full_forward(runner: ModelRunner, text_tokens: list[int], slice_rows: int,
                                                      monkeypatch) -> None:
    monkeypatch.setattr(model_runner_module, "PROMPT_LOGPROBS_ROWS", slice_rows)
    prompt = text_tokens[:45]
    expected = full_sequence_logprobs(runner, prompt)
    table = [3, 9, 0, 14]  # scattered blocks: paging, not contiguity
    other_prompt = text_tokens[10:30]
    other_table = [5, 6]
    chunks = [(0, 13), (13, 29), (29, 45)]
    greedy = SamplingParams(temperature=0.0, logprobs=2)
    collected: list[TokenLogprobs] = []
    sampled = None
    for step, (start, stop) in enumerate(chunks):
        last = stop == len(prompt)
        target = seq("p", prompt[start:stop], stop, table, last, sampling_params=greedy if last else None,
                     next_prompt_token_id=None if last else prompt[stop], prompt_logprobs=5)
        # A neighbour in the same batch (before it: the offsets into the hidden rows must be right).
        neighbour = seq("other", other_prompt[: 5 * (step + 1)][-5:], 5 * (step + 1), other_table, False)
        result = runner.execute_model(StepBatch(step, [neighbour, target]))
        assert result.errors == {}
        assert "other" not in result.prompt_logprobs
        collected.extend(result.prompt_logprobs["p"])
        if last:
            sampled = result
    # Position p predicts token p + 1: 44 entries for a 45-token prompt (the last position is sampled).
    assert len(collected) == len(prompt) - 1
    for position, lp in enumerate(collected):
        assert_close_to(lp, expected[position], prompt[position + 1], 5)
    token = sampled.sampled_token_ids["p"]
    assert token == int(expected[-1].argmax())
    assert_close_to(sampled.logprobs["p"], expected[-1], token, 2)
    assert sampled.logprobs["p"].rank == 1


def test_logprobs_are_raw_before_bias_and_penalties(runner: ModelRunner, text_tokens: list[int]) -> None:
    prompt = text_tokens[:20]
    expected = full_sequence_logprobs(runner, prompt)[-1]
    unlikely = int(expected.argmin())
    biased = SamplingParams(temperature=0.0, logit_bias={unlikely: 100.0}, logprobs=3)
    penalised = SamplingParams(temperature=0.7, seed=3, repetition_penalty=1.8, presence_penalty=1.0, logprobs=0)
    batch = StepBatch(0, [
        seq("biased", prompt, len(prompt), [0, 1], True, sampling_params=biased, prompt_token_ids=prompt,
            output_token_ids=[]),
        seq("penalised", prompt, len(prompt), [2, 3], True, sampling_params=penalised, prompt_token_ids=prompt,
            output_token_ids=[]),
        seq("none", prompt, len(prompt), [4, 5], True, sampling_params=SamplingParams(temperature=0.0)),
    ])
    result = runner.execute_model(batch)
    assert result.errors == {}
    assert result.sampled_token_ids["biased"] == unlikely  # the bias decided the token...
    assert_close_to(result.logprobs["biased"], expected, unlikely, 3)  # ...its logprob is the model's
    assert result.logprobs["biased"].rank == expected.size
    penalised_lp = result.logprobs["penalised"]
    assert_close_to(penalised_lp, expected, result.sampled_token_ids["penalised"], 0)
    assert penalised_lp.top_token_ids == []
    assert "none" not in result.logprobs and result.sampled_token_ids["none"] == int(expected.argmax())


def test_failing_row_stops_only_its_request(runner: ModelRunner, text_tokens: list[int]) -> None:
    prompt = text_tokens[:8]
    vocab = runner.config.model.vocab_size
    nothing = np.zeros(-(-vocab // 32), dtype=np.int32)
    batch = StepBatch(0, [
        seq("masked-out", prompt, len(prompt), [0], True, sampling_params=SamplingParams(temperature=0.0, logprobs=1),
            allowed_token_bitmask=nothing),
        seq("fine", prompt, len(prompt), [1], True, sampling_params=SamplingParams(temperature=0.0, logprobs=1)),
        seq("bad-prompt-id", prompt, len(prompt), [2], False, next_prompt_token_id=vocab, prompt_logprobs=0),
    ])
    result = runner.execute_model(batch)
    assert set(result.errors) == {"masked-out", "bad-prompt-id"}
    assert "every token is excluded" in result.errors["masked-out"]
    assert "outside the vocabulary" in result.errors["bad-prompt-id"]
    assert set(result.sampled_token_ids) == {"fine"} and set(result.logprobs) == {"fine"}
    assert result.prompt_logprobs == {}
