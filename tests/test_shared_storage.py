"""The storage tier shared across instances, DP ranks and restarts (issue 14, items 1-2).

Unit part: the engine's lookup handle (``StorageLookup``) and what the KV-cache manager does with its
answers; the store is a real file backend another "instance" (a second backend object on the same
directory) wrote into, and the cache transfer process is the boundary (its tasks are collected).
A store that hangs is a stand-in at the network boundary (Mooncake's exists RPC).

Integration part (real servers): a restarted server and a second server on the same directory (and the
same Mooncake master) serve a prompt from what the first one stored, with the same greedy output; a
corrupted object or one stored under another key is a miss and the output stays right; the LRU cap keeps
the directory under it.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from cache_manager.block_hash import hash_full_blocks
from cache_manager.kv_cache_manager import KVCacheManager
from cache_manager.kv_layout import storage_key
from cache_manager.storage_lookup import StorageLookup, create_storage_lookup
from cache_manager.transfer_factory.base import KVStorageBackend
from cache_manager.transfer_factory.file_backend import FileStorageBackend
from cache_manager.transfer_planner import NEGATIVE_LOOKUP_TTL_S
from config.engine_config import CacheConfig, StorageConfig
from config.sampling_params import SamplingParams
from engine.sequence import Sequence
from harness.server import ServerProcess
from inter_communicator.messages import TransferTask
from tests.mooncake_utils import mooncake_importable

BS = 4
FINGERPRINT = "fp"
PROMPT = list(range(100, 114))  # 14 tokens: 3 matchable full blocks


class TransferLog:
    def __init__(self) -> None:
        self.tasks: list[TransferTask] = []

    def __call__(self, task: TransferTask) -> None:
        self.tasks.append(task)

    def of_kind(self, kind: str) -> list[TransferTask]:
        return [task for task in self.tasks if task.kind == kind]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def block_keys(tokens: list[int]) -> list[str]:
    return [storage_key(FINGERPRINT, h, tp_rank=0) for h in hash_full_blocks(tokens, BS, FINGERPRINT)]


def other_instance_stores(directory: Path, keys: list[str]) -> None:
    """What another server's cache transfer process does: write the blocks into the shared directory."""
    writer = FileStorageBackend(directory, namespace="shared")
    assert writer.batch_put(keys, [np.full(16, i, np.float32) for i in range(len(keys))]) == [True] * len(keys)
    writer.close()


def make_manager(lookup: KVStorageBackend | StorageLookup, clock: Clock | None = None,
                 timeout_s: float = 1.0) -> tuple[KVCacheManager, TransferLog]:
    if isinstance(lookup, KVStorageBackend):
        lookup = StorageLookup(lookup, timeout_s)
    log = TransferLog()
    config = CacheConfig(16, BS, FINGERPRINT, storage_enabled=True, transfer_timeout_s=10.0)
    cache = KVCacheManager(config, np.zeros(16, np.int8), submit=log, clock=clock or Clock(), storage_lookup=lookup)
    return cache, log


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=4), eos_token_ids=(2,))


def test_blocks_another_instance_stored_are_prefetched_after_one_batched_lookup(tmp_path: Path) -> None:
    keys = block_keys(PROMPT)
    other_instance_stores(tmp_path, keys)
    cache, log = make_manager(FileStorageBackend(tmp_path, namespace="shared"))
    s = seq("a", PROMPT)
    cache.admit(s)
    (prefetch,) = log.of_kind("prefetch")
    assert prefetch.storage_keys == keys
    assert cache.is_loading(s)
    stats = cache.summary()
    assert (stats["storage_lookups"], stats["storage_lookup_hits"], stats["storage_lookup_misses"]) == (1, 3, 0)
    assert stats["storage_lookup_seconds"] > 0 and stats["storage_lookup_timeouts"] == 0


def test_only_the_stored_prefix_is_prefetched(tmp_path: Path) -> None:
    keys = block_keys(PROMPT)
    other_instance_stores(tmp_path, [keys[0], keys[2]])  # block 1 is missing: block 2 cannot be used
    cache, log = make_manager(FileStorageBackend(tmp_path, namespace="shared"))
    found = cache.match(seq("a", PROMPT))
    assert found.fills == [(hash_full_blocks(PROMPT, BS, FINGERPRINT)[0], "storage")]
    assert cache.stats.storage_lookups == 1
    assert (cache.stats.storage_lookup_hits, cache.stats.storage_lookup_misses) == (2, 1)


def test_another_model_fingerprint_is_never_found(tmp_path: Path) -> None:
    foreign = [storage_key("otherfp", h, tp_rank=0) for h in hash_full_blocks(PROMPT, BS, "otherfp")]
    other_instance_stores(tmp_path, foreign)
    cache, log = make_manager(FileStorageBackend(tmp_path, namespace="shared"))
    assert cache.match(seq("a", PROMPT)).fills == []
    assert cache.stats.storage_lookup_misses == 3


def test_misses_are_remembered_only_for_a_short_time(tmp_path: Path) -> None:
    clock = Clock()
    cache, log = make_manager(FileStorageBackend(tmp_path, namespace="shared"), clock)
    assert cache.match(seq("a", PROMPT)).fills == []
    other_instance_stores(tmp_path, block_keys(PROMPT))
    assert cache.match(seq("a", PROMPT)).fills == []  # within the TTL: not asked again
    assert cache.stats.storage_lookups == 1
    clock.now += NEGATIVE_LOOKUP_TTL_S + 0.01
    assert len(cache.match(seq("a", PROMPT)).fills) == 3
    assert cache.stats.storage_lookups == 2
    # Positive answers are kept: no further lookup for these blocks.
    clock.now += NEGATIVE_LOOKUP_TTL_S + 0.01
    assert len(cache.match(seq("a", PROMPT)).fills) == 3
    assert cache.stats.storage_lookups == 2


def test_device_hits_are_not_looked_up(tmp_path: Path) -> None:
    cache, log = make_manager(FileStorageBackend(tmp_path, namespace="shared"))
    first = seq("a", PROMPT)
    cache.admit(first)
    assert cache.stats.storage_lookups == 1  # nothing cached yet: all 3 blocks asked for
    cache.allocate(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    cache.on_tokens_computed(first)
    found = cache.match(seq("b", PROMPT))
    assert len(found.hit_block_ids) == 3 and found.fills == []
    assert cache.stats.storage_lookups == 1


class HangingStore(FileStorageBackend):
    """A store whose exists call blocks until released, like an RPC to a master that stopped answering."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory, namespace="shared")
        self.release = threading.Event()
        self.calls = 0

    def exists(self, keys: list[str]) -> list[bool]:
        self.calls += 1
        self.release.wait(30)
        return super().exists(keys)


def test_a_hanging_store_costs_a_miss_within_the_timeout_not_a_stall(tmp_path: Path) -> None:
    other_instance_stores(tmp_path, block_keys(PROMPT))
    store = HangingStore(tmp_path)
    clock = Clock()
    lookup = StorageLookup(store, timeout_s=0.05)
    cache, log = make_manager(lookup, clock)
    started = time.monotonic()
    assert cache.match(seq("a", PROMPT)).fills == []
    assert time.monotonic() - started < 1.0
    assert cache.stats.storage_lookup_timeouts == 1 and cache.stats.storage_lookup_misses == 3
    # While the first call still hangs, later lookups do not queue behind it.
    clock.now += NEGATIVE_LOOKUP_TTL_S + 0.01
    started = time.monotonic()
    assert cache.match(seq("a", PROMPT)).fills == []
    assert time.monotonic() - started < 0.04
    assert store.calls == 1 and cache.stats.storage_lookup_timeouts == 2
    # Once the store answers again, the next lookup after the TTL finds the blocks.
    store.release.set()
    deadline = time.monotonic() + 5
    fills: list = []
    while not fills and time.monotonic() < deadline:
        clock.now += NEGATIVE_LOOKUP_TTL_S + 0.01
        fills = cache.match(seq("a", PROMPT)).fills
        time.sleep(0.01)
    assert len(fills) == 3 and store.calls == 2
    lookup.close()


def test_lookup_handle_from_config_uses_the_shared_directory(tmp_path: Path) -> None:
    keys = block_keys(PROMPT)
    other_instance_stores(tmp_path, keys[:2])
    lookup = create_storage_lookup(StorageConfig(backend="file", namespace="shared", file_dir=str(tmp_path),
                                                 file_max_bytes=1, lookup_timeout_s=0.5))
    try:
        assert lookup.lookup(keys).exists == [True, True, False]
        assert lookup.backend.max_bytes == 0  # only the writer evicts
    finally:
        lookup.close()


def test_max_bytes_flag_reaches_the_file_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cache_manager.transfer_factory.factory import create_storage_backend
    from config.engine_config import EngineArgs, build_engine_config

    monkeypatch.setenv("FD_STORAGE_LOOKUP_TIMEOUT_S", "0.25")
    config = build_engine_config(EngineArgs(kvcache_storage_backend="file", file_backend_storage_dir=str(tmp_path),
                                            file_backend_max_bytes=5 << 20, num_gpu_blocks_override=64))
    assert config.cache.storage.file_max_bytes == 5 << 20
    assert config.cache.storage.lookup_timeout_s == 0.25
    backend = create_storage_backend(config.cache.storage)
    assert backend.max_bytes == 5 << 20
    backend.close()
    unbounded = build_engine_config(EngineArgs(kvcache_storage_backend="file", file_backend_storage_dir=str(tmp_path),
                                               file_backend_max_bytes=0, num_gpu_blocks_override=64))
    assert unbounded.cache.storage.file_max_bytes == 0


@pytest.mark.integration
@pytest.mark.skipif(not mooncake_importable(), reason="mooncake is not importable (bash .ci/install_system_deps.sh)")
def test_mooncake_lookup_client_sees_another_clients_objects() -> None:
    from cache_manager.transfer_factory.factory import create_storage_backend
    from tests.mooncake_utils import mooncake_master

    with mooncake_master() as master:
        config = StorageConfig(backend="mooncake", namespace="shared", mooncake_master_addr=master.address,
                               mooncake_global_segment_size=32 << 20, mooncake_local_buffer_size=16 << 20,
                               lookup_timeout_s=0.5)
        lookup = create_storage_lookup(config)  # contributes no memory: nothing could be stored in it
        writer = create_storage_backend(config)
        try:
            keys = block_keys(PROMPT)
            assert writer.batch_put(keys[:2], [np.ones(16, np.float32)] * 2) == [True, True]
            assert lookup.lookup(keys).exists == [True, True, False]
            with pytest.raises(RuntimeError, match="lookup-only"):
                lookup.backend.batch_put(keys[:1], [np.ones(16, np.float32)])
        finally:
            lookup.close()
            writer.close()


# ---- integration: real servers sharing a store ------------------------------------------------------

SERVER_ARGS = ("--block-size", "16", "--num-gpu-blocks-override", "64", "--max-model-len", "1024",
               "--max-num-seqs", "4")
TOPICS = {
    "rome": "The history of the Roman Empire spans many centuries, from the founding of the city to the fall "
            "of the west, with emperors, senators, soldiers and merchants shaping a vast territory. ",
    "plants": "Photosynthesis is the process plants use to turn sunlight, water and carbon dioxide into sugar "
              "and oxygen, and it sustains almost every food chain on the planet. ",
    "ocean": "The Pacific Ocean is the largest and deepest of the world's oceans, covering about a third of "
             "the surface of the Earth and holding thousands of islands. ",
    "volcano": "Volcanoes form where molten rock from deep inside the Earth reaches the surface through cracks "
               "in the crust, building mountains of ash and lava over time. ",
}


def long_prompt(topic: str) -> str:
    return TOPICS[topic] * 5 + "Summarise the text above in one sentence."


def complete(server: ServerProcess, prompt: str) -> tuple[list[int], int, int]:
    """Greedy completion: (completion token ids, cached prompt tokens, prompt tokens)."""
    resp = httpx.post(server.base_url + "/v1/completions", json={
        "prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}, timeout=300)
    resp.raise_for_status()
    body = resp.json()
    usage = body["usage"]
    return (body["choices"][0]["completion_token_ids"], usage["prompt_tokens_details"]["cached_tokens"],
            usage["prompt_tokens"])


def cache_stats(server: ServerProcess) -> dict:
    return httpx.get(server.base_url + "/v1/cache/stats", timeout=30).json()


def wait_stored(server: ServerProcess, at_least: int, timeout: float = 60.0) -> dict:
    """Block until the server's write-through copies landed (a response can return before they do)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = cache_stats(server)
        if stats["transfers_in_flight"] == 0 and stats["storage_blocks_known"] >= at_least:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"writes did not land within {timeout} s: {stats}")
        time.sleep(0.2)


def object_files(directory: Path) -> dict[Path, int]:
    """Object file -> mtime_ns under a file-backend directory."""
    return {path: path.stat().st_mtime_ns for path in directory.rglob("*.kv")}


def file_server(directory: Path, *extra: str) -> ServerProcess:
    return ServerProcess(*SERVER_ARGS, "--kvcache-storage-backend", "file", "--file-backend-storage-dir",
                         str(directory), *extra)


@pytest.mark.integration
def test_restarted_server_reuses_its_file_store_and_rejects_damaged_objects(tmp_path: Path) -> None:
    store = tmp_path / "kv"
    cold: dict[str, list[int]] = {}
    files: dict[str, set[Path]] = {}
    with file_server(store) as first:
        known = 0
        for topic in ("rome", "plants", "ocean"):
            before = set(object_files(store))
            tokens, cached, prompt_tokens = complete(first, long_prompt(topic))
            assert cached == 0
            cold[topic] = tokens
            known += prompt_tokens // 16
            wait_stored(first, known)
            files[topic] = set(object_files(store)) - before
            assert len(files[topic]) >= (prompt_tokens - 1) // 16
    # Damage "plants": flip a payload byte in every one of its objects.
    for path in files["plants"]:
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))
    # "ocean": each object replaced by another key's object (what a foreign or misplaced object looks like).
    donors = sorted(files["rome"])
    for index, path in enumerate(sorted(files["ocean"])):
        path.write_bytes(donors[index % len(donors)].read_bytes())

    with file_server(store) as restarted:
        tokens, cached, prompt_tokens = complete(restarted, long_prompt("rome"))
        assert tokens == cold["rome"]
        assert cached == (prompt_tokens - 1) // 16 * 16  # every full prompt block came from the store
        for topic in ("plants", "ocean"):
            tokens, cached, _ = complete(restarted, long_prompt(topic))
            assert tokens == cold[topic], topic  # recomputed: the damaged objects were misses
            assert cached == 0, topic
        stats = cache_stats(restarted)
    assert stats["storage_lookups"] >= 3 and stats["storage_lookup_hits"] > 0
    assert stats["storage_hit_tokens"] > 0
    assert stats["storage_miss_blocks"] >= 2  # the first block of each damaged prompt failed verification
    assert stats["storage_lookup_timeouts"] == 0


def ttft(server: ServerProcess, prompt: str) -> float:
    """Seconds from sending a streaming request to its first content chunk."""
    started = time.perf_counter()
    with httpx.stream("POST", server.base_url + "/v1/completions", json={
            "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True}, timeout=300) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.perf_counter() - started
    raise AssertionError("the stream ended without a token")


def check_second_instance_reuses_the_first(first: ServerProcess, second: ServerProcess) -> None:
    tokens, cached, prompt_tokens = complete(first, long_prompt("volcano"))
    assert cached == 0
    wait_stored(first, (prompt_tokens - 1) // 16)
    again, cached, _ = complete(second, long_prompt("volcano"))
    assert again == tokens
    assert cached == (prompt_tokens - 1) // 16 * 16
    stats = cache_stats(second)
    assert stats["storage_lookup_hits"] >= (prompt_tokens - 1) // 16 and stats["storage_hit_tokens"] == cached


@pytest.mark.integration
def test_second_instance_on_the_same_directory_reuses_the_first_ones_blocks(tmp_path: Path) -> None:
    with file_server(tmp_path / "kv") as first, file_server(tmp_path / "kv") as second:
        check_second_instance_reuses_the_first(first, second)


@pytest.mark.integration
@pytest.mark.skipif(not mooncake_importable(), reason="mooncake is not importable (bash .ci/install_system_deps.sh)")
def test_second_instance_on_the_same_mooncake_master_reuses_the_first_ones_blocks() -> None:
    from tests.mooncake_utils import mooncake_master

    with mooncake_master() as master:
        env = {"MOONCAKE_MASTER_SERVER_ADDR": master.address, "MOONCAKE_GLOBAL_SEGMENT_SIZE": str(128 << 20),
               "MOONCAKE_LOCAL_BUFFER_SIZE": str(32 << 20)}
        with ServerProcess(*SERVER_ARGS, "--kvcache-storage-backend", "mooncake", env=env) as first, \
                ServerProcess(*SERVER_ARGS, "--kvcache-storage-backend", "mooncake", env=env) as second:
            check_second_instance_reuses_the_first(first, second)


@pytest.mark.integration
def test_lru_cap_keeps_the_directory_under_it(tmp_path: Path) -> None:
    store = tmp_path / "kv"
    cap = 16 * 737_312  # sixteen SmolLM2 blocks of 16 tokens (737,280 payload bytes + 32 header bytes)
    with file_server(store, "--file-backend-max-bytes", str(cap)) as server:
        outputs = {}
        for topic in TOPICS:  # ~10 blocks each: the cap holds less than two prompts
            outputs[topic], _, prompt_tokens = complete(server, long_prompt(topic))
            wait_stored(server, 1)
            assert sum(path.stat().st_size for path in object_files(store)) <= cap
        # The most recent prompt survived eviction: after a device-cache reset it comes back from storage.
        httpx.post(server.base_url + "/v1/cache/reset", timeout=30).raise_for_status()
        tokens, cached, _ = complete(server, long_prompt("volcano"))
        assert tokens == outputs["volcano"] and cached > 0
        # The first prompt was evicted: recomputed, same output.
        tokens, cached, _ = complete(server, long_prompt("rome"))
        assert tokens == outputs["rome"] and cached == 0


@pytest.mark.integration
@pytest.mark.skipif(not mooncake_importable(), reason="mooncake is not importable (bash .ci/install_system_deps.sh)")
def test_mooncake_master_gone_lookups_are_misses_within_the_timeout() -> None:
    from cache_manager.transfer_factory.factory import create_storage_backend
    from tests.mooncake_utils import MooncakeMaster

    master = MooncakeMaster().start()
    try:
        config = StorageConfig(backend="mooncake", namespace="shared", mooncake_master_addr=master.address,
                               mooncake_global_segment_size=32 << 20, mooncake_local_buffer_size=16 << 20,
                               mooncake_reconnect_interval_s=0.5, lookup_timeout_s=0.2)
        lookup = create_storage_lookup(config)
        writer = create_storage_backend(config)
        keys = block_keys(PROMPT)
        assert writer.batch_put(keys, [np.ones(16, np.float32)] * 3) == [True] * 3
        assert lookup.lookup(keys).exists == [True] * 3
        master.stop()
        for _ in range(5):
            started = time.monotonic()
            result = lookup.lookup(keys)
            assert result.exists == [False] * 3
            assert time.monotonic() - started < 0.5  # bounded by the timeout, whatever the client does
        lookup.close()
        writer.close()
    finally:
        master.stop()
        master.remove_log()
