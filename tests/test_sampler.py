"""Sampler behaviour on real paddle tensors: greedy, seeded determinism (penalties on too), top-k/top-p
support, sampling frequencies, and the non-finite guard. The logits processors themselves are tested
against a numpy reference in test_logits_processors.py."""
from __future__ import annotations

import envs

envs.apply_compute_thread_env(2)

import numpy as np  # noqa: E402
import paddle  # noqa: E402
import pytest  # noqa: E402

from config.sampling_params import SamplingParams  # noqa: E402
from worker.logits_processors import RowState  # noqa: E402
from worker.sampler import INVALID_TOKEN, Sampler, SamplingError  # noqa: E402

VOCAB = 49152


def random_logits(rows: int, vocab: int = VOCAB, std: float = 3.0, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, vocab)) * std).astype(np.float32)


def tensor(x: np.ndarray) -> paddle.Tensor:
    return paddle.to_tensor(x)


def softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x - x.max())
    return z / z.sum()


def test_greedy_is_argmax() -> None:
    x = random_logits(6)
    tokens = Sampler().sample(tensor(x), [SamplingParams(temperature=0.0)] * 6, [0] * 6)
    assert tokens.dtype == np.int64
    np.testing.assert_array_equal(tokens, x.argmax(axis=1))


def test_top_k_one_is_argmax_even_at_high_temperature() -> None:
    x = random_logits(4, std=0.5)
    tokens = Sampler(seed=1).sample(tensor(x), [SamplingParams(temperature=5.0, top_k=1)] * 4, [3] * 4)
    np.testing.assert_array_equal(tokens, x.argmax(axis=1))


def test_tiny_temperature_random_row_picks_the_argmax() -> None:
    x = random_logits(3)
    tokens = Sampler(seed=2).sample(tensor(x), [SamplingParams(temperature=1e-30, top_p=0.9)] * 3, [0] * 3)
    np.testing.assert_array_equal(tokens, x.argmax(axis=1))


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.2), SamplingParams(temperature=0.7, top_k=20)]
    alone, batched_first, batched_last = [], [], []
    for step in range(12):
        row = random_logits(1, std=1.5, seed=100 + step)
        noise = random_logits(3, std=2.0, seed=200 + step)
        alone.append(Sampler().sample(tensor(row), [target], [step])[0])
        first = np.concatenate([row, noise])
        batched_first.append(Sampler(seed=9).sample(tensor(first), [target] + others, [step, 5, 6, 7])[0])
        last = np.concatenate([noise, row])
        batched_last.append(Sampler().sample(tensor(last), others + [target], [1, 2, 3, step])[3])
    assert alone == batched_first == batched_last
    assert len(set(alone)) > 1, "a flat distribution over 12 steps should not repeat one token"


def test_seeded_rows_with_penalties_are_deterministic_whatever_the_batch() -> None:
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=77, presence_penalty=0.7, frequency_penalty=0.4,
                            repetition_penalty=1.3, logit_bias={3: 5.0})
    others = [SamplingParams(temperature=0.0, frequency_penalty=1.0), SamplingParams(temperature=1.1),
              SamplingParams(temperature=0.8, min_p=0.2, seed=5)]
    history: list[int] = []
    runs: dict[str, list[int]] = {"alone": [], "first": [], "last": []}
    for step in range(10):
        row = random_logits(1, vocab=1000, std=1.0, seed=300 + step)
        noise = random_logits(3, vocab=1000, seed=400 + step)
        state = RowState(prompt_token_ids=[1, 2, 3], output_token_ids=list(history))
        noise_states = [RowState(output_token_ids=[4, 4]), None, None]
        runs["alone"].append(int(Sampler().sample(row, [target], [step], [state])[0]))
        runs["first"].append(int(Sampler(seed=1).sample(np.concatenate([row, noise]), [target] + others,
                                                        [step, 1, 2, 3], [state] + noise_states)[0]))
        runs["last"].append(int(Sampler().sample(np.concatenate([noise, row]), others + [target], [4, 5, 6, step],
                                                 noise_states + [state])[3]))
        history.append(runs["alone"][-1])
    assert runs["alone"] == runs["first"] == runs["last"]
    assert len(set(runs["alone"])) > 3


def test_different_seeds_give_different_sequences() -> None:
    sampler = Sampler()
    sequences = {}
    for seed in (1, 2, 3):
        params = SamplingParams(temperature=1.0, seed=seed)
        sequences[seed] = [
            int(sampler.sample(tensor(random_logits(1, std=1.0, seed=step)), [params], [step])[0]) for step in range(8)
        ]
    assert len({tuple(s) for s in sequences.values()}) == 3


def test_top_k_only_yields_the_k_best() -> None:
    k = 5
    x = random_logits(1, std=1.0, seed=3)
    best = set(np.argsort(-x[0])[:k].tolist())
    batch = np.repeat(x, 400, axis=0)
    params = [SamplingParams(temperature=2.0, top_k=k)] * 400
    tokens = Sampler(seed=4).sample(tensor(batch), params, list(range(400)))
    assert set(tokens.tolist()) == best  # never outside, and every one of the k is reachable


def known_distribution(head_probs: list[float], vocab: int) -> np.ndarray:
    """Logits whose softmax is ``head_probs`` on the first tokens, the rest sharing what is left."""
    head = np.array(head_probs)
    tail = (1.0 - head.sum()) / (vocab - head.size)
    return np.log(np.concatenate([head, np.full(vocab - head.size, tail)])).astype(np.float32)[None, :]


@pytest.mark.parametrize(
    ("top_p", "support"),
    [(0.5, {0}), (0.79, {0, 1}), (0.8, {0, 1}), (0.81, {0, 1, 2}), (0.94, {0, 1, 2})],
)
def test_top_p_support_is_the_smallest_prefix_reaching_top_p(top_p: float, support: set[int]) -> None:
    # p = 0.5, 0.3, 0.15, then 0.05 spread over the rest of a full-size vocabulary.
    x = known_distribution([0.5, 0.3, 0.15], VOCAB)
    n = 300
    params = [SamplingParams(temperature=1.0, top_p=top_p, seed=11)] * n
    tokens = Sampler().sample(tensor(np.repeat(x, n, axis=0)), params, list(range(n)))
    assert set(tokens.tolist()) == support


@pytest.mark.parametrize("std", [1.0, 3.0, 8.0])
@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.99])
def test_top_p_support_matches_a_full_sort(std: float, top_p: float) -> None:
    """The threshold walk must find exactly the support a full sort finds, flat or peaky."""
    x = random_logits(1, std=std, seed=int(std * 10))[0]
    e = np.exp(x - x.max())
    tokens = Sampler()._top_p_support(e, top_p)
    order = np.argsort(-e, kind="stable")
    expected = np.searchsorted(np.cumsum(e[order], dtype=np.float64), top_p * e.sum(dtype=np.float64)) + 1
    assert tokens.size == len(set(tokens.tolist())) == expected
    assert set(tokens.tolist()) == set(order[:expected].tolist())


def draw_frequencies(x: np.ndarray, params: SamplingParams, draws: int, sampler: Sampler) -> np.ndarray:
    tokens = sampler.sample(tensor(np.repeat(x, draws, axis=0)), [params] * draws, list(range(draws)))
    return np.bincount(tokens, minlength=x.shape[1]) / draws


def test_frequencies_match_softmax_small_vocab() -> None:
    x = np.array([[2.0, 1.5, 1.0, 0.0, -1.0, -3.0]], dtype=np.float32)
    draws = 20000
    seeded = draw_frequencies(x, SamplingParams(temperature=0.7, seed=5), draws, Sampler())
    unseeded = draw_frequencies(x, SamplingParams(temperature=0.7), draws, Sampler(seed=6))
    expected = softmax(x[0] / 0.7)
    # One binomial std is at most 0.0036 at 20000 draws; 0.015 is about 4 std.
    np.testing.assert_allclose(seeded, expected, atol=0.015)
    np.testing.assert_allclose(unseeded, expected, atol=0.015)


def test_frequencies_after_top_k_and_top_p_are_renormalised() -> None:
    x = np.log(np.array([[0.4, 0.25, 0.2, 0.1, 0.05]], dtype=np.float32))
    # top_k=4 keeps 0.4, 0.25, 0.2, 0.1 (sum 0.95); top_p=0.6 of that needs 0.57 -> 0.4 + 0.25.
    freqs = draw_frequencies(x, SamplingParams(temperature=1.0, top_k=4, top_p=0.6, seed=8), 20000, Sampler())
    np.testing.assert_allclose(freqs, [0.4 / 0.65, 0.25 / 0.65, 0, 0, 0], atol=0.015)


def test_frequencies_across_a_full_vocabulary() -> None:
    # Mass over tokens in different 1024-token blocks (two share one), the rest zero after exp.
    x = np.full((1, VOCAB), -1e4, dtype=np.float32)
    picks = {5: 0.1, 2000: 0.15, 2040: 0.05, 30000: 0.3, VOCAB - 1: 0.4}
    for token, prob in picks.items():
        x[0, token] = np.log(prob)
    freqs = draw_frequencies(x, SamplingParams(temperature=1.0, seed=9), 4000, Sampler())
    assert set(np.flatnonzero(freqs).tolist()) == set(picks)
    for token, prob in picks.items():
        assert freqs[token] == pytest.approx(prob, abs=0.03)


def test_non_finite_rows_are_flagged_and_other_rows_kept() -> None:
    x = random_logits(4, vocab=1000)
    x[1, 7] = np.nan
    x[2, 3] = np.inf
    x[3, 0] = -np.inf
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, top_p=0.9)]
    with pytest.raises(SamplingError) as info:
        Sampler().sample(tensor(x), params, [0] * 4)
    assert info.value.rows == [1, 2, 3]
    assert info.value.tokens[0] == x[0].argmax()
    assert info.value.tokens[1:].tolist() == [INVALID_TOKEN] * 3
    assert "[1, 2, 3]" in str(info.value)


def test_mismatched_batch_is_rejected() -> None:
    with pytest.raises(ValueError, match="batch"):
        Sampler().sample(tensor(random_logits(2, vocab=10)), [SamplingParams()], [0])
