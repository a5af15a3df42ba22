"""The engine loop survives a failing request: the real Engine (scheduler, prefix cache, ZMQ sockets,
shared-memory signals) runs in a thread; the test plays the API server and a scripted worker over the
engine's real ipc sockets (the worker process is the boundary: it answers each step with token
1000 + the sequence's step index, so outputs are exact).
"""
from __future__ import annotations

import multiprocessing
import signal
import time
from pathlib import Path
from typing import Iterator

import pytest
import zmq

from engine.engine_process import MAX_CONSECUTIVE_FAILURES, EngineFailed
from engine.request import AbortRequest, EngineRequest, RequestOutput
from config.sampling_params import SamplingParams
from tests.engine_harness import ScriptedEngine

TIMEOUT_S = 30.0
MAX_TOKENS = 3
PROMPT = list(range(10, 80))  # 70 tokens: a full 64-token block plus a partial one


class Harness(ScriptedEngine):
    """A ``ScriptedEngine`` with the API server's ends of its sockets; started by the test."""

    def __init__(self, tmp_path: Path, max_num_seqs: int) -> None:
        self.outputs: dict[str, list[RequestOutput]] = {}
        super().__init__(tmp_path, "el", max_num_seqs=max_num_seqs)

    def connect(self) -> None:
        self.api_in = self.context.socket(zmq.PUSH)
        self.api_in.connect(self.addresses.requests)
        self.api_out = self.context.socket(zmq.PULL)
        self.api_out.connect(self.addresses.outputs)

    def send(self, request_id: str, prompt: list[int] | None = PROMPT, n: int = 1) -> None:
        self.api_in.send_pyobj(EngineRequest(request_id, prompt,
                                             SamplingParams(temperature=0, max_tokens=MAX_TOKENS, n=n)))

    def wait_choices(self, request_id: str, n: int) -> dict[int, list[RequestOutput]]:
        """Outputs of a request with ``n`` choices, by index, once every choice finished."""
        def by_index() -> dict[int, list[RequestOutput]]:
            grouped: dict[int, list[RequestOutput]] = {}
            for out in self.outputs.get(request_id, []):
                grouped.setdefault(out.index, []).append(out)
            return grouped

        deadline = time.monotonic() + TIMEOUT_S
        while len(by_index()) < n or not all(outs[-1].finished for outs in by_index().values()):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.api_out.poll(int(remaining * 1000)):
                raise TimeoutError(f"{request_id}: not every choice finished within {TIMEOUT_S} s: {self.outputs}")
            for output in self.api_out.recv_pyobj():
                self.outputs.setdefault(output.request_id, []).append(output)
        return by_index()

    def queue_before_start(self, count: int) -> None:
        """Let the engine take ``count`` sent requests into its queue before its loop runs."""
        deadline = time.monotonic() + TIMEOUT_S
        while self.engine.scheduler.num_waiting < count:
            assert time.monotonic() < deadline, "requests did not reach the engine"
            self.engine._receive_requests(block=True)

    def wait_finished(self, request_ids: list[str]) -> dict[str, list[RequestOutput]]:
        deadline = time.monotonic() + TIMEOUT_S
        while not all(self.outputs.get(r) and self.outputs[r][-1].finished for r in request_ids):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.api_out.poll(int(remaining * 1000)):
                raise TimeoutError(f"not finished within {TIMEOUT_S} s: {request_ids}; got {self.outputs}")
            for output in self.api_out.recv_pyobj():
                self.outputs.setdefault(output.request_id, []).append(output)
        return {r: self.outputs[r] for r in request_ids}


@pytest.fixture
def make_harness(tmp_path: Path) -> Iterator:
    made: list[Harness] = []

    def make(max_num_seqs: int = 4) -> Harness:
        made.append(Harness(tmp_path, max_num_seqs))
        return made[-1]

    yield make
    for harness in made:
        harness.close()


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def assert_completed(outputs: list[RequestOutput]) -> None:
    assert outputs[-1].finish_reason == "length" and outputs[-1].error is None, outputs[-1]
    assert tokens(outputs) == [1000 + i for i in range(MAX_TOKENS)]


def test_a_message_that_cannot_be_handled_fails_only_its_request(make_harness):
    harness = make_harness()
    harness.send("malformed", prompt=None)  # list(None) raises inside the engine's message handling
    harness.send("good")
    harness.start()
    done = harness.wait_finished(["malformed", "good"])
    assert done["malformed"][-1].finish_reason == "error"
    assert "TypeError" in done["malformed"][-1].error
    assert_completed(done["good"])
    assert harness.engine_thread_alive() and harness.engine_error is None


def test_a_failing_update_fails_the_steps_requests_and_the_loop_goes_on(make_harness, monkeypatch):
    monkeypatch.setenv("FD_ENGINE_FAULT_RAISE_IN_UPDATE", "boom")
    harness = make_harness(max_num_seqs=1)  # one sequence a step: the failing step holds only "boom"
    harness.send("boom")
    harness.send("after")
    harness.start()
    done = harness.wait_finished(["boom", "after"])
    assert done["boom"][-1].finish_reason == "error" and "injected fault" in done["boom"][-1].error
    assert tokens(done["boom"]) == []
    assert_completed(done["after"])
    assert harness.engine.cache.num_used_blocks == 0  # the failed request's blocks came back
    assert harness.engine_thread_alive() and harness.engine_error is None


def test_a_failing_schedule_fails_the_sequence_it_was_admitting(make_harness):
    harness = make_harness()
    cache = harness.engine.cache
    real_is_loading = cache.is_loading

    def is_loading(seq, *args, **kwargs):
        if seq.request_id == "poison":  # asked right after admission took its blocks
            raise ValueError("corrupt prefix entry")
        return real_is_loading(seq, *args, **kwargs)

    cache.is_loading = is_loading  # a fault in one call of the real cache manager
    harness.send("poison")
    harness.send("good")
    harness.start()
    done = harness.wait_finished(["poison", "good"])
    assert done["poison"][-1].finish_reason == "error" and "corrupt prefix entry" in done["poison"][-1].error
    assert_completed(done["good"])
    assert cache.num_used_blocks == 0  # the blocks admission took for "poison" came back
    assert harness.engine.scheduler.num_running == 0 and harness.engine.scheduler.num_waiting == 0
    assert harness.engine_thread_alive() and harness.engine_error is None


def test_every_iteration_failing_stops_the_engine(make_harness, monkeypatch):
    monkeypatch.setenv("FD_ENGINE_FAULT_RAISE_IN_UPDATE", "boom")
    harness = make_harness(max_num_seqs=1)
    ids = [f"boom-{i}" for i in range(MAX_CONSECUTIVE_FAILURES)]
    for request_id in ids:
        harness.send(request_id)
    deadline = time.monotonic() + TIMEOUT_S
    while harness.engine.scheduler.num_waiting < len(ids):  # queue them all first: no idle iteration between
        assert time.monotonic() < deadline, "requests did not reach the engine"
        harness.engine._receive_requests(block=True)
    harness.start()
    harness.threads[0].join(TIMEOUT_S)
    assert not harness.engine_thread_alive()
    assert isinstance(harness.engine_error, EngineFailed), harness.engine_error
    done = harness.wait_finished(ids)
    assert all(d[-1].finish_reason == "error" for d in done.values())


@pytest.mark.integration
def test_a_cache_transfer_process_without_progress_is_killed(make_harness, monkeypatch):
    monkeypatch.setenv("FD_CACHE_TRANSFER_TIMEOUT", "2")
    harness = make_harness()
    engine, signals = harness.engine, harness.signals
    # A real process standing in for a cache transfer process that stopped making progress.
    hung = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,), name="stand-in")
    hung.start()
    try:
        engine.supervisor.cache_transfers.append(hung)
        signals.cache_transfer_ready.value[0] = 1
        signals.cache_transfer_heartbeat.value[0] = time.time() - 1.0  # busy for 1 s: within the timeout
        assert engine.supervisor.kill_stalled_cache_transfer() is None and hung.is_alive()
        signals.cache_transfer_heartbeat.value[0] = time.time() - 3.0
        reason = engine.supervisor.kill_stalled_cache_transfer()
        assert reason is not None and "made no progress for 3 s (FD_CACHE_TRANSFER_TIMEOUT=2 s)" in reason
        hung.join(10)
        assert hung.exitcode == -signal.SIGKILL
    finally:
        engine.supervisor.cache_transfers.clear()
        if hung.is_alive():
            hung.kill()
        hung.join(10)


# ---- n > 1: choices under the client's id ----------------------------------------------------------


def test_choices_come_back_under_the_client_id_each_with_its_index(make_harness):
    harness = make_harness()
    harness.send("multi", n=3)
    harness.send("single")
    harness.start()
    choices = harness.wait_choices("multi", 3)
    assert sorted(choices) == [0, 1, 2]
    for outputs in choices.values():
        assert_completed(outputs)
    assert_completed(harness.wait_finished(["single"])["single"])
    stats = harness.engine.cache.summary()
    # 69 prompt tokens before the fork: one full 64-token block shared by 2 children, the partial one copied.
    assert stats["fork_shared_blocks"] == 2 and stats["fork_copied_blocks"] == 2
    assert harness.engine.cache.num_used_blocks == 0


def test_abort_ends_every_choice_each_with_its_output(make_harness):
    harness = make_harness()
    harness.send("multi", n=3)
    harness.queue_before_start(1)
    harness.api_in.send_pyobj(AbortRequest("multi"))  # before the fork: the choices exist only in the parent
    harness.send("after")
    harness.start()
    choices = harness.wait_choices("multi", 3)
    assert {i: [(o.finish_reason, o.new_token_ids) for o in outs] for i, outs in choices.items()} == \
        {i: [("abort", [])] for i in range(3)}
    assert_completed(harness.wait_finished(["after"])["after"])
    assert harness.engine.cache.num_used_blocks == 0


def test_a_failing_update_fails_every_choice_of_the_request(make_harness, monkeypatch):
    monkeypatch.setenv("FD_ENGINE_FAULT_RAISE_IN_UPDATE", "boom")
    harness = make_harness(max_num_seqs=2)  # boom's 2 choices fill it: the failing step holds only boom
    harness.send("boom", n=2)
    harness.send("after")
    harness.start()
    choices = harness.wait_choices("boom", 2)
    for outputs in choices.values():
        assert outputs[-1].finish_reason == "error" and "injected fault" in outputs[-1].error
    assert_completed(harness.wait_finished(["after"])["after"])
    assert harness.engine.cache.num_used_blocks == 0
    assert harness.engine_thread_alive() and harness.engine_error is None
