"""The control channel between the API server and the engine: the real ``Engine`` (scheduler,
prefix cache, ZMQ sockets, shared-memory signals) runs in a thread with a scripted worker (the
worker process is the boundary: it answers each step with token 1000 + the sequence's output
count); the real ``EngineClient`` talks to it over the engine's ipc sockets.

Checks that control commands get their own typed replies on their own sockets, that they never
count as requests or disturb a request's outputs, that ``cache_stats`` reflects the prefix
cache (a finished prompt's full block is cached; a reset drops it), that an unknown command is
answered with a ``ControlError``, and that the client reads its rank's KV-cache lock record.
"""
from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Iterator

import pytest
import zmq

from config.sampling_params import SamplingParams
from engine.entrypoints.engine_client import STATE_RUNNING, EngineClient
from engine.tokenizer import Tokenizer, load_tokenizer
from engine.request import CACHE_STATS, ControlError, ControlRequest, EngineRequest
from config.model_config import default_model_path
from inter_communicator.kvcache_lock import KVCacheLock
from tests.engine_harness import ScriptedEngine

TIMEOUT_S = 30.0
MAX_TOKENS = 3
PROMPT = list(range(10, 80))  # 70 tokens: one full 64-token block (cached once finished) and a partial one


class EngineThread(ScriptedEngine):
    """A ``ScriptedEngine`` started at once; ``alive()`` etc. make it an ``EngineProcessView``."""

    def __init__(self, tmp_path: Path) -> None:
        super().__init__(tmp_path, "cc")
        self.start()

    # EngineProcessView
    state = STATE_RUNNING
    pid = os.getpid()
    restarts = 0

    def alive(self) -> bool:
        return self.engine_thread_alive()


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[EngineThread]:
    running = EngineThread(tmp_path)
    try:
        yield running
    finally:
        running.close()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(default_model_path())


def client_for(engine: EngineThread, tokenizer: Tokenizer, lock_enabled: bool = False) -> EngineClient:
    return EngineClient(tokenizer, engine.addresses, engine.signals, engine, instance_id=engine.config.instance_id,
                        dp_rank=0, kvcache_lock_enabled=lock_enabled)


async def generate(client: EngineClient, request_id: str) -> list[int]:
    request = EngineRequest(request_id, list(PROMPT), SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    tokens: list[int] = []
    async for output in client.generate(request):
        assert output.error is None, output.error
        tokens.extend(output.new_token_ids)
    return tokens


def test_control_has_its_own_typed_replies_and_leaves_requests_alone(engine: EngineThread,
                                                                    tokenizer: Tokenizer) -> None:
    async def scenario() -> tuple:
        client = client_for(engine, tokenizer)
        await client.start()
        try:
            before = await asyncio.wait_for(client.cache_stats(), TIMEOUT_S)
            # A request and control commands at once: each answer reaches its own caller.
            tokens, during = await asyncio.wait_for(asyncio.gather(generate(client, "r1"), client.cache_stats()),
                                                    TIMEOUT_S)
            active_after = client.num_active_requests
            finished = await asyncio.wait_for(client.cache_stats(), TIMEOUT_S)
            reset = await asyncio.wait_for(client.reset_prefix_cache(), TIMEOUT_S)
            after_reset = await asyncio.wait_for(client.cache_stats(), TIMEOUT_S)
            return before, tokens, during, active_after, finished, reset, after_reset
        finally:
            await client.close()

    before, tokens, during, active_after, finished, reset, after_reset = asyncio.run(scenario())
    assert tokens == [1000 + i for i in range(MAX_TOKENS)]
    assert active_after == 0
    assert before["dp_rank"] == 0 and before["kv_blocks_cached"] == 0
    assert "kvcache_lock" not in before  # the lock is off for this client
    assert set(during) == set(before)
    assert finished["kv_blocks_cached"] == 1  # the prompt's one full block
    assert reset == {"dropped_blocks": 1}
    assert after_reset["kv_blocks_cached"] == 0


def test_unknown_command_is_answered_with_an_error(engine: EngineThread) -> None:
    context = zmq.Context()
    try:
        push = context.socket(zmq.PUSH)
        push.connect(engine.addresses.control_requests)
        pull = context.socket(zmq.PULL)
        pull.connect(engine.addresses.control_replies)
        outputs = context.socket(zmq.PULL)
        outputs.connect(engine.addresses.outputs)
        push.send_pyobj(ControlRequest("c-1", "format_disk"))
        push.send_pyobj(ControlRequest("c-2", CACHE_STATS))
        assert pull.poll(int(TIMEOUT_S * 1000)), "no control reply"
        first = pull.recv_pyobj()
        assert pull.poll(int(TIMEOUT_S * 1000)), "no second control reply"
        second = pull.recv_pyobj()
        assert first == ControlError("c-1", "unknown command 'format_disk'")
        assert second.request_id == "c-2" and "kv_blocks_cached" in second.to_json()
        assert not outputs.poll(200), "a control reply went to the request outputs"
    finally:
        context.destroy(linger=0)


def test_client_reads_its_ranks_kvcache_lock(engine: EngineThread, tokenizer: Tokenizer) -> None:
    lock = KVCacheLock.create(engine.config.instance_id, 0, role="launch")

    async def scenario() -> tuple:
        client = client_for(engine, tokenizer, lock_enabled=True)
        await client.start()
        try:
            with lock.hold("test: a holder the client must see"):
                held = client.kvcache_lock_stats()
            stats = await asyncio.wait_for(client.cache_stats(), TIMEOUT_S)
            return held, stats
        finally:
            await client.close()

    try:
        held, stats = asyncio.run(scenario())
    finally:
        lock.close()
        lock.unlink()
    assert list(held) == [0] and held[0]["held"] and held[0]["owner_role"] == "launch"
    assert stats["kvcache_lock"]["enabled"] and not stats["kvcache_lock"]["held"]
    assert stats["kvcache_lock"]["acquisitions"] >= 1


def test_client_without_the_lock_reports_none(engine: EngineThread, tokenizer: Tokenizer) -> None:
    assert client_for(engine, tokenizer).kvcache_lock_stats() == {0: None}
