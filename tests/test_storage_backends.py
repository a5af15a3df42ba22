"""KV-cache storage backends (file, real Mooncake) on real disks and a real Mooncake master.

Every backend test runs against both backends. A block is one SmolLM2 KV block at 64 tokens:
30 layers x (K, V) x 64 tokens x 3 KV heads x 64 dims float32 = 2.9 MB. The Mooncake tests
need the mooncake package (.ci/install_system_deps.sh installs it on CI) and skip only when
it is not importable; they start their own masters on free ports.
"""
from __future__ import annotations

import contextlib
import logging
import os
import resource
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from cache_manager.transfer_factory import KVStorageBackend, StorageConfig, create_storage_backend
from cache_manager.transfer_factory.base import HEADER_SIZE, encode_header
from cache_manager.transfer_factory.file_backend import FileStorageBackend
from tests.mooncake_utils import MooncakeMaster, mooncake_importable, mooncake_master

BLOCK_FLOATS = 30 * 2 * 64 * 3 * 64
BLOCK_BYTES = BLOCK_FLOATS * 4
SENTINEL = 7.0
MOONCAKE_SEGMENT_BYTES = 128 << 20  # room for ~40 blocks; tests store far fewer
MOONCAKE_LOCAL_BUFFER_BYTES = 32 << 20

needs_mooncake = pytest.mark.skipif(not mooncake_importable(),
                                    reason="mooncake is not importable (bash .ci/install_system_deps.sh)")

BACKENDS = ["file", pytest.param("mooncake", marks=[needs_mooncake, pytest.mark.integration])]  # starts a master


def random_blocks(count: int, seed: int) -> list[np.ndarray]:
    """Blocks of arbitrary bit patterns (NaNs and denormals included): byte-exactness, not float equality."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 2**32, BLOCK_FLOATS, dtype=np.uint32).view(np.float32) for _ in range(count)]


def sentinel_buffers(count: int, floats: int = BLOCK_FLOATS) -> list[np.ndarray]:
    return [np.full(floats, SENTINEL, dtype=np.float32) for _ in range(count)]


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.nbytes == b.nbytes and bytes(a.reshape(-1).view(np.uint8)) == bytes(b.reshape(-1).view(np.uint8))


def untouched(buffer: np.ndarray) -> bool:
    return bool(np.all(buffer == SENTINEL))


def unique_keys(count: int, prefix: str = "fp0123abcd") -> list[str]:
    # The cache-transfer process's shape: <model_fingerprint>_<block_hash_hex>_tp0.
    return [f"{prefix}_{uuid.uuid4().hex}{uuid.uuid4().hex}_tp0" for _ in range(count)]


def mooncake_config(master: MooncakeMaster, namespace: str, **overrides) -> StorageConfig:
    settings = dict(backend="mooncake", namespace=namespace, mooncake_master_addr=master.address,
                    mooncake_global_segment_size=MOONCAKE_SEGMENT_BYTES,
                    mooncake_local_buffer_size=MOONCAKE_LOCAL_BUFFER_BYTES,
                    mooncake_reconnect_interval_s=0.5)
    settings.update(overrides)
    return StorageConfig(**settings)


@pytest.fixture(scope="module")
def shared_master() -> Iterator[MooncakeMaster]:
    if not mooncake_importable():
        pytest.skip("mooncake is not importable (bash .ci/install_system_deps.sh)")
    with mooncake_master() as master:
        yield master


@pytest.fixture(scope="module")
def backends(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """One instance per backend kind for the whole module: a Mooncake client costs ~2 s to close."""
    created: dict[str, KVStorageBackend] = {}
    created["file"] = create_storage_backend(StorageConfig(
        backend="file", namespace="tests", file_dir=str(tmp_path_factory.mktemp("kvstore"))))
    try:
        yield created
    finally:
        for backend in created.values():
            backend.close()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, backends: dict) -> Iterator[KVStorageBackend]:
    kind = request.param
    if kind not in backends:
        master = request.getfixturevalue("shared_master")
        backends[kind] = create_storage_backend(mooncake_config(master, "tests"))
    instance = backends[kind]
    instance.clear()
    yield instance
    instance.clear()


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {name: after[name] - before[name] for name in after if after[name] != before[name]}


# ---- both backends --------------------------------------------------------------------------


def test_round_trip_blocks_byte_exact(backend: KVStorageBackend, capsys: pytest.CaptureFixture) -> None:
    blocks = random_blocks(6, seed=1)
    keys = unique_keys(len(blocks))
    before = backend.stats()

    started = time.perf_counter()
    assert backend.batch_put(keys, blocks) == [True] * len(blocks)
    put_seconds = time.perf_counter() - started
    buffers = sentinel_buffers(len(blocks))
    started = time.perf_counter()
    assert backend.batch_get(keys, buffers) == [True] * len(blocks)
    get_seconds = time.perf_counter() - started

    for block, buffer in zip(blocks, buffers):
        assert same_bytes(block, buffer)
    assert delta(before, backend.stats()) == {
        "puts": 6, "put_bytes": 6 * BLOCK_BYTES, "gets": 6, "get_bytes": 6 * BLOCK_BYTES, "hits": 6}
    megabytes = len(blocks) * BLOCK_BYTES / 1e6
    with capsys.disabled():
        print(f"\n[{backend.name}] {len(blocks)} x {BLOCK_BYTES / 1e6:.1f} MB blocks: "
              f"put {megabytes / put_seconds:.0f} MB/s ({put_seconds / len(blocks) * 1e3:.1f} ms/block), "
              f"get {megabytes / get_seconds:.0f} MB/s ({get_seconds / len(blocks) * 1e3:.1f} ms/block)")


def test_any_dtype_and_shape_round_trips(backend: KVStorageBackend) -> None:
    values = [np.arange(15, dtype=np.int32).reshape(3, 5), np.linspace(-1, 1, 7, dtype=np.float16),
              np.frombuffer(b"\x00\xffabc", dtype=np.uint8).copy()]
    keys = unique_keys(len(values))
    assert backend.batch_put(keys, values) == [True] * 3
    outputs = [np.zeros_like(value) for value in values]
    assert backend.batch_get(keys, outputs) == [True] * 3
    for value, output in zip(values, outputs):
        assert same_bytes(value, output)


def test_wrong_size_buffer_is_a_miss_and_keeps_the_object(backend: KVStorageBackend) -> None:
    block = random_blocks(1, seed=2)[0]
    key = unique_keys(1)[0]
    assert backend.batch_put([key], [block]) == [True]

    smaller, larger = sentinel_buffers(1, BLOCK_FLOATS - 1)[0], sentinel_buffers(1, BLOCK_FLOATS + 16)[0]
    assert backend.batch_get([key, key], [smaller, larger]) == [False, False]
    assert untouched(smaller) and untouched(larger)

    exact = sentinel_buffers(1)[0]
    assert backend.batch_get([key], [exact]) == [True]
    assert same_bytes(block, exact)


def test_missing_key_is_a_miss_and_leaves_the_buffer_untouched(backend: KVStorageBackend) -> None:
    present_block = random_blocks(1, seed=3)[0]
    present, missing = unique_keys(2)
    assert backend.batch_put([present], [present_block]) == [True]
    before = backend.stats()

    buffers = sentinel_buffers(2)
    assert backend.batch_get([missing, present], buffers) == [False, True]
    assert untouched(buffers[0])
    assert same_bytes(present_block, buffers[1])
    assert delta(before, backend.stats()) == {"gets": 2, "hits": 1, "misses": 1, "get_bytes": BLOCK_BYTES}


def test_exists_remove_clear(backend: KVStorageBackend) -> None:
    values = [np.full(256, i, dtype=np.float32) for i in range(3)]
    keys = unique_keys(3)
    missing = unique_keys(1)[0]
    assert backend.batch_put(keys, values) == [True] * 3
    assert backend.exists(keys + [missing]) == [True, True, True, False]

    assert backend.remove([keys[0], missing]) == 1
    assert backend.exists(keys) == [False, True, True]
    assert backend.batch_get([keys[0]], sentinel_buffers(1, 256)) == [False]

    backend.clear()
    assert backend.exists(keys) == [False, False, False]
    buffers = sentinel_buffers(2, 256)
    assert backend.batch_get(keys[1:], buffers) == [False, False]
    assert untouched(buffers[0]) and untouched(buffers[1])
    assert backend.remove(keys) == 0


def test_overwrite_replaces_the_object(backend: KVStorageBackend) -> None:
    key = unique_keys(1)[0]
    first, second = random_blocks(2, seed=4)
    assert backend.batch_put([key], [first]) == [True]
    # Read once first: Mooncake holds a read lease on objects it just served.
    assert backend.batch_get([key], sentinel_buffers(1)) == [True]
    assert backend.batch_put([key], [second]) == [True]
    output = sentinel_buffers(1)[0]
    assert backend.batch_get([key], [output]) == [True]
    assert same_bytes(second, output)

    smaller = np.arange(100, dtype=np.float32)
    assert backend.batch_put([key], [smaller]) == [True]
    assert backend.batch_get([key], [sentinel_buffers(1)[0]]) == [False]
    small_output = np.zeros(100, dtype=np.float32)
    assert backend.batch_get([key], [small_output]) == [True]
    assert same_bytes(smaller, small_output)


def test_clear_only_touches_its_own_namespace(backend: KVStorageBackend, request: pytest.FixtureRequest) -> None:
    if backend.name == "file":
        other = FileStorageBackend(backend.root_dir, namespace="other")
    else:
        other = create_storage_backend(mooncake_config(request.getfixturevalue("shared_master"), "other"))
    try:
        key = unique_keys(1)[0]
        value = np.arange(64, dtype=np.float32)
        assert backend.batch_put([key], [value]) == [True]
        assert other.batch_put([key], [value * 2]) == [True]
        backend.clear()
        assert backend.exists([key]) == [False]
        output = np.zeros(64, dtype=np.float32)
        assert other.batch_get([key], [output]) == [True]
        assert same_bytes(value * 2, output)
    finally:
        other.clear()
        other.close()


def test_programming_errors_raise(backend: KVStorageBackend) -> None:
    value = np.zeros(4, dtype=np.float32)
    with pytest.raises(ValueError, match="invalid"):
        backend.batch_put(["../escape"], [value])
    with pytest.raises(ValueError, match="2 keys but 1 arrays"):
        backend.batch_get(unique_keys(2), [value])
    with pytest.raises(ValueError, match="contiguous"):
        backend.batch_put(unique_keys(1), [np.zeros((4, 4), dtype=np.float32)[:, 0]])
    with pytest.raises(ValueError, match="unknown KV-cache storage backend 'redis'.*file, mooncake"):
        create_storage_backend(StorageConfig(backend="redis"))


# ---- file backend ---------------------------------------------------------------------------


@pytest.fixture
def file_backend(tmp_path: Path) -> Iterator[FileStorageBackend]:
    backend = FileStorageBackend(tmp_path / "store", namespace="ns")
    yield backend
    backend.close()


@pytest.mark.parametrize("damage", ["flip_payload_byte", "flip_header_byte", "truncate_payload",
                                    "truncate_header", "append_garbage"])
def test_file_damaged_object_is_a_counted_miss_and_deleted(file_backend: FileStorageBackend, damage: str,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    block = random_blocks(1, seed=5)[0]
    key = unique_keys(1)[0]
    assert file_backend.batch_put([key], [block]) == [True]
    path = file_backend.object_path(key)
    raw = bytearray(path.read_bytes())
    assert len(raw) == HEADER_SIZE + BLOCK_BYTES
    if damage == "flip_payload_byte":
        raw[HEADER_SIZE + BLOCK_BYTES // 2] ^= 0x01
    elif damage == "flip_header_byte":
        raw[0] ^= 0xFF
    elif damage == "truncate_payload":
        del raw[HEADER_SIZE + 1000:]
    elif damage == "truncate_header":
        del raw[10:]
    else:
        raw += b"\x00" * 8
    path.write_bytes(bytes(raw))
    before = file_backend.stats()

    buffer = sentinel_buffers(1)[0]
    with caplog.at_level(logging.WARNING, logger="cache_manager.transfer_factory.file_backend"):
        assert file_backend.batch_get([key], [buffer]) == [False]
    assert untouched(buffer)
    assert delta(before, file_backend.stats()) == {"gets": 1, "misses": 1, "corrupt": 1}
    assert not path.exists()
    assert any("corrupt object" in record.getMessage() for record in caplog.records)


def test_file_object_under_another_key_is_rejected(file_backend: FileStorageBackend) -> None:
    source, target = unique_keys(2)
    value = np.arange(32, dtype=np.float32)
    assert file_backend.batch_put([source], [value]) == [True]
    file_backend.object_path(target).parent.mkdir(parents=True, exist_ok=True)
    os.replace(file_backend.object_path(source), file_backend.object_path(target))
    buffer = sentinel_buffers(1, 32)[0]
    assert file_backend.batch_get([target], [buffer]) == [False]
    assert untouched(buffer)
    assert file_backend.stats()["corrupt"] == 1


@contextlib.contextmanager
def read_only_directory(path: Path) -> Iterator[None]:
    """Make ``path`` read-only for this process, also when it runs as root (which ignores modes)."""
    if os.geteuid() != 0:
        mode = path.stat().st_mode
        path.chmod(0o555)
        try:
            yield
        finally:
            path.chmod(mode)
        return
    bind = subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True, text=True)
    if bind.returncode != 0:
        pytest.skip(f"root without mount privileges cannot make a read-only directory: {bind.stderr.strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True, capture_output=True)
        yield
    finally:
        subprocess.run(["umount", str(path)], check=True, capture_output=True)


def test_file_read_only_directory_put_fails_without_exception(file_backend: FileStorageBackend,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    old_key, new_key = unique_keys(2)
    old_value = np.arange(64, dtype=np.float32)
    assert file_backend.batch_put([old_key], [old_value]) == [True]
    with read_only_directory(file_backend.directory):
        with caplog.at_level(logging.ERROR, logger="cache_manager.transfer_factory.file_backend"):
            assert file_backend.batch_put([new_key, old_key], [old_value, old_value]) == [False, False]
        assert any("puts failed" in record.getMessage() for record in caplog.records)
        output = np.zeros(64, dtype=np.float32)
        assert file_backend.batch_get([old_key], [output]) == [True]  # reads still work
        assert same_bytes(old_value, output)
    assert file_backend.stats()["put_errors"] == 2
    assert file_backend.exists([new_key]) == [False]


def test_file_full_disk_put_fails_and_leaves_no_temp_file(file_backend: FileStorageBackend) -> None:
    key = unique_keys(1)[0]
    block = random_blocks(1, seed=6)[0]
    # RLIMIT_FSIZE makes a write past 1 MB fail with EFBIG, as a full disk fails with ENOSPC
    # (Python ignores SIGXFSZ). Restored at once: it applies to the whole test process.
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        results = file_backend.batch_put([key], [block])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert results == [False]
    assert file_backend.exists([key]) == [False]
    assert list(file_backend.directory.rglob("*.tmp")) == []
    assert file_backend.batch_put([key], [block]) == [True]  # recovers once there is space


def test_file_sweeps_temp_files_of_dead_writers(tmp_path: Path) -> None:
    first = FileStorageBackend(tmp_path, namespace="ns")
    key = unique_keys(1)[0]
    assert first.batch_put([key], [np.zeros(8, dtype=np.float32)]) == [True]
    subdir = first.object_path(key).parent
    dead = subdir / f".{key}.{2**22 + 12345}.0.tmp"  # above pid_max: no such process
    alive = subdir / f".{key}.{os.getpid()}.99.tmp"
    dead.write_bytes(b"partial")
    alive.write_bytes(b"in progress")
    first.close()
    FileStorageBackend(tmp_path, namespace="ns").close()
    assert not dead.exists()
    assert alive.exists()


def test_file_default_directory_comes_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FILE_BACKEND_STORAGE_DIR", str(tmp_path / "from-env"))
    monkeypatch.setenv("FD_KVCACHE_STORAGE_NAMESPACE", "envns")
    backend = create_storage_backend(StorageConfig(backend="file"))
    try:
        assert backend.batch_put(unique_keys(1), [np.zeros(4, dtype=np.float32)]) == [True]
        assert len(list((tmp_path / "from-env" / "envns").rglob("*.kv"))) == 1
    finally:
        backend.close()


# ---- Mooncake -------------------------------------------------------------------------------


@pytest.mark.integration
@needs_mooncake
def test_mooncake_corrupt_object_is_a_counted_miss_and_removed(shared_master: MooncakeMaster) -> None:
    backend = create_storage_backend(mooncake_config(shared_master, "corrupt"))
    try:
        key = unique_keys(1)[0]
        value = np.arange(1024, dtype=np.float32)
        assert backend.batch_put([key], [value]) == [True]
        good = np.zeros(1024, dtype=np.float32)
        assert backend.batch_get([key], [good]) == [True]
        # Simulate a torn/corrupted object: same length, one payload byte flipped, written with
        # the backend's own client under its stored key.
        raw = bytearray(good.view(np.uint8).tobytes())
        raw[100] ^= 0x10
        header = encode_header(key, memoryview(good.view(np.uint8)))
        assert backend._store.upsert(f"corrupt/{key}", header + bytes(raw)) == 0
        before = backend.stats()
        buffer = sentinel_buffers(1, 1024)[0]
        assert backend.batch_get([key], [buffer]) == [False]
        assert untouched(buffer)
        assert delta(before, backend.stats()) == {"gets": 1, "misses": 1, "corrupt": 1}
        assert backend.exists([key]) == [False]
    finally:
        backend.clear()
        backend.close()


def wait_until(predicate, timeout_s: float, interval_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return False


@pytest.mark.integration
@needs_mooncake
def test_mooncake_master_outage_misses_then_reconnects() -> None:
    with mooncake_master() as master:
        backend = create_storage_backend(mooncake_config(master, "outage"))
        try:
            before_outage, after_restart = unique_keys(2)
            value = np.arange(4096, dtype=np.float32)
            assert backend.batch_put([before_outage], [value]) == [True]

            master.stop()
            started = time.monotonic()
            buffers = sentinel_buffers(3, 4096)
            assert backend.batch_get(unique_keys(2) + [before_outage], buffers) == [False] * 3
            assert backend.batch_put(unique_keys(3), [value] * 3) == [False] * 3
            assert backend.exists([before_outage]) == [False]
            assert all(untouched(buffer) for buffer in buffers)
            # With the master gone each Mooncake call can block ~4.5 s; the backend must not pay
            # that per key or per call (at most once, before it notices).
            assert time.monotonic() - started < 8.0
            stats = backend.stats()
            assert stats["put_errors"] >= 3 and stats["errors"] >= 3

            master.start()  # same port
            assert wait_until(lambda: backend.batch_put([after_restart], [value]) == [True], timeout_s=20.0), \
                "the backend did not reconnect within 20 s of the master restart"
            output = np.zeros(4096, dtype=np.float32)
            assert backend.batch_get([after_restart], [output]) == [True]
            assert same_bytes(value, output)
            # The restarted master lost its metadata: the old object is a miss, not garbage.
            old = sentinel_buffers(1, 4096)[0]
            assert backend.batch_get([before_outage], [old]) == [False]
            assert untouched(old)
        finally:
            backend.close()


@pytest.mark.integration
@needs_mooncake
def test_mooncake_backend_started_before_its_master_connects_later() -> None:
    master = MooncakeMaster()
    started = time.monotonic()
    backend = create_storage_backend(mooncake_config(master, "late"))
    try:
        assert time.monotonic() - started < 5.0  # no 90 s setup retry loop against a dead address
        assert not backend.connected
        value = np.arange(128, dtype=np.float32)
        key = unique_keys(1)[0]
        assert backend.batch_put([key], [value]) == [False]
        master.start()
        assert wait_until(lambda: backend.batch_put([key], [value]) == [True], timeout_s=15.0)
        output = np.zeros(128, dtype=np.float32)
        assert backend.batch_get([key], [output]) == [True]
        assert same_bytes(value, output)
    finally:
        backend.close()
        master.stop()
        master.remove_log()


# ---- file backend: LRU size cap (--file-backend-max-bytes) ------------------------------------

SMALL_FLOATS = 256  # 1 KiB payloads: object files of 1024 + HEADER_SIZE bytes
SMALL_OBJECT = SMALL_FLOATS * 4 + HEADER_SIZE


def test_file_cap_keeps_the_directory_under_it_and_evicts_least_recently_used(tmp_path: Path) -> None:
    cap = 10 * SMALL_OBJECT
    backend = FileStorageBackend(tmp_path, namespace="ns", max_bytes=cap)
    keys = unique_keys(40)
    values = [np.full(SMALL_FLOATS, i, np.float32) for i in range(40)]
    assert backend.batch_put(keys[:8], values[:8]) == [True] * 8
    hot = keys[0]
    for i in range(8, 40):
        # Reading an object makes it recent: the oldest write survives every eviction.
        buffer = sentinel_buffers(1, SMALL_FLOATS)[0]
        assert backend.batch_get([hot], [buffer]) == [True] and np.all(buffer == 0)
        assert backend.batch_put([keys[i]], [values[i]]) == [True]
        assert backend.disk_usage() <= cap
    assert backend.evicted > 0
    present = backend.exists(keys)
    assert present[0] and present[-1] and not all(present)
    # Evicted objects are plain misses: no exception, buffer untouched.
    missing = [k for k, p in zip(keys, present) if not p]
    buffers = sentinel_buffers(len(missing), SMALL_FLOATS)
    assert backend.batch_get(missing, buffers) == [False] * len(missing)
    assert all(untouched(b) for b in buffers)
    backend.close()


def test_file_cap_counts_what_other_processes_wrote(tmp_path: Path) -> None:
    cap = 10 * SMALL_OBJECT
    other = FileStorageBackend(tmp_path, namespace="ns")  # an uncapped writer sharing the directory
    assert other.batch_put(unique_keys(20), [np.zeros(SMALL_FLOATS, np.float32)] * 20) == [True] * 20
    capped = FileStorageBackend(tmp_path, namespace="ns", max_bytes=cap)
    assert capped.batch_put(unique_keys(1), [np.ones(SMALL_FLOATS, np.float32)]) == [True]
    assert capped.disk_usage() <= cap
    other.close()
    capped.close()


def test_file_reader_racing_an_eviction_gets_the_whole_object_or_a_miss(tmp_path: Path) -> None:
    cap = 4 * SMALL_OBJECT
    writer = FileStorageBackend(tmp_path, namespace="ns", max_bytes=cap)
    reader = FileStorageBackend(tmp_path, namespace="ns")
    keys = unique_keys(200)
    stop = threading.Event()
    outcomes = {"hit": 0, "miss": 0}
    failures: list[BaseException] = []

    def read_loop() -> None:
        try:
            while not stop.is_set():
                for index in range(len(keys)):
                    buffer = sentinel_buffers(1, SMALL_FLOATS)[0]
                    hit = reader.batch_get([keys[index]], [buffer])[0]
                    if hit:
                        assert np.all(buffer == index), "a hit must be the whole, right object"
                    else:
                        assert untouched(buffer)
                    outcomes["hit" if hit else "miss"] += 1
        except BaseException as exc:  # surfaced to the test thread below
            failures.append(exc)

    thread = threading.Thread(target=read_loop)
    thread.start()
    try:
        for index, key in enumerate(keys):
            assert writer.batch_put([key], [np.full(SMALL_FLOATS, index, np.float32)]) == [True]
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not failures, failures
    assert outcomes["hit"] > 0 and outcomes["miss"] > 0
    assert reader.stats()["errors"] == 0 and reader.stats()["corrupt"] == 0
    assert writer.disk_usage() <= cap
    writer.close()
    reader.close()


def test_file_object_larger_than_the_cap_is_a_failed_put(tmp_path: Path) -> None:
    backend = FileStorageBackend(tmp_path, namespace="ns", max_bytes=SMALL_OBJECT - 1)
    key = unique_keys(1)
    assert backend.batch_put(key, [np.zeros(SMALL_FLOATS, np.float32)]) == [False]
    assert backend.stats()["put_errors"] == 1 and backend.exists(key) == [False]
    with pytest.raises(ValueError, match="max_bytes"):
        FileStorageBackend(tmp_path, namespace="ns", max_bytes=-1)
    backend.close()
