"""n > 1 choices, prompt logprobs, min_tokens and grammar masks end to end: the real Engine with its
real worker process (the model).

The engine runs in a thread (``tests/engine_harness.py``), its worker is the real worker process
loading the default model; the test plays the API server over the engine's ipc sockets. The prompt
(42 tokens, blocks of 16) ends inside a block, so every fork shares two full blocks and copies the
partial third one (copy-on-write): a wrong copy would change the children's tokens.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import zmq

from config.model_config import default_model_path
from config.sampling_params import SamplingParams
from config.structured_output import CHOICE, StructuredOutputSpec
from engine.request import CACHE_STATS, RESET_PREFIX_CACHE, ControlRequest, EngineRequest, RequestOutput
from engine.tokenizer import load_tokenizer
from harness.reference import expected_prefix
from tests.engine_harness import ScriptedEngine

pytestmark = pytest.mark.integration

TIMEOUT_S = 120.0
BLOCK_SIZE = 16


class ModelEngine(ScriptedEngine):
    """A ``ScriptedEngine`` whose worker is the real worker process; the test holds the API server's sockets."""

    def __init__(self, tmp_path: Path) -> None:
        self.used_blocks_seen: list[int] = []
        super().__init__(tmp_path, "nc", block_size=BLOCK_SIZE, max_num_seqs=8)

    def connect(self) -> None:
        # The real worker takes the engine's batches: the scripted worker's ends must not compete for them.
        self.worker_in.close(linger=0)
        self.worker_out.close(linger=0)
        self.api_in = self.context.socket(zmq.PUSH)
        self.api_in.connect(self.addresses.requests)
        self.api_out = self.context.socket(zmq.PULL)
        self.api_out.connect(self.addresses.outputs)
        self.control_in = self.context.socket(zmq.PUSH)
        self.control_in.connect(self.addresses.control_requests)
        self.control_out = self.context.socket(zmq.PULL)
        self.control_out.connect(self.addresses.control_replies)

    def start(self) -> None:
        self.engine.supervisor.start_workers()
        thread = threading.Thread(target=self._run_engine, daemon=True)
        thread.start()
        self.threads.append(thread)

    def close(self) -> None:
        self.stop_event.set()
        for thread in self.threads:
            thread.join(30)
        if self.engine is not None:
            self.engine.supervisor.stop_workers()
        super().close()

    def generate(self, request_id: str, prompt: list[int], params: SamplingParams) -> dict[int, list[RequestOutput]]:
        """Send one request; its outputs by choice index once every choice finished."""
        self.api_in.send_pyobj(EngineRequest(request_id, prompt, params, eos_token_ids=(2,)))
        by_index: dict[int, list[RequestOutput]] = {}
        deadline = time.monotonic() + TIMEOUT_S
        while len(by_index) < params.n or not all(outs[-1].finished for outs in by_index.values()):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.api_out.poll(int(remaining * 1000)):
                raise TimeoutError(f"{request_id} not finished within {TIMEOUT_S} s: {by_index}")
            for out in self.api_out.recv_pyobj():
                assert out.request_id == request_id, out
                by_index.setdefault(out.index, []).append(out)
            self.used_blocks_seen.append(int(self.signals.engine_stats.value[2]))
        assert sorted(by_index) == list(range(params.n))
        return by_index

    def control(self, command: str) -> dict:
        self.control_in.send_pyobj(ControlRequest(f"ctl-{time.monotonic_ns()}", command))
        if not self.control_out.poll(int(TIMEOUT_S * 1000)):
            raise TimeoutError(f"no reply to {command}")
        return self.control_out.recv_pyobj().to_json()


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelEngine]:
    harness = ModelEngine(tmp_path_factory.mktemp("n_choices"))
    try:
        harness.start()
        yield harness
    finally:
        harness.close()
    assert harness.engine_error is None, harness.engine_error


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def test_greedy_choices_are_identical_to_one_choice_and_the_reference(engine, reference):
    entry = reference[0]
    prompt = entry["prompt_ids"]
    assert len(prompt) % BLOCK_SIZE != 1  # the fork copies a partial block
    max_tokens = len(entry["output_ids"])
    engine.control(RESET_PREFIX_CACHE)
    single = engine.generate("greedy-1", prompt, SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=1))
    engine.control(RESET_PREFIX_CACHE)
    before = engine.control(CACHE_STATS)
    engine.used_blocks_seen.clear()
    three = engine.generate("greedy-3", prompt,
                            SamplingParams(temperature=0, max_tokens=max_tokens, n=3, logprobs=1))
    after = engine.control(CACHE_STATS)
    ours, want = expected_prefix(entry, tokens(single[0]))
    assert ours == want
    for index in range(3):
        assert tokens(three[index]) == tokens(single[0]), index
        assert three[index][-1].finish_reason == single[0][-1].finish_reason
        # The same distribution at every step: the copied partial block holds the parent's K/V.
        got = [lp for out in three[index] for lp in out.logprobs]
        want_lps = [lp for out in single[0] for lp in out.logprobs]
        assert len(got) == len(want_lps) == len(tokens(single[0]))
        assert max(abs(a.logprob - b.logprob) for a, b in zip(got, want_lps)) < 1e-4
    # The prompt's 41 tokens before the fork: 2 full blocks shared by each child, the partial one copied.
    full = (len(prompt) - 1) // BLOCK_SIZE
    assert after["fork_shared_blocks"] - before["fork_shared_blocks"] == 2 * full
    assert after["fork_copied_blocks"] - before["fork_copied_blocks"] == 2
    separate = 3 * -(-(len(prompt) + max_tokens) // BLOCK_SIZE)
    shared = full + 3 * (-(-(len(prompt) + max_tokens) // BLOCK_SIZE) - full)
    assert 0 < max(engine.used_blocks_seen) <= shared < separate, engine.used_blocks_seen


def test_seeded_choices_are_reproducible_per_choice_and_differ(engine, reference):
    prompt = reference[1]["prompt_ids"]
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, n=4, ignore_eos=True)
    runs = []
    for attempt in range(2):
        engine.control(RESET_PREFIX_CACHE)
        runs.append({i: tokens(outs) for i, outs in engine.generate(f"seeded-{attempt}", prompt, params).items()})
    assert runs[0] == runs[1]
    assert all(len(choice) == 12 for choice in runs[0].values())
    assert len({tuple(choice) for choice in runs[0].values()}) == 4, runs[0]


def test_prompt_logprobs_with_a_warm_prefix_cache_equal_a_cold_one(engine, reference):
    prompt = reference[2]["prompt_ids"]
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    engine.control(RESET_PREFIX_CACHE)
    cold = engine.generate("plp-cold", prompt, params)[0]
    warm_up = engine.generate("plp-warm-up", prompt, SamplingParams(temperature=0, max_tokens=1))[0]
    assert warm_up[-1].num_cached_tokens > 0  # the prompt's full blocks are cached now
    warm = engine.generate("plp-warm", prompt, params)[0]
    two = engine.generate("plp-n2", prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, n=2))
    lists = [cold[0].prompt_logprobs, warm[0].prompt_logprobs, two[0][0].prompt_logprobs, two[1][0].prompt_logprobs]
    for got in lists:
        assert got is not None and len(got) == len(prompt) and got[0] is None
        assert [e.token_id for e in got[1:]] == prompt[1:]
        assert all(len(e.top_token_ids) == 3 and e.rank >= 1 and e.logprob <= 0 for e in got[1:])
    for got in lists[1:]:
        for a, b in zip(lists[0][1:], got[1:]):
            assert a.rank == b.rank and a.top_token_ids == b.top_token_ids
            assert abs(a.logprob - b.logprob) < 1e-4
    # Sent once: only the output that ends the prefill carries them.
    assert all(out.prompt_logprobs is None for out in cold[1:] + warm[1:])


def test_min_tokens_holds_eos_back_in_the_real_sampler(engine, reference):
    entry = reference[0]  # greedy: 7 tokens, then eos
    free = tokens(engine.generate("min-0", entry["prompt_ids"], SamplingParams(temperature=0, max_tokens=16))[0])
    assert len(free) < 10 and free[-1] == 2  # the stopping eos is the last token
    held = engine.generate("min-10", entry["prompt_ids"], SamplingParams(temperature=0, max_tokens=16, min_tokens=10))
    out = tokens(held[0])
    assert len(out) >= 10 and 2 not in out[:10], out
    assert out[:len(free) - 1] == free[:-1]  # eos banned, the tokens before it unchanged


def test_structured_output_choices_through_the_real_worker(engine, reference):
    tokenizer = load_tokenizer(default_model_path())
    spec = StructuredOutputSpec(CHOICE, json.dumps(["Paris", "London", "Rome"]))
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=10, n=3, structured_output=spec)
    choices = engine.generate("so-3", reference[0]["prompt_ids"], params)
    for index, outputs in choices.items():
        assert outputs[-1].finish_reason == "stop", outputs[-1]
        assert tokenizer.decode(tokens(outputs)).strip() in {"Paris", "London", "Rome"}, index
