"""Prefill/decode disaggregation over the Mooncake transfer engine (issue 14, item 3).

Unit part (no server): the offer's wire form and its checks, the block address runs, a real transfer
engine reading strided blocks from another engine (two in this process, TCP on 127.0.0.1), and the KV-cache
manager's "remote" fills: a decode-side sequence carrying an offer gets LOAD blocks filled by one
``remote_read`` task; success registers them, failure recomputes, and the offer is handed back for its
release in every case; a prefill-side ``hold`` keeps blocks referenced after the sequence is freed.

Integration part (real ``launch.py`` servers on 127.0.0.1, SmolLM2, block size 16): a prefill and a decode
instance, the two calls the router makes, on the reference prompts concurrently with FD_USE_KVCACHE_LOCK on
and off: the greedy output equals the reference (a mixed instance's), the prompt's full blocks came over the
wire (``cached_tokens``, ``remote_hit_tokens``), and no block is left held or in use on either side. A read
that fails (an offer pointing at memory the peer never registered) falls back to local prefill with the same
output; an offer for another model is refused; a decode instance killed mid-stream breaks only its own
stream, and the prefill instance frees the blocks nobody released once their TTL ended.
"""
from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from cache_manager.block_hash import hash_full_blocks
from cache_manager.kv_cache_manager import KVCacheManager
from cache_manager.pd_transfer import (KVTransferEngine, PDProtocolError, RemotePrefill, block_segments)
from config.engine_config import CacheConfig
from config.sampling_params import SamplingParams
from engine.sequence import Sequence
from harness.server import ServerProcess
from inter_communicator.messages import TransferDone, TransferTask

BS = 4
FINGERPRINT = "fp"
PROMPT = list(range(100, 114))  # 14 tokens: 3 matchable full blocks
REFERENCE = Path("/work/shared/reference/smollm2_greedy.json")
SERVER_ARGS = ("--block-size", "16", "--max-model-len", "1024", "--num-gpu-blocks-override", "192",
               "--max-num-seqs", "8")
NUM_BLOCKS = 192
HOLD_TTL_S = 10.0
# Greedy tokens compared with the reference: a prefix of its output is enough to show the KV is right.
COMPARED_TOKENS = 16


# ---- unit: wire form, addresses, a real transfer engine --------------------------------------------------

def offer(**overrides: Any) -> RemotePrefill:
    base = RemotePrefill(transfer_id="t1", session="127.0.0.1:1", release_endpoint="tcp://127.0.0.1:2",
                         kv_addr=4096, num_blocks=8, block_ids=[3, 5, 6],
                         block_hashes=hash_full_blocks(PROMPT, BS, FINGERPRINT), block_size=BS,
                         model_fingerprint=FINGERPRINT, kv_layout="hm", ttl_s=30.0, expires_at=time.time() + 30)
    for name, value in overrides.items():
        setattr(base, name, value)
    return base


def test_offer_round_trips_through_json_and_refuses_what_does_not_fit() -> None:
    sent = offer()
    params = json.loads(json.dumps(sent.to_params()))
    assert params["do_remote_prefill"] is True
    assert RemotePrefill.parse(params) == sent
    sent.check_compatible(BS, FINGERPRINT, "hm")
    with pytest.raises(PDProtocolError, match="block size 4"):
        sent.check_compatible(16, FINGERPRINT, "hm")
    with pytest.raises(PDProtocolError, match="does not match"):
        sent.check_compatible(BS, "other-model", "hm")
    for broken in ({"remote_kv_addr": "0x10"}, {"remote_block_ids": [3, 9, 1]}, {"version": 99},
                   {"block_hashes": ["a"]}, {"remote_session": None}, {"block_size": True},
                   {"expires_at": None}):
        with pytest.raises(PDProtocolError):
            RemotePrefill.parse({**params, **broken})


def test_block_segments_merge_runs_per_plane() -> None:
    local, remote, lengths = block_segments(2, 10, 1000, 4, 5000, 8, [(0, 3), (1, 4), (3, 0)])
    # plane 0: run (0<-3, 2 blocks), run (3<-0, 1 block); plane 1 starts num_blocks * 10 bytes further.
    assert local == [1000, 1030, 1040, 1070]
    assert remote == [5030, 5000, 5110, 5080]
    assert lengths == [20, 10, 20, 10]


def test_transfer_engine_reads_strided_blocks_from_a_peer() -> None:
    """Two real engines on 127.0.0.1: the device-pool layout [planes, blocks, ...] read block by block."""
    planes, block_floats = 6, 32
    peer_pool = np.arange(planes * 8 * block_floats, dtype=np.float32).reshape(planes, 8, block_floats)
    local_pool = np.zeros((planes, 4, block_floats), dtype=np.float32)
    peer, reader = KVTransferEngine("127.0.0.1"), KVTransferEngine("127.0.0.1")
    try:
        peer_addr = peer.register(peer_pool)
        local_addr = reader.register(local_pool)
        pairs = [(0, 5), (1, 6), (3, 2)]
        reader.read(peer.session, *block_segments(planes, block_floats * 4, local_addr, 4, peer_addr, 8, pairs))
        for local_id, peer_id in pairs:
            np.testing.assert_array_equal(local_pool[:, local_id], peer_pool[:, peer_id])
        np.testing.assert_array_equal(local_pool[:, 2], 0)
        # Memory the peer never registered: an error, not garbage.
        with pytest.raises(Exception, match="failed"):
            reader.read(peer.session, [local_addr], [peer_addr + peer_pool.nbytes + (1 << 20)], [128])
    finally:
        reader.close()
        peer.close()


# ---- unit: the KV-cache manager's remote fills and holds ----------------------------------------------

class TransferLog:
    def __init__(self) -> None:
        self.tasks: list[TransferTask] = []

    def __call__(self, task: TransferTask) -> None:
        self.tasks.append(task)


def decode_cache() -> tuple[KVCacheManager, TransferLog]:
    log = TransferLog()
    config = CacheConfig(16, BS, FINGERPRINT, transfer_timeout_s=10.0)
    return KVCacheManager(config, np.zeros(16, np.int8), submit=log), log


def decode_seq(remote: RemotePrefill | None) -> Sequence:
    seq = Sequence("r1", list(PROMPT), SamplingParams(max_tokens=4))
    seq.remote_prefill = remote
    return seq


@pytest.mark.parametrize("ok", [True, False])
def test_remote_fill_reads_offered_blocks_then_hands_the_offer_back(ok: bool) -> None:
    cache, log = decode_cache()
    seq = decode_seq(offer())
    assert cache.try_admit(seq, max_new_tokens=64)
    (task,) = log.tasks
    assert task.kind == "remote_read" and task.remote.block_ids == [3, 5, 6]
    assert task.remote.session == "127.0.0.1:1" and task.device_block_ids == seq.block_table[:3]
    assert cache.is_loading(seq) and seq.remote_prefill is None
    assert all(cache.pool.blocks[b].state.name == "LOAD" for b in task.device_block_ids)
    assert cache.take_finished_offers() == []  # still reading: the peer must keep its blocks
    cache.on_transfer_done(TransferDone(task.task_id, "remote_read", ok=[ok] * 3))
    assert not cache.is_loading(seq)
    assert [o.transfer_id for o in cache.take_finished_offers()] == ["t1"]
    if ok:
        assert seq.num_computed_tokens == 12 and cache.stats.remote_hit_tokens == 12
        assert cache.index.num_device == 3  # registered: later requests share them
    else:
        assert seq.num_computed_tokens == 0 and cache.stats.remote_failed_blocks == 3  # recomputed locally
    cache.free(seq)
    assert cache.num_free_blocks == 16


def test_an_offer_no_fill_needs_is_handed_back_at_admission() -> None:
    cache, log = decode_cache()
    first = decode_seq(None)
    assert cache.try_admit(first, 64)
    cache.allocate(first, len(PROMPT))
    first.num_computed_tokens = len(PROMPT)
    cache.on_tokens_computed(first)  # the prompt's blocks are now on the device
    cache.free(first)
    seq = decode_seq(offer())
    assert cache.try_admit(seq, 64)
    assert log.tasks == [] and seq.num_computed_tokens == 12  # device hits, no read
    assert [o.transfer_id for o in cache.take_finished_offers()] == ["t1"]


def test_an_offer_for_other_tokens_is_not_read() -> None:
    cache, log = decode_cache()
    seq = decode_seq(offer(block_hashes=hash_full_blocks([7] * 14, BS, FINGERPRINT)))
    assert cache.try_admit(seq, 64)
    assert log.tasks == [] and seq.num_computed_tokens == 0
    assert len(cache.take_finished_offers()) == 1


def test_hold_keeps_blocks_after_the_sequence_is_freed_until_released() -> None:
    cache, _ = decode_cache()
    seq = decode_seq(None)
    assert cache.try_admit(seq, 64)
    cache.allocate(seq, len(PROMPT))
    seq.num_computed_tokens = len(PROMPT)
    cache.on_tokens_computed(seq)
    held = cache.hold(seq, 3)
    cache.free(seq)
    assert cache.num_free_blocks == 16 - 3
    assert all(cache.pool.blocks[b].state.name == "IN_USE" for b in held)
    cache.release_held(held)
    assert cache.num_free_blocks == 16 and cache.num_cached_blocks == 3


# ---- integration: two real instances ----------------------------------------------------------------

def _references() -> list[dict[str, Any]]:
    return json.loads(REFERENCE.read_text())


def _chat_body(ref: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": ref["prompt"]}], "temperature": 0, "return_token_ids": True,
            "max_tokens": min(COMPARED_TOKENS, len(ref["output_ids"])), **extra}


def _expected(ref: dict[str, Any]) -> list[int]:
    return ref["output_ids"][:COMPARED_TOKENS]


def _prefill(server: ServerProcess, ref: dict[str, Any]) -> dict[str, Any] | None:
    response = httpx.post(server.base_url + "/v1/chat/completions", timeout=120,
                          json=_chat_body(ref, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    assert response.status_code == 200, response.text
    return response.json()["kv_transfer_params"]


def _decode(server: ServerProcess, ref: dict[str, Any], params: dict[str, Any] | None,
            stream: bool = False) -> tuple[list[int], int]:
    """The decode call; returns (completion token ids, cached_tokens)."""
    body = _chat_body(ref, kv_transfer_params=params)
    if not stream:
        response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        data = response.json()
        return data["choices"][0]["completion_token_ids"], data["usage"]["prompt_tokens_details"]["cached_tokens"]
    body.update(stream=True, stream_options={"include_usage": True})
    tokens: list[int] = []
    cached = -1
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                tokens += choice.get("completion_token_ids") or []
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    return tokens, cached


def _stats(server: ServerProcess) -> dict[str, Any]:
    response = httpx.get(server.base_url + "/v1/cache/stats", timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def _wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _assert_no_block_in_use(server: ServerProcess) -> None:
    stats = _stats(server)
    assert stats["transfers_in_flight"] == 0, stats
    assert stats["kv_blocks_free"] + stats["kv_blocks_cached"] == NUM_BLOCKS, stats


@pytest.fixture(scope="module")
def pd_servers():
    """One prefill instance and two decode instances, FD_USE_KVCACHE_LOCK off and on (the decode side's
    cache transfer process is where the lock brackets the incoming KV). Started together: a server start
    takes about a minute on a loaded 2-core machine."""
    ttl = {"FD_PD_HOLD_TTL_S": str(HOLD_TTL_S)}
    servers = {
        "prefill": ServerProcess(*SERVER_ARGS, "--splitwise-role", "prefill", env=ttl, id_prefix="pdp"),
        "lock_off": ServerProcess(*SERVER_ARGS, "--splitwise-role", "decode", env={"FD_USE_KVCACHE_LOCK": "0"},
                                  id_prefix="pdd"),
        # Lock on, and the sanitizer: every copy into a block checks it is in the state its kind requires (LOAD).
        "lock_on": ServerProcess(*SERVER_ARGS, "--splitwise-role", "decode",
                                 env={"FD_USE_KVCACHE_LOCK": "1", "FD_KVCACHE_SANITIZER": "1"}, id_prefix="pdl"),
    }
    try:
        for server in servers.values():
            server.launch()
        for server in servers.values():
            server.wait_healthy()
        yield servers
    finally:
        for server in servers.values():
            server.close()
    # The decode instance the last test kills leaves its segments behind (SIGKILL); the others clean up.
    assert servers["prefill"].leftovers == [] and servers["lock_off"].leftovers == []


@pytest.mark.integration
@pytest.mark.parametrize("lock", ["lock_off", "lock_on"])
def test_prefill_then_decode_equals_mixed_greedy_concurrently(pd_servers: dict[str, ServerProcess],
                                                              lock: str) -> None:
    prefill, decode = pd_servers["prefill"], pd_servers[lock]
    refs = _references()

    def one(index: int) -> tuple[list[int], int, int]:
        params = _prefill(prefill, refs[index])
        assert params is not None and params["do_remote_prefill"] is True
        tokens, cached = _decode(decode, refs[index], params, stream=index % 2 == 1)
        return tokens, cached, len(params["remote_block_ids"]) * 16

    with ThreadPoolExecutor(max_workers=len(refs)) as pool:
        results = list(pool.map(one, range(len(refs))))
    for ref, (tokens, cached, offered) in zip(refs, results):
        assert tokens == _expected(ref), ref["prompt"]
        assert cached >= min(offered, (len(ref["prompt_ids"]) - 1) // 16 * 16) > 0
    decode_stats = _stats(decode)
    assert decode_stats["remote_reads"] >= 1 and decode_stats["remote_hit_tokens"] > 0, decode_stats
    assert decode_stats["remote_failed_blocks"] == 0 and decode_stats["pd_offers_refused"] == 0, decode_stats
    # Every hold was released by the decode side (long before the TTL), nothing is left in use.
    _wait_for(lambda: _stats(prefill)["pd_held_blocks"] == 0, HOLD_TTL_S / 2, "the holds' release")
    assert _stats(prefill)["pd_expired"] == 0
    _assert_no_block_in_use(prefill)
    _assert_no_block_in_use(decode)


@pytest.mark.integration
def test_failed_read_falls_back_to_local_prefill(pd_servers: dict[str, ServerProcess]) -> None:
    prefill, decode = pd_servers["prefill"], pd_servers["lock_off"]
    ref = _references()[-1]
    assert httpx.post(decode.base_url + "/v1/cache/reset", timeout=10).status_code == 200
    params = _prefill(prefill, ref)
    before = _stats(decode)
    # The same offer, pointing past the memory the prefill instance registered: the peer refuses the read.
    broken = {**params, "remote_kv_addr": params["remote_kv_addr"] + (1 << 40)}
    tokens, _ = _decode(decode, ref, broken)
    assert tokens == _expected(ref)
    after = _stats(decode)
    assert after["remote_failed_blocks"] > before["remote_failed_blocks"], after
    # Another model's offer is not even tried; its hold is released all the same.
    params = _prefill(prefill, ref)
    tokens, _ = _decode(decode, ref, {**params, "model_fingerprint": "0" * 16})
    assert tokens == _expected(ref)
    assert _stats(decode)["pd_offers_refused"] == before["pd_offers_refused"] + 1
    # A nonsensical release endpoint costs the request nothing.
    params = _prefill(prefill, ref)
    tokens, _ = _decode(decode, ref, {**params, "release_endpoint": "not an endpoint"})
    assert tokens == _expected(ref)
    # An offer whose hold ends (nearly) now is not read either: the prefill side may reuse those blocks.
    params = _prefill(prefill, ref)
    tokens, _ = _decode(decode, ref, {**params, "expires_at": time.time() + 0.5})
    assert tokens == _expected(ref)
    assert _stats(decode)["pd_offers_refused"] == before["pd_offers_refused"] + 2
    # The one with the bad endpoint could not be released: it expires.
    _wait_for(lambda: _stats(prefill)["pd_held_blocks"] == 0, HOLD_TTL_S + 3, "the holds' release")
    _assert_no_block_in_use(decode)


@pytest.mark.integration
def test_long_prompt_is_read_in_several_chunks(pd_servers: dict[str, ServerProcess]) -> None:
    """More blocks than the decode side stages per round (PD_STAGING_BLOCKS = 16): read in chunks, same output
    as the decode instance computing the prompt itself (a mixed request, from an emptied prefix cache)."""
    prefill, decode = pd_servers["prefill"], pd_servers["lock_on"]
    ref = {"prompt": " ".join(r["prompt"] for r in _references()) * 6, "output_ids": [0] * 8}
    assert httpx.post(decode.base_url + "/v1/cache/reset", timeout=10).status_code == 200
    local, _ = _decode(decode, ref, None)
    assert httpx.post(decode.base_url + "/v1/cache/reset", timeout=10).status_code == 200
    params = _prefill(prefill, ref)
    assert len(params["remote_block_ids"]) > 16
    before = _stats(decode)["remote_hit_tokens"]
    tokens, cached = _decode(decode, ref, params)
    assert tokens == local
    assert _stats(decode)["remote_hit_tokens"] - before == cached == len(params["remote_block_ids"]) * 16


@pytest.mark.integration
def test_decode_killed_mid_stream_and_unreleased_holds_expire(pd_servers: dict[str, ServerProcess]) -> None:
    """Last in the module: it kills the lock-on decode instance."""
    prefill, doomed, survivor = pd_servers["prefill"], pd_servers["lock_on"], pd_servers["lock_off"]
    ref = _references()[0]
    params = _prefill(prefill, ref)
    body = _chat_body(ref, max_tokens=400, ignore_eos=True, stream=True, kv_transfer_params=params)
    broke = False
    with httpx.stream("POST", doomed.base_url + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        try:
            for index, _line in enumerate(response.iter_lines()):
                if index == 2:
                    doomed.proc.send_signal(signal.SIGKILL)
                    doomed.kill_group()
        except httpx.HTTPError:
            broke = True
    assert broke or doomed.exited()
    # The killed instance's release of the first hold is fire and forget: it may have died with the message
    # still queued, and then that hold ends at its TTL. Either way it ends before the next one is counted.
    _wait_for(lambda: _stats(prefill)["pd_held_blocks"] == 0, HOLD_TTL_S + 3, "the first hold's release or TTL")
    # A prefill whose decode call never comes (its decode instance is gone): held, then freed at the TTL.
    params = _prefill(prefill, ref)
    assert _stats(prefill)["pd_held_blocks"] == len(params["remote_block_ids"]) > 0
    expired = _stats(prefill)["pd_expired"]
    _wait_for(lambda: _stats(prefill)["pd_held_blocks"] == 0, HOLD_TTL_S + 3, "the hold's TTL")
    assert _stats(prefill)["pd_expired"] == expired + 1
    _assert_no_block_in_use(prefill)
    # The prefill instance and the other decode instance still serve.
    tokens, cached = _decode(survivor, ref, _prefill(prefill, ref))
    assert tokens == _expected(ref)
