"""Logits processors (penalties, bias, bans, bad words, structured-output mask, min_p) against a
straightforward per-row numpy reference written here, alone, combined and in mixed batches, and
their effect on the sampler: greedy and seeded rows, all-excluded rows, and rows left untouched."""
from __future__ import annotations

import envs

envs.apply_compute_thread_env(2)

from collections import Counter  # noqa: E402

import numpy as np  # noqa: E402
import paddle  # noqa: E402
import pytest  # noqa: E402

from config.sampling_params import InvalidRequestError, SamplingParams  # noqa: E402
from worker.logits_processors import RowState, apply_logits_processors, needs_processing  # noqa: E402
from worker.sampler import INVALID_TOKEN, Sampler, SamplingError  # noqa: E402

VOCAB = 300  # small, so the reference's per-token loops stay fast; one test uses the full size
FULL_VOCAB = 49152


def reference_process(logits: np.ndarray, params: SamplingParams, state: RowState) -> np.ndarray:
    """vLLM's definitions, one row, one token at a time."""
    x = logits.astype(np.float32).copy()
    vocab = x.size
    output = list(state.output_token_ids or [])
    prompt = list(state.prompt_token_ids or [])
    if state.allowed_token_bitmask is not None:
        for token in range(vocab):
            if not (int(state.allowed_token_bitmask[token // 32]) >> (token % 32)) & 1:
                x[token] = -np.inf
    for word in params.bad_words_token_ids:
        prefix = word[:-1]
        if not prefix or (len(output) >= len(prefix) and output[len(output) - len(prefix):] == prefix):
            x[word[-1]] = -np.inf
    for token in state.banned_token_ids or []:
        x[token] = -np.inf
    for token, bias in params.logit_bias.items():
        x[token] += np.float32(bias)
    if params.repetition_penalty != 1.0:
        penalty = np.float32(params.repetition_penalty)
        for token in set(prompt) | set(output):
            x[token] = x[token] / penalty if x[token] > 0 else x[token] * penalty
    for token, count in Counter(output).items():
        x[token] -= np.float32(params.frequency_penalty) * np.float32(count) + np.float32(params.presence_penalty)
    return x


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0, std: float = 2.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, vocab)) * std).astype(np.float32)


def random_bitmask(rng: np.random.Generator, vocab: int, keep: float) -> np.ndarray:
    allowed = rng.random(vocab) < keep
    allowed[rng.integers(vocab)] = True  # never empty
    padded = np.zeros(-(-vocab // 32) * 32, dtype=bool)
    padded[:vocab] = allowed
    return np.packbits(padded, bitorder="little").view("<i4").astype(np.int32)


def random_case(rng: np.random.Generator, vocab: int = VOCAB) -> tuple[SamplingParams, RowState]:
    """A row using a random subset of the controls, with a token history that makes them bite."""
    output = rng.integers(0, vocab // 3, size=int(rng.integers(0, 40))).tolist()  # repeats are likely
    prompt = rng.integers(0, vocab, size=int(rng.integers(1, 30))).tolist()
    use = rng.random(7) < 0.6
    params = SamplingParams(
        temperature=0.0 if rng.random() < 0.3 else float(rng.uniform(0.3, 1.5)),
        presence_penalty=float(rng.uniform(-2, 2)) if use[0] else 0.0,
        frequency_penalty=float(rng.uniform(-2, 2)) if use[1] else 0.0,
        repetition_penalty=float(rng.uniform(0.5, 2.0)) if use[2] else 1.0,
        logit_bias={int(t): float(rng.uniform(-100, 100)) for t in rng.integers(0, vocab, 5)} if use[3] else {},
        seed=int(rng.integers(1 << 30)),
    )
    if use[4]:
        words = [[int(rng.integers(vocab))]]  # a single-token word: always banned
        if output:
            tail = output[-2:]
            words.append(tail + [int(rng.integers(vocab))])  # its prefix ends the output: bites
        words.append([int(rng.integers(vocab)) for _ in range(3)])  # almost surely does not
        params.bad_words_token_ids = words
    state = RowState(prompt_token_ids=prompt, output_token_ids=output)
    if use[5]:
        state.banned_token_ids = rng.integers(0, vocab, size=3).tolist()
    if use[6]:
        state.allowed_token_bitmask = random_bitmask(rng, vocab, keep=0.3)
    return params, state


def assert_same_logits(ours: np.ndarray, expected: np.ndarray) -> None:
    np.testing.assert_array_equal(np.isneginf(ours), np.isneginf(expected))
    finite = ~np.isneginf(expected)
    np.testing.assert_allclose(ours[finite], expected[finite], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("seed", range(12))
def test_random_combinations_match_the_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows = 8
    cases = [random_case(rng) for _ in range(rows)]
    x = random_logits(rows, seed=seed)
    ours = x.copy()
    errors = apply_logits_processors(ours, [p for p, _ in cases], [s for _, s in cases])
    assert errors == {}
    for i, (params, state) in enumerate(cases):
        assert_same_logits(ours[i], reference_process(x[i], params, state))


@pytest.mark.parametrize(
    "params,state",
    [
        (SamplingParams(repetition_penalty=1.7), RowState(prompt_token_ids=[1, 2, 2, 9], output_token_ids=[2, 5, 5])),
        (SamplingParams(repetition_penalty=0.6), RowState(prompt_token_ids=[0, 3], output_token_ids=[4])),
        (SamplingParams(frequency_penalty=0.8), RowState(output_token_ids=[7, 7, 7, 8, 3])),
        (SamplingParams(presence_penalty=-1.5), RowState(prompt_token_ids=[11], output_token_ids=[7, 7, 8])),
        (SamplingParams(logit_bias={0: 100.0, 5: -100.0, 299: 3.5}), RowState()),
        (SamplingParams(bad_words_token_ids=[[4], [1, 2, 3], [2, 6], [9, 9, 10]]), RowState(output_token_ids=[5, 1, 2])),
        (SamplingParams(), RowState(banned_token_ids=[2, 17, 17])),
        (SamplingParams(), RowState(allowed_token_bitmask=np.array([-1, 0, -(1 << 31), 5] + [0] * 6, dtype=np.int32))),
    ],
    ids=["repetition>1", "repetition<1", "frequency", "presence", "bias", "bad-words", "min-tokens-bans", "mask"],
)
def test_each_processor_alone_matches_the_reference(params: SamplingParams, state: RowState) -> None:
    x = random_logits(1, seed=3)
    x[0, :12] = [3.0, -2.0, 0.5, -0.5, 1.0, 2.0, -1.0, 4.0, -3.0, 0.0, 1.5, -1.5]  # both signs on the touched ids
    ours = x.copy()
    assert apply_logits_processors(ours, [params], [state]) == {}
    expected = reference_process(x[0], params, state)
    assert_same_logits(ours[0], expected)
    assert not np.array_equal(ours[0], x[0]), "the case must change something"


def test_bad_words_follow_vllm() -> None:
    """One-token words always; longer words only when the output ends with all but their last token."""
    params = SamplingParams(bad_words_token_ids=[[10], [1, 2, 3], [2, 4], [7, 8, 9]])
    x = np.zeros((3, VOCAB), dtype=np.float32)
    states = [RowState(output_token_ids=[5, 1, 2]), RowState(output_token_ids=[2]), RowState(output_token_ids=[8])]
    assert apply_logits_processors(x, [params] * 3, states) == {}
    assert sorted(np.flatnonzero(np.isneginf(x[0])).tolist()) == [3, 4, 10]  # "1 2" and "2" end the output
    assert sorted(np.flatnonzero(np.isneginf(x[1])).tolist()) == [4, 10]
    assert sorted(np.flatnonzero(np.isneginf(x[2])).tolist()) == [10]  # "7 8" is not at the end


def test_structured_output_mask_bit_order_full_vocabulary() -> None:
    """Word w bit j is token 32*w + j, on the real vocabulary size; bit 31 (the sign bit) too."""
    allowed_tokens = [0, 31, 32, 1000, 4095, FULL_VOCAB - 1]
    words = np.zeros(FULL_VOCAB // 32, dtype=np.uint32)
    for token in allowed_tokens:
        words[token // 32] |= np.uint32(1) << np.uint32(token % 32)
    state = RowState(allowed_token_bitmask=words.view(np.int32))
    x = random_logits(2, vocab=FULL_VOCAB, seed=4)
    ours = x.copy()
    assert apply_logits_processors(ours, [SamplingParams(), SamplingParams()], [state, None]) == {}
    assert np.flatnonzero(np.isfinite(ours[0])).tolist() == allowed_tokens
    np.testing.assert_array_equal(ours[0, allowed_tokens], x[0, allowed_tokens])
    np.testing.assert_array_equal(ours[1], x[1])  # the row without controls is left as it was


def test_rows_that_cannot_be_processed_are_reported_alone() -> None:
    x = random_logits(5, seed=5)
    nothing = np.zeros(-(-VOCAB // 32), dtype=np.int32)
    params = [SamplingParams(), SamplingParams(logit_bias={VOCAB: 1.0}), SamplingParams(frequency_penalty=1.0),
              SamplingParams(repetition_penalty=1e-38), SamplingParams(presence_penalty=0.5)]
    states = [RowState(allowed_token_bitmask=nothing), RowState(), RowState(output_token_ids=[3, 3]),
              RowState(prompt_token_ids=[int(x[3].argmax())]), RowState(allowed_token_bitmask=nothing[:2])]
    ours = x.copy()
    errors = apply_logits_processors(ours, params, states)
    assert sorted(errors) == [0, 1, 3, 4]
    assert "every token is excluded" in errors[0]
    assert "logit_bias" in errors[1] and str(VOCAB) in errors[1]
    assert "non-finite" in errors[3]
    assert "allowed_token_bitmask" in errors[4]
    assert_same_logits(ours[2], reference_process(x[2], params[2], states[2]))


def test_plain_rows_do_not_need_processing() -> None:
    assert not needs_processing(SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1), None)
    assert not needs_processing(SamplingParams(), RowState(prompt_token_ids=[1], output_token_ids=[2], banned_token_ids=[]))
    assert needs_processing(SamplingParams(), RowState(banned_token_ids=[2]))
    assert needs_processing(SamplingParams(repetition_penalty=1.1), None)


# ---- through the sampler ------------------------------------------------------------------------

def as_plain(processed: np.ndarray) -> np.ndarray:
    """The reference-processed logits with -inf replaced by a finite value whose exp underflows to
    exactly 0 like -inf's, so the PLAIN sampler path draws from the same weights bit for bit."""
    return np.where(np.isneginf(processed), np.float32(-1e30), processed).astype(np.float32)


def plain_params(p: SamplingParams) -> SamplingParams:
    return SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p, seed=p.seed)


@pytest.mark.parametrize("seed", range(6))
def test_mixed_batches_sample_what_the_reference_logits_give(seed: int) -> None:
    """Greedy rows take the argmax of the processed logits; seeded random rows draw exactly the token
    the plain path draws from the reference-processed logits; plain rows are untouched."""
    rng = np.random.default_rng(100 + seed)
    rows = 10
    cases = [random_case(rng) if rng.random() < 0.6 else (SamplingParams(temperature=float(rng.uniform(0, 1.2)),
                                                                         seed=int(rng.integers(1000))), None)
             for _ in range(rows)]
    for params, _ in cases:
        if rng.random() < 0.3:
            params.top_k, params.top_p, params.min_p = int(rng.integers(1, 40)), float(rng.uniform(0.5, 1)), 0.05
    x = random_logits(rows, seed=seed)
    steps = [int(rng.integers(0, 50)) for _ in range(rows)]
    tokens = Sampler().sample(paddle.to_tensor(x), [p for p, _ in cases], steps, [s for _, s in cases])
    for i, (params, state) in enumerate(cases):
        expected_logits = reference_process(x[i], params, state) if state is not None else x[i]
        if params.greedy:
            assert tokens[i] == int(expected_logits.argmax()), f"row {i}"
        else:
            alone = Sampler().sample(as_plain(expected_logits)[None], [plain_params(params)], [steps[i]])
            assert tokens[i] == alone[0], f"row {i}"
        assert np.isfinite(expected_logits[tokens[i]]), f"row {i} drew an excluded token"


def test_penalties_change_what_greedy_picks() -> None:
    x = np.zeros((1, VOCAB), dtype=np.float32)
    x[0, 7], x[0, 8] = 2.0, 1.9
    plain = Sampler().sample(x, [SamplingParams(temperature=0.0)], [0])
    penalised = Sampler().sample(x, [SamplingParams(temperature=0.0, frequency_penalty=0.2)], [1],
                                 [RowState(output_token_ids=[7])])
    assert (int(plain[0]), int(penalised[0])) == (7, 8)


def test_all_excluded_row_fails_alone() -> None:
    x = random_logits(3, seed=8)
    nothing = np.zeros(-(-VOCAB // 32), dtype=np.int32)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, seed=1),
              SamplingParams(temperature=0.0, logit_bias={4: 100.0})]
    with pytest.raises(SamplingError) as info:
        Sampler().sample(x, params, [0, 0, 0], [None, RowState(allowed_token_bitmask=nothing), None])
    assert info.value.rows == [1]
    assert "every token is excluded" in info.value.reasons[1]
    assert info.value.tokens.tolist() == [int(x[0].argmax()), INVALID_TOKEN, 4]


def min_p_support(x: np.ndarray, temperature: float, min_p: float) -> set[int]:
    probs = np.exp((x - x.max()) / temperature)
    probs /= probs.sum()
    return set(np.flatnonzero(probs >= min_p * probs.max()).tolist())


def test_min_p_frequencies_are_renormalised_over_the_kept_tokens() -> None:
    x = np.log(np.array([[0.5, 0.3, 0.1, 0.06, 0.04]], dtype=np.float32))
    draws = 20000
    params = SamplingParams(temperature=1.0, min_p=0.15, seed=3)  # keeps p >= 0.075
    tokens = Sampler().sample(np.repeat(x, draws, axis=0), [params] * draws, list(range(draws)))
    freqs = np.bincount(tokens, minlength=5) / draws
    np.testing.assert_allclose(freqs, [0.5 / 0.9, 0.3 / 0.9, 0.1 / 0.9, 0, 0], atol=0.015)


@pytest.mark.parametrize("temperature,min_p", [(1.0, 0.05), (0.5, 0.01), (2.0, 0.3)])
def test_min_p_never_draws_below_the_threshold_after_temperature(temperature: float, min_p: float) -> None:
    x = random_logits(1, vocab=FULL_VOCAB, seed=9, std=2.5)
    draws = 300
    params = SamplingParams(temperature=temperature, min_p=min_p, seed=11)
    tokens = Sampler().sample(np.repeat(x, draws, axis=0), [params] * draws, list(range(draws)))
    support = min_p_support(x[0].astype(np.float64), temperature, min_p)
    assert set(tokens.tolist()) <= support
    assert len(set(tokens.tolist())) > 1 or len(support) == 1


# ---- validation of the new SamplingParams fields ---------------------------------------------------

@pytest.mark.parametrize(
    "field,value",
    [("presence_penalty", 2.5), ("presence_penalty", float("nan")), ("frequency_penalty", -2.01),
     ("repetition_penalty", 0.0), ("repetition_penalty", -5.0), ("repetition_penalty", float("inf")),
     ("min_tokens", -1), ("min_tokens", 17), ("min_p", 1.5), ("min_p", -0.1),
     ("logit_bias", {5: 100.5}), ("logit_bias", {-1: 1.0}), ("logit_bias", {3: float("nan")}),
     ("bad_words_token_ids", [[]]), ("bad_words_token_ids", [[1, -2]]), ("logprobs", 21), ("logprobs", -1),
     ("logprobs", True), ("prompt_logprobs", 21), ("n", 0), ("n", 129)],
)
def test_out_of_range_controls_are_rejected_naming_the_field(field: str, value: object) -> None:
    params = SamplingParams(max_tokens=16, **{field: value})
    with pytest.raises(InvalidRequestError) as info:
        params.validate()
    assert str(info.value).startswith(field), str(info.value)


def test_in_range_controls_are_accepted() -> None:
    SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=0.01, min_tokens=16, max_tokens=16,
                   min_p=1.0, logit_bias={0: -100.0, 49151: 100}, bad_words_token_ids=[[1], [2, 3]], logprobs=20,
                   prompt_logprobs=0, n=128).validate()
