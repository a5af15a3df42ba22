"""Fault matrix against the real multi-process server: kill a process, the server keeps serving.

Each test is bounded in time and checks outputs against the reference after
the fault, not just that something answered.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time

import httpx
import pytest

from harness.completions import assert_reference_output, health, stream_until_end
from harness.server import ServerProcess, shm_names
from harness.reference import expected_prefix, load_reference

pytestmark = pytest.mark.integration

REFERENCE = load_reference()
RECOVERY_TIMEOUT_S = 60.0


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except httpx.TransportError:
            pass  # the server may be busy restarting a child
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


def test_worker_sigkill_fails_in_flight_requests_and_restarts():
    with ServerProcess() as server:
        events: list[str] = []
        got_chunk = threading.Event()
        client = threading.Thread(target=stream_until_end, args=(server, events, got_chunk),
                                  kwargs={"prompt_ids": REFERENCE[1]["prompt_ids"], "max_tokens": 400})
        client.start()
        assert got_chunk.wait(60)
        worker_pid = health(server)["workers"][0]["pid"]
        os.kill(worker_pid, signal.SIGKILL)
        client.join(60)
        assert not client.is_alive(), "the in-flight stream hung after the worker died"
        errors = [e for e in events if e.startswith("data: {") and '"error"' in e]
        assert errors, f"no error event in the stream: {events[-3:]}"
        assert "worker process died" in json.loads(errors[-1][len("data: "):])["error"]["message"]
        assert events[-1] == "data: [DONE]"
        wait_until(lambda: health(server)["status"] == "ok" and health(server)["workers"][0]["pid"] != worker_pid,
                   RECOVERY_TIMEOUT_S, "a restarted worker")
        assert health(server)["scheduler"]["worker_restarts"] == 1
        assert_reference_output(server)
        assert health(server)["scheduler"]["kv_blocks_used"] == 0
    assert server.leftovers == [], "the server left shared-memory names for close() to sweep"


def test_cache_transfer_sigkill_restarts_and_outputs_stay_correct(tmp_path):
    with ServerProcess("--swap-space", "0.05", "--kvcache-storage-backend", "file",
                       "--file-backend-storage-dir", str(tmp_path)) as server:
        assert_reference_output(server)
        transfer_pid = health(server)["cache_transfer"][0]["pid"]
        os.kill(transfer_pid, signal.SIGKILL)
        wait_until(lambda: health(server)["scheduler"]["cache_transfer_restarts"] == 1, RECOVERY_TIMEOUT_S,
                   "a restarted cache transfer process")
        for entry in REFERENCE[:3]:
            assert_reference_output(server, entry)
        httpx.post(server.base_url + "/v1/cache/reset", timeout=30)
        assert_reference_output(server)  # reloaded from storage through the new process
        assert health(server)["cache_transfer"][0]["pid"] != transfer_pid
    assert server.leftovers == [], "the server left shared-memory names for close() to sweep"


def _hold_lock_forever(instance_id: str, ready: multiprocessing.Event) -> None:
    from inter_communicator.kvcache_lock import KVCacheLock

    lock = KVCacheLock.attach(instance_id, 0, role="test")
    lock.acquire()
    ready.set()
    time.sleep(600)  # killed by the test long before


def test_sigkill_of_a_lock_holder_does_not_deadlock_the_server():
    with ServerProcess(env={"FD_USE_KVCACHE_LOCK": "1", "FD_KVCACHE_LOCK_TIMEOUT": "2"}) as server:
        spawn = multiprocessing.get_context("spawn")
        ready = spawn.Event()
        holder = spawn.Process(target=_hold_lock_forever, args=(server.instance_id, ready))
        holder.start()
        try:
            assert ready.wait(60)
            holder.kill()
            holder.join(10)
            started = time.monotonic()
            assert_reference_output(server)
            assert time.monotonic() - started < 2 + 30  # lock timeout + recovery + a short generation
        finally:
            if holder.is_alive():
                holder.kill()
        stats = httpx.get(server.base_url + "/v1/cache/stats", timeout=30).json()
        assert stats["kvcache_lock"]["recoveries"] >= 1


def _storage_stats(server: ServerProcess) -> dict:
    return httpx.get(server.base_url + "/v1/cache/stats", timeout=30).json()


def _mount(args: list[str]) -> None:
    import subprocess

    result = subprocess.run(["mount", *args], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"mount not permitted here: {result.stderr.strip()}")


def _umount(path: str) -> None:
    import subprocess

    subprocess.run(["umount", path], capture_output=True, check=False)


@pytest.mark.parametrize("fault", ["read_only", "full"])
def test_unwritable_file_storage_means_misses_not_failures(tmp_path, fault):
    storage = tmp_path / "kv"
    storage.mkdir()
    with ServerProcess("--block-size", "16", "--kvcache-storage-backend", "file",
                       "--file-backend-storage-dir", str(storage)) as server:
        try:
            if fault == "read_only":
                _mount(["--bind", str(storage), str(storage)])
                _mount(["-o", "remount,bind,ro", str(storage)])
            else:
                _mount(["-t", "tmpfs", "-o", "size=64k", "tmpfs", str(storage)])
            for entry in REFERENCE[:3]:
                assert_reference_output(server, entry)
            wait_until(lambda: _storage_stats(server)["transfers_in_flight"] == 0, 30, "write-backs to settle")
            assert _storage_stats(server)["write_back_failed"] > 0
            httpx.post(server.base_url + "/v1/cache/reset", timeout=30)
            assert_reference_output(server, REFERENCE[1])  # nothing to reload: recomputed, still correct
        finally:
            _umount(str(storage))
        assert "ERROR" in server.log_tail(400)


def test_mooncake_master_restart_keeps_requests_succeeding():
    pytest.importorskip("mooncake.store", reason="mooncake-transfer-engine-non-cuda is not installed")
    from tests.mooncake_utils import MooncakeMaster

    master = MooncakeMaster().start()
    try:
        with ServerProcess("--block-size", "16", "--kvcache-storage-backend", "mooncake",
                           env={"MOONCAKE_MASTER_SERVER_ADDR": master.address}) as server:
            assert_reference_output(server, REFERENCE[0])
            master.stop()
            for entry in REFERENCE[1:3]:  # storage unreachable: misses, never failed requests
                assert_reference_output(server, entry)
            master = MooncakeMaster(rpc_port=master.rpc_port).start()
            before = _storage_stats(server)["storage_hit_tokens"]

            def stored_again() -> bool:
                assert_reference_output(server, REFERENCE[3])  # written through once the client reconnected
                httpx.post(server.base_url + "/v1/cache/reset", timeout=30)
                assert_reference_output(server, REFERENCE[3])
                return _storage_stats(server)["storage_hit_tokens"] > before

            wait_until(stored_again, 90, "the Mooncake backend to reconnect and serve hits again")
    finally:
        master.stop()


def test_exception_inside_the_lock_bracket_releases_it_and_serving_continues():
    env = {"FD_USE_KVCACHE_LOCK": "1", "FD_KVCACHE_FAULT_RAISE_IN_STEP": "1"}
    with ServerProcess(env=env) as server:
        failed = httpx.post(server.base_url + "/v1/completions", timeout=60, json={
            "prompt": REFERENCE[0]["prompt_ids"], "max_tokens": 4, "temperature": 0})
        assert failed.status_code == 500 and "injected fault" in failed.json()["error"]["message"]
        assert_reference_output(server)  # the next steps take the lock again: it was released
        lock = httpx.get(server.base_url + "/v1/cache/stats", timeout=30).json()["kvcache_lock"]
        assert lock["owner_pid"] == 0 and lock["recoveries"] == 0, lock


def _children(pid: int) -> set[int]:
    try:
        return {int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()}
    except FileNotFoundError:
        return set()


def test_a_request_that_breaks_the_engine_loop_fails_alone():
    # Chat request ids start with "chatcmpl-", completion ids with "cmpl-": only the chat request's steps raise.
    # One sequence a step, so the failing step holds nothing else; the others wait their turn meanwhile.
    with ServerProcess("--max-num-seqs", "1", env={"FD_ENGINE_FAULT_RAISE_IN_UPDATE": "chatcmpl"}) as server:
        engine_pids = _children(server.proc.pid)
        results: dict[str, httpx.Response] = {}

        def post(name: str, path: str, body: dict) -> None:
            results[name] = httpx.post(server.base_url + path, json=body, timeout=120)

        bodies = {name: ("/v1/completions", {"prompt": entry["prompt_ids"], "max_tokens": len(entry["output_ids"]),
                                             "temperature": 0, "return_token_ids": True})
                  for name, entry in (("first", REFERENCE[0]), ("second", REFERENCE[1]))}
        bodies["chat"] = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}],
                                                   "max_tokens": 8, "temperature": 0})
        clients = [threading.Thread(target=post, args=(name, path, body)) for name, (path, body) in bodies.items()]
        for client in clients:
            client.start()
        for client in clients:
            client.join(150)
        assert results["chat"].status_code == 500, results["chat"].text
        assert "injected fault" in results["chat"].json()["error"]["message"]
        for name, entry in (("first", REFERENCE[0]), ("second", REFERENCE[1])):
            assert results[name].status_code == 200, results[name].text
            ours, ref = expected_prefix(entry, results[name].json()["choices"][0]["completion_token_ids"])
            assert ours == ref
        assert _children(server.proc.pid) == engine_pids  # the engine process was never replaced
        status = health(server)
        assert status["status"] == "ok" and status["scheduler"]["kv_blocks_used"] == 0
        assert "Traceback" in server.log_tail(400)  # the failure was logged with its traceback


def test_a_stopped_cache_transfer_process_is_killed_and_restarted(tmp_path):
    env = {"FD_CACHE_TRANSFER_TIMEOUT": "3"}  # transfer deadlines stay at 30 s: the heartbeat must catch it
    with ServerProcess("--swap-space", "0.05", "--kvcache-storage-backend", "file",
                       "--file-backend-storage-dir", str(tmp_path), env=env) as server:
        assert_reference_output(server)
        transfer_pid = health(server)["cache_transfer"][0]["pid"]
        os.kill(transfer_pid, signal.SIGSTOP)  # alive but hung: no heartbeat, no completions
        try:
            # These need write-backs (and swaps) that the stopped process cannot run; they must still succeed.
            for entry in REFERENCE[1:3]:
                assert_reference_output(server, entry)
            wait_until(lambda: health(server)["scheduler"]["cache_transfer_restarts"] >= 1, RECOVERY_TIMEOUT_S,
                       "the engine to restart the stopped cache transfer process")
            wait_until(lambda: health(server)["cache_transfer"][0]["ready"], RECOVERY_TIMEOUT_S,
                       "the new cache transfer process to be ready")
        finally:
            try:
                os.kill(transfer_pid, signal.SIGCONT)  # if the engine did not kill it, let the shutdown do so
            except ProcessLookupError:
                pass  # killed by the engine, as it should be
        status = health(server)
        assert status["cache_transfer"][0]["pid"] != transfer_pid
        assert status["scheduler"]["cache_transfer_restarts"] == 1
        assert status["status"] == "ok"
        httpx.post(server.base_url + "/v1/cache/reset", timeout=30)
        for entry in REFERENCE[:3]:
            assert_reference_output(server, entry)  # prefixes reload from storage through the new process
        assert "made no progress" in server.log_tail(400)
        server.stop()
        assert shm_names(server.instance_id) == []  # checked before close() sweeps anything
