"""``ProcessEntry`` in real child processes: how an fdserve process stops, cleans up and exits.

Each child is a fresh Python interpreter running a small script around ``ProcessEntry``; the test
reads what the child prints (its log goes to stderr) and its exit status. No mocks: the signals,
the parent death and the deadline are the kernel's.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from inter_communicator.process_utils import EXIT_COLLECTIVE_FAILURE, EXIT_FAILURE, pid_start_time, process_alive

pytestmark = pytest.mark.integration  # every test starts a Python child

REPO_ROOT = Path(__file__).resolve().parent.parent
WAIT_S = 15.0

# argv: mode [grace_s]. Prints "ready" once the body runs, "cleanup" from its clean-up step.
CHILD = """
    import logging, sys, threading
    from inter_communicator.process_utils import ProcessEntry

    def setup_logging(role, rank):
        logging.basicConfig(stream=sys.stderr, level=logging.INFO, format=f"[{role}:{rank}] %(message)s")

    mode = sys.argv[1]
    grace_s = float(sys.argv[2]) if len(sys.argv) > 2 else 10.0
    parent_pid = 1 if mode == "parent_already_gone" else None
    with ProcessEntry("tester", 7, grace_s=grace_s, setup_logging=setup_logging, parent_pid=parent_pid,
                      watch_interval=0.1) as entry:
        def cleanup():
            print("cleanup", flush=True)
            if mode == "hang_in_cleanup":
                threading.Event().wait()  # never returns: only the deadline ends the process
        entry.cleanup("test clean-up", cleanup)
        if mode == "raise":
            raise RuntimeError("body failed")
        if mode == "fail_code":
            entry.fail(3)
        else:
            print("ready", flush=True)
            entry.stop_event.wait(60)
            print("stopped" if entry.stop_event.is_set() else "not stopped", flush=True)
"""

# argv: child script. Starts the child with our stdout, prints its pid, then waits to be killed.
MIDDLE = """
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], "wait"], stderr=subprocess.DEVNULL)
    print(child.pid, flush=True)
    time.sleep(60)
"""


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO_ROOT))


def start_child(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(CHILD), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env(), text=True)


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    """Wait for ``proc`` (killing it if it overstays) and return its exit status, stdout and stderr."""
    try:
        out, err = proc.communicate(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"child did not exit within {WAIT_S} s; stdout {out!r}, stderr {err[-2000:]!r}")
    return proc.returncode, out, err


@pytest.fixture
def children():
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_runs_the_cleanup_and_exits_zero(children, sig: signal.Signals) -> None:
    child = start_child("wait")
    children.append(child)
    assert child.stdout.readline().strip() == "ready"
    child.send_signal(sig)
    code, out, err = finish(child)
    assert code == 0, err
    assert out.split() == ["stopped", "cleanup"]
    assert "[tester:7]" in err and "tester exited (rank 7, code 0)" in err


def test_a_failing_body_still_cleans_up_and_exits_one(children) -> None:
    child = start_child("raise")
    children.append(child)
    code, out, err = finish(child)
    assert code == EXIT_FAILURE
    assert out.split() == ["cleanup"]
    assert "tester (rank 7) failed: RuntimeError: body failed" in err


def test_the_body_chooses_its_exit_code(children) -> None:
    child = start_child("fail_code")
    children.append(child)
    code, out, _ = finish(child)
    assert code == EXIT_COLLECTIVE_FAILURE == 3
    assert out.split() == ["cleanup"]


def test_a_cleanup_that_hangs_is_ended_by_the_deadline(children) -> None:
    child = start_child("hang_in_cleanup", "0.5")
    children.append(child)
    assert child.stdout.readline().strip() == "ready"
    started = time.monotonic()
    child.send_signal(signal.SIGTERM)
    code, out, err = finish(child)
    assert code == EXIT_FAILURE
    assert out.split() == ["stopped", "cleanup"]
    assert "shutdown did not finish within" in err
    assert time.monotonic() - started < 10.0


def test_a_parent_gone_before_the_entry_stops_the_body_at_once(children) -> None:
    # pid 1 is not our parent: to the entry, the parent that spawned us is already gone.
    child = start_child("parent_already_gone")
    children.append(child)
    code, out, err = finish(child)
    assert code == 0, err
    assert out.split() == ["ready", "stopped", "cleanup"]


def test_the_child_stops_and_cleans_up_when_its_parent_is_killed(children) -> None:
    middle = subprocess.Popen([sys.executable, "-c", textwrap.dedent(MIDDLE), textwrap.dedent(CHILD)],
                              stdout=subprocess.PIPE, env=env(), text=True)
    children.append(middle)
    child_pid = int(middle.stdout.readline())
    start = pid_start_time(child_pid)
    try:
        # The child shares the middle's stdout: "ready" comes through the same pipe.
        assert middle.stdout.readline().strip() == "ready"
        middle.kill()
        middle.wait(WAIT_S)
        # The pipe reaches end-of-file once the child, its last writer, has exited.
        lines = []
        deadline = time.monotonic() + WAIT_S
        while True:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"the child outlived its parent; printed {lines}"
            readable, _, _ = select.select([middle.stdout], [], [], remaining)
            if not readable:
                continue
            line = middle.stdout.readline()
            if not line:
                break
            lines.append(line.strip())
        assert lines == ["stopped", "cleanup"]
        # End-of-file comes when the exiting child closes its descriptors, a moment before the kernel marks
        # it dead: give the exit itself a bounded moment on a loaded machine.
        deadline = time.monotonic() + WAIT_S
        while process_alive(child_pid, start):
            assert time.monotonic() < deadline, "the child closed its output but did not exit"
            time.sleep(0.05)
    finally:
        if start is not None and process_alive(child_pid, start):
            os.kill(child_pid, signal.SIGKILL)
