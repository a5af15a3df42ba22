"""Graceful shutdown of the real server with traffic in flight (SIGINT to launch.py).

The server must stop taking requests, let those in flight finish until the drain deadline
(``FD_SHUTDOWN_DRAIN_S``), end the rest with a final SSE error event and ``[DONE]``, stop every
process within 10 s, log no traceback, and leave nothing of the instance in /dev/shm.
"""
from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from harness.server import ServerProcess, shm_names
from harness.reference import load_reference

pytestmark = pytest.mark.integration

REFERENCE = load_reference()
STOP_LIMIT_S = 10.0
FORBIDDEN_IN_LOG = ("Traceback", "killing it", "graceful shutdown exceeded")


def stream(server: ServerProcess, body: dict, events: list[str], first_chunk: threading.Event) -> None:
    """Read one SSE stream to its end into ``events`` (a transport error becomes an event too)."""
    try:
        with httpx.stream("POST", server.base_url + "/v1/completions", json={**body, "stream": True},
                          timeout=60) as resp:
            events.append(f"status {resp.status_code}")
            for line in resp.iter_lines():
                if line:
                    events.append(line)
                    if line.startswith("data: {"):
                        first_chunk.set()
    except httpx.HTTPError as exc:
        events.append(f"transport error: {type(exc).__name__}: {exc}")
    finally:
        first_chunk.set()


def payloads(events: list[str]) -> list[dict]:
    return [json.loads(e[len("data: "):]) for e in events if e.startswith("data: {")]


def check_stream_ended_cleanly(events: list[str]) -> str:
    """'finished' or 'error': how the stream ended; fails on a cut-off stream."""
    assert events and events[0] == "status 200", events[:3]
    assert events[-1] == "data: [DONE]", f"stream did not end with [DONE]: {events[-3:]}"
    last = payloads(events)[-1]
    if "error" in last:
        assert "shutting down" in last["error"]["message"], last
        return "error"
    assert last["choices"][0]["finish_reason"] in ("stop", "length"), last
    return "finished"


def check_clean_stop(server: ServerProcess, seconds: float) -> None:
    assert server.proc.returncode == 0, f"launch.py exited with {server.proc.returncode}:\n{server.log_tail()}"
    assert seconds < STOP_LIMIT_S, f"stopping took {seconds:.1f} s:\n{server.log_tail()}"
    log = server.log_path.read_text(errors="replace")
    for text in FORBIDDEN_IN_LOG:
        assert text not in log, f"{text!r} in the log:\n{server.log_tail(80)}"
    assert "engine exited" in log and "worker exited" in log, server.log_tail(80)  # orderly, not killed
    # launch.py has exited; a child may still be between its last log line and the kernel marking it dead
    # (seen once under a full test run): it gets what is left of the stop limit, then nothing may run.
    deadline = time.monotonic() + max(0.5, STOP_LIMIT_S - seconds)
    while running_in_group(server.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running_in_group(server.proc.pid) == []
    assert shm_names(server.instance_id) == []


def running_in_group(pgid: int) -> list[str]:
    """Processes of process group ``pgid`` that still run (zombies waiting for init's reaping do not count)."""
    running = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # exited while we looked
        state, _ppid, pgrp = stat[stat.rindex(")") + 2:].split()[:3]
        if int(pgrp) == pgid and state not in ("Z", "X"):
            try:
                command = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
            except OSError:
                command = "?"
            running.append(f"{entry} ({state}) {command}")
    return running


def run_streams(server: ServerProcess, body: dict, count: int) -> tuple[list[threading.Thread], list[list[str]]]:
    threads, all_events = [], []
    for _ in range(count):
        events: list[str] = []
        got_chunk = threading.Event()
        thread = threading.Thread(target=stream, args=(server, body, events, got_chunk), daemon=True)
        thread.start()
        threads.append(thread)
        all_events.append(events)
        assert got_chunk.wait(60), f"no token within 60 s: {events}"
    return threads, all_events


def test_sigint_with_long_streams_in_flight_ends_them_with_an_error_and_stops_fast():
    with ServerProcess() as server:
        body = {"prompt": REFERENCE[1]["prompt_ids"], "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
        threads, all_events = run_streams(server, body, 4)
        seconds = server.stop(signal.SIGINT, timeout=30)
        for thread in threads:
            thread.join(10)
            assert not thread.is_alive(), "a stream hung after the server stopped"
        endings = [check_stream_ended_cleanly(events) for events in all_events]
        assert endings == ["error"] * 4, endings  # 1500 tokens cannot finish within the 5 s drain
        check_clean_stop(server, seconds)


def test_short_requests_finish_normally_during_the_drain():
    # 8 tokens take well under a second on a quiet machine; the 6 s drain leaves room for a loaded one (steps of
    # ~1 s were seen under a full test run) and still ends within STOP_LIMIT_S, because the drain stops as soon as
    # nothing is in flight.
    with ServerProcess(env={"FD_SHUTDOWN_DRAIN_S": "6"}) as server:
        body = {"prompt": REFERENCE[0]["prompt_ids"], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        warm_up = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)  # first steps are slow
        assert warm_up.status_code == 200, warm_up.text
        threads, all_events = [], []
        for _ in range(2):  # both sent before the signal
            events: list[str] = []
            thread = threading.Thread(target=stream, args=(server, body, events, threading.Event()), daemon=True)
            thread.start()
            threads.append(thread)
            all_events.append(events)
        deadline = time.monotonic() + 30
        while httpx.get(server.base_url + "/health", timeout=10).json()["active_requests"] < 2:
            assert time.monotonic() < deadline, "the requests never reached the engine"
            time.sleep(0.01)
        started = time.monotonic()
        server.proc.send_signal(signal.SIGINT)
        # A request after the signal is refused: 503 on a kept-alive connection, or no listener.
        try:
            late = httpx.post(server.base_url + "/v1/completions", json=body, timeout=10)
            assert late.status_code == 503, late.text
            assert "shutting down" in late.json()["error"]["message"]
        except httpx.TransportError:
            pass  # the listener is closed: also a refusal
        server.proc.wait(STOP_LIMIT_S + 5)
        seconds = time.monotonic() - started
        for thread in threads:
            thread.join(10)
        endings = [check_stream_ended_cleanly(events) for events in all_events]
        assert endings == ["finished"] * 2, all_events
        for events in all_events:
            finishing = [p for p in payloads(events) if p["choices"][0].get("finish_reason") == "length"]
            assert len(finishing) == 1, events
        log = server.log_path.read_text(errors="replace")
        in_flight = int(re.search(r"shutdown: draining (\d+) request", log).group(1))
        assert in_flight >= 1, "no request was in flight when the drain began"
        assert "every request finished during the drain" in log
        check_clean_stop(server, seconds)


def test_a_second_sigint_during_the_drain_stops_at_once_without_a_traceback():
    with ServerProcess() as server:
        body = {"prompt": REFERENCE[1]["prompt_ids"], "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
        threads, all_events = run_streams(server, body, 1)
        server.proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 10
        while "draining requests" not in server.log_path.read_text(errors="replace") and time.monotonic() < deadline:
            time.sleep(0.05)
        started = time.monotonic()
        seconds = server.stop(signal.SIGINT, timeout=30)
        threads[0].join(10)
        assert not threads[0].is_alive(), "the stream hung after the server stopped"
        assert check_stream_ended_cleanly(all_events[0]) == "error"  # its client was told why
        assert "again; stopping now" in server.log_path.read_text(errors="replace"), server.log_tail(40)
        # Well before the 5 s drain would have ended.
        assert time.monotonic() - started < 4.0, server.log_tail(40)
        check_clean_stop(server, seconds)
