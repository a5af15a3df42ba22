"""The API server supervises its engine processes: SIGKILL an engine, the server serves again.

Real processes throughout: the engine (and with it its worker) is killed while requests are
in flight; those requests end with an error, the API server restarts the engine of that DP
rank, and new requests get the reference greedy output again. The restart budget itself is
checked without processes (``RestartBudget``).
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from engine.entrypoints.engine_supervisor import RestartBudget
from harness.completions import assert_reference_output, complete, health, stream_until_end
from harness.server import ServerProcess
from harness.reference import load_reference

REFERENCE = load_reference()
RECOVERY_TIMEOUT_S = 60.0


def assert_ended_with_engine_error(events: list[str]) -> None:
    errors = [e for e in events if e.startswith("data: {") and '"error"' in e]
    assert errors, f"no error event in the stream: {events[-3:]}"
    assert "engine process died" in json.loads(errors[-1][len("data: "):])["error"]["message"]
    assert events[-1] == "data: [DONE]"


def wait_for_restart(server: ServerProcess, old_pid: int, rank: int | None = None) -> dict:
    """Poll until the engine (of ``rank``) runs under a new pid and /health is ok; returns its health."""
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    last: dict = {}
    while time.monotonic() < deadline:
        try:
            last = health(server)
        except httpx.TransportError:
            last = {}
        engine = (last["ranks"][rank] if rank is not None else last).get("engine", {}) if last else {}
        if last.get("status") == "ok" and engine.get("pid") not in (None, old_pid):
            return last
        time.sleep(0.5)
    pytest.fail(f"no restarted engine within {RECOVERY_TIMEOUT_S:.0f} s: {last}\n{server.log_tail()}")


def start_stream(server: ServerProcess) -> tuple[threading.Thread, list[str]]:
    events: list[str] = []
    got_chunk = threading.Event()
    thread = threading.Thread(target=stream_until_end, args=(server, events, got_chunk), daemon=True,
                              kwargs={"prompt_ids": REFERENCE[1]["prompt_ids"], "max_tokens": 1000})
    thread.start()
    assert got_chunk.wait(60), "no token within 60 s"
    return thread, events


@pytest.mark.integration
def test_engine_sigkill_fails_in_flight_requests_and_the_engine_is_restarted():
    with ServerProcess() as server:
        stream, events = start_stream(server)
        blocking: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: blocking.append(complete(server, REFERENCE[2])), daemon=True)
        waiter.start()
        # Kill only once the blocking request is in flight: sent during the restart it would rightly get a 503.
        deadline = time.monotonic() + 30
        while (before := health(server))["active_requests"] < 2:
            assert time.monotonic() < deadline, f"the blocking request never reached the engine: {before}"
            time.sleep(0.05)
        engine_pid, worker_pid = before["engine"]["pid"], before["workers"][0]["pid"]
        assert before["engine_restarts"] == 0
        killed_at = time.monotonic()
        os.kill(engine_pid, signal.SIGKILL)

        stream.join(30)
        waiter.join(30)
        assert not stream.is_alive() and not waiter.is_alive(), "a request hung after its engine died"
        assert_ended_with_engine_error(events)
        assert blocking[0].status_code == 500, blocking[0].text
        assert "engine process died" in blocking[0].json()["error"]["message"]

        # While the new engine loads, requests are refused at once, never left hanging.
        during = complete(server, REFERENCE[0], timeout=30)
        if during.status_code != 200:
            assert during.status_code == 503, during.text
            assert "restarting" in during.json()["error"]["message"]

        after = wait_for_restart(server, engine_pid)
        assert time.monotonic() - killed_at < RECOVERY_TIMEOUT_S
        assert after["engine_restarts"] == 1 and after["engine"]["restarts"] == 1
        assert after["workers"][0]["pid"] != worker_pid
        for entry in REFERENCE[:2]:
            assert_reference_output(server, entry)
        metrics = httpx.get(server.base_url + "/metrics", timeout=10).text
        assert 'fdserve:engine_restarts_total{dp_rank="0"' in metrics
        line = next(l for l in metrics.splitlines() if l.startswith("fdserve:engine_restarts_total{"))
        assert float(line.rsplit(" ", 1)[1]) == 1.0
    assert server.proc.returncode == 0, server.log_tail()
    assert server.leftovers == [], "the server left shared-memory names for close() to sweep"


@pytest.mark.integration
def test_data_parallel_engine_sigkill_only_fails_its_rank_and_the_other_rank_keeps_serving():
    with ServerProcess("--data-parallel-size", "2") as server:
        stream, events = start_stream(server)
        ranks = health(server)["ranks"]
        # The stream went to the idlest rank; kill that one's engine.
        busy = max(range(2), key=lambda r: ranks[r]["active_requests"])
        victim_pid = ranks[busy]["engine"]["pid"]
        survivor_pid = ranks[1 - busy]["engine"]["pid"]
        # The worker dies with its engine here, too abruptly to remove its KV-cache segment:
        # the API server must sweep it, or the new worker could not create it again.
        os.kill(victim_pid, signal.SIGKILL)
        os.kill(ranks[busy]["workers"][0]["pid"], signal.SIGKILL)
        stream.join(30)
        assert not stream.is_alive()
        assert_ended_with_engine_error(events)
        # The live rank serves every new request while the other one restarts.
        for entry in REFERENCE[:2]:
            assert_reference_output(server, entry)
        assert health(server)["ranks"][1 - busy]["engine"]["pid"] == survivor_pid
        after = wait_for_restart(server, victim_pid, rank=busy)
        assert after["ranks"][busy]["engine_restarts"] == 1
        assert after["ranks"][1 - busy]["engine_restarts"] == 0
        assert after["engine_restarts"] == 1
        assert f"kvcache_tp0.{busy} left by the dead engine" in server.log_path.read_text(errors="replace")
        assert_reference_output(server, REFERENCE[3])
    assert server.leftovers == [], "the server left shared-memory names for close() to sweep"


def test_restart_budget_allows_five_restarts_per_window_then_refuses():
    now = [1000.0]
    budget = RestartBudget(max_restarts=5, window_s=300.0, clock=lambda: now[0])
    for _ in range(5):
        assert budget.record()
        now[0] += 10.0
    assert not budget.record()  # the 6th within 300 s
    assert not budget.record()


def test_restart_budget_forgets_restarts_older_than_the_window():
    now = [0.0]
    budget = RestartBudget(max_restarts=2, window_s=300.0, clock=lambda: now[0])
    assert budget.record() and budget.record()
    now[0] = 301.0
    assert budget.record() and budget.record()  # the first two have left the window
    assert budget.record() is False


def test_a_rank_beyond_its_restart_budget_stays_down_and_answers_503(tmp_path):
    """The supervisor's give-up path on a real replica (no engine spawned: the budget is spent)."""
    import asyncio
    import dataclasses
    import uuid

    from engine.entrypoints.api_server import build_app
    from config.engine_config import EngineArgs, build_engine_config
    from engine.entrypoints.engine_client import STATE_DOWN, EngineClient
    from engine.engine_process import MAX_RESTARTS_PER_WINDOW
    from engine.tokenizer import load_tokenizer
    from inter_communicator.shm import sweep_stale
    from engine.entrypoints.engine_supervisor import EngineReplica, EngineSupervisor
    from config.model_config import default_model_path

    base = build_engine_config(EngineArgs(num_gpu_blocks_override=16))
    config = dataclasses.replace(base, instance_id=f"sup-{uuid.uuid4().hex[:10]}", ipc_dir=str(tmp_path))
    replica = EngineReplica(config)
    try:
        for _ in range(MAX_RESTARTS_PER_WINDOW):
            assert replica.count_restart()
        client = EngineClient(load_tokenizer(default_model_path()), replica.addresses, replica.signals, replica,
                              instance_id=config.instance_id, dp_rank=config.parallel.dp_rank)
        supervisor = EngineSupervisor([replica], [client])

        async def scenario() -> tuple[httpx.Response, httpx.Response]:
            await supervisor._restart(0)  # the next death: over budget, so no new engine
            app = build_app(client, served_model_name="m", max_model_len=config.scheduler.max_model_len)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
                refused = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                status = await http.get("/health")
            return refused, status

        refused, status = asyncio.run(scenario())
        assert replica.state == STATE_DOWN and replica.proc is None and replica.restarts == 0
        assert refused.status_code == 503, refused.text
        assert "failed too often" in refused.json()["error"]["message"]
        assert status.status_code == 503
        assert status.json()["engine"]["state"] == "down"
    finally:
        replica.stop()
        leftovers = sweep_stale(config.instance_id)
    assert leftovers == [], "the stopped replica left shared-memory names behind"
